//! The node's figures exported to the `metrics` recorder.

use kvferry_core::{Endpoint, FailureReason, Role};

/// The `role` label of metrics.
pub fn role_label(role: Role) -> &'static str {
    match role {
        Role::Prefill => "prefill",
        Role::Decode => "decode",
    }
}

/// Publishes the staging pool device memory moves through: that this node stages (and with
/// which engine), its size, what is free now, and the shared buffers taken so far (each
/// connection's own buffer is not counted).
pub fn export_staging_metrics(staging: &kvferry_memory::Staging, role: Role) {
    let role = role_label(role);
    let engine = staging.engine().name();
    let config = staging.config();
    metrics::gauge!("kvferry_staging_buffers", "role" => role, "engine" => engine)
        .set(config.buffers as f64);
    metrics::gauge!("kvferry_staging_buffers_free", "role" => role, "engine" => engine)
        .set(staging.free() as f64);
    metrics::counter!("kvferry_staging_buffers_taken_total", "role" => role, "engine" => engine)
        .absolute(staging.taken());
}

/// Publishes the core's counters (absolute values) and gauges through the `metrics` facade.
pub fn export_metrics(endpoint: &Endpoint, role: Role) {
    let role = role_label(role);
    let c = endpoint.counters();
    for (name, value) in c.iter() {
        metrics::counter!(format!("kvferry_{name}_total"), "role" => role).absolute(value);
    }
    for reason in FailureReason::ALL {
        metrics::counter!("kvferry_rooms_failed_total", "role" => role, "reason" => reason.as_str())
            .absolute(c.failed(reason));
    }
    metrics::gauge!("kvferry_sessions_blacklisted", "role" => role)
        .set(endpoint.blacklisted_sessions() as f64);
    metrics::gauge!("kvferry_ops_live", "role" => role).set(endpoint.live_ops() as f64);
    metrics::gauge!("kvferry_rooms_live", "role" => role).set(endpoint.live_rooms() as f64);
    for sid in endpoint.session_ids() {
        let Some(st) = endpoint.session_stats(sid) else {
            continue;
        };
        let session = sid.0.to_string();
        metrics::counter!("kvferry_session_bytes_total", "role" => role, "session" => session.clone()).absolute(st.bytes_done);
        metrics::counter!("kvferry_session_ops_total", "role" => role, "session" => session.clone()).absolute(st.ops_done);
        metrics::counter!("kvferry_session_ops_failed_total", "role" => role, "session" => session.clone()).absolute(st.ops_failed);
        metrics::gauge!("kvferry_session_ops_in_flight", "role" => role, "session" => session)
            .set(f64::from(st.in_flight));
    }
}
