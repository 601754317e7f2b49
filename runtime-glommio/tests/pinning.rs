//! Pinning is asked for, and then a node pins its shards only to cores it can have to itself
//! within this process: never to a core another kvferry node of the process pinned (two
//! nodes pinned to the same cores share them while other cores idle). Its own test binary:
//! it narrows the test thread's cores.
#![allow(clippy::unwrap_used)] // tests may panic

use std::sync::Arc;

use kvferry_core::sim::small_layout;
use kvferry_core::{Config, EndpointInfo, Incarnation, NodeId, Role};
use kvferry_glommio::{Node, NodeConfig, ShardConfig};
use kvferry_memory::MemoryMap;

fn start(node: u64, pin: bool) -> Node {
    let layout = small_layout(16);
    let config = NodeConfig {
        core: Config::default(),
        info: EndpointInfo::new(Role::Decode, NodeId(node), Incarnation(node), layout),
        data_connections: 1,
        seed: node,
        faults: None,
        backend: Default::default(),
        same_host: Default::default(),
        tls: None,
        read_spin: kvferry_glommio::DEFAULT_READ_SPIN,
    };
    let shards = ShardConfig {
        shards: 1,
        pin,
        ..ShardConfig::default()
    };
    kvferry_glommio::start(config, Arc::new(MemoryMap::allocate(layout)), shards).unwrap()
}

#[test]
fn a_core_pinned_by_one_node_is_not_pinned_by_another_and_is_free_again_once_it_stops() {
    use rustix::process::{sched_getaffinity, sched_setaffinity, CpuSet};
    // This thread (and the shard threads it starts) may run on one core only.
    let allowed = sched_getaffinity(None).unwrap();
    let core = (0..CpuSet::MAX_CPU).find(|&c| allowed.is_set(c)).unwrap();
    let mut one = CpuSet::new();
    one.set(core);
    sched_setaffinity(None, &one).unwrap();

    assert_eq!(
        start(1, false).pinned_cores(),
        &[] as &[usize],
        "off by default"
    );
    let first = start(2, true);
    assert_eq!(first.pinned_cores(), &[core]);
    let second = start(3, true);
    assert_eq!(
        second.pinned_cores(),
        &[] as &[usize],
        "the only core is the first node's: the second runs unpinned"
    );
    drop(first);
    assert_eq!(start(4, true).pinned_cores(), &[core]);
    drop(second);
}
