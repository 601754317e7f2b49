//! Shared set-ups for the simulation tests.
#![allow(dead_code, unreachable_pub)]

use std::time::Duration;

use kvferry_core::sim::{fast_config, small_layout, Faults, Sim, Workload};
use kvferry_core::Config;

/// One prefill and one decode, connected and past the handshake.
pub fn pair(seed: u64, config: Config) -> (Sim, usize, usize) {
    let mut sim = Sim::new(seed, Faults::default());
    let layout = small_layout(4096);
    let p = sim.add_prefill(config.clone(), layout, 0, 0..layout.layers);
    let d = sim.add_decode(config, layout, 0);
    sim.connect(d, p);
    sim.run_for(Duration::from_millis(5), 10_000)
        .expect("handshake");
    (sim, p, d)
}

/// Two prefill ranks (PP stages splitting the layers) and two decode ranks, fully connected.
pub fn cluster(seed: u64, config: Config, faults: Faults) -> (Sim, Vec<usize>, Vec<usize>) {
    let mut sim = Sim::new(seed, faults);
    let layout = small_layout(2048);
    let p0 = sim.add_prefill(config.clone(), layout, 0, 0..2);
    let p1 = sim.add_prefill(config.clone(), layout, 1, 2..4);
    let d0 = sim.add_decode(config.clone(), layout, 0);
    let d1 = sim.add_decode(config, layout, 1);
    for d in [d0, d1] {
        for p in [p0, p1] {
            sim.connect(d, p);
        }
    }
    sim.run_for(Duration::from_millis(5), 10_000)
        .expect("handshake");
    (sim, vec![p0, p1], vec![d0, d1])
}

/// Runs a workload to completion and asserts the universal invariants.
pub fn run_workload(sim: &mut Sim, w: Workload, max_steps: u64) {
    sim.start_workload(w);
    let r = sim.run_until(max_steps, |s| s.workload_done());
    assert_eq!(r, Ok(()), "outcomes so far: {:?}", sim.workload_outcomes());
    assert_invariants(sim);
}

/// No violation, counters agree with events, nothing left behind.
pub fn assert_invariants(sim: &Sim) {
    assert!(
        sim.violations.is_empty(),
        "violations: {:#?}",
        &sim.violations[..sim.violations.len().min(20)]
    );
    let mismatches = sim.counter_mismatches();
    assert!(mismatches.is_empty(), "counter mismatches: {mismatches:#?}");
}

/// The default fast configuration.
pub fn config() -> Config {
    fast_config()
}

use kvferry_core::{Chunk, Event, FailureReason, Grant, KvPoll, RoomId, SessionId};

/// Decode `d` opens `room` fed by `ps` with `pages` pages granted at once; every prefill of
/// `ps` opens its sender. Returns the granted destination pages.
pub fn open_room(sim: &mut Sim, d: usize, ps: &[usize], room: u64, pages: u32) -> Vec<u32> {
    open_room_with(sim, d, ps, room, pages, |dst| {
        Grant::new(dst, Some(room as u32), None)
    })
}

/// As [`open_room`], with the grant `grant` makes of the destination pages.
pub fn open_room_with(
    sim: &mut Sim,
    d: usize,
    ps: &[usize],
    room: u64,
    pages: u32,
    grant: impl FnOnce(Vec<u32>) -> Grant,
) -> Vec<u32> {
    let dst = open_receiver_with(sim, d, ps, room, pages, grant);
    let now = sim.now;
    for &p in ps {
        sim.nodes[p]
            .endpoint
            .open_sender(now, RoomId(room), 0, None)
            .expect("open sender");
        sim.drain(p);
    }
    dst
}

/// Decode `d` alone opens `room` fed by `ps`, `pages` pages granted with `grant`. Returns the
/// granted destination pages.
pub fn open_receiver_with(
    sim: &mut Sim,
    d: usize,
    ps: &[usize],
    room: u64,
    pages: u32,
    grant: impl FnOnce(Vec<u32>) -> Grant,
) -> Vec<u32> {
    let now = sim.now;
    let id = RoomId(room);
    let dst = sim.nodes[d].alloc(id, 0, pages).expect("decode pages");
    let sources: Vec<SessionId> = ps
        .iter()
        .map(|&p| sim.session(d, p).expect("session"))
        .collect();
    sim.nodes[d]
        .endpoint
        .open_receiver(now, id, 0, &sources, Some(grant(dst.clone())))
        .expect("open receiver");
    sim.drain(d);
    dst
}

/// Prefill `p` sends all `pages` of `room` as one last chunk (whole batch or layerwise).
pub fn send_all(sim: &mut Sim, p: usize, room: u64, pages: u32, layerwise: bool) {
    let now = sim.now;
    let id = RoomId(room);
    let src = sim.nodes[p].alloc(id, 0, pages).expect("prefill pages");
    let chunk = Chunk {
        extras: Vec::new(),
        pages: src,
        last: true,
        aux_slot: Some(room as u32),
        state_slot: None,
        layerwise,
    };
    sim.nodes[p]
        .endpoint
        .send_chunk(now, id, chunk)
        .expect("send chunk");
    sim.drain(p);
}

/// Prefill `p` says `layer` of `room` finished its forward pass, and its outputs are drained.
pub fn mark_layer(sim: &mut Sim, p: usize, room: u64, layer: u16) {
    let now = sim.now;
    sim.nodes[p]
        .endpoint
        .mark_layer_ready(now, &[RoomId(room)], layer)
        .expect("layer ready");
    sim.drain(p);
}

/// The state of `room` on node `n`.
pub fn state(sim: &Sim, n: usize, room: u64) -> Option<KvPoll> {
    sim.nodes[n].endpoint.room_state(RoomId(room))
}

/// Runs `ms` milliseconds of simulated time.
pub fn run_ms(sim: &mut Sim, ms: u64) {
    sim.run_for(Duration::from_millis(ms), 5_000_000)
        .expect("no livelock");
}

/// When node `n` saw `room` become releasable.
pub fn released_at(sim: &Sim, n: usize, room: u64) -> Option<std::time::Instant> {
    sim.nodes[n].events.iter().find_map(|(t, e)| match e {
        Event::Releasable { room: r, .. } if *r == RoomId(room) => Some(*t),
        _ => None,
    })
}

/// When node `n` saw `room` reach `state`.
pub fn state_at(sim: &Sim, n: usize, room: u64, state: KvPoll) -> Option<std::time::Instant> {
    sim.nodes[n].events.iter().find_map(|(t, e)| match e {
        Event::RoomState {
            room: r, state: s, ..
        } if *r == RoomId(room) && *s == state => Some(*t),
        _ => None,
    })
}

/// Shorthand for a failed state.
pub fn failed(reason: FailureReason) -> Option<KvPoll> {
    Some(KvPoll::Failed(reason))
}
