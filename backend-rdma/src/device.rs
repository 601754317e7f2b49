//! Devices through `rdma-sys` (feature `rdma`): discovery with typed errors, and the
//! protection domain every memory registration of a node hangs off.

use std::ffi::CStr;

use crate::ffi::{
    ibv_alloc_pd, ibv_close_device, ibv_dealloc_pd, ibv_free_device_list, ibv_get_device_list,
    ibv_get_device_name, ibv_open_device, ibv_query_device,
};

/// Why RDMA cannot be used on this host.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RdmaError {
    /// libibverbs could not be loaded (no rdma-core on this host), or lacks a verb; says
    /// what the loader found.
    NoLibrary(String),
    /// The kernel has no RDMA support (`ibv_get_device_list` failed with `ENOSYS`): load the
    /// drivers (`modprobe ib_core`, a device driver, or `rdma_rxe` for soft-RoCE).
    NoKernelSupport,
    /// The kernel supports RDMA but no device is present (`ls /sys/class/infiniband`).
    NoDevice,
    /// No device has this name.
    DeviceNotFound(String),
    /// A verbs call failed (which one, and `errno`).
    Verbs {
        /// The call.
        call: &'static str,
        /// Its errno.
        errno: i32,
    },
}

impl std::fmt::Display for RdmaError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            RdmaError::NoLibrary(why) => write!(
                f,
                "libibverbs cannot be loaded ({why}); install rdma-core (libibverbs1 and the NIC's provider), or use --backend tcp"
            ),
            RdmaError::NoKernelSupport => write!(
                f,
                "this kernel has no RDMA support (ibv_get_device_list: ENOSYS); load ib_core and a device driver, or rdma_rxe for soft-RoCE, or use --backend tcp"
            ),
            RdmaError::NoDevice => write!(
                f,
                "no RDMA device (ls /sys/class/infiniband is empty); add one (e.g. rdma link add rxe0 type rxe netdev eth0) or use --backend tcp"
            ),
            RdmaError::DeviceNotFound(name) => {
                write!(f, "no RDMA device named {name}; name another one, or use --backend tcp")
            }
            RdmaError::Verbs { call, errno } => write!(
                f,
                "{call} failed (errno {errno}); check the device and its port, or use --backend tcp"
            ),
        }
    }
}

impl std::error::Error for RdmaError {}

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

/// The names of the RDMA devices on this host.
pub fn list_devices() -> Result<Vec<String>, RdmaError> {
    crate::ffi::load_verbs()?;
    let mut n: std::os::raw::c_int = 0;
    // SAFETY: `n` is a valid out-pointer; the returned list (or NULL) is freed below.
    let list = unsafe { ibv_get_device_list(&mut n) };
    if list.is_null() {
        let e = errno();
        return Err(if e == libc_enosys() {
            RdmaError::NoKernelSupport
        } else {
            RdmaError::Verbs {
                call: "ibv_get_device_list",
                errno: e,
            }
        });
    }
    let mut names = Vec::with_capacity(n.max(0) as usize);
    for i in 0..n.max(0) as usize {
        // SAFETY: the list holds `n` valid device pointers (NULL-terminated after them).
        let dev = unsafe { *list.add(i) };
        if dev.is_null() {
            break;
        }
        // SAFETY: a valid device has a NUL-terminated name owned by the list.
        let name = unsafe { ibv_get_device_name(dev) };
        if !name.is_null() {
            // SAFETY: non-NULL, NUL-terminated, alive until the list is freed.
            names.push(
                unsafe { CStr::from_ptr(name) }
                    .to_string_lossy()
                    .into_owned(),
            );
        }
    }
    // SAFETY: `list` came from ibv_get_device_list and is freed once.
    unsafe { ibv_free_device_list(list) };
    if names.is_empty() {
        return Err(RdmaError::NoDevice);
    }
    Ok(names)
}

/// `ENOSYS` on Linux.
fn libc_enosys() -> i32 {
    38
}

/// An opened device with its protection domain.
#[derive(Debug)]
pub struct Device {
    name: String,
    ctx: *mut rdma_sys::ibv_context,
    pd: *mut rdma_sys::ibv_pd,
}

// SAFETY: verbs contexts and protection domains may be used from any thread (libibverbs
// serialises what needs it); `Device` only hands out shared access to them.
unsafe impl Send for Device {}
// SAFETY: as above.
unsafe impl Sync for Device {}

impl Device {
    /// Opens the device called `name`, or the first one, and allocates its protection domain.
    pub fn open(name: Option<&str>) -> Result<Device, RdmaError> {
        let names = list_devices()?;
        let wanted = match name {
            Some(n) => names
                .iter()
                .position(|d| d == n)
                .ok_or_else(|| RdmaError::DeviceNotFound(n.to_owned()))?,
            None => 0,
        };
        let mut n: std::os::raw::c_int = 0;
        // SAFETY: as in list_devices; the list is freed before returning.
        let list = unsafe { ibv_get_device_list(&mut n) };
        if list.is_null() || wanted >= n.max(0) as usize {
            return Err(RdmaError::NoDevice);
        }
        // SAFETY: `wanted` < n: a valid device pointer of the list.
        let ctx = unsafe { ibv_open_device(*list.add(wanted)) };
        let open_errno = errno();
        // SAFETY: freed once; an opened context stays valid after the list is freed.
        unsafe { ibv_free_device_list(list) };
        if ctx.is_null() {
            return Err(RdmaError::Verbs {
                call: "ibv_open_device",
                errno: open_errno,
            });
        }
        // SAFETY: `ctx` is an open context.
        let pd = unsafe { ibv_alloc_pd(ctx) };
        if pd.is_null() {
            let e = errno();
            // SAFETY: closing the context we opened, once.
            unsafe { ibv_close_device(ctx) };
            return Err(RdmaError::Verbs {
                call: "ibv_alloc_pd",
                errno: e,
            });
        }
        Ok(Device {
            name: names[wanted].clone(),
            ctx,
            pd,
        })
    }

    /// The device's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The most work requests one send queue of this device may hold.
    pub fn max_qp_wr(&self) -> Result<u32, RdmaError> {
        // SAFETY: zeroed is a valid initial value for this plain C struct.
        let mut attr: rdma_sys::ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: live context, valid out-pointer.
        let rc = unsafe { ibv_query_device(self.ctx, &mut attr) };
        if rc != 0 {
            return Err(RdmaError::Verbs {
                call: "ibv_query_device",
                errno: rc,
            });
        }
        Ok(attr.max_qp_wr.max(1) as u32)
    }

    /// The open context.
    pub(crate) fn ctx(&self) -> *mut rdma_sys::ibv_context {
        self.ctx
    }

    /// The protection domain every registration of this device hangs off.
    pub(crate) fn pd(&self) -> *mut rdma_sys::ibv_pd {
        self.pd
    }
}

impl Drop for Device {
    fn drop(&mut self) {
        // SAFETY: both were allocated in `open` and are released once, PD first.
        unsafe {
            ibv_dealloc_pd(self.pd);
            ibv_close_device(self.ctx);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::WcStatus;

    #[test]
    fn wc_status_values_match_libibverbs() {
        use rdma_sys::ibv_wc_status as s;
        let expected = [
            s::IBV_WC_SUCCESS,
            s::IBV_WC_LOC_LEN_ERR,
            s::IBV_WC_LOC_QP_OP_ERR,
            s::IBV_WC_LOC_EEC_OP_ERR,
            s::IBV_WC_LOC_PROT_ERR,
            s::IBV_WC_WR_FLUSH_ERR,
            s::IBV_WC_MW_BIND_ERR,
            s::IBV_WC_BAD_RESP_ERR,
            s::IBV_WC_LOC_ACCESS_ERR,
            s::IBV_WC_REM_INV_REQ_ERR,
            s::IBV_WC_REM_ACCESS_ERR,
            s::IBV_WC_REM_OP_ERR,
            s::IBV_WC_RETRY_EXC_ERR,
            s::IBV_WC_RNR_RETRY_EXC_ERR,
            s::IBV_WC_LOC_RDD_VIOL_ERR,
            s::IBV_WC_REM_INV_RD_REQ_ERR,
            s::IBV_WC_REM_ABORT_ERR,
            s::IBV_WC_INV_EECN_ERR,
            s::IBV_WC_INV_EEC_STATE_ERR,
            s::IBV_WC_FATAL_ERR,
            s::IBV_WC_RESP_TIMEOUT_ERR,
            s::IBV_WC_GENERAL_ERR,
            s::IBV_WC_TM_ERR,
            s::IBV_WC_TM_RNDV_INCOMPLETE,
        ];
        for (ours, theirs) in WcStatus::ALL.iter().zip(expected) {
            assert_eq!(*ours as u32, theirs, "{ours:?}");
        }
    }

    #[test]
    fn no_device_is_a_typed_error_not_a_panic() {
        match Device::open(None) {
            Ok(d) => eprintln!("an RDMA device is present ({}); skipping", d.name()),
            Err(e) => {
                assert!(
                    matches!(e, RdmaError::NoKernelSupport | RdmaError::NoDevice),
                    "{e:?}"
                );
                assert!(e.to_string().contains("--backend tcp"), "{e}");
            }
        }
    }
}
