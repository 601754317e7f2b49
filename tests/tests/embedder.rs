//! A thread-per-core server calls kvferry from its own glommio executor, with no tokio runtime
//! anywhere in the embedder: every future of the embedder API, the room handles' waits and the
//! announcements work there as they do on tokio.
#![allow(clippy::unwrap_used)] // tests may panic

use std::sync::Arc;
use std::time::Duration;

use glommio::{LocalExecutorBuilder, Placement};
use kvferry_core::{Chunk, Config, Grant, KvPoll, Region, Role, RoomId};
use kvferry_glommio::ShardConfig;
use kvferry_memory::MemoryMap;
use kvferry_testkit::{node_config, Shape};

const ROOMS: u64 = 8;

/// The byte every page of `room`, `layer`, `plane`, `index` (within the room) carries.
fn pattern(room: RoomId, layer: u16, plane: u8, index: usize) -> u8 {
    (room.0 as usize * 31 + usize::from(layer) * 7 + usize::from(plane) * 3 + index) as u8
}

/// The `index`-th page of room `room` (rooms 1.. get consecutive runs of `per_room` pages).
fn page_of(room: RoomId, per_room: u32, index: usize) -> u32 {
    (room.0 as u32 - 1) * per_room + index as u32
}

#[test]
fn a_glommio_embedder_moves_rooms_without_a_tokio_runtime() {
    let shape = Shape {
        layers: 2,
        planes: 2,
        page_bytes: 4096,
        pages_per_room: 4,
        concurrency: ROOMS as usize,
        ..Shape::default()
    };
    let embedder = LocalExecutorBuilder::new(Placement::Unbound)
        .spawn(move || async move {
            let layout = shape.layout();
            let start = |role: Role, seed: u64| {
                kvferry_glommio::start(
                    node_config(role, &shape, Config::default(), b"token", seed),
                    Arc::new(MemoryMap::allocate(layout)),
                    ShardConfig {
                        shards: 2,
                        spin_before_park: Duration::ZERO,
                        ..ShardConfig::default()
                    },
                )
                .unwrap()
            };
            let (prefill, decode) = (start(Role::Prefill, 1), start(Role::Decode, 2));
            let addrs = prefill
                .listen("127.0.0.1:0".parse().unwrap())
                .await
                .unwrap();
            let peer = decode.connect(addrs).await.unwrap();

            // Prefill: each announced room gets its pages written, then sent as one chunk.
            let mut announcements = prefill.room_announcements();
            let per_room = shape.pages_per_room;
            let server = {
                let prefill = prefill.clone();
                glommio::spawn_local(async move {
                    let mut handles = Vec::new();
                    for _ in 0..ROOMS {
                        let a = announcements.recv().await.unwrap();
                        let memory = prefill.memory();
                        let pages: Vec<u32> = (0..per_room as usize)
                            .map(|i| page_of(a.room, per_room, i))
                            .collect();
                        for layer in 0..shape.layers {
                            for plane in 0..shape.planes {
                                for (i, &p) in pages.iter().enumerate() {
                                    let bytes = vec![pattern(a.room, layer, plane, i); 4096];
                                    let at = u64::from(p) * 4096;
                                    memory
                                        .write(Region::Kv { layer, plane }, at, &bytes)
                                        .unwrap();
                                }
                            }
                        }
                        let handle = prefill
                            .open_sender(a.room, a.generation, None)
                            .await
                            .unwrap();
                        let chunk = Chunk {
                            extras: Vec::new(),
                            pages,
                            last: true,
                            aux_slot: None,
                            state_slot: None,
                            layerwise: false,
                        };
                        prefill.send_chunk(a.room, chunk).await.unwrap();
                        handles.push(handle);
                    }
                    let mut states = Vec::new();
                    for mut h in handles {
                        states.push(h.terminal().await);
                    }
                    states
                })
            };

            // Decode: open every room with its own pages (in reverse order, so the pages a
            // room lands in differ from those it was sent from), wait, then verify.
            let mut rooms = Vec::new();
            for r in 1..=ROOMS {
                let room = RoomId(r);
                let pages: Vec<u32> = (0..per_room as usize)
                    .map(|i| page_of(RoomId(ROOMS + 1 - r), per_room, i))
                    .collect();
                let grant = Grant {
                    extras: Vec::new(),
                    pages: pages.clone(),
                    aux_slot: None,
                    state_slot: None,
                    receivers: 1,
                    skip_pages: 0,
                    idle_sources: 0,
                    prompt: None,
                };
                let handle = decode
                    .open_receiver(room, 0, vec![peer], Some(grant))
                    .await
                    .unwrap();
                rooms.push((room, pages, handle));
            }
            for (room, pages, handle) in &mut rooms {
                assert_eq!(handle.terminal().await, KvPoll::Success, "{room}");
                for layer in 0..shape.layers {
                    for plane in 0..shape.planes {
                        for (i, &p) in pages.iter().enumerate() {
                            let mut got = vec![0u8; 4096];
                            let at = u64::from(p) * 4096;
                            decode
                                .memory()
                                .read(Region::Kv { layer, plane }, at, &mut got)
                                .unwrap();
                            let want = pattern(*room, layer, plane, i);
                            assert!(
                                got.iter().all(|&b| b == want),
                                "{room} layer {layer} page {i}"
                            );
                        }
                    }
                }
            }
            let sent = server.await;
            assert!(sent.iter().all(|s| *s == KvPoll::Success), "{sent:?}");
            prefill.shutdown().await;
            decode.shutdown().await;
        })
        .unwrap();
    embedder.join().unwrap();
}
