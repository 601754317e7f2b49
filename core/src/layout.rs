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
    /// Whether a peer with layout `other` can exchange KV with us. Capacities may differ, and
    /// so may `page_bytes` where the two hold different heads of the same model
    /// ([`Heads::compatible`] checks those).
    pub fn compatible(&self, other: &Layout) -> Result<(), LayoutMismatch> {
        let pairs = [
            ("layers", u64::from(self.layers), u64::from(other.layers)),
            ("planes", u64::from(self.planes), u64::from(other.planes)),
            (
                "aux_bytes",
                u64::from(self.aux_bytes),
                u64::from(other.aux_bytes),
            ),
            (
                "state_bytes",
                u64::from(self.state_bytes),
                u64::from(other.state_bytes),
            ),
        ];
        LayoutMismatch::first(&pairs)
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
            // Extra pools are described beside the layout (see `EndpointInfo::region_len`).
            Region::Extra { .. } => None,
            Region::Scratch => Some(SCRATCH_BYTES),
        }
    }
}

/// Size of the scratch region every endpoint registers for session probes.
pub const SCRATCH_BYTES: u64 = 64;

/// Most extra pools an endpoint may register.
pub const MAX_EXTRA_POOLS: usize = 16;
/// Most tensors in one extra pool.
pub const MAX_EXTRA_TENSORS: usize = 4096;

/// A pool of per-request data that moves with a room besides its KV pages, addressed by its
/// own item indices: a model's recurrent state slots (Mamba), its sliding-window KV pages
/// (their own page size and pool), its sparse-attention indexer pages. Each of the pool's
/// tensors is one region ([`Region::Extra`]) of `items` items of that tensor's `item_bytes`;
/// a room names the same item indices in every tensor of the pool.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub struct ExtraPool {
    /// Items (slots or pages) each tensor of the pool holds. May differ between peers.
    pub items: u32,
    /// Bytes of one item in each tensor, in tensor order. Must match the peer's unless the
    /// tensor is split into [`ItemPart`]s.
    pub item_bytes: Vec<u32>,
    /// Per tensor, the parts tensor parallelism splits its items into (a recurrent layer's
    /// conv channels and SSM heads); empty for a tensor whose items move whole, and empty
    /// altogether when no tensor is split.
    pub parts: Vec<Vec<ItemPart>>,
}

/// Most parts one extra tensor's items split into.
pub const MAX_ITEM_PARTS: usize = 64;

/// One part of an extra tensor's item that tensor parallelism splits across ranks: `rows`
/// rows `stride` bytes apart from `offset` in the item, each holding this endpoint's `count`
/// units (`first..first + count` of the model's `units`) of `unit_bytes` bytes. A GDN
/// layer's conv state is three such parts per kernel row (its query, key and value channels),
/// its SSM state one (its value heads). Peers copy, row for row, the units both hold.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ItemPart {
    /// Where the part's first row starts in the item.
    pub offset: u32,
    /// Rows, at least 1.
    pub rows: u32,
    /// Bytes from one row's start to the next one's (ignored for one row).
    pub stride: u32,
    /// Units of the whole model (every rank's together).
    pub units: u16,
    /// First unit this endpoint holds.
    pub first: u16,
    /// Units this endpoint holds, contiguous in each row.
    pub count: u16,
    /// Bytes of one unit.
    pub unit_bytes: u32,
}

impl ItemPart {
    /// Bytes of this endpoint's share of one row.
    pub fn row_bytes(&self) -> u64 {
        u64::from(self.count) * u64::from(self.unit_bytes)
    }

    /// Where the part ends in the item; `None` for a part no endpoint registers: no row, no
    /// unit held, units past the model's, or rows that overlap.
    pub fn end(&self) -> Option<u64> {
        let row = self.row_bytes();
        let stride = if self.rows > 1 {
            u64::from(self.stride)
        } else {
            0
        };
        let well_formed = self.rows > 0
            && self.count > 0
            && self.unit_bytes > 0
            && u32::from(self.first) + u32::from(self.count) <= u32::from(self.units);
        if !well_formed {
            return None;
        }
        rows_end(u64::from(self.offset), row, self.rows, stride)
    }
}

/// How one tensor of an extra pool's items go from a source to a destination.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum ItemCopy {
    /// Whole items of the same size on both sides.
    Whole,
    /// The units both hold, part by part (offsets within an item; parts sharing none
    /// left out), between items of `src_item` and `dst_item` bytes.
    Parts {
        /// Bytes of one item at the source.
        src_item: u64,
        /// Bytes of one item at the destination.
        dst_item: u64,
        /// The shared units of each part both hold some of, in part order.
        parts: Vec<PartCopy>,
    },
}

/// The shared units of one [`ItemPart`] between a source and a destination, within an item.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct PartCopy {
    /// Which of the tensor's parts.
    pub part: u8,
    /// The model's units both hold, `lo..hi`.
    pub units: core::ops::Range<u16>,
    /// Where the first row's shared units sit in the source's item.
    pub src_offset: u64,
    /// Where they go in the destination's item.
    pub dst_offset: u64,
    /// Bytes of each row's shared units.
    pub len: u64,
    /// Rows.
    pub rows: u32,
    /// Row stride in the source's item (0 for one row).
    pub src_stride: u64,
    /// Row stride in the destination's item (0 for one row).
    pub dst_stride: u64,
}

/// Per pool and tensor, how items go from one endpoint's extra pools to another's.
pub type ExtraCopies = Vec<Vec<ItemCopy>>;

impl PartCopy {
    /// The row of this part a write of `len` bytes at `at` (within the destination's item)
    /// starts on, if it is exactly that row's shared units.
    pub fn row_at(&self, at: u64, len: u64) -> Option<u32> {
        let rel = at.checked_sub(self.dst_offset)?;
        if len != self.len {
            return None;
        }
        let row = if self.rows > 1 {
            (rel % self.dst_stride == 0).then(|| rel / self.dst_stride)?
        } else {
            (rel == 0).then_some(0)?
        };
        u32::try_from(row).ok().filter(|r| *r < self.rows)
    }
}

impl ExtraPool {
    /// Bytes of one item of tensor `tensor` of pool `pool` among `pools`; 0 when there is
    /// no such tensor.
    pub fn item_bytes_of(pools: &[ExtraPool], pool: u8, tensor: u16) -> u64 {
        pools
            .get(usize::from(pool))
            .and_then(|p| p.item_bytes.get(usize::from(tensor)))
            .map_or(0, |b| u64::from(*b))
    }

    /// Size in bytes of tensor `tensor`'s region, or `None` if the pool has no such tensor.
    pub fn region_len(&self, tensor: u16) -> Option<u64> {
        let item = self.item_bytes.get(usize::from(tensor))?;
        Some(u64::from(self.items) * u64::from(*item))
    }

    /// The first item of `lists` (one list per pool) outside `pools`, as (pool, item, items
    /// the pool holds); a list for a pool that does not exist is reported with 0 items.
    pub fn out_of_range(pools: &[ExtraPool], lists: &[Vec<u32>]) -> Option<(usize, u32, u32)> {
        lists
            .iter()
            .enumerate()
            .find_map(|(p, list)| match pools.get(p) {
                None => (!list.is_empty()).then_some((p, list[0], 0)),
                Some(pool) => list
                    .iter()
                    .find(|i| **i >= pool.items)
                    .map(|i| (p, *i, pool.items)),
            })
    }

    /// The parts tensor `tensor`'s items split into (empty: whole items).
    pub fn parts_of(&self, tensor: usize) -> &[ItemPart] {
        self.parts.get(tensor).map_or(&[][..], |p| &p[..])
    }

    /// Why this endpoint's own pools cannot be registered, if they cannot: more than
    /// [`MAX_ITEM_PARTS`] parts to a tensor, parts for some tensors of a pool but not a list
    /// per tensor, a part that is not inside its item ([`ItemPart::end`]), or two parts of
    /// one tensor that overlap (a row of one would be counted as the other's).
    pub fn invalid_parts(pools: &[ExtraPool]) -> Option<String> {
        for (p, pool) in pools.iter().enumerate() {
            if !pool.parts.is_empty() && pool.parts.len() != pool.item_bytes.len() {
                return Some(format!(
                    "pool {p}: parts for {} tensors, the pool has {}",
                    pool.parts.len(),
                    pool.item_bytes.len()
                ));
            }
            for (t, parts) in pool.parts.iter().enumerate() {
                if parts.len() > MAX_ITEM_PARTS {
                    return Some(format!("pool {p} tensor {t}: {} parts", parts.len()));
                }
                let item = u64::from(pool.item_bytes[t]);
                if let Some(k) = parts
                    .iter()
                    .position(|x| x.end().map_or(true, |e| e > item))
                {
                    return Some(format!(
                        "pool {p} tensor {t}: part {k} {:?} is not inside a {item}-byte item",
                        parts[k]
                    ));
                }
                let mut bytes: Vec<(u64, u64, usize)> = Vec::new();
                for (k, x) in parts.iter().enumerate() {
                    let stride = if x.rows > 1 { u64::from(x.stride) } else { 0 };
                    for row in 0..u64::from(x.rows) {
                        let at = u64::from(x.offset) + row * stride;
                        bytes.push((at, at + x.row_bytes(), k));
                    }
                }
                bytes.sort_unstable();
                if let Some(w) = bytes.windows(2).find(|w| w[1].0 < w[0].1) {
                    return Some(format!(
                        "pool {p} tensor {t}: parts {} and {} overlap",
                        w[0].2, w[1].2
                    ));
                }
            }
        }
        None
    }

    /// Whether every tensor of every pool is split into parts (and there is a pool).
    pub fn all_split(pools: &[ExtraPool]) -> bool {
        !pools.is_empty()
            && pools
                .iter()
                .all(|p| (0..p.item_bytes.len()).all(|t| !p.parts_of(t).is_empty()))
    }

    /// Whether two endpoints' extra pools can exchange data: the same pools, each with the
    /// same tensors, each of the same item size or split into the same parts (rows, units
    /// and unit size; which units each holds, and where, may differ). Item counts may differ.
    pub fn compatible(ours: &[ExtraPool], theirs: &[ExtraPool]) -> Result<(), LayoutMismatch> {
        LayoutMismatch::first(&[("extra_pools", ours.len() as u64, theirs.len() as u64)])?;
        for (a, b) in ours.iter().zip(theirs) {
            LayoutMismatch::first(&[(
                "extra_tensors",
                a.item_bytes.len() as u64,
                b.item_bytes.len() as u64,
            )])?;
            for (t, (x, y)) in a.item_bytes.iter().zip(&b.item_bytes).enumerate() {
                let (pa, pb) = (a.parts_of(t), b.parts_of(t));
                let mut pairs = vec![("extra_parts", pa.len() as u64, pb.len() as u64)];
                if pa.is_empty() {
                    pairs.push(("extra_item_bytes", u64::from(*x), u64::from(*y)));
                }
                for (p, q) in pa.iter().zip(pb) {
                    pairs.push(("extra_part_rows", u64::from(p.rows), u64::from(q.rows)));
                    pairs.push(("extra_part_units", u64::from(p.units), u64::from(q.units)));
                    pairs.push((
                        "extra_part_unit_bytes",
                        u64::from(p.unit_bytes),
                        u64::from(q.unit_bytes),
                    ));
                }
                LayoutMismatch::first(&pairs)?;
            }
        }
        Ok(())
    }

    /// How items go from `src`'s pools to `dst`'s (pools [`ExtraPool::compatible`] accepted):
    /// whole where a tensor is not split, or split the same way with the same item size on
    /// both sides; otherwise, part by part, the units both hold.
    pub fn copies(src: &[ExtraPool], dst: &[ExtraPool]) -> ExtraCopies {
        src.iter()
            .zip(dst)
            .map(|(s, d)| {
                (0..s.item_bytes.len())
                    .map(|t| {
                        let (ps, pd) = (s.parts_of(t), d.parts_of(t));
                        if ps == pd && s.item_bytes.get(t) == d.item_bytes.get(t) {
                            return ItemCopy::Whole;
                        }
                        ItemCopy::Parts {
                            src_item: u64::from(s.item_bytes[t]),
                            dst_item: d.item_bytes.get(t).map_or(0, |b| u64::from(*b)),
                            parts: ps
                                .iter()
                                .zip(pd)
                                .enumerate()
                                .filter_map(|(k, (a, b))| part_copy(k as u8, a, b))
                                .collect(),
                        }
                    })
                    .collect()
            })
            .collect()
    }
}

/// The units of one part both `a` (source) and `b` (destination) hold; `None` when none.
fn part_copy(part: u8, a: &ItemPart, b: &ItemPart) -> Option<PartCopy> {
    let lo = a.first.max(b.first);
    let hi = (a.first + a.count).min(b.first + b.count);
    if hi <= lo {
        return None;
    }
    let unit = u64::from(a.unit_bytes);
    let multi = a.rows > 1;
    Some(PartCopy {
        part,
        units: lo..hi,
        src_offset: u64::from(a.offset) + u64::from(lo - a.first) * unit,
        dst_offset: u64::from(b.offset) + u64::from(lo - b.first) * unit,
        len: u64::from(hi - lo) * unit,
        rows: a.rows,
        src_stride: if multi { u64::from(a.stride) } else { 0 },
        dst_stride: if multi { u64::from(b.stride) } else { 0 },
    })
}

/// A field where two layouts disagree, with both values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LayoutMismatch {
    /// The first differing field.
    pub field: &'static str,
    /// This endpoint's value.
    pub ours: u64,
    /// The peer's value.
    pub theirs: u64,
}

impl LayoutMismatch {
    /// The first of `(field, ours, theirs)` whose values differ.
    pub fn first(pairs: &[(&'static str, u64, u64)]) -> Result<(), LayoutMismatch> {
        match pairs.iter().find(|(_, a, b)| a != b) {
            Some(&(field, ours, theirs)) => Err(LayoutMismatch {
                field,
                ours,
                theirs,
            }),
            None => Ok(()),
        }
    }
}

impl core::fmt::Display for LayoutMismatch {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        write!(
            f,
            "layout field {} differs: this node has {}, the peer {}",
            self.field, self.ours, self.theirs
        )
    }
}

/// Which of the model's KV heads an endpoint holds in every token row of its pages, when
/// attention heads are split across tensor-parallel ranks.
///
/// A page is `page_tokens` rows, one per token, each holding `count` heads of `head_bytes`
/// bytes: `page_bytes = page_tokens × count × head_bytes`. Peers that hold the same heads copy
/// whole pages; peers that hold different heads copy, for every token, the bytes of the heads
/// both hold (a head slice). The default, one head of `page_bytes` out of one, is an
/// endpoint that does not split heads (and MLA's latent KV, which every rank holds whole).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Heads {
    /// KV heads of the whole model (every rank's together).
    pub total: u16,
    /// First head this endpoint holds.
    pub start: u16,
    /// Heads this endpoint holds, contiguous in each token row.
    pub count: u16,
    /// Bytes of one head of one token (head dimension × element size).
    pub head_bytes: u32,
}

impl Heads {
    /// Whole pages: one head that is the whole page, of one.
    pub fn whole(layout: &Layout) -> Heads {
        Heads {
            total: 1,
            start: 0,
            count: 1,
            head_bytes: layout.page_bytes,
        }
    }

    /// Bytes of one token row (the heads this endpoint holds).
    pub fn row_bytes(&self) -> u64 {
        u64::from(self.count) * u64::from(self.head_bytes)
    }

    /// Tokens per page of `page_bytes`, or `None` when such pages are not whole rows of
    /// these heads (or the heads are out of range).
    pub fn page_tokens(&self, page_bytes: u32) -> Option<u32> {
        let row = self.row_bytes();
        let fits = self.count > 0
            && self.head_bytes > 0
            && u32::from(self.start) + u32::from(self.count) <= u32::from(self.total);
        (fits && u64::from(page_bytes) % row == 0).then(|| (u64::from(page_bytes) / row) as u32)
    }

    /// Heads both endpoints hold, `start..end`; empty when they share none.
    pub fn shared(&self, other: &Heads) -> core::ops::Range<u16> {
        let start = self.start.max(other.start);
        let end = (self.start + self.count).min(other.start + other.count);
        start..end.max(start)
    }

    /// How a peer holding `theirs` writes into this endpoint's pages of `page_bytes`: the
    /// bytes of each token row it fills; `None` when it holds the same heads (whole pages).
    pub fn row_write(&self, page_bytes: u32, theirs: &Heads) -> Option<RowWrite> {
        if self == theirs {
            return None;
        }
        let shared = self.shared(theirs);
        let head = u64::from(self.head_bytes);
        Some(RowWrite {
            row_bytes: self.row_bytes(),
            skip: u64::from(shared.start.saturating_sub(self.start)) * head,
            len: u64::from(shared.end - shared.start) * head,
            tokens: self.page_tokens(page_bytes).unwrap_or(0),
        })
    }

    /// Whether a peer holding `theirs` over `their_layout` splits the same model the same
    /// way: total heads, head size and tokens per page agree (the heads held may differ).
    pub fn compatible(
        &self,
        layout: &Layout,
        theirs: &Heads,
        their_layout: &Layout,
    ) -> Result<(), LayoutMismatch> {
        let tokens = |h: &Heads, l: &Layout| u64::from(h.page_tokens(l.page_bytes).unwrap_or(0));
        let page_bytes = if self.count == theirs.count {
            (layout.page_bytes, their_layout.page_bytes)
        } else {
            (0, 0) // different heads held: their pages are meant to differ in size
        };
        LayoutMismatch::first(&[
            (
                "heads_total",
                u64::from(self.total),
                u64::from(theirs.total),
            ),
            (
                "page_bytes",
                u64::from(page_bytes.0),
                u64::from(page_bytes.1),
            ),
            (
                "head_bytes",
                u64::from(self.head_bytes),
                u64::from(theirs.head_bytes),
            ),
            (
                "page_tokens",
                tokens(self, layout),
                tokens(theirs, their_layout),
            ),
        ])
    }
}

/// The part of each of this endpoint's token rows that one peer writes (the heads both hold).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RowWrite {
    /// Bytes of one of our token rows.
    pub row_bytes: u64,
    /// Where the peer's part starts in each row.
    pub skip: u64,
    /// Bytes of the peer's part of each row (0 when it holds none of our heads).
    pub len: u64,
    /// Token rows per page.
    pub tokens: u32,
}

impl RowWrite {
    /// Whether `len` bytes at `offset` of a region are exactly the peer's part of one row,
    /// or (when its part is the whole row) whole rows.
    pub fn admits(&self, offset: u64, len: u64) -> bool {
        if self.len == 0 || self.row_bytes == 0 {
            false
        } else if self.len == self.row_bytes {
            offset % self.row_bytes == 0 && len % self.row_bytes == 0
        } else {
            offset % self.row_bytes == self.skip && len == self.len
        }
    }

    /// Whether every row of `slice` is admitted: one row as [`RowWrite::admits`]; several
    /// rows the peer's part of token rows a whole number of rows apart.
    pub fn admits_rows(&self, slice: &Slice) -> bool {
        self.admits(slice.dst_offset, slice.len)
            && (slice.rows == 1
                || (self.len == slice.len && slice.dst_stride % self.row_bytes == 0))
    }

    /// The token rows (region-wide row numbers) that an admitted write fills.
    pub fn rows(&self, offset: u64, len: u64) -> core::ops::Range<u64> {
        let first = offset / self.row_bytes;
        first..first + (len / self.row_bytes).max(1)
    }
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
    /// One tensor of an extra pool ([`ExtraPool`]).
    Extra {
        /// The pool's index among the endpoint's extra pools.
        pool: u8,
        /// The tensor's index in its pool.
        tensor: u16,
    },
    /// A small region each endpoint registers so peers can probe the data path.
    Scratch,
}

const REGION_AUX: u32 = 0xFFFF_FF00;
const REGION_STATE: u32 = 0xFFFF_FF01;
const REGION_SCRATCH: u32 = 0xFFFF_FF02;
/// Extra regions are `0xFE << 24 | pool << 16 | tensor`.
const REGION_EXTRA: u32 = 0xFE;

impl Region {
    /// Wire encoding: KV regions are `layer << 8 | plane`, extra regions
    /// `0xFE << 24 | pool << 16 | tensor`, special regions use reserved codes.
    pub fn code(self) -> u32 {
        match self {
            Region::Kv { layer, plane } => (u32::from(layer) << 8) | u32::from(plane),
            Region::Aux => REGION_AUX,
            Region::State => REGION_STATE,
            Region::Extra { pool, tensor } => {
                (REGION_EXTRA << 24) | (u32::from(pool) << 16) | u32::from(tensor)
            }
            Region::Scratch => REGION_SCRATCH,
        }
    }

    /// Whether a decode lets its sources write this region over a one-sided path (RDMA,
    /// same-host copies): those rooms and probes write (KV, aux, state, extras, and the
    /// 64-byte scratch region only probes write, which holds nothing anyone reads).
    pub fn written_by_peers(self) -> bool {
        matches!(
            self,
            Region::Kv { .. }
                | Region::Aux
                | Region::State
                | Region::Extra { .. }
                | Region::Scratch
        )
    }

    /// Inverse of [`Region::code`]; `None` for codes that name no region.
    pub fn from_code(code: u32) -> Option<Region> {
        match code {
            REGION_AUX => Some(Region::Aux),
            REGION_STATE => Some(Region::State),
            REGION_SCRATCH => Some(Region::Scratch),
            c if c >> 24 == REGION_EXTRA && ((c >> 16) & 0xFF) < MAX_EXTRA_POOLS as u32 => {
                Some(Region::Extra {
                    pool: (c >> 16) as u8,
                    tensor: c as u16,
                })
            }
            c if c >> 24 == 0 => Some(Region::Kv {
                layer: (c >> 8) as u16,
                plane: (c & 0xFF) as u8,
            }),
            _ => None,
        }
    }
}

/// One copy of `rows` rows of `len` bytes each: row `i` is read at `src_offset + i x
/// src_stride` in the source's `region` and written at `dst_offset + i x dst_stride` in the
/// destination's region of the same name. A contiguous run is one row (strides 0); a head
/// slice of every token row of a page is one strided slice.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Slice {
    /// Region on both sides.
    pub region: Region,
    /// Byte offset of the first row in the source endpoint's region.
    pub src_offset: u64,
    /// Byte offset of the first row in the destination endpoint's region.
    pub dst_offset: u64,
    /// Bytes in each row.
    pub len: u64,
    /// Rows, at least 1.
    pub rows: u32,
    /// Bytes from one row's start to the next one's in the source (0 for one row).
    pub src_stride: u64,
    /// Bytes from one row's start to the next one's in the destination (0 for one row).
    pub dst_stride: u64,
}

impl Slice {
    /// One contiguous run of `len` bytes.
    pub const fn run(region: Region, src_offset: u64, dst_offset: u64, len: u64) -> Self {
        Slice {
            region,
            src_offset,
            dst_offset,
            len,
            rows: 1,
            src_stride: 0,
            dst_stride: 0,
        }
    }

    /// Bytes the slice moves: `rows x len`, saturating.
    pub fn bytes(&self) -> u64 {
        self.len.saturating_mul(u64::from(self.rows))
    }

    /// Where row `i` starts: `(src, dst)` offsets.
    pub fn row(&self, i: u32) -> (u64, u64) {
        let i = u64::from(i);
        (
            self.src_offset + i * self.src_stride,
            self.dst_offset + i * self.dst_stride,
        )
    }

    /// Every row as a contiguous run, in order.
    pub fn runs(&self) -> impl Iterator<Item = Slice> + '_ {
        (0..self.rows).map(|i| {
            let (src, dst) = self.row(i);
            Slice::run(self.region, src, dst, self.len)
        })
    }

    /// Where the destination's last row ends; `None` for a shape [`rows_end`] refuses.
    pub fn dst_end(&self) -> Option<u64> {
        rows_end(self.dst_offset, self.len, self.rows, self.dst_stride)
    }
}

/// Bytes of one slice descriptor on the wire (write batches, operation checksums): `region`
/// u32, `offset` u64, `len` u64, `rows` u32, `stride` u64.
pub const DESCRIPTOR_LEN: usize = 32;

/// Where the last of `rows` rows of `len` bytes, `stride` apart from `offset`, ends; `None`
/// for a shape no writer sends: an empty row, no row, a stride with one row, rows that
/// overlap (`stride < len`), or an end past `u64::MAX`.
pub fn rows_end(offset: u64, len: u64, rows: u32, stride: u64) -> Option<u64> {
    let well_formed = len > 0
        && rows > 0
        && if rows == 1 {
            stride == 0
        } else {
            stride >= len
        };
    if !well_formed {
        return None;
    }
    offset
        .checked_add(u64::from(rows - 1).checked_mul(stride)?)?
        .checked_add(len)
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
