//! The control codec: every frame round-trips, and the decoder is total.

use kvferry_core::codec::{
    DecodeError, ErrorCode, Hello, Message, ProgressStage, RoomRequest, HEADER_LEN,
    PROTOCOL_VERSION,
};
use kvferry_core::sim::small_layout;
use kvferry_core::{FailureReason, Heads, Incarnation, NodeId, PageRun, Role, RoomId};
use proptest::prelude::*;
use smallvec::smallvec;

const MAX: u32 = 1 << 20;

fn every_message() -> Vec<Message> {
    let room = RoomId(0xDEAD_BEEF_0123);
    vec![
        Message::Hello(Hello {
            checksum: false,
            extras: Vec::new(),
            role: Role::Decode,
            rank: 3,
            node: NodeId(77),
            incarnation: Incarnation(0x1234_5678_9ABC),
            layout: small_layout(4096),
            layer_start: 1,
            layer_end: 3,
            writes_aux: false,
            heads: Heads {
                total: 8,
                start: 2,
                count: 2,
                head_bytes: 128,
            },
            heartbeat_interval_ms: 500,
            heartbeat_misses: 30,
            proof: [0xA5; 32],
        }),
        Message::Challenge { nonce: [7; 32] },
        Message::RoomPending {
            room,
            generation: 2,
            queue_position: 9,
        },
        Message::RoomRequest(RoomRequest {
            extras: Vec::new(),
            room,
            generation: 1,
            receivers: 2,
            skip_pages: 3,
            pages: smallvec![PageRun { start: 5, len: 3 }, PageRun { start: 100, len: 1 }],
            aux_slot: Some(4),
            state_slot: None,
            prompt: None,
        }),
        Message::RoomStatus {
            room,
            generation: 0,
            failure: None,
        },
        Message::RoomStatus {
            room,
            generation: 0,
            failure: Some(FailureReason::SessionBlacklisted),
        },
        Message::Progress {
            room,
            generation: 0,
            stage: ProgressStage::Computing,
        },
        Message::Abort {
            room,
            generation: 5,
            reason: FailureReason::AbortedLocally,
        },
        Message::AbortAck {
            room,
            generation: 5,
        },
        Message::Heartbeat {
            free_pages: 10,
            queued_rooms: 2,
            frames_received: 7,
        },
        Message::Probe { nonce: 42 },
        Message::ProbeAck { nonce: 42 },
        Message::Error {
            code: ErrorCode::BadToken,
            detail: "cluster token mismatch".into(),
        },
        Message::Transport {
            payload: vec![1, 2, 3, 0xFF],
        },
        Message::Transport { payload: vec![] },
        Message::Hello(Hello {
            checksum: false,
            extras: vec![
                kvferry_core::ExtraPool {
                    items: 64,
                    item_bytes: vec![48, 80],
                    parts: Vec::new(),
                },
                kvferry_core::ExtraPool {
                    items: 9,
                    item_bytes: vec![256; 3],
                    parts: Vec::new(),
                },
            ],
            role: Role::Prefill,
            rank: 0,
            node: NodeId(78),
            incarnation: Incarnation(3),
            layout: small_layout(16),
            layer_start: 0,
            layer_end: 4,
            writes_aux: true,
            heads: Heads::whole(&small_layout(16)),
            heartbeat_interval_ms: 1,
            heartbeat_misses: 1,
            proof: [1; 32],
        }),
        Message::RoomRequest(RoomRequest {
            extras: vec![
                smallvec![PageRun { start: 5, len: 1 }],
                smallvec![],
                smallvec![PageRun { start: 10, len: 3 }, PageRun { start: 40, len: 2 }],
            ],
            room,
            generation: 4,
            receivers: 1,
            skip_pages: 0,
            pages: smallvec![PageRun { start: 0, len: 2 }],
            aux_slot: Some(1),
            state_slot: Some(2),
            prompt: None,
        }),
    ]
}

#[test]
fn every_frame_round_trips() {
    for msg in every_message() {
        let mut buf = Vec::new();
        msg.encode(&mut buf);
        assert_eq!(
            Message::decode(&buf, MAX),
            Ok(Some((msg.clone(), buf.len()))),
            "{msg:?}"
        );
        assert_eq!(msg.encoded_len(), buf.len());
    }
}

#[test]
fn a_partial_frame_asks_for_more_bytes() {
    for msg in every_message() {
        let mut buf = Vec::new();
        msg.encode(&mut buf);
        for cut in 0..buf.len() {
            assert_eq!(
                Message::decode(&buf[..cut], MAX),
                Ok(None),
                "{msg:?} cut at {cut}"
            );
        }
    }
}

#[test]
fn an_oversized_length_is_refused_before_the_body_arrives() {
    let buf = (MAX + 1).to_le_bytes();
    assert_eq!(
        Message::decode(&buf, MAX),
        Err(DecodeError::TooLong {
            len: MAX + 1,
            max: MAX
        })
    );
}

#[test]
fn an_unknown_version_and_type_are_typed_errors() {
    assert_eq!(
        Message::decode(&[2, 0, 0, 0, PROTOCOL_VERSION + 1, 1], MAX),
        Err(DecodeError::UnknownVersion(PROTOCOL_VERSION + 1))
    );
    assert_eq!(
        Message::decode(&[2, 0, 0, 0, PROTOCOL_VERSION, 200], MAX),
        Err(DecodeError::UnknownType(200))
    );
    assert_eq!(
        Message::decode(&[1, 0, 0, 0, 1], MAX),
        Err(DecodeError::TooShort { len: 1 })
    );
}

#[test]
fn truncated_and_padded_bodies_are_typed_errors() {
    let mut buf = Vec::new();
    Message::Probe { nonce: 1 }.encode(&mut buf);
    let mut short = buf.clone();
    short.pop();
    short[0] -= 1;
    assert_eq!(
        Message::decode(&short, MAX),
        Err(DecodeError::Truncated { ty: 9 })
    );
    let mut long = buf.clone();
    long.push(0);
    long[0] += 1;
    assert_eq!(
        Message::decode(&long, MAX),
        Err(DecodeError::TrailingBytes { ty: 9 })
    );
}

#[test]
fn a_page_count_larger_than_the_frame_is_refused_without_allocating() {
    let mut buf = Vec::new();
    Message::RoomRequest(RoomRequest {
        extras: Vec::new(),
        room: RoomId(1),
        generation: 0,
        receivers: 1,
        skip_pages: 0,
        pages: smallvec![],
        aux_slot: None,
        state_slot: None,
        prompt: None,
    })
    .encode(&mut buf);
    // The run count sits before the one-byte count of extra pools.
    let n = buf.len();
    buf[n - 5..n - 1].copy_from_slice(&u32::MAX.to_le_bytes());
    assert_eq!(
        Message::decode(&buf, MAX),
        Err(DecodeError::InvalidRoomRequest {
            room: RoomId(1),
            generation: 0,
            field: "length"
        })
    );
}

#[test]
fn an_extra_pool_claiming_more_tensors_than_the_frame_holds_is_refused() {
    let Message::Hello(h) = every_message().remove(0) else {
        panic!("the first message is a hello")
    };
    let mut buf = Vec::new();
    Message::Hello(Hello {
        extras: vec![kvferry_core::ExtraPool {
            items: 1,
            item_bytes: vec![8],
            parts: Vec::new(),
        }],
        ..h
    })
    .encode(&mut buf);
    // The pool's tensor count (u16) sits before its one item size.
    let n = buf.len();
    buf[n - 6..n - 4].copy_from_slice(&4000u16.to_le_bytes());
    assert_eq!(
        Message::decode(&buf, MAX),
        Err(DecodeError::InvalidField {
            ty: 1,
            field: "extra tensors"
        })
    );
}

#[test]
fn a_request_for_nothing_that_names_extra_items_is_refused() {
    let mut buf = Vec::new();
    Message::RoomRequest(RoomRequest {
        extras: vec![smallvec![PageRun { start: 1, len: 1 }]],
        room: RoomId(1),
        generation: 0,
        receivers: 1,
        skip_pages: u32::MAX,
        pages: smallvec![],
        aux_slot: None,
        state_slot: None,
        prompt: None,
    })
    .encode(&mut buf);
    assert_eq!(
        Message::decode(&buf, MAX),
        Err(DecodeError::InvalidRoomRequest {
            room: RoomId(1),
            generation: 0,
            field: "skip_pages"
        })
    );
}

#[test]
fn invalid_field_values_name_the_field() {
    let mut buf = Vec::new();
    Message::Abort {
        room: RoomId(1),
        generation: 0,
        reason: FailureReason::Shutdown,
    }
    .encode(&mut buf);
    let n = buf.len();
    buf[n - 1] = 0xEE;
    assert_eq!(
        Message::decode(&buf, MAX),
        Err(DecodeError::InvalidField {
            ty: 6,
            field: "reason"
        })
    );
}

/// A hello with each impossible value in turn: the error names the field (and the endpoint
/// sends it back in an `InvalidHello` error frame).
#[test]
fn every_impossible_hello_value_is_named() {
    let Message::Hello(good) = every_message()[0].clone() else {
        unreachable!("the first message is a hello")
    };
    // (field, body offset, bytes written there). Offsets: role 6, rank 7, node 9,
    // incarnation 17, layout 25 (layers, planes 27, page_bytes 28, ...), layer_start 48,
    // layer_end 50, writes_aux 52, heads 53 (total, start 55, count 57, head_bytes 59),
    // heartbeat interval 63, misses 67.
    let cases: [(&str, usize, &[u8]); 11] = [
        ("role", 6, &[3]),
        ("planes", 27, &[3]),
        ("page_bytes", 28, &[0; 4]),
        ("layers", 25, &[0; 2]),
        ("layer range", 50, &[200]),
        ("writes_aux", 52, &[2]),
        ("heads", 53, &[3, 0]),
        ("heads", 57, &[0, 0]),
        ("heads", 59, &[0xFF, 0, 0, 0]),
        ("heartbeat_interval_ms", 63, &[0; 4]),
        ("heartbeat_misses", 67, &[0xFF; 4]),
    ];
    for (field, at, bytes) in cases {
        let mut buf = Vec::new();
        Message::Hello(good.clone()).encode(&mut buf);
        buf[at..at + bytes.len()].copy_from_slice(bytes);
        assert_eq!(
            Message::decode(&buf, MAX),
            Err(DecodeError::InvalidField { ty: 1, field }),
            "{field}"
        );
    }
}

/// Found by cargo-fuzz: a lossy decode of invalid UTF-8 re-encoded to other bytes.
#[test]
fn an_error_detail_that_is_not_utf8_is_refused() {
    let crash = [
        0x0a,
        0,
        0,
        0,
        PROTOCOL_VERSION,
        0x0b,
        1,
        0,
        4,
        0,
        0,
        0,
        0,
        0xee,
    ];
    assert_eq!(
        Message::decode(&crash, MAX),
        Err(DecodeError::InvalidField {
            ty: 11,
            field: "detail"
        })
    );
}

#[test]
fn header_is_length_version_type() {
    let mut buf = Vec::new();
    Message::Heartbeat {
        free_pages: 1,
        queued_rooms: 2,
        frames_received: 3,
    }
    .encode(&mut buf);
    assert_eq!(buf.len(), HEADER_LEN + 16);
    assert_eq!(&buf[..6], &[18, 0, 0, 0, PROTOCOL_VERSION, 8]);
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 20_000, ..ProptestConfig::default() })]

    #[test]
    fn the_decoder_never_panics_and_never_overreads(bytes in proptest::collection::vec(any::<u8>(), 0..300), max in 0u32..4096) {
        if let Ok(Some((msg, used))) = Message::decode(&bytes, max) {
            prop_assert!(used <= bytes.len());
            // What decodes re-encodes to the same bytes.
            let mut again = Vec::new();
            msg.encode(&mut again);
            prop_assert_eq!(&again[..], &bytes[..used]);
        }
    }

    #[test]
    fn a_flipped_bit_in_a_valid_frame_is_an_error_or_another_valid_frame(which in 0usize..13, pos in any::<prop::sample::Index>(), bit in 0u8..8) {
        let msg = every_message()[which].clone();
        let mut buf = Vec::new();
        msg.encode(&mut buf);
        let i = pos.index(buf.len());
        buf[i] ^= 1 << bit;
        let _ = Message::decode(&buf, MAX);
    }
}

#[test]
fn a_transport_payload_longer_than_the_limit_is_refused() {
    use kvferry_core::codec::MAX_TRANSPORT_LEN;
    // Hand-built: header, type 12, a length one past the limit, and that many bytes.
    let len = MAX_TRANSPORT_LEN + 1;
    let mut frame = Vec::new();
    frame.extend_from_slice(&((2 + 2 + len) as u32).to_le_bytes());
    frame.push(PROTOCOL_VERSION);
    frame.push(12);
    frame.extend_from_slice(&(len as u16).to_le_bytes());
    frame.extend(std::iter::repeat_n(7u8, len));
    assert_eq!(
        Message::decode(&frame, MAX),
        Err(DecodeError::InvalidField {
            ty: 12,
            field: "transport length"
        })
    );
}

/// The hello's size is the one `docs/PROTOCOL.md` states (99 bytes of body with no extra
/// pool, 6 of header, and 6 + 4 per tensor for each pool).
#[test]
fn a_hello_is_the_size_the_protocol_states() {
    let mut buf = Vec::new();
    every_message()[0].encode(&mut buf);
    assert_eq!(buf.len(), HEADER_LEN + 99);
    let doc = include_str!("../../docs/PROTOCOL.md");
    assert!(doc.contains("Body length: 99 with no extra pool (the frame is 105 bytes"));
    assert!(doc.contains("`7 + 4 x tensors` per pool"));
    assert!(doc.contains("`1 + 22 x parts` per tensor"));
    let Message::Hello(h) = every_message().remove(0) else {
        panic!("the first message is a hello")
    };
    let pools = vec![
        kvferry_core::ExtraPool {
            items: 8,
            item_bytes: vec![48, 80],
            parts: Vec::new(),
        },
        kvferry_core::ExtraPool {
            items: 4,
            item_bytes: vec![256; 5],
            parts: Vec::new(),
        },
    ];
    let mut buf = Vec::new();
    Message::Hello(Hello {
        extras: pools.clone(),
        ..h.clone()
    })
    .encode(&mut buf);
    assert_eq!(buf.len(), HEADER_LEN + 99 + (7 + 4 * 2) + (7 + 4 * 5));
    // The first pool split: its first tensor into two parts, its second into one.
    let part = kvferry_core::ItemPart {
        offset: 0,
        rows: 1,
        stride: 0,
        units: 2,
        first: 0,
        count: 1,
        unit_bytes: 8,
    };
    let mut split = pools;
    split[0].parts = vec![vec![part, part], vec![part]];
    let mut buf = Vec::new();
    let hello = Message::Hello(Hello { extras: split, ..h });
    hello.encode(&mut buf);
    assert_eq!(
        buf.len(),
        HEADER_LEN + 99 + (7 + 4 * 2 + (1 + 22 * 2) + (1 + 22)) + (7 + 4 * 5)
    );
    assert_eq!(Message::decode(&buf, MAX), Ok(Some((hello, buf.len()))));
}

#[test]
fn a_hello_whose_parts_leave_their_item_is_malformed() {
    let Message::Hello(h) = every_message().remove(0) else {
        panic!("the first message is a hello")
    };
    let part = kvferry_core::ItemPart {
        offset: 40,
        rows: 1,
        stride: 0,
        units: 2,
        first: 0,
        count: 1,
        unit_bytes: 16,
    };
    let pool = kvferry_core::ExtraPool {
        items: 8,
        item_bytes: vec![48],
        parts: vec![vec![part]],
    };
    let mut buf = Vec::new();
    Message::Hello(Hello {
        extras: vec![pool],
        ..h
    })
    .encode(&mut buf);
    assert!(matches!(
        Message::decode(&buf, MAX),
        Err(DecodeError::InvalidField { .. })
    ));
}

/// A room request's size is the one `docs/PROTOCOL.md` states: 39 bytes, 8 per page run,
/// and 4 + 8 per item run for each listed extra pool.
#[test]
fn a_room_request_is_the_size_the_protocol_states() {
    let request = every_message()
        .into_iter()
        .filter_map(|m| match m {
            Message::RoomRequest(r) if !r.extras.is_empty() => Some(r),
            _ => None,
        })
        .next()
        .expect("a room request with extra items");
    let runs = request.pages.len();
    let extras: usize = request.extras.iter().map(|x| 4 + 8 * x.len()).sum();
    let mut buf = Vec::new();
    Message::RoomRequest(request).encode(&mut buf);
    assert_eq!(buf.len(), HEADER_LEN + 39 + 8 * runs + extras);
    let doc = include_str!("../../docs/PROTOCOL.md");
    assert!(doc.contains("Body length: 39 + 8 x run_count + Σ (4 + 8 x item_run_count)"));
}
