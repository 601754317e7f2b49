//! Property tests over random workloads, fault schedules and API call sequences.
//!
//! After every run: every room reached a terminal state within its deadline bound and was
//! released on every node; no state left a terminal state; no operation of a room was emitted
//! after it failed (abort processed) or was released; no write landed on a page that was not
//! its room's (so `Releasable` never preceded the acks or a confirmed fence); counters agree
//! with the event stream.

mod common;

use std::time::Duration;

use kvferry_core::codec::Message;
use kvferry_core::sim::{Faults, Sim, Workload};
use kvferry_core::{Chunk, FailureReason, Grant, RoomId};
use proptest::prelude::*;

fn faults() -> impl Strategy<Value = Faults> {
    (
        0.0..0.3f64,
        0.0..0.05f64,
        0.0..0.05f64,
        0.0..0.2f64,
        0.0..0.2f64,
        0.0..0.01f64,
        0.0..0.002f64,
        0.0..0.01f64,
        0.0..0.1f64,
    )
        .prop_map(
            |(transient, fatal, hang, dup, reorder, drop, reset, corrupt, orphan)| Faults {
                msg_corrupt: corrupt,
                op_orphan: orphan,
                op_transient: transient,
                op_fatal: fatal,
                op_hang: hang,
                msg_duplicate: dup,
                msg_reorder: reorder,
                msg_drop: drop,
                link_reset: reset,
                reconnect_after: Some(Duration::from_millis(50)),
                ..Faults::default()
            },
        )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 128, ..ProptestConfig::default() })]

    #[test]
    fn every_room_concludes_and_nothing_is_corrupted_under_random_faults(
        seed in any::<u64>(),
        faults in faults(),
        rooms in 10usize..80,
        decode_abort in 0.0..0.3f64,
        prefill_abort in 0.0..0.1f64,
        layerwise in 0.0..1.0f64,
        retries in 1u32..5,
        threshold in 1u32..12,
    ) {
        let mut config = common::config();
        config.transfer_retries = retries;
        config.session_failure_threshold = threshold;
        let (mut sim, ps, ds) = common::cluster(seed, config.clone(), faults);
        let mut w = Workload::new(ds, vec![ps], rooms);
        w.decode_abort = decode_abort;
        w.prefill_abort = prefill_abort;
        w.layerwise = layerwise;
        sim.start_workload(w);
        let result = sim.run_until(5_000_000, |s| s.workload_done());
        prop_assert_eq!(result, Ok(()), "outcomes {:?}", sim.workload_outcomes());
        prop_assert!(sim.violations.is_empty(), "{:?}", sim.violations);
        prop_assert!(sim.counter_mismatches().is_empty(), "{:?}", sim.counter_mismatches());
        // Bootstrap + waiting (refreshed by progress while alive) + abort-ack + op timeouts.
        let bound = config.bootstrap_timeout + config.waiting_timeout * 2 + config.abort_ack_timeout
            + config.operation_timeout * (retries + 1) + Duration::from_secs(1);
        let late = sim.late_rooms(bound);
        prop_assert!(late.is_empty(), "{:?}", late);
        prop_assert!(sim.quiescent());
    }
}

/// One embedder call or world event in a random sequence against one prefill-decode pair.
#[derive(Debug, Clone)]
enum Step {
    OpenReceiver {
        room: u8,
        pages: u8,
        granted: bool,
    },
    Grant {
        room: u8,
    },
    OpenSender {
        room: u8,
    },
    Chunk {
        room: u8,
        pages: u8,
        last: bool,
        layerwise: bool,
    },
    Layer {
        room: u8,
        layer: u16,
    },
    AbortDecode {
        room: u8,
    },
    AbortPrefill {
        room: u8,
    },
    FailRoom {
        room: u8,
        prefill: bool,
    },
    Garbage {
        bytes: Vec<u8>,
        to_prefill: bool,
    },
    Forged {
        room: u8,
        kind: u8,
        to_prefill: bool,
    },
    Advance {
        ms: u16,
    },
    Faults {
        transient: bool,
        hang: bool,
    },
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        (0u8..6, 1u8..12, any::<bool>()).prop_map(|(room, pages, granted)| Step::OpenReceiver {
            room,
            pages,
            granted
        }),
        (0u8..6).prop_map(|room| Step::Grant { room }),
        (0u8..6).prop_map(|room| Step::OpenSender { room }),
        (0u8..6, 0u8..8, any::<bool>(), any::<bool>()).prop_map(
            |(room, pages, last, layerwise)| Step::Chunk {
                room,
                pages,
                last,
                layerwise
            }
        ),
        (0u8..6, 0u16..5).prop_map(|(room, layer)| Step::Layer { room, layer }),
        (0u8..6).prop_map(|room| Step::AbortDecode { room }),
        (0u8..6).prop_map(|room| Step::AbortPrefill { room }),
        (0u8..6, any::<bool>()).prop_map(|(room, prefill)| Step::FailRoom { room, prefill }),
        (proptest::collection::vec(any::<u8>(), 0..40), any::<bool>())
            .prop_map(|(bytes, to_prefill)| Step::Garbage { bytes, to_prefill }),
        (0u8..6, 0u8..6, any::<bool>()).prop_map(|(room, kind, to_prefill)| Step::Forged {
            room,
            kind,
            to_prefill
        }),
        (0u16..3000).prop_map(|ms| Step::Advance { ms }),
        (any::<bool>(), any::<bool>())
            .prop_map(|(transient, hang)| Step::Faults { transient, hang }),
    ]
}

// One arm per step of the property run: the whole vocabulary of the run reads in one place.
fn apply(sim: &mut Sim, p: usize, d: usize, step: Step) {
    let now = sim.now;
    let sd = sim.session(d, p);
    let sp = sim.session(p, d);
    match step {
        Step::OpenReceiver {
            room,
            pages,
            granted,
        } => {
            let id = RoomId(u64::from(room));
            if sim.nodes[d].endpoint.room_state(id).is_some() {
                return;
            }
            let Some(sd) = sd else { return };
            // Pages are taken only for a grant given now: the simulation counts every page it
            // took for a room as the room's, so pages never granted would have to land too.
            let grant = if granted {
                let Some(dst) = sim.nodes[d].alloc(id, 0, u32::from(pages)) else {
                    return;
                };
                Some(Grant {
                    extras: Vec::new(),
                    pages: dst,
                    aux_slot: Some(u32::from(room)),
                    state_slot: None,
                    receivers: 1,
                    skip_pages: 0,
                    idle_sources: 0,
                    prompt: None,
                })
            } else {
                None
            };
            sim.nodes[d]
                .endpoint
                .open_receiver(now, id, 0, &[sd], grant)
                .expect("fresh room opens");
        }
        Step::Grant { room } => {
            let id = RoomId(u64::from(room));
            if sim.nodes[d].endpoint.room_state(id) != Some(kvferry_core::KvPoll::Bootstrapping) {
                return;
            }
            if let Some(dst) = sim.nodes[d].alloc(id, 0, 4) {
                let _ = sim.nodes[d].endpoint.grant_pages(
                    now,
                    id,
                    Grant {
                        extras: Vec::new(),
                        pages: dst,
                        aux_slot: None,
                        state_slot: None,
                        receivers: 1,
                        skip_pages: 0,
                        idle_sources: 0,
                        prompt: None,
                    },
                );
            }
        }
        Step::OpenSender { room } => {
            let _ = sim.nodes[p]
                .endpoint
                .open_sender(now, RoomId(u64::from(room)), 0, None);
        }
        Step::Chunk {
            room,
            pages,
            last,
            layerwise,
        } => {
            let id = RoomId(u64::from(room));
            if let Some(src) = sim.nodes[p].alloc(id, 0, u32::from(pages)) {
                let _ = sim.nodes[p].endpoint.send_chunk(
                    now,
                    id,
                    Chunk {
                        extras: Vec::new(),
                        pages: src,
                        last,
                        aux_slot: Some(1),
                        state_slot: None,
                        layerwise,
                    },
                );
            }
        }
        Step::Layer { room, layer } => {
            let _ = sim.nodes[p]
                .endpoint
                .mark_layer_ready(now, &[RoomId(u64::from(room))], layer);
        }
        Step::AbortDecode { room } => {
            let _ = sim.nodes[d].endpoint.abort(now, RoomId(u64::from(room)));
        }
        Step::AbortPrefill { room } => {
            let _ = sim.nodes[p].endpoint.abort(now, RoomId(u64::from(room)));
        }
        Step::FailRoom { room, prefill } => {
            let n = if prefill { p } else { d };
            sim.nodes[n].endpoint.fail_room(
                now,
                RoomId(u64::from(room)),
                FailureReason::ProtocolError,
            );
        }
        Step::Garbage { bytes, to_prefill } => {
            let (n, s) = if to_prefill { (p, sp) } else { (d, sd) };
            if let Some(s) = s {
                let used = sim.nodes[n].endpoint.handle_input(now, s, &bytes);
                assert!(used <= bytes.len());
            }
        }
        Step::Forged {
            room,
            kind,
            to_prefill,
        } => {
            let (n, s) = if to_prefill { (p, sp) } else { (d, sd) };
            let room = RoomId(u64::from(room));
            let msg = match kind {
                0 => Message::RoomStatus {
                    room,
                    generation: 0,
                    failure: None,
                },
                1 => Message::AbortAck {
                    room,
                    generation: 0,
                },
                2 => Message::Abort {
                    room,
                    generation: 0,
                    reason: FailureReason::AbortedLocally,
                },
                3 => Message::Progress {
                    room,
                    generation: 0,
                    stage: kvferry_core::codec::ProgressStage::Transferring,
                },
                4 => Message::RoomPending {
                    room,
                    generation: 0,
                    queue_position: 3,
                },
                _ => Message::RoomStatus {
                    room,
                    generation: 0,
                    failure: Some(FailureReason::TransferFailed),
                },
            };
            if let Some(s) = s {
                let mut buf = Vec::new();
                msg.encode(&mut buf);
                sim.nodes[n].endpoint.handle_input(now, s, &buf);
            }
        }
        Step::Advance { ms } => {
            sim.run_for(Duration::from_millis(u64::from(ms)), 1_000_000)
                .expect("no livelock");
        }
        Step::Faults { transient, hang } => {
            sim.faults.op_transient = if transient { 0.5 } else { 0.0 };
            sim.faults.op_hang = if hang { 0.3 } else { 0.0 };
            sim.faults.op_orphan = if transient { 0.2 } else { 0.0 };
        }
    }
    sim.drain(p);
    sim.drain(d);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 512, ..ProptestConfig::default() })]

    /// Random embedder calls, forged peer messages and garbage never panic, never corrupt
    /// pages, and every room still concludes and is released once the world calms down.
    #[test]
    fn random_api_sequences_and_hostile_input_keep_every_invariant(
        seed in any::<u64>(),
        steps in proptest::collection::vec(step(), 1..60),
    ) {
        let (mut sim, p, d) = common::pair(seed, common::config());
        for s in steps {
            apply(&mut sim, p, d, s);
            prop_assert!(sim.violations.is_empty(), "{:?}", sim.violations);
        }
        sim.faults = Faults::default();
        // Long enough for every deadline, abort-ack and fence to play out.
        sim.run_for(Duration::from_secs(20), 5_000_000).expect("no livelock");
        prop_assert!(sim.violations.is_empty(), "{:?}", sim.violations);
        prop_assert!(sim.counter_mismatches().is_empty(), "{:?}", sim.counter_mismatches());
        for n in [p, d] {
            prop_assert_eq!(sim.nodes[n].endpoint.live_rooms(), 0, "node {} holds rooms", n);
            prop_assert_eq!(sim.nodes[n].endpoint.live_ops(), 0);
        }
    }
}
