//! Authentication: both ends prove the cluster token over fresh nonces, the token never goes
//! on the wire, a listener tells a stranger nothing but its challenge, recorded handshakes
//! replay to nothing, and data connections are bound to their session by its key.
#![allow(clippy::unwrap_used)] // tests may panic

use std::time::{Duration, Instant};

use kvferry_core::codec::{ErrorCode, Hello, Message};
use kvferry_core::sim::{fast_config, small_layout};
use kvferry_core::{
    DataRefusal, Endpoint, EndpointInfo, Event, Heads, Incarnation, NodeId, RejectReason, Role,
    SessionId, SessionState,
};

const TOKEN: &[u8] = b"s3cret-cluster-token";

fn endpoint(role: Role, node: u64, token: &[u8]) -> Endpoint {
    let mut info = EndpointInfo::new(role, NodeId(node), Incarnation(node * 10), small_layout(64));
    info.token = token.to_vec();
    Endpoint::new(fast_config(), info, node, Instant::now()).unwrap()
}

/// Every frame an endpoint has queued, encoded.
fn sent(e: &mut Endpoint) -> Vec<u8> {
    let mut buf = Vec::new();
    while e.poll_transmit(&mut buf).is_some() {}
    buf
}

fn frames(mut bytes: &[u8]) -> Vec<Message> {
    let mut out = Vec::new();
    while let Ok(Some((m, n))) = Message::decode(bytes, 1 << 20) {
        out.push(m);
        bytes = &bytes[n..];
    }
    out
}

/// A connector `c` and a listener `l` talking until neither has anything to say. Returns
/// every byte the listener sent.
fn handshake(c: &mut Endpoint, sc: SessionId, l: &mut Endpoint, sl: SessionId) -> Vec<u8> {
    handshake_at(c, sc, l, sl, Instant::now())
}

/// [`handshake`] at a given instant (silence is counted from it).
fn handshake_at(
    c: &mut Endpoint,
    sc: SessionId,
    l: &mut Endpoint,
    sl: SessionId,
    now: Instant,
) -> Vec<u8> {
    let mut from_listener = Vec::new();
    loop {
        let a = sent(c);
        l.handle_input(now, sl, &a);
        let b = sent(l);
        c.handle_input(now, sc, &b);
        from_listener.extend_from_slice(&b);
        if a.is_empty() && b.is_empty() {
            return from_listener;
        }
    }
}

fn events(e: &mut Endpoint) -> Vec<Event> {
    std::iter::from_fn(|| e.poll_event()).collect()
}

fn established(e: &Endpoint, s: SessionId) -> bool {
    e.session_state(s) == Some(SessionState::Established)
}

#[test]
fn both_ends_prove_the_token_and_it_never_goes_on_the_wire() {
    let mut c = endpoint(Role::Decode, 1, TOKEN);
    let mut l = endpoint(Role::Prefill, 2, TOKEN);
    let sc = c.open_session(Instant::now());
    let sl = l.accept_session(Instant::now());
    let mut all = sent(&mut c);
    let first = all.clone();
    l.handle_input(Instant::now(), sl, &first);
    let rest = handshake(&mut c, sc, &mut l, sl);
    all.extend_from_slice(&rest);
    assert!(established(&c, sc) && established(&l, sl));
    assert!(
        !all.windows(TOKEN.len()).any(|w| w == TOKEN),
        "the token appears in the handshake bytes"
    );
    assert_eq!(
        c.data_key(sc).unwrap(),
        l.data_key(sl).unwrap(),
        "both ends derive the same session key"
    );
}

#[test]
fn a_stranger_gets_only_a_challenge_and_a_refusal_and_nothing_it_can_use() {
    let mut stranger = endpoint(Role::Decode, 1, b"guess");
    let mut l = endpoint(Role::Prefill, 2, TOKEN);
    let sc = stranger.open_session(Instant::now());
    let sl = l.accept_session(Instant::now());
    let captured = handshake(&mut stranger, sc, &mut l, sl);
    let got = frames(&captured);
    assert_eq!(got.len(), 2, "{got:?}");
    assert!(matches!(got[0], Message::Challenge { .. }), "{got:?}");
    assert!(
        matches!(
            &got[1],
            Message::Error {
                code: ErrorCode::BadToken,
                ..
            }
        ),
        "{got:?}"
    );
    assert!(!established(&l, sl));
    assert!(events(&mut l).iter().any(|e| matches!(
        e,
        Event::SessionRejected {
            reason: RejectReason::BadToken,
            ..
        }
    )));
    // Try what was captured: its challenge as ours, each 32 captured bytes as a proof.
    let Message::Challenge { nonce } = got[0] else {
        unreachable!()
    };
    let mut attempts: Vec<[u8; 32]> = vec![nonce];
    attempts.extend(
        captured
            .windows(32)
            .map(|w| <[u8; 32]>::try_from(w).unwrap()),
    );
    for proof in attempts.into_iter().take(64) {
        let s = l.accept_session(Instant::now());
        let mut bytes = Vec::new();
        Message::Challenge { nonce }.encode(&mut bytes);
        l.handle_input(Instant::now(), s, &bytes);
        let Message::Hello(mut hello) = our_kind_of_hello() else {
            unreachable!()
        };
        hello.proof = proof;
        let mut bytes = Vec::new();
        Message::Hello(hello).encode(&mut bytes);
        l.handle_input(Instant::now(), s, &bytes);
        assert!(!established(&l, s), "captured bytes let a stranger in");
    }
}

/// A decode hello of the shape the listener accepts, proof still to fill in.
fn our_kind_of_hello() -> Message {
    Message::Hello(Hello {
        checksum: false,
        extras: Vec::new(),
        role: Role::Decode,
        rank: 0,
        node: NodeId(1),
        incarnation: Incarnation(10),
        layout: small_layout(64),
        layer_start: 0,
        layer_end: 4,
        writes_aux: true,
        heads: Heads::whole(&small_layout(64)),
        heartbeat_interval_ms: 250,
        heartbeat_misses: 3,
        proof: [0; 32],
    })
}

#[test]
fn a_recorded_handshake_replayed_on_a_new_connection_is_refused() {
    let mut c = endpoint(Role::Decode, 1, TOKEN);
    let mut l = endpoint(Role::Prefill, 2, TOKEN);
    let sc = c.open_session(Instant::now());
    let sl = l.accept_session(Instant::now());
    // Record what the real connector says.
    let mut recorded = Vec::new();
    let now = Instant::now();
    loop {
        let a = sent(&mut c);
        recorded.extend_from_slice(&a);
        l.handle_input(now, sl, &a);
        let b = sent(&mut l);
        c.handle_input(now, sc, &b);
        if a.is_empty() && b.is_empty() {
            break;
        }
    }
    assert!(established(&l, sl));
    // Replay it, byte for byte, on a fresh connection to the same listener.
    let replay = l.accept_session(Instant::now());
    l.handle_input(Instant::now(), replay, &recorded);
    assert!(!established(&l, replay));
    let answer = frames(&sent(&mut l));
    assert!(
        answer.iter().any(|m| matches!(
            m,
            Message::Error {
                code: ErrorCode::BadToken,
                ..
            }
        )),
        "{answer:?}"
    );
}

#[test]
fn a_wrong_token_is_refused_with_a_clear_error_on_both_ends() {
    let mut c = endpoint(Role::Decode, 1, b"other-token");
    let mut l = endpoint(Role::Prefill, 2, TOKEN);
    let sc = c.open_session(Instant::now());
    let sl = l.accept_session(Instant::now());
    handshake(&mut c, sc, &mut l, sl);
    assert!(events(&mut l).iter().any(|e| matches!(
        e,
        Event::SessionRejected {
            reason: RejectReason::BadToken,
            ..
        }
    )));
    assert!(events(&mut c).iter().any(|e| matches!(
        e,
        Event::PeerError {
            code: ErrorCode::BadToken,
            ..
        }
    )));
}

#[test]
fn a_listener_that_cannot_prove_the_token_is_refused_by_the_connector() {
    let mut c = endpoint(Role::Decode, 1, TOKEN);
    let sc = c.open_session(Instant::now());
    let _ = sent(&mut c);
    // An impostor listener: answers with a challenge, then a hello with a made-up proof.
    let mut bytes = Vec::new();
    Message::Challenge { nonce: [3; 32] }.encode(&mut bytes);
    c.handle_input(Instant::now(), sc, &bytes);
    let Some(Message::Hello(_)) = frames(&sent(&mut c)).pop() else {
        panic!("the connector answers the challenge with its hello")
    };
    let Message::Hello(mut fake) = our_kind_of_hello() else {
        unreachable!()
    };
    fake.role = Role::Prefill;
    fake.proof = [9; 32];
    let mut bytes = Vec::new();
    Message::Hello(fake).encode(&mut bytes);
    c.handle_input(Instant::now(), sc, &bytes);
    assert!(!established(&c, sc));
    assert!(events(&mut c).iter().any(|e| matches!(
        e,
        Event::SessionRejected {
            reason: RejectReason::BadToken,
            ..
        }
    )));
}

#[test]
fn a_hello_before_the_challenges_is_refused_at_once() {
    let mut l = endpoint(Role::Prefill, 2, TOKEN);
    let sl = l.accept_session(Instant::now());
    let mut bytes = Vec::new();
    our_kind_of_hello().encode(&mut bytes);
    l.handle_input(Instant::now(), sl, &bytes);
    let answer = frames(&sent(&mut l));
    assert!(
        matches!(
            answer.as_slice(),
            [Message::Error {
                code: ErrorCode::ProtocolViolation,
                ..
            }]
        ),
        "{answer:?}"
    );
    assert_ne!(l.session_state(sl), Some(SessionState::Handshaking));
}

/// A listener that has exchanged challenges with a connector whose nonce is `[1; 32]`, and
/// the listener's nonce.
fn challenged_listener() -> (Endpoint, SessionId, [u8; 32]) {
    let mut l = endpoint(Role::Prefill, 2, TOKEN);
    let sl = l.accept_session(Instant::now());
    let mut bytes = Vec::new();
    Message::Challenge { nonce: [1; 32] }.encode(&mut bytes);
    l.handle_input(Instant::now(), sl, &bytes);
    let nonce = match frames(&sent(&mut l)).as_slice() {
        [Message::Challenge { nonce }] => *nonce,
        other => panic!("{other:?}"),
    };
    (l, sl, nonce)
}

/// `proof_c` as `docs/PROTOCOL.md` defines it, written here from the doc: HMAC-SHA256 of
/// the label, both nonces and the hello frame with its proof bytes zero, placed in the frame.
fn sign_as_connector(frame: &mut [u8], token: &[u8], listener_nonce: &[u8; 32]) {
    use hmac::{Hmac, Mac};
    let at = kvferry_core::codec::HELLO_PROOF_OFFSET;
    if frame.len() < at + 32 {
        return; // no room for a proof
    }
    frame[at..at + 32].fill(0);
    let mut mac = <Hmac<sha2::Sha256> as Mac>::new_from_slice(token).unwrap();
    mac.update(b"kvferry/2 connector");
    mac.update(&[1; 32]);
    mac.update(listener_nonce);
    mac.update(frame);
    let proof = mac.finalize().into_bytes();
    frame[at..at + 32].copy_from_slice(&proof);
}

#[test]
fn an_impossible_hello_value_gets_an_error_naming_the_field_at_once() {
    let (mut l, sl, nonce) = challenged_listener();
    let mut bytes = Vec::new();
    our_kind_of_hello().encode(&mut bytes);
    bytes[27] = 3; // planes
    sign_as_connector(&mut bytes, TOKEN, &nonce);
    l.handle_input(Instant::now(), sl, &bytes);
    let answer = frames(&sent(&mut l));
    match answer.as_slice() {
        [Message::Error {
            code: ErrorCode::InvalidHello,
            detail,
        }] => assert!(detail.contains("planes"), "{detail}"),
        other => panic!("{other:?}"),
    }
    assert_ne!(l.session_state(sl), Some(SessionState::Handshaking));
}

/// `docs/PROTOCOL.md`: a decode's layer range and `writes_aux` are unused by prefill but
/// checked like every hello field, with the detail the doc gives.
#[test]
fn a_decodes_impossible_layer_fields_get_the_invalid_hello_the_doc_states() {
    let doc = include_str!("../../docs/PROTOCOL.md")
        .split_whitespace()
        .collect::<Vec<_>>()
        .join(" ");
    let layers = small_layout(64).layers;
    for (what, patch, detail) in [
        (
            "layer_end past layers",
            0usize,
            "hello: invalid layer range",
        ),
        ("an empty range", 1, "hello: invalid layer range"),
        ("writes_aux 2", 2, "hello: invalid writes_aux"),
    ] {
        let (mut l, sl, nonce) = challenged_listener();
        let mut bytes = Vec::new();
        our_kind_of_hello().encode(&mut bytes);
        // Frame offsets of layer_start, layer_end and writes_aux (the Hello table, after the
        // 6-byte header).
        let (start, end, aux) = (6 + 42, 6 + 44, 6 + 46);
        match patch {
            0 => bytes[end..end + 2].copy_from_slice(&(layers + 1).to_le_bytes()),
            1 => bytes[start..start + 2].copy_from_slice(&layers.to_le_bytes()),
            _ => bytes[aux] = 2,
        }
        sign_as_connector(&mut bytes, TOKEN, &nonce);
        l.handle_input(Instant::now(), sl, &bytes);
        match frames(&sent(&mut l)).as_slice() {
            [Message::Error {
                code: ErrorCode::InvalidHello,
                detail: got,
            }] => assert_eq!(got, detail, "{what}"),
            other => panic!("{what}: {other:?}"),
        }
        assert!(
            doc.contains(&format!("\"{detail}\"")),
            "{detail} in the doc"
        );
    }
}

#[test]
fn a_wrong_proof_gets_the_same_refusal_whatever_else_the_hello_holds() {
    let hello = || {
        let mut bytes = Vec::new();
        our_kind_of_hello().encode(&mut bytes);
        bytes
    };
    let valid = hello();
    let mut no_layers = hello();
    no_layers[25..27].fill(0);
    let mut bad_planes = hello();
    bad_planes[27] = 3;
    let mut trailing = hello();
    trailing.push(0);
    let len = (trailing.len() - 4) as u32;
    trailing[..4].copy_from_slice(&len.to_le_bytes());
    let mut wrong_role = hello();
    wrong_role[6] = 1;
    let mut short = hello();
    short.truncate(60);
    short[..4].copy_from_slice(&56u32.to_le_bytes());
    let mut answers = Vec::new();
    for (what, mut frame) in [
        ("valid", valid),
        ("layers 0", no_layers),
        ("planes 3", bad_planes),
        ("trailing byte", trailing),
        ("same role", wrong_role),
        ("too short for a proof", short),
    ] {
        let (mut l, sl, nonce) = challenged_listener();
        sign_as_connector(&mut frame, b"another token", &nonce);
        l.handle_input(Instant::now(), sl, &frame);
        let answer = frames(&sent(&mut l));
        assert!(
            matches!(
                answer.as_slice(),
                [Message::Error {
                    code: ErrorCode::BadToken,
                    ..
                }]
            ),
            "{what}: {answer:?}"
        );
        assert_ne!(l.session_state(sl), Some(SessionState::Handshaking));
        answers.push(answer);
    }
    assert!(answers.windows(2).all(|w| w[0] == w[1]), "{answers:?}");
}

#[test]
fn each_end_learns_the_others_heartbeats_and_both_use_the_longer_window() {
    let mut c = endpoint(Role::Decode, 1, TOKEN);
    let mut config = fast_config();
    config.heartbeat_interval = Duration::from_millis(400);
    config.heartbeat_misses = 5;
    let mut info = EndpointInfo::new(Role::Prefill, NodeId(2), Incarnation(20), small_layout(64));
    info.token = TOKEN.to_vec();
    let mut l = Endpoint::new(config, info, 2, Instant::now()).unwrap();
    let sc = c.open_session(Instant::now());
    let sl = l.accept_session(Instant::now());
    // Silence is counted from the handshake: the same instant as the checks below.
    let start = Instant::now();
    handshake_at(&mut c, sc, &mut l, sl, start);
    let peer = events(&mut c)
        .into_iter()
        .find_map(|e| match e {
            Event::SessionEstablished { peer, .. } => Some(peer),
            _ => None,
        })
        .unwrap();
    assert_eq!(peer.heartbeat_interval, Duration::from_millis(400));
    assert_eq!(peer.heartbeat_misses, 5);
    // The connector's own window is 250 ms × 3; the listener's 2 s is the one both use:
    // silent for 1.9 s, the session stands; at 2.1 s it is given up.
    for ms in (50..=1_900).step_by(50) {
        c.handle_timeout(start + Duration::from_millis(ms));
        let _ = sent(&mut c);
        assert!(established(&c, sc), "given up after {ms} ms of silence");
    }
    c.handle_timeout(start + Duration::from_millis(2_100));
    assert!(!established(&c, sc));
}

#[test]
fn a_data_connection_proves_its_session_key_and_a_replay_of_it_is_refused() {
    let mut c = endpoint(Role::Decode, 1, TOKEN);
    let mut l = endpoint(Role::Prefill, 2, TOKEN);
    let sc = c.open_session(Instant::now());
    let sl = l.accept_session(Instant::now());
    handshake(&mut c, sc, &mut l, sl);
    let key = c.data_key(sc).unwrap();
    let challenge = l.data_challenge();
    let proof = key.prove(&challenge);
    assert_eq!(l.admit_data(&challenge, &key.tag(), &proof), Ok(sl));
    // The same answer to the next connection's (fresh) challenge is a replay.
    let next = l.data_challenge();
    assert_ne!(next, challenge);
    assert_eq!(
        l.admit_data(&next, &key.tag(), &proof),
        Err(DataRefusal::BadProof)
    );
    assert_eq!(
        l.admit_data(&next, &[0; 16], &key.prove(&next)),
        Err(DataRefusal::UnknownSession)
    );
    // A key from another session (another token) proves nothing here.
    let mut other_c = endpoint(Role::Decode, 3, b"other");
    let mut other_l = endpoint(Role::Prefill, 4, b"other");
    let oc = other_c.open_session(Instant::now());
    let ol = other_l.accept_session(Instant::now());
    handshake(&mut other_c, oc, &mut other_l, ol);
    let foreign = other_c.data_key(oc).unwrap();
    assert_eq!(
        l.admit_data(&next, &foreign.tag(), &foreign.prove(&next)),
        Err(DataRefusal::UnknownSession)
    );
}
