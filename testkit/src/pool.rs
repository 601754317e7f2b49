//! Free pages and aux slots, handed out in runs and given back.

use std::collections::VecDeque;

/// A pool of page indices.
#[derive(Debug)]
pub(crate) struct Pool {
    pub(crate) free: VecDeque<u32>,
}

impl Pool {
    pub(crate) fn new(n: u32) -> Self {
        Pool {
            free: (0..n).collect(),
        }
    }

    pub(crate) fn take(&mut self, n: u32) -> Option<Vec<u32>> {
        if self.free.len() < n as usize {
            return None;
        }
        Some(self.free.drain(..n as usize).collect())
    }

    pub(crate) fn give(&mut self, pages: &[u32]) {
        self.free.extend(pages.iter().copied());
    }
}
