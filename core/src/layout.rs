//! Memory layout: which regions an endpoint registered and how pages map to byte ranges.

use smallvec::SmallVec;

/// The shape of an endpoint's registered KV memory, exchanged in the handshake.
///
/// KV memory is one region per (layer, plane), each `pages` pages of `page_bytes` bytes.
/// `planes` is 2 for K and V, 1 for MLA-style joint KV. Aux (per-request metadata rows) and
/// state (per-request recurrent state, e.g. Mamba) regions hold `slots` items each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Layout {
    /// Number of model layers (all of them, not only the ones this endpoint owns).
    pub layers: u16,
    /// KV planes per layer: 2 (K and V) or 1 (joint).
    pub planes: u8,
    /// Bytes of one page in one (layer, plane) region.
    pub page_bytes: u32,
    /// Pages per KV region (the pool size). May differ between peers.
    pub pages: u32,
    /// Bytes of one aux row; 0 when the model has no aux data.
    pub aux_bytes: u32,
    /// Bytes of one state slot; 0 when the model has no recurrent state.
    pub state_bytes: u32,
    /// Aux rows and state slots registered. May differ between peers.
    pub slots: u32,
}

impl Layout {
    /// Whether a peer with layout `other` can exchange KV with us. Capacities may differ.
    pub fn compatible(&self, other: &Layout) -> Result<(), LayoutMismatch> {
        let field = if self.layers != other.layers {
            "layers"
        } else if self.planes != other.planes {
            "planes"
        } else if self.page_bytes != other.page_bytes {
            "page_bytes"
        } else if self.aux_bytes != other.aux_bytes {
            "aux_bytes"
        } else if self.state_bytes != other.state_bytes {
            "state_bytes"
        } else {
            return Ok(());
        };
        Err(LayoutMismatch { field })
    }

    /// Number of KV regions (layers x planes).
    pub fn kv_regions(&self) -> u32 {
        u32::from(self.layers) * u32::from(self.planes)
    }

    /// Size in bytes of a region of this layout, or `None` if the region does not exist.
    pub fn region_len(&self, region: Region) -> Option<u64> {
        match region {
            Region::Kv { layer, plane } if layer < self.layers && plane < self.planes => {
                Some(u64::from(self.pages) * u64::from(self.page_bytes))
            }
            Region::Kv { .. } => None,
            Region::Aux if self.aux_bytes > 0 => {
                Some(u64::from(self.slots) * u64::from(self.aux_bytes))
            }
            Region::State if self.state_bytes > 0 => {
                Some(u64::from(self.slots) * u64::from(self.state_bytes))
            }
            Region::Aux | Region::State => None,
            Region::Scratch => Some(SCRATCH_BYTES),
        }
    }
}

/// Size of the scratch region every endpoint registers for session probes.
pub const SCRATCH_BYTES: u64 = 64;

/// A field where two layouts disagree.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayoutMismatch {
    /// The first differing field.
    pub field: &'static str,
}

/// A registered memory region, named the same way on both peers.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Region {
    /// The KV pages of one layer and plane.
    Kv {
        /// Layer index.
        layer: u16,
        /// 0 = K (or joint KV), 1 = V.
        plane: u8,
    },
    /// Per-request aux rows.
    Aux,
    /// Per-request recurrent state slots.
    State,
    /// A small region each endpoint registers so peers can probe the data path.
    Scratch,
}

const REGION_AUX: u32 = 0xFFFF_FF00;
const REGION_STATE: u32 = 0xFFFF_FF01;
const REGION_SCRATCH: u32 = 0xFFFF_FF02;

impl Region {
    /// Wire encoding: KV regions are `layer << 8 | plane`, special regions use reserved codes.
    pub fn code(self) -> u32 {
        match self {
            Region::Kv { layer, plane } => (u32::from(layer) << 8) | u32::from(plane),
            Region::Aux => REGION_AUX,
            Region::State => REGION_STATE,
            Region::Scratch => REGION_SCRATCH,
        }
    }

    /// Inverse of [`Region::code`]; `None` for codes that name no region.
    pub fn from_code(code: u32) -> Option<Region> {
        match code {
            REGION_AUX => Some(Region::Aux),
            REGION_STATE => Some(Region::State),
            REGION_SCRATCH => Some(Region::Scratch),
            c if c >> 24 == 0 => Some(Region::Kv {
                layer: (c >> 8) as u16,
                plane: (c & 0xFF) as u8,
            }),
            _ => None,
        }
    }
}

/// One contiguous copy: `len` bytes at `src_offset` in the source's `region` to `dst_offset`
/// in the destination's region of the same name.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Slice {
    /// Region on both sides.
    pub region: Region,
    /// Byte offset in the source endpoint's region.
    pub src_offset: u64,
    /// Byte offset in the destination endpoint's region.
    pub dst_offset: u64,
    /// Bytes to copy.
    pub len: u64,
}

/// A run of consecutive page indices `start..start + len`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct PageRun {
    /// First page.
    pub start: u32,
    /// Number of pages.
    pub len: u32,
}

/// Compresses page indices into runs of consecutive pages, in the given order.
pub fn page_runs(pages: &[u32]) -> SmallVec<[PageRun; 4]> {
    let mut runs: SmallVec<[PageRun; 4]> = SmallVec::new();
    for &p in pages {
        match runs.last_mut() {
            Some(r) if r.start.checked_add(r.len) == Some(p) => r.len += 1,
            _ => runs.push(PageRun { start: p, len: 1 }),
        }
    }
    runs
}

/// Sorted, merged page runs of one room: answers "is this byte range inside the room's pages".
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PageSet {
    runs: Vec<PageRun>,
    /// Pages in the runs before each run.
    before: Vec<u32>,
}

impl PageSet {
    /// Builds the set from page indices in any order, duplicates allowed.
    pub fn new(pages: &[u32]) -> Self {
        let mut sorted = pages.to_vec();
        sorted.sort_unstable();
        sorted.dedup();
        let runs = page_runs(&sorted).into_vec();
        let mut before = Vec::with_capacity(runs.len());
        let mut n = 0u32;
        for r in &runs {
            before.push(n);
            n = n.saturating_add(r.len);
        }
        PageSet { runs, before }
    }

    /// Number of pages in the set.
    pub fn len(&self) -> u32 {
        self.runs
            .last()
            .zip(self.before.last())
            .map_or(0, |(r, b)| b.saturating_add(r.len))
    }

    /// Whether the set has no page.
    pub fn is_empty(&self) -> bool {
        self.runs.is_empty()
    }

    /// The position of `page` among the set's pages in ascending order, if it belongs.
    pub fn rank(&self, page: u32) -> Option<u32> {
        let i = self.runs.partition_point(|r| r.start <= page);
        let r = self.runs.get(i.checked_sub(1)?)?;
        (u64::from(page) < u64::from(r.start) + u64::from(r.len))
            .then(|| self.before[i - 1] + (page - r.start))
    }

    /// Whether every page in `first..=last` belongs to the set.
    pub fn contains_range(&self, first: u32, last: u32) -> bool {
        let i = self.runs.partition_point(|r| r.start <= first);
        if i == 0 {
            return false;
        }
        let r = self.runs[i - 1];
        u64::from(last) < u64::from(r.start) + u64::from(r.len)
    }
}
