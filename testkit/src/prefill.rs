//! The prefill half: serves every room a decode asks for with the pattern.

use crate::{aux_row, fill_room_layer, Pool, Shape, AUX_BYTES};
use kvferry_core::codec::SKIP_ALL;
use kvferry_core::{Chunk, Region, RoomId};
use kvferry_driver::{Announcement, Node};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

/// Serves synthetic KV as a prefill node: every room a decode announces is opened, its
/// source pages filled with the room's pattern and sent (chunked or layer by layer).
/// Runs until the node shuts down.
pub async fn serve_prefill(node: Node, shape: Shape) {
    let mut announcements = node.room_announcements();
    let layout = shape.layout();
    let pool = Arc::new(Mutex::new(Pool::new(layout.pages)));
    let slots = Arc::new(Mutex::new(Pool::new(layout.slots)));
    // Rooms wait here for source memory; every release wakes the loop to retry them.
    let freed = Arc::new(tokio::sync::Notify::new());
    let mut waiting: VecDeque<(RoomId, u32, u32)> = VecDeque::new();
    loop {
        tokio::select! {
            a = announcements.recv() => match a {
                Some(a) => waiting.push_back((a.room, a.generation, room_pages(&shape, a))),
                None => return,
            },
            _ = freed.notified() => {}
        }
        // Start every waiting room that has source memory.
        while let Some(&(room, generation, pages)) = waiting.front() {
            let Some(src) = pool.lock().map(|mut p| p.take(pages)).ok().flatten() else {
                break;
            };
            let Some(slot) = slots.lock().map(|mut s| s.take(1)).ok().flatten() else {
                if let Ok(mut p) = pool.lock() {
                    p.give(&src);
                }
                break;
            };
            waiting.pop_front();
            let node = node.clone();
            let shape = shape.clone();
            let pool = pool.clone();
            let slots = slots.clone();
            let freed = freed.clone();
            tokio::spawn(async move {
                let handle = node.open_sender(room, generation, None).await;
                let Ok(mut handle) = handle else {
                    if let Ok(mut p) = pool.lock() {
                        p.give(&src);
                    }
                    if let Ok(mut s) = slots.lock() {
                        s.give(&slot);
                    }
                    freed.notify_one();
                    return;
                };
                send_room(&node, &shape, room, &src, slot[0]).await;
                handle.releasable().await;
                if let Ok(mut p) = pool.lock() {
                    p.give(&src);
                }
                if let Ok(mut s) = slots.lock() {
                    s.give(&slot);
                }
                freed.notify_one();
            });
        }
    }
}

/// The pages of an announced room: the prefix the decode holds and the pages it granted
/// (its first `skip_pages` room pages are computed here too, and never sent), at most what
/// this node holds (a room that needs more fails `grant_mismatch`); a decode still waiting
/// for pages, or one that wants nothing from this rank, gets the shape's room.
fn room_pages(shape: &Shape, a: Announcement) -> u32 {
    if a.pages == 0 || a.skip_pages == SKIP_ALL {
        return shape.pages_per_room;
    }
    a.skip_pages
        .saturating_add(a.pages)
        .min(shape.layout().pages)
}

pub(crate) async fn send_room(
    node: &Node,
    shape: &Shape,
    room: RoomId,
    src: &[u32],
    aux_slot: u32,
) {
    let memory = node.memory();
    let mut page = vec![0u8; shape.page_bytes as usize];
    let fill_layer =
        |layer: u16, page: &mut Vec<u8>| fill_room_layer(memory, shape, room, layer, src, page);
    let _ = memory.write(
        Region::Aux,
        u64::from(aux_slot) * u64::from(AUX_BYTES),
        &aux_row(room),
    );
    let chunks = shape.chunks.clamp(1, src.len().max(1) as u32) as usize;
    let per = src.len().div_ceil(chunks);
    if !shape.layerwise {
        for layer in 0..shape.layers {
            fill_layer(layer, &mut page);
        }
    }
    for (c, part) in src.chunks(per.max(1)).enumerate() {
        let last = c + 1 == chunks || (c + 1) * per >= src.len();
        let chunk = Chunk {
            extras: Vec::new(),
            pages: part.to_vec(),
            last,
            aux_slot: Some(aux_slot),
            state_slot: None,
            layerwise: shape.layerwise,
        };
        if !shape.layerwise && !shape.layer_compute.is_zero() {
            // Whole-batch mode: the chunk moves only after its whole forward pass.
            tokio::time::sleep(shape.layer_compute * u32::from(shape.layers)).await;
        }
        if node.send_chunk(room, chunk).await.is_err() {
            return;
        }
        if shape.layerwise {
            // The forward pass: layer L is ready L+1 compute times after the chunk started
            // (deadlines from the start, so timer rounding does not accumulate).
            let started = tokio::time::Instant::now();
            for layer in 0..shape.layers {
                tokio::time::sleep_until(started + shape.layer_compute * (u32::from(layer) + 1))
                    .await;
                if c == 0 {
                    fill_layer(layer, &mut page);
                }
                if node.mark_layer_ready(vec![room], layer).await.is_err() {
                    return;
                }
            }
        }
        if last {
            break;
        }
    }
}
