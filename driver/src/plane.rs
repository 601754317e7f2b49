//! Where the driver loop hands its own data plane besides TCP data connections (RDMA,
//! feature `rdma`, [`crate::rdma`]) a session once established, the peer's hellos, each
//! operation, fences, closes and the landed bytes to verify. Without the feature there is
//! none: every session moves over TCP data connections.

#[cfg(feature = "rdma")]
pub(crate) use crate::rdma::{establish, fence, on_hello as transport, post};

#[cfg(not(feature = "rdma"))]
mod tcp_only {
    use crate::{Driver, Host};
    use kvferry_core::{SessionId, TransferOp};

    /// No plane takes the session: it moves over TCP.
    pub(crate) fn establish<H: Host>(_driver: &mut Driver<H>, _session: SessionId) -> bool {
        false
    }

    /// No plane reads the peer's hellos.
    pub(crate) fn transport<H: Host>(
        _driver: &mut Driver<H>,
        _session: SessionId,
        _payload: &[u8],
    ) {
    }

    /// Every operation goes to a TCP data connection.
    pub(crate) fn post<H: Host>(_driver: &mut Driver<H>, op: TransferOp) -> Option<TransferOp> {
        Some(op)
    }

    /// The TCP data connections carry out every fence.
    pub(crate) fn fence<H: Host>(_driver: &mut Driver<H>, _session: SessionId) -> bool {
        false
    }
}
#[cfg(not(feature = "rdma"))]
pub(crate) use tcp_only::{establish, fence, post, transport};

/// The session is closing: its RDMA queue pair (if any) goes to the error state and a
/// same-host writer lets go of the peer's memory, so nothing more of it lands.
pub(crate) fn close<H: crate::Host>(_io: &mut crate::SessionIo<H>) {
    crate::cma::stop_writing(_io);
    #[cfg(feature = "rdma")]
    if let Some(r) = _io.rdma.take() {
        r.close();
    }
}

/// Decode over a one-sided plane, with the checksum option
/// ([`kvferry_core::Action::VerifyLanded`]): the bytes now in `ranges` are hashed off the
/// driver's thread ([`crate::Job::VerifyLanded`]) and the permit handed back with
/// `end_write`, `applied()` if they hash to `checksum`, `corrupt()` if not. Without such a
/// plane the permit goes back unapplied at once.
pub(crate) fn verify_landed<H: crate::Host>(
    driver: &mut crate::Driver<H>,
    permit: kvferry_core::WritePermit,
    ranges: Vec<kvferry_core::Slice>,
    checksum: u64,
) {
    if let Some(memory) = one_sided_memory(driver) {
        driver.host().start(crate::Job::VerifyLanded {
            permit,
            ranges,
            checksum,
            memory,
        });
        return;
    }
    driver
        .endpoint_mut()
        .end_write(std::time::Instant::now(), permit, &[]);
}

/// The memory one-sided planes write into on this node (RDMA's or the same-host plane's:
/// the node's one map either way).
fn one_sided_memory<H: crate::Host>(
    driver: &crate::Driver<H>,
) -> Option<std::sync::Arc<kvferry_memory::MemoryMap>> {
    #[cfg(feature = "rdma")]
    if let Some(memory) = driver.rdma_plane().map(|p| p.memory().clone()) {
        return Some(memory);
    }
    driver.same_host_plane().map(|p| p.memory().clone())
}

/// Decode over a one-sided plane into device memory whose writes need a flush
/// ([`kvferry_core::Action::FlushLanded`]): the node's copy engine flushes the NIC's writes
/// into each of its devices off the driver's thread ([`crate::Job::FlushLanded`]), then the
/// room succeeds (or fails with why). Without such a plane there is nothing to flush.
pub(crate) fn flush_landed<H: crate::Host>(
    driver: &mut crate::Driver<H>,
    room: kvferry_core::RoomId,
    generation: kvferry_core::Generation,
) {
    #[cfg(feature = "rdma")]
    if let Some(memory) = driver.rdma_plane().map(|p| p.memory().clone()) {
        driver.host().start(crate::Job::FlushLanded {
            room,
            generation,
            memory,
        });
        return;
    }
    driver
        .endpoint_mut()
        .end_flush(std::time::Instant::now(), room, generation, Ok(()));
}
