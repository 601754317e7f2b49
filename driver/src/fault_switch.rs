//! The injected data-path faults of one driver, shared with its receive paths.

use crate::FaultPlan;

/// The injected data-path faults of one driver, readable from its receive paths without
/// the driver (demos and tests; `None` in production).
#[derive(Clone, Debug, Default)]
pub struct FaultSwitch(std::sync::Arc<std::sync::Mutex<Option<FaultPlan>>>);

impl FaultSwitch {
    /// The faults in force.
    pub fn get(&self) -> Option<FaultPlan> {
        *self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Replaces the faults in force.
    pub fn set(&self, faults: Option<FaultPlan>) {
        *self.0.lock().unwrap_or_else(|p| p.into_inner()) = faults;
    }
}
