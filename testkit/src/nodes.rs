//! Starting nodes of either runtime and backend, and the one node type the CLI and tests drive.

use crate::{mix, Report, Shape};
use kvferry_core::{Config, Incarnation, NodeId, Role};
use kvferry_glommio::ShardConfig;
use kvferry_memory::MemoryMap;
use kvferry_tokio::{Node, NodeConfig, NodeError};
use std::sync::Arc;
use std::time::Instant;

/// Builds a node config for one side of the demo or the split commands.
pub fn node_config(role: Role, shape: &Shape, core: Config, token: &[u8], seed: u64) -> NodeConfig {
    let mut info = kvferry_core::EndpointInfo::new(
        role,
        NodeId(
            seed ^ if role == Role::Prefill {
                0x5052
            } else {
                0x4445
            },
        ),
        Incarnation(
            mix(seed ^ std::process::id() as u64 ^ Instant::now().elapsed().as_nanos() as u64) | 1,
        ),
        shape.layout(),
    );
    info.token = token.to_vec();
    NodeConfig {
        core,
        info,
        data_connections: shape.data_connections,
        seed,
        faults: None,
        backend: Default::default(),
        same_host: Default::default(),
        tls: None,
        // `KVFERRY_READ_SPIN_US`; the CLI refuses a bad value before it gets here.
        read_spin: kvferry_tokio::read_spin_from_vars(std::env::vars())
            .unwrap_or(kvferry_tokio::DEFAULT_READ_SPIN),
    }
}

/// The counters of a finished run folded into its report.
pub fn add_counters(
    report: &mut Report,
    prefill: &kvferry_core::Counters,
    decode: &kvferry_core::Counters,
) {
    report.retries = prefill.retries + decode.retries;
    report.sessions_blacklisted = prefill.sessions_blacklisted + decode.sessions_blacklisted;
    report.sessions_recovered = prefill.sessions_recovered + decode.sessions_recovered;
}

/// Faults the demo injects, reproducibly for a seed.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct DemoFaults {
    /// Probability that a write batch resets its data connection (a transient data-path
    /// failure for every operation in flight on it).
    pub fault_rate: f64,
    /// Probability that decode aborts a room mid-flight.
    pub abort_rate: f64,
    /// Seed of every decision.
    pub seed: u64,
}

/// Which data-plane backend moves the bytes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Backend {
    /// TCP (every build).
    Tcp,
    /// RDMA verbs (builds with the `rdma` feature, hosts with a device).
    Rdma,
    /// Same-host copies with a peer on this host, else RDMA where this build and host can,
    /// else TCP (said at start and per session).
    Auto,
    /// Same-host copies with a peer on this host, TCP otherwise (said per session).
    SameHost,
}

impl Backend {
    /// Parses `tcp` or `rdma`, and checks that this build and host can run it: an RDMA request
    /// gets a typed answer saying what is missing and offering TCP.
    pub fn parse(name: &str) -> Result<Backend, String> {
        match name {
            "tcp" => Ok(Backend::Tcp),
            "rdma" => rdma_available().map(|()| Backend::Rdma),
            "auto" => Ok(Backend::Auto),
            "same-host" | "same_host" => Ok(Backend::SameHost),
            other => Err(format!(
                "unknown backend {other:?} (tcp, rdma, same-host or auto)"
            )),
        }
    }

    /// The node config's data plane for this backend (RDMA: `device`, or the first one, port
    /// 1).
    pub fn data_backend(self, device: Option<String>) -> kvferry_tokio::DataBackend {
        match self {
            Backend::Tcp => kvferry_tokio::DataBackend::Tcp,
            Backend::Rdma => kvferry_tokio::DataBackend::Rdma { device, port: 1 },
            Backend::Auto => kvferry_tokio::DataBackend::Auto { device, port: 1 },
            Backend::SameHost => kvferry_tokio::DataBackend::Tcp,
        }
    }

    /// Whether sessions with a peer on this host take the same-host path.
    pub fn same_host(self) -> kvferry_tokio::SameHost {
        match self {
            Backend::Auto => kvferry_tokio::SameHost::Auto,
            Backend::SameHost => kvferry_tokio::SameHost::Required,
            Backend::Tcp | Backend::Rdma => kvferry_tokio::SameHost::Off,
        }
    }
}

#[cfg(not(feature = "rdma"))]
pub(crate) fn rdma_available() -> Result<(), String> {
    Err("this kvferry was built without RDMA support: rebuild with `cargo build --release -p kvferry-cli --features rdma` (needs libibverbs-dev, see scripts/install-deps.sh), or run the same command with --backend tcp".to_owned())
}

#[cfg(feature = "rdma")]
pub(crate) fn rdma_available() -> Result<(), String> {
    match kvferry_rdma::device::Device::open(None) {
        Err(e) => Err(format!("RDMA is not available on this host: {e}")),
        Ok(_) => Ok(()),
    }
}

/// Which driver runs a node.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Runtime {
    /// The tokio driver (one endpoint).
    Tokio,
    /// The thread-per-core glommio driver with this many shards.
    Glommio {
        /// Executors (one endpoint each).
        shards: usize,
        /// Pin each shard to a core of its own ([`ShardConfig::pin`]).
        pin: bool,
    },
}

impl Runtime {
    /// Parses `tokio` or `glommio` (with `shards`, pinned or not, for glommio).
    pub fn parse(name: &str, shards: usize, pin: bool) -> Result<Runtime, String> {
        match name {
            "tokio" => Ok(Runtime::Tokio),
            "glommio" => Ok(Runtime::Glommio {
                shards: shards.max(1),
                pin,
            }),
            other => Err(format!("unknown runtime {other:?} (tokio or glommio)")),
        }
    }

    /// The runtime's name.
    pub fn name(&self) -> &'static str {
        match self {
            Runtime::Tokio => "tokio",
            Runtime::Glommio { .. } => "glommio",
        }
    }

    /// Starts a node of this runtime (inside a tokio runtime for `Tokio`).
    pub fn start(&self, cfg: NodeConfig, memory: Arc<MemoryMap>) -> Result<Node, NodeError> {
        self.start_with(cfg, memory, false)
    }

    /// Starts one node of a pair that shares this process (a demo or bench prefill and
    /// decode of this runtime). Both nodes' shards share the process's cores, so a shard
    /// spinning before it parks takes a core from another node's shard: such shards park at
    /// once (the 2-core scaling sweep ran 3-37 % more rooms/s so).
    pub fn start_paired(&self, cfg: NodeConfig, memory: Arc<MemoryMap>) -> Result<Node, NodeError> {
        self.start_with(cfg, memory, true)
    }

    fn start_with(
        &self,
        cfg: NodeConfig,
        memory: Arc<MemoryMap>,
        paired: bool,
    ) -> Result<Node, NodeError> {
        Ok(match *self {
            Runtime::Tokio => kvferry_tokio::start(cfg, memory)?,
            Runtime::Glommio { shards, pin } => {
                let cores = std::thread::available_parallelism().map_or(1, |c| c.get());
                let mut config = ShardConfig {
                    shards,
                    pin,
                    ..ShardConfig::default()
                };
                if paired || shards > cores {
                    config.spin_before_park = std::time::Duration::ZERO;
                }
                kvferry_glommio::start(cfg, memory, config)?
            }
        })
    }
}

/// The runtime label of a pair: one name, or `prefill/decode` when they differ.
pub fn runtime_label(prefill: &str, decode: &str) -> String {
    if prefill == decode {
        prefill.to_owned()
    } else {
        format!("{prefill}/{decode}")
    }
}

/// The distinct data paths of `node`'s sessions, joined by `+` (`none` without a session).
pub async fn path_label(node: &Node) -> String {
    let mut labels: Vec<&str> = node
        .data_paths()
        .await
        .into_iter()
        .map(|(_, _, path)| path.as_str())
        .collect();
    labels.sort_unstable();
    labels.dedup();
    if labels.is_empty() {
        "none".to_owned()
    } else {
        labels.join("+")
    }
}

#[cfg(test)]
mod backend_tests {
    use super::Backend;

    #[test]
    fn tcp_is_always_available() {
        assert_eq!(Backend::parse("tcp"), Ok(Backend::Tcp));
        assert_eq!(Backend::parse("auto"), Ok(Backend::Auto));
    }

    #[test]
    fn rdma_without_a_build_or_a_device_is_a_typed_refusal_that_offers_tcp() {
        // With the default build: not built in. With `rdma` on a host without a device (CI):
        // no kernel support or no device. Either way the answer says how to run over TCP.
        match Backend::parse("rdma") {
            Ok(b) => eprintln!("RDMA usable here: {b:?}"),
            Err(why) => assert!(why.contains("--backend tcp"), "{why}"),
        }
        assert!(Backend::parse("carrier-pigeon").is_err());
    }
}
