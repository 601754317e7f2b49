//! The receive path's admission through the core: every write checked against the room's
//! grant, every permit handed back.

use crate::{FaultKind, FaultPlan};
use std::time::Instant;

use kvferry_core::{
    Endpoint, Generation, RoomId, SessionId, Slice, TransferId, WritePermit, WriteRefused,
};
use kvferry_memory::WriteCheck;

/// How a receive path reaches its node's core endpoint: each driver says how it gets at the
/// endpoint (a lock, a shard's cell) and how it then handles the endpoint's outputs.
pub trait EndpointAccess {
    /// Runs `f` on the endpoint, then handles its outputs if `drain(&result)`; `None` when the
    /// node is gone.
    fn run<T>(
        &self,
        f: impl FnOnce(&mut Endpoint, Instant) -> T,
        drain: impl FnOnce(&T) -> bool,
    ) -> Option<T>;

    /// The fault plan in force (demos and tests).
    fn faults(&self) -> Option<FaultPlan>;
}

/// The receive path's admission on every driver: the node's core decides each write (every
/// slice against the room's granted pages) and takes every permit back.
pub struct CoreCheck<A> {
    /// The way to the endpoint.
    pub access: A,
    /// The session the data connection belongs to.
    pub session: SessionId,
}

impl<A: EndpointAccess> WriteCheck for CoreCheck<A> {
    fn inject_reset(&self, room: RoomId, op: TransferId) -> bool {
        self.access
            .faults()
            .is_some_and(|f| f.kind == FaultKind::Break && f.hits(room, op))
    }

    fn begin(
        &self,
        room: RoomId,
        generation: Generation,
        slices: &[Slice],
    ) -> Result<WritePermit, WriteRefused> {
        // A refusal may have changed a room's state (its outputs go out now); an accepted
        // write changes nothing until it ends.
        self.access
            .run(
                |e, now| e.begin_write(now, self.session, room, generation, slices),
                |r| r.is_err(),
            )
            .unwrap_or(Err(WriteRefused::UnknownRoom))
    }

    fn end(&self, permit: WritePermit) {
        self.access.run(|e, now| e.end_write(now, permit), |_| true);
    }
}
