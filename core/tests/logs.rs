//! The warnings operators rely on: a recovered transfer names session, room and attempts; an
//! exhausted one names session, slice count, bytes and the first slice.
#![allow(clippy::unwrap_used)] // tests may panic

mod common;

use std::io::Write;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::{open_room, run_ms, send_all};

#[derive(Clone, Default)]
struct Captured(Arc<Mutex<Vec<u8>>>);

impl Write for Captured {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

fn capture(f: impl FnOnce()) -> String {
    let out = Captured::default();
    let writer = out.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_writer(move || writer.clone())
        .with_ansi(false)
        .with_max_level(tracing::Level::WARN)
        .finish();
    tracing::subscriber::with_default(subscriber, f);
    let bytes = out.0.lock().unwrap().clone();
    String::from_utf8(bytes).unwrap()
}

#[test]
fn a_recovered_transfer_warns_with_session_room_and_attempts() {
    let logs = capture(|| {
        let (mut sim, p, d) = common::pair(5, common::config());
        let heal = sim.now + Duration::from_millis(8);
        sim.break_data_path(p, d, heal);
        open_room(&mut sim, d, &[p], 1, 2);
        send_all(&mut sim, p, 1, 2, false);
        run_ms(&mut sim, 200);
    });
    let line = logs
        .lines()
        .find(|l| l.contains("transfer recovered after retry"))
        .expect(&logs);
    assert!(
        line.contains("session=session#")
            && line.contains("room=Some(room#1)")
            && line.contains("attempts="),
        "{line}"
    );
}

#[test]
fn an_exhausted_transfer_warns_with_session_slices_bytes_and_first_slice() {
    let logs = capture(|| {
        let (mut sim, p, d) = common::pair(6, common::config());
        sim.break_data_path(p, d, sim.now + Duration::from_secs(3600));
        open_room(&mut sim, d, &[p], 1, 2);
        send_all(&mut sim, p, 1, 2, false);
        run_ms(&mut sim, 200);
    });
    let line = logs
        .lines()
        .find(|l| l.contains("transfer failed after retries"))
        .expect(&logs);
    for field in [
        "session=session#",
        "slices=",
        "bytes=",
        "first_slice=Some(Slice",
    ] {
        assert!(line.contains(field), "{field} missing in {line}");
    }
}
