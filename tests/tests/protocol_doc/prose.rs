//! What the doc states in prose and vectors: checksum and prompt-digest vectors, the limits
//! and defaults, every error detail a peer can provoke, the answers about a concluded room.

use super::*;

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
