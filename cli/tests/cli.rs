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
    use std::io::{BufRead, BufReader};
    let mut prefill = Command::new(env!("CARGO_BIN_EXE_kvferry"))
        .args(["prefill", "--listen", "127.0.0.1:0", "--page-bytes", "4096"])
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
    let addr = addr.expect("prefill prints its address");
    // Keep reading its log so that it never blocks on a full pipe.
    std::thread::spawn(move || lines.for_each(drop));
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
