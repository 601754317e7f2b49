//! `kvferry-glommio`: the thread-per-core driver. One glommio executor (io_uring) per shard,
//! pinned to a core where the machine allows; each shard owns its own `kvferry-core`
//! [`Endpoint`], its own listener and its own sockets, and shares nothing with the others.
//!
//! Routing rule (the same on every driver, see [`kvferry_driver::shard_of`]): room `r` lives
//! on shard `r mod shards`. Each shard is its own logical node towards peers (its node id is
//! derived from the configured one, see [`shard_node`]) and listens on its own address; a peer is named
//! by the list of its shard addresses, and room `r` uses the session to address
//! `r mod len`. Every shard of this node connects to every address of a peer, so both sides
//! agree on where a room lives whatever their shard counts.
//!
//! Like the tokio driver it feeds the core's inputs, drains its outputs in the documented
//! order, arms one timer from `poll_timeout` and carries out operations and fences through
//! `kvferry-tcp`; it never decides a retry, a timeout or a room's state. The sending side of
//! a data connection ([`DataSender`]) and the receiving side ([`ScatterConn`]) are public, so
//! `kvferry bench` measures exactly the path a shard uses. Within a shard there
//! is no lock: the endpoint lives in a `RefCell` owned by the shard's thread. The embedder's
//! calls reach a shard as closures over a channel and come back through a oneshot; dropping a
//! call's future after it was sent loses only the answer (the call still takes effect: a
//! room opened that way can still be aborted by its id), and `RoomHandle` waits are
//! cancel-safe as on tokio.

use std::cell::{Cell, RefCell};
use std::future::Future;
use std::net::SocketAddr;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, IntoRawFd};
use std::rc::{Rc, Weak};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use foldhash::fast::FixedState;
use glommio::channels::local_channel::{self, LocalReceiver, LocalSender};
use glommio::net::{TcpListener, TcpStream};
use glommio::{LocalExecutorBuilder, Placement, Task};
use kvferry_core::{
    Action, ApiError, Chunk, Counters, Endpoint, EndpointInfo, Event, Generation, Grant, KvPoll,
    NodeId, Role, RoomId, SessionId, SessionState, TargetId, TransferId, TransferOp,
    TransferOutcome,
};
use kvferry_driver::{
    connect_failure, export_metrics, round_robin, shard_of, Announcer, CoreCheck, EndpointAccess,
    RoomBook,
};
pub use kvferry_driver::{
    Announcement, DataBackend, FaultPlan, KvNode, Link, NodeConfig, NodeError, PeerId, RoomHandle,
    RoomView,
};
use kvferry_memory::{MemoryMap, WriteCheck};
use kvferry_sync::{Acked, ConnSet, LedgerState, Start};
use kvferry_tcp::stream::{
    answer_data_on, challenge_data_on, hello_control, hello_data, read_ack, read_preamble_on,
    serve_writes_on,
};
use kvferry_tcp::{gather_iovecs, prepare_op, Limits, Preamble};
use tokio::sync::{mpsc, oneshot};
use tracing::{debug, info, warn};

type Map<K, V> = std::collections::HashMap<K, V, FixedState>;

mod scatter;
pub use scatter::ScatterConn;

/// glommio needs at least this much locked memory per executor.
const MEMLOCK_MIN: u64 = 512 * 1024;
/// Receive buffer of a data connection (larger reads go straight to registered memory).
const RECV_BUF: usize = 256 * 1024;
/// The io_uring buffer memory each executor registers (small: the limit is shared).
const IO_MEMORY: usize = 1 << 20;

/// A closure run on a shard's thread with its state.
type Cmd = Box<dyn FnOnce(&Rc<Shard>) + Send>;

/// Everything to start a [`GlommioNode`] beyond the common [`NodeConfig`].
#[derive(Clone, Copy, Debug)]
pub struct ShardConfig {
    /// Number of shards (executors); at least 1.
    pub shards: usize,
    /// Pin shard `i` to CPU `i mod cpus` (falls back to unpinned where not allowed).
    pub pin: bool,
    /// How long an executor keeps polling for work before it parks in the kernel.
    pub spin_before_park: Duration,
}

/// The default [`ShardConfig::spin_before_park`]. Parking and waking through io_uring costs
/// glommio about as much again as the round trip itself: an acked 4 KiB operation took
/// 107-159 us without spinning and 68-71 us with 50 us of it (`kvferry bench`, three paired
/// runs on 2 cores), and a shard spins only in the 50 us after it last had work.
pub const DEFAULT_SPIN_BEFORE_PARK: Duration = Duration::from_micros(50);

impl Default for ShardConfig {
    fn default() -> Self {
        ShardConfig {
            shards: 1,
            pin: true,
            spin_before_park: DEFAULT_SPIN_BEFORE_PARK,
        }
    }
}

/// A running kvferry node on glommio: `shards` executors, each a shard with its own endpoint.
/// Cheap to clone, `Send + Sync`: call it from any thread or runtime. The last clone dropped
/// (or [`KvNode::shutdown`]) stops the shards.
#[derive(Clone)]
pub struct GlommioNode {
    shared: Arc<NodeShared>,
    _last: Arc<StopOnDrop>,
}

impl std::fmt::Debug for GlommioNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GlommioNode")
            .field("role", &self.shared.role)
            .field("shards", &self.shared.shards.len())
            .finish_non_exhaustive()
    }
}

struct NodeShared {
    role: Role,
    shards: Vec<flume::Sender<Cmd>>,
    memory: Arc<MemoryMap>,
    /// How each peer is reached: `[peer][shard][address]`.
    peers: Mutex<Vec<Vec<Vec<Link>>>>,
    announcements: Announcer,
    threads: Mutex<Vec<glommio::ExecutorJoinHandle<()>>>,
    handshake_timeout: Duration,
}

struct StopOnDrop(Arc<NodeShared>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        for tx in &self.0.shards {
            let _ = tx.send(Box::new(|shard: &Rc<Shard>| shard.stop()));
        }
    }
}

/// The node id shard `index` presents to peers: the configured id for shard 0, a hash of it
/// and the index for the others (ids of distinct nodes' shards then collide only by chance,
/// 2^-64, where `id + index` would collide for nodes whose ids are close).
pub fn shard_node(node: NodeId, index: usize) -> NodeId {
    if index == 0 {
        return node;
    }
    let mut z = node.0 ^ (index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    NodeId(z ^ (z >> 31))
}

/// Raises the soft `RLIMIT_MEMLOCK` to the hard limit (allowed without privileges) and checks
/// that every executor can lock what glommio needs.
pub fn ensure_memlock(shards: usize) -> Result<(), NodeError> {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let limit = getrlimit(Resource::Memlock);
    let hard = limit.maximum;
    let raised = Rlimit {
        current: hard,
        maximum: hard,
    };
    if limit.current != hard {
        let _ = setrlimit(Resource::Memlock, raised);
    }
    let now = getrlimit(Resource::Memlock).current;
    let need = (MEMLOCK_MIN.max(IO_MEMORY as u64 + 64 * 1024)) * shards as u64;
    match now {
        None => Ok(()),
        Some(v) if v >= need => Ok(()),
        Some(v) => Err(NodeError::Runtime(format!(
            "RLIMIT_MEMLOCK is {v} bytes after raising the soft limit to the hard one; \
             glommio needs at least {need} bytes for {shards} shard(s): \
             run `ulimit -l unlimited` (or raise memlock in /etc/security/limits.conf) \
             or use fewer shards"
        ))),
    }
}

impl GlommioNode {
    /// Starts `shards.shards` executors over `memory` (registered for `config.info.layout`).
    /// Callable from any thread; does not need a runtime.
    pub fn start(
        config: NodeConfig,
        memory: Arc<MemoryMap>,
        shards: ShardConfig,
    ) -> Result<GlommioNode, NodeError> {
        if config.backend != DataBackend::Tcp {
            return Err(NodeError::Backend(
                "the glommio driver carries data over TCP only; RDMA runs on the tokio driver (--runtime tokio)".to_owned(),
            ));
        }
        if config.tls.is_some() {
            return Err(NodeError::Tls(
                "the glommio driver has no TLS yet; TLS runs on the tokio driver (--runtime tokio)"
                    .to_owned(),
            ));
        }
        let n = shards.shards.max(1);
        ensure_memlock(n)?;
        let cpus = std::thread::available_parallelism().map_or(1, |c| c.get());
        let announcements = Announcer::default();
        let mut senders = Vec::with_capacity(n);
        let mut threads = Vec::with_capacity(n);
        for i in 0..n {
            let (tx, rx) = flume::unbounded::<Cmd>();
            let mut info = config.info.clone();
            info.node = shard_node(config.info.node, i);
            let setup = ShardSetup {
                index: i,
                config: config.clone(),
                info,
                memory: memory.clone(),
                announcements: announcements.clone(),
                rx,
            };
            let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<(), String>>();
            let placement = if shards.pin {
                Placement::Fixed(i % cpus)
            } else {
                Placement::Unbound
            };
            let spawn =
                |placement: Placement, setup: ShardSetup, ready: std::sync::mpsc::Sender<_>| {
                    LocalExecutorBuilder::new(placement)
                        .name(&format!("kvferry-shard-{i}"))
                        .io_memory(IO_MEMORY)
                        .spin_before_park(shards.spin_before_park)
                        .spawn(move || shard_main(setup, ready))
                };
            let handle = match spawn(placement, setup.clone(), ready_tx.clone()) {
                Ok(h) => h,
                Err(e) if shards.pin => {
                    warn!(shard = i, error = %e, "cannot pin the shard; running it unpinned");
                    spawn(Placement::Unbound, setup, ready_tx)
                        .map_err(|e| NodeError::Runtime(format!("shard {i}: {e}")))?
                }
                Err(e) => return Err(NodeError::Runtime(format!("shard {i}: {e}"))),
            };
            match ready_rx.recv_timeout(Duration::from_secs(10)) {
                Ok(Ok(())) => {}
                Ok(Err(e)) => return Err(NodeError::Runtime(format!("shard {i}: {e}"))),
                Err(_) => return Err(NodeError::Runtime(format!("shard {i} did not start"))),
            }
            senders.push(tx);
            threads.push(handle);
        }
        let shared = Arc::new(NodeShared {
            role: config.info.role,
            shards: senders,
            memory,
            peers: Mutex::new(Vec::new()),
            announcements,
            threads: Mutex::new(threads),
            handshake_timeout: config.core.handshake_timeout,
        });
        Ok(GlommioNode {
            _last: Arc::new(StopOnDrop(shared.clone())),
            shared,
        })
    }

    /// Runs `f` on shard `shard` and returns its result.
    fn call<T, F>(&self, shard: usize, f: F) -> impl Future<Output = Result<T, NodeError>> + Send
    where
        T: Send + 'static,
        F: FnOnce(&Rc<Shard>) -> T + Send + 'static,
    {
        let (tx, rx) = oneshot::channel();
        let sent = self.shared.shards[shard]
            .send(Box::new(move |s: &Rc<Shard>| {
                let _ = tx.send(f(s));
            }))
            .is_ok();
        async move {
            if !sent {
                return Err(NodeError::ShutDown);
            }
            rx.await.map_err(|_| NodeError::ShutDown)
        }
    }

    /// Runs `f` on the shard that owns `room`.
    fn on_room<T, F>(&self, room: RoomId, f: F) -> impl Future<Output = Result<T, NodeError>> + Send
    where
        T: Send + 'static,
        F: FnOnce(&Rc<Shard>) -> T + Send + 'static,
    {
        self.call(shard_of(room, self.shared.shards.len()), f)
    }

    /// The core's counters of one shard.
    pub async fn shard_counters(&self, shard: usize) -> Result<Counters, NodeError> {
        self.call(shard, |s| s.state.borrow().endpoint.counters().clone())
            .await
    }

    /// The link to each of `peers` on the shard owning `room` (address `room mod n`).
    fn links_for(&self, room: RoomId, peers: &[PeerId]) -> Result<Vec<(PeerId, Link)>, NodeError> {
        let shard = shard_of(room, self.shared.shards.len());
        let table = self.shared.peers.lock().unwrap_or_else(|p| p.into_inner());
        peers
            .iter()
            .map(|p| {
                let per_shard = table.get(p.0 as usize).ok_or(NodeError::UnknownPeer(*p))?;
                let links = &per_shard[shard];
                Ok((*p, links[shard_of(room, links.len())]))
            })
            .collect()
    }

    fn add_peer(&self, per_shard: Vec<Vec<Link>>) -> PeerId {
        let mut table = self.shared.peers.lock().unwrap_or_else(|p| p.into_inner());
        table.push(per_shard);
        PeerId(table.len() as u32 - 1)
    }
}

fn api(result: Result<Result<(), ApiError>, NodeError>) -> Result<(), NodeError> {
    result?.map_err(NodeError::Api)
}

impl KvNode for GlommioNode {
    fn runtime(&self) -> &'static str {
        "glommio"
    }

    fn memory(&self) -> &Arc<MemoryMap> {
        &self.shared.memory
    }

    fn shards(&self) -> usize {
        self.shared.shards.len()
    }

    async fn listen(&self, addr: SocketAddr) -> Result<Vec<SocketAddr>, NodeError> {
        let mut out = Vec::with_capacity(self.shards());
        for i in 0..self.shards() {
            let mut a = addr;
            if a.port() != 0 {
                a.set_port(addr.port().wrapping_add(i as u16));
            }
            let local = self.call(i, move |s| s.listen(a)).await??;
            out.push(local);
        }
        Ok(out)
    }

    async fn connect(&self, addrs: Vec<SocketAddr>) -> Result<PeerId, NodeError> {
        let timeout = self.shared.handshake_timeout;
        let mut per_shard = Vec::with_capacity(self.shards());
        for i in 0..self.shards() {
            let mut sessions = Vec::with_capacity(addrs.len());
            for &addr in &addrs {
                let (tx, rx) = oneshot::channel();
                self.call(i, move |s| {
                    let s = s.clone();
                    glommio::spawn_local(async move {
                        let _ = tx.send(s.connect(addr, timeout).await);
                    })
                    .detach();
                })
                .await?;
                let sid = rx.await.map_err(|_| NodeError::ShutDown)??;
                sessions.push(Link::Session(sid));
            }
            per_shard.push(sessions);
        }
        Ok(self.add_peer(per_shard))
    }

    async fn connect_persistent(&self, addrs: Vec<SocketAddr>) -> Result<PeerId, NodeError> {
        let mut per_shard = Vec::with_capacity(self.shards());
        for i in 0..self.shards() {
            let addrs = addrs.clone();
            let links = self
                .call(i, move |s| {
                    addrs
                        .into_iter()
                        .map(|a| {
                            let target = {
                                let mut st = s.state.borrow_mut();
                                let t = st.endpoint.add_target(Instant::now());
                                // Known before the drain carries out the core's first connect.
                                st.targets.insert(t, a);
                                t
                            };
                            s.drain();
                            Link::Target(target)
                        })
                        .collect::<Vec<_>>()
                })
                .await?;
            per_shard.push(links);
        }
        Ok(self.add_peer(per_shard))
    }

    async fn open_receiver(
        &self,
        room: RoomId,
        generation: Generation,
        peers: Vec<PeerId>,
        grant: Option<Grant>,
    ) -> Result<RoomHandle, NodeError> {
        let links = self.links_for(room, &peers)?;
        let links: Vec<Link> = links.into_iter().map(|(_, l)| l).collect();
        self.on_room(room, move |s| {
            s.open_room(room, |e, now| {
                e.open_receiver_via(now, room, generation, &links, grant)
            })
            .map_err(NodeError::Api)
        })
        .await?
    }

    async fn grant_pages(&self, room: RoomId, grant: Grant) -> Result<(), NodeError> {
        api(self
            .on_room(room, move |s| {
                s.with(|e, now| e.grant_pages(now, room, grant))
            })
            .await)
    }

    async fn open_sender(
        &self,
        room: RoomId,
        generation: Generation,
    ) -> Result<RoomHandle, NodeError> {
        self.on_room(room, move |s| {
            s.open_room(room, |e, now| e.open_sender(now, room, generation))
        })
        .await?
        .map_err(NodeError::Api)
    }

    async fn send_chunk(&self, room: RoomId, chunk: Chunk) -> Result<(), NodeError> {
        api(self
            .on_room(room, move |s| {
                s.with(|e, now| e.send_chunk(now, room, chunk))
            })
            .await)
    }

    async fn mark_layer_ready(&self, rooms: Vec<RoomId>, layer: u16) -> Result<(), NodeError> {
        let n = self.shards();
        let mut by_shard: Vec<Vec<RoomId>> = vec![Vec::new(); n];
        for r in rooms {
            by_shard[shard_of(r, n)].push(r);
        }
        for (i, rooms) in by_shard.into_iter().enumerate() {
            if rooms.is_empty() {
                continue;
            }
            api(self
                .call(i, move |s| {
                    s.with(|e, now| e.mark_layer_ready(now, &rooms, layer))
                })
                .await)?;
        }
        Ok(())
    }

    async fn set_capacity(&self, capacity: kvferry_core::Capacity) {
        // Each shard advertises its share, so the sum over a peer's sessions is the truth.
        let n = self.shards() as u32;
        for i in 0..self.shards() {
            let extra = u32::from((i as u32) < capacity.free_pages % n);
            let share = kvferry_core::Capacity {
                free_pages: capacity.free_pages / n + extra,
                queued_rooms: capacity.queued_rooms,
            };
            let _ = self
                .call(i, move |s| s.with(|e, _| e.set_capacity(share)))
                .await;
        }
    }

    async fn set_queue_position(&self, room: RoomId, position: u32) -> Result<(), NodeError> {
        api(self
            .on_room(room, move |s| {
                s.with(|e, now| e.set_queue_position(now, room, position))
            })
            .await)
    }

    async fn set_faults(&self, faults: Option<FaultPlan>) {
        for i in 0..self.shards() {
            let _ = self.call(i, move |s| s.faults.set(faults)).await;
        }
    }

    async fn abort(&self, room: RoomId) -> Result<(), NodeError> {
        api(self
            .on_room(room, move |s| s.with(|e, now| e.abort(now, room)))
            .await)
    }

    async fn counters(&self) -> Counters {
        let mut total = Counters::default();
        for i in 0..self.shards() {
            if let Ok(c) = self.shard_counters(i).await {
                total.add(&c);
            }
        }
        total
    }

    fn room_announcements(&self) -> mpsc::UnboundedReceiver<Announcement> {
        self.shared.announcements.subscribe()
    }

    async fn shutdown(&self) {
        for i in 0..self.shards() {
            let (tx, rx) = oneshot::channel();
            let sent = self
                .call(i, move |s| {
                    let s = s.clone();
                    glommio::spawn_local(async move {
                        s.shutdown().await;
                        let _ = tx.send(());
                    })
                    .detach();
                })
                .await;
            if sent.is_ok() {
                let _ = rx.await;
            }
        }
        let threads = std::mem::take(
            &mut *self
                .shared
                .threads
                .lock()
                .unwrap_or_else(|p| p.into_inner()),
        );
        // The executors exit once stopped; joining blocks, so do it off the caller's thread.
        std::thread::spawn(move || {
            for t in threads {
                let _ = t.join();
            }
        });
    }
}

// ------------------------------------------------------------------------------- shards

#[derive(Clone)]
struct ShardSetup {
    index: usize,
    config: NodeConfig,
    info: EndpointInfo,
    memory: Arc<MemoryMap>,
    announcements: Announcer,
    rx: flume::Receiver<Cmd>,
}

/// Why a session ended before its handshake completed (kept to explain `connect` failures).
#[derive(Clone, Debug)]
enum Refusal {
    Peer(String),
    Rejected(kvferry_core::RejectReason),
}

impl Refusal {
    fn into_error(self) -> NodeError {
        match self {
            Refusal::Peer(why) => NodeError::Refused(why),
            Refusal::Rejected(r) => NodeError::Rejected(r),
        }
    }
}

/// One shard: an endpoint and everything around it, owned by one executor thread.
struct Shard {
    index: usize,
    state: RefCell<ShardState>,
    memory: Arc<MemoryMap>,
    info: EndpointInfo,
    limits: Limits,
    data_connections: usize,
    faults: Cell<Option<FaultPlan>>,
    announcements: Announcer,
    wake: LocalSender<()>,
    stopped: Cell<bool>,
    /// Tasks that live as long as the shard (listeners, the timer).
    background: RefCell<Vec<Task<()>>>,
    /// Told when the core reports the shutdown complete.
    shutdown_done: RefCell<Option<LocalSender<()>>>,
}

struct ShardState {
    endpoint: Endpoint,
    io: Map<SessionId, SessionIo>,
    rooms: RoomBook,
    armed: Option<Instant>,
    metrics_at: Instant,
    targets: Map<TargetId, SocketAddr>,
    refusals: Map<SessionId, Refusal>,
}

struct SessionIo {
    control_tx: LocalSender<Vec<u8>>,
    tasks: Vec<Task<()>>,
    /// Set when this side connected: it opens the data connections.
    peer_addr: Option<SocketAddr>,
    data: ConnSet<DataConn>,
    next_sender: usize,
    /// Operations waiting for a data connection (the core's operation timeout bounds them).
    parked: Vec<TransferOp>,
}

/// One data connection of a session.
enum DataConn {
    Sender(DataSender),
    Receiver(Task<()>),
}

impl DataConn {
    async fn close(self) {
        match self {
            DataConn::Sender(s) => s.close().await,
            DataConn::Receiver(t) => {
                let _ = t.cancel().await;
            }
        }
    }
}

/// Where a [`DataSender`] reports each operation's outcome (on the shard's own thread).
pub type LocalReport = Rc<dyn Fn(TransferId, TransferOutcome)>;

/// The sending side of one data connection on a shard: a writer task and an ack reader task
/// over two handles of the same socket, and the connection's ledger in a `RefCell`. Every
/// operation handed to [`DataSender::send`] is reported exactly once.
pub struct DataSender {
    ops: LocalSender<TransferOp>,
    ledger: Rc<RefCell<LedgerState>>,
    writer: Task<()>,
    reader: Task<()>,
    report: LocalReport,
}

impl DataSender {
    /// Starts the writer and ack reader of `stream` (call on a glommio executor); sources are
    /// read from `memory`.
    pub fn spawn(
        stream: TcpStream,
        memory: Arc<MemoryMap>,
        report: LocalReport,
    ) -> std::io::Result<Self> {
        let (read, write) = split(stream)?;
        let (tx, rx) = local_channel::new_unbounded::<TransferOp>();
        let ledger = Rc::new(RefCell::new(LedgerState::default()));
        let writer = glommio::spawn_local(write_loop(
            write,
            rx,
            memory,
            ledger.clone(),
            report.clone(),
        ));
        let reader = glommio::spawn_local(ack_loop(read, ledger.clone(), report.clone()));
        Ok(DataSender {
            ops: tx,
            ledger,
            writer,
            reader,
            report,
        })
    }

    /// Queues an operation; gives it back if the connection is closed.
    pub fn send(&self, op: TransferOp) -> Result<(), TransferOp> {
        if !self.ledger.borrow_mut().enqueue(op.id) {
            return Err(op);
        }
        self.ops.try_send(op).map_err(|e| {
            let op = match e {
                glommio::GlommioError::Closed(glommio::ResourceType::Channel(op))
                | glommio::GlommioError::WouldBlock(glommio::ResourceType::Channel(op)) => op,
                _ => unreachable_op(),
            };
            self.ledger.borrow_mut().unqueue(op.id);
            op
        })
    }

    /// Stops both tasks; every operation not yet reported is reported `Transient`.
    pub async fn close(self) {
        let _ = self.writer.cancel().await;
        let _ = self.reader.cancel().await;
        fail_pending(&self.ledger, &self.report);
    }
}

#[allow(clippy::panic)]
fn unreachable_op() -> TransferOp {
    // try_send only ever gives the item back through Closed or WouldBlock.
    panic!("glommio channel returned an error without the item")
}

async fn shard_main(setup: ShardSetup, ready: std::sync::mpsc::Sender<Result<(), String>>) {
    let now = Instant::now();
    let endpoint = match Endpoint::new(
        setup.config.core.clone(),
        setup.info.clone(),
        setup.config.seed.wrapping_add(setup.index as u64),
        now,
    ) {
        Ok(e) => e,
        Err(e) => {
            let _ = ready.send(Err(e.to_string()));
            return;
        }
    };
    let (wake, wake_rx) = local_channel::new_unbounded::<()>();
    let shard = Rc::new(Shard {
        index: setup.index,
        state: RefCell::new(ShardState {
            endpoint,
            io: Map::default(),
            rooms: RoomBook::new(setup.info.role),
            armed: None,
            metrics_at: now,
            targets: Map::default(),
            refusals: Map::default(),
        }),
        memory: setup.memory,
        limits: Limits {
            max_slices: setup.config.core.max_op_slices,
            max_bytes: setup.config.core.max_op_bytes,
        },
        info: setup.info,
        data_connections: setup.config.data_connections.max(1),
        faults: Cell::new(setup.config.faults),
        announcements: setup.announcements,
        wake,
        stopped: Cell::new(false),
        background: RefCell::new(Vec::new()),
        shutdown_done: RefCell::new(None),
    });
    let timer = glommio::spawn_local(drive(Rc::downgrade(&shard), wake_rx));
    shard.background.borrow_mut().push(timer);
    let _ = ready.send(Ok(()));
    while let Ok(cmd) = setup.rx.recv_async().await {
        cmd(&shard);
        if shard.stopped.get() {
            break;
        }
    }
    shard.stop();
    let tasks = std::mem::take(&mut *shard.background.borrow_mut());
    for t in tasks {
        let _ = t.cancel().await;
    }
    let io: Vec<SessionIo> = {
        let mut st = shard.state.borrow_mut();
        st.io.drain().map(|(_, io)| io).collect()
    };
    for mut io in io {
        for c in io.data.close().unwrap_or_default() {
            c.close().await;
        }
        for t in io.tasks.drain(..) {
            let _ = t.cancel().await;
        }
    }
}

/// The shard's timer task: arms one timer from the core's deadline and feeds it back.
async fn drive(weak: Weak<Shard>, wake: LocalReceiver<()>) {
    loop {
        let Some(shard) = weak.upgrade() else { return };
        if shard.stopped.get() {
            return;
        }
        let deadline = {
            let now = Instant::now();
            let due = shard
                .state
                .borrow()
                .endpoint
                .poll_timeout()
                .is_some_and(|(t, _)| t <= now);
            if due {
                shard.with_endpoint(|e, now| e.handle_timeout(now));
            }
            let mut st = shard.state.borrow_mut();
            if now.duration_since(st.metrics_at) >= Duration::from_millis(500) {
                st.metrics_at = now;
                export_metrics(&st.endpoint, shard.info.role);
            }
            let next = st.endpoint.poll_timeout().map(|(t, _)| t);
            st.armed = next;
            next
        };
        drop(shard);
        let sleep = async {
            match deadline {
                Some(t) => glommio::timer::sleep(t.saturating_duration_since(Instant::now())).await,
                None => glommio::timer::sleep(Duration::from_secs(3600)).await,
            }
            true
        };
        let woken = async { wake.recv().await.is_some() };
        if !futures_lite::future::or(sleep, woken).await {
            return;
        }
    }
}

impl Shard {
    fn stop(&self) {
        self.stopped.set(true);
        let _ = self.wake.try_send(());
    }

    /// Runs `f` on the endpoint, then drains (the core's rule after every input).
    fn with_endpoint<T>(self: &Rc<Self>, f: impl FnOnce(&mut Endpoint, Instant) -> T) -> T {
        let out = {
            let mut st = self.state.borrow_mut();
            f(&mut st.endpoint, Instant::now())
        };
        self.drain();
        out
    }

    fn with<T>(self: &Rc<Self>, f: impl FnOnce(&mut Endpoint, Instant) -> T) -> T {
        self.with_endpoint(f)
    }

    fn open_room(
        self: &Rc<Self>,
        room: RoomId,
        f: impl FnOnce(&mut Endpoint, Instant) -> Result<(), ApiError>,
    ) -> Result<RoomHandle, ApiError> {
        let handle = {
            let mut st = self.state.borrow_mut();
            let current = st
                .endpoint
                .room_state(room)
                .unwrap_or(KvPoll::Bootstrapping);
            st.rooms.watch(room, current)
        };
        let result = self.with_endpoint(f);
        match result {
            Ok(()) => Ok(handle),
            Err(e) => {
                let mut st = self.state.borrow_mut();
                if st.endpoint.room_generation(room).is_none() {
                    st.rooms.forget(room);
                }
                Err(e)
            }
        }
    }

    /// A data connection's report: each outcome goes to this shard's core while it lives.
    fn report(self: &Rc<Self>) -> LocalReport {
        let shard = Rc::downgrade(self);
        Rc::new(move |id, outcome| {
            if let Some(shard) = shard.upgrade() {
                shard.transfer_result(id, outcome);
            }
        })
    }

    fn transfer_result(self: &Rc<Self>, id: TransferId, outcome: TransferOutcome) {
        self.with_endpoint(|e, now| e.handle_transfer_result(now, id, outcome));
    }

    /// Drains every output of the core, in the documented order, after an input.
    fn drain(self: &Rc<Self>) {
        loop {
            let mut progressed = false;
            let mut buf = Vec::new();
            loop {
                let sid = self.state.borrow_mut().endpoint.poll_transmit(&mut buf);
                let Some(sid) = sid else { break };
                progressed = true;
                let st = self.state.borrow();
                if let Some(io) = st.io.get(&sid) {
                    let _ = io.control_tx.try_send(std::mem::take(&mut buf));
                } else {
                    tracing::trace!(shard = self.index, session = %sid, len = buf.len(), "transmit for a session without io dropped");
                    buf.clear();
                }
            }
            loop {
                let action = self.state.borrow_mut().endpoint.poll_action();
                let Some(action) = action else { break };
                progressed = true;
                match action {
                    Action::FenceSession(sid) => self.start_fence(sid),
                    Action::CloseSession(sid) => self.start_close(sid),
                    Action::Connect { target, timeout } => self.start_connect(target, timeout),
                    Action::OpenDataConnection(sid) => self.open_data_connections(sid, 1),
                }
            }
            loop {
                let now = Instant::now();
                let op = self.state.borrow_mut().endpoint.poll_transfer(now);
                let Some(op) = op else { break };
                progressed = true;
                let id = op.id;
                let mut st = self.state.borrow_mut();
                let rejected = match st.io.get_mut(&op.session) {
                    Some(io) if !io.data.is_closing() => match dispatch(io, op) {
                        Ok(()) => false,
                        Err(op) => {
                            // No data connection yet (or all broke): wait for one.
                            io.parked.push(op);
                            false
                        }
                    },
                    _ => true,
                };
                if rejected {
                    st.endpoint
                        .handle_transfer_result(now, id, TransferOutcome::Transient);
                }
            }
            loop {
                let event = self.state.borrow_mut().endpoint.poll_event();
                let Some(event) = event else { break };
                progressed = true;
                self.on_event(&event);
            }
            if !progressed {
                break;
            }
        }
        let st = self.state.borrow();
        let next = st.endpoint.poll_timeout().map(|(t, _)| t);
        if st.armed.is_none() || next < st.armed {
            let _ = self.wake.try_send(());
        }
    }

    fn on_event(self: &Rc<Self>, event: &Event) {
        match *event {
            ref e if RoomBook::follows(e) => {
                self.state.borrow_mut().rooms.on_event(event);
            }
            Event::ShutDown { .. } => {
                if let Some(tx) = self.shutdown_done.borrow_mut().take() {
                    let _ = tx.try_send(());
                }
            }
            Event::SessionEstablished { session, peer } => {
                info!(shard = self.index, %session, node = %peer.node, "session established");
                self.open_data_connections(session, self.data_connections);
            }
            Event::RoomAnnounced { .. } => self.announcements.on_event(event),
            Event::PeerError {
                session,
                code,
                ref detail,
            } => {
                self.state
                    .borrow_mut()
                    .refusals
                    .entry(session)
                    .or_insert_with(|| Refusal::Peer(format!("{code:?}: {detail}")));
            }
            Event::SessionRejected { session, reason } => {
                self.state
                    .borrow_mut()
                    .refusals
                    .insert(session, Refusal::Rejected(reason));
            }
            Event::SessionBlacklisted { session } => {
                warn!(shard = self.index, %session, "session blacklisted")
            }
            Event::SessionRecovered { session } => {
                info!(shard = self.index, %session, "session recovered")
            }
            _ => {}
        }
    }

    fn listen(self: &Rc<Self>, addr: SocketAddr) -> Result<SocketAddr, NodeError> {
        // glommio's own bind sets SO_REUSEPORT, which would let a second node silently share
        // (and steal connections from) an address in use; bind plainly and hand it over.
        let plain = std::net::TcpListener::bind(addr)?;
        plain.set_nonblocking(true)?;
        // SAFETY: `plain` is a fresh listening socket whose ownership moves to glommio.
        let listener = unsafe { TcpListener::from_raw_fd(plain.into_raw_fd()) };
        let local = listener.local_addr().map_err(std::io::Error::from)?;
        let weak = Rc::downgrade(self);
        let task = glommio::spawn_local(async move {
            loop {
                match listener.accept().await {
                    Ok(stream) => {
                        let Some(shard) = weak.upgrade() else { return };
                        if shard.stopped.get() {
                            return;
                        }
                        glommio::spawn_local(accept(Rc::downgrade(&shard), stream)).detach();
                    }
                    Err(e) => {
                        warn!(error = %e, "accept failed; backing off");
                        glommio::timer::sleep(Duration::from_millis(50)).await;
                    }
                }
            }
        });
        self.background.borrow_mut().push(task);
        Ok(local)
    }

    /// Opens a session to `addr` and waits (at most `timeout`) for its handshake.
    async fn connect(
        self: Rc<Self>,
        addr: SocketAddr,
        timeout: Duration,
    ) -> Result<SessionId, NodeError> {
        let mut stream = TcpStream::connect(addr)
            .await
            .map_err(std::io::Error::from)?;
        let _ = stream.set_nodelay(true);
        hello_control(&mut stream).await?;
        let sid = self.attach_control(stream, Some(addr), None);
        let deadline = Instant::now() + timeout;
        loop {
            let (state, refusal) = {
                let st = self.state.borrow();
                (
                    st.endpoint.session_state(sid),
                    st.refusals.get(&sid).cloned(),
                )
            };
            match state {
                Some(SessionState::Established | SessionState::Blacklisted) => return Ok(sid),
                None | Some(SessionState::Closing) => {
                    return Err(refusal.map_or(NodeError::HandshakeTimeout, Refusal::into_error))
                }
                Some(SessionState::Handshaking) => {}
            }
            if Instant::now() >= deadline {
                return Err(NodeError::HandshakeTimeout);
            }
            glommio::timer::sleep(Duration::from_millis(1)).await;
        }
    }

    /// Registers a control connection with the core and starts its reader and writer.
    fn attach_control(
        self: &Rc<Self>,
        stream: TcpStream,
        peer_addr: Option<SocketAddr>,
        target: Option<TargetId>,
    ) -> SessionId {
        let (read, write) = match split(stream) {
            Ok(halves) => halves,
            Err(e) => {
                warn!(error = %e, "cannot split a control connection");
                // A session that closes at once: the core learns it like any other loss.
                let sid = self.with_endpoint(|e, now| e.open_session(now));
                self.with_endpoint(|e, now| e.handle_disconnected(now, sid));
                return sid;
            }
        };
        let (tx, rx) = local_channel::new_unbounded::<Vec<u8>>();
        let sid = {
            let mut st = self.state.borrow_mut();
            let now = Instant::now();
            let sid = match (target, peer_addr) {
                (Some(t), _) => st.endpoint.open_session_for(now, t),
                (None, Some(_)) => st.endpoint.open_session(now),
                (None, None) => st.endpoint.accept_session(now),
            };
            // The session's io exists before any task of it can run (and drain).
            st.io.insert(
                sid,
                SessionIo {
                    control_tx: tx,
                    tasks: Vec::new(),
                    peer_addr,
                    data: ConnSet::default(),
                    next_sender: 0,
                    parked: Vec::new(),
                },
            );
            sid
        };
        let writer = glommio::spawn_local(async move {
            use futures_lite::AsyncWriteExt;
            let mut write = write;
            while let Some(frame) = rx.recv().await {
                tracing::trace!(session = %sid, len = frame.len(), first = frame.get(4).copied(), "control frame out");
                if write.write_all(&frame).await.is_err() {
                    break;
                }
            }
        });
        let weak = Rc::downgrade(self);
        let reader = glommio::spawn_local(async move {
            use futures_lite::AsyncReadExt;
            let mut read = read;
            let mut buf: Vec<u8> = Vec::with_capacity(64 * 1024);
            let mut chunk = vec![0u8; 64 * 1024];
            loop {
                let n = match read.read(&mut chunk).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => n,
                };
                let Some(shard) = weak.upgrade() else { return };
                tracing::trace!(session = %sid, n, first = chunk.get(4).copied(), "control bytes in");
                buf.extend_from_slice(&chunk[..n]);
                let used = shard.with_endpoint(|e, now| e.handle_input(now, sid, &buf));
                buf.drain(..used.min(buf.len()));
            }
            if let Some(shard) = weak.upgrade() {
                debug!(session = %sid, "control connection ended");
                shard.start_close(sid);
            }
        });
        if let Some(io) = self.state.borrow_mut().io.get_mut(&sid) {
            io.tasks.push(writer);
            io.tasks.push(reader);
        }
        self.drain();
        sid
    }

    /// Puts an accepted or opened data connection to work for `sid`, by role.
    fn attach_data(self: &Rc<Self>, sid: SessionId, stream: TcpStream) {
        if self
            .state
            .borrow()
            .io
            .get(&sid)
            .map_or(true, |io| io.data.is_closing())
        {
            return; // dropping the stream closes it
        }
        let conn = match self.info.role {
            Role::Prefill => match DataSender::spawn(stream, self.memory.clone(), self.report()) {
                Ok(s) => DataConn::Sender(s),
                Err(e) => {
                    warn!(session = %sid, error = %e, "cannot split a data connection");
                    return;
                }
            },
            Role::Decode => {
                let weak = Rc::downgrade(self);
                let check: Rc<dyn WriteCheck> = Rc::new(CoreCheck {
                    access: ShardAccess(Rc::downgrade(self)),
                    session: sid,
                });
                let memory = self.memory.clone();
                let limits = self.limits;
                DataConn::Receiver(glommio::spawn_local(async move {
                    // One receive usually brings header, table and a small payload at once.
                    let mut stream =
                        ScatterConn(futures_lite::io::BufReader::with_capacity(RECV_BUF, stream));
                    match serve_writes_on(&mut stream, &memory, check, limits).await {
                        Ok(stats) => debug!(
                            applied = stats.applied,
                            refused = stats.refused,
                            "data connection ended"
                        ),
                        Err(e) => debug!(error = %e, "data connection ended"),
                    }
                    drop(stream);
                    // A fence cancels this task before it gets here: this end was a break, and
                    // the core decides whether and when it is replaced.
                    if let Some(shard) = weak.upgrade() {
                        shard.with_endpoint(|e, now| e.handle_data_connection_lost(now, sid));
                    }
                }))
            }
        };
        {
            let mut st = self.state.borrow_mut();
            let Some(io) = st.io.get_mut(&sid) else {
                return;
            };
            // Cannot be refused: checked above, and nothing ran in between.
            let _ = io.data.attach(conn);
        }
        let parked = {
            let mut st = self.state.borrow_mut();
            st.io
                .get_mut(&sid)
                .map(|io| std::mem::take(&mut io.parked))
                .unwrap_or_default()
        };
        {
            let mut st = self.state.borrow_mut();
            if let Some(io) = st.io.get_mut(&sid) {
                for op in parked {
                    if let Err(op) = dispatch(io, op) {
                        io.parked.push(op);
                    }
                }
            }
        }
        self.drain();
    }

    /// Opens `n` data connections of `sid` if this side dialed it (it knows the peer's
    /// address) and its handshake gave it a key; each proves the key.
    fn open_data_connections(self: &Rc<Self>, sid: SessionId, n: usize) {
        let (addr, key) = {
            let st = self.state.borrow();
            let addr = st
                .io
                .get(&sid)
                .filter(|io| !io.data.is_closing())
                .and_then(|io| io.peer_addr);
            (addr, st.endpoint.data_key(sid))
        };
        let (Some(addr), Some(key)) = (addr, key) else {
            return;
        };
        for _ in 0..n {
            let weak = Rc::downgrade(self);
            let key = key.clone();
            glommio::spawn_local(async move {
                let opened = async {
                    let mut stream = TcpStream::connect(addr).await?;
                    let _ = stream.set_nodelay(true);
                    hello_data(&mut stream, &key).await?;
                    Ok::<_, std::io::Error>(stream)
                }
                .await;
                match opened {
                    Ok(stream) => {
                        if let Some(shard) = weak.upgrade() {
                            shard.attach_data(sid, stream);
                        }
                    }
                    Err(e) => warn!(session = %sid, error = %e, "data connection failed"),
                }
            })
            .detach();
        }
    }

    /// Carries out a connect the core asked for; a failure is reported back to it.
    fn start_connect(self: &Rc<Self>, target: TargetId, timeout: Duration) {
        let Some(addr) = self.state.borrow().targets.get(&target).copied() else {
            return;
        };
        let weak = Rc::downgrade(self);
        glommio::spawn_local(async move {
            let opened = async {
                let mut stream = TcpStream::connect(addr).await?;
                let _ = stream.set_nodelay(true);
                hello_control(&mut stream).await?;
                Ok::<_, std::io::Error>(stream)
            };
            let timeout = async {
                glommio::timer::sleep(timeout).await;
                Err(std::io::Error::from(std::io::ErrorKind::TimedOut))
            };
            let result = futures_lite::future::or(opened, timeout).await;
            let Some(shard) = weak.upgrade() else { return };
            match result {
                Ok(stream) => {
                    shard.attach_control(stream, Some(addr), Some(target));
                }
                Err(err) => {
                    debug!(%target, %addr, error = %err, "connect failed");
                    let failure = connect_failure(&err);
                    shard.with_endpoint(|e, now| e.handle_connect_failed(now, target, failure));
                }
            }
        })
        .detach();
    }

    /// Reports every parked operation of a session as transient (it was never written).
    fn unpark(self: &Rc<Self>, sid: SessionId) {
        let parked = {
            let mut st = self.state.borrow_mut();
            st.io
                .get_mut(&sid)
                .map(|io| std::mem::take(&mut io.parked))
                .unwrap_or_default()
        };
        let now = Instant::now();
        let mut st = self.state.borrow_mut();
        for op in parked {
            st.endpoint
                .handle_transfer_result(now, op.id, TransferOutcome::Transient);
        }
    }

    /// Carries out a fence: close the session's data connections, wait until nothing of them
    /// can write, confirm to the core, then re-open them if this side opens them.
    fn start_fence(self: &Rc<Self>, sid: SessionId) {
        self.unpark(sid);
        let taken = {
            let mut st = self.state.borrow_mut();
            st.io.get_mut(&sid).map(|io| io.data.fence())
        };
        let Some(conns) = taken else {
            self.state
                .borrow_mut()
                .endpoint
                .handle_fence_complete(Instant::now(), sid);
            return;
        };
        let weak = Rc::downgrade(self);
        glommio::spawn_local(async move {
            for c in conns {
                c.close().await;
            }
            let Some(shard) = weak.upgrade() else { return };
            shard.with_endpoint(|e, now| e.handle_fence_complete(now, sid));
            info!(shard = shard.index, session = %sid, "session fenced");
            shard.open_data_connections(sid, shard.data_connections);
        })
        .detach();
    }

    /// Carries out a close: stop every connection of the session, then tell the core.
    fn start_close(self: &Rc<Self>, sid: SessionId) {
        self.unpark(sid);
        let taken = {
            let mut st = self.state.borrow_mut();
            st.io.get_mut(&sid).and_then(|io| {
                let conns = io.data.close()?;
                Some((conns, std::mem::take(&mut io.tasks)))
            })
        };
        let Some((conns, tasks)) = taken else {
            return;
        };
        let weak = Rc::downgrade(self);
        glommio::spawn_local(async move {
            // Let the writer flush a final error frame before the socket goes.
            glommio::timer::sleep(Duration::from_millis(10)).await;
            for c in conns {
                c.close().await;
            }
            for t in tasks {
                let _ = t.cancel().await;
            }
            let Some(shard) = weak.upgrade() else { return };
            shard.state.borrow_mut().io.remove(&sid);
            shard.with_endpoint(|e, now| e.handle_disconnected(now, sid));
        })
        .detach();
    }

    /// Fails every room, tells every peer, and waits until the core says the shutdown is
    /// complete (every session closed, or its shutdown timeout).
    async fn shutdown(self: Rc<Self>) {
        let (tx, rx) = local_channel::new_bounded::<()>(1);
        *self.shutdown_done.borrow_mut() = Some(tx);
        self.with_endpoint(|e, now| e.shutdown(now));
        if !self.state.borrow().endpoint.shutdown_complete() {
            let _ = rx.recv().await;
        }
        self.stop();
    }
}

/// Hands an operation to the next open data connection of the session, round-robin.
fn dispatch(io: &mut SessionIo, op: TransferOp) -> Result<(), TransferOp> {
    let senders: Vec<&DataSender> = io
        .data
        .iter()
        .filter_map(|c| match c {
            DataConn::Sender(s) => Some(s),
            DataConn::Receiver(_) => None,
        })
        .collect();
    round_robin(&senders, &mut io.next_sender, op, |s, op| s.send(op))
}

/// Two handles on one socket (reads on one task, writes on another, no lock between them).
fn split(stream: TcpStream) -> std::io::Result<(TcpStream, TcpStream)> {
    // SAFETY: the descriptor is open for as long as `stream` lives, which spans this call.
    let borrowed = unsafe { BorrowedFd::borrow_raw(stream.as_raw_fd()) };
    let dup = borrowed.try_clone_to_owned()?;
    // SAFETY: `dup` is a fresh descriptor this function owns (a dup of a connected TCP
    // socket); ownership passes to the new TcpStream, which closes it.
    let other = unsafe { TcpStream::from_raw_fd(dup.into_raw_fd()) };
    Ok((stream, other))
}

fn fail_pending(ledger: &RefCell<LedgerState>, report: &LocalReport) {
    let failed = ledger.borrow_mut().close();
    for id in failed {
        report(id, TransferOutcome::Transient);
    }
}

async fn write_loop(
    mut write: TcpStream,
    rx: LocalReceiver<TransferOp>,
    memory: Arc<MemoryMap>,
    ledger: Rc<RefCell<LedgerState>>,
    report: LocalReport,
) {
    let mut header = Vec::with_capacity(4096);
    while let Some(op) = rx.recv().await {
        let (sources, bad) = prepare_op(&op, &memory, &mut header);
        let start = ledger.borrow_mut().start(op.id, bad);
        match start {
            Start::Gone => continue,
            Start::Closed => {
                report(op.id, Start::unsent(bad));
                continue;
            }
            Start::Write => {}
        }
        if let Err(e) = write_gather(&mut write, &header, &sources).await {
            debug!(error = %e, "data connection write failed");
            break;
        }
    }
    fail_pending(&ledger, &report);
}

/// Writes `header` then every source range straight from registered memory with as few
/// `sendmsg` calls as the kernel allows (glommio's sockets have no vectored write, and
/// staging through a buffer costs a copy of every byte). When the socket is full, glommio's
/// own write of the next contiguous piece waits for room.
async fn write_gather(
    stream: &mut TcpStream,
    header: &[u8],
    sources: &[(usize, usize)],
) -> std::io::Result<()> {
    use futures_lite::AsyncWriteExt;
    use rustix::net::{sendmsg, SendAncillaryBuffer, SendFlags};
    let total = header.len() + sources.iter().map(|s| s.1).sum::<usize>();
    let mut done = 0usize;
    while done < total {
        let iov = gather_iovecs(header, sources, done);
        let sent = {
            // SAFETY: the descriptor stays open for as long as `stream`, which outlives the call.
            let fd = unsafe { BorrowedFd::borrow_raw(stream.as_raw_fd()) };
            sendmsg(
                fd,
                &iov,
                &mut SendAncillaryBuffer::default(),
                SendFlags::DONTWAIT | SendFlags::NOSIGNAL,
            )
        };
        match sent {
            Ok(0) => return Err(std::io::ErrorKind::WriteZero.into()),
            Ok(n) => done += n,
            Err(rustix::io::Errno::INTR) => {}
            Err(rustix::io::Errno::AGAIN) => {
                let piece = &iov[0][..iov[0].len().min(64 * 1024)];
                stream.write_all(piece).await?;
                done += piece.len();
            }
            Err(e) => return Err(e.into()),
        }
    }
    Ok(())
}

async fn ack_loop(read: TcpStream, ledger: Rc<RefCell<LedgerState>>, report: LocalReport) {
    // Pipelined operations' acknowledgements arrive together: read them in one go.
    let mut read = futures_lite::io::BufReader::with_capacity(4096, read);
    loop {
        let (id, status) = match read_ack(&mut read).await {
            Ok(ack) => ack,
            Err(e) => {
                debug!(error = %e, "data connection closed");
                break;
            }
        };
        let acked = ledger.borrow_mut().acked(id);
        if let Acked::OutOfOrder(expected) = acked {
            warn!(got = %id, ?expected, "acknowledgement out of order, closing the data connection");
            if let Some(e) = expected {
                report(e, TransferOutcome::Transient);
            }
            break;
        }
        let outcome = match status {
            kvferry_tcp::AckStatus::Applied => TransferOutcome::Done,
            kvferry_tcp::AckStatus::Refused => TransferOutcome::Refused,
        };
        report(id, outcome);
    }
    fail_pending(&ledger, &report);
}

/// Reads an accepted connection's preamble and hands it to the shard.
async fn accept(weak: Weak<Shard>, mut stream: TcpStream) {
    let _ = stream.set_nodelay(true);
    // A connection that says nothing gets as long as a handshake, then is dropped.
    let Some(wait) = weak
        .upgrade()
        .map(|s| s.state.borrow().endpoint.config().handshake_timeout)
    else {
        return;
    };
    let preamble = {
        let read = read_preamble_on(&mut stream);
        let timeout = async {
            glommio::timer::sleep(wait).await;
            Err(kvferry_tcp::ServeError::Io(
                std::io::ErrorKind::TimedOut.into(),
            ))
        };
        match futures_lite::future::or(read, timeout).await {
            Ok(p) => p,
            Err(e) => {
                warn!(error = %e, "refused a connection");
                return;
            }
        }
    };
    let Some(shard) = weak.upgrade() else { return };
    match preamble {
        Preamble::Control => {
            shard.attach_control(stream, None, None);
        }
        Preamble::Data => {
            // The core's challenge; the answer names the session and proves its key.
            let (challenge, wait) = {
                let mut st = shard.state.borrow_mut();
                let wait = st.endpoint.config().handshake_timeout;
                (st.endpoint.data_challenge(), wait)
            };
            let read = async { challenge_data_on(&mut stream, &challenge).await.map(Some) };
            let timeout = async {
                glommio::timer::sleep(wait).await;
                Ok(None)
            };
            let hello = match futures_lite::future::or(read, timeout).await {
                Ok(Some(hello)) => hello,
                Ok(None) => {
                    warn!("no data hello in time; connection dropped");
                    return;
                }
                Err(e) => {
                    debug!(error = %e, "data connection ended before its hello");
                    return;
                }
            };
            let admitted =
                shard
                    .state
                    .borrow()
                    .endpoint
                    .admit_data(&challenge, &hello.tag, &hello.proof);
            match admitted {
                Ok(sid) => {
                    if answer_data_on(&mut stream, true).await.is_ok() {
                        shard.attach_data(sid, stream);
                    }
                }
                Err(refusal) => {
                    warn!(%refusal, "data connection refused");
                    let _ = answer_data_on(&mut stream, false).await;
                }
            }
        }
    }
}

/// The receive path's way to this shard's endpoint: its cell, then a drain.
struct ShardAccess(Weak<Shard>);

impl EndpointAccess for ShardAccess {
    fn run<T>(
        &self,
        f: impl FnOnce(&mut Endpoint, Instant) -> T,
        after: impl FnOnce(&T) -> bool,
    ) -> Option<T> {
        let shard = self.0.upgrade()?;
        let out = f(&mut shard.state.borrow_mut().endpoint, Instant::now());
        if after(&out) {
            shard.drain();
        }
        Some(out)
    }

    fn faults(&self) -> Option<FaultPlan> {
        self.0.upgrade().and_then(|s| s.faults.get())
    }
}
