//! Staging buffers on the NUMA node of the device they are copied to and from: a buffer's
//! pages go where they are first touched, so the pool is allocated, touched and page-locked
//! on a thread that runs only on that node's CPUs. A copy between a GPU and memory on the
//! other socket crosses the inter-socket link and loses bandwidth.

use std::path::Path;

/// The CPUs of the NUMA node the PCI device `pci_bus_id` (`0000:3b:00.0`) sits on, as sysfs
/// under `sysfs` says; `None` where it does not say (one node, no NUMA information).
pub fn cpus_near(sysfs: &Path, pci_bus_id: &str) -> Option<Vec<usize>> {
    let node: i64 = std::fs::read_to_string(
        sysfs
            .join("bus/pci/devices")
            .join(pci_bus_id)
            .join("numa_node"),
    )
    .ok()?
    .trim()
    .parse()
    .ok()?;
    if node < 0 {
        return None;
    }
    let list = std::fs::read_to_string(
        sysfs
            .join("devices/system/node")
            .join(format!("node{node}"))
            .join("cpulist"),
    )
    .ok()?;
    let cpus = parse_cpulist(list.trim())?;
    (!cpus.is_empty()).then_some(cpus)
}

/// `0-3,8,10-11` as CPU numbers; `None` if it is not such a list.
fn parse_cpulist(list: &str) -> Option<Vec<usize>> {
    let mut cpus = Vec::new();
    for part in list.split(',').filter(|p| !p.is_empty()) {
        match part.split_once('-') {
            Some((a, b)) => {
                let (a, b): (usize, usize) = (a.parse().ok()?, b.parse().ok()?);
                if b < a || b - a > 4096 {
                    return None;
                }
                cpus.extend(a..=b);
            }
            None => cpus.push(part.parse().ok()?),
        }
    }
    Some(cpus)
}

/// Runs `f` on a thread of its own restricted to `cpus` (where the kernel allows: otherwise
/// it runs unrestricted), and returns what it returns.
pub(crate) fn on_cpus<T: Send>(cpus: &[usize], f: impl FnOnce() -> T + Send) -> T {
    std::thread::scope(|s| {
        s.spawn(|| {
            let mut set = rustix::process::CpuSet::new();
            for &c in cpus
                .iter()
                .filter(|&&c| c < rustix::process::CpuSet::MAX_CPU)
            {
                set.set(c);
            }
            // Not fatal: the buffers then land wherever the scheduler runs this thread.
            let _ = rustix::process::sched_setaffinity(None, &set);
            f()
        })
        .join()
        .unwrap_or_else(|p| std::panic::resume_unwind(p))
    })
}

/// A fake sysfs for tests of placement (here and in the staging pool's).
#[cfg(test)]
pub(crate) mod test_sysfs {
    #![allow(clippy::unwrap_used)] // tests may panic

    /// A sysfs with one GPU at `0000:3b:00.0` on node `node`, whose CPUs are `cpulist`.
    pub(crate) fn sysfs(node: &str, cpulist: &str) -> tempdir::Dir {
        let d = tempdir::Dir::new();
        let dev = d.path().join("bus/pci/devices/0000:3b:00.0");
        std::fs::create_dir_all(&dev).unwrap();
        std::fs::write(dev.join("numa_node"), format!("{node}\n")).unwrap();
        let n = d.path().join("devices/system/node/node1");
        std::fs::create_dir_all(&n).unwrap();
        std::fs::write(n.join("cpulist"), format!("{cpulist}\n")).unwrap();
        d
    }

    /// A directory removed on drop (no dependency for three tests).
    pub(crate) mod tempdir {
        pub(crate) struct Dir(std::path::PathBuf);

        impl Dir {
            pub(crate) fn new() -> Dir {
                static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
                let n = N.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                let p =
                    std::env::temp_dir().join(format!("kvferry-numa-{}-{n}", std::process::id()));
                std::fs::create_dir_all(&p).unwrap();
                Dir(p)
            }

            pub(crate) fn path(&self) -> &std::path::Path {
                &self.0
            }
        }

        impl Drop for Dir {
            fn drop(&mut self) {
                let _ = std::fs::remove_dir_all(&self.0);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests may panic

    use super::test_sysfs::sysfs;
    use super::*;

    #[test]
    fn a_device_on_node_1_is_near_node_1s_cpus() {
        let d = sysfs("1", "0-1,4,6-7");
        assert_eq!(
            cpus_near(d.path(), "0000:3b:00.0"),
            Some(vec![0, 1, 4, 6, 7])
        );
    }

    #[test]
    fn no_numa_information_is_no_preference() {
        let d = sysfs("-1", "0-1");
        assert_eq!(cpus_near(d.path(), "0000:3b:00.0"), None);
        assert_eq!(cpus_near(d.path(), "0000:99:00.0"), None);
        let bad = sysfs("1", "zero-one");
        assert_eq!(cpus_near(bad.path(), "0000:3b:00.0"), None);
    }

    #[test]
    fn work_on_cpus_runs_restricted_to_them() {
        let affinity = on_cpus(&[0], || {
            let set = rustix::process::sched_getaffinity(None).unwrap();
            (0..64).filter(|&c| set.is_set(c)).collect::<Vec<_>>()
        });
        assert_eq!(affinity, vec![0]);
    }
}
