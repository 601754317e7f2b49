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

mod connections;
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
    /// What the driver task waits on between turns ([`Driver::wakeup`]).
    wakeup: std::sync::Arc<tokio::sync::Notify>,
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
            wakeup: std::sync::Arc::new(tokio::sync::Notify::new()),
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

    /// What the driver task ([`crate::runtime::run_driver`]) waits on between turns: notified
    /// when a drain ran out of budget or moved the core's next deadline earlier than the
    /// task's timer, and by a runtime that stops the node.
    pub fn wakeup(&self) -> std::sync::Arc<tokio::sync::Notify> {
        self.wakeup.clone()
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
            self.wakeup.notify_one();
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
                match crate::cma::post(self, op) {
                    crate::cma::Posted::Done => {}
                    crate::cma::Posted::OverTcp(op) => self.dispatch(now, op),
                    crate::cma::Posted::Elsewhere(op) => {
                        if let Some(op) = plane::post(self, op) {
                            self.dispatch(now, op);
                        }
                    }
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
}
