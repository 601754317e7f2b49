//! Multi-rank consensus: a pure rule that never panics on skew, applied exactly once.

use kvferry_core::consensus::{combine, ConsensusLog, Decision};
use kvferry_core::{FailureReason as R, KvPoll, RoomId};
use proptest::prelude::*;

#[test]
fn failed_dominates_and_otherwise_the_least_advanced_state_wins() {
    use KvPoll::*;
    assert_eq!(combine(&[Success, Transferring, Success]), Transferring);
    assert_eq!(
        combine(&[Bootstrapping, Failed(R::BootstrapTimeout)]),
        Failed(R::BootstrapTimeout)
    );
    assert_eq!(
        combine(&[Failed(R::DecodeSaturated), Failed(R::BootstrapTimeout)]),
        Failed(R::DecodeSaturated)
    );
    assert_eq!(combine(&[]), Bootstrapping);
}

#[test]
fn decisions_apply_in_order_exactly_once_whatever_the_arrival() {
    let mut leader = ConsensusLog::new(16);
    let d: Vec<Decision> = (1..=3)
        .map(|r| {
            leader
                .decide(RoomId(r), &[KvPoll::Failed(R::AbortedLocally)])
                .unwrap()
        })
        .collect();
    let mut follower = ConsensusLog::new(16);
    assert!(follower.apply(d[2]).is_empty(), "waits for the gap");
    assert!(follower.apply(d[1]).is_empty());
    let applied = follower.apply(d[0]);
    assert_eq!(applied, vec![d[0], d[1], d[2]]);
    assert!(follower.apply(d[1]).is_empty(), "duplicate");
    assert_eq!(follower.applied_up_to(), 3);
}

#[test]
fn a_non_terminal_combination_is_not_decided() {
    let mut leader = ConsensusLog::new(16);
    assert!(leader
        .decide(RoomId(1), &[KvPoll::Bootstrapping, KvPoll::WaitingForInput])
        .is_none());
}

fn poll() -> impl Strategy<Value = KvPoll> {
    prop_oneof![
        Just(KvPoll::Bootstrapping),
        Just(KvPoll::WaitingForInput),
        Just(KvPoll::Transferring),
        Just(KvPoll::Success),
        (0usize..12).prop_map(|i| KvPoll::Failed(R::ALL[i])),
    ]
}

proptest! {
    #[test]
    fn combine_is_total_and_never_more_advanced_than_any_rank(polls in proptest::collection::vec(poll(), 0..8)) {
        let c = combine(&polls);
        for p in &polls {
            prop_assert!(c.order() <= p.order());
        }
        if polls.iter().any(|p| matches!(p, KvPoll::Failed(_))) {
            prop_assert!(matches!(c, KvPoll::Failed(_)));
        }
    }

    #[test]
    fn every_rank_applies_the_same_sequence(order in Just((0u64..20).collect::<Vec<_>>()).prop_shuffle(), dup in 0usize..20) {
        let mut leader = ConsensusLog::new(64);
        let ds: Vec<Decision> = (0..20).map(|r| leader.decide(RoomId(r), &[KvPoll::Success]).unwrap()).collect();
        let mut rank = ConsensusLog::new(64);
        let mut applied = Vec::new();
        for i in order {
            applied.extend(rank.apply(ds[i as usize]));
            applied.extend(rank.apply(ds[dup]));
        }
        prop_assert_eq!(applied, ds);
    }
}

#[test]
fn transitions_out_of_terminal_states_are_error_values() {
    assert!(KvPoll::Success
        .transition(KvPoll::Failed(R::AbortedLocally))
        .is_err());
    assert!(KvPoll::Failed(R::AbortedLocally)
        .transition(KvPoll::Success)
        .is_err());
    assert!(KvPoll::Transferring
        .transition(KvPoll::Bootstrapping)
        .is_err());
    assert!(KvPoll::Bootstrapping
        .transition(KvPoll::Failed(R::BootstrapTimeout))
        .is_ok());
    assert_eq!(R::from_code(R::Shutdown.code()), Some(R::Shutdown));
    assert_eq!(R::from_code(0), None);
}

#[test]
fn every_failure_reason_explains_itself_distinctly() {
    let mut seen = std::collections::HashSet::new();
    for r in R::ALL {
        assert!(r.explain().len() > 20, "{r}");
        assert!(seen.insert(r.explain()), "{r} shares its explanation");
        assert_eq!(R::from_code(r.code()), Some(r));
    }
}
