//! How a batch of copy jobs becomes as few engine calls as it can: neighbouring pieces that
//! continue each other become one run, and equal pieces at a fixed stride on both sides (head
//! rows of heterogeneous tensor parallelism, pages of one layer) become one strided copy. A
//! call costs microseconds on a GPU, so a batch of 4 KiB pages or 256 B rows moved one call
//! per piece runs at a small fraction of the bus.

use crate::staging::CopyJob;

/// The largest pitch a strided copy takes (CUDA's `cuMemcpy2D` limit on every device so far).
pub const MAX_PITCH: usize = (1 << 31) - 1;

/// One call of a copy engine.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CopyCall {
    /// One contiguous run.
    Run(CopyJob),
    /// `rows` rows of `width` bytes: row `i` goes from `src + i * src_pitch` to
    /// `dst + i * dst_pitch`.
    Rows {
        /// First destination byte.
        dst: usize,
        /// First source byte.
        src: usize,
        /// Bytes per row.
        width: usize,
        /// Rows.
        rows: usize,
        /// Distance between rows at the destination (at least `width`).
        dst_pitch: usize,
        /// Distance between rows at the source (at least `width`).
        src_pitch: usize,
    },
}

impl CopyCall {
    /// The contiguous pieces the call moves: itself for a run, each row for rows.
    pub fn pieces(&self) -> impl Iterator<Item = CopyJob> {
        let (first, width, rows, dst_pitch, src_pitch) = match *self {
            CopyCall::Run(j) => (j, j.len, 1, 0, 0),
            CopyCall::Rows {
                dst,
                src,
                width,
                rows,
                dst_pitch,
                src_pitch,
            } => (
                CopyJob {
                    dst,
                    src,
                    len: width,
                },
                width,
                rows,
                dst_pitch,
                src_pitch,
            ),
        };
        (0..rows).map(move |r| CopyJob {
            dst: first.dst + r * dst_pitch,
            src: first.src + r * src_pitch,
            len: width,
        })
    }

    /// Bytes the call moves.
    pub fn bytes(&self) -> usize {
        match *self {
            CopyCall::Run(j) => j.len,
            CopyCall::Rows { width, rows, .. } => width * rows,
        }
    }
}

/// The calls that carry out `jobs` (in order, none of them overlapping another's
/// destination): the same bytes to the same places, in fewer calls.
pub fn plan_copies(jobs: &[CopyJob]) -> Vec<CopyCall> {
    let runs = merge_runs(jobs);
    let mut calls = Vec::with_capacity(runs.len());
    let mut i = 0;
    while i < runs.len() {
        let rows = rows_from(&runs[i..]);
        if rows >= 2 {
            let (a, b) = (runs[i], runs[i + 1]);
            calls.push(CopyCall::Rows {
                dst: a.dst,
                src: a.src,
                width: a.len,
                rows,
                dst_pitch: b.dst - a.dst,
                src_pitch: b.src - a.src,
            });
            i += rows;
        } else {
            calls.push(CopyCall::Run(runs[i]));
            i += 1;
        }
    }
    calls
}

/// `jobs` with each piece that continues the previous one on both sides folded into it.
fn merge_runs(jobs: &[CopyJob]) -> Vec<CopyJob> {
    let mut runs: Vec<CopyJob> = Vec::with_capacity(jobs.len());
    for &j in jobs.iter().filter(|j| j.len > 0) {
        match runs.last_mut() {
            Some(last)
                if last.src.checked_add(last.len) == Some(j.src)
                    && last.dst.checked_add(last.len) == Some(j.dst) =>
            {
                last.len += j.len;
            }
            _ => runs.push(j),
        }
    }
    runs
}

/// How many of `runs`, from the first, are rows of one strided copy: the same width, and
/// the same forward pitch (no narrower than a row, within [`MAX_PITCH`]) on each side.
fn rows_from(runs: &[CopyJob]) -> usize {
    let [a, b, ..] = runs else {
        return runs.len();
    };
    let pitch = |from: usize, to: usize| to.checked_sub(from).filter(|p| *p >= a.len);
    let (Some(dst_pitch), Some(src_pitch)) = (pitch(a.dst, b.dst), pitch(a.src, b.src)) else {
        return 1;
    };
    if b.len != a.len || dst_pitch > MAX_PITCH || src_pitch > MAX_PITCH {
        return 1;
    }
    let mut n = 2;
    while let Some(c) = runs.get(n) {
        let prev = runs[n - 1];
        if c.len != a.len
            || prev.dst.checked_add(dst_pitch) != Some(c.dst)
            || prev.src.checked_add(src_pitch) != Some(c.src)
        {
            break;
        }
        n += 1;
    }
    n
}

/// Carries out `call` with the CPU (the host copy engine, and tests).
///
/// # Safety
///
/// Every byte the call reads and writes must be valid for it, and no destination byte may
/// be a source byte of the same call.
pub unsafe fn copy_with_cpu(call: &CopyCall) {
    for j in call.pieces() {
        // SAFETY: the caller's contract, piece by piece.
        unsafe { std::ptr::copy_nonoverlapping(j.src as *const u8, j.dst as *mut u8, j.len) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn job(dst: usize, src: usize, len: usize) -> CopyJob {
        CopyJob { dst, src, len }
    }

    #[test]
    fn pieces_that_continue_each_other_become_one_run() {
        let jobs = [
            job(0, 1000, 4096),
            job(4096, 5096, 4096),
            job(8192, 9192, 100),
        ];
        assert_eq!(plan_copies(&jobs), vec![CopyCall::Run(job(0, 1000, 8292))]);
    }

    #[test]
    fn equal_rows_at_a_fixed_stride_become_one_strided_copy() {
        // 256 B head rows, 1 KiB apart in the source, packed in the destination.
        let jobs: Vec<CopyJob> = (0..16)
            .map(|i| job(i * 256, 10_000 + i * 1024, 256))
            .collect();
        assert_eq!(
            plan_copies(&jobs),
            vec![CopyCall::Rows {
                dst: 0,
                src: 10_000,
                width: 256,
                rows: 16,
                dst_pitch: 256,
                src_pitch: 1024,
            }]
        );
    }

    #[test]
    fn scattered_pieces_stay_one_call_each() {
        let jobs = [
            job(0, 90_000, 4096),
            job(4096, 50_000, 4096),
            job(8192, 10_000, 4096),
        ];
        assert_eq!(plan_copies(&jobs).len(), 3);
    }

    #[test]
    fn a_stride_that_breaks_ends_the_rows_and_the_rest_is_planned_on() {
        let mut jobs: Vec<CopyJob> = (0..4).map(|i| job(i * 64, 1000 + i * 128, 64)).collect();
        jobs.push(job(4 * 64, 7777, 64));
        jobs.push(job(5 * 64, 9000, 10));
        let calls = plan_copies(&jobs);
        assert_eq!(calls.len(), 3, "{calls:?}");
        assert!(matches!(calls[0], CopyCall::Rows { rows: 4, .. }));
    }

    /// A small deterministic generator (no dependency for one test).
    fn next(seed: &mut u64) -> u64 {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        *seed
    }

    #[test]
    fn the_plan_moves_exactly_the_bytes_the_jobs_move() {
        let mut seed = 0x9E37_79B9_7F4A_7C15u64;
        for _ in 0..500 {
            let src: Vec<u8> = (0..8192).map(|i| (i * 31 % 251) as u8).collect();
            let mut want = vec![0u8; 8192];
            let mut got = vec![0u8; 8192];
            // Jobs over disjoint destination slots (as the staged paths make them), drawn from
            // runs, rows and scatter.
            let slot = [16usize, 64, 256][next(&mut seed) as usize % 3];
            let slots = 8192 / slot;
            let mut jobs = Vec::new();
            let mut d = 0;
            while d + 1 < slots && jobs.len() < 40 {
                let s = match next(&mut seed) % 3 {
                    0 => d,
                    1 => (d * 2) % slots,
                    _ => next(&mut seed) as usize % slots,
                };
                let len = if next(&mut seed) % 4 == 0 {
                    slot / 2
                } else {
                    slot
                };
                jobs.push((d * slot, s * slot, len));
                d += 1 + (next(&mut seed) % 2) as usize;
            }
            for &(dst, s, len) in &jobs {
                want[dst..dst + len].copy_from_slice(&src[s..s + len]);
            }
            let (to, from) = (got.as_mut_ptr() as usize, src.as_ptr() as usize);
            let jobs: Vec<CopyJob> = jobs
                .iter()
                .map(|&(dst, s, len)| job(to + dst, from + s, len))
                .collect();
            for call in plan_copies(&jobs) {
                // SAFETY: every job lies inside `src` and `got`, which do not overlap.
                unsafe { copy_with_cpu(&call) };
            }
            assert_eq!(got, want);
        }
    }
}
