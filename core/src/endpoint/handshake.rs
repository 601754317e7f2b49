//! Sessions: opening and accepting them, the challenges, proofs and hellos, refusals and strikes, and the control frames' dispatch.

use std::sync::Arc;
use std::time::{Duration, Instant};

use tracing::{info, warn};

use crate::api::{
    Capacity, DataRefusal, EndpointInfo, Event, PeerInfo, RejectReason, SessionState, SessionStats,
};
use crate::auth::{
    connector_proof, constant_time_eq, listener_proof, Nonce, Proof, SessionKey, SessionTag,
};
use crate::codec::{DecodeError, ErrorCode, Hello, Message, HELLO_TYPE};
use crate::ids::SessionId;
use crate::layout::{ExtraPool, LayoutMismatch};
use crate::state::{FailureReason, Role};
use crate::timer::Timer;

use super::data_dials::DataDials;
use super::liveness::Liveness;
use super::op_queue::OpQueue;
use super::probation::Probation;
use super::timers::SessionTimers;
use super::writer::Writer;
use super::{hello_transcript, Auth, Endpoint, HandshakeError, Session, Set};

impl Endpoint {
    /// This side opened a control connection to a peer: returns its session handle and
    /// queues our hello on it (the connector speaks first).
    pub fn open_session(&mut self, now: Instant) -> SessionId {
        let ours = self.nonces.fresh();
        let sid = self.new_session(now, Auth::ConnectorChallenged { ours });
        self.outbox
            .transmit(sid, Message::Challenge { nonce: ours });
        self.refuse_while_shutting_down(now, sid);
        sid
    }

    /// Our listener accepted a control connection: returns its session handle. We send our
    /// challenge once the connector sent its own, and our hello only once the connector's
    /// hello proved it knows the cluster token: before that a stranger learns nothing.
    pub fn accept_session(&mut self, now: Instant) -> SessionId {
        let sid = self.new_session(now, Auth::ListenerWaiting);
        self.refuse_while_shutting_down(now, sid);
        sid
    }

    /// A connection that became ours after the shutdown began (a dial or an accept already
    /// under way) is told so and closed at once: a node going away opens no session.
    fn refuse_while_shutting_down(&mut self, now: Instant, sid: SessionId) {
        if self.shutdown.begun() {
            self.close_for_shutdown(now, sid);
        }
    }

    /// Our hello, its proof still zero.
    pub(super) fn our_hello(&self) -> Hello {
        Hello {
            role: self.local.role,
            rank: self.local.rank,
            node: self.local.node,
            incarnation: self.local.incarnation,
            layout: self.local.layout,
            layer_start: self.local.layer_start,
            layer_end: self.local.layer_end,
            writes_aux: self.local.writes_aux,
            heads: self.local.heads,
            heartbeat_interval_ms: self
                .config
                .heartbeat_interval
                .as_millis()
                .clamp(1, u128::from(u32::MAX)) as u32,
            heartbeat_misses: self.config.heartbeat_misses.max(1),
            proof: [0; 32],
            checksum: self.config.checksum,
            extras: self.local.extras.clone(),
        }
    }

    /// The key binding data connections to `session`, once its handshake completed.
    pub fn data_key(&self, session: SessionId) -> Option<SessionKey> {
        match &self.sessions.get(&session)?.auth {
            Auth::Done(key) => Some(key.clone()),
            _ => None,
        }
    }

    /// A fresh challenge for a data connection our listener accepted.
    pub fn data_challenge(&mut self) -> Nonce {
        self.nonces.fresh()
    }

    /// Admits a data connection that answered `challenge` with `proof` for the session named
    /// by `tag`: the session it belongs to, if that session is usable and the proof is right.
    pub fn admit_data(
        &self,
        challenge: &Nonce,
        tag: &SessionTag,
        proof: &Proof,
    ) -> Result<SessionId, DataRefusal> {
        let (sid, key) = self
            .sessions
            .iter()
            .find_map(|(sid, s)| match &s.auth {
                Auth::Done(key) if key.tag() == *tag => Some((*sid, key)),
                _ => None,
            })
            .ok_or(DataRefusal::UnknownSession)?;
        if !key.verify(challenge, proof) {
            return Err(DataRefusal::BadProof);
        }
        match self.sessions.get(&sid).map(|s| s.state) {
            Some(SessionState::Established | SessionState::Blacklisted) => Ok(sid),
            _ => Err(DataRefusal::SessionEnded),
        }
    }

    pub(super) fn new_session(&mut self, now: Instant, auth: Auth) -> SessionId {
        let inbound = matches!(auth, Auth::ListenerWaiting);
        let now = self.clock(now);
        let sid = self.sessions.next_id();
        let mut session = Session {
            state: SessionState::Handshaking,
            peer: None,
            extra_copies: Arc::default(),
            liveness: Liveness::new(
                now,
                self.config.heartbeat_interval * self.config.heartbeat_misses,
                self.config.silence_timeout,
            ),
            probation: Probation::new(self.config.probe_interval),
            timers: SessionTimers::default(),
            inbound,
            auth,
            data_lost: 0,
            data_dials: DataDials::new(
                now,
                self.config.connect_timeout,
                self.config.handshake_timeout,
            ),
            resumes: None,
            handing_over: false,
            last_targeted: now,
            ops: OpQueue::default(),
            rooms: Set::with_hasher(self.hasher.clone()),
            strikes: 0,
            capacity: None,
            close_reason: FailureReason::ConnectionLost,
            stats: SessionStats::default(),
            target: None,
            epoch: 0,
            writer: Writer::default(),
        };
        self.timers.set(
            &mut session.timers.handshake,
            now + self.config.handshake_timeout,
            Timer::Handshake(sid),
        );
        self.sessions.insert(sid, session);
        sid
    }

    /// Bytes arrived on a session's control connection. Consumes every complete frame and
    /// returns how many bytes were used; the caller keeps the rest for the next call.
    ///
    /// Malformed frames earn the session a strike; a broken framing or too many strikes close
    /// it (the whole buffer is then reported as consumed).
    pub fn handle_input(&mut self, now: Instant, session: SessionId, buf: &[u8]) -> usize {
        let now = self.clock(now);
        if self.successions.is_superseded(session) {
            // Sent before the peer moved to the fresh connection; it sends again what counts.
            return buf.len();
        }
        let mut used = 0;
        loop {
            match self.sessions.get(&session).map(|s| s.state) {
                None | Some(SessionState::Closing) => return buf.len(),
                Some(_) => {}
            }
            if self.hello_proof_refused(session, &buf[used..]) {
                self.reject(session, RejectReason::BadToken);
                return buf.len();
            }
            match Message::decode(&buf[used..], self.config.max_frame_len) {
                Ok(None) => return used,
                Ok(Some((msg, n))) => {
                    used += n;
                    self.count_received(session);
                    self.handle_message(now, session, msg);
                }
                Err(err)
                    if self
                        .sessions
                        .get(&session)
                        .is_some_and(|s| s.peer.is_none()) =>
                {
                    // Nothing is skipped before the handshake completed: say what was wrong
                    // and close at once, rather than leave the peer to its handshake timeout.
                    let (code, what) = match err {
                        DecodeError::UnknownVersion(_) => {
                            self.reject(session, RejectReason::VersionMismatch);
                            return buf.len();
                        }
                        DecodeError::InvalidField { ty, field } if ty == HELLO_TYPE => {
                            (ErrorCode::InvalidHello, format!("hello: invalid {field}"))
                        }
                        other => (ErrorCode::Malformed, other.to_string()),
                    };
                    self.refuse_handshake(session, code, &what);
                    return buf.len();
                }
                Err(err) => {
                    if let DecodeError::InvalidRoomRequest {
                        room, generation, ..
                    } = err
                    {
                        self.on_unservable_request(now, session, room, generation);
                    }
                    let skippable = matches!(
                        err,
                        DecodeError::UnknownType(_)
                            | DecodeError::Truncated { .. }
                            | DecodeError::TrailingBytes { .. }
                            | DecodeError::InvalidField { .. }
                            | DecodeError::InvalidRoomRequest { .. }
                    );
                    self.strike(session, &err.to_string(), !skippable);
                    if !skippable {
                        return buf.len();
                    }
                    // The length prefix was sane: skip exactly this frame.
                    let len = buf[used..used + 4]
                        .try_into()
                        .map(u32::from_le_bytes)
                        .unwrap_or(0);
                    used += 4 + len as usize;
                    self.count_received(session);
                }
            }
        }
    }

    /// One more frame read from the session's connection (the count its heartbeats report).
    fn count_received(&mut self, sid: SessionId) {
        if let Some(s) = self.sessions.get_mut(&sid) {
            s.liveness.frame_received();
        }
    }

    pub(super) fn handle_message(&mut self, now: Instant, sid: SessionId, msg: Message) {
        let Some(s) = self.sessions.get_mut(&sid) else {
            return;
        };
        s.liveness.heard(now);
        let established = s.peer.is_some();
        if s.resumes.is_some() && !msg.is_handshake() {
            // The dialer uses the fresh connection: it took the work over on its side.
            self.commit_resume(sid);
        }
        match msg {
            Message::Challenge { nonce } => {
                if established {
                    self.strike(sid, "a challenge after the handshake", false);
                } else {
                    self.on_challenge(sid, nonce);
                }
            }
            Message::Hello(h) => {
                if established {
                    self.strike(sid, "second hello", false);
                } else {
                    self.on_hello(now, sid, h);
                }
            }
            // Also before the hello: a listener refuses a bad token without saying who it is.
            Message::Error { code, detail } => {
                if code == ErrorCode::Shutdown {
                    info!(session = %sid, %detail, "peer is closing the session");
                } else {
                    warn!(session = %sid, ?code, %detail, "peer reported an error");
                }
                self.outbox.event(Event::PeerError {
                    session: sid,
                    code,
                    detail: detail.clone(),
                });
                let reason = code.failure_reason();
                if let Some(s) = self.sessions.get_mut(&sid) {
                    s.close_reason = reason;
                    // The peer's core stopped handing out this session's operations before
                    // it sent this: a writer that copies inline has nothing left landing.
                    s.writer.stopped();
                }
                self.fail_session_rooms(now, sid, reason);
                self.request_close(sid);
            }
            other if !established => {
                let what = format!("{} before the handshake completed", other.name());
                self.refuse_handshake(sid, ErrorCode::ProtocolViolation, &what);
            }
            Message::Heartbeat {
                free_pages,
                queued_rooms,
                frames_received,
            } => {
                if let Some(s) = self.sessions.get_mut(&sid) {
                    s.capacity = Some(Capacity {
                        free_pages,
                        queued_rooms,
                    });
                    s.liveness.confirmed(frames_received, now);
                }
            }
            Message::Probe { nonce } => self.outbox.transmit(sid, Message::ProbeAck { nonce }),
            Message::Transport { payload } => {
                self.outbox.event(Event::TransportReceived {
                    session: sid,
                    payload,
                });
            }
            Message::ProbeAck { nonce } => self.on_probe_ack(now, sid, nonce),
            Message::RoomPending {
                room,
                generation,
                queue_position,
            } if self.local.role == Role::Prefill => {
                self.on_room_pending(now, sid, room, generation, queue_position)
            }
            Message::RoomRequest(req) if self.local.role == Role::Prefill => {
                self.on_room_request(now, sid, req)
            }
            Message::Abort {
                room,
                generation,
                reason,
            } if self.local.role == Role::Prefill => {
                self.on_abort(now, sid, room, generation, reason)
            }
            Message::RoomStatus {
                room,
                generation,
                failure,
            } if self.local.role == Role::Decode => {
                self.on_room_status(now, sid, room, generation, failure)
            }
            Message::Progress {
                room,
                generation,
                stage,
            } if self.local.role == Role::Decode => {
                self.on_progress(now, sid, room, generation, stage)
            }
            Message::AbortAck { room, generation } if self.local.role == Role::Decode => {
                self.on_abort_ack(now, sid, room, generation)
            }
            Message::OpChecksum {
                room,
                generation,
                checksum,
                ranges,
            } if self.local.role == Role::Decode => {
                self.on_op_checksum(now, sid, room, generation, checksum, &ranges)
            }
            other => {
                let role = match self.local.role {
                    Role::Prefill => "prefill",
                    Role::Decode => "decode",
                };
                let what = format!("{} sent to a {role} endpoint", other.name());
                self.strike(sid, &what, false);
            }
        }
    }

    /// The peer's challenge: a listener answers with its own, a connector with its hello.
    pub(super) fn on_challenge(&mut self, sid: SessionId, theirs: Nonce) {
        let Some(s) = self.sessions.get(&sid) else {
            return;
        };
        match s.auth {
            Auth::ListenerWaiting => {
                let ours = self.nonces.fresh();
                if let Some(s) = self.sessions.get_mut(&sid) {
                    s.auth = Auth::ListenerChallenged { theirs, ours };
                }
                self.outbox
                    .transmit(sid, Message::Challenge { nonce: ours });
            }
            Auth::ConnectorChallenged { ours } => {
                let mut hello = self.our_hello();
                let transcript = hello_transcript(&hello);
                hello.proof = connector_proof(&self.local.token, &ours, &theirs, &transcript);
                if let Some(s) = self.sessions.get_mut(&sid) {
                    s.auth = Auth::ConnectorHello {
                        ours,
                        theirs,
                        hello: transcript,
                    };
                }
                self.outbox.transmit(sid, Message::Hello(hello));
            }
            Auth::ListenerChallenged { theirs: seen, .. }
            | Auth::ConnectorHello { theirs: seen, .. }
                if seen == theirs =>
            {
                // The same challenge again: harmless, but not what a peer should send.
                self.strike(sid, "a repeated challenge", false)
            }
            _ => self.refuse_handshake(sid, ErrorCode::ProtocolViolation, "a second challenge"),
        }
    }

    /// Closes a session whose handshake broke a rule, saying which, at once.
    pub(super) fn refuse_handshake(&mut self, sid: SessionId, code: ErrorCode, what: &str) {
        self.counters.protocol_errors += 1;
        warn!(session = %sid, ?code, %what, "handshake refused");
        let now = self.last_now;
        self.close_session(now, sid, code, what, FailureReason::ProtocolError);
    }

    /// Whether `buf` starts with a complete hello, on a session awaiting one, whose proof
    /// does not check out. It is read from the raw frame (the transcript is the frame with
    /// its proof zeroed) before any other field, so a peer without the token gets the same
    /// refusal whatever else its hello holds; a frame too short to hold a proof is refused
    /// too. Anything else is left to the decoder.
    fn hello_proof_refused(&self, sid: SessionId, buf: &[u8]) -> bool {
        let awaiting = self.sessions.get(&sid).is_some_and(|s| {
            matches!(
                s.auth,
                Auth::ListenerChallenged { .. } | Auth::ConnectorHello { .. }
            )
        });
        let Some(len) = buf
            .get(..4)
            .and_then(|b| b.try_into().ok())
            .map(u32::from_le_bytes)
        else {
            return false;
        };
        if !awaiting || len < 2 || len > self.config.max_frame_len {
            return false;
        }
        let Some(frame) = buf.get(..4 + len as usize) else {
            return false;
        };
        if frame[4] != crate::codec::PROTOCOL_VERSION || frame[5] != HELLO_TYPE {
            return false;
        }
        let at = crate::codec::HELLO_PROOF_OFFSET;
        let Some(proof) = frame.get(at..at + crate::auth::PROOF_LEN) else {
            return true;
        };
        let mut transcript = frame.to_vec();
        transcript[at..at + crate::auth::PROOF_LEN].fill(0);
        self.expected_proof(sid, &transcript)
            .is_ok_and(|want| !constant_time_eq(&want, proof))
    }

    /// The proof the peer's hello must carry, from its transcript (the hello frame as sent,
    /// proof bytes zero).
    fn expected_proof(&self, sid: SessionId, theirs: &[u8]) -> Result<Proof, HandshakeError> {
        let token = &self.local.token;
        let Some(s) = self.sessions.get(&sid) else {
            return Err(HandshakeError::Refused(RejectReason::BadToken));
        };
        match &s.auth {
            Auth::ListenerChallenged { theirs: c, ours: l } => {
                Ok(connector_proof(token, c, l, theirs))
            }
            Auth::ConnectorHello {
                ours: c,
                theirs: l,
                hello,
            } => Ok(listener_proof(token, c, l, hello, theirs)),
            Auth::ListenerWaiting | Auth::ConnectorChallenged { .. } | Auth::Done(_) => {
                Err(HandshakeError::OutOfOrder)
            }
        }
    }

    /// Checks the peer's proof of the cluster token: the session's key and, on a listener,
    /// the hello to answer with (sent only once every other check passed too).
    pub(super) fn authenticate(
        &self,
        sid: SessionId,
        h: &Hello,
    ) -> Result<(SessionKey, Option<Hello>), HandshakeError> {
        let token = &self.local.token;
        let theirs = hello_transcript(h);
        if !constant_time_eq(&self.expected_proof(sid, &theirs)?, &h.proof) {
            return Err(HandshakeError::Refused(RejectReason::BadToken));
        }
        match self.sessions.get(&sid).map(|s| &s.auth) {
            Some(Auth::ListenerChallenged { theirs: c, ours: l }) => {
                let mut ours = self.our_hello();
                ours.proof = listener_proof(token, c, l, &theirs, &hello_transcript(&ours));
                Ok((SessionKey::derive(token, c, l), Some(ours)))
            }
            Some(Auth::ConnectorHello {
                ours: c, theirs: l, ..
            }) => Ok((SessionKey::derive(token, c, l), None)),
            _ => Err(HandshakeError::OutOfOrder),
        }
    }

    pub(super) fn on_hello(&mut self, now: Instant, sid: SessionId, h: Hello) {
        let checked = self.check_hello(sid, &h);
        let (key, reply) = match checked {
            Ok(auth) => auth,
            Err(HandshakeError::OutOfOrder) => {
                return self.refuse_handshake(
                    sid,
                    ErrorCode::ProtocolViolation,
                    "a hello before the challenges were exchanged",
                )
            }
            Err(HandshakeError::Refused(r)) => return self.reject(sid, r),
        };
        let inbound = match self.sessions.get_mut(&sid) {
            Some(s) => {
                s.auth = Auth::Done(key);
                s.inbound
            }
            None => return,
        };
        if let Some(hello) = reply {
            self.outbox.transmit(sid, Message::Hello(hello));
        }
        let peer = PeerInfo {
            role: h.role,
            rank: h.rank,
            node: h.node,
            incarnation: h.incarnation,
            layout: h.layout,
            layer_start: h.layer_start,
            layer_end: h.layer_end,
            writes_aux: h.writes_aux,
            heads: h.heads,
            heartbeat_interval: Duration::from_millis(u64::from(h.heartbeat_interval_ms)),
            heartbeat_misses: h.heartbeat_misses,
        };
        let (mut resumed_from, was_blacklisted) = self.meet_known_peer(now, sid, &h);
        let pending_resume = resumed_from.filter(|_| inbound);
        if pending_resume.is_some() {
            resumed_from = None;
        } else {
            self.sessions.set_node(h.node, sid);
        }
        let remembered = self.sessions.take_blacklist(h.node);
        let interval = self.config.heartbeat_interval;
        // Both ends give up on a silent session at the same moment: the longer of the two
        // announced liveness windows. Link checks wait out at least two of its heartbeats.
        let window = (interval * self.config.heartbeat_misses)
            .max(peer.heartbeat_interval * peer.heartbeat_misses);
        let silence = self.config.silence_timeout.max(peer.heartbeat_interval * 2);
        // Which side's items are the source is fixed by the roles: the prefill's go to the
        // decode's.
        let copies = Arc::new(if self.local.role == Role::Prefill {
            ExtraPool::copies(&self.local.extras, &h.extras)
        } else {
            ExtraPool::copies(&h.extras, &self.local.extras)
        });
        let Some(s) = self.sessions.get_mut(&sid) else {
            return;
        };
        s.peer = Some(peer);
        s.extra_copies = Arc::clone(&copies);
        self.grants.add_session(sid, peer, s.epoch, copies);
        s.liveness.agree(window, silence);
        s.data_dials.established(now);
        s.state = SessionState::Established;
        s.resumes = pending_resume;
        if let Some(o) = pending_resume.and_then(|o| self.sessions.get_mut(&o)) {
            o.handing_over = true;
        }
        let Some(s) = self.sessions.get_mut(&sid) else {
            return;
        };
        self.timers.cancel(&mut s.timers.handshake);
        self.timers.set(
            &mut s.timers.heartbeat,
            now + interval,
            Timer::Heartbeat(sid),
        );
        self.timers
            .set(&mut s.timers.liveness, now + window, Timer::Liveness(sid));
        self.timers
            .set(&mut s.timers.silence, now + silence, Timer::Silence(sid));
        let target = s.target;
        // Room messages queued for it while it handshook would leave behind our Hello (queued
        // just before this): they go, and `replay` below says where those rooms stand now.
        self.outbox.drop_room_messages(sid);
        if let Some(old) = resumed_from {
            self.take_over(h.node, old, sid);
        }
        self.outbox
            .event(Event::SessionEstablished { session: sid, peer });
        let link_timeout = self
            .sessions
            .get(&sid)
            .map_or(self.config.connect_timeout, |s| s.data_dials.timeout());
        if let Some(t) = target.and_then(|t| self.targets.get_mut(&t)) {
            t.established(sid, &self.config, link_timeout, &mut self.timers);
        }
        if resumed_from.is_none() {
            // Rooms opened on it while it was still handshaking (their messages were held
            // back) hear where they stand now; the target's waiting rooms attach just below.
            self.replay(sid);
        }
        if let Some(t) = target {
            self.target_up(now, t);
        }
        if resumed_from.is_some() {
            self.replay(sid);
        }
        let remembered =
            remembered.is_some_and(|m| m.incarnation == h.incarnation && m.until > now);
        if was_blacklisted || remembered {
            // Same process reconnected: its blacklist stands until a probe succeeds.
            self.blacklist(now, sid);
        }
    }

    /// The hello's proof, then its role and layout against ours: the session key and the
    /// hello to answer with, or why the peer is refused. Who we are and what we expect is
    /// told only to a peer that knows the token.
    fn check_hello(
        &mut self,
        sid: SessionId,
        h: &Hello,
    ) -> Result<(SessionKey, Option<Hello>), HandshakeError> {
        self.authenticate(sid, h).and_then(|auth| {
            if h.role == self.local.role {
                return Err(HandshakeError::Refused(RejectReason::WrongRole));
            }
            let (ours, theirs) = (&self.local, h);
            let checked = ours
                .layout
                .compatible(&theirs.layout)
                .and_then(|()| {
                    ours.heads
                        .compatible(&ours.layout, &theirs.heads, &theirs.layout)
                })
                .and_then(|()| ExtraPool::compatible(&ours.extras, &theirs.extras))
                .and_then(|()| {
                    LayoutMismatch::first(&[(
                        "checksum",
                        u64::from(self.config.checksum),
                        u64::from(theirs.checksum),
                    )])
                })
                .and_then(|()| extras_whole_heads(ours, theirs));
            if let Err(m) = checked {
                return Err(HandshakeError::Refused(RejectReason::IncompatibleLayout(m)));
            }
            Ok(auth)
        })
    }

    /// A hello from a node this endpoint already has a session with (`sid` being a fresh
    /// one): the old session of the same incarnation is to be taken over (returned), one of
    /// a previous incarnation is closed as restarted, and one blacklisted or closing is
    /// closed (whether it was blacklisted is returned: the blacklist stands).
    fn meet_known_peer(
        &mut self,
        now: Instant,
        sid: SessionId,
        h: &Hello,
    ) -> (Option<SessionId>, bool) {
        // A known peer: a new incarnation voids its previous life; the same one on a fresh
        // connection takes the old session's work over (the old link went silent).
        let mut resumed_from = None;
        let mut was_blacklisted = false;
        if let Some(old) = self.sessions.of_node(h.node) {
            if old != sid {
                let (old_inc, old_state) = self
                    .sessions
                    .get(&old)
                    .map(|s| (s.peer.map(|p| p.incarnation), Some(s.state)))
                    .unwrap_or((None, None));
                if old_inc == Some(h.incarnation)
                    && old_state == Some(SessionState::Established)
                    && !self.successions.is_superseded(old)
                {
                    resumed_from = Some(old);
                } else if old_inc != Some(h.incarnation) {
                    info!(node = %h.node, old = %old, new = %sid, "peer restarted");
                    self.outbox.event(Event::PeerRestarted {
                        node: h.node,
                        old,
                        new: sid,
                    });
                    self.close_session(
                        now,
                        old,
                        ErrorCode::Shutdown,
                        "superseded by a new incarnation",
                        FailureReason::PeerRestarted,
                    );
                } else {
                    // Blacklisted (its rooms failed already) or closing: the new session
                    // starts clean, except that a blacklist stands until a probe succeeds.
                    was_blacklisted = old_state == Some(SessionState::Blacklisted);
                    self.close_session(
                        now,
                        old,
                        ErrorCode::Shutdown,
                        "superseded by a new connection",
                        FailureReason::ConnectionLost,
                    );
                }
            }
        }
        (resumed_from, was_blacklisted)
    }

    pub(super) fn reject(&mut self, sid: SessionId, reason: RejectReason) {
        warn!(session = %sid, ?reason, "peer refused at handshake");
        self.counters.sessions_rejected += 1;
        self.outbox.event(Event::SessionRejected {
            session: sid,
            reason,
        });
        let (code, detail) = match reason {
            RejectReason::BadToken => (
                ErrorCode::BadToken,
                "cluster token mismatch (the proof of the token did not check out)".to_owned(),
            ),
            RejectReason::WrongRole => (ErrorCode::WrongRole, "same role on both ends".to_owned()),
            RejectReason::IncompatibleLayout(m) => (ErrorCode::IncompatibleLayout, m.to_string()),
            RejectReason::VersionMismatch => (
                ErrorCode::VersionMismatch,
                format!(
                    "protocol version differs (this node speaks version {})",
                    crate::codec::PROTOCOL_VERSION
                ),
            ),
        };
        let now = self.last_now;
        self.close_session(now, sid, code, &detail, reason.failure_reason());
    }

    pub(super) fn strike(&mut self, sid: SessionId, what: &str, fatal: bool) {
        self.counters.protocol_errors += 1;
        let limit = self.config.protocol_strikes;
        let Some(s) = self.sessions.get_mut(&sid) else {
            return;
        };
        s.strikes += 1;
        warn!(session = %sid, strikes = s.strikes, %what, "protocol error from peer");
        if fatal || s.strikes >= limit {
            let now = self.last_now;
            let code = if fatal {
                ErrorCode::Malformed
            } else {
                ErrorCode::ProtocolViolation
            };
            self.close_session(now, sid, code, what, FailureReason::ProtocolError);
        }
    }
}

/// Peers that hold different KV heads hold different shares of their extra pools' items
/// too: they exchange them only when both split every tensor into parts
/// ([`ExtraPool::compatible`] checked the parts agree), never item for item.
fn extras_whole_heads(ours: &EndpointInfo, theirs: &Hello) -> Result<(), LayoutMismatch> {
    let (a, b) = (ours.heads, theirs.heads);
    let split = ExtraPool::all_split(&ours.extras) && ExtraPool::all_split(&theirs.extras);
    if ours.extras.is_empty() || a == b || split {
        return Ok(());
    }
    let (field, ours, theirs) = if a.count != b.count {
        ("heads_count_with_extra_pools", a.count, b.count)
    } else {
        ("heads_start_with_extra_pools", a.start, b.start)
    };
    Err(LayoutMismatch {
        field,
        ours: u64::from(ours),
        theirs: u64::from(theirs),
    })
}
