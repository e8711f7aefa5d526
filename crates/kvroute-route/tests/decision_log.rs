//! The recorded decision log replays byte for byte: every line (one decision with everything
//! it was decided from, logged by the gateway with `KVROUTE_DECISION_LOG`) gives, through the
//! routing core now, the decision and the bookings it logged.
//!
//! `tests/data/decisions.jsonl` was recorded from the decision function as it was before the
//! routing core was its own crate (commit 9faa8be4, each figure read once per decision), in
//! front of simulated fleets, under four policies and three sets of weights; see
//! `tests/data/README.md`. `KVROUTE_REPLAY_LOG=FILE` replays another log instead.

use kvroute_route::log::Entry;

/// The log to replay, and whether it is the bundled one (which covers every policy).
fn log_text() -> (String, bool) {
    match std::env::var_os("KVROUTE_REPLAY_LOG") {
        Some(path) => (
            std::fs::read_to_string(&path)
                .unwrap_or_else(|e| panic!("replay log {path:?} could not be read: {e}")),
            false,
        ),
        None => (include_str!("data/decisions.jsonl").to_string(), true),
    }
}

#[test]
fn every_recorded_decision_replays_identically_through_the_core() {
    let (text, bundled) = log_text();
    let mut replayed = 0;
    let mut policies = std::collections::BTreeSet::new();
    for (i, line) in text.lines().enumerate() {
        let entry: Entry = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("line {}: not a decision log entry: {e}", i + 1));
        let (decision, bookings) = entry.replay();
        assert_eq!(
            decision,
            entry.decision,
            "line {}: the decision differs\nreplayed: {}\nrecorded: {}",
            i + 1,
            decision,
            entry.decision
        );
        assert_eq!(
            bookings,
            entry.bookings,
            "line {}: the bookings differ",
            i + 1
        );
        // The entry round-trips: written again, it reads as the recorded line (field for
        // field, floats bit for bit).
        let again: serde_json::Value =
            serde_json::from_str(&entry.line()).expect("a written entry parses");
        let recorded: serde_json::Value = serde_json::from_str(line).expect("parsed above");
        assert_eq!(again, recorded, "line {} does not round-trip", i + 1);
        policies.insert(entry.policy.name());
        replayed += 1;
    }
    assert!(replayed > 0, "the log is empty");
    if bundled {
        assert!(replayed >= 200, "only {replayed} decisions in the log");
        assert_eq!(policies.len(), 4, "the log covers {policies:?}");
    }
}
