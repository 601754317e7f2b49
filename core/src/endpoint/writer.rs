//! Decode: how a session's peer writes into this node's memory, and what that asks of the
//! endpoint: whether each write is seen landing, who can stop the writes, and whether
//! landed bytes need a flush before the device sees them.
//!
//! Invariants of [`Writer`]: a flush is needed only of what a one-sided writer landed; a
//! writer whose one-sided path was declined is fenced by closing its connections again.

/// How the peer of a session writes into this node's memory.
#[derive(Debug, Default)]
pub(super) struct Writer {
    /// Its writes land without this endpoint seeing them (RDMA): `Success` of its rooms
    /// rests on the source's word, bound to the peer's incarnation, not on landed bytes.
    one_sided: bool,
    /// Only the writer can stop its writes (the same-host path copies from the peer's own
    /// process): closing its connections fences nothing, so its rooms' pages stay
    /// quarantined after it ends until the writer can no longer write.
    fenced_by_writer: bool,
    /// The peer said it closes the session (an `Error` frame): it hands out no operation of
    /// it any more, so a writer-fenced session needs no quarantine after it ends.
    stopped: bool,
    /// What it writes becomes visible to the memory's device only after a flush
    /// ([`crate::api::Action::FlushLanded`]) before the room is reported `Success`.
    flush_landed: bool,
}

impl Writer {
    /// Its writes land unseen (one-sided RDMA).
    pub(super) fn set_one_sided(&mut self) {
        self.one_sided = true;
    }

    /// Only the writer can stop its writes.
    pub(super) fn set_fenced_by_writer(&mut self) {
        self.fenced_by_writer = true;
    }

    /// Its writes are seen landing again (the one-sided path was declined or given up).
    pub(super) fn set_seen(&mut self) {
        self.one_sided = false;
        self.fenced_by_writer = false;
    }

    /// What it writes needs a flush before the device sees it.
    pub(super) fn set_flush_landed(&mut self) {
        self.flush_landed = true;
    }

    /// The peer said it stops handing out this session's operations.
    pub(super) fn stopped(&mut self) {
        self.stopped = true;
    }

    /// Whether its writes land without this endpoint seeing them.
    pub(super) fn one_sided(&self) -> bool {
        self.one_sided
    }

    /// Whether its rooms need a flush of what landed before they succeed.
    pub(super) fn needs_flush(&self) -> bool {
        self.one_sided && self.flush_landed
    }

    /// Whether the session's end leaves writes that may still land: only the writer could
    /// stop them and it did not say it did.
    pub(super) fn may_write_after_end(&self) -> bool {
        self.fenced_by_writer && !self.stopped
    }
}
