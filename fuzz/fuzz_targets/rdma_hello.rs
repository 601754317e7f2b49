//! The RDMA hello (bytes a peer sends inside a `Transport` frame, so attacker-controlled):
//! the decoder never panics, re-encodes what it decodes to the same bytes, and a write target
//! resolved from it always lies inside the first announced region of the slice's name, with
//! that region's rkey.
#![no_main]

use kvferry_core::{Region, Slice};
use kvferry_rdma::RdmaHello;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    // The first 20 bytes name a slice to resolve (region code, offset, length); the rest is
    // the hello.
    let (probe, bytes) = data.split_at(data.len().min(20));
    let Ok(hello) = RdmaHello::decode(bytes) else {
        return;
    };
    let mut again = Vec::new();
    hello.encode(&mut again);
    assert_eq!(again, bytes, "re-encoding differs for {hello:?}");
    if probe.len() < 20 {
        return;
    }
    let word = |i: usize| {
        let mut w = [0u8; 8];
        w.copy_from_slice(&probe[i..i + 8]);
        u64::from_le_bytes(w)
    };
    let code = u32::from_le_bytes([probe[0], probe[1], probe[2], probe[3]]);
    let Some(region) = Region::from_code(code) else {
        return;
    };
    let slice = Slice::run(region, 0, word(4), word(12));
    if let Some((addr, rkey)) = hello.target(&slice) {
        let r = hello
            .regions
            .iter()
            .find(|r| r.region == region.code())
            .expect("a target comes from an announced region");
        assert_eq!(rkey, r.rkey);
        assert!(slice.len > 0);
        assert!(addr >= r.addr);
        let end = addr.checked_add(slice.len).expect("no overflow");
        assert!(end <= r.addr + r.len, "target leaves the region: {slice:?} {r:?}");
    }
});
