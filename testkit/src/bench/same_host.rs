//! `bench --backend same-host`: one room at a time between a prefill and a decode of this
//! process (so of one host) over the same-host path and over loopback TCP, against a
//! single-thread memcpy of the same bytes in the same run.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvferry_core::{Chunk, Config, Grant, KvPoll, Layout, Region, Role, RoomId};
use kvferry_memory::MemoryMap;
use kvferry_tokio::{Node, NodeError, SameHost};

use crate::Shape;

/// One workload's times, best of the run's rounds each.
#[derive(Clone, Debug)]
pub struct SameHostPoint {
    /// What moved.
    pub workload: &'static str,
    /// Bytes per room.
    pub bytes: u64,
    /// One thread copying the same bytes with `copy_from_slice`, page by page.
    pub memcpy: Duration,
    /// The room over the same-host path, from opening it to its `Success`.
    pub same_host: Duration,
    /// The same room over loopback TCP.
    pub tcp: Duration,
    /// Every byte of every room checked against its source, none different.
    pub clean: bool,
}

impl SameHostPoint {
    /// GB/s of a time for this point's bytes.
    pub fn gbps(&self, t: Duration) -> f64 {
        self.bytes as f64 / t.as_secs_f64().max(1e-12) / 1e9
    }
}

/// A workload: pages of `page_bytes`, the room's `pages`; `scattered` puts every page of the
/// room one page apart on both sides (nothing coalesces), else they are contiguous.
struct Workload {
    name: &'static str,
    page_bytes: u32,
    pages: u32,
    scattered: bool,
}

const WORKLOADS: [Workload; 2] = [
    Workload {
        name: "64 MiB room",
        page_bytes: 1 << 20,
        pages: 64,
        scattered: false,
    },
    Workload {
        name: "1024 x 16 KiB pages",
        page_bytes: 16 << 10,
        pages: 1024,
        scattered: true,
    },
];

impl Workload {
    fn layout(&self) -> Layout {
        Layout {
            layers: 1,
            planes: 1,
            page_bytes: self.page_bytes,
            pages: self.pages * 2 + 1,
            aux_bytes: 0,
            state_bytes: 0,
            slots: 0,
        }
    }

    /// The room's pages: the source's odd pages and the destination's even ones when
    /// scattered, else the first `pages` on both sides.
    fn pages(&self) -> (Vec<u32>, Vec<u32>) {
        if self.scattered {
            (
                (0..self.pages).map(|i| 2 * i + 1).collect(),
                (0..self.pages).map(|i| 2 * i).collect(),
            )
        } else {
            ((0..self.pages).collect(), (0..self.pages).collect())
        }
    }

    /// One thread copying the room's bytes page by page (best of `rounds`).
    fn memcpy(&self, rounds: usize) -> Duration {
        let page = self.page_bytes as usize;
        let len = page * (self.pages as usize * 2 + 1);
        let src: Vec<u8> = (0..len).map(|i| i as u8).collect();
        let mut dst = vec![0u8; len];
        let (from, to) = self.pages();
        let mut best = Duration::MAX;
        for _ in 0..rounds.max(1) {
            let t0 = Instant::now();
            for (s, d) in from.iter().zip(&to) {
                let (s, d) = (*s as usize * page, *d as usize * page);
                dst[d..d + page].copy_from_slice(&src[s..s + page]);
            }
            best = best.min(t0.elapsed());
            std::hint::black_box(&dst);
        }
        best
    }
}

/// Starts a prefill and a decode of `layout` linked as `same_host` says, connected.
async fn pair(
    layout: Layout,
    same_host: SameHost,
) -> Result<(Node, Node, kvferry_tokio::PeerId), NodeError> {
    let shape = Shape {
        layers: 1,
        planes: 1,
        page_bytes: layout.page_bytes,
        pages_per_room: layout.pages,
        ..Shape::default()
    };
    let token = b"same-host-bench".to_vec();
    let mut p = crate::node_config(Role::Prefill, &shape, Config::default(), &token, 11);
    let mut d = crate::node_config(Role::Decode, &shape, Config::default(), &token, 12);
    p.info.layout = layout;
    d.info.layout = layout;
    p.same_host = same_host;
    d.same_host = same_host;
    let prefill = kvferry_tokio::start(p, Arc::new(MemoryMap::allocate(layout)))?;
    let decode = kvferry_tokio::start(d, Arc::new(MemoryMap::allocate(layout)))?;
    let addrs = prefill
        .listen("127.0.0.1:0".parse().map_err(|_| NodeError::ShutDown)?)
        .await?;
    let peer = decode.connect(addrs).await?;
    Ok((prefill, decode, peer))
}

/// Moves one room `room` from `from` pages to `to` pages; its time from opening to
/// `Success`, and whether every byte landed as the source holds it.
async fn one_room(
    prefill: &Node,
    decode: &Node,
    peer: kvferry_tokio::PeerId,
    room: RoomId,
    w: &Workload,
) -> Result<(Duration, bool), NodeError> {
    let (from, to) = w.pages();
    // A pattern of this room in every source page, so a stale page is caught.
    let page = w.page_bytes as usize;
    let region = Region::Kv { layer: 0, plane: 0 };
    for &p in &from {
        let bytes: Vec<u8> = (0..page)
            .map(|i| (i as u64 ^ room.0.wrapping_mul(131) ^ u64::from(p)) as u8)
            .collect();
        let _ = prefill
            .memory()
            .write(region, u64::from(p) * page as u64, &bytes);
    }
    let sender = {
        let prefill = prefill.clone();
        let from = from.clone();
        tokio::spawn(async move {
            let handle = prefill.open_sender(room, 0, None).await?;
            prefill
                .send_chunk(
                    room,
                    Chunk {
                        extras: Vec::new(),
                        pages: from,
                        last: true,
                        aux_slot: None,
                        state_slot: None,
                        layerwise: false,
                    },
                )
                .await?;
            Ok::<_, NodeError>(handle)
        })
    };
    let grant = Grant {
        extras: Vec::new(),
        pages: to.clone(),
        aux_slot: None,
        state_slot: None,
        receivers: 1,
        skip_pages: 0,
        idle_sources: 0,
        prompt: None,
    };
    let t0 = Instant::now();
    let mut handle = decode
        .open_receiver(room, 0, vec![peer], Some(grant))
        .await?;
    let state = handle.terminal().await;
    let took = t0.elapsed();
    let mut sent = sender.await.map_err(|_| NodeError::ShutDown)??;
    sent.terminal().await;
    let mut clean = state == KvPoll::Success;
    let (mut a, mut b) = (vec![0u8; page], vec![0u8; page]);
    for (s, d) in from.iter().zip(&to) {
        let read_a = prefill
            .memory()
            .read(region, u64::from(*s) * page as u64, &mut a);
        let read_b = decode
            .memory()
            .read(region, u64::from(*d) * page as u64, &mut b);
        clean &= read_a.is_ok() && read_b.is_ok() && a == b;
    }
    Ok((took, clean))
}

/// The workloads over the same-host path and over loopback TCP, `rounds` rooms each (best
/// counts), alternating which goes first; each point goes to `done` when measured.
pub async fn same_host(
    rounds: usize,
    done: &mut dyn FnMut(&SameHostPoint),
) -> Result<Vec<SameHostPoint>, NodeError> {
    let mut out = Vec::new();
    for w in &WORKLOADS {
        let links = [
            pair(w.layout(), SameHost::Auto).await?,
            pair(w.layout(), SameHost::Off).await?,
        ];
        let mut best = [Duration::MAX; 2];
        let mut clean = true;
        let mut room = 1;
        for i in 0..rounds.max(1) {
            for k in [i % 2, 1 - i % 2] {
                let (prefill, decode, peer) = &links[k];
                let (took, ok) = one_room(prefill, decode, *peer, RoomId(room), w).await?;
                room += 1;
                clean &= ok;
                best[k] = best[k].min(took);
            }
        }
        // The same-host pair must really have moved over it, the TCP pair never.
        for (k, (_, decode, _)) in links.iter().enumerate() {
            let cma = crate::path_label(decode).await.contains("cma");
            clean &= cma == (k == 0);
        }
        for (prefill, decode, _) in links {
            decode.shutdown().await;
            prefill.shutdown().await;
        }
        let point = SameHostPoint {
            workload: w.name,
            bytes: u64::from(w.pages) * u64::from(w.page_bytes),
            memcpy: w.memcpy(rounds),
            same_host: best[0],
            tcp: best[1],
            clean,
        };
        done(&point);
        out.push(point);
    }
    Ok(out)
}
