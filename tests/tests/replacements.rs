//! A decode whose data connections are replaced again and again (a flaky link, forged
//! acknowledgements) lets each ended one go: after 1,000 replacements its sessions hold no
//! more connections than configured (plus one just ended) and its memory has not grown with
//! them. Alone in its test binary, so the process's memory is this scenario's.
#![allow(clippy::unwrap_used)] // tests may panic

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicI64, Ordering};
use std::time::Duration;

use kvferry_core::{Config, Role};
use kvferry_testkit::run_decode;
use kvferry_tests::proxy::FaultProxy;
use kvferry_tests::{
    assert_all_clean, fast_core, prefill_on, rooms, small_shape, start_on, Runtime,
};

const REPLACEMENTS: u64 = 1000;

/// Counts the bytes this process holds on the heap: what a kept connection would grow.
struct Counting;

static LIVE: AtomicI64 = AtomicI64::new(0);

// SAFETY: every call is forwarded to the system allocator with its own arguments; the
// counter only reads the sizes.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        LIVE.fetch_add(layout.size() as i64, Ordering::Relaxed);
        // SAFETY: the caller's layout, as GlobalAlloc::alloc requires.
        unsafe { System.alloc(layout) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        LIVE.fetch_sub(layout.size() as i64, Ordering::Relaxed);
        // SAFETY: ptr came from System.alloc with this layout.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static ALLOCATOR: Counting = Counting;

/// Heap bytes held now, in KiB.
fn heap_kib() -> i64 {
    LIVE.load(Ordering::Relaxed) / 1024
}

async fn replacing_data_connections_leaves_the_decode_flat(p: Runtime, d: Runtime) {
    let shape = small_shape();
    let core = Config {
        data_reconnect_interval: Duration::from_millis(1),
        ..fast_core()
    };
    let (prefill, addrs, _server) =
        prefill_on(p, &shape, core.clone(), 61, "127.0.0.1:0".parse().unwrap()).await;
    let mut proxies = Vec::new();
    for &a in &addrs {
        proxies.push(FaultProxy::start(a, 62).await.unwrap());
    }
    let decode = start_on(d, Role::Decode, &shape, core, 63);
    let peer = decode
        .connect(proxies.iter().map(|x| x.addr).collect())
        .await
        .unwrap();
    assert_all_clean(&run_decode(&decode, peer, rooms(8, 1)).await, 8);
    let sessions = decode.data_connections().await.len() as u64;
    let per_session = shape.data_connections as u64;
    let seen = |proxies: &[FaultProxy]| -> u64 {
        proxies.iter().map(FaultProxy::data_connections_seen).sum()
    };
    let (mut early, mut late) = (i64::MAX, i64::MAX);
    let mut replaced = 0;
    let open = |proxies: &[FaultProxy]| -> u64 {
        proxies
            .iter()
            .map(|x| x.data_connections_open() as u64)
            .sum()
    };
    for round in 1..=REPLACEMENTS {
        // Every connection of the last round is back before this one resets them all.
        let settled = async {
            while open(&proxies) < sessions * per_session {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        };
        tokio::time::timeout(Duration::from_secs(5), settled)
            .await
            .unwrap_or_else(|_| panic!("round {round}: {} data connections open", open(&proxies)));
        let before = seen(&proxies);
        let reset: u64 = proxies.iter().map(FaultProxy::reset_data).sum();
        replaced += reset;
        // Each connection reset is opened again.
        let reopened = async {
            while seen(&proxies) < before + reset {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        };
        if tokio::time::timeout(Duration::from_secs(5), reopened)
            .await
            .is_err()
        {
            panic!(
                "round {round}: data connections not reopened: seen {} (before {before}), decode holds {:?}, decode counters {:?}",
                seen(&proxies),
                decode.data_connections().await,
                decode.counters().await
            );
        }
        if round % 100 == 0 {
            for (shard, sid, n) in decode.data_connections().await {
                assert!(
                    n as u64 <= per_session + 1,
                    "round {round}: shard {shard} session {sid} holds {n} data connections"
                );
            }
        }
        // The heap at rest (every connection open), lowest of the rounds after warm-up and
        // of the last ones: buffers in flight make single samples swing by a few 100 KiB.
        let heap = heap_kib();
        if (100..200).contains(&round) {
            early = early.min(heap);
        }
        if round > REPLACEMENTS - 100 {
            late = late.min(heap);
        }
    }
    // Each round resets every data connection the proxies know as one (all of them but the
    // rare one whose first bytes are still on the way).
    assert!(replaced >= REPLACEMENTS, "only {replaced} replacements");
    let grown = late - early;
    eprintln!("{p:?} prefill, {d:?} decode: {replaced} data connections replaced, heap at rest grew {grown} KiB from rounds 100-200 to the last 100");
    // Each ended receiver kept costs its task: about 280 KiB here over these rounds on a
    // glommio decode; at rest the heap moves by less than 140 KiB either way.
    assert!(
        grown < 160,
        "the heap at rest grew {grown} KiB over the replacements"
    );
    assert_eq!(decode.data_connections().await.len() as u64, sessions);
    assert_all_clean(&run_decode(&decode, peer, rooms(8, 100)).await, 8);
    decode.shutdown().await;
    prefill.shutdown().await;
}

/// One scenario at a time (memory is the process's): each driver pair in turn.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn replacing_data_connections_a_thousand_times_leaves_each_decode_flat() {
    kvferry_tests::log_if_asked();
    for (p, d) in [
        (Runtime::Tokio, Runtime::Tokio),
        (kvferry_tests::GLOMMIO, kvferry_tests::GLOMMIO),
        (Runtime::Tokio, kvferry_tests::GLOMMIO),
    ] {
        replacing_data_connections_leaves_the_decode_flat(p, d).await;
    }
}
