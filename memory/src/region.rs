//! Registered memory: the regions peers may read from and write into.

use std::alloc::{alloc_zeroed, dealloc, Layout as AllocLayout};
use std::ptr::NonNull;
use std::sync::Arc;

use kvferry_core::layout::SCRATCH_BYTES;
use kvferry_core::{ExtraPool, Layout, Region};

use crate::staging::{CopyDirection, CopyError, CopyJob, InFlightCopies, MemoryKind, Staging};

/// This host's memory page size (`sysconf(_SC_PAGESIZE)`: 4 KiB on x86-64, 16 or 64 KiB on
/// some aarch64 hosts): what [`HostBuffer`]s are aligned to and rounded up to.
pub fn page_size() -> usize {
    static PAGE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *PAGE.get_or_init(rustix::param::page_size)
}

/// An owned, zeroed host buffer on whole pages of its own: page-locking it for DMA never
/// touches a page another allocation shares.
#[derive(Debug)]
pub struct HostBuffer {
    ptr: NonNull<u8>,
    len: usize,
    pages: AllocLayout,
}

// SAFETY: HostBuffer uniquely owns its allocation, like a Box<[u8]>.
unsafe impl Send for HostBuffer {}
// SAFETY: shared access only hands out `&[u8]`; mutation needs `&mut self`.
unsafe impl Sync for HostBuffer {}

impl HostBuffer {
    /// Allocates `len` zeroed bytes on whole pages ([`page_size`]). `len` 0 gives an empty
    /// buffer.
    pub fn new(len: usize) -> Self {
        if len == 0 {
            return HostBuffer {
                ptr: NonNull::dangling(),
                len: 0,
                pages: AllocLayout::new::<()>(),
            };
        }
        let page = page_size();
        let pages = match len
            .checked_next_multiple_of(page)
            .and_then(|bytes| AllocLayout::from_size_align(bytes, page).ok())
        {
            Some(l) => l,
            None => panic!("buffer of {len} bytes cannot be laid out"),
        };
        // SAFETY: `pages` has a non-zero size.
        let raw = unsafe { alloc_zeroed(pages) };
        let Some(ptr) = NonNull::new(raw) else {
            std::alloc::handle_alloc_error(pages)
        };
        HostBuffer { ptr, len, pages }
    }

    /// Bytes allocated: `len` rounded up to whole pages.
    pub fn capacity(&self) -> usize {
        self.pages.size()
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: ptr is valid for len initialised (zeroed) bytes for the life of self.
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as above, and &mut self guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    pub(crate) fn raw(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        if self.len > 0 {
            // SAFETY: allocated in `new` with exactly this layout.
            unsafe { dealloc(self.ptr.as_ptr(), self.pages) };
        }
    }
}

/// One registered region: base pointer, length, and what memory it is.
#[derive(Clone, Copy, Debug)]
struct Extent {
    ptr: *mut u8,
    len: usize,
    kind: MemoryKind,
}

/// One region an embedder registers: its base, its length and what memory it is.
#[derive(Clone, Copy, Debug)]
pub struct ExternalRegion {
    /// First byte.
    pub ptr: *mut u8,
    /// Bytes.
    pub len: usize,
    /// Host memory, or a device's.
    pub kind: MemoryKind,
}

impl ExternalRegion {
    /// Host memory at `ptr`.
    pub fn host(ptr: *mut u8, len: usize) -> Self {
        ExternalRegion {
            ptr,
            len,
            kind: MemoryKind::Host,
        }
    }
}

/// Why a registered range could not be read or written by this process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum AccessError {
    /// The range is not registered.
    OutOfBounds(OutOfBounds),
    /// The range is device memory and this map has no copy engine to reach it.
    NoCopyEngine {
        /// The region.
        region: Region,
        /// What memory it is.
        kind: MemoryKind,
    },
    /// The copy engine failed.
    Copy(CopyError),
}

impl std::fmt::Display for AccessError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            AccessError::OutOfBounds(e) => e.fmt(f),
            AccessError::NoCopyEngine { region, kind } => write!(
                f,
                "{region:?} is {kind}, and no copy engine was registered to reach it"
            ),
            AccessError::Copy(e) => e.fmt(f),
        }
    }
}

impl std::error::Error for AccessError {}

impl From<OutOfBounds> for AccessError {
    fn from(e: OutOfBounds) -> Self {
        AccessError::OutOfBounds(e)
    }
}

/// Where every region of a layout lives in this process.
///
/// The data plane reads source slices from it (prefill) and scatters received bytes into it
/// (decode). Which bytes may be touched, and when, is decided by the core: a write is applied
/// only after [`kvferry_core::Endpoint::check_write`] accepted it for its room, and a page is
/// reused by the embedder only after `Releasable`.
#[derive(Debug)]
pub struct MemoryMap {
    layout: Layout,
    kv: Vec<Extent>,
    aux: Option<Extent>,
    state: Option<Extent>,
    /// One extent per tensor of each extra pool.
    extras: Vec<Vec<Extent>>,
    scratch: Extent,
    staging: Option<Arc<Staging>>,
    _owned: Vec<HostBuffer>,
}

// SAFETY: a MemoryMap only holds addresses of memory that its registrant promised stays valid
// (owned HostBuffers, or external memory under `register_external`'s contract). Concurrent
// access to one byte range is excluded by the core's page ownership (see the type's doc).
unsafe impl Send for MemoryMap {}
// SAFETY: as above.
unsafe impl Sync for MemoryMap {}

/// A region or byte range that does not exist in a [`MemoryMap`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OutOfBounds {
    /// Region asked for.
    pub region: Region,
    /// Offset asked for.
    pub offset: u64,
    /// Length asked for.
    pub len: u64,
}

impl std::fmt::Display for OutOfBounds {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{:?} bytes {}..+{} are not registered",
            self.region, self.offset, self.len
        )
    }
}

impl std::error::Error for OutOfBounds {}

impl MemoryMap {
    /// Allocates owned host memory for every region of `layout` (tests, the CLI, the demo).
    pub fn allocate(layout: Layout) -> Self {
        let mut owned = Vec::new();
        let mut kv = Vec::new();
        let kv_len = layout.pages as usize * layout.page_bytes as usize;
        for _ in 0..layout.kv_regions() {
            let b = HostBuffer::new(kv_len);
            kv.push(Extent {
                ptr: b.raw(),
                len: b.len(),
                kind: MemoryKind::Host,
            });
            owned.push(b);
        }
        let mut extent = |len: usize| {
            let b = HostBuffer::new(len.max(1));
            let e = Extent {
                ptr: b.raw(),
                len,
                kind: MemoryKind::Host,
            };
            owned.push(b);
            e
        };
        let aux = (layout.aux_bytes > 0)
            .then(|| extent(layout.slots as usize * layout.aux_bytes as usize));
        let state = (layout.state_bytes > 0)
            .then(|| extent(layout.slots as usize * layout.state_bytes as usize));
        let scratch = extent(SCRATCH_BYTES as usize);
        MemoryMap {
            layout,
            kv,
            aux,
            state,
            extras: Vec::new(),
            scratch,
            staging: None,
            _owned: owned,
        }
    }

    /// The same map with owned host memory for every tensor of `pools` (tests, the CLI).
    pub fn with_owned_extras(mut self, pools: &[ExtraPool]) -> Self {
        self.extras = pools
            .iter()
            .map(|pool| {
                pool.item_bytes
                    .iter()
                    .map(|b| {
                        let len = pool.items as usize * *b as usize;
                        let buf = HostBuffer::new(len.max(1));
                        let e = Extent {
                            ptr: buf.raw(),
                            len,
                            kind: MemoryKind::Host,
                        };
                        self._owned.push(buf);
                        e
                    })
                    .collect()
            })
            .collect();
        self
    }

    /// The same map with the embedder's memory for every tensor of `pools`: `regions[p][t]`
    /// holds tensor `t` of pool `p`, at least `items × item_bytes[t]` bytes.
    ///
    /// # Safety
    ///
    /// As [`MemoryMap::register_regions`], for every region given.
    pub unsafe fn with_extras(
        mut self,
        pools: &[ExtraPool],
        regions: &[Vec<ExternalRegion>],
    ) -> Result<Self, OutOfBounds> {
        let mut extras = Vec::with_capacity(pools.len());
        for (p, pool) in pools.iter().enumerate() {
            let given = regions.get(p).map_or(&[][..], |v| &v[..]);
            let mut tensors = Vec::with_capacity(pool.item_bytes.len());
            for (t, item) in pool.item_bytes.iter().enumerate() {
                let len = u64::from(pool.items) * u64::from(*item);
                let region = Region::Extra {
                    pool: p as u8,
                    tensor: t as u16,
                };
                match given.get(t) {
                    Some(r) if !r.ptr.is_null() && r.len as u64 >= len => tensors.push(Extent {
                        ptr: r.ptr,
                        len: len as usize,
                        kind: r.kind,
                    }),
                    _ => {
                        return Err(OutOfBounds {
                            region,
                            offset: 0,
                            len,
                        })
                    }
                }
            }
            if given.len() != tensors.len() {
                return Err(OutOfBounds {
                    region: Region::Extra {
                        pool: p as u8,
                        tensor: tensors.len() as u16,
                    },
                    offset: 0,
                    len: 0,
                });
            }
            extras.push(tensors);
        }
        if regions.len() != pools.len() {
            return Err(OutOfBounds {
                region: Region::Extra {
                    pool: pools.len() as u8,
                    tensor: 0,
                },
                offset: 0,
                len: 0,
            });
        }
        self.extras = extras;
        Ok(self)
    }

    /// Like [`MemoryMap::allocate`], with the KV regions standing for memory of CUDA device
    /// `device` (they live on the host): the staged paths run over it through a
    /// [`crate::HostCopyEngine`] on machines without a GPU.
    pub fn allocate_as_device(layout: Layout, device: u32) -> Self {
        let mut map = MemoryMap::allocate(layout);
        for e in map.kv.iter_mut() {
            e.kind = MemoryKind::Cuda { device };
        }
        map
    }

    /// Reaches this map's device regions through `staging` (its engine and buffer pool).
    pub fn with_staging(mut self, staging: Arc<Staging>) -> Self {
        self.staging = Some(staging);
        self
    }

    /// The copy engine and staging pool device regions are reached through, if any.
    pub fn staging(&self) -> Option<&Arc<Staging>> {
        self.staging.as_ref()
    }

    /// Whether a NIC's writes into any of this memory's devices need a flush before the
    /// device's work sees them ([`crate::CopyEngine::flush_remote_writes`]).
    pub fn remote_writes_need_flush(&self) -> bool {
        let Some(staging) = self.staging() else {
            return false;
        };
        self.devices()
            .any(|d| staging.engine().remote_writes_need_flush(d))
    }

    /// Flushes a NIC's writes into each of this memory's devices (see
    /// [`MemoryMap::remote_writes_need_flush`]); the first failure.
    pub fn flush_remote_writes(&self) -> Result<(), CopyError> {
        let Some(staging) = self.staging() else {
            return Ok(());
        };
        self.devices()
            .try_for_each(|d| staging.engine().flush_remote_writes(d))
    }

    /// The devices this memory's regions live on, in order, once each.
    pub fn devices(&self) -> impl Iterator<Item = u32> {
        let mut devices: Vec<u32> = self
            .device_regions()
            .filter_map(|(_, k)| match k {
                MemoryKind::Cuda { device } => Some(device),
                MemoryKind::Host => None,
            })
            .collect();
        devices.sort_unstable();
        devices.dedup();
        devices.into_iter()
    }

    /// What memory `region` is (`None`: not registered).
    pub fn kind(&self, region: Region) -> Option<MemoryKind> {
        self.extent(region).map(|e| e.kind)
    }

    /// The first device region this map cannot reach (no copy engine), if any: a node over
    /// such memory must refuse to start, naming it.
    pub fn unreachable_region(&self) -> Option<(Region, MemoryKind)> {
        if self.staging.is_some() {
            return None;
        }
        self.device_regions().next()
    }

    /// Every region and what memory it is.
    pub fn kinds(&self) -> impl Iterator<Item = (Region, MemoryKind)> + '_ {
        self.regions().map(|(r, e)| (r, e.kind))
    }

    /// Every registered region and its length in bytes (KV, aux, state, scratch, extras).
    pub fn region_lens(&self) -> impl Iterator<Item = (Region, u64)> + '_ {
        self.regions()
            .filter(|(_, e)| e.len > 0)
            .map(|(r, e)| (r, e.len as u64))
    }

    /// Every device region and what memory it is.
    pub fn device_regions(&self) -> impl Iterator<Item = (Region, MemoryKind)> + '_ {
        self.regions()
            .filter(|(_, e)| e.kind != MemoryKind::Host)
            .map(|(r, e)| (r, e.kind))
    }

    fn regions(&self) -> impl Iterator<Item = (Region, Extent)> + '_ {
        let planes = self.layout.planes.max(1);
        let kv = self.kv.iter().enumerate().map(move |(i, e)| {
            let region = Region::Kv {
                layer: (i / usize::from(planes)) as u16,
                plane: (i % usize::from(planes)) as u8,
            };
            (region, *e)
        });
        let others = [
            self.aux.map(|e| (Region::Aux, e)),
            self.state.map(|e| (Region::State, e)),
            Some((Region::Scratch, self.scratch)),
        ];
        let extras = self.extras.iter().enumerate().flat_map(|(p, tensors)| {
            tensors.iter().enumerate().map(move |(t, e)| {
                let region = Region::Extra {
                    pool: p as u8,
                    tensor: t as u16,
                };
                (region, *e)
            })
        });
        kv.chain(others.into_iter().flatten()).chain(extras)
    }

    /// Registers memory the embedder owns (GPU-mapped host memory, a KV pool, ...).
    ///
    /// `kv` holds one `(base, len)` per KV region in `layer * planes + plane` order; `aux` and
    /// `state` are required when the layout has them. A scratch region is allocated here.
    ///
    /// # Safety
    ///
    /// Every pointer must be valid for reads and writes of its length for as long as this map
    /// (and any clone of the `Arc` holding it) lives, and the embedder must not touch pages of
    /// a room between granting/sending them and the room's `Releasable` event.
    pub unsafe fn register_external(
        layout: Layout,
        kv: &[(*mut u8, usize)],
        aux: Option<(*mut u8, usize)>,
        state: Option<(*mut u8, usize)>,
    ) -> Result<Self, OutOfBounds> {
        let kv: Vec<ExternalRegion> = kv
            .iter()
            .map(|&(p, l)| ExternalRegion::host(p, l))
            .collect();
        let aux = aux.map(|(p, l)| ExternalRegion::host(p, l));
        let state = state.map(|(p, l)| ExternalRegion::host(p, l));
        // SAFETY: the caller's contract, unchanged.
        unsafe { MemoryMap::register_regions(layout, &kv, aux, state) }
    }

    /// Registers memory the embedder owns, each region host or device memory (a GPU's KV
    /// pool). Device regions are never read or written by the CPU: the data plane reaches
    /// them through the copy engine given with [`MemoryMap::with_staging`], and a node over
    /// device memory it cannot reach refuses to start ([`MemoryMap::unreachable_region`]).
    ///
    /// # Safety
    ///
    /// As [`MemoryMap::register_external`]; a device region's pointer must be a device
    /// address of its device valid for its length.
    pub unsafe fn register_regions(
        layout: Layout,
        kv: &[ExternalRegion],
        aux: Option<ExternalRegion>,
        state: Option<ExternalRegion>,
    ) -> Result<Self, OutOfBounds> {
        // SAFETY: the caller's contract, unchanged.
        unsafe { MemoryMap::register_stage(layout, 0..layout.layers, kv, aux, state) }
    }

    /// As [`MemoryMap::register_regions`] for a pipeline stage that holds only `layers`: `kv`
    /// has one region per (layer, plane) of those layers, and any access to another layer's
    /// region is out of bounds.
    ///
    /// # Safety
    ///
    /// As [`MemoryMap::register_regions`].
    pub unsafe fn register_stage(
        layout: Layout,
        layers: core::ops::Range<u16>,
        kv: &[ExternalRegion],
        aux: Option<ExternalRegion>,
        state: Option<ExternalRegion>,
    ) -> Result<Self, OutOfBounds> {
        let kv_len = layout.pages as usize * layout.page_bytes as usize;
        let bad = |region| OutOfBounds {
            region,
            offset: 0,
            len: kv_len as u64,
        };
        let planes = usize::from(layout.planes);
        let owned = usize::from(layers.end.saturating_sub(layers.start));
        if layers.end > layout.layers || kv.len() != owned * planes {
            return Err(bad(Region::Kv {
                layer: layers.start,
                plane: 0,
            }));
        }
        let mut extents = Vec::with_capacity(usize::from(layout.layers) * planes);
        let none = Extent {
            ptr: core::ptr::NonNull::<u8>::dangling().as_ptr(),
            len: 0,
            kind: MemoryKind::Host,
        };
        extents.resize(usize::from(layers.start) * planes, none);
        for (i, r) in kv.iter().enumerate() {
            if r.ptr.is_null() || r.len < kv_len {
                return Err(bad(Region::Kv {
                    layer: layers.start + (i / planes) as u16,
                    plane: (i % planes) as u8,
                }));
            }
            extents.push(Extent {
                ptr: r.ptr,
                len: kv_len,
                kind: r.kind,
            });
        }
        extents.resize(usize::from(layout.layers) * planes, none);
        let check = |want: u64, given: Option<ExternalRegion>, region| match (want, given) {
            (0, _) => Ok(None),
            (w, Some(r)) if !r.ptr.is_null() && r.len as u64 >= w => Ok(Some(Extent {
                ptr: r.ptr,
                len: w as usize,
                kind: r.kind,
            })),
            (w, _) => Err(OutOfBounds {
                region,
                offset: 0,
                len: w,
            }),
        };
        let aux = check(
            u64::from(layout.slots) * u64::from(layout.aux_bytes),
            aux,
            Region::Aux,
        )?;
        let state = check(
            u64::from(layout.slots) * u64::from(layout.state_bytes),
            state,
            Region::State,
        )?;
        let scratch_buf = HostBuffer::new(SCRATCH_BYTES as usize);
        let scratch = Extent {
            ptr: scratch_buf.raw(),
            len: SCRATCH_BYTES as usize,
            kind: MemoryKind::Host,
        };
        Ok(MemoryMap {
            layout,
            kv: extents,
            aux,
            state,
            extras: Vec::new(),
            scratch,
            staging: None,
            _owned: vec![scratch_buf],
        })
    }

    /// The layout this memory was registered for.
    pub fn layout(&self) -> &Layout {
        &self.layout
    }

    fn extent(&self, region: Region) -> Option<Extent> {
        match region {
            Region::Kv { layer, plane } if plane < self.layout.planes => self
                .kv
                .get(usize::from(layer) * usize::from(self.layout.planes) + usize::from(plane))
                .copied(),
            Region::Kv { .. } => None,
            Region::Aux => self.aux,
            Region::State => self.state,
            Region::Extra { pool, tensor } => self
                .extras
                .get(usize::from(pool))?
                .get(usize::from(tensor))
                .copied(),
            Region::Scratch => Some(self.scratch),
        }
    }

    /// Base pointer of `len` bytes at `offset` in `region`, bounds-checked, if the CPU may
    /// touch them: an error for device memory, which only a copy engine reaches.
    pub fn host_range(
        &self,
        region: Region,
        offset: u64,
        len: u64,
    ) -> Result<*mut u8, AccessError> {
        let ptr = self.range(region, offset, len)?;
        match self.kind(region) {
            Some(MemoryKind::Host) | None => Ok(ptr),
            Some(kind) => Err(AccessError::NoCopyEngine { region, kind }),
        }
    }

    /// Base pointer of `len` bytes at `offset` in `region`, bounds-checked, whatever memory it
    /// is (a device address for device regions: never dereference it on the CPU).
    pub fn range(&self, region: Region, offset: u64, len: u64) -> Result<*mut u8, OutOfBounds> {
        let oob = OutOfBounds {
            region,
            offset,
            len,
        };
        let e = self.extent(region).ok_or(oob)?;
        let end = offset.checked_add(len).ok_or(oob)?;
        if end > e.len as u64 {
            return Err(oob);
        }
        // SAFETY: offset + len <= e.len, so the result stays inside the registered extent.
        Ok(unsafe { e.ptr.add(offset as usize) })
    }

    /// Reads a registered range (tests, verification); device memory through the copy
    /// engine, waiting on this thread. The caller must own the pages per the core (room
    /// concluded on decode, or not yet sent on prefill).
    pub fn read(&self, region: Region, offset: u64, out: &mut [u8]) -> Result<(), AccessError> {
        let ptr = self.range(region, offset, out.len() as u64)?;
        match self.kind(region) {
            Some(MemoryKind::Cuda { device }) => self.staged_blocking(
                region,
                device,
                CopyDirection::DeviceToHost,
                ptr as usize,
                out,
            ),
            _ => {
                // SAFETY: range() checked the bounds; host memory; the page-ownership
                // contract excludes writers.
                unsafe { std::ptr::copy_nonoverlapping(ptr, out.as_mut_ptr(), out.len()) };
                Ok(())
            }
        }
    }

    /// Writes a registered range (filling source pages, free patterns); device memory
    /// through the copy engine. Same contract as `read`.
    pub fn write(&self, region: Region, offset: u64, data: &[u8]) -> Result<(), AccessError> {
        let ptr = self.range(region, offset, data.len() as u64)?;
        match self.kind(region) {
            Some(MemoryKind::Cuda { device }) => {
                let mut data = data.to_vec();
                self.staged_blocking(
                    region,
                    device,
                    CopyDirection::HostToDevice,
                    ptr as usize,
                    &mut data,
                )
            }
            _ => {
                // SAFETY: range() checked the bounds; host memory; the page-ownership
                // contract excludes other users.
                unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), ptr, data.len()) };
                Ok(())
            }
        }
    }

    /// Copies between device address `device_addr` and `host` through a buffer of its own
    /// (never the data plane's pool: a thread waiting here must not wait for buffers that
    /// tasks of its own runtime hold), waiting on this thread.
    fn staged_blocking(
        &self,
        region: Region,
        device: u32,
        direction: CopyDirection,
        device_addr: usize,
        host: &mut [u8],
    ) -> Result<(), AccessError> {
        let Some(staging) = &self.staging else {
            return Err(AccessError::NoCopyEngine {
                region,
                kind: MemoryKind::Cuda { device },
            });
        };
        let mut buf = HostBuffer::new(host.len().min(staging.config().buffer_bytes));
        let addr = buf.raw() as usize;
        let mut done = 0;
        while done < host.len() {
            let n = buf.len().min(host.len() - done);
            if direction == CopyDirection::HostToDevice {
                buf.as_mut_slice()[..n].copy_from_slice(&host[done..done + n]);
            }
            let job = match direction {
                CopyDirection::DeviceToHost => CopyJob {
                    dst: addr,
                    src: device_addr + done,
                    len: n,
                },
                CopyDirection::HostToDevice => CopyJob {
                    dst: device_addr + done,
                    src: addr,
                    len: n,
                },
            };
            let mut copies = InFlightCopies::default();
            copies.start(staging, device, direction, vec![job]);
            copies.wait_blocking().map_err(AccessError::Copy)?;
            if direction == CopyDirection::DeviceToHost {
                host[done..done + n].copy_from_slice(&buf.as_slice()[..n]);
            }
            done += n;
        }
        Ok(())
    }
}
