//! The NIC nearest the memory, on fake sysfs trees shaped like the servers people run:
//! 8 GPUs with 4 or 8 NICs under PCIe switches on 2 NUMA nodes, a NIC with no NUMA
//! information, a soft-RoCE device with no PCI function, and host memory.
#![allow(clippy::unwrap_used)] // tests may panic

use std::path::{Path, PathBuf};

use kvferry_rdma::topology::{
    current_numa_node, nearest, numa_node_of_cpu, Choice, MemoryPlace, Nearness,
};

/// A sysfs tree under a fresh directory.
struct Sysfs {
    root: PathBuf,
}

impl Sysfs {
    fn new(name: &str) -> Sysfs {
        let root =
            std::env::temp_dir().join(format!("kvferry-sysfs-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&root);
        std::fs::create_dir_all(&root).unwrap();
        Sysfs { root }
    }

    /// A PCI function at `path` (root complex, bridges, function) with `numa` (-1: none).
    fn function(&self, path: &[&str], numa: i32) -> PathBuf {
        let mut dir = self.root.join("devices");
        for p in path {
            dir = dir.join(p);
        }
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("numa_node"), format!("{numa}\n")).unwrap();
        let id = path.last().unwrap();
        let bus = self.root.join("bus/pci/devices");
        std::fs::create_dir_all(&bus).unwrap();
        std::os::unix::fs::symlink(&dir, bus.join(id)).unwrap();
        dir
    }

    /// An RDMA device `name` on the PCI function at `path`.
    fn nic(&self, name: &str, path: &[&str], numa: i32) {
        let dir = self.function(path, numa);
        let class = self.root.join("class/infiniband").join(name);
        std::fs::create_dir_all(&class).unwrap();
        std::os::unix::fs::symlink(dir, class.join("device")).unwrap();
    }

    /// An RDMA device with no PCI function (soft-RoCE).
    fn soft(&self, name: &str) {
        std::fs::create_dir_all(self.root.join("class/infiniband").join(name)).unwrap();
    }

    fn path(&self) -> &Path {
        &self.root
    }
}

impl Drop for Sysfs {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.root);
    }
}

fn gpu(id: &str) -> MemoryPlace {
    MemoryPlace::Gpu {
        pci_bus_id: id.to_owned(),
    }
}

fn names(n: usize) -> Vec<String> {
    (0..n).map(|i| format!("mlx5_{i}")).collect()
}

/// Root complex `rc` (0 or 1, NUMA node of the same number), root port `port`, a switch
/// below it with downstream ports; returns the bridge path down to downstream port `down`.
fn below_switch(rc: usize, port: usize, down: usize) -> Vec<String> {
    let root = if rc == 0 { "pci0000:00" } else { "pci0000:80" };
    let bus = rc * 0x80 + port * 0x10;
    vec![
        root.to_owned(),
        format!("0000:{:02x}:{:02x}.0", rc * 0x80, port + 1),
        format!("0000:{:02x}:00.0", bus + 1),
        format!("0000:{:02x}:{:02x}.0", bus + 2, down),
    ]
}

fn at(path: &[String], function: String) -> (Vec<String>, String) {
    let mut p = path.to_vec();
    p.push(function.clone());
    (p, function)
}

fn refs(p: &[String]) -> Vec<&str> {
    p.iter().map(String::as_str).collect()
}

/// 8 GPUs and `nics_per_switch` x 4 NICs: two root complexes (NUMA 0 and 1), two root ports
/// each, one switch per port holding 2 GPUs and the NICs; with 2 NICs per switch each GPU
/// and its NIC share a downstream port. Returns the GPUs' bus ids.
fn server(sys: &Sysfs, nics_per_switch: usize) -> Vec<String> {
    let mut gpus = Vec::new();
    let mut nic = 0;
    for rc in 0..2 {
        for port in 0..2 {
            for g in 0..2 {
                let bus = rc * 0x80 + port * 0x10 + 3 + g;
                let (path, id) = at(&below_switch(rc, port, g), format!("0000:{bus:02x}:00.0"));
                sys.function(&refs(&path), rc as i32);
                gpus.push(id);
                if nics_per_switch == 2 {
                    let (path, _) = at(&below_switch(rc, port, g), format!("0000:{bus:02x}:00.1"));
                    sys.nic(&format!("mlx5_{nic}"), &refs(&path), rc as i32);
                    nic += 1;
                }
            }
            if nics_per_switch == 1 {
                let bus = rc * 0x80 + port * 0x10 + 8;
                let (path, _) = at(&below_switch(rc, port, 8), format!("0000:{bus:02x}:00.0"));
                sys.nic(&format!("mlx5_{nic}"), &refs(&path), rc as i32);
                nic += 1;
            }
        }
    }
    gpus
}

fn chosen(device: &str, nearness: Nearness) -> Option<Choice> {
    Some(Choice {
        device: device.to_owned(),
        nearness,
    })
}

#[test]
fn each_gpu_takes_the_nic_under_its_own_switch_with_4_nics() {
    let sys = Sysfs::new("4nics");
    let gpus = server(&sys, 1);
    for (i, id) in gpus.iter().enumerate() {
        assert_eq!(
            nearest(sys.path(), &names(4), &gpu(id)),
            chosen(&format!("mlx5_{}", i / 2), Nearness::SamePcieSwitch),
            "GPU {i} at {id}"
        );
    }
}

#[test]
fn each_gpu_takes_the_nic_on_its_own_downstream_port_with_8_nics() {
    let sys = Sysfs::new("8nics");
    let gpus = server(&sys, 2);
    for (i, id) in gpus.iter().enumerate() {
        assert_eq!(
            nearest(sys.path(), &names(8), &gpu(id)),
            chosen(&format!("mlx5_{i}"), Nearness::SamePcieSwitch),
            "GPU {i} at {id}"
        );
    }
}

#[test]
fn without_a_nic_on_its_switch_a_gpu_takes_one_on_its_root_complex_then_its_numa_node() {
    let sys = Sysfs::new("fallbacks");
    // GPU on root complex 0 (NUMA 0), port 0; a NIC on root complex 0, port 1; another on a
    // third root complex of NUMA 0; one with no NUMA information.
    let (path, id) = at(&below_switch(0, 0, 0), "0000:03:00.0".into());
    sys.function(&refs(&path), 0);
    let (other_port, _) = at(&below_switch(0, 1, 0), "0000:13:00.0".into());
    sys.nic("mlx5_1", &refs(&other_port), 0);
    sys.nic("mlx5_2", &["pci0000:c0", "0000:c0:01.0", "0000:c1:00.0"], 0);
    sys.nic(
        "mlx5_0",
        &["pci0000:40", "0000:40:01.0", "0000:41:00.0"],
        -1,
    );
    let all = vec!["mlx5_0".to_owned(), "mlx5_1".into(), "mlx5_2".into()];
    assert_eq!(
        nearest(sys.path(), &all, &gpu(&id)),
        chosen("mlx5_1", Nearness::SameRootComplex)
    );
    let not_on_its_root = vec!["mlx5_0".to_owned(), "mlx5_2".into()];
    assert_eq!(
        nearest(sys.path(), &not_on_its_root, &gpu(&id)),
        chosen("mlx5_2", Nearness::SameNumaNode)
    );
    let only_unknown = vec!["mlx5_0".to_owned()];
    assert_eq!(
        nearest(sys.path(), &only_unknown, &gpu(&id)),
        chosen("mlx5_0", Nearness::Far),
        "a NIC with no NUMA information is still used when it is the only one"
    );
}

#[test]
fn host_memory_takes_a_nic_on_its_numa_node() {
    let sys = Sysfs::new("host");
    server(&sys, 1);
    let on = |numa_node| nearest(sys.path(), &names(4), &MemoryPlace::Host { numa_node });
    assert_eq!(on(Some(1)), chosen("mlx5_2", Nearness::SameNumaNode));
    assert_eq!(on(Some(0)), chosen("mlx5_0", Nearness::SameNumaNode));
    assert_eq!(
        on(None),
        chosen("mlx5_0", Nearness::Far),
        "unknown: the first"
    );
}

#[test]
fn a_soft_roce_device_is_far_and_used_when_alone() {
    let sys = Sysfs::new("rxe");
    sys.soft("rxe0");
    let (path, id) = at(&below_switch(0, 0, 0), "0000:03:00.0".into());
    sys.function(&refs(&path), 0);
    assert_eq!(
        nearest(sys.path(), &["rxe0".to_owned()], &gpu(&id)),
        chosen("rxe0", Nearness::Far)
    );
    assert_eq!(nearest(sys.path(), &[], &gpu(&id)), None);
}

#[test]
fn a_cpus_numa_node_is_read_from_its_node_link() {
    let sys = Sysfs::new("cpus");
    for (cpu, node) in [(0, 0), (1, 0), (2, 1), (3, 1)] {
        let dir = sys.path().join(format!("devices/system/cpu/cpu{cpu}"));
        std::fs::create_dir_all(dir.join(format!("node{node}"))).unwrap();
        std::fs::create_dir_all(dir.join("cache")).unwrap();
    }
    assert_eq!(numa_node_of_cpu(sys.path(), 2), Some(1));
    assert_eq!(numa_node_of_cpu(sys.path(), 1), Some(0));
    assert_eq!(numa_node_of_cpu(sys.path(), 9), None);
    // This host: every CPU of a kernel with NUMA support has its node link.
    if Path::new("/sys/devices/system/cpu/cpu0/node0").exists() {
        assert!(current_numa_node(Path::new("/sys")).is_some());
    }
}
