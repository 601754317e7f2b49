//! Starting a node: its configuration, its data backend and path, and the memory check
//! every driver makes before anything starts.

use crate::{FaultPlan, NodeError, Unsupported};

use kvferry_core::{Config, EndpointInfo};
use kvferry_memory::MemoryMap;

/// Everything needed to start a node (any driver).
#[derive(Clone, Debug)]
pub struct NodeConfig {
    /// The core's knobs.
    pub core: Config,
    /// Who this endpoint is.
    pub info: EndpointInfo,
    /// Data connections opened per session (operations are spread over them).
    pub data_connections: usize,
    /// Seed of the core's random choices.
    pub seed: u64,
    /// Injected data-path faults (demos and tests only; `None` in production).
    pub faults: Option<FaultPlan>,
    /// Which data plane carries the operations.
    pub backend: DataBackend,
    /// Whether sessions with peers on this host take the same-host path.
    pub same_host: crate::SameHost,
    /// TLS on every control and data connection (`None`: plain TCP). The cluster-token
    /// proofs of the handshake run inside it either way.
    pub tls: Option<kvferry_tcp::TlsFiles>,
    /// How long a plain TCP connection's reads keep calling `recv` after its last bytes
    /// before they wait on the runtime's poller ([`kvferry_tcp::polled::Polled`]): a small
    /// operation's round trip then costs syscalls, not a parked thread's wake-up. A glommio
    /// shard spins at most this long, and only where it is pinned (its executor parks at
    /// once elsewhere). Zero: one try, then the poller.
    pub read_spin: std::time::Duration,
}

/// The default [`NodeConfig::read_spin`].
pub const DEFAULT_READ_SPIN: std::time::Duration = std::time::Duration::from_micros(50);

/// The longest [`NodeConfig::read_spin`] `KVFERRY_READ_SPIN_US` may ask for: past a
/// millisecond a read is no faster for spinning, only busier.
const MAX_READ_SPIN_US: u64 = 1000;

/// Refuses a [`NodeConfig::read_spin`] past a millisecond, naming it.
pub fn check_read_spin(spin: std::time::Duration) -> Result<(), NodeError> {
    if spin > std::time::Duration::from_micros(MAX_READ_SPIN_US) {
        return Err(NodeError::Io(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            format!("read_spin {spin:?}: at most {MAX_READ_SPIN_US} us"),
        )));
    }
    Ok(())
}

/// [`NodeConfig::read_spin`] as `KVFERRY_READ_SPIN_US` among `vars` gives it (the default
/// without it); an error names the value that is no number of microseconds.
pub fn read_spin_from_vars<K: AsRef<str>, V: AsRef<str>>(
    vars: impl IntoIterator<Item = (K, V)>,
) -> Result<std::time::Duration, String> {
    let mut spin = DEFAULT_READ_SPIN;
    for (k, v) in vars {
        if k.as_ref() == "KVFERRY_READ_SPIN_US" {
            let us = v
                .as_ref()
                .trim()
                .parse::<u64>()
                .ok()
                .filter(|&us| us <= MAX_READ_SPIN_US)
                .ok_or_else(|| {
                    format!(
                        "KVFERRY_READ_SPIN_US={:?}: not a number of microseconds up to {MAX_READ_SPIN_US}",
                        v.as_ref()
                    )
                })?;
            spin = std::time::Duration::from_micros(us);
        }
    }
    Ok(spin)
}

/// Which data plane carries a node's operations (the control channel is TCP either way).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum DataBackend {
    /// Data connections over TCP (every driver).
    #[default]
    Tcp,
    /// One-sided RDMA WRITEs on an RC queue pair per session (a driver built with its
    /// `rdma` feature); a node that cannot open the device refuses to start, naming why.
    Rdma {
        /// The device to open (`None`: the one nearest the node's memory).
        device: Option<String>,
        /// Its port (usually 1).
        port: u8,
    },
    /// RDMA where this host can (a build with RDMA, rdma-core, a device, memory it can
    /// register), TCP otherwise, said at start; either way a session moves over RDMA only
    /// where its peer does too.
    Auto {
        /// The device to open (`None`: the one nearest the node's memory).
        device: Option<String>,
        /// Its port (usually 1).
        port: u8,
    },
}

impl DataBackend {
    /// Whether the node asks for RDMA, required or where it can.
    pub fn wants_rdma(&self) -> bool {
        !matches!(self, DataBackend::Tcp)
    }
}

/// The path one session's operations take, as logged when it is chosen and published as
/// `kvferry_session_path{path}`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum DataPath {
    /// TCP data connections from and into host memory.
    Tcp,
    /// TCP data connections, this node's device memory staged through host buffers.
    TcpStaged,
    /// One-sided RDMA WRITEs from and into host memory.
    Rdma,
    /// One-sided RDMA WRITEs with this node's device memory registered directly (dma-buf).
    RdmaDmaBuf,
    /// Same host: cross-memory attach (`process_vm_writev`) into the decode's memory.
    Cma,
    /// Same host, device memory: copies on the prefill's GPU into the decode's device
    /// memory mapped through CUDA IPC (host regions, if any, by cross-memory attach).
    CudaIpc,
}

impl DataPath {
    /// The label in logs and metrics.
    pub fn as_str(self) -> &'static str {
        match self {
            DataPath::Tcp => "tcp",
            DataPath::TcpStaged => "tcp_staged",
            DataPath::Rdma => "rdma",
            DataPath::RdmaDmaBuf => "rdma_dmabuf",
            DataPath::Cma => "cma",
            DataPath::CudaIpc => "cuda_ipc",
        }
    }

    /// Whether the path is TCP.
    pub fn is_tcp(self) -> bool {
        matches!(self, DataPath::Tcp | DataPath::TcpStaged)
    }
}

/// The `Transport` payload by which a node says it moves a session's data over TCP (no RDMA
/// for this session: a TCP node, or device memory its NIC cannot register); a peer that
/// offered RDMA moves that session over TCP too. `docs/PROTOCOL.md`, "Data path".
pub const TCP_PATH: [u8; 1] = [0];

/// Refuses, before anything starts, memory the data plane cannot reach: a device region
/// without a copy engine. Never a crash, never a CPU read of a device address. Over RDMA,
/// device memory the NIC cannot register moves staged over TCP (the RDMA adapter decides).
pub fn check_memory(
    memory: &MemoryMap,
    backend: &DataBackend,
    checksum: bool,
) -> Result<(), NodeError> {
    if checksum
        && matches!(backend, DataBackend::Rdma { .. })
        && memory.device_regions().next().is_some()
    {
        return Err(NodeError::Unsupported(Unsupported::ChecksumOverRdmaDevice));
    }
    if let Some((region, kind)) = memory.unreachable_region() {
        return Err(NodeError::UnreachableMemory {
            region,
            kind,
            fix: "register it with a copy engine (MemoryMap::with_staging; the CUDA engine of kvferry-gpu), or register host memory",
        });
    }
    if let (Some(staging), Some((region, kind))) =
        (memory.staging(), memory.device_regions().next())
    {
        let config = staging.config();
        tracing::info!(
            ?region,
            %kind,
            engine = staging.engine().name(),
            buffers = config.buffers,
            buffer_bytes = config.buffer_bytes,
            rdma = backend.wants_rdma(),
            "device memory staged through host buffers where it moves over TCP"
        );
    }
    Ok(())
}

/// A build without RDMA: `Auto` moves every session over TCP (said at start), `Rdma` is
/// refused.
pub fn tcp_only(backend: &DataBackend) -> Result<(), NodeError> {
    match backend {
        DataBackend::Tcp => Ok(()),
        DataBackend::Auto { .. } => {
            tracing::info!(target: START_TARGET, "this build has no RDMA: every session moves over TCP");
            Ok(())
        }
        DataBackend::Rdma { .. } => Err(NodeError::Unsupported(crate::Unsupported::RdmaNotBuilt)),
    }
}

/// The `tracing` target of a node's start line, shown at `info` by the CLI's and Python's
/// default filter (`warn,kvferry::start=info`).
pub const START_TARGET: &str = "kvferry::start";

/// Logs the one line that says what a node runs: role and rank, runtime, data plane, where
/// its KV lives (and the staging pool device memory moves through), the checksum, TLS and
/// what its cluster token is.
pub fn log_start(runtime: &str, config: &NodeConfig, memory: &MemoryMap) {
    let info = &config.info;
    let plane = match &config.backend {
        DataBackend::Tcp => format!("tcp x{}", config.data_connections),
        DataBackend::Rdma { device, port } => {
            format!(
                "rdma {}:{port}",
                device.as_deref().unwrap_or("nearest device")
            )
        }
        DataBackend::Auto { device, port } => format!(
            "auto: rdma {}:{port} where it can, else tcp x{}",
            device.as_deref().unwrap_or("nearest device"),
            config.data_connections
        ),
    };
    let kv = match memory.device_regions().next() {
        Some((_, kind)) => kind.to_string(),
        None => "host".to_owned(),
    };
    let staging = memory.staging().map_or("none".to_owned(), |s| {
        let c = s.config();
        format!(
            "{} x {} B ({})",
            c.buffers,
            c.buffer_bytes,
            s.engine().name()
        )
    });
    let token = if info.token.is_empty() {
        "none (loopback listeners only)"
    } else if info.token == kvferry_core::auth::DEMO_TOKEN {
        "the demo token (loopback listeners only)"
    } else {
        "set"
    };
    tracing::info!(
        target: START_TARGET,
        role = ?info.role,
        rank = info.rank,
        node = %info.node,
        runtime,
        data_plane = %plane,
        kv = %kv,
        staging = %staging,
        checksum = if config.core.checksum { "on" } else { "off" },
        tls = if config.tls.is_some() { "on" } else { "off" },
        token,
        "kvferry node started"
    );
}
