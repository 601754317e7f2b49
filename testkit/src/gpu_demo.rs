//! `kvferry demo --gpu`: the overlap demo with the KV cache in GPU memory.
//!
//! Prefill's forward pass is a CUDA kernel per layer (compiled with NVRTC) that writes the
//! layer's KV pattern for every room of the batch into device memory and then runs until the
//! configured per-layer compute time has passed. After each layer the copy stream waits for
//! the kernel's event and copies the layer into page-locked host memory (the memory the TCP
//! data plane sends from), so the copy of layer L overlaps the kernel of layer L+1 and the
//! network send of layer L-1. A [`LayerWaiter`] thread sees the events complete and the
//! pipeline marks the layer ready in the core; no runtime thread waits on the GPU. Decode
//! receives into page-locked host memory and copies each room into its own device region as
//! the room succeeds; at the end the device region is copied back and every byte checked.

use std::sync::Arc;
use std::time::{Duration, Instant};

use kvferry_core::{Config, Layout, Role};
use kvferry_gpu::cuda::cudarc::driver::{LaunchConfig, PushKernelArg};
use kvferry_gpu::cuda::{DeviceRegion, Gpu, PinnedBuffer};
use kvferry_gpu::{GpuError, LayerWaiter, PollPolicy, Readiness};
use kvferry_memory::MemoryMap;
use kvferry_tokio::KvNode;
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

/// Page-locked host memory for every region of a layout, registered as a node's memory.
struct Staging {
    /// One buffer per KV region, in `layer * planes + plane` order.
    kv: Vec<PinnedBuffer>,
    _aux: PinnedBuffer,
    map: Arc<MemoryMap>,
}

impl Staging {
    fn new(gpu: &Gpu, layout: Layout) -> Result<Staging, String> {
        let kv_len = layout.pages as usize * layout.page_bytes as usize;
        let kv = (0..layout.kv_regions())
            .map(|_| gpu.alloc_pinned(kv_len))
            .collect::<Result<Vec<_>, _>>()
            .map_err(gpu_err)?;
        let aux = gpu
            .alloc_pinned(layout.slots as usize * layout.aux_bytes as usize)
            .map_err(gpu_err)?;
        let regions: Vec<(*mut u8, usize)> = kv.iter().map(|b| (b.as_mut_ptr(), b.len())).collect();
        // SAFETY: every buffer lives in this `Staging`, which the demo drops only after both
        // nodes (the only other holders of the map) have shut down and been dropped; pages
        // are touched by the demo only before they are sent or after their room concluded.
        let map = unsafe {
            MemoryMap::register_external(
                layout,
                &regions,
                Some((aux.as_mut_ptr(), aux.len())),
                None,
            )
        }
        .map_err(|e| e.to_string())?;
        Ok(Staging {
            kv,
            _aux: aux,
            map: Arc::new(map),
        })
    }
}

/// Device memory of one side: every KV region back to back, as the host layout has them.
struct DeviceKv {
    region: DeviceRegion,
    kv_len: usize,
}

/// Times a full copy of `dev` into `host` and back; returns (device->host, host->device) GB/s.
fn staging_bandwidth(gpu: &Gpu, dev: &DeviceKv, host: &Staging) -> Result<(f64, f64), String> {
    let stream = gpu.new_stream().map_err(gpu_err)?;
    let bytes = (dev.kv_len * host.kv.len()) as f64;
    let mut gbps = [0.0; 2];
    for (k, to_host) in [true, false].into_iter().enumerate() {
        let t = Instant::now();
        for (r, buf) in host.kv.iter().enumerate() {
            let (at, ptr, len) = (r * dev.kv_len, buf.as_mut_ptr(), dev.kv_len);
            // SAFETY: the staging buffers are not in use by any node yet; the stream is
            // synchronized before they are.
            let queued = unsafe {
                if to_host {
                    gpu.copy_to_host_async(&stream, &dev.region, at, ptr, len)
                } else {
                    gpu.copy_to_device_async(&stream, &dev.region, at, ptr, len)
                }
            };
            queued.map_err(gpu_err)?;
        }
        stream.synchronize().map_err(|e| format!("{e:?}"))?;
        gbps[k] = bytes / t.elapsed().as_secs_f64() / 1e9;
    }
    Ok((gbps[0], gbps[1]))
}

/// Starts the GPU forward pass of `batch` on its own thread: per layer a kernel, an event, a
/// copy of the layer into the staging memory after that event, and a second event; two
/// [`LayerWaiter`]s turn the events into [`LayerSignal`]s.
fn gpu_forward(
    gpu: Arc<Gpu>,
    kernel: Arc<kvferry_gpu::cuda::cudarc::driver::CudaFunction>,
    src: Arc<std::sync::Mutex<DeviceKv>>,
    staging: Vec<(usize, usize)>,
    batch: Batch,
    compute: Duration,
) -> mpsc::UnboundedReceiver<LayerSignal> {
    let (tx, rx) = mpsc::unbounded_channel();
    std::thread::spawn(move || {
        let layers = usize::from(batch.shape.layers);
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let signal = |computed: bool| {
            let tx = tx.clone();
            let done = done_tx.clone();
            move |r: Readiness| {
                let at = Instant::now();
                let s = match r {
                    Readiness::Ready { layer, .. } if computed => {
                        LayerSignal::Computed { layer, at }
                    }
                    Readiness::Ready { layer, .. } => LayerSignal::Staged { layer, at },
                    Readiness::Failed { layer, error, .. } => {
                        LayerSignal::Failed(format!("layer {layer}: {error}"))
                    }
                };
                let _ = tx.send(s);
                let _ = done.send(());
            }
        };
        let computed = LayerWaiter::spawn(PollPolicy::default(), signal(true));
        let staged = LayerWaiter::spawn(PollPolicy::default(), signal(false));
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
            let kv_len = src.kv_len;
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
            let step = (|| -> Result<(), GpuError> {
                let ev_computed = gpu.record(gpu.compute_stream())?;
                gpu.wait_for(gpu.copy_stream(), &ev_computed)?;
                computed.watch(rooms.clone(), layer, Box::new(ev_computed))?;
                for plane in 0..shape.planes {
                    let r = usize::from(layer) * usize::from(shape.planes) + usize::from(plane);
                    let (ptr, _) = staging[r];
                    // SAFETY: the staging buffer of region r outlives the demo's nodes; the
                    // batch's pages of it are not sent before this layer's Staged signal,
                    // which comes only after the event recorded below completed.
                    unsafe {
                        gpu.copy_to_host_async(
                            gpu.copy_stream(),
                            &src.region,
                            r * kv_len,
                            ptr as *mut u8,
                            batch_bytes,
                        )?;
                    }
                }
                let ev_staged = gpu.record(gpu.copy_stream())?;
                staged.watch(rooms.clone(), layer, Box::new(ev_staged))
            })();
            if let Err(e) = step {
                return fail(format!("layer {layer}: {e}"));
            }
        }
        // Keep the waiters until every event was reported (they drop unreported ones).
        for _ in 0..2 * layers {
            if done_rx.recv_timeout(Duration::from_secs(120)).is_err() {
                return fail("a GPU event did not complete within 120 s".to_owned());
            }
        }
    });
    rx
}

/// Decode's side of the GPU: copies each room that succeeded from the staging memory into
/// the device region as its index arrives, then waits for the copies; returns when decode
/// held every landed room in GPU memory.
fn land_on_gpu(
    gpu: Arc<Gpu>,
    dst: Arc<std::sync::Mutex<DeviceKv>>,
    staging: Vec<(usize, usize)>,
    batch: Batch,
    mut landed: mpsc::UnboundedReceiver<u32>,
) -> std::thread::JoinHandle<Result<Instant, String>> {
    std::thread::spawn(move || {
        let stream = gpu.new_stream().map_err(gpu_err)?;
        let dst = dst
            .lock()
            .map_err(|_| "the device region's lock is poisoned")?;
        let room_bytes = batch.shape.pages_per_room as usize * batch.shape.page_bytes as usize;
        while let Some(i) = landed.blocking_recv() {
            let offset = i as usize * room_bytes;
            for (r, &(ptr, _)) in staging.iter().enumerate() {
                // SAFETY: the room succeeded, so nothing writes its pages any more, and the
                // staging memory outlives this thread (joined before the nodes are dropped).
                unsafe {
                    gpu.copy_to_device_async(
                        &stream,
                        &dst.region,
                        r * dst.kv_len + offset,
                        (ptr as *const u8).wrapping_add(offset),
                        room_bytes,
                    )
                }
                .map_err(gpu_err)?;
            }
        }
        stream.synchronize().map_err(|e| format!("{e:?}"))?;
        Ok(Instant::now())
    })
}

/// Copies decode's device region back and checks every page of every room that succeeded
/// (aux rows stay in host memory and are read there).
fn verify_on_gpu(
    gpu: &Gpu,
    dst: &DeviceKv,
    staging: &Staging,
    batch: &Batch,
    succeeded: &[bool],
) -> Result<(u64, u64), String> {
    let planes = usize::from(batch.shape.planes);
    let batch_bytes = batch.rooms as usize
        * batch.shape.pages_per_room as usize
        * batch.shape.page_bytes as usize;
    let mut back = vec![0u8; batch_bytes * staging.kv.len()];
    let stream = gpu.new_stream().map_err(gpu_err)?;
    for r in 0..staging.kv.len() {
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
    let map = staging.map.clone();
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
    let prefill_staging = Staging::new(&gpu, layout)?;
    let decode_staging = Staging::new(&gpu, layout)?;
    let bandwidth = staging_bandwidth(&gpu, &src, &prefill_staging)?;
    let src = Arc::new(std::sync::Mutex::new(src));
    let dst = Arc::new(std::sync::Mutex::new(dst));
    let addresses = |s: &Staging| -> Vec<(usize, usize)> {
        s.kv.iter()
            .map(|b| (b.as_mut_ptr() as usize, b.len()))
            .collect()
    };
    let (prefill_addrs, decode_addrs) = (addresses(&prefill_staging), addresses(&decode_staging));

    let token = kvferry_core::auth::DEMO_TOKEN.to_vec();
    let start = |role: Role, seed: u64, map: Arc<MemoryMap>| {
        let mut cfg = node_config(role, &shape, core.clone(), &token, seed);
        cfg.backend = backend.clone();
        runtime.start_paired(cfg, map).map_err(|e| e.to_string())
    };
    if backend != crate::DataBackend::Tcp {
        // GPUDirect (registering device memory with the NIC) is not written: say so.
        tracing::warn!("GPU KV is staged through page-locked host memory over RDMA too (GPUDirect registration is not implemented)");
    }
    let prefill = start(Role::Prefill, 1, prefill_staging.map.clone())?;
    let decode = start(Role::Decode, 2, decode_staging.map.clone())?;
    let result = async {
        let peer = overlap::connect_loopback(&prefill, &decode).await?;
        let mut runs = Vec::new();
        for (layerwise, batch) in overlap::both_modes(batch) {
            overlap::clear_destination(&decode_staging.map, &batch);
            let (landed_tx, landed_rx) = mpsc::unbounded_channel();
            let lander = land_on_gpu(
                gpu.clone(),
                dst.clone(),
                decode_addrs.clone(),
                batch.clone(),
                landed_rx,
            );
            let (g, kn, s, st, b) = (
                gpu.clone(),
                kernel.clone(),
                src.clone(),
                prefill_addrs.clone(),
                batch.clone(),
            );
            let times = overlap::run_batch(
                &prefill,
                &decode,
                peer,
                &batch,
                overlap::BatchMode {
                    layerwise,
                    deadline: Duration::from_secs(120),
                },
                move || gpu_forward(g, kn, s, st, b, compute),
                Some(landed_tx),
            )
            .await;
            let held = tokio::task::spawn_blocking(move || lander.join())
                .await
                .map_err(|e| e.to_string())?
                .map_err(|_| "the GPU landing thread panicked".to_owned())??;
            let times = times?;
            let succeeded: Vec<bool> = times.landed.iter().map(Option::is_some).collect();
            let (ok, bad) = {
                let dst = dst
                    .lock()
                    .map_err(|_| "the device region's lock is poisoned")?;
                verify_on_gpu(&gpu, &dst, &decode_staging, &batch, &succeeded)?
            };
            let label = if layerwise {
                "layerwise"
            } else {
                "whole batch"
            };
            runs.push(OverlapRun {
                timeline: times.timeline(label, layerwise, Some(held)),
                pages_verified: ok,
                pages_corrupted: bad,
                rooms_failed: times.failed.len() as u64,
            });
        }
        overlap::share_layer_transfer(&mut runs);
        Ok::<_, String>(OverlapReport {
            memory: format!("GPU ({})", info.name),
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
    // The nodes go before the staging memory they were registered with.
    drop(decode);
    drop(prefill);
    drop(prefill_staging);
    drop(decode_staging);
    result
}
