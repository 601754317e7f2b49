//! What an embedder, a driver or a test may read of the endpoint: its identity, knobs and
//! counters, and each room's and session's state.

use crate::api::{ApiError, Capacity, EndpointInfo, PeerInfo, SessionState, SessionStats};
use crate::config::Config;
use crate::counters::Counters;
use crate::ids::{Generation, RoomId, SessionId};
use crate::state::KvPoll;

use super::{Endpoint, GrantTable};
use std::sync::Arc;

impl Endpoint {
    /// This endpoint's identity.
    pub fn info(&self) -> &EndpointInfo {
        &self.local
    }

    /// Decode: the table of live rooms' grants, for a receive path to admit writes without
    /// the driver's lock ([`GrantTable::begin`]); whatever it does not admit goes to
    /// [`Endpoint::begin_write`].
    pub fn grant_table(&self) -> Arc<GrantTable> {
        self.grants.clone()
    }

    /// Whether this endpoint may accept connections on an address (`loopback` or not):
    /// beyond loopback only with a cluster token of its own, unless `allow_no_token`.
    pub fn check_listen(&self, loopback: bool) -> Result<(), ApiError> {
        if loopback || self.config.allow_no_token {
            return Ok(());
        }
        let token = if self.local.token.is_empty() {
            "no cluster token"
        } else if self.local.token == crate::auth::DEMO_TOKEN {
            "the built-in demo token"
        } else {
            return Ok(());
        };
        Err(ApiError::OpenListener { token })
    }

    /// The configuration in force.
    pub fn config(&self) -> &Config {
        &self.config
    }

    /// Counters so far.
    pub fn counters(&self) -> &Counters {
        &self.counters
    }

    /// State of a live room, or the outcome of a concluded one still remembered.
    pub fn room_state(&self, room: RoomId) -> Option<KvPoll> {
        match self.rooms.get(&room) {
            Some(r) => Some(r.state),
            None => self.tombstones.get(room).map(|t| t.1),
        }
    }

    /// Generation of a live room.
    pub fn room_generation(&self, room: RoomId) -> Option<Generation> {
        self.rooms.get(&room).map(|r| r.generation)
    }

    /// Number of room records held (live or waiting to become releasable).
    pub fn live_rooms(&self) -> usize {
        self.rooms.len()
    }

    /// Ids of the rooms held, in no particular order.
    pub fn room_ids(&self) -> impl Iterator<Item = RoomId> + '_ {
        self.rooms.ids()
    }

    /// Number of room operations queued, waiting for a retry, or in flight (probes excluded).
    pub fn live_ops(&self) -> usize {
        self.ops.of_rooms()
    }

    /// Number of armed deadlines.
    pub fn armed_timers(&self) -> usize {
        self.timers.len()
    }

    /// State of a session.
    pub fn session_state(&self, session: SessionId) -> Option<SessionState> {
        self.sessions.get(&session).map(|s| s.state)
    }

    /// Who is behind an established session.
    pub fn peer(&self, session: SessionId) -> Option<PeerInfo> {
        self.sessions.get(&session).and_then(|s| s.peer)
    }

    /// Capacity last advertised by the decode peer of a session (prefill admission control).
    pub fn peer_capacity(&self, session: SessionId) -> Option<Capacity> {
        self.sessions.get(&session).and_then(|s| s.capacity)
    }

    /// Per-session data-path figures, for exporters.
    pub fn session_stats(&self, session: SessionId) -> Option<SessionStats> {
        self.sessions.get(&session).map(|s| SessionStats {
            in_flight: s.ops.in_flight(),
            queued: s.ops.queued() as u32,
            ..s.stats
        })
    }

    /// Sessions blacklisted right now.
    pub fn blacklisted_sessions(&self) -> usize {
        self.sessions
            .values()
            .filter(|s| s.state == SessionState::Blacklisted)
            .count()
    }

    /// Consecutive exhausted operations of a session.
    pub fn session_failures(&self, session: SessionId) -> Option<u32> {
        self.sessions.get(&session).map(|s| s.probation.failures())
    }

    /// Ids of the open sessions.
    pub fn session_ids(&self) -> impl Iterator<Item = SessionId> + '_ {
        self.sessions.keys().copied()
    }
}
