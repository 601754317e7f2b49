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

pub mod proxy {
    //! A fault-injecting TCP proxy for loopback tests: delay, stall a direction, black-hole
    //! both for a while, corrupt bytes, reset every connection. Decisions are seeded.

    use std::net::SocketAddr;
    use std::sync::{Arc, Mutex};
    use std::time::{Duration, Instant};

    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
    use tokio::net::{TcpListener, TcpStream};
    use tokio::task::JoinHandle;

    /// What the proxy does to the bytes it forwards, changeable at any time.
    #[derive(Clone, Debug, Default)]
    pub struct ProxyFaults {
        /// Added before forwarding each chunk.
        pub delay: Duration,
        /// Hold client-to-server bytes (they flow again when cleared).
        pub stall_up: bool,
        /// Hold server-to-client bytes.
        pub stall_down: bool,
        /// Hold both directions until this instant (a black hole that TCP would outlast).
        pub blackhole_until: Option<Instant>,
        /// Probability that a forwarded chunk has one byte flipped.
        pub corrupt: f64,
    }

    struct State {
        faults: Mutex<ProxyFaults>,
        pumps: Mutex<Vec<JoinHandle<()>>>,
        rng: Mutex<u64>,
    }

    /// A running proxy in front of `upstream`.
    pub struct FaultProxy {
        /// Where clients connect.
        pub addr: SocketAddr,
        state: Arc<State>,
        accept: JoinHandle<()>,
    }

    impl Drop for FaultProxy {
        fn drop(&mut self) {
            self.accept.abort();
            self.reset_all();
        }
    }

    impl FaultProxy {
        /// Listens on an ephemeral loopback port and forwards to `upstream`.
        pub async fn start(upstream: SocketAddr, seed: u64) -> std::io::Result<FaultProxy> {
            let listener = TcpListener::bind("127.0.0.1:0").await?;
            let addr = listener.local_addr()?;
            let state = Arc::new(State {
                faults: Mutex::new(ProxyFaults::default()),
                pumps: Mutex::new(Vec::new()),
                rng: Mutex::new(seed | 1),
            });
            let s = state.clone();
            let accept = tokio::spawn(async move {
                while let Ok((client, _)) = listener.accept().await {
                    let Ok(server) = TcpStream::connect(upstream).await else {
                        continue;
                    };
                    let _ = client.set_nodelay(true);
                    let _ = server.set_nodelay(true);
                    let (cr, cw) = client.into_split();
                    let (sr, sw) = server.into_split();
                    let up = tokio::spawn(pump(cr, sw, s.clone(), true));
                    let down = tokio::spawn(pump(sr, cw, s.clone(), false));
                    if let Ok(mut p) = s.pumps.lock() {
                        p.push(up);
                        p.push(down);
                    }
                }
            });
            Ok(FaultProxy {
                addr,
                state,
                accept,
            })
        }

        /// Changes the faults.
        pub fn set(&self, f: impl FnOnce(&mut ProxyFaults)) {
            if let Ok(mut faults) = self.state.faults.lock() {
                f(&mut faults);
            }
        }

        /// Resets every connection through the proxy (both ends see them close).
        pub fn reset_all(&self) {
            if let Ok(mut p) = self.state.pumps.lock() {
                for t in p.drain(..) {
                    t.abort();
                }
            }
        }
    }

    fn held(state: &State, up: bool) -> bool {
        let f = match state.faults.lock() {
            Ok(f) => f.clone(),
            Err(_) => return false,
        };
        let stalled = if up { f.stall_up } else { f.stall_down };
        stalled || f.blackhole_until.is_some_and(|t| t > Instant::now())
    }

    async fn pump(mut from: OwnedReadHalf, mut to: OwnedWriteHalf, state: Arc<State>, up: bool) {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = match from.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            while held(&state, up) {
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
            let (delay, corrupt) = match state.faults.lock() {
                Ok(f) => (f.delay, f.corrupt),
                Err(_) => (Duration::ZERO, 0.0),
            };
            if !delay.is_zero() {
                tokio::time::sleep(delay).await;
                // A stall or black hole set during the delay holds this chunk too.
                while held(&state, up) {
                    tokio::time::sleep(Duration::from_millis(1)).await;
                }
            }
            if corrupt > 0.0 {
                if let Ok(mut r) = state.rng.lock() {
                    *r ^= *r << 13;
                    *r ^= *r >> 7;
                    *r ^= *r << 17;
                    if (*r >> 11) as f64 / (1u64 << 53) as f64 <= corrupt {
                        let i = (*r % n as u64) as usize;
                        buf[i] ^= 0x5A;
                    }
                }
            }
            if to.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
        let _ = to.shutdown().await;
    }
}
