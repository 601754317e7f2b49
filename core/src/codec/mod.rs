//! Control-message codec: length-prefixed, versioned frames. The decoder is total.
//!
//! Frame: `len: u32 LE` (bytes after this field), `version: u8`, `type: u8`, body. Every
//! integer is little-endian. `docs/PROTOCOL.md` documents each body byte by byte.

mod decode;

use bytes::BufMut;
use core::fmt;
use smallvec::SmallVec;

use crate::auth::{Nonce, Proof, NONCE_LEN, PROOF_LEN};
use crate::ids::{Generation, Incarnation, NodeId, PromptDigest, RoomId};
use crate::layout::{
    rows_end, ExtraPool, Heads, ItemPart, Layout, PageRun, Region, DESCRIPTOR_LEN, MAX_EXTRA_POOLS,
    MAX_EXTRA_TENSORS, MAX_ITEM_PARTS,
};
use crate::state::{FailureReason, Role};
use decode::decode_body;

/// The protocol version this crate speaks. Version 2 replaced the token in the hello with a
/// challenge and proofs; version 3 added the frame count to the heartbeat (an older peer is
/// refused: [`ErrorCode::VersionMismatch`]).
pub const PROTOCOL_VERSION: u8 = 9;
/// Bytes before the body: length, version, type.
pub const HEADER_LEN: usize = 6;

/// Where a `Hello` frame's proof starts, from the frame's first byte: after the header and
/// the 65 bytes of fields before it (`docs/PROTOCOL.md`, "Type 1"). The proof is checked
/// there before any other field of the hello is read.
pub const HELLO_PROOF_OFFSET: usize = HEADER_LEN + 65;

/// `RoomRequest::skip_pages` of a decode that wants nothing from this prefill rank.
pub const SKIP_ALL: u32 = u32::MAX;
/// Longest heartbeat interval a hello may announce (10 minutes).
pub const MAX_HEARTBEAT_INTERVAL_MS: u32 = 600_000;
/// Most missed heartbeats a hello may announce.
pub const MAX_HEARTBEAT_MISSES: u32 = 10_000;
/// Longest detail text of an error frame.
pub const MAX_DETAIL_LEN: usize = 256;
/// Longest payload of a [`Message::Transport`] frame.
pub const MAX_TRANSPORT_LEN: usize = 16 * 1024;

/// Everything two endpoints say to each other on the control connection.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Message {
    /// First frame on every session, both directions: a fresh nonce the other side's proof
    /// must cover. The connector sends its own first; the listener answers with its own.
    Challenge {
        /// 32 fresh, unpredictable bytes.
        nonce: Nonce,
    },
    /// Second frame on every session, both directions: who the sender is, with its proof of
    /// the cluster token. The connector's goes first; the listener's only once the
    /// connector's proof checked out.
    Hello(Hello),
    /// Decode -> prefill: decode knows the room but has not granted pages yet.
    RoomPending {
        /// Room.
        room: RoomId,
        /// Attempt of the room.
        generation: Generation,
        /// 0: pages are being allocated; k > 0: queued behind k rooms for lack of capacity.
        queue_position: u32,
    },
    /// Decode -> prefill: pages granted; write the room here.
    RoomRequest(RoomRequest),
    /// Either way: the room concluded on the sender of this frame.
    RoomStatus {
        /// Room.
        room: RoomId,
        /// Attempt of the room.
        generation: Generation,
        /// `None` = success, `Some(reason)` = failed.
        failure: Option<FailureReason>,
    },
    /// Prefill -> decode: the room is alive and at this stage (keeps decode's deadline honest).
    Progress {
        /// Room.
        room: RoomId,
        /// Attempt of the room.
        generation: Generation,
        /// Where the room is on prefill.
        stage: ProgressStage,
    },
    /// Decode -> prefill: stop writing this room; reply with `AbortAck` once drained.
    Abort {
        /// Room.
        room: RoomId,
        /// Attempt of the room.
        generation: Generation,
        /// Why decode gave up.
        reason: FailureReason,
    },
    /// Prefill -> decode: no write for this room is queued or in flight, and none will be.
    AbortAck {
        /// Room.
        room: RoomId,
        /// Attempt of the room.
        generation: Generation,
    },
    /// Either way, every heartbeat interval: liveness plus decode capacity.
    Heartbeat {
        /// Free KV pages (decode); 0 for prefill.
        free_pages: u32,
        /// Rooms queued for capacity (decode); a saturated decode has free_pages 0 or a queue.
        queued_rooms: u32,
        /// Frames the sender of this heartbeat has received on this connection so far: tells
        /// the peer whether its own frames get through, not only whether ours do.
        frames_received: u64,
    },
    /// Control-level echo request; part of probing a blacklisted session.
    Probe {
        /// Echoed back in the ack.
        nonce: u64,
    },
    /// Answer to [`Message::Probe`].
    ProbeAck {
        /// The probe's nonce.
        nonce: u64,
    },
    /// The sender is about to close the session for this reason.
    Error {
        /// What went wrong.
        code: ErrorCode,
        /// Human-readable detail, at most [`MAX_DETAIL_LEN`] bytes.
        detail: String,
    },
    /// Prefill -> decode, one-sided data plane (RDMA) with the checksum option: one
    /// operation's writes completed; the XXH3-64 of its source bytes, slice after slice, for
    /// decode to verify over the bytes that landed before the room may succeed.
    OpChecksum {
        /// Room.
        room: RoomId,
        /// Attempt of the room.
        generation: Generation,
        /// XXH3-64 (seed 0) of the operation's bytes, in slice order.
        checksum: u64,
        /// Where the operation's slices landed, in order (1 to [`MAX_CHECKED_RANGES`]).
        ranges: Vec<LandedRange>,
    },
    /// Bytes for the peer's data-plane backend, opaque to the core (for example the RDMA
    /// hello: queue pair and rkeys), at most [`MAX_TRANSPORT_LEN`].
    Transport {
        /// The backend's bytes.
        payload: Vec<u8>,
    },
}

/// Where one slice of a checked operation landed on decode ([`Message::OpChecksum`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LandedRange {
    /// Region written.
    pub region: Region,
    /// Byte offset in decode's region.
    pub offset: u64,
    /// Bytes of each row (never 0).
    pub len: u64,
    /// Rows (at least 1).
    pub rows: u32,
    /// Bytes from one row's start to the next (0 for one row, at least `len` otherwise).
    pub stride: u64,
}

/// Most ranges one [`Message::OpChecksum`] names.
pub const MAX_CHECKED_RANGES: usize = 4096;

/// Bytes of the largest [`Message::OpChecksum`] frame, header included: a node with the
/// checksum on must accept frames this long.
pub const MAX_OP_CHECKSUM_FRAME: usize =
    HEADER_LEN + 8 + 4 + 8 + 2 + DESCRIPTOR_LEN * MAX_CHECKED_RANGES;

/// The handshake: who the peer is, what memory it registered, how often it speaks, and its
/// proof of the cluster token.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hello {
    /// Prefill or decode.
    pub role: Role,
    /// Rank of the endpoint in its instance (TP/PP index).
    pub rank: u16,
    /// Stable name of the endpoint slot.
    pub node: NodeId,
    /// Process start identity.
    pub incarnation: Incarnation,
    /// Registered memory.
    pub layout: Layout,
    /// First layer this endpoint writes (prefill PP stage), inclusive.
    pub layer_start: u16,
    /// Last layer this endpoint writes, exclusive.
    pub layer_end: u16,
    /// Whether this endpoint writes the aux and state data (the last PP stage).
    pub writes_aux: bool,
    /// The KV heads it holds in every token row (attention TP).
    pub heads: Heads,
    /// How often the sender sends a heartbeat, in milliseconds (at least 1).
    pub heartbeat_interval_ms: u32,
    /// How many of its heartbeats may go missing before its peer may give up (at least 1):
    /// the sender's liveness window is `heartbeat_interval_ms × heartbeat_misses`.
    pub heartbeat_misses: u32,
    /// HMAC-SHA256 proof of the cluster token over both nonces and the hellos (see
    /// `docs/PROTOCOL.md`, "Authentication"). Computed with these 32 bytes set to zero.
    pub proof: Proof,
    /// Whether it checksums every write end to end (`flags` bit 0 on the wire); both ends
    /// of a session must agree.
    pub checksum: bool,
    /// The extra pools it registered (after the proof on the wire).
    pub extras: Vec<ExtraPool>,
}

/// Decode's page grant for one room.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RoomRequest {
    /// Room.
    pub room: RoomId,
    /// Attempt of the room.
    pub generation: Generation,
    /// How many decode ranks will request this room from this prefill rank.
    pub receivers: u8,
    /// Pages at the start of the room the decode already holds: not sent, and `pages` start
    /// after them. [`SKIP_ALL`]: the decode wants nothing from this rank (it only confirms).
    pub skip_pages: u32,
    /// Destination pages in room order (page `i` of the room goes to the `i`-th listed page).
    pub pages: SmallVec<[PageRun; 4]>,
    /// Destination aux row.
    pub aux_slot: Option<u32>,
    /// Destination state slot.
    pub state_slot: Option<u32>,
    /// The tokens the decode wants the room's KV for; `None`: not checked.
    pub prompt: Option<PromptDigest>,
    /// Destination items of each extra pool, in room order.
    pub extras: Vec<SmallVec<[PageRun; 4]>>,
}

impl RoomRequest {
    /// This request as a source asked for nothing sees it: every page skipped, no slot.
    pub fn idle(&self) -> RoomRequest {
        RoomRequest {
            skip_pages: SKIP_ALL,
            pages: SmallVec::new(),
            aux_slot: None,
            state_slot: None,
            extras: Vec::new(),
            ..self.clone()
        }
    }
}

/// Stage of a room on prefill, reported in [`Message::Progress`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ProgressStage {
    /// Request received, waiting for compute.
    Queued,
    /// Chunks are being computed.
    Computing,
    /// Data is moving.
    Transferring,
}

/// Why a peer closes a session.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ErrorCode {
    /// Frames could not be decoded.
    Malformed,
    /// The cluster token did not match.
    BadToken,
    /// Protocol versions differ.
    VersionMismatch,
    /// Memory layouts cannot work together.
    IncompatibleLayout,
    /// Role pairing is wrong (prefill to prefill, ...).
    WrongRole,
    /// The peer violated the protocol.
    ProtocolViolation,
    /// The endpoint is shutting down.
    Shutdown,
    /// Nothing arrived from the peer for the liveness window: the
    /// link or the peer went silent. Not a protocol violation.
    HeartbeatsMissed,
    /// A hello field holds an impossible value; the detail names the field.
    InvalidHello,
    /// The handshake did not complete within the sender's `handshake_timeout`.
    HandshakeTimeout,
    /// The sender's data path did not confirm a fence within its `fence_timeout`: it cannot
    /// show that nothing in flight may still land, so it gives the session up.
    FenceTimeout,
}

impl ErrorCode {
    /// What the receiver of this code fails the session's rooms with.
    pub fn failure_reason(self) -> crate::state::FailureReason {
        use crate::state::FailureReason as R;
        match self {
            ErrorCode::IncompatibleLayout | ErrorCode::VersionMismatch | ErrorCode::WrongRole => {
                R::IncompatiblePeer
            }
            ErrorCode::BadToken => R::Unauthorized,
            ErrorCode::Shutdown => R::PeerShutdown,
            ErrorCode::HeartbeatsMissed | ErrorCode::HandshakeTimeout => R::PeerSilent,
            ErrorCode::Malformed | ErrorCode::ProtocolViolation | ErrorCode::InvalidHello => {
                R::ProtocolError
            }
            ErrorCode::FenceTimeout => R::TransferFailed,
        }
    }

    const ALL: [ErrorCode; 11] = [
        ErrorCode::Malformed,
        ErrorCode::BadToken,
        ErrorCode::VersionMismatch,
        ErrorCode::IncompatibleLayout,
        ErrorCode::WrongRole,
        ErrorCode::ProtocolViolation,
        ErrorCode::Shutdown,
        ErrorCode::HeartbeatsMissed,
        ErrorCode::InvalidHello,
        ErrorCode::HandshakeTimeout,
        ErrorCode::FenceTimeout,
    ];

    /// The two-byte code on the wire (`docs/PROTOCOL.md`, "Type 11").
    pub fn code(self) -> u16 {
        self as u16 + 1
    }

    fn from_code(c: u16) -> Option<Self> {
        Self::ALL.get((c as usize).checked_sub(1)?).copied()
    }
}

/// Frame type codes.
mod ty {
    pub(super) const HELLO: u8 = 1;
    pub(super) const ROOM_PENDING: u8 = 2;
    pub(super) const ROOM_REQUEST: u8 = 3;
    pub(super) const ROOM_STATUS: u8 = 4;
    pub(super) const PROGRESS: u8 = 5;
    pub(super) const ABORT: u8 = 6;
    pub(super) const ABORT_ACK: u8 = 7;
    pub(super) const HEARTBEAT: u8 = 8;
    pub(super) const PROBE: u8 = 9;
    pub(super) const PROBE_ACK: u8 = 10;
    pub(super) const ERROR: u8 = 11;
    pub(super) const TRANSPORT: u8 = 12;
    pub(super) const CHALLENGE: u8 = 13;
    pub(super) const OP_CHECKSUM: u8 = 14;
}

/// Frame type code of [`Message::Hello`] (errors in a hello close the session at once).
pub const HELLO_TYPE: u8 = ty::HELLO;

/// A frame that cannot be decoded. The session that sent it earns a strike.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum DecodeError {
    /// The length prefix exceeds the configured maximum.
    TooLong {
        /// Announced length.
        len: u32,
        /// Configured maximum.
        max: u32,
    },
    /// The length prefix is too small to hold a version and a type.
    TooShort {
        /// Announced length.
        len: u32,
    },
    /// The peer speaks another protocol version.
    UnknownVersion(u8),
    /// No frame type has this code.
    UnknownType(u8),
    /// The body ended before a field of this frame type.
    Truncated {
        /// Frame type code.
        ty: u8,
    },
    /// The body is longer than its fields.
    TrailingBytes {
        /// Frame type code.
        ty: u8,
    },
    /// A field holds a value that has no meaning.
    InvalidField {
        /// Frame type code.
        ty: u8,
        /// Field name.
        field: &'static str,
    },
    /// A `RoomRequest` whose room and generation were read but whose rest is invalid (a
    /// field, or the body's length): the requester is answered for that room at once.
    InvalidRoomRequest {
        /// The room the request names.
        room: RoomId,
        /// The attempt it names.
        generation: Generation,
        /// The invalid field, or `length` for a body too short or too long.
        field: &'static str,
    },
}

impl fmt::Display for DecodeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            DecodeError::TooLong { len, max } => write!(f, "frame length {len} exceeds {max}"),
            DecodeError::TooShort { len } => write!(f, "frame length {len} below header"),
            DecodeError::UnknownVersion(v) => write!(f, "unknown protocol version {v}"),
            DecodeError::UnknownType(t) => write!(f, "unknown frame type {t}"),
            DecodeError::Truncated { ty } => write!(f, "frame type {ty} truncated"),
            DecodeError::TrailingBytes { ty } => write!(f, "frame type {ty} has trailing bytes"),
            DecodeError::InvalidField { ty, field } => {
                write!(f, "frame type {ty} has an invalid {field}")
            }
            DecodeError::InvalidRoomRequest {
                room,
                generation,
                field,
            } => write!(
                f,
                "room request for {room} generation {generation} has an invalid {field}"
            ),
        }
    }
}

impl std::error::Error for DecodeError {}

impl Message {
    /// Whether this is a frame a session carries before its handshake completes (challenge,
    /// hello, or the error that refuses it).
    pub fn is_handshake(&self) -> bool {
        matches!(
            self,
            Message::Challenge { .. } | Message::Hello(_) | Message::Error { .. }
        )
    }

    /// The frame type's name, for logs.
    pub fn name(&self) -> &'static str {
        match self {
            Message::Challenge { .. } => "Challenge",
            Message::Hello(_) => "Hello",
            Message::RoomPending { .. } => "RoomPending",
            Message::RoomRequest(_) => "RoomRequest",
            Message::RoomStatus { .. } => "RoomStatus",
            Message::Progress { .. } => "Progress",
            Message::Abort { .. } => "Abort",
            Message::AbortAck { .. } => "AbortAck",
            Message::Heartbeat { .. } => "Heartbeat",
            Message::Probe { .. } => "Probe",
            Message::ProbeAck { .. } => "ProbeAck",
            Message::Error { .. } => "Error",
            Message::OpChecksum { .. } => "OpChecksum",
            Message::Transport { .. } => "Transport",
        }
    }

    // One arm per message type, the mirror of `decode_body`: kept as one table for the same
    // reason.
    /// Appends this message as one frame to `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        let start = out.len();
        out.put_u32_le(0);
        out.put_u8(PROTOCOL_VERSION);
        match self {
            Message::Challenge { nonce } => {
                out.put_u8(ty::CHALLENGE);
                out.put_slice(nonce);
            }
            Message::Hello(h) => {
                out.put_u8(ty::HELLO);
                out.put_u8(h.role.code());
                out.put_u16_le(h.rank);
                out.put_u64_le(h.node.0);
                out.put_u64_le(h.incarnation.0);
                put_layout(out, &h.layout);
                out.put_u16_le(h.layer_start);
                out.put_u16_le(h.layer_end);
                out.put_u8(u8::from(h.writes_aux));
                out.put_u16_le(h.heads.total);
                out.put_u16_le(h.heads.start);
                out.put_u16_le(h.heads.count);
                out.put_u32_le(h.heads.head_bytes);
                out.put_u32_le(h.heartbeat_interval_ms);
                out.put_u32_le(h.heartbeat_misses);
                out.put_slice(&h.proof);
                out.put_u8(u8::from(h.checksum));
                out.put_u8(h.extras.len() as u8);
                for pool in &h.extras {
                    out.put_u32_le(pool.items);
                    out.put_u16_le(pool.item_bytes.len() as u16);
                    for b in &pool.item_bytes {
                        out.put_u32_le(*b);
                    }
                    let split = !pool.parts.is_empty();
                    out.put_u8(u8::from(split));
                    for t in (0..pool.item_bytes.len()).filter(|_| split) {
                        let parts = pool.parts_of(t);
                        out.put_u8(parts.len() as u8);
                        for p in parts {
                            out.put_u32_le(p.offset);
                            out.put_u32_le(p.rows);
                            out.put_u32_le(p.stride);
                            out.put_u16_le(p.units);
                            out.put_u16_le(p.first);
                            out.put_u16_le(p.count);
                            out.put_u32_le(p.unit_bytes);
                        }
                    }
                }
            }
            Message::RoomPending {
                room,
                generation,
                queue_position,
            } => {
                out.put_u8(ty::ROOM_PENDING);
                put_room(out, *room, *generation);
                out.put_u32_le(*queue_position);
            }
            Message::RoomRequest(r) => {
                out.put_u8(ty::ROOM_REQUEST);
                put_room(out, r.room, r.generation);
                out.put_u8(r.receivers);
                out.put_u32_le(r.skip_pages);
                put_opt_u32(out, r.aux_slot);
                put_opt_u32(out, r.state_slot);
                out.put_u8(u8::from(r.prompt.is_some()));
                out.put_u64_le(r.prompt.map_or(0, |p| p.0));
                put_runs(out, &r.pages);
                out.put_u8(r.extras.len() as u8);
                for runs in &r.extras {
                    put_runs(out, runs);
                }
            }
            Message::RoomStatus {
                room,
                generation,
                failure,
            } => {
                out.put_u8(ty::ROOM_STATUS);
                put_room(out, *room, *generation);
                out.put_u8(failure.map_or(0, FailureReason::code));
            }
            Message::Progress {
                room,
                generation,
                stage,
            } => {
                out.put_u8(ty::PROGRESS);
                put_room(out, *room, *generation);
                out.put_u8(match stage {
                    ProgressStage::Queued => 1,
                    ProgressStage::Computing => 2,
                    ProgressStage::Transferring => 3,
                });
            }
            Message::Abort {
                room,
                generation,
                reason,
            } => {
                out.put_u8(ty::ABORT);
                put_room(out, *room, *generation);
                out.put_u8(reason.code());
            }
            Message::AbortAck { room, generation } => {
                out.put_u8(ty::ABORT_ACK);
                put_room(out, *room, *generation);
            }
            Message::Heartbeat {
                free_pages,
                queued_rooms,
                frames_received,
            } => {
                out.put_u8(ty::HEARTBEAT);
                out.put_u32_le(*free_pages);
                out.put_u32_le(*queued_rooms);
                out.put_u64_le(*frames_received);
            }
            Message::Probe { nonce } => {
                out.put_u8(ty::PROBE);
                out.put_u64_le(*nonce);
            }
            Message::ProbeAck { nonce } => {
                out.put_u8(ty::PROBE_ACK);
                out.put_u64_le(*nonce);
            }
            Message::Error { code, detail } => {
                out.put_u8(ty::ERROR);
                out.put_u16_le(code.code());
                let mut end = detail.len().min(MAX_DETAIL_LEN);
                while !detail.is_char_boundary(end) {
                    end -= 1;
                }
                out.put_u16_le(end as u16);
                out.put_slice(&detail.as_bytes()[..end]);
            }
            Message::OpChecksum {
                room,
                generation,
                checksum,
                ranges,
            } => {
                out.put_u8(ty::OP_CHECKSUM);
                put_room(out, *room, *generation);
                out.put_u64_le(*checksum);
                let n = ranges.len().min(MAX_CHECKED_RANGES);
                out.put_u16_le(n as u16);
                for r in &ranges[..n] {
                    out.put_u32_le(r.region.code());
                    out.put_u64_le(r.offset);
                    out.put_u64_le(r.len);
                    out.put_u32_le(r.rows);
                    out.put_u64_le(r.stride);
                }
            }
            Message::Transport { payload } => {
                out.put_u8(ty::TRANSPORT);
                let end = payload.len().min(MAX_TRANSPORT_LEN);
                out.put_u16_le(end as u16);
                out.put_slice(&payload[..end]);
            }
        }
        let len = (out.len() - start - 4) as u32;
        out[start..start + 4].copy_from_slice(&len.to_le_bytes());
    }

    /// Encoded size of this message in bytes, header included.
    pub fn encoded_len(&self) -> usize {
        let mut v = Vec::new();
        self.encode(&mut v);
        v.len()
    }

    /// Decodes the first frame of `buf`.
    ///
    /// `Ok(None)` means more bytes are needed; `Ok(Some((msg, used)))` consumed `used` bytes.
    /// A frame whose length prefix exceeds `max_frame_len` is refused before its body arrives.
    pub fn decode(buf: &[u8], max_frame_len: u32) -> Result<Option<(Message, usize)>, DecodeError> {
        let Some(prefix) = buf.get(..4) else {
            return Ok(None);
        };
        let len = u32::from_le_bytes([prefix[0], prefix[1], prefix[2], prefix[3]]);
        if len > max_frame_len {
            return Err(DecodeError::TooLong {
                len,
                max: max_frame_len,
            });
        }
        if len < 2 {
            return Err(DecodeError::TooShort { len });
        }
        let total = 4 + len as usize;
        let Some(frame) = buf.get(4..total) else {
            return Ok(None);
        };
        let version = frame[0];
        if version != PROTOCOL_VERSION {
            return Err(DecodeError::UnknownVersion(version));
        }
        let msg = decode_body(frame[1], &frame[2..])?;
        Ok(Some((msg, total)))
    }
}

fn put_room(out: &mut Vec<u8>, room: RoomId, generation: Generation) {
    out.put_u64_le(room.0);
    out.put_u32_le(generation);
}

fn put_runs(out: &mut Vec<u8>, runs: &[PageRun]) {
    out.put_u32_le(runs.len() as u32);
    for run in runs {
        out.put_u32_le(run.start);
        out.put_u32_le(run.len);
    }
}

fn put_opt_u32(out: &mut Vec<u8>, v: Option<u32>) {
    out.put_u32_le(v.unwrap_or(u32::MAX));
}

fn put_layout(out: &mut Vec<u8>, l: &Layout) {
    out.put_u16_le(l.layers);
    out.put_u8(l.planes);
    out.put_u32_le(l.page_bytes);
    out.put_u32_le(l.pages);
    out.put_u32_le(l.aux_bytes);
    out.put_u32_le(l.state_bytes);
    out.put_u32_le(l.slots);
}
