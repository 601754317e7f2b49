//! `kvferry-tokio`: the driver that runs a `kvferry-core` [`Endpoint`] on tokio.
//!
//! It is the tokio [`Host`] of the one driver loop ([`kvferry_driver::Driver`]): it owns
//! sockets, tasks and the one timer, keeps the driver behind a mutex, and starts what the
//! driver asks for (connects, data connections, fences, closes), carrying data-path
//! operations through `kvferry-tcp` (or RDMA with the `rdma` feature). Every decision is the
//! driver's or the core's: if this file ever needs an `if` about a retry, a timeout or a
//! room's state, their API is missing something.
//!
//! Embedders get a [`Node`]: open rooms, send chunks, mark layers ready, abort, and await a
//! room's terminal state and its release through a cancel-safe [`RoomHandle`].

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use kvferry_core::{
    ApiError, Capacity, Chunk, Config, Counters, Endpoint, EndpointInfo, Event, FailureReason,
    Generation, Grant, KvPoll, Role, RoomId, SessionId, SessionKey, TargetId, TransferId,
    TransferOutcome,
};
use kvferry_memory::{MemoryMap, WriteCheck};
use kvferry_tcp::{
    accept_conn, connect_control, connect_data, serve_writes, Conn, DataSender, Limits, Report,
    TlsSetup, TokioIo,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{broadcast, mpsc, oneshot, watch, Notify};
use tokio::task::JoinHandle;
use tracing::{debug, info_span, warn, Instrument};

#[cfg(feature = "rdma")]
mod rdma;

pub use kvferry_driver::{
    export_metrics, shard_of, Announcement, DataBackend, FaultPlan, KvNode, Link, NodeConfig,
    NodeError, PeerId, RoomHandle, RoomView,
};
use kvferry_driver::{
    within, Accepted, Announcer, CoreCheck, DataConn, Driver, Embedder, EndpointAccess, Host,
    Release, ShardCalls,
};

/// The tokio side of the driver loop: starts tasks on the node's runtime that report back
/// to the driver behind [`Shared::driver`].
struct TokioHost {
    shared: Weak<Shared>,
    runtime: tokio::runtime::Handle,
    tls: Option<TlsSetup>,
    events: broadcast::Sender<Event>,
}

struct Shared {
    driver: Mutex<Driver<TokioHost>>,
    wake: Notify,
    memory: Arc<MemoryMap>,
    events: broadcast::Sender<Event>,
    runtime: tokio::runtime::Handle,
    info: EndpointInfo,
    limits: Limits,
    /// TLS on every connection, when configured.
    tls: Option<TlsSetup>,
    faults: Mutex<Option<FaultPlan>>,
    announcements: Announcer,
    stopped: watch::Sender<bool>,
    /// The registered memory and device when data moves over RDMA.
    #[cfg(feature = "rdma")]
    rdma: Option<Arc<kvferry_rdma::link::RdmaNode>>,
}

/// A running kvferry endpoint on tokio. Cheap to clone; the last [`Node::shutdown`] or drop
/// of every clone ends its tasks.
#[derive(Clone)]
pub struct Node {
    shared: Arc<Shared>,
    /// The room calls of the embedder API, and how each peer named through it is reached.
    rooms: Arc<Embedder<Locked>>,
    _last: Arc<StopOnDrop>,
}

/// The node's one driver, behind its lock: a tokio node is one shard.
struct Locked(Arc<Shared>);

impl ShardCalls for Locked {
    type Host = TokioHost;

    fn shards(&self) -> usize {
        1
    }

    fn call<T, F>(
        &self,
        _shard: usize,
        f: F,
    ) -> impl std::future::Future<Output = Result<T, NodeError>> + Send
    where
        T: Send + 'static,
        F: FnOnce(&mut Driver<TokioHost>) -> T + Send + 'static,
    {
        std::future::ready(Ok(f(&mut self.0.lock())))
    }
}

/// Held by every clone of a [`Node`]: when the last one goes, the tasks stop.
struct StopOnDrop(Arc<Shared>);

impl Drop for StopOnDrop {
    fn drop(&mut self) {
        let _ = self.0.stopped.send(true);
    }
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Node")
            .field("role", &self.shared.info.role)
            .finish_non_exhaustive()
    }
}

impl Shared {
    fn lock(&self) -> MutexGuard<'_, Driver<TokioHost>> {
        self.driver.lock().unwrap_or_else(|p| p.into_inner())
    }
}

impl Node {
    /// Starts a node over `memory` (which must be registered for `config.info.layout`).
    /// Must be called inside a tokio runtime.
    pub fn start(config: NodeConfig, memory: Arc<MemoryMap>) -> Result<Node, NodeError> {
        let now = Instant::now();
        let endpoint = Endpoint::new(config.core.clone(), config.info.clone(), config.seed, now)
            .map_err(|e| {
                NodeError::Io(std::io::Error::new(
                    std::io::ErrorKind::InvalidInput,
                    e.to_string(),
                ))
            })?;
        #[cfg(feature = "rdma")]
        let rdma = match &config.backend {
            DataBackend::Tcp => None,
            DataBackend::Rdma { device, port } => Some(rdma::open(
                &memory,
                config.info.role == Role::Decode,
                device.as_deref(),
                *port,
            )?),
        };
        #[cfg(not(feature = "rdma"))]
        if config.backend != DataBackend::Tcp {
            return Err(NodeError::Backend(
                "this build has no RDMA support: rebuild with the `rdma` feature, or use --backend tcp".to_owned(),
            ));
        }
        let tls = match &config.tls {
            Some(files) => Some(TlsSetup::load(files).map_err(|e| NodeError::Tls(e.to_string()))?),
            None => None,
        };
        let (events, _) = broadcast::channel(65536);
        let (stopped, _) = watch::channel(false);
        let limits = Limits {
            max_slices: config.core.max_op_slices,
            max_bytes: config.core.max_op_bytes,
        };
        let runtime = tokio::runtime::Handle::current();
        let announcements = Announcer::default();
        let shared = Arc::new_cyclic(|weak| {
            let host = TokioHost {
                shared: weak.clone(),
                runtime: runtime.clone(),
                tls: tls.clone(),
                events: events.clone(),
            };
            Shared {
                driver: Mutex::new(Driver::new(
                    endpoint,
                    host,
                    config.data_connections,
                    announcements.clone(),
                    now,
                )),
                wake: Notify::new(),
                memory,
                events,
                runtime,
                info: config.info,
                limits,
                tls,
                faults: Mutex::new(config.faults),
                announcements,
                stopped,
                #[cfg(feature = "rdma")]
                rdma,
            }
        });
        let weak = Arc::downgrade(&shared);
        let role = shared.info.role;
        tokio::spawn(drive(weak).instrument(info_span!("kvferry_driver", ?role)));
        Ok(Node {
            _last: Arc::new(StopOnDrop(shared.clone())),
            rooms: Arc::new(Embedder::new(Locked(shared.clone()))),
            shared,
        })
    }

    /// Listens for peers on `addr`; returns the bound address. Runs until shutdown.
    pub async fn listen(&self, addr: SocketAddr) -> Result<SocketAddr, NodeError> {
        let listener = TcpListener::bind(addr).await?;
        let local = listener.local_addr()?;
        let weak = Arc::downgrade(&self.shared);
        let mut stopped = self.shared.stopped.subscribe();
        tokio::spawn(
            async move {
                loop {
                    tokio::select! {
                        _ = async { let _ = stopped.wait_for(|s| *s).await; } => break,
                        accepted = listener.accept() => match accepted {
                            Ok((stream, peer)) => {
                                let weak = weak.clone();
                                tokio::spawn(async move { accept(weak, stream, peer).await });
                            }
                            Err(e) => {
                                warn!(error = %e, "accept failed; backing off");
                                tokio::time::sleep(Duration::from_millis(50)).await;
                            }
                        },
                    }
                }
            }
            .instrument(info_span!("kvferry_listener", %local)),
        );
        Ok(local)
    }

    /// Connects to a peer's listener and completes the handshake; returns the session.
    pub async fn connect(&self, addr: SocketAddr) -> Result<SessionId, NodeError> {
        let stream = connect_control(addr, self.shared.tls.as_ref()).await?;
        let (tx, rx) = oneshot::channel();
        attach_control(&self.shared, stream, Some(addr), None, Some(tx));
        // The core's handshake timer bounds the wait: it closes a session that stays silent.
        rx.await.map_err(|_| NodeError::ShutDown)?
    }

    /// Keeps a session to the peer at `addr`, reconnecting with the core's backoff whenever it
    /// drops (a restarted peer is picked up without restarting this node). Rooms use the
    /// current session from [`Node::target_session`].
    pub fn connect_persistent(&self, addr: SocketAddr) -> TargetId {
        self.shared.lock().add_target(addr)
    }

    /// The established session of a persistent peer, if it has one right now.
    pub fn target_session(&self, target: TargetId) -> Option<SessionId> {
        self.shared.lock().endpoint().target_session(target)
    }

    /// The core's configuration.
    pub fn config(&self) -> Config {
        self.shared.lock().endpoint().config().clone()
    }

    /// The registered memory.
    pub fn memory(&self) -> &Arc<MemoryMap> {
        &self.shared.memory
    }

    /// A snapshot of the core's counters.
    pub fn counters(&self) -> Counters {
        self.shared.lock().endpoint().counters().clone()
    }

    /// The state of a room (live or remembered).
    pub fn room_state(&self, room: RoomId) -> Option<KvPoll> {
        self.shared.lock().endpoint().room_state(room)
    }

    /// Replaces the injected data-path faults (demos and tests only).
    pub fn set_faults(&self, faults: Option<FaultPlan>) {
        if let Ok(mut f) = self.shared.faults.lock() {
            *f = faults;
        }
    }

    /// Prefill: every room a decode asks for before this node opened it, without loss. The
    /// embedder opens each with [`Node::open_sender`]. A second call replaces the first.
    pub fn room_announcements(&self) -> mpsc::UnboundedReceiver<Announcement> {
        self.shared.announcements.subscribe()
    }

    /// Every core event from now on (a lagging subscriber loses the oldest ones).
    pub fn subscribe(&self) -> broadcast::Receiver<Event> {
        self.shared.events.subscribe()
    }

    /// Runs `f` on the endpoint, then drains its outputs.
    fn with<T>(&self, f: impl FnOnce(&mut Endpoint, Instant) -> T) -> T {
        self.shared.lock().with(f)
    }

    /// Decode: opens a receiver room fed by `sources`; see [`Endpoint::open_receiver`].
    pub fn open_receiver(
        &self,
        room: RoomId,
        generation: Generation,
        sources: &[SessionId],
        grant: Option<Grant>,
    ) -> Result<RoomHandle, ApiError> {
        self.shared.lock().open_room(room, |e, now| {
            e.open_receiver(now, room, generation, sources, grant)
        })
    }

    /// Decode: grants a room its pages.
    pub fn grant_pages(&self, room: RoomId, grant: Grant) -> Result<(), ApiError> {
        self.with(|e, now| e.grant_pages(now, room, grant))
    }

    /// Decode: the room waits for capacity behind `position` others.
    pub fn set_queue_position(&self, room: RoomId, position: u32) -> Result<(), ApiError> {
        self.with(|e, now| e.set_queue_position(now, room, position))
    }

    /// Decode: free capacity advertised in heartbeats.
    pub fn set_capacity(&self, capacity: Capacity) {
        self.with(|e, _| e.set_capacity(capacity))
    }

    /// Prefill: opens a sender room.
    pub fn open_sender(
        &self,
        room: RoomId,
        generation: Generation,
    ) -> Result<RoomHandle, ApiError> {
        self.shared
            .lock()
            .open_room(room, |e, now| e.open_sender(now, room, generation))
    }

    /// Prefill: sends the next chunk of a room.
    pub fn send_chunk(&self, room: RoomId, chunk: Chunk) -> Result<(), ApiError> {
        self.with(|e, now| e.send_chunk(now, room, chunk))
    }

    /// Prefill: layer `layer` of `rooms` finished its forward pass.
    pub fn mark_layer_ready(&self, rooms: &[RoomId], layer: u16) -> Result<(), ApiError> {
        self.with(|e, now| e.mark_layer_ready(now, rooms, layer))
    }

    /// Aborts a room locally.
    pub fn abort(&self, room: RoomId) -> Result<(), ApiError> {
        self.with(|e, now| e.abort(now, room))
    }

    /// Fails a room softly (consensus verdicts); `false` if it was already terminal.
    pub fn fail_room(&self, room: RoomId, reason: FailureReason) -> bool {
        self.with(|e, now| e.fail_room(now, room, reason))
    }

    /// Fails every room, tells every peer, closes every connection and stops the tasks.
    pub async fn shutdown(&self) {
        // The core says when it is done: every session closed, or its shutdown timeout.
        let (tx, rx) = oneshot::channel();
        self.shared.lock().shutdown(tx);
        let _ = rx.await;
        let _ = self.shared.stopped.send(true);
        self.shared.wake.notify_one();
    }
}

/// The runtime-neutral embedder API: a tokio node is one shard.
impl KvNode for Node {
    fn runtime(&self) -> &'static str {
        "tokio"
    }

    fn backend(&self) -> &'static str {
        #[cfg(feature = "rdma")]
        if self.shared.rdma.is_some() {
            return "rdma";
        }
        "tcp"
    }

    fn memory(&self) -> &Arc<MemoryMap> {
        &self.shared.memory
    }

    fn shards(&self) -> usize {
        1
    }

    async fn listen(&self, addr: SocketAddr) -> Result<Vec<SocketAddr>, NodeError> {
        Ok(vec![Node::listen(self, addr).await?])
    }

    async fn connect(&self, addrs: Vec<SocketAddr>) -> Result<PeerId, NodeError> {
        let mut links = Vec::with_capacity(addrs.len());
        for addr in addrs {
            links.push(Link::Session(Node::connect(self, addr).await?));
        }
        Ok(self.rooms.add_peer(vec![links]))
    }

    async fn connect_persistent(&self, addrs: Vec<SocketAddr>) -> Result<PeerId, NodeError> {
        self.rooms.connect_persistent(addrs).await
    }

    async fn open_receiver(
        &self,
        room: RoomId,
        generation: Generation,
        peers: Vec<PeerId>,
        grant: Option<Grant>,
    ) -> Result<RoomHandle, NodeError> {
        self.rooms
            .open_receiver(room, generation, peers, grant)
            .await
    }

    async fn grant_pages(&self, room: RoomId, grant: Grant) -> Result<(), NodeError> {
        self.rooms.grant_pages(room, grant).await
    }

    async fn open_sender(
        &self,
        room: RoomId,
        generation: Generation,
    ) -> Result<RoomHandle, NodeError> {
        self.rooms.open_sender(room, generation).await
    }

    async fn send_chunk(&self, room: RoomId, chunk: Chunk) -> Result<(), NodeError> {
        self.rooms.send_chunk(room, chunk).await
    }

    async fn mark_layer_ready(&self, rooms: Vec<RoomId>, layer: u16) -> Result<(), NodeError> {
        self.rooms.mark_layer_ready(rooms, layer).await
    }

    async fn set_capacity(&self, capacity: Capacity) {
        self.rooms.set_capacity(capacity).await;
    }

    async fn set_queue_position(&self, room: RoomId, position: u32) -> Result<(), NodeError> {
        self.rooms.set_queue_position(room, position).await
    }

    async fn set_faults(&self, faults: Option<FaultPlan>) {
        Node::set_faults(self, faults);
    }

    async fn abort(&self, room: RoomId) -> Result<(), NodeError> {
        self.rooms.abort(room).await
    }

    async fn counters(&self) -> Counters {
        self.rooms.counters().await
    }

    fn room_announcements(&self) -> mpsc::UnboundedReceiver<Announcement> {
        Node::room_announcements(self)
    }

    async fn reach(&self, peer: PeerId) -> Result<(), NodeError> {
        self.rooms.reach(peer).await
    }

    async fn shutdown(&self) {
        Node::shutdown(self).await;
    }
}

/// The single driver task: one turn of the driver loop whenever its timer fires or it is
/// woken, until the node stops.
async fn drive(weak: Weak<Shared>) {
    loop {
        let Some(shared) = weak.upgrade() else { return };
        if *shared.stopped.borrow() {
            return;
        }
        let deadline = shared.lock().turn(Instant::now());
        let sleep = async {
            match deadline {
                Some(t) => tokio::time::sleep_until(tokio::time::Instant::from_std(t)).await,
                None => std::future::pending().await,
            }
        };
        let mut stopped = shared.stopped.subscribe();
        tokio::select! {
            _ = sleep => {}
            _ = shared.wake.notified() => {}
            _ = async { let _ = stopped.wait_for(|s| *s).await; } => return,
        }
    }
}

impl Host for TokioHost {
    type Sender = DataSender;
    type Receiver = JoinHandle<()>;
    type Control = mpsc::UnboundedSender<Vec<u8>>;
    type ControlTasks = ControlTasks;
    #[cfg(feature = "rdma")]
    type SessionExt = Option<rdma::SessionRdma>;
    #[cfg(not(feature = "rdma"))]
    type SessionExt = ();

    fn connect(&self, target: TargetId, addr: SocketAddr, timeout: Duration) {
        let weak = self.shared.clone();
        let tls = self.tls.clone();
        self.runtime.spawn(async move {
            let result =
                match tokio::time::timeout(timeout, connect_control(addr, tls.as_ref())).await {
                    Ok(r) => r,
                    Err(_) => Err(std::io::Error::from(std::io::ErrorKind::TimedOut)),
                };
            let Some(shared) = weak.upgrade() else { return };
            match result {
                Ok(stream) => {
                    attach_control(&shared, stream, Some(addr), Some(target), None);
                }
                Err(e) => {
                    debug!(%target, %addr, error = %e, "connect failed");
                    shared.lock().connect_failed(target, &e);
                }
            }
        });
    }

    fn open_data(&self, sid: SessionId, addr: SocketAddr, key: SessionKey, n: usize) {
        for _ in 0..n {
            let weak = self.shared.clone();
            let key = key.clone();
            let tls = self.tls.clone();
            self.runtime.spawn(async move {
                match connect_data(addr, &key, tls.as_ref()).await {
                    Ok(stream) => {
                        if let Some(shared) = weak.upgrade() {
                            attach_data(&shared, sid, stream);
                        }
                    }
                    Err(e) => warn!(session = %sid, error = %e, "data connection failed"),
                }
            });
        }
    }

    fn release(
        &self,
        sid: SessionId,
        conns: Vec<DataConn<Self>>,
        tasks: Option<ControlTasks>,
        linger: Duration,
        why: Release,
    ) {
        let weak = self.shared.clone();
        self.runtime.spawn(async move {
            // Control frames first, then data connections: see `Host::release`.
            if let Some(t) = tasks {
                t.stop(linger).await;
            }
            for c in conns {
                close_data(c).await;
            }
            if let Some(shared) = weak.upgrade() {
                shared.lock().released(sid, why);
            }
        });
    }

    fn wake(&self) {
        if let Some(shared) = self.shared.upgrade() {
            shared.wake.notify_one();
        }
    }

    fn publish(&self, event: Event) {
        let _ = self.events.send(event);
    }

    fn receiver_finished(receiver: &JoinHandle<()>) -> bool {
        receiver.is_finished()
    }

    #[cfg(feature = "rdma")]
    fn establish(driver: &mut Driver<Self>, sid: SessionId) -> bool {
        rdma::establish(driver, sid)
    }

    #[cfg(feature = "rdma")]
    fn transport(driver: &mut Driver<Self>, sid: SessionId, payload: &[u8]) {
        rdma::on_hello(driver, sid, payload);
    }

    #[cfg(feature = "rdma")]
    fn post(
        driver: &mut Driver<Self>,
        op: kvferry_core::TransferOp,
    ) -> Option<kvferry_core::TransferOp> {
        rdma::post(driver, op)
    }

    #[cfg(feature = "rdma")]
    fn fence_own(driver: &mut Driver<Self>, sid: SessionId) -> bool {
        rdma::fence(driver, sid)
    }

    #[cfg(feature = "rdma")]
    fn close_own(ext: &mut Self::SessionExt) {
        if let Some(r) = ext.take() {
            r.close();
        }
    }
}

/// A control connection's tasks.
struct ControlTasks {
    writer: JoinHandle<()>,
    reader: JoinHandle<()>,
}

impl ControlTasks {
    /// Stops reading at once; lets the writer send what is queued (its queue is closed, so it
    /// ends by itself) for at most `linger`.
    async fn stop(self, linger: Duration) {
        self.reader.abort();
        let _ = self.reader.await;
        let mut writer = self.writer;
        if tokio::time::timeout(linger, &mut writer).await.is_err() {
            writer.abort();
            let _ = writer.await;
        }
    }
}

/// Closes a data connection and waits until nothing of it can write any more.
async fn close_data(conn: DataConn<TokioHost>) {
    match conn {
        DataConn::Sender(s) => s.close().await,
        DataConn::Receiver(t) => {
            t.abort();
            let _ = t.await;
        }
    }
}

/// Registers a control connection with the driver and starts its reader and writer;
/// `handshake` is told how the session's handshake ends.
fn attach_control(
    shared: &Arc<Shared>,
    stream: Conn,
    peer_addr: Option<SocketAddr>,
    target: Option<TargetId>,
    handshake: Option<oneshot::Sender<Result<SessionId, NodeError>>>,
) -> SessionId {
    let _ = stream.tcp().set_nodelay(true);
    let (mut read, mut write) = tokio::io::split(stream);
    let (tx, mut rx) = mpsc::unbounded_channel::<Vec<u8>>();
    let sid = {
        let mut driver = shared.lock();
        let sid = driver.attach_control(tx, peer_addr, target);
        // Before the reader starts: no answer of the peer can come first.
        if let Some(w) = handshake {
            driver.on_handshake(sid, w);
        }
        sid
    };
    let weak = Arc::downgrade(shared);
    let span = info_span!("kvferry_session", session = %sid);
    let writer = shared.runtime.spawn(
        async move {
            while let Some(mut frame) = rx.recv().await {
                while let Ok(more) = rx.try_recv() {
                    frame.extend_from_slice(&more);
                }
                if write.write_all(&frame).await.is_err() || write.flush().await.is_err() {
                    break;
                }
            }
        }
        .instrument(span.clone()),
    );
    let reader = shared.runtime.spawn(
        async move {
            let mut buf: Vec<u8> = Vec::with_capacity(64 * 1024);
            let mut chunk = vec![0u8; 64 * 1024];
            loop {
                let n = match read.read(&mut chunk).await {
                    Ok(0) | Err(_) => break,
                    Ok(n) => n,
                };
                let Some(shared) = weak.upgrade() else { return };
                buf.extend_from_slice(&chunk[..n]);
                let used = shared.lock().with(|e, now| e.handle_input(now, sid, &buf));
                buf.drain(..used.min(buf.len()));
            }
            if let Some(shared) = weak.upgrade() {
                debug!("control connection ended");
                shared.lock().control_ended(sid);
            }
        }
        .instrument(span),
    );
    if let Err(tasks) = shared
        .lock()
        .add_tasks(sid, ControlTasks { writer, reader })
    {
        tasks.writer.abort();
        tasks.reader.abort();
    }
    sid
}

async fn accept(weak: Weak<Shared>, tcp: TcpStream, peer: SocketAddr) {
    let access = SharedAccess(weak);
    let Some((tls, wait)) = access.0.upgrade().map(|s| {
        let wait = s.lock().endpoint().config().handshake_timeout;
        (s.tls.clone(), wait)
    }) else {
        return;
    };
    let mut stream = match within(wait, tokio::time::sleep, accept_conn(tcp, tls.as_ref())).await {
        Some(Ok(stream)) => stream,
        Some(Err(e)) => {
            warn!(%peer, error = %e, "refused a connection");
            return;
        }
        None => {
            warn!(%peer, "no TLS handshake in time; connection dropped");
            return;
        }
    };
    let accepted = kvferry_driver::accept(
        &mut TokioIo(&mut stream),
        &access,
        Some(peer),
        tokio::time::sleep,
    )
    .await;
    let Some(shared) = access.0.upgrade() else {
        return;
    };
    match accepted {
        Some(Accepted::Control) => {
            attach_control(&shared, stream, None, None, None);
        }
        Some(Accepted::Data(sid)) => attach_data(&shared, sid, stream),
        None => {}
    }
}

fn attach_data(shared: &Arc<Shared>, sid: SessionId, stream: Conn) {
    let mut driver = shared.lock();
    if !driver.wants_data(sid) {
        return; // dropping the stream closes it
    }
    let conn = match shared.info.role {
        Role::Prefill => {
            let weak = Arc::downgrade(shared);
            let report: Report = Arc::new(move |id: TransferId, outcome: TransferOutcome| {
                if let Some(shared) = weak.upgrade() {
                    shared
                        .lock()
                        .with(|e, now| e.handle_transfer_result(now, id, outcome));
                }
            });
            DataConn::Sender(DataSender::spawn(stream, shared.memory.clone(), report))
        }
        Role::Decode => {
            let weak = Arc::downgrade(shared);
            let check: Arc<dyn WriteCheck + Send + Sync> = Arc::new(CoreCheck {
                access: SharedAccess(Arc::downgrade(shared)),
                session: sid,
            });
            let memory = shared.memory.clone();
            let limits = shared.limits;
            DataConn::Receiver(
                shared.runtime.spawn(
                    async move {
                        match serve_writes(stream, memory, check, limits).await {
                            Ok(stats) => debug!(
                                applied = stats.applied,
                                refused = stats.refused,
                                "data connection ended"
                            ),
                            Err(e) => debug!(error = %e, "data connection ended"),
                        }
                        // A fence aborts this task before it gets here: this end was a break.
                        if let Some(shared) = weak.upgrade() {
                            shared.lock().data_connection_lost(sid);
                        }
                    }
                    .instrument(info_span!("kvferry_data", session = %sid)),
                ),
            )
        }
    };
    // Cannot be refused: checked under this same lock above.
    let _ = driver.attach_data(sid, conn);
}

/// The receive path's way to this node's endpoint: its lock, then a drain.
struct SharedAccess(Weak<Shared>);

impl EndpointAccess for SharedAccess {
    fn run<T>(
        &self,
        f: impl FnOnce(&mut Endpoint, Instant) -> T,
        after: impl FnOnce(&T) -> bool,
    ) -> Option<T> {
        let shared = self.0.upgrade()?;
        let mut driver = shared.lock();
        let out = f(driver.endpoint_mut(), Instant::now());
        if after(&out) {
            driver.drain();
        }
        Some(out)
    }

    fn faults(&self) -> Option<FaultPlan> {
        self.0
            .upgrade()
            .and_then(|s| s.faults.lock().ok().and_then(|f| *f))
    }
}
