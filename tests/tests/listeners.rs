//! No open listener without a token: a node with no cluster token, or with the CLI's demo
//! token that everyone knows, listens on loopback only, unless told `allow_no_token`; with a
//! token of its own it listens anywhere. On both runtimes.
#![allow(clippy::unwrap_used)] // tests may panic

use std::net::SocketAddr;
use std::sync::Arc;

use kvferry_core::{Config, Role};
use kvferry_memory::MemoryMap;
use kvferry_testkit::{node_config, Node, Runtime};
use kvferry_tests::{fast_core, small_shape, RUNTIMES};

fn node(rt: Runtime, token: &[u8], core: Config) -> Node {
    let shape = small_shape();
    let cfg = node_config(Role::Prefill, &shape, core, token, 1);
    rt.start(cfg, Arc::new(MemoryMap::allocate(shape.layout())))
        .unwrap()
}

fn any_address() -> SocketAddr {
    "0.0.0.0:0".parse().unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_without_a_token_of_its_own_refuses_to_listen_beyond_loopback_naming_the_fix() {
    for rt in RUNTIMES {
        for (token, what) in [
            (&b""[..], "no cluster token"),
            (b"kvferry-demo", "the built-in demo token"),
        ] {
            let n = node(rt, token, fast_core());
            let err = n.listen(any_address()).await.unwrap_err().to_string();
            assert!(err.contains(what), "{}: {err}", rt.name());
            assert!(err.contains("KVFERRY_TOKEN"), "{err}");
            assert!(err.contains("KVFERRY_ALLOW_NO_TOKEN=1"), "{err}");
            n.shutdown().await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_without_a_token_listens_on_loopback() {
    for rt in RUNTIMES {
        let n = node(rt, b"", fast_core());
        let addrs = n.listen("127.0.0.1:0".parse().unwrap()).await.unwrap();
        assert!(addrs.iter().all(|a| a.ip().is_loopback()), "{addrs:?}");
        n.shutdown().await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_with_its_own_token_or_told_to_allow_none_listens_anywhere() {
    for rt in RUNTIMES {
        let own = node(rt, b"a-secret-of-this-cluster", fast_core());
        own.listen(any_address()).await.unwrap();
        own.shutdown().await;
        let allowed = Config {
            allow_no_token: true,
            ..fast_core()
        };
        let told = node(rt, b"", allowed);
        told.listen(any_address()).await.unwrap();
        told.shutdown().await;
    }
}
