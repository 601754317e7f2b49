//! The embedder's API, written once for every runtime: [`Node`]. How a call reaches the
//! driver of one shard is all a runtime supplies ([`Shards`]: a lock on tokio, a closure sent
//! to the shard's thread on glommio), with its listeners and its shutdown. Room `r` lives on
//! shard `r mod shards` ([`shard_of`]); a peer is the list of its addresses on every shard.

use std::future::Future;
use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use kvferry_core::{
    ApiError, Capacity, Chunk, Config, Counters, Endpoint, Event, FailureReason, Generation, Grant,
    KvPoll, Link, PromptDigest, Role, RoomId, SessionId, TargetId,
};
use kvferry_memory::MemoryMap;
use tokio::sync::{broadcast, mpsc, oneshot};

use crate::{
    shard_of, Announcement, Announcer, Answer, DataPath, EventSink, FaultPlan, NodeError, PeerId,
};
use crate::{Driver, Host, RoomHandle};

/// A future a runtime hands back from a [`Shards`] method.
pub type ShardFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// An embedder's call, run on one shard's driver.
pub type ShardCall = Box<dyn FnOnce(&mut dyn DriverCalls) + Send>;

/// What a runtime supplies under a [`Node`]: how a call reaches the driver of one of its
/// shards, how it listens, how it shuts down. Dropping it (with the node's last clone) stops
/// the node's tasks.
pub trait Shards: Send + Sync + 'static {
    /// How many shards (drivers) the node runs; a tokio node is one.
    fn count(&self) -> usize;

    /// Runs `call` on the driver of `shard`; `ShutDown` when the shard is gone (the call
    /// never ran).
    fn call(&self, shard: usize, call: ShardCall) -> ShardFuture<'static, Result<(), NodeError>>;

    /// Accepts peers on `addr` (port 0: any); one address per shard.
    fn listen(&self, addr: SocketAddr) -> ShardFuture<'_, Result<Vec<SocketAddr>, NodeError>>;

    /// Closes the listeners, then fails every room, tells every peer and closes every
    /// connection; ends once the core says the shutdown is complete. Runs to its end even if
    /// the caller stops waiting.
    fn shutdown(&self) -> ShardFuture<'static, ()>;
}

/// How [`DriverCalls::open_room`] opens a room on the core.
pub type RoomOpen<'a> = Box<dyn FnOnce(&mut Endpoint, Instant) -> Result<(), ApiError> + 'a>;

/// A shard's driver as an embedder's call sees it, whatever runtime it runs on.
pub trait DriverCalls {
    /// The core.
    fn endpoint(&self) -> &Endpoint;
    /// The core, to hand it an input; [`DriverCalls::drain`] after.
    fn endpoint_mut(&mut self) -> &mut Endpoint;
    /// Carries out what the core asked for since the last drain.
    fn drain(&mut self);
    /// [`Driver::dial`].
    fn dial(&mut self, addr: SocketAddr, tx: Answer);
    /// [`Driver::add_target`].
    fn add_target(&mut self, addr: SocketAddr) -> Result<TargetId, ApiError>;
    /// [`Driver::on_target`].
    fn on_target(&mut self, target: TargetId, tx: Answer);
    /// [`Driver::take_let_go`].
    fn take_let_go(&mut self) -> Vec<TargetId>;
    /// [`Driver::disconnect`].
    fn disconnect(&mut self, links: &[Link]);
    /// [`Driver::set_faults`].
    fn set_faults(&mut self, faults: Option<FaultPlan>);
    /// [`Driver::open_room`].
    fn open_room(&mut self, room: RoomId, open: RoomOpen<'_>) -> Result<RoomHandle, ApiError>;
    /// [`Driver::session_paths`].
    fn session_paths(&self) -> Vec<(SessionId, DataPath)>;
    /// [`Driver::session_data_connections`].
    fn session_data_connections(&self) -> Vec<(SessionId, usize)>;
}

impl<H: Host> DriverCalls for Driver<H> {
    fn endpoint(&self) -> &Endpoint {
        Driver::endpoint(self)
    }
    fn endpoint_mut(&mut self) -> &mut Endpoint {
        Driver::endpoint_mut(self)
    }
    fn drain(&mut self) {
        Driver::drain(self);
    }
    fn dial(&mut self, addr: SocketAddr, tx: Answer) {
        Driver::dial(self, addr, tx);
    }
    fn add_target(&mut self, addr: SocketAddr) -> Result<TargetId, ApiError> {
        Driver::add_target(self, addr)
    }
    fn on_target(&mut self, target: TargetId, tx: Answer) {
        Driver::on_target(self, target, tx);
    }
    fn take_let_go(&mut self) -> Vec<TargetId> {
        Driver::take_let_go(self)
    }
    fn disconnect(&mut self, links: &[Link]) {
        Driver::disconnect(self, links);
    }
    fn set_faults(&mut self, faults: Option<FaultPlan>) {
        Driver::set_faults(self, faults);
    }
    fn open_room(&mut self, room: RoomId, open: RoomOpen<'_>) -> Result<RoomHandle, ApiError> {
        Driver::open_room(self, room, open)
    }
    fn session_paths(&self) -> Vec<(SessionId, DataPath)> {
        Driver::session_paths(self)
    }
    fn session_data_connections(&self) -> Vec<(SessionId, usize)> {
        Driver::session_data_connections(self)
    }
}

/// Runs `f` on the core of `d`, then drains what it asked for (the core's rule after every
/// input).
fn with<T>(d: &mut dyn DriverCalls, f: impl FnOnce(&mut Endpoint, Instant) -> T) -> T {
    let out = f(d.endpoint_mut(), Instant::now());
    d.drain();
    out
}

/// A running kvferry node, prefill or decode, on any runtime: the embedder's API. Open rooms,
/// send chunks, mark layers ready, abort, and await a room's terminal state and release
/// through a cancel-safe [`RoomHandle`]. Cheap to clone, `Send + Sync`, and every future it
/// returns is `Send`, so any executor can await it; the last clone dropped (or
/// [`Node::shutdown`]) stops its tasks.
#[derive(Clone)]
pub struct Node {
    inner: Arc<NodeInner>,
}

/// What a runtime hands [`Node::new`]: its shards and what it started them with.
pub struct NodeParts {
    /// How calls reach the node's shards.
    pub shards: Box<dyn Shards>,
    /// Which runtime runs it (`"tokio"`, `"glommio"`).
    pub runtime: &'static str,
    /// Which data plane carries its operations (`"tcp"`, `"rdma"`).
    pub backend: &'static str,
    /// Prefill or decode.
    pub role: Role,
    /// The core's configuration (every shard's).
    pub config: Config,
    /// The registered memory.
    pub memory: Arc<MemoryMap>,
    /// Where the shards announce the rooms decodes ask for.
    pub announcements: Announcer,
    /// Where the shards' drivers publish every core event.
    pub events: EventSink,
    /// The cores the node's shards are pinned to, in shard order (empty: none pinned).
    pub pinned_cores: Vec<usize>,
}

struct NodeInner {
    parts: NodeParts,
    peers: Mutex<PeerTable>,
}

impl std::fmt::Debug for Node {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let p = &self.inner.parts;
        f.debug_struct("Node")
            .field("runtime", &p.runtime)
            .field("role", &p.role)
            .field("shards", &p.shards.count())
            .finish_non_exhaustive()
    }
}

/// Per peer, per shard of this node: the links to each of the peer's addresses. A peer
/// disconnected or let go leaves no entry; ids are not reused.
#[derive(Debug, Default)]
struct PeerTable {
    next: u32,
    links: std::collections::HashMap<u32, Vec<Vec<Link>>>,
}

impl PeerTable {
    fn add(&mut self, per_shard: Vec<Vec<Link>>) -> PeerId {
        let id = self.next;
        self.next = self.next.wrapping_add(1);
        self.links.insert(id, per_shard);
        PeerId(id)
    }

    /// Forgets every peer with a link among `targets` of `shard` (the core let them go as
    /// idle). Its other links stay with their cores until those let them go too: a room may
    /// still be on one, and no new room can reach them.
    fn forget(&mut self, shard: usize, targets: &[TargetId]) {
        if targets.is_empty() {
            return;
        }
        self.links.retain(|_, per_shard| {
            !per_shard.get(shard).is_some_and(|links| {
                links
                    .iter()
                    .any(|l| matches!(l, Link::Target(t) if targets.contains(t)))
            })
        });
    }
}

fn api<T>(result: Result<Result<T, ApiError>, NodeError>) -> Result<T, NodeError> {
    result?.map_err(NodeError::from)
}

impl Node {
    /// The node a runtime started, with no peer yet.
    pub fn new(parts: NodeParts) -> Node {
        Node {
            inner: Arc::new(NodeInner {
                parts,
                peers: Mutex::new(PeerTable::default()),
            }),
        }
    }

    /// Runs `f` on the driver of `shard` and gives back its result (`ShutDown` when the
    /// shard is gone).
    async fn call<T: Send + 'static>(
        &self,
        shard: usize,
        f: impl FnOnce(&mut dyn DriverCalls) -> T + Send + 'static,
    ) -> Result<T, NodeError> {
        let (tx, rx) = oneshot::channel();
        let call: ShardCall = Box::new(move |d| {
            let _ = tx.send(f(d));
        });
        self.inner.parts.shards.call(shard, call).await?;
        rx.await.map_err(|_| NodeError::ShutDown)
    }

    /// Which runtime runs this node (`"tokio"`, `"glommio"`).
    pub fn runtime(&self) -> &'static str {
        self.inner.parts.runtime
    }

    /// Which data plane carries its operations (`"tcp"`, `"rdma"`).
    pub fn backend(&self) -> &'static str {
        self.inner.parts.backend
    }

    /// The registered memory the node moves bytes from and into.
    pub fn memory(&self) -> &Arc<MemoryMap> {
        &self.inner.parts.memory
    }

    /// How many shards own rooms (1 on tokio).
    pub fn shards(&self) -> usize {
        self.inner.parts.shards.count()
    }

    /// The core each shard is pinned to, in shard order; empty when no shard is pinned
    /// (a glommio node's `ShardConfig::pin`).
    pub fn pinned_cores(&self) -> &[usize] {
        &self.inner.parts.pinned_cores
    }

    /// The core's configuration.
    pub fn config(&self) -> &Config {
        &self.inner.parts.config
    }

    /// Every core event from now on, of every shard (a subscriber lagging by more than 65536
    /// loses the oldest).
    pub fn subscribe(&self) -> broadcast::Receiver<Event> {
        self.inner.parts.events.subscribe()
    }

    /// Prefill: every room a decode asks for, lossless: those no receiver took yet (asked
    /// for before this call) come first. One receiver at a time; this one replaces the last.
    pub fn room_announcements(&self) -> mpsc::UnboundedReceiver<Announcement> {
        self.inner.parts.announcements.subscribe()
    }

    /// Accepts peers on `addr` (port 0: any); returns one address per shard.
    pub async fn listen(&self, addr: SocketAddr) -> Result<Vec<SocketAddr>, NodeError> {
        self.check_listen(addr).await?;
        let bound = self.inner.parts.shards.listen(addr).await?;
        tracing::info!(target: crate::START_TARGET, runtime = self.runtime(), addrs = ?bound, "kvferry node listening");
        Ok(bound)
    }

    /// Fails every room, tells every peer, closes every connection and listener, and waits
    /// until the core says it is done. A caller that stops waiting does not leave the node
    /// half shut down.
    pub async fn shutdown(&self) {
        self.inner.parts.shards.shutdown().await;
    }

    /// The state of a room (live or remembered).
    pub async fn room_state(&self, room: RoomId) -> Option<KvPoll> {
        self.on_room(room, move |d| d.endpoint().room_state(room))
            .await
            .ok()
            .flatten()
    }

    /// Fails a room softly (consensus verdicts); `false` if it was already terminal or the
    /// node is shut down.
    pub async fn fail_room(&self, room: RoomId, reason: FailureReason) -> bool {
        self.on_room(room, move |d| {
            with(d, |e, now| e.fail_room(now, room, reason))
        })
        .await
        .unwrap_or(false)
    }

    /// Opens sessions from every shard to each of a peer's `addrs` (one per shard of the
    /// peer) and waits for their handshakes; names the peer. If one fails, the sessions
    /// opened so far are closed again: a failed call leaves nothing behind. Each connection
    /// gets one attempt of at most 8 x `connect_timeout` (a link slower than
    /// `connect_timeout` is still reached; one that never answers fails after it).
    pub async fn connect(&self, addrs: Vec<SocketAddr>) -> Result<PeerId, NodeError> {
        let mut per_shard = Vec::with_capacity(self.shards());
        for shard in 0..self.shards() {
            per_shard.push(Vec::with_capacity(addrs.len()));
            for &addr in &addrs {
                let (tx, rx) = oneshot::channel();
                // The dial is bounded by the core's connect timeout, the handshake by its
                // handshake timeout.
                let opened = match self.call(shard, move |d| d.dial(addr, tx)).await {
                    Ok(()) => rx.await.map_err(|_| NodeError::ShutDown).and_then(|r| r),
                    Err(e) => Err(e),
                };
                match opened {
                    Ok(session) => per_shard[shard].push(Link::Session(session)),
                    Err(e) => {
                        self.let_go(per_shard).await;
                        return Err(e);
                    }
                }
            }
        }
        Ok(self.add_peer(per_shard))
    }

    /// Lets a peer go: its kept links are dialed no more, its sessions close (rooms still
    /// on them fail `AbortedLocally`; the peer hears an orderly goodbye), waits for it end
    /// with [`NodeError::Disconnected`], and its id is unknown from now on.
    pub async fn disconnect(&self, peer: PeerId) -> Result<(), NodeError> {
        let per_shard = {
            let mut table = self.table();
            table
                .links
                .remove(&peer.0)
                .ok_or(NodeError::UnknownPeer(peer))?
        };
        self.let_go(per_shard).await;
        Ok(())
    }

    /// Disconnects `per_shard`'s links on their shards (a shard gone has let them go).
    async fn let_go(&self, per_shard: Vec<Vec<Link>>) {
        for (shard, links) in per_shard.into_iter().enumerate() {
            if !links.is_empty() {
                let _ = self.call(shard, move |d| d.disconnect(&links)).await;
            }
        }
    }

    /// Replaces the injected data-path faults on every shard (demos and tests).
    pub async fn set_faults(&self, faults: Option<crate::FaultPlan>) {
        for shard in 0..self.shards() {
            let _ = self.call(shard, move |d| d.set_faults(faults)).await;
        }
    }

    /// Names a peer by its links, per shard of this node.
    fn add_peer(&self, per_shard: Vec<Vec<Link>>) -> PeerId {
        self.table().add(per_shard)
    }

    fn table(&self) -> std::sync::MutexGuard<'_, PeerTable> {
        self.inner.peers.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn peer(&self, peer: PeerId) -> Result<Vec<Vec<Link>>, NodeError> {
        self.table()
            .links
            .get(&peer.0)
            .cloned()
            .ok_or(NodeError::UnknownPeer(peer))
    }

    /// Forgets the peers whose kept links any shard's core let go as idle.
    async fn forget_let_go(&self) {
        for shard in 0..self.shards() {
            if let Ok(targets) = self.call(shard, |d| d.take_let_go()).await {
                self.table().forget(shard, &targets);
            }
        }
    }

    /// Whether `peer` names a peer of this node: `false` once it was disconnected, or let
    /// go after the core's `peer_idle_timeout` unused (connect again to use it).
    pub async fn knows_peer(&self, peer: PeerId) -> bool {
        self.forget_let_go().await;
        self.table().links.contains_key(&peer.0)
    }

    /// The link to each of `peers` on the shard owning `room` (address `room mod n`).
    fn links_for(&self, room: RoomId, peers: &[PeerId]) -> Result<Vec<Link>, NodeError> {
        let shard = shard_of(room, self.shards());
        let table = self.table();
        peers
            .iter()
            .map(|p| {
                let per_shard = table.links.get(&p.0).ok_or(NodeError::UnknownPeer(*p))?;
                let links = per_shard.get(shard).ok_or(NodeError::UnknownPeer(*p))?;
                if links.is_empty() {
                    return Err(NodeError::UnknownPeer(*p));
                }
                Ok(links[shard_of(room, links.len())])
            })
            .collect()
    }

    /// Runs `f` on the driver of the shard owning `room`.
    async fn on_room<T: Send + 'static>(
        &self,
        room: RoomId,
        f: impl FnOnce(&mut dyn DriverCalls) -> T + Send + 'static,
    ) -> Result<T, NodeError> {
        self.call(shard_of(room, self.shards()), f).await
    }

    /// A peer this node keeps connected to on every shard (dialed again whenever lost). If a
    /// shard refuses (its shutdown began), the shards that took it let it go again.
    pub async fn connect_persistent(&self, addrs: Vec<SocketAddr>) -> Result<PeerId, NodeError> {
        self.forget_let_go().await;
        let mut per_shard = Vec::with_capacity(self.shards());
        for shard in 0..self.shards() {
            let addrs = addrs.clone();
            let added = self
                .call(shard, move |d| {
                    let mut links = Vec::with_capacity(addrs.len());
                    for a in addrs {
                        match d.add_target(a) {
                            Ok(t) => links.push(Link::Target(t)),
                            Err(e) => {
                                d.disconnect(&links);
                                return Err(NodeError::from(e));
                            }
                        }
                    }
                    Ok(links)
                })
                .await
                .and_then(|r| r);
            match added {
                Ok(links) => per_shard.push(links),
                Err(e) => {
                    self.let_go(per_shard).await;
                    return Err(e);
                }
            }
        }
        Ok(self.add_peer(per_shard))
    }

    /// Waits until every persistent link to `peer` reached its first verdict.
    pub async fn reach(&self, peer: PeerId) -> Result<(), NodeError> {
        self.forget_let_go().await;
        for (shard, links) in self.peer(peer)?.into_iter().enumerate() {
            for link in links {
                // A session the embedder opened was reached when it was opened.
                let Link::Target(target) = link else { continue };
                let (tx, rx) = oneshot::channel();
                self.call(shard, move |d| d.on_target(target, tx)).await?;
                rx.await.map_err(|_| NodeError::ShutDown)??;
            }
        }
        Ok(())
    }

    /// Why a persistent peer is unreachable now (down for its whole `unreachable_timeout`),
    /// or `None` while it has a session or may still come back; answers at once
    /// (`ShutDown` once this node's shutdown began: it keeps no peer any more).
    pub async fn unreachable(&self, peer: PeerId) -> Result<Option<FailureReason>, NodeError> {
        self.forget_let_go().await;
        for (shard, links) in self.peer(peer)?.into_iter().enumerate() {
            for link in links {
                let Link::Target(target) = link else { continue };
                let found = self
                    .call(shard, move |d| {
                        let e = d.endpoint();
                        e.may_connect().map(|()| e.target_unreachable(target))
                    })
                    .await?
                    .map_err(NodeError::from)?;
                if found.is_some() {
                    return Ok(found);
                }
            }
        }
        Ok(None)
    }

    /// Decode: opens a receiver room fed by `peers`.
    pub async fn open_receiver(
        &self,
        room: RoomId,
        generation: Generation,
        peers: Vec<PeerId>,
        grant: Option<Grant>,
    ) -> Result<RoomHandle, NodeError> {
        let links = self.links_for(room, &peers)?;
        let via = links.clone();
        let (opened, let_go) = self
            .on_room(room, move |d| {
                let opened = d.open_room(
                    room,
                    Box::new(move |e, now| e.open_receiver_via(now, room, generation, &via, grant)),
                );
                (opened, d.take_let_go())
            })
            .await?;
        self.table().forget(shard_of(room, self.shards()), &let_go);
        opened.map_err(|e| match e {
            // Let go as idle between the lookup and the open: the peer is unknown now.
            ApiError::UnknownTarget(t) => links
                .iter()
                .position(|l| *l == Link::Target(t))
                .map_or(NodeError::from(e), |i| NodeError::UnknownPeer(peers[i])),
            e => NodeError::from(e),
        })
    }

    /// Decode: grants a room its pages.
    pub async fn grant_pages(&self, room: RoomId, grant: Grant) -> Result<(), NodeError> {
        api(self
            .on_room(room, move |d| {
                with(d, |e, now| e.grant_pages(now, room, grant))
            })
            .await)
    }

    /// Whether this node may listen on `addr` (the core's rule: beyond loopback only with a
    /// cluster token of its own).
    pub async fn check_listen(&self, addr: SocketAddr) -> Result<(), NodeError> {
        let loopback = addr.ip().is_loopback();
        api(self
            .call(0, move |d| d.endpoint().check_listen(loopback))
            .await)
    }

    /// Prefill: opens a sender room for the KV of `prompt`'s tokens (`None`: unchecked).
    pub async fn open_sender(
        &self,
        room: RoomId,
        generation: Generation,
        prompt: Option<PromptDigest>,
    ) -> Result<RoomHandle, NodeError> {
        api(self
            .on_room(room, move |d| {
                d.open_room(
                    room,
                    Box::new(move |e, now| e.open_sender(now, room, generation, prompt)),
                )
            })
            .await)
    }

    /// Prefill: sends the next chunk of a room.
    pub async fn send_chunk(&self, room: RoomId, chunk: Chunk) -> Result<(), NodeError> {
        api(self
            .on_room(room, move |d| {
                with(d, |e, now| e.send_chunk(now, room, chunk))
            })
            .await)
    }

    /// Prefill: layer `layer` of `rooms` finished its forward pass.
    pub async fn mark_layer_ready(&self, rooms: Vec<RoomId>, layer: u16) -> Result<(), NodeError> {
        let n = self.shards();
        let mut by_shard: Vec<Vec<RoomId>> = vec![Vec::new(); n];
        for r in rooms {
            by_shard[shard_of(r, n)].push(r);
        }
        for (shard, rooms) in by_shard.into_iter().enumerate() {
            if rooms.is_empty() {
                continue;
            }
            api(self
                .call(shard, move |d| {
                    with(d, |e, now| e.mark_layer_ready(now, &rooms, layer))
                })
                .await)?;
        }
        Ok(())
    }

    /// Decode: free capacity advertised in heartbeats; each shard advertises its share, so
    /// the sum over a peer's sessions is the truth.
    pub async fn set_capacity(&self, capacity: Capacity) {
        let n = self.shards() as u32;
        for shard in 0..n {
            let extra = u32::from(shard < capacity.free_pages % n);
            let share = Capacity {
                free_pages: capacity.free_pages / n + extra,
                queued_rooms: capacity.queued_rooms,
            };
            let _ = self
                .call(shard as usize, move |d| {
                    with(d, |e, _| e.set_capacity(share))
                })
                .await;
        }
    }

    /// Decode: the room waits for capacity behind `position` others.
    pub async fn set_queue_position(&self, room: RoomId, position: u32) -> Result<(), NodeError> {
        api(self
            .on_room(room, move |d| {
                with(d, |e, now| e.set_queue_position(now, room, position))
            })
            .await)
    }

    /// Aborts a room locally.
    pub async fn abort(&self, room: RoomId) -> Result<(), NodeError> {
        api(self
            .on_room(room, move |d| with(d, |e, now| e.abort(now, room)))
            .await)
    }

    /// The core's counters of one shard.
    pub async fn shard_counters(&self, shard: usize) -> Result<Counters, NodeError> {
        self.call(shard, |d| d.endpoint().counters().clone()).await
    }

    /// The path each live session of every shard moves its operations on (sessions whose
    /// path is not chosen yet are left out).
    pub async fn data_paths(&self) -> Vec<(usize, SessionId, crate::DataPath)> {
        let mut all = Vec::new();
        for shard in 0..self.shards() {
            if let Ok(paths) = self.call(shard, |d| d.session_paths()).await {
                all.extend(paths.into_iter().map(|(sid, path)| (shard, sid, path)));
            }
        }
        all
    }

    /// The data connections each session of every shard holds.
    pub async fn data_connections(&self) -> Vec<(usize, SessionId, usize)> {
        let mut all = Vec::new();
        for shard in 0..self.shards() {
            if let Ok(counts) = self.call(shard, |d| d.session_data_connections()).await {
                all.extend(counts.into_iter().map(|(sid, n)| (shard, sid, n)));
            }
        }
        all
    }

    /// The core's counters summed over every shard.
    pub async fn counters(&self) -> Counters {
        let mut total = Counters::default();
        for shard in 0..self.shards() {
            if let Ok(c) = self.shard_counters(shard).await {
                total.add(&c);
            }
        }
        total
    }
}
