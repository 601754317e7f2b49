//! Deterministic simulation: several endpoints, a simulated clock that jumps to the next
//! deadline, and a seeded network and data path that delay, drop, duplicate, reorder, corrupt,
//! reset and fail. Used by the core's tests and reusable by later crates.
//!
//! The simulated data path models the race that corrupts KV in existing systems: a write is
//! checked when it starts ([`Endpoint::check_write`], as a receiver validates a header) and its
//! bytes land when it completes. Page ownership is tracked on every node, so a write landing on
//! a page that was released and given to another room is reported as a violation.

use std::cmp::Reverse;
use std::collections::{BTreeMap, BinaryHeap, HashMap, HashSet};

use foldhash::fast::FixedState;
use std::time::{Duration, Instant};

use crate::api::{
    Action, Chunk, EndpointInfo, Event, Grant, TransferOp, TransferOutcome, WritePermit,
};
use crate::config::Config;
use crate::endpoint::Endpoint;
use crate::ids::{Generation, Incarnation, NodeId, RoomId, SessionId, TransferId};
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
        }
    }
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
        for &p in pages {
            for layer in 0..layout.layers {
                for plane in 0..layout.planes {
                    let code = Region::Kv { layer, plane }.code();
                    if !landed.is_some_and(|l| l.contains(&(code, u64::from(p)))) {
                        return Some(format!("page {p} of layer {layer} plane {plane}"));
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
            next_orphan: 0,
            unlanded: HashMap::default(),
            rx: HashMap::default(),
        }
    }

    /// Adds a node and returns its index.
    pub fn add_node(&mut self, config: Config, info: EndpointInfo) -> usize {
        let seed = self.rng.next_u64();
        let endpoint = match Endpoint::new(config.clone(), info.clone(), seed, self.now) {
            Ok(e) => e,
            Err(e) => panic!("sim node config invalid: {e}"),
        };
        let pages = vec![None; info.layout.pages as usize];
        self.nodes.push(SimNode {
            endpoint,
            pages,
            free_pages: (0..info.layout.pages).rev().collect(),
            owned: HashMap::default(),
            states: HashMap::default(),
            released: HashSet::default(),
            concluded_at: HashMap::default(),
            events: Vec::new(),
            data_down_until: HashMap::default(),
            landed: HashMap::default(),
            info,
            config,
            seed,
        });
        self.nodes.len() - 1
    }

    /// Adds a prefill node owning `layers` (and aux if it owns the last layer).
    pub fn add_prefill(
        &mut self,
        config: Config,
        layout: Layout,
        rank: u16,
        layers: std::ops::Range<u16>,
    ) -> usize {
        let n = self.nodes.len() as u64;
        let mut info = EndpointInfo::new(
            Role::Prefill,
            NodeId(100 + n),
            Incarnation(self.rng.next_u64()),
            layout,
        );
        info.rank = rank;
        info.writes_aux = layers.end == layout.layers;
        info.layer_start = layers.start;
        info.layer_end = layers.end;
        info.token = b"sim-token".to_vec();
        self.add_node(config, info)
    }

    /// Adds a decode node.
    pub fn add_decode(&mut self, config: Config, layout: Layout, rank: u16) -> usize {
        let n = self.nodes.len() as u64;
        let mut info = EndpointInfo::new(
            Role::Decode,
            NodeId(100 + n),
            Incarnation(self.rng.next_u64()),
            layout,
        );
        info.rank = rank;
        info.token = b"sim-token".to_vec();
        self.add_node(config, info)
    }

    /// Restarts a node: a new endpoint with a new incarnation, all its memory freed, all its
    /// links dropped without notice to itself (the old process is gone).
    pub fn restart(&mut self, n: usize) {
        let node = &mut self.nodes[n];
        let mut info = node.info.clone();
        info.incarnation = Incarnation(node.seed.wrapping_mul(31).wrapping_add(self.steps) | 1);
        node.info = info.clone();
        node.endpoint = match Endpoint::new(node.config.clone(), info, node.seed ^ 0xA5A5, self.now)
        {
            Ok(e) => e,
            Err(e) => panic!("sim node config invalid: {e}"),
        };
        for p in node.pages.iter_mut() {
            *p = None;
        }
        node.free_pages = (0..node.info.layout.pages).rev().collect();
        node.owned.clear();
        // The new process knows nothing of the old one's rooms: the same ids may come again.
        node.landed.clear();
        node.states.clear();
        node.released.clear();
        node.concluded_at.clear();
        node.events.clear();
        self.unlanded.retain(|k, _| k.0 != n);
        self.inflight.retain(|_, f| f.src != n && f.dst != n);
        self.orphans.retain(|_, f| f.dst != n);
        self.rx.retain(|k, _| k.0 != n);
        // Whatever was on its way to the old process is lost with it.
        let queue = std::mem::take(&mut self.queue);
        self.queue = queue
            .into_iter()
            .filter(|Reverse(q)| match &q.2 {
                Pending::Deliver { node, .. }
                | Pending::OpDone { node, .. }
                | Pending::Fence { node, .. }
                | Pending::Close { node, .. } => *node != n,
                _ => true,
            })
            .collect();
        for l in self.links.iter_mut() {
            for end in [&mut l.a, &mut l.b] {
                if end.0 == n {
                    l.up = false;
                    // The old process is gone: its end of the link must never match the new one.
                    end.1 = DEAD_SESSION;
                }
            }
        }
    }

    /// Connects two nodes with a fresh control connection; returns (session on a, session on b).
    pub fn connect(&mut self, a: usize, b: usize) -> (SessionId, SessionId) {
        let sa = self.nodes[a].endpoint.open_session(self.now);
        let sb = self.nodes[b].endpoint.accept_session(self.now);
        self.links.push(Link {
            a: (a, sa),
            b: (b, sb),
            up: true,
            last_delivery: [self.now; 2],
            blackhole_until: self.now,
        });
        self.drain(a);
        self.drain(b);
        (sa, sb)
    }

    /// The current session of node `a` toward node `b`, if their link is up.
    pub fn session(&self, a: usize, b: usize) -> Option<SessionId> {
        self.links.iter().rev().find_map(|l| {
            match (l.up, l.a.0 == a && l.b.0 == b, l.b.0 == a && l.a.0 == b) {
                (true, true, _) => Some(l.a.1),
                (true, _, true) => Some(l.b.1),
                _ => None,
            }
        })
    }

    /// Makes the data path between `a` and `b` fail transiently until `until` (control works).
    pub fn break_data_path(&mut self, a: usize, b: usize, until: Instant) {
        for (x, y) in [(a, b), (b, a)] {
            if let Some(s) = self.session(x, y) {
                self.nodes[x].data_down_until.insert(s, until);
            }
        }
    }

    /// Drops every control message between `a` and `b` until `until` (data path hangs too).
    pub fn blackhole(&mut self, a: usize, b: usize, until: Instant) {
        for l in self.links.iter_mut() {
            if l.up && ((l.a.0 == a && l.b.0 == b) || (l.a.0 == b && l.b.0 == a)) {
                l.blackhole_until = until;
            }
        }
    }

    /// Resets the link between `a` and `b`: both sides see the connection drop.
    pub fn reset_link(&mut self, a: usize, b: usize) {
        if let Some(s) = self.session(a, b) {
            self.push(
                self.now,
                Pending::Close {
                    node: a,
                    session: s,
                },
            );
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
                    Action::CloseSession(session) => {
                        self.push(self.now, Pending::Close { node: n, session })
                    }
                    // The simulation manages its links itself (connect, reset_link), and its
                    // data path has no connections to replace.
                    Action::Connect { .. } | Action::OpenDataConnection(_) => {}
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

    fn start_op(&mut self, n: usize, op: TransferOp) {
        self.ops_emitted += 1;
        if let Some(room) = op.room {
            let key = (room, op.generation);
            let node = &self.nodes[n];
            if node.released.contains(&key) {
                self.violations
                    .push(format!("node {n}: op for {room} emitted after its release"));
            } else if matches!(node.states.get(&key), Some(KvPoll::Failed(_))) {
                self.violations
                    .push(format!("node {n}: op for {room} emitted after it failed"));
            }
        }
        let Some((li, dir)) = self.link_of(n, op.session) else {
            let id = op.id;
            self.inflight.insert(
                (n, id),
                InFlight {
                    src: n,
                    dst: n,
                    dst_session: op.session,
                    op,
                    outcome: TransferOutcome::Transient,
                    permit: None,
                },
            );
            let at = self.now;
            self.push(at, Pending::OpDone { node: n, id });
            return;
        };
        let l = &self.links[li];
        let (dst, dst_session) = if dir == 0 { l.b } else { l.a };
        if let (Some(room), Some(first)) = (op.room, op.slices.first()) {
            self.unlanded
                .entry((dst, room, op.generation))
                .or_default()
                .insert((n, first.region.code(), first.dst_offset));
        }
        let l = &self.links[li];
        let up = l.up;
        let blackholed = l.blackhole_until > self.now;
        let down = self.nodes[n]
            .data_down_until
            .get(&op.session)
            .is_some_and(|t| *t > self.now);
        let mut outcome = TransferOutcome::Done;
        let mut hang = false;
        let mut permit = None;
        if !up || down {
            outcome = TransferOutcome::Transient;
        } else if blackholed || self.rng.chance(self.faults.op_hang) {
            hang = true;
        } else if self.rng.chance(self.faults.op_fatal) {
            outcome = TransferOutcome::Fatal;
        } else if self.rng.chance(self.faults.op_transient) {
            outcome = TransferOutcome::Transient;
        } else {
            // The receiver validates the write header when the write starts; the permit
            // holds the room's pages until the bytes landed.
            let room = op.room.unwrap_or(RoomId(0));
            match self.nodes[dst].endpoint.begin_write(
                self.now,
                dst_session,
                room,
                op.generation,
                &op.slices,
            ) {
                Ok(p) => permit = Some(p),
                Err(_) => outcome = TransferOutcome::Refused,
            }
            self.drain(dst);
        }
        let id = op.id;
        let delay = self.faults.op_delay;
        let d = self.uniform(delay);
        if permit.is_some() && !hang && self.rng.chance(self.faults.op_orphan) {
            // The sender sees a broken connection now; the receiver applies the bytes later.
            let key = self.next_orphan;
            self.next_orphan += 1;
            let late = d + self.uniform(delay) * 4;
            let f = InFlight {
                src: n,
                dst,
                dst_session,
                op,
                outcome,
                permit,
            };
            // Its bytes left the source now (they sit in the network); they land later.
            self.check_source(&f);
            self.orphans.insert(key, f);
            let at = self.now + late;
            self.push(at, Pending::OrphanLands { key });
            self.nodes[n]
                .endpoint
                .handle_transfer_result(self.now, id, TransferOutcome::Transient);
            self.drain(n);
            return;
        }
        self.inflight.insert(
            (n, id),
            InFlight {
                src: n,
                dst,
                dst_session,
                op,
                outcome,
                permit,
            },
        );
        if !hang {
            let at = self.now + d;
            self.push(at, Pending::OpDone { node: n, id });
        }
    }

    /// The receiver is done with a write (`landed`: every byte applied; else abandoned): its
    /// permit goes back.
    fn end_write(&mut self, f: &InFlight, landed: bool) {
        if let Some(permit) = f.permit {
            let permit = if landed { permit.applied() } else { permit };
            self.nodes[f.dst].endpoint.end_write(self.now, permit);
            self.drain(f.dst);
        }
    }

    /// The bytes of a write land now: check that every page still belongs to the room.
    fn land(&mut self, f: &InFlight) {
        self.land_dst(f);
        self.check_source(f);
    }

    /// The sender read the write's source pages: check that they still belong to the room.
    fn check_source(&mut self, f: &InFlight) {
        self.check_owner(f, f.src, |s| s.src_offset, ("read", "from source page"));
    }

    /// The write's bytes land in the destination: every page must still be the room's.
    fn land_dst(&mut self, f: &InFlight) {
        if let (Some(room), Some(first)) = (f.op.room, f.op.slices.first()) {
            if let Some(set) = self.unlanded.get_mut(&(f.dst, room, f.op.generation)) {
                set.remove(&(f.src, first.region.code(), first.dst_offset));
            }
        }
        if let Some(room) = f.op.room {
            let layout = self.nodes[f.dst].info.layout;
            let landed = self.nodes[f.dst]
                .landed
                .entry((room, f.op.generation))
                .or_default();
            for slice in f.op.slices.iter() {
                let unit = match slice.region {
                    Region::Kv { .. } => u64::from(layout.page_bytes),
                    Region::Aux => u64::from(layout.aux_bytes),
                    Region::State => u64::from(layout.state_bytes),
                    Region::Scratch => continue,
                };
                if unit == 0 {
                    continue;
                }
                // Only whole units count: a page half written is not there.
                let first = slice.dst_offset.div_ceil(unit);
                let end = (slice.dst_offset + slice.len) / unit;
                for i in first..end {
                    landed.insert((slice.region.code(), i));
                }
            }
        }
        self.check_owner(f, f.dst, |s| s.dst_offset, ("write", "landed on page"));
    }

    /// Every KV page the write's slices touch on `node` (at the offsets `offset` picks) must
    /// belong to the write's room; each one that does not is a violation worded with `what`
    /// (the access, and where).
    fn check_owner(
        &mut self,
        f: &InFlight,
        node: usize,
        offset: impl Fn(&crate::layout::Slice) -> u64,
        what: (&str, &str),
    ) {
        let Some(room) = f.op.room else { return };
        let key = (room, f.op.generation);
        let page_bytes = u64::from(self.nodes[node].info.layout.page_bytes);
        for slice in f.op.slices.iter() {
            if !matches!(slice.region, Region::Kv { .. }) {
                continue;
            }
            let first = offset(slice) / page_bytes;
            let last = (offset(slice) + slice.len - 1) / page_bytes;
            for p in first..=last {
                let owner = self.nodes[node].pages.get(p as usize).copied().flatten();
                if owner != Some(key) {
                    let (access, place) = what;
                    self.violations.push(format!(
                        "node {node}: {access} of {room} {place} {p} owned by {owner:?}"
                    ));
                }
            }
        }
    }

    fn record(&mut self, n: usize, ev: Event) {
        let now = self.now;
        match &ev {
            Event::RoomState {
                room,
                generation,
                state,
            } => {
                let key = (*room, *generation);
                let node = &mut self.nodes[n];
                if let Some(prev) = node.states.get(&key) {
                    if prev.is_terminal() {
                        self.violations.push(format!(
                            "node {n}: {room} left terminal {prev:?} for {state:?}"
                        ));
                    }
                }
                node.states.insert(key, *state);
                let is_decode = node.info.role == Role::Decode;
                if *state == KvPoll::Success
                    && is_decode
                    && self
                        .unlanded
                        .get(&(n, *room, *generation))
                        .is_some_and(|s| !s.is_empty())
                {
                    self.violations.push(format!(
                        "node {n}: {room} succeeded with operations that never landed"
                    ));
                }
                if *state == KvPoll::Success && is_decode {
                    if let Some(missing) = self.nodes[n].unlanded_page(key) {
                        self.violations.push(format!(
                            "node {n}: {room} succeeded but {missing} was never written in this lifetime"
                        ));
                    }
                }
                let node = &mut self.nodes[n];
                if state.is_terminal() {
                    node.concluded_at.insert(key, now);
                }
            }
            Event::Releasable { room, generation } => {
                let key = (*room, *generation);
                let node = &mut self.nodes[n];
                if !node.states.get(&key).is_some_and(|s| s.is_terminal()) {
                    self.violations
                        .push(format!("node {n}: {room} releasable before terminal"));
                }
                if !node.released.insert(key) {
                    self.violations
                        .push(format!("node {n}: {room} released twice"));
                }
                node.free(*room, *generation);
                self.releases += 1;
            }
            _ => {}
        }
        self.nodes[n].events.push((now, ev));
    }

    /// The earliest moment something happens.
    fn next_time(&self) -> Option<Instant> {
        let q = self.queue.peek().map(|Reverse(q)| q.0);
        let timers = self
            .nodes
            .iter()
            .filter_map(|n| n.endpoint.poll_timeout().map(|(t, _)| t))
            .min();
        match (q, timers) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Advances to the next moment and processes everything due. `false` when idle.
    pub fn step(&mut self) -> bool {
        let Some(t) = self.next_time() else {
            return false;
        };
        if t > self.now {
            self.now = t;
        }
        self.steps += 1;
        while self.queue.peek().is_some_and(|Reverse(q)| q.0 <= self.now) {
            if let Some(Reverse(Queued(_, _, p))) = self.queue.pop() {
                self.process(p);
            }
        }
        for n in 0..self.nodes.len() {
            if self.nodes[n]
                .endpoint
                .poll_timeout()
                .is_some_and(|(t, _)| t <= self.now)
            {
                self.nodes[n].endpoint.handle_timeout(self.now);
                self.drain(n);
            }
        }
        true
    }

    fn process(&mut self, p: Pending) {
        match p {
            Pending::Deliver {
                node,
                session,
                bytes,
            } => {
                if self.nodes[node].endpoint.session_state(session).is_none() {
                    return;
                }
                // A byte stream, as a driver sees it: keep what the core did not consume.
                let data = match self.rx.remove(&(node, session)) {
                    Some(mut held) => {
                        held.extend_from_slice(&bytes);
                        held
                    }
                    None => bytes,
                };
                let used = self.nodes[node]
                    .endpoint
                    .handle_input(self.now, session, &data);
                if used > data.len() {
                    self.violations.push(format!(
                        "node {node}: consumed {used} of {} bytes",
                        data.len()
                    ));
                }
                if used < data.len() {
                    self.rx.insert((node, session), data[used..].to_vec());
                }
                self.drain(node);
            }
            Pending::OpDone { node, id } => {
                let Some(f) = self.inflight.remove(&(node, id)) else {
                    return;
                };
                let landed = f.outcome == TransferOutcome::Done;
                if landed {
                    self.land(&f);
                }
                self.end_write(&f, landed);
                self.nodes[node]
                    .endpoint
                    .handle_transfer_result(self.now, id, f.outcome);
                self.drain(node);
            }
            Pending::OrphanLands { key } => {
                if let Some(f) = self.orphans.remove(&key) {
                    self.land_dst(&f);
                    self.end_write(&f, true);
                }
            }
            Pending::Fence { node, session } => {
                // Break every write in flight over this session, in either direction.
                let peer = self.link_of(node, session).map(|(li, dir)| {
                    if dir == 0 {
                        self.links[li].b
                    } else {
                        self.links[li].a
                    }
                });
                let broken: Vec<(usize, TransferId)> = self
                    .inflight
                    .iter()
                    .filter(|(_, f)| {
                        (f.src == node && f.op.session == session)
                            || Some((f.dst, f.dst_session)) == Some((node, session))
                                && peer.is_some_and(|p| p.0 == f.src)
                    })
                    .map(|(k, _)| *k)
                    .collect();
                for key in broken {
                    if let Some(f) = self.inflight.remove(&key) {
                        self.end_write(&f, false);
                        self.nodes[f.src].endpoint.handle_transfer_result(
                            self.now,
                            f.op.id,
                            TransferOutcome::Transient,
                        );
                        self.drain(f.src);
                    }
                }
                // The receiver's side of the fence stops its receive paths: nothing lands.
                self.orphans
                    .retain(|_, f| !(f.dst == node && f.dst_session == session));
                self.nodes[node]
                    .endpoint
                    .handle_fence_complete(self.now, session);
                self.drain(node);
            }
            Pending::Close { node, session } => {
                let Some((li, _)) = self.link_of(node, session) else {
                    return;
                };
                let l = &mut self.links[li];
                let was_up = l.up;
                l.up = false;
                // Through a black hole the far end learns nothing: its own timers decide.
                let ends: Vec<(usize, SessionId)> = if l.blackhole_until > self.now {
                    vec![(node, session)]
                } else {
                    vec![l.a, l.b]
                };
                for &(n, s) in &ends {
                    let broken: Vec<(usize, TransferId)> = self
                        .inflight
                        .iter()
                        .filter(|(_, f)| {
                            (f.src == n && f.op.session == s) || (f.dst == n && f.dst_session == s)
                        })
                        .map(|(k, _)| *k)
                        .collect();
                    self.orphans
                        .retain(|_, f| !(f.dst == n && f.dst_session == s));
                    for key in broken {
                        if let Some(f) = self.inflight.remove(&key) {
                            self.end_write(&f, false);
                            self.nodes[f.src].endpoint.handle_transfer_result(
                                self.now,
                                f.op.id,
                                TransferOutcome::Transient,
                            );
                            self.drain(f.src);
                        }
                    }
                }
                for &(n, s) in &ends {
                    if s != DEAD_SESSION {
                        self.nodes[n].endpoint.handle_disconnected(self.now, s);
                        self.drain(n);
                    }
                }
                let (a, b) = (self.links[li].a.0, self.links[li].b.0);
                if let (true, Some(after)) = (was_up, self.faults.reconnect_after) {
                    let at = self.now + after;
                    self.push(at, Pending::Reconnect { a, b });
                }
            }
            Pending::Reconnect { a, b } => {
                if self.session(a, b).is_none() {
                    self.connect(a, b);
                }
            }
            Pending::Work(w) => self.work(w),
        }
    }

    /// Runs until `done` holds, at most `max_steps` steps.
    pub fn run_until(
        &mut self,
        max_steps: u64,
        mut done: impl FnMut(&Sim) -> bool,
    ) -> Result<(), SimError> {
        let start = self.steps;
        while !done(self) {
            if self.steps - start >= max_steps {
                return Err(SimError::Livelock {
                    steps: self.steps - start,
                });
            }
            if !self.step() {
                return if done(self) {
                    Ok(())
                } else {
                    Err(SimError::Stalled)
                };
            }
        }
        Ok(())
    }

    /// Runs for `d` of simulated time (or until idle), at most `max_steps` steps.
    pub fn run_for(&mut self, d: Duration, max_steps: u64) -> Result<(), SimError> {
        let until = self.now + d;
        let start = self.steps;
        loop {
            match self.next_time() {
                Some(t) if t <= until => {}
                _ => {
                    self.now = self.now.max(until);
                    return Ok(());
                }
            }
            if self.steps - start >= max_steps {
                return Err(SimError::Livelock {
                    steps: self.steps - start,
                });
            }
            self.step();
        }
    }

    /// Whether every node holds no room and no operation.
    pub fn quiescent(&self) -> bool {
        self.nodes
            .iter()
            .all(|n| n.endpoint.live_rooms() == 0 && n.endpoint.live_ops() == 0)
    }

    /// Checks that each node's counters agree with its event stream; returns mismatches.
    pub fn counter_mismatches(&self) -> Vec<String> {
        let mut out = Vec::new();
        for (i, n) in self.nodes.iter().enumerate() {
            let c = n.endpoint.counters();
            let succ = n.count_events(|e| {
                matches!(
                    e,
                    Event::RoomState {
                        state: KvPoll::Success,
                        ..
                    }
                )
            }) as u64;
            if succ != c.rooms_succeeded {
                out.push(format!(
                    "node {i}: {succ} success events, counter {}",
                    c.rooms_succeeded
                ));
            }
            for reason in FailureReason::ALL {
                let ev = n.count_events(|e| matches!(e, Event::RoomState { state: KvPoll::Failed(r), .. } if *r == reason)) as u64;
                if ev != c.failed(reason) {
                    out.push(format!(
                        "node {i}: {ev} {reason} events, counter {}",
                        c.failed(reason)
                    ));
                }
            }
            let rel = n.count_events(|e| matches!(e, Event::Releasable { .. })) as u64;
            if rel != c.rooms_released {
                out.push(format!(
                    "node {i}: {rel} releasable events, counter {}",
                    c.rooms_released
                ));
            }
            let bl = n.count_events(|e| matches!(e, Event::SessionBlacklisted { .. })) as u64;
            if bl != c.sessions_blacklisted {
                out.push(format!(
                    "node {i}: {bl} blacklist events, counter {}",
                    c.sessions_blacklisted
                ));
            }
            out.extend(n.layer_delivery_mismatches(i));
            let rec = n.count_events(|e| matches!(e, Event::SessionRecovered { .. })) as u64;
            if rec != c.sessions_recovered {
                out.push(format!(
                    "node {i}: {rec} recovery events, counter {}",
                    c.sessions_recovered
                ));
            }
        }
        out
    }
}

// -------------------------------------------------------------------- workload

/// A stream of rooms between decode and prefill nodes, with chunking, layerwise sends,
/// aborts and page allocation (pages return to the pool only on `Releasable`).
#[derive(Debug, Clone)]
pub struct Workload {
    /// Decode nodes rooms are spread over.
    pub decodes: Vec<usize>,
    /// Groups of prefill nodes; a room is fed by every node of one group (PP stages).
    pub prefill_groups: Vec<Vec<usize>>,
    /// Rooms to run.
    pub rooms: usize,
    /// Time between room arrivals.
    pub interarrival: Duration,
    /// Pages per room (range).
    pub pages: (u32, u32),
    /// Chunks per room (range).
    pub chunks: (u8, u8),
    /// Compute time between chunks.
    pub chunk_compute: Duration,
    /// Probability a room is sent layer by layer.
    pub layerwise: f64,
    /// Probability decode aborts the room at a random moment.
    pub decode_abort: f64,
    /// Probability prefill aborts the room at a random moment.
    pub prefill_abort: f64,
    /// Outcome per room index (filled as rooms run).
    pub states: Vec<RoomRun>,
    /// Rooms whose pages had to wait for capacity.
    pub queued_for_pages: u64,
    /// Rooms that arrived so far.
    pub arrived: usize,
    /// Releasable events expected: one per node that opened a workload room.
    pub expected_releases: usize,
    /// Releasable events seen before the workload started.
    pub releases_before: usize,
}

/// The record of one workload room.
#[derive(Debug, Clone, Default)]
pub struct RoomRun {
    /// Room id.
    pub room: Option<RoomId>,
    /// Decode node.
    pub decode: usize,
    /// Prefill nodes.
    pub prefills: Vec<usize>,
    /// When it was opened.
    pub opened_at: Option<Instant>,
    /// Pages.
    pub pages: u32,
    /// Chunks.
    pub chunks: u8,
    /// Layerwise.
    pub layerwise: bool,
    /// Source pages per prefill node.
    pub src: Vec<Vec<u32>>,
    /// Whether it could not even be opened (no session).
    pub unopened: bool,
}

impl Workload {
    /// A workload with plain defaults over the given nodes.
    pub fn new(decodes: Vec<usize>, prefill_groups: Vec<Vec<usize>>, rooms: usize) -> Self {
        Workload {
            decodes,
            prefill_groups,
            rooms,
            interarrival: Duration::from_micros(200),
            pages: (1, 16),
            chunks: (1, 3),
            chunk_compute: Duration::from_micros(300),
            layerwise: 0.2,
            decode_abort: 0.0,
            prefill_abort: 0.0,
            states: Vec::new(),
            queued_for_pages: 0,
            arrived: 0,
            expected_releases: 0,
            releases_before: 0,
        }
    }
}

impl Sim {
    /// Installs a workload and schedules its arrivals.
    pub fn start_workload(&mut self, mut w: Workload) {
        w.states = vec![RoomRun::default(); w.rooms];
        w.releases_before = self.releases;
        let interarrival = w.interarrival;
        let rooms = w.rooms;
        self.workload = Some(w);
        for i in 0..rooms {
            let at = self.now + interarrival * i as u32;
            self.push(at, Pending::Work(WorkItem::Arrive(i)));
        }
    }

    /// Whether every workload room concluded and was released on every node that had it.
    pub fn workload_done(&self) -> bool {
        let Some(w) = &self.workload else { return true };
        w.arrived == w.rooms && self.releases - w.releases_before == w.expected_releases
    }

    fn work(&mut self, item: WorkItem) {
        let now = self.now;
        let Some(mut w) = self.workload.take() else {
            return;
        };
        match item {
            WorkItem::Arrive(i) => {
                let room = RoomId(i as u64 + 1);
                let decode = w.decodes[i % w.decodes.len()];
                let group =
                    w.prefill_groups[(i / w.decodes.len()) % w.prefill_groups.len()].clone();
                let pages = w.pages.0 + self.rng.below(u64::from(w.pages.1 - w.pages.0) + 1) as u32;
                let chunks = (w.chunks.0
                    + self.rng.below(u64::from(w.chunks.1 - w.chunks.0) + 1) as u8)
                    .min(pages as u8)
                    .max(1);
                let layerwise = self.rng.chance(w.layerwise);
                let run = &mut w.states[i];
                run.room = Some(room);
                run.decode = decode;
                run.prefills = group.clone();
                run.pages = pages;
                run.chunks = chunks;
                run.layerwise = layerwise;
                run.opened_at = Some(now);
                w.arrived += 1;
                let sources: Option<Vec<SessionId>> =
                    group.iter().map(|&p| self.session(decode, p)).collect();
                let Some(sources) = sources else {
                    run.unopened = true;
                    self.workload = Some(w);
                    return;
                };
                let grant = self.nodes[decode].alloc(room, 0, pages).map(|dst| Grant {
                    pages: dst,
                    aux_slot: Some(i as u32 % 4096),
                    state_slot: None,
                    receivers: 1,
                });
                if grant.is_none() {
                    w.queued_for_pages += 1;
                }
                let queued = grant.is_none();
                if self.nodes[decode]
                    .endpoint
                    .open_receiver(now, room, 0, &sources, grant)
                    .is_err()
                {
                    run.unopened = true;
                    self.workload = Some(w);
                    return;
                }
                w.expected_releases += 1;
                if queued {
                    let _ = self.nodes[decode].endpoint.set_queue_position(now, room, 1);
                    self.push(
                        now + Duration::from_millis(1),
                        Pending::Work(WorkItem::Grant(i)),
                    );
                }
                self.drain(decode);
                for (k, &p) in group.iter().enumerate() {
                    if self.nodes[p].endpoint.open_sender(now, room, 0).is_ok() {
                        w.expected_releases += 1;
                    }
                    let src = self.nodes[p].alloc(room, 0, pages).unwrap_or_default();
                    if let Some(run) = w.states.get_mut(i) {
                        run.src.push(src);
                    }
                    let _ = k;
                    self.drain(p);
                }
                self.push(now + w.chunk_compute, Pending::Work(WorkItem::Chunk(i, 0)));
                if self.rng.chance(w.decode_abort) {
                    let at = now + Duration::from_micros(self.rng.below(2_000));
                    self.push(at, Pending::Work(WorkItem::Abort(i, true)));
                }
                if self.rng.chance(w.prefill_abort) {
                    let at = now + Duration::from_micros(self.rng.below(2_000));
                    self.push(at, Pending::Work(WorkItem::Abort(i, false)));
                }
            }
            WorkItem::Grant(i) => {
                let run = &w.states[i];
                let (decode, room, pages) = (run.decode, run.room.unwrap_or_default(), run.pages);
                if self.nodes[decode].endpoint.room_state(room) == Some(KvPoll::Bootstrapping) {
                    match self.nodes[decode].alloc(room, 0, pages) {
                        Some(dst) => {
                            let grant = Grant {
                                pages: dst,
                                aux_slot: Some(i as u32 % 4096),
                                state_slot: None,
                                receivers: 1,
                            };
                            let _ = self.nodes[decode].endpoint.grant_pages(now, room, grant);
                        }
                        None => self.push(
                            now + Duration::from_millis(1),
                            Pending::Work(WorkItem::Grant(i)),
                        ),
                    }
                    self.drain(decode);
                }
            }
            WorkItem::Chunk(i, c) => {
                let run = w.states[i].clone();
                let room = run.room.unwrap_or_default();
                let per = run.pages.div_ceil(u32::from(run.chunks));
                let lo = (u32::from(c) * per).min(run.pages) as usize;
                let hi = ((u32::from(c) + 1) * per).min(run.pages) as usize;
                let last = c + 1 >= run.chunks;
                for (k, &p) in run.prefills.iter().enumerate() {
                    let pages = run
                        .src
                        .get(k)
                        .map(|s| s[lo.min(s.len())..hi.min(s.len())].to_vec())
                        .unwrap_or_default();
                    let chunk = Chunk {
                        pages,
                        last,
                        aux_slot: Some(i as u32 % 4096),
                        state_slot: None,
                        layerwise: run.layerwise,
                    };
                    let _ = self.nodes[p].endpoint.send_chunk(now, room, chunk);
                    self.drain(p);
                }
                if run.layerwise {
                    let layers = self.nodes[run.prefills[0]].info.layout.layers;
                    for l in 0..layers {
                        let at = now + w.chunk_compute / u32::from(layers) * u32::from(l + 1);
                        self.push(at, Pending::Work(WorkItem::Layer(i, c, l)));
                    }
                }
                if !last {
                    self.push(
                        now + w.chunk_compute,
                        Pending::Work(WorkItem::Chunk(i, c + 1)),
                    );
                }
            }
            WorkItem::Layer(i, _c, layer) => {
                let run = &w.states[i];
                let room = run.room.unwrap_or_default();
                for &p in &run.prefills.clone() {
                    let info = &self.nodes[p].info;
                    if layer >= info.layer_start && layer < info.layer_end {
                        let _ = self.nodes[p].endpoint.mark_layer_ready(now, &[room], layer);
                        self.drain(p);
                    }
                }
            }
            WorkItem::Abort(i, on_decode) => {
                let run = &w.states[i];
                let room = run.room.unwrap_or_default();
                let n = if on_decode {
                    run.decode
                } else {
                    run.prefills[0]
                };
                let _ = self.nodes[n].endpoint.abort(now, room);
                self.drain(n);
            }
        }
        self.workload = Some(w);
    }

    /// Rooms of the workload whose decode side reached each outcome.
    pub fn workload_outcomes(&self) -> BTreeMap<String, usize> {
        let mut out = BTreeMap::new();
        let Some(w) = &self.workload else { return out };
        for r in &w.states {
            let key = match r.room {
                _ if r.unopened => "unopened".to_owned(),
                Some(room) => match self.nodes[r.decode].states.get(&(room, 0)) {
                    Some(KvPoll::Success) => "success".to_owned(),
                    Some(KvPoll::Failed(reason)) => reason.as_str().to_owned(),
                    Some(_) => "unfinished".to_owned(),
                    None => "unknown".to_owned(),
                },
                None => "not_arrived".to_owned(),
            };
            *out.entry(key).or_default() += 1;
        }
        out
    }

    /// Workload rooms that became terminal later than `bound` after they opened, on any node.
    pub fn late_rooms(&self, bound: Duration) -> Vec<String> {
        let mut out = Vec::new();
        let Some(w) = &self.workload else { return out };
        for r in &w.states {
            let (Some(room), Some(opened)) = (r.room, r.opened_at) else {
                continue;
            };
            if r.unopened {
                continue;
            }
            for n in std::iter::once(r.decode).chain(r.prefills.iter().copied()) {
                match self.nodes[n].concluded_at.get(&(room, 0)) {
                    Some(t) if t.duration_since(opened) <= bound => {}
                    Some(t) => out.push(format!(
                        "{room} on node {n} concluded after {:?}",
                        t.duration_since(opened)
                    )),
                    None => out.push(format!("{room} on node {n} never concluded")),
                }
            }
        }
        out
    }
}
