//! A fresh session of a peer taking a silent one's work over: who inherits, the resume, the
//! hand-over before the old one ends, and the replay of what was in flight.

use tracing::info;

use crate::api::{Event, Link, SessionState};
use crate::codec::Message;
use crate::ids::{NodeId, RoomId, SessionId};

use super::{Endpoint, Side};

impl Endpoint {
    /// The live session that carries `session`'s work: itself, or the one that took it over.
    pub(super) fn heir(&self, session: SessionId) -> SessionId {
        self.successions.heir(session)
    }

    /// A fresh connection of the same peer process takes over the work of `old`, whose link
    /// went silent: rooms, operations and failure count move to `new`, and nothing fails.
    /// Operations in flight on the old connection run again on the new one once their old
    /// attempt reports. The dialing side takes over when the peer's hello arrives and closes
    /// the old connection at once; the accepting side takes over only once the dialer used
    /// the new connection (or the old one ended), so its own close of the old connection can
    /// never overtake the dialer's take-over.
    pub(super) fn take_over(&mut self, node: NodeId, old: SessionId, new: SessionId) {
        let Some(o) = self.sessions.get_mut(&old) else {
            return;
        };
        let rooms = std::mem::take(&mut o.rooms);
        let ops = o.ops.hand_over();
        let old_target = o.target.take();
        let (failures, capacity) = (o.probation.failures(), o.capacity);
        o.timers.cancel_watch(&mut self.timers);
        self.ops.move_session(old, new);
        for room in &rooms {
            let Some(r) = self.rooms.get_mut(room) else {
                continue;
            };
            match &mut r.side {
                Side::Sender(x) => {
                    for rcv in x.receivers.iter_mut().filter(|x| x.session == old) {
                        rcv.session = new;
                    }
                    for a in x.announced_by.iter_mut().filter(|a| **a == old) {
                        *a = new;
                    }
                }
                Side::Receiver(rr) => {
                    for src in rr.sources.iter_mut().filter(|s| s.session == old) {
                        src.session = new;
                    }
                    self.grants.move_writer(*room, old, new);
                    for l in rr.waiting_for.iter_mut() {
                        if *l == Link::Session(old) {
                            *l = Link::Session(new);
                        }
                    }
                }
            }
        }
        for p in self.pending.values_mut() {
            for (s, _) in p.requests.iter_mut().filter(|(s, _)| *s == old) {
                *s = new;
            }
            for (s, _) in p.notices.iter_mut().filter(|(s, _)| *s == old) {
                *s = new;
            }
        }
        let moved = rooms.len();
        let Some(n) = self.sessions.get_mut(&new) else {
            return;
        };
        n.rooms.extend(rooms);
        n.ops.take_over(ops);
        n.probation.carry_over(failures);
        n.capacity = n.capacity.or(capacity);
        n.target = n.target.or(old_target);
        let inbound = n.inbound;
        self.sessions.set_node(node, new);
        self.grants.supersede(old);
        // Whoever named the old session (an embedder's link, a target kept connected) now
        // names the new one: a target that still pointed at the old session would see it
        // close, dial again, and its fresh session would take this one over in turn.
        self.successions.take_over(old, new);
        self.targets.follow(old, new);
        self.counters.sessions_resumed += 1;
        info!(%node, %old, %new, rooms = moved, "link back: a fresh connection took the silent session over");
        self.outbox.event(Event::SessionResumed { node, old, new });
        if !inbound {
            // We dialed, so the peer takes over at our first message (sent now).
            let heartbeat = self.heartbeat(new);
            self.outbox.transmit(new, heartbeat);
        }
        // Both sides now carry on over `new`, so the old connection can go. The accepting
        // side closes it too rather than wait for the dialer's close: that close may sit
        // behind the old connection's TCP retransmission backoff for seconds, and until then
        // the operations in flight on it would not report.
        self.request_close(old);
        self.mark_ready(new);
    }

    /// Accepted side: the fresh session `sid` takes over the silent one it was waiting for.
    pub(super) fn commit_resume(&mut self, sid: SessionId) {
        let Some(s) = self.sessions.get_mut(&sid) else {
            return;
        };
        let Some(old) = s.resumes.take() else {
            return;
        };
        let Some(who) = s.peer.map(|p| (p.node, p.incarnation)) else {
            return;
        };
        let node = who.0;
        let same = self.sessions.get(&old).is_some_and(|o| {
            o.state == SessionState::Established
                && o.peer.map(|p| (p.node, p.incarnation)) == Some(who)
        });
        if !same || self.successions.is_superseded(old) {
            self.sessions.set_node(node, sid);
            self.resume_unused(old);
            return;
        }
        self.take_over(node, old, sid);
        self.replay(sid);
    }

    /// Accepted side: no fresh session will take `old` over after all; it carries writes again.
    pub(super) fn resume_unused(&mut self, old: SessionId) {
        if let Some(o) = self.sessions.get_mut(&old) {
            o.handing_over = false;
        }
        self.mark_ready(old);
    }

    /// Accepted side: `old` is ending; a fresh session of the same peer waiting to take it
    /// over does so now, so the end fails nothing. Whether there was one.
    pub(super) fn hand_over_before_end(&mut self, old: SessionId) -> bool {
        let heir = self
            .sessions
            .iter()
            .find(|(_, s)| s.resumes == Some(old))
            .map(|(id, _)| *id);
        if let Some(heir) = heir {
            self.commit_resume(heir);
        }
        heir.is_some()
    }

    /// After a take-over: says again on `sid` what the peer may have lost with the old
    /// connection. Each message is one the peer treats as a duplicate if it had it.
    pub(super) fn replay(&mut self, sid: SessionId) {
        let Some(s) = self.sessions.get(&sid) else {
            return;
        };
        let rooms: Vec<RoomId> = s.rooms.iter().copied().collect();
        for room in rooms {
            let Some(r) = self.rooms.get(&room) else {
                continue;
            };
            let generation = r.generation;
            let state = r.state;
            let msg = match &r.side {
                Side::Sender(x)
                    if state.is_terminal() && x.receivers.iter().any(|x| x.session == sid) =>
                {
                    self.answer_with_outcome(sid, room, generation, state.failure());
                    continue;
                }
                Side::Sender(_) => continue,
                Side::Receiver(rr) => {
                    let Some(src) = rr.sources.iter().find(|s| s.session == sid) else {
                        continue;
                    };
                    match state.failure() {
                        Some(reason) if !src.done && !src.drained => Message::Abort {
                            room,
                            generation,
                            reason,
                        },
                        _ if state.is_terminal() => continue,
                        _ if src.granted => match &rr.request {
                            Some(req) if src.idle => Message::RoomRequest(req.idle()),
                            Some(req) => Message::RoomRequest((**req).clone()),
                            None => continue,
                        },
                        _ => Message::RoomPending {
                            room,
                            generation,
                            queue_position: rr.queue_position,
                        },
                    }
                }
            };
            self.outbox.transmit(sid, msg);
        }
    }
}
