#![allow(unexpected_cfgs)] // pyo3 0.22's exception macro names a cfg newer compilers check
#![allow(clippy::useless_conversion)] // pyo3 0.22's #[pymethods] expansion converts every PyResult
//! `kvferry-python`: the native module of the `kvferry` Python package.
//!
//! Owns the translation between Python and the embedder API ([`kvferry_tokio::Node`]): a
//! [`Node`] runs a tokio node on its own threads, over memory the caller registered by
//! pointer and length; every call that can wait releases the GIL, `poll` never blocks, and
//! every error reaches Python as a typed exception. It must never decide anything about a
//! room (the core's) nor let a Python value reach memory outside the registered regions
//! (the core checks every page index against the layout and the grant).

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use kvferry_core::{
    ApiError, Chunk, Config, EndpointInfo, FailureReason, Grant, Heads, Incarnation, KvPoll,
    NodeId, PromptDigest, RoomId,
};
use kvferry_memory::{ExternalRegion, MemoryKind, MemoryMap};
use kvferry_tokio::{Announcement, NodeConfig, NodeError, PeerId, RoomHandle};
use pyo3::prelude::*;
use pyo3::types::PyDict;
use tokio::sync::mpsc;

mod errors;
mod parse;
use errors::*;
use parse::*;

/// SGLang's `KVPoll` integer of a state.
fn kvpoll(state: KvPoll) -> u8 {
    match state {
        KvPoll::Failed(_) => 0,
        KvPoll::Bootstrapping => 1,
        KvPoll::WaitingForInput => 2,
        KvPoll::Transferring => 3,
        KvPoll::Success => 4,
    }
}

/// Checks what the driver says each registered pointer is (where CUDA is usable) and gives
/// device memory a CUDA copy engine with a staging pool of `buffers` x `bytes`: a device
/// pointer registered as host, or device memory no engine can reach, is refused naming the
/// region, before anything reads it.
fn reach_device_memory(memory: MemoryMap, buffers: usize, bytes: usize) -> PyResult<MemoryMap> {
    use kvferry_gpu::engine::{verify_kinds, CudaCopyEngine, KindError};
    use kvferry_memory::{Staging, StagingConfig};
    match verify_kinds(&memory) {
        Ok(()) => {}
        Err(e @ KindError::Mismatch(_)) => {
            return Err(UnsupportedMemory::new_err(format!(
                "{e} (pass kv_device=N for GPU KV)"
            )))
        }
        Err(e) => return Err(UnsupportedMemory::new_err(e.to_string())),
    }
    let Some((region, kind)) = memory.unreachable_region() else {
        return Ok(memory);
    };
    let engine = CudaCopyEngine::for_memory(&memory).map_err(|e| {
        UnsupportedMemory::new_err(format!(
            "{region:?} is {kind}, and no CUDA copy engine can reach it here: {e}"
        ))
    })?;
    let config = StagingConfig {
        buffers,
        buffer_bytes: bytes,
        ..StagingConfig::default()
    };
    let staging = Staging::new(engine, config)
        .map_err(|e| UnsupportedMemory::new_err(format!("staging pool for {kind}: {e}")))?;
    Ok(memory.with_staging(staging))
}

/// A `(pointer, length)` pair from Python.
type Span = (usize, usize);

/// A kvferry node (one prefill or decode rank) over memory the caller owns.
///
/// `kv` is one `(pointer, length)` per KV region in `layer * planes + plane` order (what
/// `numpy.ndarray.ctypes.data` / `.nbytes` or `torch.Tensor.data_ptr()` give), each at least
/// `pages * page_bytes` long; `aux` and `state` likewise when the layout has them. With
/// `kv_device=N` the KV regions are memory of CUDA device N (`torch.Tensor.data_ptr()` of a
/// CUDA tensor): never read by the CPU, staged through `staging_buffers` page-locked buffers
/// of `staging_buffer_bytes` by the CUDA copy engine, refused with `UnsupportedMemory` where
/// CUDA is not usable. Lifetime
/// rule: every buffer must stay allocated, and must not move, until `shutdown()` returns; a
/// room's pages must not be touched between granting or sending them and the room's
/// `releasable()`.
#[pyclass(module = "kvferry._kvferry")]
struct Node {
    runtime: tokio::runtime::Runtime,
    node: kvferry_tokio::Node,
    rooms: Mutex<HashMap<u64, RoomHandle>>,
    announcements: Mutex<mpsc::UnboundedReceiver<Announcement>>,
    closed: std::sync::atomic::AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// A prefill's announcement as Python sees it: `(room, generation, pages, skip_pages)`.
type AskedRoom = (u64, u32, u32, Option<u32>);

impl Node {
    fn check_open(&self) -> PyResult<()> {
        if self.closed.load(std::sync::atomic::Ordering::Acquire) {
            return Err(NodeClosed::new_err("the node is shut down"));
        }
        Ok(())
    }

    /// Runs `f` on the node's runtime with the GIL released.
    fn block<T: Send, F>(&self, py: Python<'_>, f: F) -> PyResult<T>
    where
        F: std::future::Future<Output = Result<T, NodeError>> + Send,
    {
        self.check_open()?;
        self.finish(py, f).map_err(node_error)
    }

    /// Runs `f` to its end on the node's runtime, releasing the GIL only if it has to wait.
    /// Most node calls end at their first poll (the core answers inline); a thread that
    /// gives the GIL back while another runs Python waits up to Python's switch interval
    /// (5 ms) to get it again, which cost the vLLM connector's opener threads 5-20 ms a room.
    fn finish<T: Send, F>(&self, py: Python<'_>, f: F) -> T
    where
        F: std::future::Future<Output = T> + Send,
    {
        let mut f = std::pin::pin!(f);
        let first = {
            let _context = self.runtime.enter();
            f.as_mut()
                .poll(&mut std::task::Context::from_waker(std::task::Waker::noop()))
        };
        match first {
            std::task::Poll::Ready(done) => done,
            std::task::Poll::Pending => py.allow_threads(|| self.runtime.block_on(f)),
        }
    }

    fn follow(&self, room: u64, handle: RoomHandle) {
        lock(&self.rooms).insert(room, handle);
    }

    fn view(&self, room: u64) -> PyResult<kvferry_tokio::RoomView> {
        lock(&self.rooms)
            .get(&room)
            .map(RoomHandle::view)
            .ok_or_else(|| InvalidArgument::new_err(format!("no room {room} on this node")))
    }
}

#[pymethods]
impl Node {
    /// Starts a node. `role` is "prefill" or "decode"; `layout` a dict (layers, planes,
    /// page_bytes, pages, aux_bytes, state_bytes, slots); `config` keyword arguments name the
    /// `KVFERRY_*` knobs in lower case without the prefix (`transfer_retries=5`,
    /// `bootstrap_timeout_ms=30000`) and override the environment.
    #[new]
    #[pyo3(signature = (role, layout, kv, aux=None, state=None, token=b"".to_vec(), node_id=None, rank=0, data_connections=2, kv_device=None, staging_buffers=16, staging_buffer_bytes=1<<20, heads=None, layer_range=None, extras=Vec::new(), extra_parts=Vec::new(), transport=None, rdma_device=None, rdma_port=1, **config))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        role: &str,
        layout: &Bound<'_, PyDict>,
        kv: Vec<Span>,
        aux: Option<Span>,
        state: Option<Span>,
        token: Vec<u8>,
        node_id: Option<u64>,
        rank: u16,
        data_connections: usize,
        kv_device: Option<u32>,
        staging_buffers: usize,
        staging_buffer_bytes: usize,
        heads: Option<(u16, u16, u16, u32)>,
        layer_range: Option<(u16, u16)>,
        extras: Vec<Vec<(usize, usize, u32)>>,
        extra_parts: Vec<Vec<Vec<PartTuple>>>,
        transport: Option<String>,
        rdma_device: Option<String>,
        rdma_port: u8,
        config: Option<&Bound<'_, PyDict>>,
    ) -> PyResult<Self> {
        let role = parse_role(role)?;
        let (backend, same_host) = parse_transport(transport, rdma_device, rdma_port)?;
        let layout = parse_layout(layout)?;
        let heads = match heads {
            None => Heads::whole(&layout),
            Some((total, start, count, head_bytes)) => {
                let h = Heads {
                    total,
                    start,
                    count,
                    head_bytes,
                };
                if h.page_tokens(layout.page_bytes).is_none() {
                    return Err(InvalidArgument::new_err(format!(
                        "heads (total {total}, start {start}, count {count}, head_bytes \
                         {head_bytes}): need start + count <= total, count and head_bytes > 0, \
                         and page_bytes ({}) a multiple of count x head_bytes",
                        layout.page_bytes
                    )));
                }
                h
            }
        };
        let (layer_start, layer_end) = layer_range.unwrap_or((0, layout.layers));
        if layer_start >= layer_end || layer_end > layout.layers {
            return Err(InvalidArgument::new_err(format!(
                "layer_range ({layer_start}, {layer_end}): need start < end <= layers ({})",
                layout.layers
            )));
        }
        let mut vars: Vec<(String, String)> = std::env::vars().collect();
        if let Some(config) = config {
            for (k, v) in config.iter() {
                let k: String = k.extract()?;
                vars.push((
                    format!("KVFERRY_{}", k.to_uppercase()),
                    v.str()?.to_string(),
                ));
            }
        }
        let read_spin = kvferry_tokio::read_spin_from_vars(vars.iter().map(|(k, v)| (k, v)))
            .map_err(InvalidArgument::new_err)?;
        let core = Config::from_vars(vars).map_err(|e| InvalidArgument::new_err(e.to_string()))?;
        let host = |(p, l): Span| ExternalRegion::host(p as *mut u8, l);
        let kind = kv_device.map_or(MemoryKind::Host, |device| MemoryKind::Cuda { device });
        let kv: Vec<ExternalRegion> = kv
            .into_iter()
            .map(|(p, l)| ExternalRegion {
                ptr: p as *mut u8,
                len: l,
                kind,
            })
            .collect();
        // A pipeline stage may give only its own layers' regions.
        let stage = if kv.len() == layout.kv_regions() as usize {
            0..layout.layers
        } else {
            layer_start..layer_end
        };
        // SAFETY: the caller promises (the class's lifetime rule) that each span is a live
        // buffer of its length until shutdown, of the memory kind it names; the map checks
        // lengths against the layout, and no CPU path reads a device region.
        let memory = unsafe {
            MemoryMap::register_stage(layout, stage, &kv, aux.map(host), state.map(host))
        }
        .map_err(|e| InvalidArgument::new_err(format!("registered memory: {e}")))?;
        let (mut pools, regions) = parse_extras(&extras, kind)?;
        parse_extra_parts(&mut pools, extra_parts)?;
        // SAFETY: as above, for the extra pools' spans.
        let memory = unsafe { memory.with_extras(&pools, &regions) }
            .map_err(|e| InvalidArgument::new_err(format!("registered memory: {e}")))?;
        let memory = reach_device_memory(memory, staging_buffers, staging_buffer_bytes)?;
        let started = std::time::UNIX_EPOCH
            .elapsed()
            .map_or(1, |d| d.as_nanos() as u64);
        let node = NodeId(node_id.unwrap_or(started ^ u64::from(std::process::id())));
        let mut info = EndpointInfo::new(role, node, Incarnation(started | 1), layout);
        info.token = token;
        info.rank = rank;
        info.heads = heads;
        info.layer_start = layer_start;
        info.layer_end = layer_end;
        info.extras = pools;
        // The last pipeline stage writes the aux row and state slot.
        info.writes_aux = layer_end == layout.layers;
        let cfg = NodeConfig {
            core,
            info,
            data_connections,
            seed: started,
            faults: None,
            backend,
            same_host,
            tls: None,
            read_spin,
        };
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("kvferry")
            .enable_all()
            .build()
            .map_err(|e| KvferryError::new_err(format!("cannot start threads: {e}")))?;
        let node = {
            let _inside = runtime.enter();
            kvferry_tokio::start(cfg, Arc::new(memory)).map_err(node_error)?
        };
        let announcements = Mutex::new(node.room_announcements());
        Ok(Node {
            runtime,
            node,
            rooms: Mutex::new(HashMap::new()),
            announcements,
            closed: false.into(),
        })
    }

    /// Accepts peers on `addr` ("host:port", port 0 for any); returns the bound addresses.
    fn listen(&self, py: Python<'_>, addr: &str) -> PyResult<Vec<String>> {
        let addr = parse_addr(addr)?;
        let bound = self.block(py, self.node.listen(addr))?;
        Ok(bound.iter().map(ToString::to_string).collect())
    }

    /// Opens sessions to a peer listening on `addrs` and waits for the handshakes; returns
    /// the peer's id.
    fn connect(&self, py: Python<'_>, addrs: Vec<String>) -> PyResult<u32> {
        let addrs = addrs
            .iter()
            .map(|a| parse_addr(a))
            .collect::<PyResult<_>>()?;
        Ok(self.block(py, self.node.connect(addrs))?.0)
    }

    /// Names a peer the core keeps connected (reconnecting after losses) and, with `reach`,
    /// waits for its first contact; returns the peer's id. A peer not reached is let go
    /// again before the error is raised.
    #[pyo3(signature = (addrs, reach=true))]
    fn connect_persistent(&self, py: Python<'_>, addrs: Vec<String>, reach: bool) -> PyResult<u32> {
        let addrs = addrs
            .iter()
            .map(|a| parse_addr(a))
            .collect::<PyResult<_>>()?;
        let node = self.node.clone();
        let peer = self.block(py, async move {
            let peer = node.connect_persistent(addrs).await?;
            if reach {
                if let Err(e) = node.reach(peer).await {
                    // The caller never hears this peer's id: it must not be dialed on.
                    let _ = node.disconnect(peer).await;
                    return Err(e);
                }
            }
            Ok(peer)
        })?;
        Ok(peer.0)
    }

    /// Lets a peer go: a kept one is dialed no more, its sessions close (rooms still on
    /// them fail `aborted_locally`), and its id is unknown from now on.
    fn disconnect(&self, py: Python<'_>, peer: u32) -> PyResult<()> {
        let node = self.node.clone();
        self.block(py, async move { node.disconnect(PeerId(peer)).await })
    }

    /// The data path each live session moves its operations on: `(session, path)` pairs,
    /// `path` one of "tcp", "tcp_staged", "rdma", "rdma_dmabuf", "cma" (`kvferry_session_path`).
    fn session_paths(&self, py: Python<'_>) -> PyResult<Vec<(u64, &'static str)>> {
        let node = self.node.clone();
        let paths = self.block(py, async move { Ok(node.data_paths().await) })?;
        Ok(paths
            .into_iter()
            .map(|(_, session, path)| (u64::from(session.0), path.as_str()))
            .collect())
    }

    /// Whether `peer` still names a peer of this node: False once it was disconnected, or let
    /// go after `peer_idle_timeout` unused (calls with it raise `UnknownPeer`).
    fn knows_peer(&self, py: Python<'_>, peer: u32) -> PyResult<bool> {
        let node = self.node.clone();
        self.block(py, async move { Ok(node.knows_peer(PeerId(peer)).await) })
    }

    /// Waits until a persistent peer has had its first contact: at once if it had, an
    /// error if it refused us or stayed unreachable for the `unreachable_timeout`.
    fn reach(&self, py: Python<'_>, peer: u32) -> PyResult<()> {
        let node = self.node.clone();
        self.block(py, async move { node.reach(PeerId(peer)).await })
    }

    /// Why a persistent peer is unreachable now (the reason's name, e.g.
    /// "connection_refused": down for its whole `unreachable_timeout`, so a room opened
    /// toward it fails at once), or None; never waits.
    fn unreachable(&self, py: Python<'_>, peer: u32) -> PyResult<Option<&'static str>> {
        let node = self.node.clone();
        let found = self.block(py, async move { node.unreachable(PeerId(peer)).await })?;
        Ok(found.map(|r| r.as_str()))
    }

    /// Decode: opens room `room` fed by `peers`, with its pages granted now or later.
    /// `prompt`: the `prompt_digest` of the tokens whose KV this decode wants (a source that
    /// holds the room for other tokens refuses it with `prompt_mismatch`).
    #[pyo3(signature = (room, peers, pages=None, aux_slot=None, state_slot=None, generation=0, receivers=1, skip_pages=0, idle_sources=Vec::new(), extras=Vec::new(), prompt=None))]
    #[allow(clippy::too_many_arguments)]
    fn open_receiver(
        &self,
        py: Python<'_>,
        room: u64,
        peers: Vec<u32>,
        pages: Option<Vec<u32>>,
        aux_slot: Option<u32>,
        state_slot: Option<u32>,
        generation: u32,
        receivers: u8,
        skip_pages: u32,
        idle_sources: Vec<usize>,
        extras: Vec<Vec<u32>>,
        prompt: Option<u64>,
    ) -> PyResult<()> {
        let idle_sources = idle_mask(&idle_sources, peers.len())?;
        let grant = pages.map(|pages| Grant {
            pages,
            aux_slot,
            state_slot,
            receivers,
            skip_pages,
            idle_sources,
            extras,
            prompt: prompt.map(PromptDigest),
        });
        let peers = peers.into_iter().map(PeerId).collect();
        let handle = self.block(
            py,
            self.node
                .open_receiver(RoomId(room), generation, peers, grant),
        )?;
        self.follow(room, handle);
        Ok(())
    }

    /// Decode: grants a room opened without pages its destination pages. `skip_pages`: room
    /// pages this decode already holds (not sent; `pages` are the ones after them);
    /// `idle_sources`: positions in the room's `peers` asked for nothing (they only confirm);
    /// `extras`: per extra pool, the destination items in room order; `prompt`: as for
    /// `open_receiver`.
    #[pyo3(signature = (room, pages, aux_slot=None, state_slot=None, receivers=1, skip_pages=0, idle_sources=Vec::new(), extras=Vec::new(), prompt=None))]
    #[allow(clippy::too_many_arguments)]
    fn grant_pages(
        &self,
        py: Python<'_>,
        room: u64,
        pages: Vec<u32>,
        aux_slot: Option<u32>,
        state_slot: Option<u32>,
        receivers: u8,
        skip_pages: u32,
        idle_sources: Vec<usize>,
        extras: Vec<Vec<u32>>,
        prompt: Option<u64>,
    ) -> PyResult<()> {
        let grant = Grant {
            pages,
            aux_slot,
            state_slot,
            receivers,
            skip_pages,
            idle_sources: idle_mask(&idle_sources, 64)?,
            extras,
            prompt: prompt.map(PromptDigest),
        };
        self.block(py, self.node.grant_pages(RoomId(room), grant))
    }

    /// Prefill: the next room a decode asked for, as `(room, generation, pages, skip_pages)`:
    /// the pages it granted (0 while it waits for pages) after the `skip_pages` it holds,
    /// `skip_pages` None where the decode wants nothing from this rank (an idle source, which
    /// only confirms); waits up to `timeout` seconds (0: do not wait), `None` if none came.
    #[pyo3(signature = (timeout=0.0))]
    fn next_announcement(&self, py: Python<'_>, timeout: f64) -> PyResult<Option<AskedRoom>> {
        self.check_open()?;
        let wait = Duration::from_secs_f64(timeout.max(0.0));
        // One already queued is taken with the GIL held (see `finish`).
        let queued = self
            .announcements
            .try_lock()
            .ok()
            .and_then(|mut rx| rx.try_recv().ok());
        let got = queued.or_else(|| {
            py.allow_threads(|| {
                let mut rx = lock(&self.announcements);
                self.runtime
                    .block_on(async { tokio::time::timeout(wait, rx.recv()).await.ok().flatten() })
            })
        });
        Ok(got.map(|a| {
            let skip = (a.skip_pages != kvferry_core::codec::SKIP_ALL).then_some(a.skip_pages);
            (a.room.0, a.generation, a.pages, skip)
        }))
    }

    /// Prefill: opens the sender side of room `room`, holding the KV of the tokens whose
    /// `prompt_digest` is `prompt` (a decode that asks for other tokens is refused with
    /// `prompt_mismatch`; None checks nothing).
    #[pyo3(signature = (room, generation=0, prompt=None))]
    fn open_sender(
        &self,
        py: Python<'_>,
        room: u64,
        generation: u32,
        prompt: Option<u64>,
    ) -> PyResult<()> {
        let handle = self.block(
            py,
            self.node
                .open_sender(RoomId(room), generation, prompt.map(PromptDigest)),
        )?;
        self.follow(room, handle);
        Ok(())
    }

    /// Prefill: sends the next chunk of source `pages` of a room (`last` with its aux row,
    /// state slot and `extras`: per extra pool, the source items in room order). A room that
    /// already failed (its decode refused or aborted it) raises its failure, a `RoomFailed`.
    #[pyo3(signature = (room, pages, last=true, aux_slot=None, state_slot=None, layerwise=false, extras=Vec::new()))]
    #[allow(clippy::too_many_arguments)]
    fn send_chunk(
        &self,
        py: Python<'_>,
        room: u64,
        pages: Vec<u32>,
        last: bool,
        aux_slot: Option<u32>,
        state_slot: Option<u32>,
        layerwise: bool,
        extras: Vec<Vec<u32>>,
    ) -> PyResult<()> {
        let chunk = Chunk {
            pages,
            last,
            aux_slot,
            state_slot,
            layerwise,
            extras,
        };
        self.check_open()?;
        self.finish(py, self.node.send_chunk(RoomId(room), chunk))
            .map_err(|e| match e {
                // Its decode refused or aborted it: the prefill learns why, as a room failure.
                NodeError::Api(ApiError::RoomConcluded(_, KvPoll::Failed(reason))) => {
                    room_failure(reason)
                }
                e => node_error(e),
            })
    }

    /// Prefill: layer `layer` of `rooms` finished its forward pass (layerwise chunks).
    fn mark_layer_ready(&self, py: Python<'_>, rooms: Vec<u64>, layer: u16) -> PyResult<()> {
        let rooms = rooms.into_iter().map(RoomId).collect();
        self.block(py, self.node.mark_layer_ready(rooms, layer))
    }

    /// Decode: a room opened without pages waits for KV capacity behind `position` others
    /// (0: being allocated now); its bootstrap deadline then fails it as `decode_saturated`,
    /// on both sides.
    fn set_queue_position(&self, py: Python<'_>, room: u64, position: u32) -> PyResult<()> {
        self.block(py, self.node.set_queue_position(RoomId(room), position))
    }

    /// Aborts a room; decode keeps its pages quarantined until `releasable()`.
    fn abort(&self, py: Python<'_>, room: u64) -> PyResult<()> {
        self.block(py, self.node.abort(RoomId(room)))
    }

    /// Fails an open room with `reason` (a reason's name, e.g. "incompatible_peer") when the
    /// embedder finds it cannot be served: its peers hear it as an abort, and it is counted
    /// under that reason. False if the room had already ended.
    fn fail(&self, py: Python<'_>, room: u64, reason: &str) -> PyResult<bool> {
        self.check_open()?;
        let reason = FailureReason::ALL
            .into_iter()
            .find(|r| r.as_str() == reason)
            .ok_or_else(|| {
                InvalidArgument::new_err(format!("no failure reason named {reason:?}"))
            })?;
        self.check_open()?;
        Ok(self.finish(py, self.node.fail_room(RoomId(room), reason)))
    }

    /// The room's state as SGLang's `KVPoll` integer (Failed=0, Bootstrapping=1,
    /// WaitingForInput=2, Transferring=3, Success=4). Never blocks.
    fn poll(&self, room: u64) -> PyResult<u8> {
        Ok(kvpoll(self.view(room)?.state))
    }

    /// The exception a failed room ended with (`None` unless its state is Failed).
    fn failure(&self, room: u64) -> PyResult<Option<PyErr>> {
        Ok(match self.view(room)?.state {
            KvPoll::Failed(reason) => Some(room_failure(reason)),
            _ => None,
        })
    }

    /// Whether the room's pages may be reused (no write of it can land any more).
    fn releasable(&self, room: u64) -> PyResult<bool> {
        Ok(self.view(room)?.releasable)
    }

    /// Waits (GIL released) up to `timeout` seconds for the room to end; returns its
    /// `KVPoll` integer.
    fn wait(&self, py: Python<'_>, room: u64, timeout: f64) -> PyResult<u8> {
        let mut handle = lock(&self.rooms)
            .get(&room)
            .cloned()
            .ok_or_else(|| InvalidArgument::new_err(format!("no room {room} on this node")))?;
        let wait = Duration::from_secs_f64(timeout.max(0.0));
        let state = self.finish(py, async {
            match tokio::time::timeout(wait, handle.terminal()).await {
                Ok(state) => state,
                Err(_) => handle.view().state,
            }
        });
        Ok(kvpoll(state))
    }

    /// Stops following a concluded room (its state is then forgotten by this object).
    fn forget(&self, room: u64) {
        lock(&self.rooms).remove(&room);
    }

    /// Every scalar counter of the core by name (`rooms_succeeded`, `peers_let_go`, ...: the
    /// metrics' names without `kvferry_` and `_total`), summed over the node.
    fn counters<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let c = self.block(py, async { Ok(self.node.counters().await) })?;
        let d = PyDict::new_bound(py);
        for (name, value) in c.iter() {
            d.set_item(name, value)?;
        }
        Ok(d)
    }

    /// Fails every room, tells every peer and stops the node's threads' work. Later calls
    /// raise `NodeClosed`.
    fn shutdown(&self, py: Python<'_>) -> PyResult<()> {
        if self.closed.swap(true, std::sync::atomic::Ordering::AcqRel) {
            return Ok(());
        }
        py.allow_threads(|| self.runtime.block_on(self.node.shutdown()));
        Ok(())
    }
}

/// The process's Prometheus recorder, once metrics are enabled.
static METRICS: std::sync::OnceLock<metrics_exporter_prometheus::PrometheusHandle> =
    std::sync::OnceLock::new();

/// Records every node's metrics in this process (the names and labels of the CLI's
/// `--metrics-addr`), served on `http://ADDR/metrics` when `addr` is given; once per process.
#[pyfunction]
#[pyo3(signature = (addr=None))]
fn enable_metrics(py: Python<'_>, addr: Option<&str>) -> PyResult<()> {
    use metrics_exporter_prometheus::PrometheusBuilder;
    if METRICS.get().is_some() {
        return Err(InvalidArgument::new_err("metrics are already enabled"));
    }
    let handle = match addr {
        None => {
            let recorder = PrometheusBuilder::new().build_recorder();
            let handle = recorder.handle();
            metrics::set_global_recorder(recorder)
                .map_err(|e| KvferryError::new_err(format!("cannot record metrics: {e}")))?;
            handle
        }
        Some(addr) => {
            let addr = parse_addr(addr)?;
            let (tx, rx) = std::sync::mpsc::channel();
            // The exporter's HTTP listener runs on a thread of its own, outside every node.
            std::thread::Builder::new()
                .name("kvferry-metrics".into())
                .spawn(move || {
                    let runtime = match tokio::runtime::Builder::new_current_thread()
                        .enable_all()
                        .build()
                    {
                        Ok(r) => r,
                        Err(e) => return drop(tx.send(Err(e.to_string()))),
                    };
                    let built = {
                        let _inside = runtime.enter();
                        PrometheusBuilder::new().with_http_listener(addr).build()
                    };
                    let (recorder, exporter) = match built {
                        Ok(b) => b,
                        Err(e) => return drop(tx.send(Err(e.to_string()))),
                    };
                    let handle = recorder.handle();
                    if let Err(e) = metrics::set_global_recorder(recorder) {
                        return drop(tx.send(Err(e.to_string())));
                    }
                    let _ = tx.send(Ok(handle));
                    let _ = runtime.block_on(exporter);
                })
                .map_err(|e| KvferryError::new_err(format!("cannot start threads: {e}")))?;
            py.allow_threads(move || rx.recv())
                .map_err(|_| KvferryError::new_err("the metrics thread ended"))?
                .map_err(|e| {
                    ConnectError::new_err(format!("cannot serve metrics on {addr}: {e}"))
                })?
        }
    };
    let _ = METRICS.set(handle);
    Ok(())
}

/// Every node's metrics in Prometheus' text format (after `enable_metrics`).
/// The prompt digest of `tokens` (XXH3-64 of the ids as little-endian u32, see
/// docs/PROTOCOL.md): what `open_sender`, `open_receiver` and `grant_pages` take as `prompt`.
#[pyfunction]
fn prompt_digest(tokens: Vec<i64>) -> PyResult<u64> {
    let ids = tokens
        .iter()
        .map(|&t| u32::try_from(t))
        .collect::<Result<Vec<u32>, _>>()
        .map_err(|_| InvalidArgument::new_err("a token id is outside 0..2**32"))?;
    Ok(PromptDigest::of_tokens(&ids).0)
}

#[pyfunction]
fn metrics_text() -> PyResult<String> {
    let handle = METRICS
        .get()
        .ok_or_else(|| InvalidArgument::new_err("call kvferry.enable_metrics() first"))?;
    handle.run_upkeep();
    Ok(handle.render())
}

/// The native module.
#[pymodule]
fn _kvferry(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    // kvferry's tracing events go to stderr, filtered by KVFERRY_LOG as in the CLI; an
    // embedder that installed a subscriber of its own keeps it.
    let _ = tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("KVFERRY_LOG")
                .unwrap_or_else(|_| "warn,kvferry::start=info".into()),
        )
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .try_init();
    m.add_class::<Node>()?;
    m.add_function(wrap_pyfunction!(enable_metrics, m)?)?;
    m.add_function(wrap_pyfunction!(metrics_text, m)?)?;
    m.add_function(wrap_pyfunction!(prompt_digest, m)?)?;
    for (name, e) in [
        ("KvferryError", py.get_type_bound::<KvferryError>()),
        ("InvalidArgument", py.get_type_bound::<InvalidArgument>()),
        ("UnknownPeer", py.get_type_bound::<UnknownPeer>()),
        (
            "TransportUnavailable",
            py.get_type_bound::<TransportUnavailable>(),
        ),
        ("NodeClosed", py.get_type_bound::<NodeClosed>()),
        (
            "UnsupportedMemory",
            py.get_type_bound::<UnsupportedMemory>(),
        ),
        ("ConnectError", py.get_type_bound::<ConnectError>()),
        ("PeerRefused", py.get_type_bound::<PeerRefused>()),
        ("PeerUnreachable", py.get_type_bound::<PeerUnreachable>()),
        ("HandshakeTimeout", py.get_type_bound::<HandshakeTimeout>()),
        ("RoomFailed", py.get_type_bound::<RoomFailed>()),
        ("TimeoutFailure", py.get_type_bound::<TimeoutFailure>()),
        ("PeerFailure", py.get_type_bound::<PeerFailure>()),
        ("TransferFailure", py.get_type_bound::<TransferFailure>()),
        ("AbortFailure", py.get_type_bound::<AbortFailure>()),
        ("CapacityFailure", py.get_type_bound::<CapacityFailure>()),
        ("ProtocolFailure", py.get_type_bound::<ProtocolFailure>()),
        ("ShutdownFailure", py.get_type_bound::<ShutdownFailure>()),
    ] {
        m.add(name, e)?;
    }
    Ok(())
}
