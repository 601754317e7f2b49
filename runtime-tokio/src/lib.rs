//! `kvferry-tokio`: the tokio runtime of the driver loop.
//!
//! It is the driver's [`Runtime`] and [`Host`] on tokio: it keeps the one
//! [`kvferry_driver::Driver`] behind a mutex, spawns the tasks `kvferry_driver::runtime`
//! writes once (each [`Job`] and [`Work`], the listener, the timer), and lends its timer,
//! its sockets and TLS; data moves through `kvferry-tcp` (or
//! RDMA with the `rdma` feature). It must never decide a retry, a timeout or a room's state:
//! if it needs an `if` about one, the core's API is missing something.
//!
//! Embedders get a [`Node`] from [`start`]: open rooms, send chunks, mark layers ready,
//! abort, and await a room's terminal state and its release through a cancel-safe
//! [`RoomHandle`].

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use kvferry_core::{Endpoint, EndpointInfo, Event, SessionKey};
use kvferry_memory::MemoryMap;
use kvferry_tcp::polled::Polled;
use kvferry_tcp::{
    accept_conn, connect_control, connect_data, serve_writes, Conn, DataSender, Limits, Report,
    ServeError, ServeStats, TlsSetup, TokioIo,
};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{oneshot, watch, Notify};
use tokio::task::JoinHandle;
use tracing::{info_span, Instrument};

#[cfg(feature = "rdma")]
mod rdma;
#[cfg(feature = "rdma")]
pub use kvferry_driver::rdma::SessionRdma;

use kvferry_driver::runtime::{Reporter, Work};
pub use kvferry_driver::{
    export_metrics, read_spin_from_vars, shard_of, Announcement, DataBackend, DataPath, FaultKind,
    FaultPlan, Link, Node, NodeConfig, NodeError, PeerId, RoomHandle, RoomView, SameHost,
    Unsupported, DEFAULT_READ_SPIN,
};
use kvferry_driver::{
    runtime, Announcer, CoreCheck, Driver, DriverAccess, EventSink, Host, Job, NodeParts, Runtime,
    ShardCall, ShardFuture, Shards,
};

/// The tokio side of the driver loop: starts tasks on the node's runtime that report back
/// to the driver behind the node's lock.
#[derive(Clone)]
pub struct TokioHost {
    shared: Weak<Shared>,
    memory: Arc<MemoryMap>,
    limits: Limits,
    runtime: tokio::runtime::Handle,
    tls: Option<TlsSetup>,
    events: EventSink,
    /// [`NodeConfig::read_spin`].
    read_spin: Duration,
}

struct Shared {
    driver: Mutex<Driver<TokioHost>>,
    /// The driver task's wake-up ([`Driver::wakeup`]): a stop must reach it.
    wakeup: Arc<Notify>,
    memory: Arc<MemoryMap>,
    events: EventSink,
    info: EndpointInfo,
    announcements: Announcer,
    stopped: watch::Sender<bool>,
    /// The listeners' tasks; `None` once the shutdown began (no listener opens again).
    listeners: Mutex<Option<Vec<JoinHandle<()>>>>,
}

/// A tokio node's one shard: its driver behind the lock. Dropped with the node's last clone,
/// it stops the node's tasks.
struct Locked(Arc<Shared>);

impl Drop for Locked {
    fn drop(&mut self) {
        // `send_replace`: `send` drops the value while no task holds a receiver (a driver
        // mid-turn), and that driver would then never see the stop.
        self.0.stopped.send_replace(true);
        self.0.wakeup.notify_one();
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Driver<TokioHost>> {
        lock(&self.driver)
    }

    /// The node's host: the way its tasks reach its driver.
    fn host(&self) -> TokioHost {
        self.lock().host().clone()
    }
}

/// Locks `m`, whatever a panicking holder left in it.
fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Starts a node over `memory` (which must be registered for `config.info.layout`). Must be
/// called inside a tokio runtime.
pub fn start(config: NodeConfig, memory: Arc<MemoryMap>) -> Result<Node, NodeError> {
    kvferry_driver::check_memory(&memory, &config.backend, config.core.checksum)?;
    kvferry_driver::check_same_host(config.same_host, &memory)?;
    kvferry_driver::check_read_spin(config.read_spin)?;
    kvferry_driver::log_start("tokio", &config, &memory);
    let now = Instant::now();
    let endpoint = Endpoint::new(config.core.clone(), config.info.clone(), config.seed, now)
        .map_err(|e| {
            NodeError::Io(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                e.to_string(),
            ))
        })?;
    #[cfg(feature = "rdma")]
    let rdma = kvferry_driver::rdma::open_backend(
        &config.backend,
        &memory,
        config.info.role == kvferry_core::Role::Decode,
        config.core.checksum,
    )?;
    #[cfg(not(feature = "rdma"))]
    kvferry_driver::tcp_only(&config.backend)?;
    let tls = match &config.tls {
        Some(files) => Some(TlsSetup::load(files).map_err(NodeError::Tls)?),
        None => None,
    };
    let events = EventSink::default();
    let (stopped, _) = watch::channel(false);
    let limits = Limits {
        checksum: config.core.checksum,
        max_slices: config.core.max_op_slices,
        max_bytes: config.core.max_op_bytes,
    };
    let runtime = tokio::runtime::Handle::current();
    let announcements = Announcer::default();
    let shared = Arc::new_cyclic(|weak| {
        let host = TokioHost {
            shared: weak.clone(),
            memory: memory.clone(),
            limits,
            runtime: runtime.clone(),
            tls: tls.clone(),
            events: events.clone(),
            read_spin: config.read_spin,
        };
        let driver = Driver::new(
            endpoint,
            host,
            config.data_connections,
            announcements.clone(),
            now,
        );
        Shared {
            wakeup: driver.wakeup(),
            driver: Mutex::new(driver),
            memory,
            events,
            info: config.info,
            announcements,
            stopped,
            listeners: Mutex::new(Some(Vec::new())),
        }
    });
    let weak = Arc::downgrade(&shared);
    let stopped = move || weak.upgrade().map_or(true, |s| *s.stopped.borrow());
    let (host, backend) = {
        let mut driver = shared.lock();
        driver.set_faults(config.faults);
        driver.set_staging(shared.memory.staging().cloned());
        driver.set_same_host_plane(kvferry_driver::SameHostPlane::open(
            config.same_host,
            shared.memory.clone(),
        ));
        #[cfg(feature = "rdma")]
        driver.set_rdma_plane(
            rdma.map(|node| kvferry_driver::rdma::RdmaPlane::new(node, shared.memory.clone())),
        );
        (driver.host().clone(), driver_backend(&driver))
    };
    let role = shared.info.role;
    let driver = runtime::run_driver(host, stopped);
    tokio::spawn(driver.instrument(info_span!("kvferry_driver", ?role)));
    Ok(Node::new(NodeParts {
        runtime: "tokio",
        backend,
        role: shared.info.role,
        config: config.core,
        memory: shared.memory.clone(),
        announcements: shared.announcements.clone(),
        events: shared.events.clone(),
        pinned_cores: Vec::new(),
        shards: Box::new(Locked(shared)),
    }))
}

/// Which data plane the driver moves operations on.
fn driver_backend(driver: &Driver<TokioHost>) -> &'static str {
    #[cfg(feature = "rdma")]
    if driver.rdma_plane().is_some() {
        return "rdma";
    }
    let _ = driver;
    "tcp"
}

/// The node's one shard behind its lock: calls take the lock; listeners are tasks of the
/// runtime.
impl Shards for Locked {
    fn count(&self) -> usize {
        1
    }

    fn call(&self, _shard: usize, call: ShardCall) -> ShardFuture<'static, Result<(), NodeError>> {
        call(&mut *self.0.lock());
        Box::pin(std::future::ready(Ok(())))
    }

    fn listen(&self, addr: SocketAddr) -> ShardFuture<'_, Result<Vec<SocketAddr>, NodeError>> {
        Box::pin(async move {
            let shared = &self.0;
            if lock(&shared.listeners).is_none() {
                return Err(NodeError::ShutDown);
            }
            let listener = TcpListener::bind(addr).await?;
            let local = listener.local_addr()?;
            let host = shared.host();
            let mut stopped = shared.stopped.subscribe();
            let serve = async move {
                let take = {
                    let host = host.clone();
                    move |(tcp, peer)| {
                        host.runtime.spawn(accept(host.clone(), tcp, peer));
                    }
                };
                let listener = &listener;
                tokio::select! {
                    _ = stopped.wait_for(|s| *s) => {}
                    _ = runtime::listen(host, move || listener.accept(), take) => {}
                }
            };
            let mut listeners = lock(&shared.listeners);
            // The shutdown may have begun while this one was bound: it is not served then.
            let Some(listeners) = listeners.as_mut() else {
                return Err(NodeError::ShutDown);
            };
            listeners.push(tokio::spawn(
                serve.instrument(info_span!("kvferry_listener", %local)),
            ));
            Ok(vec![local])
        })
    }

    fn shutdown(&self) -> ShardFuture<'static, ()> {
        let shared = self.0.clone();
        // A task of its own: a caller that stops waiting (a timeout around this call) does
        // not leave a node half shut down.
        let steps = async move {
            // The listeners close before any peer hears the goodbye: one that dials again
            // at once is refused, not let in by a node about to go (and left waiting out its
            // handshake timeout); a node restarted at the same address can bind it at once.
            let listeners = lock(&shared.listeners).take().unwrap_or_default();
            for l in listeners {
                l.abort();
                let _ = l.await;
            }
            // The core says when it is done: every session closed, or its shutdown timeout.
            // A node dropped meanwhile stopped its driver task, which fires that timeout: its
            // stop ends the wait too.
            let (tx, rx) = oneshot::channel();
            shared.lock().shutdown(tx);
            let mut stopped = shared.stopped.subscribe();
            tokio::select! {
                _ = rx => {}
                _ = stopped.wait_for(|s| *s) => {}
            }
            shared.stopped.send_replace(true);
            shared.wakeup.notify_one();
        };
        let task = self.0.host().runtime.spawn(steps);
        Box::pin(async move {
            let _ = task.await;
        })
    }
}

impl Host for TokioHost {
    type Sender = DataSender;
    type Task = JoinHandle<()>;

    fn start(&self, job: Job<Self>) {
        self.runtime.spawn(job.run(self.clone()));
    }

    fn publish(&self, event: Event) {
        self.events.publish(event);
    }

    fn task_finished(task: &JoinHandle<()>) -> bool {
        task.is_finished()
    }
}

impl Runtime for TokioHost {
    type Stream = TokioIo<Conn>;
    type Read = Box<dyn futures_io::AsyncRead + Send + Unpin>;
    type Write = Box<dyn futures_io::AsyncWrite + Send + Unpin>;

    fn drive<T>(&self, f: impl FnOnce(&mut Driver<TokioHost>) -> T) -> Option<T> {
        let shared = self.shared.upgrade()?;
        let out = f(&mut shared.lock());
        Some(out)
    }

    fn sleep(wait: Duration) -> impl std::future::Future<Output = ()> {
        tokio::time::sleep(wait)
    }

    async fn dial(
        &self,
        addr: SocketAddr,
        key: Option<SessionKey>,
    ) -> std::io::Result<TokioIo<Conn>> {
        Ok(TokioIo(match key {
            None => connect_control(addr, self.tls.as_ref()).await?,
            Some(key) => connect_data(addr, &key, self.tls.as_ref()).await?,
        }))
    }

    fn split(&self, stream: TokioIo<Conn>) -> std::io::Result<(Self::Read, Self::Write)> {
        Ok(match stream.0 {
            // Plain TCP: the socket's own halves, no lock between them; the reader reads the
            // socket before it waits on tokio's poller, as data connections do.
            Conn::Plain(tcp) => {
                let (read, write) = tcp.into_split();
                (
                    Box::new(Polled::new(TokioIo(read), self.read_spin)),
                    Box::new(TokioIo(write)),
                )
            }
            // TLS: one session state, shared by the two halves of its stream.
            tls @ Conn::Tls(_) => {
                let (read, write) = tokio::io::split(tls);
                (Box::new(TokioIo(read)), Box::new(TokioIo(write)))
            }
        })
    }

    fn spawn(&self, work: Work<Self>) -> JoinHandle<()> {
        self.runtime.spawn(work.run(self.clone()))
    }

    fn start_sender(
        &self,
        stream: TokioIo<Conn>,
        report: Reporter<Self>,
    ) -> std::io::Result<DataSender> {
        let report: Report = Arc::new(move |id, outcome| report.report(id, outcome));
        Ok(DataSender::spawn(
            stream.0,
            self.memory.clone(),
            report,
            self.read_spin,
        ))
    }

    fn serve(
        &self,
        stream: TokioIo<Conn>,
        check: CoreCheck<DriverAccess<Self>>,
    ) -> impl std::future::Future<Output = Result<ServeStats, ServeError>> + 'static {
        serve_writes(
            stream.0,
            self.memory.clone(),
            Arc::new(check),
            self.limits,
            self.read_spin,
        )
    }

    #[cfg(feature = "rdma")]
    type Readable = rdma::TokioReadable;

    #[cfg(feature = "rdma")]
    fn readable(&self, fd: kvferry_driver::rdma::CompletionFd) -> std::io::Result<Self::Readable> {
        rdma::readable(fd)
    }

    #[cfg(feature = "rdma")]
    async fn wait(readable: &mut Self::Readable) -> std::io::Result<()> {
        rdma::wait(readable).await
    }

    fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> impl std::future::Future<Output = Option<T>> {
        let task = self.runtime.spawn_blocking(f);
        async move { task.await.ok() }
    }
}

/// Takes a connection the listener accepted: TLS first where configured, then the preamble,
/// all within the core's deadline for the connection.
async fn accept(host: TokioHost, tcp: TcpStream, peer: SocketAddr) {
    let tls = host.tls.clone();
    let open = async move { accept_conn(tcp, tls.as_ref()).await.map(TokioIo) };
    runtime::take_accepted(host, open, Some(peer)).await;
}
