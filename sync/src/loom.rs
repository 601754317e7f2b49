//! The synchronization types of this crate: `loom`'s under `cfg(loom)`, std's otherwise
//! (the shim tokio uses), so the models check exactly the code the drivers run.

#[cfg(loom)]
pub use loom::sync::{Arc, Mutex, MutexGuard};
#[cfg(not(loom))]
pub use std::sync::{Arc, Mutex, MutexGuard};

/// Locks `m`, recovering the data if a holder panicked (the state stays consistent because
/// every critical section here completes its updates before anything can panic).
pub fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}
