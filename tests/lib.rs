//! Helpers for the integration tests: nodes on loopback with small synthetic shapes.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use kvferry_core::{Config, Role};
use kvferry_memory::MemoryMap;
use kvferry_testkit::{node_config, Shape};

/// A small shape: 4 layers, K and V, 4 KiB pages, 8 pages per room.
pub fn small_shape() -> Shape {
    Shape {
        layers: 4,
        planes: 2,
        page_bytes: 4096,
        pages_per_room: 8,
        prefix_pages: 0,
        chunks: 1,
        concurrency: 8,
        layerwise: false,
        layer_compute: Duration::ZERO,
        data_connections: 2,
    }
}

/// How many times slower than the hardware its deadlines model this machine runs:
/// `KVFERRY_TEST_TIME_SCALE` (1 unless set; the emulated soft-RoCE guest sets it).
pub fn time_scale() -> u32 {
    std::env::var("KVFERRY_TEST_TIME_SCALE")
        .ok()
        .and_then(|v| v.parse().ok())
        .filter(|&n| n >= 1)
        .unwrap_or(1)
}

/// Core knobs with short deadlines so failure tests finish fast. An operation's deadline and
/// a connection attempt's grow with [`time_scale`]: under emulation one write batch can take
/// most of a second.
pub fn fast_core() -> Config {
    Config {
        bootstrap_timeout: Duration::from_secs(2),
        waiting_timeout: Duration::from_secs(2),
        abort_ack_timeout: Duration::from_millis(500),
        heartbeat_interval: Duration::from_millis(200),
        progress_interval: Duration::from_millis(200),
        operation_timeout: Duration::from_millis(1000) * time_scale(),
        // A data connection's dial and preamble: a cold emulated guest can take longer than
        // the default's 200 ms, and each timed-out dial fails the operations waiting on it.
        connect_timeout: Config::default().connect_timeout * time_scale(),
        retry_backoff: Duration::from_millis(5),
        ..Config::default()
    }
}

/// `fast_core` with short peer-loss windows: rooms waiting for a peer that is down give up
/// after 1 s, and a lost peer is dialed again every 20-100 ms.
pub fn peer_loss_core() -> Config {
    Config {
        unreachable_timeout: Duration::from_secs(1),
        reconnect_interval: Duration::from_millis(20),
        reconnect_max_interval: Duration::from_millis(100),
        ..fast_core()
    }
}

/// Device memory (CUDA device 0) for `small_shape`, reached through `engine` and a pool of
/// `buffers` buffers of `bytes` each.
pub fn device_memory(
    engine: Arc<kvferry_memory::HostCopyEngine>,
    buffers: usize,
    bytes: usize,
) -> Arc<MemoryMap> {
    let staging = kvferry_memory::Staging::new(
        engine,
        kvferry_memory::StagingConfig {
            buffers,
            buffer_bytes: bytes,
            ..kvferry_memory::StagingConfig::default()
        },
    )
    .expect("staging pool");
    Arc::new(MemoryMap::allocate_as_device(small_shape().layout(), 0).with_staging(staging))
}

/// `fast_core` with deadlines a slowed engine keeps on a loaded machine: the host engine is
/// one thread that sleeps before every batch (verification included), and on a machine with
/// three busy loops per core each sleep can take milliseconds. Rooms that must fail still
/// fail within seconds (the failing engine breaks connections at once).
pub fn staged_core() -> Config {
    Config {
        operation_timeout: Duration::from_secs(10),
        waiting_timeout: Duration::from_secs(20),
        bootstrap_timeout: Duration::from_secs(20),
        ..fast_core()
    }
}

/// Both runtimes, glommio on one shard: the pair most driver-level tests run on.
pub const RUNTIMES: [Runtime; 2] = [
    Runtime::Tokio,
    Runtime::Glommio {
        shards: 1,
        pin: false,
    },
];

/// Starts a node of `role` with its own memory.
pub fn start(role: Role, shape: &Shape, core: Config, seed: u64) -> Node {
    let mut cfg = node_config(role, shape, core, b"test-token", seed);
    use_test_backend(&mut cfg);
    kvferry_tokio::start(cfg, Arc::new(MemoryMap::allocate(shape.layout()))).expect("node starts")
}

/// A prefill node serving synthetic KV on an ephemeral loopback port.
pub async fn prefill(
    shape: &Shape,
    core: Config,
    seed: u64,
) -> (Node, SocketAddr, tokio::task::JoinHandle<()>) {
    let node = start(Role::Prefill, shape, core, seed);
    // A tokio node is one shard: one address.
    let addr = node
        .listen("127.0.0.1:0".parse().expect("addr"))
        .await
        .expect("listen")[0];
    let server = tokio::spawn(kvferry_testkit::serve_prefill(node.clone(), shape.clone()));
    (node, addr, server)
}

/// Asserts that `n` rooms succeeded and no page was corrupted.
pub fn assert_all_clean(report: &kvferry_testkit::Report, n: u64) {
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
pub use kvferry_testkit::proxy;

// ------------------------------------------------------------------ any driver

pub use kvferry_testkit::{Node, Runtime};
/// The glommio configuration the generic suite runs: two shards (one per core here).
pub const GLOMMIO: Runtime = Runtime::Glommio {
    shards: 2,
    pin: false,
};

/// A node config of `role` (test token, `core`) whose data moves over RDMA on the host's first
/// device, port 1.
pub fn rdma_config(
    role: Role,
    shape: &Shape,
    core: Config,
    seed: u64,
) -> kvferry_tokio::NodeConfig {
    let mut cfg = node_config(role, shape, core, b"test-token", seed);
    cfg.backend = kvferry_testkit::DataBackend::Rdma {
        device: None,
        port: 1,
    };
    cfg
}

/// With `KVFERRY_TEST_BACKEND=rdma`, nodes move data over the first RDMA device, on either
/// runtime, so the suite written for TCP runs over RDMA too (`scripts/rdma-guest.sh` does so
/// on soft-RoCE); with `KVFERRY_TEST_BACKEND=same_host`, over the same-host path (the
/// nodes of a test share its process, so its host).
pub fn use_test_backend(cfg: &mut kvferry_tokio::NodeConfig) {
    match std::env::var("KVFERRY_TEST_BACKEND").as_deref() {
        Ok("rdma") => {
            cfg.backend = kvferry_testkit::DataBackend::Rdma {
                device: None,
                port: 1,
            };
        }
        Ok("same_host") => cfg.same_host = kvferry_testkit::SameHost::Auto,
        _ => {}
    }
}

/// Starts a node of `role` on `runtime` with its own memory.
pub fn start_on(runtime: Runtime, role: Role, shape: &Shape, core: Config, seed: u64) -> Node {
    let mut cfg = node_config(role, shape, core, b"test-token", seed);
    use_test_backend(&mut cfg);
    runtime
        .start(cfg, Arc::new(MemoryMap::allocate(shape.layout())))
        .expect("node starts")
}

/// A prefill node on `runtime` serving synthetic KV on `at` (port 0: any ports).
pub async fn prefill_on(
    runtime: Runtime,
    shape: &Shape,
    core: Config,
    seed: u64,
    at: SocketAddr,
) -> (Node, Vec<SocketAddr>, tokio::task::JoinHandle<()>) {
    let node = start_on(runtime, Role::Prefill, shape, core, seed);
    let addrs = node.listen(at).await.expect("listen");
    let server = tokio::spawn(kvferry_testkit::serve_prefill(node.clone(), shape.clone()));
    (node, addrs, server)
}

/// A decode run of `n` rooms from room `first`, small shape, 30 s deadline.
pub fn rooms(n: u64, first: u64) -> kvferry_testkit::DecodeRun {
    kvferry_testkit::DecodeRun {
        rooms: n,
        shape: small_shape(),
        first_room: first,
        progress: None,
        deadline: Duration::from_secs(30),
        abort_rate: 0.0,
        seed: 0,
    }
}

/// A loopback address whose port and the next `n - 1` ones are free right now (for tests
/// that restart a node behind the same addresses).
pub fn free_ports(n: u16) -> SocketAddr {
    let mut seed = u64::from(std::process::id()).wrapping_mul(0x9E37_79B9_7F4A_7C15)
        ^ std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
    loop {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        // Below Linux's ephemeral range (32768-60999): an outgoing connection cannot take
        // the port between this check and the node's bind.
        let base = 20_000 + (seed >> 33) as u16 % 12_000;
        let all_free = (0..n).all(|i| std::net::TcpListener::bind(("127.0.0.1", base + i)).is_ok());
        if all_free {
            return SocketAddr::from(([127, 0, 0, 1], base));
        }
    }
}

/// Sends the nodes' `tracing` events to the test's output when `KVFERRY_TEST_LOG` holds a
/// filter (`KVFERRY_TEST_LOG=kvferry_core=debug cargo test ...`); does nothing otherwise.
pub fn log_if_asked() {
    if let Ok(filter) = std::env::var("KVFERRY_TEST_LOG") {
        let _ = tracing_subscriber::fmt()
            .with_env_filter(tracing_subscriber::EnvFilter::new(filter))
            .with_test_writer()
            .try_init();
    }
}

/// Runs one async scenario `fn(prefill_runtime, decode_runtime)` on every driver: tokio,
/// glommio (2 shards), and a mixed pair (tokio prefill, glommio decode).
#[macro_export]
macro_rules! on_every_driver {
    ($($name:ident),* $(,)?) => {
        $(
            mod $name {
                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn tokio() {
                    $crate::log_if_asked();
                    super::$name($crate::Runtime::Tokio, $crate::Runtime::Tokio).await;
                }

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn glommio() {
                    $crate::log_if_asked();
                    super::$name($crate::GLOMMIO, $crate::GLOMMIO).await;
                }

                #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
                async fn tokio_prefill_glommio_decode() {
                    $crate::log_if_asked();
                    super::$name($crate::Runtime::Tokio, $crate::GLOMMIO).await;
                }
            }
        )*
    };
}
