//! The verbs data path (feature `rdma`): memory registration, an RC queue pair brought up
//! from the peer's [`RdmaHello`], chained RDMA WRITEs with one signalled completion per
//! operation, completions through a completion channel whose descriptor a driver awaits
//! (re-armed after each drain), and the fence as "error state, then drain".

use std::os::fd::{AsRawFd, BorrowedFd, RawFd};
use std::sync::Arc;

use kvferry_core::{TransferId, TransferOutcome};
use rdma_sys::*;

use crate::ffi::{
    ibv_ack_cq_events, ibv_create_comp_channel, ibv_create_cq, ibv_create_qp, ibv_dereg_mr,
    ibv_destroy_comp_channel, ibv_destroy_cq, ibv_destroy_qp, ibv_get_cq_event, ibv_modify_qp,
    ibv_query_gid, ibv_query_port, ibv_reg_dmabuf_mr, ibv_reg_mr,
};

use crate::device::{Device, RdmaError};
use crate::{QpLifecycle, RdmaHello, RemoteRegion, WcStatus, PSN_MASK};

/// The narrowest access a registration needs: local write always (the NIC writes received
/// data or reads the source), remote write only where peers may write.
fn access_flags(remote_write: bool) -> ibv_access_flags {
    let mut access = ibv_access_flags::IBV_ACCESS_LOCAL_WRITE;
    if remote_write {
        access |= ibv_access_flags::IBV_ACCESS_REMOTE_WRITE;
    }
    access
}

fn verbs_err(call: &'static str) -> RdmaError {
    RdmaError::Verbs {
        call,
        errno: std::io::Error::last_os_error().raw_os_error().unwrap_or(0),
    }
}

fn check(call: &'static str, rc: i32) -> Result<(), RdmaError> {
    if rc == 0 {
        Ok(())
    } else {
        Err(RdmaError::Verbs { call, errno: rc })
    }
}

/// One registered memory range.
#[derive(Debug)]
pub struct MemoryRegistration {
    mr: *mut ibv_mr,
    addr: u64,
    len: u64,
    _device: Arc<Device>,
}

// SAFETY: a memory region handle is usable from any thread; it is only read after creation.
unsafe impl Send for MemoryRegistration {}
// SAFETY: as above.
unsafe impl Sync for MemoryRegistration {}

impl MemoryRegistration {
    /// Registers `[ptr, ptr + len)` with `device`'s protection domain: local write always
    /// (the NIC writes received data or reads the source), remote write only if
    /// `remote_write` (decode's KV, aux and state regions; never a prefill's, never scratch).
    ///
    /// # Safety
    /// The range must stay allocated and must not move until the registration is dropped.
    pub unsafe fn new(
        device: &Arc<Device>,
        ptr: *mut u8,
        len: usize,
        remote_write: bool,
    ) -> Result<MemoryRegistration, RdmaError> {
        let access = access_flags(remote_write);
        // SAFETY: the caller guarantees the range; the PD is alive as long as `device`.
        let mr = unsafe { ibv_reg_mr(device.pd(), ptr.cast(), len, access.0 as i32) };
        if mr.is_null() {
            return Err(verbs_err("ibv_reg_mr"));
        }
        Ok(MemoryRegistration {
            mr,
            addr: ptr as u64,
            len: len as u64,
            _device: device.clone(),
        })
    }

    /// Registers `len` bytes of device memory exported as the dma-buf `fd`, starting
    /// `offset` bytes into it, addressed by the NIC as `[iova, iova + len)` (the memory's own
    /// device address, so operations name it as they name host memory). The access rules
    /// are [`MemoryRegistration::new`]'s. Fails where the device or its driver cannot
    /// register dma-bufs (soft-RoCE cannot): the caller stages instead.
    pub fn dma_buf(
        device: &Arc<Device>,
        fd: BorrowedFd<'_>,
        offset: u64,
        iova: u64,
        len: usize,
        remote_write: bool,
    ) -> Result<MemoryRegistration, RdmaError> {
        let access = access_flags(remote_write);
        // SAFETY: the PD is alive as long as `device`; the dma-buf is a live descriptor the
        // kernel pins for the registration's life (it takes its own reference).
        let mr = unsafe {
            ibv_reg_dmabuf_mr(
                device.pd(),
                offset,
                len,
                iova,
                fd.as_raw_fd(),
                access.0 as i32,
            )
        }?;
        if mr.is_null() {
            return Err(verbs_err("ibv_reg_dmabuf_mr"));
        }
        Ok(MemoryRegistration {
            mr,
            addr: iova,
            len: len as u64,
            _device: device.clone(),
        })
    }

    /// The local key (for scatter/gather entries).
    pub fn lkey(&self) -> u32 {
        // SAFETY: `mr` is a live registration.
        unsafe { (*self.mr).lkey }
    }

    /// The remote key (announced to the peer in the hello when remote writes are allowed).
    pub fn rkey(&self) -> u32 {
        // SAFETY: `mr` is a live registration.
        unsafe { (*self.mr).rkey }
    }

    /// What a peer needs to write into this registration as layout region `region`.
    pub fn announce(&self, region: u32) -> RemoteRegion {
        RemoteRegion {
            region,
            addr: self.addr,
            len: self.len,
            rkey: self.rkey(),
        }
    }

    /// The registered range's first address.
    pub fn base(&self) -> u64 {
        self.addr
    }

    /// Whether `[addr, addr + len)` lies inside this registration.
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        addr >= self.addr
            && addr
                .checked_add(len)
                .is_some_and(|e| e <= self.addr + self.len)
    }
}

impl Drop for MemoryRegistration {
    fn drop(&mut self) {
        // SAFETY: registered in `new`, deregistered once.
        unsafe { ibv_dereg_mr(self.mr) };
    }
}

/// One local piece of an operation: registered source bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LocalPiece {
    /// Address in a registration.
    pub addr: u64,
    /// Length (at most 2^31 per piece).
    pub len: u32,
    /// The registration's local key.
    pub lkey: u32,
}

/// An RC queue pair with its completion queue and completion channel.
#[derive(Debug)]
pub struct RcQueuePair {
    device: Arc<Device>,
    channel: *mut ibv_comp_channel,
    cq: *mut ibv_cq,
    qp: *mut ibv_qp,
    port: u8,
    psn: u32,
    lifecycle: QpLifecycle,
}

// SAFETY: the verbs objects are used by one owner at a time (`&mut self` for every call that
// changes them); libibverbs allows using them from any thread.
unsafe impl Send for RcQueuePair {}

impl RcQueuePair {
    /// Creates the channel, the CQ (`depth` entries) and an RC QP on `port`, and moves the QP
    /// to INIT with remote write access.
    pub fn new(device: &Arc<Device>, port: u8, depth: u32, psn: u32) -> Result<Self, RdmaError> {
        let ctx = device.ctx();
        // SAFETY: `ctx` is an open context owned by `device`.
        let channel = unsafe { ibv_create_comp_channel(ctx) };
        if channel.is_null() {
            return Err(verbs_err("ibv_create_comp_channel"));
        }
        // The driver awaits the channel's descriptor: it must not block.
        // SAFETY: the channel's fd is open for the channel's lifetime.
        let fd = unsafe { std::os::fd::BorrowedFd::borrow_raw((*channel).fd) };
        let _ = rustix::fs::fcntl_setfl(fd, rustix::fs::OFlags::NONBLOCK);
        // SAFETY: valid context and channel.
        let cq = unsafe { ibv_create_cq(ctx, depth as i32, std::ptr::null_mut(), channel, 0) };
        if cq.is_null() {
            let e = verbs_err("ibv_create_cq");
            // SAFETY: created above, destroyed once.
            unsafe { ibv_destroy_comp_channel(channel) };
            return Err(e);
        }
        // SAFETY: zeroed is a valid initial value for this plain C struct.
        let mut init: ibv_qp_init_attr = unsafe { std::mem::zeroed() };
        init.send_cq = cq;
        init.recv_cq = cq;
        init.qp_type = ibv_qp_type::IBV_QPT_RC;
        init.sq_sig_all = 0;
        init.cap.max_send_wr = depth;
        init.cap.max_recv_wr = 1;
        init.cap.max_send_sge = 1;
        init.cap.max_recv_sge = 1;
        // SAFETY: valid PD and attributes.
        let qp = unsafe { ibv_create_qp(device.pd(), &mut init) };
        if qp.is_null() {
            let e = verbs_err("ibv_create_qp");
            // SAFETY: created above, destroyed once, CQ before its channel.
            unsafe {
                ibv_destroy_cq(cq);
                ibv_destroy_comp_channel(channel);
            }
            return Err(e);
        }
        let mut me = RcQueuePair {
            device: device.clone(),
            channel,
            cq,
            qp,
            port,
            psn: psn & PSN_MASK,
            lifecycle: QpLifecycle::new(),
        };
        // SAFETY: zeroed is a valid initial value for this plain C struct.
        let mut attr: ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = ibv_qp_state::IBV_QPS_INIT;
        attr.pkey_index = 0;
        attr.port_num = port;
        attr.qp_access_flags = (ibv_access_flags::IBV_ACCESS_LOCAL_WRITE
            | ibv_access_flags::IBV_ACCESS_REMOTE_WRITE)
            .0;
        let mask = ibv_qp_attr_mask::IBV_QP_STATE
            | ibv_qp_attr_mask::IBV_QP_PKEY_INDEX
            | ibv_qp_attr_mask::IBV_QP_PORT
            | ibv_qp_attr_mask::IBV_QP_ACCESS_FLAGS;
        // SAFETY: live QP, valid attributes.
        check("ibv_modify_qp(INIT)", unsafe {
            ibv_modify_qp(qp, &mut attr, mask.0 as i32)
        })?;
        me.lifecycle.to_init().map_err(|_| RdmaError::Verbs {
            call: "qp lifecycle INIT",
            errno: 0,
        })?;
        me.arm()?;
        Ok(me)
    }

    /// Asks for an event on the channel at the next completion.
    fn arm(&mut self) -> Result<(), RdmaError> {
        // SAFETY: live CQ.
        check("ibv_req_notify_cq", unsafe {
            ibv_req_notify_cq(self.cq, 0)
        })
    }

    /// This side's hello: how to reach this QP, and `regions` the peer may write.
    pub fn hello(&self, regions: Vec<RemoteRegion>) -> Result<RdmaHello, RdmaError> {
        // SAFETY: zeroed is a valid initial value for this plain C struct.
        let mut port: ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: live context, valid out-pointer.
        check("ibv_query_port", unsafe {
            ibv_query_port(self.device.ctx(), self.port, &mut port)
        })?;
        // SAFETY: zeroed is a valid gid.
        let mut gid: ibv_gid = unsafe { std::mem::zeroed() };
        // SAFETY: live context, valid out-pointer; index 0 is the port's default GID.
        check("ibv_query_gid", unsafe {
            ibv_query_gid(self.device.ctx(), self.port, 0, &mut gid)
        })?;
        Ok(RdmaHello {
            // SAFETY: live QP.
            qpn: unsafe { (*self.qp).qp_num },
            psn: self.psn,
            lid: port.lid,
            port: self.port,
            // SAFETY: the raw view of the union is always valid.
            gid: unsafe { gid.raw },
            mtu: port.active_mtu as u8,
            regions,
        })
    }

    /// Connects to the peer of `remote`: INIT -> RTR -> RTS.
    pub fn connect(&mut self, remote: &RdmaHello) -> Result<(), RdmaError> {
        let lifecycle_err = |_| RdmaError::Verbs {
            call: "qp lifecycle",
            errno: 0,
        };
        // The path MTU is the smaller of the two ports' active MTUs.
        // SAFETY: zeroed is a valid initial value for this plain C struct.
        let mut port: ibv_port_attr = unsafe { std::mem::zeroed() };
        // SAFETY: live context, valid out-pointer.
        check("ibv_query_port", unsafe {
            ibv_query_port(self.device.ctx(), self.port, &mut port)
        })?;
        let mtu = (port.active_mtu as u8).min(remote.mtu).max(1);
        self.lifecycle.to_rtr(remote).map_err(lifecycle_err)?;
        // SAFETY: zeroed is a valid initial value for this plain C struct.
        let mut attr: ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = ibv_qp_state::IBV_QPS_RTR;
        attr.path_mtu = ibv_mtu::Type::from(mtu);
        attr.dest_qp_num = remote.qpn;
        attr.rq_psn = remote.psn;
        attr.max_dest_rd_atomic = 1;
        attr.min_rnr_timer = 12;
        attr.ah_attr.dlid = remote.lid;
        attr.ah_attr.port_num = self.port;
        if remote.gid != [0u8; 16] {
            attr.ah_attr.is_global = 1;
            attr.ah_attr.grh.dgid = ibv_gid { raw: remote.gid };
            attr.ah_attr.grh.sgid_index = 0;
            // Enough for routed RoCE v2; on one subnet it is never reached.
            attr.ah_attr.grh.hop_limit = 64;
        }
        let mask = ibv_qp_attr_mask::IBV_QP_STATE
            | ibv_qp_attr_mask::IBV_QP_AV
            | ibv_qp_attr_mask::IBV_QP_PATH_MTU
            | ibv_qp_attr_mask::IBV_QP_DEST_QPN
            | ibv_qp_attr_mask::IBV_QP_RQ_PSN
            | ibv_qp_attr_mask::IBV_QP_MAX_DEST_RD_ATOMIC
            | ibv_qp_attr_mask::IBV_QP_MIN_RNR_TIMER;
        // SAFETY: live QP, valid attributes.
        check("ibv_modify_qp(RTR)", unsafe {
            ibv_modify_qp(self.qp, &mut attr, mask.0 as i32)
        })?;
        // SAFETY: zeroed is a valid initial value for this plain C struct.
        let mut attr: ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = ibv_qp_state::IBV_QPS_RTS;
        attr.timeout = 14;
        attr.retry_cnt = 7;
        attr.rnr_retry = 7;
        attr.sq_psn = self.psn;
        attr.max_rd_atomic = 1;
        let mask = ibv_qp_attr_mask::IBV_QP_STATE
            | ibv_qp_attr_mask::IBV_QP_TIMEOUT
            | ibv_qp_attr_mask::IBV_QP_RETRY_CNT
            | ibv_qp_attr_mask::IBV_QP_RNR_RETRY
            | ibv_qp_attr_mask::IBV_QP_SQ_PSN
            | ibv_qp_attr_mask::IBV_QP_MAX_QP_RD_ATOMIC;
        // SAFETY: live QP, valid attributes.
        check("ibv_modify_qp(RTS)", unsafe {
            ibv_modify_qp(self.qp, &mut attr, mask.0 as i32)
        })?;
        self.lifecycle.to_rts().map_err(lifecycle_err)
    }

    /// Posts operation `op` as chained RDMA WRITEs, piece `i` of `local` to `remote[i]`
    /// (`(address, rkey)`, from [`RdmaHello::target`]), with one signalled completion on the
    /// last. Its outcome comes back from [`RcQueuePair::completions`].
    pub fn post_write(
        &mut self,
        op: TransferId,
        local: &[LocalPiece],
        remote: &[(u64, u32)],
    ) -> Result<(), RdmaError> {
        if local.is_empty() || local.len() != remote.len() {
            return Err(RdmaError::Verbs {
                call: "post_write: pieces and targets differ",
                errno: 0,
            });
        }
        let wr_id = self.lifecycle.post(op).map_err(|_| RdmaError::Verbs {
            call: "post_write: queue pair not ready",
            errno: 0,
        })?;
        let mut sges: Vec<ibv_sge> = local
            .iter()
            .map(|p| ibv_sge {
                addr: p.addr,
                length: p.len,
                lkey: p.lkey,
            })
            .collect();
        // SAFETY: zeroed is a valid initial value for this plain C struct.
        let mut wrs: Vec<ibv_send_wr> = (0..local.len())
            .map(|_| unsafe { std::mem::zeroed() })
            .collect();
        let n = wrs.len();
        let base = wrs.as_mut_ptr();
        for (i, wr) in wrs.iter_mut().enumerate() {
            wr.wr_id = wr_id;
            // SAFETY: `i + 1 < n` points inside `wrs`, which outlives the post call.
            wr.next = if i + 1 < n {
                unsafe { base.add(i + 1) }
            } else {
                std::ptr::null_mut()
            };
            wr.sg_list = &mut sges[i];
            wr.num_sge = 1;
            wr.opcode = ibv_wr_opcode::IBV_WR_RDMA_WRITE;
            wr.send_flags = if i + 1 == n {
                ibv_send_flags::IBV_SEND_SIGNALED.0
            } else {
                0
            };
            wr.wr.rdma = rdma_t {
                remote_addr: remote[i].0,
                rkey: remote[i].1,
            };
        }
        let mut bad: *mut ibv_send_wr = std::ptr::null_mut();
        // SAFETY: live QP; the chain and its SGEs are valid for the duration of the call
        // (verbs copies them into the send queue).
        let rc = unsafe { ibv_post_send(self.qp, base, &mut bad) };
        if rc != 0 {
            // Nothing of it was queued and the QP is unchanged (a full send queue reads
            // ENOMEM): forget it; the caller reports the operation.
            let _ = self.lifecycle.cancel(wr_id);
            return Err(RdmaError::Verbs {
                call: "ibv_post_send",
                errno: rc,
            });
        }
        Ok(())
    }

    /// The completion channel's descriptor: readable when completions are waiting (await it
    /// with tokio's `AsyncFd` or an io_uring poll), then call [`RcQueuePair::completions`].
    pub fn completion_fd(&self) -> RawFd {
        // SAFETY: the channel lives as long as `self`.
        unsafe { (*self.channel).fd }
    }

    /// Consumes the channel's events, re-arms it, and returns every finished operation with
    /// its outcome (each exactly once). Also usable for busy polling.
    pub fn completions(&mut self) -> Result<Vec<(TransferId, TransferOutcome)>, RdmaError> {
        let mut events = 0u32;
        loop {
            let mut cq: *mut ibv_cq = std::ptr::null_mut();
            let mut ctx: *mut std::os::raw::c_void = std::ptr::null_mut();
            // SAFETY: live channel; non-blocking, so it returns -1 when no event is queued.
            if unsafe { ibv_get_cq_event(self.channel, &mut cq, &mut ctx) } != 0 {
                break;
            }
            events += 1;
        }
        if events > 0 {
            // SAFETY: acknowledges exactly the events received above.
            unsafe { ibv_ack_cq_events(self.cq, events) };
        }
        // Re-arm before polling, so a completion racing the poll still raises an event.
        self.arm()?;
        let mut out = Vec::new();
        // SAFETY: zeroed is a valid initial value for these plain C structs.
        let mut wcs: Vec<ibv_wc> = (0..32).map(|_| unsafe { std::mem::zeroed() }).collect();
        loop {
            // SAFETY: live CQ; `wcs` has room for 32 entries.
            let n = unsafe { ibv_poll_cq(self.cq, wcs.len() as i32, wcs.as_mut_ptr()) };
            if n < 0 {
                return Err(RdmaError::Verbs {
                    call: "ibv_poll_cq",
                    errno: n,
                });
            }
            for wc in &wcs[..n as usize] {
                if let Some(done) = self
                    .lifecycle
                    .complete(wc.wr_id, WcStatus::from_raw(wc.status))
                {
                    out.push(done);
                }
            }
            if (n as usize) < wcs.len() {
                break;
            }
        }
        Ok(out)
    }

    /// The core's fence: the QP goes to the error state; outstanding writes complete flushed
    /// (collect them with [`RcQueuePair::completions`]) until [`RcQueuePair::is_drained`].
    pub fn fence(&mut self) -> Result<(), RdmaError> {
        // SAFETY: zeroed is a valid initial value for this plain C struct.
        let mut attr: ibv_qp_attr = unsafe { std::mem::zeroed() };
        attr.qp_state = ibv_qp_state::IBV_QPS_ERR;
        // SAFETY: live QP, valid attributes.
        check("ibv_modify_qp(ERR)", unsafe {
            ibv_modify_qp(self.qp, &mut attr, ibv_qp_attr_mask::IBV_QP_STATE.0 as i32)
        })?;
        self.lifecycle.fence();
        Ok(())
    }

    /// Where the QP is in its lifecycle.
    pub fn state(&self) -> crate::QpState {
        self.lifecycle.state()
    }

    /// Whether the fence is complete: nothing of this QP can land any more.
    pub fn is_drained(&self) -> bool {
        self.lifecycle.is_drained()
    }
}

impl Drop for RcQueuePair {
    fn drop(&mut self) {
        // SAFETY: each was created in `new` and is destroyed once, QP before CQ before channel.
        unsafe {
            ibv_destroy_qp(self.qp);
            ibv_destroy_cq(self.cq);
            ibv_destroy_comp_channel(self.channel);
        }
    }
}
