//! Workloads: streams of rooms between decode and prefill nodes, with chunking, layerwise
//! sends, aborts and page allocation.

use super::*;

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

    // One arm per step of a workload room's life (arrive, grant, chunk, layer, abort), as an
    // embedder would take them: the simulated embedder reads in one place.
    pub(super) fn work(&mut self, item: WorkItem) {
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
                    skip_pages: 0,
                    idle_sources: 0,
                    extras: Vec::new(),
                    prompt: None,
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
                    if self.nodes[p]
                        .endpoint
                        .open_sender(now, room, 0, None)
                        .is_ok()
                    {
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
                                skip_pages: 0,
                                idle_sources: 0,
                                extras: Vec::new(),
                                prompt: None,
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
                        extras: Vec::new(),
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
