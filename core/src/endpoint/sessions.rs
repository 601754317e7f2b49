//! The endpoint's sessions: each by its id, the one established session of each peer node,
//! and the blacklists remembered of peers whose session ended blacklisted.
//!
//! Invariants of [`Sessions`]: an id is never given twice; a node names at most one session,
//! and only one that exists (a session that leaves takes its node's entry with it); a
//! remembered blacklist is of a node with no established session since it was remembered
//! (the next hello of that node takes it).

use std::time::{Duration, Instant};

use foldhash::fast::FixedState;

use crate::ids::{DialId, Incarnation, NodeId, SessionId};

use super::{Map, Session};

/// Every session of the endpoint, and what it remembers of peers between them.
#[derive(Debug)]
pub(super) struct Sessions {
    by_id: Map<SessionId, Session>,
    last_id: u32,
    /// Established sessions by peer node, to notice restarts and duplicates.
    by_node: Map<NodeId, SessionId>,
    /// Blacklists of peers whose connection dropped, so a reconnect cannot launder them.
    blacklists: Map<NodeId, RememberedBlacklist>,
}

/// A blacklisted peer's process, remembered until `until`.
#[derive(Debug, Clone, Copy)]
pub(super) struct RememberedBlacklist {
    pub(super) incarnation: Incarnation,
    pub(super) until: Instant,
}

impl Sessions {
    pub(super) fn new(hasher: FixedState) -> Self {
        Sessions {
            by_id: Map::with_hasher(hasher.clone()),
            last_id: 0,
            by_node: Map::with_hasher(hasher.clone()),
            blacklists: Map::with_hasher(hasher),
        }
    }

    /// The id the next session gets.
    pub(super) fn next_id(&mut self) -> SessionId {
        self.last_id += 1;
        SessionId(self.last_id)
    }

    /// Adds a session under the id [`Self::next_id`] gave it.
    pub(super) fn insert(&mut self, sid: SessionId, session: Session) {
        self.by_id.insert(sid, session);
    }

    /// Removes a session, and its node's entry if it named it.
    pub(super) fn remove(&mut self, sid: &SessionId) -> Option<Session> {
        let s = self.by_id.remove(sid)?;
        if let Some(peer) = s.peer {
            self.forget_node(peer.node, *sid);
        }
        Some(s)
    }

    pub(super) fn get(&self, sid: &SessionId) -> Option<&Session> {
        self.by_id.get(sid)
    }

    pub(super) fn get_mut(&mut self, sid: &SessionId) -> Option<&mut Session> {
        self.by_id.get_mut(sid)
    }

    pub(super) fn contains_key(&self, sid: &SessionId) -> bool {
        self.by_id.contains_key(sid)
    }

    pub(super) fn is_empty(&self) -> bool {
        self.by_id.is_empty()
    }

    pub(super) fn len(&self) -> usize {
        self.by_id.len()
    }

    pub(super) fn keys(&self) -> impl Iterator<Item = &SessionId> {
        self.by_id.keys()
    }

    pub(super) fn values(&self) -> impl Iterator<Item = &Session> {
        self.by_id.values()
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = (&SessionId, &Session)> {
        self.by_id.iter()
    }

    /// A dial connected or failed: it no longer counts as the dialing session's.
    pub(super) fn settle_data_dial(&mut self, dial: DialId) {
        for s in self.by_id.values_mut() {
            if s.data_dials.settled(dial).is_some() {
                return;
            }
        }
    }

    /// A dial reached its deadline: the session it was a data connection of, if any, and the
    /// deadline that session's next dials get.
    pub(super) fn data_dial_timed_out(&mut self, dial: DialId) -> Option<(SessionId, Duration)> {
        self.by_id
            .iter_mut()
            .find_map(|(sid, s)| s.data_dials.timed_out(dial).map(|t| (*sid, t)))
    }

    /// The established session of `node`, if any.
    pub(super) fn of_node(&self, node: NodeId) -> Option<SessionId> {
        self.by_node.get(&node).copied()
    }

    /// `sid` is now `node`'s established session.
    pub(super) fn set_node(&mut self, node: NodeId, sid: SessionId) {
        if self.by_id.contains_key(&sid) {
            self.by_node.insert(node, sid);
        }
    }

    /// `sid` is no longer `node`'s session (if it was).
    pub(super) fn forget_node(&mut self, node: NodeId, sid: SessionId) {
        if self.by_node.get(&node) == Some(&sid) {
            self.by_node.remove(&node);
        }
    }

    /// Remembers that `node`'s process was blacklisted, until the blacklist would have
    /// idled out.
    pub(super) fn remember_blacklist(&mut self, node: NodeId, b: RememberedBlacklist) {
        self.blacklists.insert(node, b);
    }

    /// What was remembered of `node`'s blacklisting; a hello of the node takes it.
    pub(super) fn take_blacklist(&mut self, node: NodeId) -> Option<RememberedBlacklist> {
        self.blacklists.remove(&node)
    }
}
