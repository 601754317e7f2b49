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
