//! What a runtime lends the driver loop ([`Runtime`]), and the tasks every runtime runs,
//! written once over it: dialing a control or a data connection, taking an accepted one,
//! reading and writing a control connection, serving a data connection, releasing a
//! session's connections, the listener's loop and the timer task that turns the driver.
//!
//! A runtime only spawns these futures ([`Job::run`], [`Work::run`], [`listen`],
//! [`take_accepted`], [`run_driver`]) and says how its sockets are dialed and split. The spawn
//! stays in the adapter because tokio needs its tasks `Send` and a thread-per-core shard's are
//! not: each adapter spawns them with its own concrete types, so the same body is `Send` where
//! it must be and local where it may be.

use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use futures_io::{AsyncRead, AsyncWrite};
use futures_lite::{AsyncReadExt, AsyncWriteExt};
use kvferry_core::{
    DialId, Endpoint, Role, SessionId, SessionKey, TargetId, TransferId, TransferOutcome,
};
use kvferry_tcp::send::Task;
use kvferry_tcp::{ServeError, ServeStats};
use tokio::sync::mpsc;
use tracing::{debug, info_span, warn, Instrument};

use crate::accept::Accepted;
use crate::{Answer, CoreWait};
use crate::{
    CoreCheck, DataConn, Dial, Driver, EndpointAccess, FaultPlan, FaultSwitch, Host, Job,
    NodeError, OpSink, Release,
};

/// A control connection's writer queue: the driver sends frames, the writer task drains it.
pub type ControlQueue = mpsc::UnboundedSender<Vec<u8>>;

/// What a runtime lends the driver loop beyond its [`Host`]: a way into its driver, its
/// timer, its sockets, its spawn of the driver's tasks ([`Work`]) and its data plane's two
/// halves. Implemented by a cheap handle to one driver (a weak reference to a node or a
/// shard); apart from `drive`, none of its methods reaches the driver, and none is called
/// from inside `drive`.
pub trait Runtime: Host<Task: Task + Future + Unpin> + Clone {
    /// A connection of this runtime (TLS inside, where configured).
    type Stream: AsyncRead + AsyncWrite + Unpin + 'static;
    /// A control connection's reading half.
    type Read: AsyncRead + Unpin + 'static;
    /// A control connection's writing half.
    type Write: AsyncWrite + Unpin + 'static;

    /// Runs `f` on the driver; `None` once the node (or shard) is gone.
    fn drive<T>(&self, f: impl FnOnce(&mut Driver<Self>) -> T) -> Option<T>;

    /// The runtime's timer.
    fn sleep(wait: Duration) -> impl Future<Output = ()>;

    /// Opens a connection to a kvferry listener and says what it is for: a control
    /// connection (`key` is `None`) or a data connection proving `key`.
    fn dial(
        &self,
        addr: SocketAddr,
        key: Option<SessionKey>,
    ) -> impl Future<Output = io::Result<Self::Stream>>;

    /// Splits a control connection into the halves its reader and its writer own.
    fn split(&self, stream: Self::Stream) -> io::Result<(Self::Read, Self::Write)>;

    /// Spawns `work` ([`Work::run`]) on the runtime, where a task of the node may run (not
    /// from inside [`Runtime::drive`]).
    fn spawn(&self, work: Work<Self>) -> <Self as Host>::Task;

    /// Starts prefill's sending half on a data connection; each operation's outcome goes to
    /// `report`.
    fn start_sender(
        &self,
        stream: Self::Stream,
        report: Reporter<Self>,
    ) -> io::Result<Self::Sender>;

    /// Decode's receiving half of a data connection: serves writes from it, each admitted
    /// by `check`, until the connection ends.
    fn serve(
        &self,
        stream: Self::Stream,
        check: CoreCheck<DriverAccess<Self>>,
    ) -> impl Future<Output = Result<ServeStats, ServeError>> + 'static;

    /// How this runtime waits for an RDMA completion channel to be readable.
    #[cfg(feature = "rdma")]
    type Readable;

    /// Starts waiting on `fd`'s readability (called on the runtime, inside
    /// [`crate::rdma::watch`]).
    #[cfg(feature = "rdma")]
    fn readable(&self, fd: crate::rdma::CompletionFd) -> io::Result<Self::Readable>;

    /// Waits until the descriptor has something to read. What was there when the previous
    /// wait returned has been consumed by then: the wait is for what comes after.
    #[cfg(feature = "rdma")]
    fn wait(readable: &mut Self::Readable) -> impl Future<Output = io::Result<()>>;

    /// Runs `f` where it may take long (not on the thread of a task of the node); `None` if
    /// it could not finish (it panicked).
    fn blocking<T: Send + 'static>(
        &self,
        f: impl FnOnce() -> T + Send + 'static,
    ) -> impl Future<Output = Option<T>>;
}

/// A task of a node that runs on a runtime's sockets: what [`Runtime::spawn`] runs.
pub enum Work<R: Runtime> {
    /// Reads a control connection's frames into the core (`read_control`).
    ReadControl {
        /// The connection's session.
        session: SessionId,
        /// Its reading half.
        read: R::Read,
    },
    /// Writes the driver's frames on a control connection (`write_control`).
    WriteControl {
        /// The connection's session.
        session: SessionId,
        /// The frames the driver queues.
        queue: mpsc::UnboundedReceiver<Vec<u8>>,
        /// Its writing half.
        write: R::Write,
    },
    /// Serves decode's side of a data connection (`serve_data`).
    Serve {
        /// The connection's session.
        session: SessionId,
        /// The connection.
        stream: R::Stream,
    },
}

impl<R: Runtime> Work<R> {
    /// The task's body, on `rt`.
    pub async fn run(self, rt: R) {
        match self {
            Work::ReadControl { session, read } => {
                let span = info_span!("kvferry_session", %session);
                read_control(rt, session, read).instrument(span).await;
            }
            Work::WriteControl {
                session,
                queue,
                write,
            } => {
                let span = info_span!("kvferry_session", %session);
                write_control(queue, write).instrument(span).await;
            }
            Work::Serve { session, stream } => {
                let span = info_span!("kvferry_data", %session);
                let serve = rt.serve(stream, check(rt.clone(), session));
                serve_data(rt, session, serve).instrument(span).await;
            }
        }
    }
}

impl<R: Runtime> Job<R> {
    /// The job's body, on `rt`.
    pub async fn run(self, rt: R) {
        match self {
            Job::Connect { addr, dial } => connect(rt, addr, dial).await,
            Job::OpenData { session, addr, key } => open_data(rt, session, addr, key).await,
            Job::Release {
                session,
                conns,
                tasks,
                linger,
                why,
            } => release(rt, session, conns, tasks, linger, why).await,
            #[cfg(feature = "rdma")]
            Job::WatchCompletions { session, qp, stop } => {
                crate::rdma::watch(rt, session, qp, stop).await;
            }
            Job::VerifyLanded {
                permit,
                ranges,
                checksum,
                memory,
            } => {
                let verdict =
                    rt.blocking(move || crate::landed_verdict(&memory, permit, &ranges, checksum));
                if let Some(permit) = verdict.await {
                    rt.drive(|d| d.with(|e, now| e.end_write(now, permit, &[])));
                }
            }
            #[cfg(feature = "rdma")]
            Job::FlushLanded {
                room,
                generation,
                memory,
            } => {
                let flushed = rt.blocking(move || memory.flush_remote_writes());
                let result = match flushed.await {
                    Some(r) => r.map_err(|e| e.to_string()),
                    None => Err("the flush did not run".to_owned()),
                };
                rt.drive(|d| d.with(|e, now| e.end_flush(now, room, generation, result)));
            }
        }
    }
}

/// Where a data connection's sender reports each operation's outcome: the core, through the
/// driver a [`Runtime`] handle reaches.
#[derive(Clone)]
pub struct Reporter<R>(R);

impl<R: Runtime> Reporter<R> {
    /// Operation `id` ended with `outcome`.
    pub fn report(&self, id: TransferId, outcome: TransferOutcome) {
        self.0
            .drive(|d| d.with(|e, now| e.handle_transfer_result(now, id, outcome)));
    }
}

/// A control connection's reader and writer tasks.
pub struct ControlTasks<T> {
    /// Reads frames into the core.
    pub reader: T,
    /// Writes the driver's frames.
    pub writer: T,
}

impl<T: Task + Future + Unpin> ControlTasks<T> {
    /// Stops reading at once; lets the writer send what is queued (its queue is closed, so it
    /// ends by itself) until `linger` ends (`None`: not at all), then stops it.
    pub async fn stop(self, linger: Option<CoreWait>) {
        self.reader.stop().await;
        let mut writer = self.writer;
        let flushed = match linger {
            Some(linger) => {
                futures_lite::future::or(async { Some((&mut writer).await) }, async {
                    let _ = linger.await;
                    None
                })
                .await
            }
            None => None,
        };
        if flushed.is_none() {
            writer.stop().await;
        }
    }
}

/// The endpoint of the driver a [`Runtime`] handle reaches, for the receive path's
/// [`crate::CoreCheck`]; the injected faults are read from the driver's [`FaultSwitch`],
/// so a write batch takes the driver only for its admission.
pub struct DriverAccess<R> {
    rt: R,
    faults: FaultSwitch,
}

impl<R: Runtime> DriverAccess<R> {
    /// The way to `rt`'s driver (no faults if the node is gone).
    pub fn new(rt: R) -> Self {
        let faults = rt.drive(|d| d.fault_switch()).unwrap_or_default();
        DriverAccess { rt, faults }
    }
}

impl<R: Runtime> EndpointAccess for DriverAccess<R> {
    fn run<T>(
        &self,
        f: impl FnOnce(&mut Endpoint, Instant) -> T,
        drain: impl FnOnce(&T) -> bool,
    ) -> Option<T> {
        self.rt.drive(|d| {
            let out = f(d.endpoint_mut(), Instant::now());
            if drain(&out) {
                d.drain();
            }
            out
        })
    }

    fn faults(&self) -> Option<FaultPlan> {
        self.faults.get()
    }
}

/// Puts a data connection to work for `session` if the driver wants it ([`Driver::wants_data`]):
/// prefill starts a sender on it, decode a receiver.
pub fn attach_data<R: Runtime>(rt: &R, session: SessionId, stream: R::Stream) {
    let wanted = rt.drive(|d| d.wants_data(session).then(|| d.endpoint().info().role));
    let Some(Some(role)) = wanted else {
        return; // dropping the stream closes it
    };
    let conn = match role {
        Role::Prefill => match rt.start_sender(stream, Reporter(rt.clone())) {
            Ok(sender) => DataConn::Sender(sender),
            Err(e) => {
                warn!(%session, error = %e, "cannot start a data connection");
                // Lost like any other: the core decides whether it is replaced.
                rt.drive(|d| d.data_connection_lost(session));
                return;
            }
        },
        Role::Decode => DataConn::Receiver(rt.spawn(Work::Serve { session, stream })),
    };
    // The session may have closed since: the connection then goes at once.
    if let Some(Err(conn)) = rt.drive(|d| d.attach_data(session, conn)) {
        match conn {
            DataConn::Sender(s) => s.abort(),
            DataConn::Receiver(t) => t.abort(),
        }
    }
}

/// The receive path's admission of `session`'s writes: the core, through the driver `rt`
/// reaches.
fn check<R: Runtime>(rt: R, session: SessionId) -> CoreCheck<DriverAccess<R>> {
    CoreCheck::new(DriverAccess::new(rt), session)
}

/// [`Runtime::dial`] for a caller or (with its session and key) a data connection, until the
/// core gives the attempt up (`connect_timeout`, or the session's data-dial deadline); an
/// attempt given up fails as timed out.
async fn dial_bounded<R: Runtime>(
    rt: &R,
    addr: SocketAddr,
    data: Option<(SessionId, SessionKey)>,
) -> io::Result<R::Stream> {
    let started = rt.drive(|d| match &data {
        Some((session, _)) => d.data_dial_started(*session),
        None => d.dial_started(),
    });
    let key = data.map(|(_, key)| key);
    let Some((dial, abandon)) = started else {
        return Err(io::Error::other("the node is gone"));
    };
    dial_until(rt, addr, key, dial, abandon).await
}

/// [`Runtime::dial`] until `abandon` ends (the core gave attempt `dial` up): then it fails
/// as timed out.
async fn dial_until<R: Runtime>(
    rt: &R,
    addr: SocketAddr,
    key: Option<SessionKey>,
    dial: DialId,
    abandon: CoreWait,
) -> io::Result<R::Stream> {
    let dialed = futures_lite::future::or(async { Some(rt.dial(addr, key).await) }, async {
        let _ = abandon.await;
        None
    })
    .await;
    rt.drive(|d| d.dial_settled(dial));
    dialed.unwrap_or_else(|| Err(io::ErrorKind::TimedOut.into()))
}

/// Dials a control connection for `dial` and hands it to the driver, or says the attempt
/// failed ([`Job::Connect`]).
async fn connect<R: Runtime>(rt: R, addr: SocketAddr, dial: Dial) {
    match dial {
        Dial::Target {
            target,
            dial,
            abandon,
        } => {
            // Its connect timeout counts from here: a task that ran late waited for a CPU,
            // not for the peer.
            rt.drive(|d| d.dial_began(dial));
            match dial_until(&rt, addr, None, dial, abandon).await {
                Ok(stream) => attach_control(&rt, stream, Some(addr), Some(target), None),
                // Also after the core said to abandon it: the core counts what it found.
                Err(e) => {
                    debug!(%target, %addr, error = %e, "connect failed");
                    rt.drive(|d| d.connect_failed(dial, &e));
                }
            }
        }
        Dial::Caller(tx) => match dial_bounded(&rt, addr, None).await {
            Ok(stream) => attach_control(&rt, stream, Some(addr), None, Some(tx)),
            Err(e) => {
                // An attempt the shutdown ended (or a node gone) is the node's ShutDown.
                let refused = rt.drive(|d| d.endpoint().may_connect().err());
                let _ = tx.send(Err(match refused {
                    Some(None) => NodeError::Io(e),
                    _ => NodeError::ShutDown,
                }));
            }
        },
    }
}

/// Opens one data connection of `session` ([`Job::OpenData`]) within the deadline the core
/// keeps for the session's data dials; one that does not open is a lost data connection,
/// which the core replaces after its `data_reconnect_interval`.
async fn open_data<R: Runtime>(rt: R, session: SessionId, addr: SocketAddr, key: SessionKey) {
    match dial_bounded(&rt, addr, Some((session, key))).await {
        Ok(stream) => attach_data(&rt, session, stream),
        Err(e) => {
            warn!(%session, error = %e, "data connection failed");
            rt.drive(|d| d.data_connection_lost(session));
        }
    }
}

/// Stops a session's control tasks (a close's; none for a fence), then closes its data
/// connections, then tells the driver ([`Job::Release`]).
async fn release<R: Runtime>(
    rt: R,
    session: SessionId,
    conns: Vec<DataConn<R>>,
    tasks: Option<ControlTasks<R::Task>>,
    linger: Option<CoreWait>,
    why: Release,
) {
    // Control frames first, then data connections: see `Job::Release`.
    if let Some(t) = tasks {
        t.stop(linger).await;
    }
    close_all(conns).await;
    rt.drive(|d| d.released(session, why));
}

/// Closes data connections until nothing of them can write any more.
pub async fn close_all<H: Host>(conns: Vec<DataConn<H>>)
where
    H::Task: Task,
{
    for conn in conns {
        match conn {
            DataConn::Sender(s) => s.close().await,
            DataConn::Receiver(t) => t.stop().await,
        }
    }
}

/// Takes a connection a listener accepted: `open` finishes opening it (a TLS handshake, or
/// nothing), [`crate::accept`] reads its preamble (and a data connection's hello), and it is
/// handed to the driver. All of it must end before the core's deadline for the connection
/// ([`kvferry_core::Action::DropAccepted`]); the connection is dropped when that comes first.
pub async fn take_accepted<R: Runtime>(
    rt: R,
    open: impl Future<Output = io::Result<R::Stream>>,
    peer: Option<SocketAddr>,
) {
    let access = DriverAccess::new(rt);
    let Some((conn, deadline)) = access.rt.drive(|d| d.accepted()) else {
        return;
    };
    let work = async {
        let mut stream = match open.await {
            Ok(stream) => stream,
            Err(e) => {
                warn!(?peer, error = %e, "refused a connection");
                return None;
            }
        };
        let accepted = crate::accept(&mut stream, &access, peer).await?;
        Some((stream, accepted))
    };
    let settled = futures_lite::future::or(work, async {
        let _ = deadline.await;
        warn!(?peer, %conn, "connection did not become a session's in time; dropped");
        None
    })
    .await;
    access.rt.drive(|d| d.accept_settled(conn));
    match settled {
        Some((stream, Accepted::Control)) => attach_control(&access.rt, stream, None, None, None),
        Some((stream, Accepted::Data(session))) => attach_data(&access.rt, session, stream),
        None => {}
    }
}

/// Accepts connections until the node is gone, handing each to `take`; after a failed
/// accept (out of descriptors, say) it accepts again when the core says (its
/// `accept_backoff`).
pub async fn listen<R, S, F>(rt: R, mut accept: impl FnMut() -> F, take: impl Fn(S))
where
    R: Runtime,
    F: Future<Output = io::Result<S>>,
{
    loop {
        match accept().await {
            Ok(accepted) => take(accepted),
            Err(e) => {
                let Some(resume) = rt.drive(|d| d.accept_failed()) else {
                    return;
                };
                warn!(error = %e, "accept failed; backing off");
                let _ = resume.await;
            }
        }
    }
}

/// Takes a control connection into the driver: registers it (`handshake` is told how the
/// session's handshake ends), then spawns its reader and writer.
pub fn attach_control<R: Runtime>(
    rt: &R,
    stream: R::Stream,
    peer_addr: Option<SocketAddr>,
    target: Option<TargetId>,
    handshake: Option<Answer>,
) {
    let Some((session, queue)) = register_control(rt, peer_addr, target, handshake) else {
        return;
    };
    let (read, write) = match rt.split(stream) {
        Ok(halves) => halves,
        Err(e) => {
            warn!(%session, error = %e, "cannot split a control connection");
            // A session that closes at once: the core learns it like any loss.
            rt.drive(|d| d.control_ended(session));
            return;
        }
    };
    let tasks = ControlTasks {
        writer: rt.spawn(Work::WriteControl {
            session,
            queue,
            write,
        }),
        reader: rt.spawn(Work::ReadControl { session, read }),
    };
    add_control_tasks(rt, session, tasks);
}

/// Registers a control connection with the driver; returns its session and the queue its
/// writer drains. `handshake` is told how the session's handshake ends.
fn register_control<R: Runtime>(
    rt: &R,
    peer_addr: Option<SocketAddr>,
    target: Option<TargetId>,
    handshake: Option<Answer>,
) -> Option<(SessionId, mpsc::UnboundedReceiver<Vec<u8>>)> {
    let (tx, rx) = mpsc::unbounded_channel();
    let session = rt.drive(|d| {
        let session = d.attach_control(tx, peer_addr, target);
        // Before the reader starts: no answer of the peer can come first.
        if let Some(w) = handshake {
            d.on_handshake(session, w);
        }
        session
    })?;
    Some((session, rx))
}

/// Hands a control connection's tasks to the driver; stops them if the session closed
/// meanwhile.
fn add_control_tasks<R: Runtime>(rt: &R, session: SessionId, tasks: ControlTasks<R::Task>) {
    let refused = match rt.drive(|d| d.add_tasks(session, tasks)) {
        Some(Ok(())) => return,
        Some(Err(tasks)) => tasks,
        None => return,
    };
    refused.reader.abort();
    refused.writer.abort();
}

/// A control connection's reader: feeds what arrives to the core until the connection ends,
/// then closes the session.
async fn read_control<R: Runtime>(rt: R, session: SessionId, mut read: impl AsyncRead + Unpin) {
    let mut buf: Vec<u8> = Vec::with_capacity(64 * 1024);
    let mut chunk = vec![0u8; 64 * 1024];
    loop {
        let n = match read.read(&mut chunk).await {
            Ok(0) | Err(_) => break,
            Ok(n) => n,
        };
        buf.extend_from_slice(&chunk[..n]);
        let Some(used) = rt.drive(|d| d.with(|e, now| e.handle_input(now, session, &buf))) else {
            return;
        };
        buf.drain(..used.min(buf.len()));
    }
    debug!(%session, "control connection ended");
    rt.drive(|d| d.control_ended(session));
}

/// A control connection's writer: writes the driver's frames, coalescing what is queued,
/// until the queue closes (the session closed) or the connection fails.
async fn write_control(
    mut queue: mpsc::UnboundedReceiver<Vec<u8>>,
    mut write: impl AsyncWrite + Unpin,
) {
    while let Some(mut frame) = queue.recv().await {
        while let Ok(more) = queue.try_recv() {
            frame.extend_from_slice(&more);
        }
        if write.write_all(&frame).await.is_err() || write.flush().await.is_err() {
            break;
        }
    }
}

/// Decode's data connection task: runs `serve` (the data plane's receiver) to its end, then
/// tells the driver the connection was lost. A fence stops this task before it gets there.
async fn serve_data<R: Runtime>(
    rt: R,
    session: SessionId,
    serve: impl Future<Output = Result<ServeStats, ServeError>>,
) {
    match serve.await {
        Ok(stats) => debug!(
            %session,
            applied = stats.applied,
            refused = stats.refused,
            "data connection ended"
        ),
        Err(e) => debug!(%session, error = %e, "data connection ended"),
    }
    // The core decides whether and when it is replaced.
    rt.drive(|d| d.data_connection_lost(session));
}

/// The driver task: one [`Driver::turn`] whenever the core's timer is due or the driver's
/// [`Driver::wakeup`] is notified; ends once `stopped` says so after a wake-up (a runtime
/// that stops the node notifies it), or when the node is gone.
pub async fn run_driver<R: Runtime>(rt: R, stopped: impl Fn() -> bool) {
    let Some(wakeup) = rt.drive(|d| d.wakeup()) else {
        return;
    };
    loop {
        let Some(deadline) = rt.drive(|d| d.turn(Instant::now())) else {
            return;
        };
        let timer = async {
            match deadline {
                Some(t) => R::sleep(t.saturating_duration_since(Instant::now())).await,
                None => std::future::pending().await,
            }
        };
        futures_lite::future::or(timer, wakeup.notified()).await;
        if stopped() {
            return;
        }
    }
}
