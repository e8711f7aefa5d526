//! The simulated engine's event stream over real ZMQ sockets, decoded by kvroute-wire: live
//! batches, replay in both reply layouts, dropped batches, publisher restarts, DP ranks on
//! consecutive ports and the older array layout.

use crate::common;

use bytes::Bytes;
use common::post;
use common::subscriber::Subscriber;
use kvroute_index::{Event, Index, Query};
use kvroute_sim::{Fleet, FleetOptions, PublisherConfig, ReplayLayout, WireFormat, WorkerConfig};
use serde_json::json;
use std::time::Duration;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, ZmqMessage};

/// The seq rank 0's publisher gives its next batch.
async fn engine_next_seq(http: std::net::SocketAddr) -> u64 {
    common::get(http, "/admin/cache").await.json()["ranks"][0]["publisher"]["next_seq"]
        .as_u64()
        .unwrap()
}

fn decode(worker: &str, frames: &[Vec<u8>]) -> kvroute_wire::DecodedBatch {
    let refs: Vec<&[u8]> = frames.iter().map(Vec::as_slice).collect();
    kvroute_wire::decode_message(&worker.into(), &refs)
        .unwrap()
        .2
}

async fn fleet(preset: &str, opts: impl FnOnce(&mut FleetOptions)) -> Fleet {
    let mut cfg = WorkerConfig::for_preset(preset).unwrap();
    cfg.speedup = 1000.0;
    let mut o = FleetOptions::new(cfg, 1);
    opts(&mut o);
    Fleet::start(o).await.unwrap()
}

async fn complete(addr: std::net::SocketAddr, prompt: &[u32], salt: Option<&str>) -> u64 {
    let mut body = json!({"prompt": prompt, "max_tokens": 3});
    if let Some(s) = salt {
        body["cache_salt"] = json!(s);
    }
    let r = post(addr, "/v1/completions", &body).await.json();
    r["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap()
}

#[tokio::test]
async fn the_live_stream_lets_an_index_predict_every_reported_hit() {
    let f = fleet("tiny-gemma3", |_| {}).await;
    let w = &f.workers[0];
    let mut sub = Subscriber::join(&w.zmq[0], w.http, 0).await;
    let index = Index::new();
    let base: Vec<u32> = (0..150).map(|i| (i * 13 + 5) % 1000).collect();
    let mut prompts = vec![base.clone()];
    let mut b2 = base[..100].to_vec();
    b2.extend(500..560);
    prompts.push(b2);
    prompts.push(base.clone());
    let mut next_seq = None;
    for (i, p) in prompts.iter().enumerate() {
        let q = Query {
            tokens: p.clone(),
            ..Query::default()
        };
        let predicted = index.predict(&"w0".into(), 0, &q).cached;
        let cached = complete(w.http, p, None).await;
        assert_eq!(predicted, cached, "request {i}");
        let mut published = 0;
        for (seq, frames) in sub.batches().await {
            assert!(next_seq.is_none_or(|n| seq == n), "no gaps");
            next_seq = Some(seq + 1);
            published += 1;
            index.apply_all(&decode("w0", &frames).events);
        }
        if i == 0 {
            assert!(published >= 1, "the first request published");
        }
    }
    assert!(index.stats().block_copies > 0);
}

async fn replay(endpoint: &str, start: u64) -> Vec<Vec<Vec<u8>>> {
    let mut d = DealerSocket::new();
    d.connect(endpoint).await.unwrap();
    let req = kvroute_wire::replay_request(start);
    let msg = ZmqMessage::try_from(req.into_iter().map(Bytes::from).collect::<Vec<_>>()).unwrap();
    d.send(msg).await.unwrap();
    let mut out = Vec::new();
    loop {
        let m = tokio::time::timeout(Duration::from_secs(5), d.recv())
            .await
            .expect("replay reply")
            .unwrap();
        let frames: Vec<Vec<u8>> = m.into_vec().iter().map(|f| f.to_vec()).collect();
        let refs: Vec<&[u8]> = frames.iter().map(Vec::as_slice).collect();
        if kvroute_wire::parse_replay_reply(&refs).unwrap() == kvroute_wire::ReplayReply::End {
            return out;
        }
        out.push(frames);
    }
}

#[tokio::test]
async fn replay_returns_buffered_batches_then_the_end_marker_in_both_layouts() {
    for layout in [ReplayLayout::WithTopic, ReplayLayout::Old] {
        let f = fleet("tiny-gemma3", |o| {
            o.replay_layout = layout;
            o.topic = "kv".into();
        })
        .await;
        let w = &f.workers[0];
        for k in 0..3u32 {
            let p: Vec<u32> = (0..70).map(|i| (i * 3 + k * 101) % 1000).collect();
            complete(w.http, &p, None).await;
        }
        // Every batch is buffered once the engine counted it (the replay reads the buffer).
        let queued = engine_next_seq(w.http).await;
        let all = common::wait_for(common::WAIT, "every batch in the replay buffer", || async {
            let all = replay(&w.replay[0], 0).await;
            if all.len() as u64 == queued {
                Ok(all)
            } else {
                Err(format!("{} of {queued}", all.len()))
            }
        })
        .await;
        assert!(all.len() >= 3, "{layout:?}: {} batches", all.len());
        let from1 = replay(&w.replay[0], 1).await;
        assert_eq!(from1.len(), all.len() - 1);
        for frames in &all {
            let expected = if layout == ReplayLayout::WithTopic {
                4
            } else {
                3
            };
            assert_eq!(frames.len(), expected, "{layout:?}");
            if layout == ReplayLayout::WithTopic {
                assert_eq!(frames[1], b"kv");
            }
        }
    }
}

#[tokio::test]
async fn dropped_batches_leave_a_seq_gap_that_replay_fills() {
    let f = fleet("tiny-gemma3", |_| {}).await;
    let w = &f.workers[0];
    let mut sub = Subscriber::join(&w.zmq[0], w.http, 0).await;
    // The probes that saw the subscription join took the first seqs.
    let first = engine_next_seq(w.http).await;
    complete(w.http, &(0..40).collect::<Vec<u32>>(), None).await;
    post(w.http, "/admin/faults", &json!({"drop_batches": 2})).await;
    for k in 1..4u32 {
        let p: Vec<u32> = (0..40).map(|i| i + 200 * k).collect();
        complete(w.http, &p, None).await;
    }
    let seen: Vec<u64> = sub.batches().await.iter().map(|(s, _)| *s).collect();
    assert_eq!(seen, vec![first, first + 3]);
    let missing = replay(&w.replay[0], first + 1).await;
    let seqs: Vec<u64> = missing
        .iter()
        .map(|f| u64::from_be_bytes(f[2].as_slice().try_into().unwrap()))
        .collect();
    assert_eq!(seqs, vec![first + 1, first + 2, first + 3]);
}

#[tokio::test]
async fn a_publisher_restart_starts_the_seq_again_at_zero_keeping_or_clearing_the_cache() {
    let f = fleet("tiny-gemma3", |_| {}).await;
    let w = &f.workers[0];
    let mut sub = Subscriber::join(&w.zmq[0], w.http, 0).await;
    let first = engine_next_seq(w.http).await;
    let p: Vec<u32> = (0..100).collect();
    complete(w.http, &p, None).await;
    post(w.http, "/admin/restart", &json!({"clear_cache": false})).await;
    assert_eq!(complete(w.http, &p, None).await, 96);
    post(w.http, "/admin/restart", &json!({"clear_cache": true})).await;
    assert_eq!(complete(w.http, &p, None).await, 0);
    let seqs: Vec<u64> = sub.take(2).await.iter().map(|(s, _)| *s).collect();
    // The cached repeat stores nothing; after the second restart the store is seq 0 again.
    assert_eq!(seqs, vec![first, 0]);
    assert_eq!(
        engine_next_seq(w.http).await,
        1,
        "nothing published after it"
    );
}

#[tokio::test]
async fn dp_ranks_publish_on_consecutive_ports_and_stamp_their_rank() {
    // Two consecutive free ports: retry where another process holds port + 1.
    let mut started = None;
    for _ in 0..20 {
        let port = {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port()
        };
        let mut cfg = WorkerConfig::for_preset("tiny-gemma3").unwrap();
        cfg.speedup = 1000.0;
        cfg.data_parallel_size = 2;
        cfg.zmq = Some(PublisherConfig::new(&format!("tcp://*:{port}")));
        if let Ok(h) = kvroute_sim::start_worker("dp", cfg, ([127, 0, 0, 1], 0).into()).await {
            started = Some((port, h));
            break;
        }
    }
    let (port, h) = started.expect("two consecutive free ports");
    assert_eq!(h.zmq.len(), 2);
    let mut subs = Vec::new();
    for r in 0..2u16 {
        let endpoint = format!("tcp://127.0.0.1:{}", port + r);
        subs.push(Subscriber::join(&endpoint, h.http, r as usize).await);
    }
    for k in 0..4u32 {
        let p: Vec<u32> = (0..40).map(|i| i + 100 * k).collect();
        complete(h.http, &p, None).await;
    }
    for (r, sub) in subs.iter_mut().enumerate() {
        let mut stored = 0;
        for (_, frames) in sub.batches().await {
            let batch = decode("dp", &frames);
            assert_eq!(batch.dp_rank, Some(r as u32));
            stored += batch
                .events
                .iter()
                .filter(|e| matches!(e, Event::Stored(_)))
                .count();
        }
        assert!(stored > 0, "rank {r} published no store");
    }
}

#[tokio::test]
async fn the_older_array_layout_decodes_to_the_same_stores() {
    let f = fleet("llama", |o| o.format = WireFormat::LegacyArray).await;
    let w = &f.workers[0];
    let mut sub = Subscriber::join(&w.zmq[0], w.http, 0).await;
    complete(w.http, &(0..40).collect::<Vec<u32>>(), None).await;
    let got = sub.batches().await;
    let events = decode("w0", &got[0].1).events;
    assert!(matches!(&events[0], Event::Stored(s) if s.hashes.len() == 2 && s.group.is_none()));
}
