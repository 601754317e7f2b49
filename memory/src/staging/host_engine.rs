//! The host copy engine: device memory that lives on the host, copied by a worker thread,
//! so the staged pipeline runs where there is no GPU.

use super::{
    CopyDirection, CopyDone, CopyEngine, CopyError, CopyJob, IpcExport, IpcHandleType, IpcMapping,
};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::Duration;

/// A copy engine for machines without a GPU: a worker thread that copies with the CPU after
/// a fixed delay per batch, so the staged pipeline (ordering, overlap, the bounded pool,
/// faults mid-copy) runs in CI over memory registered as device memory but living on the
/// host.
#[derive(Debug)]
pub struct HostCopyEngine {
    jobs: flume::Sender<(CopyDirection, Vec<CopyJob>, CopyDone)>,
    counts: Arc<CopyCounts>,
    /// Batches of the failing direction so far, and which direction fails after how many.
    failing: Arc<AtomicU64>,
    fail: Option<(CopyDirection, u64)>,
    /// Exports end a piece at every multiple of this many bytes of address.
    export_piece: Option<u64>,
}

/// What a copy engine was asked to do, and the calls it made for it.
#[derive(Debug, Default)]
pub struct CopyCounts {
    /// Batches started.
    pub batches: AtomicU64,
    /// Jobs (pieces) in them.
    pub jobs: AtomicU64,
    /// Copy calls made for them after planning ([`crate::plan_copies`]).
    pub calls: AtomicU64,
    /// Bytes moved.
    pub bytes: AtomicU64,
}

impl CopyCounts {
    /// Counts one batch and the calls planned for it.
    pub fn count(&self, jobs: usize, calls: &[crate::CopyCall]) {
        self.batches.fetch_add(1, Ordering::Relaxed);
        self.jobs.fetch_add(jobs as u64, Ordering::Relaxed);
        self.calls.fetch_add(calls.len() as u64, Ordering::Relaxed);
        let bytes: usize = calls.iter().map(crate::CopyCall::bytes).sum();
        self.bytes.fetch_add(bytes as u64, Ordering::Relaxed);
    }

    /// `(batches, jobs, calls, bytes)` so far.
    pub fn snapshot(&self) -> (u64, u64, u64, u64) {
        (
            self.batches.load(Ordering::Relaxed),
            self.jobs.load(Ordering::Relaxed),
            self.calls.load(Ordering::Relaxed),
            self.bytes.load(Ordering::Relaxed),
        )
    }
}

impl HostCopyEngine {
    /// An engine whose every batch takes at least `delay`.
    pub fn new(delay: Duration) -> Arc<Self> {
        Self::failing(delay, None)
    }

    /// An engine that fails every batch of `fail.0`'s direction after the first `fail.1` of
    /// them (fault tests). Copies into a peer ([`CopyEngine::copy_to_peer`]) count as the
    /// prefill's outgoing batches (`DeviceToHost`), one per job (a staged operation is many
    /// batches, a peer copy one call).
    pub fn failing(delay: Duration, fail: Option<(CopyDirection, u64)>) -> Arc<Self> {
        Self::with(delay, fail, None)
    }

    fn with(
        delay: Duration,
        fail: Option<(CopyDirection, u64)>,
        export_piece: Option<u64>,
    ) -> Arc<Self> {
        let (tx, rx) = flume::unbounded::<(CopyDirection, Vec<CopyJob>, CopyDone)>();
        let counts = Arc::new(CopyCounts::default());
        let counted = counts.clone();
        let failing = Arc::new(AtomicU64::new(0));
        let seen = failing.clone();
        std::thread::Builder::new()
            .name("kvferry-host-copy".to_owned())
            .spawn(move || {
                while let Ok((direction, jobs, done)) = rx.recv() {
                    if !delay.is_zero() {
                        std::thread::sleep(delay);
                    }
                    if let Some((failing, ok)) = fail {
                        if failing == direction && seen.fetch_add(1, Ordering::SeqCst) + 1 > ok {
                            done(Err(CopyError("injected copy failure".to_owned())));
                            continue;
                        }
                    }
                    let calls = crate::plan_copies(&jobs);
                    counted.count(jobs.len(), &calls);
                    for call in &calls {
                        // SAFETY: the staged paths hand only ranges of registered memory
                        // (bounds-checked by MemoryMap) and of staging buffers they hold until
                        // `done` runs; "device" memory of this engine is host memory.
                        unsafe { crate::copy_with_cpu(call) };
                    }
                    done(Ok(()));
                }
            })
            .map(|_| ())
            .unwrap_or_else(|e| panic!("cannot start the host copy thread: {e}"));
        Arc::new(HostCopyEngine {
            jobs: tx,
            counts,
            failing,
            fail,
            export_piece,
        })
    }

    /// An engine whose exports ([`CopyEngine::export_ipc`]) end a piece at every multiple of
    /// `piece` bytes of address, as a region over several allocations of the VMM API is
    /// exported: pages that cross a piece's end are copied in two.
    pub fn exporting_in_pieces(piece: u64) -> Arc<Self> {
        Self::with(Duration::ZERO, None, Some(piece.max(1)))
    }

    /// What it was asked to do and the calls it made (the copy benchmark's counts).
    pub fn counts(&self) -> &CopyCounts {
        &self.counts
    }
}

impl CopyEngine for HostCopyEngine {
    fn name(&self) -> &'static str {
        "host"
    }

    fn start(&self, _device: u32, direction: CopyDirection, jobs: Vec<CopyJob>, done: CopyDone) {
        if let Err(flume::SendError((_, _, done))) = self.jobs.send((direction, jobs, done)) {
            done(Err(CopyError("the host copy thread is gone".to_owned())));
        }
    }

    /// Its "device" memory is this process's host memory: only this process maps it (two
    /// nodes of one test process), in place.
    fn export_ipc(
        &self,
        _device: u32,
        addr: u64,
        len: u64,
        _importer: u32,
    ) -> Result<Vec<IpcExport>, CopyError> {
        let piece = self.export_piece.unwrap_or(u64::MAX);
        let end = addr.saturating_add(len);
        let mut pieces = Vec::new();
        let mut at = addr;
        while at < end {
            let next = end.min((at / piece).saturating_add(1).saturating_mul(piece));
            pieces.push(IpcExport {
                handle_type: IpcHandleType::InPlace,
                handle: [0; 64],
                addr: at,
                len: next - at,
                offset: 0,
                keep: None,
            });
            at = next;
        }
        Ok(pieces)
    }

    fn import_ipc(
        &self,
        _device: u32,
        owner: u32,
        export: &IpcExport,
    ) -> Result<IpcMapping, CopyError> {
        let mine = std::process::id();
        if export.handle_type != IpcHandleType::InPlace || owner != mine {
            return Err(CopyError(format!(
                "the host copy engine maps only its own process's memory (process {owner}'s {:?} export, this is {mine})",
                export.handle_type
            )));
        }
        Ok(IpcMapping {
            addr: export.addr,
            keep: None,
        })
    }

    fn copy_to_peer(&self, _device: u32, jobs: &[CopyJob]) -> Result<(), CopyError> {
        if let Some((CopyDirection::DeviceToHost, ok)) = self.fail {
            let n = jobs.len().max(1) as u64;
            if self.failing.fetch_add(n, Ordering::SeqCst) + n > ok {
                return Err(CopyError("injected copy failure".to_owned()));
            }
        }
        if let Some(piece) = self.export_piece {
            // Pieces of different allocations are not contiguous where they are mapped: a
            // copy that crosses a piece's end would land outside it.
            if let Some(job) = jobs
                .iter()
                .find(|j| j.len > 0 && j.dst as u64 / piece != (j.dst + j.len - 1) as u64 / piece)
            {
                return Err(CopyError(format!(
                    "a copy of {} bytes to {:#x} crosses the end of an exported piece",
                    job.len, job.dst
                )));
            }
        }
        let calls = crate::plan_copies(jobs);
        self.counts.count(jobs.len(), &calls);
        for call in &calls {
            // SAFETY: sources are registered memory of this process (bounds-checked by
            // MemoryMap) and destinations lie inside a mapping of `import_ipc`, which is this
            // process's own registered memory, bounds-checked by the caller against the
            // exported region's length.
            unsafe { crate::copy_with_cpu(call) };
        }
        Ok(())
    }
}
