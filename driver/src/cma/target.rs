//! Where a writer's copies of one session land: the receiver's host regions by cross-memory
//! attach, its device regions mapped here by the copy engine.

use super::*;

/// One piece of a receiver's device region, mapped into this process.
pub(super) struct DeviceTarget {
    pub(super) region: u32,
    /// Where the piece starts in its region.
    pub(super) start: u64,
    pub(super) len: u64,
    /// This node's device the copies into it run on.
    pub(super) device: u32,
    pub(super) mapping: IpcMapping,
}

/// Where a writer's copies of one session go: the receiver's host regions (cross-memory
/// attach) and its device regions mapped here (CUDA IPC).
pub struct SameHostTarget {
    pub(super) host: CmaTarget,
    pub(super) device: Vec<DeviceTarget>,
    pub(super) engine: Option<Arc<dyn CopyEngine>>,
    /// The session said once that its short rows go over TCP.
    pub(super) rows_by_tcp_said: std::sync::atomic::AtomicBool,
}

/// Why a copy into the receiver did not complete.
pub(super) enum CopyFailure {
    Host(CmaError),
    Device(CopyError),
}

impl std::fmt::Display for CopyFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CopyFailure::Host(e) => e.fmt(f),
            CopyFailure::Device(e) => e.fmt(f),
        }
    }
}

impl SameHostTarget {
    /// The first slice of `slices` whose rows land apart in the receiver's host memory and
    /// are too short to copy well by cross-memory attach ([`kvferry_cma::pins_every_row`]);
    /// device regions' rows go by the copy engine, which has no such cost.
    pub(super) fn slow_rows<'a>(&self, slices: &'a [Slice]) -> Option<&'a Slice> {
        slices.iter().find(|s| {
            let code = s.region.code();
            kvferry_cma::pins_every_row(s) && !self.device.iter().any(|d| d.region == code)
        })
    }

    /// Copies every row of `slices` into the receiver: device regions' rows by the copy
    /// engine, the rest by cross-memory attach. Nothing is copied if a device row leaves its
    /// region; when it returns, every byte landed.
    pub(super) fn write(&self, memory: &MemoryMap, slices: &[Slice]) -> Result<(), CopyFailure> {
        if self.device.is_empty() {
            return self
                .host
                .write(memory, slices)
                .map(drop)
                .map_err(CopyFailure::Host);
        }
        let mut host = Vec::new();
        let mut jobs: Vec<(u32, CopyJob)> = Vec::new();
        for slice in slices {
            let code = slice.region.code();
            let first = self.device.partition_point(|d| d.region < code);
            let pieces = &self.device
                [first..first + self.device[first..].partition_point(|d| d.region == code)];
            let Some(last) = pieces.last() else {
                host.push(*slice);
                continue;
            };
            if !slice
                .dst_end()
                .is_some_and(|end| end <= last.start + last.len)
            {
                return Err(CopyFailure::Host(CmaError::OutsideRegion { region: code }));
            }
            for run in slice.runs() {
                let src = memory
                    .range(run.region, run.src_offset, run.len)
                    .map_err(|e| CopyFailure::Host(CmaError::Source(e.to_string())))?;
                // A run crossing from one allocation into the next is copied in two.
                let (mut at, mut src, end) =
                    (run.dst_offset, src as usize, run.dst_offset + run.len);
                while at < end {
                    let i = pieces.partition_point(|d| d.start + d.len <= at);
                    let piece = &pieces[i];
                    let n = (end.min(piece.start + piece.len) - at) as usize;
                    jobs.push((
                        piece.device,
                        CopyJob {
                            dst: (piece.mapping.addr + (at - piece.start)) as usize,
                            src,
                            len: n,
                        },
                    ));
                    at += n as u64;
                    src += n;
                }
            }
        }
        if !host.is_empty() {
            self.host.write(memory, &host).map_err(CopyFailure::Host)?;
        }
        if jobs.is_empty() {
            return Ok(());
        }
        let engine = self.engine.as_ref().ok_or_else(|| {
            CopyFailure::Device(CopyError("device memory without a copy engine".to_owned()))
        })?;
        jobs.sort_by_key(|(device, _)| *device);
        for group in jobs.chunk_by(|a, b| a.0 == b.0) {
            let device = group[0].0;
            let batch: Vec<CopyJob> = group.iter().map(|(_, job)| *job).collect();
            engine
                .copy_to_peer(device, &batch)
                .map_err(CopyFailure::Device)?;
        }
        Ok(())
    }
}
