//! `kvferry-tokio`: the driver that runs a `kvferry-core` [`Endpoint`] on tokio.
//!
//! It owns sockets, timers and tasks, and nothing else: it feeds the core's inputs (control
//! bytes, finished operations, fired timers, connections), drains its outputs in the documented
//! order after every input, arms one timer from `poll_timeout`, and carries out data-path
//! operations and fences through `kvferry-tcp`. It never decides a retry, a timeout or a
//! room's state: if it ever needs such an `if`, the core's API is missing something.
//!
//! Embedders get a [`Node`]: open rooms, send chunks, mark layers ready, abort, and await a
//! room's terminal state and its release through a cancel-safe [`RoomHandle`].

use std::net::SocketAddr;
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use foldhash::fast::FixedState;
use kvferry_core::{
    Action, ApiError, Capacity, Chunk, Config, Counters, Endpoint, EndpointInfo, Event,
    FailureReason, Generation, Grant, KvPoll, Role, RoomId, SessionId, SessionKey, TargetId,
    TransferId, TransferOutcome,
};
use kvferry_memory::{MemoryMap, WriteCheck};
use kvferry_sync::ConnSet;
use kvferry_tcp::{
    accept_conn, answer_data, challenge_data, connect_control, connect_data, read_preamble,
    serve_writes, Conn, DataSender, Limits, Preamble, Report, TlsSetup,
};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::{broadcast, mpsc, watch, Notify};
use tokio::task::JoinHandle;
use tracing::{debug, info, info_span, warn, Instrument};

type Map<K, V> = std::collections::HashMap<K, V, FixedState>;

#[cfg(feature = "rdma")]
mod rdma;

use kvferry_driver::{
    connect_failure, round_robin, Announcer, CoreCheck, EndpointAccess, RoomBook,
};
pub use kvferry_driver::{
    export_metrics, shard_of, Announcement, DataBackend, FaultPlan, KvNode, Link, NodeConfig,
    NodeError, PeerId, RoomHandle, RoomView,
};

struct SessionIo {
    control_tx: mpsc::UnboundedSender<Vec<u8>>,
    tasks: Vec<JoinHandle<()>>,
    /// Set when this side connected: it opens the data connections.
    peer_addr: Option<SocketAddr>,
    /// Data connections; closing once the session is being closed (loom-modelled).
    data: ConnSet<DataConn>,
    next_sender: usize,
    /// Operations waiting for a data connection (the core's operation timeout bounds them).
    parked: Vec<kvferry_core::TransferOp>,
    /// The session's queue pair when the node moves data over RDMA.
    #[cfg(feature = "rdma")]
    rdma: Option<rdma::SessionRdma>,
}

/// One data connection of a session: prefill writes on it, decode serves writes from it.
enum DataConn {
    Sender(DataSender),
    Receiver(JoinHandle<()>),
}

impl DataConn {
    /// Closes the connection and waits until nothing of it can write any more.
    async fn close(self) {
        match self {
            DataConn::Sender(s) => s.close().await,
            DataConn::Receiver(t) => {
                t.abort();
                let _ = t.await;
            }
        }
    }
}

struct Inner {
    endpoint: Endpoint,
    io: Map<SessionId, SessionIo>,
    rooms: RoomBook,
    armed: Option<Instant>,
    metrics_at: Instant,
    /// Where each target lives.
    targets: Map<TargetId, SocketAddr>,
}

struct Shared {
    inner: Mutex<Inner>,
    wake: Notify,
    memory: Arc<MemoryMap>,
    events: broadcast::Sender<Event>,
    runtime: tokio::runtime::Handle,
    data_connections: usize,
    info: EndpointInfo,
    limits: Limits,
    /// TLS on every connection, when configured.
    tls: Option<TlsSetup>,
    faults: Mutex<Option<FaultPlan>>,
    announcements: Announcer,
    /// How each peer named through [`KvNode`] is reached, one link per peer address.
    peers: Mutex<Vec<Vec<Link>>>,
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
    _last: Arc<StopOnDrop>,
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
    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
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
        let shared = Arc::new(Shared {
            inner: Mutex::new(Inner {
                endpoint,
                io: Map::default(),
                rooms: RoomBook::new(config.info.role),
                armed: None,
                metrics_at: now,
                targets: Map::default(),
            }),
            wake: Notify::new(),
            memory,
            events,
            runtime: tokio::runtime::Handle::current(),
            data_connections: config.data_connections.max(1),
            info: config.info,
            limits,
            tls,
            faults: Mutex::new(config.faults),
            announcements: Announcer::default(),
            peers: Mutex::new(Vec::new()),
            stopped,
            #[cfg(feature = "rdma")]
            rdma,
        });
        let weak = Arc::downgrade(&shared);
        let role = shared.info.role;
        tokio::spawn(drive(weak).instrument(info_span!("kvferry_driver", ?role)));
        Ok(Node {
            _last: Arc::new(StopOnDrop(shared.clone())),
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
        use kvferry_core::SessionState;
        let tls = self.shared.tls.clone();
        let stream = connect_control(addr, tls.as_ref()).await?;
        let mut events = self.shared.events.subscribe();
        let sid = attach_control(&self.shared, stream, Some(addr), None);
        let deadline = tokio::time::Instant::now() + self.config().handshake_timeout;
        let mut refusal: Option<NodeError> = None;
        // A refusal explains a closed session; events are sent before the lock is released,
        // so reading them after seeing the state misses none.
        let read_refusal = |events: &mut broadcast::Receiver<Event>,
                            refusal: &mut Option<NodeError>| loop {
            match events.try_recv() {
                Ok(Event::PeerError {
                    session,
                    code,
                    detail,
                }) if session == sid => {
                    refusal.get_or_insert(NodeError::Refused(format!("{code:?}: {detail}")));
                }
                Ok(Event::SessionRejected { session, reason }) if session == sid => {
                    *refusal = Some(NodeError::Rejected(reason));
                }
                Ok(_) | Err(broadcast::error::TryRecvError::Lagged(_)) => {}
                Err(_) => break,
            }
        };
        loop {
            let state = self.shared.lock().endpoint.session_state(sid);
            match state {
                Some(SessionState::Established | SessionState::Blacklisted) => return Ok(sid),
                None | Some(SessionState::Closing) => {
                    read_refusal(&mut events, &mut refusal);
                    return Err(refusal.unwrap_or(NodeError::HandshakeTimeout));
                }
                Some(SessionState::Handshaking) => {}
            }
            match tokio::time::timeout_at(deadline, events.recv()).await {
                Err(_) => return Err(NodeError::HandshakeTimeout),
                Ok(Err(broadcast::error::RecvError::Closed)) => return Err(NodeError::ShutDown),
                Ok(Ok(Event::PeerError {
                    session,
                    code,
                    detail,
                })) if session == sid => {
                    refusal.get_or_insert(NodeError::Refused(format!("{code:?}: {detail}")));
                }
                Ok(Ok(Event::SessionRejected { session, reason })) if session == sid => {
                    refusal = Some(NodeError::Rejected(reason));
                }
                Ok(_) => {}
            }
        }
    }

    /// Keeps a session to the peer at `addr`, reconnecting with the core's backoff whenever it
    /// drops (a restarted peer is picked up without restarting this node). Rooms use the
    /// current session from [`Node::target_session`].
    pub fn connect_persistent(&self, addr: SocketAddr) -> TargetId {
        let mut inner = self.shared.lock();
        let target = inner.endpoint.add_target(Instant::now());
        inner.targets.insert(target, addr);
        drain(&self.shared, &mut inner);
        target
    }

    /// The established session of a persistent peer, if it has one right now.
    pub fn target_session(&self, target: TargetId) -> Option<SessionId> {
        self.shared.lock().endpoint.target_session(target)
    }

    /// The core's configuration.
    pub fn config(&self) -> Config {
        self.shared.lock().endpoint.config().clone()
    }

    /// The registered memory.
    pub fn memory(&self) -> &Arc<MemoryMap> {
        &self.shared.memory
    }

    /// A snapshot of the core's counters.
    pub fn counters(&self) -> Counters {
        self.shared.lock().endpoint.counters().clone()
    }

    /// The state of a room (live or remembered).
    pub fn room_state(&self, room: RoomId) -> Option<KvPoll> {
        self.shared.lock().endpoint.room_state(room)
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
        let mut inner = self.shared.lock();
        let out = f(&mut inner.endpoint, Instant::now());
        drain(&self.shared, &mut inner);
        out
    }

    fn watch_room(&self, room: RoomId, state: KvPoll) -> RoomHandle {
        let mut inner = self.shared.lock();
        let current = inner.endpoint.room_state(room).unwrap_or(state);
        inner.rooms.watch(room, current)
    }

    /// Decode: opens a receiver room fed by `sources`; see [`Endpoint::open_receiver`].
    pub fn open_receiver(
        &self,
        room: RoomId,
        generation: Generation,
        sources: &[SessionId],
        grant: Option<Grant>,
    ) -> Result<RoomHandle, ApiError> {
        let handle = self.watch_room(room, KvPoll::Bootstrapping);
        match self.with(|e, now| e.open_receiver(now, room, generation, sources, grant)) {
            Ok(()) => Ok(handle),
            Err(err) => {
                self.forget_room(room);
                Err(err)
            }
        }
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
        let handle = self.watch_room(room, KvPoll::Bootstrapping);
        match self.with(|e, now| e.open_sender(now, room, generation)) {
            Ok(()) => Ok(handle),
            Err(err) => {
                self.forget_room(room);
                Err(err)
            }
        }
    }

    fn forget_room(&self, room: RoomId) {
        let mut inner = self.shared.lock();
        if inner.endpoint.room_generation(room).is_none() {
            inner.rooms.forget(room);
        }
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
        let mut events = self.shared.events.subscribe();
        let complete = self.with(|e, now| {
            e.shutdown(now);
            e.shutdown_complete()
        });
        // A second call finds the shutdown complete already: its event went out before.
        if !complete {
            loop {
                match events.recv().await {
                    Ok(Event::ShutDown { .. }) | Err(broadcast::error::RecvError::Closed) => break,
                    Err(broadcast::error::RecvError::Lagged(_))
                        if self.shared.lock().endpoint.shutdown_complete() =>
                    {
                        break
                    }
                    Ok(_) | Err(broadcast::error::RecvError::Lagged(_)) => {}
                }
            }
        }
        let _ = self.shared.stopped.send(true);
        self.shared.wake.notify_one();
    }
}

impl Node {
    /// The links that carry `room` from or to each of `peers` (address `room mod n`).
    fn links_for(&self, room: RoomId, peers: &[PeerId]) -> Result<Vec<Link>, NodeError> {
        let table = self.shared.peers.lock().unwrap_or_else(|p| p.into_inner());
        peers
            .iter()
            .map(|p| {
                let links = table.get(p.0 as usize).ok_or(NodeError::UnknownPeer(*p))?;
                Ok(links[shard_of(room, links.len())])
            })
            .collect()
    }

    fn add_peer(&self, links: Vec<Link>) -> PeerId {
        let mut table = self.shared.peers.lock().unwrap_or_else(|p| p.into_inner());
        table.push(links);
        PeerId(table.len() as u32 - 1)
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
        Ok(self.add_peer(links))
    }

    async fn connect_persistent(&self, addrs: Vec<SocketAddr>) -> Result<PeerId, NodeError> {
        let links = addrs
            .into_iter()
            .map(|a| Link::Target(Node::connect_persistent(self, a)))
            .collect();
        Ok(self.add_peer(links))
    }

    async fn open_receiver(
        &self,
        room: RoomId,
        generation: Generation,
        peers: Vec<PeerId>,
        grant: Option<Grant>,
    ) -> Result<RoomHandle, NodeError> {
        let links = self.links_for(room, &peers)?;
        let handle = self.watch_room(room, KvPoll::Bootstrapping);
        match self.with(|e, now| e.open_receiver_via(now, room, generation, &links, grant)) {
            Ok(()) => Ok(handle),
            Err(err) => {
                self.forget_room(room);
                Err(err.into())
            }
        }
    }

    async fn grant_pages(&self, room: RoomId, grant: Grant) -> Result<(), NodeError> {
        Ok(Node::grant_pages(self, room, grant)?)
    }

    async fn open_sender(
        &self,
        room: RoomId,
        generation: Generation,
    ) -> Result<RoomHandle, NodeError> {
        Ok(Node::open_sender(self, room, generation)?)
    }

    async fn send_chunk(&self, room: RoomId, chunk: Chunk) -> Result<(), NodeError> {
        Ok(Node::send_chunk(self, room, chunk)?)
    }

    async fn mark_layer_ready(&self, rooms: Vec<RoomId>, layer: u16) -> Result<(), NodeError> {
        Ok(Node::mark_layer_ready(self, &rooms, layer)?)
    }

    async fn set_capacity(&self, capacity: Capacity) {
        Node::set_capacity(self, capacity);
    }

    async fn set_queue_position(&self, room: RoomId, position: u32) -> Result<(), NodeError> {
        Ok(Node::set_queue_position(self, room, position)?)
    }

    async fn set_faults(&self, faults: Option<FaultPlan>) {
        Node::set_faults(self, faults);
    }

    async fn abort(&self, room: RoomId) -> Result<(), NodeError> {
        Ok(Node::abort(self, room)?)
    }

    async fn counters(&self) -> Counters {
        Node::counters(self)
    }

    fn room_announcements(&self) -> mpsc::UnboundedReceiver<Announcement> {
        Node::room_announcements(self)
    }

    async fn shutdown(&self) {
        Node::shutdown(self).await;
    }
}

/// The single driver task: arms one timer from the core's deadline and feeds it back.
async fn drive(weak: Weak<Shared>) {
    loop {
        let Some(shared) = weak.upgrade() else { return };
        if *shared.stopped.borrow() {
            return;
        }
        let deadline = {
            let mut inner = shared.lock();
            let now = Instant::now();
            if inner.endpoint.poll_timeout().is_some_and(|(t, _)| t <= now) {
                inner.endpoint.handle_timeout(now);
                drain(&shared, &mut inner);
            }
            if now.duration_since(inner.metrics_at) >= Duration::from_millis(500) {
                inner.metrics_at = now;
                export_metrics(&inner.endpoint, shared.info.role);
            }
            let next = inner.endpoint.poll_timeout().map(|(t, _)| t);
            inner.armed = next;
            next
        };
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

/// Drains every output of the core, in the documented order, after an input.
fn drain(shared: &Arc<Shared>, inner: &mut Inner) {
    loop {
        let mut progressed = false;
        let mut buf = Vec::new();
        while let Some(sid) = inner.endpoint.poll_transmit(&mut buf) {
            progressed = true;
            if let Some(io) = inner.io.get(&sid) {
                let _ = io.control_tx.send(std::mem::take(&mut buf));
            } else {
                buf.clear();
            }
        }
        while let Some(action) = inner.endpoint.poll_action() {
            progressed = true;
            match action {
                Action::FenceSession(sid) => start_fence(shared, inner, sid),
                Action::CloseSession(sid) => start_close(shared, inner, sid),
                Action::Connect { target, timeout } => {
                    start_connect(shared, inner, target, timeout)
                }
                Action::OpenDataConnection(sid) => open_data_connections(shared, inner, sid, 1),
            }
        }
        let now = Instant::now();
        while let Some(op) = inner.endpoint.poll_transfer(now) {
            progressed = true;
            #[cfg(feature = "rdma")]
            if let Some(node) = shared.rdma.clone() {
                rdma::post(inner, &node, op);
                continue;
            }
            let id = op.id;
            match inner.io.get_mut(&op.session) {
                Some(io) if !io.data.is_closing() => {
                    if let Err(op) = dispatch(io, op) {
                        // No data connection yet (or all broke): wait for one to attach.
                        io.parked.push(op);
                    }
                }
                _ => inner
                    .endpoint
                    .handle_transfer_result(now, id, TransferOutcome::Transient),
            }
        }
        while let Some(event) = inner.endpoint.poll_event() {
            progressed = true;
            on_event(shared, inner, &event);
            let _ = shared.events.send(event);
        }
        if !progressed {
            break;
        }
    }
    if inner.endpoint.poll_timeout().map(|(t, _)| t) < inner.armed || inner.armed.is_none() {
        shared.wake.notify_one();
    }
}

/// Hands an operation to the next open data connection of the session, round-robin.
fn dispatch(
    io: &mut SessionIo,
    op: kvferry_core::TransferOp,
) -> Result<(), kvferry_core::TransferOp> {
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

/// Reports every parked operation of a session as transient (it was never written).
fn unpark(inner: &mut Inner, sid: SessionId) {
    let parked = inner
        .io
        .get_mut(&sid)
        .map(|io| std::mem::take(&mut io.parked))
        .unwrap_or_default();
    let now = Instant::now();
    for op in parked {
        inner
            .endpoint
            .handle_transfer_result(now, op.id, TransferOutcome::Transient);
    }
}

fn on_event(shared: &Arc<Shared>, inner: &mut Inner, event: &Event) {
    match *event {
        ref e if RoomBook::follows(e) => inner.rooms.on_event(event),
        Event::SessionEstablished { session, peer } => {
            info!(%session, node = %peer.node, role = ?peer.role, rank = peer.rank, "session established");
            #[cfg(feature = "rdma")]
            if let Some(node) = shared.rdma.clone() {
                rdma::establish(shared, inner, &node, session);
                return;
            }
            open_data_connections(shared, inner, session, shared.data_connections);
        }
        Event::RoomAnnounced { .. } => shared.announcements.on_event(event),
        #[cfg(feature = "rdma")]
        Event::TransportReceived {
            session,
            ref payload,
        } => {
            if let Some(node) = shared.rdma.clone() {
                rdma::on_hello(shared, inner, &node, session, payload);
            }
        }
        Event::SessionBlacklisted { session } => warn!(%session, "session blacklisted"),
        Event::SessionRecovered { session } => info!(%session, "session recovered"),
        _ => {}
    }
}

/// Registers a control connection with the core and starts its reader and writer.
fn attach_control(
    shared: &Arc<Shared>,
    stream: Conn,
    peer_addr: Option<SocketAddr>,
    target: Option<TargetId>,
) -> SessionId {
    let _ = stream.tcp().set_nodelay(true);
    let (mut read, mut write) = tokio::io::split(stream);
    let (tx, mut rx) = mpsc::unbounded_channel::<Vec<u8>>();
    let mut inner = shared.lock();
    let sid = match (target, peer_addr) {
        (Some(t), _) => inner.endpoint.open_session_for(Instant::now(), t),
        (None, Some(_)) => inner.endpoint.open_session(Instant::now()),
        (None, None) => inner.endpoint.accept_session(Instant::now()),
    };
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
    let weak = Arc::downgrade(shared);
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
                let mut inner = shared.lock();
                let used = inner.endpoint.handle_input(Instant::now(), sid, &buf);
                drain(&shared, &mut inner);
                drop(inner);
                buf.drain(..used.min(buf.len()));
            }
            if let Some(shared) = weak.upgrade() {
                debug!("control connection ended");
                let mut inner = shared.lock();
                start_close(&shared, &mut inner, sid);
            }
        }
        .instrument(span),
    );
    inner.io.insert(
        sid,
        SessionIo {
            control_tx: tx,
            tasks: vec![writer, reader],
            peer_addr,
            data: ConnSet::default(),
            next_sender: 0,
            parked: Vec::new(),
            #[cfg(feature = "rdma")]
            rdma: None,
        },
    );
    drain(shared, &mut inner);
    sid
}

async fn accept(weak: Weak<Shared>, tcp: TcpStream, peer: SocketAddr) {
    // A connection that says nothing gets as long as a handshake, then is dropped.
    let Some((tls, wait)) = weak.upgrade().map(|s| {
        let wait = s.lock().endpoint.config().handshake_timeout;
        (s.tls.clone(), wait)
    }) else {
        return;
    };
    let opened = async {
        let mut stream = accept_conn(tcp, tls.as_ref())
            .await
            .map_err(kvferry_tcp::ServeError::Io)?;
        let preamble = read_preamble(&mut stream).await?;
        Ok::<_, kvferry_tcp::ServeError>((stream, preamble))
    };
    let (mut stream, preamble) = match tokio::time::timeout(wait, opened).await {
        Ok(Ok(p)) => p,
        Ok(Err(e)) => {
            warn!(%peer, error = %e, "refused a connection");
            return;
        }
        Err(_) => {
            warn!(%peer, "no preamble in time; connection dropped");
            return;
        }
    };
    let Some(shared) = weak.upgrade() else { return };
    match preamble {
        Preamble::Control => {
            attach_control(&shared, stream, None, None);
        }
        Preamble::Data => {
            // The core's challenge; the answer names the session and proves its key.
            let (challenge, wait) = {
                let mut inner = shared.lock();
                let wait = inner.endpoint.config().handshake_timeout;
                (inner.endpoint.data_challenge(), wait)
            };
            let hello =
                match tokio::time::timeout(wait, challenge_data(&mut stream, &challenge)).await {
                    Ok(Ok(hello)) => hello,
                    Ok(Err(e)) => {
                        debug!(%peer, error = %e, "data connection ended before its hello");
                        return;
                    }
                    Err(_) => {
                        warn!(%peer, "no data hello in time; connection dropped");
                        return;
                    }
                };
            let admitted = shared
                .lock()
                .endpoint
                .admit_data(&challenge, &hello.tag, &hello.proof);
            match admitted {
                Ok(sid) => {
                    if answer_data(&mut stream, true).await.is_ok() {
                        attach_data(&shared, sid, stream);
                    }
                }
                Err(refusal) => {
                    warn!(%peer, %refusal, "data connection refused");
                    let _ = answer_data(&mut stream, false).await;
                }
            }
        }
    }
}

/// Puts an accepted or opened data connection to work for `sid`, by role.
fn attach_data(shared: &Arc<Shared>, sid: SessionId, stream: Conn) {
    let mut inner = shared.lock();
    let Some(io) = inner.io.get_mut(&sid) else {
        return;
    };
    if io.data.is_closing() {
        return; // dropping the stream closes it
    }
    match shared.info.role {
        Role::Prefill => {
            let weak = Arc::downgrade(shared);
            let report: Report = Arc::new(move |id: TransferId, outcome: TransferOutcome| {
                if let Some(shared) = weak.upgrade() {
                    let mut inner = shared.lock();
                    inner
                        .endpoint
                        .handle_transfer_result(Instant::now(), id, outcome);
                    drain(&shared, &mut inner);
                }
            });
            let sender = DataSender::spawn(stream, shared.memory.clone(), report);
            // Cannot be refused: checked under this same lock above.
            let _ = io.data.attach(DataConn::Sender(sender));
            for op in std::mem::take(&mut io.parked) {
                if let Err(op) = dispatch(io, op) {
                    io.parked.push(op);
                }
            }
        }
        Role::Decode => {
            let weak = Arc::downgrade(shared);
            let check: Arc<dyn WriteCheck + Send + Sync> = Arc::new(CoreCheck {
                access: SharedAccess(Arc::downgrade(shared)),
                session: sid,
            });
            let memory = shared.memory.clone();
            let limits = shared.limits;
            let task = shared.runtime.spawn(
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
                    data_connection_lost(&weak, sid);
                }
                .instrument(info_span!("kvferry_data", session = %sid)),
            );
            let _ = io.data.attach(DataConn::Receiver(task));
        }
    }
    // Operations may have been waiting for a connection.
    drain(shared, &mut inner);
}

/// Opens `n` data connections of `sid` if this side dialed it (it knows the peer's address)
/// and its handshake gave it a key; each proves the key.
fn open_data_connections(shared: &Arc<Shared>, inner: &Inner, sid: SessionId, n: usize) {
    let Some(addr) = inner
        .io
        .get(&sid)
        .filter(|io| !io.data.is_closing())
        .and_then(|io| io.peer_addr)
    else {
        return;
    };
    if let Some(key) = inner.endpoint.data_key(sid) {
        open_data_connections_n(shared, sid, addr, n, key);
    }
}

/// Opens `n` data connections of `sid`, each proving the session's `key`.
fn open_data_connections_n(
    shared: &Arc<Shared>,
    sid: SessionId,
    addr: SocketAddr,
    n: usize,
    key: SessionKey,
) {
    for _ in 0..n {
        let weak = Arc::downgrade(shared);
        let key = key.clone();
        let tls = shared.tls.clone();
        shared.runtime.spawn(async move {
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

/// Carries out a connect the core asked for; a failure is reported back to it.
fn start_connect(shared: &Arc<Shared>, inner: &mut Inner, target: TargetId, timeout: Duration) {
    let Some(&addr) = inner.targets.get(&target) else {
        return;
    };
    let weak = Arc::downgrade(shared);
    let tls = shared.tls.clone();
    shared.runtime.spawn(async move {
        let result = match tokio::time::timeout(timeout, connect_control(addr, tls.as_ref())).await
        {
            Ok(r) => r,
            Err(_) => Err(std::io::Error::from(std::io::ErrorKind::TimedOut)),
        };
        let Some(shared) = weak.upgrade() else { return };
        match result {
            Ok(stream) => {
                attach_control(&shared, stream, Some(addr), Some(target));
            }
            Err(e) => {
                debug!(%target, %addr, error = %e, "connect failed");
                let mut inner = shared.lock();
                inner
                    .endpoint
                    .handle_connect_failed(Instant::now(), target, connect_failure(&e));
                drain(&shared, &mut inner);
            }
        }
    });
}

/// Carries out a fence: close the session's data connections, wait until nothing of them can
/// write, confirm to the core, then re-open them if this side opens data connections.
fn start_fence(shared: &Arc<Shared>, inner: &mut Inner, sid: SessionId) {
    unpark(inner, sid);
    #[cfg(feature = "rdma")]
    if shared.rdma.is_some() {
        rdma::fence(shared, inner, sid);
        return;
    }
    let Some(io) = inner.io.get_mut(&sid) else {
        inner.endpoint.handle_fence_complete(Instant::now(), sid);
        return;
    };
    let conns = io.data.fence();
    let weak = Arc::downgrade(shared);
    shared.runtime.spawn(async move {
        for c in conns {
            c.close().await;
        }
        let Some(shared) = weak.upgrade() else { return };
        let mut inner = shared.lock();
        inner.endpoint.handle_fence_complete(Instant::now(), sid);
        drain(&shared, &mut inner);
        info!(session = %sid, "session fenced");
        open_data_connections(&shared, &inner, sid, shared.data_connections);
    });
}

/// Carries out a close: stop every connection of the session, then tell the core.
fn start_close(shared: &Arc<Shared>, inner: &mut Inner, sid: SessionId) {
    unpark(inner, sid);
    let Some(io) = inner.io.get_mut(&sid) else {
        return;
    };
    let Some(conns) = io.data.close() else {
        return; // already closing
    };
    let tasks = std::mem::take(&mut io.tasks);
    #[cfg(feature = "rdma")]
    if let Some(r) = io.rdma.take() {
        r.close();
    }
    let weak = Arc::downgrade(shared);
    shared.runtime.spawn(async move {
        // Let the writer flush a final error frame before the socket goes.
        tokio::time::sleep(Duration::from_millis(10)).await;
        for c in conns {
            c.close().await;
        }
        for t in tasks {
            t.abort();
            let _ = t.await;
        }
        let Some(shared) = weak.upgrade() else { return };
        let mut inner = shared.lock();
        inner.io.remove(&sid);
        inner.endpoint.handle_disconnected(Instant::now(), sid);
        drain(&shared, &mut inner);
    });
}

/// A data connection of `sid` ended on its own: the core decides whether and when it is
/// replaced ([`Action::OpenDataConnection`]).
fn data_connection_lost(weak: &Weak<Shared>, sid: SessionId) {
    let Some(shared) = weak.upgrade() else { return };
    let mut inner = shared.lock();
    if let Some(io) = inner.io.get_mut(&sid) {
        io.data.retain(|c| match c {
            DataConn::Receiver(t) => !t.is_finished(),
            DataConn::Sender(_) => true,
        });
    }
    inner
        .endpoint
        .handle_data_connection_lost(Instant::now(), sid);
    drain(&shared, &mut inner);
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
        let mut inner = shared.lock();
        let out = f(&mut inner.endpoint, Instant::now());
        if after(&out) {
            drain(&shared, &mut inner);
        }
        Some(out)
    }

    fn faults(&self) -> Option<FaultPlan> {
        self.0
            .upgrade()
            .and_then(|s| s.faults.lock().ok().and_then(|f| *f))
    }
}
