//! Bitset over the layers this endpoint owns (the ones a sender room released or planned).

use smallvec::SmallVec;

#[derive(Debug, Clone, Default)]
pub(super) struct LayerBits(SmallVec<[u64; 2]>);

impl LayerBits {
    pub(super) fn new(n: usize) -> Self {
        LayerBits(SmallVec::from_elem(0, n.div_ceil(64).max(1)))
    }
    pub(super) fn all(n: usize) -> Self {
        let mut b = Self::new(n);
        for i in 0..n {
            b.set(i);
        }
        b
    }
    pub(super) fn get(&self, i: usize) -> bool {
        self.0.get(i / 64).is_some_and(|w| w & (1 << (i % 64)) != 0)
    }
    pub(super) fn set(&mut self, i: usize) {
        if let Some(w) = self.0.get_mut(i / 64) {
            *w |= 1 << (i % 64);
        }
    }
    pub(super) fn count(&self) -> u32 {
        self.0.iter().map(|w| w.count_ones()).sum()
    }
}
