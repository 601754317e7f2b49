//! The data-plane decoders (write header, slice table, ack, data hello) never panic, every
//! accepted table adds up to its header's payload, and the write validator a receiver runs on
//! every header (the core's `GrantTable`, then [`kvferry_core::Endpoint::begin_write`]) only
//! ever authorizes writes that lie entirely in pages owned by the room they name (checked
//! against the simulation's page owners, a reference independent of the core's bookkeeping).
#![no_main]

use std::time::Duration;

use kvferry_core::sim::{fast_config, small_layout, Faults, Sim};
use kvferry_core::{Grant, Region, RoomId};
use kvferry_tcp::{decode_ack, decode_slices, DataHello, WriteHeader, ACK_LEN, DATA_HELLO_LEN, WRITE_HEADER_LEN};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() >= WRITE_HEADER_LEN {
        let mut h = [0u8; WRITE_HEADER_LEN];
        h.copy_from_slice(&data[..WRITE_HEADER_LEN]);
        if let Ok(header) = WriteHeader::decode(&h, 4096, 1 << 30) {
            let table = &data[WRITE_HEADER_LEN..];
            if let Ok(slices) = decode_slices(table, header.payload, 4096) {
                let total: u64 = slices.iter().map(kvferry_core::Slice::bytes).sum();
                assert_eq!(total, header.payload);
                assert!(slices.iter().all(|s| s.len > 0 && s.dst_end().is_some()));
                validate(&header, &slices);
            }
        }
    }
    if data.len() >= ACK_LEN {
        let mut a = [0u8; ACK_LEN];
        a.copy_from_slice(&data[..ACK_LEN]);
        let _ = decode_ack(&a);
    }
    if data.len() >= DATA_HELLO_LEN {
        let mut f = [0u8; DATA_HELLO_LEN];
        f.copy_from_slice(&data[..DATA_HELLO_LEN]);
        assert_eq!(DataHello::decode(&f).encode(), f);
    }
});

/// Runs a decoded write against a decode endpoint holding two granted rooms (1 and 2).
fn validate(header: &WriteHeader, slices: &[kvferry_core::Slice]) {
    let mut sim = Sim::new(1, Faults::default());
    let layout = small_layout(64);
    let p = sim.add_prefill(fast_config(), layout, 0, 0..layout.layers);
    let d = sim.add_decode(fast_config(), layout, 0);
    sim.connect(d, p);
    let _ = sim.run_for(Duration::from_millis(5), 100_000);
    let Some(sd) = sim.session(d, p) else { return };
    for (room, n) in [(RoomId(1), 3), (RoomId(2), 5)] {
        let Some(pages) = sim.nodes[d].alloc(room, 0, n) else { return };
        let grant = Grant::new(pages, Some(1), None);
        let now = sim.now;
        let _ = sim.nodes[d].endpoint.open_receiver(now, room, 0, &[sd], Some(grant));
    }
    sim.drain(d);
    let now = sim.now;
    let page = u64::from(layout.page_bytes);
    // As the receive paths admit: the grant table without the driver's lock, the core for
    // whatever the table does not admit.
    let table = sim.nodes[d].endpoint.grant_table();
    let verdict = match table.begin(sd, header.room, header.generation, slices) {
        Some(permit) => Ok(permit),
        None => sim.nodes[d].endpoint.begin_write(now, sd, header.room, header.generation, slices),
    };
    if let Ok(permit) = verdict {
        for s in slices.iter().flat_map(kvferry_core::Slice::runs) {
            if let Region::Kv { .. } = s.region {
                for p in s.dst_offset / page..=(s.dst_offset + s.len - 1) / page {
                    let owner = sim.nodes[d].pages.get(p as usize).copied().flatten();
                    assert_eq!(owner, Some((header.room, header.generation)), "page {p} of {s:?}");
                }
            }
        }
        sim.nodes[d].endpoint.end_write(now, permit, slices);
    }
}
