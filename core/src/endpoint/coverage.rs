//! Which units of a room one decode source must write (every owned layer, plane, granted page
//! and token row, the aux row, the state slot, the granted extra items), and which of them
//! applied writes covered.
//!
//! Invariants kept here: `covered` counts each required unit once, however often it is
//! written; units outside what the grant asked of this source are never required; the room
//! may count this source's `Success` only once `complete()`.

use crate::api::{EndpointInfo, Grant, PeerInfo};
use crate::layout::{ItemCopy, PageSet};

use super::grant_table::item_copy;

/// Which units of a room one source must write, and which applied writes covered.
#[derive(Debug, Default)]
pub(super) struct Coverage {
    bits: Vec<u64>,
    /// Units required.
    expected: u32,
    /// Units required and covered.
    covered: u32,
    /// First layer the source owns.
    layer_start: u16,
    /// Layers the source owns (within this endpoint's layout).
    layers: u16,
    planes: u8,
    pages: u32,
    /// Units per page: 1 for whole pages, the token rows for a source holding other heads.
    tokens: u32,
    aux: bool,
    state: bool,
    /// Per extra pool the source writes.
    extras: Box<[ExtraUnits]>,
}

/// The units of one extra pool a source writes: per tensor, per granted item, one for a
/// whole item or one per shared row of its parts.
#[derive(Debug, Default)]
struct ExtraUnits {
    /// The pool's first unit.
    first: u32,
    /// Granted items the source writes (0: none).
    items: u32,
    /// Per tensor: its first unit after `first`, and its units per item.
    tensors: Box<[(u32, u32)]>,
}

impl Coverage {
    pub(super) fn new(
        local: &EndpointInfo,
        peer: Option<PeerInfo>,
        copies: &[Vec<ItemCopy>],
        grant: &Grant,
    ) -> Self {
        let Some(p) = peer else {
            return Coverage::default();
        };
        let layout = &local.layout;
        let layers = p.layer_end.min(layout.layers).saturating_sub(p.layer_start);
        let pages = PageSet::new(&grant.pages).len();
        let tokens = local
            .heads
            .row_write(layout.page_bytes, &p.heads)
            .map_or(1, |w| w.tokens.max(1));
        let aux = p.writes_aux && grant.aux_slot.is_some() && layout.aux_bytes > 0;
        let state = p.writes_aux && grant.state_slot.is_some() && layout.state_bytes > 0;
        let mut units = u32::from(layers) * u32::from(layout.planes) * pages * tokens + 2;
        let kv_units = units - 2;
        // The source that writes aux writes the extra items too (the last pipeline stage).
        let mut extras = Vec::new();
        for (p_index, (pool, asked)) in local.extras.iter().zip(&grant.extras).enumerate() {
            let items = if p.writes_aux {
                PageSet::new(asked).len()
            } else {
                0
            };
            let mut tensors = Vec::with_capacity(pool.item_bytes.len());
            let mut per_items = 0u32;
            for t in 0..pool.item_bytes.len() {
                let per_item = match item_copy(copies, p_index as u8, t as u16) {
                    ItemCopy::Whole => 1,
                    ItemCopy::Parts { parts, .. } => {
                        parts.iter().fold(0u32, |n, x| n.saturating_add(x.rows))
                    }
                };
                tensors.push((per_items.saturating_mul(items), per_item));
                per_items = per_items.saturating_add(per_item);
            }
            extras.push(ExtraUnits {
                first: units,
                items,
                tensors: tensors.into_boxed_slice(),
            });
            units = units.saturating_add(per_items.saturating_mul(items));
        }
        let extra_units = units - kv_units - 2;
        Coverage {
            bits: vec![0; (units as usize).div_ceil(64)],
            expected: kv_units + u32::from(aux) + u32::from(state) + extra_units,
            covered: 0,
            layer_start: p.layer_start,
            layers,
            planes: layout.planes,
            pages,
            tokens,
            aux,
            state,
            extras: extras.into_boxed_slice(),
        }
    }

    /// The unit of item rank `rank` of tensor `tensor` of extra pool `pool`: its `sub`th
    /// shared row (0 for a whole item).
    pub(super) fn extra_unit(&self, pool: u8, tensor: u16, rank: u32, sub: u32) -> Option<u32> {
        let x = self.extras.get(usize::from(pool))?;
        let &(start, per_item) = x.tensors.get(usize::from(tensor))?;
        if rank >= x.items || sub >= per_item {
            return None;
        }
        x.first
            .checked_add(start)?
            .checked_add(rank.checked_mul(per_item)?)?
            .checked_add(sub)
    }

    /// The unit of (layer, plane, page rank, token row), or of the aux row / state slot.
    pub(super) fn kv_unit(&self, layer: u16, plane: u8, rank: u32, token: u32) -> Option<u32> {
        let l = layer
            .checked_sub(self.layer_start)
            .filter(|l| *l < self.layers)?;
        let page = (u32::from(l) * u32::from(self.planes) + u32::from(plane)) * self.pages + rank;
        (token < self.tokens).then(|| page * self.tokens + token)
    }

    pub(super) fn slot_unit(&self, state: bool) -> u32 {
        u32::from(self.layers) * u32::from(self.planes) * self.pages * self.tokens
            + u32::from(state)
    }

    pub(super) fn mark(&mut self, unit: u32) {
        let (w, b) = ((unit / 64) as usize, unit % 64);
        let Some(word) = self.bits.get_mut(w) else {
            return;
        };
        if *word & (1 << b) != 0 {
            return;
        }
        *word |= 1 << b;
        let kv_units = self.slot_unit(false);
        let required = unit < kv_units
            || (unit == kv_units && self.aux)
            || (unit == kv_units + 1 && self.state)
            || unit >= kv_units + 2;
        if required {
            self.covered += 1;
        }
    }

    pub(super) fn complete(&self) -> bool {
        self.covered >= self.expected
    }

    /// Units required and covered so far.
    pub(super) fn covered(&self) -> u32 {
        self.covered
    }

    /// Units required.
    pub(super) fn expected(&self) -> u32 {
        self.expected
    }
}
