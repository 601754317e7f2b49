//! The copies: `process_vm_writev` from this process's host memory into the receiver's
//! announced regions, and the proof read before the first one.

use kvferry_core::Slice;
use kvferry_memory::MemoryMap;

use crate::CmaRegion;

/// Most iovecs one call takes on either side (the kernel's `UIO_MAXIOV`).
pub const IOV_MAX: usize = 1024;

/// Why a copy into the peer did not complete.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum CmaError {
    /// The kernel refused access to the peer (`EPERM`): ptrace rules changed, or the peer
    /// became non-dumpable.
    Permission,
    /// The peer process is gone (`ESRCH`).
    PeerGone,
    /// Part of the range is not mapped writable in the peer (`EFAULT`, or fewer bytes copied
    /// than asked): `copied` bytes of the call landed.
    Fault {
        /// Bytes the failing call copied before it stopped.
        copied: usize,
    },
    /// A slice names a region the peer did not announce, or leaves it: never copied.
    OutsideRegion {
        /// The region's code.
        region: u32,
    },
    /// A slice's source is not this process's host memory (out of bounds, or device memory).
    Source(String),
    /// The proof cell held something else: the pid is not the peer that sent the `Open`.
    NotThePeer,
    /// Any other error of the call.
    Os(i32),
}

impl std::fmt::Display for CmaError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CmaError::Permission => write!(f, "the kernel refused access to the peer (EPERM)"),
            CmaError::PeerGone => write!(f, "the peer process is gone (ESRCH)"),
            CmaError::Fault { copied } => {
                write!(
                    f,
                    "the peer's memory is not writable there ({copied} bytes copied)"
                )
            }
            CmaError::OutsideRegion { region } => {
                write!(f, "a slice leaves the peer's region {region:#x}")
            }
            CmaError::Source(e) => write!(f, "a slice's source is not host memory: {e}"),
            CmaError::NotThePeer => write!(f, "the peer's proof cell does not hold its nonce"),
            CmaError::Os(errno) => write!(f, "process_vm_writev failed (errno {errno})"),
        }
    }
}

impl std::error::Error for CmaError {}

impl CmaError {
    fn of_errno(errno: i32) -> CmaError {
        match errno {
            libc::EPERM => CmaError::Permission,
            libc::ESRCH => CmaError::PeerGone,
            libc::EFAULT => CmaError::Fault { copied: 0 },
            e => CmaError::Os(e),
        }
    }
}

/// The receiver of one session as its writer sees it: the process and the regions it
/// announced in its `Open`.
#[derive(Clone, Debug)]
pub struct CmaTarget {
    pid: libc::pid_t,
    /// Sorted by region code.
    regions: Vec<CmaRegion>,
}

impl CmaTarget {
    /// The receiver `pid` and the regions it lets this process write.
    pub fn new(pid: u32, mut regions: Vec<CmaRegion>) -> CmaTarget {
        regions.sort_by_key(|r| r.region);
        CmaTarget {
            pid: pid as libc::pid_t,
            regions,
        }
    }

    /// The receiver's pid.
    pub fn pid(&self) -> u32 {
        self.pid as u32
    }

    /// Reads the 16 bytes at `addr` in the receiver and checks they are `nonce`: the kernel
    /// lets this process write there, and the pid is the process that sent them.
    pub fn prove(&self, addr: u64, nonce: &[u8; 16]) -> Result<(), CmaError> {
        let mut seen = [0u8; 16];
        let local = libc::iovec {
            iov_base: seen.as_mut_ptr().cast(),
            iov_len: seen.len(),
        };
        let remote = libc::iovec {
            iov_base: addr as *mut libc::c_void,
            iov_len: seen.len(),
        };
        // SAFETY: `local` covers `seen`, which lives across the call; the remote address is
        // read by the kernel in the peer's address space, which it checks.
        let n = unsafe { libc::process_vm_readv(self.pid, &local, 1, &remote, 1, 0) };
        if n < 0 {
            return Err(CmaError::of_errno(errno()));
        }
        if n as usize != seen.len() || &seen != nonce {
            return Err(CmaError::NotThePeer);
        }
        Ok(())
    }

    /// Copies every row of `slices` from `memory` to the same region in the receiver, in
    /// as few calls as the iovec limit allows (rows adjacent on both sides merged). Nothing
    /// is copied if any row lies outside what either side has. Returns the bytes copied.
    pub fn write(&self, memory: &MemoryMap, slices: &[Slice]) -> Result<u64, CmaError> {
        let mut local: Vec<libc::iovec> = Vec::new();
        let mut remote: Vec<libc::iovec> = Vec::new();
        let mut total = 0u64;
        for slice in slices {
            let code = slice.region.code();
            let target = self
                .regions
                .binary_search_by_key(&code, |r| r.region)
                .ok()
                .map(|i| self.regions[i])
                .ok_or(CmaError::OutsideRegion { region: code })?;
            let end = slice
                .dst_end()
                .ok_or(CmaError::OutsideRegion { region: code })?;
            if end > target.len {
                return Err(CmaError::OutsideRegion { region: code });
            }
            for run in slice.runs() {
                let src = memory
                    .host_range(run.region, run.src_offset, run.len)
                    .map_err(|e| CmaError::Source(e.to_string()))?;
                let dst = target.addr + run.dst_offset;
                let len = run.len as usize;
                total += run.len;
                // Rows that continue the previous one on both sides go in the same iovec.
                if let (Some(l), Some(r)) = (local.last_mut(), remote.last_mut()) {
                    let l_end = (l.iov_base as usize).wrapping_add(l.iov_len);
                    let r_end = (r.iov_base as usize).wrapping_add(r.iov_len);
                    if l_end == src as usize && r_end == dst as usize {
                        l.iov_len += len;
                        r.iov_len += len;
                        continue;
                    }
                }
                local.push(libc::iovec {
                    iov_base: src.cast(),
                    iov_len: len,
                });
                remote.push(libc::iovec {
                    iov_base: dst as *mut libc::c_void,
                    iov_len: len,
                });
            }
        }
        for (l, r) in local.chunks(IOV_MAX).zip(remote.chunks(IOV_MAX)) {
            let want: usize = l.iter().map(|v| v.iov_len).sum();
            // SAFETY: every local iovec lies inside `memory`'s host regions (bounds-checked by
            // `host_range`), which outlive the call, and the caller owns those pages per the
            // core (a room's source pages are held until its operations settle); every remote
            // iovec lies inside a region the receiver announced for this session, which the
            // kernel checks against the receiver's own mappings.
            let n = unsafe {
                libc::process_vm_writev(
                    self.pid,
                    l.as_ptr(),
                    l.len() as libc::c_ulong,
                    r.as_ptr(),
                    r.len() as libc::c_ulong,
                    0,
                )
            };
            if n < 0 {
                return Err(CmaError::of_errno(errno()));
            }
            if n as usize != want {
                return Err(CmaError::Fault { copied: n as usize });
            }
        }
        Ok(total)
    }
}

fn errno() -> i32 {
    std::io::Error::last_os_error().raw_os_error().unwrap_or(0)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests may panic

    use super::*;
    use kvferry_core::{Layout, Region};

    fn layout() -> Layout {
        Layout {
            layers: 2,
            planes: 2,
            page_bytes: 4096,
            pages: 8,
            aux_bytes: 0,
            state_bytes: 0,
            slots: 0,
        }
    }

    /// A receiver in this very process: `dst`'s regions announced as its `Open` would.
    fn target_of(dst: &MemoryMap) -> CmaTarget {
        let regions = dst
            .region_lens()
            .map(|(region, len)| CmaRegion {
                region: region.code(),
                addr: dst.range(region, 0, len).unwrap() as u64,
                len,
            })
            .collect();
        CmaTarget::new(std::process::id(), regions)
    }

    fn filled(seed: u8) -> MemoryMap {
        let m = MemoryMap::allocate(layout());
        for (region, len) in m.region_lens().collect::<Vec<_>>() {
            let bytes: Vec<u8> = (0..len)
                .map(|i| (i as u8).wrapping_mul(31) ^ seed)
                .collect();
            m.write(region, 0, &bytes).unwrap();
        }
        m
    }

    fn read(m: &MemoryMap, region: Region, offset: u64, len: usize) -> Vec<u8> {
        let mut out = vec![0u8; len];
        m.read(region, offset, &mut out).unwrap();
        out
    }

    #[test]
    fn strided_rows_land_where_the_slice_says_and_nowhere_else() {
        let (src, dst) = (filled(1), filled(2));
        let region = Region::Kv { layer: 1, plane: 0 };
        let slice = Slice {
            region,
            src_offset: 64,
            dst_offset: 4096,
            len: 100,
            rows: 5,
            src_stride: 512,
            dst_stride: 128,
        };
        let before = read(&dst, region, 0, 8 * 4096);
        let copied = target_of(&dst).write(&src, &[slice]).unwrap();
        assert_eq!(copied, 500);
        let mut want = before;
        for i in 0..5u64 {
            let s = read(&src, region, 64 + i * 512, 100);
            let at = (4096 + i * 128) as usize;
            want[at..at + 100].copy_from_slice(&s);
        }
        assert_eq!(read(&dst, region, 0, 8 * 4096), want);
    }

    #[test]
    fn more_rows_than_one_call_takes_all_land() {
        let (src, dst) = (filled(3), filled(4));
        let region = Region::Kv { layer: 0, plane: 1 };
        // 2000 rows of 8 bytes, gaps on both sides: 2000 iovecs, two calls.
        let slice = Slice {
            region,
            src_offset: 0,
            dst_offset: 8,
            len: 8,
            rows: 2000,
            src_stride: 16,
            dst_stride: 16,
        };
        target_of(&dst).write(&src, &[slice]).unwrap();
        for i in [0u64, 1023, 1024, 1999] {
            assert_eq!(
                read(&dst, region, 8 + i * 16, 8),
                read(&src, region, i * 16, 8)
            );
        }
    }

    #[test]
    fn a_slice_leaving_the_announced_region_copies_nothing() {
        let (src, dst) = (filled(5), filled(6));
        let region = Region::Kv { layer: 0, plane: 0 };
        let before = read(&dst, region, 0, 8 * 4096);
        let inside = Slice::run(region, 0, 0, 4096);
        let outside = Slice::run(region, 0, 8 * 4096 - 10, 11);
        assert_eq!(
            target_of(&dst).write(&src, &[inside, outside]),
            Err(CmaError::OutsideRegion {
                region: region.code()
            })
        );
        assert_eq!(read(&dst, region, 0, 8 * 4096), before);
        let unknown = Slice::run(Region::Aux, 0, 0, 8);
        assert!(matches!(
            target_of(&dst).write(&src, &[unknown]),
            Err(CmaError::OutsideRegion { .. })
        ));
    }

    #[test]
    fn a_proof_holds_only_with_the_right_nonce() {
        let cell = Box::new([9u8; 16]);
        let t = CmaTarget::new(std::process::id(), Vec::new());
        assert_eq!(t.prove(cell.as_ptr() as u64, &[9; 16]), Ok(()));
        assert_eq!(
            t.prove(cell.as_ptr() as u64, &[8; 16]),
            Err(CmaError::NotThePeer)
        );
    }

    #[test]
    fn a_process_that_is_gone_is_named_so() {
        let mut child = std::process::Command::new("true").spawn().unwrap();
        let pid = child.id();
        child.wait().unwrap();
        let t = CmaTarget::new(pid, Vec::new());
        assert_eq!(t.prove(0x1000, &[0; 16]), Err(CmaError::PeerGone));
    }
}
