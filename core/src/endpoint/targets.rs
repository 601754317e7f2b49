//! Targets: peers the embedder asked the core to keep connected, each with its session, its
//! reconnect backoff, its connection attempt and what the attempts found.

use std::time::{Duration, Instant};

use foldhash::fast::FixedState;

use crate::api::ConnectFailure;
use crate::config::Config;
use crate::ids::{DialId, RoomId, SessionId, TargetId};
use crate::state::FailureReason;
use crate::timer::{Timer, TimerKey, TimerTable};

use super::attempt::Attempt;
use super::Map;

/// Every target by id, and the id counter.
#[derive(Debug)]
pub(super) struct Targets {
    by_id: Map<TargetId, Target>,
    last_id: u32,
}

impl Targets {
    /// No target yet; ids hashed with the endpoint's seeded `hasher`.
    pub(super) fn new(hasher: FixedState) -> Self {
        Targets {
            by_id: Map::with_hasher(hasher),
            last_id: 0,
        }
    }

    /// A new target, down since `now`: its unreachable deadline and (with a
    /// `peer_idle_timeout`) its idle deadline are armed; the caller dials it.
    pub(super) fn add(
        &mut self,
        now: Instant,
        config: &Config,
        timers: &mut TimerTable,
    ) -> TargetId {
        self.last_id += 1;
        let id = TargetId(self.last_id);
        let mut unreachable_timer = None;
        timers.set(
            &mut unreachable_timer,
            now + config.unreachable_timeout,
            Timer::Unreachable(id),
        );
        let mut idle_timer = None;
        if !config.peer_idle_timeout.is_zero() {
            timers.set(
                &mut idle_timer,
                now + config.peer_idle_timeout,
                Timer::TargetIdle(id),
            );
        }
        self.by_id.insert(
            id,
            Target {
                session: None,
                backoff: config.reconnect_interval,
                timer: None,
                down_since: Some(now),
                waiting: Vec::new(),
                unreachable_timer,
                unreachable_reported: false,
                attempt: Attempt::default(),
                check: None,
                evidence: None,
                last_used: now,
                idle_timer,
                dial_timeout: config.connect_timeout,
                link_measured: false,
            },
        );
        id
    }

    /// Removes a target; none of its deadlines fires after this.
    pub(super) fn remove(&mut self, id: TargetId, timers: &mut TimerTable) -> Option<Target> {
        let mut t = self.by_id.remove(&id)?;
        timers.cancel(&mut t.timer);
        timers.cancel(&mut t.unreachable_timer);
        timers.cancel(&mut t.idle_timer);
        Some(t)
    }

    /// The endpoint is shutting down: no target is dialed again or waited for.
    pub(super) fn stop_dialing(&mut self, timers: &mut TimerTable) {
        for t in self.by_id.values_mut() {
            timers.cancel(&mut t.timer);
            timers.cancel(&mut t.unreachable_timer);
        }
    }

    pub(super) fn get(&self, id: &TargetId) -> Option<&Target> {
        self.by_id.get(id)
    }

    pub(super) fn get_mut(&mut self, id: &TargetId) -> Option<&mut Target> {
        self.by_id.get_mut(id)
    }

    pub(super) fn contains(&self, id: &TargetId) -> bool {
        self.by_id.contains_key(id)
    }

    pub(super) fn iter_mut(&mut self) -> impl Iterator<Item = (&TargetId, &mut Target)> {
        self.by_id.iter_mut()
    }

    pub(super) fn values_mut(&mut self) -> impl Iterator<Item = &mut Target> {
        self.by_id.values_mut()
    }

    /// The target whose pending attempt `dial` is.
    pub(super) fn of_dial(&self, dial: DialId) -> Option<TargetId> {
        self.by_id
            .iter()
            .find_map(|(id, t)| t.attempt.is(dial).then_some(*id))
    }

    /// Whether some target's attempt `dial` is being abandoned.
    pub(super) fn abandoning(&self, dial: DialId) -> bool {
        self.by_id.values().any(|t| t.attempt.abandoning(dial))
    }

    /// Whether `session` is a target's session or its link check: a kept peer holds it.
    pub(super) fn hold(&self, session: SessionId) -> bool {
        self.by_id
            .values()
            .any(|t| t.session == Some(session) || t.check == Some(session))
    }

    /// The targets whose session `session` is.
    pub(super) fn on_session(&self, session: SessionId) -> Vec<TargetId> {
        self.by_id
            .iter()
            .filter(|(_, t)| t.session == Some(session))
            .map(|(id, _)| *id)
            .collect()
    }

    /// `new` took `old`'s work over: targets that followed `old` follow `new`.
    pub(super) fn follow(&mut self, old: SessionId, new: SessionId) {
        for t in self.by_id.values_mut().filter(|t| t.session == Some(old)) {
            t.session = Some(new);
        }
    }
}

/// A peer to stay connected to: the core decides when to (re)connect.
#[derive(Debug)]
pub(super) struct Target {
    pub(super) session: Option<SessionId>,
    pub(super) backoff: Duration,
    pub(super) timer: Option<TimerKey>,
    /// Since when the target has had no established session (`None`: it has one).
    pub(super) down_since: Option<Instant>,
    /// Receiver rooms waiting for this target's session.
    pub(super) waiting: Vec<RoomId>,
    pub(super) unreachable_timer: Option<TimerKey>,
    /// `Event::TargetUnreachable` went out for the current time down.
    pub(super) unreachable_reported: bool,
    /// Its connection attempt under way, one at most, and the last one given up.
    pub(super) attempt: Attempt,
    /// A fresh connection checking the link while the session is silent, in its handshake.
    pub(super) check: Option<SessionId>,
    /// What the attempts since the session went silent or down found.
    pub(super) evidence: Option<LinkEvidence>,
    /// When a room last opened toward it or left its session: `peer_idle_timeout` counts
    /// from here.
    pub(super) last_used: Instant,
    pub(super) idle_timer: Option<TimerKey>,
    /// The deadline of its next attempt, a link check's too: `connect_timeout`, doubled after
    /// each attempt nobody answered in time until a session was established (up to
    /// [`dial_timeout_cap`]), then what that session's handshake measured (`connect_timeout`
    /// on a fast link, so a healed link is found within it).
    pub(super) dial_timeout: Duration,
    /// A session's handshake measured the link: an attempt that times out after that is an
    /// outage, not a slow link, and the next one keeps the deadline (a healed link is found
    /// within it), until the target is reported unreachable (the link may have changed).
    pub(super) link_measured: bool,
}

/// The longest a target's attempt waits to connect: a link whose connect takes longer than
/// `connect_timeout` is still reached, and after an outage a healed link is found within this.
pub(super) fn dial_timeout_cap(config: &Config) -> Duration {
    config.connect_timeout * 8
}

impl Target {
    /// Its session is established: it is up, and the next loss dials at the shortest pause,
    /// each attempt given `link_timeout` (what the link's handshake took, see
    /// `DataDials::established`) within `connect_timeout` and the cap.
    pub(super) fn established(
        &mut self,
        session: SessionId,
        config: &Config,
        link_timeout: Duration,
        timers: &mut TimerTable,
    ) {
        self.backoff = config.reconnect_interval;
        self.session = Some(session);
        self.check = None;
        self.evidence = None;
        self.dial_timeout = link_timeout
            .min(dial_timeout_cap(config))
            .max(config.connect_timeout);
        self.link_measured = true;
        timers.cancel(&mut self.timer);
    }

    /// An attempt that is not a link check got no answer within its deadline: unless a
    /// session measured the link, the next one waits twice as long, up to the cap (a link
    /// slower than the deadline is reached); if one did, this is an outage and the deadline
    /// stays.
    pub(super) fn attempt_timed_out(&mut self, config: &Config) {
        if !self.link_measured {
            self.dial_timeout = (self.dial_timeout * 2).min(dial_timeout_cap(config));
        }
    }

    /// Down for the whole `unreachable_timeout`: what the last session measured may no longer
    /// be the link (a route that moved), so unanswered attempts grow their deadline again.
    pub(super) fn unreachable(&mut self) {
        self.link_measured = false;
    }
}

/// What the connection attempts to a target found, since its session went silent or down:
/// the evidence that names the reason of rooms failed for it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum LinkEvidence {
    /// The host refused: nothing listens at the port.
    Refused,
    /// No answer within the connect timeout, or no route.
    NoAnswer,
    /// A connection was made but no hello came back: the peer process does not answer.
    Silent,
    /// The peer answered and refused us at the handshake (token, role, layout, version).
    Rejected(FailureReason),
}

impl LinkEvidence {
    /// What a failed connection attempt found.
    pub(super) fn of(failure: ConnectFailure) -> Self {
        match failure {
            ConnectFailure::Refused => LinkEvidence::Refused,
            ConnectFailure::NoAnswer => LinkEvidence::NoAnswer,
        }
    }

    /// The reason of rooms that gave up on a link this evidence describes.
    pub(super) fn reason(self) -> FailureReason {
        match self {
            LinkEvidence::Refused => FailureReason::ConnectionRefused,
            LinkEvidence::NoAnswer => FailureReason::PeerUnreachable,
            LinkEvidence::Silent => FailureReason::PeerSilent,
            LinkEvidence::Rejected(reason) => reason,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{
        dial_timeout_cap, Config, Duration, FixedState, Instant, LinkEvidence, SessionId, Targets,
        Timer, TimerTable,
    };

    fn config() -> Config {
        Config {
            peer_idle_timeout: Duration::from_secs(30),
            ..Config::default()
        }
    }

    /// No target yet, an empty timer table, and the time now.
    fn fresh() -> (Targets, TimerTable, Instant) {
        (
            Targets::new(FixedState::default()),
            TimerTable::default(),
            Instant::now(),
        )
    }

    #[test]
    fn a_new_target_is_down_with_its_unreachable_and_idle_deadlines_armed() {
        let (mut targets, mut timers, now) = fresh();
        let config = config();
        let id = targets.add(now, &config, &mut timers);
        let t = targets.get(&id).unwrap();
        assert_eq!(t.down_since, Some(now));
        assert!(t.unreachable_timer.is_some() && t.idle_timer.is_some());
        assert_eq!(
            timers.next().map(|(at, _)| at),
            Some(now + config.unreachable_timeout.min(config.peer_idle_timeout))
        );
        assert_ne!(
            targets.add(now, &config, &mut timers),
            id,
            "ids are never reused"
        );
    }

    #[test]
    fn a_removed_target_leaves_no_deadline_behind() {
        let (mut targets, mut timers, now) = fresh();
        let id = targets.add(now, &config(), &mut timers);
        targets.get_mut(&id).unwrap().established(
            SessionId(1),
            &config(),
            Duration::ZERO,
            &mut timers,
        );
        assert!(targets.remove(id, &mut timers).is_some());
        assert!(timers.next().is_none());
        assert!(!targets.contains(&id));
    }

    #[test]
    fn a_session_is_held_by_the_target_that_keeps_it_or_checks_it() {
        let (mut targets, mut timers, now) = fresh();
        let a = targets.add(now, &config(), &mut timers);
        let b = targets.add(now, &config(), &mut timers);
        targets.get_mut(&a).unwrap().session = Some(SessionId(1));
        targets.get_mut(&b).unwrap().check = Some(SessionId(2));
        assert!(targets.hold(SessionId(1)) && targets.hold(SessionId(2)));
        assert!(!targets.hold(SessionId(3)));
        assert_eq!(targets.on_session(SessionId(1)), vec![a]);
        targets.follow(SessionId(1), SessionId(4));
        assert_eq!(targets.on_session(SessionId(4)), vec![a]);
        assert!(targets.on_session(SessionId(1)).is_empty());
    }

    #[test]
    fn an_established_target_resets_its_backoff_and_forgets_what_attempts_found() {
        let (mut targets, mut timers, now) = fresh();
        let id = targets.add(now, &config(), &mut timers);
        let t = targets.get_mut(&id).unwrap();
        t.backoff = Duration::from_secs(8);
        t.evidence = Some(LinkEvidence::Refused);
        t.check = Some(SessionId(2));
        timers.set(
            &mut t.timer,
            now + Duration::from_secs(1),
            Timer::Reconnect(id),
        );
        t.established(SessionId(2), &config(), Duration::ZERO, &mut timers);
        assert_eq!(
            (t.session, t.check, t.evidence),
            (Some(SessionId(2)), None, None)
        );
        assert_eq!(t.backoff, config().reconnect_interval);
        assert!(t.timer.is_none());
    }

    #[test]
    fn unanswered_attempts_double_the_deadline_until_a_session_sets_it_from_its_link() {
        let (mut targets, mut timers, now) = fresh();
        let config = config();
        let id = targets.add(now, &config, &mut timers);
        let t = targets.get_mut(&id).unwrap();
        assert_eq!(t.dial_timeout, config.connect_timeout);
        t.attempt_timed_out(&config);
        assert_eq!(t.dial_timeout, config.connect_timeout * 2);
        for _ in 0..10 {
            t.attempt_timed_out(&config);
        }
        assert_eq!(t.dial_timeout, dial_timeout_cap(&config));
        // A session whose handshake was quick: the next loss dials at connect_timeout again,
        // and an attempt that times out then is an outage: the deadline stays.
        t.established(SessionId(1), &config, Duration::ZERO, &mut timers);
        assert_eq!(t.dial_timeout, config.connect_timeout);
        t.attempt_timed_out(&config);
        assert_eq!(t.dial_timeout, config.connect_timeout);
        // Down for the whole unreachable window: the link may have changed, attempts grow.
        t.unreachable();
        t.attempt_timed_out(&config);
        assert_eq!(t.dial_timeout, config.connect_timeout * 2);
        // One over a slow link: its attempts get what that link's handshake needed.
        let slow = config.connect_timeout * 3;
        t.established(SessionId(2), &config, slow, &mut timers);
        assert_eq!(t.dial_timeout, slow);
        t.established(
            SessionId(3),
            &config,
            Duration::from_secs(3600),
            &mut timers,
        );
        assert_eq!(t.dial_timeout, dial_timeout_cap(&config));
    }
}
