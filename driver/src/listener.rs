//! The driver's half of the listener's waits: it holds what ends each one, and the core
//! decides when ([`Action::DropAccepted`], [`Action::AbandonDial`], [`Action::StopDraining`],
//! [`Action::ResumeAccepting`], [`Action::StopLingering`]). No timer of the runtime is
//! involved.
//!
//! [`Action::DropAccepted`]: kvferry_core::Action::DropAccepted
//! [`Action::AbandonDial`]: kvferry_core::Action::AbandonDial
//! [`Action::StopDraining`]: kvferry_core::Action::StopDraining
//! [`Action::ResumeAccepting`]: kvferry_core::Action::ResumeAccepting
//! [`Action::StopLingering`]: kvferry_core::Action::StopLingering

use std::time::Instant;

use kvferry_core::{ConnId, DialId, DrainId, SessionId};
use tokio::sync::oneshot;

use crate::{Driver, Host};

/// Ends when the core says a wait is over, or when the node is gone (its sender dropped).
pub type CoreWait = oneshot::Receiver<()>;

/// The ends of one kind of wait the core decides, by what each belongs to.
pub(crate) struct Pending<K>(crate::machine::Map<K, oneshot::Sender<()>>);

impl<K> Default for Pending<K> {
    fn default() -> Self {
        Pending(Default::default())
    }
}

impl<K: std::hash::Hash + Eq> Pending<K> {
    /// Keeps the end of `key`'s wait; `over`: the wait ends at once instead (no core timer
    /// would end it).
    pub(crate) fn arm(&mut self, key: K, over: bool) -> CoreWait {
        let (end, wait) = oneshot::channel();
        if !over {
            self.0.insert(key, end);
        }
        wait
    }

    /// The core ended `key`'s wait.
    pub(crate) fn end(&mut self, key: &K) {
        if let Some(end) = self.0.remove(key) {
            let _ = end.send(());
        }
    }

    /// `key` settled first: its wait is not to end any more.
    pub(crate) fn forget(&mut self, key: &K) {
        self.0.remove(key);
    }

    fn end_all(&mut self) {
        for (_, end) in self.0.drain() {
            let _ = end.send(());
        }
    }
}

/// The ends of the waits the core decides, by what they belong to.
#[derive(Default)]
pub(crate) struct Ends {
    /// Accepted connections not yet a session's.
    pub(crate) accepted: Pending<ConnId>,
    /// Listeners paused after a failed accept.
    paused: Vec<oneshot::Sender<()>>,
    /// Connection attempts under way.
    pub(crate) dials: Pending<DialId>,
    /// Replaced data paths still draining.
    pub(crate) drains: Pending<DrainId>,
}

impl Ends {
    pub(crate) fn resume_accepting(&mut self) {
        for end in self.paused.drain(..) {
            let _ = end.send(());
        }
    }

    /// Ends every wait at once (the node shut down: no core timer fires any more).
    pub(crate) fn end_all(&mut self) {
        self.accepted.end_all();
        self.dials.end_all();
        self.drains.end_all();
        self.resume_accepting();
    }
}

impl<H: Host> Driver<H> {
    /// A connection the listener accepted: it must become a session's before the core's
    /// deadline, and the returned wait ends when the core drops it. Report it with
    /// [`Driver::accept_settled`] once it is a session's or gone.
    pub fn accepted(&mut self) -> (ConnId, CoreWait) {
        let conn = self.with(|e, now| e.handle_accepted(now));
        // A node shutting down takes no connection: the wait is over before it starts.
        let over = self.endpoint().may_connect().is_err();
        (conn, self.ends_mut().accepted.arm(conn, over))
    }

    /// An accepted connection became a session's, or ended: its deadline no longer applies.
    pub fn accept_settled(&mut self, conn: ConnId) {
        self.ends_mut().accepted.forget(&conn);
        self.with(|e, _| e.handle_accept_settled(conn));
    }

    /// A connection attempt starts: the returned wait ends when the core gives it up (its
    /// `connect_timeout`, [`kvferry_core::Action::AbandonDial`]). Report it with
    /// [`Driver::dial_settled`] once it connected or failed.
    pub fn dial_started(&mut self) -> (DialId, CoreWait) {
        let dial = self.with(|e, now| e.handle_dial_started(now));
        let over = self.endpoint().shutdown_complete();
        (dial, self.ends_mut().dials.arm(dial, over))
    }

    /// One of `session`'s data connections is dialed now
    /// ([`kvferry_core::Action::OpenDataConnection`]), within the deadline the core keeps for
    /// that session's data dials; otherwise as [`Driver::dial_started`].
    pub fn data_dial_started(&mut self, session: SessionId) -> (DialId, CoreWait) {
        let dial = self.with(|e, now| e.handle_data_dial_started(now, session));
        let over = self.endpoint().shutdown_complete();
        (dial, self.ends_mut().dials.arm(dial, over))
    }

    /// A target's attempt ([`kvferry_core::Action::Connect`]) begins now: its
    /// deadline counts from here, not from when the core asked.
    pub fn dial_began(&mut self, dial: DialId) {
        self.with(|e, now| e.handle_dial_began(now, dial));
    }

    /// A connection attempt connected or failed: its deadline no longer applies.
    pub fn dial_settled(&mut self, dial: DialId) {
        self.ends_mut().dials.forget(&dial);
        self.with(|e, _| e.handle_dial_settled(dial));
    }

    /// A replaced data path starts draining: the returned wait ends when the core says to
    /// stop collecting what it flushes (its `operation_timeout`,
    /// [`kvferry_core::Action::StopDraining`]). Report it with [`Driver::drain_settled`] once
    /// it is drained or gone.
    pub fn drain_started(&mut self) -> (DrainId, CoreWait) {
        let drain = self.with(|e, now| e.handle_drain_started(now));
        let over = self.endpoint().shutdown_complete();
        (drain, self.ends_mut().drains.arm(drain, over))
    }

    /// A replaced data path is drained or gone: its deadline no longer applies.
    pub fn drain_settled(&mut self, drain: DrainId) {
        self.ends_mut().drains.forget(&drain);
        self.with(|e, _| e.handle_drain_settled(drain));
    }

    /// The listener failed to accept: the returned wait ends when the core lets it accept
    /// again (its `accept_backoff`).
    pub fn accept_failed(&mut self) -> CoreWait {
        self.with(|e, now: Instant| e.handle_accept_failed(now));
        let (end, wait) = oneshot::channel();
        if !self.endpoint().shutdown_complete() {
            self.ends_mut().paused.push(end);
        }
        wait
    }

    /// The wait that ends a closing session's control writer: when the core's
    /// `close_linger` is over ([`kvferry_core::Action::StopLingering`]).
    pub(crate) fn linger_of(&mut self, session: SessionId) -> Option<CoreWait> {
        let (end, wait) = oneshot::channel();
        let lingering = self.endpoint().session_lingers(session);
        let io = self.session_io(session)?;
        if lingering {
            io.linger = Some(end);
        }
        // A close the core set no linger for (the session is gone from it, or the node shut
        // down) stops the writer at once.
        Some(wait)
    }
}
