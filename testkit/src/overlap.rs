//! The overlap demo: one batch of rooms whose forward pass runs layer by layer, moved either
//! layer by layer (each layer leaves once its compute finished and its KV is staged in the
//! registered memory) or as one whole batch after the last layer, timed per layer onto a
//! [`Timeline`] and checked byte for byte on decode.
//!
//! The forward pass is a parameter: on the host it fills the layer's pages and waits out the
//! per-layer compute time; with `--gpu` it is a CUDA kernel per layer whose completion and
//! staging copy are CUDA events (see `gpu_demo`). Everything here is the same for both, so
//! the pipeline the GPU run relies on is the one CI exercises.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use kvferry_core::{Chunk, Grant, KvPoll, Region, Role, RoomId};
use kvferry_gpu::{LayerTimes, Span, Timeline};
use kvferry_memory::MemoryMap;
use kvferry_tokio::{Node, PeerId, RoomHandle};
use tokio::sync::mpsc;

use crate::{aux_row, check_room, fill_room_layer, write_free, Shape, AUX_BYTES};

/// One batch of rooms that go through the forward pass together.
#[derive(Clone, Debug)]
pub struct Batch {
    /// The model shape (layers, planes, page size, pages per room).
    pub shape: Shape,
    /// Rooms in the batch.
    pub rooms: u32,
    /// The first room's id (distinct runs use distinct ranges, so stale bytes never verify).
    pub first_room: u64,
}

impl Batch {
    /// The room at `index` of the batch.
    pub fn room(&self, index: u32) -> RoomId {
        RoomId(self.first_room + u64::from(index))
    }

    /// The pages of the room at `index`: the batch's rooms sit side by side, so one layer of
    /// the whole batch is one contiguous range per plane (one copy per plane when staging).
    pub fn pages(&self, index: u32) -> Vec<u32> {
        let n = self.shape.pages_per_room;
        (index * n..(index + 1) * n).collect()
    }

    /// Bytes of one layer of the whole batch (every plane).
    pub fn layer_bytes(&self) -> u64 {
        u64::from(self.shape.planes)
            * u64::from(self.rooms)
            * u64::from(self.shape.pages_per_room)
            * u64::from(self.shape.page_bytes)
    }

    /// The memory layout both nodes register: the batch plus the shape's slack.
    pub fn shape_for_layout(&self) -> Shape {
        Shape {
            concurrency: self.rooms as usize,
            ..self.shape.clone()
        }
    }
}

/// What the forward pass tells the pipeline about a layer.
#[derive(Debug)]
pub enum LayerSignal {
    /// The layer's compute finished.
    Computed {
        /// The layer.
        layer: u16,
        /// When the finish was seen.
        at: Instant,
    },
    /// The layer's KV of every room sits in the registered source memory: it may be sent.
    Staged {
        /// The layer.
        layer: u16,
        /// When the staging was seen complete.
        at: Instant,
    },
    /// The forward pass or a staging copy failed: the batch's rooms are aborted.
    Failed(String),
}

/// When each step of one batch happened.
#[derive(Clone, Debug)]
pub struct BatchTimes {
    /// The forward pass started.
    pub started: Instant,
    /// Per layer: its compute finished.
    pub computed: Vec<Option<Instant>>,
    /// Per layer: its KV was staged.
    pub staged: Vec<Option<Instant>>,
    /// Per layer: every room's copy of it was acknowledged by decode.
    pub delivered: Vec<Option<Instant>>,
    /// Per room: decode saw it succeed.
    pub landed: Vec<Option<Instant>>,
    /// Rooms that did not succeed, with their state.
    pub failed: Vec<(RoomId, KvPoll)>,
}

impl BatchTimes {
    /// The timeline of this batch; `held` is when decode had every room where it computes
    /// from (later than the transfers when it copies them into GPU memory).
    pub fn timeline(&self, label: &str, layerwise: bool, held: Option<Instant>) -> Timeline {
        let rel = |t: Option<Instant>| t.map_or(Duration::ZERO, |t| t - self.started);
        let mut layers = Vec::new();
        let mut previous = Duration::ZERO;
        for (l, &c) in self.computed.iter().enumerate() {
            let computed = rel(c);
            layers.push(LayerTimes {
                layer: l as u16,
                compute: Span {
                    start: previous,
                    end: computed,
                },
                // A layer's transfer runs from its compute's end (staging included) to decode
                // holding it; not clamped, so a layer delivered before it was computed shows.
                transfer: layerwise.then(|| Span {
                    start: computed,
                    end: rel(self.delivered.get(l).copied().flatten()),
                }),
            });
            previous = computed;
        }
        let batch = (!layerwise).then(|| Span {
            start: previous,
            end: self
                .delivered
                .iter()
                .map(|&d| rel(d))
                .max()
                .unwrap_or_default()
                .max(previous),
        });
        Timeline {
            label: label.to_owned(),
            layers,
            batch,
            held: held.map(|h| h - self.started),
            layer_transfer: None,
        }
    }
}

/// Fills decode's pages with the free pattern, so that only bytes this batch delivered verify.
pub fn clear_destination(memory: &MemoryMap, batch: &Batch) {
    write_free(
        memory,
        &batch.shape,
        0..batch.rooms * batch.shape.pages_per_room,
    );
}

/// Writes the pattern of `layer` of every room of the batch into the source memory: what a
/// host forward pass produces, and what the GPU kernel must produce too.
pub fn fill_layer(memory: &MemoryMap, batch: &Batch, layer: u16) {
    let mut page = vec![0u8; batch.shape.page_bytes as usize];
    for i in 0..batch.rooms {
        let pages = batch.pages(i);
        fill_room_layer(
            memory,
            &batch.shape,
            batch.room(i),
            layer,
            &pages,
            &mut page,
        );
    }
}

/// Checks every page and aux row of every room that succeeded, reading through `read`
/// (`(region, offset, out)`): decode's host memory, or a copy back from GPU memory.
/// Returns (pages verified, pages and aux rows corrupted).
pub fn verify(
    batch: &Batch,
    succeeded: &[bool],
    mut read: impl FnMut(Region, u64, &mut [u8]) -> bool,
) -> (u64, u64) {
    let (mut ok, mut bad) = (0, 0);
    for i in 0..batch.rooms {
        if !succeeded[i as usize] {
            continue;
        }
        let check = check_room(
            &batch.shape,
            batch.room(i),
            0,
            &batch.pages(i),
            i,
            &mut read,
        );
        ok += check.pages - check.bad_pages;
        bad += check.bad_pages + u64::from(!check.aux_ok);
    }
    (ok, bad)
}

/// A host forward pass: layer L fills its pages of every room, then waits until L+1 compute
/// times have passed since the start (deadlines from the start, so sleeps do not drift). The
/// registered memory is where the pattern is written, so a layer is staged when computed.
pub fn host_forward(
    memory: Arc<MemoryMap>,
    batch: Batch,
    compute: Duration,
) -> mpsc::UnboundedReceiver<LayerSignal> {
    let (tx, rx) = mpsc::unbounded_channel();
    std::thread::spawn(move || {
        let start = Instant::now();
        for layer in 0..batch.shape.layers {
            fill_layer(&memory, &batch, layer);
            let due = start + compute * (u32::from(layer) + 1);
            std::thread::sleep(due.saturating_duration_since(Instant::now()));
            let at = Instant::now();
            if tx.send(LayerSignal::Computed { layer, at }).is_err()
                || tx.send(LayerSignal::Staged { layer, at }).is_err()
            {
                return;
            }
        }
    });
    rx
}

/// How a batch moves.
#[derive(Clone, Copy, Debug)]
pub struct BatchMode {
    /// Layer by layer as each is staged, or everything after the last layer.
    pub layerwise: bool,
    /// Longest wait for a layer signal, and for each room to finish.
    pub deadline: Duration,
}

/// Follows the forward pass's layer signals until every layer is staged, marking each
/// staged layer ready on every room when `layerwise`: when each layer was computed and
/// staged, and why the pass stopped short (it failed, ended early, or fell silent past
/// `deadline`), if it did.
async fn follow_forward(
    prefill: &Node,
    rooms: &[RoomId],
    layerwise: bool,
    deadline: Duration,
    signals: &mut mpsc::UnboundedReceiver<LayerSignal>,
    layers: usize,
) -> Result<(Vec<Option<Instant>>, Vec<Option<Instant>>, Option<String>), String> {
    let mut computed = vec![None; layers];
    let mut staged = vec![None; layers];
    let mut failure = None;
    let mut staged_count = 0;
    while staged_count < layers {
        let signal = tokio::time::timeout(deadline, signals.recv()).await;
        match signal {
            Ok(Some(LayerSignal::Computed { layer, at })) => {
                if let Some(c) = computed.get_mut(usize::from(layer)) {
                    *c = Some(at);
                }
            }
            Ok(Some(LayerSignal::Staged { layer, at })) => {
                let Some(s) = staged.get_mut(usize::from(layer)) else {
                    continue;
                };
                *s = Some(at);
                staged_count += 1;
                if layerwise {
                    prefill
                        .mark_layer_ready(rooms.to_vec(), layer)
                        .await
                        .map_err(|e| format!("mark_layer_ready: {e}"))?;
                }
            }
            Ok(Some(LayerSignal::Failed(e))) => {
                failure = Some(e);
                break;
            }
            Ok(None) => {
                failure = Some("the forward pass stopped before its last layer".to_owned());
                break;
            }
            Err(_) => {
                failure = Some(format!("no layer signal for {deadline:?}"));
                break;
            }
        }
    }
    Ok((computed, staged, failure))
}

/// Opens every room of `batch` on both sides: the decode's with their grants, the prefill's
/// with each room's aux row written first. Returns the decode's handles, then the prefill's.
async fn open_batch(
    prefill: &Node,
    decode: &Node,
    peer: PeerId,
    batch: &Batch,
) -> Result<(Vec<RoomHandle>, Vec<RoomHandle>), String> {
    let n = batch.rooms as usize;
    let mut receivers = Vec::with_capacity(n);
    for i in 0..batch.rooms {
        let grant = Grant {
            extras: Vec::new(),
            pages: batch.pages(i),
            aux_slot: Some(i),
            state_slot: None,
            receivers: 1,
            skip_pages: 0,
            idle_sources: 0,
            prompt: None,
        };
        let h = decode
            .open_receiver(batch.room(i), 0, vec![peer], Some(grant))
            .await
            .map_err(|e| format!("decode could not open {}: {e}", batch.room(i)))?;
        receivers.push(h);
    }
    let source = prefill.memory().clone();
    let mut senders = Vec::with_capacity(n);
    for i in 0..batch.rooms {
        let room = batch.room(i);
        let _ = source.write(
            Region::Aux,
            u64::from(i) * u64::from(AUX_BYTES),
            &aux_row(room),
        );
        let h = prefill
            .open_sender(room, 0, None)
            .await
            .map_err(|e| format!("prefill could not open {room}: {e}"))?;
        senders.push(h);
    }
    Ok((receivers, senders))
}

/// Runs one batch from `prefill` to `decode` (connected as `peer`): opens every room on both
/// sides, starts the forward pass, and sends each layer as it is staged (`layerwise`) or
/// everything after the last layer. `landed` hears each room's index as decode sees it
/// succeed. Rooms not finished within `deadline` are aborted and reported failed.
pub async fn run_batch(
    prefill: &Node,
    decode: &Node,
    peer: PeerId,
    batch: &Batch,
    mode: BatchMode,
    forward: impl FnOnce() -> mpsc::UnboundedReceiver<LayerSignal>,
    landed: Option<mpsc::UnboundedSender<u32>>,
) -> Result<BatchTimes, String> {
    let BatchMode {
        layerwise,
        deadline,
    } = mode;
    let layers = usize::from(batch.shape.layers);
    let n = batch.rooms as usize;
    let rooms: Vec<RoomId> = (0..batch.rooms).map(|i| batch.room(i)).collect();
    let (receivers, senders) = open_batch(prefill, decode, peer, batch).await?;
    let chunk = |i: u32, layerwise: bool| Chunk {
        extras: Vec::new(),
        pages: batch.pages(i),
        last: true,
        aux_slot: Some(i),
        state_slot: None,
        layerwise,
    };
    if layerwise {
        for i in 0..batch.rooms {
            prefill
                .send_chunk(batch.room(i), chunk(i, true))
                .await
                .map_err(|e| format!("send_chunk: {e}"))?;
        }
    }
    // A layer counts as delivered when the last room's copy of it is acknowledged.
    let delivered = Arc::new(Mutex::new(vec![None::<Instant>; layers]));
    let mut watchers = Vec::new();
    for mut h in senders {
        let delivered = delivered.clone();
        watchers.push(tokio::spawn(async move {
            for l in 0..layers {
                if h.layer_delivered(l as u16).await.is_err() {
                    return;
                }
                let now = Instant::now();
                if let Ok(mut d) = delivered.lock() {
                    d[l] = Some(d[l].map_or(now, |t: Instant| t.max(now)));
                }
            }
        }));
    }
    let mut decoders = Vec::new();
    for (i, mut h) in receivers.into_iter().enumerate() {
        let landed = landed.clone();
        decoders.push(tokio::spawn(async move {
            let state = tokio::time::timeout(deadline, h.terminal()).await;
            let at = Instant::now();
            if state == Ok(KvPoll::Success) {
                if let Some(tx) = landed {
                    let _ = tx.send(i as u32);
                }
            }
            (state, at)
        }));
    }
    drop(landed);

    let started = Instant::now();
    let mut signals = forward();
    let (computed, staged, failure) =
        follow_forward(prefill, &rooms, layerwise, deadline, &mut signals, layers).await?;
    if let Some(e) = failure {
        for &room in &rooms {
            let _ = decode.abort(room).await;
        }
        return Err(e);
    }
    if !layerwise {
        for i in 0..batch.rooms {
            prefill
                .send_chunk(batch.room(i), chunk(i, false))
                .await
                .map_err(|e| format!("send_chunk: {e}"))?;
        }
    }
    let mut times = BatchTimes {
        started,
        computed,
        staged,
        delivered: Vec::new(),
        landed: vec![None; n],
        failed: Vec::new(),
    };
    for (i, d) in decoders.into_iter().enumerate() {
        match d.await {
            Ok((Ok(KvPoll::Success), at)) => times.landed[i] = Some(at),
            Ok((Ok(state), _)) => times.failed.push((rooms[i], state)),
            Ok((Err(_), _)) | Err(_) => {
                let _ = decode.abort(rooms[i]).await;
                times.failed.push((rooms[i], KvPoll::Transferring));
            }
        }
    }
    for w in watchers {
        let _ = tokio::time::timeout(Duration::from_secs(1), w).await;
    }
    times.delivered = delivered.lock().map(|d| d.clone()).unwrap_or_default();
    Ok(times)
}

/// One mode of the overlap demo, measured.
#[derive(Clone, Debug)]
pub struct OverlapRun {
    /// The run's timeline (its label says the mode).
    pub timeline: Timeline,
    /// Pages that arrived intact.
    pub pages_verified: u64,
    /// Pages (or aux rows) that did not.
    pub pages_corrupted: u64,
    /// Rooms that did not succeed.
    pub rooms_failed: u64,
}

/// The overlap demo's report: both modes on the same batch shape.
#[derive(Clone, Debug)]
pub struct OverlapReport {
    /// Where the KV lived (`host`, or the GPU's name).
    pub memory: String,
    /// The runtime of the nodes.
    pub runtime: String,
    /// The data plane (`tcp`, `rdma`).
    pub backend: String,
    /// Layers of the model.
    pub layers: u16,
    /// Rooms in the batch.
    pub rooms: u32,
    /// Bytes of one layer of the batch.
    pub layer_bytes: u64,
    /// Host <-> device staging bandwidth in GB/s (device to host, host to device), GPU only.
    pub staging_gbps: Option<(f64, f64)>,
    /// Layerwise first, then whole batch.
    pub runs: Vec<OverlapRun>,
}

/// Gives every run the same one-layer transfer for its ideal: the whole-batch run's transfer
/// divided by the layers (the link carried nothing else then).
pub fn share_layer_transfer(runs: &mut [OverlapRun]) {
    let one = runs
        .iter()
        .find(|r| r.timeline.batch.is_some())
        .map(|r| r.timeline.one_layer_transfer());
    for r in runs {
        r.timeline.layer_transfer = one;
    }
}

impl OverlapReport {
    /// Layerwise completion over whole-batch completion (below 1: layerwise finished first).
    pub fn layerwise_vs_batch(&self) -> Option<f64> {
        let [a, b] = self.runs.as_slice() else {
            return None;
        };
        let b = b.timeline.complete_at().as_secs_f64();
        (b > 0.0).then(|| a.timeline.complete_at().as_secs_f64() / b)
    }

    /// The report as text.
    pub fn text(&self) -> String {
        use std::fmt::Write;
        let mut s = String::new();
        let _ = writeln!(
            s,
            "overlap demo: {} rooms x {} layers, {:.1} MiB per layer, KV in {} memory, runtime {}, backend {}",
            self.rooms,
            self.layers,
            self.layer_bytes as f64 / (1u64 << 20) as f64,
            self.memory,
            self.runtime,
            self.backend
        );
        if let Some((d2h, h2d)) = self.staging_gbps {
            let _ = writeln!(
                s,
                "staging through pinned host memory: device->host {d2h:.2} GB/s, host->device {h2d:.2} GB/s"
            );
        }
        if let Some(t) = self.runs.first().map(|r| &r.timeline) {
            let (c, x) = (t.compute_per_layer(), t.one_layer_transfer());
            let _ = writeln!(
                s,
                "per layer: compute {:.2} ms, transfer {:.2} ms alone ({}; ideal = {} x compute + one layer's transfer)",
                c.as_secs_f64() * 1e3,
                x.as_secs_f64() * 1e3,
                if c >= x {
                    "compute-bound: layerwise can hide the transfer"
                } else {
                    "transfer-bound: no schedule reaches the ideal"
                },
                self.layers
            );
        }
        for r in &self.runs {
            let t = &r.timeline;
            let _ = writeln!(
                s,
                "{:<12} decode holds the whole KV at {:>9.2} ms (ideal {:.2} ms, {:.3}x ideal); pages {} verified, {} corrupted; {} rooms failed",
                t.label,
                t.complete_at().as_secs_f64() * 1e3,
                t.ideal().as_secs_f64() * 1e3,
                t.vs_ideal(),
                r.pages_verified,
                r.pages_corrupted,
                r.rooms_failed
            );
        }
        if let Some(x) = self.layerwise_vs_batch() {
            let _ = writeln!(s, "layerwise / whole batch: {x:.3}");
        }
        s
    }

    /// The report as JSON.
    pub fn json(&self) -> serde_json::Value {
        let runs: Vec<serde_json::Value> = self
            .runs
            .iter()
            .map(|r| {
                let t = &r.timeline;
                serde_json::json!({
                    "mode": t.label,
                    "complete_ms": t.complete_at().as_secs_f64() * 1e3,
                    "ideal_ms": t.ideal().as_secs_f64() * 1e3,
                    "vs_ideal": t.vs_ideal(),
                    "compute_ms": t.layers.iter().map(|l| l.compute.len().as_secs_f64() * 1e3).collect::<Vec<_>>(),
                    "transfer_ms": t.layers.iter().map(|l| l.transfer.map(|x| x.len().as_secs_f64() * 1e3)).collect::<Vec<_>>(),
                    "pages_verified": r.pages_verified,
                    "pages_corrupted": r.pages_corrupted,
                    "rooms_failed": r.rooms_failed,
                })
            })
            .collect();
        serde_json::json!({
            "memory": self.memory,
            "runtime": self.runtime,
            "backend": self.backend,
            "layers": self.layers,
            "rooms": self.rooms,
            "layer_bytes": self.layer_bytes,
            "staging_gbps": self.staging_gbps.map(|(a, b)| serde_json::json!({"device_to_host": a, "host_to_device": b})),
            "layerwise_vs_batch": self.layerwise_vs_batch(),
            "compute_per_layer_ms": self.runs.first().map(|r| r.timeline.compute_per_layer().as_secs_f64() * 1e3),
            "one_layer_transfer_ms": self.runs.first().map(|r| r.timeline.one_layer_transfer().as_secs_f64() * 1e3),
            "runs": runs,
        })
    }

    /// Whether every page of every room arrived intact.
    pub fn clean(&self) -> bool {
        self.runs
            .iter()
            .all(|r| r.pages_corrupted == 0 && r.rooms_failed == 0)
    }
}

/// Listens on loopback with `prefill` and connects `decode` to it.
pub async fn connect_loopback(prefill: &Node, decode: &Node) -> Result<PeerId, String> {
    let addrs = prefill
        .listen(([127, 0, 0, 1], 0).into())
        .await
        .map_err(|e| e.to_string())?;
    decode.connect(addrs).await.map_err(|e| e.to_string())
}

/// The overlap demo's two runs of `batch`: layerwise, then whole batch, on distinct room ids
/// (so bytes left from the first run never verify in the second).
pub fn both_modes(batch: &Batch) -> [(bool, Batch); 2] {
    [true, false].map(|layerwise| {
        let k = u64::from(!layerwise);
        (
            layerwise,
            Batch {
                first_room: batch.first_room + k * u64::from(batch.rooms),
                ..batch.clone()
            },
        )
    })
}

/// The host overlap demo: both nodes in this process on loopback, the forward pass on the
/// host taking `compute` per layer; runs the batch layerwise, then as a whole batch.
pub async fn run_host_overlap(
    prefill: &Node,
    decode: &Node,
    batch: &Batch,
    compute: Duration,
) -> Result<OverlapReport, String> {
    let peer = connect_loopback(prefill, decode).await?;
    let mut runs = Vec::new();
    for (layerwise, batch) in both_modes(batch) {
        clear_destination(decode.memory(), &batch);
        let memory = prefill.memory().clone();
        let b = batch.clone();
        let times = run_batch(
            prefill,
            decode,
            peer,
            &batch,
            BatchMode {
                layerwise,
                deadline: Duration::from_secs(60),
            },
            move || host_forward(memory, b, compute),
            None,
        )
        .await?;
        let held = times.landed.iter().flatten().max().copied();
        let succeeded: Vec<bool> = times.landed.iter().map(Option::is_some).collect();
        let target = decode.memory().clone();
        let (ok, bad) = verify(&batch, &succeeded, |region, offset, out| {
            target.read(region, offset, out).is_ok()
        });
        let label = if layerwise {
            "layerwise"
        } else {
            "whole batch"
        };
        runs.push(OverlapRun {
            timeline: times.timeline(label, layerwise, held),
            pages_verified: ok,
            pages_corrupted: bad,
            rooms_failed: times.failed.len() as u64,
        });
    }
    share_layer_transfer(&mut runs);
    Ok(OverlapReport {
        memory: "host".to_owned(),
        runtime: crate::runtime_label(prefill.runtime(), decode.runtime()),
        backend: decode.backend().to_owned(),
        layers: batch.shape.layers,
        rooms: batch.rooms,
        layer_bytes: batch.layer_bytes(),
        staging_gbps: None,
        runs,
    })
}

/// Starts a prefill and a decode node on `runtime` with host memory and runs the host overlap
/// demo between them.
pub async fn run_overlap_demo(
    batch: &Batch,
    core: kvferry_core::Config,
    runtime: crate::Runtime,
    backend: crate::DataBackend,
    compute: Duration,
) -> Result<OverlapReport, String> {
    let token = kvferry_core::auth::DEMO_TOKEN.to_vec();
    let shape = batch.shape_for_layout();
    let layout = shape.layout();
    let start = |role: Role, seed: u64| {
        let mut cfg = crate::node_config(role, &shape, core.clone(), &token, seed);
        cfg.backend = backend.clone();
        runtime
            .start_paired(cfg, Arc::new(MemoryMap::allocate(layout)))
            .map_err(|e| e.to_string())
    };
    let prefill = start(Role::Prefill, 1)?;
    let decode = start(Role::Decode, 2)?;
    let report = run_host_overlap(&prefill, &decode, batch, compute).await;
    decode.shutdown().await;
    prefill.shutdown().await;
    report
}
