//! The fields two RDMA peers exchange over the control channel before any write: how to
//! reach the other's queue pair, and which registered regions it may write, with the rkeys.
//! Layout in `docs/PROTOCOL.md` ("RDMA hello").

use kvferry_core::{Region, Slice};

/// Packet sequence numbers and QP numbers are 24-bit.
pub const PSN_MASK: u32 = 0x00FF_FFFF;
/// Most regions one hello may announce.
const MAX_REGIONS: usize = 4096;
const VERSION: u8 = 1;
const FIXED_LEN: usize = 1 + 4 + 4 + 2 + 1 + 16 + 1 + 2;
const REGION_LEN: usize = 4 + 8 + 8 + 4;

/// One registered region the sender of the hello lets its peer write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct RemoteRegion {
    /// Which region of the layout ([`Region::code`]).
    pub region: u32,
    /// Its virtual address in the announcing process.
    pub addr: u64,
    /// Its length in bytes.
    pub len: u64,
    /// The rkey of its memory registration (remote write only).
    pub rkey: u32,
}

/// What one side tells the other to connect an RC queue pair and to write into its memory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RdmaHello {
    /// The announcing side's QP number (24-bit, non-zero).
    pub qpn: u32,
    /// Its initial packet sequence number (24-bit).
    pub psn: u32,
    /// Its port's LID (InfiniBand; 0 on RoCE).
    pub lid: u16,
    /// Its port number.
    pub port: u8,
    /// Its GID (RoCE and routed InfiniBand).
    pub gid: [u8; 16],
    /// Active path MTU as `enum ibv_mtu` (1 = 256 B ... 5 = 4096 B).
    pub mtu: u8,
    /// Regions the peer may write (a prefill announces none: nobody writes into a prefill).
    pub regions: Vec<RemoteRegion>,
}

/// Why a received RDMA hello was refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum HandshakeError {
    /// Shorter than its fields say.
    Truncated,
    /// Another version of this hello.
    Version(u8),
    /// QP number or PSN wider than 24 bits, or a zero QP number.
    BadQueuePair,
    /// MTU outside 1..=5.
    BadMtu(u8),
    /// More regions than allowed.
    TooManyRegions(usize),
    /// An empty region, or one whose end overflows the address space.
    BadRegion(u32),
    /// Bytes after the last region.
    TrailingBytes,
}

impl std::fmt::Display for HandshakeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HandshakeError::Truncated => write!(f, "RDMA hello truncated"),
            HandshakeError::Version(v) => write!(f, "RDMA hello version {v} is not 1"),
            HandshakeError::BadQueuePair => write!(f, "RDMA hello has no usable QP number or PSN"),
            HandshakeError::BadMtu(m) => write!(f, "RDMA hello MTU code {m} is not 1..=5"),
            HandshakeError::TooManyRegions(n) => write!(f, "RDMA hello announces {n} regions"),
            HandshakeError::BadRegion(c) => {
                write!(f, "RDMA hello region {c:#x} is empty or overflows")
            }
            HandshakeError::TrailingBytes => write!(f, "RDMA hello has trailing bytes"),
        }
    }
}

impl std::error::Error for HandshakeError {}

impl RdmaHello {
    /// Encodes the hello (little-endian).
    pub fn encode(&self, out: &mut Vec<u8>) {
        out.push(VERSION);
        out.extend_from_slice(&self.qpn.to_le_bytes());
        out.extend_from_slice(&self.psn.to_le_bytes());
        out.extend_from_slice(&self.lid.to_le_bytes());
        out.push(self.port);
        out.extend_from_slice(&self.gid);
        out.push(self.mtu);
        out.extend_from_slice(&(self.regions.len().min(u16::MAX as usize) as u16).to_le_bytes());
        for r in &self.regions {
            out.extend_from_slice(&r.region.to_le_bytes());
            out.extend_from_slice(&r.addr.to_le_bytes());
            out.extend_from_slice(&r.len.to_le_bytes());
            out.extend_from_slice(&r.rkey.to_le_bytes());
        }
    }

    /// Decodes and validates a hello (total: any input gives a hello or a typed error).
    pub fn decode(b: &[u8]) -> Result<RdmaHello, HandshakeError> {
        if b.len() < FIXED_LEN {
            return Err(HandshakeError::Truncated);
        }
        let u16_at = |i: usize| u16::from_le_bytes([b[i], b[i + 1]]);
        let u32_at = |i: usize| u32::from_le_bytes([b[i], b[i + 1], b[i + 2], b[i + 3]]);
        let u64_at = |i: usize| {
            let mut w = [0u8; 8];
            w.copy_from_slice(&b[i..i + 8]);
            u64::from_le_bytes(w)
        };
        if b[0] != VERSION {
            return Err(HandshakeError::Version(b[0]));
        }
        let qpn = u32_at(1);
        let psn = u32_at(5);
        if qpn == 0 || qpn & !PSN_MASK != 0 || psn & !PSN_MASK != 0 {
            return Err(HandshakeError::BadQueuePair);
        }
        let lid = u16_at(9);
        let port = b[11];
        let mut gid = [0u8; 16];
        gid.copy_from_slice(&b[12..28]);
        let mtu = b[28];
        if !(1..=5).contains(&mtu) {
            return Err(HandshakeError::BadMtu(mtu));
        }
        let n = usize::from(u16_at(29));
        if n > MAX_REGIONS {
            return Err(HandshakeError::TooManyRegions(n));
        }
        let need = FIXED_LEN + n * REGION_LEN;
        if b.len() < need {
            return Err(HandshakeError::Truncated);
        }
        if b.len() > need {
            return Err(HandshakeError::TrailingBytes);
        }
        let mut regions = Vec::with_capacity(n);
        for k in 0..n {
            let at = FIXED_LEN + k * REGION_LEN;
            let r = RemoteRegion {
                region: u32_at(at),
                addr: u64_at(at + 4),
                len: u64_at(at + 12),
                rkey: u32_at(at + 20),
            };
            if r.len == 0 || r.addr.checked_add(r.len).is_none() {
                return Err(HandshakeError::BadRegion(r.region));
            }
            regions.push(r);
        }
        Ok(RdmaHello {
            qpn,
            psn,
            lid,
            port,
            gid,
            mtu,
            regions,
        })
    }

    /// Where the destination of `slice`'s first row lies in the peer's memory: `(remote
    /// address, rkey)`, or `None` if the peer announced no such region or any row leaves it.
    /// The sender never builds a work request outside what the receiver registered.
    pub fn target(&self, slice: &Slice) -> Option<(u64, u32)> {
        let code = slice.region.code();
        let r = self.regions.iter().find(|r| r.region == code)?;
        if slice.dst_end()? > r.len {
            return None;
        }
        Some((r.addr + slice.dst_offset, r.rkey))
    }
}

/// Regions of a layout that a decode announces to prefills: those written over a one-sided
/// path ([`Region::written_by_peers`]); a probe over RDMA must travel the same path as the
/// operations whose failures blacklisted the session, so the scratch region is one of them.
pub fn writable(region: Region) -> bool {
    region.written_by_peers()
}
