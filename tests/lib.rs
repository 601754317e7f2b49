//! Helpers for the integration tests: nodes on loopback with small synthetic shapes.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use kvferry_cli::{node_config, Shape};
use kvferry_core::{Config, Role};
use kvferry_tcp::MemoryMap;
use kvferry_tokio::Node;

/// A small shape: 4 layers, K and V, 4 KiB pages, 8 pages per room.
pub fn small_shape() -> Shape {
    Shape {
        layers: 4,
        planes: 2,
        page_bytes: 4096,
        pages_per_room: 8,
        chunks: 1,
        concurrency: 8,
        layerwise: false,
        layer_compute: Duration::ZERO,
        data_connections: 2,
    }
}

/// Core knobs with short deadlines so failure tests finish fast.
pub fn fast_core() -> Config {
    Config {
        bootstrap_timeout: Duration::from_secs(2),
        waiting_timeout: Duration::from_secs(2),
        abort_ack_timeout: Duration::from_millis(500),
        heartbeat_interval: Duration::from_millis(200),
        operation_timeout: Duration::from_millis(1000),
        retry_backoff: Duration::from_millis(5),
        ..Config::default()
    }
}

/// Starts a node of `role` with its own memory.
pub fn start(role: Role, shape: &Shape, core: Config, seed: u64) -> Node {
    let cfg = node_config(role, shape, core, b"test-token", seed);
    Node::start(cfg, Arc::new(MemoryMap::allocate(shape.layout()))).expect("node starts")
}

/// A prefill node serving synthetic KV on an ephemeral loopback port.
pub async fn prefill(
    shape: &Shape,
    core: Config,
    seed: u64,
) -> (Node, SocketAddr, tokio::task::JoinHandle<()>) {
    let node = start(Role::Prefill, shape, core, seed);
    let addr = node
        .listen("127.0.0.1:0".parse().expect("addr"))
        .await
        .expect("listen");
    let server = tokio::spawn(kvferry_cli::serve_prefill(node.clone(), shape.clone()));
    (node, addr, server)
}

/// Asserts that `n` rooms succeeded and no page was corrupted.
pub fn assert_all_clean(report: &kvferry_cli::Report, n: u64) {
    assert_eq!(
        (report.rooms_succeeded, report.pages_corrupted),
        (n, 0),
        "{report:?}"
    );
}

/// Whether the peer closes `stream` within `within` (reading and discarding whatever it sends).
pub async fn closed_by_peer(stream: &mut tokio::net::TcpStream, within: Duration) -> bool {
    use tokio::io::AsyncReadExt;
    let mut buf = [0u8; 512];
    tokio::time::timeout(within, async {
        loop {
            match stream.read(&mut buf).await {
                Ok(0) | Err(_) => return true,
                Ok(_) => continue,
            }
        }
    })
    .await
    .unwrap_or(false)
}

/// The fault-injecting proxy (lives in the CLI crate so `kvferry proxy` can use it too).
pub use kvferry_cli::proxy;
