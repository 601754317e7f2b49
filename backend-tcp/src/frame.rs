//! Data-plane frames (see `docs/PROTOCOL.md`, "Data plane"). Decoders are total.

use kvferry_core::auth::{Nonce, Proof, SessionTag, PROOF_LEN, TAG_LEN};
use kvferry_core::{Generation, Region, RoomId, Slice, TransferId};

/// First bytes of every connection to a kvferry listener.
pub const MAGIC: [u8; 4] = *b"KVF1";
/// Connection kind: control (the core's frames follow).
pub const KIND_CONTROL: u8 = 1;
/// Connection kind: data (write batches follow).
pub const KIND_DATA: u8 = 2;
/// Size of a write header.
pub const WRITE_HEADER_LEN: usize = 33;
/// Size of one slice descriptor.
pub const SLICE_DESC_LEN: usize = kvferry_core::DESCRIPTOR_LEN;
/// Size of an acknowledgement.
pub const ACK_LEN: usize = 9;
/// Frame type of a write batch.
pub const FRAME_WRITE: u8 = 1;
/// Frame type of a write batch followed by the XXH3-64 of its payload (8 bytes,
/// little-endian): sessions with the end-to-end checksum on.
pub const FRAME_WRITE_CHECKED: u8 = 2;
/// Size of the checksum trailer of a [`FRAME_WRITE_CHECKED`] batch.
pub const CHECKSUM_LEN: usize = 8;

/// Length of a data listener's challenge, sent right after the connector's magic and kind.
pub const DATA_CHALLENGE_LEN: usize = kvferry_core::auth::NONCE_LEN;
/// Length of a data hello: the session's tag and the proof.
pub const DATA_HELLO_LEN: usize = kvferry_core::auth::TAG_LEN + kvferry_core::auth::PROOF_LEN;

/// A data connection's answer to its listener's challenge: which session it belongs to, and
/// proof that it holds that session's key (never the cluster token).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DataHello {
    /// The session's tag ([`kvferry_core::SessionKey::tag`]).
    pub tag: SessionTag,
    /// [`kvferry_core::SessionKey::prove`] over the listener's challenge.
    pub proof: Proof,
}

impl DataHello {
    /// The answer to `challenge` for the session of `key`.
    pub fn answer(key: &kvferry_core::SessionKey, challenge: &Nonce) -> Self {
        DataHello {
            tag: key.tag(),
            proof: key.prove(challenge),
        }
    }

    /// Encodes the hello (tag, then proof).
    pub fn encode(&self) -> [u8; DATA_HELLO_LEN] {
        let mut out = [0u8; DATA_HELLO_LEN];
        out[..TAG_LEN].copy_from_slice(&self.tag);
        out[TAG_LEN..].copy_from_slice(&self.proof);
        out
    }

    /// Decodes a hello; every 48 bytes are one (the listener's check decides).
    pub fn decode(b: &[u8; DATA_HELLO_LEN]) -> Self {
        let mut tag = [0u8; TAG_LEN];
        tag.copy_from_slice(&b[..TAG_LEN]);
        let mut proof = [0u8; PROOF_LEN];
        proof.copy_from_slice(&b[TAG_LEN..]);
        DataHello { tag, proof }
    }
}

/// The fixed header of a write batch.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct WriteHeader {
    /// The sender's operation id, echoed in the acknowledgement.
    pub op: TransferId,
    /// Room written (0 for probes).
    pub room: RoomId,
    /// Its generation.
    pub generation: Generation,
    /// Number of slice descriptors that follow.
    pub slices: u32,
    /// Payload bytes after the descriptors: the sum of the slice lengths.
    pub payload: u64,
    /// Whether the payload is followed by its XXH3-64 ([`FRAME_WRITE_CHECKED`]).
    pub checked: bool,
}

impl WriteHeader {
    /// Encodes the header into `out`.
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.push(if self.checked {
            FRAME_WRITE_CHECKED
        } else {
            FRAME_WRITE
        });
        out.extend_from_slice(&self.op.0.to_le_bytes());
        out.extend_from_slice(&self.room.0.to_le_bytes());
        out.extend_from_slice(&self.generation.to_le_bytes());
        out.extend_from_slice(&self.slices.to_le_bytes());
        out.extend_from_slice(&self.payload.to_le_bytes());
    }

    /// Decodes and bounds a header.
    pub fn decode(
        b: &[u8; WRITE_HEADER_LEN],
        max_slices: u32,
        max_payload: u64,
    ) -> Result<Self, FrameError> {
        if b[0] != FRAME_WRITE && b[0] != FRAME_WRITE_CHECKED {
            return Err(FrameError::UnknownType(b[0]));
        }
        let u64_at = |i: usize| {
            let mut a = [0u8; 8];
            a.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(a)
        };
        let u32_at = |i: usize| {
            let mut a = [0u8; 4];
            a.copy_from_slice(&b[i..i + 4]);
            u32::from_le_bytes(a)
        };
        let h = WriteHeader {
            op: TransferId(u64_at(1)),
            room: RoomId(u64_at(9)),
            generation: u32_at(17),
            slices: u32_at(21),
            payload: u64_at(25),
            checked: b[0] == FRAME_WRITE_CHECKED,
        };
        if h.slices == 0 || h.slices > max_slices {
            return Err(FrameError::TooManySlices {
                slices: h.slices,
                max: max_slices,
            });
        }
        if h.payload > max_payload {
            return Err(FrameError::TooLarge {
                bytes: h.payload,
                max: max_payload,
            });
        }
        Ok(h)
    }
}

/// Encodes one slice descriptor (destination side only: region, offset, row length, rows,
/// stride).
pub fn encode_slice(s: &Slice, out: &mut Vec<u8>) {
    out.extend_from_slice(&s.region.code().to_le_bytes());
    out.extend_from_slice(&s.dst_offset.to_le_bytes());
    out.extend_from_slice(&s.len.to_le_bytes());
    out.extend_from_slice(&s.rows.to_le_bytes());
    out.extend_from_slice(&s.dst_stride.to_le_bytes());
}

/// Decodes the descriptor table and checks it adds up to the header's payload and carries at
/// most `max_rows` rows in all (the receiver's `max_op_slices`: what one write may make it
/// place and account, whatever its bytes).
pub fn decode_slices(table: &[u8], payload: u64, max_rows: u32) -> Result<Vec<Slice>, FrameError> {
    if table.len() % SLICE_DESC_LEN != 0 {
        return Err(FrameError::Malformed("slice table length"));
    }
    let mut out = Vec::with_capacity(table.len() / SLICE_DESC_LEN);
    let mut total = 0u64;
    let mut rows_total = 0u64;
    for d in table.chunks_exact(SLICE_DESC_LEN) {
        let mut r = [0u8; 4];
        r.copy_from_slice(&d[0..4]);
        let region =
            Region::from_code(u32::from_le_bytes(r)).ok_or(FrameError::Malformed("region"))?;
        let mut o = [0u8; 8];
        o.copy_from_slice(&d[4..12]);
        let offset = u64::from_le_bytes(o);
        o.copy_from_slice(&d[12..20]);
        let len = u64::from_le_bytes(o);
        r.copy_from_slice(&d[20..24]);
        let rows = u32::from_le_bytes(r);
        o.copy_from_slice(&d[24..32]);
        let stride = u64::from_le_bytes(o);
        if kvferry_core::rows_end(offset, len, rows, stride).is_none() {
            return Err(FrameError::Malformed("slice rows"));
        }
        rows_total += u64::from(rows);
        if rows_total > u64::from(max_rows) {
            return Err(FrameError::Malformed("more rows than max_op_slices"));
        }
        total = total
            .checked_add(len * u64::from(rows))
            .ok_or(FrameError::Malformed("payload overflow"))?;
        out.push(Slice {
            region,
            src_offset: offset,
            dst_offset: offset,
            len,
            rows,
            src_stride: stride,
            dst_stride: stride,
        });
    }
    if total != payload {
        return Err(FrameError::Malformed(
            "payload length differs from the slices",
        ));
    }
    Ok(out)
}

/// Outcome codes carried in acknowledgements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AckStatus {
    /// Every byte applied.
    Applied = 0,
    /// Refused by the receiver's checks; nothing was written.
    Refused = 1,
    /// The bytes landed but their XXH3-64 differs from the trailer: the receiver failed the
    /// room (`checksum_mismatch`). The writer treats it as a refusal.
    Corrupt = 2,
}

/// Encodes an acknowledgement.
pub fn encode_ack(op: TransferId, status: AckStatus) -> [u8; ACK_LEN] {
    let mut b = [0u8; ACK_LEN];
    b[..8].copy_from_slice(&op.0.to_le_bytes());
    b[8] = status as u8;
    b
}

/// Decodes an acknowledgement.
pub fn decode_ack(b: &[u8; ACK_LEN]) -> Result<(TransferId, AckStatus), FrameError> {
    let mut a = [0u8; 8];
    a.copy_from_slice(&b[..8]);
    let status = match b[8] {
        0 => AckStatus::Applied,
        1 => AckStatus::Refused,
        2 => AckStatus::Corrupt,
        _ => return Err(FrameError::Malformed("ack status")),
    };
    Ok((TransferId(u64::from_le_bytes(a)), status))
}

/// A data-plane frame that cannot be accepted. The connection carrying it is closed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum FrameError {
    /// Not a kvferry connection.
    BadMagic,
    /// Unknown connection kind or frame type.
    UnknownType(u8),
    /// More slices than the configured maximum.
    TooManySlices {
        /// Announced.
        slices: u32,
        /// Allowed.
        max: u32,
    },
    /// More payload than the configured maximum.
    TooLarge {
        /// Announced.
        bytes: u64,
        /// Allowed.
        max: u64,
    },
    /// A field holds an impossible value.
    Malformed(&'static str),
    /// No established session matches the connecting peer.
    UnknownPeer,
}

impl std::fmt::Display for FrameError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            FrameError::BadMagic => write!(f, "not a kvferry connection"),
            FrameError::UnknownType(t) => write!(f, "unknown connection kind or frame type {t}"),
            FrameError::TooManySlices { slices, max } => {
                write!(f, "{slices} slices exceed the maximum {max}")
            }
            FrameError::TooLarge { bytes, max } => {
                write!(f, "{bytes} payload bytes exceed the maximum {max}")
            }
            FrameError::Malformed(what) => write!(f, "malformed {what}"),
            FrameError::UnknownPeer => write!(f, "no established session for this peer"),
        }
    }
}

impl std::error::Error for FrameError {}
