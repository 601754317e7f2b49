//! Why recent sessions ended, for rooms opened over them late.
//!
//! Invariants of [`EndedSessions`]: it holds at most [`ENDED_KEPT`] sessions, each once, and
//! forgets the oldest first; a session's reason is the last one recorded for it.

use std::collections::VecDeque;

use foldhash::fast::FixedState;

use crate::ids::SessionId;
use crate::state::FailureReason;

use super::Map;

/// How many ended sessions keep their reason for rooms opened over them late.
const ENDED_KEPT: usize = 1024;

/// Sessions that ended for good, with their reason (the last [`ENDED_KEPT`]): a room opened
/// over one fails at once with that reason instead of being refused.
#[derive(Debug)]
pub(super) struct EndedSessions {
    reasons: Map<SessionId, FailureReason>,
    order: VecDeque<SessionId>,
}

impl EndedSessions {
    pub(super) fn new(hasher: FixedState) -> Self {
        EndedSessions {
            reasons: Map::with_hasher(hasher),
            order: VecDeque::new(),
        }
    }

    /// Why `session` ended, if it ended for good recently.
    pub(super) fn reason(&self, session: SessionId) -> Option<FailureReason> {
        self.reasons.get(&session).copied()
    }

    /// Keeps why `session` ended (a later reason replaces an earlier one), forgetting the
    /// oldest beyond [`ENDED_KEPT`].
    pub(super) fn remember(&mut self, session: SessionId, reason: FailureReason) {
        if self.reasons.insert(session, reason).is_none() {
            self.order.push_back(session);
        }
        while self.order.len() > ENDED_KEPT {
            if let Some(old) = self.order.pop_front() {
                self.reasons.remove(&old);
            }
        }
    }
}
