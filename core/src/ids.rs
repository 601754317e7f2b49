//! Handles: small copyable newtypes that name things owned by an [`crate::Endpoint`].

use core::fmt;

macro_rules! id_type {
    ($(#[$doc:meta])* $name:ident($inner:ty), $prefix:literal) => {
        $(#[$doc])*
        #[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Default)]
        pub struct $name(pub $inner);

        impl fmt::Debug for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                write!(f, concat!($prefix, "{}"), self.0)
            }
        }

        impl fmt::Display for $name {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                fmt::Debug::fmt(self, f)
            }
        }
    };
}

id_type!(
    /// One request's KV handoff, chosen by the router and shared by every rank of both sides.
    RoomId(u64),
    "room#"
);
id_type!(
    /// The link from this endpoint to one peer endpoint over one control connection.
    ///
    /// Allocated by [`crate::Endpoint::open_session`]; the driver maps it to its sockets.
    SessionId(u32),
    "session#"
);
id_type!(
    /// A peer this endpoint keeps a session with, reconnecting when it drops
    /// ([`crate::Endpoint::add_target`]).
    TargetId(u32),
    "target#"
);
id_type!(
    /// A connection this node's listener accepted, before it is a session's control or data
    /// connection ([`crate::Endpoint::handle_accepted`]).
    ConnId(u64),
    "conn#"
);
id_type!(
    /// A connection attempt the driver started, until it connected or failed
    /// ([`crate::Endpoint::handle_dial_started`]).
    DialId(u64),
    "dial#"
);
id_type!(
    /// A replaced data path whose outstanding operations the driver still collects
    /// ([`crate::Endpoint::handle_drain_started`]).
    DrainId(u64),
    "drain#"
);
id_type!(
    /// One data-path operation emitted by [`crate::Endpoint::poll_transfer`].
    TransferId(u64),
    "op#"
);
id_type!(
    /// A stable name of an endpoint process slot (host + rank), constant across restarts.
    NodeId(u64),
    "node#"
);
id_type!(
    /// A random number chosen at each process start: a new value means the peer restarted.
    Incarnation(u64),
    "inc#"
);

/// Attempt number of a room: a router replay or retry of the same [`RoomId`] uses a higher one.
///
/// Every control message and data write names `(room, generation)`, so a late message of an
/// earlier attempt can never touch a later one.
pub type Generation = u32;

/// The identity of the tokens whose KV a room carries: XXH3-64 (seed 0) of their ids, each
/// as a little-endian `u32`, in order. Both sides name it, so a room handed to another
/// prompt's request is refused (`prompt_mismatch`) instead of loading that prompt's KV.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct PromptDigest(pub u64);

impl PromptDigest {
    /// The digest of `tokens`, the prompt's token ids whose KV the room carries.
    pub fn of_tokens(tokens: &[u32]) -> PromptDigest {
        use core::hash::Hasher;
        let mut hasher = twox_hash::XxHash3_64::with_seed(0);
        for t in tokens {
            hasher.write(&t.to_le_bytes());
        }
        PromptDigest(hasher.finish())
    }
}

impl fmt::Debug for PromptDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "prompt#{:016x}", self.0)
    }
}

impl fmt::Display for PromptDigest {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}
