//! A kept peer's connection attempt: the one asked of the driver, whether the driver was told
//! to give it up, and the last one its deadline ended.
//!
//! Invariants of [`Attempt`]: a target has at most one attempt pending; only a pending
//! attempt can be being abandoned; an attempt ends once (by its outcome or, after being
//! abandoned, by its deadline, which counts it as no answer); what the driver reports later
//! of an attempt given up is evidence, never counted as an attempt again.

use crate::ids::DialId;

/// A target's connection attempts.
#[derive(Debug, Default)]
pub(super) struct Attempt {
    /// The connection attempt asked of the driver and not yet ended: by its outcome
    /// ([`super::Endpoint::open_session_for`], [`super::Endpoint::handle_connect_failed`]) or
    /// by its deadline, which counts as no answer.
    pending: Option<DialId>,
    /// The driver was told to give `pending` up ([`crate::api::Action::AbandonDial`]) and has
    /// one more `connect_timeout` to say what it found before the core counts it as no answer.
    abandoning: bool,
    /// The last attempt its deadline ended: what the driver reports of it later is still
    /// evidence of the peer (a refusal that came late on a busy machine).
    given_up: Option<DialId>,
}

impl Attempt {
    /// The attempt pending, if any.
    pub(super) fn pending(&self) -> Option<DialId> {
        self.pending
    }

    /// Whether `dial` is this target's pending attempt.
    pub(super) fn is(&self, dial: DialId) -> bool {
        self.pending == Some(dial)
    }

    /// `dial` is the attempt now; the one it supersedes, if any, is returned to be settled.
    pub(super) fn start(&mut self, dial: DialId) -> Option<DialId> {
        self.abandoning = false;
        self.pending.replace(dial)
    }

    /// The pending attempt ended (connected or failed): it is returned to be settled.
    pub(super) fn end(&mut self) -> Option<DialId> {
        self.abandoning = false;
        self.pending.take()
    }

    /// Whether `dial` is pending and the driver was told to give it up.
    pub(super) fn abandoning(&self, dial: DialId) -> bool {
        self.is(dial) && self.abandoning
    }

    /// The pending attempt's deadline passed: true the first time (the driver is told to
    /// give it up), false once it was (it never reported: counted as no answer now, and
    /// remembered as given up).
    pub(super) fn abandon(&mut self) -> bool {
        if !self.abandoning {
            self.abandoning = true;
            return true;
        }
        self.given_up = self.pending;
        false
    }

    /// Whether `dial` is the attempt its deadline ended (once: the report is taken).
    pub(super) fn late_report(&mut self, dial: DialId) -> bool {
        if self.given_up != Some(dial) {
            return false;
        }
        self.given_up = None;
        true
    }
}

#[cfg(test)]
mod tests {
    use super::Attempt;
    use crate::ids::DialId;

    #[test]
    fn a_new_attempt_supersedes_the_pending_one_and_clears_its_abandoning() {
        let mut a = Attempt::default();
        assert_eq!(a.start(DialId(1)), None);
        assert!(a.abandon());
        assert!(a.abandoning(DialId(1)));
        assert_eq!(a.start(DialId(2)), Some(DialId(1)));
        assert!(!a.abandoning(DialId(2)));
        assert!(a.is(DialId(2)) && !a.is(DialId(1)));
    }

    #[test]
    fn an_attempt_that_never_reports_is_given_up_and_its_late_report_taken_once() {
        let mut a = Attempt::default();
        a.start(DialId(3));
        assert!(
            a.abandon(),
            "first deadline: the driver is told to give it up"
        );
        assert!(!a.abandon(), "second deadline: counted as no answer");
        assert_eq!(a.end(), Some(DialId(3)));
        assert!(a.pending().is_none());
        assert!(a.late_report(DialId(3)));
        assert!(!a.late_report(DialId(3)));
    }
}
