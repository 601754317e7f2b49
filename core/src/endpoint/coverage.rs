//! Which units of a room one decode source must write (every owned layer, plane, granted page
//! and token row, the aux row, the state slot, the granted extra items), and which of them
//! applied writes covered.
//!
//! Invariants kept here: `covered` counts each required unit once, however often it is
//! written; units outside what the grant asked of this source are never required; the room
//! may count this source's `Success` only once `complete()`.

use crate::api::{EndpointInfo, Grant, PeerInfo};
use crate::layout::PageSet;

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
    /// Per extra pool the source writes: (its first unit, tensors, granted items).
    extras: Box<[(u32, u16, u32)]>,
}

impl Coverage {
    pub(super) fn new(local: &EndpointInfo, peer: Option<PeerInfo>, grant: &Grant) -> Self {
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
        for (pool, asked) in local.extras.iter().zip(&grant.extras) {
            let items = PageSet::new(asked).len();
            let tensors = pool.item_bytes.len() as u16;
            if p.writes_aux && items > 0 {
                extras.push((units, tensors, items));
                units = units.saturating_add(u32::from(tensors).saturating_mul(items));
            } else {
                extras.push((units, tensors, 0));
            }
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

    /// The unit of item rank `rank` of tensor `tensor` of extra pool `pool`.
    pub(super) fn extra_unit(&self, pool: u8, tensor: u16, rank: u32) -> Option<u32> {
        let &(first, tensors, items) = self.extras.get(usize::from(pool))?;
        (tensor < tensors && rank < items).then(|| first + u32::from(tensor) * items + rank)
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
