//! The data-plane decoders (write header, slice table, ack, data hello) never panic, and every
//! accepted table adds up to its header's payload.
#![no_main]

use kvferry_tcp::{decode_ack, decode_slices, DataHello, WriteHeader, ACK_LEN, WRITE_HEADER_LEN};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    if data.len() >= WRITE_HEADER_LEN {
        let mut h = [0u8; WRITE_HEADER_LEN];
        h.copy_from_slice(&data[..WRITE_HEADER_LEN]);
        if let Ok(header) = WriteHeader::decode(&h, 4096, 1 << 30) {
            let table = &data[WRITE_HEADER_LEN..];
            if let Ok(slices) = decode_slices(table, header.payload) {
                let total: u64 = slices.iter().map(|s| s.len).sum();
                assert_eq!(total, header.payload);
                assert!(slices.iter().all(|s| s.len > 0));
            }
        }
    }
    if data.len() >= ACK_LEN {
        let mut a = [0u8; ACK_LEN];
        a.copy_from_slice(&data[..ACK_LEN]);
        let _ = decode_ack(&a);
    }
    if data.len() >= 17 {
        let mut f = [0u8; 17];
        f.copy_from_slice(&data[..17]);
        let _ = DataHello::decode_fixed(&f);
    }
});
