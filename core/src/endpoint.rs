//! [`Endpoint`]: the deterministic state machine of one prefill or decode rank.

use std::collections::{HashMap, HashSet, VecDeque};

use foldhash::fast::FixedState;
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use smallvec::SmallVec;
use tracing::{debug, info, warn};

use crate::api::{
    Action, ApiError, Capacity, Chunk, ConnectFailure, DataRefusal, EndpointInfo, Event, Grant,
    Link, OpKind, PeerInfo, RejectReason, SessionState, SessionStats, TransferOp, TransferOutcome,
    WritePermit, WriteRefused,
};
use crate::auth::{
    connector_proof, constant_time_eq, listener_proof, Nonce, Nonces, Proof, SessionKey, SessionTag,
};
use crate::codec::{
    DecodeError, ErrorCode, Hello, Message, ProgressStage, RoomRequest, HELLO_TYPE,
};
use crate::config::{Config, ConfigError};
use crate::counters::Counters;
use crate::ids::{Generation, Incarnation, NodeId, RoomId, SessionId, TargetId, TransferId};
use crate::layout::{page_runs, PageSet, Region, Slice};
use crate::plan::{plan_aux, plan_kv, OpLimits};
use crate::rng::Rng;
use crate::state::{FailureReason, KvPoll, Role};
use crate::timer::{Timer, TimerKey, TimerTable};

/// Hash maps seeded from the endpoint seed: deterministic iteration for equal inputs, and
/// keys chosen by peers cannot be aimed at a hasher they do not know.
type Map<K, V> = HashMap<K, V, FixedState>;
type Set<K> = HashSet<K, FixedState>;

/// One prefill or decode rank: every room, session, operation and deadline it owns.
///
/// # Method groups
///
/// - **Getters**: [`Endpoint::room_state`], [`Endpoint::session_state`],
///   [`Endpoint::counters`], [`Endpoint::peer_capacity`], ...
/// - **Inputs** (`handle_*`, each with `now`): control bytes from a peer, a finished
///   data-path operation, a fired timer, a session connected, disconnected or fenced.
/// - **Commands** from the embedding scheduler: decode opens receiver rooms and grants pages;
///   prefill opens sender rooms, sends chunks and marks layers ready; both abort or fail rooms.
/// - **Outputs** (`poll_*`): control frames to send, data-path operations to run, actions on
///   connections, scheduler events, and the next deadline.
///
/// # Drain contract
///
/// After every input or command, the driver drains, in this order: [`Endpoint::poll_transmit`]
/// until `None`, [`Endpoint::poll_action`] until `None`, [`Endpoint::poll_transfer`] until
/// `None`, [`Endpoint::poll_event`] until `None`, and finally re-arms its single timer from
/// [`Endpoint::poll_timeout`]. When the timer fires it calls [`Endpoint::handle_timeout`].
/// Times passed in must not decrease; an earlier time is treated as the latest one seen.
///
/// Nothing here reads a clock, does IO, spawns or panics on peer input.
#[derive(Debug)]
pub struct Endpoint {
    config: Config,
    local: EndpointInfo,
    rng: Rng,
    /// Challenges for peers: unpredictable without the cluster token and our seed.
    nonces: Nonces,
    last_now: Instant,
    shut_down: bool,
    sessions: Map<SessionId, Session>,
    next_session: u32,
    /// Established sessions by peer node, to notice restarts and duplicates.
    nodes: Map<NodeId, SessionId>,
    /// Blacklists of peers whose connection dropped, so a reconnect cannot launder them.
    blacklist_memory: Map<NodeId, RememberedBlacklist>,
    rooms: Map<RoomId, Room>,
    tombstones: Tombstones,
    /// Prefill: room messages that arrived before the sender room was opened.
    pending: Map<RoomId, PendingRoom>,
    pending_order: VecDeque<(RoomId, Generation)>,
    ops: Map<TransferId, Op>,
    next_op: u64,
    ready_sessions: VecDeque<SessionId>,
    timers: TimerTable,
    transmits: VecDeque<(SessionId, Message)>,
    actions: VecDeque<Action>,
    events: VecDeque<Event>,
    counters: Counters,
    capacity: Capacity,
    hasher: FixedState,
    targets: Map<TargetId, Target>,
    next_target: u32,
    /// Write permits given so far (numbers them).
    next_permit: u64,
    /// Sessions taken over by a fresh connection, with the session that carries on: their
    /// writes are refused and their late messages ignored until their connection is gone.
    superseded: Map<SessionId, SessionId>,
}

/// What the connection attempts to a target found, since its session went silent or down:
/// the evidence that names the reason of rooms failed for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum LinkEvidence {
    /// The host refused: nothing listens at the port.
    Refused,
    /// No answer within the connect timeout, or no route.
    NoAnswer,
    /// A connection was made but no hello came back: the peer process does not answer.
    Silent,
    /// The peer answered and refused us at the handshake (token, role, layout, version).
    Rejected(FailureReason),
}

impl LinkEvidence {
    /// The reason of rooms that gave up on a link this evidence describes.
    fn reason(self) -> FailureReason {
        match self {
            LinkEvidence::Refused => FailureReason::ConnectionRefused,
            LinkEvidence::NoAnswer => FailureReason::PeerUnreachable,
            LinkEvidence::Silent => FailureReason::PeerSilent,
            LinkEvidence::Rejected(reason) => reason,
        }
    }
}

/// A peer to stay connected to: the core decides when to (re)connect.
#[derive(Debug)]
struct Target {
    session: Option<SessionId>,
    backoff: Duration,
    timer: Option<TimerKey>,
    /// Since when the target has had no established session (`None`: it has one).
    down_since: Option<Instant>,
    /// Receiver rooms waiting for this target's session.
    waiting: Vec<RoomId>,
    unreachable_timer: Option<TimerKey>,
    /// A connection attempt asked of the driver and not yet reported.
    dialing: bool,
    /// A fresh connection checking the link while the session is silent, in its handshake.
    check: Option<SessionId>,
    /// What the attempts since the session went silent or down found.
    evidence: Option<LinkEvidence>,
}

/// Who a peer is across connections: its node name and process incarnation.
type PeerIdentity = (NodeId, Incarnation);

#[derive(Debug)]
struct Session {
    state: SessionState,
    peer: Option<PeerInfo>,
    last_rx: Instant,
    handshake_timer: Option<TimerKey>,
    heartbeat_timer: Option<TimerKey>,
    liveness_timer: Option<TimerKey>,
    silence_timer: Option<TimerKey>,
    probe_timer: Option<TimerKey>,
    idle_timer: Option<TimerKey>,
    /// Accepted by our listener: our hello goes out only after the peer's hello proved it
    /// knows the cluster token.
    inbound: bool,
    /// The handshake's authentication so far, then the session's key.
    auth: Auth,
    /// How long this session may stay silent before it is given up: the longer of our
    /// liveness window and the one the peer announced.
    window: Duration,
    /// Silence after which the link is checked: longer than the peer's heartbeat interval.
    silence: Duration,
    /// The silence of this session was logged (reset when the peer is heard again).
    silence_noted: bool,
    /// Accepted side: the silent session of the same peer process this one will take over
    /// once the peer uses it (its first message after the hello) or the old one ends. The
    /// dialer may give up on a fresh connection whose hello was late; until it uses it, the
    /// old session keeps its work.
    resumes: Option<SessionId>,
    /// Consecutive exhausted operations.
    failures: u32,
    probe_backoff: Duration,
    probe_nonce: Option<u64>,
    probe_op: Option<TransferId>,
    last_targeted: Instant,
    queue: VecDeque<TransferId>,
    in_flight: u32,
    in_ready: bool,
    fencing: bool,
    rooms: Set<RoomId>,
    strikes: u32,
    capacity: Option<Capacity>,
    close_reason: FailureReason,
    stats: SessionStats,
    target: Option<TargetId>,
    /// Bumped by every completed fence: permits of an older epoch are void.
    epoch: u32,
    /// Its writes land without this endpoint seeing them (RDMA): `Success` of its rooms
    /// rests on the source's word, bound to the peer's incarnation, not on landed bytes.
    one_sided: bool,
}

/// Where a session's handshake stands (see `docs/PROTOCOL.md`, "Handshake").
#[derive(Debug)]
enum Auth {
    /// Connector: our challenge went out; the listener's is awaited.
    ConnectorChallenged { ours: Nonce },
    /// Connector: our hello went out (kept with its proof zeroed, as the transcript); the
    /// listener's hello is awaited.
    ConnectorHello {
        ours: Nonce,
        theirs: Nonce,
        hello: Vec<u8>,
    },
    /// Listener: the connector's challenge is awaited.
    ListenerWaiting,
    /// Listener: our challenge went out; the connector's hello is awaited.
    ListenerChallenged { theirs: Nonce, ours: Nonce },
    /// Both proofs checked out.
    Done(SessionKey),
}

/// Why a hello did not complete the handshake.
enum HandshakeError {
    /// Refused with a typed reason (and an `Error` frame).
    Refused(RejectReason),
    /// It came before the challenges were exchanged.
    OutOfOrder,
}

/// A hello as its proof covers it: the frame as encoded, with the proof bytes zero.
fn hello_transcript(h: &Hello) -> Vec<u8> {
    let mut v = Vec::with_capacity(96);
    Message::Hello(Hello {
        proof: [0; 32],
        ..h.clone()
    })
    .encode(&mut v);
    v
}

#[derive(Debug, Clone, Copy)]
struct RememberedBlacklist {
    incarnation: Incarnation,
    until: Instant,
}

#[derive(Debug)]
struct Room {
    generation: Generation,
    state: KvPoll,
    bootstrap_timer: Option<TimerKey>,
    waiting_timer: Option<TimerKey>,
    abort_timer: Option<TimerKey>,
    /// Prefill: last chunk, layer mark or finished op. Decode: last word from a source.
    last_activity: Instant,
    side: Side,
}

#[derive(Debug)]
enum Side {
    Sender(SenderRoom),
    Receiver(ReceiverRoom),
}

#[derive(Debug, Default)]
struct SenderRoom {
    receivers: SmallVec<[Receiver; 2]>,
    expected: u8,
    saturated: bool,
    announced_by: SmallVec<[SessionId; 2]>,
    /// Identities of the decode endpoints that announced or requested the room: only they
    /// are ever answered from its outcome.
    peers: SmallVec<[PeerIdentity; 2]>,
    chunks: VecDeque<HeldChunk>,
    next_dst: u32,
    last_seen: bool,
    aux_src: Option<u32>,
    state_src: Option<u32>,
    /// Operations queued, waiting for a retry or in flight.
    ops_live: u32,
    /// Operations with an attempt in flight (reads of source pages may be happening).
    ops_in_flight: u32,
    /// Live operations per owned layer (empty until the first KV operation is planned).
    layer_live: Vec<u32>,
    /// Owned layers, from the first, whose every operation was acknowledged and reported.
    layers_delivered: u16,
    stage: Option<ProgressStage>,
    last_progress_sent: Option<Instant>,
    drained_acked: bool,
}

#[derive(Debug)]
struct Receiver {
    session: SessionId,
    dst: Vec<u32>,
    aux_slot: Option<u32>,
    state_slot: Option<u32>,
}

#[derive(Debug)]
struct HeldChunk {
    src: Vec<u32>,
    dst_start: u32,
    layerwise: bool,
    released: LayerBits,
    planned: LayerBits,
}

#[derive(Debug, Default)]
struct ReceiverRoom {
    sources: SmallVec<[Source; 2]>,
    pages: Option<PageSet>,
    aux_slot: Option<u32>,
    state_slot: Option<u32>,
    queue_position: u32,
    /// Opened through targets of which some had no session yet: the sources are attached
    /// (and the grant sent) once all of them are up. Empty once attached.
    waiting_for: SmallVec<[Link; 2]>,
    /// A grant given while the room waits for its targets.
    held_grant: Option<Grant>,
    /// The request sent with the grant, kept to send again on a session that takes over.
    request: Option<Box<RoomRequest>>,
}

#[derive(Debug)]
struct Source {
    session: SessionId,
    granted: bool,
    /// The source reported Success: all its writes were acknowledged.
    done: bool,
    /// The source acknowledged the drain, or its session was fenced or closed.
    drained: bool,
    /// Every (owned layer, plane, granted page) unit plus the aux row and state slot this
    /// source must write, as a bitmap of what applied writes covered (set with the grant).
    coverage: Coverage,
    /// Writes authorized by `begin_write` and not yet ended, which may be landing in the
    /// room's pages right now: (permit number, the session that wrote it, its units).
    pending: SmallVec<[(u64, SessionId, Vec<u32>); 2]>,
}

/// Which units of a room one source must write, and which applied writes covered.
#[derive(Debug, Default)]
struct Coverage {
    bits: Vec<u64>,
    /// Units required.
    expected: u32,
    /// Units required and covered.
    covered: u32,
    /// First layer the source owns.
    layer_start: u16,
    /// Layers the source owns (within this endpoint's layout).
    layers: u16,
    planes: u8,
    pages: u32,
    aux: bool,
    state: bool,
}

impl Coverage {
    fn new(layout: &crate::layout::Layout, peer: Option<PeerInfo>, grant: &Grant) -> Self {
        let Some(p) = peer else {
            return Coverage::default();
        };
        let layers = p.layer_end.min(layout.layers).saturating_sub(p.layer_start);
        let pages = PageSet::new(&grant.pages).len();
        let aux = p.writes_aux && grant.aux_slot.is_some() && layout.aux_bytes > 0;
        let state = p.writes_aux && grant.state_slot.is_some() && layout.state_bytes > 0;
        let units = u32::from(layers) * u32::from(layout.planes) * pages + 2;
        Coverage {
            bits: vec![0; (units as usize).div_ceil(64)],
            expected: units - 2 + u32::from(aux) + u32::from(state),
            covered: 0,
            layer_start: p.layer_start,
            layers,
            planes: layout.planes,
            pages,
            aux,
            state,
        }
    }

    /// The unit of (layer, plane, page rank), or of the aux row / state slot.
    fn kv_unit(&self, layer: u16, plane: u8, rank: u32) -> Option<u32> {
        let l = layer
            .checked_sub(self.layer_start)
            .filter(|l| *l < self.layers)?;
        Some((u32::from(l) * u32::from(self.planes) + u32::from(plane)) * self.pages + rank)
    }

    fn slot_unit(&self, state: bool) -> u32 {
        u32::from(self.layers) * u32::from(self.planes) * self.pages + u32::from(state)
    }

    fn mark(&mut self, unit: u32) {
        let (w, b) = ((unit / 64) as usize, unit % 64);
        let Some(word) = self.bits.get_mut(w) else {
            return;
        };
        if *word & (1 << b) != 0 {
            return;
        }
        *word |= 1 << b;
        let kv_units = self.slot_unit(false);
        let required = unit < kv_units
            || (unit == kv_units && self.aux)
            || (unit == kv_units + 1 && self.state);
        if required {
            self.covered += 1;
        }
    }

    fn complete(&self) -> bool {
        self.covered >= self.expected
    }
}

impl Source {
    fn new(session: SessionId) -> Self {
        Source {
            session,
            granted: false,
            done: false,
            drained: false,
            coverage: Coverage::default(),
            pending: SmallVec::new(),
        }
    }
}

#[derive(Debug)]
struct Op {
    session: SessionId,
    room: Option<RoomId>,
    generation: Generation,
    kind: OpKind,
    slices: Arc<[Slice]>,
    /// Owned-layer indexes (from the endpoint's first layer) the operation writes.
    layers: Range<usize>,
    bytes: u64,
    attempt: u32,
    phase: OpPhase,
    timer: Option<TimerKey>,
    /// In flight on a connection that a fresh one took over: whatever its report says but
    /// `Done`, it runs again on the new session without counting an attempt.
    superseded: bool,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum OpPhase {
    Queued,
    InFlight,
    RetryWait,
}

#[derive(Debug, Default)]
struct PendingRoom {
    generation: Generation,
    requests: SmallVec<[(SessionId, RoomRequest); 1]>,
    notices: SmallVec<[(SessionId, u32); 1]>,
}

/// Bounded memory of concluded rooms: answers late messages of the room's own peers and
/// refuses stale generations. It never answers another peer (a reused room id).
#[derive(Debug, Default)]
struct Tombstones {
    map: Map<RoomId, Tombstone>,
    order: VecDeque<(RoomId, u64)>,
    seq: u64,
    cap: usize,
}

#[derive(Debug)]
struct Tombstone {
    generation: Generation,
    outcome: KvPoll,
    seq: u64,
    /// Whether a room record existed here (`false`: a verdict reached before it opened).
    opened: bool,
    /// The peers that took part: the only ones answered from `outcome`.
    peers: SmallVec<[PeerIdentity; 1]>,
}

impl Tombstones {
    /// Remembers a room that was opened here and concluded.
    fn insert(
        &mut self,
        room: RoomId,
        generation: Generation,
        outcome: KvPoll,
        peers: SmallVec<[PeerIdentity; 1]>,
    ) {
        self.remember(room, generation, outcome, true, peers);
    }

    /// Remembers a verdict reached before the room was opened here (prefill only).
    fn insert_verdict(
        &mut self,
        room: RoomId,
        generation: Generation,
        reason: FailureReason,
        peers: SmallVec<[PeerIdentity; 1]>,
    ) {
        self.remember(room, generation, KvPoll::Failed(reason), false, peers);
    }

    fn remember(
        &mut self,
        room: RoomId,
        generation: Generation,
        outcome: KvPoll,
        opened: bool,
        peers: SmallVec<[PeerIdentity; 1]>,
    ) {
        self.seq += 1;
        self.map.insert(
            room,
            Tombstone {
                generation,
                outcome,
                seq: self.seq,
                opened,
                peers,
            },
        );
        self.order.push_back((room, self.seq));
        while self.order.len() > self.cap {
            if let Some((old, seq)) = self.order.pop_front() {
                if self.map.get(&old).is_some_and(|e| e.seq == seq) {
                    self.map.remove(&old);
                }
            }
        }
    }

    fn get(&self, room: RoomId) -> Option<(Generation, KvPoll)> {
        self.map.get(&room).map(|e| (e.generation, e.outcome))
    }

    /// Whether `who` took part in the remembered room (a tombstone nobody took part in, such
    /// as a prefill room that timed out unrequested, answers everyone: it can only say Failed).
    fn took_part(&self, room: RoomId, who: Option<PeerIdentity>) -> bool {
        self.map
            .get(&room)
            .is_some_and(|e| e.peers.is_empty() || who.is_some_and(|w| e.peers.contains(&w)))
    }

    /// A verdict for a room never opened here, to deliver when it is opened.
    fn verdict(&self, room: RoomId) -> Option<(Generation, FailureReason)> {
        match self.map.get(&room) {
            Some(Tombstone {
                generation,
                outcome: KvPoll::Failed(reason),
                opened: false,
                ..
            }) => Some((*generation, *reason)),
            _ => None,
        }
    }
}

/// Bitset over the layers this endpoint owns.
#[derive(Debug, Clone, Default)]
struct LayerBits(SmallVec<[u64; 2]>);

impl LayerBits {
    fn new(n: usize) -> Self {
        LayerBits(SmallVec::from_elem(0, n.div_ceil(64).max(1)))
    }
    fn all(n: usize) -> Self {
        let mut b = Self::new(n);
        for i in 0..n {
            b.set(i);
        }
        b
    }
    fn get(&self, i: usize) -> bool {
        self.0.get(i / 64).is_some_and(|w| w & (1 << (i % 64)) != 0)
    }
    fn set(&mut self, i: usize) {
        if let Some(w) = self.0.get_mut(i / 64) {
            *w |= 1 << (i % 64);
        }
    }
    fn count(&self) -> u32 {
        self.0.iter().map(|w| w.count_ones()).sum()
    }
}

impl Endpoint {
    /// A new endpoint. `seed` drives every random choice (jitter, nonces); `now` is the start.
    pub fn new(
        config: Config,
        local: EndpointInfo,
        seed: u64,
        now: Instant,
    ) -> Result<Self, ConfigError> {
        config.validate()?;
        let owned = local.layer_start < local.layer_end && local.layer_end <= local.layout.layers;
        if !owned || local.layout.page_bytes == 0 || !(1..=2).contains(&local.layout.planes) {
            return Err(ConfigError {
                name: "layout".into(),
                value: format!(
                    "{:?} layers {}..{}",
                    local.layout, local.layer_start, local.layer_end
                ),
                reason: "needs 1-2 planes, page_bytes > 0 and a non-empty owned layer range",
            });
        }
        let tombstones = Tombstones {
            cap: config.tombstones as usize,
            ..Tombstones::default()
        };
        let hasher = FixedState::with_seed(seed.rotate_left(17) ^ 0x6b76_6665_7272_7900);
        let tombstones = Tombstones {
            map: Map::with_hasher(hasher.clone()),
            ..tombstones
        };
        let nonces = Nonces::new(&local.token, seed, local.node.0, local.incarnation.0);
        Ok(Endpoint {
            config,
            local,
            rng: Rng::new(seed),
            nonces,
            last_now: now,
            shut_down: false,
            sessions: Map::with_hasher(hasher.clone()),
            next_session: 0,
            nodes: Map::with_hasher(hasher.clone()),
            blacklist_memory: Map::with_hasher(hasher.clone()),
            rooms: Map::with_hasher(hasher.clone()),
            tombstones,
            pending: Map::with_hasher(hasher.clone()),
            pending_order: VecDeque::new(),
            ops: Map::with_hasher(hasher.clone()),
            next_op: 0,
            ready_sessions: VecDeque::new(),
            timers: TimerTable::default(),
            transmits: VecDeque::new(),
            actions: VecDeque::new(),
            events: VecDeque::new(),
            counters: Counters::default(),
            capacity: Capacity::default(),
            targets: Map::with_hasher(hasher.clone()),
            next_target: 0,
            next_permit: 0,
            superseded: Map::with_hasher(hasher.clone()),
            hasher,
        })
    }

    // ---------------------------------------------------------------- getters

    /// This endpoint's identity.
    pub fn info(&self) -> &EndpointInfo {
        &self.local
    }

    /// The configuration in force.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Counters so far.
    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// State of a live room, or the outcome of a concluded one still remembered.
    pub fn room_state(&self, room: RoomId) -> Option<KvPoll> {
        match self.rooms.get(&room) {
            Some(r) => Some(r.state),
            None => self.tombstones.get(room).map(|t| t.1),
        }
    }

    /// Generation of a live room.
    pub fn room_generation(&self, room: RoomId) -> Option<Generation> {
        self.rooms.get(&room).map(|r| r.generation)
    }

    /// Number of room records held (live or waiting to become releasable).
    pub fn live_rooms(&self) -> usize {
        self.rooms.len()
    }

    /// Ids of the rooms held, in no particular order.
    pub fn room_ids(&self) -> impl Iterator<Item = RoomId> + '_ {
        self.rooms.keys().copied()
    }

    /// Number of room operations queued, waiting for a retry, or in flight (probes excluded).
    pub fn live_ops(&self) -> usize {
        self.ops.values().filter(|op| op.room.is_some()).count()
    }

    /// Number of armed deadlines.
    pub fn armed_timers(&self) -> usize {
        self.timers.len()
    }

    /// State of a session.
    pub fn session_state(&self, session: SessionId) -> Option<SessionState> {
        self.sessions.get(&session).map(|s| s.state)
    }

    /// Who is behind an established session.
    pub fn peer(&self, session: SessionId) -> Option<PeerInfo> {
        self.sessions.get(&session).and_then(|s| s.peer)
    }

    /// Capacity last advertised by the decode peer of a session (prefill admission control).
    pub fn peer_capacity(&self, session: SessionId) -> Option<Capacity> {
        self.sessions.get(&session).and_then(|s| s.capacity)
    }

    /// Per-session data-path figures, for exporters.
    pub fn session_stats(&self, session: SessionId) -> Option<SessionStats> {
        self.sessions.get(&session).map(|s| SessionStats {
            in_flight: s.in_flight,
            queued: s.queue.len() as u32,
            ..s.stats
        })
    }

    /// Sessions blacklisted right now.
    pub fn blacklisted_sessions(&self) -> usize {
        self.sessions
            .values()
            .filter(|s| s.state == SessionState::Blacklisted)
            .count()
    }

    /// Consecutive exhausted operations of a session.
    pub fn session_failures(&self, session: SessionId) -> Option<u32> {
        self.sessions.get(&session).map(|s| s.failures)
    }

    /// Ids of the open sessions.
    pub fn session_ids(&self) -> impl Iterator<Item = SessionId> + '_ {
        self.sessions.keys().copied()
    }

    /// The established (or blacklisted) session whose peer is `node` in its `incarnation`:
    /// how a driver attaches a data connection that names its peer to the right session.
    pub fn session_of(
        &self,
        node: NodeId,
        incarnation: crate::ids::Incarnation,
    ) -> Option<SessionId> {
        let sid = *self.nodes.get(&node)?;
        let s = self.sessions.get(&sid)?;
        let usable = matches!(
            s.state,
            SessionState::Established | SessionState::Blacklisted
        );
        (usable && s.peer.is_some_and(|p| p.incarnation == incarnation)).then_some(sid)
    }

    // ---------------------------------------------------------------- outputs

    /// Encodes the next control frame into `buf` and returns the session to send it on.
    #[must_use]
    pub fn poll_transmit(&mut self, buf: &mut Vec<u8>) -> Option<SessionId> {
        let (session, msg) = self.transmits.pop_front()?;
        msg.encode(buf);
        Some(session)
    }

    /// The next control message, not encoded (for drivers that batch or inspect).
    #[must_use]
    pub fn poll_message(&mut self) -> Option<(SessionId, Message)> {
        self.transmits.pop_front()
    }

    /// The next connection action the driver must carry out.
    #[must_use]
    pub fn poll_action(&mut self) -> Option<Action> {
        self.actions.pop_front()
    }

    /// The next data-path operation to run; sessions are served round-robin, each up to
    /// `max_ops_in_flight` operations, so one slow peer never holds back the others.
    #[must_use]
    pub fn poll_transfer(&mut self, now: Instant) -> Option<TransferOp> {
        let now = self.clock(now);
        while let Some(sid) = self.ready_sessions.pop_front() {
            let max = self.config.max_ops_in_flight;
            let Some(session) = self.sessions.get_mut(&sid) else {
                continue;
            };
            session.in_ready = false;
            if session.fencing || session.in_flight >= max {
                continue;
            }
            let Some(id) = session.queue.pop_front() else {
                continue;
            };
            let Some(op) = self.ops.get_mut(&id) else {
                // Dropped while queued (room concluded): the id is stale.
                self.mark_ready(sid);
                continue;
            };
            session.in_flight += 1;
            op.phase = OpPhase::InFlight;
            let out = TransferOp {
                id,
                session: sid,
                room: op.room,
                generation: op.generation,
                kind: op.kind,
                attempt: op.attempt,
                slices: op.slices.clone(),
                bytes: op.bytes,
            };
            let at = now + self.config.operation_timeout;
            self.timers.set(&mut op.timer, at, Timer::Operation(id));
            if let Some(room) = op.room {
                if let Some(Side::Sender(s)) = self.rooms.get_mut(&room).map(|r| &mut r.side) {
                    s.ops_in_flight += 1;
                }
            }
            self.mark_ready(sid);
            return Some(out);
        }
        None
    }

    /// The next event for the embedding scheduler.
    #[must_use]
    pub fn poll_event(&mut self) -> Option<Event> {
        self.events.pop_front()
    }

    /// The earliest deadline and why it exists. Call [`Endpoint::handle_timeout`] at it.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<(Instant, Timer)> {
        self.timers.next()
    }

    // ---------------------------------------------------------------- sessions

    /// This side opened a control connection to a peer: returns its session handle and
    /// queues our hello on it (the connector speaks first).
    pub fn open_session(&mut self, now: Instant) -> SessionId {
        let ours = self.nonces.fresh();
        let sid = self.new_session(now, Auth::ConnectorChallenged { ours });
        self.transmits
            .push_back((sid, Message::Challenge { nonce: ours }));
        sid
    }

    /// Our listener accepted a control connection: returns its session handle. We send our
    /// challenge once the connector sent its own, and our hello only once the connector's
    /// hello proved it knows the cluster token: before that a stranger learns nothing.
    pub fn accept_session(&mut self, now: Instant) -> SessionId {
        self.new_session(now, Auth::ListenerWaiting)
    }

    /// Our hello, its proof still zero.
    fn our_hello(&self) -> Hello {
        Hello {
            role: self.local.role,
            rank: self.local.rank,
            node: self.local.node,
            incarnation: self.local.incarnation,
            layout: self.local.layout,
            layer_start: self.local.layer_start,
            layer_end: self.local.layer_end,
            writes_aux: self.local.writes_aux,
            heartbeat_interval_ms: self
                .config
                .heartbeat_interval
                .as_millis()
                .clamp(1, u128::from(u32::MAX)) as u32,
            heartbeat_misses: self.config.heartbeat_misses.max(1),
            proof: [0; 32],
        }
    }

    /// The key binding data connections to `session`, once its handshake completed.
    pub fn data_key(&self, session: SessionId) -> Option<SessionKey> {
        match &self.sessions.get(&session)?.auth {
            Auth::Done(key) => Some(key.clone()),
            _ => None,
        }
    }

    /// A fresh challenge for a data connection our listener accepted.
    pub fn data_challenge(&mut self) -> Nonce {
        self.nonces.fresh()
    }

    /// Admits a data connection that answered `challenge` with `proof` for the session named
    /// by `tag`: the session it belongs to, if that session is usable and the proof is right.
    pub fn admit_data(
        &self,
        challenge: &Nonce,
        tag: &SessionTag,
        proof: &Proof,
    ) -> Result<SessionId, DataRefusal> {
        let (sid, key) = self
            .sessions
            .iter()
            .find_map(|(sid, s)| match &s.auth {
                Auth::Done(key) if key.tag() == *tag => Some((*sid, key)),
                _ => None,
            })
            .ok_or(DataRefusal::UnknownSession)?;
        if !key.verify(challenge, proof) {
            return Err(DataRefusal::BadProof);
        }
        match self.sessions.get(&sid).map(|s| s.state) {
            Some(SessionState::Established | SessionState::Blacklisted) => Ok(sid),
            _ => Err(DataRefusal::SessionEnded),
        }
    }

    fn new_session(&mut self, now: Instant, auth: Auth) -> SessionId {
        let inbound = matches!(auth, Auth::ListenerWaiting);
        let now = self.clock(now);
        self.next_session += 1;
        let sid = SessionId(self.next_session);
        let mut session = Session {
            state: SessionState::Handshaking,
            peer: None,
            last_rx: now,
            handshake_timer: None,
            heartbeat_timer: None,
            liveness_timer: None,
            silence_timer: None,
            probe_timer: None,
            idle_timer: None,
            inbound,
            auth,
            window: self.config.heartbeat_interval * self.config.heartbeat_misses,
            silence: self.config.silence_timeout,
            silence_noted: false,
            resumes: None,
            failures: 0,
            probe_backoff: self.config.probe_interval,
            probe_nonce: None,
            probe_op: None,
            last_targeted: now,
            queue: VecDeque::new(),
            in_flight: 0,
            in_ready: false,
            fencing: false,
            rooms: Set::with_hasher(self.hasher.clone()),
            strikes: 0,
            capacity: None,
            close_reason: FailureReason::ConnectionLost,
            stats: SessionStats::default(),
            target: None,
            epoch: 0,
            one_sided: false,
        };
        self.timers.set(
            &mut session.handshake_timer,
            now + self.config.handshake_timeout,
            Timer::Handshake(sid),
        );
        self.sessions.insert(sid, session);
        sid
    }

    /// Registers a peer to stay connected to. The core asks for a connection at once
    /// ([`Action::Connect`]) and again, with exponential backoff and jitter, whenever the
    /// session drops or the connection attempt fails, until [`Endpoint::remove_target`].
    pub fn add_target(&mut self, now: Instant) -> TargetId {
        let now = self.clock(now);
        self.next_target += 1;
        let id = TargetId(self.next_target);
        let backoff = self.config.reconnect_interval;
        self.targets.insert(
            id,
            Target {
                session: None,
                backoff,
                timer: None,
                down_since: Some(now),
                waiting: Vec::new(),
                unreachable_timer: None,
                dialing: true,
                check: None,
                evidence: None,
            },
        );
        self.actions.push_back(Action::Connect {
            target: id,
            timeout: self.config.connect_timeout,
        });
        id
    }

    /// Stops reconnecting a target (its current session, if any, stays until it ends).
    pub fn remove_target(&mut self, target: TargetId) {
        if let Some(mut t) = self.targets.remove(&target) {
            self.timers.cancel(&mut t.timer);
            self.timers.cancel(&mut t.unreachable_timer);
        }
    }

    /// The driver connected to a target: like [`Endpoint::open_session`], bound to it. While
    /// the target's session is silent this is a link check: if its handshake completes with
    /// the same peer process, it takes the silent session's work over.
    pub fn open_session_for(&mut self, now: Instant, target: TargetId) -> SessionId {
        let sid = self.open_session(now);
        let check_deadline = self.last_now + self.config.silence_timeout;
        let live = self.target_session(target);
        if let Some(t) = self.targets.get_mut(&target) {
            t.dialing = false;
            if live.is_some() {
                t.check = Some(sid);
            } else {
                t.session = Some(sid);
            }
            if let Some(s) = self.sessions.get_mut(&sid) {
                s.target = Some(target);
                if live.is_some() {
                    // A link check: a peer that took the connection but says nothing is silent.
                    self.timers.set(
                        &mut s.handshake_timer,
                        check_deadline,
                        Timer::Handshake(sid),
                    );
                }
            }
        }
        sid
    }

    /// The driver could not connect to a target: the failure is evidence for the reason of
    /// rooms that wait for it, and the core tries again (at once after a timeout, which paced
    /// the attempt already; with backoff after a refusal).
    pub fn handle_connect_failed(
        &mut self,
        now: Instant,
        target: TargetId,
        failure: ConnectFailure,
    ) {
        let now = self.clock(now);
        let live = self.target_session(target).is_some();
        let Some(t) = self.targets.get_mut(&target) else {
            return;
        };
        t.dialing = false;
        t.evidence = Some(match failure {
            ConnectFailure::Refused => LinkEvidence::Refused,
            ConnectFailure::NoAnswer => LinkEvidence::NoAnswer,
        });
        if live {
            // A silent session's link check: its silence timer paces the next one.
            return;
        }
        self.schedule_reconnect(now, target, failure == ConnectFailure::NoAnswer);
    }

    /// The reason for rooms that gave up on `target`, from what its connection attempts found.
    fn unreachable_reason(&self, target: TargetId) -> FailureReason {
        // A target is only ever waited for after an attempt failed; without one, say so.
        self.targets
            .get(&target)
            .and_then(|t| t.evidence)
            .map_or(FailureReason::PeerUnreachable, LinkEvidence::reason)
    }

    /// The established session of a target, if it has one now.
    pub fn target_session(&self, target: TargetId) -> Option<SessionId> {
        let sid = self.targets.get(&target)?.session?;
        match self.sessions.get(&sid)?.state {
            SessionState::Established | SessionState::Blacklisted => Some(sid),
            _ => None,
        }
    }

    /// The session `link` stands for now, if it has an established one.
    pub fn link_session(&self, link: Link) -> Option<SessionId> {
        match link {
            Link::Session(s) => Some(s),
            Link::Target(t) => self.target_session(t),
        }
    }

    /// Arms the next connection attempt. `paced`: the last attempt timed out, so it already
    /// waited; try again after the shortest interval (a healed link is found within it).
    fn schedule_reconnect(&mut self, now: Instant, target: TargetId, paced: bool) {
        let max = self.config.reconnect_max_interval;
        let shortest = self.config.reconnect_interval;
        let window = self.config.unreachable_timeout;
        let Some(t) = self.targets.get_mut(&target) else {
            return;
        };
        t.session = None;
        let since = *t.down_since.get_or_insert(now);
        if !t.waiting.is_empty() && t.unreachable_timer.is_none() {
            self.timers.set(
                &mut t.unreachable_timer,
                since + window,
                Timer::Unreachable(target),
            );
        }
        let base = if paced { shortest } else { t.backoff };
        let jitter = Duration::from_nanos(self.rng.below(base.as_nanos() as u64 / 4 + 1));
        self.timers
            .set(&mut t.timer, now + base + jitter, Timer::Reconnect(target));
        if !paced {
            t.backoff = (base * 2).min(max);
        }
    }

    /// Bytes arrived on a session's control connection. Consumes every complete frame and
    /// returns how many bytes were used; the caller keeps the rest for the next call.
    ///
    /// Malformed frames earn the session a strike; a broken framing or too many strikes close
    /// it (the whole buffer is then reported as consumed).
    pub fn handle_input(&mut self, now: Instant, session: SessionId, buf: &[u8]) -> usize {
        let now = self.clock(now);
        if self.superseded.contains_key(&session) {
            // Sent before the peer moved to the fresh connection; it sends again what counts.
            return buf.len();
        }
        let mut used = 0;
        loop {
            match self.sessions.get(&session).map(|s| s.state) {
                None | Some(SessionState::Closing) => return buf.len(),
                Some(_) => {}
            }
            match Message::decode(&buf[used..], self.config.max_frame_len) {
                Ok(None) => return used,
                Ok(Some((msg, n))) => {
                    used += n;
                    self.handle_message(now, session, msg);
                }
                Err(err)
                    if self
                        .sessions
                        .get(&session)
                        .is_some_and(|s| s.peer.is_none()) =>
                {
                    // Nothing is skipped before the handshake completed: say what was wrong
                    // and close at once, rather than leave the peer to its handshake timeout.
                    let (code, what) = match err {
                        DecodeError::UnknownVersion(_) => {
                            self.reject(session, RejectReason::VersionMismatch);
                            return buf.len();
                        }
                        DecodeError::InvalidField { ty, field } if ty == HELLO_TYPE => {
                            (ErrorCode::InvalidHello, format!("hello: invalid {field}"))
                        }
                        other => (ErrorCode::Malformed, other.to_string()),
                    };
                    self.refuse_handshake(session, code, &what);
                    return buf.len();
                }
                Err(err) => {
                    let skippable = matches!(
                        err,
                        DecodeError::UnknownType(_)
                            | DecodeError::Truncated { .. }
                            | DecodeError::TrailingBytes { .. }
                            | DecodeError::InvalidField { .. }
                    );
                    self.strike(session, &err.to_string(), !skippable);
                    if !skippable {
                        return buf.len();
                    }
                    // The length prefix was sane: skip exactly this frame.
                    let len = buf[used..used + 4]
                        .try_into()
                        .map(u32::from_le_bytes)
                        .unwrap_or(0);
                    used += 4 + len as usize;
                }
            }
        }
    }

    /// The session's control connection is gone and the driver closed its data connections:
    /// nothing of this session can be written any more (this counts as a fence).
    pub fn handle_disconnected(&mut self, now: Instant, session: SessionId) {
        let now = self.clock(now);
        self.hand_over_before_end(session);
        let Some(s) = self.sessions.get(&session) else {
            return;
        };
        let reason = s.close_reason;
        let successor = self.superseded.get(&session).copied();
        match s.peer {
            _ if successor.is_some() => {
                debug!(%session, "superseded connection closed");
            }
            Some(peer) if reason == FailureReason::PeerShutdown && s.rooms.is_empty() => {
                // An orderly goodbye with nothing at stake is not a loss worth a warning.
                info!(%session, node = %peer.node, "peer shut down");
            }
            Some(peer) if reason != FailureReason::Shutdown => {
                warn!(%session, node = %peer.node, %reason, rooms = s.rooms.len(), "lost the peer");
            }
            Some(peer) => info!(%session, node = %peer.node, "session closed by our shutdown"),
            None => {}
        }
        if let (SessionState::Blacklisted, Some(peer)) = (s.state, s.peer) {
            let until = s.last_targeted + self.config.blacklist_idle_timeout;
            self.blacklist_memory.insert(
                peer.node,
                RememberedBlacklist {
                    incarnation: peer.incarnation,
                    until,
                },
            );
        }
        if let Some(peer) = s.peer {
            if self.nodes.get(&peer.node) == Some(&session) {
                self.nodes.remove(&peer.node);
            }
        }
        self.fail_session_rooms(now, session, reason);
        self.settle_session_ops(now, session, false);
        self.fence_done(now, session);
        self.superseded.remove(&session);
        if let Some(mut s) = self.sessions.remove(&session) {
            for t in [
                &mut s.handshake_timer,
                &mut s.heartbeat_timer,
                &mut s.liveness_timer,
                &mut s.silence_timer,
                &mut s.probe_timer,
                &mut s.idle_timer,
            ] {
                self.timers.cancel(t);
            }
        }
        self.events.push_back(Event::SessionClosed { session });
        let refused = matches!(
            reason,
            FailureReason::Unauthorized | FailureReason::IncompatiblePeer
        );
        for t in self.targets.values_mut() {
            if refused && (t.check == Some(session) || t.session == Some(session)) {
                t.evidence = Some(LinkEvidence::Rejected(reason));
            }
            if t.check == Some(session) {
                t.check = None;
            }
        }
        let target = self
            .targets
            .iter()
            .find(|(_, t)| t.session == Some(session))
            .map(|(id, _)| *id);
        if let Some(target) = target {
            self.schedule_reconnect(now, target, false);
        }
    }

    /// The driver carried out [`Action::FenceSession`]: no write of this session that was in
    /// flight before can land any more.
    pub fn handle_fence_complete(&mut self, now: Instant, session: SessionId) {
        let now = self.clock(now);
        let Some(s) = self.sessions.get_mut(&session) else {
            return;
        };
        if !s.fencing {
            return;
        }
        s.fencing = false;
        self.settle_session_ops(now, session, true);
        self.fence_done(now, session);
        self.mark_ready(session);
    }

    /// Sends bytes from this side's data-plane backend to the peer's (for example the RDMA
    /// hello); the peer's endpoint emits [`Event::TransportReceived`]. Only on an established
    /// session, at most [`crate::codec::MAX_TRANSPORT_LEN`] bytes.
    pub fn send_transport(
        &mut self,
        now: Instant,
        session: SessionId,
        payload: &[u8],
    ) -> Result<(), ApiError> {
        let _ = self.clock(now);
        if payload.len() > crate::codec::MAX_TRANSPORT_LEN {
            return Err(ApiError::TransportTooLong(payload.len()));
        }
        let s = self
            .sessions
            .get(&session)
            .ok_or(ApiError::UnknownSession(session))?;
        if !matches!(
            s.state,
            SessionState::Established | SessionState::Blacklisted
        ) {
            return Err(ApiError::SessionNotReady(session));
        }
        self.transmits.push_back((
            session,
            Message::Transport {
                payload: payload.to_vec(),
            },
        ));
        Ok(())
    }

    /// Decode: the embedder's current free capacity, advertised in heartbeats.
    pub fn set_capacity(&mut self, capacity: Capacity) {
        self.capacity = capacity;
    }

    // ---------------------------------------------------------------- decode commands

    /// Decode: opens a receiver room fed by `sources` (one session per prefill rank feeding it).
    ///
    /// With `grant`, the pages are given now and the request is sent at once; without, the
    /// room stays `Bootstrapping` until [`Endpoint::grant_pages`] (the sources are told it is
    /// pending so their deadlines know why).
    pub fn open_receiver(
        &mut self,
        now: Instant,
        room: RoomId,
        generation: Generation,
        sources: &[SessionId],
        grant: Option<Grant>,
    ) -> Result<(), ApiError> {
        let now = self.clock(now);
        self.check_open(Role::Decode, room, generation)?;
        if sources.is_empty() {
            return Err(ApiError::NoSources);
        }
        if let Some(missing) = sources.iter().find(|s| !self.sessions.contains_key(s)) {
            return Err(ApiError::UnknownSession(*missing));
        }
        if let Some(g) = &grant {
            self.check_grant(g)?;
        }
        let rr = ReceiverRoom {
            held_grant: grant,
            ..ReceiverRoom::default()
        };
        self.insert_bootstrapping_receiver(now, room, generation, rr);
        self.attach_sources(now, room, sources);
        Ok(())
    }

    /// Decode: opens a receiver room fed through `links`: sessions, or targets the core keeps
    /// connected. A target without a session now is waited for: the room stays
    /// `Bootstrapping` (a grant given meanwhile is held) until every target is up, and fails
    /// once one has been down for `unreachable_timeout` (at once if it already has), with the
    /// reason its connection attempts found: [`FailureReason::ConnectionRefused`],
    /// [`FailureReason::PeerUnreachable`] (no answer), or the peer's refusal at the handshake.
    pub fn open_receiver_via(
        &mut self,
        now: Instant,
        room: RoomId,
        generation: Generation,
        links: &[Link],
        grant: Option<Grant>,
    ) -> Result<(), ApiError> {
        let now = self.clock(now);
        if let Some(sessions) = self.resolve_links(links)? {
            return self.open_receiver(now, room, generation, &sessions, grant);
        }
        self.check_open(Role::Decode, room, generation)?;
        if let Some(g) = &grant {
            self.check_grant(g)?;
        }
        let rr = ReceiverRoom {
            waiting_for: links.iter().copied().collect(),
            held_grant: grant,
            ..ReceiverRoom::default()
        };
        self.insert_bootstrapping_receiver(now, room, generation, rr);
        let window = self.config.unreachable_timeout;
        let mut expired = None;
        for link in links {
            let Link::Target(t) = *link else { continue };
            if self.target_session(t).is_some() {
                continue;
            }
            let Some(target) = self.targets.get_mut(&t) else {
                continue;
            };
            let since = *target.down_since.get_or_insert(now);
            if since + window <= now {
                expired = Some(t);
                continue;
            }
            target.waiting.push(room);
            if target.unreachable_timer.is_none() {
                self.timers.set(
                    &mut target.unreachable_timer,
                    since + window,
                    Timer::Unreachable(t),
                );
            }
        }
        if let Some(t) = expired {
            let reason = self.unreachable_reason(t);
            info!(%room, %reason, "room toward a peer that has been unreachable for the whole window");
            self.conclude(now, room, KvPoll::Failed(reason));
        }
        Ok(())
    }

    /// Records a new receiver room in `Bootstrapping`, with its bootstrap deadline armed.
    fn insert_bootstrapping_receiver(
        &mut self,
        now: Instant,
        room: RoomId,
        generation: Generation,
        rr: ReceiverRoom,
    ) {
        let mut record = Room {
            generation,
            state: KvPoll::Bootstrapping,
            bootstrap_timer: None,
            waiting_timer: None,
            abort_timer: None,
            last_activity: now,
            side: Side::Receiver(rr),
        };
        self.timers.set(
            &mut record.bootstrap_timer,
            now + self.config.bootstrap_timeout,
            Timer::Bootstrap(room),
        );
        self.rooms.insert(room, record);
        self.emit_state(room, generation, KvPoll::Bootstrapping);
    }

    /// The sessions behind `links` if every one has an established session now; `None` if a
    /// target has none yet.
    fn resolve_links(&self, links: &[Link]) -> Result<Option<Vec<SessionId>>, ApiError> {
        if links.is_empty() {
            return Err(ApiError::NoSources);
        }
        let mut sessions = Vec::with_capacity(links.len());
        let mut all = true;
        for link in links {
            match *link {
                Link::Session(mut sid) => {
                    // A session taken over lives on in the one that took it.
                    while let Some(&to) = self.superseded.get(&sid) {
                        sid = to;
                    }
                    sessions.push(sid);
                }
                Link::Target(t) => {
                    if !self.targets.contains_key(&t) {
                        return Err(ApiError::UnknownTarget(t));
                    }
                    match self.target_session(t) {
                        Some(sid) => sessions.push(sid),
                        None => all = false,
                    }
                }
            }
        }
        Ok(all.then_some(sessions))
    }

    /// A target's session is established: rooms waiting for it attach their sources now.
    fn target_up(&mut self, now: Instant, target: TargetId) {
        let Some(t) = self.targets.get_mut(&target) else {
            return;
        };
        if let Some(since) = t.down_since.take() {
            info!(%target, down_ms = now.saturating_duration_since(since).as_millis() as u64, "peer is reachable again");
        }
        self.timers.cancel(&mut t.unreachable_timer);
        let waiting = std::mem::take(&mut t.waiting);
        for room in waiting {
            let links = match self.rooms.get(&room).map(|r| (&r.side, r.state)) {
                Some((Side::Receiver(rr), KvPoll::Bootstrapping)) if !rr.waiting_for.is_empty() => {
                    rr.waiting_for.clone()
                }
                _ => continue,
            };
            let Ok(Some(sessions)) = self.resolve_links(&links) else {
                // Still waiting for another target; it holds the room in its own list.
                continue;
            };
            self.attach_sources(now, room, &sessions);
        }
    }

    /// Attaches a new room's sessions (at once, or once its targets are up), then sends its
    /// grant (or the pending notice).
    fn attach_sources(&mut self, now: Instant, room: RoomId, sessions: &[SessionId]) {
        let Some(r) = self.rooms.get_mut(&room) else {
            return;
        };
        let Side::Receiver(rr) = &mut r.side else {
            return;
        };
        rr.waiting_for.clear();
        for &sid in sessions {
            if rr.sources.iter().all(|s| s.session != sid) {
                rr.sources.push(Source::new(sid));
            }
        }
        let grant = rr.held_grant.take();
        for &sid in sessions {
            if let Some(s) = self.sessions.get_mut(&sid) {
                s.rooms.insert(room);
            }
        }
        debug!(%room, "room attached to its sources");
        if let Some(g) = grant {
            self.apply_grant(now, room, g);
        } else {
            self.send_to_sources(room, |room, generation| Message::RoomPending {
                room,
                generation,
                queue_position: 0,
            });
        }
        self.fail_if_sources_unusable(now, room);
    }

    /// Decode: the data path of `session` writes without this endpoint seeing each write
    /// (one-sided RDMA). Its rooms then succeed on the source's word, bound to the peer's
    /// incarnation, instead of on bytes counted through [`Endpoint::end_write`].
    pub fn set_one_sided(&mut self, session: SessionId) {
        if let Some(s) = self.sessions.get_mut(&session) {
            s.one_sided = true;
        }
    }

    /// Decode: the room waits for capacity behind `position` others (0: being allocated).
    /// The sources learn it, so a prefill deadline expiring says `DecodeSaturated`.
    pub fn set_queue_position(
        &mut self,
        now: Instant,
        room: RoomId,
        position: u32,
    ) -> Result<(), ApiError> {
        let _ = self.clock(now);
        let r = self.live_room(room, Role::Decode)?;
        if r.state != KvPoll::Bootstrapping {
            return Err(ApiError::AlreadyGranted(room));
        }
        if let Side::Receiver(rr) = &mut r.side {
            rr.queue_position = position;
        }
        self.send_to_sources(room, |room, generation| Message::RoomPending {
            room,
            generation,
            queue_position: position,
        });
        Ok(())
    }

    /// Decode: grants the room its pages and sends the request to every source.
    pub fn grant_pages(
        &mut self,
        now: Instant,
        room: RoomId,
        grant: Grant,
    ) -> Result<(), ApiError> {
        let now = self.clock(now);
        let r = self.live_room(room, Role::Decode)?;
        if r.state != KvPoll::Bootstrapping {
            return Err(ApiError::AlreadyGranted(room));
        }
        if matches!(&r.side, Side::Receiver(rr) if rr.held_grant.is_some()) {
            return Err(ApiError::AlreadyGranted(room));
        }
        self.check_grant(&grant)?;
        if let Some(Side::Receiver(rr)) = self.rooms.get_mut(&room).map(|r| &mut r.side) {
            if !rr.waiting_for.is_empty() {
                rr.held_grant = Some(grant);
                return Ok(());
            }
        }
        self.apply_grant(now, room, grant);
        Ok(())
    }

    /// Decode: may the peer behind `session` write `slice` for `(room, generation)`?
    ///
    /// Checks the room is live and of that generation, the session is a granted source, the
    /// region exists and the range stays inside the room's pages (or its aux row / state slot).
    /// Scratch-region writes (probes) only need a session. A refused write inside a live room
    /// fails that room with `ProtocolError`.
    pub fn check_write(
        &mut self,
        now: Instant,
        session: SessionId,
        room: RoomId,
        generation: Generation,
        slice: &Slice,
    ) -> Result<(), WriteRefused> {
        let now = self.clock(now);
        if self.superseded.contains_key(&session) {
            return Err(WriteRefused::SessionSuperseded);
        }
        let result = self.check_write_inner(session, room, generation, slice);
        if let Err(refused) = result {
            self.counters.writes_refused += 1;
            warn!(%room, %session, ?refused, ?slice, "data-plane write refused");
            let live = self
                .rooms
                .get(&room)
                .is_some_and(|r| r.generation == generation && !r.state.is_terminal());
            let out_of_bounds = matches!(
                refused,
                WriteRefused::OutOfRegion
                    | WriteRefused::PageNotGranted
                    | WriteRefused::SlotNotGranted
                    | WriteRefused::LayerNotOwned
                    | WriteRefused::UnknownRegion
                    | WriteRefused::NotASource
            );
            if live && out_of_bounds {
                self.conclude(now, room, KvPoll::Failed(FailureReason::ProtocolError));
            }
        }
        result
    }

    /// Decode: authorizes one whole write (every slice, as [`Endpoint::check_write`]) and
    /// counts it as landing until [`Endpoint::end_write`]: the room's pages are not released
    /// while it is out. Drivers call this, not `check_write`, before applying a payload.
    pub fn begin_write(
        &mut self,
        now: Instant,
        session: SessionId,
        room: RoomId,
        generation: Generation,
        slices: &[Slice],
    ) -> Result<WritePermit, WriteRefused> {
        for slice in slices {
            self.check_write(now, session, room, generation, slice)?;
        }
        let epoch = self.sessions.get(&session).map_or(0, |s| s.epoch);
        let holds_pages = slices.iter().any(|s| s.region != Region::Scratch);
        self.next_permit += 1;
        let seq = self.next_permit;
        if holds_pages {
            let units = self.write_units(room, session, slices);
            if let Some(src) = self.source_mut(room, generation, session) {
                src.pending.push((seq, session, units));
            }
        }
        Ok(WritePermit {
            session,
            room: holds_pages.then_some(room),
            generation,
            epoch,
            seq,
            applied: false,
        })
    }

    /// Decode: a write authorized by [`Endpoint::begin_write`] was applied or abandoned; its
    /// room's pages may be released now. Void permits (older fence epoch) are ignored.
    pub fn end_write(&mut self, now: Instant, permit: WritePermit) {
        let now = self.clock(now);
        let Some(room) = permit.room else { return };
        let current = self.sessions.get(&permit.session).map(|s| s.epoch);
        if current != Some(permit.epoch) {
            return;
        }
        // By permit number: the source may have moved to a session that took this one over.
        let Some(Side::Receiver(rr)) = self
            .rooms
            .get_mut(&room)
            .filter(|r| r.generation == permit.generation)
            .map(|r| &mut r.side)
        else {
            return;
        };
        for src in rr.sources.iter_mut() {
            if let Some(i) = src.pending.iter().position(|p| p.0 == permit.seq) {
                let (_, _, units) = src.pending.swap_remove(i);
                if permit.applied {
                    for u in units {
                        src.coverage.mark(u);
                    }
                }
                break;
            }
        }
        if self.rooms.get(&room).is_some_and(|r| r.state.is_terminal()) {
            self.maybe_release(now, room);
        }
    }

    /// Decode: the coverage units a write of (already checked) `slices` fills entirely.
    fn write_units(&self, room: RoomId, session: SessionId, slices: &[Slice]) -> Vec<u32> {
        let mut units = Vec::new();
        let Some(Side::Receiver(rr)) = self.rooms.get(&room).map(|r| &r.side) else {
            return units;
        };
        let Some(cov) = rr
            .sources
            .iter()
            .find(|s| s.session == session)
            .map(|s| &s.coverage)
        else {
            return units;
        };
        let layout = &self.local.layout;
        for s in slices {
            match s.region {
                Region::Kv { layer, plane } => {
                    let page = u64::from(layout.page_bytes);
                    let first = s.dst_offset.div_ceil(page);
                    let end = (s.dst_offset + s.len) / page;
                    for p in first..end {
                        let rank = rr.pages.as_ref().and_then(|ps| ps.rank(p as u32));
                        if let Some(u) = rank.and_then(|r| cov.kv_unit(layer, plane, r)) {
                            units.push(u);
                        }
                    }
                }
                Region::Aux if s.len >= u64::from(layout.aux_bytes) => {
                    units.push(cov.slot_unit(false));
                }
                Region::State if s.len >= u64::from(layout.state_bytes) => {
                    units.push(cov.slot_unit(true));
                }
                _ => {}
            }
        }
        units
    }

    /// Decode: the source entry of `session` in room `(room, generation)`.
    fn source_mut(
        &mut self,
        room: RoomId,
        generation: Generation,
        session: SessionId,
    ) -> Option<&mut Source> {
        let r = self.rooms.get_mut(&room)?;
        if r.generation != generation {
            return None;
        }
        let Side::Receiver(rr) = &mut r.side else {
            return None;
        };
        rr.sources.iter_mut().find(|s| s.session == session)
    }

    fn check_write_inner(
        &self,
        session: SessionId,
        room: RoomId,
        generation: Generation,
        slice: &Slice,
    ) -> Result<(), WriteRefused> {
        let layout = &self.local.layout;
        let region_len = layout
            .region_len(slice.region)
            .ok_or(WriteRefused::UnknownRegion)?;
        let end = slice
            .dst_offset
            .checked_add(slice.len)
            .ok_or(WriteRefused::OutOfRegion)?;
        if end > region_len || slice.len == 0 {
            return Err(WriteRefused::OutOfRegion);
        }
        if slice.region == Region::Scratch {
            return match self.sessions.get(&session).map(|s| s.state) {
                Some(SessionState::Established | SessionState::Blacklisted) => Ok(()),
                _ => Err(WriteRefused::NotASource),
            };
        }
        let r = self.rooms.get(&room).ok_or(WriteRefused::UnknownRoom)?;
        if r.generation != generation {
            return Err(WriteRefused::StaleGeneration);
        }
        if r.state.is_terminal() {
            return Err(WriteRefused::RoomConcluded);
        }
        let Side::Receiver(rr) = &r.side else {
            return Err(WriteRefused::UnknownRoom);
        };
        if !rr.sources.iter().any(|s| s.session == session && s.granted) {
            return Err(WriteRefused::NotASource);
        }
        match slice.region {
            Region::Kv { layer, .. } => {
                let peer = self.sessions.get(&session).and_then(|s| s.peer);
                if peer.is_some_and(|p| layer < p.layer_start || layer >= p.layer_end) {
                    return Err(WriteRefused::LayerNotOwned);
                }
                let page = u64::from(layout.page_bytes);
                let first = (slice.dst_offset / page) as u32;
                let last = ((end - 1) / page) as u32;
                let pages = rr.pages.as_ref().ok_or(WriteRefused::PageNotGranted)?;
                if pages.contains_range(first, last) {
                    Ok(())
                } else {
                    Err(WriteRefused::PageNotGranted)
                }
            }
            Region::Aux | Region::State => {
                let (slot, item) = if slice.region == Region::Aux {
                    (rr.aux_slot, layout.aux_bytes)
                } else {
                    (rr.state_slot, layout.state_bytes)
                };
                let slot = slot.ok_or(WriteRefused::SlotNotGranted)?;
                let start = u64::from(slot) * u64::from(item);
                if slice.dst_offset >= start && end <= start + u64::from(item) {
                    Ok(())
                } else {
                    Err(WriteRefused::SlotNotGranted)
                }
            }
            Region::Scratch => Ok(()),
        }
    }

    // ---------------------------------------------------------------- prefill commands

    /// Prefill: opens a sender room. It is `Bootstrapping` until every decode rank that will
    /// read it sent its request (requests that arrived earlier are applied now).
    pub fn open_sender(
        &mut self,
        now: Instant,
        room: RoomId,
        generation: Generation,
    ) -> Result<(), ApiError> {
        let now = self.clock(now);
        if self.local.role != Role::Prefill {
            return Err(ApiError::WrongRole {
                needs: Role::Prefill,
            });
        }
        if self.shut_down {
            return Err(ApiError::ShutDown);
        }
        if self.rooms.contains_key(&room) {
            return Err(ApiError::RoomExists(room));
        }
        // A failure decided before the room was opened (decode aborted, session blacklisted,
        // consensus) is delivered at once, so prefill never computes a doomed room.
        let early = match (self.tombstones.verdict(room), self.tombstones.get(room)) {
            (Some((g, reason)), _) if g == generation => Some(reason),
            (_, Some((g, _))) if g >= generation => {
                return Err(ApiError::StaleGeneration {
                    room,
                    generation,
                    used: g,
                })
            }
            _ => None,
        };
        let mut record = Room {
            generation,
            state: KvPoll::Bootstrapping,
            bootstrap_timer: None,
            waiting_timer: None,
            abort_timer: None,
            last_activity: now,
            side: Side::Sender(SenderRoom::default()),
        };
        if let Some(reason) = early {
            record.state = KvPoll::Failed(reason);
            self.rooms.insert(room, record);
            self.emit_state(room, generation, KvPoll::Failed(reason));
            self.count_terminal(KvPoll::Failed(reason));
            self.maybe_release(now, room);
            return Ok(());
        }
        self.timers.set(
            &mut record.bootstrap_timer,
            now + self.config.bootstrap_timeout,
            Timer::Bootstrap(room),
        );
        self.rooms.insert(room, record);
        self.emit_state(room, generation, KvPoll::Bootstrapping);
        if let Some(p) = self.pending.remove(&room) {
            if p.generation == generation {
                for (sid, pos) in p.notices {
                    self.on_room_pending(now, sid, room, generation, pos);
                }
                for (sid, req) in p.requests {
                    self.on_room_request(now, sid, req);
                }
            } else if p.generation > generation {
                self.pending.insert(room, p);
            }
        }
        Ok(())
    }

    /// Prefill: the next chunk of a room. Its pages go to the next granted destination pages.
    /// May be called while the room is still `Bootstrapping`; planning waits for the requests.
    pub fn send_chunk(&mut self, now: Instant, room: RoomId, chunk: Chunk) -> Result<(), ApiError> {
        let now = self.clock(now);
        let layers = self.owned_layers();
        let pages = self.local.layout.pages;
        let slots = self.local.layout.slots;
        let max_queued = self.config.max_queued_ops;
        if let Some(&page) = chunk.pages.iter().find(|p| **p >= pages) {
            return Err(ApiError::PageOutOfRange { page, pages });
        }
        for slot in [chunk.aux_slot, chunk.state_slot].into_iter().flatten() {
            if slot >= slots {
                return Err(ApiError::SlotOutOfRange { slot, slots });
            }
        }
        let sessions = &self.sessions;
        let full = match self.rooms.get(&room).map(|r| &r.side) {
            Some(Side::Sender(s)) => s.receivers.iter().map(|x| x.session).find(|sid| {
                sessions
                    .get(sid)
                    .is_some_and(|x| x.queue.len() as u32 >= max_queued)
            }),
            _ => None,
        };
        let r = self.live_room(room, Role::Prefill)?;
        let Side::Sender(s) = &mut r.side else {
            return Err(ApiError::UnknownRoom(room));
        };
        if s.last_seen {
            return Err(ApiError::ChunkAfterLast(room));
        }
        if let Some(sid) = full {
            return Err(ApiError::SessionQueueFull(sid));
        }
        let n = chunk.pages.len() as u32;
        s.chunks.push_back(HeldChunk {
            src: chunk.pages,
            dst_start: s.next_dst,
            layerwise: chunk.layerwise,
            released: if chunk.layerwise {
                LayerBits::new(layers)
            } else {
                LayerBits::all(layers)
            },
            planned: LayerBits::new(layers),
        });
        s.next_dst += n;
        if chunk.last {
            s.last_seen = true;
            s.aux_src = chunk.aux_slot;
            s.state_src = chunk.state_slot;
        }
        r.last_activity = now;
        self.plan_room(now, room);
        Ok(())
    }

    /// Prefill: layer `layer` of every named room finished its forward pass; its operations
    /// may go now. Applies to every chunk already sent that still holds that layer.
    pub fn mark_layer_ready(
        &mut self,
        now: Instant,
        rooms: &[RoomId],
        layer: u16,
    ) -> Result<(), ApiError> {
        let now = self.clock(now);
        if self.local.role != Role::Prefill {
            return Err(ApiError::WrongRole {
                needs: Role::Prefill,
            });
        }
        if layer < self.local.layer_start || layer >= self.local.layer_end {
            return Err(ApiError::LayerOutOfRange { layer });
        }
        let idx = usize::from(layer - self.local.layer_start);
        for &room in rooms {
            let Some(r) = self.rooms.get_mut(&room) else {
                continue;
            };
            if r.state.is_terminal() {
                continue;
            }
            if let Side::Sender(s) = &mut r.side {
                for c in s.chunks.iter_mut() {
                    c.released.set(idx);
                }
                r.last_activity = now;
            }
            self.plan_room(now, room);
        }
        Ok(())
    }

    // ---------------------------------------------------------------- both roles

    /// Aborts a room locally. Decode keeps its pages quarantined until every source drained
    /// or was fenced; prefill stops issuing operations and tells its receivers.
    pub fn abort(&mut self, now: Instant, room: RoomId) -> Result<(), ApiError> {
        let now = self.clock(now);
        let r = self.rooms.get(&room).ok_or(ApiError::UnknownRoom(room))?;
        if r.state.is_terminal() {
            return Err(ApiError::RoomConcluded(room, r.state));
        }
        self.conclude(now, room, KvPoll::Failed(FailureReason::AbortedLocally));
        Ok(())
    }

    /// Fails a room softly, for instance on a consensus verdict. Works from any non-terminal
    /// state (including `Bootstrapping`); returns `false` when the room was already terminal
    /// or unknown, so applying the same verdict twice is harmless.
    pub fn fail_room(&mut self, now: Instant, room: RoomId, reason: FailureReason) -> bool {
        let now = self.clock(now);
        match self.rooms.get(&room) {
            Some(r) if !r.state.is_terminal() => {
                self.conclude(now, room, KvPoll::Failed(reason));
                true
            }
            Some(_) => false,
            None => {
                // Prefill may hold requests for a room it has not opened yet: answer them.
                if let Some(p) = self.pending.remove(&room) {
                    self.reject_pending(room, p, reason);
                    true
                } else {
                    false
                }
            }
        }
    }

    /// Shuts the endpoint down: every live room fails with `Shutdown`, every session is told
    /// and closed. Later commands fail with [`ApiError::ShutDown`].
    pub fn shutdown(&mut self, now: Instant) {
        let now = self.clock(now);
        self.shut_down = true;
        let rooms: Vec<RoomId> = self.rooms.keys().copied().collect();
        for room in rooms {
            if self
                .rooms
                .get(&room)
                .is_some_and(|r| !r.state.is_terminal())
            {
                self.conclude(now, room, KvPoll::Failed(FailureReason::Shutdown));
            }
        }
        let sessions: Vec<SessionId> = self.sessions.keys().copied().collect();
        for sid in sessions {
            self.close_session(
                now,
                sid,
                ErrorCode::Shutdown,
                "shutting down",
                FailureReason::Shutdown,
            );
        }
    }

    // ---------------------------------------------------------------- data path results

    /// A data-path operation finished. Unknown ids (already settled, superseded) are ignored.
    pub fn handle_transfer_result(
        &mut self,
        now: Instant,
        id: TransferId,
        outcome: TransferOutcome,
    ) {
        let now = self.clock(now);
        let Some(op) = self.ops.get_mut(&id) else {
            self.counters.stale_messages += 1;
            return;
        };
        if op.phase != OpPhase::InFlight {
            return;
        }
        self.timers.cancel(&mut op.timer);
        self.settle_attempt(now, id, outcome);
    }

    /// Takes an attempt that was in flight out of flight and decides what happens next.
    fn settle_attempt(&mut self, now: Instant, id: TransferId, outcome: TransferOutcome) {
        let Some(mut op) = self.ops.remove(&id) else {
            return;
        };
        self.timers.cancel(&mut op.timer);
        if let Some(s) = self.sessions.get_mut(&op.session) {
            s.in_flight = s.in_flight.saturating_sub(1);
        }
        self.mark_ready(op.session);
        let room_live = op.room.and_then(|room| {
            let r = self.rooms.get_mut(&room)?;
            if let Side::Sender(s) = &mut r.side {
                s.ops_in_flight = s.ops_in_flight.saturating_sub(1);
            }
            (r.generation == op.generation && !r.state.is_terminal()).then_some(room)
        });
        if op.kind == OpKind::Probe {
            self.on_probe_result(now, op.session, id, outcome);
            return;
        }
        if op.superseded && outcome != TransferOutcome::Done {
            // Its connection was taken over: not a data-path failure, run it again as new.
            op.superseded = false;
            if room_live.is_none() {
                self.op_finished(now, op.room, op.generation, op.layers.clone());
                return;
            }
            op.phase = OpPhase::Queued;
            let session = op.session;
            let new_id = self.alloc_op_id();
            self.ops.insert(new_id, op);
            if let Some(s) = self.sessions.get_mut(&session) {
                s.queue.push_front(new_id);
            }
            self.mark_ready(session);
            return;
        }
        match outcome {
            TransferOutcome::Transient => self.counters.transient_failures += 1,
            TransferOutcome::Fatal => self.counters.fatal_failures += 1,
            _ => {}
        }
        if let Some(s) = self.sessions.get_mut(&op.session) {
            if outcome == TransferOutcome::Done {
                s.stats.ops_done += 1;
                s.stats.bytes_done += op.bytes;
            } else {
                s.stats.ops_failed += 1;
            }
        }
        let session_usable = self
            .sessions
            .get(&op.session)
            .is_some_and(|s| s.state == SessionState::Established);
        match outcome {
            TransferOutcome::Done => {
                if let Some(s) = self.sessions.get_mut(&op.session) {
                    s.failures = 0;
                }
                self.counters.bytes_transferred += op.bytes;
                if op.attempt > 1 {
                    self.counters.retry_recoveries += 1;
                    warn!(
                        session = %op.session,
                        room = ?op.room,
                        attempts = op.attempt,
                        "transfer recovered after retry"
                    );
                }
                self.op_finished(now, op.room, op.generation, op.layers.clone());
            }
            TransferOutcome::Transient
                if op.attempt < self.config.transfer_retries
                    && room_live.is_some()
                    && session_usable =>
            {
                self.counters.retries += 1;
                let step = self.config.retry_backoff;
                let jitter = self.rng.below(step.as_nanos() as u64 / 2 + 1);
                let delay = step * op.attempt + Duration::from_nanos(jitter);
                debug!(session = %op.session, room = ?op.room, attempt = op.attempt, ?delay, "transfer attempt failed, retrying");
                op.attempt += 1;
                op.phase = OpPhase::RetryWait;
                // A new id per attempt: a late report of the old attempt cannot be mistaken.
                let new_id = self.alloc_op_id();
                self.timers
                    .set(&mut op.timer, now + delay, Timer::Retry(new_id));
                self.ops.insert(new_id, op);
            }
            TransferOutcome::Refused => {
                warn!(session = %op.session, room = ?op.room, "destination refused the write");
                // Fail first: with this operation gone the room must not look complete.
                if let Some(room) = room_live {
                    self.conclude(now, room, KvPoll::Failed(FailureReason::AbortedByPeer));
                }
                self.op_finished(now, op.room, op.generation, op.layers.clone());
            }
            TransferOutcome::Transient | TransferOutcome::Fatal => {
                let first = op.slices.first().copied();
                let Some(room) = room_live else {
                    // The room already concluded (aborted): the failure says nothing new.
                    self.op_finished(now, op.room, op.generation, op.layers.clone());
                    return;
                };
                self.counters.ops_exhausted += 1;
                warn!(
                    session = %op.session,
                    room = ?op.room,
                    attempts = op.attempt,
                    slices = op.slices.len(),
                    bytes = op.bytes,
                    first_slice = ?first,
                    ?outcome,
                    "transfer failed after retries"
                );
                // Fail first: with this operation gone the room must not look complete.
                self.conclude(now, room, KvPoll::Failed(FailureReason::TransferFailed));
                self.op_finished(now, op.room, op.generation, op.layers.clone());
                let threshold = self.config.session_failure_threshold;
                let blacklist = match self.sessions.get_mut(&op.session) {
                    Some(s) if s.state == SessionState::Established => {
                        s.failures += 1;
                        s.failures >= threshold
                    }
                    _ => false,
                };
                if blacklist {
                    self.blacklist(now, op.session);
                }
            }
        }
    }

    /// One operation of a room is gone for good (done or given up).
    fn op_finished(
        &mut self,
        now: Instant,
        room: Option<RoomId>,
        generation: Generation,
        layers: Range<usize>,
    ) {
        let Some(room) = room else { return };
        let Some(r) = self.rooms.get_mut(&room) else {
            return;
        };
        if r.generation != generation {
            return;
        }
        if let Side::Sender(s) = &mut r.side {
            s.ops_live = s.ops_live.saturating_sub(1);
            if let Some(live) = s.layer_live.get_mut(layers) {
                for n in live {
                    *n = n.saturating_sub(1);
                }
            }
        }
        r.last_activity = now;
        if r.state.is_terminal() {
            self.maybe_release(now, room);
        } else {
            self.report_delivered_layers(room);
            self.check_sender_complete(now, room);
        }
    }

    /// Emits `LayerDelivered` for every owned layer, in order, whose operations are all
    /// planned (no chunk still holds it back) and acknowledged, once the last chunk was sent.
    fn report_delivered_layers(&mut self, room: RoomId) {
        let first_layer = self.local.layer_start;
        let owned = self.owned_layers();
        let Some((generation, s)) = live_sender(&mut self.rooms, room) else {
            return;
        };
        if !s.last_seen {
            return;
        }
        while usize::from(s.layers_delivered) < owned {
            let l = usize::from(s.layers_delivered);
            let planned = s.chunks.iter().all(|c| c.planned.get(l));
            if !planned || s.layer_live.get(l).is_some_and(|&n| n > 0) {
                break;
            }
            s.layers_delivered += 1;
            self.events.push_back(Event::LayerDelivered {
                room,
                generation,
                layer: first_layer + l as u16,
            });
        }
    }

    // ---------------------------------------------------------------- timers

    /// Processes every deadline due at `now`.
    pub fn handle_timeout(&mut self, now: Instant) {
        let now = self.clock(now);
        while let Some((key, timer)) = self.timers.pop_due(now) {
            self.on_timer(now, key, timer);
        }
    }

    fn on_timer(&mut self, now: Instant, key: TimerKey, timer: Timer) {
        match timer {
            Timer::Bootstrap(room) => {
                let Some(r) = self.rooms.get_mut(&room) else {
                    return;
                };
                if r.bootstrap_timer != Some(key) {
                    return;
                }
                r.bootstrap_timer = None;
                if r.state != KvPoll::Bootstrapping {
                    return;
                }
                let saturated = match &r.side {
                    Side::Sender(s) => {
                        s.saturated
                            || s.announced_by.iter().any(|sid| {
                                self.sessions
                                    .get(sid)
                                    .and_then(|x| x.capacity)
                                    .is_some_and(|c| c.saturated())
                            })
                    }
                    Side::Receiver(rr) => rr.queue_position > 0,
                };
                let down_target = match &r.side {
                    Side::Receiver(rr) => rr.waiting_for.iter().find_map(|l| match *l {
                        Link::Target(t) => Some(t),
                        Link::Session(_) => None,
                    }),
                    Side::Sender(_) => None,
                };
                let reason = if let Some(t) = down_target {
                    // Still waiting for a target's session: that is why it never bootstrapped.
                    self.unreachable_reason(t)
                } else if saturated {
                    FailureReason::DecodeSaturated
                } else {
                    FailureReason::BootstrapTimeout
                };
                info!(%room, %reason, "room bootstrap deadline expired");
                self.conclude(now, room, KvPoll::Failed(reason));
            }
            Timer::Waiting(room) => {
                let Some(r) = self.rooms.get_mut(&room) else {
                    return;
                };
                if r.waiting_timer != Some(key) {
                    return;
                }
                r.waiting_timer = None;
                if r.state.is_terminal() {
                    return;
                }
                let due = r.last_activity + self.config.waiting_timeout;
                if due > now {
                    self.timers
                        .set(&mut r.waiting_timer, due, Timer::Waiting(room));
                    return;
                }
                info!(%room, "room waiting deadline expired");
                self.conclude(now, room, KvPoll::Failed(FailureReason::WaitingTimeout));
            }
            Timer::AbortAck(room) => {
                let Some(r) = self.rooms.get_mut(&room) else {
                    return;
                };
                if r.abort_timer != Some(key) {
                    return;
                }
                r.abort_timer = None;
                let Side::Receiver(rr) = &r.side else { return };
                let undrained: SmallVec<[SessionId; 2]> = rr
                    .sources
                    .iter()
                    .filter(|s| (s.granted && !s.drained && !s.done) || !s.pending.is_empty())
                    .map(|s| s.session)
                    .collect();
                for sid in undrained {
                    warn!(%room, session = %sid, "no drain acknowledgement in time, fencing the session");
                    self.fence(sid);
                }
            }
            Timer::Operation(id) => {
                let Some(op) = self.ops.get_mut(&id) else {
                    return;
                };
                if op.timer != Some(key) || op.phase != OpPhase::InFlight {
                    return;
                }
                op.timer = None;
                let session = op.session;
                if op.superseded {
                    // It hangs on a connection already replaced: the new one is not at fault.
                    self.settle_attempt(now, id, TransferOutcome::Transient);
                    return;
                }
                warn!(%session, room = ?op.room, "transfer attempt timed out; fencing the session");
                // The attempt may still be writing: fence before anything else is sent.
                self.fence(session);
                self.settle_attempt(now, id, TransferOutcome::Transient);
            }
            Timer::Retry(id) => {
                let Some(op) = self.ops.get_mut(&id) else {
                    return;
                };
                if op.timer != Some(key) || op.phase != OpPhase::RetryWait {
                    return;
                }
                op.timer = None;
                op.phase = OpPhase::Queued;
                let session = op.session;
                if let Some(s) = self.sessions.get_mut(&session) {
                    s.queue.push_front(id);
                }
                self.mark_ready(session);
            }
            Timer::Handshake(sid) => {
                let Some(s) = self.sessions.get_mut(&sid) else {
                    return;
                };
                if s.handshake_timer != Some(key) {
                    return;
                }
                s.handshake_timer = None;
                if s.state == SessionState::Handshaking {
                    let target = s.target;
                    if let Some(t) = target.and_then(|t| self.targets.get_mut(&t)) {
                        // The connection was taken and nothing answered: the process is stuck.
                        t.evidence = Some(LinkEvidence::Silent);
                        if t.check == Some(sid) {
                            // A link check given up: close it quietly (no error that a late
                            // delivery could turn against the session it was checking).
                            self.request_close(sid);
                            return;
                        }
                    }
                    self.close_session(
                        now,
                        sid,
                        ErrorCode::HeartbeatsMissed,
                        "no hello in time",
                        FailureReason::PeerSilent,
                    );
                }
            }
            Timer::Heartbeat(sid) => self.on_heartbeat_timer(now, sid, key),
            Timer::Reconnect(target) => {
                let Some(t) = self.targets.get_mut(&target) else {
                    return;
                };
                if t.timer != Some(key) {
                    return;
                }
                t.timer = None;
                if t.dialing || self.target_session(target).is_some() {
                    return;
                }
                self.dial(target);
            }
            Timer::Silence(sid) => self.on_silence_timer(now, sid, key),
            Timer::Unreachable(target) => {
                let Some(t) = self.targets.get_mut(&target) else {
                    return;
                };
                if t.unreachable_timer != Some(key) {
                    return;
                }
                t.unreachable_timer = None;
                let waiting = std::mem::take(&mut t.waiting);
                let reason = self.unreachable_reason(target);
                if !waiting.is_empty() {
                    warn!(%target, rooms = waiting.len(), %reason, "peer unreachable for the whole window, failing the rooms waiting for it");
                }
                for room in waiting {
                    let still = self.rooms.get(&room).is_some_and(|r| {
                        matches!(&r.side, Side::Receiver(rr) if rr.waiting_for.contains(&Link::Target(target)))
                    });
                    if still {
                        self.conclude(now, room, KvPoll::Failed(reason));
                    }
                }
            }
            Timer::Liveness(sid) => {
                let Some(s) = self.sessions.get_mut(&sid) else {
                    return;
                };
                let window = s.window;
                if s.liveness_timer != Some(key) {
                    return;
                }
                s.liveness_timer = None;
                let due = s.last_rx + window;
                if due > now {
                    self.timers
                        .set(&mut s.liveness_timer, due, Timer::Liveness(sid));
                    return;
                }
                // What fresh connections found during the silence names the cause; without
                // any (a listener cannot dial), the peer is silent.
                if self.hand_over_before_end(sid) {
                    return;
                }
                let Some(s) = self.sessions.get_mut(&sid) else {
                    return;
                };
                let evidence = s
                    .target
                    .filter(|_| !self.superseded.contains_key(&sid))
                    .and_then(|t| self.targets.get(&t))
                    .and_then(|t| t.evidence);
                // Without a link check (the accepting side never dials) the peer is silent.
                let reason = evidence.map_or(FailureReason::PeerSilent, LinkEvidence::reason);
                warn!(session = %sid, %reason, "peer silent for the whole liveness window");
                self.close_session(
                    now,
                    sid,
                    ErrorCode::HeartbeatsMissed,
                    "heartbeats missed",
                    reason,
                );
            }
            Timer::Probe(sid) => {
                let Some(s) = self.sessions.get_mut(&sid) else {
                    return;
                };
                if s.probe_timer != Some(key) {
                    return;
                }
                s.probe_timer = None;
                if s.state != SessionState::Blacklisted || s.probe_op.is_some() {
                    return;
                }
                self.counters.probes_sent += 1;
                let slices: Arc<[Slice]> = Arc::from(vec![Slice {
                    region: Region::Scratch,
                    src_offset: 0,
                    dst_offset: 0,
                    len: 8,
                }]);
                let id = self.alloc_op_id();
                self.ops.insert(
                    id,
                    Op {
                        session: sid,
                        room: None,
                        generation: 0,
                        kind: OpKind::Probe,
                        slices,
                        layers: 0..0,
                        bytes: 8,
                        attempt: 1,
                        phase: OpPhase::Queued,
                        timer: None,
                        superseded: false,
                    },
                );
                if let Some(s) = self.sessions.get_mut(&sid) {
                    s.probe_op = Some(id);
                    s.queue.push_front(id);
                }
                self.mark_ready(sid);
            }
            Timer::BlacklistIdle(sid) => {
                let idle = self.config.blacklist_idle_timeout;
                let Some(s) = self.sessions.get_mut(&sid) else {
                    return;
                };
                if s.idle_timer != Some(key) {
                    return;
                }
                s.idle_timer = None;
                if s.state != SessionState::Blacklisted {
                    return;
                }
                let due = s.last_targeted + idle;
                if due > now {
                    self.timers
                        .set(&mut s.idle_timer, due, Timer::BlacklistIdle(sid));
                    return;
                }
                info!(session = %sid, "blacklisted session idle, forgetting it");
                self.counters.sessions_expired += 1;
                self.events
                    .push_back(Event::SessionExpired { session: sid });
                // Expiry forgets the blacklist: do not carry it into a reconnect.
                if let Some(s) = self.sessions.get_mut(&sid) {
                    s.state = SessionState::Established;
                }
                self.close_session(
                    now,
                    sid,
                    ErrorCode::Shutdown,
                    "idle blacklisted session",
                    FailureReason::SessionBlacklisted,
                );
            }
        }
    }

    /// Asks the driver for one connection attempt to `target`.
    fn dial(&mut self, target: TargetId) {
        let Some(t) = self.targets.get_mut(&target) else {
            return;
        };
        t.dialing = true;
        self.actions.push_back(Action::Connect {
            target,
            timeout: self.config.connect_timeout,
        });
    }

    /// A session that heard nothing for `silence_timeout` gets its link checked with fresh
    /// connections, one attempt per `connect_timeout`, until it is heard again, a fresh
    /// connection takes it over, or its liveness window ends.
    fn on_silence_timer(&mut self, now: Instant, sid: SessionId, key: TimerKey) {
        let pace = self.config.connect_timeout;
        let Some(s) = self.sessions.get_mut(&sid) else {
            return;
        };
        let silence = s.silence;
        if s.silence_timer != Some(key) {
            return;
        }
        s.silence_timer = None;
        if !matches!(
            s.state,
            SessionState::Established | SessionState::Blacklisted
        ) {
            return;
        }
        let due = s.last_rx + silence;
        if due > now {
            self.timers
                .set(&mut s.silence_timer, due, Timer::Silence(sid));
            return;
        }
        self.timers
            .set(&mut s.silence_timer, now + pace, Timer::Silence(sid));
        let Some(target) = s.target else {
            // Only the side that dials can check the link; the other waits for its peer's.
            return;
        };
        let first = !s.silence_noted;
        s.silence_noted = true;
        let quiet_ms = now.saturating_duration_since(s.last_rx).as_millis() as u64;
        let node = s.peer.map(|p| p.node);
        let Some(t) = self.targets.get_mut(&target) else {
            return;
        };
        if t.session != Some(sid) {
            return;
        }
        if first {
            t.evidence = None;
            info!(session = %sid, ?node, quiet_ms, "peer silent; checking the link with fresh connections");
        }
        if !t.dialing && t.check.is_none() {
            self.dial(target);
        }
    }

    fn on_heartbeat_timer(&mut self, now: Instant, sid: SessionId, key: TimerKey) {
        let interval = self.config.heartbeat_interval;
        let Some(s) = self.sessions.get_mut(&sid) else {
            return;
        };
        if s.heartbeat_timer != Some(key) {
            return;
        }
        s.heartbeat_timer = None;
        if s.state == SessionState::Closing {
            return;
        }
        self.timers.set(
            &mut s.heartbeat_timer,
            now + interval,
            Timer::Heartbeat(sid),
        );
        let rooms: SmallVec<[RoomId; 16]> = s.rooms.iter().copied().collect();
        let (free_pages, queued_rooms) = match self.local.role {
            Role::Decode => (self.capacity.free_pages, self.capacity.queued_rooms),
            Role::Prefill => (0, 0),
        };
        self.transmits.push_back((
            sid,
            Message::Heartbeat {
                free_pages,
                queued_rooms,
            },
        ));
        if self.local.role != Role::Prefill {
            return;
        }
        // Keepalive progress for rooms that said nothing for a progress interval, so decode's
        // deadline measures whether prefill is alive and moving, not how long its queues are.
        let interval = self.config.progress_interval;
        for room in rooms {
            let Some(r) = self.rooms.get_mut(&room) else {
                continue;
            };
            if r.state.is_terminal() {
                continue;
            }
            let Side::Sender(s) = &mut r.side else {
                continue;
            };
            let Some(stage) = s.stage else { continue };
            if s.last_progress_sent.is_some_and(|t| t + interval > now) {
                continue;
            }
            s.last_progress_sent = Some(now);
            let generation = r.generation;
            if s.receivers.iter().any(|x| x.session == sid) {
                self.transmits.push_back((
                    sid,
                    Message::Progress {
                        room,
                        generation,
                        stage,
                    },
                ));
            }
        }
    }

    // ---------------------------------------------------------------- message handling

    fn handle_message(&mut self, now: Instant, sid: SessionId, msg: Message) {
        let Some(s) = self.sessions.get_mut(&sid) else {
            return;
        };
        s.last_rx = now;
        s.silence_noted = false;
        let established = s.peer.is_some();
        if s.resumes.is_some()
            && !matches!(
                msg,
                Message::Challenge { .. } | Message::Hello(_) | Message::Error { .. }
            )
        {
            // The dialer uses the fresh connection: it took the work over on its side.
            self.commit_resume(sid);
        }
        match msg {
            Message::Challenge { nonce } => {
                if established {
                    self.strike(sid, "a challenge after the handshake", false);
                } else {
                    self.on_challenge(sid, nonce);
                }
            }
            Message::Hello(h) => {
                if established {
                    self.strike(sid, "second hello", false);
                } else {
                    self.on_hello(now, sid, h);
                }
            }
            // Also before the hello: a listener refuses a bad token without saying who it is.
            Message::Error { code, detail } => {
                if code == ErrorCode::Shutdown {
                    info!(session = %sid, %detail, "peer is closing the session");
                } else {
                    warn!(session = %sid, ?code, %detail, "peer reported an error");
                }
                self.events.push_back(Event::PeerError {
                    session: sid,
                    code,
                    detail: detail.clone(),
                });
                let reason = match code {
                    ErrorCode::IncompatibleLayout
                    | ErrorCode::VersionMismatch
                    | ErrorCode::WrongRole => FailureReason::IncompatiblePeer,
                    ErrorCode::BadToken => FailureReason::Unauthorized,
                    ErrorCode::Shutdown => FailureReason::PeerShutdown,
                    ErrorCode::HeartbeatsMissed => FailureReason::PeerSilent,
                    ErrorCode::Malformed
                    | ErrorCode::ProtocolViolation
                    | ErrorCode::InvalidHello => FailureReason::ProtocolError,
                };
                if let Some(s) = self.sessions.get_mut(&sid) {
                    s.close_reason = reason;
                }
                self.fail_session_rooms(now, sid, reason);
                self.request_close(sid);
            }
            other if !established => {
                let what = format!("{} before the handshake completed", message_name(&other));
                self.refuse_handshake(sid, ErrorCode::ProtocolViolation, &what);
            }
            Message::Heartbeat {
                free_pages,
                queued_rooms,
            } => {
                if let Some(s) = self.sessions.get_mut(&sid) {
                    s.capacity = Some(Capacity {
                        free_pages,
                        queued_rooms,
                    });
                }
            }
            Message::Probe { nonce } => {
                self.transmits.push_back((sid, Message::ProbeAck { nonce }))
            }
            Message::Transport { payload } => {
                self.events.push_back(Event::TransportReceived {
                    session: sid,
                    payload,
                });
            }
            Message::ProbeAck { nonce } => self.on_probe_ack(now, sid, nonce),
            Message::RoomPending {
                room,
                generation,
                queue_position,
            } if self.local.role == Role::Prefill => {
                self.on_room_pending(now, sid, room, generation, queue_position)
            }
            Message::RoomRequest(req) if self.local.role == Role::Prefill => {
                self.on_room_request(now, sid, req)
            }
            Message::Abort {
                room,
                generation,
                reason,
            } if self.local.role == Role::Prefill => {
                self.on_abort(now, sid, room, generation, reason)
            }
            Message::RoomStatus {
                room,
                generation,
                failure,
            } if self.local.role == Role::Decode => {
                self.on_room_status(now, sid, room, generation, failure)
            }
            Message::Progress {
                room,
                generation,
                stage,
            } if self.local.role == Role::Decode => {
                self.on_progress(now, sid, room, generation, stage)
            }
            Message::AbortAck { room, generation } if self.local.role == Role::Decode => {
                self.on_abort_ack(now, sid, room, generation)
            }
            other => {
                let what = format!(
                    "{:?} sent to a {:?} endpoint",
                    message_name(&other),
                    self.local.role
                );
                self.strike(sid, &what, false);
            }
        }
    }

    /// The peer's challenge: a listener answers with its own, a connector with its hello.
    fn on_challenge(&mut self, sid: SessionId, theirs: Nonce) {
        let Some(s) = self.sessions.get(&sid) else {
            return;
        };
        match s.auth {
            Auth::ListenerWaiting => {
                let ours = self.nonces.fresh();
                if let Some(s) = self.sessions.get_mut(&sid) {
                    s.auth = Auth::ListenerChallenged { theirs, ours };
                }
                self.transmits
                    .push_back((sid, Message::Challenge { nonce: ours }));
            }
            Auth::ConnectorChallenged { ours } => {
                let mut hello = self.our_hello();
                let transcript = hello_transcript(&hello);
                hello.proof = connector_proof(&self.local.token, &ours, &theirs, &transcript);
                if let Some(s) = self.sessions.get_mut(&sid) {
                    s.auth = Auth::ConnectorHello {
                        ours,
                        theirs,
                        hello: transcript,
                    };
                }
                self.transmits.push_back((sid, Message::Hello(hello)));
            }
            Auth::ListenerChallenged { theirs: seen, .. }
            | Auth::ConnectorHello { theirs: seen, .. }
                if seen == theirs =>
            {
                // The same challenge again: harmless, but not what a peer should send.
                self.strike(sid, "a repeated challenge", false)
            }
            _ => self.refuse_handshake(sid, ErrorCode::ProtocolViolation, "a second challenge"),
        }
    }

    /// Closes a session whose handshake broke a rule, saying which, at once.
    fn refuse_handshake(&mut self, sid: SessionId, code: ErrorCode, what: &str) {
        self.counters.protocol_errors += 1;
        warn!(session = %sid, ?code, %what, "handshake refused");
        let now = self.last_now;
        self.close_session(now, sid, code, what, FailureReason::ProtocolError);
    }

    /// Checks the peer's proof of the cluster token: the session's key and, on a listener,
    /// the hello to answer with (sent only once every other check passed too).
    fn authenticate(
        &self,
        sid: SessionId,
        h: &Hello,
    ) -> Result<(SessionKey, Option<Hello>), HandshakeError> {
        let token = &self.local.token;
        let theirs = hello_transcript(h);
        let Some(s) = self.sessions.get(&sid) else {
            return Err(HandshakeError::Refused(RejectReason::BadToken));
        };
        match &s.auth {
            Auth::ListenerChallenged { theirs: c, ours: l } => {
                if !constant_time_eq(&connector_proof(token, c, l, &theirs), &h.proof) {
                    return Err(HandshakeError::Refused(RejectReason::BadToken));
                }
                let mut ours = self.our_hello();
                ours.proof = listener_proof(token, c, l, &theirs, &hello_transcript(&ours));
                Ok((SessionKey::derive(token, c, l), Some(ours)))
            }
            Auth::ConnectorHello {
                ours: c,
                theirs: l,
                hello,
            } => {
                if !constant_time_eq(&listener_proof(token, c, l, hello, &theirs), &h.proof) {
                    return Err(HandshakeError::Refused(RejectReason::BadToken));
                }
                Ok((SessionKey::derive(token, c, l), None))
            }
            Auth::ListenerWaiting | Auth::ConnectorChallenged { .. } | Auth::Done(_) => {
                Err(HandshakeError::OutOfOrder)
            }
        }
    }

    fn on_hello(&mut self, now: Instant, sid: SessionId, h: Hello) {
        // The proof first: who we are and what we expect (role, layout) is told only to a
        // peer that knows the token.
        let checked = self.authenticate(sid, &h).and_then(|auth| {
            if h.role == self.local.role {
                return Err(HandshakeError::Refused(RejectReason::WrongRole));
            }
            if let Err(m) = self.local.layout.compatible(&h.layout) {
                return Err(HandshakeError::Refused(RejectReason::IncompatibleLayout(
                    m.field,
                )));
            }
            Ok(auth)
        });
        let (key, reply) = match checked {
            Ok(auth) => auth,
            Err(HandshakeError::OutOfOrder) => {
                return self.refuse_handshake(
                    sid,
                    ErrorCode::ProtocolViolation,
                    "a hello before the challenges were exchanged",
                )
            }
            Err(HandshakeError::Refused(r)) => return self.reject(sid, r),
        };
        let inbound = match self.sessions.get_mut(&sid) {
            Some(s) => {
                s.auth = Auth::Done(key);
                s.inbound
            }
            None => return,
        };
        if let Some(hello) = reply {
            self.transmits.push_back((sid, Message::Hello(hello)));
        }
        let peer = PeerInfo {
            role: h.role,
            rank: h.rank,
            node: h.node,
            incarnation: h.incarnation,
            layout: h.layout,
            layer_start: h.layer_start,
            layer_end: h.layer_end,
            writes_aux: h.writes_aux,
            heartbeat_interval: Duration::from_millis(u64::from(h.heartbeat_interval_ms)),
            heartbeat_misses: h.heartbeat_misses,
        };
        // A known peer: a new incarnation voids its previous life; the same one on a fresh
        // connection takes the old session's work over (the old link went silent).
        let mut resumed_from = None;
        let mut was_blacklisted = false;
        if let Some(&old) = self.nodes.get(&h.node) {
            if old != sid {
                let (old_inc, old_state) = self
                    .sessions
                    .get(&old)
                    .map(|s| (s.peer.map(|p| p.incarnation), Some(s.state)))
                    .unwrap_or((None, None));
                if old_inc == Some(h.incarnation)
                    && old_state == Some(SessionState::Established)
                    && !self.superseded.contains_key(&old)
                {
                    resumed_from = Some(old);
                } else if old_inc != Some(h.incarnation) {
                    info!(node = %h.node, old = %old, new = %sid, "peer restarted");
                    self.events.push_back(Event::PeerRestarted {
                        node: h.node,
                        old,
                        new: sid,
                    });
                    self.close_session(
                        now,
                        old,
                        ErrorCode::Shutdown,
                        "superseded by a new incarnation",
                        FailureReason::PeerRestarted,
                    );
                } else {
                    // Blacklisted (its rooms failed already) or closing: the new session
                    // starts clean, except that a blacklist stands until a probe succeeds.
                    was_blacklisted = old_state == Some(SessionState::Blacklisted);
                    self.close_session(
                        now,
                        old,
                        ErrorCode::Shutdown,
                        "superseded by a new connection",
                        FailureReason::ConnectionLost,
                    );
                }
            }
        }
        let pending_resume = resumed_from.filter(|_| inbound);
        if pending_resume.is_some() {
            resumed_from = None;
        } else {
            self.nodes.insert(h.node, sid);
        }
        let remembered = self.blacklist_memory.remove(&h.node);
        let interval = self.config.heartbeat_interval;
        // Both ends give up on a silent session at the same moment: the longer of the two
        // announced liveness windows. Link checks wait out at least two of its heartbeats.
        let window = (interval * self.config.heartbeat_misses)
            .max(peer.heartbeat_interval * peer.heartbeat_misses);
        let silence = self.config.silence_timeout.max(peer.heartbeat_interval * 2);
        let Some(s) = self.sessions.get_mut(&sid) else {
            return;
        };
        s.peer = Some(peer);
        s.window = window;
        s.silence = silence;
        s.state = SessionState::Established;
        s.resumes = pending_resume;
        self.timers.cancel(&mut s.handshake_timer);
        self.timers.set(
            &mut s.heartbeat_timer,
            now + interval,
            Timer::Heartbeat(sid),
        );
        self.timers
            .set(&mut s.liveness_timer, now + window, Timer::Liveness(sid));
        self.timers
            .set(&mut s.silence_timer, now + silence, Timer::Silence(sid));
        let target = s.target;
        if let Some(old) = resumed_from {
            self.take_over(h.node, old, sid);
        }
        self.events
            .push_back(Event::SessionEstablished { session: sid, peer });
        let reset = self.config.reconnect_interval;
        if let Some(t) = target.and_then(|t| self.targets.get_mut(&t)) {
            t.backoff = reset;
            t.session = Some(sid);
            t.check = None;
            t.evidence = None;
            self.timers.cancel(&mut t.timer);
        }
        if let Some(t) = target {
            self.target_up(now, t);
        }
        if resumed_from.is_some() {
            self.replay(sid);
        }
        let remembered =
            remembered.is_some_and(|m| m.incarnation == h.incarnation && m.until > now);
        if was_blacklisted || remembered {
            // Same process reconnected: its blacklist stands until a probe succeeds.
            self.blacklist(now, sid);
        }
    }

    /// A fresh connection of the same peer process takes over the work of `old`, whose link
    /// went silent: rooms, operations and failure count move to `new`, and nothing fails.
    /// Operations in flight on the old connection run again on the new one once their old
    /// attempt reports. The dialing side takes over when the peer's hello arrives and closes
    /// the old connection at once; the accepting side takes over only once the dialer used
    /// the new connection (or the old one ended), so its own close of the old connection can
    /// never overtake the dialer's take-over.
    fn take_over(&mut self, node: NodeId, old: SessionId, new: SessionId) {
        let Some(o) = self.sessions.get_mut(&old) else {
            return;
        };
        let rooms = std::mem::take(&mut o.rooms);
        let queue = std::mem::take(&mut o.queue);
        let (failures, capacity, in_flight) = (o.failures, o.capacity, o.in_flight);
        o.in_flight = 0;
        for t in [
            &mut o.heartbeat_timer,
            &mut o.silence_timer,
            &mut o.probe_timer,
            &mut o.idle_timer,
        ] {
            self.timers.cancel(t);
        }
        for op in self.ops.values_mut().filter(|op| op.session == old) {
            op.session = new;
            op.superseded = op.phase == OpPhase::InFlight;
        }
        for room in &rooms {
            let Some(r) = self.rooms.get_mut(room) else {
                continue;
            };
            match &mut r.side {
                Side::Sender(x) => {
                    for rcv in x.receivers.iter_mut().filter(|x| x.session == old) {
                        rcv.session = new;
                    }
                    for a in x.announced_by.iter_mut().filter(|a| **a == old) {
                        *a = new;
                    }
                }
                Side::Receiver(rr) => {
                    for src in rr.sources.iter_mut().filter(|s| s.session == old) {
                        src.session = new;
                    }
                    for l in rr.waiting_for.iter_mut() {
                        if *l == Link::Session(old) {
                            *l = Link::Session(new);
                        }
                    }
                }
            }
        }
        for p in self.pending.values_mut() {
            for (s, _) in p.requests.iter_mut().filter(|(s, _)| *s == old) {
                *s = new;
            }
            for (s, _) in p.notices.iter_mut().filter(|(s, _)| *s == old) {
                *s = new;
            }
        }
        let moved = rooms.len();
        let Some(n) = self.sessions.get_mut(&new) else {
            return;
        };
        n.rooms.extend(rooms);
        n.queue.extend(queue);
        n.failures = failures;
        n.capacity = n.capacity.or(capacity);
        n.in_flight += in_flight;
        let inbound = n.inbound;
        self.nodes.insert(node, new);
        self.superseded.insert(old, new);
        self.counters.sessions_resumed += 1;
        info!(%node, %old, %new, rooms = moved, "link back: a fresh connection took the silent session over");
        self.events
            .push_back(Event::SessionResumed { node, old, new });
        if !inbound {
            // We dialed, so the peer takes over at our first message (sent now).
            self.transmits.push_back((
                new,
                Message::Heartbeat {
                    free_pages: self.capacity.free_pages,
                    queued_rooms: self.capacity.queued_rooms,
                },
            ));
        }
        // Both sides now carry on over `new`, so the old connection can go. The accepting
        // side closes it too rather than wait for the dialer's close: that close may sit
        // behind the old connection's TCP retransmission backoff for seconds, and until then
        // the operations in flight on it would not report.
        self.request_close(old);
        self.mark_ready(new);
    }

    /// Accepted side: the fresh session `sid` takes over the silent one it was waiting for.
    fn commit_resume(&mut self, sid: SessionId) {
        let Some(s) = self.sessions.get_mut(&sid) else {
            return;
        };
        let Some(old) = s.resumes.take() else {
            return;
        };
        let Some(who) = s.peer.map(|p| (p.node, p.incarnation)) else {
            return;
        };
        let node = who.0;
        let same = self.sessions.get(&old).is_some_and(|o| {
            o.state == SessionState::Established
                && o.peer.map(|p| (p.node, p.incarnation)) == Some(who)
        });
        if !same || self.superseded.contains_key(&old) {
            self.nodes.insert(node, sid);
            return;
        }
        self.take_over(node, old, sid);
        self.replay(sid);
    }

    /// Accepted side: `old` is ending; a fresh session of the same peer waiting to take it
    /// over does so now, so the end fails nothing. Whether there was one.
    fn hand_over_before_end(&mut self, old: SessionId) -> bool {
        let heir = self
            .sessions
            .iter()
            .find(|(_, s)| s.resumes == Some(old))
            .map(|(id, _)| *id);
        if let Some(heir) = heir {
            self.commit_resume(heir);
        }
        heir.is_some()
    }

    /// After a take-over: says again on `sid` what the peer may have lost with the old
    /// connection. Each message is one the peer treats as a duplicate if it had it.
    fn replay(&mut self, sid: SessionId) {
        let Some(s) = self.sessions.get(&sid) else {
            return;
        };
        let rooms: Vec<RoomId> = s.rooms.iter().copied().collect();
        for room in rooms {
            let Some(r) = self.rooms.get(&room) else {
                continue;
            };
            let generation = r.generation;
            let state = r.state;
            let msg = match &r.side {
                Side::Sender(x)
                    if state.is_terminal() && x.receivers.iter().any(|x| x.session == sid) =>
                {
                    self.answer_with_outcome(sid, room, generation, state.failure());
                    continue;
                }
                Side::Sender(_) => continue,
                Side::Receiver(rr) => {
                    let Some(src) = rr.sources.iter().find(|s| s.session == sid) else {
                        continue;
                    };
                    match state.failure() {
                        Some(reason) if !src.done && !src.drained => Message::Abort {
                            room,
                            generation,
                            reason,
                        },
                        _ if state.is_terminal() => continue,
                        _ if src.granted => match &rr.request {
                            Some(req) => Message::RoomRequest((**req).clone()),
                            None => continue,
                        },
                        _ => Message::RoomPending {
                            room,
                            generation,
                            queue_position: rr.queue_position,
                        },
                    }
                }
            };
            self.transmits.push_back((sid, msg));
        }
    }

    fn reject(&mut self, sid: SessionId, reason: RejectReason) {
        warn!(session = %sid, ?reason, "peer refused at handshake");
        self.counters.sessions_rejected += 1;
        self.events.push_back(Event::SessionRejected {
            session: sid,
            reason,
        });
        let (code, detail) = match reason {
            RejectReason::BadToken => (
                ErrorCode::BadToken,
                "cluster token mismatch (the proof of the token did not check out)".to_owned(),
            ),
            RejectReason::WrongRole => (ErrorCode::WrongRole, "same role on both ends".to_owned()),
            RejectReason::IncompatibleLayout(f) => (
                ErrorCode::IncompatibleLayout,
                format!("layout field {f} differs"),
            ),
            RejectReason::VersionMismatch => (
                ErrorCode::VersionMismatch,
                format!(
                    "protocol version differs (this node speaks version {})",
                    crate::codec::PROTOCOL_VERSION
                ),
            ),
        };
        let now = self.last_now;
        let reason = match reason {
            RejectReason::BadToken => FailureReason::Unauthorized,
            _ => FailureReason::IncompatiblePeer,
        };
        self.close_session(now, sid, code, &detail, reason);
    }

    fn strike(&mut self, sid: SessionId, what: &str, fatal: bool) {
        self.counters.protocol_errors += 1;
        let limit = self.config.protocol_strikes;
        let Some(s) = self.sessions.get_mut(&sid) else {
            return;
        };
        s.strikes += 1;
        warn!(session = %sid, strikes = s.strikes, %what, "protocol error from peer");
        if fatal || s.strikes >= limit {
            let now = self.last_now;
            let code = if fatal {
                ErrorCode::Malformed
            } else {
                ErrorCode::ProtocolViolation
            };
            self.close_session(now, sid, code, what, FailureReason::ProtocolError);
        }
    }

    fn on_room_pending(
        &mut self,
        now: Instant,
        sid: SessionId,
        room: RoomId,
        generation: Generation,
        pos: u32,
    ) {
        if self.answer_if_concluded(sid, room, generation)
            || self.refuse_if_blacklisted(now, sid, room, generation)
        {
            return;
        }
        if self.refuse_if_served_elsewhere(sid, room, generation) {
            return;
        }
        let who = self.identity(sid);
        match self.rooms.get_mut(&room) {
            Some(r) if r.generation == generation => {
                if let Side::Sender(s) = &mut r.side {
                    if !s.announced_by.contains(&sid) {
                        s.announced_by.push(sid);
                    }
                    if let Some(w) = who.filter(|w| !s.peers.contains(w)) {
                        s.peers.push(w);
                    }
                    s.saturated = pos > 0;
                }
                if let Some(s) = self.sessions.get_mut(&sid) {
                    s.rooms.insert(room);
                }
            }
            Some(r) if r.generation > generation => self.refuse_stale(sid, room, generation),
            _ => {
                if let Some(p) = self.pending_entry(sid, room, generation) {
                    let first = p.notices.is_empty() && p.requests.is_empty();
                    p.notices.retain(|(s, _)| *s != sid);
                    p.notices.push((sid, pos));
                    if first {
                        self.events.push_back(Event::RoomAnnounced {
                            room,
                            generation,
                            session: sid,
                            pages: 0,
                        });
                    }
                }
            }
        }
    }

    fn on_room_request(&mut self, now: Instant, sid: SessionId, req: RoomRequest) {
        let (room, generation) = (req.room, req.generation);
        if self.answer_if_concluded(sid, room, generation)
            || self.refuse_if_blacklisted(now, sid, room, generation)
            || self.refuse_if_served_elsewhere(sid, room, generation)
        {
            return;
        }
        match self.rooms.get(&room) {
            Some(r) if r.generation == generation => {}
            Some(r) if r.generation > generation => {
                self.refuse_stale(sid, room, generation);
                return;
            }
            _ => {
                let pages = req.pages.iter().map(|r| r.len).sum();
                if let Some(p) = self.pending_entry(sid, room, generation) {
                    let first = p.requests.is_empty();
                    p.requests.retain(|(s, _)| *s != sid);
                    p.requests.push((sid, req));
                    if first {
                        self.events.push_back(Event::RoomAnnounced {
                            room,
                            generation,
                            session: sid,
                            pages,
                        });
                    }
                }
                return;
            }
        }
        // Validate against the peer's registered memory before accepting anything.
        let peer_layout = self
            .sessions
            .get(&sid)
            .and_then(|s| s.peer)
            .map(|p| p.layout);
        let valid = peer_layout.is_some_and(|l| {
            req.pages
                .iter()
                .all(|run| u64::from(run.start) + u64::from(run.len) <= u64::from(l.pages))
                && [req.aux_slot, req.state_slot]
                    .iter()
                    .flatten()
                    .all(|s| *s < l.slots)
        });
        if !valid {
            warn!(%room, session = %sid, "room request outside the peer's registered memory");
            self.counters.protocol_errors += 1;
            self.answer_with_outcome(sid, room, generation, Some(FailureReason::ProtocolError));
            self.conclude(now, room, KvPoll::Failed(FailureReason::ProtocolError));
            return;
        }
        let Some(r) = self.rooms.get_mut(&room) else {
            return;
        };
        if r.state.is_terminal() {
            // Concluded but still draining: tell this late requester the outcome.
            let failure = r.state.failure();
            self.answer_with_outcome(sid, room, generation, failure);
            return;
        }
        let Side::Sender(s) = &mut r.side else { return };
        if s.receivers.iter().any(|x| x.session == sid) {
            self.counters.stale_messages += 1;
            return;
        }
        let mut dst = Vec::with_capacity(req.pages.iter().map(|r| r.len as usize).sum());
        for run in &req.pages {
            dst.extend(run.start..run.start + run.len);
        }
        s.receivers.push(Receiver {
            session: sid,
            dst,
            aux_slot: req.aux_slot,
            state_slot: req.state_slot,
        });
        if let Some(w) = self
            .sessions
            .get(&sid)
            .and_then(|x| x.peer)
            .map(|p| (p.node, p.incarnation))
            .filter(|w| !s.peers.contains(w))
        {
            s.peers.push(w);
        }
        s.expected = s.expected.max(req.receivers);
        if !s.announced_by.contains(&sid) {
            s.announced_by.push(sid);
        }
        let bootstrapped = s.receivers.len() >= usize::from(s.expected);
        if let Some(x) = self.sessions.get_mut(&sid) {
            x.rooms.insert(room);
            x.last_targeted = now;
        }
        if bootstrapped {
            self.set_state(room, KvPoll::WaitingForInput);
            let Some(r) = self.rooms.get_mut(&room) else {
                return;
            };
            self.timers.cancel(&mut r.bootstrap_timer);
            r.last_activity = now;
            self.timers.set(
                &mut r.waiting_timer,
                now + self.config.waiting_timeout,
                Timer::Waiting(room),
            );
            self.send_progress(now, room, ProgressStage::Queued);
            self.plan_room(now, room);
        }
    }

    fn on_abort(
        &mut self,
        now: Instant,
        sid: SessionId,
        room: RoomId,
        generation: Generation,
        reason: FailureReason,
    ) {
        info!(%room, session = %sid, %reason, "peer aborted the room");
        let feeds = |r: &Room| match &r.side {
            Side::Sender(s) => {
                s.receivers.iter().any(|x| x.session == sid) || s.announced_by.contains(&sid)
            }
            Side::Receiver(_) => false,
        };
        if self
            .rooms
            .get(&room)
            .is_some_and(|r| r.generation == generation && !feeds(r))
        {
            // Another decode's abort of a room id this one serves (a refused reuse): it
            // touches nothing here.
            self.transmits
                .push_back((sid, Message::AbortAck { room, generation }));
            return;
        }
        match self.rooms.get(&room) {
            Some(r) if r.generation == generation => {
                if !r.state.is_terminal() {
                    self.conclude(now, room, KvPoll::Failed(FailureReason::AbortedByPeer));
                } else {
                    // Duplicate or late abort: ack again once drained.
                    self.maybe_release(now, room);
                    if self
                        .rooms
                        .get(&room)
                        .is_some_and(|r| matches!(&r.side, Side::Sender(s) if s.ops_in_flight == 0))
                    {
                        self.transmits
                            .push_back((sid, Message::AbortAck { room, generation }));
                    }
                }
                if !self
                    .rooms
                    .get(&room)
                    .is_some_and(|r| r.generation == generation)
                {
                    // Released right away: the ack went out with the release.
                }
            }
            Some(r) if r.generation > generation => {
                // An older attempt: it was drained before the new one could open.
                self.transmits
                    .push_back((sid, Message::AbortAck { room, generation }));
            }
            _ => {
                // Not open (yet, or any more): nothing of it is in flight. Remember the verdict
                // so a later open fails at once instead of computing a doomed room.
                if let Some(p) = self.pending.remove(&room) {
                    if p.generation == generation {
                        self.reject_pending(room, p, FailureReason::AbortedByPeer);
                    } else {
                        self.pending.insert(room, p);
                    }
                }
                let newer = self
                    .tombstones
                    .get(room)
                    .is_some_and(|(g, _)| g >= generation);
                if !newer {
                    let who = self.identity(sid).into_iter().collect();
                    self.tombstones.insert_verdict(
                        room,
                        generation,
                        FailureReason::AbortedByPeer,
                        who,
                    );
                }
                self.transmits
                    .push_back((sid, Message::AbortAck { room, generation }));
            }
        }
    }

    fn on_room_status(
        &mut self,
        now: Instant,
        sid: SessionId,
        room: RoomId,
        generation: Generation,
        failure: Option<FailureReason>,
    ) {
        let Some(r) = self.rooms.get_mut(&room) else {
            self.counters.stale_messages += 1;
            return;
        };
        if r.generation != generation {
            self.counters.stale_messages += 1;
            return;
        }
        let Side::Receiver(rr) = &mut r.side else {
            return;
        };
        let Some(src) = rr.sources.iter_mut().find(|s| s.session == sid) else {
            self.strike(sid, "status for a room it does not feed", false);
            return;
        };
        r.last_activity = now;
        match failure {
            None => {
                if !src.granted {
                    self.strike(sid, "success before the request", false);
                    return;
                }
                let one_sided = self.sessions.get(&sid).is_some_and(|s| s.one_sided);
                if !one_sided && !src.coverage.complete() && !r.state.is_terminal() {
                    // Success means the bytes are here: a word without them is a violation.
                    warn!(%room, session = %sid, covered = src.coverage.covered, expected = src.coverage.expected, "source reported success for pages that never landed");
                    self.counters.protocol_errors += 1;
                    self.conclude(now, room, KvPoll::Failed(FailureReason::ProtocolError));
                    return;
                }
                src.done = true;
                src.drained = true;
                let all_done = rr.sources.iter().all(|s| s.done);
                if r.state.is_terminal() {
                    self.maybe_release(now, room);
                } else if all_done {
                    self.conclude(now, room, KvPoll::Success);
                }
            }
            Some(reason) => {
                // The peer's own local reasons, seen from here.
                let reason = match reason {
                    FailureReason::AbortedLocally => FailureReason::AbortedByPeer,
                    FailureReason::Shutdown => FailureReason::PeerShutdown,
                    r => r,
                };
                if !r.state.is_terminal() {
                    self.conclude(now, room, KvPoll::Failed(reason));
                }
            }
        }
    }

    fn on_progress(
        &mut self,
        now: Instant,
        sid: SessionId,
        room: RoomId,
        generation: Generation,
        stage: ProgressStage,
    ) {
        let Some(r) = self.rooms.get_mut(&room) else {
            self.counters.stale_messages += 1;
            return;
        };
        if r.generation != generation || r.state.is_terminal() {
            self.counters.stale_messages += 1;
            return;
        }
        let Side::Receiver(rr) = &r.side else { return };
        if !rr.sources.iter().any(|s| s.session == sid && s.granted) {
            return;
        }
        r.last_activity = now;
        if stage == ProgressStage::Transferring && r.state == KvPoll::WaitingForInput {
            self.set_state(room, KvPoll::Transferring);
        }
    }

    fn on_abort_ack(&mut self, now: Instant, sid: SessionId, room: RoomId, generation: Generation) {
        let Some(r) = self.rooms.get_mut(&room) else {
            self.counters.stale_messages += 1;
            return;
        };
        if r.generation != generation {
            self.counters.stale_messages += 1;
            return;
        }
        let Side::Receiver(rr) = &mut r.side else {
            return;
        };
        if let Some(src) = rr.sources.iter_mut().find(|s| s.session == sid) {
            src.drained = true;
        }
        if r.state.is_terminal() {
            self.maybe_release(now, room);
        }
    }

    fn on_probe_result(
        &mut self,
        now: Instant,
        sid: SessionId,
        id: TransferId,
        outcome: TransferOutcome,
    ) {
        let Some(s) = self.sessions.get_mut(&sid) else {
            return;
        };
        if s.probe_op != Some(id) {
            return;
        }
        s.probe_op = None;
        if s.state != SessionState::Blacklisted {
            return;
        }
        if outcome == TransferOutcome::Done {
            // The data path works; confirm the peer's control loop answers too.
            let nonce = self.rng.next_u64();
            if let Some(s) = self.sessions.get_mut(&sid) {
                s.probe_nonce = Some(nonce);
            }
            self.transmits.push_back((sid, Message::Probe { nonce }));
            // If the ack never comes, the next probe timer tries again.
        }
        self.schedule_probe(now, sid);
    }

    fn on_probe_ack(&mut self, now: Instant, sid: SessionId, nonce: u64) {
        let Some(s) = self.sessions.get_mut(&sid) else {
            return;
        };
        if s.state != SessionState::Blacklisted || s.probe_nonce != Some(nonce) {
            return;
        }
        s.probe_nonce = None;
        s.state = SessionState::Established;
        s.failures = 0;
        s.probe_backoff = self.config.probe_interval;
        self.timers.cancel(&mut s.probe_timer);
        self.timers.cancel(&mut s.idle_timer);
        self.counters.sessions_recovered += 1;
        info!(session = %sid, "blacklisted session recovered after a successful probe");
        self.events
            .push_back(Event::SessionRecovered { session: sid });
        let _ = now;
        self.mark_ready(sid);
    }

    // ---------------------------------------------------------------- internals

    fn clock(&mut self, now: Instant) -> Instant {
        if now > self.last_now {
            self.last_now = now;
        }
        self.last_now
    }

    fn alloc_op_id(&mut self) -> TransferId {
        self.next_op += 1;
        TransferId(self.next_op)
    }

    fn owned_layers(&self) -> usize {
        usize::from(self.local.layer_end - self.local.layer_start)
    }

    fn check_open(&self, role: Role, room: RoomId, generation: Generation) -> Result<(), ApiError> {
        if self.local.role != role {
            return Err(ApiError::WrongRole { needs: role });
        }
        if self.shut_down {
            return Err(ApiError::ShutDown);
        }
        if self.rooms.contains_key(&room) {
            return Err(ApiError::RoomExists(room));
        }
        if let Some((used, _)) = self.tombstones.get(room) {
            if used >= generation {
                return Err(ApiError::StaleGeneration {
                    room,
                    generation,
                    used,
                });
            }
        }
        Ok(())
    }

    fn check_grant(&self, g: &Grant) -> Result<(), ApiError> {
        let l = &self.local.layout;
        if let Some(&page) = g.pages.iter().find(|p| **p >= l.pages) {
            return Err(ApiError::PageOutOfRange {
                page,
                pages: l.pages,
            });
        }
        for (slot, item) in [(g.aux_slot, l.aux_bytes), (g.state_slot, l.state_bytes)] {
            if let Some(slot) = slot {
                if slot >= l.slots || item == 0 {
                    return Err(ApiError::SlotOutOfRange {
                        slot,
                        slots: l.slots,
                    });
                }
            }
        }
        Ok(())
    }

    fn live_room(&mut self, room: RoomId, role: Role) -> Result<&mut Room, ApiError> {
        if self.local.role != role {
            return Err(ApiError::WrongRole { needs: role });
        }
        let r = self
            .rooms
            .get_mut(&room)
            .ok_or(ApiError::UnknownRoom(room))?;
        if r.state.is_terminal() {
            return Err(ApiError::RoomConcluded(room, r.state));
        }
        Ok(r)
    }

    fn apply_grant(&mut self, now: Instant, room: RoomId, grant: Grant) {
        let runs = page_runs(&grant.pages);
        let Some(r) = self.rooms.get_mut(&room) else {
            return;
        };
        let generation = r.generation;
        let Side::Receiver(rr) = &mut r.side else {
            return;
        };
        rr.pages = Some(PageSet::new(&grant.pages));
        rr.aux_slot = grant.aux_slot;
        rr.state_slot = grant.state_slot;
        let mut targets: SmallVec<[SessionId; 2]> = SmallVec::new();
        for src in rr.sources.iter_mut() {
            src.granted = true;
            src.coverage = Coverage::new(
                &self.local.layout,
                self.sessions.get(&src.session).and_then(|s| s.peer),
                &grant,
            );
            targets.push(src.session);
        }
        self.timers.cancel(&mut r.bootstrap_timer);
        r.last_activity = now;
        self.timers.set(
            &mut r.waiting_timer,
            now + self.config.waiting_timeout,
            Timer::Waiting(room),
        );
        let request = RoomRequest {
            room,
            generation,
            receivers: grant.receivers.max(1),
            pages: runs,
            aux_slot: grant.aux_slot,
            state_slot: grant.state_slot,
        };
        for sid in targets {
            self.transmits
                .push_back((sid, Message::RoomRequest(request.clone())));
        }
        if let Some(Side::Receiver(rr)) = self.rooms.get_mut(&room).map(|r| &mut r.side) {
            rr.request = Some(Box::new(request));
        }
        self.set_state(room, KvPoll::WaitingForInput);
    }

    fn fail_if_sources_unusable(&mut self, now: Instant, room: RoomId) {
        let Some(Side::Receiver(rr)) = self.rooms.get(&room).map(|r| &r.side) else {
            return;
        };
        let closing = rr
            .sources
            .iter()
            .filter_map(|s| self.sessions.get(&s.session))
            .find(|s| s.state == SessionState::Closing)
            .map(|s| s.close_reason);
        if let Some(reason) = closing {
            self.conclude(now, room, KvPoll::Failed(reason));
        }
    }

    fn send_to_sources(&mut self, room: RoomId, make: impl Fn(RoomId, Generation) -> Message) {
        let Some(r) = self.rooms.get(&room) else {
            return;
        };
        let Side::Receiver(rr) = &r.side else { return };
        for src in &rr.sources {
            self.transmits
                .push_back((src.session, make(room, r.generation)));
        }
    }

    fn send_progress(&mut self, now: Instant, room: RoomId, stage: ProgressStage) {
        let Some(r) = self.rooms.get_mut(&room) else {
            return;
        };
        let generation = r.generation;
        let Side::Sender(s) = &mut r.side else { return };
        if s.stage == Some(stage) {
            return;
        }
        s.stage = Some(stage);
        s.last_progress_sent = Some(now);
        for x in &s.receivers {
            self.transmits.push_back((
                x.session,
                Message::Progress {
                    room,
                    generation,
                    stage,
                },
            ));
        }
    }

    /// Answers a room message about a concluded room at once, from the tombstones.
    fn answer_if_concluded(
        &mut self,
        sid: SessionId,
        room: RoomId,
        generation: Generation,
    ) -> bool {
        if self
            .rooms
            .get(&room)
            .is_some_and(|r| r.generation >= generation)
        {
            return false;
        }
        let took_part = self.tombstones.took_part(room, self.identity(sid));
        match self.tombstones.get(room) {
            Some((g, _)) if g >= generation && !took_part => {
                self.refuse_reused(sid, room, generation);
                true
            }
            Some((g, outcome)) if g == generation => {
                let failure = outcome.failure();
                debug!(%room, session = %sid, ?outcome, "late message for a concluded room answered");
                self.answer_with_outcome(sid, room, generation, failure);
                true
            }
            Some((g, _)) if g > generation => {
                self.refuse_stale(sid, room, generation);
                true
            }
            _ => false,
        }
    }

    /// A request or notice for an attempt older than one this endpoint already holds: the
    /// decode learns at once that this attempt is void (a late duplicate is ignored there).
    fn refuse_stale(&mut self, sid: SessionId, room: RoomId, generation: Generation) {
        self.counters.stale_messages += 1;
        debug!(%room, generation, session = %sid, "request for an older generation refused");
        self.answer_with_outcome(sid, room, generation, Some(FailureReason::StaleGeneration));
    }

    /// Who the peer behind `sid` is, once its hello arrived.
    fn identity(&self, sid: SessionId) -> Option<PeerIdentity> {
        self.sessions
            .get(&sid)
            .and_then(|s| s.peer)
            .map(|p| (p.node, p.incarnation))
    }

    /// A live room already served by other decode endpoints (every receiver it expects has
    /// requested it, or it concluded) is never joined by a new one: that is a reused room id.
    fn refuse_if_served_elsewhere(
        &mut self,
        sid: SessionId,
        room: RoomId,
        generation: Generation,
    ) -> bool {
        let who = self.identity(sid);
        let Some(r) = self.rooms.get(&room) else {
            return false;
        };
        let Side::Sender(s) = &r.side else {
            return false;
        };
        let known = who.is_some_and(|w| s.peers.contains(&w))
            || s.receivers.iter().any(|x| x.session == sid)
            || s.announced_by.contains(&sid);
        let full =
            r.state != KvPoll::Bootstrapping && s.receivers.len() >= usize::from(s.expected.max(1));
        let other_generation = r.generation != generation && !known;
        if known || !(full || r.state.is_terminal() || other_generation) {
            return false;
        }
        self.refuse_reused(sid, room, generation);
        true
    }

    /// Refuses a room message from a decode that did not take part in the room this id
    /// names here: the room id was reused (another decode node, or a restarted one).
    fn refuse_reused(&mut self, sid: SessionId, room: RoomId, generation: Generation) {
        info!(%room, session = %sid, "room id already used for another decode, refused");
        self.counters.rooms_refused_reused += 1;
        self.answer_with_outcome(sid, room, generation, Some(FailureReason::RoomIdReused));
    }

    /// New rooms toward a blacklisted session fail at bootstrap, before any compute.
    fn refuse_if_blacklisted(
        &mut self,
        now: Instant,
        sid: SessionId,
        room: RoomId,
        generation: Generation,
    ) -> bool {
        let Some(s) = self.sessions.get_mut(&sid) else {
            return true;
        };
        if s.state != SessionState::Blacklisted {
            return false;
        }
        s.last_targeted = now;
        let reason = FailureReason::SessionBlacklisted;
        self.answer_with_outcome(sid, room, generation, Some(reason));
        match self.rooms.get(&room) {
            Some(r) if r.generation == generation && !r.state.is_terminal() => {
                self.conclude(now, room, KvPoll::Failed(reason));
            }
            Some(_) => {}
            None => {
                if let Some(p) = self.pending.remove(&room) {
                    self.reject_pending(room, p, reason);
                }
                let who = self.identity(sid).into_iter().collect();
                self.tombstones
                    .insert_verdict(room, generation, reason, who);
            }
        }
        true
    }

    /// Tells a decode session a room's outcome and that nothing of it is, or will be, in
    /// flight from here (late requests, rooms refused before they opened).
    fn answer_with_outcome(
        &mut self,
        sid: SessionId,
        room: RoomId,
        generation: Generation,
        failure: Option<FailureReason>,
    ) {
        self.transmits.push_back((
            sid,
            Message::RoomStatus {
                room,
                generation,
                failure,
            },
        ));
        self.transmits
            .push_back((sid, Message::AbortAck { room, generation }));
    }

    fn pending_entry(
        &mut self,
        sid: SessionId,
        room: RoomId,
        generation: Generation,
    ) -> Option<&mut PendingRoom> {
        if let Some(p) = self.pending.get(&room) {
            if p.generation > generation {
                self.refuse_stale(sid, room, generation);
                return None;
            }
            if p.generation < generation {
                self.pending.remove(&room);
            }
        }
        if !self.pending.contains_key(&room) {
            while self.pending.len() >= self.config.pending_requests as usize {
                let Some((old, g)) = self.pending_order.pop_front() else {
                    break;
                };
                if self.pending.get(&old).is_some_and(|p| p.generation == g) {
                    if let Some(p) = self.pending.remove(&old) {
                        // Evicted before the sender opened: the requesters must not wait forever.
                        self.reject_pending(old, p, FailureReason::BootstrapTimeout);
                    }
                }
            }
            self.pending_order.push_back((room, generation));
            self.pending.insert(
                room,
                PendingRoom {
                    generation,
                    ..PendingRoom::default()
                },
            );
        }
        self.pending.get_mut(&room)
    }

    fn reject_pending(&mut self, room: RoomId, p: PendingRoom, reason: FailureReason) {
        let generation = p.generation;
        let mut told: SmallVec<[SessionId; 2]> = SmallVec::new();
        let mut peers: SmallVec<[PeerIdentity; 1]> = SmallVec::new();
        for sid in p
            .requests
            .iter()
            .map(|x| x.0)
            .chain(p.notices.iter().map(|x| x.0))
        {
            if !told.contains(&sid) {
                told.push(sid);
                self.answer_with_outcome(sid, room, generation, Some(reason));
                if let Some(w) = self.identity(sid) {
                    peers.push(w);
                }
            }
        }
        self.tombstones
            .insert_verdict(room, generation, reason, peers);
    }

    fn emit_state(&mut self, room: RoomId, generation: Generation, state: KvPoll) {
        self.events.push_back(Event::RoomState {
            room,
            generation,
            state,
        });
    }

    /// Non-terminal forward move. An impossible one is refused and logged, never a panic.
    fn set_state(&mut self, room: RoomId, to: KvPoll) {
        let Some(r) = self.rooms.get_mut(&room) else {
            return;
        };
        if r.state == to {
            return;
        }
        match r.state.transition(to) {
            Ok(s) => {
                r.state = s;
                let generation = r.generation;
                self.emit_state(room, generation, s);
            }
            Err(e) => debug!(%room, error = %e, "transition refused"),
        }
    }

    fn count_terminal(&mut self, state: KvPoll) {
        match state {
            KvPoll::Success => self.counters.rooms_succeeded += 1,
            KvPoll::Failed(reason) => self.counters.rooms_failed[reason.index()] += 1,
            _ => {}
        }
    }

    /// Moves a room to a terminal state and starts whatever must follow (notify, drain,
    /// quarantine). Refused (no-op) if the room is already terminal.
    fn conclude(&mut self, now: Instant, room: RoomId, to: KvPoll) {
        let Some(r) = self.rooms.get_mut(&room) else {
            return;
        };
        let Ok(state) = r.state.transition(to) else {
            return;
        };
        r.state = state;
        let generation = r.generation;
        self.timers.cancel(&mut r.bootstrap_timer);
        self.timers.cancel(&mut r.waiting_timer);
        self.count_terminal(state);
        self.emit_state(room, generation, state);
        match state {
            KvPoll::Failed(reason) => debug!(%room, %reason, "room failed"),
            _ => debug!(%room, "room succeeded"),
        }
        let failure = state.failure();
        let Some(r) = self.rooms.get_mut(&room) else {
            return;
        };
        match &mut r.side {
            Side::Sender(s) => {
                s.chunks.clear();
                for x in &s.receivers {
                    self.transmits.push_back((
                        x.session,
                        Message::RoomStatus {
                            room,
                            generation,
                            failure,
                        },
                    ));
                }
                // Decode sessions that only announced the room learn it too.
                for sid in &s.announced_by {
                    if !s.receivers.iter().any(|x| x.session == *sid) {
                        self.transmits.push_back((
                            *sid,
                            Message::RoomStatus {
                                room,
                                generation,
                                failure,
                            },
                        ));
                        self.transmits
                            .push_back((*sid, Message::AbortAck { room, generation }));
                    }
                }
                if failure.is_some() {
                    self.drop_room_ops(room, generation);
                }
            }
            Side::Receiver(rr) => {
                // A write still landing holds the pages whatever the outcome; the abort timer
                // bounds how long (it fences the session).
                let mut waiting = rr.sources.iter().any(|s| !s.pending.is_empty());
                if let Some(reason) = failure {
                    for src in rr.sources.iter_mut() {
                        if src.done {
                            continue;
                        }
                        if !src.granted {
                            src.drained = true;
                        }
                        waiting |= !src.drained;
                        self.transmits.push_back((
                            src.session,
                            Message::Abort {
                                room,
                                generation,
                                reason,
                            },
                        ));
                    }
                }
                if waiting {
                    self.timers.set(
                        &mut r.abort_timer,
                        now + self.config.abort_ack_timeout,
                        Timer::AbortAck(room),
                    );
                }
            }
        }
        self.maybe_release(now, room);
    }

    /// Removes every queued or retry-waiting operation of a room; in-flight ones settle later.
    fn drop_room_ops(&mut self, room: RoomId, generation: Generation) {
        let mut dropped = 0u32;
        let ids: Vec<TransferId> = self
            .ops
            .iter()
            .filter(|(_, op)| {
                op.room == Some(room)
                    && op.generation == generation
                    && op.phase != OpPhase::InFlight
            })
            .map(|(id, _)| *id)
            .collect();
        for id in ids {
            if let Some(mut op) = self.ops.remove(&id) {
                self.timers.cancel(&mut op.timer);
                dropped += 1;
            }
        }
        if let Some(Side::Sender(s)) = self.rooms.get_mut(&room).map(|r| &mut r.side) {
            s.ops_live = s.ops_live.saturating_sub(dropped);
        }
    }

    /// Emits `Releasable` and forgets the room once nothing can touch its pages any more.
    fn maybe_release(&mut self, now: Instant, room: RoomId) {
        let Some(r) = self.rooms.get_mut(&room) else {
            return;
        };
        if !r.state.is_terminal() {
            return;
        }
        let generation = r.generation;
        let ready = match &mut r.side {
            Side::Sender(s) => {
                if s.ops_in_flight > 0 {
                    false
                } else {
                    if r.state != KvPoll::Success && !s.drained_acked {
                        s.drained_acked = true;
                        for x in &s.receivers {
                            self.transmits
                                .push_back((x.session, Message::AbortAck { room, generation }));
                        }
                    }
                    true
                }
            }
            Side::Receiver(rr) => rr
                .sources
                .iter()
                .all(|s| (s.drained || s.done) && s.pending.is_empty()),
        };
        if !ready {
            return;
        }
        let _ = now;
        let Some(mut r) = self.rooms.remove(&room) else {
            return;
        };
        for t in [
            &mut r.bootstrap_timer,
            &mut r.waiting_timer,
            &mut r.abort_timer,
        ] {
            self.timers.cancel(t);
        }
        let peers: SmallVec<[PeerIdentity; 1]> = match &r.side {
            Side::Sender(s) => s.peers.iter().copied().collect(),
            Side::Receiver(_) => SmallVec::new(),
        };
        let sessions: SmallVec<[SessionId; 4]> = match &r.side {
            Side::Sender(s) => s
                .receivers
                .iter()
                .map(|x| x.session)
                .chain(s.announced_by.iter().copied())
                .collect(),
            Side::Receiver(rr) => rr.sources.iter().map(|s| s.session).collect(),
        };
        for sid in sessions {
            if let Some(s) = self.sessions.get_mut(&sid) {
                s.rooms.remove(&room);
            }
        }
        self.tombstones.insert(room, generation, r.state, peers);
        self.counters.rooms_released += 1;
        self.events
            .push_back(Event::Releasable { room, generation });
    }

    /// Plans every released, not yet planned layer of a bootstrapped sender room.
    fn plan_room(&mut self, now: Instant, room: RoomId) {
        let limits = OpLimits {
            max_bytes: self.config.max_op_bytes,
            max_slices: self.config.max_op_slices,
        };
        let layout = self.local.layout;
        let first_layer = self.local.layer_start;
        let owned = self.owned_layers();
        let writes_aux = self.local.writes_aux;
        let Some((generation, s)) = live_sender(&mut self.rooms, room) else {
            return;
        };
        let mut new_ops: Vec<(SessionId, OpKind, Range<usize>, Vec<Slice>)> = Vec::new();
        let mut overflow = false;
        for c in s.chunks.iter_mut() {
            let end = c.dst_start as usize + c.src.len();
            if s.receivers.iter().any(|x| x.dst.len() < end) {
                overflow = true;
                break;
            }
            // Layers ready now and not yet planned, grouped into consecutive ranges so that
            // whole-batch chunks become as few operations as the limits allow.
            let mut l = 0;
            while l < owned {
                if !c.released.get(l) || c.planned.get(l) {
                    l += 1;
                    continue;
                }
                let start = l;
                while l < owned
                    && c.released.get(l)
                    && !c.planned.get(l)
                    && (!c.layerwise || l == start)
                {
                    c.planned.set(l);
                    l += 1;
                }
                let layers = first_layer + start as u16..first_layer + l as u16;
                for x in &s.receivers {
                    let dst = &x.dst[c.dst_start as usize..end];
                    for slices in plan_kv(&layout, layers.clone(), &c.src, dst, limits) {
                        new_ops.push((x.session, OpKind::Kv, start..l, slices));
                    }
                }
            }
        }
        if overflow {
            warn!(%room, "chunk exceeds the pages decode granted");
            self.conclude(now, room, KvPoll::Failed(FailureReason::ProtocolError));
            return;
        }
        while s
            .chunks
            .front()
            .is_some_and(|c| c.planned.count() as usize == owned)
        {
            s.chunks.pop_front();
        }
        if s.last_seen && s.chunks.is_empty() && writes_aux {
            for x in &s.receivers {
                let slices = plan_aux(&layout, s.aux_src, x.aux_slot, s.state_src, x.state_slot);
                if !slices.is_empty() {
                    new_ops.push((x.session, OpKind::Aux, 0..0, slices));
                }
            }
            s.aux_src = None;
            s.state_src = None;
        }
        s.ops_live += new_ops.len() as u32;
        if s.layer_live.len() < owned {
            s.layer_live.resize(owned, 0);
        }
        for (_, _, layers, _) in &new_ops {
            for n in &mut s.layer_live[layers.clone()] {
                *n += 1;
            }
        }
        let any = !new_ops.is_empty();
        for (sid, kind, layers, slices) in new_ops {
            let bytes = slices.iter().map(|x| x.len).sum();
            self.counters.ops_planned += 1;
            self.counters.bytes_planned += bytes;
            let id = self.alloc_op_id();
            self.ops.insert(
                id,
                Op {
                    session: sid,
                    room: Some(room),
                    generation,
                    kind,
                    slices: Arc::from(slices),
                    layers,
                    bytes,
                    attempt: 1,
                    phase: OpPhase::Queued,
                    timer: None,
                    superseded: false,
                },
            );
            if let Some(x) = self.sessions.get_mut(&sid) {
                x.queue.push_back(id);
                x.last_targeted = now;
            }
            self.mark_ready(sid);
        }
        if any {
            self.set_state(room, KvPoll::Transferring);
            self.send_progress(now, room, ProgressStage::Transferring);
        }
        self.report_delivered_layers(room);
        self.check_sender_complete(now, room);
    }

    fn check_sender_complete(&mut self, now: Instant, room: RoomId) {
        let Some(r) = self.rooms.get(&room) else {
            return;
        };
        let Side::Sender(s) = &r.side else { return };
        let complete = !r.state.is_terminal()
            && r.state != KvPoll::Bootstrapping
            && s.last_seen
            && s.chunks.is_empty()
            && s.ops_live == 0;
        if complete {
            self.conclude(now, room, KvPoll::Success);
        }
    }

    fn mark_ready(&mut self, sid: SessionId) {
        let max = self.config.max_ops_in_flight;
        let Some(s) = self.sessions.get_mut(&sid) else {
            return;
        };
        if !s.in_ready && !s.fencing && s.in_flight < max && !s.queue.is_empty() {
            s.in_ready = true;
            self.ready_sessions.push_back(sid);
        }
    }

    fn blacklist(&mut self, now: Instant, sid: SessionId) {
        let Some(s) = self.sessions.get_mut(&sid) else {
            return;
        };
        if s.state == SessionState::Blacklisted {
            return;
        }
        s.state = SessionState::Blacklisted;
        s.probe_backoff = self.config.probe_interval;
        s.last_targeted = now;
        let idle = now + self.config.blacklist_idle_timeout;
        self.timers
            .set(&mut s.idle_timer, idle, Timer::BlacklistIdle(sid));
        self.counters.sessions_blacklisted += 1;
        warn!(session = %sid, failures = s.failures, "session blacklisted");
        self.events
            .push_back(Event::SessionBlacklisted { session: sid });
        self.fail_session_rooms(now, sid, FailureReason::SessionBlacklisted);
        self.schedule_probe(now, sid);
    }

    fn schedule_probe(&mut self, now: Instant, sid: SessionId) {
        let max = self.config.probe_max_interval;
        let Some(s) = self.sessions.get_mut(&sid) else {
            return;
        };
        if s.state != SessionState::Blacklisted {
            return;
        }
        let base = s.probe_backoff;
        let jitter = Duration::from_nanos(self.rng.below(base.as_nanos() as u64 / 4 + 1));
        self.timers
            .set(&mut s.probe_timer, now + base + jitter, Timer::Probe(sid));
        s.probe_backoff = (base * 2).min(max);
    }

    fn fail_session_rooms(&mut self, now: Instant, sid: SessionId, reason: FailureReason) {
        let Some(s) = self.sessions.get(&sid) else {
            return;
        };
        let rooms: Vec<RoomId> = s.rooms.iter().copied().collect();
        for room in rooms {
            let involved = match self.rooms.get(&room).map(|r| &r.side) {
                Some(Side::Sender(x)) => {
                    x.receivers.iter().any(|x| x.session == sid) || x.announced_by.contains(&sid)
                }
                Some(Side::Receiver(_)) => true,
                None => false,
            };
            if involved {
                self.conclude(now, room, KvPoll::Failed(reason));
            }
        }
        // Prefill: requests buffered for rooms not yet opened must not linger either.
        if self.local.role == Role::Prefill {
            let stale: Vec<RoomId> = self
                .pending
                .iter()
                .filter(|(_, p)| {
                    p.requests.iter().any(|x| x.0 == sid) || p.notices.iter().any(|x| x.0 == sid)
                })
                .map(|(r, _)| *r)
                .collect();
            for room in stale {
                if let Some(p) = self.pending.remove(&room) {
                    // Tell the requesters now: they must not wait for a deadline to learn it.
                    self.reject_pending(room, p, reason);
                }
            }
        }
    }

    /// After a fence or a close: every attempt of the session still in flight is settled.
    fn settle_session_ops(&mut self, now: Instant, sid: SessionId, retry: bool) {
        let ids: Vec<TransferId> = self
            .ops
            .iter()
            .filter(|(_, op)| op.session == sid && (op.phase == OpPhase::InFlight || !retry))
            .map(|(id, _)| *id)
            .collect();
        for id in ids {
            let phase = self.ops.get(&id).map(|o| o.phase);
            if phase == Some(OpPhase::InFlight) {
                let outcome = if retry {
                    TransferOutcome::Transient
                } else {
                    TransferOutcome::Fatal
                };
                self.settle_attempt(now, id, outcome);
            } else if let Some(mut op) = self.ops.remove(&id) {
                self.timers.cancel(&mut op.timer);
                self.op_finished(now, op.room, op.generation, op.layers.clone());
            }
        }
    }

    /// Decode: a fenced or closed session can no longer write; its sources count as drained.
    fn fence_done(&mut self, now: Instant, sid: SessionId) {
        let Some(s) = self.sessions.get_mut(&sid) else {
            return;
        };
        // Nothing written before the fence can land any more: its permits are void.
        s.epoch = s.epoch.wrapping_add(1);
        let mut rooms: Vec<RoomId> = s.rooms.iter().copied().collect();
        // Writes of this connection may be pending in rooms a fresh session took over.
        let mut next = self.superseded.get(&sid).copied();
        while let Some(to) = next {
            if let Some(x) = self.sessions.get(&to) {
                rooms.extend(x.rooms.iter().copied());
            }
            next = self.superseded.get(&to).copied();
        }
        for room in rooms {
            let Some(r) = self.rooms.get_mut(&room) else {
                continue;
            };
            let terminal = r.state.is_terminal();
            let mut touched = !matches!(r.side, Side::Receiver(_));
            if let Side::Receiver(rr) = &mut r.side {
                for src in rr.sources.iter_mut() {
                    let before = src.pending.len();
                    src.pending.retain(|p| p.1 != sid);
                    touched |= src.pending.len() != before;
                    if src.session == sid {
                        touched = true;
                        if terminal {
                            src.drained = true;
                        }
                    }
                }
            }
            if terminal && touched {
                self.maybe_release(now, room);
            }
        }
    }

    fn fence(&mut self, sid: SessionId) {
        let Some(s) = self.sessions.get_mut(&sid) else {
            return;
        };
        if s.fencing || s.state == SessionState::Closing {
            return;
        }
        s.fencing = true;
        self.counters.fences += 1;
        self.actions.push_back(Action::FenceSession(sid));
    }

    fn request_close(&mut self, sid: SessionId) {
        let Some(s) = self.sessions.get_mut(&sid) else {
            return;
        };
        if s.state == SessionState::Closing {
            return;
        }
        s.state = SessionState::Closing;
        self.actions.push_back(Action::CloseSession(sid));
    }

    /// Tells the peer why, fails the session's rooms and asks the driver to close it.
    fn close_session(
        &mut self,
        now: Instant,
        sid: SessionId,
        code: ErrorCode,
        detail: &str,
        reason: FailureReason,
    ) {
        let Some(s) = self.sessions.get_mut(&sid) else {
            return;
        };
        if s.state == SessionState::Closing {
            return;
        }
        s.close_reason = reason;
        self.transmits.push_back((
            sid,
            Message::Error {
                code,
                detail: detail.to_owned(),
            },
        ));
        self.fail_session_rooms(now, sid, reason);
        self.request_close(sid);
    }
}

fn message_name(m: &Message) -> &'static str {
    match m {
        Message::Challenge { .. } => "Challenge",
        Message::Hello(_) => "Hello",
        Message::RoomPending { .. } => "RoomPending",
        Message::RoomRequest(_) => "RoomRequest",
        Message::RoomStatus { .. } => "RoomStatus",
        Message::Progress { .. } => "Progress",
        Message::Abort { .. } => "Abort",
        Message::AbortAck { .. } => "AbortAck",
        Message::Heartbeat { .. } => "Heartbeat",
        Message::Probe { .. } => "Probe",
        Message::ProbeAck { .. } => "ProbeAck",
        Message::Error { .. } => "Error",
        Message::Transport { .. } => "Transport",
    }
}

/// A sender room past its bootstrap and not concluded, with its generation: the rooms whose
/// layers may be planned and reported delivered.
fn live_sender(
    rooms: &mut Map<RoomId, Room>,
    room: RoomId,
) -> Option<(Generation, &mut SenderRoom)> {
    let r = rooms.get_mut(&room)?;
    if r.state.is_terminal() || r.state == KvPoll::Bootstrapping {
        return None;
    }
    let generation = r.generation;
    match &mut r.side {
        Side::Sender(s) => Some((generation, s)),
        Side::Receiver(_) => None,
    }
}
