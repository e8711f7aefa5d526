//! What a peer's observation teaches equals what the same observation teaches the replica
//! that made it; a malformed one changes nothing.

use super::*;
use crate::gateway::config::WorkerSpec;
use crate::gateway::peer_wire::Message;
use kvroute_index::Index;
use std::sync::Arc;

fn registry() -> (Registry, Arc<Worker>) {
    let r = Registry::new(Arc::new(Index::new()));
    let w = r
        .add(WorkerSpec::new("w0", "http://127.0.0.1:1", "m"))
        .expect("valid spec");
    (r, w)
}

fn turns() -> (Vec<u32>, Vec<u32>, Vec<u32>) {
    let first: Vec<u32> = (0..70).collect();
    let mut second = first.clone();
    second.extend(500..540);
    let mut third = second.clone();
    third.extend(900..910);
    (first, second, third)
}

#[test]
fn a_peers_placements_teach_this_replica_what_they_taught_the_peer() {
    let (home, hw) = registry();
    let (peer, _) = registry();
    let t0 = Instant::now();
    let (first, second, third) = turns();
    for (i, tokens) in [&first, &second].into_iter().enumerate() {
        let now = t0 + Duration::from_millis(400 * i as u64);
        let (gap, mark) = home.follow_ups.observe_marked(tokens, now);
        let p = Placed {
            worker: "w0".into(),
            prompt: mark,
            gap_ms: gap.map(|g| g.as_secs_f64() * 1000.0),
            moved: false,
            own_prefill_ms: 12.5,
            load_waits: Some((3.0, 1.0)),
        };
        placed(&home, &hw, &p, now);
        let m = Message::Learned(Learned::Placed(p));
        let wire = serde_json::to_string(&m).expect("serializes");
        let Ok(Message::Learned(l)) = serde_json::from_str::<Message>(&wire) else {
            panic!("the message reads back: {wire}");
        };
        from_peer(&peer, l, now).expect("applied");
    }
    // The second turn was seen as a follow-up at home, and counted so at the peer.
    assert_eq!(home.follow_ups.counts(), (2, 1));
    assert_eq!(peer.follow_ups.counts(), (2, 1));
    // The peer recognises the conversation's next turn without having seen a token of it.
    assert!(peer.follow_ups.extends_earlier(&third));
    assert!(!peer.follow_ups.extends_earlier(&[7; 40]));
    assert_eq!(home.turns.cycle(), peer.turns.cycle());
    assert_eq!(home.least_loaded.share(), peer.least_loaded.share());
    let at = t0 + Duration::from_millis(500);
    let pw = peer.get("w0").expect("worker");
    assert_eq!(
        hw.learners.lock().readings(at, &Default::default()),
        pw.learners.lock().readings(at, &Default::default())
    );
}

#[test]
fn a_peers_timings_and_answers_teach_the_same_models() {
    let (home, hw) = registry();
    let (peer, pw) = registry();
    for i in 0..40u64 {
        let work = Work::new(100 * (i % 5), 64 * (i % 3), 200 + 10 * i, i % 4);
        let ms = 20.0 + 0.3 * i as f64;
        ttft(&home, &hw, &work, ms);
        let l = Learned::Ttft {
            worker: "w0".into(),
            work,
            ms,
        };
        from_peer(&peer, l, Instant::now()).expect("applied");
        let decode = Some(DecodeSample {
            prefill: (i % 7) as f64,
            running: (i % 3) as f64,
            itl_ms: 8.0 + (i % 5) as f64,
        });
        answered(&home, &hw, 50 + i, decode);
        let l = Learned::Answered {
            worker: "w0".into(),
            tokens: 50 + i,
            decode,
        };
        from_peer(&peer, l, Instant::now()).expect("applied");
    }
    assert_eq!(home.fleet_ttft.fit(), peer.fleet_ttft.fit());
    assert_eq!(hw.learners.lock().ttft.fit(), pw.learners.lock().ttft.fit());
    assert_eq!(home.output_tokens.mean(), peer.output_tokens.mean());
    assert_eq!(
        home.fleet_decode.lent_delta(),
        peer.fleet_decode.lent_delta()
    );
    assert_eq!(
        hw.learners.lock().decode.mean_running(),
        pw.learners.lock().decode.mean_running()
    );
}

#[test]
fn a_malformed_or_misaddressed_observation_is_refused_and_changes_nothing() {
    let (peer, pw) = registry();
    let bad = [
        Learned::Ttft {
            worker: "w0".into(),
            work: Work::new(0, 0, 100, 0),
            ms: f64::NAN,
        },
        Learned::Answered {
            worker: "w0".into(),
            tokens: 1 << 40,
            decode: None,
        },
        Learned::Placed(Placed {
            worker: "w0".into(),
            prompt: None,
            gap_ms: Some(-5.0),
            moved: false,
            own_prefill_ms: 1.0,
            load_waits: None,
        }),
    ];
    for l in bad {
        assert_eq!(from_peer(&peer, l, Instant::now()), Err("malformed"));
    }
    let elsewhere = [
        Learned::Ttft {
            worker: "nobody".into(),
            work: Work::new(0, 0, 100, 0),
            ms: 10.0,
        },
        Learned::Placed(Placed {
            worker: "nobody".into(),
            prompt: None,
            gap_ms: Some(5.0),
            moved: false,
            own_prefill_ms: 1.0,
            load_waits: Some((1.0, 1.0)),
        }),
    ];
    for l in elsewhere {
        assert_eq!(from_peer(&peer, l, Instant::now()), Err("unknown_worker"));
    }
    assert_eq!(peer.turns.cycle(), registry().0.turns.cycle());
    assert_eq!(peer.follow_ups.counts(), (0, 0));
    assert_eq!(peer.output_tokens.mean(), None);
    let (fresh, fw) = registry();
    assert_eq!(pw.learners.lock().ttft.fit(), fw.learners.lock().ttft.fit());
    assert_eq!(peer.fleet_ttft.fit(), fresh.fleet_ttft.fit());
}
