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
    /// as few calls as the iovec limit allows (rows adjacent on both sides merged), on up to
    /// [`COPY_THREADS`] threads at once for a large operation (one call copies at about two
    /// thirds of one thread's memcpy: the kernel pins and maps every page it writes). Nothing
    /// is copied if any row lies outside what either side has. Returns the bytes copied; the
    /// copy is over, on every thread, when it returns.
    pub fn write(&self, memory: &MemoryMap, slices: &[Slice]) -> Result<u64, CmaError> {
        let mut runs: Vec<Run> = Vec::new();
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
                    .map_err(|e| CmaError::Source(e.to_string()))?
                    as usize;
                let dst = (target.addr + run.dst_offset) as usize;
                let len = run.len as usize;
                total += run.len;
                // Rows that continue the previous one on both sides go in the same iovec.
                if let Some(last) = runs.last_mut() {
                    if last.src + last.len == src && last.dst + last.len == dst {
                        last.len += len;
                        continue;
                    }
                }
                runs.push(Run { src, dst, len });
            }
        }
        let parts = parts_for(total as usize);
        if parts <= 1 {
            self.copy(&runs)?;
            return Ok(total);
        }
        let shares = split(&runs, total as usize, parts);
        std::thread::scope(|scope| {
            let (first, rest) = shares
                .split_first()
                .map_or((&[][..], &[][..]), |(f, r)| (&f[..], r));
            let others: Vec<_> = rest
                .iter()
                .map(|share| scope.spawn(move || self.copy(share)))
                .collect();
            let mut result = self.copy(first);
            for t in others {
                let r = t.join().unwrap_or(Err(CmaError::Os(0)));
                if result.is_ok() {
                    result = r;
                }
            }
            result
        })?;
        Ok(total)
    }

    /// One thread's share: calls of at most [`IOV_MAX`] iovecs a side each, in order.
    fn copy(&self, runs: &[Run]) -> Result<(), CmaError> {
        let mut rest = runs;
        while !rest.is_empty() {
            let (local, remote, taken) = iovecs(rest);
            rest = &rest[taken..];
            let want: usize = local.iter().map(|v| v.iov_len).sum();
            // SAFETY: every local iovec lies inside `memory`'s host regions (bounds-checked by
            // `host_range`), which outlive the call (the caller holds the map across
            // `write`, whose threads end before it returns), and the caller owns those pages
            // per the core (a room's source pages are held until its operations settle);
            // every remote iovec lies inside a region the receiver announced for this
            // session, which the kernel checks against the receiver's own mappings.
            let n = unsafe {
                libc::process_vm_writev(
                    self.pid,
                    local.as_ptr(),
                    local.len() as libc::c_ulong,
                    remote.as_ptr(),
                    remote.len() as libc::c_ulong,
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
        Ok(())
    }
}

/// Rows shorter than this, apart from each other in the receiver, cost more by cross-memory
/// attach than by a local socket: the kernel pins the receiver's pages once per remote
/// iovec (1 KiB rows every 2 KiB copy at about a fifth of one contiguous range's rate, 4 KiB
/// rows at about two fifths, 16 KiB rows at three quarters).
pub const ROW_PIN_MIN: u64 = 8 * 1024;

/// Whether `slice` lands as rows shorter than [`ROW_PIN_MIN`] that are apart in the
/// receiver's memory: one page pin a row, slower than the same bytes over a local socket.
pub fn pins_every_row(slice: &Slice) -> bool {
    slice.rows > 1 && slice.dst_stride > slice.len && slice.len < ROW_PIN_MIN
}

/// Most threads one operation's copy runs on.
pub const COPY_THREADS: usize = 4;
/// Least bytes a thread is given: below it a thread's start costs more than it saves.
const BYTES_PER_THREAD: usize = 2 << 20;

/// One contiguous copy: `len` bytes from this process's `src` to the receiver's `dst`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Run {
    src: usize,
    dst: usize,
    len: usize,
}

/// The iovecs of one call from the first runs of `runs`: each side's ranges merged where they
/// touch on that side alone (the kernel pins the receiver's pages once per remote iovec, so
/// rows that are apart in one process but touch in the other cost one pin, not one a row),
/// at most [`IOV_MAX`] a side; and how many runs they cover (at least one).
fn iovecs(runs: &[Run]) -> (Vec<libc::iovec>, Vec<libc::iovec>, usize) {
    let (mut local, mut remote) = (Vec::<libc::iovec>::new(), Vec::<libc::iovec>::new());
    let mut taken = 0;
    for r in runs {
        let joins = |v: &[libc::iovec], at: usize| {
            v.last()
                .is_some_and(|l| l.iov_base as usize + l.iov_len == at)
        };
        let (src_joins, dst_joins) = (joins(&local, r.src), joins(&remote, r.dst));
        let full = |v: &Vec<libc::iovec>, joins: bool| !joins && v.len() == IOV_MAX;
        if full(&local, src_joins) || full(&remote, dst_joins) {
            break;
        }
        for (v, at, joins) in [
            (&mut local, r.src, src_joins),
            (&mut remote, r.dst, dst_joins),
        ] {
            match v.last_mut() {
                Some(l) if joins => l.iov_len += r.len,
                _ => v.push(libc::iovec {
                    iov_base: at as *mut libc::c_void,
                    iov_len: r.len,
                }),
            }
        }
        taken += 1;
    }
    (local, remote, taken)
}

/// How many threads an operation of `bytes` is copied on.
fn parts_for(bytes: usize) -> usize {
    if bytes < 2 * BYTES_PER_THREAD {
        return 1;
    }
    // Asked once: std reads the cgroup's quota from /proc and /sys on every call, which cost
    // an operation copied inline on the driver more than its copy did.
    static CORES: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    let cores = *CORES.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    cores.min(COPY_THREADS).min(bytes / BYTES_PER_THREAD).max(1)
}

/// `runs` cut into `parts` shares of nearly equal bytes, in order (a run split where a
/// share ends).
fn split(runs: &[Run], total: usize, parts: usize) -> Vec<Vec<Run>> {
    let per = total.div_ceil(parts.max(1)).max(1);
    let mut shares = vec![Vec::new()];
    let mut room = per;
    for &run in runs {
        let mut run = run;
        while run.len > 0 {
            if room == 0 {
                shares.push(Vec::new());
                room = per;
            }
            let take = run.len.min(room);
            if let Some(share) = shares.last_mut() {
                share.push(Run {
                    src: run.src,
                    dst: run.dst,
                    len: take,
                });
            }
            run.src += take;
            run.dst += take;
            run.len -= take;
            room -= take;
        }
    }
    shares
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
    fn rows_apart_on_one_side_and_touching_on_the_other_are_one_iovec_on_the_other() {
        // A decode rank's own half of every prefill row: 1 KiB apart every 2 KiB at the
        // source, side by side at the destination.
        let runs: Vec<Run> = (0..8)
            .map(|i| Run {
                src: 0x10000 + i * 2048,
                dst: 0x90000 + i * 1024,
                len: 1024,
            })
            .collect();
        let (local, remote, taken) = iovecs(&runs);
        assert_eq!((local.len(), remote.len(), taken), (8, 1, 8));
        assert_eq!(remote[0].iov_len, 8 * 1024);
        let (local, remote, _) = iovecs(
            &runs
                .iter()
                .map(|r| Run {
                    src: r.dst,
                    dst: r.src,
                    len: r.len,
                })
                .collect::<Vec<_>>(),
        );
        assert_eq!((local.len(), remote.len()), (1, 8));
    }

    #[test]
    fn only_short_rows_apart_in_the_receiver_pin_a_page_each() {
        let rows = |len: u64, dst_stride: u64, rows: u32| Slice {
            region: Region::Kv { layer: 0, plane: 0 },
            src_offset: 0,
            dst_offset: 0,
            len,
            rows,
            src_stride: len,
            dst_stride,
        };
        assert!(pins_every_row(&rows(1024, 2048, 16)));
        assert!(!pins_every_row(&rows(1024, 1024, 16)), "side by side");
        assert!(
            !pins_every_row(&rows(ROW_PIN_MIN, 2 * ROW_PIN_MIN, 4)),
            "long rows"
        );
        assert!(!pins_every_row(&rows(1024, 2048, 1)), "one row");
    }

    #[test]
    fn a_call_takes_at_most_the_iovec_limit_on_either_side() {
        let runs: Vec<Run> = (0..IOV_MAX + 5)
            .map(|i| Run {
                src: 0x10000 + i * 64,
                dst: 0x90000 + i * 32,
                len: 32,
            })
            .collect();
        let (local, remote, taken) = iovecs(&runs);
        assert_eq!((local.len(), remote.len(), taken), (IOV_MAX, 1, IOV_MAX));
        assert_eq!(iovecs(&runs[taken..]).2, 5);
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
    fn shares_cover_every_byte_once_in_order_and_nearly_equal() {
        let runs = vec![
            Run {
                src: 0,
                dst: 1000,
                len: 10,
            },
            Run {
                src: 100,
                dst: 2000,
                len: 25,
            },
            Run {
                src: 500,
                dst: 3000,
                len: 5,
            },
        ];
        let shares = split(&runs, 40, 3);
        assert_eq!(shares.len(), 3);
        let sizes: Vec<usize> = shares
            .iter()
            .map(|s| s.iter().map(|r| r.len).sum())
            .collect();
        assert_eq!(sizes, vec![14, 14, 12]);
        let flat: Vec<(usize, usize)> = shares
            .iter()
            .flatten()
            .flat_map(|r| (0..r.len).map(move |i| (r.src + i, r.dst + i)))
            .collect();
        let want: Vec<(usize, usize)> = runs
            .iter()
            .flat_map(|r| (0..r.len).map(move |i| (r.src + i, r.dst + i)))
            .collect();
        assert_eq!(flat, want);
    }

    #[test]
    fn a_large_copy_on_several_threads_lands_every_byte() {
        let layout = Layout {
            layers: 1,
            planes: 1,
            page_bytes: 1 << 20,
            pages: 12,
            aux_bytes: 0,
            state_bytes: 0,
            slots: 0,
        };
        let src = MemoryMap::allocate(layout);
        let dst = MemoryMap::allocate(layout);
        let region = Region::Kv { layer: 0, plane: 0 };
        let bytes: Vec<u8> = (0..12u64 << 20).map(|i| (i * 7 + i / 4099) as u8).collect();
        src.write(region, 0, &bytes).unwrap();
        let copied = target_of(&dst)
            .write(&src, &[Slice::run(region, 0, 0, 12 << 20)])
            .unwrap();
        assert_eq!(copied, 12 << 20);
        assert_eq!(read(&dst, region, 0, 12 << 20), bytes);
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
