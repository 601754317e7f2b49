//! A node over device memory publishes its staging pool in its metrics. Its own test binary:
//! the recorder is global, and other nodes of the process would publish the same names.
#![allow(clippy::unwrap_used)] // tests may panic

use std::time::Duration;

use kvferry_core::Role;
use kvferry_memory::HostCopyEngine;
use kvferry_testkit::node_config;
use kvferry_tests::{assert_all_clean, device_memory, rooms, small_shape, staged_core, Runtime};

/// Engine, size, free buffers, and the shared buffers taken.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_staging_node_publishes_its_pool_in_its_metrics() {
    let recorder = metrics_exporter_prometheus::PrometheusBuilder::new()
        .install_recorder()
        .unwrap();
    let memory = || device_memory(HostCopyEngine::new(Duration::ZERO), 3, 8192);
    let shape = small_shape();
    let prefill = Runtime::Tokio
        .start(
            node_config(Role::Prefill, &shape, staged_core(), b"test-token", 1),
            memory(),
        )
        .unwrap();
    let decode = Runtime::Tokio
        .start(
            node_config(Role::Decode, &shape, staged_core(), b"test-token", 2),
            memory(),
        )
        .unwrap();
    // The nodes stay up while the metrics are read (run_pair would shut them down).
    let addrs = prefill
        .listen("127.0.0.1:0".parse().unwrap())
        .await
        .unwrap();
    let _server = tokio::spawn(kvferry_testkit::serve_prefill(
        prefill.clone(),
        shape.clone(),
    ));
    let peer = decode.connect(addrs).await.unwrap();
    let report = kvferry_testkit::run_decode(&decode, peer, rooms(10, 1)).await;
    assert_all_clean(&report, 10);
    // Metrics are published every 500 ms of driver turns, by each node on its own clock.
    let expected = [
        r#"kvferry_staging_buffers{role="decode",engine="host"} 3"#,
        r#"kvferry_staging_buffers{role="prefill",engine="host"} 3"#,
        "kvferry_staging_buffers_taken_total{",
    ];
    let deadline = std::time::Instant::now() + Duration::from_secs(10);
    let text = loop {
        let text = recorder.render();
        if expected.iter().all(|line| text.contains(line)) || std::time::Instant::now() > deadline {
            break text;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    };
    for line in expected {
        assert!(
            text.contains(line),
            "{line} not in ({} bytes):\n{text}",
            text.len()
        );
    }
    assert!(text.contains("kvferry_staging_buffers_free{"), "{text}");
}
