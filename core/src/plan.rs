//! Transfer planning: page lists and a layout in, bounded lists of slices out.

use core::ops::Range;

use crate::layout::{Layout, Region, Slice};

/// Bounds on one data-path operation.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct OpLimits {
    /// Most payload bytes per operation (a single slice larger than this is split at pages).
    pub max_bytes: u64,
    /// Most slices per operation.
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
    let n = src.len().min(dst.len());
    let page = u64::from(layout.page_bytes);
    // Longest run, in pages, that fits one operation (at least one page).
    let max_run = (limits.max_bytes / page).max(1);
    let mut runs: Vec<(u32, u32, u64)> = Vec::new();
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
    let mut ops = Vec::new();
    let mut cur: Vec<Slice> = Vec::new();
    let mut cur_bytes = 0u64;
    for layer in layers {
        for plane in 0..layout.planes {
            let region = Region::Kv { layer, plane };
            for &(s, d, len) in &runs {
                let bytes = len * page;
                if !cur.is_empty()
                    && (cur_bytes + bytes > limits.max_bytes
                        || cur.len() as u32 >= limits.max_slices)
                {
                    ops.push(std::mem::take(&mut cur));
                    cur_bytes = 0;
                }
                cur.push(Slice {
                    region,
                    src_offset: u64::from(s) * page,
                    dst_offset: u64::from(d) * page,
                    len: bytes,
                });
                cur_bytes += bytes;
            }
        }
    }
    if !cur.is_empty() {
        ops.push(cur);
    }
    ops
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
            slices.push(Slice {
                region,
                src_offset: u64::from(s) * u64::from(item),
                dst_offset: u64::from(d) * u64::from(item),
                len: u64::from(item),
            });
        }
    }
    slices
}
