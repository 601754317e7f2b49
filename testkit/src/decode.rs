//! The decode half: opens rooms, grants pages, checks every byte that landed.

use crate::{
    all_words, check_room, kv_regions, mix, write_free, Pool, Report, Shape, AUX_BYTES, FREE_WORD,
};
use kvferry_core::{Grant, KvPoll, Region, RoomId};
use kvferry_memory::MemoryMap;
use kvferry_tokio::{Node, NodeError, PeerId};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tracing::warn;

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
pub(crate) fn abort_plan(rate: f64, seed: u64, room: RoomId) -> Option<Duration> {
    let z = mix(seed ^ room.0.wrapping_mul(0xD6E8_FEB8_6659_FD93));
    ((z >> 11) as f64 / (1u64 << 53) as f64 <= rate && rate > 0.0)
        .then(|| Duration::from_micros(z % 3000))
}

pub(crate) struct Pages {
    pool: Pool,
    slots: Pool,
}

/// Requests `run.rooms` rooms from the prefill `peer`, verifies every page of every
/// successful room, checks free pages before reuse, and reports. A persistent peer
/// ([`Node::connect_persistent`]) that is away is waited for up to the room deadline, so
/// rooms keep flowing across a prefill restart.
pub async fn run_decode(node: &Node, peer: PeerId, run: DecodeRun) -> Report {
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
            let (outcome, ended) = decode_room(
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
            // A room's latency runs to its end (Success: the KV is usable), not to its pages'
            // release, which may wait for the source's word.
            (outcome, ended.unwrap_or_else(Instant::now) - t0)
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
pub(crate) struct PageBook {
    pages: Mutex<Pages>,
    freed: tokio::sync::Notify,
}

/// What the decode run checked, shared by its room tasks.
#[derive(Default)]
pub(crate) struct Tally {
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
pub(crate) enum RoomOutcome {
    /// The core's terminal state (or the last state seen).
    Ended(KvPoll),
    /// The node refused to open the room; the embedder-API error, in snake_case, and
    /// whether the refusal was the node being shut down.
    Refused(String, bool),
    /// No terminal state within the run's deadline.
    Unfinished,
}

/// The variant name of an error, in snake_case (`RoomExists(..)` -> `room_exists`).
pub(crate) fn error_kind(e: &NodeError) -> String {
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
pub(crate) async fn decode_room(
    node: &Node,
    peer: PeerId,
    shape: &Shape,
    room: RoomId,
    book: &PageBook,
    memory: &MemoryMap,
    tally: &Tally,
    deadline: Duration,
    abort_after: Option<Duration>,
) -> (RoomOutcome, Option<Instant>) {
    use std::sync::atomic::Ordering::Relaxed;
    let page_bytes = u64::from(shape.page_bytes);
    // Pages come back only on Releasable, so with `concurrency` rooms they always suffice.
    let (dst, slot) = loop {
        // Registered before the check: a release between the two still wakes it.
        let freed = book.freed.notified();
        let got = {
            let Ok(mut p) = book.pages.lock() else {
                return (RoomOutcome::Unfinished, None);
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
        skip_pages: shape.prefix_pages,
        idle_sources: 0,
        prompt: None,
    };
    // A persistent peer that is away is waited for by the core, up to its unreachable window.
    let mut handle = match node.open_receiver(room, 0, vec![peer], Some(grant)).await {
        Ok(h) => h,
        Err(e) => {
            warn!(%room, error = %e, "room could not be opened");
            give_back(&dst);
            let shut_down = matches!(e, NodeError::ShutDown);
            return (RoomOutcome::Refused(error_kind(&e), shut_down), None);
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
        return (RoomOutcome::Unfinished, None);
    };
    let ended = Instant::now();
    if state == KvPoll::Success {
        let check = check_room(
            shape,
            room,
            shape.prefix_pages,
            &dst,
            slot,
            |region, offset, out| memory.read(region, offset, out).is_ok(),
        );
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
        return (RoomOutcome::Unfinished, Some(ended));
    }
    write_free(memory, shape, dst.iter().copied());
    give_back(&dst);
    (RoomOutcome::Ended(state), Some(ended))
}
