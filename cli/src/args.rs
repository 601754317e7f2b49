//! The arguments every node command shares (the KV shape, the node's knobs) and what they
//! start: the configuration, the metrics endpoint, the node itself, the room printers.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::Args;
use kvferry_core::{Config, Role};
use kvferry_memory::MemoryMap;
use kvferry_testkit::{node_config, Node, Progress, Report, RoomEnd, Runtime, Shape};

#[derive(Args, Clone)]
pub(crate) struct ShapeArgs {
    /// Model layers.
    #[arg(long, default_value_t = 8)]
    pub(crate) layers: u16,
    /// KV planes per layer (2 = K and V).
    #[arg(long, default_value_t = 2)]
    pub(crate) planes: u8,
    /// Bytes per page per layer and plane.
    #[arg(long, default_value_t = 16384)]
    pub(crate) page_bytes: u32,
    /// Pages per room (the pages a decode grants and a prefill sends).
    #[arg(long, default_value_t = 32)]
    pub(crate) pages_per_room: u32,
    /// Decode: room pages it already holds (a cached prefix), asked as `skip_pages`: each
    /// room is prefix + pages-per-room pages long and only the last pages-per-room move.
    #[arg(long, default_value_t = 0)]
    pub(crate) prefix_pages: u32,
    /// Chunks per room.
    #[arg(long, default_value_t = 1)]
    pub(crate) chunks: u32,
    /// Rooms in flight at once.
    #[arg(long, default_value_t = 16)]
    pub(crate) concurrency: usize,
    /// Send layer by layer: each layer moves as soon as its forward pass is done.
    #[arg(long)]
    pub(crate) layerwise: bool,
    /// Simulated forward time per layer and chunk, in microseconds (both modes, to compare).
    #[arg(long, default_value_t = 0)]
    pub(crate) layer_compute_us: u64,
    /// Data connections per session (decode and demo: the decode opens them; default 2).
    #[arg(long)]
    pub(crate) data_connections: Option<usize>,
}

impl ShapeArgs {
    pub(crate) fn shape(&self) -> Result<Shape, String> {
        let shape = Shape {
            layers: self.layers,
            planes: self.planes,
            page_bytes: self.page_bytes,
            pages_per_room: self.pages_per_room,
            prefix_pages: self.prefix_pages,
            chunks: self.chunks,
            concurrency: self.concurrency,
            layerwise: self.layerwise,
            layer_compute: Duration::from_micros(self.layer_compute_us),
            data_connections: self.data_connections.unwrap_or(2),
        };
        shape.check().map_err(|e| format!("--page-bytes: {e}"))?;
        Ok(shape)
    }
}

#[derive(Args, Clone)]
pub(crate) struct CommonArgs {
    /// Cluster token shared by every node.
    #[arg(
        long,
        env = "KVFERRY_TOKEN",
        default_value = "kvferry-demo",
        hide_env_values = true
    )]
    pub(crate) token: String,
    /// TOML file of core knobs (keys as in KVFERRY_* without the prefix, any case).
    #[arg(long)]
    pub(crate) config: Option<PathBuf>,
    /// TLS on every connection: this node's certificate chain (PEM). Needs --tls-key and
    /// --tls-ca; either runtime.
    #[arg(long, env = "KVFERRY_TLS_CERT", requires_all = ["tls_key", "tls_ca"])]
    pub(crate) tls_cert: Option<PathBuf>,
    /// TLS: this node's private key (PEM).
    #[arg(long, env = "KVFERRY_TLS_KEY", requires = "tls_cert")]
    pub(crate) tls_key: Option<PathBuf>,
    /// TLS: the CA certificates peers' certificates must chain to (PEM).
    #[arg(long, env = "KVFERRY_TLS_CA", requires = "tls_cert")]
    pub(crate) tls_ca: Option<PathBuf>,
    /// TLS: the name a listener's certificate must carry (DNS name or IP address).
    #[arg(long, env = "KVFERRY_TLS_SERVER_NAME", default_value = "kvferry")]
    pub(crate) tls_server_name: String,
    /// Checksum every write end to end (XXH3-64, verified before it is acknowledged): a
    /// corrupted page fails its room with checksum_mismatch. Both sides must agree.
    #[arg(long)]
    pub(crate) checksum: bool,
    /// Serve Prometheus metrics on this address.
    #[arg(long)]
    pub(crate) metrics_addr: Option<SocketAddr>,
    /// Print the report as one JSON object.
    #[arg(long)]
    pub(crate) json: bool,
    /// The driver: tokio, or glommio (thread-per-core, io_uring).
    #[arg(long, default_value = "tokio")]
    pub(crate) runtime: String,
    /// Shards (executors, one per core) for --runtime glommio.
    #[arg(long, default_value_t = 1)]
    pub(crate) shards: usize,
    /// With --runtime glommio: pin each shard to a core of its own (only where the node owns
    /// its cores; shards of a pinned node cannot move away from a busy core).
    #[arg(long)]
    pub(crate) pin: bool,
    /// The data-plane backend: tcp, rdma (builds with the `rdma` feature; either runtime),
    /// same-host (cross-memory attach with a peer on this host, TCP otherwise), or auto
    /// (same-host where the peer shares this host, else RDMA where this build and host can,
    /// else TCP; said at start and per session).
    #[arg(long, default_value = "tcp")]
    pub(crate) backend: String,
    /// With --backend rdma or auto: the RDMA device to use (default: the one nearest the KV).
    #[arg(long)]
    pub(crate) rdma_device: Option<String>,
}

impl CommonArgs {
    pub(crate) fn runtime(&self) -> Result<Runtime, String> {
        kvferry_testkit::Backend::parse(&self.backend)?;
        Runtime::parse(&self.runtime, self.shards, self.pin)
    }

    /// The TLS files, when --tls-cert (and with it --tls-key and --tls-ca) was given.
    pub(crate) fn tls(&self) -> Option<kvferry_tcp::TlsFiles> {
        Some(kvferry_tcp::TlsFiles {
            cert: self.tls_cert.clone()?,
            key: self.tls_key.clone()?,
            ca: self.tls_ca.clone()?,
            server_name: self.tls_server_name.clone(),
        })
    }

    pub(crate) fn data_backend(&self) -> Result<kvferry_testkit::DataBackend, String> {
        Ok(kvferry_testkit::Backend::parse(&self.backend)?.data_backend(self.rdma_device.clone()))
    }

    /// Whether sessions with a peer on this host take the same-host path (`same-host`, `auto`).
    pub(crate) fn same_host(&self) -> Result<kvferry_testkit::SameHost, String> {
        Ok(kvferry_testkit::Backend::parse(&self.backend)?.same_host())
    }
}

/// The core's knobs: `KVFERRY_*` variables, then the `--config` file, then flags.
pub(crate) fn load_config(common: &CommonArgs) -> Result<Config, String> {
    let mut config = Config::from_env().map_err(|e| e.to_string())?;
    // The driver's own knob (read by `node_config`): refused here, before any node starts.
    kvferry_testkit::read_spin_from_vars(std::env::vars())?;
    if let Some(path) = common.config.as_ref() {
        let text = std::fs::read_to_string(path)
            .map_err(|e| format!("cannot read {}: {e}", path.display()))?;
        let table: toml::Table = text
            .parse()
            .map_err(|e| format!("{}: {e}", path.display()))?;
        for (key, value) in table {
            let value = match value {
                toml::Value::Integer(i) => i.to_string(),
                toml::Value::Boolean(b) => b.to_string(),
                toml::Value::String(s) => s,
                other => {
                    return Err(format!(
                        "{}: {key} must be an integer, not {other}",
                        path.display()
                    ))
                }
            };
            config
                .set(&key, &value)
                .map_err(|why| format!("{}: {key} = {value}: {why}", path.display()))?;
        }
        config.validate().map_err(|e| e.to_string())?;
    }
    if common.checksum {
        config.checksum = true;
    }
    Ok(config)
}

pub(crate) fn install_metrics(addr: Option<SocketAddr>) -> Result<(), String> {
    if let Some(addr) = addr {
        metrics_exporter_prometheus::PrometheusBuilder::new()
            .with_http_listener(addr)
            .install()
            .map_err(|e| format!("cannot serve metrics on {addr}: {e}"))?;
    }
    Ok(())
}

/// Loads the configuration, serves metrics if asked, and starts a node of `role` with its own
/// host memory for `shape`.
pub(crate) fn start_node(
    role: Role,
    shape: &ShapeArgs,
    common: &CommonArgs,
) -> Result<(Node, Shape), String> {
    let runtime = common.runtime()?;
    let config = load_config(common)?;
    install_metrics(common.metrics_addr)?;
    let shape = shape.shape()?;
    let mut cfg = node_config(role, &shape, config, common.token.as_bytes(), rand_seed());
    cfg.backend = common.data_backend()?;
    cfg.same_host = common.same_host()?;
    cfg.tls = common.tls();
    let node = runtime
        .start(cfg, Arc::new(MemoryMap::allocate(shape.layout())))
        .map_err(|e| e.to_string())?;
    Ok((node, shape))
}

pub(crate) fn rand_seed() -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(1);
    t ^ (u64::from(std::process::id()) << 32)
}

/// Appends each ended room to `path` (then tells `inner`, the progress bar, if any).
pub(crate) fn room_logger(
    path: &std::path::Path,
    inner: Option<Progress>,
) -> Result<Progress, String> {
    use std::io::Write;
    let file =
        std::fs::File::create(path).map_err(|e| format!("--room-log {}: {e}", path.display()))?;
    let file = std::sync::Mutex::new(std::io::LineWriter::new(file));
    Ok(Arc::new(move |e: &RoomEnd| {
        if let Ok(mut f) = file.lock() {
            let now = std::time::UNIX_EPOCH.elapsed().unwrap_or_default();
            let _ = writeln!(f, "{} {} {}", now.as_millis(), e.room.0, e.outcome);
        }
        if let Some(p) = &inner {
            p(e);
        }
    }))
}

pub(crate) fn progress_bar(
    rooms: u64,
    json: bool,
) -> (Option<Progress>, Option<indicatif::ProgressBar>) {
    if json {
        return (None, None);
    }
    let bar = indicatif::ProgressBar::new(rooms);
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "{bar:40} {pos}/{len} rooms {elapsed_precise} {per_sec}",
    ) {
        bar.set_style(style);
    }
    let b = bar.clone();
    (
        Some(Arc::new(move |e: &RoomEnd| b.set_position(e.finished))),
        Some(bar),
    )
}

pub(crate) fn print_report(report: &Report, json: bool) {
    if json {
        println!("{}", report.to_json());
    } else {
        println!("kvferry report\n{}", report.table());
    }
}
