//! `kvferry-core`: the deterministic, IO-free state machine of kvferry. It owns every decision
//! about moving an LLM request's KV cache from prefill to decode; it never touches a socket, a
//! clock, a thread or KV memory.
//!
//! # The lifecycle in one page
//!
//! An [`Endpoint`] is one rank, prefill or decode. A driver (tokio, glommio, the simulation in
//! [`sim`]) feeds it inputs with the current time and carries out its outputs.
//!
//! 1. **Sessions.** When a control connection to a peer is up, the driver calls
//!    [`Endpoint::open_session`] (it dialed) or [`Endpoint::accept_session`] (it accepted).
//!    Both sides exchange challenges, then a [`codec::Hello`] (role, rank, node, incarnation,
//!    memory [`Layout`], heartbeat interval) carrying an HMAC proof of the cluster token over
//!    both challenges ([`auth`]); the token itself never goes on the wire, and a listener
//!    says who it is only to a connector that proved the token. A wrong proof, same role or
//!    an incompatible layout rejects that peer only. Data connections prove the session's
//!    key ([`Endpoint::data_key`], [`Endpoint::admit_data`]).
//! 2. **Rooms.** A room is one request's KV handoff, named by a router-chosen [`RoomId`] and a
//!    [`Generation`] (attempt). Decode opens a receiver room with [`Endpoint::open_receiver`]
//!    naming its source sessions and grants pages ([`Endpoint::grant_pages`], or at once);
//!    this sends a `RoomRequest` to each prefill rank. Prefill opens the sender room with
//!    [`Endpoint::open_sender`]; it is `Bootstrapping` until every expected request arrived,
//!    then `WaitingForInput`.
//! 3. **Transfer.** Prefill calls [`Endpoint::send_chunk`] for each chunk (the last one
//!    flagged), whole-batch or layer by layer with [`Endpoint::mark_layer_ready`]. The core
//!    plans [`TransferOp`]s (coalesced page runs, bounded size, aux and state last) and hands
//!    them out through [`Endpoint::poll_transfer`]; the driver reports each with
//!    [`Endpoint::handle_transfer_result`]. Transient failures are retried with jittered
//!    backoff; exhausted operations fail the room and count against the session, which is
//!    blacklisted at `session_failure_threshold` and probed until it recovers. Once the last
//!    chunk was sent, [`Event::LayerDelivered`] tells prefill, layer by layer and in order,
//!    when every operation of a layer was acknowledged (what overlap measurements and staging
//!    buffers need).
//! 4. **Conclusion.** When every operation of the last chunk is acknowledged, prefill sends
//!    `RoomStatus(Success)`; decode reaches `Success` once every source said so. Any failure
//!    is pushed to the other side at once with its typed [`FailureReason`].
//! 5. **Release.** [`Event::Releasable`] says the room's pages can be reused. On decode this
//!    comes only after every source acknowledged the drain (`AbortAck`) or its session was
//!    fenced ([`Action::FenceSession`] carried out and confirmed): an aborted room's pages are
//!    quarantined, never released on a plain timer.
//!
//! Every non-terminal state has a deadline ([`Timer`]); [`Endpoint::poll_timeout`] says the
//! next one and why. [`consensus`] combines the states of several ranks without ever
//! asserting on skew. The same inputs in the same order give the same outputs.
//!
//! The one state the core shares is decode's [`GrantTable`]: receive paths on other threads
//! admit writes against it without the driver's lock (behind its own short lock), and count
//! what is landing there so that no release hands pages on under a write; only the core
//! changes what it grants, and whatever the table does not admit goes to the core.
//!
//! Drain contract, errors and method groups: see [`Endpoint`].
#![forbid(unsafe_code)]
#![deny(missing_docs)]

mod api;
pub mod auth;
pub mod codec;
pub mod config;
pub mod consensus;
pub mod counters;
mod endpoint;
pub mod ids;
pub mod layout;
pub mod plan;
pub mod rng;
pub mod sim;
pub mod state;
mod timer;

pub use api::{
    Action, ApiError, Capacity, Chunk, ConnectFailure, DataRefusal, EndpointInfo, Event, Grant,
    Link, OpKind, PeerInfo, RejectReason, SessionState, SessionStats, Sessions, TransferOp,
    TransferOutcome, WritePermit, WriteRefused,
};
pub use auth::SessionKey;
pub use config::{Config, ConfigError};
pub use counters::Counters;
pub use endpoint::{Endpoint, GrantTable};
pub use ids::{
    ConnId, DialId, DrainId, Generation, Incarnation, NodeId, PromptDigest, RoomId, SessionId,
    TargetId, TransferId,
};
pub use layout::{
    rows_end, ExtraCopies, ExtraPool, Heads, ItemCopy, ItemPart, Layout, LayoutMismatch, PageRun,
    PartCopy, Region, Slice, DESCRIPTOR_LEN,
};
pub use state::{FailureReason, InvalidTransition, KvPoll, Role};
pub use timer::Timer;
