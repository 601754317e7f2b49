//! The driver's side of connections and sessions: control and data connections attached and
//! lost, dials, targets, rooms opened, data paths chosen, fences and closes carried out.

use super::*;

impl<H: Host> Driver<H> {
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
    pub(super) fn open_data_connections(&mut self, session: SessionId, n: usize) {
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
    pub(super) fn unpark(&mut self, session: SessionId) {
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
    pub(super) fn start_fence(&mut self, session: SessionId) {
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
    pub(super) fn start_close(&mut self, session: SessionId) {
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
