//! Who carries a taken-over session's work: the sessions a fresh connection of the same peer
//! superseded, and the heir every link to a taken-over session resolves to.
//!
//! Invariants of [`Successions`]: a session is superseded by at most one session, and the
//! chain of successors from any session ends (each successor is newer than what it
//! supersedes). An heir is never a session that was itself taken over or that ended for
//! good: a take-over moves every heir that named the old session to the new one, and a
//! session that ends for good takes its heir entries with it.

use foldhash::fast::FixedState;

use crate::ids::SessionId;

use super::Map;

/// Sessions taken over by a fresh connection and who carries their work now.
#[derive(Debug)]
pub(super) struct Successions {
    /// Taken-over sessions whose connection is not gone yet, with the session that took
    /// each over: their writes are refused and their late messages ignored.
    superseded: Map<SessionId, SessionId>,
    /// Every taken-over session with the live session that carries its work: a link an
    /// embedder holds to one resolves to it.
    heirs: Map<SessionId, SessionId>,
}

impl Successions {
    pub(super) fn new(hasher: FixedState) -> Self {
        Successions {
            superseded: Map::with_hasher(hasher.clone()),
            heirs: Map::with_hasher(hasher),
        }
    }

    /// `new` takes `old`'s work over: `old` is superseded until its connection is gone, and
    /// `old`, with every session whose work `old` carried, now resolves to `new`.
    pub(super) fn take_over(&mut self, old: SessionId, new: SessionId) {
        self.superseded.insert(old, new);
        for heir in self.heirs.values_mut().filter(|h| **h == old) {
            *heir = new;
        }
        self.heirs.insert(old, new);
    }

    /// The live session that carries `session`'s work: itself, or the one that took it over.
    pub(super) fn heir(&self, session: SessionId) -> SessionId {
        self.heirs.get(&session).copied().unwrap_or(session)
    }

    /// Whether a fresh connection took `session` over while its connection still exists.
    pub(super) fn is_superseded(&self, session: SessionId) -> bool {
        self.superseded.contains_key(&session)
    }

    /// The sessions that carried `session`'s work after it, nearest first (empty unless it
    /// was taken over and its connection still exists).
    pub(super) fn successors(&self, session: SessionId) -> impl Iterator<Item = SessionId> + '_ {
        std::iter::successors(self.superseded.get(&session).copied(), |s| {
            self.superseded.get(s).copied()
        })
    }

    /// `session`'s connection is gone. `true` if it ended for good (it was not taken
    /// over): links to it, or to sessions whose work it carried, end with it.
    pub(super) fn connection_gone(&mut self, session: SessionId) -> bool {
        if self.superseded.remove(&session).is_some() {
            return false;
        }
        self.heirs.retain(|_, heir| *heir != session);
        true
    }
}

#[cfg(test)]
mod tests {
    use super::{FixedState, SessionId, Successions};

    fn sid(n: u32) -> SessionId {
        SessionId(n)
    }

    #[test]
    fn a_link_to_a_twice_taken_over_session_resolves_to_the_latest() {
        let mut s = Successions::new(FixedState::default());
        s.take_over(sid(1), sid(2));
        s.take_over(sid(2), sid(3));
        assert_eq!(s.heir(sid(1)), sid(3));
        assert_eq!(s.heir(sid(2)), sid(3));
        assert_eq!(s.successors(sid(1)).collect::<Vec<_>>(), [sid(2), sid(3)]);
    }

    #[test]
    fn a_superseded_connection_that_goes_leaves_its_heir_in_place() {
        let mut s = Successions::new(FixedState::default());
        s.take_over(sid(1), sid(2));
        assert!(!s.connection_gone(sid(1)));
        assert!(!s.is_superseded(sid(1)));
        assert_eq!(s.heir(sid(1)), sid(2));
    }

    #[test]
    fn an_heir_that_ends_for_good_takes_the_links_to_it_along() {
        let mut s = Successions::new(FixedState::default());
        s.take_over(sid(1), sid(2));
        assert!(s.connection_gone(sid(2)));
        assert_eq!(s.heir(sid(1)), sid(1));
    }
}
