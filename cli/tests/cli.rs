//! The `kvferry` command as a user runs it: options that cannot mean anything where they
//! are given are refused with a message that says where they belong.

use std::process::Command;

#[test]
fn a_prefill_refuses_data_connections_which_its_decode_opens() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvferry"))
        .args([
            "prefill",
            "--listen",
            "127.0.0.1:0",
            "--data-connections",
            "3",
        ])
        .output()
        .expect("kvferry runs");
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("--data-connections 3") && err.contains("kvferry decode --data-connections"),
        "{err}"
    );
}

#[test]
fn a_page_size_the_pattern_cannot_fill_is_refused_at_start() {
    for args in [
        &["demo", "--page-bytes", "12"][..],
        &["prefill", "--listen", "127.0.0.1:0", "--page-bytes", "4100"][..],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_kvferry"))
            .args(args)
            .output()
            .expect("kvferry runs");
        assert!(!out.status.success(), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("--page-bytes") && err.contains("multiple of 8"),
            "{err}"
        );
    }
}

/// `bench --tls` on glommio labels its lines with the runtime that ran.
#[test]
fn the_tls_bench_names_the_runtime_that_ran() {
    let out = Command::new(env!("CARGO_BIN_EXE_kvferry"))
        .args([
            "bench",
            "--tls",
            "--quick",
            "--iterations",
            "1",
            "--runtime",
            "glommio",
            "--json",
        ])
        .output()
        .expect("kvferry runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lines = String::from_utf8_lossy(&out.stdout);
    let lines: Vec<&str> = lines.lines().collect();
    assert_eq!(lines.len(), 3, "{lines:?}");
    for line in lines {
        assert!(line.contains(r#""runtime":"glommio""#), "{line}");
    }
}

/// A decode that holds a prefix of every room (`--prefix-pages`) against `kvferry prefill`:
/// every room succeeds and every granted page holds its room page's pattern.
#[test]
fn prefix_rooms_move_between_the_cli_prefill_and_decode_with_every_page_verified() {
    let (mut prefill, addr) = spawn_prefill(&[], &["--page-bytes", "4096"]);
    let out = Command::new(env!("CARGO_BIN_EXE_kvferry"))
        .args([
            "decode",
            "--connect",
            &addr,
            "--rooms",
            "24",
            "--page-bytes",
            "4096",
            "--pages-per-room",
            "8",
            "--prefix-pages",
            "5",
            "--json",
        ])
        .output()
        .expect("kvferry decode runs");
    let _ = prefill.kill();
    let _ = prefill.wait();
    let report = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success(), "{report}");
    for field in [
        r#""rooms_succeeded":24"#,
        r#""pages_corrupted":0"#,
        r#""pages_verified":3072"#,
    ] {
        assert!(report.contains(field), "{field} in {report}");
    }
}

/// A `kvferry prefill` process started with `pre` before it (a wrapper such as `unshare`) and
/// `args` after, its address read from its log (which keeps being read so that it never
/// blocks on a full pipe).
fn spawn_prefill(pre: &[&str], args: &[&str]) -> (std::process::Child, String) {
    use std::io::{BufRead, BufReader};
    let bin = env!("CARGO_BIN_EXE_kvferry");
    let mut cmd = match pre.split_first() {
        Some((first, rest)) => {
            let mut c = Command::new(first);
            c.args(rest).arg(bin);
            c
        }
        None => Command::new(bin),
    };
    let mut prefill = cmd
        .args(["prefill", "--listen", "127.0.0.1:0"])
        .args(args)
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .expect("kvferry prefill starts");
    let stderr = prefill.stderr.take().expect("stderr");
    let mut lines = BufReader::new(stderr).lines().map_while(Result::ok);
    let mut addr = None;
    for line in lines.by_ref() {
        if let Some(a) = line
            .split_whitespace()
            .find(|w| w.starts_with("127.0.0.1:"))
        {
            addr = Some(a.trim_matches(|c: char| c == ',' || c == ')').to_owned());
            break;
        }
    }
    std::thread::spawn(move || lines.for_each(drop));
    (prefill, addr.expect("prefill prints its address"))
}

/// `kvferry decode --json` against `addr` with `args`; its report.
fn decode_report(addr: &str, args: &[&str]) -> (bool, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_kvferry"))
        .args(["decode", "--connect", addr, "--json"])
        .args(args)
        .output()
        .expect("kvferry decode runs");
    let report = String::from_utf8_lossy(&out.stdout).into_owned();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    (out.status.success(), report + &err)
}

/// Two processes on one host, both on `--backend same-host` (the path required): the
/// prefill copies into the decode's memory (cross-memory attach), every page verified.
#[test]
fn a_cli_prefill_and_decode_on_one_host_move_rooms_over_the_same_host_path() {
    let (mut prefill, addr) = spawn_prefill(&[], &["--backend", "same-host"]);
    let (ok, report) = decode_report(&addr, &["--rooms", "64", "--backend", "same-host"]);
    let _ = prefill.kill();
    let _ = prefill.wait();
    assert!(ok, "{report}");
    for field in [
        r#""rooms_succeeded":64"#,
        r#""pages_corrupted":0"#,
        r#"path="cma""#,
    ] {
        assert!(report.contains(field), "{field} in {report}");
    }
}

/// Whether `unshare -p` works here (root or user namespaces); says SKIPPED otherwise. The
/// tests run it with `--kill-child`: the prefill it forks dies with it, not outliving the test.
fn can_unshare_pid() -> bool {
    let unshare = Command::new("unshare")
        .args(["-p", "-f", "true"])
        .status()
        .is_ok_and(|s| s.success());
    if !unshare {
        eprintln!("SKIPPED: unshare -p needs root (or user namespaces) here");
    }
    unshare
}

/// The prefill in a PID namespace of its own (as in another container): same boot, but its
/// pid would name another process here, so the decode declines, says why, and the rooms
/// move over TCP (`--backend auto` on both).
#[test]
fn a_prefill_in_another_pid_namespace_moves_over_tcp_and_the_decode_says_why() {
    if !can_unshare_pid() {
        return;
    }
    let (mut prefill, addr) = spawn_prefill(
        &["unshare", "-p", "-f", "--kill-child"],
        &["--backend", "auto"],
    );
    let (ok, report) = decode_report(&addr, &["--rooms", "16", "--backend", "auto"]);
    let _ = prefill.kill();
    let _ = prefill.wait();
    assert!(ok, "{report}");
    assert!(report.contains(r#""rooms_succeeded":16"#), "{report}");
    assert!(report.contains(r#""decode_path":"tcp""#), "{report}");
    assert!(
        report.contains("same-host path declined") && report.contains("different PID namespaces"),
        "the decode says why: {report}"
    );
}

/// A decode that requires the path (`--backend same-host`) and a prefill in another PID
/// namespace: each session is refused as it is established and the decode says why; its
/// rooms fail `incompatible_peer` (none moves over TCP), or, where the first refusal came
/// before its connect returned, the connect fails saying this node refused it.
#[test]
fn a_decode_that_requires_the_same_host_path_refuses_a_prefill_in_another_pid_namespace() {
    if !can_unshare_pid() {
        return;
    }
    let (mut prefill, addr) = spawn_prefill(
        &["unshare", "-p", "-f", "--kill-child"],
        &["--backend", "auto"],
    );
    let (ok, report) = decode_report(&addr, &["--rooms", "16", "--backend", "same-host"]);
    let _ = prefill.kill();
    let _ = prefill.wait();
    let rooms_failed =
        report.contains(r#""rooms_succeeded":0"#) && report.contains(r#""incompatible_peer":16"#);
    let connect_refused = !ok
        && report.contains("cannot reach prefill")
        && report.contains("this node requires the same-host path");
    assert!(rooms_failed || connect_refused, "ok={ok}: {report}");
    assert!(
        report.contains("requires it") && report.contains("different PID namespaces"),
        "the decode says why: {report}"
    );
}

/// The prefill process killed while it copies rooms into the decode: the decode's rooms end
/// (none unfinished), no page it verified is corrupted and no free page was written, and
/// the writer's exit releases its pages without waiting out its liveness window.
#[test]
fn a_same_host_prefill_killed_mid_run_leaves_no_corrupted_or_written_free_page() {
    let (mut prefill, addr) = spawn_prefill(&[], &["--backend", "same-host"]);
    let decode = {
        let addr = addr.clone();
        std::thread::spawn(move || {
            decode_report(&addr, &["--rooms", "600", "--backend", "same-host"])
        })
    };
    std::thread::sleep(std::time::Duration::from_millis(1500));
    let _ = prefill.kill();
    let _ = prefill.wait();
    let (_, report) = decode.join().expect("decode thread");
    for field in [
        r#""pages_corrupted":0"#,
        r#""free_pages_written":0"#,
        r#""rooms_unfinished":0"#,
        r#"path="cma""#,
    ] {
        assert!(report.contains(field), "{field} in {report}");
    }
    assert!(!report.contains(r#""rooms_succeeded":600"#), "{report}");
    // The writer's exit is seen: its pages wait out no liveness window.
    assert!(!report.contains("stay quarantined"), "{report}");
}
