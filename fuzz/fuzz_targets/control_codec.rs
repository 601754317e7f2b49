//! The control-frame decoder never panics, never over-reads, and re-encodes what it decodes
//! to the same bytes.
#![no_main]

use kvferry_core::codec::Message;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let max = 1 << 20;
    let mut rest = data;
    while let Ok(Some((msg, used))) = Message::decode(rest, max) {
        assert!(used <= rest.len());
        let mut again = Vec::new();
        msg.encode(&mut again);
        assert_eq!(&again[..], &rest[..used], "re-encoding differs for {msg:?}");
        rest = &rest[used..];
    }
});
