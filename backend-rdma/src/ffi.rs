//! libibverbs, loaded at run time: the exported verbs this backend calls, resolved once from
//! `libibverbs.so.1`. Nothing links the library, so a binary or wheel built with RDMA starts
//! on a host without rdma-core, and says so only when a node asks for RDMA. The calls that
//! rdma-core defines inline (`ibv_post_send`, `ibv_poll_cq`, `ibv_req_notify_cq`) go through
//! the context's function table and need no symbol.

use std::os::raw::{c_char, c_int, c_uint, c_void};
use std::sync::OnceLock;

use rdma_sys::{
    _compat_ibv_port_attr, ibv_comp_channel, ibv_context, ibv_cq, ibv_device, ibv_device_attr,
    ibv_gid, ibv_mr, ibv_pd, ibv_qp, ibv_qp_attr, ibv_qp_init_attr,
};

use crate::device::RdmaError;

/// The names tried, in order: the ABI's soname, then the development link.
const LIBRARIES: [&str; 2] = ["libibverbs.so.1", "libibverbs.so"];

/// The exported verbs, typed as `<infiniband/verbs.h>` declares them.
struct Verbs {
    get_device_list: unsafe extern "C" fn(*mut c_int) -> *mut *mut ibv_device,
    free_device_list: unsafe extern "C" fn(*mut *mut ibv_device),
    get_device_name: unsafe extern "C" fn(*mut ibv_device) -> *const c_char,
    open_device: unsafe extern "C" fn(*mut ibv_device) -> *mut ibv_context,
    close_device: unsafe extern "C" fn(*mut ibv_context) -> c_int,
    query_device: unsafe extern "C" fn(*mut ibv_context, *mut ibv_device_attr) -> c_int,
    query_port: unsafe extern "C" fn(*mut ibv_context, u8, *mut _compat_ibv_port_attr) -> c_int,
    query_gid: unsafe extern "C" fn(*mut ibv_context, u8, c_int, *mut ibv_gid) -> c_int,
    alloc_pd: unsafe extern "C" fn(*mut ibv_context) -> *mut ibv_pd,
    dealloc_pd: unsafe extern "C" fn(*mut ibv_pd) -> c_int,
    reg_mr: unsafe extern "C" fn(*mut ibv_pd, *mut c_void, usize, c_int) -> *mut ibv_mr,
    /// Absent before rdma-core 34: dma-buf registration is then refused like an unable NIC.
    reg_dmabuf_mr:
        Option<unsafe extern "C" fn(*mut ibv_pd, u64, usize, u64, c_int, c_int) -> *mut ibv_mr>,
    dereg_mr: unsafe extern "C" fn(*mut ibv_mr) -> c_int,
    create_comp_channel: unsafe extern "C" fn(*mut ibv_context) -> *mut ibv_comp_channel,
    destroy_comp_channel: unsafe extern "C" fn(*mut ibv_comp_channel) -> c_int,
    create_cq: unsafe extern "C" fn(
        *mut ibv_context,
        c_int,
        *mut c_void,
        *mut ibv_comp_channel,
        c_int,
    ) -> *mut ibv_cq,
    destroy_cq: unsafe extern "C" fn(*mut ibv_cq) -> c_int,
    create_qp: unsafe extern "C" fn(*mut ibv_pd, *mut ibv_qp_init_attr) -> *mut ibv_qp,
    modify_qp: unsafe extern "C" fn(*mut ibv_qp, *mut ibv_qp_attr, c_int) -> c_int,
    destroy_qp: unsafe extern "C" fn(*mut ibv_qp) -> c_int,
    get_cq_event:
        unsafe extern "C" fn(*mut ibv_comp_channel, *mut *mut ibv_cq, *mut *mut c_void) -> c_int,
    ack_cq_events: unsafe extern "C" fn(*mut ibv_cq, c_uint),
    /// Keeps the symbols above valid: never unloaded.
    _library: libloading::Library,
}

/// Loads libibverbs if it is not yet: every other call here needs it, and the first verbs
/// call of a node ([`crate::device::list_devices`]) makes it, so a host without rdma-core
/// gets this error instead of a missing-library failure at start.
pub(crate) fn load_verbs() -> Result<(), RdmaError> {
    verbs().map(|_| ())
}

/// The verbs of this process, loaded by the first call; why not, when the library is absent
/// or lacks a symbol every supported rdma-core has.
fn verbs() -> Result<&'static Verbs, RdmaError> {
    static VERBS: OnceLock<Result<Verbs, RdmaError>> = OnceLock::new();
    VERBS.get_or_init(load).as_ref().map_err(Clone::clone)
}

// `let f = ...; f` ends each symbol's borrow of `library` before the library moves.
#[allow(clippy::let_and_return)]
fn load() -> Result<Verbs, RdmaError> {
    let mut tried = Vec::new();
    let library = LIBRARIES
        .iter()
        .find_map(|name| {
            // SAFETY: loading libibverbs runs its initialisers, which only set up its own
            // state (provider discovery happens at ibv_get_device_list).
            match unsafe { libloading::Library::new(name) } {
                Ok(l) => Some(l),
                Err(e) => {
                    tried.push(e.to_string());
                    None
                }
            }
        })
        .ok_or_else(|| RdmaError::NoLibrary(tried.join("; ")))?;
    macro_rules! sym {
        ($name:literal) => {{
            // SAFETY: the symbol is the exported verb of that name, whose C signature the
            // field's type spells out (checked against rdma-sys's bindings of verbs.h).
            let f = *unsafe { library.get(concat!($name, "\0").as_bytes()) }
                .map_err(|e| RdmaError::NoLibrary(format!("libibverbs has no {}: {e}", $name)))?;
            f
        }};
    }
    Ok(Verbs {
        get_device_list: sym!("ibv_get_device_list"),
        free_device_list: sym!("ibv_free_device_list"),
        get_device_name: sym!("ibv_get_device_name"),
        open_device: sym!("ibv_open_device"),
        close_device: sym!("ibv_close_device"),
        query_device: sym!("ibv_query_device"),
        query_port: sym!("ibv_query_port"),
        query_gid: sym!("ibv_query_gid"),
        alloc_pd: sym!("ibv_alloc_pd"),
        dealloc_pd: sym!("ibv_dealloc_pd"),
        reg_mr: sym!("ibv_reg_mr"),
        reg_dmabuf_mr: {
            // SAFETY: as for `sym!`.
            let f = unsafe { library.get(b"ibv_reg_dmabuf_mr\0") }
                .ok()
                .map(|s| *s);
            f
        },
        dereg_mr: sym!("ibv_dereg_mr"),
        create_comp_channel: sym!("ibv_create_comp_channel"),
        destroy_comp_channel: sym!("ibv_destroy_comp_channel"),
        create_cq: sym!("ibv_create_cq"),
        destroy_cq: sym!("ibv_destroy_cq"),
        create_qp: sym!("ibv_create_qp"),
        modify_qp: sym!("ibv_modify_qp"),
        destroy_qp: sym!("ibv_destroy_qp"),
        get_cq_event: sym!("ibv_get_cq_event"),
        ack_cq_events: sym!("ibv_ack_cq_events"),
        _library: library,
    })
}

/// Declares each exported verb as a function of the same name that calls it through the
/// loaded library: the callers read as they would against `<infiniband/verbs.h>`. Every
/// verbs object hangs off a device, opened only after [`load_verbs`] succeeded, so the
/// library is loaded whenever one of these runs with a live object; `$none` is what each
/// returns otherwise.
macro_rules! verbs_fns {
    ($(fn $name:ident($($arg:ident: $ty:ty),*) -> $ret:ty = $field:ident or $none:expr;)*) => {$(
        #[doc = concat!("`", stringify!($name), "` of the loaded libibverbs.")]
        #[allow(clippy::unused_unit)]
        pub(crate) unsafe fn $name($($arg: $ty),*) -> $ret {
            match verbs() {
                // SAFETY: the caller upholds the verb's contract, as for a direct call.
                Ok(v) => unsafe { (v.$field)($($arg),*) },
                Err(_) => $none,
            }
        }
    )*};
}

verbs_fns! {
    fn ibv_get_device_list(n: *mut c_int) -> *mut *mut ibv_device = get_device_list or std::ptr::null_mut();
    fn ibv_free_device_list(list: *mut *mut ibv_device) -> () = free_device_list or ();
    fn ibv_get_device_name(d: *mut ibv_device) -> *const c_char = get_device_name or std::ptr::null();
    fn ibv_open_device(d: *mut ibv_device) -> *mut ibv_context = open_device or std::ptr::null_mut();
    fn ibv_close_device(c: *mut ibv_context) -> c_int = close_device or -1;
    fn ibv_query_device(c: *mut ibv_context, a: *mut ibv_device_attr) -> c_int = query_device or -1;
    fn ibv_query_gid(c: *mut ibv_context, p: u8, i: c_int, g: *mut ibv_gid) -> c_int = query_gid or -1;
    fn ibv_alloc_pd(c: *mut ibv_context) -> *mut ibv_pd = alloc_pd or std::ptr::null_mut();
    fn ibv_dealloc_pd(pd: *mut ibv_pd) -> c_int = dealloc_pd or -1;
    fn ibv_reg_mr(pd: *mut ibv_pd, a: *mut c_void, l: usize, f: c_int) -> *mut ibv_mr = reg_mr or std::ptr::null_mut();
    fn ibv_dereg_mr(mr: *mut ibv_mr) -> c_int = dereg_mr or -1;
    fn ibv_create_comp_channel(c: *mut ibv_context) -> *mut ibv_comp_channel = create_comp_channel or std::ptr::null_mut();
    fn ibv_destroy_comp_channel(ch: *mut ibv_comp_channel) -> c_int = destroy_comp_channel or -1;
    fn ibv_create_cq(c: *mut ibv_context, n: c_int, x: *mut c_void, ch: *mut ibv_comp_channel, v: c_int) -> *mut ibv_cq = create_cq or std::ptr::null_mut();
    fn ibv_destroy_cq(cq: *mut ibv_cq) -> c_int = destroy_cq or -1;
    fn ibv_create_qp(pd: *mut ibv_pd, a: *mut ibv_qp_init_attr) -> *mut ibv_qp = create_qp or std::ptr::null_mut();
    fn ibv_modify_qp(qp: *mut ibv_qp, a: *mut ibv_qp_attr, m: c_int) -> c_int = modify_qp or -1;
    fn ibv_destroy_qp(qp: *mut ibv_qp) -> c_int = destroy_qp or -1;
    fn ibv_get_cq_event(ch: *mut ibv_comp_channel, cq: *mut *mut ibv_cq, x: *mut *mut c_void) -> c_int = get_cq_event or -1;
    fn ibv_ack_cq_events(cq: *mut ibv_cq, n: c_uint) -> () = ack_cq_events or ();
}

/// `ibv_query_port` into the full attribute struct (the exported call fills its older
/// prefix, which holds every field read here).
pub(crate) unsafe fn ibv_query_port(
    ctx: *mut ibv_context,
    port: u8,
    attr: *mut rdma_sys::ibv_port_attr,
) -> c_int {
    match verbs() {
        // SAFETY: the caller's contract; the compat struct is a prefix of `ibv_port_attr`.
        Ok(v) => unsafe { (v.query_port)(ctx, port, attr.cast()) },
        Err(_) => -1,
    }
}

/// `ibv_reg_dmabuf_mr`, or `Err(EOPNOTSUPP)` where this libibverbs predates it.
pub(crate) unsafe fn ibv_reg_dmabuf_mr(
    pd: *mut ibv_pd,
    offset: u64,
    len: usize,
    iova: u64,
    fd: c_int,
    access: c_int,
) -> Result<*mut ibv_mr, RdmaError> {
    const EOPNOTSUPP: i32 = 95;
    let f = verbs()?.reg_dmabuf_mr.ok_or(RdmaError::Verbs {
        call: "ibv_reg_dmabuf_mr",
        errno: EOPNOTSUPP,
    })?;
    // SAFETY: the caller's contract, as for a direct call.
    Ok(unsafe { f(pd, offset, len, iova, fd, access) })
}
