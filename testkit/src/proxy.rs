//! A fault-injecting TCP proxy for loopback tests: delay, stall a direction, black-hole
//! both for a while, corrupt bytes, truncate, reset connections (at once or on a seeded
//! schedule). Loopback only: it exists for tests and for `kvferry proxy`.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// What the proxy does to the bytes it forwards, changeable at any time.
#[derive(Clone, Debug, Default)]
pub struct ProxyFaults {
    /// Added before forwarding each chunk.
    pub delay: Duration,
    /// Hold client-to-server bytes (they flow again when cleared).
    pub stall_up: bool,
    /// Hold server-to-client bytes.
    pub stall_down: bool,
    /// Hold both directions until this instant (a black hole that TCP would outlast).
    pub blackhole_until: Option<Instant>,
    /// Probability that a forwarded chunk has one byte flipped.
    pub corrupt: f64,
    /// Probability that a forwarded chunk resets its connection instead (a seeded schedule).
    pub reset: f64,
    /// Forward only this many bytes of the next chunk, then close that connection.
    pub truncate_next: Option<usize>,
    /// Bytes slipped in ahead of the next decode-to-prefill chunk of a data connection past
    /// its handshake (where only acknowledgements travel): a forged acknowledgement.
    pub forge_data_ack: Option<Vec<u8>>,
    /// Flip one bit of the prefill-to-decode bytes of the next data connection to reach this
    /// many bytes past its handshake (inside the write batches: a corrupted page, where the
    /// offset lands in a payload).
    pub flip_data_byte: Option<u64>,
}

struct State {
    faults: Mutex<ProxyFaults>,
    /// Signalled whenever the faults change, so held pumps wait for it instead of polling.
    changed: tokio::sync::Notify,
    /// The connections through the proxy.
    pumps: Mutex<Vec<Pumps>>,
    /// Data connections seen so far (known at their first bytes).
    data_seen: AtomicU64,
    rng: Mutex<kvferry_core::rng::Rng>,
}

/// One connection's two directions, and whether it is a data connection (known at its first
/// bytes).
struct Pumps {
    up: JoinHandle<()>,
    down: JoinHandle<()>,
    data: Arc<AtomicBool>,
}

impl Pumps {
    /// Neither direction forwards any more.
    fn ended(&self) -> bool {
        self.up.is_finished() && self.down.is_finished()
    }

    fn is_data(&self) -> bool {
        self.data.load(Ordering::Relaxed)
    }

    fn abort(&self) {
        self.up.abort();
        self.down.abort();
    }
}

/// A running proxy in front of `upstream`.
pub struct FaultProxy {
    /// Where clients connect.
    pub addr: SocketAddr,
    state: Arc<State>,
    accept: JoinHandle<()>,
}

impl Drop for FaultProxy {
    fn drop(&mut self) {
        self.accept.abort();
        self.reset_all();
    }
}

impl FaultProxy {
    /// Listens on an ephemeral loopback port and forwards to `upstream`.
    pub async fn start(upstream: SocketAddr, seed: u64) -> std::io::Result<FaultProxy> {
        Self::start_on(SocketAddr::from(([127, 0, 0, 1], 0)), upstream, seed).await
    }

    /// Listens on `listen` (which must be a loopback address) and forwards to `upstream`.
    pub async fn start_on(
        listen: SocketAddr,
        upstream: SocketAddr,
        seed: u64,
    ) -> std::io::Result<FaultProxy> {
        if !listen.ip().is_loopback() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "the fault proxy only listens on loopback addresses",
            ));
        }
        let listener = TcpListener::bind(listen).await?;
        let addr = listener.local_addr()?;
        let state = Arc::new(State {
            faults: Mutex::new(ProxyFaults::default()),
            changed: tokio::sync::Notify::new(),
            pumps: Mutex::new(Vec::new()),
            data_seen: AtomicU64::new(0),
            rng: Mutex::new(kvferry_core::rng::Rng::new(seed)),
        });
        let s = state.clone();
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(upstream).await else {
                    continue;
                };
                let _ = client.set_nodelay(true);
                let _ = server.set_nodelay(true);
                let (cr, cw) = client.into_split();
                let (sr, sw) = server.into_split();
                let data = Arc::new(AtomicBool::new(false));
                let up = tokio::spawn(pump(cr, sw, s.clone(), true, data.clone()));
                let down = tokio::spawn(pump(sr, cw, s.clone(), false, data.clone()));
                if let Ok(mut p) = s.pumps.lock() {
                    // Connections that ended go, so that a long run stays small.
                    p.retain(|c| !c.ended());
                    p.push(Pumps { up, down, data });
                }
            }
        });
        Ok(FaultProxy {
            addr,
            state,
            accept,
        })
    }

    /// Changes the faults.
    pub fn set(&self, f: impl FnOnce(&mut ProxyFaults)) {
        if let Ok(mut faults) = self.state.faults.lock() {
            f(&mut faults);
        }
        self.state.changed.notify_waiters();
    }

    /// Resets every connection through the proxy (both ends see them close).
    pub fn reset_all(&self) {
        if let Ok(mut p) = self.state.pumps.lock() {
            for c in p.drain(..) {
                c.abort();
            }
        }
    }

    /// Resets every data connection through the proxy (known as one by its first bytes),
    /// leaving control connections be. Returns how many it reset.
    pub fn reset_data(&self) -> u64 {
        let mut reset = 0;
        if let Ok(mut p) = self.state.pumps.lock() {
            p.retain(|c| {
                let keep = !c.is_data() || c.ended();
                if !keep {
                    c.abort();
                    reset += 1;
                }
                keep
            });
        }
        reset
    }

    /// Data connections open through the proxy now.
    pub fn data_connections_open(&self) -> usize {
        self.state.pumps.lock().map_or(0, |p| {
            p.iter()
                .filter(|c| c.is_data() && !c.up.is_finished() && !c.down.is_finished())
                .count()
        })
    }

    /// Data connections that reached the proxy so far.
    pub fn data_connections_seen(&self) -> u64 {
        self.state.data_seen.load(Ordering::Relaxed)
    }
}

/// Returns once this direction is neither stalled nor black-holed: woken when the faults
/// change, or when the black hole's end comes.
async fn wait_until_passing(state: &State, up: bool) {
    loop {
        // Registered before the check: a change between the two still wakes it.
        let changed = state.changed.notified();
        let f = match state.faults.lock() {
            Ok(f) => f.clone(),
            Err(_) => return,
        };
        let stalled = if up { f.stall_up } else { f.stall_down };
        let hole = f.blackhole_until.filter(|t| *t > Instant::now());
        match (stalled, hole) {
            (false, None) => return,
            (true, _) => changed.await,
            (false, Some(end)) => {
                tokio::select! {
                    _ = changed => {}
                    _ = tokio::time::sleep_until(end.into()) => {}
                }
            }
        }
    }
}

fn next(state: &State) -> u64 {
    state.rng.lock().map(|mut r| r.next_u64()).unwrap_or(0)
}

fn chance(state: &State, p: f64) -> bool {
    state.rng.lock().map(|mut r| r.chance(p)).unwrap_or(false)
}

/// Bytes a decode sends on a data connection before its first acknowledgement: the
/// preamble (magic and kind) and its data hello.
const DATA_HANDSHAKE_UP: usize = kvferry_tcp::MAGIC.len() + 1 + kvferry_tcp::DATA_HELLO_LEN;

/// Bytes a prefill sends on a data connection before its first write batch: the challenge
/// and the one-byte answer.
const DATA_HANDSHAKE_DOWN: usize = kvferry_tcp::DATA_CHALLENGE_LEN + 1;

async fn pump(
    mut from: OwnedReadHalf,
    mut to: OwnedWriteHalf,
    state: Arc<State>,
    up: bool,
    is_data: Arc<AtomicBool>,
) {
    let mut buf = vec![0u8; 64 * 1024];
    let mut forwarded = 0usize;
    // The connection's first bytes (its magic and kind), however the reads split them.
    let preamble = kvferry_tcp::MAGIC.len() + 1;
    let mut first = Vec::with_capacity(preamble);
    loop {
        let n = match from.read(&mut buf).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        if up && first.len() < preamble {
            let take = (preamble - first.len()).min(n);
            first.extend_from_slice(&buf[..take]);
            if first.len() == preamble {
                let data = first.starts_with(&kvferry_tcp::MAGIC)
                    && first[kvferry_tcp::MAGIC.len()] == kvferry_tcp::KIND_DATA;
                is_data.store(data, Ordering::Relaxed);
                if data {
                    state.data_seen.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        let data = is_data.load(Ordering::Relaxed);
        if !up && data {
            // The stream position of the byte to flip, if this chunk holds it.
            let (start, end) = (forwarded as u64, (forwarded + n) as u64);
            if let Ok(mut f) = state.faults.lock() {
                let target = f.flip_data_byte.map(|at| at + DATA_HANDSHAKE_DOWN as u64);
                if let Some(pos) = target.filter(|pos| (start..end).contains(pos)) {
                    buf[(pos - start) as usize] ^= 0x10;
                    f.flip_data_byte = None;
                }
            }
        }
        if up && data && forwarded >= DATA_HANDSHAKE_UP {
            let forged = state
                .faults
                .lock()
                .ok()
                .and_then(|mut f| f.forge_data_ack.take());
            if let Some(forged) = forged {
                if to.write_all(&forged).await.is_err() {
                    break;
                }
            }
        }
        forwarded += n;
        wait_until_passing(&state, up).await;
        let (delay, corrupt, reset) = match state.faults.lock() {
            Ok(f) => (f.delay, f.corrupt, f.reset),
            Err(_) => (Duration::ZERO, 0.0, 0.0),
        };
        if !delay.is_zero() {
            tokio::time::sleep(delay).await;
            // A stall or black hole set during the delay holds this chunk too.
            wait_until_passing(&state, up).await;
        }
        if corrupt > 0.0 && chance(&state, corrupt) {
            let i = (next(&state) % n as u64) as usize;
            buf[i] ^= 0x5A;
        }
        if reset > 0.0 && chance(&state, reset) {
            break;
        }
        let cut = match state.faults.lock() {
            Ok(mut f) => f.truncate_next.take(),
            Err(_) => None,
        };
        if let Some(cut) = cut {
            let _ = to.write_all(&buf[..cut.min(n)]).await;
            break;
        }
        if to.write_all(&buf[..n]).await.is_err() {
            break;
        }
    }
    let _ = to.shutdown().await;
}
