//! Registered memory: the regions peers may read from and write into.

use std::alloc::{alloc_zeroed, dealloc, Layout as AllocLayout};
use std::ptr::NonNull;

use kvferry_core::layout::SCRATCH_BYTES;
use kvferry_core::{Layout, Region};

/// Alignment of [`HostBuffer`]s: a page, so DMA-capable paths can use them later.
pub const PAGE_ALIGN: usize = 4096;

/// An owned, zeroed, page-aligned host buffer.
#[derive(Debug)]
pub struct HostBuffer {
    ptr: NonNull<u8>,
    len: usize,
}

// SAFETY: HostBuffer uniquely owns its allocation, like a Box<[u8]>.
unsafe impl Send for HostBuffer {}
// SAFETY: shared access only hands out `&[u8]`; mutation needs `&mut self`.
unsafe impl Sync for HostBuffer {}

impl HostBuffer {
    /// Allocates `len` zeroed bytes aligned to [`PAGE_ALIGN`]. `len` 0 gives an empty buffer.
    pub fn new(len: usize) -> Self {
        if len == 0 {
            return HostBuffer {
                ptr: NonNull::dangling(),
                len: 0,
            };
        }
        let layout = match AllocLayout::from_size_align(len, PAGE_ALIGN) {
            Ok(l) => l,
            Err(_) => panic!("buffer of {len} bytes cannot be laid out"),
        };
        // SAFETY: `layout` has a non-zero size.
        let raw = unsafe { alloc_zeroed(layout) };
        let Some(ptr) = NonNull::new(raw) else {
            std::alloc::handle_alloc_error(layout)
        };
        HostBuffer { ptr, len }
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

    fn raw(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        if self.len > 0 {
            if let Ok(layout) = AllocLayout::from_size_align(self.len, PAGE_ALIGN) {
                // SAFETY: allocated in `new` with exactly this layout.
                unsafe { dealloc(self.ptr.as_ptr(), layout) };
            }
        }
    }
}

/// One registered region: base pointer and length.
#[derive(Clone, Copy, Debug)]
struct Extent {
    ptr: *mut u8,
    len: usize,
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
    scratch: Extent,
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
            });
            owned.push(b);
        }
        let mut extent = |len: usize| {
            let b = HostBuffer::new(len.max(1));
            let e = Extent { ptr: b.raw(), len };
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
            scratch,
            _owned: owned,
        }
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
        let kv_len = layout.pages as usize * layout.page_bytes as usize;
        let bad = |region| OutOfBounds {
            region,
            offset: 0,
            len: kv_len as u64,
        };
        if kv.len() != layout.kv_regions() as usize {
            return Err(bad(Region::Kv { layer: 0, plane: 0 }));
        }
        let mut extents = Vec::with_capacity(kv.len());
        for (i, &(ptr, len)) in kv.iter().enumerate() {
            if ptr.is_null() || len < kv_len {
                let planes = u32::from(layout.planes);
                return Err(bad(Region::Kv {
                    layer: (i as u32 / planes) as u16,
                    plane: (i as u32 % planes) as u8,
                }));
            }
            extents.push(Extent { ptr, len: kv_len });
        }
        let check = |want: u64, given: Option<(*mut u8, usize)>, region| match (want, given) {
            (0, _) => Ok(None),
            (w, Some((ptr, len))) if !ptr.is_null() && len as u64 >= w => Ok(Some(Extent {
                ptr,
                len: w as usize,
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
        };
        Ok(MemoryMap {
            layout,
            kv: extents,
            aux,
            state,
            scratch,
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
            Region::Scratch => Some(self.scratch),
        }
    }

    /// Base pointer of `len` bytes at `offset` in `region`, bounds-checked.
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

    /// Reads a registered range (tests, verification). The caller must own the pages per the
    /// core (room concluded on decode, or not yet sent on prefill).
    pub fn read(&self, region: Region, offset: u64, out: &mut [u8]) -> Result<(), OutOfBounds> {
        let ptr = self.range(region, offset, out.len() as u64)?;
        // SAFETY: range() checked the bounds; the page-ownership contract excludes writers.
        unsafe { std::ptr::copy_nonoverlapping(ptr, out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    /// Writes a registered range (filling source pages, free patterns). Same contract as `read`.
    pub fn write(&self, region: Region, offset: u64, data: &[u8]) -> Result<(), OutOfBounds> {
        let ptr = self.range(region, offset, data.len() as u64)?;
        // SAFETY: range() checked the bounds; the page-ownership contract excludes other users.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), ptr, data.len()) };
        Ok(())
    }
}
