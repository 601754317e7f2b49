//! [`Endpoint`]: the deterministic state machine of one prefill or decode rank.

mod attempt;
mod coverage;
mod data_dials;
mod ended;
mod grant_table;
mod handshake;
mod health;
mod heartbeats;
mod layer_bits;
mod link;
mod listener;
mod liveness;
mod op_queue;
mod operations;
mod outbox;
mod pending_rooms;
mod planning;
mod probation;
mod queries;
mod receiver;
mod room_table;
mod rooms;
mod sender;
mod sessions;
mod successions;
mod takeover;
mod targets;
mod timers;
mod tombstones;
mod writer;
mod writes;

use std::collections::{HashMap, HashSet, VecDeque};
use std::sync::Arc;

use foldhash::fast::FixedState;
use std::time::Instant;

use smallvec::SmallVec;
use tracing::debug;

use crate::api::{
    Action, Capacity, EndpointInfo, Event, Grant, Link, PeerInfo, RejectReason, SessionState,
    SessionStats, TransferOp,
};
use crate::auth::{Nonce, Nonces, SessionKey};
use crate::codec::{Hello, Message, ProgressStage, RoomRequest};
use crate::config::{Config, ConfigError};
use crate::counters::Counters;
use crate::ids::{
    DialId, DrainId, Generation, Incarnation, NodeId, PromptDigest, RoomId, SessionId, TargetId,
};
use crate::layout::{ExtraCopies, ExtraPool};
use crate::rng::Rng;
use crate::state::{FailureReason, KvPoll};
use crate::timer::{Timer, TimerKey, TimerTable};
use coverage::Coverage;
use data_dials::DataDials;
use ended::EndedSessions;
pub use grant_table::GrantTable;
use grant_table::Granted;
use layer_bits::LayerBits;
use listener::{Deadlines, Listener};
use liveness::Liveness;
use op_queue::OpQueue;
use operations::{Op, OpPhase, Operations};
use outbox::Outbox;
use pending_rooms::PendingRooms;
use probation::Probation;
use room_table::Rooms;
use sessions::Sessions;
use successions::Successions;
use targets::Targets;
use timers::SessionTimers;
use tombstones::Tombstones;
use writer::Writer;

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
/// # State
///
/// Each part of the state that has an invariant owns its fields and keeps it in its own
/// module: the sessions by id and by peer node (`sessions`), and per session what its peer
/// was heard doing (`liveness`), its record toward the blacklist (`probation`), its
/// operations (`op_queue`), how its peer writes into us (`writer`) and its deadlines
/// (`timers::SessionTimers`); rooms that ended (`tombstones`), requests for rooms not open
/// yet (`pending_rooms`), take-overs (`successions`), the listener and dials (`listener`),
/// peers kept connected (`targets`), data-path operations and the sessions' turns to start
/// them (`operations`), what waits for the driver's drain (`outbox`), and decode's grants
/// with the writes landing under them, shared with the receive paths (`grant_table`).
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
    shutdown: Shutdown,
    sessions: Sessions,
    /// The rooms held, from their opening to their release.
    rooms: Rooms,
    tombstones: Tombstones,
    /// Prefill: room messages that arrived before the sender room was opened.
    pending: PendingRooms,
    /// Data-path operations, and the sessions whose turn it is to start one.
    ops: Operations,
    timers: TimerTable,
    /// Messages, actions and events waiting for the driver's drain.
    outbox: Outbox,
    counters: Counters,
    capacity: Capacity,
    hasher: FixedState,
    /// Peers kept connected.
    targets: Targets,
    /// Decode: the live rooms' grants and the writes landing in them, shared with the
    /// receive paths.
    grants: Arc<GrantTable>,
    /// Sessions taken over by a fresh connection, and who carries their work now.
    successions: Successions,
    /// Why recent sessions ended, for rooms opened over them late.
    ended: EndedSessions,
    /// Accepted connections not yet a session's, and the accept backoff.
    listener: Listener,
    /// Connection attempts under way, each with its `connect_timeout`.
    dials: Deadlines<DialId>,
    /// Replaced data paths still flushing, each with its `operation_timeout`.
    drains: Deadlines<DrainId>,
    /// Sessions that ended while only their writer could fence them: the rooms they could
    /// still write, quarantined until the writer's liveness window has passed.
    writer_quarantines: Map<SessionId, WriterQuarantine>,
}

/// Where the endpoint's shutdown stands: it goes one way, Running to Closing to Complete.
#[derive(Debug)]
enum Shutdown {
    Running,
    /// Begun: every session is closing, until the last one closed or `timer` fired.
    Closing {
        timer: Option<TimerKey>,
    },
    /// [`Event::ShutDown`] went out.
    Complete,
}

impl Shutdown {
    /// Whether the shutdown began: no new room, session or connection from now on.
    fn begun(&self) -> bool {
        !matches!(self, Shutdown::Running)
    }
}

/// The rooms an ended writer-fenced session could still write, and when that is over.
#[derive(Debug)]
struct WriterQuarantine {
    rooms: Vec<RoomId>,
    timer: Option<TimerKey>,
}

/// Who a peer is across connections: its node name and process incarnation.
type PeerIdentity = (NodeId, Incarnation);

#[derive(Debug)]
struct Session {
    state: SessionState,
    peer: Option<PeerInfo>,
    /// How extra items go between us and the peer (set with `peer`).
    extra_copies: Arc<ExtraCopies>,
    /// What the peer was heard and confirmed doing, and the link check it drives.
    liveness: Liveness,
    /// Consecutive failures toward the blacklist, and the probes back from it.
    probation: Probation,
    timers: SessionTimers,
    /// Accepted by our listener: our hello goes out only after the peer's hello proved it
    /// knows the cluster token.
    inbound: bool,
    /// The handshake's authentication so far, then the session's key.
    auth: Auth,
    /// Broken data connections waiting to be replaced.
    data_lost: u32,
    /// Data connections being dialed, and the deadline the next dial gets.
    data_dials: DataDials,
    /// Accepted side: the silent session of the same peer process this one will take over
    /// once the peer uses it (its first message after the hello) or the old one ends. The
    /// dialer may give up on a fresh connection whose hello was late; until it uses it, the
    /// old session keeps its work.
    resumes: Option<SessionId>,
    /// Accepted side: a fresh session waits to take this one over. The dialer may have moved
    /// already and refuses writes that still come here, so none is started until the take-over
    /// happens or the fresh session ends unused.
    handing_over: bool,
    last_targeted: Instant,
    /// Its operations toward the peer: queued, in flight, its turn, a pending fence.
    ops: OpQueue,
    rooms: Set<RoomId>,
    strikes: u32,
    capacity: Option<Capacity>,
    close_reason: FailureReason,
    stats: SessionStats,
    target: Option<TargetId>,
    /// Bumped by every completed fence: permits of an older epoch are void.
    epoch: u32,
    /// Decode: how the peer writes into our memory (seen or one-sided, who can stop it).
    writer: Writer,
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

impl Room {
    /// A room just opened: Bootstrapping, no deadline armed yet.
    fn bootstrapping(generation: Generation, now: Instant, side: Side) -> Room {
        Room {
            generation,
            state: KvPoll::Bootstrapping,
            bootstrap_timer: None,
            waiting_timer: None,
            abort_timer: None,
            last_activity: now,
            side,
        }
    }
}

/// A node is prefill or decode, so all its rooms hold the same variant: boxing the larger
/// one would add an allocation per room and save no memory.
#[derive(Debug)]
#[allow(clippy::large_enum_variant)]
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
    /// Source items of each extra pool (from the last chunk).
    extras_src: Vec<Vec<u32>>,
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
    /// Whether the grants were checked against the chunks once the last one arrived.
    grant_checked: bool,
    /// The tokens the embedder opened the room for; `None`: requests are not checked.
    prompt: Option<PromptDigest>,
}

#[derive(Debug)]
struct Receiver {
    session: SessionId,
    /// Room pages this receiver already holds (`SKIP_ALL`: it wants none).
    skip: u32,
    dst: Vec<u32>,
    aux_slot: Option<u32>,
    state_slot: Option<u32>,
    /// Destination items of each extra pool.
    extras: Vec<Vec<u32>>,
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
    /// What the grant gave (shared with the [`GrantTable`]).
    granted: Arc<Granted>,
    queue_position: u32,
    /// Opened through targets of which some had no session yet: the sources are attached
    /// (and the grant sent) once all of them are up. Empty once attached.
    waiting_for: SmallVec<[Link; 2]>,
    /// A grant given while the room waits for its targets.
    held_grant: Option<Grant>,
    /// The request sent with the grant, kept to send again on a session that takes over.
    request: Option<Box<RoomRequest>>,
    /// Every source reported Success and the landed writes are being flushed
    /// ([`Action::FlushLanded`]): the room succeeds when the flush ends.
    flushing: bool,
}

#[derive(Debug)]
struct Source {
    session: SessionId,
    granted: bool,
    /// Takes part without writing (the grant's `idle_sources`): asked for nothing.
    idle: bool,
    /// The source reported Success: all its writes were acknowledged.
    done: bool,
    /// The source acknowledged the drain, or its session was fenced or closed.
    drained: bool,
    /// Every (owned layer, plane, granted page) unit plus the aux row and state slot this
    /// source must write, as a bitmap of what applied writes covered (set with the grant).
    coverage: Coverage,
    /// One-sided, checksummed path: operations whose landed bytes the driver is hashing
    /// (permit number, units they cover). Not writes, so no fence voids them: their bytes
    /// landed before the source heard its operation was done.
    checking: Vec<(u64, Vec<u32>)>,
    /// The source reported Success while some of its checks were still running: it counts
    /// once the last one ends.
    success_pending: bool,
}

impl Source {
    fn new(session: SessionId) -> Self {
        Source {
            session,
            granted: false,
            idle: false,
            done: false,
            drained: false,
            coverage: Coverage::default(),
            checking: Vec::new(),
            success_pending: false,
        }
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
        if local.heads.page_tokens(local.layout.page_bytes).is_none() {
            return Err(ConfigError {
                name: "heads".into(),
                value: format!("{:?} over page_bytes {}", local.heads, local.layout.page_bytes),
                reason: "needs start + count <= total, head_bytes > 0, and pages of whole token rows (page_bytes a multiple of count x head_bytes)",
            });
        }
        if let Some(why) = ExtraPool::invalid_parts(&local.extras) {
            return Err(ConfigError {
                name: "extras".into(),
                value: why,
                reason: "each tensor's parts inside its item, at most 64, none overlapping",
            });
        }
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
        let hasher = FixedState::with_seed(seed.rotate_left(17) ^ 0x6b76_6665_7272_7900);
        let tombstones = Tombstones::new(config.tombstones as usize, hasher.clone());
        let nonces = Nonces::new(&local.token, seed, local.node.0, local.incarnation.0);
        let local_copy = local.clone();
        Ok(Endpoint {
            config,
            local,
            rng: Rng::new(seed),
            nonces,
            last_now: now,
            shutdown: Shutdown::Running,
            sessions: Sessions::new(hasher.clone()),
            rooms: Rooms::new(hasher.clone()),
            tombstones,
            pending: PendingRooms::new(hasher.clone()),
            ops: Operations::new(hasher.clone()),
            timers: TimerTable::default(),
            outbox: Outbox::default(),
            counters: Counters::default(),
            capacity: Capacity::default(),
            targets: Targets::new(hasher.clone()),
            grants: Arc::new(GrantTable::new(Arc::new(local_copy), hasher.clone())),
            successions: Successions::new(hasher.clone()),
            ended: EndedSessions::new(hasher.clone()),
            listener: Listener::default(),
            dials: Deadlines::default(),
            drains: Deadlines::default(),
            writer_quarantines: Map::default(),
            hasher,
        })
    }

    /// Encodes the next control frame into `buf` and returns the session to send it on.
    #[must_use]
    pub fn poll_transmit(&mut self, buf: &mut Vec<u8>) -> Option<SessionId> {
        let (session, msg) = self.poll_message()?;
        msg.encode(buf);
        Some(session)
    }

    /// The next control message, not encoded (for drivers that batch or inspect).
    #[must_use]
    pub fn poll_message(&mut self) -> Option<(SessionId, Message)> {
        loop {
            let (session, msg) = self.outbox.next_transmit()?;
            let s = self.sessions.get_mut(&session);
            // Until its handshake completes a session carries the handshake alone: a room
            // message for it (a room opened on it early) is dropped here and sent, from the
            // room's state then, when the session is established (`replay`).
            let handshaking = s
                .as_ref()
                .is_some_and(|s| s.state == SessionState::Handshaking);
            if handshaking && !msg.is_handshake() {
                continue;
            }
            if let Some(s) = s {
                s.liveness.frame_sent(self.last_now);
            }
            return Some((session, msg));
        }
    }

    /// The next connection action the driver must carry out.
    #[must_use]
    pub fn poll_action(&mut self) -> Option<Action> {
        self.outbox.next_action()
    }

    /// The next data-path operation to run; sessions are served round-robin, each up to
    /// `max_ops_in_flight` operations, so one slow peer never holds back the others.
    #[must_use]
    pub fn poll_transfer(&mut self, now: Instant) -> Option<TransferOp> {
        let now = self.clock(now);
        while let Some(sid) = self.ops.next_ready() {
            let max = self.config.max_ops_in_flight;
            let Some(session) = self.sessions.get_mut(&sid) else {
                continue;
            };
            // A closing session runs nothing more: a peer that hears its goodbye may count
            // on it (a same-host writer's receiver releases its pages on it).
            let may_run = !session.handing_over && session.state != SessionState::Closing;
            let Some(id) = session.ops.turn(max, may_run) else {
                continue;
            };
            let Some(op) = self.ops.get_mut(&id) else {
                // Dropped while queued (room concluded): the id is stale.
                self.mark_ready(sid);
                continue;
            };
            session.ops.started();
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
                checksum: self.config.checksum,
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
        self.outbox.next_event()
    }

    /// The earliest deadline and why it exists. Call [`Endpoint::handle_timeout`] at it.
    #[must_use]
    pub fn poll_timeout(&self) -> Option<(Instant, Timer)> {
        self.timers.next()
    }

    /// Decode: the embedder's current free capacity, advertised in heartbeats.
    pub fn set_capacity(&mut self, capacity: Capacity) {
        self.capacity = capacity;
    }

    fn clock(&mut self, now: Instant) -> Instant {
        if now > self.last_now {
            self.last_now = now;
        }
        self.last_now
    }

    fn owned_layers(&self) -> usize {
        usize::from(self.local.layer_end - self.local.layer_start)
    }

    fn emit_state(&mut self, room: RoomId, generation: Generation, state: KvPoll) {
        self.outbox.event(Event::RoomState {
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
}
