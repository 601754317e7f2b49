//! Injected data-path faults (demos and tests): which writes are hit, and what a hit does.

use kvferry_core::{RoomId, Slice, TransferId};
use kvferry_memory::MemoryMap;

/// Reproducible data-path fault injection: each write is hit with probability `rate`,
/// decided by a hash of (seed, room, operation id); `kind` says what a hit does.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct FaultPlan {
    /// Probability that a write is hit.
    pub rate: f64,
    /// Seed of the decisions.
    pub seed: u64,
    /// What a hit does.
    pub kind: FaultKind,
}

/// What an injected data-path fault does to the write it hits.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
#[non_exhaustive]
pub enum FaultKind {
    /// The write breaks: over TCP the receiver resets the data connection before applying the
    /// batch; over RDMA the prefill posts it with a key the peer never registered, so the
    /// peer's device refuses it and the queue pair fails.
    #[default]
    Break,
    /// One bit of the write's first byte is flipped on its way (RDMA: the prefill flips it in
    /// the source after hashing and before posting), so the bytes that land are not the ones
    /// the source held: what the checksum option must catch.
    FlipBit,
}

impl FaultPlan {
    /// Whether the batch `op` of `room` is hit.
    pub fn hits(&self, room: RoomId, op: TransferId) -> bool {
        let mut z = self.seed ^ room.0.rotate_left(21) ^ op.0.wrapping_mul(0x9E37_79B9_7F4A_7C15);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^= z >> 31;
        ((z >> 11) as f64 / (1u64 << 53) as f64) < self.rate
    }
}

/// `FaultKind::FlipBit` on a one-sided path: flips the first bit of the first source byte of
/// `slices` (again, to restore it); `false` if it cannot be read or written.
pub(crate) fn flip_first_source_bit(memory: &MemoryMap, slices: &[Slice]) -> bool {
    let Some(first) = slices.first() else {
        return false;
    };
    let mut byte = [0u8; 1];
    let read = memory.read(first.region, first.src_offset, &mut byte);
    byte[0] ^= 1;
    read.is_ok() && memory.write(first.region, first.src_offset, &byte).is_ok()
}
