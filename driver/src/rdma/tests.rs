#![allow(clippy::unwrap_used)] // tests may panic

use std::sync::Arc;

use kvferry_core::{Layout, Region};
use kvferry_memory::{
    CopyDirection, CopyDone, CopyEngine, CopyError, CopyJob, DmaBuf, MemoryMap, Staging,
    StagingConfig,
};

use super::export_regions;

/// Exports every region but those starting at `refuse`, each refused with its address.
struct Exporter {
    refuse: Vec<u64>,
}

impl CopyEngine for Exporter {
    fn name(&self) -> &'static str {
        "exporter"
    }

    fn start(&self, _: u32, _: CopyDirection, _: Vec<CopyJob>, done: CopyDone) {
        done(Ok(()));
    }

    fn export_dma_buf(&self, _: u32, addr: u64, _: usize) -> Result<DmaBuf, CopyError> {
        if self.refuse.contains(&addr) {
            return Err(CopyError(format!("{addr:#x} spans two allocations")));
        }
        Ok(DmaBuf {
            fd: std::fs::File::open("/dev/null").unwrap().into(),
            offset: 0,
        })
    }
}

#[test]
fn every_device_region_that_cannot_be_exported_is_reported_with_its_own_reason() {
    let layout = Layout {
        layers: 2,
        planes: 2,
        page_bytes: 4096,
        pages: 4,
        aux_bytes: 0,
        state_bytes: 0,
        slots: 0,
    };
    let memory = MemoryMap::allocate_as_device(layout, 0);
    let regions: Vec<(Region, u64)> = memory
        .region_lens()
        .map(|(r, len)| (r, memory.range(r, 0, len).unwrap() as u64))
        .collect();
    let refuse = vec![regions[1].1, regions[3].1];
    let staging = Staging::new(
        Arc::new(Exporter {
            refuse: refuse.clone(),
        }),
        StagingConfig::default(),
    )
    .unwrap();
    let devices = memory.device_regions().count();
    let exports = export_regions(&memory.with_staging(staging));
    assert_eq!(exports.exported.len(), devices - 2);
    assert_eq!(exports.host.len(), regions.len() - devices);
    let refused: Vec<(Region, String)> = exports.refused;
    assert_eq!(
        refused,
        vec![
            (
                regions[1].0,
                format!("copy failed: {:#x} spans two allocations", refuse[0])
            ),
            (
                regions[3].0,
                format!("copy failed: {:#x} spans two allocations", refuse[1])
            ),
        ]
    );
}
