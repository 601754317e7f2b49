//! Admission of writes into registered memory: every backend asks before it lands bytes.

use kvferry_core::{Generation, RoomId, Slice, TransferId, WritePermit, WriteRefused};

/// Decides whether a write may be applied: the driver asks the core's `begin_write` and
/// hands the permit back with `end_write` once the bytes are applied or abandoned.
pub trait WriteCheck {
    /// Fault injection for demos and tests: `true` resets the connection before this
    /// operation's payload is applied (as a network failure would). Never in production use.
    fn inject_reset(&self, _room: RoomId, _op: TransferId) -> bool {
        false
    }

    /// Accepts (with a permit that holds the room's pages) or refuses every slice of one
    /// operation for `(room, generation)`.
    fn begin(
        &self,
        room: RoomId,
        generation: Generation,
        slices: &[Slice],
    ) -> Result<WritePermit, WriteRefused>;

    /// The write of `permit`, made of `slices` (as admitted), was applied or abandoned.
    fn end(&self, permit: WritePermit, slices: &[Slice]);
}
