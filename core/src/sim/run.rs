//! Running the simulation: events recorded per node, the clock stepped to the next deadline,
//! pending deliveries and completions processed, and the invariants checked at the end.

use super::*;

impl Sim {
    pub(super) fn record(&mut self, n: usize, ev: Event) {
        let now = self.now;
        match &ev {
            Event::RoomState {
                room,
                generation,
                state,
            } => {
                let key = (*room, *generation);
                let node = &mut self.nodes[n];
                if let Some(prev) = node.states.get(&key) {
                    if prev.is_terminal() {
                        self.violations.push(format!(
                            "node {n}: {room} left terminal {prev:?} for {state:?}"
                        ));
                    }
                }
                node.states.insert(key, *state);
                let is_decode = node.info.role == Role::Decode;
                if *state == KvPoll::Success
                    && is_decode
                    && self
                        .unlanded
                        .get(&(n, *room, *generation))
                        .is_some_and(|s| !s.is_empty())
                {
                    self.violations.push(format!(
                        "node {n}: {room} succeeded with operations that never landed"
                    ));
                }
                if *state == KvPoll::Success && is_decode {
                    if let Some(missing) = self.nodes[n].unlanded_page(key) {
                        self.violations.push(format!(
                            "node {n}: {room} succeeded but {missing} was never written in this lifetime"
                        ));
                    }
                }
                let node = &mut self.nodes[n];
                if state.is_terminal() {
                    node.concluded_at.insert(key, now);
                }
            }
            Event::Releasable { room, generation } => {
                let key = (*room, *generation);
                let node = &mut self.nodes[n];
                if !node.states.get(&key).is_some_and(|s| s.is_terminal()) {
                    self.violations
                        .push(format!("node {n}: {room} releasable before terminal"));
                }
                if !node.released.insert(key) {
                    self.violations
                        .push(format!("node {n}: {room} released twice"));
                }
                node.free(*room, *generation);
                self.releases += 1;
            }
            _ => {}
        }
        self.nodes[n].events.push((now, ev));
    }

    /// The earliest moment something happens.
    pub(super) fn next_time(&self) -> Option<Instant> {
        let q = self.queue.peek().map(|Reverse(q)| q.0);
        let timers = self
            .nodes
            .iter()
            .filter_map(|n| n.endpoint.poll_timeout().map(|(t, _)| t))
            .min();
        match (q, timers) {
            (Some(a), Some(b)) => Some(a.min(b)),
            (a, b) => a.or(b),
        }
    }

    /// Advances to the next moment and processes everything due. `false` when idle.
    pub fn step(&mut self) -> bool {
        let Some(t) = self.next_time() else {
            return false;
        };
        if t > self.now {
            self.now = t;
        }
        self.steps += 1;
        while self.queue.peek().is_some_and(|Reverse(q)| q.0 <= self.now) {
            if let Some(Reverse(Queued(_, _, p))) = self.queue.pop() {
                self.process(p);
            }
        }
        for n in 0..self.nodes.len() {
            if self.nodes[n]
                .endpoint
                .poll_timeout()
                .is_some_and(|(t, _)| t <= self.now)
            {
                self.nodes[n].endpoint.handle_timeout(self.now);
                self.drain(n);
            }
        }
        true
    }

    // One arm per kind of pending event of the simulated network and data path: the
    // simulation's whole model of the world reads in one place.
    pub(super) fn process(&mut self, p: Pending) {
        match p {
            Pending::Deliver {
                node,
                session,
                bytes,
            } => {
                if self.nodes[node].endpoint.session_state(session).is_none() {
                    return;
                }
                // A byte stream, as a driver sees it: keep what the core did not consume.
                let data = match self.rx.remove(&(node, session)) {
                    Some(mut held) => {
                        held.extend_from_slice(&bytes);
                        held
                    }
                    None => bytes,
                };
                let used = self.nodes[node]
                    .endpoint
                    .handle_input(self.now, session, &data);
                if used > data.len() {
                    self.violations.push(format!(
                        "node {node}: consumed {used} of {} bytes",
                        data.len()
                    ));
                }
                if used < data.len() {
                    self.rx.insert((node, session), data[used..].to_vec());
                }
                self.drain(node);
            }
            Pending::OpDone { node, id } => {
                let Some(f) = self.inflight.remove(&(node, id)) else {
                    return;
                };
                let landed = f.outcome == TransferOutcome::Done;
                if landed {
                    self.land(&f);
                }
                self.end_write(&f, landed);
                self.nodes[node]
                    .endpoint
                    .handle_transfer_result(self.now, id, f.outcome);
                self.drain(node);
            }
            Pending::OrphanLands { key } => {
                if let Some(f) = self.orphans.remove(&key) {
                    self.land_dst(&f);
                    self.end_write(&f, true);
                }
            }
            Pending::Fence { node, session } => {
                // Break every write in flight over this session, in either direction.
                let peer = self.link_of(node, session).map(|(li, dir)| {
                    if dir == 0 {
                        self.links[li].b
                    } else {
                        self.links[li].a
                    }
                });
                let broken: Vec<(usize, TransferId)> = self
                    .inflight
                    .iter()
                    .filter(|(_, f)| {
                        (f.src == node && f.op.session == session)
                            || Some((f.dst, f.dst_session)) == Some((node, session))
                                && peer.is_some_and(|p| p.0 == f.src)
                    })
                    .map(|(k, _)| *k)
                    .collect();
                for key in broken {
                    if let Some(f) = self.inflight.remove(&key) {
                        self.end_write(&f, false);
                        self.nodes[f.src].endpoint.handle_transfer_result(
                            self.now,
                            f.op.id,
                            TransferOutcome::Transient,
                        );
                        self.drain(f.src);
                    }
                }
                // The receiver's side of the fence stops its receive paths: nothing lands.
                self.orphans
                    .retain(|_, f| !(f.dst == node && f.dst_session == session));
                // A data path that cannot drain (a queue pair whose flush never completes)
                // never confirms: the core's `fence_timeout` decides.
                if !self.faults.fence_stuck {
                    self.nodes[node]
                        .endpoint
                        .handle_fence_complete(self.now, session);
                }
                self.drain(node);
            }
            Pending::Close { node, session } => {
                let Some((li, _)) = self.link_of(node, session) else {
                    return;
                };
                let l = &mut self.links[li];
                let was_up = l.up;
                l.up = false;
                // Through a black hole the far end learns nothing: its own timers decide.
                let ends: Vec<(usize, SessionId)> = if l.blackhole_until > self.now {
                    vec![(node, session)]
                } else {
                    vec![l.a, l.b]
                };
                for &(n, s) in &ends {
                    let broken: Vec<(usize, TransferId)> = self
                        .inflight
                        .iter()
                        .filter(|(_, f)| {
                            (f.src == n && f.op.session == s) || (f.dst == n && f.dst_session == s)
                        })
                        .map(|(k, _)| *k)
                        .collect();
                    self.orphans
                        .retain(|_, f| !(f.dst == n && f.dst_session == s));
                    for key in broken {
                        if let Some(f) = self.inflight.remove(&key) {
                            self.end_write(&f, false);
                            self.nodes[f.src].endpoint.handle_transfer_result(
                                self.now,
                                f.op.id,
                                TransferOutcome::Transient,
                            );
                            self.drain(f.src);
                        }
                    }
                }
                for &(n, s) in &ends {
                    if s != DEAD_SESSION {
                        self.nodes[n].endpoint.handle_disconnected(self.now, s);
                        self.drain(n);
                    }
                }
                let (a, b) = (self.links[li].a.0, self.links[li].b.0);
                if let (true, Some(after)) = (was_up, self.faults.reconnect_after) {
                    let at = self.now + after;
                    self.push(at, Pending::Reconnect { a, b });
                }
            }
            Pending::Reconnect { a, b } => {
                if self.session(a, b).is_none() {
                    self.connect(a, b);
                }
            }
            Pending::Dial { node, target, dial } => {
                let Some(&peer) = self.targets.get(&(node, target)) else {
                    return;
                };
                let abandoned = self.nodes[node]
                    .waits_ended
                    .iter()
                    .any(|(_, w)| *w == WaitEnded::AbandonDial(dial));
                if self.silent.contains(&peer) || abandoned {
                    // Nobody answers (or the driver gave the attempt up before it connected),
                    // and nothing is reported: the core's deadline ends it.
                    return;
                }
                let sa = self.nodes[node].endpoint.open_session_for(self.now, target);
                let sb = self.nodes[peer].endpoint.accept_session(self.now);
                self.add_link((node, sa), (peer, sb));
            }
            Pending::Work(w) => self.work(w),
        }
    }

    /// Runs until `done` holds, at most `max_steps` steps.
    pub fn run_until(
        &mut self,
        max_steps: u64,
        mut done: impl FnMut(&Sim) -> bool,
    ) -> Result<(), SimError> {
        let start = self.steps;
        while !done(self) {
            if self.steps - start >= max_steps {
                return Err(SimError::Livelock {
                    steps: self.steps - start,
                });
            }
            if !self.step() {
                return if done(self) {
                    Ok(())
                } else {
                    Err(SimError::Stalled)
                };
            }
        }
        Ok(())
    }

    /// Runs for `d` of simulated time (or until idle), at most `max_steps` steps.
    pub fn run_for(&mut self, d: Duration, max_steps: u64) -> Result<(), SimError> {
        let until = self.now + d;
        let start = self.steps;
        loop {
            match self.next_time() {
                Some(t) if t <= until => {}
                _ => {
                    self.now = self.now.max(until);
                    return Ok(());
                }
            }
            if self.steps - start >= max_steps {
                return Err(SimError::Livelock {
                    steps: self.steps - start,
                });
            }
            self.step();
        }
    }

    /// Whether every node holds no room and no operation.
    pub fn quiescent(&self) -> bool {
        self.nodes
            .iter()
            .all(|n| n.endpoint.live_rooms() == 0 && n.endpoint.live_ops() == 0)
    }

    /// Checks that each node's counters agree with its event stream; returns mismatches.
    pub fn counter_mismatches(&self) -> Vec<String> {
        let mut out = Vec::new();
        for (i, n) in self.nodes.iter().enumerate() {
            let c = n.endpoint.counters();
            let succ = n.count_events(|e| {
                matches!(
                    e,
                    Event::RoomState {
                        state: KvPoll::Success,
                        ..
                    }
                )
            }) as u64;
            if succ != c.rooms_succeeded {
                out.push(format!(
                    "node {i}: {succ} success events, counter {}",
                    c.rooms_succeeded
                ));
            }
            for reason in FailureReason::ALL {
                let ev = n.count_events(|e| matches!(e, Event::RoomState { state: KvPoll::Failed(r), .. } if *r == reason)) as u64;
                if ev != c.failed(reason) {
                    out.push(format!(
                        "node {i}: {ev} {reason} events, counter {}",
                        c.failed(reason)
                    ));
                }
            }
            let rel = n.count_events(|e| matches!(e, Event::Releasable { .. })) as u64;
            if rel != c.rooms_released {
                out.push(format!(
                    "node {i}: {rel} releasable events, counter {}",
                    c.rooms_released
                ));
            }
            let bl = n.count_events(|e| matches!(e, Event::SessionBlacklisted { .. })) as u64;
            if bl != c.sessions_blacklisted {
                out.push(format!(
                    "node {i}: {bl} blacklist events, counter {}",
                    c.sessions_blacklisted
                ));
            }
            out.extend(n.layer_delivery_mismatches(i));
            let rec = n.count_events(|e| matches!(e, Event::SessionRecovered { .. })) as u64;
            if rec != c.sessions_recovered {
                out.push(format!(
                    "node {i}: {rec} recovery events, counter {}",
                    c.sessions_recovered
                ));
            }
        }
        out
    }
}
