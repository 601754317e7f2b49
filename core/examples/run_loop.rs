//! The sans-IO core's run loop, with nothing else: a prefill and a decode `Endpoint` in one
//! process, their control frames passed in memory, their data operations applied by copying
//! between two byte maps, their timers fired by advancing a clock. Every driver kvferry ships
//! (`kvferry-driver` over tokio or glommio) is this loop with sockets, tasks and a real clock
//! in place of the three in-memory stand-ins.
//!
//!     cargo run -p kvferry-core --example run_loop

use std::collections::HashMap;
use std::time::{Duration, Instant};

use kvferry_core::{
    Action, Chunk, Config, Endpoint, EndpointInfo, Grant, Incarnation, KvPoll, Layout, NodeId,
    Region, Role, RoomId, SessionId, TransferOutcome,
};

/// One node: the core, and the memory its operations read or land in.
struct Node {
    endpoint: Endpoint,
    memory: HashMap<Region, Vec<u8>>,
}

fn node(role: Role, id: u64, layout: Layout, now: Instant) -> Node {
    let mut info = EndpointInfo::new(role, NodeId(id), Incarnation(id), layout);
    info.token = b"cluster-secret".to_vec();
    let endpoint = Endpoint::new(Config::default(), info, id, now).expect("a valid layout");
    let mut memory = HashMap::new();
    for layer in 0..layout.layers {
        for plane in 0..layout.planes {
            let bytes = vec![0u8; (layout.pages * layout.page_bytes) as usize];
            memory.insert(Region::Kv { layer, plane }, bytes);
        }
    }
    memory.insert(
        Region::Aux,
        vec![0u8; (layout.slots * layout.aux_bytes) as usize],
    );
    Node { endpoint, memory }
}

fn main() {
    let layout = Layout {
        layers: 2,
        planes: 2,
        page_bytes: 64,
        pages: 8,
        aux_bytes: 16,
        state_bytes: 0,
        slots: 4,
    };
    let mut now = Instant::now();
    let mut prefill = node(Role::Prefill, 1, layout, now);
    let mut decode = node(Role::Decode, 2, layout, now);
    // The prefill's KV for the room: pages 3 and 4 of every layer and plane, and aux slot 1.
    for (region, bytes) in prefill.memory.iter_mut() {
        let fill = if *region == Region::Aux { 0xA0 } else { 0x5A };
        bytes.iter_mut().for_each(|b| *b = fill);
    }

    // One control connection: decode dialed, prefill accepted. Each side names it by its own
    // session id; the loop below is the wire between them.
    let at_decode: SessionId = decode.endpoint.open_session(now);
    let at_prefill: SessionId = prefill.endpoint.accept_session(now);

    // The room: decode grants pages 6 and 7 (and aux slot 2); prefill sends its pages 3 and 4.
    let room = RoomId(42);
    let grant = Grant::new(vec![6, 7], Some(2), None);
    decode
        .endpoint
        .open_receiver(now, room, 0, &[at_decode], Some(grant))
        .expect("receiver opens");
    prefill
        .endpoint
        .open_sender(now, room, 0, None)
        .expect("sender opens");
    let chunk = Chunk {
        pages: vec![3, 4],
        last: true,
        aux_slot: Some(1),
        state_slot: None,
        layerwise: false,
        extras: Vec::new(),
    };
    prefill
        .endpoint
        .send_chunk(now, room, chunk)
        .expect("chunk accepted");

    let mut frame = Vec::new();
    for _turn in 0..10_000 {
        let mut progressed = false;
        // 1. Control frames, both ways: what one side transmits is the other's input.
        while prefill.endpoint.poll_transmit(&mut frame).is_some() {
            decode.endpoint.handle_input(now, at_decode, &frame);
            frame.clear();
            progressed = true;
        }
        while decode.endpoint.poll_transmit(&mut frame).is_some() {
            prefill.endpoint.handle_input(now, at_prefill, &frame);
            frame.clear();
            progressed = true;
        }
        // 2. Data operations: decode admits each write against the room's grant, the bytes
        //    land, and both sides hear how it ended.
        while let Some(op) = prefill.endpoint.poll_transfer(now) {
            progressed = true;
            let outcome = match op.room.map(|room| {
                decode
                    .endpoint
                    .begin_write(now, at_decode, room, op.generation, &op.slices)
            }) {
                Some(Ok(permit)) => {
                    for s in op.slices.iter().flat_map(kvferry_core::Slice::runs) {
                        let (src, dst) = (s.src_offset as usize, s.dst_offset as usize);
                        let len = s.len as usize;
                        let bytes = prefill.memory[&s.region][src..src + len].to_vec();
                        let target = decode.memory.get_mut(&s.region).expect("region");
                        target[dst..dst + len].copy_from_slice(&bytes);
                    }
                    decode.endpoint.end_write(now, permit.applied(), &op.slices);
                    TransferOutcome::Done
                }
                _ => TransferOutcome::Refused,
            };
            prefill.endpoint.handle_transfer_result(now, op.id, outcome);
        }
        // 3. Actions (fences, closes, dials) would go to the connections; none come here.
        for n in [&mut prefill, &mut decode] {
            while let Some(action) = n.endpoint.poll_action() {
                if let Action::VerifyLanded { permit, .. } = action {
                    n.endpoint.end_write(now, permit, &[]);
                }
            }
            while n.endpoint.poll_event().is_some() {}
        }
        // 4. The room's outcome, as the embedder sees it.
        let state = decode.endpoint.room_state(room);
        if let Some(KvPoll::Success | KvPoll::Failed(_)) = state {
            let landed = &decode.memory[&Region::Kv { layer: 1, plane: 1 }];
            let page = layout.page_bytes as usize;
            assert!(landed[6 * page..8 * page].iter().all(|b| *b == 0x5A));
            assert!(landed[..6 * page].iter().all(|b| *b == 0));
            let aux = &decode.memory[&Region::Aux][2 * 16..3 * 16];
            assert!(aux.iter().all(|b| *b == 0xA0));
            println!("room {room}: {state:?} on decode, every byte in place");
            return;
        }
        // 5. Time: once nothing is left to do now, sleep until the earliest deadline either
        //    core asked for, then fire it.
        if progressed {
            continue;
        }
        let next = [&prefill, &decode]
            .iter()
            .filter_map(|n| n.endpoint.poll_timeout().map(|(at, _)| at))
            .min();
        now = next.map_or(now + Duration::from_millis(1), |at| at.max(now));
        prefill.endpoint.handle_timeout(now);
        decode.endpoint.handle_timeout(now);
    }
    panic!("the room did not end");
}
