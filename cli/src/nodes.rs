//! `kvferry prefill` and `kvferry decode`: one node each, in processes of their own, until
//! the rooms are done or a signal stops them.

use std::net::SocketAddr;
use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use kvferry_core::Role;
use kvferry_testkit::{add_counters, run_decode, serve_prefill, DecodeRun};

use crate::args::{print_report, progress_bar, room_logger, start_node, CommonArgs, ShapeArgs};

// The arguments of `kvferry prefill`; the command's help is its variant's doc comment.
#[derive(Args)]
pub(crate) struct PrefillArgs {
    /// Address to listen on.
    #[arg(long)]
    pub(crate) listen: SocketAddr,
    #[command(flatten)]
    pub(crate) shape: ShapeArgs,
    #[command(flatten)]
    pub(crate) common: CommonArgs,
}

// The arguments of `kvferry decode`; the command's help is its variant's doc comment.
#[derive(Args)]
pub(crate) struct DecodeArgs {
    /// The prefill node's address; a sharded (glommio) prefill: every shard's address,
    /// comma-separated, in the order it printed them.
    #[arg(long, value_delimiter = ',', required = true)]
    pub(crate) connect: Vec<SocketAddr>,
    /// Rooms to request.
    #[arg(long, default_value_t = 256)]
    pub(crate) rooms: u64,
    /// First room id. Default: a fresh range for every run, so a re-run or a restarted
    /// decode never reuses room ids that prefill already concluded (a reused id is
    /// refused with `room_id_reused`).
    #[arg(long)]
    pub(crate) first_room: Option<u64>,
    /// Write one line per room as it ends: wall-clock milliseconds since the Unix epoch
    /// (to line up with outside events), room id, outcome.
    #[arg(long)]
    pub(crate) room_log: Option<PathBuf>,
    #[command(flatten)]
    pub(crate) shape: ShapeArgs,
    #[command(flatten)]
    pub(crate) common: CommonArgs,
}

/// Runs `kvferry prefill` until SIGINT or SIGTERM.
pub(crate) async fn prefill(args: PrefillArgs) -> Result<(), String> {
    let PrefillArgs {
        listen,
        shape,
        common,
    } = args;
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

/// Runs `kvferry decode`: its rooms, then the report.
pub(crate) async fn decode(args: DecodeArgs) -> Result<(), String> {
    let DecodeArgs {
        connect,
        rooms,
        first_room,
        room_log,
        shape,
        common,
    } = args;
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
