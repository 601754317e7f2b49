//! A prefill and a decode run against each other: the `kvferry demo` and the tests' pairs.

use crate::{
    add_counters, node_config, path_label, run_decode, runtime_label, serve_prefill, DecodeRun,
    DemoFaults, Progress, Report, Runtime, Shape,
};
use kvferry_core::{Config, Role};
use kvferry_memory::MemoryMap;
use kvferry_tokio::{Node, NodeError};
use std::sync::Arc;
use std::time::Duration;

/// Moves `run.rooms` rooms from `prefill` to `decode` (both started, on loopback) and reports.
pub async fn run_pair(prefill: &Node, decode: &Node, run: DecodeRun) -> Result<Report, NodeError> {
    let addrs = prefill
        .listen("127.0.0.1:0".parse().map_err(|_| NodeError::ShutDown)?)
        .await?;
    let server = tokio::spawn(serve_prefill(prefill.clone(), run.shape.clone()));
    let peer = decode.connect(addrs).await?;
    let mut report = run_decode(decode, peer, run).await;
    report.runtime = runtime_label(prefill.runtime(), decode.runtime());
    report.backend = decode.backend().to_owned();
    report.prefill_path = path_label(prefill).await;
    report.decode_path = path_label(decode).await;
    add_counters(
        &mut report,
        &prefill.counters().await,
        &decode.counters().await,
    );
    decode.shutdown().await;
    prefill.shutdown().await;
    server.abort();
    Ok(report)
}

/// How the demo's two nodes are linked: the data plane, and TLS or not.
#[derive(Clone, Debug, Default)]
pub struct DemoLink {
    /// TCP data connections or RDMA.
    pub backend: kvferry_tokio::DataBackend,
    /// Whether the two nodes (one process, so one host) take the same-host path.
    pub same_host: kvferry_tokio::SameHost,
    /// TLS on every connection (tokio runtime).
    pub tls: Option<kvferry_tcp::TlsFiles>,
}

impl From<kvferry_tokio::DataBackend> for DemoLink {
    fn from(backend: kvferry_tokio::DataBackend) -> Self {
        DemoLink {
            backend,
            same_host: Default::default(),
            tls: None,
        }
    }
}

/// Runs prefill and decode in this process on loopback and moves `rooms` rooms end to end.
pub async fn run_demo(
    shape: Shape,
    core: Config,
    rooms: u64,
    faults: DemoFaults,
    progress: Option<Progress>,
    runtime: Runtime,
    link: DemoLink,
) -> Result<Report, NodeError> {
    let DemoLink {
        backend,
        same_host,
        tls,
    } = link;
    let token = kvferry_core::auth::DEMO_TOKEN.to_vec();
    let mut prefill_cfg = node_config(Role::Prefill, &shape, core.clone(), &token, 1);
    let mut decode_cfg = node_config(Role::Decode, &shape, core, &token, 2);
    prefill_cfg.backend = backend.clone();
    decode_cfg.backend = backend;
    prefill_cfg.same_host = same_host;
    decode_cfg.same_host = same_host;
    prefill_cfg.tls = tls.clone();
    decode_cfg.tls = tls;
    if faults.fault_rate > 0.0 {
        // Decode injects on the TCP receive path; prefill on the RDMA post path, which decode
        // never sees.
        decode_cfg.faults = Some(kvferry_tokio::FaultPlan {
            rate: faults.fault_rate,
            seed: faults.seed,
            kind: kvferry_tokio::FaultKind::Break,
        });
        prefill_cfg.faults = decode_cfg.faults;
    }
    let layout = shape.layout();
    let prefill = runtime.start_paired(prefill_cfg, Arc::new(MemoryMap::allocate(layout)))?;
    let decode = runtime.start_paired(decode_cfg, Arc::new(MemoryMap::allocate(layout)))?;
    let run = DecodeRun {
        rooms,
        shape,
        first_room: 1,
        progress,
        deadline: Duration::from_secs(600),
        abort_rate: faults.abort_rate,
        seed: faults.seed,
    };
    run_pair(&prefill, &decode, run).await
}
