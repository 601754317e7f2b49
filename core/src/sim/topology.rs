//! The simulation's nodes and links: nodes added and restarted, sessions connected, links
//! broken, black-holed and reset.

use super::*;

impl Sim {
    /// Adds a node and returns its index.
    pub fn add_node(&mut self, config: Config, info: EndpointInfo) -> usize {
        let seed = self.rng.next_u64();
        let endpoint = match Endpoint::new(config.clone(), info.clone(), seed, self.now) {
            Ok(e) => e,
            Err(e) => panic!("sim node config invalid: {e}"),
        };
        let pages = vec![None; info.layout.pages as usize];
        self.nodes.push(SimNode {
            endpoint,
            pages,
            free_pages: (0..info.layout.pages).rev().collect(),
            owned: HashMap::default(),
            states: HashMap::default(),
            released: HashSet::default(),
            concluded_at: HashMap::default(),
            events: Vec::new(),
            data_down_until: HashMap::default(),
            landed: HashMap::default(),
            waits_ended: Vec::new(),
            info,
            config,
            seed,
        });
        self.nodes.len() - 1
    }

    /// Adds a prefill node owning `layers` (and aux if it owns the last layer).
    pub fn add_prefill(
        &mut self,
        config: Config,
        layout: Layout,
        rank: u16,
        layers: std::ops::Range<u16>,
    ) -> usize {
        let n = self.nodes.len() as u64;
        let mut info = EndpointInfo::new(
            Role::Prefill,
            NodeId(100 + n),
            Incarnation(self.rng.next_u64()),
            layout,
        );
        info.rank = rank;
        info.writes_aux = layers.end == layout.layers;
        info.layer_start = layers.start;
        info.layer_end = layers.end;
        info.token = b"sim-token".to_vec();
        self.add_node(config, info)
    }

    /// Adds a decode node.
    pub fn add_decode(&mut self, config: Config, layout: Layout, rank: u16) -> usize {
        let n = self.nodes.len() as u64;
        let mut info = EndpointInfo::new(
            Role::Decode,
            NodeId(100 + n),
            Incarnation(self.rng.next_u64()),
            layout,
        );
        info.rank = rank;
        info.token = b"sim-token".to_vec();
        self.add_node(config, info)
    }

    /// Restarts a node: a new endpoint with a new incarnation, all its memory freed, all its
    /// links dropped without notice to itself (the old process is gone).
    pub fn restart(&mut self, n: usize) {
        let node = &mut self.nodes[n];
        let mut info = node.info.clone();
        info.incarnation = Incarnation(node.seed.wrapping_mul(31).wrapping_add(self.steps) | 1);
        node.info = info.clone();
        node.endpoint = match Endpoint::new(node.config.clone(), info, node.seed ^ 0xA5A5, self.now)
        {
            Ok(e) => e,
            Err(e) => panic!("sim node config invalid: {e}"),
        };
        for p in node.pages.iter_mut() {
            *p = None;
        }
        node.free_pages = (0..node.info.layout.pages).rev().collect();
        node.owned.clear();
        // The new process knows nothing of the old one's rooms: the same ids may come again.
        node.landed.clear();
        node.states.clear();
        node.released.clear();
        node.concluded_at.clear();
        node.events.clear();
        // Its dials and their ids went with it (the new endpoint numbers from 1 again).
        node.waits_ended
            .retain(|(_, w)| !matches!(w, WaitEnded::AbandonDial(_)));
        // The old process's targets went with it (a target toward `n` stays: it redials).
        self.targets.retain(|k, _| k.0 != n);
        self.unlanded.retain(|k, _| k.0 != n);
        self.landed_ops.retain(|k, _| k.0 != n);
        self.inflight.retain(|_, f| f.src != n && f.dst != n);
        self.orphans.retain(|_, f| f.dst != n);
        self.rx.retain(|k, _| k.0 != n);
        // Whatever was on its way to the old process is lost with it.
        let queue = std::mem::take(&mut self.queue);
        self.queue = queue
            .into_iter()
            .filter(|Reverse(q)| match &q.2 {
                Pending::Deliver { node, .. }
                | Pending::OpDone { node, .. }
                | Pending::Fence { node, .. }
                | Pending::Close { node, .. }
                | Pending::Dial { node, .. } => *node != n,
                _ => true,
            })
            .collect();
        for l in self.links.iter_mut() {
            for end in [&mut l.a, &mut l.b] {
                if end.0 == n {
                    l.up = false;
                    // The old process is gone: its end of the link must never match the new one.
                    end.1 = DEAD_SESSION;
                }
            }
        }
    }

    /// Connects two nodes with a fresh control connection; returns (session on a, session on b).
    pub fn connect(&mut self, a: usize, b: usize) -> (SessionId, SessionId) {
        let sa = self.nodes[a].endpoint.open_session(self.now);
        let sb = self.nodes[b].endpoint.accept_session(self.now);
        self.add_link((a, sa), (b, sb));
        (sa, sb)
    }

    /// A fresh control connection between two sessions just opened on either end.
    pub(crate) fn add_link(&mut self, a: (usize, SessionId), b: (usize, SessionId)) {
        self.links.push(Link {
            a,
            b,
            up: true,
            last_delivery: [self.now; 2],
            blackhole_until: self.now,
        });
        self.drain(a.0);
        self.drain(b.0);
    }

    /// Makes node `a` keep a session to node `b` (a persistent peer): its core's connection
    /// attempts reach `b` at once, and every session the core loses is dialed again on its
    /// reconnect timer.
    pub fn add_target(&mut self, a: usize, b: usize) -> TargetId {
        let target = self.nodes[a].endpoint.add_target(self.now);
        self.targets.insert((a, target), b);
        self.drain(a);
        target
    }

    /// Makes connection attempts to node `b` go unanswered (`true`: a host that drops the
    /// SYNs) or be answered again (`false`); attempts already unanswered stay so.
    pub fn silence_dials(&mut self, b: usize, silent: bool) {
        if silent {
            self.silent.insert(b);
        } else {
            self.silent.remove(&b);
        }
    }

    /// Makes connection attempts to node `b` connect only after `latency` (a long link's
    /// connect); an attempt the core abandons first never connects.
    pub fn slow_dials(&mut self, b: usize, latency: Duration) {
        self.dial_latency.insert(b, latency);
    }

    /// The current session of node `a` toward node `b`, if their link is up.
    pub fn session(&self, a: usize, b: usize) -> Option<SessionId> {
        self.links.iter().rev().find_map(|l| {
            match (l.up, l.a.0 == a && l.b.0 == b, l.b.0 == a && l.a.0 == b) {
                (true, true, _) => Some(l.a.1),
                (true, _, true) => Some(l.b.1),
                _ => None,
            }
        })
    }

    /// Makes the data path between `a` and `b` fail transiently until `until` (control works).
    pub fn break_data_path(&mut self, a: usize, b: usize, until: Instant) {
        for (x, y) in [(a, b), (b, a)] {
            if let Some(s) = self.session(x, y) {
                self.nodes[x].data_down_until.insert(s, until);
            }
        }
    }

    /// Drops every control message between `a` and `b` until `until` (data path hangs too).
    pub fn blackhole(&mut self, a: usize, b: usize, until: Instant) {
        for l in self.links.iter_mut() {
            if l.up && ((l.a.0 == a && l.b.0 == b) || (l.a.0 == b && l.b.0 == a)) {
                l.blackhole_until = until;
            }
        }
    }

    /// Resets the link between `a` and `b`: both sides see the connection drop.
    pub fn reset_link(&mut self, a: usize, b: usize) {
        if let Some(s) = self.session(a, b) {
            self.push(
                self.now,
                Pending::Close {
                    node: a,
                    session: s,
                },
            );
        }
    }
}
