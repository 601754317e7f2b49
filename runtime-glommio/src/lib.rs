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
//! `kvferry-tcp`, whose data plane (the same as tokio's) it runs on glommio's sockets; it
//! never decides a retry, a timeout or a room's state. Within a shard there
//! is no lock: the endpoint lives in a `RefCell` owned by the shard's thread. The embedder's
//! calls reach a shard as closures over a channel and come back through a oneshot; dropping a
//! call's future after it was sent loses only the answer (the call still takes effect: a
//! room opened that way can still be aborted by its id), and `RoomHandle` waits are
//! cancel-safe as on tokio.

use std::cell::{Cell, RefCell};
use std::future::Future;
use std::net::SocketAddr;
use std::os::fd::{FromRawFd, IntoRawFd};
use std::rc::{Rc, Weak};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use glommio::channels::local_channel::{self, LocalSender};
use glommio::net::{TcpListener, TcpStream};
use glommio::{LocalExecutorBuilder, Placement, Task};
use kvferry_core::{
    Counters, Endpoint, EndpointInfo, NodeId, Role, SessionId, SessionKey, TargetId,
};
use kvferry_driver::{
    runtime, Announcer, Answer, ControlQueue, ControlTasks, CoreCheck, DataConn, Dial, Driver,
    DriverAccess, Embedder, Host, Release, Runtime, RuntimeNode, ShardCalls,
};
pub use kvferry_driver::{
    Announcement, DataBackend, FaultPlan, KvNode, Link, NodeConfig, NodeError, PeerId, RoomHandle,
    RoomView,
};
use kvferry_memory::{MemoryMap, WriteCheck};
use kvferry_tcp::fd::second_handle;
use kvferry_tcp::glommio::{serve_local, LocalDataSender as DataSender, LocalReport};
use kvferry_tcp::stream::{hello_control, hello_data};
use kvferry_tcp::Limits;
use tokio::sync::{mpsc, oneshot};
use tracing::warn;

/// glommio needs at least this much locked memory per executor.
const MEMLOCK_MIN: u64 = 512 * 1024;
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
            .field("shards", &self.shared.rooms.calls().0.len())
            .finish_non_exhaustive()
    }
}

struct NodeShared {
    role: Role,
    /// The room calls over every shard, and how each peer is reached.
    rooms: Embedder<Shards>,
    memory: Arc<MemoryMap>,
    announcements: Announcer,
    threads: Mutex<Vec<glommio::ExecutorJoinHandle<()>>>,
}

struct StopOnDrop(Arc<NodeShared>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        for tx in &self.0.rooms.calls().0 {
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
            rooms: Embedder::new(Shards(senders)),
            memory,
            announcements,
            threads: Mutex::new(threads),
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
        self.shared.rooms.calls().run(shard, f)
    }

    /// The core's counters of one shard.
    pub async fn shard_counters(&self, shard: usize) -> Result<Counters, NodeError> {
        self.shared.rooms.shard_counters(shard).await
    }
}

/// The node's way into its shards: one command channel to each shard's thread.
pub struct Shards(Vec<flume::Sender<Cmd>>);

impl Shards {
    /// Runs `f` on shard `shard` (on its thread) and returns its result.
    fn run<T, F>(&self, shard: usize, f: F) -> impl Future<Output = Result<T, NodeError>> + Send
    where
        T: Send + 'static,
        F: FnOnce(&Rc<Shard>) -> T + Send + 'static,
    {
        let (tx, rx) = oneshot::channel();
        let sent = self.0.get(shard).is_some_and(|s| {
            s.send(Box::new(move |s: &Rc<Shard>| {
                let _ = tx.send(f(s));
            }))
            .is_ok()
        });
        async move {
            if !sent {
                return Err(NodeError::ShutDown);
            }
            rx.await.map_err(|_| NodeError::ShutDown)
        }
    }
}

impl ShardCalls for Shards {
    type Host = ShardHost;

    fn shards(&self) -> usize {
        self.0.len()
    }

    fn call<T, F>(&self, shard: usize, f: F) -> impl Future<Output = Result<T, NodeError>> + Send
    where
        T: Send + 'static,
        F: FnOnce(&mut Driver<ShardHost>) -> T + Send + 'static,
    {
        self.run(shard, move |s| s.drive(f))
    }
}

/// The embedder API ([`KvNode`]) of a glommio node: calls go to the shard owning the room.
impl RuntimeNode for GlommioNode {
    type Calls = Shards;

    fn embedder(&self) -> &Embedder<Shards> {
        &self.shared.rooms
    }

    fn runtime(&self) -> &'static str {
        "glommio"
    }

    fn memory(&self) -> &Arc<MemoryMap> {
        &self.shared.memory
    }

    async fn listen(&self, addr: SocketAddr) -> Result<Vec<SocketAddr>, NodeError> {
        let mut out = Vec::with_capacity(self.shared.rooms.calls().shards());
        for i in 0..self.shared.rooms.calls().shards() {
            let mut a = addr;
            if a.port() != 0 {
                a.set_port(addr.port().wrapping_add(i as u16));
            }
            let local = self.call(i, move |s| s.listen(a)).await??;
            out.push(local);
        }
        Ok(out)
    }

    fn room_announcements(&self) -> mpsc::UnboundedReceiver<Announcement> {
        self.shared.announcements.subscribe()
    }

    async fn shutdown(&self) {
        for i in 0..self.shared.rooms.calls().shards() {
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

/// One shard: an endpoint and the driver loop around it, owned by one executor thread.
struct Shard {
    driver: RefCell<Driver<ShardHost>>,
    memory: Arc<MemoryMap>,
    info: EndpointInfo,
    limits: Limits,
    wake: LocalSender<()>,
    stopped: Cell<bool>,
    /// Tasks that live as long as the shard (listeners, the timer).
    background: RefCell<Vec<Task<()>>>,
    /// The listeners' tasks.
    listeners: RefCell<Vec<Task<()>>>,
    /// Tasks the driver asked for, started once it is no longer borrowed.
    spawns: RefCell<Vec<std::pin::Pin<Box<dyn Future<Output = ()>>>>>,
}

/// A shard's side of the driver loop: starts tasks on the shard's executor that report back
/// to the driver in [`Shard::driver`].
#[derive(Clone)]
pub struct ShardHost {
    shard: Weak<Shard>,
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
    let shard = Rc::new_cyclic(|weak| Shard {
        driver: RefCell::new(Driver::new(
            endpoint,
            ShardHost {
                shard: weak.clone(),
            },
            setup.config.data_connections,
            setup.announcements,
            now,
        )),
        memory: setup.memory,
        limits: Limits {
            max_slices: setup.config.core.max_op_slices,
            max_bytes: setup.config.core.max_op_bytes,
        },
        info: setup.info,
        wake,
        stopped: Cell::new(false),
        background: RefCell::new(Vec::new()),
        listeners: RefCell::new(Vec::new()),
        spawns: RefCell::new(Vec::new()),
    });
    shard.drive(|d| d.set_faults(setup.config.faults));
    let weak = Rc::downgrade(&shard);
    let host = shard.host();
    let timer = glommio::spawn_local(async move {
        let wake = &wake_rx;
        let woken = || async {
            wake.recv().await.is_some() && weak.upgrade().is_some_and(|s| !s.stopped.get())
        };
        runtime::run_driver(host, woken).await;
    });
    shard.background.borrow_mut().push(timer);
    let _ = ready.send(Ok(()));
    while let Ok(cmd) = setup.rx.recv_async().await {
        cmd(&shard);
        if shard.stopped.get() {
            break;
        }
    }
    shard.stop();
    let mut tasks = std::mem::take(&mut *shard.background.borrow_mut());
    tasks.append(&mut shard.listeners.borrow_mut());
    for t in tasks {
        let _ = t.cancel().await;
    }
    let sessions = shard.drive(|d| d.take_all());
    for (conns, tasks) in sessions {
        runtime::close_all(conns).await;
        if let Some(t) = tasks {
            let _ = t.reader.cancel().await;
            let _ = t.writer.cancel().await;
        }
    }
}

impl ShardHost {
    /// Starts `task` once the shard's driver is no longer borrowed (glommio may run a task
    /// the moment it is spawned, and it would find the driver in use).
    fn spawn(&self, task: impl Future<Output = ()> + 'static) {
        if let Some(shard) = self.shard.upgrade() {
            shard.spawns.borrow_mut().push(Box::pin(task));
        }
    }
}

impl Host for ShardHost {
    type Sender = DataSender;
    type Receiver = Task<()>;
    type Control = ControlQueue;
    type ControlTasks = ControlTasks<Task<()>>;
    type SessionExt = ();

    fn connect(&self, addr: SocketAddr, timeout: Duration, dial: Dial) {
        self.spawn(runtime::connect(self.clone(), addr, timeout, dial));
    }

    fn open_data(&self, sid: SessionId, addr: SocketAddr, key: SessionKey, n: usize) {
        for _ in 0..n {
            self.spawn(runtime::open_data(self.clone(), sid, addr, key.clone()));
        }
    }

    fn release(
        &self,
        sid: SessionId,
        conns: Vec<DataConn<Self>>,
        tasks: Option<ControlTasks<Task<()>>>,
        linger: Duration,
        why: Release,
    ) {
        self.spawn(runtime::release(
            self.clone(),
            sid,
            conns,
            tasks,
            linger,
            why,
        ));
    }

    fn wake(&self) {
        if let Some(shard) = self.shard.upgrade() {
            let _ = shard.wake.try_send(());
        }
    }
}

impl Runtime for ShardHost {
    type Host = ShardHost;
    type Task = Task<()>;
    type Sender = DataSender;
    type Stream = TcpStream;

    fn io(
        stream: &mut TcpStream,
    ) -> impl futures_io::AsyncRead + futures_io::AsyncWrite + Unpin + '_ {
        stream
    }

    fn drive<T>(&self, f: impl FnOnce(&mut Driver<ShardHost>) -> T) -> Option<T> {
        Some(self.shard.upgrade()?.drive(f))
    }

    fn sleep(wait: Duration) -> impl Future<Output = ()> {
        glommio::timer::sleep(wait)
    }

    async fn dial(&self, addr: SocketAddr, key: Option<SessionKey>) -> std::io::Result<TcpStream> {
        let mut stream = TcpStream::connect(addr).await?;
        let _ = stream.set_nodelay(true);
        match key {
            None => hello_control(&mut stream).await?,
            Some(key) => hello_data(&mut stream, &key).await?,
        }
        Ok(stream)
    }

    fn attach_control(
        &self,
        stream: TcpStream,
        peer_addr: Option<SocketAddr>,
        target: Option<TargetId>,
        handshake: Option<Answer>,
    ) {
        let Some((sid, queue)) = runtime::register_control(self, peer_addr, target, handshake)
        else {
            return;
        };
        let write = match second_handle(&stream) {
            Ok(write) => write,
            Err(e) => {
                warn!(session = %sid, error = %e, "cannot split a control connection");
                // A session that closes at once: the core learns it like any other loss.
                self.drive(|d| d.control_ended(sid));
                return;
            }
        };
        let tasks = ControlTasks {
            writer: glommio::spawn_local(runtime::write_control(queue, write)),
            reader: glommio::spawn_local(runtime::read_control(self.clone(), sid, stream)),
        };
        runtime::add_control_tasks(self, sid, tasks);
    }

    fn attach_data(&self, sid: SessionId, stream: TcpStream) {
        let Some(shard) = self.shard.upgrade() else {
            return;
        };
        if !shard.driver.borrow().wants_data(sid) {
            return; // dropping the stream closes it
        }
        let memory = shard.memory.clone();
        let conn = match shard.info.role {
            Role::Prefill => {
                let host = self.clone();
                let report: LocalReport = Rc::new(move |id, outcome| {
                    host.drive(|d| d.with(|e, now| e.handle_transfer_result(now, id, outcome)));
                });
                match DataSender::spawn(stream, memory, report) {
                    Ok(s) => DataConn::Sender(s),
                    Err(e) => {
                        warn!(session = %sid, error = %e, "cannot split a data connection");
                        return;
                    }
                }
            }
            Role::Decode => {
                let check: Rc<dyn WriteCheck> = Rc::new(CoreCheck {
                    access: DriverAccess(self.clone()),
                    session: sid,
                });
                let limits = shard.limits;
                let host = self.clone();
                DataConn::Receiver(glommio::spawn_local(async move {
                    let serve = serve_local(stream, &memory, check, limits);
                    runtime::serve_data(host, sid, serve).await;
                }))
            }
        };
        // Cannot be refused: checked above, and nothing ran in between.
        let _ = shard.drive(|d| d.attach_data(sid, conn));
    }
}

impl Shard {
    /// Runs `f` on the driver, then starts the tasks it asked for (the only way in, so
    /// no task ever finds the driver borrowed).
    fn drive<T>(&self, f: impl FnOnce(&mut Driver<ShardHost>) -> T) -> T {
        let out = f(&mut self.driver.borrow_mut());
        loop {
            let spawns = std::mem::take(&mut *self.spawns.borrow_mut());
            if spawns.is_empty() {
                return out;
            }
            for task in spawns {
                glommio::spawn_local(task).detach();
            }
        }
    }

    fn stop(&self) {
        self.stopped.set(true);
        let _ = self.wake.try_send(());
    }

    /// The shard's host: the way its tasks reach its driver.
    fn host(&self) -> ShardHost {
        self.driver.borrow().host().clone()
    }

    fn listen(self: &Rc<Self>, addr: SocketAddr) -> Result<SocketAddr, NodeError> {
        // glommio's own bind sets SO_REUSEPORT, which would let a second node silently share
        // (and steal connections from) an address in use; bind plainly and hand it over.
        let plain = std::net::TcpListener::bind(addr)?;
        plain.set_nonblocking(true)?;
        // SAFETY: `plain` is a fresh listening socket whose ownership moves to glommio.
        let listener = unsafe { TcpListener::from_raw_fd(plain.into_raw_fd()) };
        let local = listener.local_addr().map_err(std::io::Error::from)?;
        let host = self.host();
        let task = glommio::spawn_local(async move {
            let take = {
                let host = host.clone();
                move |stream: TcpStream| {
                    let _ = stream.set_nodelay(true);
                    let peer = stream.peer_addr().ok();
                    glommio::spawn_local(runtime::take_accepted(host.clone(), stream, peer))
                        .detach();
                }
            };
            let listener = &listener;
            let accept = move || async move { Ok(listener.accept().await?) };
            runtime::listen(host, accept, take).await;
        });
        self.listeners.borrow_mut().push(task);
        Ok(local)
    }

    /// Fails every room, tells every peer, and waits until the core says the shutdown is
    /// complete (every session closed, or its shutdown timeout).
    async fn shutdown(self: Rc<Self>) {
        let (tx, rx) = oneshot::channel();
        self.drive(|d| d.shutdown(tx));
        let _ = rx.await;
        // The listeners close before the shutdown returns: a node restarted at the same
        // address can bind it at once.
        let listeners = std::mem::take(&mut *self.listeners.borrow_mut());
        for l in listeners {
            let _ = l.cancel().await;
        }
        self.stop();
    }
}
