//! Arbitrary embedder calls, hostile bytes, faults and time steps against a prefill and a
//! decode endpoint in the deterministic simulation. After every step: no invariant violation
//! (no state leaves a terminal state, no write lands on a page that is not its room's, no
//! operation after a room failed, no room succeeds with operations missing). At the end,
//! with faults off and every deadline passed: nothing is left behind and the counters agree
//! with the events.
//!
//! A second decode asks for the same room ids, and either side may restart (a new
//! incarnation, all its memory freed) and reconnect, or lose its link into a black hole and
//! dial again (the fresh connection takes the silent session over): no room id reused across
//! decodes, incarnations or connections may succeed without every granted page landing in
//! its own lifetime.
#![no_main]

use std::time::Duration;

use kvferry_core::sim::{fast_config, small_layout, Faults, Sim};
use kvferry_core::{Chunk, FailureReason, Grant, KvPoll, RoomId};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut sim = Sim::new(data.len() as u64, Faults::default());
    let layout = small_layout(256);
    let p = sim.add_prefill(fast_config(), layout, 0, 0..layout.layers);
    let d = sim.add_decode(fast_config(), layout, 0);
    let d2 = sim.add_decode(fast_config(), layout, 0);
    sim.connect(d, p);
    sim.connect(d2, p);
    let _ = sim.run_for(Duration::from_millis(5), 100_000);
    let mut bytes = data.iter().copied();
    let mut next = move || bytes.next();
    while let Some(op) = next() {
        let now = sim.now;
        let room = RoomId(u64::from(next().unwrap_or(0) % 6));
        let arg = next().unwrap_or(0);
        let sd = sim.session(d, p);
        let sp = sim.session(p, d);
        match op % 13 {
            0 | 10 => {
                let dn = if op % 13 == 0 { d } else { d2 };
                if sim.nodes[dn].endpoint.room_state(room).is_none() {
                    if let (Some(sd), Some(dst)) = (sim.session(dn, p), sim.nodes[dn].alloc(room, 0, u32::from(arg % 12) + 1)) {
                        let grant = (arg & 0x80 == 0).then(|| Grant::new(dst, Some(1), None));
                        if sim.nodes[dn].endpoint.open_receiver(now, room, 0, &[sd], grant).is_err() {
                            // Refused: the embedder keeps its pages, the room owns nothing.
                            sim.nodes[dn].give_back(room, 0);
                        }
                    }
                }
            }
            11 => {
                let _ = sim.nodes[d2].endpoint.abort(now, room);
            }
            12 if arg & 0x80 != 0 => {
                // A black hole on one decode's link, then a fresh connection that takes its
                // silent session over (or, past the window, finds it gone).
                let dn = if arg & 1 == 0 { d } else { d2 };
                let until = now + Duration::from_millis(u64::from(arg % 16) * 100);
                sim.blackhole(dn, p, until);
                let _ = sim.run_for(Duration::from_millis(u64::from(arg % 8) * 50), 1_000_000);
                sim.connect(dn, p);
            }
            12 => {
                // A process restarts behind the same address and its peers reconnect.
                let n = [p, d, d2][usize::from(arg % 3)];
                sim.restart(n);
                sim.connect(d, p);
                sim.connect(d2, p);
            }
            1 => {
                let _ = sim.nodes[p].endpoint.open_sender(now, room, 0, None);
            }
            2 => {
                if let Some(src) = sim.nodes[p].alloc(room, 0, u32::from(arg % 8)) {
                    let chunk = Chunk { pages: src, last: arg & 0x40 != 0, aux_slot: Some(1), state_slot: None, layerwise: arg & 0x20 != 0, extras: Vec::new() };
                    let _ = sim.nodes[p].endpoint.send_chunk(now, room, chunk);
                }
            }
            3 => {
                let _ = sim.nodes[p].endpoint.mark_layer_ready(now, &[room], u16::from(arg % 5));
            }
            4 => {
                let _ = sim.nodes[d].endpoint.abort(now, room);
            }
            5 => {
                let _ = sim.nodes[p].endpoint.abort(now, room);
            }
            6 => {
                let len = usize::from(arg % 32);
                let garbage: Vec<u8> = (0..len).map(|_| next().unwrap_or(0)).collect();
                let (n, s) = if arg & 1 == 0 { (p, sp) } else { (d, sd) };
                if let Some(s) = s {
                    let used = sim.nodes[n].endpoint.handle_input(now, s, &garbage);
                    assert!(used <= garbage.len());
                }
            }
            7 => {
                let _ = sim.run_for(Duration::from_millis(u64::from(arg) * 10), 1_000_000);
            }
            8 => {
                sim.faults.op_transient = f64::from(arg % 4) / 8.0;
                sim.faults.op_hang = if arg & 0x10 != 0 { 0.2 } else { 0.0 };
                sim.faults.msg_duplicate = if arg & 0x20 != 0 { 0.2 } else { 0.0 };
                sim.faults.op_orphan = if arg & 0x40 != 0 { 0.3 } else { 0.0 };
            }
            _ => {
                let n = if arg & 1 == 0 { p } else { d };
                sim.nodes[n].endpoint.fail_room(now, room, FailureReason::ProtocolError);
            }
        }
        sim.drain(p);
        sim.drain(d);
        sim.drain(d2);
        assert!(sim.violations.is_empty(), "{:?}", sim.violations);
    }
    sim.faults = Faults::default();
    sim.run_for(Duration::from_secs(20), 5_000_000).expect("no livelock");
    assert!(sim.violations.is_empty(), "{:?}", sim.violations);
    assert!(sim.counter_mismatches().is_empty(), "{:?}", sim.counter_mismatches());
    for n in [p, d, d2] {
        assert_eq!(sim.nodes[n].endpoint.live_rooms(), 0);
        assert_eq!(sim.nodes[n].endpoint.live_ops(), 0);
        for room in 0..6 {
            let s = sim.nodes[n].endpoint.room_state(RoomId(room));
            assert!(s.is_none() || s.is_some_and(KvPoll::is_terminal));
        }
    }
});
