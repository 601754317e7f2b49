//! Why GPU work cannot proceed.

/// A GPU-side failure, typed so the embedder can say what to check.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GpuError {
    /// No `libcuda.so` could be loaded (no NVIDIA driver on this host).
    NoLibcuda,
    /// The driver loaded but reports no device.
    NoDevice,
    /// A CUDA driver call failed.
    Driver(String),
    /// The waiter thread is gone (the node shut down).
    Stopped,
}

impl std::fmt::Display for GpuError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            GpuError::NoLibcuda => write!(
                f,
                "no CUDA driver library (libcuda.so) on this host: install the NVIDIA driver, or run without --gpu"
            ),
            GpuError::NoDevice => write!(f, "the CUDA driver reports no GPU: run without --gpu"),
            GpuError::Driver(e) => write!(f, "CUDA driver error: {e}"),
            GpuError::Stopped => write!(f, "the GPU event waiter has stopped"),
        }
    }
}

impl std::error::Error for GpuError {}
