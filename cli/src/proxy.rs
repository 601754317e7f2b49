//! `kvferry proxy`: a fault-injecting TCP proxy between two nodes, for trying failures by hand.

use std::net::SocketAddr;
use std::time::Duration;

use clap::Args;

// The arguments of `kvferry proxy`; the command's help is its variant's doc comment.
#[derive(Args)]
pub(crate) struct ProxyArgs {
    /// Loopback address to listen on (point the decode's --connect here).
    #[arg(long)]
    pub(crate) listen: SocketAddr,
    /// The node behind the proxy (the prefill's --listen address).
    #[arg(long)]
    pub(crate) upstream: SocketAddr,
    /// Delay added to every forwarded chunk, in milliseconds.
    #[arg(long, default_value_t = 0)]
    pub(crate) delay_ms: u64,
    /// Probability that a forwarded chunk has one byte flipped.
    #[arg(long, default_value_t = 0.0)]
    pub(crate) corrupt: f64,
    /// Probability that a forwarded chunk resets its connection instead.
    #[arg(long, default_value_t = 0.0)]
    pub(crate) reset: f64,
    /// Black-hole both directions for this many milliseconds every --blackhole-every-ms.
    #[arg(long, default_value_t = 0)]
    pub(crate) blackhole_ms: u64,
    /// Period of the black holes, in milliseconds.
    #[arg(long, default_value_t = 10_000)]
    pub(crate) blackhole_every_ms: u64,
    /// Hold one direction only during the black holes: "up" (to upstream) or "down".
    #[arg(long)]
    pub(crate) stall: Option<String>,
    /// Truncate the next chunk (and close its connection) once per black-hole period.
    #[arg(long)]
    pub(crate) truncate: bool,
    /// Seed of the corrupt and reset decisions.
    #[arg(long, default_value_t = 1)]
    pub(crate) seed: u64,
}

/// Runs `kvferry proxy` until Ctrl-C.
pub(crate) async fn run(args: ProxyArgs) -> Result<(), String> {
    let ProxyArgs {
        listen,
        upstream,
        delay_ms,
        corrupt,
        reset,
        blackhole_ms,
        blackhole_every_ms,
        stall,
        truncate,
        seed,
    } = args;
    let stall_up = match stall.as_deref() {
        None => None,
        Some("up") => Some(true),
        Some("down") => Some(false),
        Some(other) => return Err(format!("--stall must be up or down, not {other}")),
    };
    for (name, p) in [("--corrupt", corrupt), ("--reset", reset)] {
        if !(0.0..=1.0).contains(&p) {
            return Err(format!("{name} must be a probability in 0..=1, not {p}"));
        }
    }
    let proxy = kvferry_testkit::proxy::FaultProxy::start_on(listen, upstream, seed)
        .await
        .map_err(|e| format!("proxy on {listen}: {e}"))?;
    proxy.set(|f| {
        f.delay = Duration::from_millis(delay_ms);
        f.corrupt = corrupt;
        f.reset = reset;
    });
    eprintln!("kvferry proxy {} -> {upstream}", proxy.addr);
    let period = Duration::from_millis(blackhole_every_ms.max(1));
    loop {
        tokio::select! {
            _ = tokio::signal::ctrl_c() => return Ok(()),
            _ = tokio::time::sleep(period) => {
                if truncate {
                    proxy.set(|f| f.truncate_next = Some(1));
                }
                if blackhole_ms > 0 {
                    let hold = Duration::from_millis(blackhole_ms);
                    match stall_up {
                        None => {
                            let until = std::time::Instant::now() + hold;
                            proxy.set(|f| f.blackhole_until = Some(until));
                        }
                        Some(up) => {
                            proxy.set(|f| if up { f.stall_up = true } else { f.stall_down = true });
                            tokio::time::sleep(hold).await;
                            proxy.set(|f| if up { f.stall_up = false } else { f.stall_down = false });
                        }
                    }
                }
            }
        }
    }
}
