//! Work-completion statuses and the core outcome each one means.

use kvferry_core::TransferOutcome;

/// `enum ibv_wc_status` from `<infiniband/verbs.h>`, by value (checked against `rdma-sys`
/// when the `rdma` feature is on).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
#[allow(missing_docs)] // the verbs names say it
pub enum WcStatus {
    Success = 0,
    LocLenErr = 1,
    LocQpOpErr = 2,
    LocEecOpErr = 3,
    LocProtErr = 4,
    WrFlushErr = 5,
    MwBindErr = 6,
    BadRespErr = 7,
    LocAccessErr = 8,
    RemInvReqErr = 9,
    RemAccessErr = 10,
    RemOpErr = 11,
    RetryExcErr = 12,
    RnrRetryExcErr = 13,
    LocRddViolErr = 14,
    RemInvRdReqErr = 15,
    RemAbortErr = 16,
    InvEecnErr = 17,
    InvEecStateErr = 18,
    FatalErr = 19,
    RespTimeoutErr = 20,
    GeneralErr = 21,
    TmErr = 22,
    TmRndvIncomplete = 23,
}

impl WcStatus {
    /// Every status, in value order.
    pub const ALL: [WcStatus; 24] = [
        WcStatus::Success,
        WcStatus::LocLenErr,
        WcStatus::LocQpOpErr,
        WcStatus::LocEecOpErr,
        WcStatus::LocProtErr,
        WcStatus::WrFlushErr,
        WcStatus::MwBindErr,
        WcStatus::BadRespErr,
        WcStatus::LocAccessErr,
        WcStatus::RemInvReqErr,
        WcStatus::RemAccessErr,
        WcStatus::RemOpErr,
        WcStatus::RetryExcErr,
        WcStatus::RnrRetryExcErr,
        WcStatus::LocRddViolErr,
        WcStatus::RemInvRdReqErr,
        WcStatus::RemAbortErr,
        WcStatus::InvEecnErr,
        WcStatus::InvEecStateErr,
        WcStatus::FatalErr,
        WcStatus::RespTimeoutErr,
        WcStatus::GeneralErr,
        WcStatus::TmErr,
        WcStatus::TmRndvIncomplete,
    ];

    /// The status of a raw `ibv_wc.status`; `None` for a value this build does not know.
    pub fn from_raw(v: u32) -> Option<WcStatus> {
        WcStatus::ALL.get(v as usize).copied()
    }
}

/// The core outcome of an operation whose (last, signalled) work request completed with
/// `status`; an unknown raw status is fatal.
///
/// | status | outcome | why |
/// |---|---|---|
/// | `SUCCESS` | `Done` | the write landed in the peer's memory |
/// | `RETRY_EXC_ERR`, `RNR_RETRY_EXC_ERR`, `RESP_TIMEOUT_ERR` | `Transient` | the path or the peer did not answer in time; another attempt may |
/// | `WR_FLUSH_ERR` | `Flushed` | flushed because the QP went to the error state (a fence or an earlier write's failure); the write never ran |
/// | `REM_ABORT_ERR` | `Transient` | the responder aborted the operation |
/// | `REM_ACCESS_ERR` | `Refused` | the peer's memory region refused the write (rkey, range or access flags): the receiver's rule, like a refused TCP write |
/// | every other error | `Fatal` | a local programming, protection or device error that retrying cannot fix |
pub fn classify(status: Option<WcStatus>) -> TransferOutcome {
    match status {
        Some(WcStatus::Success) => TransferOutcome::Done,
        Some(
            WcStatus::RetryExcErr
            | WcStatus::RnrRetryExcErr
            | WcStatus::RespTimeoutErr
            | WcStatus::RemAbortErr,
        ) => TransferOutcome::Transient,
        Some(WcStatus::WrFlushErr) => TransferOutcome::Flushed,
        Some(WcStatus::RemAccessErr) => TransferOutcome::Refused,
        _ => TransferOutcome::Fatal,
    }
}
