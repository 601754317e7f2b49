//! `kvferry`: demo, prefill, decode, proxy and bench: argument parsing and printing over the
//! reference embedder in `kvferry-testkit`.

use kvferry_testkit::bench;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Duration;

use clap::{Args, Parser, Subcommand};
use kvferry_core::{Config, Role};
use kvferry_driver::KvNode;
use kvferry_memory::MemoryMap;
use kvferry_testkit::{
    add_counters, node_config, run_decode, run_demo, serve_prefill, AnyNode, DecodeRun, DemoFaults,
    Progress, Report, RoomEnd, Runtime, Shape,
};

#[derive(Parser)]
#[command(
    name = "kvferry",
    version,
    about = "Move LLM KV caches from prefill to decode, correctly."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run a prefill and a decode node on loopback and move real bytes end to end.
    Demo {
        #[command(flatten)]
        shape: ShapeArgs,
        #[command(flatten)]
        common: CommonArgs,
        /// Rooms to move.
        #[arg(long, default_value_t = 256)]
        rooms: u64,
        /// Probability that a write batch resets its data connection (transient failures).
        #[arg(long, default_value_t = 0.0)]
        fault_rate: f64,
        /// Probability that decode aborts a room mid-flight.
        #[arg(long, default_value_t = 0.0)]
        abort_rate: f64,
        /// Seed of the injected faults and aborts.
        #[arg(long, default_value_t = 1)]
        seed: u64,
        /// Run the overlap demo instead: one batch whose forward pass runs layer by layer
        /// (--layer-compute-us each, 20 ms when 0), moved layerwise and then as one whole
        /// batch, timed per layer against the ideal overlap.
        #[arg(long)]
        overlap: bool,
        /// Rooms in the overlap demo's batch.
        #[arg(long, default_value_t = 16)]
        batch: u32,
        /// The overlap demo with the KV regions in GPU memory, a CUDA kernel per layer and
        /// layer readiness from CUDA events (builds with the `gpu` feature, hosts with an
        /// NVIDIA GPU).
        #[arg(long)]
        gpu: bool,
        /// Write the overlap demo's compute/transfer timeline as SVG to this file (implies
        /// --overlap).
        #[arg(long)]
        timeline: Option<PathBuf>,
    },
    /// Serve synthetic KV as a prefill node.
    Prefill {
        /// Address to listen on.
        #[arg(long)]
        listen: SocketAddr,
        #[command(flatten)]
        shape: ShapeArgs,
        #[command(flatten)]
        common: CommonArgs,
    },
    /// Act as a decode node: request rooms from a prefill node and verify every byte.
    Decode {
        /// The prefill node's address; a sharded (glommio) prefill: every shard's address,
        /// comma-separated, in the order it printed them.
        #[arg(long, value_delimiter = ',', required = true)]
        connect: Vec<SocketAddr>,
        /// Rooms to request.
        #[arg(long, default_value_t = 256)]
        rooms: u64,
        /// First room id. Default: a fresh range for every run, so a re-run or a restarted
        /// decode never reuses room ids that prefill already concluded (a reused id is
        /// refused with `room_id_reused`).
        #[arg(long)]
        first_room: Option<u64>,
        /// Write one line per room as it ends: wall-clock milliseconds since the Unix epoch
        /// (to line up with outside events), room id, outcome.
        #[arg(long)]
        room_log: Option<PathBuf>,
        #[command(flatten)]
        shape: ShapeArgs,
        #[command(flatten)]
        common: CommonArgs,
    },
    /// A fault-injecting TCP proxy between two nodes (loopback only), for trying failures.
    Proxy {
        /// Loopback address to listen on (point the decode's --connect here).
        #[arg(long)]
        listen: SocketAddr,
        /// The node behind the proxy (the prefill's --listen address).
        #[arg(long)]
        upstream: SocketAddr,
        /// Delay added to every forwarded chunk, in milliseconds.
        #[arg(long, default_value_t = 0)]
        delay_ms: u64,
        /// Probability that a forwarded chunk has one byte flipped.
        #[arg(long, default_value_t = 0.0)]
        corrupt: f64,
        /// Probability that a forwarded chunk resets its connection instead.
        #[arg(long, default_value_t = 0.0)]
        reset: f64,
        /// Black-hole both directions for this many milliseconds every --blackhole-every-ms.
        #[arg(long, default_value_t = 0)]
        blackhole_ms: u64,
        /// Period of the black holes, in milliseconds.
        #[arg(long, default_value_t = 10_000)]
        blackhole_every_ms: u64,
        /// Hold one direction only during the black holes: "up" (to upstream) or "down".
        #[arg(long)]
        stall: Option<String>,
        /// Truncate the next chunk (and close its connection) once per black-hole period.
        #[arg(long)]
        truncate: bool,
        /// Seed of the corrupt and reset decisions.
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
    /// Measure the TCP data plane against a plain socket pair.
    Bench {
        /// Operations per workload, runtime and round (the 4 KiB round trip runs 100x as many).
        #[arg(long, default_value_t = 7)]
        iterations: usize,
        /// Interleaved rounds per workload: each runs raw, tokio and glommio back to back, in
        /// each of the six orders in turn, so load that drifts slows all of them alike.
        #[arg(long, default_value_t = 6)]
        rounds: usize,
        /// Which data plane to measure against raw TCP: tokio, glommio, or all (with --tls or
        /// --backend rdma: the driver both nodes run on, tokio or glommio).
        #[arg(long, default_value = "tokio")]
        runtime: String,
        /// The data-plane backend: tcp, or rdma (builds with the `rdma` feature): with rdma,
        /// room workloads through two nodes over TCP and over RDMA, side by side.
        #[arg(long, default_value = "tcp")]
        backend: String,
        /// With --backend rdma: the RDMA device to use (default: the first one).
        #[arg(long)]
        rdma_device: Option<String>,
        /// Instead of the data-plane workloads: room lifecycles per second through the
        /// glommio driver with 1, 2, ... shards up to the number of cores.
        #[arg(long)]
        scaling: bool,
        /// Instead of the data-plane workloads: how late the GPU layer waiter reports a
        /// completed layer, and its CPU cost, per poll policy (host events; no GPU needed).
        #[arg(long)]
        layer_events: bool,
        /// Instead of the data-plane workloads: the copy engine moving staged batches
        /// (contiguous, scattered 4 KiB pages, 256 B rows at a stride) against one 64 MiB
        /// copy, both ways; the host engine, or with --gpu the CUDA engine on GPU 0.
        #[arg(long)]
        copy_engine: bool,
        /// With --copy-engine: the CUDA engine on GPU 0 (builds with the `gpu` feature).
        #[arg(long)]
        gpu: bool,
        /// Rooms per point of the scaling sweep.
        #[arg(long, default_value_t = 20000)]
        scaling_rooms: u64,
        /// With --scaling: the most shards to sweep to (default: the number of cores).
        #[arg(long)]
        shards: Option<usize>,
        /// Instead of the data-plane workloads: room workloads through two nodes with TLS off
        /// and on, side by side (a throwaway CA; every byte verified).
        #[arg(long)]
        tls: bool,
        /// With --tls or --backend rdma: one round with a sixteenth of each workload's rooms,
        /// to check the path end to end on a slow link (noisier figures).
        #[arg(long)]
        quick: bool,
        /// Run one data-plane workload alone, for instance under a profiler.
        #[arg(long, value_parser = clap::builder::PossibleValuesParser::new(bench::workload_names()))]
        workload: Option<String>,
        /// Print one JSON object per workload instead of a table.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Args, Clone)]
struct ShapeArgs {
    /// Model layers.
    #[arg(long, default_value_t = 8)]
    layers: u16,
    /// KV planes per layer (2 = K and V).
    #[arg(long, default_value_t = 2)]
    planes: u8,
    /// Bytes per page per layer and plane.
    #[arg(long, default_value_t = 16384)]
    page_bytes: u32,
    /// Pages per room (the pages a decode grants and a prefill sends).
    #[arg(long, default_value_t = 32)]
    pages_per_room: u32,
    /// Decode: room pages it already holds (a cached prefix), asked as `skip_pages`: each
    /// room is prefix + pages-per-room pages long and only the last pages-per-room move.
    #[arg(long, default_value_t = 0)]
    prefix_pages: u32,
    /// Chunks per room.
    #[arg(long, default_value_t = 1)]
    chunks: u32,
    /// Rooms in flight at once.
    #[arg(long, default_value_t = 16)]
    concurrency: usize,
    /// Send layer by layer: each layer moves as soon as its forward pass is done.
    #[arg(long)]
    layerwise: bool,
    /// Simulated forward time per layer and chunk, in microseconds (both modes, to compare).
    #[arg(long, default_value_t = 0)]
    layer_compute_us: u64,
    /// Data connections per session (decode and demo: the decode opens them; default 2).
    #[arg(long)]
    data_connections: Option<usize>,
}

impl ShapeArgs {
    fn shape(&self) -> Result<Shape, String> {
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
struct CommonArgs {
    /// Cluster token shared by every node.
    #[arg(
        long,
        env = "KVFERRY_TOKEN",
        default_value = "kvferry-demo",
        hide_env_values = true
    )]
    token: String,
    /// TOML file of core knobs (keys as in KVFERRY_* without the prefix, any case).
    #[arg(long)]
    config: Option<PathBuf>,
    /// TLS on every connection: this node's certificate chain (PEM). Needs --tls-key and
    /// --tls-ca; either runtime.
    #[arg(long, env = "KVFERRY_TLS_CERT", requires_all = ["tls_key", "tls_ca"])]
    tls_cert: Option<PathBuf>,
    /// TLS: this node's private key (PEM).
    #[arg(long, env = "KVFERRY_TLS_KEY", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// TLS: the CA certificates peers' certificates must chain to (PEM).
    #[arg(long, env = "KVFERRY_TLS_CA", requires = "tls_cert")]
    tls_ca: Option<PathBuf>,
    /// TLS: the name a listener's certificate must carry (DNS name or IP address).
    #[arg(long, env = "KVFERRY_TLS_SERVER_NAME", default_value = "kvferry")]
    tls_server_name: String,
    /// Checksum every write end to end (XXH3-64, verified before it is acknowledged): a
    /// corrupted page fails its room with checksum_mismatch. Both sides must agree.
    #[arg(long)]
    checksum: bool,
    /// Serve Prometheus metrics on this address.
    #[arg(long)]
    metrics_addr: Option<SocketAddr>,
    /// Print the report as one JSON object.
    #[arg(long)]
    json: bool,
    /// The driver: tokio, or glommio (thread-per-core, io_uring).
    #[arg(long, default_value = "tokio")]
    runtime: String,
    /// Shards (executors, one per core) for --runtime glommio.
    #[arg(long, default_value_t = 1)]
    shards: usize,
    /// With --runtime glommio: pin each shard to a core of its own (only where the node owns
    /// its cores; shards of a pinned node cannot move away from a busy core).
    #[arg(long)]
    pin: bool,
    /// The data-plane backend: tcp, rdma (builds with the `rdma` feature; either runtime),
    /// same-host (cross-memory attach with a peer on this host, TCP otherwise), or auto
    /// (same-host where the peer shares this host, else RDMA where this build and host can,
    /// else TCP; said at start and per session).
    #[arg(long, default_value = "tcp")]
    backend: String,
    /// With --backend rdma or auto: the RDMA device to use (default: the one nearest the KV).
    #[arg(long)]
    rdma_device: Option<String>,
}

impl CommonArgs {
    fn runtime(&self) -> Result<Runtime, String> {
        kvferry_testkit::Backend::parse(&self.backend)?;
        Runtime::parse(&self.runtime, self.shards, self.pin)
    }

    /// The TLS files, when --tls-cert (and with it --tls-key and --tls-ca) was given.
    fn tls(&self) -> Option<kvferry_tcp::TlsFiles> {
        Some(kvferry_tcp::TlsFiles {
            cert: self.tls_cert.clone()?,
            key: self.tls_key.clone()?,
            ca: self.tls_ca.clone()?,
            server_name: self.tls_server_name.clone(),
        })
    }

    fn data_backend(&self) -> Result<kvferry_testkit::DataBackend, String> {
        Ok(kvferry_testkit::Backend::parse(&self.backend)?.data_backend(self.rdma_device.clone()))
    }

    /// Whether sessions with a peer on this host take the same-host path (`same-host`, `auto`).
    fn same_host(&self) -> Result<kvferry_testkit::SameHost, String> {
        Ok(kvferry_testkit::Backend::parse(&self.backend)?.same_host())
    }
}

/// The core's knobs: `KVFERRY_*` variables, then the `--config` file, then flags.
fn load_config(common: &CommonArgs) -> Result<Config, String> {
    let mut config = Config::from_env().map_err(|e| e.to_string())?;
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

fn install_metrics(addr: Option<SocketAddr>) -> Result<(), String> {
    if let Some(addr) = addr {
        metrics_exporter_prometheus::PrometheusBuilder::new()
            .with_http_listener(addr)
            .install()
            .map_err(|e| format!("cannot serve metrics on {addr}: {e}"))?;
    }
    Ok(())
}

/// Prints one `bench --backend same-host` result: GB/s of each path and of memcpy, and the
/// ratios the same-host path is held to.
fn print_same_host_point(p: &kvferry_testkit::bench::SameHostPoint, json: bool) {
    let (cma, memcpy, tcp) = (p.gbps(p.same_host), p.gbps(p.memcpy), p.gbps(p.tcp));
    if json {
        println!(
            "{{\"workload\":\"{}\",\"bytes\":{},\"same_host_gbps\":{cma:.3},\"memcpy_gbps\":{memcpy:.3},\"tcp_gbps\":{tcp:.3},\"vs_memcpy\":{:.3},\"vs_tcp\":{:.3},\"clean\":{}}}",
            p.workload,
            p.bytes,
            cma / memcpy,
            cma / tcp,
            p.clean
        );
    } else {
        println!(
            "{:<22} same-host {cma:>6.2} GB/s   memcpy {memcpy:>6.2} GB/s   loopback tcp {tcp:>6.2} GB/s   same-host/memcpy {:.2}x   same-host/tcp {:.2}x{}",
            p.workload,
            cma / memcpy,
            cma / tcp,
            if p.clean { "" } else { "   NOT CLEAN" }
        );
    }
}

/// Prints one `bench --tls` or `--backend rdma` result: a workload over the two links named
/// `names`, and their ratio.
fn print_link_point(p: &bench::LinkPoint, names: [&str; 2], json: bool) {
    let [a, b] = names;
    let ratio = p.gbps[1] / p.gbps[0].max(1e-9);
    if json {
        let mut o =
            serde_json::json!({ "workload": p.workload, "runtime": p.runtime, "clean": p.clean });
        o[format!("{a}_gbps")] = p.gbps[0].into();
        o[format!("{b}_gbps")] = p.gbps[1].into();
        o[format!("{b}_vs_{a}")] = ratio.into();
        println!("{o}");
    } else {
        println!(
            "{:<28} {a} {:>7.3} GB/s  {b} {:>7.3} GB/s  {b}/{a} {:>6.3}  {}",
            p.workload,
            p.gbps[0],
            p.gbps[1],
            ratio,
            if p.clean {
                "every byte verified"
            } else {
                "LOST OR CORRUPTED PAGES"
            }
        );
    }
}

/// The copy-engine bench: the CUDA engine on GPU 0 with `gpu`, else the host engine.
fn copy_engine_figures(gpu: bool, iterations: usize) -> Result<Vec<bench::CopyFigure>, String> {
    if !gpu {
        return bench::copy_engine_host(iterations);
    }
    #[cfg(feature = "gpu")]
    return bench::copy_engine_cuda(iterations);
    #[cfg(not(feature = "gpu"))]
    Err("this kvferry was built without the gpu feature: build with --features gpu".to_owned())
}

/// An error if any workload of a link bench lost or corrupted a page.
fn link_points_clean(points: &[bench::LinkPoint]) -> Result<(), String> {
    if points.iter().any(|p| !p.clean) {
        return Err("pages were lost or corrupted".to_owned());
    }
    Ok(())
}

/// Appends each ended room to `path` (then tells `inner`, the progress bar, if any).
fn room_logger(path: &std::path::Path, inner: Option<Progress>) -> Result<Progress, String> {
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

fn progress_bar(rooms: u64, json: bool) -> (Option<Progress>, Option<indicatif::ProgressBar>) {
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

/// `demo --overlap`, `--timeline` or `--gpu`: layerwise against whole batch on one batch.
async fn overlap_demo(
    shape: &ShapeArgs,
    common: &CommonArgs,
    rooms: u32,
    gpu: bool,
    timeline: Option<PathBuf>,
) -> Result<(), String> {
    if rooms == 0 {
        return Err("--batch must be at least 1".to_owned());
    }
    let config = load_config(common)?;
    let runtime = common.runtime()?;
    let mut shape = shape.shape()?;
    let compute = if shape.layer_compute.is_zero() {
        Duration::from_millis(20)
    } else {
        shape.layer_compute
    };
    shape.layerwise = true;
    let batch = kvferry_testkit::overlap::Batch {
        shape,
        rooms,
        first_room: 1,
    };
    let report = if gpu {
        kvferry_testkit::gpu_overlap_demo(&batch, config, runtime, common.data_backend()?, compute)
            .await?
    } else {
        kvferry_testkit::overlap::run_overlap_demo(
            &batch,
            config,
            runtime,
            common.data_backend()?,
            compute,
        )
        .await?
    };
    if let Some(path) = &timeline {
        let runs: Vec<&kvferry_gpu::Timeline> = report.runs.iter().map(|r| &r.timeline).collect();
        std::fs::write(path, kvferry_gpu::Timeline::svg(&runs))
            .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    }
    if common.json {
        println!("{}", report.json());
    } else {
        print!("{}", report.text());
        if let Some(path) = &timeline {
            println!("timeline written to {}", path.display());
        }
    }
    if !report.clean() {
        return Err("the overlap demo lost or corrupted pages".to_owned());
    }
    Ok(())
}

fn print_report(report: &Report, json: bool) {
    if json {
        println!("{}", report.to_json());
    } else {
        println!("kvferry report\n{}", report.table());
    }
}

#[tokio::main]
async fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("KVFERRY_LOG")
                .unwrap_or_else(|_| "warn,kvferry::start=info".into()),
        )
        .with_ansi(std::io::IsTerminal::is_terminal(&std::io::stderr()))
        .with_writer(std::io::stderr)
        .init();
    let cli = Cli::parse();
    if let Err(e) = run(cli).await {
        eprintln!("kvferry: {e}");
        std::process::exit(1);
    }
}

/// Resolves on SIGINT (Ctrl-C) or SIGTERM (what systemd and Kubernetes send).
async fn stop_signal() {
    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()).ok();
    let terminate = async {
        match term.as_mut() {
            Some(t) => {
                t.recv().await;
            }
            None => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = terminate => {}
    }
}

/// A room-id range no earlier run used: the clock and the process id, in the high bits.
fn fresh_room_range() -> u64 {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64);
    let z = (nanos ^ (u64::from(std::process::id()) << 32)).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    // Room ids of one run stay below 2^32 apart, so they never wrap.
    (z >> 1) & !0xFFFF_FFFF
}

async fn run(cli: Cli) -> Result<(), String> {
    match cli.command {
        Command::Demo {
            shape,
            common,
            rooms,
            fault_rate,
            abort_rate,
            seed,
            overlap,
            batch,
            gpu,
            timeline,
        } => {
            if overlap || gpu || timeline.is_some() {
                return overlap_demo(&shape, &common, batch, gpu, timeline).await;
            }
            for (name, p) in [("--fault-rate", fault_rate), ("--abort-rate", abort_rate)] {
                if !(0.0..=1.0).contains(&p) {
                    return Err(format!("{name} must be a probability in 0..=1, not {p}"));
                }
            }
            let config = load_config(&common)?;
            install_metrics(common.metrics_addr)?;
            let (progress, bar) = progress_bar(rooms, common.json);
            let faults = DemoFaults {
                fault_rate,
                abort_rate,
                seed,
            };
            let report = run_demo(
                shape.shape()?,
                config,
                rooms,
                faults,
                progress,
                common.runtime()?,
                kvferry_testkit::DemoLink {
                    backend: common.data_backend()?,
                    same_host: common.same_host()?,
                    tls: common.tls(),
                },
            )
            .await
            .map_err(|e| e.to_string())?;
            if let Some(bar) = bar {
                bar.finish_and_clear();
            }
            print_report(&report, common.json);
            if report.corrupted() || report.rooms_unfinished > 0 {
                return Err(format!(
                    "{} corrupted pages, {} corrupted aux rows, {} free pages written, {} unfinished rooms",
                    report.pages_corrupted,
                    report.aux_corrupted,
                    report.free_pages_written,
                    report.rooms_unfinished
                ));
            }
            Ok(())
        }
        Command::Prefill {
            listen,
            shape,
            common,
        } => {
            if let Some(n) = shape.data_connections {
                return Err(format!(
                    "--data-connections {n}: a session's data connections are opened by its \
                     decode (`kvferry decode --data-connections`); a prefill takes as many as \
                     each decode opens"
                ));
            }
            let (node, shape) = start_node(Role::Prefill, &shape, &common)?;
            let addrs = node.listen(listen).await.map_err(|e| e.to_string())?;
            let list: Vec<String> = addrs.iter().map(|a| a.to_string()).collect();
            eprintln!(
                "kvferry prefill ({}) listening on {}",
                node.runtime(),
                list.join(",")
            );
            let server = tokio::spawn(serve_prefill(node.clone(), shape));
            stop_signal().await;
            eprintln!("kvferry prefill: shutting down (peers are told)");
            node.shutdown().await;
            server.abort();
            Ok(())
        }
        Command::Decode {
            connect,
            rooms,
            first_room,
            room_log,
            shape,
            common,
        } => {
            let (node, shape) = start_node(Role::Decode, &shape, &common)?;
            let shown: Vec<String> = connect.iter().map(|a| a.to_string()).collect();
            let shown = shown.join(",");
            // The persistent peer carries the rooms and is reconnected if the prefill
            // restarts. Its first contact reports a refusal (token, layout) as a typed
            // error at once; a prefill not up yet is waited for up to the core's
            // unreachable timeout.
            let peer = node
                .connect_persistent(connect.clone())
                .await
                .map_err(|e| e.to_string())?;
            node.reach(peer)
                .await
                .map_err(|e| format!("cannot reach prefill at {shown}: {e}"))?;
            // SIGTERM or SIGINT: the node shuts down (its peers are told), every room still
            // open fails with `shutdown`, and the report is printed as usual.
            let stopper = {
                let node = node.clone();
                tokio::spawn(async move {
                    stop_signal().await;
                    eprintln!("kvferry decode: shutting down, finishing the report");
                    node.shutdown().await;
                })
            };
            let (progress, bar) = progress_bar(rooms, common.json);
            let progress = match room_log {
                Some(path) => Some(room_logger(&path, progress)?),
                None => progress,
            };
            let first_room = first_room.unwrap_or_else(fresh_room_range);
            let run = DecodeRun {
                rooms,
                shape,
                first_room,
                progress,
                deadline: Duration::from_secs(600),
                abort_rate: 0.0,
                seed: 0,
            };
            let mut report = run_decode(&node, peer, run).await;
            report.runtime = node.runtime().to_owned();
            report.backend = node.backend().to_owned();
            // The prefill is another process: only this side's path is known here.
            report.decode_path = kvferry_testkit::path_label(&node).await;
            if let Some(bar) = bar {
                bar.finish_and_clear();
            }
            add_counters(
                &mut report,
                &kvferry_core::Counters::default(),
                &node.counters().await,
            );
            stopper.abort();
            node.shutdown().await;
            print_report(&report, common.json);
            if report.corrupted() {
                return Err(format!(
                    "{} corrupted pages, {} corrupted aux rows, {} free pages written",
                    report.pages_corrupted, report.aux_corrupted, report.free_pages_written
                ));
            }
            Ok(())
        }
        Command::Proxy {
            listen,
            upstream,
            delay_ms,
            corrupt,
            reset,
            blackhole_ms,
            blackhole_every_ms,
            stall,
            truncate,
            seed,
        } => {
            let stall_up = match stall.as_deref() {
                None => None,
                Some("up") => Some(true),
                Some("down") => Some(false),
                Some(other) => return Err(format!("--stall must be up or down, not {other}")),
            };
            for (name, p) in [("--corrupt", corrupt), ("--reset", reset)] {
                if !(0.0..=1.0).contains(&p) {
                    return Err(format!("{name} must be a probability in 0..=1, not {p}"));
                }
            }
            let proxy = kvferry_testkit::proxy::FaultProxy::start_on(listen, upstream, seed)
                .await
                .map_err(|e| format!("proxy on {listen}: {e}"))?;
            proxy.set(|f| {
                f.delay = Duration::from_millis(delay_ms);
                f.corrupt = corrupt;
                f.reset = reset;
            });
            eprintln!("kvferry proxy {} -> {upstream}", proxy.addr);
            let period = Duration::from_millis(blackhole_every_ms.max(1));
            loop {
                tokio::select! {
                    _ = tokio::signal::ctrl_c() => return Ok(()),
                    _ = tokio::time::sleep(period) => {
                        if truncate {
                            proxy.set(|f| f.truncate_next = Some(1));
                        }
                        if blackhole_ms > 0 {
                            let hold = Duration::from_millis(blackhole_ms);
                            match stall_up {
                                None => {
                                    let until = std::time::Instant::now() + hold;
                                    proxy.set(|f| f.blackhole_until = Some(until));
                                }
                                Some(up) => {
                                    proxy.set(|f| if up { f.stall_up = true } else { f.stall_down = true });
                                    tokio::time::sleep(hold).await;
                                    proxy.set(|f| if up { f.stall_up = false } else { f.stall_down = false });
                                }
                            }
                        }
                    }
                }
            }
        }
        Command::Bench {
            iterations,
            rounds,
            runtime,
            backend,
            rdma_device,
            scaling,
            layer_events,
            copy_engine,
            gpu,
            scaling_rooms,
            shards,
            tls,
            quick,
            workload,
            json,
        } => {
            if workload.is_some() && (layer_events || scaling || tls || backend != "tcp") {
                return Err(
                    "--workload picks one of the data-plane workloads; it does not apply to \
                     --layer-events, --scaling, --tls or --backend rdma"
                        .to_owned(),
                );
            }
            // The room workloads (--tls, --backend rdma) run on one driver: `all` means tokio.
            let link_runtime = match runtime.as_str() {
                "glommio" => Runtime::parse("glommio", 1, false)?,
                _ => Runtime::Tokio,
            };
            let links = if quick {
                bench::LinkRun {
                    iterations: 1,
                    room_divisor: 16,
                    runtime: link_runtime,
                }
            } else {
                bench::LinkRun {
                    iterations: iterations.min(3),
                    room_divisor: 1,
                    runtime: link_runtime,
                }
            };
            if gpu && !copy_engine {
                return Err(
                    "--gpu goes with --copy-engine (demo --gpu runs rooms on a GPU)".to_owned(),
                );
            }
            if copy_engine {
                let figures = tokio::task::spawn_blocking(move || {
                    copy_engine_figures(gpu, iterations.min(5))
                })
                .await
                .map_err(|e| e.to_string())??;
                for f in &figures {
                    println!("{}", if json { f.json() } else { f.text() });
                }
                return Ok(());
            }
            if layer_events {
                let points = tokio::task::spawn_blocking(|| bench::layer_events(2000))
                    .await
                    .map_err(|e| e.to_string())?;
                for p in &points {
                    let (spin, every) = (p.policy.spin.as_micros(), p.policy.interval.as_micros());
                    let cpu = p.cpu_cores.map_or("n/a".to_owned(), |c| format!("{c:.2}"));
                    if json {
                        println!(
                            "{}",
                            serde_json::json!({ "spin_us": spin, "interval_us": every, "late_median_us": p.median.as_secs_f64() * 1e6, "late_p99_us": p.p99.as_secs_f64() * 1e6, "cpu_cores": p.cpu_cores })
                        );
                    } else {
                        println!(
                            "waiter spin {spin:>5} us, poll every {every:>5} us: reported {:>7.1} us late (median), {:>7.1} us (p99), CPU {cpu} cores",
                            p.median.as_secs_f64() * 1e6,
                            p.p99.as_secs_f64() * 1e6,
                        );
                    }
                }
                return Ok(());
            }
            if tls {
                let mut print = |p: &bench::LinkPoint| print_link_point(p, ["plain", "tls"], json);
                let points = bench::tls(links, &mut print)
                    .await
                    .map_err(|e| e.to_string())?;
                return link_points_clean(&points);
            }
            if kvferry_testkit::Backend::parse(&backend)? == kvferry_testkit::Backend::SameHost {
                let mut print = |p: &bench::SameHostPoint| print_same_host_point(p, json);
                let points = bench::same_host(iterations.max(3), &mut print)
                    .await
                    .map_err(|e| e.to_string())?;
                if points.iter().any(|p| !p.clean) {
                    return Err(
                        "a same-host bench room did not land every byte, or took the wrong path"
                            .to_owned(),
                    );
                }
                return Ok(());
            }
            if kvferry_testkit::Backend::parse(&backend)? == kvferry_testkit::Backend::Rdma {
                let mut print = |p: &bench::LinkPoint| print_link_point(p, ["tcp", "rdma"], json);
                let points = bench::backends(links, rdma_device, &mut print)
                    .await
                    .map_err(|e| e.to_string())?;
                return link_points_clean(&points);
            }
            if scaling {
                let points = bench::scaling(scaling_rooms, shards)
                    .await
                    .map_err(|e| e.to_string())?;
                for p in &points {
                    if json {
                        println!(
                            "{}",
                            serde_json::json!({ "runtime": "glommio", "shards": p.shards, "rooms_per_s": p.rooms_per_s, "gbps": p.gbps, "speedup": p.speedup, "efficiency": p.efficiency, "clean": p.clean })
                        );
                    } else {
                        println!(
                            "glommio shards {:>2}  {:>10.0} rooms/s  {:>7.3} GB/s  speedup {:>5.2}  efficiency {:>5.2}  {}",
                            p.shards, p.rooms_per_s, p.gbps, p.speedup, p.efficiency,
                            if p.clean { "all rooms verified" } else { "ROOMS FAILED OR CORRUPTED" }
                        );
                    }
                }
                return Ok(());
            }
            let runtimes = match runtime.as_str() {
                "tokio" => bench::Runtimes {
                    tokio: true,
                    glommio: false,
                },
                "glommio" => bench::Runtimes {
                    tokio: false,
                    glommio: true,
                },
                "all" => bench::Runtimes {
                    tokio: true,
                    glommio: true,
                },
                other => {
                    return Err(format!(
                        "--runtime must be tokio, glommio or all, not {other}"
                    ))
                }
            };
            let results = bench::run_rounds(iterations, runtimes, rounds, workload.as_deref())
                .await
                .map_err(|e| e.to_string())?;
            for r in &results {
                if json {
                    println!(
                        "{}",
                        serde_json::json!({ "workload": r.workload, "runtime": r.runtime, "unit": r.unit, "kvferry": r.kvferry, "raw": r.raw, "ratio": r.ratio, "target": r.target })
                    );
                } else {
                    println!(
                        "{:<18} {:<8} kvferry {:>10.3} {:<4}  raw {:>10.3} {:<4}  ratio {:>6.3}  (target {})",
                        r.workload, r.runtime, r.kvferry, r.unit, r.raw, r.unit, r.ratio, r.target
                    );
                }
            }
            for (workload, advantage) in bench::glommio_vs_tokio(&results) {
                if json {
                    println!(
                        "{}",
                        serde_json::json!({ "workload": workload, "glommio_vs_tokio": advantage, "target": ">= 1.0" })
                    );
                } else {
                    println!(
                        "{:<18} glommio vs tokio {:>6.3}x  (target >= 1.0, higher is better)",
                        workload, advantage
                    );
                }
            }
            Ok(())
        }
    }
}

/// Loads the configuration, serves metrics if asked, and starts a node of `role` with its own
/// host memory for `shape`.
fn start_node(
    role: Role,
    shape: &ShapeArgs,
    common: &CommonArgs,
) -> Result<(AnyNode, Shape), String> {
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

fn rand_seed() -> u64 {
    let t = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos() as u64)
        .unwrap_or(1);
    t ^ (u64::from(std::process::id()) << 32)
}
