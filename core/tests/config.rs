//! Configuration: documented defaults, `KVFERRY_*` loading, errors that name the variable.

use std::time::Duration;

use kvferry_core::Config;

#[test]
fn defaults_are_the_documented_starting_points() {
    let c = Config::default();
    assert_eq!(c.transfer_retries, 3);
    assert_eq!(c.retry_backoff, Duration::from_millis(50));
    assert_eq!(c.session_failure_threshold, 10);
    assert_eq!(c.probe_interval, Duration::from_secs(1));
    assert_eq!(c.probe_max_interval, Duration::from_secs(30));
    assert_eq!(c.bootstrap_timeout, Duration::from_secs(300));
    assert_eq!(c.waiting_timeout, Duration::from_secs(300));
    assert_eq!(c.abort_ack_timeout, Duration::from_secs(5));
    assert_eq!(c.heartbeat_interval, Duration::from_millis(500));
    assert_eq!(
        c.heartbeat_interval * c.heartbeat_misses,
        Duration::from_secs(15),
        "liveness window"
    );
    assert_eq!(c.progress_interval, Duration::from_secs(5));
    assert_eq!(c.silence_timeout, Duration::from_secs(1));
    assert_eq!(c.connect_timeout, Duration::from_millis(200));
    assert!(c.validate().is_ok());
}

#[test]
fn a_silence_timeout_within_one_heartbeat_is_refused() {
    let err = Config::from_vars([
        ("KVFERRY_HEARTBEAT_INTERVAL_MS", "1000"),
        ("KVFERRY_SILENCE_TIMEOUT_MS", "1000"),
    ])
    .unwrap_err();
    assert_eq!(err.name, "KVFERRY_SILENCE_TIMEOUT_MS");
}

#[test]
fn environment_variables_override_defaults() {
    let c = Config::from_vars([
        ("KVFERRY_TRANSFER_RETRIES", "5"),
        ("KVFERRY_RETRY_BACKOFF_MS", "10"),
        ("KVFERRY_SESSION_FAILURE_THRESHOLD", "1"),
        ("KVFERRY_MAX_OP_BYTES", "1048576"),
        ("PATH", "/usr/bin"),
        ("KVFERRY_TOKEN", "not a core knob"),
    ])
    .unwrap();
    assert_eq!(c.transfer_retries, 5);
    assert_eq!(c.retry_backoff, Duration::from_millis(10));
    assert_eq!(c.session_failure_threshold, 1);
    assert_eq!(c.max_op_bytes, 1 << 20);
}

#[test]
fn an_unparsable_value_names_the_variable() {
    let err = Config::from_vars([("KVFERRY_TRANSFER_RETRIES", "three")]).unwrap_err();
    assert_eq!(err.name, "KVFERRY_TRANSFER_RETRIES");
    assert_eq!(err.value, "three");
    assert!(err.to_string().contains("KVFERRY_TRANSFER_RETRIES"));
}

#[test]
fn an_out_of_range_value_names_the_variable() {
    let err = Config::from_vars([("KVFERRY_SESSION_FAILURE_THRESHOLD", "0")]).unwrap_err();
    assert_eq!(err.name, "KVFERRY_SESSION_FAILURE_THRESHOLD");
    let err = Config::from_vars([
        ("KVFERRY_PROBE_INTERVAL_MS", "5000"),
        ("KVFERRY_PROBE_MAX_INTERVAL_MS", "100"),
    ])
    .unwrap_err();
    assert_eq!(err.name, "KVFERRY_PROBE_MAX_INTERVAL_MS");
}

#[test]
fn toml_style_lower_case_keys_are_accepted_by_set() {
    let mut c = Config::default();
    c.set("heartbeat_interval_ms", "250").unwrap();
    assert_eq!(c.heartbeat_interval, Duration::from_millis(250));
    assert!(c.set("no_such_knob", "1").is_err());
    assert!(Config::keys().count() >= 20);
}

#[test]
fn the_checksum_needs_operations_whose_checksum_fits_one_frame() {
    let too_many = Config {
        checksum: true,
        max_op_slices: 4097,
        ..Config::default()
    };
    assert_eq!(
        too_many.validate().map_err(|e| e.name),
        Err("KVFERRY_MAX_OP_SLICES".to_owned())
    );
    let short_frames = Config {
        checksum: true,
        max_frame_len: 4096,
        ..Config::default()
    };
    assert_eq!(
        short_frames.validate().map_err(|e| e.name),
        Err("KVFERRY_MAX_FRAME_LEN".to_owned())
    );
    assert!(Config {
        checksum: true,
        ..Config::default()
    }
    .validate()
    .is_ok());
}
