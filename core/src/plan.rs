//! Transfer planning: page lists and a layout in, bounded lists of slices out.

use core::ops::Range;

use crate::layout::{ExtraPool, Heads, ItemCopy, Layout, Region, Slice};

/// Bounds on one data-path operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpLimits {
    /// Most payload bytes per operation (a single slice larger than this is split at pages).
    pub max_bytes: u64,
    /// Most rows per operation, each slice counting its rows: bounds the descriptor table a
    /// receiver reads and the work requests of one RDMA post.
    pub max_slices: u32,
}

/// Plans the KV slices that copy room pages `src[i] -> dst[i]` for `layers` (every plane),
/// coalescing runs where both sides are consecutive, ordered by layer, plane, page. The slices
/// are cut into operations that respect `limits`; each returned `Vec` is one operation.
///
/// `src` and `dst` must have the same length (callers pass matched prefixes).
pub fn plan_kv(
    layout: &Layout,
    layers: Range<u16>,
    src: &[u32],
    dst: &[u32],
    limits: OpLimits,
) -> Vec<Vec<Slice>> {
    let page = u64::from(layout.page_bytes);
    let runs = paired_runs(src, dst, (limits.max_bytes / page).max(1));
    let mut ops = Ops::new(limits);
    for layer in layers {
        for plane in 0..layout.planes {
            let region = Region::Kv { layer, plane };
            for &(s, d, len) in &runs {
                ops.push(Slice::run(
                    region,
                    u64::from(s) * page,
                    u64::from(d) * page,
                    len * page,
                ));
            }
        }
    }
    ops.finish()
}

/// Slices gathered into operations that respect `limits`, in order.
struct Ops {
    limits: OpLimits,
    ops: Vec<Vec<Slice>>,
    cur: Vec<Slice>,
    cur_bytes: u64,
    cur_rows: u32,
}

impl Ops {
    fn new(limits: OpLimits) -> Self {
        Ops {
            limits,
            ops: Vec::new(),
            cur: Vec::new(),
            cur_bytes: 0,
            cur_rows: 0,
        }
    }

    /// Adds `slice` to the current operation, or starts the next one when it would not fit.
    fn push(&mut self, slice: Slice) {
        if !self.cur.is_empty()
            && (self.cur_bytes + slice.bytes() > self.limits.max_bytes
                || self.cur_rows.saturating_add(slice.rows) > self.limits.max_slices)
        {
            self.ops.push(std::mem::take(&mut self.cur));
            self.cur_bytes = 0;
            self.cur_rows = 0;
        }
        self.cur_bytes += slice.bytes();
        self.cur_rows = self.cur_rows.saturating_add(slice.rows);
        self.cur.push(slice);
    }

    /// Adds the contiguous run `slice`, extending the last slice where it continues it on
    /// both sides and the operation has room.
    fn push_merged(&mut self, slice: Slice) {
        if let Some(last) = self.cur.last_mut() {
            if last.rows == 1
                && last.region == slice.region
                && last.src_offset + last.len == slice.src_offset
                && last.dst_offset + last.len == slice.dst_offset
                && self.cur_bytes + slice.len <= self.limits.max_bytes
            {
                last.len += slice.len;
                self.cur_bytes += slice.len;
                return;
            }
        }
        self.push(slice);
    }

    fn finish(mut self) -> Vec<Vec<Slice>> {
        if !self.cur.is_empty() {
            self.ops.push(self.cur);
        }
        self.ops
    }
}

/// Runs `(src, dst, len)` of pairs `src[i] -> dst[i]` consecutive on both sides, each at most
/// `max_run` long.
fn paired_runs(src: &[u32], dst: &[u32], max_run: u64) -> Vec<(u32, u32, u64)> {
    let n = src.len().min(dst.len());
    let mut runs = Vec::new();
    let mut i = 0;
    while i < n {
        let (s0, d0) = (src[i], dst[i]);
        let mut len = 1u64;
        while i + (len as usize) < n
            && len < max_run
            && u64::from(src[i + len as usize]) == u64::from(s0) + len
            && u64::from(dst[i + len as usize]) == u64::from(d0) + len
        {
            len += 1;
        }
        runs.push((s0, d0, len));
        i += len as usize;
    }
    runs
}

/// Plans the slices that copy items `src[i] -> dst[i]` of extra pool `pool` (every tensor
/// of it, each as `copies` says: whole items, or the rows of the parts both hold), coalescing
/// consecutive whole items, ordered by tensor, cut into operations that respect `limits`.
/// Empty when the pool does not exist or nothing is asked.
pub fn plan_extras(
    pools: &[ExtraPool],
    copies: &[Vec<ItemCopy>],
    pool: usize,
    src: &[u32],
    dst: &[u32],
    limits: OpLimits,
) -> Vec<Vec<Slice>> {
    let Some(p) = pools.get(pool) else {
        return Vec::new();
    };
    let mut ops = Ops::new(limits);
    for (tensor, &item) in p.item_bytes.iter().enumerate() {
        let item = u64::from(item);
        let region = Region::Extra {
            pool: pool as u8,
            tensor: tensor as u16,
        };
        let how = copies.get(pool).and_then(|p| p.get(tensor));
        if let Some(ItemCopy::Parts {
            src_item,
            dst_item,
            parts,
        }) = how
        {
            for (&s, &d) in src.iter().zip(dst) {
                for part in parts {
                    let at = (
                        u64::from(s) * src_item + part.src_offset,
                        u64::from(d) * dst_item + part.dst_offset,
                    );
                    let rows = Slice {
                        region,
                        src_offset: at.0,
                        dst_offset: at.1,
                        len: part.len,
                        rows: part.rows,
                        src_stride: part.src_stride,
                        dst_stride: part.dst_stride,
                    };
                    push_rows(&mut ops, rows, limits);
                }
            }
            continue;
        }
        for (s, d, len) in paired_runs(src, dst, (limits.max_bytes / item).max(1)) {
            ops.push(Slice::run(
                region,
                u64::from(s) * item,
                u64::from(d) * item,
                len * item,
            ));
        }
    }
    ops.finish()
}

/// `slice`'s rows (its strides set even for one row) as strided slices of at most
/// `max_bytes` and `max_slices` rows each, in order.
fn push_rows(ops: &mut Ops, slice: Slice, limits: OpLimits) {
    let per = u32::try_from((limits.max_bytes / slice.len.max(1)).max(1))
        .unwrap_or(u32::MAX)
        .min(limits.max_slices.max(1));
    let mut first = 0;
    while first < slice.rows {
        let rows = per.min(slice.rows - first);
        let (src_offset, dst_offset) = slice.row(first);
        ops.push(Slice {
            src_offset,
            dst_offset,
            rows,
            src_stride: if rows > 1 { slice.src_stride } else { 0 },
            dst_stride: if rows > 1 { slice.dst_stride } else { 0 },
            ..slice
        });
        first += rows;
    }
}

/// One side of a copy between endpoints that hold different heads: its page size and heads.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HeadSide {
    /// Bytes of one page of one (layer, plane) region on this side.
    pub page_bytes: u32,
    /// The heads this side holds in every token row.
    pub heads: Heads,
}

/// Plans the head slices that copy room pages `src[i] -> dst[i]` for `layers` (every plane)
/// between two endpoints that hold different heads: for every page, one slice whose rows are
/// the page's token rows, each the bytes of the heads both hold, from where they sit in the
/// source's row to where they sit in the destination's. Where those bytes are whole rows on
/// both sides the page is one run, and runs contiguous on both sides are merged. Ordered by
/// layer, plane, page, cut into operations that respect `limits`; empty when the two share no
/// head (the caller refuses such a pairing).
pub fn plan_kv_heads(
    planes: u8,
    from: HeadSide,
    to: HeadSide,
    layers: Range<u16>,
    src: &[u32],
    dst: &[u32],
    limits: OpLimits,
) -> Vec<Vec<Slice>> {
    let shared = from.heads.shared(&to.heads);
    let head = u64::from(from.heads.head_bytes);
    let len = u64::from(shared.end - shared.start) * head;
    let tokens = from.heads.page_tokens(from.page_bytes).unwrap_or(0);
    if len == 0 || tokens == 0 {
        return Vec::new();
    }
    let (src_row, dst_row) = (from.heads.row_bytes(), to.heads.row_bytes());
    let src_skip = u64::from(shared.start - from.heads.start) * head;
    let dst_skip = u64::from(shared.start - to.heads.start) * head;
    let whole_rows = len == src_row && len == dst_row;
    let mut ops = Ops::new(limits);
    for layer in layers {
        for plane in 0..planes {
            let region = Region::Kv { layer, plane };
            for (&s, &d) in src.iter().zip(dst) {
                let src_page = u64::from(s) * u64::from(from.page_bytes) + src_skip;
                let dst_page = u64::from(d) * u64::from(to.page_bytes) + dst_skip;
                if whole_rows {
                    ops.push_merged(Slice::run(
                        region,
                        src_page,
                        dst_page,
                        u64::from(tokens) * len,
                    ));
                    continue;
                }
                // A page's rows go in pieces of at most `max_bytes` (a page is far smaller
                // in practice).
                let rows = Slice {
                    region,
                    src_offset: src_page,
                    dst_offset: dst_page,
                    len,
                    rows: tokens,
                    src_stride: src_row,
                    dst_stride: dst_row,
                };
                push_rows(&mut ops, rows, limits);
            }
        }
    }
    ops.finish()
}

/// Slices of the aux row and state slot of a room (the last operation of a room).
pub fn plan_aux(
    layout: &Layout,
    src_aux: Option<u32>,
    dst_aux: Option<u32>,
    src_state: Option<u32>,
    dst_state: Option<u32>,
) -> Vec<Slice> {
    let mut slices = Vec::new();
    let pairs = [
        (Region::Aux, layout.aux_bytes, src_aux, dst_aux),
        (Region::State, layout.state_bytes, src_state, dst_state),
    ];
    for (region, item, s, d) in pairs {
        if let (true, Some(s), Some(d)) = (item > 0, s, d) {
            slices.push(Slice::run(
                region,
                u64::from(s) * u64::from(item),
                u64::from(d) * u64::from(item),
                u64::from(item),
            ));
        }
    }
    slices
}
