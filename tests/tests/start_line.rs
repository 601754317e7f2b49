//! A node says what it runs in one start line: role, runtime, data plane, where its KV lives,
//! the staging pool, checksum, TLS and what its token is, without terminal colour codes. Its
//! own test binary: a `tracing` callsite first hit with no subscriber in this process would
//! keep that answer.
#![allow(clippy::unwrap_used)] // tests may panic

use std::sync::Arc;

use kvferry_core::{Config, Role};
use kvferry_memory::MemoryMap;
use kvferry_testkit::{node_config, Runtime};
use kvferry_tests::{fast_core, small_shape};

/// Everything a node's start line writes, as text.
#[derive(Clone, Default)]
struct Captured(Arc<std::sync::Mutex<Vec<u8>>>);

impl std::io::Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

#[test]
fn a_node_says_what_it_runs_in_one_start_line() {
    let captured = Captured::default();
    let sink = captured.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_env_filter("warn,kvferry::start=info")
        .with_ansi(false)
        .with_writer(move || sink.clone())
        .finish();
    let runtime = tokio::runtime::Runtime::new().unwrap();
    tracing::subscriber::with_default(subscriber, || {
        let _guard = runtime.enter();
        for (token, said) in [
            (&b"a-secret"[..], "token=\"set\""),
            (b"", "token=\"none (loopback listeners only)\""),
        ] {
            let core = Config {
                checksum: true,
                ..fast_core()
            };
            let shape = small_shape();
            let cfg = node_config(Role::Prefill, &shape, core, token, 1);
            let n = Runtime::Tokio
                .start(cfg, Arc::new(MemoryMap::allocate(shape.layout())))
                .unwrap();
            runtime.block_on(n.shutdown());
            let text = String::from_utf8(std::mem::take(&mut *captured.0.lock().unwrap())).unwrap();
            let lines: Vec<&str> = text
                .lines()
                .filter(|l| l.contains("kvferry node started"))
                .collect();
            assert_eq!(lines.len(), 1, "captured: {text:?}");
            for field in [
                "role=Prefill",
                "runtime=\"tokio\"",
                "data_plane=tcp x2",
                "kv=host",
                "staging=none",
                "checksum=\"on\"",
                "tls=\"off\"",
                said,
            ] {
                assert!(lines[0].contains(field), "{field} not in {}", lines[0]);
            }
            assert!(!lines[0].contains('\u{1b}'), "no ANSI codes: {}", lines[0]);
        }
    });
}
