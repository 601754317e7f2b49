//! The embedder-facing node API ([`KvNode`], derived for every [`RuntimeNode`]), peers, room
//! sharding, and the book that turns the core's room events into handle updates.

use crate::{
    role_label, Announcement, DataPath, Embedder, FaultPlan, NodeError, RoomHandle, RoomView,
    ShardCalls,
};
use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Instant;

use foldhash::fast::FixedState;
use kvferry_core::{
    Chunk, Counters, Event, FailureReason, Generation, Grant, KvPoll, PromptDigest, Role, RoomId,
    SessionId,
};
use kvferry_memory::MemoryMap;
use tokio::sync::{mpsc, watch};

type Map<K, V> = std::collections::HashMap<K, V, FixedState>;

/// A peer as the embedder names it: the list of its addresses (one per shard of the peer;
/// one for a tokio node). Room `r` moves over the session to address `r mod len`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PeerId(pub u32);

/// The shard (or peer address) that owns room `room` among `n`: `room mod n`. Both sides of
/// a transfer apply it, so a room meets its peer on the same shard whatever the runtimes.
pub fn shard_of(room: RoomId, n: usize) -> usize {
    (room.0 % n.max(1) as u64) as usize
}

/// The embedder's API, the same on every driver (tokio, glommio): open rooms, send chunks,
/// mark layers ready, abort, and await a room's terminal state and release through a
/// cancel-safe [`RoomHandle`]. Every future is `Send`, so any executor can await it.
pub trait KvNode: Clone + Send + Sync + 'static {
    /// Which runtime runs this node (`"tokio"`, `"glommio"`).
    fn runtime(&self) -> &'static str;

    /// Which data plane carries its operations (`"tcp"`, `"rdma"`).
    fn backend(&self) -> &'static str {
        "tcp"
    }

    /// The registered memory the node moves bytes from and into.
    fn memory(&self) -> &Arc<MemoryMap>;

    /// How many shards own rooms (1 on tokio).
    fn shards(&self) -> usize;

    /// Accepts peers on `addr` (port 0: any); returns one address per shard.
    fn listen(
        &self,
        addr: SocketAddr,
    ) -> impl Future<Output = Result<Vec<SocketAddr>, NodeError>> + Send;

    /// Opens sessions to a peer that listens on `addrs` (one per shard of the peer) and waits
    /// for their handshakes.
    fn connect(
        &self,
        addrs: Vec<SocketAddr>,
    ) -> impl Future<Output = Result<PeerId, NodeError>> + Send;

    /// Names a peer whose sessions the core keeps connected by itself (reconnecting with
    /// backoff after a loss or a restart); rooms toward it fail with
    /// [`NodeError::PeerUnavailable`] while it is away.
    fn connect_persistent(
        &self,
        addrs: Vec<SocketAddr>,
    ) -> impl Future<Output = Result<PeerId, NodeError>> + Send;

    /// Lets a peer go (a prefill scaled away, say): a kept peer is dialed no more, its
    /// sessions close (rooms still on them fail `AbortedLocally`, the peer's `PeerShutdown`),
    /// calls waiting for it end with [`NodeError::Disconnected`], and its id is unknown from
    /// now on ([`NodeError::UnknownPeer`]).
    fn disconnect(&self, peer: PeerId) -> impl Future<Output = Result<(), NodeError>> + Send;

    /// Whether `peer` still names a peer: `false` once disconnected, or let go after the
    /// core's `peer_idle_timeout` unused (calls with it fail [`NodeError::UnknownPeer`]).
    fn knows_peer(&self, peer: PeerId) -> impl Future<Output = bool> + Send;

    /// Decode: opens a room fed by `peers` (see [`kvferry_core::Endpoint::open_receiver`]).
    fn open_receiver(
        &self,
        room: RoomId,
        generation: Generation,
        peers: Vec<PeerId>,
        grant: Option<Grant>,
    ) -> impl Future<Output = Result<RoomHandle, NodeError>> + Send;

    /// Decode: grants pages to a room opened without them.
    fn grant_pages(
        &self,
        room: RoomId,
        grant: Grant,
    ) -> impl Future<Output = Result<(), NodeError>> + Send;

    /// Prefill: opens a sender room for the KV of `prompt`'s tokens: a decode that asks for
    /// it for other tokens is refused with `prompt_mismatch` (`None`: unchecked).
    fn open_sender(
        &self,
        room: RoomId,
        generation: Generation,
        prompt: Option<PromptDigest>,
    ) -> impl Future<Output = Result<RoomHandle, NodeError>> + Send;

    /// Prefill: hands a chunk of pages to send.
    fn send_chunk(
        &self,
        room: RoomId,
        chunk: Chunk,
    ) -> impl Future<Output = Result<(), NodeError>> + Send;

    /// Prefill: layer `layer` of `rooms` is computed.
    fn mark_layer_ready(
        &self,
        rooms: Vec<RoomId>,
        layer: u16,
    ) -> impl Future<Output = Result<(), NodeError>> + Send;

    /// Decode: the embedder's free capacity, advertised to prefills (backpressure).
    fn set_capacity(&self, capacity: kvferry_core::Capacity) -> impl Future<Output = ()> + Send;

    /// Decode: a room waiting for pages is at `position` in the embedder's queue.
    fn set_queue_position(
        &self,
        room: RoomId,
        position: u32,
    ) -> impl Future<Output = Result<(), NodeError>> + Send;

    /// Injects reproducible data-path faults (demos and tests only; `None` clears them).
    fn set_faults(&self, faults: Option<FaultPlan>) -> impl Future<Output = ()> + Send;

    /// Aborts a room (its pages stay quarantined until no write can land).
    fn abort(&self, room: RoomId) -> impl Future<Output = Result<(), NodeError>> + Send;

    /// The core's counters, summed over shards.
    fn counters(&self) -> impl Future<Output = Counters> + Send;

    /// The path each live session moves its operations on, per shard (`kvferry_session_path`).
    fn data_paths(&self) -> impl Future<Output = Vec<(usize, SessionId, DataPath)>> + Send;

    /// The data connections each session holds, per shard: at most its configured count
    /// and one that just ended, however often they were replaced.
    fn data_connections(&self) -> impl Future<Output = Vec<(usize, SessionId, usize)>> + Send;

    /// Prefill: every room a decode asks for, lossless: those no receiver took yet (asked
    /// for before this call) come first. One receiver at a time; this one replaces the last.
    fn room_announcements(&self) -> mpsc::UnboundedReceiver<Announcement>;

    /// Waits until every address of a persistent peer ([`KvNode::connect_persistent`]) has
    /// had a session: the first contact. Fails at once if one of them refused us at the
    /// handshake, or once one stayed unreachable for the core's `unreachable_timeout`.
    fn reach(&self, peer: PeerId) -> impl Future<Output = Result<(), NodeError>> + Send;

    /// Why a persistent peer is unreachable now (down for the whole `unreachable_timeout`: a
    /// room opened toward it fails at once), or `None`; never waits.
    fn unreachable(
        &self,
        peer: PeerId,
    ) -> impl Future<Output = Result<Option<FailureReason>, NodeError>> + Send;

    /// Fails every room, tells every peer, closes every connection and stops.
    fn shutdown(&self) -> impl Future<Output = ()> + Send;
}

/// What a runtime's node says of itself: its embedder (every room call goes through it), its
/// memory, how it listens and how it shuts down. Every such node is a [`KvNode`].
pub trait RuntimeNode: Clone + Send + Sync + 'static {
    /// How a call reaches one of the node's shards.
    type Calls: ShardCalls;

    /// The room calls and the peer table over the node's shards.
    fn embedder(&self) -> &Embedder<Self::Calls>;

    /// Which runtime runs this node (`"tokio"`, `"glommio"`).
    fn runtime(&self) -> &'static str;

    /// Which data plane carries its operations (`"tcp"`, `"rdma"`).
    fn backend(&self) -> &'static str {
        "tcp"
    }

    /// The registered memory the node moves bytes from and into.
    fn memory(&self) -> &Arc<MemoryMap>;

    /// Accepts peers on `addr` (port 0: any); returns one address per shard.
    fn listen(
        &self,
        addr: SocketAddr,
    ) -> impl Future<Output = Result<Vec<SocketAddr>, NodeError>> + Send;

    /// Prefill: every room a decode asks for before this node opened it.
    fn room_announcements(&self) -> mpsc::UnboundedReceiver<Announcement>;

    /// Fails every room, tells every peer, closes every connection and listener.
    fn shutdown(&self) -> impl Future<Output = ()> + Send;
}

impl<N: RuntimeNode> KvNode for N {
    fn runtime(&self) -> &'static str {
        RuntimeNode::runtime(self)
    }

    fn backend(&self) -> &'static str {
        RuntimeNode::backend(self)
    }

    fn memory(&self) -> &Arc<MemoryMap> {
        RuntimeNode::memory(self)
    }

    fn shards(&self) -> usize {
        self.embedder().calls().shards()
    }

    async fn listen(&self, addr: SocketAddr) -> Result<Vec<SocketAddr>, NodeError> {
        self.embedder().check_listen(addr).await?;
        let bound = RuntimeNode::listen(self, addr).await?;
        tracing::info!(target: crate::START_TARGET, runtime = self.runtime(), addrs = ?bound, "kvferry node listening");
        Ok(bound)
    }

    async fn connect(&self, addrs: Vec<SocketAddr>) -> Result<PeerId, NodeError> {
        self.embedder().connect(addrs).await
    }

    async fn connect_persistent(&self, addrs: Vec<SocketAddr>) -> Result<PeerId, NodeError> {
        self.embedder().connect_persistent(addrs).await
    }

    async fn disconnect(&self, peer: PeerId) -> Result<(), NodeError> {
        self.embedder().disconnect(peer).await
    }

    async fn knows_peer(&self, peer: PeerId) -> bool {
        self.embedder().knows_peer(peer).await
    }

    async fn open_receiver(
        &self,
        room: RoomId,
        generation: Generation,
        peers: Vec<PeerId>,
        grant: Option<Grant>,
    ) -> Result<RoomHandle, NodeError> {
        let rooms = self.embedder();
        rooms.open_receiver(room, generation, peers, grant).await
    }

    async fn grant_pages(&self, room: RoomId, grant: Grant) -> Result<(), NodeError> {
        self.embedder().grant_pages(room, grant).await
    }

    async fn open_sender(
        &self,
        room: RoomId,
        generation: Generation,
        prompt: Option<PromptDigest>,
    ) -> Result<RoomHandle, NodeError> {
        self.embedder().open_sender(room, generation, prompt).await
    }

    async fn send_chunk(&self, room: RoomId, chunk: Chunk) -> Result<(), NodeError> {
        self.embedder().send_chunk(room, chunk).await
    }

    async fn mark_layer_ready(&self, rooms: Vec<RoomId>, layer: u16) -> Result<(), NodeError> {
        self.embedder().mark_layer_ready(rooms, layer).await
    }

    async fn set_capacity(&self, capacity: kvferry_core::Capacity) {
        self.embedder().set_capacity(capacity).await;
    }

    async fn set_queue_position(&self, room: RoomId, position: u32) -> Result<(), NodeError> {
        self.embedder().set_queue_position(room, position).await
    }

    async fn set_faults(&self, faults: Option<FaultPlan>) {
        self.embedder().set_faults(faults).await;
    }

    async fn abort(&self, room: RoomId) -> Result<(), NodeError> {
        self.embedder().abort(room).await
    }

    async fn counters(&self) -> Counters {
        self.embedder().counters().await
    }

    async fn data_paths(&self) -> Vec<(usize, SessionId, DataPath)> {
        self.embedder().data_paths().await
    }

    async fn data_connections(&self) -> Vec<(usize, SessionId, usize)> {
        self.embedder().data_connections().await
    }

    fn room_announcements(&self) -> mpsc::UnboundedReceiver<Announcement> {
        RuntimeNode::room_announcements(self)
    }

    async fn reach(&self, peer: PeerId) -> Result<(), NodeError> {
        self.embedder().reach(peer).await
    }

    async fn unreachable(&self, peer: PeerId) -> Result<Option<FailureReason>, NodeError> {
        self.embedder().unreachable(peer).await
    }

    async fn shutdown(&self) {
        RuntimeNode::shutdown(self).await;
    }
}

/// The driver's room handles: turns the core's room events into [`RoomHandle`] updates and
/// measures how long failed rooms' pages stayed quarantined.
#[derive(Debug)]
pub struct RoomBook {
    role: Role,
    rooms: Map<RoomId, watch::Sender<RoomView>>,
    failed_at: Map<RoomId, Instant>,
}

impl RoomBook {
    /// An empty book for a node of `role`.
    pub fn new(role: Role) -> Self {
        RoomBook {
            role,
            rooms: Map::default(),
            failed_at: Map::default(),
        }
    }

    /// A handle on `room`, starting from `state` unless the room is already watched.
    pub fn watch(&mut self, room: RoomId, state: KvPoll) -> RoomHandle {
        let tx = self.rooms.entry(room).or_insert_with(|| {
            watch::channel(RoomView {
                state,
                releasable: false,
                delivered_through: None,
            })
            .0
        });
        RoomHandle::new(room, tx.subscribe())
    }

    /// Drops the handles of a room that was never opened after all.
    pub fn forget(&mut self, room: RoomId) {
        self.rooms.remove(&room);
    }

    /// Whether `event` is one the book follows (drivers hand it these).
    pub fn follows(event: &Event) -> bool {
        matches!(
            event,
            Event::RoomState { .. } | Event::Releasable { .. } | Event::LayerDelivered { .. }
        )
    }

    /// Applies a room event of the core to its handles.
    pub fn on_event(&mut self, event: &Event) {
        match *event {
            Event::RoomState { room, state, .. } => {
                if let Some(tx) = self.rooms.get(&room) {
                    tx.send_modify(|v| v.state = state);
                }
                if matches!(state, KvPoll::Failed(_)) {
                    self.failed_at.insert(room, Instant::now());
                }
            }
            Event::LayerDelivered { room, layer, .. } => {
                if let Some(tx) = self.rooms.get(&room) {
                    tx.send_modify(|v| v.delivered_through = Some(layer));
                }
            }
            Event::Releasable { room, .. } => {
                if let Some(t) = self.failed_at.remove(&room) {
                    metrics::histogram!("kvferry_quarantine_seconds", "role" => role_label(self.role))
                        .record(t.elapsed().as_secs_f64());
                }
                if let Some(tx) = self.rooms.remove(&room) {
                    tx.send_modify(|v| v.releasable = true);
                }
            }
            _ => {}
        }
    }
}
