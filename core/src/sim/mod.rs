//! Deterministic simulation: several endpoints, a simulated clock that jumps to the next
//! deadline, and a seeded network and data path that delay, drop, duplicate, reorder, corrupt,
//! reset and fail. Used by the core's tests and reusable by later crates.
//!
//! The simulated data path models the race that corrupts KV in existing systems: a write is
//! checked when it starts ([`Endpoint::check_write`], as a receiver validates a header) and its
//! bytes land when it completes. Page ownership is tracked on every node, so a write landing on
//! a page that was released and given to another room is reported as a violation.

mod datapath;
mod run;
mod topology;
mod workload;
pub use workload::{RoomRun, Workload};

use std::cmp::Reverse;
use std::collections::{BTreeMap, BTreeSet, BinaryHeap, HashMap, HashSet};

use foldhash::fast::FixedState;
use std::time::{Duration, Instant};

use crate::api::{
    Action, Chunk, EndpointInfo, Event, Grant, TransferOp, TransferOutcome, WritePermit,
};
use crate::config::Config;
use crate::endpoint::Endpoint;
use crate::ids::{
    DialId, Generation, Incarnation, NodeId, RoomId, SessionId, TargetId, TransferId,
};
use crate::layout::{Layout, Region};
use crate::rng::Rng;
use crate::state::{FailureReason, KvPoll, Role};

/// Fault probabilities and delays of the simulated network and data path.
#[derive(Clone, Debug, PartialEq)]
pub struct Faults {
    /// Control message delay range.
    pub msg_delay: (Duration, Duration),
    /// Probability a control message is lost.
    pub msg_drop: f64,
    /// Probability a control message is delivered twice.
    pub msg_duplicate: f64,
    /// Probability a control message ignores FIFO order (overtakes or is overtaken).
    pub msg_reorder: f64,
    /// Probability a control message has one byte flipped.
    pub msg_corrupt: f64,
    /// Probability that sending a control message resets its link.
    pub link_reset: f64,
    /// Data operation duration range.
    pub op_delay: (Duration, Duration),
    /// Probability a data operation attempt fails transiently.
    pub op_transient: f64,
    /// Probability a data operation attempt fails fatally.
    pub op_fatal: f64,
    /// Probability a data operation attempt never reports (until a fence).
    pub op_hang: f64,
    /// Probability an attempt is reported to its sender as a transient failure while its
    /// bytes still land at the receiver later (a broken connection whose receive buffer is
    /// still being applied): what the receiver's write permits exist for.
    pub op_orphan: f64,
    /// Delay before a closed link is re-established (`None`: never).
    pub reconnect_after: Option<Duration>,
    /// How long a closing session's control writer takes to send what is queued (a peer
    /// that stopped reading: longer than `close_linger`, and the core's linger stops it).
    pub close_flush: Duration,
    /// Fences are never confirmed (a data path whose drain does not complete).
    pub fence_stuck: bool,
}

impl Default for Faults {
    fn default() -> Self {
        Faults {
            msg_delay: (Duration::from_micros(20), Duration::from_micros(200)),
            msg_drop: 0.0,
            msg_duplicate: 0.0,
            msg_reorder: 0.0,
            msg_corrupt: 0.0,
            link_reset: 0.0,
            op_delay: (Duration::from_micros(50), Duration::from_micros(500)),
            op_transient: 0.0,
            op_fatal: 0.0,
            op_hang: 0.0,
            op_orphan: 0.0,
            reconnect_after: None,
            close_flush: Duration::ZERO,
            fence_stuck: false,
        }
    }
}

/// A wait of a driver that the core ended (an action the simulation has no socket for).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum WaitEnded {
    /// [`Action::DropAccepted`]: an accepted connection did not become a session's in time.
    DropAccepted(crate::ids::ConnId),
    /// [`Action::ResumeAccepting`]: the pause after a failed accept is over.
    ResumeAccepting,
    /// [`Action::StopLingering`]: a closing session's writer had its `close_linger`.
    StopLingering(SessionId),
    /// [`Action::AbandonDial`]: a connection attempt did not connect in time.
    AbandonDial(crate::ids::DialId),
    /// [`Action::StopDraining`]: a replaced data path did not drain in time.
    StopDraining(crate::ids::DrainId),
}

/// A node of the simulation: one endpoint and the memory it owns.
#[derive(Debug)]
pub struct SimNode {
    /// The state machine under test.
    pub endpoint: Endpoint,
    /// Owner of every page: `None` = free.
    pub pages: Vec<Option<(RoomId, Generation)>>,
    free_pages: Vec<u32>,
    owned: HashMap<(RoomId, Generation), Vec<u32>, FixedState>,
    /// Last state seen per room attempt, from events.
    pub states: HashMap<(RoomId, Generation), KvPoll, FixedState>,
    /// Room attempts declared releasable.
    pub released: HashSet<(RoomId, Generation), FixedState>,
    /// When each room attempt became terminal.
    pub concluded_at: HashMap<(RoomId, Generation), Instant, FixedState>,
    /// Every event, with its time.
    pub events: Vec<(Instant, Event)>,
    /// When the data path of a peer session is down (transient failures), until when.
    pub data_down_until: HashMap<SessionId, Instant, FixedState>,
    /// Per room attempt of this lifetime: the (region code, page) pairs whose every byte a
    /// write landed here since its pages were allocated. `Success` needs all granted ones.
    landed: HashMap<(RoomId, Generation), LandedUnits, FixedState>,
    /// The waits this node's core ended, as the driver would act on them, with their time.
    pub waits_ended: Vec<(Instant, WaitEnded)>,
    info: EndpointInfo,
    config: Config,
    seed: u64,
}

impl SimNode {
    /// Takes `n` free pages for a room attempt; `None` if not enough are free. The pages
    /// freed last are reused first, so a stray write into a released room hits the next owner.
    pub fn alloc(&mut self, room: RoomId, generation: Generation, n: u32) -> Option<Vec<u32>> {
        if self.free_pages.len() < n as usize {
            return None;
        }
        let got = self
            .free_pages
            .split_off(self.free_pages.len() - n as usize);
        for &p in &got {
            self.pages[p as usize] = Some((room, generation));
        }
        // A new lifetime of this room attempt: nothing of it has landed yet.
        self.landed.remove(&(room, generation));
        self.owned
            .entry((room, generation))
            .or_default()
            .extend_from_slice(&got);
        Some(got)
    }

    /// Gives back the pages of a room attempt the endpoint refused to open (they were never
    /// handed to it).
    pub fn give_back(&mut self, room: RoomId, generation: Generation) {
        self.free(room, generation);
    }

    fn free(&mut self, room: RoomId, generation: Generation) {
        for p in self.owned.remove(&(room, generation)).unwrap_or_default() {
            if self.pages[p as usize] == Some((room, generation)) {
                self.pages[p as usize] = None;
                self.free_pages.push(p);
            }
        }
    }

    /// The first granted (layer, plane, page) of a room attempt that no write landed on since
    /// its pages were allocated, worded for a violation; `None` if every one landed.
    fn unlanded_page(&self, key: (RoomId, Generation)) -> Option<String> {
        let layout = self.info.layout;
        let pages = self.owned.get(&key)?;
        let landed = self.landed.get(&key);
        // Units of a page: its heads of every token row (one where heads are not split).
        let units = u64::from(layout.page_bytes / self.info.heads.head_bytes.max(1));
        for &p in pages {
            for layer in 0..layout.layers {
                for plane in 0..layout.planes {
                    let code = Region::Kv { layer, plane }.code();
                    let first = u64::from(p) * units;
                    if let Some(u) = (first..first + units)
                        .find(|u| !landed.is_some_and(|l| l.contains(&(code, *u))))
                    {
                        return Some(format!(
                            "page {p} of layer {layer} plane {plane} (head unit {})",
                            u - first
                        ));
                    }
                }
            }
        }
        None
    }

    /// Where a sender room's `LayerDelivered` events break their promise: every owned layer
    /// once, in order, before `Success`, and none after the room concluded.
    fn layer_delivery_mismatches(&self, i: usize) -> Vec<String> {
        let mut out = Vec::new();
        let mut delivered: HashMap<(RoomId, Generation), Vec<u16>> = HashMap::new();
        let mut concluded: HashSet<(RoomId, Generation)> = HashSet::new();
        for (_, e) in &self.events {
            match *e {
                Event::LayerDelivered {
                    room,
                    generation,
                    layer,
                } => {
                    if concluded.contains(&(room, generation)) {
                        out.push(format!(
                            "node {i}: {room} layer {layer} delivered after its end"
                        ));
                    }
                    delivered.entry((room, generation)).or_default().push(layer);
                }
                Event::RoomState {
                    room,
                    generation,
                    state,
                } if state.is_terminal() => {
                    concluded.insert((room, generation));
                    if state == KvPoll::Success && self.info.role == Role::Prefill {
                        let want: Vec<u16> = (self.info.layer_start..self.info.layer_end).collect();
                        let got = delivered.remove(&(room, generation)).unwrap_or_default();
                        if got != want {
                            out.push(format!(
                                "node {i}: {room} succeeded after layers {got:?} were delivered"
                            ));
                        }
                    }
                }
                _ => {}
            }
        }
        out
    }

    /// Number of events of this node matching `f`.
    pub fn count_events(&self, f: impl Fn(&Event) -> bool) -> usize {
        self.events.iter().filter(|(_, e)| f(e)).count()
    }
}

/// An operation across its attempts: (source node, first slice's region code, its offset).
type LogicalOp = (usize, u32, u64);

/// (region code, page or slot) pairs a write covered entirely.
type LandedUnits = HashSet<(u32, u64), FixedState>;

/// Marks the end of a link whose process restarted.
const DEAD_SESSION: SessionId = SessionId(u32::MAX);

#[derive(Debug)]
struct Link {
    a: (usize, SessionId),
    b: (usize, SessionId),
    up: bool,
    last_delivery: [Instant; 2],
    blackhole_until: Instant,
}

/// A pending happening, ordered by (time, sequence) only.
#[derive(Debug)]
struct Queued(Instant, u64, Pending);

impl PartialEq for Queued {
    fn eq(&self, other: &Self) -> bool {
        (self.0, self.1) == (other.0, other.1)
    }
}

impl Eq for Queued {}

impl PartialOrd for Queued {
    fn partial_cmp(&self, other: &Self) -> Option<std::cmp::Ordering> {
        Some(self.cmp(other))
    }
}

impl Ord for Queued {
    fn cmp(&self, other: &Self) -> std::cmp::Ordering {
        (self.0, self.1).cmp(&(other.0, other.1))
    }
}

#[derive(Debug, Clone)]
enum Pending {
    Deliver {
        node: usize,
        session: SessionId,
        bytes: Vec<u8>,
    },
    OpDone {
        node: usize,
        id: TransferId,
    },
    /// An orphaned write's bytes land now (its sender already saw it fail).
    OrphanLands {
        key: u64,
    },
    Fence {
        node: usize,
        session: SessionId,
    },
    Close {
        node: usize,
        session: SessionId,
    },
    Reconnect {
        a: usize,
        b: usize,
    },
    /// Node `node` carries out its core's [`Action::Connect`] for `target`: attempt `dial`
    /// connects now, unless the core abandoned it by then.
    Dial {
        node: usize,
        target: TargetId,
        dial: DialId,
    },
    Work(WorkItem),
}

#[derive(Debug, Clone, Copy)]
enum WorkItem {
    Arrive(usize),
    Grant(usize),
    Chunk(usize, u8),
    Layer(usize, u8, u16),
    Abort(usize, bool),
}

#[derive(Debug)]
struct InFlight {
    src: usize,
    dst: usize,
    dst_session: SessionId,
    op: TransferOp,
    outcome: TransferOutcome,
    /// The receiver's permit while the bytes may be landing.
    permit: Option<WritePermit>,
}

/// Why a simulation run stopped early.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SimError {
    /// The step budget ran out before the goal was reached: a livelock or a hang.
    Livelock {
        /// Steps taken.
        steps: u64,
    },
    /// Nothing is left to do and the goal was not reached.
    Stalled,
}

/// The simulation world.
#[derive(Debug)]
pub struct Sim {
    /// Simulated time.
    pub now: Instant,
    /// Time zero.
    pub start: Instant,
    /// Nodes, indexed by creation order.
    pub nodes: Vec<SimNode>,
    /// Fault model, changeable between steps.
    pub faults: Faults,
    /// Invariant violations seen (corruption, ops after abort, ...). Must stay empty.
    pub violations: Vec<String>,
    /// Data operations emitted, by kind.
    pub ops_emitted: u64,
    /// Steps taken.
    pub steps: u64,
    /// The room workload, if any.
    pub workload: Option<Workload>,
    /// Releasable events seen on all nodes.
    pub releases: usize,
    links: Vec<Link>,
    /// The peer node each node's targets ([`Sim::add_target`]) stand for.
    targets: BTreeMap<(usize, TargetId), usize>,
    /// Nodes whose listeners answer no connection attempt ([`Sim::silence_dials`]).
    silent: BTreeSet<usize>,
    /// How long a connection attempt to a node takes to connect ([`Sim::slow_dials`]).
    dial_latency: BTreeMap<usize, Duration>,
    queue: BinaryHeap<Reverse<Queued>>,
    seq: u64,
    rng: Rng,
    /// Ordered, so fences break operations in the same order on every run.
    inflight: BTreeMap<(usize, TransferId), InFlight>,
    /// Writes whose sender saw them fail while their bytes still land (`Faults::op_orphan`).
    orphans: BTreeMap<u64, InFlight>,
    next_orphan: u64,
    /// Logical operations (source node, first destination slice) of each room attempt that
    /// have not landed yet: a room may only succeed once its set is empty.
    /// Keyed by (destination node, room, generation).
    unlanded: HashMap<(usize, RoomId, Generation), HashSet<LogicalOp, FixedState>, FixedState>,
    /// Logical operations that landed once: a later attempt of one (a retry of a write whose
    /// sender saw it fail while its bytes still landed) does not make it unlanded again.
    landed_ops: HashMap<(usize, RoomId, Generation), HashSet<LogicalOp, FixedState>, FixedState>,
    rx: HashMap<(usize, SessionId), Vec<u8>, FixedState>,
}

/// A layout small enough for fast simulation: 4 layers, K and V, 1 KiB pages.
pub fn small_layout(pages: u32) -> Layout {
    Layout {
        layers: 4,
        planes: 2,
        page_bytes: 1024,
        pages,
        aux_bytes: 64,
        state_bytes: 0,
        slots: 4096,
    }
}

/// A configuration with short deadlines, so simulated runs cover many of them.
pub fn fast_config() -> Config {
    Config {
        retry_backoff: Duration::from_millis(5),
        probe_interval: Duration::from_millis(100),
        probe_max_interval: Duration::from_secs(2),
        blacklist_idle_timeout: Duration::from_secs(30),
        bootstrap_timeout: Duration::from_secs(2),
        waiting_timeout: Duration::from_secs(2),
        abort_ack_timeout: Duration::from_millis(500),
        heartbeat_interval: Duration::from_millis(250),
        heartbeat_misses: 3,
        progress_interval: Duration::from_millis(250),
        silence_timeout: Duration::from_millis(500),
        connect_timeout: Duration::from_millis(100),
        handshake_timeout: Duration::from_secs(1),
        operation_timeout: Duration::from_millis(500),
        fence_timeout: Duration::from_secs(1),
        ..Config::default()
    }
}

impl Sim {
    /// An empty world with a seed and a fault model.
    pub fn new(seed: u64, faults: Faults) -> Self {
        let start = Instant::now();
        Sim {
            now: start,
            start,
            nodes: Vec::new(),
            faults,
            violations: Vec::new(),
            ops_emitted: 0,
            steps: 0,
            workload: None,
            releases: 0,
            links: Vec::new(),
            queue: BinaryHeap::new(),
            seq: 0,
            rng: Rng::new(seed ^ 0x5EED),
            inflight: BTreeMap::new(),
            orphans: BTreeMap::new(),
            targets: BTreeMap::new(),
            silent: BTreeSet::new(),
            dial_latency: BTreeMap::new(),
            next_orphan: 0,
            unlanded: HashMap::default(),
            landed_ops: HashMap::default(),
            rx: HashMap::default(),
        }
    }

    fn push(&mut self, at: Instant, p: Pending) {
        self.seq += 1;
        self.queue.push(Reverse(Queued(at, self.seq, p)));
    }

    fn uniform(&mut self, range: (Duration, Duration)) -> Duration {
        let span = range.1.saturating_sub(range.0).as_nanos() as u64;
        range.0 + Duration::from_nanos(self.rng.below(span + 1))
    }

    fn link_of(&self, node: usize, session: SessionId) -> Option<(usize, usize)> {
        // Newest first: a restarted endpoint reuses session numbers of its previous life.
        self.links.iter().enumerate().rev().find_map(|(i, l)| {
            if l.a == (node, session) {
                Some((i, 0))
            } else if l.b == (node, session) {
                Some((i, 1))
            } else {
                None
            }
        })
    }

    /// Drains every output of node `n` and routes it, repeating until nothing is left.
    pub fn drain(&mut self, n: usize) {
        loop {
            let mut progressed = false;
            let mut buf = Vec::with_capacity(64);
            while let Some(session) = self.nodes[n].endpoint.poll_transmit(&mut buf) {
                progressed = true;
                let bytes = std::mem::replace(&mut buf, Vec::with_capacity(64));
                self.route(n, session, bytes);
            }
            while let Some(action) = self.nodes[n].endpoint.poll_action() {
                progressed = true;
                match action {
                    Action::FenceSession(session) => {
                        self.push(self.now, Pending::Fence { node: n, session })
                    }
                    // The writer sends what is queued first (`Faults::close_flush`), unless the
                    // core's linger stops it sooner.
                    Action::CloseSession(session) => {
                        let at = self.now + self.faults.close_flush;
                        self.push(at, Pending::Close { node: n, session })
                    }
                    Action::StopLingering(session) => {
                        self.nodes[n]
                            .waits_ended
                            .push((self.now, WaitEnded::StopLingering(session)));
                        self.push(self.now, Pending::Close { node: n, session })
                    }
                    Action::DropAccepted(conn) => self.nodes[n]
                        .waits_ended
                        .push((self.now, WaitEnded::DropAccepted(conn))),
                    Action::ResumeAccepting => self.nodes[n]
                        .waits_ended
                        .push((self.now, WaitEnded::ResumeAccepting)),
                    Action::StopDraining(drain) => self.nodes[n]
                        .waits_ended
                        .push((self.now, WaitEnded::StopDraining(drain))),
                    // The attempt is given up; a target's the core counted itself.
                    Action::AbandonDial(dial) => self.nodes[n]
                        .waits_ended
                        .push((self.now, WaitEnded::AbandonDial(dial))),
                    // Carried out after the peer's dial latency: a silenced peer's attempt is
                    // never reported.
                    Action::Connect { target, dial } => {
                        let latency = self
                            .targets
                            .get(&(n, target))
                            .and_then(|peer| self.dial_latency.get(peer))
                            .copied()
                            .unwrap_or_default();
                        self.push(
                            self.now + latency,
                            Pending::Dial {
                                node: n,
                                target,
                                dial,
                            },
                        )
                    }
                    // Other links are made by the test (connect, reset_link), and the data path
                    // has no connections to replace.
                    Action::OpenDataConnection(_) => {}
                    // No simulated path is one-sided, so no source sends operation checksums;
                    // a permit that came anyway is handed back unapplied.
                    Action::VerifyLanded { permit, .. } => {
                        self.nodes[n].endpoint.end_write(self.now, permit, &[])
                    }
                    // Simulated memory needs no flush: carried out at once.
                    Action::FlushLanded { room, generation } => {
                        self.nodes[n]
                            .endpoint
                            .end_flush(self.now, room, generation, Ok(()))
                    }
                }
            }
            while let Some(op) = self.nodes[n].endpoint.poll_transfer(self.now) {
                progressed = true;
                self.start_op(n, op);
            }
            while let Some(ev) = self.nodes[n].endpoint.poll_event() {
                progressed = true;
                self.record(n, ev);
            }
            if !progressed {
                break;
            }
        }
    }

    fn route(&mut self, n: usize, session: SessionId, mut bytes: Vec<u8>) {
        let Some((li, dir)) = self.link_of(n, session) else {
            return;
        };
        let l = &self.links[li];
        if !l.up || l.blackhole_until > self.now {
            return;
        }
        let (peer, peer_session) = if dir == 0 { l.b } else { l.a };
        if self.rng.chance(self.faults.link_reset) {
            self.push(self.now, Pending::Close { node: n, session });
            return;
        }
        if self.rng.chance(self.faults.msg_drop) {
            return;
        }
        if self.rng.chance(self.faults.msg_corrupt) && !bytes.is_empty() {
            let i = self.rng.below(bytes.len() as u64) as usize;
            bytes[i] ^= 1 << self.rng.below(8);
        }
        let delay = self.faults.msg_delay;
        let d = self.uniform(delay);
        let mut at = self.now + d;
        if !self.rng.chance(self.faults.msg_reorder) {
            at = at.max(self.links[li].last_delivery[dir]);
            self.links[li].last_delivery[dir] = at;
        }
        if self.rng.chance(self.faults.msg_duplicate) {
            let again = at + self.uniform(delay);
            self.push(
                again,
                Pending::Deliver {
                    node: peer,
                    session: peer_session,
                    bytes: bytes.clone(),
                },
            );
        }
        self.push(
            at,
            Pending::Deliver {
                node: peer,
                session: peer_session,
                bytes,
            },
        );
    }
}
