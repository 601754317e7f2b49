//! Deadlines: every timer the endpoint arms, and what its expiry does.

use super::*;

impl Endpoint {
    /// Processes every deadline due at `now`.
    pub fn handle_timeout(&mut self, now: Instant) {
        let now = self.clock(now);
        while let Some((key, timer)) = self.timers.pop_due(now) {
            self.on_timer(now, key, timer);
        }
    }

    pub(super) fn on_timer(&mut self, now: Instant, key: TimerKey, timer: Timer) {
        match timer {
            Timer::Bootstrap(room) => {
                let Some(r) = self.rooms.get_mut(&room) else {
                    return;
                };
                if !fired(&mut r.bootstrap_timer, key) {
                    return;
                }
                if r.state != KvPoll::Bootstrapping {
                    return;
                }
                let saturated = match &r.side {
                    Side::Sender(s) => {
                        s.saturated
                            || s.announced_by.iter().any(|sid| {
                                self.sessions
                                    .get(sid)
                                    .and_then(|x| x.capacity)
                                    .is_some_and(|c| c.saturated())
                            })
                    }
                    Side::Receiver(rr) => rr.queue_position > 0,
                };
                let down_target = match &r.side {
                    Side::Receiver(rr) => rr.waiting_for.iter().find_map(|l| match *l {
                        Link::Target(t) => Some(t),
                        Link::Session(_) => None,
                    }),
                    Side::Sender(_) => None,
                };
                let reason = if let Some(t) = down_target {
                    // Still waiting for a target's session: that is why it never bootstrapped.
                    self.unreachable_reason(t)
                } else if saturated {
                    FailureReason::DecodeSaturated
                } else {
                    FailureReason::BootstrapTimeout
                };
                info!(%room, %reason, "room bootstrap deadline expired");
                self.conclude(now, room, KvPoll::Failed(reason));
            }
            Timer::Waiting(room) => {
                let Some(r) = self.rooms.get_mut(&room) else {
                    return;
                };
                if !fired(&mut r.waiting_timer, key) {
                    return;
                }
                if r.state.is_terminal() {
                    return;
                }
                let due = r.last_activity + self.config.waiting_timeout;
                if due > now {
                    self.timers
                        .set(&mut r.waiting_timer, due, Timer::Waiting(room));
                    return;
                }
                info!(%room, "room waiting deadline expired");
                self.conclude(now, room, KvPoll::Failed(FailureReason::WaitingTimeout));
            }
            Timer::AbortAck(room) => {
                let Some(r) = self.rooms.get_mut(&room) else {
                    return;
                };
                if !fired(&mut r.abort_timer, key) {
                    return;
                }
                let Side::Receiver(rr) = &r.side else { return };
                let undrained: SmallVec<[SessionId; 2]> = rr
                    .sources
                    .iter()
                    .filter(|s| (s.granted && !s.drained && !s.done) || !s.pending.is_empty())
                    .map(|s| s.session)
                    .collect();
                for sid in undrained {
                    warn!(%room, session = %sid, "no drain acknowledgement in time, fencing the session");
                    self.fence(sid);
                }
            }
            Timer::Operation(id) => {
                let Some(op) = self.ops.get_mut(&id) else {
                    return;
                };
                if op.timer != Some(key) || op.phase != OpPhase::InFlight {
                    return;
                }
                op.timer = None;
                let session = op.session;
                if op.superseded {
                    // It hangs on a connection already replaced: the new one is not at fault.
                    self.settle_attempt(now, id, TransferOutcome::Transient);
                    return;
                }
                warn!(%session, room = ?op.room, "transfer attempt timed out; fencing the session");
                // The attempt may still be writing: fence before anything else is sent.
                self.fence(session);
                self.settle_attempt(now, id, TransferOutcome::Transient);
            }
            Timer::Retry(id) => {
                let Some(op) = self.ops.get_mut(&id) else {
                    return;
                };
                if op.timer != Some(key) || op.phase != OpPhase::RetryWait {
                    return;
                }
                op.timer = None;
                op.phase = OpPhase::Queued;
                let session = op.session;
                if let Some(s) = self.sessions.get_mut(&session) {
                    s.queue.push_front(id);
                }
                self.mark_ready(session);
            }
            Timer::Handshake(sid) => {
                let Some(s) = self.sessions.get_mut(&sid) else {
                    return;
                };
                if !fired(&mut s.handshake_timer, key) {
                    return;
                }
                if s.state == SessionState::Handshaking {
                    let target = s.target;
                    if let Some(t) = target.and_then(|t| self.targets.get_mut(&t)) {
                        // The connection was taken and nothing answered: the process is stuck.
                        t.evidence = Some(LinkEvidence::Silent);
                        if t.check == Some(sid) {
                            // A link check given up: close it quietly (no error that a late
                            // delivery could turn against the session it was checking).
                            self.request_close(sid);
                            return;
                        }
                    }
                    self.close_session(
                        now,
                        sid,
                        ErrorCode::HandshakeTimeout,
                        "no hello in time",
                        FailureReason::PeerSilent,
                    );
                }
            }
            Timer::Heartbeat(sid) => self.on_heartbeat_timer(now, sid, key),
            Timer::Reconnect(target) => {
                let Some(t) = self.targets.get_mut(&target) else {
                    return;
                };
                if !fired(&mut t.timer, key) {
                    return;
                }
                let dialing = t.dial.is_some();
                if dialing || self.target_session(target).is_some() {
                    debug!(%target, dialing, "reconnect timer: no dial");
                    return;
                }
                self.dial(target);
            }
            Timer::Silence(sid) => self.on_silence_timer(now, sid, key),
            Timer::DataReconnect(sid) => {
                let Some(s) = self.sessions.get_mut(&sid) else {
                    return;
                };
                if !fired(&mut s.data_timer, key) {
                    return;
                }
                let live = matches!(
                    s.state,
                    SessionState::Established | SessionState::Blacklisted
                );
                let n = std::mem::take(&mut s.data_lost);
                if live && !s.fencing {
                    for _ in 0..n {
                        self.actions.push_back(Action::OpenDataConnection(sid));
                    }
                }
            }
            Timer::Accepted(conn) => self.on_accepted_timer(conn, key),
            Timer::AcceptBackoff => self.on_accept_backoff_timer(key),
            Timer::Dial(dial) => self.on_dial_timer(now, dial, key),
            Timer::Drain(drain) => self.on_drain_timer(drain, key),
            Timer::Linger(sid) => {
                let Some(s) = self.sessions.get_mut(&sid) else {
                    return;
                };
                if fired(&mut s.linger_timer, key) && s.state == SessionState::Closing {
                    debug!(session = %sid, "close linger over; stopping the control writer");
                    self.actions.push_back(Action::StopLingering(sid));
                }
            }
            Timer::WriterQuarantine(sid) => {
                let Some(q) = self.writer_quarantines.get_mut(&sid) else {
                    return;
                };
                if !fired(&mut q.timer, key) {
                    return;
                }
                if let Some(q) = self.writer_quarantines.remove(&sid) {
                    debug!(session = %sid, "the writer's liveness window passed: its rooms' pages go back");
                    self.sources_drained(now, sid, q.rooms);
                }
            }
            Timer::Fence(sid) => {
                let Some(s) = self.sessions.get_mut(&sid) else {
                    return;
                };
                if fired(&mut s.fence_timer, key) && s.fencing && s.state != SessionState::Closing {
                    warn!(session = %sid, "the data path did not confirm a fence in time; closing the session");
                    self.counters.fence_timeouts += 1;
                    self.close_session(
                        now,
                        sid,
                        ErrorCode::FenceTimeout,
                        "fence not confirmed in time",
                        FailureReason::TransferFailed,
                    );
                }
            }
            Timer::Shutdown => {
                if fired(&mut self.shutdown_timer, key) {
                    self.finish_shutdown();
                }
            }
            Timer::TargetIdle(target) => {
                let Some(t) = self.targets.get_mut(&target) else {
                    return;
                };
                if fired(&mut t.idle_timer, key) {
                    self.on_target_idle(now, target);
                }
            }
            Timer::Unreachable(target) => {
                let Some(t) = self.targets.get_mut(&target) else {
                    return;
                };
                if !fired(&mut t.unreachable_timer, key) {
                    return;
                }
                t.unreachable_reported = true;
                let waiting = std::mem::take(&mut t.waiting);
                let reason = self.unreachable_reason(target);
                self.events
                    .push_back(Event::TargetUnreachable { target, reason });
                if !waiting.is_empty() {
                    warn!(%target, rooms = waiting.len(), %reason, "peer unreachable for the whole window, failing the rooms waiting for it");
                }
                for room in waiting {
                    let still = self.rooms.get(&room).is_some_and(|r| {
                        matches!(&r.side, Side::Receiver(rr) if rr.waiting_for.contains(&Link::Target(target)))
                    });
                    if still {
                        self.conclude(now, room, KvPoll::Failed(reason));
                    }
                }
            }
            Timer::Liveness(sid) => {
                let Some(s) = self.sessions.get_mut(&sid) else {
                    return;
                };
                let window = s.window;
                if !fired(&mut s.liveness_timer, key) {
                    return;
                }
                let due = s.last_rx + window;
                if due > now {
                    self.timers
                        .set(&mut s.liveness_timer, due, Timer::Liveness(sid));
                    return;
                }
                // What fresh connections found during the silence names the cause; without
                // any (a listener cannot dial), the peer is silent.
                if self.hand_over_before_end(sid) {
                    return;
                }
                let Some(s) = self.sessions.get_mut(&sid) else {
                    return;
                };
                let evidence = s
                    .target
                    .filter(|_| !self.successions.is_superseded(sid))
                    .and_then(|t| self.targets.get(&t))
                    .and_then(|t| t.evidence);
                // Without a link check (the accepting side never dials) the peer is silent.
                let reason = evidence.map_or(FailureReason::PeerSilent, LinkEvidence::reason);
                warn!(session = %sid, %reason, "peer silent for the whole liveness window");
                self.close_session(
                    now,
                    sid,
                    ErrorCode::HeartbeatsMissed,
                    "heartbeats missed",
                    reason,
                );
            }
            Timer::Probe(sid) => {
                let Some(s) = self.sessions.get_mut(&sid) else {
                    return;
                };
                if !fired(&mut s.probe_timer, key) {
                    return;
                }
                if s.state != SessionState::Blacklisted || s.probe_op.is_some() {
                    return;
                }
                self.counters.probes_sent += 1;
                let slices: Arc<[Slice]> = Arc::from(vec![Slice::run(Region::Scratch, 0, 0, 8)]);
                let id = self.alloc_op_id();
                self.ops.insert(
                    id,
                    Op {
                        session: sid,
                        room: None,
                        generation: 0,
                        kind: OpKind::Probe,
                        slices,
                        layers: 0..0,
                        bytes: 8,
                        attempt: 1,
                        flushes: 0,
                        phase: OpPhase::Queued,
                        timer: None,
                        superseded: false,
                        source_checksum: None,
                    },
                );
                if let Some(s) = self.sessions.get_mut(&sid) {
                    s.probe_op = Some(id);
                    s.queue.push_front(id);
                }
                self.mark_ready(sid);
            }
            Timer::BlacklistIdle(sid) => {
                let idle = self.config.blacklist_idle_timeout;
                let Some(s) = self.sessions.get_mut(&sid) else {
                    return;
                };
                if !fired(&mut s.idle_timer, key) {
                    return;
                }
                if s.state != SessionState::Blacklisted {
                    return;
                }
                let due = s.last_targeted + idle;
                if due > now {
                    self.timers
                        .set(&mut s.idle_timer, due, Timer::BlacklistIdle(sid));
                    return;
                }
                info!(session = %sid, "blacklisted session idle, forgetting it");
                self.counters.sessions_expired += 1;
                self.events
                    .push_back(Event::SessionExpired { session: sid });
                // Expiry forgets the blacklist: do not carry it into a reconnect.
                if let Some(s) = self.sessions.get_mut(&sid) {
                    s.state = SessionState::Established;
                }
                self.close_session(
                    now,
                    sid,
                    ErrorCode::Shutdown,
                    "idle blacklisted session",
                    FailureReason::SessionBlacklisted,
                );
            }
        }
    }
}

/// Whether the timer that fired under `key` is still the one `slot` holds (not re-armed or
/// cancelled since); if so the slot is cleared, since that timer is spent.
pub(super) fn fired(slot: &mut Option<TimerKey>, key: TimerKey) -> bool {
    if *slot != Some(key) {
        return false;
    }
    *slot = None;
    true
}
