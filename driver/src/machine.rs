//! The one driver loop: every runtime's driver is this state machine plus a [`Host`] that
//! spawns the runtime's tasks and moves bytes.
//!
//! [`Driver`] owns a core [`Endpoint`] and what the loop needs around it (each session's
//! connections, operations waiting for a data connection, room handles, targets' addresses,
//! callers waiting for a handshake or for the shutdown). It feeds the core's inputs, drains
//! its outputs in the documented order under a budget, and turns the core's actions into
//! requests to its [`Host`]. It never waits and never does IO: the host starts tasks (each
//! [`crate::Job`], and the connections' [`crate::runtime::Work`]), and those tasks report back
//! through the `Driver` methods their docs name (the control reader through the core's
//! `handle_input`, a data sender through `handle_transfer_result`).
//! The host keeps the driver behind whatever its runtime shares state with (a mutex on
//! tokio, a cell on a thread-per-core shard) and never calls back into it from inside a
//! [`Host`] method.

use crate::plane;
use crate::runtime::ControlTasks;
use crate::session_io::send_round_robin;
use crate::waits::{Refusal, Waits};
use crate::{
    Answer, Connections, DataConn, Dial, FaultSwitch, Host, Job, OpSink, Release, SessionIo,
};
use std::net::SocketAddr;
use std::time::{Duration, Instant};

use foldhash::fast::FixedState;
use kvferry_core::{
    Action, ApiError, Endpoint, Event, KvPoll, Role, RoomId, SessionId, SessionState, TargetId,
    TransferOp, TransferOutcome,
};
use kvferry_sync::ConnSet;
use tokio::sync::oneshot;
use tracing::{debug, info, warn};

use crate::RoomHandle;
use crate::{connect_failure, export_metrics, Announcer, DataPath, FaultPlan, NodeError, RoomBook};

pub(crate) type Map<K, V> = std::collections::HashMap<K, V, FixedState>;

/// Outputs one drain handles before it yields: the rest waits for the next turn, so one
/// busy node cannot hold its runtime's thread (or its lock) for an unbounded time.
pub const TURN_BUDGET: usize = 4096;

/// How often the core's counters are exported as metrics.
const METRICS_EVERY: Duration = Duration::from_millis(500);

/// The driver loop's state: a core endpoint and everything the loop keeps around it.
pub struct Driver<H: Host> {
    endpoint: Endpoint,
    host: H,
    io: Map<SessionId, SessionIo<H>>,
    rooms: RoomBook,
    targets: Map<TargetId, SocketAddr>,
    /// Callers waiting for a session's handshake.
    handshakes: Waits<SessionId>,
    /// Callers waiting for a target's first contact (refusals of any of its sessions).
    target_waits: Waits<TargetId>,
    /// Targets the core let go as idle, not yet taken by the embedder's peer table.
    let_go: Vec<TargetId>,
    shutdown_waiters: Vec<oneshot::Sender<()>>,
    armed: Option<Instant>,
    metrics_at: Instant,
    /// Whether an input reached the core since the last export of its metrics.
    metrics_dirty: bool,
    role: Role,
    data_connections: usize,
    announcements: Announcer,
    /// Injected data-path faults (demos and tests), shared with the receive paths so a
    /// write batch reads them without taking the driver.
    faults: FaultSwitch,
    /// The shared staging pool device memory moves through, for its metrics.
    staging: Option<std::sync::Arc<kvferry_memory::Staging>>,
    /// What ends the listener's waits when the core says so.
    ends: crate::listener::Ends,
    /// The node's RDMA data plane, when its data moves over RDMA.
    #[cfg(feature = "rdma")]
    rdma: Option<crate::rdma::RdmaPlane>,
    /// The node's same-host plane (cross-memory attach with peers on this host).
    same_host: Option<std::sync::Arc<crate::cma::SameHostPlane>>,
}

impl<H: Host> Driver<H> {
    /// A driver of `endpoint` whose tasks `host` starts; `data_connections` are opened per
    /// session this side dials.
    pub fn new(
        endpoint: Endpoint,
        host: H,
        data_connections: usize,
        announcements: Announcer,
        now: Instant,
    ) -> Self {
        let role = endpoint.info().role;
        Driver {
            endpoint,
            host,
            io: Map::default(),
            rooms: RoomBook::new(role),
            targets: Map::default(),
            handshakes: Waits::new(),
            target_waits: Waits::new(),
            let_go: Vec::new(),
            shutdown_waiters: Vec::new(),
            armed: None,
            metrics_at: now,
            metrics_dirty: true,
            role,
            data_connections: data_connections.max(1),
            announcements,
            faults: FaultSwitch::default(),
            staging: None,
            ends: crate::listener::Ends::default(),
            #[cfg(feature = "rdma")]
            rdma: None,
            same_host: None,
        }
    }

    /// Moves this driver's sessions with peers on this host over `plane` where both can.
    pub fn set_same_host_plane(&mut self, plane: std::sync::Arc<crate::cma::SameHostPlane>) {
        self.same_host = Some(plane);
    }

    /// The node's same-host plane, if it has one.
    pub fn same_host_plane(&self) -> Option<&std::sync::Arc<crate::cma::SameHostPlane>> {
        self.same_host.as_ref()
    }

    /// The shared staging pool of the node's device memory, exported with its metrics.
    pub fn set_staging(&mut self, staging: Option<std::sync::Arc<kvferry_memory::Staging>>) {
        self.staging = staging;
    }

    /// Moves this driver's sessions over `plane` (RDMA) where their peers do too.
    #[cfg(feature = "rdma")]
    pub fn set_rdma_plane(&mut self, plane: Option<crate::rdma::RdmaPlane>) {
        self.rdma = plane;
    }

    /// The node's RDMA data plane, if its data moves over RDMA.
    #[cfg(feature = "rdma")]
    pub fn rdma_plane(&self) -> Option<&crate::rdma::RdmaPlane> {
        self.rdma.as_ref()
    }

    /// The core endpoint (read-only: inputs go through [`Driver::with`]).
    pub fn endpoint(&self) -> &Endpoint {
        &self.endpoint
    }

    /// The core endpoint, for an input whose outputs the caller drains itself
    /// ([`Driver::drain`]) or that has none (challenges, admissions).
    pub fn endpoint_mut(&mut self) -> &mut Endpoint {
        &mut self.endpoint
    }

    /// The data-path faults injected on this driver's data paths (demos and tests).
    pub fn faults(&self) -> Option<FaultPlan> {
        self.faults.get()
    }

    /// Replaces the injected data-path faults.
    pub fn set_faults(&mut self, faults: Option<FaultPlan>) {
        self.faults.set(faults);
    }

    /// The switch the receive paths read the injected faults from.
    pub fn fault_switch(&self) -> FaultSwitch {
        self.faults.clone()
    }

    pub(crate) fn ends_mut(&mut self) -> &mut crate::listener::Ends {
        &mut self.ends
    }

    /// The host.
    pub fn host(&self) -> &H {
        &self.host
    }

    /// A session's connections, if the driver has any.
    pub fn session_io(&mut self, session: SessionId) -> Option<&mut SessionIo<H>> {
        self.io.get_mut(&session)
    }

    /// Runs `f` on the endpoint, then drains its outputs (the core's rule after every input).
    pub fn with<T>(&mut self, f: impl FnOnce(&mut Endpoint, Instant) -> T) -> T {
        let out = f(&mut self.endpoint, Instant::now());
        self.drain();
        out
    }

    /// One turn of the host's driver task: the outputs left from a budgeted drain, the
    /// core's timer if it is due, metrics; returns when the next turn is due (now, if the
    /// budget ran out with outputs left).
    pub fn turn(&mut self, now: Instant) -> Option<Instant> {
        let mut more = self.drain_some();
        if self.endpoint.poll_timeout().is_some_and(|(t, _)| t <= now) {
            self.endpoint.handle_timeout(now);
            more |= self.drain_some();
            self.metrics_dirty = true;
        }
        self.export_metrics_if_due(now);
        let next = self.next_turn();
        self.armed = next;
        if more {
            return Some(now);
        }
        next
    }

    /// When the next turn is due: the core's timer, or the export of metrics that changed
    /// since the last one (a node with no timer left still publishes its last change).
    fn next_turn(&self) -> Option<Instant> {
        let core = self.endpoint.poll_timeout().map(|(t, _)| t);
        let metrics = self.metrics_dirty.then(|| self.metrics_at + METRICS_EVERY);
        core.into_iter().chain(metrics).min()
    }

    /// Publishes the node's metrics if the last export is [`METRICS_EVERY`] old: from every
    /// turn and every drain, so a change is published by the next input or timer, whichever
    /// task handles it.
    fn export_metrics_if_due(&mut self, now: Instant) {
        if now.duration_since(self.metrics_at) < METRICS_EVERY {
            return;
        }
        self.metrics_at = now;
        self.metrics_dirty = false;
        export_metrics(&self.endpoint, self.role);
        if let Some(s) = &self.staging {
            crate::export_staging_metrics(s, self.role);
        }
        let role = crate::role_label(self.role);
        for (sid, io) in &self.io {
            if let Some(path) = io.path {
                metrics::gauge!("kvferry_session_path", "role" => role, "session" => sid.0.to_string(), "path" => path.as_str())
                    .set(1.0);
            }
        }
    }

    /// Drains the core's outputs in the documented order (transmits, actions, operations,
    /// events), at most [`TURN_BUDGET`] of them; asks the host for a turn when the budget ran
    /// out or the core's next deadline is earlier than the one the host's timer waits for.
    pub fn drain(&mut self) {
        let more = self.drain_some();
        self.metrics_dirty = true;
        self.export_metrics_if_due(Instant::now());
        let next = self.next_turn();
        let earlier = next.is_some_and(|t| self.armed.map_or(true, |a| t < a));
        if more || earlier {
            self.host.wake();
        }
    }

    /// Drains at most [`TURN_BUDGET`] outputs; `true` if some are left.
    fn drain_some(&mut self) -> bool {
        let mut budget = TURN_BUDGET;
        let mut buf = Vec::new();
        loop {
            let mut progressed = false;
            while let Some(sid) = self.endpoint.poll_transmit(&mut buf) {
                progressed = true;
                match self.io.get(&sid).and_then(|io| io.control.as_ref()) {
                    Some(control) => {
                        // A writer that has ended drops it: the reader's end reports the loss.
                        let _ = control.send(std::mem::take(&mut buf));
                    }
                    None => buf.clear(),
                }
            }
            while let Some(action) = self.endpoint.poll_action() {
                progressed = true;
                match action {
                    Action::FenceSession(sid) => self.start_fence(sid),
                    Action::CloseSession(sid) => self.start_close(sid),
                    Action::Connect { target, dial } => {
                        // A target without an address never connects: its deadline ends it.
                        if let Some(&addr) = self.targets.get(&target) {
                            let over = self.endpoint.shutdown_complete();
                            let abandon = self.ends.dials.arm(dial, over);
                            let dial = Dial::Target {
                                target,
                                dial,
                                abandon,
                            };
                            self.host.start(Job::Connect { addr, dial });
                        }
                    }
                    Action::OpenDataConnection(sid) => self.open_data_connections(sid, 1),
                    Action::DropAccepted(conn) => self.ends.accepted.end(&conn),
                    Action::AbandonDial(dial) => self.ends.dials.end(&dial),
                    Action::StopDraining(drain) => self.ends.drains.end(&drain),
                    Action::ResumeAccepting => self.ends.resume_accepting(),
                    Action::StopLingering(sid) => {
                        if let Some(end) = self.io.get_mut(&sid).and_then(|io| io.linger.take()) {
                            let _ = end.send(());
                        }
                    }
                    Action::VerifyLanded {
                        permit,
                        ranges,
                        checksum,
                    } => {
                        plane::verify_landed(self, permit, ranges, checksum);
                    }
                    Action::FlushLanded { room, generation } => {
                        plane::flush_landed(self, room, generation);
                    }
                }
                budget -= 1;
                if budget == 0 {
                    return true;
                }
            }
            let now = Instant::now();
            while let Some(op) = self.endpoint.poll_transfer(now) {
                progressed = true;
                let Some(op) = crate::cma::post(self, op) else {
                    budget -= 1;
                    if budget == 0 {
                        return true;
                    }
                    continue;
                };
                if let Some(op) = plane::post(self, op) {
                    self.dispatch(now, op);
                }
                budget -= 1;
                if budget == 0 {
                    return true;
                }
            }
            while let Some(event) = self.endpoint.poll_event() {
                progressed = true;
                self.on_event(&event);
                self.host.publish(event);
                budget -= 1;
                if budget == 0 {
                    return true;
                }
            }
            if !progressed {
                return false;
            }
        }
    }

    /// Hands an operation to the next open data connection of its session, round-robin;
    /// parks it while the session has none, reports it transient if the session is closing.
    fn dispatch(&mut self, now: Instant, op: TransferOp) {
        let id = op.id;
        match self.io.get_mut(&op.session) {
            Some(io) if !io.data.is_closing() => {
                if let Err(op) = send_round_robin(io, op) {
                    io.parked.push(op);
                }
            }
            _ => self
                .endpoint
                .handle_transfer_result(now, id, TransferOutcome::Transient),
        }
    }

    fn on_event(&mut self, event: &Event) {
        match *event {
            ref e if RoomBook::follows(e) => self.rooms.on_event(event),
            Event::SessionEstablished { session, peer } => {
                info!(%session, node = %peer.node, role = ?peer.role, rank = peer.rank, "session established");
                self.handshakes.succeed(&session, session);
                if !plane::establish(self, session) {
                    // A peer that offered RDMA hears that this session moves over TCP.
                    if let Err(e) =
                        self.endpoint
                            .send_transport(Instant::now(), session, &crate::TCP_PATH)
                    {
                        debug!(%session, error = %e, "could not say the session moves over TCP");
                    }
                    self.use_tcp_path(session, "this node has no RDMA data plane");
                }
                crate::cma::establish(self, session);
            }
            Event::SessionClosed { session } => {
                self.handshakes
                    .fail(&session, || NodeError::HandshakeTimeout);
            }
            Event::PeerError {
                session,
                code,
                ref detail,
            } => self.note_refusal(session, Refusal::Peer(code, detail.clone()), true),
            Event::SessionRejected { session, reason } => {
                self.note_refusal(session, Refusal::Rejected(reason), false)
            }
            Event::TargetUp { target, session } => self.target_waits.succeed(&target, session),
            Event::TargetRefused { target, reason } => self
                .target_waits
                .fail_keeping(&target, || NodeError::RefusedAs(reason)),
            Event::TargetUnreachable { target, reason } => self
                .target_waits
                .fail(&target, || NodeError::Unreachable(reason)),
            Event::TargetLetGo { target } => {
                self.targets.remove(&target);
                self.target_waits.fail(&target, || NodeError::Disconnected);
                self.let_go.push(target);
            }
            Event::ShutDown { .. } => {
                for w in self.shutdown_waiters.drain(..) {
                    let _ = w.send(());
                }
                // No core timer fires once the node is shut down (its driver loop ends):
                // every wait the core was to end ends now.
                self.ends.end_all();
                for io in self.io.values_mut() {
                    if let Some(end) = io.linger.take() {
                        let _ = end.send(());
                    }
                }
            }
            Event::RoomAnnounced { .. } => self.announcements.on_event(event),
            Event::TransportReceived {
                session,
                ref payload,
            } if kvferry_cma::CmaMessage::claims(payload) => {
                crate::cma::on_message(self, session, payload)
            }
            Event::TransportReceived {
                session,
                ref payload,
            } => plane::transport(self, session, payload),
            Event::SessionBlacklisted { session } => warn!(%session, "session blacklisted"),
            Event::SessionRecovered { session } => info!(%session, "session recovered"),
            _ => {}
        }
    }

    /// This node refused `session` because it requires the same-host path and the session
    /// cannot take it (`why`): its waiters hear that, not a peer's refusal.
    pub(crate) fn note_same_host_refusal(&mut self, session: SessionId, why: &'static str) {
        self.note_refusal(session, Refusal::SameHost(why), false);
    }

    /// Remembers why `session` was refused, for its handshake's waiters and its target's.
    fn note_refusal(&mut self, session: SessionId, refusal: Refusal, first: bool) {
        if let Some(target) = self.io.get(&session).and_then(|io| io.target) {
            self.target_waits.note(&target, refusal.clone(), first);
        }
        self.handshakes.note(&session, refusal, first);
    }

    /// Registers a control connection with the core: dialed by this side for `target`
    /// (`peer_addr` and `target` set), dialed by the embedder (`peer_addr` only), or accepted
    /// (neither). [`crate::runtime::attach_control`] then spawns the connection's reader and
    /// writer and hands them to [`Driver::add_tasks`].
    pub fn attach_control(
        &mut self,
        control: crate::ControlQueue,
        peer_addr: Option<SocketAddr>,
        target: Option<TargetId>,
    ) -> SessionId {
        let now = Instant::now();
        let sid = match (target, peer_addr) {
            (Some(t), _) => self.endpoint.open_session_for(now, t),
            (None, Some(_)) => self.endpoint.open_session(now),
            (None, None) => self.endpoint.accept_session(now),
        };
        self.io.insert(
            sid,
            SessionIo {
                control: Some(control),
                tasks: None,
                peer_addr,
                target,
                data: ConnSet::default(),
                next_sender: 0,
                parked: Vec::new(),
                path: None,
                linger: None,
                cma: None,
                #[cfg(feature = "rdma")]
                rdma: None,
            },
        );
        self.drain();
        sid
    }

    /// The tasks of `session`'s control connection, stopped when it closes; given back if the
    /// session closed meanwhile (the host stops them).
    pub fn add_tasks(
        &mut self,
        session: SessionId,
        tasks: ControlTasks<H::Task>,
    ) -> Result<(), ControlTasks<H::Task>> {
        match self.io.get_mut(&session) {
            Some(io) if !io.data.is_closing() && io.tasks.is_none() => {
                io.tasks = Some(tasks);
                Ok(())
            }
            _ => Err(tasks),
        }
    }

    /// Tells `tx` when `session`'s handshake ends: `Ok` once established, else why not (the
    /// peer's refusal, or [`NodeError::HandshakeTimeout`] when the core's timer closed it).
    pub fn on_handshake(&mut self, session: SessionId, tx: Answer) {
        match self.endpoint.session_state(session) {
            Some(SessionState::Established | SessionState::Blacklisted) => {
                let _ = tx.send(Ok(session));
            }
            Some(SessionState::Handshaking | SessionState::Closing) => {
                self.handshakes.add(session, tx);
            }
            None => {
                let _ = tx.send(Err(NodeError::HandshakeTimeout));
            }
        }
    }

    /// Tells `tx` about `target`'s first contact: `Ok` with its session once it has one, the
    /// peer's refusal if it refused us at the handshake, or [`NodeError::Unreachable`] once
    /// the core gave up waiting for it (`unreachable_timeout`).
    pub fn on_target(&mut self, target: TargetId, tx: Answer) {
        if let Some(session) = self.endpoint.target_session(target) {
            let _ = tx.send(Ok(session));
            return;
        }
        if let Some(reason) = self.endpoint.target_refused(target) {
            // What the peer said (both layout values, ...) if it said it, else the reason.
            let why = self
                .target_waits
                .noted(&target)
                .unwrap_or_else(|| NodeError::RefusedAs(reason));
            let _ = tx.send(Err(why));
            return;
        }
        if let Some(reason) = self.endpoint.target_unreachable(target) {
            let _ = tx.send(Err(NodeError::Unreachable(reason)));
            return;
        }
        if let Err(e) = self.endpoint.may_connect() {
            let _ = tx.send(Err(e.into()));
            return;
        }
        self.target_waits.add(target, tx);
    }

    /// A control connection's reader ended: close the session's connections (the core hears
    /// it once they are closed). The peer is gone or the connection broke, so the writer does
    /// not linger: the core set no linger for a close it did not ask for.
    pub fn control_ended(&mut self, session: SessionId) {
        self.start_close(session);
        self.drain();
    }

    /// Whether a data connection of `session` would be put to work (the session is known
    /// and not closing): a host checks before it starts the connection's tasks.
    pub fn wants_data(&self, session: SessionId) -> bool {
        self.io
            .get(&session)
            .is_some_and(|io| !io.data.is_closing())
    }

    /// Puts an accepted or opened data connection to work for `session`, then sends the
    /// operations that waited for one; gives `conn` back if the session is gone or closing.
    pub fn attach_data(
        &mut self,
        session: SessionId,
        conn: DataConn<H>,
    ) -> Result<(), DataConn<H>> {
        let Some(io) = self.io.get_mut(&session) else {
            return Err(conn);
        };
        // Connections that ended on their own (the peer closed them, or broke the protocol
        // and this side closed them) take nothing more: the new one replaces them.
        io.data.retain(|c| match c {
            DataConn::Sender(s) => !s.is_closed(),
            DataConn::Receiver(r) => !H::task_finished(r),
        });
        io.data.attach(conn)?;
        io.send_parked();
        self.drain();
        Ok(())
    }

    /// A data connection of `session` ended on its own: the core decides whether and when
    /// it is replaced ([`Action::OpenDataConnection`]).
    pub fn data_connection_lost(&mut self, session: SessionId) {
        if let Some(io) = self.io.get_mut(&session) {
            io.data.retain(|c| match c {
                DataConn::Receiver(r) => !H::task_finished(r),
                DataConn::Sender(_) => true,
            });
        }
        self.endpoint
            .handle_data_connection_lost(Instant::now(), session);
        self.drain();
    }

    /// A target's connection attempt ([`Job::Connect`]) failed with `error`, or was abandoned
    /// when the core said so (then `error` says whether a refusal was already there to read).
    pub fn connect_failed(&mut self, dial: kvferry_core::DialId, error: &std::io::Error) {
        let failure = connect_failure(error);
        self.ends.dials.forget(&dial);
        self.endpoint
            .handle_connect_failed(Instant::now(), dial, failure);
        self.drain();
    }

    /// The connections a host released ([`Job::Release`]) are closed.
    pub fn released(&mut self, session: SessionId, why: Release) {
        match why {
            Release::Fence => self.fence_closed(session),
            Release::Close => self.closed(session),
        }
    }

    /// A fence's connections are closed: confirm it to the core, then
    /// re-open the data connections if this side opens them.
    pub fn fence_closed(&mut self, session: SessionId) {
        self.endpoint.handle_fence_complete(Instant::now(), session);
        self.drain();
        info!(%session, "session fenced");
        self.open_data_connections(session, self.data_connections);
    }

    /// Every connection of `session` is closed: the core forgets it.
    pub fn closed(&mut self, session: SessionId) {
        let writer = self
            .io
            .remove(&session)
            .and_then(|io| crate::cma::writer_of(&io));
        self.endpoint.handle_disconnected(Instant::now(), session);
        if writer.is_some_and(crate::cma::exited) {
            // A same-host writer that exited writes nothing more: no quarantine to wait out.
            self.endpoint.handle_writer_exited(Instant::now(), session);
        }
        self.drain();
    }

    /// Dials a session to `addr` for an embedder's call, bounded by the core's
    /// `connect_timeout`; `tx` hears how its handshake ends ([`Driver::on_handshake`]).
    pub fn dial(&mut self, addr: SocketAddr, tx: Answer) {
        if let Err(e) = self.endpoint.may_connect() {
            let _ = tx.send(Err(e.into()));
            return;
        }
        self.host.start(Job::Connect {
            addr,
            dial: Dial::Caller(tx),
        });
    }

    /// Keeps a session to the peer at `addr`, reconnecting with the core's backoff.
    pub fn add_target(&mut self, addr: SocketAddr) -> Result<TargetId, ApiError> {
        self.endpoint.may_connect()?;
        let target = self.endpoint.add_target(Instant::now());
        // Known before the drain carries out the core's first connect.
        self.targets.insert(target, addr);
        self.drain();
        Ok(target)
    }

    /// The targets the core let go as idle since the last call: the peers they belong to
    /// are unknown from now on.
    pub fn take_let_go(&mut self) -> Vec<TargetId> {
        std::mem::take(&mut self.let_go)
    }

    /// Lets `links` go (the embedder disconnected their peer): a kept target is dialed no
    /// more and waits for it end with [`NodeError::Disconnected`]; every session of them
    /// closes (rooms still on one fail `AbortedLocally`; the peer hears an orderly goodbye).
    pub fn disconnect(&mut self, links: &[kvferry_core::Link]) {
        let now = Instant::now();
        for link in links {
            match *link {
                kvferry_core::Link::Target(target) => {
                    self.endpoint.disconnect_target(now, target);
                    self.targets.remove(&target);
                    self.target_waits.fail(&target, || NodeError::Disconnected);
                }
                kvferry_core::Link::Session(session) => self.endpoint.disconnect(now, session),
            }
        }
        self.drain();
    }

    /// Opens a room through `open` and returns its handle; a room `open` refused is not
    /// followed.
    pub fn open_room(
        &mut self,
        room: RoomId,
        open: impl FnOnce(&mut Endpoint, Instant) -> Result<(), ApiError>,
    ) -> Result<RoomHandle, ApiError> {
        let current = self
            .endpoint
            .room_state(room)
            .unwrap_or(KvPoll::Bootstrapping);
        let handle = self.rooms.watch(room, current);
        match self.with(open) {
            Ok(()) => Ok(handle),
            Err(e) => {
                if self.endpoint.room_generation(room).is_none() {
                    self.rooms.forget(room);
                }
                Err(e)
            }
        }
    }

    /// Starts the core's shutdown; `done` is told when the core says it is complete.
    pub fn shutdown(&mut self, done: oneshot::Sender<()>) {
        self.endpoint.shutdown(Instant::now());
        // Kept peers are dialed no more: nobody waiting for one would hear.
        self.target_waits.shut_down();
        if self.endpoint.shutdown_complete() {
            let _ = done.send(());
        } else {
            self.shutdown_waiters.push(done);
        }
        self.drain();
    }

    /// Every session's connections, taken for a host that stops (each closed by the host).
    pub fn take_all(&mut self) -> Vec<Connections<H>> {
        self.io
            .drain()
            .map(|(_, mut io)| {
                // An RDMA queue pair goes to the error state: nothing more of it lands.
                plane::close(&mut io);
                (io.data.close().unwrap_or_default(), io.tasks)
            })
            .collect()
    }

    /// `session` moves its operations over TCP data connections (this node does no RDMA, or
    /// the peer said it does none for this session): opened now if this side opens them,
    /// the operations held meanwhile going out on them.
    pub fn use_tcp_path(&mut self, session: SessionId, why: &'static str) {
        self.set_path(session, self.tcp_path(), why);
        if let Some(io) = self.io.get_mut(&session) {
            io.send_parked();
        }
        self.open_data_connections(session, self.data_connections);
    }

    /// The TCP path this node's sessions take: staged where its memory needs a copy engine.
    pub(crate) fn tcp_path(&self) -> DataPath {
        if self.staging.is_some() {
            DataPath::TcpStaged
        } else {
            DataPath::Tcp
        }
    }

    /// Records (and logs) the path `session`'s operations take.
    pub fn set_path(&mut self, session: SessionId, path: DataPath, why: &'static str) {
        if let Some(io) = self.io.get_mut(&session) {
            if io.path != Some(path) {
                let peer = self.endpoint.peer(session).map(|p| p.node);
                info!(target: crate::START_TARGET, %session, ?peer, path = path.as_str(), why, "session data path");
                io.path = Some(path);
            }
        }
    }

    /// Every session whose path is chosen, with it.
    pub fn session_paths(&self) -> Vec<(SessionId, DataPath)> {
        let mut paths: Vec<_> = self
            .io
            .iter()
            .filter_map(|(sid, io)| io.path.map(|p| (*sid, p)))
            .collect();
        paths.sort_by_key(|(sid, _)| sid.0);
        paths
    }

    /// Every session with the data connections it holds (those that ended are let go as
    /// each next one ends or is attached).
    pub fn session_data_connections(&self) -> Vec<(SessionId, usize)> {
        let mut counts: Vec<_> = self
            .io
            .iter()
            .map(|(sid, io)| (*sid, io.data.len()))
            .collect();
        counts.sort_by_key(|(sid, _)| sid.0);
        counts
    }

    /// The path `session`'s operations take (`None`: not chosen yet, or no such session).
    pub fn session_path(&self, session: SessionId) -> Option<DataPath> {
        self.io.get(&session).and_then(|io| io.path)
    }

    /// Opens `n` data connections of `session` if this side dialed it (it knows the peer's
    /// address) and its handshake gave it a key; each proves the key.
    fn open_data_connections(&mut self, session: SessionId, n: usize) {
        let Some(addr) = self
            .io
            .get(&session)
            .filter(|io| !io.data.is_closing())
            .and_then(|io| io.peer_addr)
        else {
            return;
        };
        if let Some(key) = self.endpoint.data_key(session) {
            for _ in 0..n {
                let key = key.clone();
                self.host.start(Job::OpenData { session, addr, key });
            }
        }
    }

    /// Reports every parked operation of a session as transient (it was never written).
    fn unpark(&mut self, session: SessionId) {
        let parked = self
            .io
            .get_mut(&session)
            .map(SessionIo::take_parked)
            .unwrap_or_default();
        let now = Instant::now();
        for op in parked {
            self.endpoint
                .handle_transfer_result(now, op.id, TransferOutcome::Transient);
        }
    }

    /// Carries out a fence: the host closes the session's data connections, then
    /// [`Driver::released`] confirms it.
    fn start_fence(&mut self, session: SessionId) {
        self.unpark(session);
        if crate::cma::fence(self, session) {
            return;
        }
        self.fence_data_connections(session);
    }

    /// The fence of the session's RDMA queue pair or TCP data connections (after a same-host
    /// writer confirmed its own).
    pub(crate) fn fence_data_connections(&mut self, session: SessionId) {
        if plane::fence(self, session) {
            return;
        }
        match self.io.get_mut(&session) {
            Some(io) => {
                let conns = io.data.fence();
                self.host.start(Job::Release {
                    session,
                    conns,
                    tasks: None,
                    linger: None,
                    why: Release::Fence,
                });
            }
            None => self.endpoint.handle_fence_complete(Instant::now(), session),
        }
    }

    /// Carries out a close: the host stops every connection of the session, then
    /// [`Driver::released`] tells the core.
    fn start_close(&mut self, session: SessionId) {
        self.unpark(session);
        let Some(io) = self.io.get_mut(&session) else {
            return;
        };
        let Some(conns) = io.data.close() else {
            return; // already closing
        };
        let tasks = io.tasks.take();
        io.control = None;
        plane::close(io);
        let linger = self.linger_of(session);
        self.host.start(Job::Release {
            session,
            conns,
            tasks,
            linger,
            why: Release::Close,
        });
    }
}
