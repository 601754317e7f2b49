//! A locked-memory limit too low for glommio is a typed error that names the limit, the value
//! found and the fix; never a panic or a hang. Its own test binary: it lowers the limit of the
//! whole process for good.
#![allow(clippy::unwrap_used)] // tests may panic

use std::sync::Arc;

use kvferry_core::sim::small_layout;
use kvferry_core::{Config, EndpointInfo, Incarnation, NodeId, Role};
use kvferry_glommio::{NodeConfig, NodeError, ShardConfig};
use kvferry_memory::MemoryMap;

#[test]
fn a_too_low_memlock_limit_is_a_typed_error_that_names_the_fix() {
    use rustix::process::{setrlimit, Resource, Rlimit};
    let low = Rlimit {
        current: Some(64 * 1024),
        maximum: Some(64 * 1024),
    };
    setrlimit(Resource::Memlock, low).unwrap();
    let layout = small_layout(16);
    let config = NodeConfig {
        core: Config::default(),
        info: EndpointInfo::new(Role::Decode, NodeId(1), Incarnation(1), layout),
        data_connections: 1,
        seed: 1,
        faults: None,
        backend: Default::default(),
        same_host: Default::default(),
        tls: None,
        read_spin: kvferry_glommio::DEFAULT_READ_SPIN,
    };
    let err = kvferry_glommio::start(
        config,
        Arc::new(MemoryMap::allocate(layout)),
        ShardConfig {
            shards: 2,
            pin: false,
            ..ShardConfig::default()
        },
    )
    .unwrap_err();
    let NodeError::MemoryLockLimit { limit, shards, .. } = &err else {
        panic!("not a memory lock error: {err}");
    };
    assert_eq!((*limit, *shards), (65536, 2));
    let why = err.to_string();
    assert!(why.contains("RLIMIT_MEMLOCK"), "{why}");
    assert!(why.contains("65536"), "names the value found: {why}");
    assert!(why.contains("ulimit -l"), "names the fix: {why}");
}
