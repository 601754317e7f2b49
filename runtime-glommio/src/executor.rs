//! Starting a glommio node's executors: one thread per shard, each with the locked memory
//! glommio needs, pinned to a core of its own only when asked and when this process has a
//! free core for every shard.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use glommio::{ExecutorJoinHandle, LocalExecutorBuilder, Placement};
use kvferry_core::{EndpointInfo, NodeId};
use kvferry_driver::{Announcer, NodeConfig, NodeError};
use kvferry_memory::MemoryMap;
use tracing::warn;

use crate::{shard_main, Cmd};

/// glommio needs at least this much locked memory per executor.
const MEMLOCK_MIN: u64 = 512 * 1024;
/// The io_uring buffer memory each executor registers (small: the limit is shared).
const IO_MEMORY: usize = 1 << 20;

/// Everything to start a glommio node ([`crate::start`]) beyond the common [`NodeConfig`].
#[derive(Clone, Copy, Debug)]
pub struct ShardConfig {
    /// Number of shards (executors); at least 1.
    pub shards: usize,
    /// Pin each shard to a core of its own: a core this process may run on that no other
    /// kvferry node of this process has pinned. When there are not that many free cores, no
    /// shard is pinned (a warning says so). Off by default: a pinned shard cannot move away
    /// from a core that busy neighbours share, so pin only where the node owns its cores.
    pub pin: bool,
    /// How long an executor keeps polling for work before it parks in the kernel, and a data
    /// connection keeps reading its socket after its last bytes before it waits on the ring
    /// (`kvferry_tcp::glommio::Polled`). Only a pinned shard spins: glommio parks an
    /// unpinned executor at once, and its reads wait at once.
    pub spin_before_park: Duration,
}

/// The default [`ShardConfig::spin_before_park`]. Parking, and waiting for a socket, through
/// io_uring costs glommio more than a small operation's whole round trip (docs/PERFORMANCE.md);
/// a shard spins only in the 50 us after it last had work.
pub const DEFAULT_SPIN_BEFORE_PARK: Duration = Duration::from_micros(50);

impl Default for ShardConfig {
    fn default() -> Self {
        ShardConfig {
            shards: 1,
            pin: false,
            spin_before_park: DEFAULT_SPIN_BEFORE_PARK,
        }
    }
}

/// The node id shard `index` presents to peers: the configured id for shard 0, a hash of it
/// and the index for the others (ids of distinct nodes' shards then collide only by chance,
/// 2^-64, where `id + index` would collide for nodes whose ids are close).
pub fn shard_node(node: NodeId, index: usize) -> NodeId {
    if index == 0 {
        return node;
    }
    let mut z = node.0 ^ (index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    NodeId(z ^ (z >> 31))
}

/// Raises the soft `RLIMIT_MEMLOCK` to the hard limit (allowed without privileges) and checks
/// that every executor can lock what glommio needs.
pub fn ensure_memlock(shards: usize) -> Result<(), NodeError> {
    use rustix::process::{getrlimit, setrlimit, Resource, Rlimit};
    let limit = getrlimit(Resource::Memlock);
    let hard = limit.maximum;
    let raised = Rlimit {
        current: hard,
        maximum: hard,
    };
    if limit.current != hard {
        let _ = setrlimit(Resource::Memlock, raised);
    }
    let now = getrlimit(Resource::Memlock).current;
    let need = (MEMLOCK_MIN.max(IO_MEMORY as u64 + 64 * 1024)) * shards as u64;
    match now {
        None => Ok(()),
        Some(v) if v >= need => Ok(()),
        Some(v) => Err(NodeError::MemoryLockLimit {
            limit: v,
            needed: need,
            shards,
        }),
    }
}

/// The cores kvferry nodes of this process have pinned shards to.
static PINNED: Mutex<BTreeSet<usize>> = Mutex::new(BTreeSet::new());

/// Cores a node's shards are pinned to; they are free for another node once it drops.
#[derive(Debug, Default)]
pub(crate) struct CoreClaim(Vec<usize>);

impl CoreClaim {
    /// Claims `n` cores this process may run on and no other node has pinned; `None` (and
    /// nothing claimed) if there are fewer.
    fn take(n: usize) -> Option<CoreClaim> {
        let allowed = rustix::process::sched_getaffinity(None).ok()?;
        let mut pinned = PINNED.lock().unwrap_or_else(|p| p.into_inner());
        let free: Vec<usize> = (0..rustix::process::CpuSet::MAX_CPU)
            .filter(|&c| allowed.is_set(c) && !pinned.contains(&c))
            .take(n)
            .collect();
        if free.len() < n {
            return None;
        }
        pinned.extend(free.iter().copied());
        Some(CoreClaim(free))
    }

    /// The claimed cores, shard `i`'s at index `i`.
    pub(crate) fn cores(&self) -> &[usize] {
        &self.0
    }

    /// The core of shard `i`, if the node pins its shards.
    fn core(&self, i: usize) -> Option<usize> {
        self.0.get(i).copied()
    }
}

impl Drop for CoreClaim {
    fn drop(&mut self) {
        let mut pinned = PINNED.lock().unwrap_or_else(|p| p.into_inner());
        for c in &self.0 {
            pinned.remove(c);
        }
    }
}

/// What a shard's thread starts from.
#[derive(Clone)]
pub(crate) struct ShardSetup {
    pub(crate) index: usize,
    pub(crate) config: NodeConfig,
    pub(crate) info: EndpointInfo,
    pub(crate) memory: Arc<MemoryMap>,
    pub(crate) announcements: Announcer,
    /// Where the shard's driver publishes every core event (the node's subscribers).
    pub(crate) events: kvferry_driver::EventSink,
    pub(crate) rx: flume::Receiver<Cmd>,
    /// Held until the shard's thread ends: its receivers hear the end (a call queued to a
    /// shard whose thread panicked is never run, and its caller must not wait for it).
    pub(crate) alive: flume::Sender<()>,
    /// TLS on every connection, when configured (loaded once for all shards).
    pub(crate) tls: Option<kvferry_tcp::TlsSetup>,
    /// The node's RDMA device, when data moves over RDMA (opened once for all shards).
    pub(crate) rdma: crate::RdmaDevice,
    /// The node's same-host plane (opened once for all shards).
    pub(crate) same_host: Arc<kvferry_driver::SameHostPlane>,
    /// How long a data connection's read keeps trying its socket before it waits on the
    /// ring (`ShardConfig::spin_before_park` on a pinned shard, else zero).
    pub(crate) read_spin: Duration,
}

/// The running shards of a node: their command channels, threads, and pinned cores.
pub(crate) struct Started {
    pub(crate) senders: Vec<flume::Sender<Cmd>>,
    /// Each shard's end, heard when its thread is gone.
    pub(crate) ends: Vec<flume::Receiver<()>>,
    pub(crate) threads: Vec<ExecutorJoinHandle<()>>,
    pub(crate) cores: CoreClaim,
}

/// Starts one executor per shard, each running [`shard_main`], and waits until each is up.
pub(crate) fn spawn_shards(
    config: &NodeConfig,
    memory: &Arc<MemoryMap>,
    shards: ShardConfig,
    announcements: &Announcer,
    events: &kvferry_driver::EventSink,
    rdma: crate::RdmaDevice,
) -> Result<Started, NodeError> {
    let n = shards.shards.max(1);
    let tls = match &config.tls {
        Some(files) => Some(kvferry_tcp::TlsSetup::load(files).map_err(NodeError::Tls)?),
        None => None,
    };
    ensure_memlock(n)?;
    let cores = if shards.pin {
        CoreClaim::take(n).unwrap_or_else(|| {
            warn!(
                shards = n,
                "fewer free cores than shards (cores this process may use that no other kvferry node pinned): no shard is pinned"
            );
            CoreClaim::default()
        })
    } else {
        CoreClaim::default()
    };
    let mut senders = Vec::with_capacity(n);
    let mut ends = Vec::with_capacity(n);
    let mut threads = Vec::with_capacity(n);
    let same_host = kvferry_driver::SameHostPlane::open(config.same_host, memory.clone());
    for i in 0..n {
        let (tx, rx) = flume::unbounded::<Cmd>();
        let (alive, end) = flume::bounded::<()>(1);
        let mut info = config.info.clone();
        info.node = shard_node(config.info.node, i);
        let setup = ShardSetup {
            index: i,
            config: config.clone(),
            info,
            memory: memory.clone(),
            announcements: announcements.clone(),
            events: events.clone(),
            rx,
            alive,
            tls: tls.clone(),
            rdma: rdma.clone(),
            same_host: same_host.clone(),
            read_spin: Duration::ZERO,
        };
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<Result<(), String>>();
        let placement = cores.core(i).map_or(Placement::Unbound, Placement::Fixed);
        let spawn =
            |placement: Placement, mut setup: ShardSetup, ready: std::sync::mpsc::Sender<_>| {
                // glommio spins only on a pinned executor; the socket reads follow it.
                setup.read_spin = if matches!(placement, Placement::Fixed(_)) {
                    shards.spin_before_park.min(setup.config.read_spin)
                } else {
                    Duration::ZERO
                };
                LocalExecutorBuilder::new(placement)
                    .name(&format!("kvferry-shard-{i}"))
                    .io_memory(IO_MEMORY)
                    .spin_before_park(shards.spin_before_park)
                    .spawn(move || shard_main(setup, ready))
            };
        let handle = match spawn(placement, setup.clone(), ready_tx.clone()) {
            Ok(h) => h,
            Err(e) if cores.core(i).is_some() => {
                warn!(shard = i, error = %e, "cannot pin the shard; running it unpinned");
                spawn(Placement::Unbound, setup, ready_tx.clone()).map_err(|e| shard_error(i, e))?
            }
            Err(e) => return Err(shard_error(i, e)),
        };
        // The shard's thread holds the only sender left: it says whether it started, or its
        // end (a panic during setup) closes the channel. No fixed wait.
        drop(ready_tx);
        match ready_rx.recv() {
            Ok(Ok(())) => {}
            Ok(Err(e)) => return Err(shard_error(i, e)),
            Err(_) => {
                return Err(shard_error(
                    i,
                    "its thread ended before it said it was ready",
                ))
            }
        }
        senders.push(tx);
        ends.push(end);
        threads.push(handle);
    }
    Ok(Started {
        senders,
        ends,
        threads,
        cores,
    })
}

/// A shard that could not start, with why.
fn shard_error(shard: usize, e: impl std::fmt::Display) -> NodeError {
    NodeError::ShardStart {
        shard,
        source: Some(e.to_string().into()),
    }
}
