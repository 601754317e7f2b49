//! Who counts as "the same host", and the ptrace permission a receiver grants its writer.

use std::sync::Mutex;

use crate::Decline;

/// Where a process runs: its host's boot and its PID namespace. Two processes may address
/// each other's memory by pid only when all three fields are equal.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HostIdentity {
    /// `/proc/sys/kernel/random/boot_id`: new at every boot, different on every host.
    pub boot_id: [u8; 16],
    /// The inode of `/proc/self/ns/pid`.
    pub pid_namespace: u64,
    /// The device of `/proc/self/ns/pid` (with the inode, names the namespace).
    pub namespace_device: u64,
}

impl HostIdentity {
    /// This process's identity; [`Decline::Unsupported`] where `/proc` does not say it.
    pub fn current() -> Result<HostIdentity, Decline> {
        let text = std::fs::read_to_string("/proc/sys/kernel/random/boot_id")
            .map_err(|_| Decline::Unsupported)?;
        let boot_id = parse_boot_id(&text).ok_or(Decline::Unsupported)?;
        let ns = rustix::fs::stat("/proc/self/ns/pid").map_err(|_| Decline::Unsupported)?;
        Ok(HostIdentity {
            boot_id,
            pid_namespace: ns.st_ino as u64,
            namespace_device: ns.st_dev as u64,
        })
    }

    /// Whether a process of `other` is reachable from this one by pid, or why not.
    pub fn reaches(&self, other: &HostIdentity) -> Result<(), Decline> {
        if self.boot_id != other.boot_id {
            return Err(Decline::OtherHost);
        }
        if (self.pid_namespace, self.namespace_device)
            != (other.pid_namespace, other.namespace_device)
        {
            return Err(Decline::OtherPidNamespace);
        }
        Ok(())
    }
}

/// A boot id as the kernel prints it (a UUID: 32 hex digits and dashes).
fn parse_boot_id(text: &str) -> Option<[u8; 16]> {
    let hex: Vec<u8> = text
        .trim()
        .bytes()
        .filter(|&c| c != b'-')
        .map(|c| (c as char).to_digit(16).map(|d| d as u8))
        .collect::<Option<_>>()?;
    if hex.len() != 32 {
        return None;
    }
    let mut id = [0u8; 16];
    for (i, pair) in hex.chunks(2).enumerate() {
        id[i] = (pair[0] << 4) | pair[1];
    }
    Some(id)
}

/// What Yama (`/proc/sys/kernel/yama/ptrace_scope`) lets a writer do to a receiver of the
/// same user.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum PtraceScope {
    /// No Yama, or scope 0: any process of the same user may attach.
    Classic,
    /// Scope 1: only ancestors, and the one ptracer the receiver declares.
    Restricted,
    /// Scope 2 or 3: only with `CAP_SYS_PTRACE`, or never: nothing to grant.
    AdminOnly,
}

impl PtraceScope {
    /// This host's scope.
    pub fn current() -> PtraceScope {
        match std::fs::read_to_string("/proc/sys/kernel/yama/ptrace_scope") {
            Err(_) => PtraceScope::Classic,
            Ok(s) => match s.trim() {
                "0" => PtraceScope::Classic,
                "1" => PtraceScope::Restricted,
                _ => PtraceScope::AdminOnly,
            },
        }
    }
}

/// The permission a receiver gives its writers. Under Yama's scope 1 a process declares at
/// most one ptracer: the first writer's pid holds it (for as many sessions as that process
/// opens) until its last session ends; a second writer process is declined with
/// [`Decline::PtraceHeld`] and moves over TCP.
#[derive(Debug)]
pub struct PtracePolicy {
    scope: PtraceScope,
    /// The declared ptracer and how many sessions use it.
    declared: Mutex<Option<(u32, usize)>>,
}

impl PtracePolicy {
    /// The policy of this process (Yama's exception is the process's, whichever node or
    /// shard grants it).
    pub fn process() -> &'static PtracePolicy {
        static POLICY: std::sync::OnceLock<PtracePolicy> = std::sync::OnceLock::new();
        POLICY.get_or_init(|| PtracePolicy {
            scope: PtraceScope::current(),
            declared: Mutex::new(None),
        })
    }

    /// Lets `writer` write into this process for one session ([`PtracePolicy::release`]
    /// once it ends). This process itself needs nothing.
    pub fn grant(&self, writer: u32) -> Result<(), Decline> {
        if writer == std::process::id() || self.scope == PtraceScope::Classic {
            return Ok(());
        }
        if self.scope == PtraceScope::AdminOnly {
            // The writer may still hold CAP_SYS_PTRACE: its probe finds out.
            return Ok(());
        }
        let mut declared = self.declared.lock().unwrap_or_else(|p| p.into_inner());
        match *declared {
            Some((pid, ref mut n)) if pid == writer => {
                *n += 1;
                Ok(())
            }
            Some(_) => Err(Decline::PtraceHeld),
            None => {
                let pid =
                    rustix::process::Pid::from_raw(writer as i32).ok_or(Decline::PtraceRefused)?;
                rustix::process::set_ptracer(rustix::process::PTracer::ProcessID(pid))
                    .map_err(|_| Decline::PtraceRefused)?;
                *declared = Some((writer, 1));
                Ok(())
            }
        }
    }

    /// One session of `writer` ended: its exception goes with its last one.
    pub fn release(&self, writer: u32) {
        if self.scope != PtraceScope::Restricted || writer == std::process::id() {
            return;
        }
        let mut declared = self.declared.lock().unwrap_or_else(|p| p.into_inner());
        if let Some((pid, n)) = declared.as_mut() {
            if *pid == writer {
                *n -= 1;
                if *n == 0 {
                    let _ = rustix::process::set_ptracer(rustix::process::PTracer::None);
                    *declared = None;
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)] // tests may panic

    use super::*;

    #[test]
    fn a_boot_id_parses_from_what_the_kernel_prints() {
        let id = parse_boot_id("0f1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0\n").unwrap();
        assert_eq!(id[0], 0x0f);
        assert_eq!(id[15], 0xf0);
        assert_eq!(parse_boot_id("0f1e"), None);
        assert_eq!(parse_boot_id("zz1e2d3c-4b5a-6978-8796-a5b4c3d2e1f0"), None);
    }

    #[test]
    fn this_process_reaches_itself_and_not_another_host_or_namespace() {
        let me = HostIdentity::current().unwrap();
        assert_eq!(me.reaches(&me), Ok(()));
        let mut other = me;
        other.boot_id[0] ^= 1;
        assert_eq!(me.reaches(&other), Err(Decline::OtherHost));
        let mut other = me;
        other.pid_namespace ^= 1;
        assert_eq!(me.reaches(&other), Err(Decline::OtherPidNamespace));
    }

    #[test]
    fn under_yama_scope_one_a_second_writer_process_is_declined_until_the_first_lets_go() {
        let policy = PtracePolicy {
            scope: PtraceScope::Restricted,
            declared: Mutex::new(Some((1, 1))),
        };
        assert_eq!(policy.grant(2), Err(Decline::PtraceHeld));
        assert_eq!(policy.grant(1), Ok(()));
        policy.release(1);
        assert_eq!(policy.grant(2), Err(Decline::PtraceHeld));
        // This process never needs an exception for itself.
        assert_eq!(policy.grant(std::process::id()), Ok(()));
    }
}
