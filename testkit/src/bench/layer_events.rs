//! How late the GPU layer waiter reports a completed layer, and its CPU cost, per poll policy.

use super::*;

/// How fast the GPU layer waiter notices a completed layer, for one poll policy.
#[derive(Clone, Debug)]
pub struct WaiterPoint {
    /// The policy (spin, then sleep between polls).
    pub policy: kvferry_gpu::PollPolicy,
    /// Median time from an event completing to the embedder hearing of it.
    pub median: Duration,
    /// 99th percentile of the same.
    pub p99: Duration,
    /// CPU the process used meanwhile, in cores (1.0 = one core busy), from /proc/self/stat.
    pub cpu_cores: Option<f64>,
}

/// An event that completes at a deadline, as a layer's kernel would.
struct DeadlineEvent(Instant);

impl kvferry_gpu::LayerEvent for DeadlineEvent {
    fn poll_complete(&mut self) -> Result<bool, kvferry_gpu::GpuError> {
        Ok(Instant::now() >= self.0)
    }
}

/// utime + stime of this process, in seconds (Linux).
fn cpu_seconds() -> Option<f64> {
    let stat = std::fs::read_to_string("/proc/self/stat").ok()?;
    let fields: Vec<&str> = stat.rsplit_once(')')?.1.split_whitespace().collect();
    let ticks: f64 = fields.get(11)?.parse::<f64>().ok()? + fields.get(12)?.parse::<f64>().ok()?;
    Some(ticks / 100.0)
}

/// `bench --layer-events`: `events` layers complete 0.5-1.5 ms apart (one at a time, as a
/// forward pass does); per poll policy, how late the waiter reports them and what it costs.
pub fn layer_events(events: usize) -> Vec<WaiterPoint> {
    use kvferry_gpu::{LayerWaiter, PollPolicy, Readiness};
    let policies = [
        PollPolicy::default(),
        PollPolicy {
            spin: Duration::ZERO,
            interval: Duration::from_micros(50),
        },
        PollPolicy {
            spin: Duration::ZERO,
            interval: Duration::from_millis(1),
        },
        PollPolicy {
            spin: Duration::from_millis(2),
            interval: Duration::from_micros(50),
        },
    ];
    let mut out = Vec::new();
    for policy in policies {
        let (tx, rx) = std::sync::mpsc::channel::<(u16, Instant)>();
        let waiter = LayerWaiter::spawn(policy, move |r| {
            if let Readiness::Ready { layer, .. } = r {
                let _ = tx.send((layer, Instant::now()));
            }
        });
        let cpu0 = cpu_seconds();
        let t0 = Instant::now();
        let mut late = Vec::with_capacity(events);
        for i in 0..events {
            let gap = Duration::from_micros(500 + (i as u64 * 7919) % 1000);
            let due = Instant::now() + gap;
            let event = Box::new(DeadlineEvent(due));
            if waiter.watch(vec![RoomId(1)], i as u16, event).is_err() {
                break;
            }
            match rx.recv_timeout(Duration::from_secs(1)) {
                Ok((_, seen)) => late.push(seen.saturating_duration_since(due)),
                Err(_) => break,
            }
        }
        let elapsed = t0.elapsed().as_secs_f64();
        let cpu = match (cpu0, cpu_seconds()) {
            (Some(a), Some(b)) if elapsed > 0.0 => Some((b - a) / elapsed),
            _ => None,
        };
        drop(waiter);
        late.sort();
        let at = |q: f64| {
            late.get(((late.len() as f64 * q) as usize).min(late.len().saturating_sub(1)))
                .copied()
                .unwrap_or_default()
        };
        out.push(WaiterPoint {
            policy,
            median: at(0.5),
            p99: at(0.99),
            cpu_cores: cpu,
        });
    }
    out
}
