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

/// The lines of the doc from the first that contains `start` up to the next blank line.
fn paragraph(start: &str) -> Vec<&'static str> {
    let at = DOC
        .find(start)
        .unwrap_or_else(|| panic!("PROTOCOL.md has no {start:?}"));
    DOC[at..]
        .lines()
        .skip_while(|l| !l.starts_with('|'))
        .take_while(|l| l.starts_with('|'))
        .collect()
}

/// The `code`-quoted texts of a table row's cell `cell`.
fn quoted(row: &str, cell: usize) -> Vec<String> {
    let text = row.split('|').nth(cell).unwrap_or("");
    text.split('`')
        .skip(1)
        .step_by(2)
        .map(str::to_owned)
        .collect()
}

#[test]
fn the_checksum_test_vectors_in_the_doc_are_what_the_data_plane_computes() {
    let rows = paragraph("Test vectors (value, then the trailer's bytes)");
    let payload = |cell: &str| -> Vec<u8> {
        if cell.contains("empty") {
            Vec::new()
        } else if cell.contains("`kvferry`") {
            b"kvferry".to_vec()
        } else if cell.contains("4096 bytes, byte `i` = `i mod 251`") {
            (0..4096).map(|i| (i % 251) as u8).collect()
        } else {
            panic!("a test vector this test does not know: {cell}")
        }
    };
    let mut checked = 0;
    for row in rows.iter().skip(2) {
        let cells: Vec<&str> = row.split('|').collect();
        let data = payload(cells[1]);
        let value = u64::from_str_radix(quoted(row, 2)[0].trim_start_matches("0x"), 16).unwrap();
        let trailer: Vec<u8> = quoted(row, 3)[0]
            .split(' ')
            .map(|b| u8::from_str_radix(b, 16).unwrap())
            .collect();
        // Streamed in two pieces, as the data plane feeds it.
        let mut h = kvferry_memory::Checksum::new();
        let (a, b) = data.split_at(data.len() / 3);
        h.update(a);
        h.update(b);
        assert_eq!(h.digest(), value, "{row}");
        assert_eq!(h.digest().to_le_bytes().to_vec(), trailer, "{row}");
        checked += 1;
    }
    assert_eq!(checked, 3);
}

/// The doc's prose with every line break a space, to find sentences a line break splits.
fn prose() -> String {
    DOC.split_whitespace().collect::<Vec<_>>().join(" ")
}

#[test]
fn the_write_batch_limits_and_the_tombstones_are_the_defaults_the_doc_states() {
    let c = kvferry_core::Config::default();
    let doc = prose();
    assert!(doc.contains(&format!(
        "1..=`max_op_slices` (the receiver's; default {}, `KVFERRY_MAX_OP_SLICES`)",
        c.max_op_slices
    )));
    assert!(doc.contains(&format!(
        "at most `max_op_bytes` (the receiver's; default 64 MiB = {}, `KVFERRY_MAX_OP_BYTES`)",
        c.max_op_bytes
    )));
    assert!(doc.contains(&format!(
        "the last `tombstones` (default {}, `KVFERRY_TOMBSTONES`)",
        c.tombstones
    )));
    let version = kvferry_core::codec::PROTOCOL_VERSION;
    assert!(DOC.contains(&format!("| 4 | 1 | `version` | `{version}`;")));
    assert!(doc.contains(&format!("(this node speaks version {version})")));
}

#[test]
fn the_cli_refuses_page_sizes_the_page_pattern_cannot_fill() {
    assert!(DOC.contains("`--page-bytes` must be a multiple of 8 and at least 16"));
    let with = |page_bytes| kvferry_testkit::Shape {
        page_bytes,
        ..kvferry_testkit::Shape::default()
    };
    for bad in [0, 8, 12, 20, 4097] {
        assert!(with(bad).check().is_err(), "{bad}");
    }
    for good in [16, 24, 4096, 16384] {
        assert!(with(good).check().is_ok(), "{good}");
    }
}

/// A template of the doc's detail table matches `detail`: a word's run of capitals (`N`,
/// `FIELD`, `room#ROOM`, `A,`) stands for any value.
fn matches_template(template: &str, detail: &str) -> bool {
    let word = |t: &str, d: &str| {
        let prefix: String = t.chars().take_while(|c| !c.is_ascii_uppercase()).collect();
        let rest = &t[prefix.len()..];
        let upper: String = rest.chars().take_while(char::is_ascii_uppercase).collect();
        let suffix = &rest[upper.len()..];
        t == d
            || (!upper.is_empty()
                && !suffix.chars().any(char::is_alphanumeric)
                && d.len() > prefix.len() + suffix.len()
                && d.starts_with(&prefix)
                && d.ends_with(suffix))
    };
    let (t, d): (Vec<&str>, Vec<&str>) =
        (template.split(' ').collect(), detail.split(' ').collect());
    t.len() == d.len() && t.iter().zip(&d).all(|(t, d)| word(t, d))
}

/// Every `Error` a scripted peer provokes from a real endpoint carries a detail the doc's
/// table lists for that code.
#[test]
fn every_error_detail_a_peer_can_provoke_is_listed_in_the_doc_under_its_code() {
    use kvferry_core::{Endpoint, EndpointInfo};
    use std::time::{Duration, Instant};
    let rows = paragraph("The detail texts this implementation sends, per code");
    let templates = |code: ErrorCode| -> Vec<String> {
        let n = code.code();
        let row = rows
            .iter()
            .find(|r| r.starts_with(&format!("| {n} ")))
            .unwrap_or_else(|| panic!("no row for code {n}"));
        quoted(row, 2)
    };
    let now = Instant::now();
    let layout = small_layout(64);
    let endpoint = |role, node: u64, token: &[u8], layout| {
        let mut info = EndpointInfo::new(role, NodeId(node), Incarnation(node), layout);
        info.token = token.to_vec();
        Endpoint::new(kvferry_core::sim::fast_config(), info, node, now).unwrap()
    };
    let errors = |e: &mut Endpoint| -> Vec<(ErrorCode, String)> {
        let mut buf = Vec::new();
        while e.poll_transmit(&mut buf).is_some() {}
        let mut out = Vec::new();
        let mut at = &buf[..];
        while let Ok(Some((m, n))) = Message::decode(at, 1 << 20) {
            if let Message::Error { code, detail } = m {
                out.push((code, detail));
            }
            at = &at[n..];
        }
        out
    };
    // Runs a connector and a listener against each other; every Error either sent.
    let talk = |c: &mut Endpoint, l: &mut Endpoint, at: Instant| {
        let (sc, sl) = (c.open_session(at), l.accept_session(at));
        let mut seen = Vec::new();
        for _ in 0..8 {
            let mut a = Vec::new();
            while c.poll_transmit(&mut a).is_some() {}
            l.handle_input(at, sl, &a);
            let mut b = Vec::new();
            while l.poll_transmit(&mut b).is_some() {}
            c.handle_input(at, sc, &b);
            for bytes in [&a, &b] {
                let mut at = &bytes[..];
                while let Ok(Some((m, n))) = Message::decode(at, 1 << 20) {
                    if let Message::Error { code, detail } = m {
                        seen.push((code, detail));
                    }
                    at = &at[n..];
                }
            }
        }
        (sc, sl, seen)
    };
    let mut provoked: Vec<(ErrorCode, String)> = Vec::new();
    // A wrong token; the same role; a layout that differs.
    let mut d = endpoint(Role::Decode, 1, b"t", layout);
    provoked.extend(
        talk(
            &mut d,
            &mut endpoint(Role::Prefill, 2, b"other", layout),
            now,
        )
        .2,
    );
    let mut d = endpoint(Role::Decode, 1, b"t", layout);
    provoked.extend(talk(&mut d, &mut endpoint(Role::Decode, 2, b"t", layout), now).2);
    let other = kvferry_core::Layout {
        layers: layout.layers + 1,
        ..layout
    };
    let mut d = endpoint(Role::Decode, 1, b"t", layout);
    provoked.extend(talk(&mut d, &mut endpoint(Role::Prefill, 2, b"t", other), now).2);
    // Another protocol version; a frame before the handshake; garbage after it, three times;
    // a room frame the role does not take; a shutdown; no hello in time.
    let mut p = endpoint(Role::Prefill, 2, b"t", layout);
    let s = p.accept_session(now);
    p.handle_input(now, s, &[2, 0, 0, 0, 5, 8]);
    provoked.extend(errors(&mut p));
    let mut p = endpoint(Role::Prefill, 2, b"t", layout);
    let s = p.accept_session(now);
    p.handle_input(now, s, &[3, 0, 0, 0, PROTOCOL_VERSION_BYTE, 13, 0]);
    provoked.extend(errors(&mut p));
    let mut p = endpoint(Role::Prefill, 2, b"t", layout);
    let s = p.accept_session(now);
    let mut frame = Vec::new();
    Message::Probe { nonce: 1 }.encode(&mut frame);
    p.handle_input(now, s, &frame);
    provoked.extend(errors(&mut p));
    let mut d = endpoint(Role::Decode, 1, b"t", layout);
    let mut p = endpoint(Role::Prefill, 2, b"t", layout);
    let (_, sl, _) = talk(&mut d, &mut p, now);
    for _ in 0..2 {
        let mut wrong = Vec::new();
        Message::AbortAck {
            room: RoomId(1),
            generation: 0,
        }
        .encode(&mut wrong);
        p.handle_input(now, sl, &wrong);
    }
    p.handle_input(now, sl, &[2, 0, 0, 0, PROTOCOL_VERSION_BYTE, 200]);
    provoked.extend(errors(&mut p));
    let mut d = endpoint(Role::Decode, 1, b"t", layout);
    let mut p = endpoint(Role::Prefill, 2, b"t", layout);
    talk(&mut d, &mut p, now);
    p.shutdown(now);
    provoked.extend(errors(&mut p));
    let mut p = endpoint(Role::Prefill, 2, b"t", layout);
    p.accept_session(now);
    p.handle_timeout(now + Duration::from_secs(60));
    provoked.extend(errors(&mut p));
    let codes: Vec<u16> = provoked.iter().map(|(c, _)| c.code()).collect();
    for code in [1, 2, 3, 4, 5, 6, 7, 10] {
        assert!(
            codes.contains(&code),
            "code {code} not provoked: {provoked:?}"
        );
    }
    for (code, detail) in &provoked {
        assert!(
            templates(*code).iter().any(|t| matches_template(t, detail)),
            "{code:?} {detail:?} is not in the doc's detail table"
        );
    }
}

const PROTOCOL_VERSION_BYTE: u8 = kvferry_core::codec::PROTOCOL_VERSION;

/// `docs/PROTOCOL.md`, "Concluded rooms" and `Abort`: a succeeded room is remembered, not
/// held; the decode that took part re-requesting it gets its outcome then `AbortAck`, a late
/// abort gets `AbortAck` alone, another decode gets `room_id_reused`.
#[test]
fn answers_about_a_concluded_room_are_the_ones_the_doc_states() {
    use kvferry_core::sim::{Faults, Sim};
    use kvferry_core::{Chunk, Grant, KvPoll};
    use std::time::Duration;
    let doc = prose();
    assert!(doc.contains("An abort of a room that already concluded (a late or duplicated abort, whether the room is still draining or only remembered) is answered with `AbortAck` alone"));
    assert!(doc.contains("from an endpoint that took part, the room's outcome (`0` for a success) at the same generation"));
    let mut sim = Sim::new(47, Faults::default());
    let layout = small_layout(64);
    let config = kvferry_core::sim::fast_config();
    let p = sim.add_prefill(config.clone(), layout, 0, 0..layout.layers);
    let d = sim.add_decode(config.clone(), layout, 0);
    let other = sim.add_decode(config, layout, 1);
    sim.connect(d, p);
    sim.connect(other, p);
    sim.run_for(Duration::from_millis(5), 10_000).unwrap();
    let room = RoomId(3);
    let now = sim.now;
    let dst = sim.nodes[d].alloc(room, 0, 2).unwrap();
    let sd = sim.session(d, p).unwrap();
    sim.nodes[d]
        .endpoint
        .open_receiver(now, room, 0, &[sd], Some(Grant::new(dst, Some(0), None)))
        .unwrap();
    sim.drain(d);
    sim.nodes[p]
        .endpoint
        .open_sender(now, room, 0, None)
        .unwrap();
    let src = sim.nodes[p].alloc(room, 0, 2).unwrap();
    let chunk = Chunk {
        extras: Vec::new(),
        pages: src,
        last: true,
        aux_slot: Some(0),
        state_slot: None,
        layerwise: false,
    };
    sim.nodes[p].endpoint.send_chunk(now, room, chunk).unwrap();
    sim.drain(p);
    sim.run_for(Duration::from_millis(50), 100_000).unwrap();
    assert_eq!(
        sim.nodes[d].endpoint.room_state(room),
        Some(KvPoll::Success)
    );
    assert_eq!(
        sim.nodes[p].endpoint.room_state(room),
        Some(KvPoll::Success)
    );
    let ask = |sim: &mut Sim, from: usize, msg: Message| -> Vec<Message> {
        let sp = sim.session(p, from).unwrap();
        let mut frame = Vec::new();
        msg.encode(&mut frame);
        let now = sim.now;
        sim.nodes[p].endpoint.handle_input(now, sp, &frame);
        std::iter::from_fn(|| sim.nodes[p].endpoint.poll_message())
            .filter(|(s, _)| *s == sp)
            .map(|(_, m)| m)
            .filter(|m| !matches!(m, Message::Heartbeat { .. }))
            .collect()
    };
    let request = Message::RoomRequest(RoomRequest {
        room,
        generation: 0,
        receivers: 1,
        skip_pages: 0,
        pages: smallvec![PageRun { start: 8, len: 2 }],
        aux_slot: Some(1),
        state_slot: None,
        extras: Vec::new(),
        prompt: None,
    });
    let status = |failure| Message::RoomStatus {
        room,
        generation: 0,
        failure,
    };
    let ack = Message::AbortAck {
        room,
        generation: 0,
    };
    assert_eq!(
        ask(&mut sim, d, request.clone()),
        [status(None), ack.clone()]
    );
    let abort = Message::Abort {
        room,
        generation: 0,
        reason: FailureReason::WaitingTimeout,
    };
    assert_eq!(ask(&mut sim, d, abort), std::slice::from_ref(&ack));
    assert_eq!(
        ask(&mut sim, other, request),
        [status(Some(FailureReason::RoomIdReused)), ack]
    );
}

#[test]
fn the_prompt_digest_vectors_in_the_doc_are_what_the_core_computes() {
    use kvferry_core::PromptDigest;
    let hex = |tokens: &[u32]| format!("`{:#018x}`", PromptDigest::of_tokens(tokens).0);
    let thousand: Vec<u32> = (0..1000).collect();
    let at = DOC
        .find("**Prompts.**")
        .expect("PROTOCOL.md defines the prompt digest");
    let text: String = DOC[at..]
        .split("\n\n")
        .next()
        .unwrap()
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    for vector in [
        format!("no tokens {}", hex(&[])),
        format!("`[1, 2, 3]` {}", hex(&[1, 2, 3])),
        format!("`0, 1, ..., 999` {}", hex(&thousand)),
    ] {
        assert!(text.contains(&vector), "{vector} not in: {text}");
    }
    // The bytes the doc spells out are the ones hashed.
    let bytes = "01 00 00 00 02 00 00 00 03 00 00 00";
    assert!(text.contains(&format!("`{bytes}`")));
    let spelled: Vec<u8> = bytes
        .split(' ')
        .map(|b| u8::from_str_radix(b, 16).unwrap())
        .collect();
    let mut h = kvferry_memory::Checksum::new();
    h.update(&spelled);
    assert_eq!(h.digest(), PromptDigest::of_tokens(&[1, 2, 3]).0);
}
