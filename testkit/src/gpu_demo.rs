//! `kvferry demo --gpu`: the overlap demo with the KV cache in GPU memory, moved by the
//! nodes themselves through the CUDA copy engine.
//!
//! Prefill's forward pass is a CUDA kernel per layer (compiled with NVRTC) that writes the
//! layer's KV pattern for every room of the batch into device memory and then runs until the
//! configured per-layer compute time has passed. Both nodes register their device memory as
//! CUDA memory: the data plane stages it through page-locked buffers with the CUDA copy
//! engine (its own stream, batches planned into runs and strided copies), so the staging of
//! layer L overlaps the kernel of layer L+1 and the network send of layer L-1. A
//! [`LayerWaiter`] thread sees each layer's event complete and the pipeline marks the layer
//! ready in the core; no runtime thread waits on the GPU. Decode lands every room straight in
//! its device memory through the same engine; at the end its device memory is copied back
//! and every byte checked.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvferry_core::{Config, Layout, Role};
use kvferry_gpu::cuda::cudarc::driver::{LaunchConfig, PushKernelArg};
use kvferry_gpu::cuda::{DeviceRegion, Gpu};
use kvferry_gpu::engine::CudaCopyEngine;
use kvferry_gpu::{GpuError, LayerWaiter, PollPolicy, Readiness};
use kvferry_memory::{
    CopyDirection, CopyEngine, CopyJob, ExternalRegion, HostBuffer, MemoryKind, MemoryMap, Staging,
    StagingConfig,
};
use tokio::sync::mpsc;

use crate::overlap::{self, Batch, LayerSignal, OverlapReport, OverlapRun};
use crate::{node_config, Runtime};

/// The synthetic forward pass: the same pattern as `fill_pattern`, word for word, then a wait
/// on the GPU's global timer until `spin_ns` have passed since the block started.
const FORWARD: &str = r#"
__device__ unsigned long long mix(unsigned long long z) {
    z += 0x9E3779B97F4A7C15ULL;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ULL;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBULL;
    return z ^ (z >> 31);
}

extern "C" __global__ void forward(
    unsigned long long* kv,
    unsigned long long region_words,
    unsigned long long first_room,
    unsigned int rooms,
    unsigned int pages_per_room,
    unsigned int words_per_page,
    unsigned int planes,
    unsigned int layer,
    unsigned long long spin_ns)
{
    unsigned long long t0;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t0));
    unsigned long long per_plane = (unsigned long long)rooms * pages_per_room * words_per_page;
    unsigned long long words = per_plane * planes;
    unsigned long long step = (unsigned long long)gridDim.x * blockDim.x;
    for (unsigned long long w = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x; w < words; w += step) {
        unsigned long long plane = w / per_plane;
        unsigned long long rest = w % per_plane;
        unsigned long long page = rest / words_per_page;
        unsigned long long word = rest % words_per_page;
        unsigned long long room = first_room + page / pages_per_room;
        unsigned long long index = page % pages_per_room;
        unsigned long long seed = mix(room ^ ((unsigned long long)layer << 40) ^ (plane << 36) ^ (index << 4));
        kv[((unsigned long long)layer * planes + plane) * region_words + page * words_per_page + word] =
            seed ^ (word * 0x9E3779B97F4A7C15ULL);
    }
    unsigned long long t = t0;
    while (t - t0 < spin_ns) {
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    }
}
"#;

fn gpu_err(e: GpuError) -> String {
    e.to_string()
}

/// Device memory of one side: every KV region back to back, as the host layout has them.
struct DeviceKv {
    region: DeviceRegion,
    kv_len: usize,
}

/// One node's memory: its KV regions in `dev` (CUDA device 0, reached through the CUDA copy
/// engine), its aux rows in host memory.
struct NodeMemory {
    map: Arc<MemoryMap>,
    _aux: Box<[u8]>,
}

impl NodeMemory {
    fn new(gpu: &Gpu, dev: &DeviceKv, layout: Layout) -> Result<NodeMemory, String> {
        let base = dev.region.device_addr(gpu) as usize;
        let kv: Vec<ExternalRegion> = (0..layout.kv_regions() as usize)
            .map(|r| ExternalRegion {
                ptr: (base + r * dev.kv_len) as *mut u8,
                len: dev.kv_len,
                kind: MemoryKind::Cuda { device: 0 },
            })
            .collect();
        let mut aux = vec![0u8; (layout.slots * layout.aux_bytes) as usize].into_boxed_slice();
        let aux_region =
            (!aux.is_empty()).then(|| ExternalRegion::host(aux.as_mut_ptr(), aux.len()));
        // SAFETY: the device region and the aux rows outlive the nodes: the demo drops both
        // only after the nodes (the only other holders of the map) shut down and were dropped.
        let map = unsafe { MemoryMap::register_regions(layout, &kv, aux_region, None) }
            .map_err(|e| e.to_string())?;
        let engine = CudaCopyEngine::for_memory(&map).map_err(gpu_err)?;
        let staging = Staging::new(engine, StagingConfig::default()).map_err(|e| e.to_string())?;
        Ok(NodeMemory {
            map: Arc::new(map.with_staging(staging)),
            _aux: aux,
        })
    }

    fn engine(&self) -> Result<&Arc<dyn CopyEngine>, String> {
        self.map
            .staging()
            .map(|s| s.engine())
            .ok_or_else(|| "the node's memory has no copy engine".to_owned())
    }
}

/// Times the copy engine moving every KV region of `dev` into one page-locked buffer and
/// back; returns (device->host, host->device) GB/s.
fn staging_bandwidth(
    gpu: &Gpu,
    dev: &DeviceKv,
    regions: usize,
    engine: &dyn CopyEngine,
) -> Result<(f64, f64), String> {
    let mut host = HostBuffer::new(dev.kv_len);
    engine.pin(&mut host).map_err(|e| e.to_string())?;
    let base = dev.region.device_addr(gpu) as usize;
    let buffer = host.as_slice().as_ptr() as usize;
    let mut gbps = [0.0; 2];
    let mut result = Ok(());
    for (k, direction) in [CopyDirection::DeviceToHost, CopyDirection::HostToDevice]
        .into_iter()
        .enumerate()
    {
        let (tx, rx) = std::sync::mpsc::channel();
        let t = Instant::now();
        for r in 0..regions {
            let (device, len) = (base + r * dev.kv_len, dev.kv_len);
            let job = match direction {
                CopyDirection::DeviceToHost => CopyJob {
                    dst: buffer,
                    src: device,
                    len,
                },
                CopyDirection::HostToDevice => CopyJob {
                    dst: device,
                    src: buffer,
                    len,
                },
            };
            let tx = tx.clone();
            engine.start(
                0,
                direction,
                vec![job],
                Box::new(move |r| {
                    let _ = tx.send(r);
                }),
            );
        }
        for _ in 0..regions {
            match rx.recv_timeout(Duration::from_secs(60)) {
                Ok(Ok(())) => {}
                Ok(Err(e)) => result = Err(e.to_string()),
                Err(_) => result = Err("a staging copy did not end within 60 s".to_owned()),
            }
        }
        gbps[k] = (dev.kv_len * regions) as f64 / t.elapsed().as_secs_f64() / 1e9;
    }
    engine.unpin(&mut host);
    result.map(|()| (gbps[0], gbps[1]))
}

/// Starts the GPU forward pass of `batch` on its own thread: per layer a kernel and an event
/// a [`LayerWaiter`] turns into the layer's [`LayerSignal`]s. The layer's pages are in the
/// node's registered (device) memory once its kernel ended: the data plane stages them.
fn gpu_forward(
    gpu: Arc<Gpu>,
    kernel: Arc<kvferry_gpu::cuda::cudarc::driver::CudaFunction>,
    src: Arc<std::sync::Mutex<DeviceKv>>,
    batch: Batch,
    compute: Duration,
) -> mpsc::UnboundedReceiver<LayerSignal> {
    let (tx, rx) = mpsc::unbounded_channel();
    std::thread::spawn(move || {
        let layers = usize::from(batch.shape.layers);
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let signal = {
            let tx = tx.clone();
            move |r: Readiness| {
                let at = Instant::now();
                match r {
                    Readiness::Ready { layer, .. } => {
                        let _ = tx.send(LayerSignal::Computed { layer, at });
                        let _ = tx.send(LayerSignal::Staged { layer, at });
                    }
                    Readiness::Failed { layer, error, .. } => {
                        let _ = tx.send(LayerSignal::Failed(format!("layer {layer}: {error}")));
                    }
                }
                let _ = done_tx.send(());
            }
        };
        let computed = LayerWaiter::spawn(PollPolicy::default(), signal);
        let fail = |e: String| {
            let _ = tx.send(LayerSignal::Failed(e));
        };
        let Ok(mut src) = src.lock() else {
            return fail("the device region's lock is poisoned".to_owned());
        };
        let shape = &batch.shape;
        let page_bytes = shape.page_bytes as usize;
        let words_per_page = shape.page_bytes / 8;
        let batch_bytes = batch.rooms as usize * shape.pages_per_room as usize * page_bytes;
        let region_words = (src.kv_len / 8) as u64;
        let threads = 256u32;
        let words = u64::from(shape.planes) * (batch_bytes / 8) as u64;
        let blocks = words.div_ceil(u64::from(threads)).clamp(1, 1024) as u32;
        let rooms: Vec<kvferry_core::RoomId> = (0..batch.rooms).map(|i| batch.room(i)).collect();
        for layer in 0..shape.layers {
            let compute_stream = gpu.compute_stream().clone();
            let mut launch = compute_stream.launch_builder(&kernel);
            let spin_ns = compute.as_nanos() as u64;
            let first_room = batch.first_room;
            let (rooms_n, ppr, planes, l) = (
                batch.rooms,
                shape.pages_per_room,
                u32::from(shape.planes),
                u32::from(layer),
            );
            launch
                .arg(src.region.slice_mut())
                .arg(&region_words)
                .arg(&first_room)
                .arg(&rooms_n)
                .arg(&ppr)
                .arg(&words_per_page)
                .arg(&planes)
                .arg(&l)
                .arg(&spin_ns);
            let config = LaunchConfig {
                grid_dim: (blocks, 1, 1),
                block_dim: (threads, 1, 1),
                shared_mem_bytes: 0,
            };
            // SAFETY: the arguments match the kernel's signature in order and type; the kernel
            // writes only inside the device region (layer * planes + plane < regions and
            // page < rooms * pages_per_room <= layout pages).
            if let Err(e) = unsafe { launch.launch(config) } {
                return fail(format!("kernel launch: {e:?}"));
            }
            let step = gpu
                .record(gpu.compute_stream())
                .and_then(|ev| computed.watch(rooms.clone(), layer, Box::new(ev)));
            if let Err(e) = step {
                return fail(format!("layer {layer}: {e}"));
            }
        }
        // Keep the waiter until every event was reported (it drops unreported ones).
        for _ in 0..layers {
            if done_rx.recv_timeout(Duration::from_secs(120)).is_err() {
                return fail("a GPU event did not complete within 120 s".to_owned());
            }
        }
    });
    rx
}

/// Copies decode's device region back and checks every page of every room that succeeded
/// (aux rows stay in host memory and are read there).
fn verify_on_gpu(
    gpu: &Gpu,
    dst: &DeviceKv,
    map: &Arc<MemoryMap>,
    batch: &Batch,
    succeeded: &[bool],
) -> Result<(u64, u64), String> {
    let planes = usize::from(batch.shape.planes);
    let regions = map.layout().kv_regions() as usize;
    let batch_bytes = batch.rooms as usize
        * batch.shape.pages_per_room as usize
        * batch.shape.page_bytes as usize;
    let mut back = vec![0u8; batch_bytes * regions];
    let stream = gpu.new_stream().map_err(gpu_err)?;
    for r in 0..regions {
        let out = &mut back[r * batch_bytes..(r + 1) * batch_bytes];
        // SAFETY: `back` outlives the copy: the stream is synchronized before it is read.
        unsafe {
            gpu.copy_to_host_async(
                &stream,
                &dst.region,
                r * dst.kv_len,
                out.as_mut_ptr(),
                batch_bytes,
            )
        }
        .map_err(gpu_err)?;
    }
    stream.synchronize().map_err(|e| format!("{e:?}"))?;
    let map = map.clone();
    Ok(overlap::verify(
        batch,
        succeeded,
        |region, offset, out| match region {
            kvferry_core::Region::Kv { layer, plane } => {
                let r = usize::from(layer) * planes + usize::from(plane);
                let start = r * batch_bytes + offset as usize;
                match back.get(start..start + out.len()) {
                    Some(b) => {
                        out.copy_from_slice(b);
                        true
                    }
                    None => false,
                }
            }
            _ => map.read(region, offset, out).is_ok(),
        },
    ))
}

/// `demo --gpu`: the overlap demo with both nodes' KV in GPU memory of device 0.
pub async fn gpu_overlap_demo(
    batch: &Batch,
    core: Config,
    runtime: Runtime,
    backend: crate::DataBackend,
    compute: Duration,
) -> Result<OverlapReport, String> {
    let info = kvferry_gpu::cuda::probe().map_err(gpu_err)?;
    let gpu = Arc::new(Gpu::open(0).map_err(gpu_err)?);
    let kernel = Arc::new(gpu.compile(FORWARD, "forward").map_err(gpu_err)?);
    let shape = batch.shape_for_layout();
    let layout = shape.layout();
    let kv_len = layout.pages as usize * layout.page_bytes as usize;
    let regions = layout.kv_regions() as usize;
    let device_kv = |gpu: &Gpu| -> Result<DeviceKv, String> {
        Ok(DeviceKv {
            region: gpu.alloc_ordered(kv_len * regions).map_err(gpu_err)?,
            kv_len,
        })
    };
    let src = device_kv(&gpu)?;
    let dst = device_kv(&gpu)?;
    let prefill_memory = NodeMemory::new(&gpu, &src, layout)?;
    let decode_memory = NodeMemory::new(&gpu, &dst, layout)?;
    let bandwidth = staging_bandwidth(&gpu, &src, regions, &**prefill_memory.engine()?)?;
    let src = Arc::new(std::sync::Mutex::new(src));

    let token = kvferry_core::auth::DEMO_TOKEN.to_vec();
    let start = |role: Role, seed: u64, map: Arc<MemoryMap>| {
        let mut cfg = node_config(role, &shape, core.clone(), &token, seed);
        cfg.backend = backend.clone();
        runtime.start_paired(cfg, map).map_err(|e| e.to_string())
    };
    let prefill = start(Role::Prefill, 1, prefill_memory.map.clone())?;
    let decode = start(Role::Decode, 2, decode_memory.map.clone())?;
    let result = async {
        let peer = overlap::connect_loopback(&prefill, &decode).await?;
        let mut runs = Vec::new();
        for (layerwise, batch) in overlap::both_modes(batch) {
            overlap::clear_destination(&decode_memory.map, &batch);
            let (g, kn, s, b) = (gpu.clone(), kernel.clone(), src.clone(), batch.clone());
            let times = overlap::run_batch(
                &prefill,
                &decode,
                peer,
                &batch,
                overlap::BatchMode {
                    layerwise,
                    deadline: Duration::from_secs(120),
                },
                move || gpu_forward(g, kn, s, b, compute),
                None,
            )
            .await?;
            let succeeded: Vec<bool> = times.landed.iter().map(Option::is_some).collect();
            let (ok, bad) = verify_on_gpu(&gpu, &dst, &decode_memory.map, &batch, &succeeded)?;
            let label = if layerwise {
                "layerwise"
            } else {
                "whole batch"
            };
            runs.push(OverlapRun {
                timeline: times.timeline(label, layerwise, None),
                pages_verified: ok,
                pages_corrupted: bad,
                rooms_failed: times.failed.len() as u64,
            });
        }
        overlap::share_layer_transfer(&mut runs);
        Ok::<_, String>(OverlapReport {
            memory: format!("GPU ({}), CUDA copy engine", info.name),
            runtime: crate::runtime_label(prefill.runtime(), decode.runtime()),
            backend: decode.backend().to_owned(),
            layers: batch.shape.layers,
            rooms: batch.rooms,
            layer_bytes: batch.layer_bytes(),
            staging_gbps: Some(bandwidth),
            runs,
        })
    }
    .await;
    decode.shutdown().await;
    prefill.shutdown().await;
    // The nodes go before the memory they were registered with.
    drop(decode);
    drop(prefill);
    drop(prefill_memory);
    drop(decode_memory);
    result
}
