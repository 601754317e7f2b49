//! The byte pattern every page and aux row carries, derived from (room, layer, plane, page),
//! written by the prefill and checked by the decode (`docs/PROTOCOL.md` spells it out).

use crate::{Shape, AUX_BYTES, FREE_WORD};
use kvferry_core::{Region, RoomId};
use kvferry_memory::MemoryMap;
use tracing::warn;

pub(crate) fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// Word `i` of the pattern of (room, layer, plane, page index within the room). Words 0 and 1
/// spell the room and (layer, plane, index) themselves, so two distinct pages never hold the
/// same bytes (pages are at least 16 bytes); the rest is a hash of all four.
pub(crate) fn pattern_word(room: RoomId, layer: u16, plane: u8, index: u32, i: usize) -> u64 {
    let place = (u64::from(layer) << 40) | (u64::from(plane) << 32) | u64::from(index);
    match i {
        0 => room.0,
        1 => place ^ 0x6b76_0000_0000_0000,
        _ => mix(mix(room.0) ^ place) ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15),
    }
}

/// Fills `page` with the pattern of (room, layer, plane, page index within the room).
pub fn fill_pattern(page: &mut [u8], room: RoomId, layer: u16, plane: u8, index: u32) {
    for (i, w) in page.chunks_exact_mut(8).enumerate() {
        w.copy_from_slice(&pattern_word(room, layer, plane, index, i).to_le_bytes());
    }
}

/// Whether `page` holds exactly the pattern of (room, layer, plane, index).
pub fn check_pattern(page: &[u8], room: RoomId, layer: u16, plane: u8, index: u32) -> bool {
    page.chunks_exact(8).enumerate().all(|(i, w)| {
        let mut a = [0u8; 8];
        a.copy_from_slice(w);
        u64::from_le_bytes(a) == pattern_word(room, layer, plane, index, i)
    })
}

pub(crate) fn all_words(page: &[u8], word: u64) -> bool {
    page.chunks_exact(8).all(|w| {
        let mut a = [0u8; 8];
        a.copy_from_slice(w);
        u64::from_le_bytes(a) == word
    })
}

pub(crate) fn fill_words(page: &mut [u8], word: u64) {
    for w in page.chunks_exact_mut(8) {
        w.copy_from_slice(&word.to_le_bytes());
    }
}

pub(crate) fn kv_regions(shape: &Shape) -> impl Iterator<Item = (u16, u8)> + '_ {
    (0..shape.layers).flat_map(move |l| (0..shape.planes).map(move |p| (l, p)))
}

/// Writes the pattern of `layer` of `room` into its pages (`src[i]` holds the room's page i),
/// every plane; `page` is scratch of one page.
pub(crate) fn fill_room_layer(
    memory: &MemoryMap,
    shape: &Shape,
    room: RoomId,
    layer: u16,
    src: &[u32],
    page: &mut [u8],
) {
    for plane in 0..shape.planes {
        for (i, &p) in src.iter().enumerate() {
            fill_pattern(page, room, layer, plane, i as u32);
            let _ = memory.write(
                Region::Kv { layer, plane },
                u64::from(p) * u64::from(shape.page_bytes),
                page,
            );
        }
    }
}

/// Writes the free pattern into `pages` of every KV region, so a stray write shows.
pub(crate) fn write_free(
    memory: &MemoryMap,
    shape: &Shape,
    pages: impl Iterator<Item = u32> + Clone,
) {
    let mut free = vec![0u8; shape.page_bytes as usize];
    fill_words(&mut free, FREE_WORD);
    for (layer, plane) in kv_regions(shape) {
        for p in pages.clone() {
            let _ = memory.write(
                Region::Kv { layer, plane },
                u64::from(p) * u64::from(shape.page_bytes),
                &free,
            );
        }
    }
}

/// A room's aux row: its id in every word.
pub(crate) fn aux_row(room: RoomId) -> [u8; AUX_BYTES as usize] {
    let mut aux = [0u8; AUX_BYTES as usize];
    fill_words(&mut aux, room.0);
    aux
}

/// What one room's pages and aux row held against its pattern.
pub(crate) struct RoomCheck {
    /// Pages read.
    pub(crate) pages: u64,
    /// Pages that did not hold the room's pattern.
    pub(crate) bad_pages: u64,
    /// Whether the aux row held the room's id.
    pub(crate) aux_ok: bool,
}

/// Checks every page of `room` (`pages[i]` holds its page `first + i`) and its aux row in `aux_slot`,
/// reading through `read` (host memory, or a copy back from GPU memory); logs what is wrong.
pub(crate) fn check_room(
    shape: &Shape,
    room: RoomId,
    first: u32,
    pages: &[u32],
    aux_slot: u32,
    mut read: impl FnMut(Region, u64, &mut [u8]) -> bool,
) -> RoomCheck {
    let mut buf = vec![0u8; shape.page_bytes as usize];
    let mut check = RoomCheck {
        pages: 0,
        bad_pages: 0,
        aux_ok: true,
    };
    for (layer, plane) in kv_regions(shape) {
        for (i, &p) in pages.iter().enumerate() {
            let offset = u64::from(p) * u64::from(shape.page_bytes);
            check.pages += 1;
            let read_ok = read(Region::Kv { layer, plane }, offset, &mut buf);
            if !read_ok || !check_pattern(&buf, room, layer, plane, first + i as u32) {
                check.bad_pages += 1;
                warn!(%room, page = p, layer, plane, still_free = all_words(&buf, FREE_WORD), first_word = ?&buf[..8], "page holds the wrong bytes");
            }
        }
    }
    let mut aux = [0u8; AUX_BYTES as usize];
    let offset = u64::from(aux_slot) * u64::from(AUX_BYTES);
    if !read(Region::Aux, offset, &mut aux) || !all_words(&aux, room.0) {
        check.aux_ok = false;
        warn!(%room, "aux row holds the wrong bytes");
    }
    check
}

#[cfg(test)]
mod protocol_doc {
    use super::*;

    /// The page pattern, computed as `docs/PROTOCOL.md` spells it out for an independent
    /// decode, is the one the CLI's prefill writes.
    #[test]
    fn the_page_pattern_is_the_one_the_protocol_doc_spells_out() {
        let doc = include_str!("../../docs/PROTOCOL.md");
        for constant in [
            "0x6b76000000000000",
            "0x9E3779B97F4A7C15",
            "0xBF58476D1CE4E5B9",
            "0x94D049BB133111EB",
        ] {
            assert!(doc.contains(constant), "{constant}");
        }
        let splitmix = |mut z: u64| {
            z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        let (room, l, p, i) = (RoomId(0xABCD_0001), 5u16, 1u8, 17u32);
        let mut page = vec![0u8; 64];
        fill_pattern(&mut page, room, l, p, i);
        let place = (u64::from(l) << 40) | (u64::from(p) << 32) | u64::from(i);
        for (k, w) in page.chunks_exact(8).enumerate() {
            let want = match k {
                0 => room.0,
                1 => place ^ 0x6b76_0000_0000_0000,
                _ => {
                    splitmix(splitmix(room.0) ^ place)
                        ^ (k as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
                }
            };
            assert_eq!(u64::from_le_bytes(w.try_into().unwrap()), want, "word {k}");
        }
        assert_eq!(&aux_row(room)[..8], &room.0.to_le_bytes());
    }
}
