//! The receive path's hold on a room's pages while a write lands.

use kvferry_core::WritePermit;

/// Where a receive path hands its write permits back: the driver's lock around the core
/// (`Endpoint::end_write`, then the usual drain).
pub trait EndWrite {
    /// Hands `permit` back to the core.
    fn end_write(&self, permit: WritePermit);
}

/// A write permit held while its bytes are applied. Dropping it hands the permit back, so a
/// receive task cancelled mid-write (a fence aborts it) still lets the room's pages go.
///
/// The rule it carries: the core never releases a room's pages while a permit for them is
/// out, and a permit is only ever taken (`Endpoint::begin_write`) before the first byte is
/// applied, so no byte can land after the room's pages were released.
#[derive(Debug)]
pub struct Landing<E: EndWrite> {
    permit: Option<WritePermit>,
    to: E,
}

impl<E: EndWrite> Landing<E> {
    /// Holds `permit` until drop (or [`Landing::end`]).
    pub fn new(permit: WritePermit, to: E) -> Self {
        Landing {
            permit: Some(permit),
            to,
        }
    }

    /// Every byte of the write was applied: hand the permit back now, marked applied (the
    /// core counts these bytes toward the room's `Success`). Dropping instead abandons it.
    pub fn applied(mut self) {
        if let Some(p) = self.permit.take() {
            self.to.end_write(p.applied());
        }
    }

    /// The write's bytes landed but did not match the sender's checksum: hand the permit
    /// back marked corrupt (the core fails the room with `checksum_mismatch`).
    pub fn corrupt(mut self) {
        if let Some(p) = self.permit.take() {
            self.to.end_write(p.corrupt());
        }
    }
}

impl<E: EndWrite> Drop for Landing<E> {
    fn drop(&mut self) {
        if let Some(p) = self.permit.take() {
            self.to.end_write(p);
        }
    }
}
