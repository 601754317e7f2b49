//! The RDMA device nearest a node's memory, read from sysfs as NCCL and Mooncake read it:
//! a NIC under the same PCIe switch as the GPU that holds the KV beats one under the same
//! root complex, which beats one on the same NUMA node, which beats the rest. Host memory
//! takes a NIC on its NUMA node. Pure file reads: any tree can be passed (tests build fake
//! ones), and nothing here needs libibverbs.

use std::path::{Path, PathBuf};

/// Where a node's KV lives.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum MemoryPlace {
    /// On the GPU with this PCI bus id, as sysfs names it (`0000:3b:00.0`).
    Gpu {
        /// The bus id.
        pci_bus_id: String,
    },
    /// In host memory near this NUMA node (`None`: unknown).
    Host {
        /// The node.
        numa_node: Option<u32>,
    },
}

/// How near a chosen device is to the memory, best first.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Nearness {
    /// Under the same PCIe bridge or switch as the GPU (NCCL's PIX/PXB).
    SamePcieSwitch,
    /// Under the same root complex, through the host bridge (PHB).
    SameRootComplex,
    /// On the same NUMA node, across root complexes (NODE).
    SameNumaNode,
    /// Anywhere else, or the topology is unknown (SYS).
    Far,
}

impl Nearness {
    /// The label in logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Nearness::SamePcieSwitch => "same PCIe switch",
            Nearness::SameRootComplex => "same root complex",
            Nearness::SameNumaNode => "same NUMA node",
            Nearness::Far => "far or unknown",
        }
    }
}

/// A device chosen for some memory, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Choice {
    /// The RDMA device's name (`mlx5_0`).
    pub device: String,
    /// How near it is.
    pub nearness: Nearness,
}

/// Where a PCI function sits: its root complex and the bridges above it, from the root.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
struct PciPlace {
    /// `pci0000:00`, then each bridge's bus id, down to (not including) the function.
    above: Vec<String>,
    numa_node: Option<u32>,
}

fn is_bus_id(s: &str) -> bool {
    // dddd:bb:dd.f
    let b = s.as_bytes();
    b.len() == 12 && b[4] == b':' && b[7] == b':' && b[10] == b'.'
}

/// The place of the PCI function whose sysfs directory `link` resolves to.
fn pci_place(link: &Path) -> Option<PciPlace> {
    let dir = std::fs::canonicalize(link).ok()?;
    let parts: Vec<String> = dir
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    let root = parts.iter().position(|p| p.starts_with("pci"))?;
    let mut above: Vec<String> = parts[root..]
        .iter()
        .take_while(|p| p.starts_with("pci") || is_bus_id(p))
        .cloned()
        .collect();
    // The last one is the function itself.
    above.pop()?;
    let numa_node = std::fs::read_to_string(dir.join("numa_node"))
        .ok()
        .and_then(|s| s.trim().parse::<i64>().ok())
        .and_then(|n| u32::try_from(n).ok());
    Some(PciPlace { above, numa_node })
}

/// `sysfs`'s view of RDMA device `name` (`class/infiniband/<name>/device`).
fn device_place(sysfs: &Path, name: &str) -> Option<PciPlace> {
    pci_place(&sysfs.join("class/infiniband").join(name).join("device"))
}

/// How near a device at `nic` is to memory at `memory`.
fn nearness(
    nic: Option<&PciPlace>,
    memory: &Option<PciPlace>,
    numa: Option<u32>,
) -> (Nearness, usize) {
    let Some(nic) = nic else {
        return (Nearness::Far, 0);
    };
    if let Some(m) = memory {
        let shared = nic
            .above
            .iter()
            .zip(&m.above)
            .take_while(|(a, b)| a == b)
            .count();
        if shared >= 2 {
            return (Nearness::SamePcieSwitch, shared);
        }
        if shared == 1 {
            return (Nearness::SameRootComplex, 0);
        }
    }
    if numa.is_some() && nic.numa_node == numa {
        return (Nearness::SameNumaNode, 0);
    }
    (Nearness::Far, 0)
}

/// The device of `devices` nearest `memory` in the tree under `sysfs` (`/sys` on a host);
/// among equally near ones the first named. `None` when `devices` is empty.
pub fn nearest(sysfs: &Path, devices: &[String], memory: &MemoryPlace) -> Option<Choice> {
    let (place, numa) = match memory {
        MemoryPlace::Gpu { pci_bus_id } => {
            let place = pci_place(&sysfs.join("bus/pci/devices").join(pci_bus_id));
            let numa = place.as_ref().and_then(|p| p.numa_node);
            (place, numa)
        }
        MemoryPlace::Host { numa_node } => (None, *numa_node),
    };
    let mut best: Option<(Nearness, usize, &String)> = None;
    for name in devices {
        let (near, depth) = nearness(device_place(sysfs, name).as_ref(), &place, numa);
        // Nearer first, then the deeper shared bridge; the first named wins a tie.
        let better = match best {
            None => true,
            Some((n, d, _)) => near < n || (near == n && depth > d),
        };
        if better {
            best = Some((near, depth, name));
        }
    }
    best.map(|(nearness, _, device)| Choice {
        device: device.clone(),
        nearness,
    })
}

/// The NUMA node of the CPU this thread runs on, from `sysfs` and `/proc/self/stat`.
pub fn current_numa_node(sysfs: &Path) -> Option<u32> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    // Field 39 (processor) counted after the command's closing parenthesis (field 2).
    let after = &stat[stat.rfind(')')? + 1..];
    let cpu: u32 = after.split_whitespace().nth(36)?.parse().ok()?;
    numa_node_of_cpu(sysfs, cpu)
}

/// The NUMA node `cpu` belongs to (`devices/system/cpu/cpuN/nodeM`).
pub fn numa_node_of_cpu(sysfs: &Path, cpu: u32) -> Option<u32> {
    let dir: PathBuf = sysfs.join(format!("devices/system/cpu/cpu{cpu}"));
    std::fs::read_dir(dir).ok()?.find_map(|e| {
        let name = e.ok()?.file_name().to_string_lossy().into_owned();
        name.strip_prefix("node")?.parse().ok()
    })
}
