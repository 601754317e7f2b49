//! The synthetic model and workload a run moves.

use kvferry_core::Layout;
use std::time::Duration;

/// The synthetic model and workload.
#[derive(Clone, Debug)]
pub struct Shape {
    /// Model layers.
    pub layers: u16,
    /// 2 for K and V.
    pub planes: u8,
    /// Bytes per page per (layer, plane).
    pub page_bytes: u32,
    /// Pages per room the decode grants (and the prefill sends).
    pub pages_per_room: u32,
    /// Decode: room pages it already holds (a cached prefix), asked as `skip_pages`: its
    /// rooms are `prefix_pages + pages_per_room` pages long and only the last
    /// `pages_per_room` move.
    pub prefix_pages: u32,
    /// Chunks per room.
    pub chunks: u32,
    /// Rooms in flight at once.
    pub concurrency: usize,
    /// Send layer by layer: each layer's operations leave when its forward pass is done.
    pub layerwise: bool,
    /// Simulated forward time per layer and chunk (both modes, so they compare).
    pub layer_compute: Duration,
    /// Data connections per session.
    pub data_connections: usize,
}

impl Default for Shape {
    fn default() -> Self {
        Shape {
            layers: 8,
            planes: 2,
            page_bytes: 16 * 1024,
            pages_per_room: 32,
            prefix_pages: 0,
            chunks: 1,
            concurrency: 16,
            layerwise: false,
            layer_compute: Duration::ZERO,
            data_connections: 2,
        }
    }
}

/// Bytes of one aux row: the room id, to check it arrived with the room.
pub const AUX_BYTES: u32 = 64;
pub(crate) const FREE_WORD: u64 = 0xFEED_FACE_DEAD_BEEF;

impl Shape {
    /// The registered memory layout: room for `concurrency` rooms, with slack for quarantine.
    pub fn layout(&self) -> Layout {
        let pages = (self.pages_per_room as usize * (self.concurrency + 4)) as u32;
        Layout {
            layers: self.layers,
            planes: self.planes,
            page_bytes: self.page_bytes,
            pages,
            aux_bytes: AUX_BYTES,
            state_bytes: 0,
            slots: (self.concurrency as u32 + 4) * 2,
        }
    }

    /// Refuses a shape the page pattern cannot tell apart: pages are 8-byte words, the
    /// first two naming (room) and (layer, plane, page), so a page is a whole number of
    /// words and at least two.
    pub fn check(&self) -> Result<(), String> {
        if self.page_bytes < 16 || self.page_bytes % 8 != 0 {
            return Err(format!(
                "page bytes {}: a page must be a multiple of 8 bytes and at least 16 (the \
                 pattern is 8-byte words, the first two naming the room and the page)",
                self.page_bytes
            ));
        }
        Ok(())
    }

    /// Payload bytes of one room.
    pub fn room_bytes(&self) -> u64 {
        u64::from(self.layers)
            * u64::from(self.planes)
            * u64::from(self.pages_per_room)
            * u64::from(self.page_bytes)
            + u64::from(AUX_BYTES)
    }
}
