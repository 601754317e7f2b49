//! The same-host path's messages, carried in the core's `Transport` frames. Layout in
//! `docs/PROTOCOL.md` ("Same-host path"); every decode is total (bytes give a message or a
//! typed error).

use crate::HostIdentity;

/// First byte of every same-host message: never `0x00` (the TCP path notice) nor `0x01`
/// (the RDMA hello's version).
pub const TAG: u8 = 0x43;
/// Most regions one `Open` may announce (what fits a `Transport` frame).
const MAX_REGIONS: usize = 800;
const REGION_LEN: usize = 4 + 8 + 8;
/// Bytes of one device region in an `Open`: code, handle type, address, length, offset,
/// handle.
const DEVICE_REGION_LEN: usize = 4 + 4 + 8 + 8 + 8 + 64;
/// Bytes of an `Open` before its regions: tag, kind, pid, proof address, nonce, and the two
/// counts.
const OPEN_FIXED_LEN: usize = 2 + 4 + 8 + 16 + 2 + 2;
/// Most bytes one same-host message takes (a `Transport` frame's payload).
const MAX_MESSAGE_LEN: usize = 16 * 1024;

const KIND_OFFER: u8 = 1;
const KIND_OPEN: u8 = 2;
const KIND_ACCEPT: u8 = 3;
const KIND_DECLINE: u8 = 4;
const KIND_FENCE: u8 = 5;
const KIND_FENCED: u8 = 6;

/// Writer -> receiver, once the session is established: where the writer runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Offer {
    /// The writer's host and PID namespace.
    pub host: HostIdentity,
    /// The writer's process id in that namespace.
    pub pid: u32,
}

/// One region the receiver lets its writer write, at its address in the receiver.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CmaRegion {
    /// Which region of the layout (`Region::code`).
    pub region: u32,
    /// Its virtual address in the receiver's process.
    pub addr: u64,
    /// Its length in bytes.
    pub len: u64,
}

/// One piece of a device-memory region the receiver lets its writer write, exported for the
/// writer's process to map (CUDA IPC). A region spanning several allocations (the VMM API's)
/// is several pieces of its code, next to each other in the list and in address order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DeviceRegion {
    /// Which region of the layout (`Region::code`).
    pub region: u32,
    /// How the writer reaches it (`kvferry_memory::IpcHandleType`'s code).
    pub handle_type: u32,
    /// The piece's device address in the receiver's process.
    pub addr: u64,
    /// Its length in bytes.
    pub len: u64,
    /// Where it starts inside its allocation.
    pub offset: u64,
    /// The allocation's handle (`cuIpcGetMemHandle`'s bytes, or a file descriptor's).
    pub handle: [u8; 64],
}

/// Receiver -> writer: the receiver shares the writer's host and let it write: where, and
/// the proof cell that shows the pid is the receiver.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Open {
    /// The receiver's process id.
    pub pid: u32,
    /// Address of 16 bytes in the receiver holding `nonce`.
    pub nonce_addr: u64,
    /// What the writer must read at `nonce_addr` before its first write.
    pub nonce: [u8; 16],
    /// The host-memory regions the writer may write (cross-memory attach).
    pub regions: Vec<CmaRegion>,
    /// The device-memory regions the writer may write (CUDA IPC).
    pub device: Vec<DeviceRegion>,
}

/// Why a side does not move a session over the same-host path (the session stays on TCP or
/// RDMA and both sides log this reason).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Decline {
    /// The peers run on different hosts (boot ids differ).
    OtherHost,
    /// Same host, different PID namespaces (two containers): a pid would name another process.
    OtherPidNamespace,
    /// The node's configuration forbids it (`transport=tcp` or `rdma`).
    Forbidden,
    /// Device memory on either side (CUDA IPC is its path, not cross-memory attach).
    DeviceMemory,
    /// The kernel refused the writer access to the receiver (ptrace rules, Yama, a
    /// non-dumpable receiver).
    PtraceRefused,
    /// Yama allows one declared ptracer per process and another session's writer holds it.
    PtraceHeld,
    /// The proof cell did not hold the nonce: the pid is not the receiver.
    NotThePeer,
    /// More regions than one `Open` carries.
    TooManyRegions,
    /// This host cannot say who it is (no /proc), or the platform has no cross-memory attach.
    Unsupported,
    /// Copies that had worked failed (the receiver's memory unmapped, the process gone): the
    /// session moves over TCP from now on.
    CopyFailed,
    /// Device memory the receiver could not export or the writer could not map (no CUDA
    /// IPC: a VMM or expandable-segments allocation, no peer access between the GPUs, a
    /// copy engine without it).
    IpcUnavailable,
    /// The checksum option with device memory: the CPU cannot hash bytes a GPU copy lands,
    /// so such a session keeps the staged path, which hashes them in host buffers.
    ChecksumOnDevice,
}

impl Decline {
    /// The code on the wire.
    pub fn code(self) -> u8 {
        match self {
            Decline::OtherHost => 1,
            Decline::OtherPidNamespace => 2,
            Decline::Forbidden => 3,
            Decline::DeviceMemory => 4,
            Decline::PtraceRefused => 5,
            Decline::PtraceHeld => 6,
            Decline::NotThePeer => 7,
            Decline::TooManyRegions => 8,
            Decline::Unsupported => 9,
            Decline::CopyFailed => 10,
            Decline::IpcUnavailable => 11,
            Decline::ChecksumOnDevice => 12,
        }
    }

    /// Inverse of [`Decline::code`].
    pub fn from_code(code: u8) -> Option<Decline> {
        Some(match code {
            1 => Decline::OtherHost,
            2 => Decline::OtherPidNamespace,
            3 => Decline::Forbidden,
            4 => Decline::DeviceMemory,
            5 => Decline::PtraceRefused,
            6 => Decline::PtraceHeld,
            7 => Decline::NotThePeer,
            8 => Decline::TooManyRegions,
            9 => Decline::Unsupported,
            10 => Decline::CopyFailed,
            11 => Decline::IpcUnavailable,
            12 => Decline::ChecksumOnDevice,
            _ => return None,
        })
    }

    /// The reason in words, as logs give it.
    pub fn as_str(self) -> &'static str {
        match self {
            Decline::OtherHost => "different hosts",
            Decline::OtherPidNamespace => "different PID namespaces",
            Decline::Forbidden => "the same-host path is turned off (transport)",
            Decline::DeviceMemory => {
                "device memory a same-host copy cannot reach (device source, host destination; or no copy engine)"
            }
            Decline::PtraceRefused => "the kernel refused cross-memory attach (ptrace rules)",
            Decline::PtraceHeld => "Yama's one ptracer exception is held by another peer",
            Decline::NotThePeer => "the peer's pid does not hold its proof",
            Decline::TooManyRegions => "more regions than one Open announces",
            Decline::Unsupported => "this host has no cross-memory attach or no host identity",
            Decline::CopyFailed => "a same-host copy failed",
            Decline::IpcUnavailable => "device memory not mappable across the processes (CUDA IPC)",
            Decline::ChecksumOnDevice => "the checksum option with device memory",
        }
    }
}

impl std::fmt::Display for Decline {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// One same-host message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CmaMessage {
    /// Writer -> receiver: where the writer runs.
    Offer(Offer),
    /// Receiver -> writer: write here.
    Open(Open),
    /// Writer -> receiver: the proof held; from now on this session's writes go this way.
    Accept,
    /// Either way: not this session, and why.
    Decline(Decline),
    /// Receiver -> writer: confirm that no write issued before this can land any more.
    Fence {
        /// Tells this fence's confirmation from an earlier one's.
        epoch: u32,
    },
    /// Writer -> receiver: nothing written before the fence of `epoch` is still landing.
    Fenced {
        /// The fence confirmed.
        epoch: u32,
    },
}

/// Why received bytes are no same-host message.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MessageError {
    /// Does not start with [`TAG`].
    NotSameHost,
    /// An unknown kind byte.
    Kind(u8),
    /// Shorter than its fields say.
    Truncated,
    /// Bytes after the last field.
    TrailingBytes,
    /// An unknown decline code.
    DeclineCode(u8),
    /// More regions than allowed.
    TooManyRegions(usize),
    /// An empty region, one whose end overflows the address space, or a device region's
    /// pieces apart or out of order.
    BadRegion(u32),
    /// An unknown device-memory handle type.
    HandleType(u32),
}

impl std::fmt::Display for MessageError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            MessageError::NotSameHost => write!(f, "not a same-host message"),
            MessageError::Kind(k) => write!(f, "same-host message kind {k} is unknown"),
            MessageError::Truncated => write!(f, "same-host message truncated"),
            MessageError::TrailingBytes => write!(f, "same-host message has trailing bytes"),
            MessageError::DeclineCode(c) => write!(f, "same-host decline code {c} is unknown"),
            MessageError::TooManyRegions(n) => write!(f, "same-host Open announces {n} regions"),
            MessageError::BadRegion(c) => write!(
                f,
                "same-host region {c:#x} is empty, overflows, or its pieces are apart"
            ),
            MessageError::HandleType(t) => {
                write!(f, "same-host device handle type {t} is unknown")
            }
        }
    }
}

impl std::error::Error for MessageError {}

/// Whether `payload` is a same-host message (by its first byte).
fn is_same_host(payload: &[u8]) -> bool {
    payload.first() == Some(&TAG)
}

impl CmaMessage {
    /// Whether `payload` is a same-host message (by its first byte).
    pub fn claims(payload: &[u8]) -> bool {
        is_same_host(payload)
    }

    /// Whether a [`CmaMessage::Open`] of `regions` host and `device` device regions fits
    /// one message.
    pub fn open_fits(regions: usize, device: usize) -> bool {
        regions <= MAX_REGIONS
            && OPEN_FIXED_LEN + regions * REGION_LEN + device * DEVICE_REGION_LEN <= MAX_MESSAGE_LEN
    }

    /// Encodes the message (little-endian).
    pub fn encode(&self) -> Vec<u8> {
        let mut out = vec![TAG];
        match self {
            CmaMessage::Offer(o) => {
                out.push(KIND_OFFER);
                out.extend_from_slice(&o.host.boot_id);
                out.extend_from_slice(&o.host.pid_namespace.to_le_bytes());
                out.extend_from_slice(&o.host.namespace_device.to_le_bytes());
                out.extend_from_slice(&o.pid.to_le_bytes());
            }
            CmaMessage::Open(o) => {
                out.push(KIND_OPEN);
                out.extend_from_slice(&o.pid.to_le_bytes());
                out.extend_from_slice(&o.nonce_addr.to_le_bytes());
                out.extend_from_slice(&o.nonce);
                out.extend_from_slice(
                    &(o.regions.len().min(u16::MAX as usize) as u16).to_le_bytes(),
                );
                for r in &o.regions {
                    out.extend_from_slice(&r.region.to_le_bytes());
                    out.extend_from_slice(&r.addr.to_le_bytes());
                    out.extend_from_slice(&r.len.to_le_bytes());
                }
                out.extend_from_slice(
                    &(o.device.len().min(u16::MAX as usize) as u16).to_le_bytes(),
                );
                for r in &o.device {
                    out.extend_from_slice(&r.region.to_le_bytes());
                    out.extend_from_slice(&r.handle_type.to_le_bytes());
                    out.extend_from_slice(&r.addr.to_le_bytes());
                    out.extend_from_slice(&r.len.to_le_bytes());
                    out.extend_from_slice(&r.offset.to_le_bytes());
                    out.extend_from_slice(&r.handle);
                }
            }
            CmaMessage::Accept => out.push(KIND_ACCEPT),
            CmaMessage::Decline(d) => {
                out.push(KIND_DECLINE);
                out.push(d.code());
            }
            CmaMessage::Fence { epoch } => {
                out.push(KIND_FENCE);
                out.extend_from_slice(&epoch.to_le_bytes());
            }
            CmaMessage::Fenced { epoch } => {
                out.push(KIND_FENCED);
                out.extend_from_slice(&epoch.to_le_bytes());
            }
        }
        out
    }

    /// Decodes and validates a message.
    pub fn decode(b: &[u8]) -> Result<CmaMessage, MessageError> {
        let mut r = Reader { b, at: 0 };
        if r.u8()? != TAG {
            return Err(MessageError::NotSameHost);
        }
        let msg = match r.u8()? {
            KIND_OFFER => {
                let mut boot_id = [0u8; 16];
                boot_id.copy_from_slice(r.take(16)?);
                let pid_namespace = r.u64()?;
                let namespace_device = r.u64()?;
                let pid = r.u32()?;
                CmaMessage::Offer(Offer {
                    host: HostIdentity {
                        boot_id,
                        pid_namespace,
                        namespace_device,
                    },
                    pid,
                })
            }
            KIND_OPEN => {
                let pid = r.u32()?;
                let nonce_addr = r.u64()?;
                let mut nonce = [0u8; 16];
                nonce.copy_from_slice(r.take(16)?);
                let n = usize::from(r.u16()?);
                if n > MAX_REGIONS {
                    return Err(MessageError::TooManyRegions(n));
                }
                if r.b.len() - r.at < n * REGION_LEN {
                    return Err(MessageError::Truncated);
                }
                let mut regions = Vec::with_capacity(n);
                for _ in 0..n {
                    let region = CmaRegion {
                        region: r.u32()?,
                        addr: r.u64()?,
                        len: r.u64()?,
                    };
                    if region.len == 0 || region.addr.checked_add(region.len).is_none() {
                        return Err(MessageError::BadRegion(region.region));
                    }
                    regions.push(region);
                }
                let d = usize::from(r.u16()?);
                if !CmaMessage::open_fits(n, d) {
                    return Err(MessageError::TooManyRegions(n + d));
                }
                if r.b.len() - r.at < d * DEVICE_REGION_LEN {
                    return Err(MessageError::Truncated);
                }
                let mut device: Vec<DeviceRegion> = Vec::with_capacity(d);
                for _ in 0..d {
                    let region = r.u32()?;
                    let handle_type = r.u32()?;
                    if kvferry_memory::IpcHandleType::from_code(handle_type).is_none() {
                        return Err(MessageError::HandleType(handle_type));
                    }
                    let addr = r.u64()?;
                    let len = r.u64()?;
                    let offset = r.u64()?;
                    let mut handle = [0u8; 64];
                    handle.copy_from_slice(r.take(64)?);
                    if len == 0
                        || addr.checked_add(len).is_none()
                        || offset.checked_add(len).is_none()
                    {
                        return Err(MessageError::BadRegion(region));
                    }
                    // A region's pieces are next to each other, each starting where the
                    // previous one ended.
                    let follows = device.last().filter(|p| p.region == region);
                    let seen = device.iter().any(|p| p.region == region);
                    if seen && follows.map_or(true, |p| p.addr + p.len != addr) {
                        return Err(MessageError::BadRegion(region));
                    }
                    device.push(DeviceRegion {
                        region,
                        handle_type,
                        addr,
                        len,
                        offset,
                        handle,
                    });
                }
                CmaMessage::Open(Open {
                    pid,
                    nonce_addr,
                    nonce,
                    regions,
                    device,
                })
            }
            KIND_ACCEPT => CmaMessage::Accept,
            KIND_DECLINE => {
                let code = r.u8()?;
                CmaMessage::Decline(
                    Decline::from_code(code).ok_or(MessageError::DeclineCode(code))?,
                )
            }
            KIND_FENCE => CmaMessage::Fence { epoch: r.u32()? },
            KIND_FENCED => CmaMessage::Fenced { epoch: r.u32()? },
            k => return Err(MessageError::Kind(k)),
        };
        if r.at != b.len() {
            return Err(MessageError::TrailingBytes);
        }
        Ok(msg)
    }
}

struct Reader<'a> {
    b: &'a [u8],
    at: usize,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], MessageError> {
        let end = self.at.checked_add(n).ok_or(MessageError::Truncated)?;
        let s = self.b.get(self.at..end).ok_or(MessageError::Truncated)?;
        self.at = end;
        Ok(s)
    }

    fn u8(&mut self) -> Result<u8, MessageError> {
        Ok(self.take(1)?[0])
    }

    fn u16(&mut self) -> Result<u16, MessageError> {
        let s = self.take(2)?;
        Ok(u16::from_le_bytes([s[0], s[1]]))
    }

    fn u32(&mut self) -> Result<u32, MessageError> {
        let s = self.take(4)?;
        Ok(u32::from_le_bytes([s[0], s[1], s[2], s[3]]))
    }

    fn u64(&mut self) -> Result<u64, MessageError> {
        let mut w = [0u8; 8];
        w.copy_from_slice(self.take(8)?);
        Ok(u64::from_le_bytes(w))
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests may panic

    use super::*;

    fn every_kind() -> Vec<CmaMessage> {
        let host = HostIdentity {
            boot_id: [7; 16],
            pid_namespace: 4026531836,
            namespace_device: 4,
        };
        vec![
            CmaMessage::Offer(Offer { host, pid: 4242 }),
            CmaMessage::Open(Open {
                pid: 99,
                nonce_addr: 0x7f00_0000_1000,
                nonce: [3; 16],
                regions: vec![
                    CmaRegion {
                        region: 0x0100,
                        addr: 0x7f00_0000_2000,
                        len: 4096,
                    },
                    CmaRegion {
                        region: 0xFFFF_FF02,
                        addr: 0x7f00_0000_9000,
                        len: 64,
                    },
                ],
                device: vec![
                    DeviceRegion {
                        region: 0x0101,
                        handle_type: 1,
                        addr: 0x7f10_0020_0000,
                        len: 1 << 20,
                        offset: 2 << 20,
                        handle: [9; 64],
                    },
                    DeviceRegion {
                        region: 0x0102,
                        handle_type: 2,
                        addr: 0x7f20_0000_0000,
                        len: 2 << 20,
                        offset: 0,
                        handle: [8; 64],
                    },
                    DeviceRegion {
                        region: 0x0102,
                        handle_type: 2,
                        addr: 0x7f20_0020_0000,
                        len: 1 << 20,
                        offset: 0,
                        handle: [7; 64],
                    },
                ],
            }),
            CmaMessage::Accept,
            CmaMessage::Decline(Decline::PtraceHeld),
            CmaMessage::Fence { epoch: 3 },
            CmaMessage::Fenced { epoch: 3 },
        ]
    }

    #[test]
    fn every_message_decodes_to_itself() {
        for m in every_kind() {
            assert_eq!(CmaMessage::decode(&m.encode()), Ok(m));
        }
    }

    /// The sizes docs/PROTOCOL.md ("Same-host messages") gives each kind.
    #[test]
    fn every_kind_has_the_length_the_protocol_doc_gives() {
        let lens: Vec<usize> = every_kind().iter().map(|m| m.encode().len()).collect();
        // tag and kind, then: Offer 16 + 8 + 8 + 4; Open 4 + 8 + 16 + 2 + 20 per host region
        // (two here) + 2 + 96 per device region piece (three here); Accept nothing; Decline 1;
        // Fence and Fenced 4.
        assert_eq!(lens, vec![2 + 36, 2 + 30 + 40 + 2 + 3 * 96, 2, 3, 6, 6]);
        let open = CmaMessage::decode(&every_kind()[1].encode()).unwrap();
        let b = open.encode();
        assert_eq!(&b[..2], &[0x43, 2]);
        assert_eq!(u16::from_le_bytes([b[30], b[31]]), 2, "n at offset 30");
        assert_eq!(
            u16::from_le_bytes([b[72], b[73]]),
            3,
            "d after the host regions"
        );
        assert_eq!(&b[74 + 4..74 + 8], &1u32.to_le_bytes(), "the handle type");
        assert_eq!(
            &b[74 + 32..74 + 96],
            &[9; 64],
            "the handle ends each device region"
        );
    }

    #[test]
    fn every_truncation_and_every_extra_byte_is_a_typed_error() {
        for m in every_kind() {
            let b = m.encode();
            for cut in 0..b.len() {
                assert!(CmaMessage::decode(&b[..cut]).is_err(), "{m:?} cut at {cut}");
            }
            let mut long = b.clone();
            long.push(0);
            assert_eq!(CmaMessage::decode(&long), Err(MessageError::TrailingBytes));
        }
    }

    #[test]
    fn an_empty_or_overflowing_region_is_refused() {
        for (addr, len) in [(0x1000, 0), (u64::MAX - 10, 11)] {
            let m = CmaMessage::Open(Open {
                pid: 1,
                nonce_addr: 0,
                nonce: [0; 16],
                regions: vec![CmaRegion {
                    region: 5,
                    addr,
                    len,
                }],
                device: Vec::new(),
            });
            assert_eq!(
                CmaMessage::decode(&m.encode()),
                Err(MessageError::BadRegion(5))
            );
            let d = CmaMessage::Open(Open {
                pid: 1,
                nonce_addr: 0,
                nonce: [0; 16],
                regions: Vec::new(),
                device: vec![DeviceRegion {
                    region: 6,
                    handle_type: 1,
                    addr,
                    len,
                    offset: 0,
                    handle: [0; 64],
                }],
            });
            assert_eq!(
                CmaMessage::decode(&d.encode()),
                Err(MessageError::BadRegion(6))
            );
        }
    }

    #[test]
    fn an_open_fits_one_transport_frame_or_is_refused() {
        // 32 fixed bytes + 20 per host region + 96 per device region piece <= 16 KiB.
        assert!(CmaMessage::open_fits(2, 169));
        assert!(!CmaMessage::open_fits(2, 170));
        assert!(CmaMessage::open_fits(800, 0));
        assert!(!CmaMessage::open_fits(801, 0));
        let big = CmaMessage::Open(Open {
            pid: 1,
            nonce_addr: 0,
            nonce: [0; 16],
            regions: Vec::new(),
            device: vec![
                DeviceRegion {
                    region: 6,
                    handle_type: 1,
                    addr: 4096,
                    len: 4096,
                    offset: 0,
                    handle: [0; 64],
                };
                171
            ],
        });
        assert_eq!(
            CmaMessage::decode(&big.encode()),
            Err(MessageError::TooManyRegions(171))
        );
    }

    fn device_open(pieces: &[(u32, u32, u64, u64)]) -> CmaMessage {
        CmaMessage::Open(Open {
            pid: 1,
            nonce_addr: 0,
            nonce: [0; 16],
            regions: Vec::new(),
            device: pieces
                .iter()
                .map(|&(region, handle_type, addr, len)| DeviceRegion {
                    region,
                    handle_type,
                    addr,
                    len,
                    offset: 0,
                    handle: [0; 64],
                })
                .collect(),
        })
    }

    #[test]
    fn a_device_regions_pieces_must_follow_each_other() {
        let ok = device_open(&[
            (6, 2, 0x1000, 0x1000),
            (6, 2, 0x2000, 0x3000),
            (7, 1, 0x9000, 16),
        ]);
        assert_eq!(CmaMessage::decode(&ok.encode()), Ok(ok));
        for pieces in [
            // A gap between two pieces.
            [
                (6, 2, 0x1000, 0x1000),
                (6, 2, 0x3000, 0x1000),
                (7, 1, 0x9000, 16),
            ],
            // Out of order.
            [
                (6, 2, 0x2000, 0x1000),
                (6, 2, 0x1000, 0x1000),
                (7, 1, 0x9000, 16),
            ],
            // Another region between them.
            [
                (6, 2, 0x1000, 0x1000),
                (7, 1, 0x9000, 16),
                (6, 2, 0x2000, 0x1000),
            ],
        ] {
            assert_eq!(
                CmaMessage::decode(&device_open(&pieces).encode()),
                Err(MessageError::BadRegion(6)),
                "{pieces:?}"
            );
        }
    }

    #[test]
    fn an_unknown_device_handle_type_is_refused() {
        let m = device_open(&[(6, 3, 0x1000, 0x1000)]);
        assert_eq!(
            CmaMessage::decode(&m.encode()),
            Err(MessageError::HandleType(3))
        );
    }

    #[test]
    fn the_tag_is_neither_the_tcp_notice_nor_an_rdma_hello() {
        assert!(!is_same_host(&[0]));
        assert!(!is_same_host(&[1, 2, 3]));
        assert_eq!(CmaMessage::decode(&[0]), Err(MessageError::NotSameHost));
    }

    /// docs/PROTOCOL.md's `Decline` bullet names every code the decoder knows, and no other.
    #[test]
    fn the_protocol_doc_names_every_decline_code() {
        let doc = include_str!("../../docs/PROTOCOL.md");
        let start = doc.find("- `Decline` (either way)").unwrap();
        let end = start + doc[start..].find("\n- ").unwrap();
        let bullet = doc[start..end].replace('\n', " ");
        let named: Vec<u8> = (1..=20)
            .filter(|c| bullet.contains(&format!(": {c} ")) || bullet.contains(&format!(", {c} ")))
            .collect();
        let known: Vec<u8> = (1..=20)
            .filter(|c| Decline::from_code(*c).is_some())
            .collect();
        assert_eq!(named, known, "{bullet}");
    }

    #[test]
    fn every_decline_code_round_trips_and_zero_names_none() {
        for code in 1..=12 {
            assert_eq!(Decline::from_code(code).map(Decline::code), Some(code));
        }
        assert_eq!(Decline::from_code(0), None);
        assert_eq!(Decline::from_code(13), None);
    }
}
