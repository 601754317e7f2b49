//! `kvferry demo`: a prefill and a decode node on loopback, rooms moved end to end with
//! every byte checked, or the overlap demo (layerwise against whole batch).

use std::path::PathBuf;
use std::time::Duration;

use clap::Args;
use kvferry_testkit::{run_demo, DemoFaults};

use crate::args::{
    install_metrics, load_config, print_report, progress_bar, CommonArgs, ShapeArgs,
};

// The arguments of `kvferry demo`; the command's help is its variant's doc comment.
#[derive(Args)]
pub(crate) struct DemoArgs {
    #[command(flatten)]
    pub(crate) shape: ShapeArgs,
    #[command(flatten)]
    pub(crate) common: CommonArgs,
    /// Rooms to move.
    #[arg(long, default_value_t = 256)]
    pub(crate) rooms: u64,
    /// Probability that a write batch resets its data connection (transient failures).
    #[arg(long, default_value_t = 0.0)]
    pub(crate) fault_rate: f64,
    /// Probability that decode aborts a room mid-flight.
    #[arg(long, default_value_t = 0.0)]
    pub(crate) abort_rate: f64,
    /// Seed of the injected faults and aborts.
    #[arg(long, default_value_t = 1)]
    pub(crate) seed: u64,
    /// Run the overlap demo instead: one batch whose forward pass runs layer by layer
    /// (--layer-compute-us each, 20 ms when 0), moved layerwise and then as one whole
    /// batch, timed per layer against the ideal overlap.
    #[arg(long)]
    pub(crate) overlap: bool,
    /// Rooms in the overlap demo's batch.
    #[arg(long, default_value_t = 16)]
    pub(crate) batch: u32,
    /// The overlap demo with the KV regions in GPU memory, a CUDA kernel per layer and
    /// layer readiness from CUDA events (builds with the `gpu` feature, hosts with an
    /// NVIDIA GPU).
    #[arg(long)]
    pub(crate) gpu: bool,
    /// Write the overlap demo's compute/transfer timeline as SVG to this file (implies
    /// --overlap).
    #[arg(long)]
    pub(crate) timeline: Option<PathBuf>,
}

/// Runs `kvferry demo`.
pub(crate) async fn run(args: DemoArgs) -> Result<(), String> {
    let DemoArgs {
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
    } = args;
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
