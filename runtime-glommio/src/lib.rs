//! `kvferry-glommio`: the thread-per-core runtime of the driver loop. One glommio executor
//! (io_uring) per shard, pinned to a core of its own only when asked ([`ShardConfig::pin`]); each shard owns its own
//! [`Driver`] (and so its own `kvferry-core` [`Endpoint`]), listener and sockets, and shares
//! nothing with the others. It is the driver's [`Runtime`] and [`Host`] on glommio: it
//! spawns, on the shard's thread, the tasks `kvferry_driver::runtime` writes once, and lends
//! its timer and sockets. It must never decide a retry, a timeout or a room's state.
//!
//! Routing rule (the same on every runtime, see [`kvferry_driver::shard_of`]): room `r` lives
//! on shard `r mod shards`. Each shard is its own logical node towards peers (its node id is
//! derived from the configured one, see [`shard_node`]) and listens on its own address; a
//! peer is named by the list of its shard addresses, and room `r` uses the session to address
//! `r mod len`. Within a shard there is no lock: the driver lives in a `RefCell` owned by the
//! shard's thread. The embedder's calls reach a shard as closures over a channel; dropping a
//! call's future after it was sent loses only the answer, and `RoomHandle` waits are
//! cancel-safe.

mod executor;
#[cfg(feature = "rdma")]
mod rdma;

use std::cell::{Cell, RefCell};
use std::future::Future;
use std::net::SocketAddr;
use std::os::fd::{FromRawFd, IntoRawFd};
use std::pin::Pin;
use std::rc::{Rc, Weak};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use futures_io::{AsyncRead, AsyncWrite};
use glommio::net::{TcpListener, TcpStream};
use glommio::Task;
use kvferry_core::{Endpoint, SessionKey};
use kvferry_driver::runtime::{Reporter, Work};
use kvferry_driver::{
    runtime, Announcer, CoreCheck, Driver, DriverAccess, EventSink, Host, Job, NodeParts, Runtime,
    ShardCall, ShardFuture, Shards,
};
pub use kvferry_driver::{
    Announcement, DataBackend, FaultKind, FaultPlan, Link, Node, NodeConfig, NodeError, PeerId,
    RoomHandle, RoomView, SameHost, Unsupported, DEFAULT_READ_SPIN,
};
use kvferry_memory::MemoryMap;
use kvferry_tcp::fd::second_handle;
use kvferry_tcp::glommio::{
    serve_local, LocalConn, LocalDataSender as DataSender, LocalReport, Polled,
};
use kvferry_tcp::stream::{hello_control, hello_data};
use kvferry_tcp::{Limits, ServeError, ServeStats, TlsSetup};
use tokio::sync::oneshot;

use executor::ShardSetup;
pub use executor::{ensure_memlock, shard_node, ShardConfig, DEFAULT_SPIN_BEFORE_PARK};

/// The node's RDMA device when data moves over RDMA (feature `rdma`), shared by its shards.
#[cfg(feature = "rdma")]
pub(crate) type RdmaDevice = Option<rdma::ShardRdma>;
/// Never one: this build moves data over TCP only.
#[cfg(not(feature = "rdma"))]
pub(crate) type RdmaDevice = Option<NoRdma>;

/// No RDMA device can exist in a build without the `rdma` feature.
#[cfg(not(feature = "rdma"))]
#[derive(Clone, Debug)]
pub(crate) enum NoRdma {}

/// A closure run on a shard's thread with its state.
pub(crate) type Cmd = Box<dyn FnOnce(&Rc<Shard>) + Send>;

/// Starts `shards.shards` executors over `memory` (registered for `config.info.layout`), each
/// a shard with its own endpoint. Callable from any thread; does not need a runtime. The node
/// is `Send + Sync`: call it from any thread or runtime. [`Node::shutdown`] (or the last
/// clone dropped) stops the shards' work; a shard's thread ends when the last clone is
/// dropped (until then it answers calls from its shut-down core).
pub fn start(
    config: NodeConfig,
    memory: Arc<MemoryMap>,
    shards: ShardConfig,
) -> Result<Node, NodeError> {
    kvferry_driver::check_memory(&memory, &config.backend, config.core.checksum)?;
    kvferry_driver::check_same_host(config.same_host, &memory)?;
    kvferry_driver::check_read_spin(config.read_spin)?;
    kvferry_driver::log_start("glommio", &config, &memory);
    let (rdma, rdma_stop) = open_rdma(&config, &memory)?;
    let backend = if rdma.is_some() { "rdma" } else { "tcp" };
    let announcements = Announcer::default();
    let events = EventSink::default();
    let started = executor::spawn_shards(&config, &memory, shards, &announcements, &events, rdma)?;
    let pinned_cores = started.cores.cores().to_vec();
    Ok(Node::new(NodeParts {
        runtime: "glommio",
        backend,
        role: config.info.role,
        config: config.core,
        memory,
        announcements,
        events,
        pinned_cores,
        shards: Box::new(ShardSet(Arc::new(ShardsInner {
            senders: started.senders,
            ends: started.ends,
            threads: Mutex::new(started.threads),
            _cores: started.cores,
            _pollers: rdma_stop,
        }))),
    }))
}

/// Opens the RDMA device the config asks for (registering `memory`), once for every shard,
/// with the write end of its pollers' stop pipe.
fn open_rdma(
    config: &NodeConfig,
    memory: &MemoryMap,
) -> Result<(RdmaDevice, Option<std::os::fd::OwnedFd>), NodeError> {
    #[cfg(feature = "rdma")]
    return rdma::open(
        &config.backend,
        memory,
        config.info.role == kvferry_core::Role::Decode,
        config.core.checksum,
    );
    #[cfg(not(feature = "rdma"))]
    {
        let _ = memory;
        kvferry_driver::tcp_only(&config.backend).map(|()| (None, None))
    }
}

/// The node's shards: one command channel to each shard's thread, and each thread's end.
/// Dropped with the node's last clone, it stops every shard.
struct ShardSet(Arc<ShardsInner>);

struct ShardsInner {
    senders: Vec<flume::Sender<Cmd>>,
    ends: Vec<flume::Receiver<()>>,
    threads: Mutex<Vec<glommio::ExecutorJoinHandle<()>>>,
    /// The cores the shards are pinned to, given back when the node is gone.
    _cores: executor::CoreClaim,
    /// The write end of the RDMA completion pollers' stop pipe: they end with the node.
    _pollers: Option<std::os::fd::OwnedFd>,
}

impl Drop for ShardSet {
    fn drop(&mut self) {
        for tx in &self.0.senders {
            let _ = tx.send(Box::new(|shard: &Rc<Shard>| shard.stop()));
        }
    }
}

impl ShardsInner {
    /// Runs `f` on shard `shard` (on its thread) and returns its result.
    fn run<T, F>(&self, shard: usize, f: F) -> impl Future<Output = Result<T, NodeError>> + Send
    where
        T: Send + 'static,
        F: FnOnce(&Rc<Shard>) -> T + Send + 'static,
    {
        let (tx, rx) = oneshot::channel();
        let sent = self.senders.get(shard).is_some_and(|s| {
            s.send(Box::new(move |s: &Rc<Shard>| {
                let _ = tx.send(f(s));
            }))
            .is_ok()
        });
        let end = self.ends.get(shard).cloned();
        async move {
            let Some(end) = end.filter(|_| sent) else {
                return Err(NodeError::ShutDown);
            };
            // A command queued to a shard whose thread ended (it panicked) is never run nor
            // dropped (the channel keeps it): its answer is also awaited against that end.
            let answer = async { rx.await.map_err(|_| NodeError::ShutDown) };
            let gone = async {
                let _ = end.recv_async().await;
                Err(NodeError::ShutDown)
            };
            futures_lite::future::or(answer, gone).await
        }
    }
}

/// Calls go to the shard owning the room, as closures over its command channel; each shard
/// listens on an address of its own.
impl Shards for ShardSet {
    fn count(&self) -> usize {
        self.0.senders.len()
    }

    fn call(&self, shard: usize, call: ShardCall) -> ShardFuture<'static, Result<(), NodeError>> {
        Box::pin(self.0.run(shard, move |s| s.drive(|d| call(d))))
    }

    fn listen(&self, addr: SocketAddr) -> ShardFuture<'_, Result<Vec<SocketAddr>, NodeError>> {
        Box::pin(async move {
            let mut out = Vec::with_capacity(self.count());
            for i in 0..self.count() {
                let mut a = addr;
                if a.port() != 0 {
                    a.set_port(addr.port().wrapping_add(i as u16));
                }
                out.push(self.0.run(i, move |s| s.listen(a)).await??);
            }
            Ok(out)
        })
    }

    fn shutdown(&self) -> ShardFuture<'static, ()> {
        let inner = self.0.clone();
        let (done, finished) = oneshot::channel();
        // A thread of its own: a caller that stops waiting (a timeout around this call) does
        // not leave a node half shut down. It then joins the executors, which exit once the
        // node is dropped (it lets go of its own hold first).
        std::thread::spawn(move || {
            futures_lite::future::block_on(shut_down_shards(&inner));
            let threads =
                std::mem::take(&mut *inner.threads.lock().unwrap_or_else(|p| p.into_inner()));
            drop(inner);
            let _ = done.send(());
            for t in threads {
                let _ = t.join();
            }
        });
        Box::pin(async move {
            let _ = finished.await;
        })
    }
}

/// Every shard's listeners close before any shard says goodbye (a peer that hears one
/// shard's and dials another at once is refused too), then the shards shut down together.
async fn shut_down_shards(calls: &ShardsInner) {
    for step in [Shard::close_listeners as ShardStep, Shard::shutdown] {
        let mut done = Vec::new();
        for i in 0..calls.senders.len() {
            let (tx, rx) = oneshot::channel();
            let sent = calls
                .run(i, move |s| {
                    let s = s.clone();
                    glommio::spawn_local(async move {
                        step(s).await;
                        let _ = tx.send(());
                    })
                    .detach();
                })
                .await;
            if sent.is_ok() {
                done.push(rx);
            }
        }
        for rx in done {
            let _ = rx.await;
        }
    }
    // One more call each: the stopped shard's command loop sees the stop and lets go of its
    // tasks and sessions now, not at the next call that would come.
    for i in 0..calls.senders.len() {
        let _ = calls.run(i, |_| ()).await;
    }
}

// ------------------------------------------------------------------------------- shards

/// A listener's task and its socket (shut down before the task is cancelled).
type Listening = (Task<()>, std::net::TcpListener);

/// A step every shard of a node takes (on its own executor).
type ShardStep = fn(Rc<Shard>) -> Pin<Box<dyn Future<Output = ()>>>;

/// One shard: an endpoint and the driver loop around it, owned by one executor thread.
struct Shard {
    driver: RefCell<Driver<ShardHost>>,
    /// The driver task's wake-up ([`Driver::wakeup`]): a stop must reach it.
    wakeup: Arc<tokio::sync::Notify>,
    stopped: Cell<bool>,
    /// Told when the shard stops: a shutdown waiting for its core ends then too.
    stopping: tokio::sync::Notify,
    /// Tasks that live as long as the shard (listeners, the timer).
    background: RefCell<Vec<Task<()>>>,
    /// The listeners' tasks, each with its socket; `None` once the shutdown began (no
    /// listener opens again).
    listeners: RefCell<Option<Vec<Listening>>>,
    /// Tasks the driver asked for, started once it is no longer borrowed.
    spawns: RefCell<Vec<std::pin::Pin<Box<dyn Future<Output = ()>>>>>,
}

/// A shard's side of the driver loop: starts tasks on the shard's executor that report back
/// to the driver in its `Shard`.
#[derive(Clone)]
pub struct ShardHost {
    shard: Weak<Shard>,
    memory: Arc<MemoryMap>,
    limits: Limits,
    /// TLS on every connection, when configured.
    tls: Option<TlsSetup>,
    /// The node's RDMA device, when data moves over RDMA.
    #[cfg_attr(not(feature = "rdma"), allow(dead_code))]
    rdma: RdmaDevice,
    /// How long a data connection's read keeps trying its socket after the last bytes
    /// before it waits on the ring: the shard's spin before parking where it is pinned (the
    /// only shard glommio lets spin), else zero.
    read_spin: std::time::Duration,
    /// The node's subscribers to core events.
    events: EventSink,
}

/// A shard's thread: builds its endpoint and driver, says it is up, then runs the node's
/// calls until it stops.
pub(crate) async fn shard_main(
    setup: ShardSetup,
    ready: std::sync::mpsc::Sender<Result<(), String>>,
) {
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
    let shard = Rc::new_cyclic(|weak| {
        let driver = Driver::new(
            endpoint,
            ShardHost {
                shard: weak.clone(),
                memory: setup.memory,
                tls: setup.tls,
                rdma: setup.rdma,
                read_spin: setup.read_spin,
                events: setup.events,
                limits: Limits {
                    checksum: setup.config.core.checksum,
                    max_slices: setup.config.core.max_op_slices,
                    max_bytes: setup.config.core.max_op_bytes,
                },
            },
            setup.config.data_connections,
            setup.announcements,
            now,
        );
        Shard {
            wakeup: driver.wakeup(),
            driver: RefCell::new(driver),
            stopped: Cell::new(false),
            stopping: tokio::sync::Notify::new(),
            background: RefCell::new(Vec::new()),
            listeners: RefCell::new(Some(Vec::new())),
            spawns: RefCell::new(Vec::new()),
        }
    });
    shard.drive(|d| {
        d.set_faults(setup.config.faults);
        let staging = d.host().memory.staging().cloned();
        d.set_staging(staging);
        d.set_same_host_plane(setup.same_host.clone());
        #[cfg(feature = "rdma")]
        {
            let memory = d.host().memory.clone();
            let plane = d.host().rdma.as_ref().map(|r| r.plane(memory));
            d.set_rdma_plane(plane);
        }
    });
    let weak = Rc::downgrade(&shard);
    let host = shard.host();
    let timer = glommio::spawn_local(async move {
        let stopped = move || weak.upgrade().map_or(true, |s| s.stopped.get());
        runtime::run_driver(host, stopped).await;
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
    let listeners = shard.listeners.borrow_mut().take().unwrap_or_default();
    tasks.extend(listeners.into_iter().map(|(task, _)| task));
    for t in tasks {
        let _ = t.cancel().await;
    }
    let sessions = shard.drive(|d| d.take_all());
    for (conns, tasks) in sessions {
        runtime::close_all(conns).await;
        if let Some(t) = tasks {
            let _ = t.reader.task.cancel().await;
            let _ = t.writer.task.cancel().await;
        }
    }
    // A stopped shard still answers calls until the node is gone, from its shut-down core
    // (its final counters; `ShutDown` for everything else), as a tokio node does.
    while let Ok(cmd) = setup.rx.recv_async().await {
        cmd(&shard);
    }
    // Callers waiting on a command this shard will never run hear its end now.
    drop(setup.alive);
}

impl ShardHost {
    /// Starts `task` once the shard's driver is no longer borrowed (glommio may run a task
    /// the moment it is spawned, and it would find the driver in use).
    fn defer(&self, task: impl Future<Output = ()> + 'static) {
        if let Some(shard) = self.shard.upgrade() {
            shard.spawns.borrow_mut().push(Box::pin(task));
        }
    }
}

/// A task the driver holds on a shard (a decode receiver, a control connection's reader or
/// writer): the glommio task, and whether its body ended, which a glommio task cannot say.
#[derive(Debug)]
pub struct ShardTask {
    task: Task<()>,
    /// Set once the task's body is gone: it returned, or the task was cancelled.
    ended: Rc<Cell<bool>>,
}

/// Marks its [`ShardTask`] ended when dropped with the task's body (however it ends).
struct Ended(Rc<Cell<bool>>);

impl Drop for Ended {
    fn drop(&mut self) {
        self.0.set(true);
    }
}

impl kvferry_tcp::send::Task for ShardTask {
    async fn stop(self) {
        let _ = self.task.cancel().await;
    }

    fn abort(self) {
        // Dropping a glommio task cancels it.
    }
}

impl Future for ShardTask {
    type Output = ();

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<()> {
        Pin::new(&mut self.task).poll(cx)
    }
}

impl Host for ShardHost {
    type Sender = DataSender;
    type Task = ShardTask;

    fn start(&self, job: Job<Self>) {
        self.defer(job.run(self.clone()));
    }

    fn publish(&self, event: kvferry_core::Event) {
        self.events.publish(event);
    }

    fn task_finished(task: &ShardTask) -> bool {
        task.ended.get()
    }
}

impl Runtime for ShardHost {
    type Stream = LocalConn;
    type Read = Box<dyn AsyncRead + Unpin>;
    type Write = Box<dyn AsyncWrite + Unpin>;

    fn drive<T>(&self, f: impl FnOnce(&mut Driver<ShardHost>) -> T) -> Option<T> {
        Some(self.shard.upgrade()?.drive(f))
    }

    fn sleep(wait: Duration) -> impl Future<Output = ()> {
        glommio::timer::sleep(wait)
    }

    async fn dial(&self, addr: SocketAddr, key: Option<SessionKey>) -> std::io::Result<LocalConn> {
        let tcp = TcpStream::connect(addr).await?;
        let _ = tcp.set_nodelay(true);
        let mut stream = match &self.tls {
            Some(tls) => LocalConn::Tls(Box::new(tls.connect_on(tcp).await?)),
            None => LocalConn::Plain(tcp),
        };
        match key {
            None => hello_control(&mut stream).await?,
            Some(key) => hello_data(&mut stream, &key).await?,
        }
        Ok(stream)
    }

    fn split(&self, stream: LocalConn) -> std::io::Result<(Self::Read, Self::Write)> {
        Ok(match stream {
            // Plain TCP: reader and writer on two handles of the socket, no lock between them;
            // the reader reads the socket before it waits on the ring, as data connections do.
            LocalConn::Plain(stream) => {
                let write = second_handle(&stream)?;
                (
                    Box::new(Polled::new(stream, self.read_spin)),
                    Box::new(write),
                )
            }
            // TLS: one session state, shared by the two halves of its stream.
            tls @ LocalConn::Tls(_) => {
                let (read, write) = futures_lite::io::split(tls);
                (Box::new(read), Box::new(write))
            }
        })
    }

    fn spawn(&self, work: Work<Self>) -> ShardTask {
        // Never from inside `drive` (where a spawned task could find the driver in use):
        // that is what `defer` is for.
        debug_assert!(self
            .shard
            .upgrade()
            .map_or(true, |s| s.driver.try_borrow_mut().is_ok()));
        let ended = Rc::new(Cell::new(false));
        let mark = Ended(ended.clone());
        let body = work.run(self.clone());
        let task = glommio::spawn_local(async move {
            // Dropped when the body returns, or with it when the task is cancelled.
            let _mark = mark;
            body.await;
        });
        ShardTask { task, ended }
    }

    fn start_sender(
        &self,
        stream: LocalConn,
        report: Reporter<Self>,
    ) -> std::io::Result<DataSender> {
        let report: LocalReport = Rc::new(move |id, outcome| report.report(id, outcome));
        DataSender::spawn(stream, self.memory.clone(), report, self.read_spin)
    }

    fn serve(
        &self,
        stream: LocalConn,
        check: CoreCheck<DriverAccess<Self>>,
    ) -> impl Future<Output = Result<ServeStats, ServeError>> + 'static {
        let (memory, limits, spin) = (self.memory.clone(), self.limits, self.read_spin);
        async move { serve_local(stream, &memory, Rc::new(check), limits, spin).await }
    }

    #[cfg(feature = "rdma")]
    type Readable = kvferry_driver::rdma::PolledFd;

    #[cfg(feature = "rdma")]
    fn readable(&self, fd: kvferry_driver::rdma::CompletionFd) -> std::io::Result<Self::Readable> {
        rdma::readable(&self.rdma, fd)
    }

    #[cfg(feature = "rdma")]
    async fn wait(readable: &mut Self::Readable) -> std::io::Result<()> {
        readable.wait().await
    }

    fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> impl Future<Output = Option<T>> {
        // Off the shard's thread: hashing what a room landed takes as long as its bytes.
        let done = glommio::executor().spawn_blocking(f);
        async move { Some(done.await) }
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
        self.wakeup.notify_one();
        self.stopping.notify_waiters();
    }

    /// The shard's host: the way its tasks reach its driver.
    fn host(&self) -> ShardHost {
        self.driver.borrow().host().clone()
    }

    fn listen(self: &Rc<Self>, addr: SocketAddr) -> Result<SocketAddr, NodeError> {
        if self.listeners.borrow().is_none() {
            return Err(NodeError::ShutDown);
        }
        // glommio's own bind sets SO_REUSEPORT, which would let a second node silently share
        // (and steal connections from) an address in use; bind plainly and hand it over.
        let plain = std::net::TcpListener::bind(addr)?;
        plain.set_nonblocking(true)?;
        let socket = plain.try_clone()?;
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
                    let tls = host.tls.clone();
                    // TLS first where configured, within the core's deadline for the
                    // connection like its preamble.
                    let open = async move {
                        Ok(match tls {
                            Some(tls) => LocalConn::Tls(Box::new(tls.accept_on(stream).await?)),
                            None => LocalConn::Plain(stream),
                        })
                    };
                    glommio::spawn_local(runtime::take_accepted(host.clone(), open, peer)).detach();
                }
            };
            let listener = &listener;
            let accept = move || async move { Ok(listener.accept().await?) };
            runtime::listen(host, accept, take).await;
        });
        if let Some(listeners) = self.listeners.borrow_mut().as_mut() {
            listeners.push((task, socket));
        }
        Ok(local)
    }

    /// Closes the shard's listeners (before a shutdown tells any peer; a node restarted at
    /// the same address can bind it at once).
    fn close_listeners(self: Rc<Self>) -> Pin<Box<dyn Future<Output = ()>>> {
        Box::pin(async move {
            let listeners = self.listeners.borrow_mut().take().unwrap_or_default();
            for (task, socket) in listeners {
                // Out of the listening state first: an accept already handed to the kernel
                // (io_uring) keeps the socket alive past its close, and would still take one
                // connection; shut down, it takes none and new ones are refused.
                let _ = rustix::net::shutdown(&socket, rustix::net::Shutdown::ReadWrite);
                let _ = task.cancel().await;
            }
        })
    }

    /// Fails every room, tells every peer, and waits until the core says the shutdown is
    /// complete (every session closed, or its shutdown timeout).
    fn shutdown(self: Rc<Self>) -> Pin<Box<dyn Future<Output = ()>>> {
        Box::pin(async move {
            self.clone().close_listeners().await;
            let (tx, rx) = oneshot::channel();
            self.drive(|d| d.shutdown(tx));
            // A node dropped meanwhile stopped the shard, whose driver task fires the core's
            // shutdown timeout: its stop ends the wait too. The flag is read and the wait
            // begun without a yield between, on the shard's one thread.
            let stopped = async {
                if !self.stopped.get() {
                    self.stopping.notified().await;
                }
            };
            futures_lite::future::or(
                async {
                    let _ = rx.await;
                },
                stopped,
            )
            .await;
            self.stop();
        })
    }
}
