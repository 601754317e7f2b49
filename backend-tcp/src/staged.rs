//! Operations whose pages are device memory, over TCP: staged through host buffers.
//!
//! Prefill copies the operation's payload, one staging buffer at a time, from device memory
//! into buffers of the node's pool, and writes buffer k to the socket while the engine still
//! fills buffer k+1. Decode reads each buffer's worth of payload from the socket and copies
//! it to the device while it reads the next; it acknowledges only after every copy landed,
//! so an acknowledged byte is in device memory. The wire is the same as for host memory: a
//! host decode can receive from a device prefill and the other way round.
//!
//! Copies in flight are waited for before their buffers go back to the pool and before a
//! write is acknowledged. A task cancelled mid-copy (a fence, a closed connection) hands its
//! copies and their buffers to the reaper ([`InFlightCopies`]) instead of blocking its thread:
//! no engine ever writes into a buffer someone else uses. The engine runs a device's copies in
//! order on one stream, so a later write into the same pages lands after them.

use crate::io_common::Checksum;
use std::collections::VecDeque;
use std::io;

use kvferry_core::Slice;
use kvferry_memory::{
    CopyDirection, CopyJob, InFlightCopies, MemoryKind, MemoryMap, Staging, StagingBuffer,
};

use crate::send::GatherWrite;

/// Buffers one connection keeps in flight: one on the wire (or being read), the next being
/// copied.
pub const DEPTH: usize = 2;

/// One contiguous range of an operation, where it lives.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Piece {
    addr: usize,
    len: usize,
    kind: MemoryKind,
}

/// The ranges of `slices`' rows (addresses from registered memory, a row each) with their
/// memory kinds.
pub(crate) fn pieces(memory: &MemoryMap, slices: &[Slice], addrs: &[(usize, usize)]) -> Vec<Piece> {
    slices
        .iter()
        .flat_map(|s| std::iter::repeat(s).take(s.rows as usize))
        .zip(addrs)
        .map(|(s, &(addr, len))| Piece {
            addr,
            len,
            kind: memory.kind(s.region).unwrap_or(MemoryKind::Host),
        })
        .collect()
}

/// Whether any of `slices` is device memory (the operation is staged).
pub(crate) fn on_device(memory: &MemoryMap, slices: &[Slice]) -> bool {
    slices
        .iter()
        .any(|s| !matches!(memory.kind(s.region), Some(MemoryKind::Host) | None))
}

/// The copies that move payload bytes `lo..hi` between `pieces` and `buffer` (whose byte 0
/// is payload byte `lo`): device pieces become engine jobs per device, host pieces are
/// copied here with the CPU.
fn plan(
    pieces: &[Piece],
    lo: usize,
    hi: usize,
    buffer: &mut StagingBuffer,
    direction: CopyDirection,
) -> Vec<(u32, Vec<CopyJob>)> {
    let mut jobs: Vec<(u32, Vec<CopyJob>)> = Vec::new();
    let base = buffer.addr();
    let mut at = 0usize;
    for p in pieces {
        let (start, end) = (at, at + p.len);
        at = end;
        let (a, b) = (start.max(lo), end.min(hi));
        if a >= b {
            continue;
        }
        let mem = p.addr + (a - start);
        let staged = base + (a - lo);
        let len = b - a;
        match p.kind {
            MemoryKind::Cuda { device } => {
                let job = match direction {
                    CopyDirection::DeviceToHost => CopyJob {
                        dst: staged,
                        src: mem,
                        len,
                    },
                    CopyDirection::HostToDevice => CopyJob {
                        dst: mem,
                        src: staged,
                        len,
                    },
                };
                match jobs.iter_mut().find(|(d, _)| *d == device) {
                    Some((_, list)) => list.push(job),
                    None => jobs.push((device, vec![job])),
                }
            }
            MemoryKind::Host => {
                let range = a - lo..b - lo;
                // SAFETY: `mem..mem+len` lies inside one registered host range resolved by
                // MemoryMap::range for this operation, whose pages the core holds for it.
                unsafe {
                    match direction {
                        CopyDirection::DeviceToHost => buffer.as_mut_slice()[range]
                            .copy_from_slice(std::slice::from_raw_parts(mem as *const u8, len)),
                        CopyDirection::HostToDevice => {
                            std::slice::from_raw_parts_mut(mem as *mut u8, len)
                                .copy_from_slice(&buffer.as_slice()[range])
                        }
                    }
                }
            }
        }
    }
    jobs
}

fn copy_failed(e: kvferry_memory::CopyError) -> io::Error {
    io::Error::other(e)
}

/// A buffer being filled or emptied by the engine. Dropped with copies pending, it leaves the
/// buffer to them: it goes back to the pool once they landed.
struct Stage {
    copies: InFlightCopies,
    buffer: StagingBuffer,
    len: usize,
}

impl Drop for Stage {
    fn drop(&mut self) {
        if !self.copies.is_empty() {
            let buffer = self.buffer.take();
            self.copies.hold(buffer);
        }
    }
}

/// A connection's own staging buffer (its lane), made once per connection on first use, with
/// the node's engine and buffer size. A connection never waits for the node's shared pool:
/// it always has its lane, and takes a shared buffer for depth only when one is free. So
/// connections cannot block each other, even while one of them waits on its socket (a full
/// send buffer, a peer that stalls mid-write) holding buffers.
pub(crate) fn lane(staging: &Staging) -> io::Result<std::sync::Arc<Staging>> {
    Staging::new(
        staging.engine().clone(),
        kvferry_memory::StagingConfig {
            buffers: 1,
            ..staging.config()
        },
    )
    .map_err(copy_failed)
}

/// Starts the stage of payload bytes `next..` (as many as `buffer` holds, up to `total`):
/// the engine's copies of its device pieces in `direction`, and the CPU's of its host pieces
/// at once. Prefill's buffer is empty here (the engine fills it); decode's holds the bytes
/// just read.
fn start_stage(
    pieces: &[Piece],
    next: usize,
    total: usize,
    mut buffer: StagingBuffer,
    direction: CopyDirection,
    staging: &Staging,
) -> Stage {
    let hi = (next + buffer.len()).min(total);
    let mut copies = InFlightCopies::default();
    for (device, jobs) in plan(pieces, next, hi, &mut buffer, direction) {
        copies.start(staging, device, direction, jobs);
    }
    Stage {
        copies,
        buffer,
        len: hi - next,
    }
}

/// The connection's lane, made on first use.
pub(crate) fn lane_of(
    slot: &mut Option<std::sync::Arc<Staging>>,
    staging: &Staging,
) -> io::Result<std::sync::Arc<Staging>> {
    if let Some(l) = slot {
        return Ok(l.clone());
    }
    let l = lane(staging)?;
    *slot = Some(l.clone());
    Ok(l)
}

/// The next buffer: the lane's if free, else a free one of the shared pool; `None` when both
/// are out (the caller frees one of its own first). Waits only for the lane, and only when
/// the connection holds nothing, when the lane is free.
async fn next_buffer(lane: &Staging, shared: &Staging, held: usize) -> Option<StagingBuffer> {
    if let Some(b) = lane.try_acquire().or_else(|| shared.try_acquire()) {
        return Some(b);
    }
    if held == 0 {
        return Some(lane.acquire().await);
    }
    None
}

/// Prefill: writes `header`, then the payload of `pieces` staged through `staging`.
/// An error leaves the frame half written: the caller closes the connection.
pub(crate) async fn write_staged<W: GatherWrite>(
    write: &mut W,
    header: &[u8],
    pieces: &[Piece],
    lane: &Staging,
    staging: &Staging,
    mut hasher: Option<Checksum>,
) -> io::Result<()> {
    let total: usize = pieces.iter().map(|p| p.len).sum();
    write.write_gather(header, &[]).await?;
    let mut stages: VecDeque<Stage> = VecDeque::new();
    let mut next = 0usize;
    while next < total || !stages.is_empty() {
        while stages.len() < DEPTH && next < total {
            let Some(buffer) = next_buffer(lane, staging, stages.len()).await else {
                break;
            };
            let stage = start_stage(
                pieces,
                next,
                total,
                buffer,
                CopyDirection::DeviceToHost,
                staging,
            );
            next += stage.len;
            stages.push_back(stage);
        }
        let Some(mut stage) = stages.pop_front() else {
            break;
        };
        stage.copies.all().await.map_err(copy_failed)?;
        if let Some(h) = hasher.as_mut() {
            // The staged bytes, in payload order: exactly what goes on the wire.
            h.update(&stage.buffer.as_slice()[..stage.len]);
        }
        write
            .write_gather(&[], &[(stage.buffer.addr(), stage.len)])
            .await?;
    }
    if let Some(h) = hasher {
        // A checked batch's trailer: the XXH3-64 of the payload just written.
        let trailer = h.digest().to_le_bytes();
        write
            .write_gather(&[], &[(trailer.as_ptr() as usize, trailer.len())])
            .await?;
    }
    Ok(())
}

/// Decode: reads the payload of `pieces` from `read`, staged through `staging`, and copies it
/// into place; returns once every byte is at its destination.
pub(crate) async fn read_staged<R: futures_io::AsyncRead + Unpin>(
    read: &mut R,
    pieces: &[Piece],
    lane: &Staging,
    staging: &Staging,
    mut hasher: Option<&mut Checksum>,
) -> io::Result<()> {
    use futures_lite::AsyncReadExt;
    let total: usize = pieces.iter().map(|p| p.len).sum();
    let mut stages: VecDeque<Stage> = VecDeque::new();
    let mut next = 0usize;
    while next < total {
        let mut buffer = match next_buffer(lane, staging, stages.len()).await {
            Some(b) => b,
            None => {
                // Every buffer of the pool is out: the oldest of ours frees when its copy lands.
                if let Some(mut oldest) = stages.pop_front() {
                    oldest.copies.all().await.map_err(copy_failed)?;
                }
                continue;
            }
        };
        let n = buffer.len().min(total - next);
        read.read_exact(&mut buffer.as_mut_slice()[..n]).await?;
        if let Some(h) = hasher.as_deref_mut() {
            // The bytes as they arrived, before the engine copies them into place.
            h.update(&buffer.as_slice()[..n]);
        }
        let stage = start_stage(
            pieces,
            next,
            total,
            buffer,
            CopyDirection::HostToDevice,
            staging,
        );
        next += stage.len;
        stages.push_back(stage);
        while stages.len() >= DEPTH {
            if let Some(mut oldest) = stages.pop_front() {
                oldest.copies.all().await.map_err(copy_failed)?;
            }
        }
    }
    for mut stage in stages.drain(..) {
        stage.copies.all().await.map_err(copy_failed)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::{Arc, Mutex};

    use kvferry_memory::{CopyDone, CopyEngine, HostBuffer, StagingConfig};

    use super::*;

    /// What happened, in order.
    #[derive(Clone, Debug, PartialEq, Eq)]
    enum Step {
        Copy(usize),
        Write(Vec<u8>),
    }

    type Steps = Arc<Mutex<Vec<Step>>>;

    /// Copies at once with the CPU and records each batch's length.
    struct Recording(Steps);

    impl CopyEngine for Recording {
        fn name(&self) -> &'static str {
            "recording"
        }

        fn start(&self, _device: u32, _d: CopyDirection, jobs: Vec<CopyJob>, done: CopyDone) {
            for j in &jobs {
                // SAFETY: the test's own buffers, alive for the test.
                unsafe {
                    std::ptr::copy_nonoverlapping(j.src as *const u8, j.dst as *mut u8, j.len)
                };
            }
            let len = jobs.iter().map(|j| j.len).sum();
            self.0.lock().unwrap().push(Step::Copy(len));
            done(Ok(()));
        }
    }

    /// Records every write's bytes.
    struct Wire(Steps);

    impl GatherWrite for Wire {
        async fn write_gather(
            &mut self,
            header: &[u8],
            sources: &[(usize, usize)],
        ) -> io::Result<()> {
            let mut bytes = header.to_vec();
            for &(p, l) in sources {
                // SAFETY: staging buffers the pipeline holds while it writes them.
                bytes.extend_from_slice(unsafe { std::slice::from_raw_parts(p as *const u8, l) });
            }
            self.0.lock().unwrap().push(Step::Write(bytes));
            Ok(())
        }

        async fn finish(&mut self) {}
    }

    #[test]
    fn buffer_k_goes_on_the_wire_after_buffer_k_plus_1_started_copying_and_every_byte_is_in_order()
    {
        let steps: Steps = Arc::default();
        let staging = Staging::new(
            Arc::new(Recording(steps.clone())),
            StagingConfig {
                buffers: 4,
                buffer_bytes: 1000,
                ..StagingConfig::default()
            },
        )
        .unwrap();
        // A device piece of 3500 bytes between two host pieces: five buffers' worth in all.
        let mut device = HostBuffer::new(3500);
        let mut host = HostBuffer::new(700);
        for (i, b) in device.as_mut_slice().iter_mut().enumerate() {
            *b = (i % 251) as u8;
        }
        for (i, b) in host.as_mut_slice().iter_mut().enumerate() {
            *b = (i % 13) as u8 + 100;
        }
        let piece = |b: &HostBuffer, range: std::ops::Range<usize>, kind| Piece {
            addr: b.as_slice().as_ptr() as usize + range.start,
            len: range.len(),
            kind,
        };
        let pieces = [
            piece(&host, 0..300, MemoryKind::Host),
            piece(&device, 0..3500, MemoryKind::Cuda { device: 0 }),
            piece(&host, 300..700, MemoryKind::Host),
        ];
        let mut wire = Wire(steps.clone());
        let lane = lane(&staging).unwrap();
        futures_lite::future::block_on(write_staged(
            &mut wire, b"HDR", &pieces, &lane, &staging, None,
        ))
        .unwrap();
        let steps = steps.lock().unwrap().clone();
        // Every byte, in payload order, after the header.
        let mut expected = b"HDR".to_vec();
        expected.extend_from_slice(&host.as_slice()[0..300]);
        expected.extend_from_slice(device.as_slice());
        expected.extend_from_slice(&host.as_slice()[300..700]);
        let sent: Vec<u8> = steps
            .iter()
            .filter_map(|s| match s {
                Step::Write(b) => Some(b.clone()),
                Step::Copy(_) => None,
            })
            .flatten()
            .collect();
        assert_eq!(sent, expected);
        // Five buffers: the first four hold device bytes (copied by the engine), the fifth
        // only host bytes (no batch).
        let copies: Vec<usize> = steps
            .iter()
            .filter_map(|s| match s {
                Step::Copy(n) => Some(*n),
                Step::Write(_) => None,
            })
            .collect();
        assert_eq!(copies, vec![700, 1000, 1000, 800]);
        // Buffer k is written only after buffer k+1's copy started.
        let position = |want: &dyn Fn(&Step) -> bool, nth: usize| {
            steps
                .iter()
                .enumerate()
                .filter(|(_, s)| want(s))
                .nth(nth)
                .map(|(i, _)| i)
        };
        for k in 0..copies.len() - 1 {
            let copy_next = position(&|s| matches!(s, Step::Copy(_)), k + 1).unwrap();
            // Write 0 is the header; buffer k is write k + 1.
            let write_k = position(&|s| matches!(s, Step::Write(_)), k + 1).unwrap();
            assert!(
                copy_next < write_k,
                "buffer {k} written before buffer {} was copying: {steps:?}",
                k + 1
            );
        }
        assert_eq!(staging.free(), 4, "every buffer back in the pool");
        assert_eq!(lane.free(), 1, "and the lane's");
    }
}
