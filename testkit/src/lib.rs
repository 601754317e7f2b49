//! `kvferry-testkit`: the reference embedder that the `kvferry` command and the integration
//! tests share. A synthetic model shape whose every page carries a pattern derived from
//! (room, layer, plane, page), a prefill half that serves it, a decode half that requests
//! rooms and verifies every byte, the report, the layerwise overlap and GPU demos, the fault
//! proxy and throwaway TLS certificates.
//!
//! It embeds kvferry exactly as a user would, through the driver's API; it never reaches into
//! the core's internals and is never a dependency of a kvferry library crate.

pub mod bench;
pub mod overlap;
pub mod proxy;
pub mod testcert;

use std::collections::{BTreeMap, VecDeque};
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvferry_core::{
    Chunk, Config, Counters, FailureReason, Generation, Grant, Incarnation, KvPoll, Layout, NodeId,
    Region, Role, RoomId,
};
use kvferry_glommio::{GlommioNode, ShardConfig};
use kvferry_memory::MemoryMap;
pub use kvferry_tokio::DataBackend;
use kvferry_tokio::{Announcement, KvNode, Node, NodeConfig, NodeError, PeerId, RoomHandle};
use tracing::warn;

/// The synthetic model and workload.
#[derive(Clone, Debug)]
pub struct Shape {
    /// Model layers.
    pub layers: u16,
    /// 2 for K and V.
    pub planes: u8,
    /// Bytes per page per (layer, plane).
    pub page_bytes: u32,
    /// Pages per room.
    pub pages_per_room: u32,
    /// Chunks per room.
    pub chunks: u32,
    /// Rooms in flight at once.
    pub concurrency: usize,
    /// Send layer by layer: each layer's operations leave when its forward pass is done.
    pub layerwise: bool,
    /// Simulated forward time per layer and chunk (both modes, so they compare).
    pub layer_compute: Duration,
    /// Data connections per session.
    pub data_connections: usize,
}

impl Default for Shape {
    fn default() -> Self {
        Shape {
            layers: 8,
            planes: 2,
            page_bytes: 16 * 1024,
            pages_per_room: 32,
            chunks: 1,
            concurrency: 16,
            layerwise: false,
            layer_compute: Duration::ZERO,
            data_connections: 2,
        }
    }
}

/// Bytes of one aux row: the room id, to check it arrived with the room.
pub const AUX_BYTES: u32 = 64;
const FREE_WORD: u64 = 0xFEED_FACE_DEAD_BEEF;

impl Shape {
    /// The registered memory layout: room for `concurrency` rooms, with slack for quarantine.
    pub fn layout(&self) -> Layout {
        let pages = (self.pages_per_room as usize * (self.concurrency + 4)) as u32;
        Layout {
            layers: self.layers,
            planes: self.planes,
            page_bytes: self.page_bytes,
            pages,
            aux_bytes: AUX_BYTES,
            state_bytes: 0,
            slots: (self.concurrency as u32 + 4) * 2,
        }
    }

    /// Payload bytes of one room.
    pub fn room_bytes(&self) -> u64 {
        u64::from(self.layers)
            * u64::from(self.planes)
            * u64::from(self.pages_per_room)
            * u64::from(self.page_bytes)
            + u64::from(AUX_BYTES)
    }
}

fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Word `i` of the pattern of (room, layer, plane, page index within the room). Words 0 and 1
/// spell the room and (layer, plane, index) themselves, so two distinct pages never hold the
/// same bytes (pages are at least 16 bytes); the rest is a hash of all four.
fn pattern_word(room: RoomId, layer: u16, plane: u8, index: u32, i: usize) -> u64 {
    let place = (u64::from(layer) << 40) | (u64::from(plane) << 32) | u64::from(index);
    match i {
        0 => room.0,
        1 => place ^ 0x6b76_0000_0000_0000,
        _ => mix(mix(room.0) ^ place) ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15),
    }
}

/// Fills `page` with the pattern of (room, layer, plane, page index within the room).
pub fn fill_pattern(page: &mut [u8], room: RoomId, layer: u16, plane: u8, index: u32) {
    for (i, w) in page.chunks_exact_mut(8).enumerate() {
        w.copy_from_slice(&pattern_word(room, layer, plane, index, i).to_le_bytes());
    }
}

/// Whether `page` holds exactly the pattern of (room, layer, plane, index).
pub fn check_pattern(page: &[u8], room: RoomId, layer: u16, plane: u8, index: u32) -> bool {
    page.chunks_exact(8).enumerate().all(|(i, w)| {
        let mut a = [0u8; 8];
        a.copy_from_slice(w);
        u64::from_le_bytes(a) == pattern_word(room, layer, plane, index, i)
    })
}

fn all_words(page: &[u8], word: u64) -> bool {
    page.chunks_exact(8).all(|w| {
        let mut a = [0u8; 8];
        a.copy_from_slice(w);
        u64::from_le_bytes(a) == word
    })
}

fn fill_words(page: &mut [u8], word: u64) {
    for w in page.chunks_exact_mut(8) {
        w.copy_from_slice(&word.to_le_bytes());
    }
}

fn kv_regions(shape: &Shape) -> impl Iterator<Item = (u16, u8)> + '_ {
    (0..shape.layers).flat_map(move |l| (0..shape.planes).map(move |p| (l, p)))
}

/// Writes the pattern of `layer` of `room` into its pages (`src[i]` holds the room's page i),
/// every plane; `page` is scratch of one page.
fn fill_room_layer(
    memory: &MemoryMap,
    shape: &Shape,
    room: RoomId,
    layer: u16,
    src: &[u32],
    page: &mut [u8],
) {
    for plane in 0..shape.planes {
        for (i, &p) in src.iter().enumerate() {
            fill_pattern(page, room, layer, plane, i as u32);
            let _ = memory.write(
                Region::Kv { layer, plane },
                u64::from(p) * u64::from(shape.page_bytes),
                page,
            );
        }
    }
}

/// Writes the free pattern into `pages` of every KV region, so a stray write shows.
fn write_free(memory: &MemoryMap, shape: &Shape, pages: impl Iterator<Item = u32> + Clone) {
    let mut free = vec![0u8; shape.page_bytes as usize];
    fill_words(&mut free, FREE_WORD);
    for (layer, plane) in kv_regions(shape) {
        for p in pages.clone() {
            let _ = memory.write(
                Region::Kv { layer, plane },
                u64::from(p) * u64::from(shape.page_bytes),
                &free,
            );
        }
    }
}

/// A room's aux row: its id in every word.
fn aux_row(room: RoomId) -> [u8; AUX_BYTES as usize] {
    let mut aux = [0u8; AUX_BYTES as usize];
    fill_words(&mut aux, room.0);
    aux
}

/// What one room's pages and aux row held against its pattern.
struct RoomCheck {
    /// Pages read.
    pages: u64,
    /// Pages that did not hold the room's pattern.
    bad_pages: u64,
    /// Whether the aux row held the room's id.
    aux_ok: bool,
}

/// Checks every page of `room` (`pages[i]` holds its page i) and its aux row in `aux_slot`,
/// reading through `read` (host memory, or a copy back from GPU memory); logs what is wrong.
fn check_room(
    shape: &Shape,
    room: RoomId,
    pages: &[u32],
    aux_slot: u32,
    mut read: impl FnMut(Region, u64, &mut [u8]) -> bool,
) -> RoomCheck {
    let mut buf = vec![0u8; shape.page_bytes as usize];
    let mut check = RoomCheck {
        pages: 0,
        bad_pages: 0,
        aux_ok: true,
    };
    for (layer, plane) in kv_regions(shape) {
        for (i, &p) in pages.iter().enumerate() {
            let offset = u64::from(p) * u64::from(shape.page_bytes);
            check.pages += 1;
            let read_ok = read(Region::Kv { layer, plane }, offset, &mut buf);
            if !read_ok || !check_pattern(&buf, room, layer, plane, i as u32) {
                check.bad_pages += 1;
                warn!(%room, page = p, layer, plane, still_free = all_words(&buf, FREE_WORD), first_word = ?&buf[..8], "page holds the wrong bytes");
            }
        }
    }
    let mut aux = [0u8; AUX_BYTES as usize];
    let offset = u64::from(aux_slot) * u64::from(AUX_BYTES);
    if !read(Region::Aux, offset, &mut aux) || !all_words(&aux, room.0) {
        check.aux_ok = false;
        warn!(%room, "aux row holds the wrong bytes");
    }
    check
}

/// Builds a node config for one side of the demo or the split commands.
pub fn node_config(role: Role, shape: &Shape, core: Config, token: &[u8], seed: u64) -> NodeConfig {
    let mut info = kvferry_core::EndpointInfo::new(
        role,
        NodeId(
            seed ^ if role == Role::Prefill {
                0x5052
            } else {
                0x4445
            },
        ),
        Incarnation(
            mix(seed ^ std::process::id() as u64 ^ Instant::now().elapsed().as_nanos() as u64) | 1,
        ),
        shape.layout(),
    );
    info.token = token.to_vec();
    NodeConfig {
        core,
        info,
        data_connections: shape.data_connections,
        seed,
        faults: None,
        backend: Default::default(),
        tls: None,
    }
}

/// A pool of page indices.
#[derive(Debug)]
struct Pool {
    free: VecDeque<u32>,
}

impl Pool {
    fn new(n: u32) -> Self {
        Pool {
            free: (0..n).collect(),
        }
    }

    fn take(&mut self, n: u32) -> Option<Vec<u32>> {
        if self.free.len() < n as usize {
            return None;
        }
        Some(self.free.drain(..n as usize).collect())
    }

    fn give(&mut self, pages: &[u32]) {
        self.free.extend(pages.iter().copied());
    }
}

/// Serves synthetic KV as a prefill node: every room a decode announces is opened, its
/// source pages filled with the room's pattern and sent (chunked or layer by layer).
/// Runs until the node shuts down.
pub async fn serve_prefill<N: KvNode>(node: N, shape: Shape) {
    let mut announcements = node.room_announcements();
    let layout = shape.layout();
    let pool = Arc::new(Mutex::new(Pool::new(layout.pages)));
    let slots = Arc::new(Mutex::new(Pool::new(layout.slots)));
    // Rooms wait here for source memory; every release wakes the loop to retry them.
    let freed = Arc::new(tokio::sync::Notify::new());
    let mut waiting: VecDeque<(RoomId, u32, u32)> = VecDeque::new();
    loop {
        tokio::select! {
            a = announcements.recv() => match a {
                Some(a) => waiting.push_back((a.room, a.generation, a.pages)),
                None => return,
            },
            _ = freed.notified() => {}
        }
        // Start every waiting room that has source memory.
        while let Some(&(room, generation, pages)) = waiting.front() {
            let pages = if pages == 0 {
                shape.pages_per_room
            } else {
                pages.min(shape.pages_per_room)
            };
            let Some(src) = pool.lock().map(|mut p| p.take(pages)).ok().flatten() else {
                break;
            };
            let Some(slot) = slots.lock().map(|mut s| s.take(1)).ok().flatten() else {
                if let Ok(mut p) = pool.lock() {
                    p.give(&src);
                }
                break;
            };
            waiting.pop_front();
            let node = node.clone();
            let shape = shape.clone();
            let pool = pool.clone();
            let slots = slots.clone();
            let freed = freed.clone();
            tokio::spawn(async move {
                let handle = node.open_sender(room, generation).await;
                let Ok(mut handle) = handle else {
                    if let Ok(mut p) = pool.lock() {
                        p.give(&src);
                    }
                    if let Ok(mut s) = slots.lock() {
                        s.give(&slot);
                    }
                    freed.notify_one();
                    return;
                };
                send_room(&node, &shape, room, &src, slot[0]).await;
                handle.releasable().await;
                if let Ok(mut p) = pool.lock() {
                    p.give(&src);
                }
                if let Ok(mut s) = slots.lock() {
                    s.give(&slot);
                }
                freed.notify_one();
            });
        }
    }
}

async fn send_room<N: KvNode>(node: &N, shape: &Shape, room: RoomId, src: &[u32], aux_slot: u32) {
    let memory = node.memory();
    let mut page = vec![0u8; shape.page_bytes as usize];
    let fill_layer =
        |layer: u16, page: &mut Vec<u8>| fill_room_layer(memory, shape, room, layer, src, page);
    let _ = memory.write(
        Region::Aux,
        u64::from(aux_slot) * u64::from(AUX_BYTES),
        &aux_row(room),
    );
    let chunks = shape.chunks.clamp(1, src.len().max(1) as u32) as usize;
    let per = src.len().div_ceil(chunks);
    if !shape.layerwise {
        for layer in 0..shape.layers {
            fill_layer(layer, &mut page);
        }
    }
    for (c, part) in src.chunks(per.max(1)).enumerate() {
        let last = c + 1 == chunks || (c + 1) * per >= src.len();
        let chunk = Chunk {
            extras: Vec::new(),
            pages: part.to_vec(),
            last,
            aux_slot: Some(aux_slot),
            state_slot: None,
            layerwise: shape.layerwise,
        };
        if !shape.layerwise && !shape.layer_compute.is_zero() {
            // Whole-batch mode: the chunk moves only after its whole forward pass.
            tokio::time::sleep(shape.layer_compute * u32::from(shape.layers)).await;
        }
        if node.send_chunk(room, chunk).await.is_err() {
            return;
        }
        if shape.layerwise {
            // The forward pass: layer L is ready L+1 compute times after the chunk started
            // (deadlines from the start, so timer rounding does not accumulate).
            let started = tokio::time::Instant::now();
            for layer in 0..shape.layers {
                tokio::time::sleep_until(started + shape.layer_compute * (u32::from(layer) + 1))
                    .await;
                if c == 0 {
                    fill_layer(layer, &mut page);
                }
                if node.mark_layer_ready(vec![room], layer).await.is_err() {
                    return;
                }
            }
        }
        if last {
            break;
        }
    }
}

/// The outcome of a decode run: exactly the fields of `--json`.
#[derive(Clone, Debug, Default)]
pub struct Report {
    /// The runtime that ran the nodes (`tokio`, `glommio`, or `prefill/decode` when mixed).
    pub runtime: String,
    /// The data-plane backend (`tcp`).
    pub backend: String,
    /// The data paths the prefill's sessions took (`tcp`, `tcp_staged`, `rdma`,
    /// `rdma_dmabuf`; several joined by `+`).
    pub prefill_path: String,
    /// The data paths the decode's sessions took.
    pub decode_path: String,
    /// Rooms requested.
    pub rooms_total: u64,
    /// Rooms that reached Success.
    pub rooms_succeeded: u64,
    /// Rooms that reached Failed.
    pub rooms_failed: u64,
    /// Failed rooms by reason.
    pub failed_by_reason: BTreeMap<String, u64>,
    /// Rooms with no terminal state when the run ended.
    pub rooms_unfinished: u64,
    /// Rooms the node refused to open, by the embedder-API error (`room_exists`, ...).
    pub refused_by_error: BTreeMap<String, u64>,
    /// Rooms never opened because the node shut down first (SIGINT or SIGTERM mid-run).
    pub rooms_not_opened: u64,
    /// Bytes that landed in successful rooms and were verified (pages and aux rows that held
    /// exactly what prefill wrote).
    pub bytes_transferred: u64,
    /// Wall time of the run.
    pub elapsed_s: f64,
    /// Payload GB/s.
    pub throughput_gbps: f64,
    /// Room latency percentiles in milliseconds: p50, p99, max.
    pub latency_ms: (f64, f64, f64),
    /// Operation attempts retried.
    pub retries: u64,
    /// Sessions blacklisted.
    pub sessions_blacklisted: u64,
    /// Sessions recovered by a probe.
    pub sessions_recovered: u64,
    /// Pages of successful rooms whose bytes were checked.
    pub pages_verified: u64,
    /// Of those, pages whose bytes were wrong (never more than `pages_verified`).
    pub pages_corrupted: u64,
    /// Aux rows of successful rooms checked.
    pub aux_verified: u64,
    /// Of those, aux rows that held the wrong bytes.
    pub aux_corrupted: u64,
    /// Free pages checked before reuse.
    pub free_pages_checked: u64,
    /// Of those, free pages something wrote into (a stray write).
    pub free_pages_written: u64,
}

impl Report {
    /// The `--json` object.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({
            "runtime": self.runtime,
            "backend": self.backend,
            "prefill_path": self.prefill_path,
            "decode_path": self.decode_path,
            "rooms_total": self.rooms_total,
            "rooms_succeeded": self.rooms_succeeded,
            "rooms_failed": self.rooms_failed,
            "failed_by_reason": self.failed_by_reason,
            "rooms_unfinished": self.rooms_unfinished,
            "refused_by_error": self.refused_by_error,
            "rooms_not_opened": self.rooms_not_opened,
            "bytes_transferred": self.bytes_transferred,
            "elapsed_s": self.elapsed_s,
            "throughput_gbps": self.throughput_gbps,
            "latency_ms": { "p50": self.latency_ms.0, "p99": self.latency_ms.1, "max": self.latency_ms.2 },
            "retries": self.retries,
            "sessions_blacklisted": self.sessions_blacklisted,
            "sessions_recovered": self.sessions_recovered,
            "pages_verified": self.pages_verified,
            "pages_corrupted": self.pages_corrupted,
            "aux_verified": self.aux_verified,
            "aux_corrupted": self.aux_corrupted,
            "free_pages_checked": self.free_pages_checked,
            "free_pages_written": self.free_pages_written,
        })
    }

    /// Whether anything checked held the wrong bytes: the run must not pass.
    pub fn corrupted(&self) -> bool {
        self.pages_corrupted + self.aux_corrupted + self.free_pages_written > 0
    }

    /// The human-readable table.
    pub fn table(&self) -> String {
        let mut s = String::new();
        let row = |s: &mut String, k: &str, v: String| s.push_str(&format!("  {k:<22} {v}\n"));
        row(&mut s, "runtime", self.runtime.clone());
        row(&mut s, "backend", self.backend.clone());
        row(
            &mut s,
            "data path",
            format!("prefill {}, decode {}", self.prefill_path, self.decode_path),
        );
        row(
            &mut s,
            "rooms",
            format!(
                "{} total, {} succeeded, {} failed, {} unfinished",
                self.rooms_total, self.rooms_succeeded, self.rooms_failed, self.rooms_unfinished
            ),
        );
        for (reason, n) in &self.failed_by_reason {
            let why = FailureReason::ALL
                .iter()
                .find(|r| r.as_str() == reason)
                .map(|r| r.explain())
                .unwrap_or("");
            row(
                &mut s,
                &format!("  failed: {reason}"),
                format!("{n}  ({why})"),
            );
        }
        for (error, n) in &self.refused_by_error {
            row(&mut s, &format!("  refused: {error}"), n.to_string());
        }
        if self.rooms_not_opened > 0 {
            row(
                &mut s,
                "  not opened",
                format!("{}  (the node shut down first)", self.rooms_not_opened),
            );
        }
        row(
            &mut s,
            "bytes transferred",
            format!(
                "{} ({:.2} GiB)",
                self.bytes_transferred,
                self.bytes_transferred as f64 / (1u64 << 30) as f64
            ),
        );
        row(&mut s, "elapsed", format!("{:.3} s", self.elapsed_s));
        row(
            &mut s,
            "throughput",
            format!("{:.3} GB/s", self.throughput_gbps),
        );
        row(
            &mut s,
            "room latency",
            format!(
                "p50 {:.2} ms, p99 {:.2} ms, max {:.2} ms",
                self.latency_ms.0, self.latency_ms.1, self.latency_ms.2
            ),
        );
        row(&mut s, "retries", self.retries.to_string());
        row(
            &mut s,
            "sessions",
            format!(
                "{} blacklisted, {} recovered",
                self.sessions_blacklisted, self.sessions_recovered
            ),
        );
        for (error, n) in &self.refused_by_error {
            row(&mut s, &format!("  refused: {error}"), n.to_string());
        }
        row(
            &mut s,
            "pages",
            format!(
                "{} verified, {} corrupted",
                self.pages_verified, self.pages_corrupted
            ),
        );
        row(
            &mut s,
            "aux rows",
            format!(
                "{} verified, {} corrupted",
                self.aux_verified, self.aux_corrupted
            ),
        );
        row(
            &mut s,
            "free pages",
            format!(
                "{} checked, {} written to",
                self.free_pages_checked, self.free_pages_written
            ),
        );
        s
    }
}

/// One room of a decode run ended.
#[derive(Clone, Debug)]
pub struct RoomEnd {
    /// Rooms ended so far, this one included.
    pub finished: u64,
    /// The room.
    pub room: RoomId,
    /// `success`, a failure reason (`peer_unreachable`, ...), `refused:<error>` or `unfinished`.
    pub outcome: String,
    /// When it ended, since the run started.
    pub at: Duration,
}

/// Progress callback: called once per room as it ends.
pub type Progress = Arc<dyn Fn(&RoomEnd) + Send + Sync>;

/// Options of a decode run.
#[derive(Clone)]
pub struct DecodeRun {
    /// Rooms to request.
    pub rooms: u64,
    /// The shape (must match the prefill's).
    pub shape: Shape,
    /// First room id (distinct runs against one prefill use distinct ranges).
    pub first_room: u64,
    /// Called as rooms finish.
    pub progress: Option<Progress>,
    /// A room that is not terminal after this long counts as unfinished (the run stops).
    pub deadline: Duration,
    /// Decode aborts each room with this probability, 0-3 ms after opening it.
    pub abort_rate: f64,
    /// Seed of the abort decisions (reproducible per room).
    pub seed: u64,
}

/// A reproducible coin per (seed, room): `Some(delay)` when the room is hit.
fn abort_plan(rate: f64, seed: u64, room: RoomId) -> Option<Duration> {
    let z = mix(seed ^ room.0.wrapping_mul(0xD6E8_FEB8_6659_FD93));
    ((z >> 11) as f64 / (1u64 << 53) as f64 <= rate && rate > 0.0)
        .then(|| Duration::from_micros(z % 3000))
}

struct Pages {
    pool: Pool,
    slots: Pool,
}

/// Requests `run.rooms` rooms from the prefill `peer`, verifies every page of every
/// successful room, checks free pages before reuse, and reports. A persistent peer
/// ([`KvNode::connect_persistent`]) that is away is waited for up to the room deadline, so
/// rooms keep flowing across a prefill restart.
pub async fn run_decode<N: KvNode>(node: &N, peer: PeerId, run: DecodeRun) -> Report {
    let shape = run.shape.clone();
    let layout = shape.layout();
    let memory = node.memory().clone();
    // Every free page carries the free pattern, checked when it is handed out again.
    write_free(&memory, &shape, 0..layout.pages);
    let pages = Arc::new(PageBook {
        pages: Mutex::new(Pages {
            pool: Pool::new(layout.pages),
            slots: Pool::new(layout.slots),
        }),
        freed: tokio::sync::Notify::new(),
    });
    let tally = Arc::new(Tally::default());
    let started = Instant::now();
    let semaphore = Arc::new(tokio::sync::Semaphore::new(shape.concurrency.max(1)));
    let mut tasks = Vec::new();
    let finished = Arc::new(std::sync::atomic::AtomicU64::new(0));
    // Set by the first room the node refuses because it shut down: no later room is opened.
    let shut_down = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let mut opened = 0;
    for i in 0..run.rooms {
        let Ok(permit) = semaphore.clone().acquire_owned().await else {
            break;
        };
        if shut_down.load(std::sync::atomic::Ordering::Relaxed) {
            break;
        }
        opened += 1;
        let room = RoomId(run.first_room + i);
        let node = node.clone();
        let shape = shape.clone();
        let pages = pages.clone();
        let memory = memory.clone();
        let tally = tally.clone();
        let finished = finished.clone();
        let progress = run.progress.clone();
        let shut_down = shut_down.clone();
        let deadline = run.deadline;
        let abort_after = abort_plan(run.abort_rate, run.seed, room);
        tasks.push(tokio::spawn(async move {
            let _permit = permit;
            let t0 = Instant::now();
            let outcome = decode_room(
                &node,
                peer,
                &shape,
                room,
                &pages,
                &memory,
                &tally,
                deadline,
                abort_after,
            )
            .await;
            if matches!(outcome, RoomOutcome::Refused(_, true)) {
                shut_down.store(true, std::sync::atomic::Ordering::Relaxed);
            }
            let n = finished.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
            if let Some(p) = progress {
                let outcome = match &outcome {
                    RoomOutcome::Ended(KvPoll::Success) => "success".to_owned(),
                    RoomOutcome::Ended(KvPoll::Failed(r)) => r.as_str().to_owned(),
                    RoomOutcome::Refused(e, _) => format!("refused:{e}"),
                    RoomOutcome::Ended(_) | RoomOutcome::Unfinished => "unfinished".to_owned(),
                };
                p(&RoomEnd {
                    finished: n,
                    room,
                    outcome,
                    at: started.elapsed(),
                });
            }
            (outcome, t0.elapsed())
        }));
    }
    let mut report = Report {
        rooms_total: run.rooms,
        rooms_not_opened: run.rooms - opened,
        ..Report::default()
    };
    let mut latencies = Vec::new();
    for t in tasks {
        let Ok((outcome, latency)) = t.await else {
            report.rooms_unfinished += 1;
            continue;
        };
        match outcome {
            RoomOutcome::Ended(KvPoll::Success) => {
                report.rooms_succeeded += 1;
                latencies.push(latency);
            }
            RoomOutcome::Ended(KvPoll::Failed(reason)) => {
                report.rooms_failed += 1;
                *report
                    .failed_by_reason
                    .entry(reason.as_str().to_owned())
                    .or_default() += 1;
                latencies.push(latency);
            }
            RoomOutcome::Refused(error, _) => {
                *report.refused_by_error.entry(error).or_default() += 1;
            }
            RoomOutcome::Ended(_) | RoomOutcome::Unfinished => report.rooms_unfinished += 1,
        }
    }
    let refused: u64 = report.refused_by_error.values().sum();
    report.rooms_unfinished += opened.saturating_sub(
        report.rooms_succeeded + report.rooms_failed + report.rooms_unfinished + refused,
    );
    report.elapsed_s = started.elapsed().as_secs_f64();
    use std::sync::atomic::Ordering::Relaxed;
    report.bytes_transferred = tally.bytes_verified.load(Relaxed);
    report.throughput_gbps = report.bytes_transferred as f64 / report.elapsed_s.max(1e-9) / 1e9;
    latencies.sort();
    let pct = |q: f64| -> f64 {
        if latencies.is_empty() {
            return 0.0;
        }
        let i = ((latencies.len() as f64 * q).ceil() as usize).clamp(1, latencies.len()) - 1;
        latencies[i].as_secs_f64() * 1e3
    };
    report.latency_ms = (pct(0.5), pct(0.99), pct(1.0));
    report.pages_verified = tally.pages_verified.load(Relaxed);
    report.pages_corrupted = tally.pages_corrupted.load(Relaxed);
    report.aux_verified = tally.aux_verified.load(Relaxed);
    report.aux_corrupted = tally.aux_corrupted.load(Relaxed);
    report.free_pages_checked = tally.free_checked.load(Relaxed);
    report.free_pages_written = tally.free_written.load(Relaxed);
    report
}

/// Decode's free pages and aux slots, and the signal a room gives when it hands some back
/// (rooms that find too few wait on it rather than poll).
struct PageBook {
    pages: Mutex<Pages>,
    freed: tokio::sync::Notify,
}

/// What the decode run checked, shared by its room tasks.
#[derive(Default)]
struct Tally {
    pages_verified: std::sync::atomic::AtomicU64,
    pages_corrupted: std::sync::atomic::AtomicU64,
    aux_verified: std::sync::atomic::AtomicU64,
    aux_corrupted: std::sync::atomic::AtomicU64,
    free_checked: std::sync::atomic::AtomicU64,
    free_written: std::sync::atomic::AtomicU64,
    /// Bytes of successful rooms that held exactly what prefill wrote.
    bytes_verified: std::sync::atomic::AtomicU64,
}

/// How one decode room ended, as the node reported it.
enum RoomOutcome {
    /// The core's terminal state (or the last state seen).
    Ended(KvPoll),
    /// The node refused to open the room; the embedder-API error, in snake_case, and
    /// whether the refusal was the node being shut down.
    Refused(String, bool),
    /// No terminal state within the run's deadline.
    Unfinished,
}

/// The variant name of an error, in snake_case (`RoomExists(..)` -> `room_exists`).
fn error_kind(e: &NodeError) -> String {
    let debug = match e {
        NodeError::Api(api) => format!("{api:?}"),
        other => format!("{other:?}"),
    };
    let name: String = debug.chars().take_while(|c| c.is_alphanumeric()).collect();
    let mut out = String::new();
    for (i, c) in name.chars().enumerate() {
        if c.is_uppercase() && i > 0 {
            out.push('_');
        }
        out.push(c.to_ascii_lowercase());
    }
    out
}

#[allow(clippy::too_many_arguments)]
async fn decode_room<N: KvNode>(
    node: &N,
    peer: PeerId,
    shape: &Shape,
    room: RoomId,
    book: &PageBook,
    memory: &MemoryMap,
    tally: &Tally,
    deadline: Duration,
    abort_after: Option<Duration>,
) -> RoomOutcome {
    use std::sync::atomic::Ordering::Relaxed;
    let page_bytes = u64::from(shape.page_bytes);
    // Pages come back only on Releasable, so with `concurrency` rooms they always suffice.
    let (dst, slot) = loop {
        // Registered before the check: a release between the two still wakes it.
        let freed = book.freed.notified();
        let got = {
            let Ok(mut p) = book.pages.lock() else {
                return RoomOutcome::Unfinished;
            };
            match (
                p.pool.free.len() >= shape.pages_per_room as usize,
                !p.slots.free.is_empty(),
            ) {
                (true, true) => p
                    .pool
                    .take(shape.pages_per_room)
                    .zip(p.slots.take(1).map(|s| s[0])),
                _ => None,
            }
        };
        match got {
            Some(g) => break g,
            None => freed.await,
        }
    };
    // A free page must still hold the free pattern: anything else is a stray write.
    let mut buf = vec![0u8; shape.page_bytes as usize];
    for (layer, plane) in kv_regions(shape) {
        for &p in &dst {
            let _ = memory.read(
                Region::Kv { layer, plane },
                u64::from(p) * page_bytes,
                &mut buf,
            );
            tally.free_checked.fetch_add(1, Relaxed);
            if !all_words(&buf, FREE_WORD) {
                tally.free_written.fetch_add(1, Relaxed);
                warn!(%room, page = p, layer, plane, "a free page was written to");
            }
        }
    }
    let give_back = |dst: &[u32]| {
        if let Ok(mut pg) = book.pages.lock() {
            pg.pool.give(dst);
            pg.slots.give(&[slot]);
        }
        book.freed.notify_waiters();
    };
    let grant = Grant {
        extras: Vec::new(),
        pages: dst.clone(),
        aux_slot: Some(slot),
        state_slot: None,
        receivers: 1,
        skip_pages: 0,
        idle_sources: 0,
    };
    // A persistent peer that is away is waited for by the core, up to its unreachable window.
    let mut handle = match node.open_receiver(room, 0, vec![peer], Some(grant)).await {
        Ok(h) => h,
        Err(e) => {
            warn!(%room, error = %e, "room could not be opened");
            give_back(&dst);
            let shut_down = matches!(
                e,
                NodeError::ShutDown | NodeError::Api(kvferry_core::ApiError::ShutDown)
            );
            return RoomOutcome::Refused(error_kind(&e), shut_down);
        }
    };
    if let Some(delay) = abort_after {
        // The client gives up mid-flight; its pages must not be reused until no write
        // can land any more (the free-pattern check catches any that does).
        let mut watch = handle.clone();
        tokio::select! {
            _ = watch.terminal() => {}
            _ = tokio::time::sleep(delay) => { let _ = node.abort(room).await; }
        }
    }
    let Ok(state) = tokio::time::timeout(deadline, handle.terminal()).await else {
        return RoomOutcome::Unfinished;
    };
    if state == KvPoll::Success {
        let check = check_room(shape, room, &dst, slot, |region, offset, out| {
            memory.read(region, offset, out).is_ok()
        });
        tally.pages_verified.fetch_add(check.pages, Relaxed);
        tally.pages_corrupted.fetch_add(check.bad_pages, Relaxed);
        tally.aux_verified.fetch_add(1, Relaxed);
        tally
            .aux_corrupted
            .fetch_add(u64::from(!check.aux_ok), Relaxed);
        let good = (check.pages - check.bad_pages) * page_bytes
            + if check.aux_ok {
                u64::from(AUX_BYTES)
            } else {
                0
            };
        tally.bytes_verified.fetch_add(good, Relaxed);
    }
    // Pages go back only when the core says nothing can write them any more.
    if tokio::time::timeout(deadline, handle.releasable())
        .await
        .is_err()
    {
        return RoomOutcome::Unfinished;
    }
    write_free(memory, shape, dst.iter().copied());
    give_back(&dst);
    RoomOutcome::Ended(state)
}

/// The counters of a finished run folded into its report.
pub fn add_counters(
    report: &mut Report,
    prefill: &kvferry_core::Counters,
    decode: &kvferry_core::Counters,
) {
    report.retries = prefill.retries + decode.retries;
    report.sessions_blacklisted = prefill.sessions_blacklisted + decode.sessions_blacklisted;
    report.sessions_recovered = prefill.sessions_recovered + decode.sessions_recovered;
}

/// Faults the demo injects, reproducibly for a seed.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct DemoFaults {
    /// Probability that a write batch resets its data connection (a transient data-path
    /// failure for every operation in flight on it).
    pub fault_rate: f64,
    /// Probability that decode aborts a room mid-flight.
    pub abort_rate: f64,
    /// Seed of every decision.
    pub seed: u64,
}

/// Which data-plane backend moves the bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// TCP (every build).
    Tcp,
    /// RDMA verbs (builds with the `rdma` feature, hosts with a device).
    Rdma,
}

impl Backend {
    /// Parses `tcp` or `rdma`, and checks that this build and host can run it: an RDMA request
    /// gets a typed answer saying what is missing and offering TCP.
    pub fn parse(name: &str) -> Result<Backend, String> {
        match name {
            "tcp" => Ok(Backend::Tcp),
            "rdma" => rdma_available().map(|()| Backend::Rdma),
            other => Err(format!("unknown backend {other:?} (tcp or rdma)")),
        }
    }

    /// The node config's data plane for this backend (RDMA: `device`, or the first one, port
    /// 1).
    pub fn data_backend(self, device: Option<String>) -> kvferry_tokio::DataBackend {
        match self {
            Backend::Tcp => kvferry_tokio::DataBackend::Tcp,
            Backend::Rdma => kvferry_tokio::DataBackend::Rdma { device, port: 1 },
        }
    }
}

#[cfg(not(feature = "rdma"))]
fn rdma_available() -> Result<(), String> {
    Err("this kvferry was built without RDMA support: rebuild with `cargo build --release -p kvferry-cli --features rdma` (needs libibverbs-dev, see scripts/install-deps.sh), or run the same command with --backend tcp".to_owned())
}

#[cfg(feature = "rdma")]
fn rdma_available() -> Result<(), String> {
    match kvferry_rdma::device::Device::open(None) {
        Err(e) => Err(format!("RDMA is not available on this host: {e}")),
        Ok(_) => Ok(()),
    }
}

/// `demo --gpu`: the overlap demo with KV in GPU memory. Without the `gpu` feature: a typed
/// answer that says how to get one, never a panic.
#[cfg(not(feature = "gpu"))]
pub async fn gpu_overlap_demo(
    _batch: &overlap::Batch,
    _core: Config,
    _runtime: Runtime,
    _backend: DataBackend,
    _compute: Duration,
) -> Result<overlap::OverlapReport, String> {
    Err("this kvferry was built without GPU support: rebuild with `cargo build --release -p kvferry-cli --features gpu`, or run without --gpu".to_owned())
}

#[cfg(feature = "gpu")]
pub mod gpu_demo;
#[cfg(feature = "gpu")]
pub use gpu_demo::gpu_overlap_demo;

/// Which driver runs a node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Runtime {
    /// The tokio driver (one endpoint).
    Tokio,
    /// The thread-per-core glommio driver with this many shards.
    Glommio {
        /// Executors (one endpoint each).
        shards: usize,
        /// Pin each shard to a core of its own ([`ShardConfig::pin`]).
        pin: bool,
    },
}

impl Runtime {
    /// Parses `tokio` or `glommio` (with `shards`, pinned or not, for glommio).
    pub fn parse(name: &str, shards: usize, pin: bool) -> Result<Runtime, String> {
        match name {
            "tokio" => Ok(Runtime::Tokio),
            "glommio" => Ok(Runtime::Glommio {
                shards: shards.max(1),
                pin,
            }),
            other => Err(format!("unknown runtime {other:?} (tokio or glommio)")),
        }
    }

    /// The runtime's name.
    pub fn name(&self) -> &'static str {
        match self {
            Runtime::Tokio => "tokio",
            Runtime::Glommio { .. } => "glommio",
        }
    }

    /// Starts a node of this runtime (inside a tokio runtime for `Tokio`).
    pub fn start(&self, cfg: NodeConfig, memory: Arc<MemoryMap>) -> Result<AnyNode, NodeError> {
        self.start_with(cfg, memory, false)
    }

    /// Starts one node of a pair that shares this process (a demo or bench prefill and
    /// decode of this runtime). Both nodes' shards share the process's cores, so a shard
    /// spinning before it parks takes a core from another node's shard: such shards park at
    /// once (the 2-core scaling sweep ran 3-37 % more rooms/s so).
    pub fn start_paired(
        &self,
        cfg: NodeConfig,
        memory: Arc<MemoryMap>,
    ) -> Result<AnyNode, NodeError> {
        self.start_with(cfg, memory, true)
    }

    fn start_with(
        &self,
        cfg: NodeConfig,
        memory: Arc<MemoryMap>,
        paired: bool,
    ) -> Result<AnyNode, NodeError> {
        Ok(match *self {
            Runtime::Tokio => AnyNode::Tokio(Node::start(cfg, memory)?),
            Runtime::Glommio { shards, pin } => {
                let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
                let mut config = ShardConfig {
                    shards,
                    pin,
                    ..ShardConfig::default()
                };
                if paired || shards > cores {
                    config.spin_before_park = std::time::Duration::ZERO;
                }
                AnyNode::Glommio(GlommioNode::start(cfg, memory, config)?)
            }
        })
    }
}

/// A node of either driver behind one type (the CLI and the tests pick the runtime at run
/// time).
#[derive(Clone, Debug)]
pub enum AnyNode {
    /// A tokio node.
    Tokio(Node),
    /// A glommio node.
    Glommio(GlommioNode),
}

macro_rules! both {
    ($self:ident, $n:ident => $e:expr) => {
        match $self {
            AnyNode::Tokio($n) => $e,
            AnyNode::Glommio($n) => $e,
        }
    };
}

impl KvNode for AnyNode {
    fn runtime(&self) -> &'static str {
        both!(self, n => n.runtime())
    }

    fn backend(&self) -> &'static str {
        both!(self, n => n.backend())
    }

    fn memory(&self) -> &Arc<MemoryMap> {
        both!(self, n => KvNode::memory(n))
    }

    fn shards(&self) -> usize {
        both!(self, n => n.shards())
    }

    async fn listen(&self, addr: SocketAddr) -> Result<Vec<SocketAddr>, NodeError> {
        both!(self, n => KvNode::listen(n, addr).await)
    }

    async fn connect(&self, addrs: Vec<SocketAddr>) -> Result<PeerId, NodeError> {
        both!(self, n => KvNode::connect(n, addrs).await)
    }

    async fn connect_persistent(&self, addrs: Vec<SocketAddr>) -> Result<PeerId, NodeError> {
        both!(self, n => KvNode::connect_persistent(n, addrs).await)
    }

    async fn open_receiver(
        &self,
        room: RoomId,
        generation: Generation,
        peers: Vec<PeerId>,
        grant: Option<Grant>,
    ) -> Result<RoomHandle, NodeError> {
        both!(self, n => KvNode::open_receiver(n, room, generation, peers, grant).await)
    }

    async fn grant_pages(&self, room: RoomId, grant: Grant) -> Result<(), NodeError> {
        both!(self, n => KvNode::grant_pages(n, room, grant).await)
    }

    async fn open_sender(
        &self,
        room: RoomId,
        generation: Generation,
    ) -> Result<RoomHandle, NodeError> {
        both!(self, n => KvNode::open_sender(n, room, generation).await)
    }

    async fn send_chunk(&self, room: RoomId, chunk: Chunk) -> Result<(), NodeError> {
        both!(self, n => KvNode::send_chunk(n, room, chunk).await)
    }

    async fn mark_layer_ready(&self, rooms: Vec<RoomId>, layer: u16) -> Result<(), NodeError> {
        both!(self, n => KvNode::mark_layer_ready(n, rooms, layer).await)
    }

    async fn set_capacity(&self, capacity: kvferry_core::Capacity) {
        both!(self, n => KvNode::set_capacity(n, capacity).await)
    }

    async fn set_queue_position(&self, room: RoomId, position: u32) -> Result<(), NodeError> {
        both!(self, n => KvNode::set_queue_position(n, room, position).await)
    }

    async fn set_faults(&self, faults: Option<kvferry_tokio::FaultPlan>) {
        both!(self, n => KvNode::set_faults(n, faults).await)
    }

    async fn abort(&self, room: RoomId) -> Result<(), NodeError> {
        both!(self, n => KvNode::abort(n, room).await)
    }

    async fn counters(&self) -> Counters {
        both!(self, n => KvNode::counters(n).await)
    }

    async fn data_paths(&self) -> Vec<(usize, kvferry_core::SessionId, kvferry_tokio::DataPath)> {
        both!(self, n => KvNode::data_paths(n).await)
    }

    fn room_announcements(&self) -> tokio::sync::mpsc::UnboundedReceiver<Announcement> {
        both!(self, n => KvNode::room_announcements(n))
    }

    async fn reach(&self, peer: PeerId) -> Result<(), NodeError> {
        both!(self, n => KvNode::reach(n, peer).await)
    }

    async fn unreachable(&self, peer: PeerId) -> Result<Option<FailureReason>, NodeError> {
        both!(self, n => KvNode::unreachable(n, peer).await)
    }

    async fn shutdown(&self) {
        both!(self, n => KvNode::shutdown(n).await)
    }
}

/// The runtime label of a pair: one name, or `prefill/decode` when they differ.
pub fn runtime_label(prefill: &str, decode: &str) -> String {
    if prefill == decode {
        prefill.to_owned()
    } else {
        format!("{prefill}/{decode}")
    }
}

/// The distinct data paths of `node`'s sessions, joined by `+` (`none` without a session).
pub async fn path_label<N: KvNode>(node: &N) -> String {
    let mut labels: Vec<&str> = node
        .data_paths()
        .await
        .into_iter()
        .map(|(_, _, path)| path.as_str())
        .collect();
    labels.sort_unstable();
    labels.dedup();
    if labels.is_empty() {
        "none".to_owned()
    } else {
        labels.join("+")
    }
}

/// Moves `run.rooms` rooms from `prefill` to `decode` (both started, on loopback) and reports.
pub async fn run_pair<P: KvNode, D: KvNode>(
    prefill: &P,
    decode: &D,
    run: DecodeRun,
) -> Result<Report, NodeError> {
    let addrs = prefill
        .listen("127.0.0.1:0".parse().map_err(|_| NodeError::ShutDown)?)
        .await?;
    let server = tokio::spawn(serve_prefill(prefill.clone(), run.shape.clone()));
    let peer = decode.connect(addrs).await?;
    let mut report = run_decode(decode, peer, run).await;
    report.runtime = runtime_label(prefill.runtime(), decode.runtime());
    report.backend = decode.backend().to_owned();
    report.prefill_path = path_label(prefill).await;
    report.decode_path = path_label(decode).await;
    add_counters(
        &mut report,
        &prefill.counters().await,
        &decode.counters().await,
    );
    decode.shutdown().await;
    prefill.shutdown().await;
    server.abort();
    Ok(report)
}

/// How the demo's two nodes are linked: the data plane, and TLS or not.
#[derive(Clone, Debug, Default)]
pub struct DemoLink {
    /// TCP data connections or RDMA.
    pub backend: kvferry_tokio::DataBackend,
    /// TLS on every connection (tokio runtime).
    pub tls: Option<kvferry_tcp::TlsFiles>,
}

impl From<kvferry_tokio::DataBackend> for DemoLink {
    fn from(backend: kvferry_tokio::DataBackend) -> Self {
        DemoLink { backend, tls: None }
    }
}

/// Runs prefill and decode in this process on loopback and moves `rooms` rooms end to end.
pub async fn run_demo(
    shape: Shape,
    core: Config,
    rooms: u64,
    faults: DemoFaults,
    progress: Option<Progress>,
    runtime: Runtime,
    link: DemoLink,
) -> Result<Report, NodeError> {
    let DemoLink { backend, tls } = link;
    let token = b"kvferry-demo".to_vec();
    let mut prefill_cfg = node_config(Role::Prefill, &shape, core.clone(), &token, 1);
    let mut decode_cfg = node_config(Role::Decode, &shape, core, &token, 2);
    prefill_cfg.backend = backend.clone();
    decode_cfg.backend = backend;
    prefill_cfg.tls = tls.clone();
    decode_cfg.tls = tls;
    if faults.fault_rate > 0.0 {
        // Decode injects on the TCP receive path; prefill on the RDMA post path, which decode
        // never sees.
        decode_cfg.faults = Some(kvferry_tokio::FaultPlan {
            rate: faults.fault_rate,
            seed: faults.seed,
            kind: kvferry_tokio::FaultKind::Break,
        });
        prefill_cfg.faults = decode_cfg.faults;
    }
    let layout = shape.layout();
    let prefill = runtime.start_paired(prefill_cfg, Arc::new(MemoryMap::allocate(layout)))?;
    let decode = runtime.start_paired(decode_cfg, Arc::new(MemoryMap::allocate(layout)))?;
    let run = DecodeRun {
        rooms,
        shape,
        first_room: 1,
        progress,
        deadline: Duration::from_secs(600),
        abort_rate: faults.abort_rate,
        seed: faults.seed,
    };
    run_pair(&prefill, &decode, run).await
}

#[cfg(test)]
mod backend_tests {
    use super::Backend;

    #[test]
    fn tcp_is_always_available() {
        assert_eq!(Backend::parse("tcp"), Ok(Backend::Tcp));
    }

    #[test]
    fn rdma_without_a_build_or_a_device_is_a_typed_refusal_that_offers_tcp() {
        // With the default build: not built in. With `rdma` on a host without a device (CI):
        // no kernel support or no device. Either way the answer says how to run over TCP.
        match Backend::parse("rdma") {
            Ok(b) => eprintln!("RDMA usable here: {b:?}"),
            Err(why) => assert!(why.contains("--backend tcp"), "{why}"),
        }
        assert!(Backend::parse("carrier-pigeon").is_err());
    }
}

#[cfg(test)]
mod protocol_doc {
    use super::*;

    /// The page pattern, computed as `docs/PROTOCOL.md` spells it out for an independent
    /// decode, is the one the CLI's prefill writes.
    #[test]
    fn the_page_pattern_is_the_one_the_protocol_doc_spells_out() {
        let doc = include_str!("../../docs/PROTOCOL.md");
        for constant in [
            "0x6b76000000000000",
            "0x9E3779B97F4A7C15",
            "0xBF58476D1CE4E5B9",
            "0x94D049BB133111EB",
        ] {
            assert!(doc.contains(constant), "{constant}");
        }
        let splitmix = |mut z: u64| {
            z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        let (room, l, p, i) = (RoomId(0xABCD_0001), 5u16, 1u8, 17u32);
        let mut page = vec![0u8; 64];
        fill_pattern(&mut page, room, l, p, i);
        let place = (u64::from(l) << 40) | (u64::from(p) << 32) | u64::from(i);
        for (k, w) in page.chunks_exact(8).enumerate() {
            let want = match k {
                0 => room.0,
                1 => place ^ 0x6b76_0000_0000_0000,
                _ => {
                    splitmix(splitmix(room.0) ^ place)
                        ^ (k as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
                }
            };
            assert_eq!(u64::from_le_bytes(w.try_into().unwrap()), want, "word {k}");
        }
        assert_eq!(&aux_row(room)[..8], &room.0.to_le_bytes());
    }
}
