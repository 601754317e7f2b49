//! The receive path's admission through the core: every write checked against the room's
//! grant (the core's [`GrantTable`] without the driver's lock, the core itself for whatever
//! the table does not admit), every permit handed back under the lock once.

use crate::{FaultKind, FaultPlan};
use std::sync::Arc;
use std::time::Instant;

use kvferry_core::{
    Endpoint, Generation, GrantTable, RoomId, SessionId, Slice, TransferId, WritePermit,
    WriteRefused,
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
    access: A,
    session: SessionId,
    /// The core's published grants (`None` once the node is gone).
    grants: Option<Arc<GrantTable>>,
}

impl<A: EndpointAccess> CoreCheck<A> {
    /// The admission of a data connection of `session`, reaching its core through `access`.
    pub fn new(access: A, session: SessionId) -> Self {
        let grants = access.run(|e, _| e.grant_table(), |_| false);
        CoreCheck {
            access,
            session,
            grants,
        }
    }
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
        let table = self.grants.as_ref();
        if let Some(permit) = table.and_then(|t| t.begin(self.session, room, generation, slices)) {
            return Ok(permit);
        }
        // A refusal may have changed a room's state (its outputs go out now); an accepted
        // write changes nothing until it ends.
        self.access
            .run(
                |e, now| e.begin_write(now, self.session, room, generation, slices),
                |r| r.is_err(),
            )
            .unwrap_or(Err(WriteRefused::UnknownRoom))
    }

    fn end(&self, permit: WritePermit, slices: &[Slice]) {
        self.access
            .run(|e, now| e.end_write(now, permit, slices), |_| true);
    }
}
