//! Nothing waits for an unrelated timer: with heartbeats and progress keepalives 30 s apart,
//! no timer but the one at stake would wake a driver (or a glommio shard) for the whole test,
//! so a lost wake-up shows as a room late by up to 30 s, not as a few milliseconds. A room's
//! deadline fires at its time, and rooms whose calls come from other threads move at once.
//! The margins (700 ms on a 1 s deadline, 5 s for 40 rooms) are what a 2-core machine with
//! three busy loops per core keeps: measured there, deadlines fired at most 20 ms late.
#![allow(clippy::unwrap_used)] // tests may panic

use std::time::{Duration, Instant};

use kvferry_core::{Config, FailureReason, Grant, KvPoll, Role, RoomId};
use kvferry_testkit::{run_pair, DecodeRun};
use kvferry_tests::Runtime;
use kvferry_tests::{assert_all_clean, fast_core, on_every_driver, rooms, small_shape, start_on};

/// `fast_core` where nothing but the deadlines under test arms a timer for 30 s.
fn quiet_core() -> Config {
    Config {
        bootstrap_timeout: Duration::from_secs(1),
        waiting_timeout: Duration::from_secs(1),
        heartbeat_interval: Duration::from_secs(30),
        heartbeat_misses: 4,
        silence_timeout: Duration::from_secs(60),
        progress_interval: Duration::from_secs(30),
        ..fast_core()
    }
}

/// 20 decode rooms, opened 37 ms apart toward a prefill whose embedder never opens them:
/// granted at once, each fails `waiting_timeout` after it was opened, within the margin.
async fn a_room_deadline_fires_on_time_when_no_other_timer_would_wake_the_driver(
    p: Runtime,
    d: Runtime,
) {
    let shape = small_shape();
    let prefill = start_on(p, Role::Prefill, &shape, quiet_core(), 1);
    let addrs = prefill
        .listen("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let decode = start_on(d, Role::Decode, &shape, quiet_core(), 2);
    let peer = decode.connect(addrs).await.unwrap();
    let mut tasks = Vec::new();
    for i in 0..20u64 {
        let decode = decode.clone();
        tasks.push(tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(i * 37)).await;
            let grant = Grant {
                extras: Vec::new(),
                pages: vec![i as u32 * 2],
                aux_slot: None,
                state_slot: None,
                receivers: 1,
                skip_pages: 0,
                idle_sources: 0,
                prompt: None,
            };
            let opened = Instant::now();
            let mut room = decode
                .open_receiver(RoomId(1000 + i), 0, vec![peer], Some(grant))
                .await
                .unwrap();
            let end = tokio::time::timeout(Duration::from_secs(5), room.terminal()).await;
            (end, opened.elapsed())
        }));
    }
    for task in tasks {
        let (end, after) = task.await.unwrap();
        let end = end.unwrap_or_else(|_| panic!("a 1 s deadline had not fired after {after:?}"));
        assert_eq!(end, KvPoll::Failed(FailureReason::WaitingTimeout));
        assert!(
            after >= Duration::from_secs(1) && after < Duration::from_millis(1700),
            "a 1 s deadline fired after {after:?}"
        );
    }
}

/// 40 rooms moved end to end, each call from the test's threads: every room done well before
/// the first heartbeat could have woken a driver that missed a call.
async fn rooms_move_at_once_when_no_timer_would_wake_the_driver(p: Runtime, d: Runtime) {
    let shape = small_shape();
    let prefill = start_on(p, Role::Prefill, &shape, quiet_core(), 3);
    let decode = start_on(d, Role::Decode, &shape, quiet_core(), 4);
    let run = DecodeRun {
        deadline: Duration::from_secs(20),
        ..rooms(40, 1)
    };
    let report = tokio::time::timeout(Duration::from_secs(20), run_pair(&prefill, &decode, run))
        .await
        .expect("40 rooms did not end within 20 s: a call waited for a timer")
        .unwrap();
    assert_all_clean(&report, 40);
    assert!(
        report.elapsed_s < 5.0,
        "40 rooms took {:.1} s: a call waited for a timer",
        report.elapsed_s
    );
}

on_every_driver!(
    a_room_deadline_fires_on_time_when_no_other_timer_would_wake_the_driver,
    rooms_move_at_once_when_no_timer_would_wake_the_driver,
);
