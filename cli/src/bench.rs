//! `kvferry bench`: the data plane against a plain socket pair, and the other benches (links,
//! same host, scaling, layer events, the copy engine), each printing ratios measured in one run.

use clap::Args;
use kvferry_testkit::bench;
use kvferry_testkit::Runtime;

// The arguments of `kvferry bench`; the command's help is its variant's doc comment.
#[derive(Args)]
pub(crate) struct BenchArgs {
    /// Operations per workload, runtime and round (the 4 KiB round trip runs 100x as many).
    #[arg(long, default_value_t = 7)]
    pub(crate) iterations: usize,
    /// Interleaved rounds per workload: each runs raw, tokio and glommio back to back, in
    /// each of the six orders in turn, so load that drifts slows all of them alike.
    #[arg(long, default_value_t = 6)]
    pub(crate) rounds: usize,
    /// Which data plane to measure against raw TCP: tokio, glommio, or all (with --tls or
    /// --backend rdma: the driver both nodes run on, tokio or glommio).
    #[arg(long, default_value = "tokio")]
    pub(crate) runtime: String,
    /// The data-plane backend: tcp, or rdma (builds with the `rdma` feature): with rdma,
    /// room workloads through two nodes over TCP and over RDMA, side by side.
    #[arg(long, default_value = "tcp")]
    pub(crate) backend: String,
    /// With --backend rdma: the RDMA device to use (default: the first one).
    #[arg(long)]
    pub(crate) rdma_device: Option<String>,
    /// Instead of the data-plane workloads: room lifecycles per second through the
    /// glommio driver with 1, 2, ... shards up to the number of cores.
    #[arg(long)]
    pub(crate) scaling: bool,
    /// Instead of the data-plane workloads: how late the GPU layer waiter reports a
    /// completed layer, and its CPU cost, per poll policy (host events; no GPU needed).
    #[arg(long)]
    pub(crate) layer_events: bool,
    /// Instead of the data-plane workloads: the copy engine moving staged batches
    /// (contiguous, scattered 4 KiB pages, 256 B rows at a stride) against one 64 MiB
    /// copy, both ways; the host engine, or with --gpu the CUDA engine on GPU 0.
    #[arg(long)]
    pub(crate) copy_engine: bool,
    /// With --copy-engine: the CUDA engine on GPU 0 (builds with the `gpu` feature).
    #[arg(long)]
    pub(crate) gpu: bool,
    /// Rooms per point of the scaling sweep.
    #[arg(long, default_value_t = 20000)]
    pub(crate) scaling_rooms: u64,
    /// With --scaling: the most shards to sweep to (default: the number of cores).
    #[arg(long)]
    pub(crate) shards: Option<usize>,
    /// Instead of the data-plane workloads: room workloads through two nodes with TLS off
    /// and on, side by side (a throwaway CA; every byte verified).
    #[arg(long)]
    pub(crate) tls: bool,
    /// With --tls or --backend rdma: one round with a sixteenth of each workload's rooms,
    /// to check the path end to end on a slow link (noisier figures).
    #[arg(long)]
    pub(crate) quick: bool,
    /// Run one data-plane workload alone, for instance under a profiler.
    #[arg(long, value_parser = clap::builder::PossibleValuesParser::new(bench::workload_names()))]
    pub(crate) workload: Option<String>,
    /// Print one JSON object per workload instead of a table.
    #[arg(long)]
    pub(crate) json: bool,
}

/// Runs `kvferry bench`.
pub(crate) async fn run(args: BenchArgs) -> Result<(), String> {
    let BenchArgs {
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
    } = args;
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
        return Err("--gpu goes with --copy-engine (demo --gpu runs rooms on a GPU)".to_owned());
    }
    if copy_engine {
        let figures =
            tokio::task::spawn_blocking(move || copy_engine_figures(gpu, iterations.min(5)))
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
        print_layer_events(&points, json);
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
                "a same-host bench room did not land every byte, or took the wrong path".to_owned(),
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
        print_scaling(&points, json);
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
    // On a worker of the runtime, as a tokio server's task would call: the main thread
    // parks outside the worker pool, and waking it cost both contenders 50-60 us.
    let workload = workload.clone();
    let results = tokio::spawn(async move {
        bench::run_rounds(iterations, runtimes, rounds, workload.as_deref()).await
    })
    .await
    .map_err(|e| e.to_string())?
    .map_err(|e| e.to_string())?;
    print_data_plane(&results, json);
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

/// Prints `bench --layer-events`: how late the layer waiter reports, per poll policy.
fn print_layer_events(points: &[bench::WaiterPoint], json: bool) {
    for p in points {
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
}

/// Prints `bench --scaling`: rooms per second per shard count, and the speedup.
fn print_scaling(points: &[bench::ScalePoint], json: bool) {
    for p in points {
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
}

/// Prints the data-plane workloads against raw TCP, then glommio against tokio.
fn print_data_plane(results: &[bench::BenchResult], json: bool) {
    for r in results {
        if json {
            println!(
                "{}",
                serde_json::json!({ "workload": r.workload, "runtime": r.runtime, "unit": r.unit, "kvferry": r.kvferry, "raw": r.raw, "ratio": r.ratio, "own_raw": r.own_raw, "own_ratio": r.own_ratio, "target": r.target })
            );
        } else {
            print!(
                "{:<18} {:<8} kvferry {:>10.3} {:<4}  raw {:>10.3} {:<4}  ratio {:>6.3}  (target {})",
                r.workload, r.runtime, r.kvferry, r.unit, r.raw, r.unit, r.ratio, r.target
            );
            // glommio's own sockets: what the runtime costs before kvferry adds anything.
            if r.runtime == "glommio" {
                print!(
                    "  raw on glommio {:.3} {}, ratio {:.3}",
                    r.own_raw, r.unit, r.own_ratio
                );
            }
            println!();
        }
    }
    for (workload, advantage) in bench::glommio_vs_tokio(results) {
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
}
