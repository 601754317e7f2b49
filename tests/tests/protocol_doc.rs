//! `docs/PROTOCOL.md` is the specification: every frame's table in it (control frames, and
//! the data plane's write batch and ack) gives the exact size and order of the frame's
//! fields. These tests encode one frame of each type with the codecs and read every
//! fixed-size field back at the offset the doc's table implies, so the doc cannot drift from
//! the code.
#![allow(clippy::unwrap_used)] // tests may panic

use kvferry_core::codec::{
    ErrorCode, Hello, LandedRange, Message, ProgressStage, RoomRequest, HEADER_LEN,
};
use kvferry_core::sim::small_layout;
use kvferry_core::{FailureReason, Heads, Incarnation, NodeId, PageRun, Region, Role, RoomId};
use smallvec::smallvec;

const DOC: &str = include_str!("../../docs/PROTOCOL.md");

/// The `(size, field)` rows of the first table after the heading that starts with `heading`.
/// Sizes that are not a number (a length field's value, `8 x run_count`, `per pool`) are 0:
/// the frames below leave those parts empty.
fn table(heading: &str) -> Vec<(usize, String)> {
    let at = DOC
        .find(heading)
        .unwrap_or_else(|| panic!("PROTOCOL.md has no {heading:?}"));
    let mut rows = Vec::new();
    let mut started = false;
    for line in DOC[at..].lines().skip(1) {
        if !line.starts_with('|') {
            if started {
                break;
            }
            continue;
        }
        started = true;
        let cells: Vec<&str> = line.split('|').map(str::trim).collect();
        let (size, field) = (cells[1], cells[2].trim_matches('`'));
        if size == "size" || size.starts_with("---") {
            continue;
        }
        rows.push((size.parse().unwrap_or(0), field.to_owned()));
    }
    assert!(!rows.is_empty(), "no table under {heading:?}");
    rows
}

/// Encodes `msg` and checks, against the doc's table under `heading`: the body's length,
/// and each `(field, value)` read little-endian at the offset the table implies.
fn check(heading: &str, msg: Message, fields: &[(&str, u64)]) {
    let mut frame = Vec::new();
    msg.encode(&mut frame);
    check_bytes(heading, &frame[HEADER_LEN..], fields);
}

/// As [`check`], for bytes a codec already encoded.
fn check_bytes(heading: &str, body: &[u8], fields: &[(&str, u64)]) {
    let rows = table(heading);
    let size: usize = rows.iter().map(|r| r.0).sum();
    assert_eq!(
        body.len(),
        size,
        "{heading}: body length against the doc's table"
    );
    for (name, value) in fields {
        let mut offset = 0;
        let (width, _) = rows
            .iter()
            .find(|(w, f)| {
                let hit = f == name;
                if !hit {
                    offset += w;
                }
                hit
            })
            .unwrap_or_else(|| panic!("{heading}: no field {name:?} in the doc"));
        let mut le = [0u8; 8];
        le[..*width].copy_from_slice(&body[offset..offset + width]);
        assert_eq!(
            u64::from_le_bytes(le),
            *value,
            "{heading}: field {name} at offset {offset}"
        );
    }
}

// One check per control message, in the doc's order: kept as one table so that it and the
// doc read side by side.
#[test]
fn every_control_frame_has_the_size_and_field_offsets_the_protocol_doc_states() {
    let room = RoomId(0x0102_0304_0506_0708);
    let layout = small_layout(4096);
    check(
        "### Type 13: `Challenge`",
        Message::Challenge { nonce: [9; 32] },
        &[],
    );
    check(
        "### Type 1: `Hello`",
        Message::Hello(Hello {
            role: Role::Decode,
            rank: 3,
            node: NodeId(77),
            incarnation: Incarnation(0x1234),
            layout,
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
            checksum: true,
            extras: Vec::new(),
        }),
        &[
            ("role", 2),
            ("rank", 3),
            ("node", 77),
            ("incarnation", 0x1234),
            ("layers", u64::from(layout.layers)),
            ("planes", u64::from(layout.planes)),
            ("page_bytes", u64::from(layout.page_bytes)),
            ("pages", u64::from(layout.pages)),
            ("aux_bytes", u64::from(layout.aux_bytes)),
            ("state_bytes", u64::from(layout.state_bytes)),
            ("slots", u64::from(layout.slots)),
            ("layer_start", 1),
            ("layer_end", 3),
            ("writes_aux", 0),
            ("heads_total", 8),
            ("head_start", 2),
            ("head_count", 2),
            ("head_bytes", 128),
            ("heartbeat_interval_ms", 500),
            ("heartbeat_misses", 30),
            ("flags", 1),
            ("extra_pools", 0),
        ],
    );
    check(
        "### Type 2: `RoomPending`",
        Message::RoomPending {
            room,
            generation: 5,
            queue_position: 9,
        },
        &[("room", room.0), ("generation", 5), ("queue_position", 9)],
    );
    check(
        "### Type 3: `RoomRequest`",
        Message::RoomRequest(RoomRequest {
            room,
            generation: 2,
            receivers: 3,
            skip_pages: 4,
            pages: smallvec![],
            aux_slot: Some(6),
            state_slot: None,
            extras: Vec::new(),
            prompt: None,
        }),
        &[
            ("room", room.0),
            ("generation", 2),
            ("receivers", 3),
            ("skip_pages", 4),
            ("aux_slot", 6),
            ("state_slot", u64::from(u32::MAX)),
            ("run_count", 0),
            ("extra_count", 0),
        ],
    );
    check(
        "### Type 4: `RoomStatus`",
        Message::RoomStatus {
            room,
            generation: 1,
            failure: Some(FailureReason::ChecksumMismatch),
        },
        &[
            ("room", room.0),
            ("generation", 1),
            ("failure", u64::from(FailureReason::ChecksumMismatch.code())),
        ],
    );
    check(
        "### Type 5: `Progress`",
        Message::Progress {
            room,
            generation: 1,
            stage: ProgressStage::Computing,
        },
        &[("room", room.0), ("stage", 2)],
    );
    check(
        "### Type 6: `Abort`",
        Message::Abort {
            room,
            generation: 7,
            reason: FailureReason::WaitingTimeout,
        },
        &[
            ("generation", 7),
            ("reason", u64::from(FailureReason::WaitingTimeout.code())),
        ],
    );
    check(
        "### Type 7: `AbortAck`",
        Message::AbortAck {
            room,
            generation: 7,
        },
        &[("room", room.0), ("generation", 7)],
    );
    check(
        "### Type 8: `Heartbeat`",
        Message::Heartbeat {
            free_pages: 11,
            queued_rooms: 12,
            frames_received: 13,
        },
        &[
            ("free_pages", 11),
            ("queued_rooms", 12),
            ("frames_received", 13),
        ],
    );
    check(
        "### Types 9 and 10: `Probe` / `ProbeAck`",
        Message::Probe { nonce: 99 },
        &[("nonce", 99)],
    );
    check(
        "### Types 9 and 10: `Probe` / `ProbeAck`",
        Message::ProbeAck { nonce: 98 },
        &[("nonce", 98)],
    );
    check(
        "### Type 11: `Error`",
        Message::Error {
            code: ErrorCode::HandshakeTimeout,
            detail: String::new(),
        },
        &[("code", 10), ("detail_len", 0)],
    );
    check(
        "### Type 11: `Error`",
        Message::Error {
            code: ErrorCode::FenceTimeout,
            detail: String::new(),
        },
        &[("code", 11), ("detail_len", 0)],
    );
    check(
        "### Type 12: `Transport`",
        Message::Transport {
            payload: Vec::new(),
        },
        &[("len", 0)],
    );
    check(
        "### Type 14: `OpChecksum`",
        Message::OpChecksum {
            room: RoomId(71),
            generation: 3,
            checksum: 0x0123_4567_89ab_cdef,
            ranges: Vec::new(),
        },
        &[
            ("room", 71),
            ("generation", 3),
            ("checksum", 0x0123_4567_89ab_cdef),
            ("range_count", 0),
        ],
    );
}

/// Each range of an `OpChecksum` adds the 32 bytes the doc states, fields in its order.
#[test]
fn each_range_of_an_op_checksum_adds_the_bytes_the_doc_states() {
    let range = LandedRange {
        region: Region::Kv { layer: 2, plane: 1 },
        offset: 4096,
        len: 1024,
        rows: 16,
        stride: 2048,
    };
    let frame = |n: usize| {
        let mut out = Vec::new();
        Message::OpChecksum {
            room: RoomId(1),
            generation: 0,
            checksum: 0,
            ranges: vec![range; n],
        }
        .encode(&mut out);
        out
    };
    let (one, two) = (frame(1), frame(2));
    assert_eq!(two.len() - one.len(), 32);
    assert!(DOC.contains("| 32 x range_count | ranges |"));
    let at = HEADER_LEN + 8 + 4 + 8 + 2;
    let le = |b: &[u8]| {
        let mut x = [0u8; 8];
        x[..b.len()].copy_from_slice(b);
        u64::from_le_bytes(x)
    };
    assert_eq!(le(&one[at..at + 4]), u64::from(range.region.code()));
    assert_eq!(le(&one[at + 4..at + 12]), 4096);
    assert_eq!(le(&one[at + 12..at + 20]), 1024);
    assert_eq!(le(&one[at + 20..at + 24]), 16);
    assert_eq!(le(&one[at + 24..at + 32]), 2048);
    assert_eq!(one.len(), at + 32);
}

#[test]
fn the_variable_parts_of_a_room_request_grow_by_the_sizes_the_doc_states() {
    let with = |pages: usize, pools: &[usize]| {
        let mut frame = Vec::new();
        Message::RoomRequest(RoomRequest {
            room: RoomId(1),
            generation: 0,
            receivers: 1,
            skip_pages: 0,
            pages: (0..pages as u32)
                .map(|i| PageRun {
                    start: 10 * i,
                    len: 1,
                })
                .collect(),
            aux_slot: None,
            state_slot: None,
            prompt: None,
            extras: pools
                .iter()
                .map(|&n| {
                    (0..n as u32)
                        .map(|i| PageRun {
                            start: 10 * i,
                            len: 1,
                        })
                        .collect()
                })
                .collect(),
        })
        .encode(&mut frame);
        frame.len() - HEADER_LEN
    };
    let base = with(0, &[]);
    assert_eq!(with(3, &[]), base + 3 * 8);
    assert_eq!(with(0, &[2, 0]), base + (4 + 2 * 8) + 4);
}

#[test]
fn the_data_planes_write_batch_header_and_ack_have_the_layout_the_doc_states() {
    let mut header = Vec::new();
    kvferry_tcp::WriteHeader {
        op: kvferry_core::TransferId(0x1111),
        room: RoomId(0x2222),
        generation: 3,
        slices: 0,
        payload: 0,
        checked: true,
    }
    .encode(&mut header);
    check_bytes(
        "### Write batch",
        &header,
        &[
            ("type", 2),
            ("op", 0x1111),
            ("room", 0x2222),
            ("generation", 3),
            ("slice_count", 0),
            ("payload", 0),
        ],
    );
    let ack = kvferry_tcp::encode_ack(
        kvferry_core::TransferId(0x3333),
        kvferry_tcp::AckStatus::Corrupt,
    );
    check_bytes("### Ack", &ack, &[("op", 0x3333), ("status", 2)]);
    let mut slice = Vec::new();
    let strided = kvferry_core::Slice {
        region: Region::Kv { layer: 1, plane: 0 },
        src_offset: 0,
        dst_offset: 5,
        len: 6,
        rows: 7,
        src_stride: 99,
        dst_stride: 8,
    };
    kvferry_tcp::encode_slice(&strided, &mut slice);
    assert!(DOC.contains("| 32 x slice_count | slices |"));
    check_bytes(
        "#### Slice descriptor",
        &slice,
        &[
            ("region", u64::from(strided.region.code())),
            ("dst_offset", 5),
            ("len", 6),
            ("rows", 7),
            ("stride", 8),
        ],
    );
    let decoded = kvferry_tcp::decode_slices(&slice, 42, 4096).unwrap();
    assert!(
        kvferry_tcp::decode_slices(&slice, 42, 6).is_err(),
        "more rows than the receiver's max_op_slices"
    );
    assert_eq!(
        (
            decoded[0].dst_offset,
            decoded[0].len,
            decoded[0].rows,
            decoded[0].dst_stride
        ),
        (5, 6, 7, 8),
        "the payload is rows x len"
    );
}

#[path = "protocol_doc/prose.rs"]
mod prose;
