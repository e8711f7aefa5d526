//! Engine behaviours the corpora do not isolate: duplicates, preemption, window blocks freed
//! but still cached, the Mamba chunk split, the time model's effect on TTFT (a reused prefix,
//! an arrival mid-step, a later prompt sharing an earlier one's last prefill step), and the
//! slots speculative decoding allocates (the drafter's lookahead, a padded admission).

use kvroute_index::Event;
use kvroute_sim::{Engine, EngineConfig, NewRequest};

fn req(prompt: Vec<u32>, max_tokens: usize) -> NewRequest {
    NewRequest {
        id: String::new(),
        prompt,
        max_tokens,
        ..NewRequest::default()
    }
}

fn run_all(e: &mut Engine) -> (Vec<Event>, Vec<kvroute_sim::TokenOut>) {
    let (mut events, mut tokens) = (Vec::new(), Vec::new());
    for _ in 0..100_000 {
        if !e.has_work() {
            break;
        }
        let out = e.step();
        events.extend(out.events);
        tokens.extend(out.tokens);
    }
    (events, tokens)
}

#[test]
fn a_request_that_recomputes_a_cached_block_stores_it_again_and_each_copy_is_evicted_separately() {
    let mut cfg = EngineConfig::for_preset("llama").unwrap();
    cfg.num_blocks = 40;
    let mut e = Engine::new(cfg).unwrap();
    let p: Vec<u32> = (0..160).collect();
    e.add_request(req(p.clone(), 1)).unwrap();
    e.add_request(req(p.clone(), 1)).unwrap();
    let (events, _) = run_all(&mut e);
    let stores: Vec<usize> = events
        .iter()
        .filter_map(|ev| match ev {
            Event::Stored(s) => Some(s.hashes.len()),
            _ => None,
        })
        .collect();
    // The second request reuses 144 tokens (at most n − 1 = 159, in whole blocks) and
    // recomputes the last block: its hash is stored a second time.
    assert_eq!(stores, vec![10, 1]);
    let copies: Vec<u32> = e.kv.contents()[&0].values().copied().collect();
    assert_eq!(copies.iter().filter(|n| **n == 2).count(), 1);
    // Fresh prompts now need the pool: every copy leaves with its own removal.
    for k in 1..4u32 {
        e.add_request(req((0..160).map(|i| i + 1000 * k).collect(), 1))
            .unwrap();
        run_all(&mut e);
    }
    assert!(e
        .kv
        .contents()
        .get(&0)
        .is_some_and(|g| g.values().all(|n| *n <= 2)));
}

#[test]
fn a_full_pool_preempts_the_last_running_request_which_still_finishes() {
    let mut cfg = EngineConfig::for_preset("llama").unwrap();
    cfg.num_blocks = 12;
    cfg.max_num_seqs = 4;
    let mut e = Engine::new(cfg).unwrap();
    let mut handles = Vec::new();
    for k in 0..3u32 {
        handles.push(
            e.add_request(req((0..60).map(|i| i + 100 * k).collect(), 60))
                .unwrap(),
        );
    }
    let (_, tokens) = run_all(&mut e);
    assert!(e.stats.preemptions > 0);
    for h in handles {
        let mine: Vec<_> = tokens.iter().filter(|t| t.handle == h).collect();
        assert_eq!(mine.len(), 60);
        assert!(mine.last().is_some_and(|t| t.finished.is_some()));
    }
}

#[test]
fn window_blocks_leaving_the_window_are_freed_but_stay_cached_until_evicted() {
    let mut cfg = EngineConfig::for_preset("tiny-gemma3").unwrap();
    cfg.retention = None; // dense: every window block is stored
    let mut e = Engine::new(cfg).unwrap();
    let p: Vec<u32> = (0..300).collect();
    let h = e.add_request(req(p, 40)).unwrap();
    e.step(); // prefill
    let free_after_prefill = e.kv.num_free_blocks();
    e.step(); // the first decode step frees what left the window
    let held = e.kv.held_blocks(h);
    // Full attention holds every block; a window of 64 only the last three.
    assert_eq!(held, vec![3, 3, 3, 10]);
    assert_eq!(e.kv.num_free_blocks(), free_after_prefill + 3 * 7);
    // Freed, but still cached: all nine full blocks of each window group.
    assert_eq!(e.kv.contents()[&0].len(), 9);
}

#[test]
fn a_gdn_prefill_is_cut_at_the_last_cacheable_boundary_and_a_mamba2_one_is_not() {
    for (preset, steps_with_prefill) in [("tiny-qwen3-next", 2), ("tiny-nemotron-h", 1)] {
        let mut cfg = EngineConfig::for_preset(preset).unwrap();
        cfg.max_num_batched_tokens = 2048;
        let mut e = Engine::new(cfg).unwrap();
        e.add_request(req((0..200).collect(), 1)).unwrap();
        let mut prefill_steps = 0;
        while e.has_work() {
            let out = e.step();
            if out.scheduled_tokens > 1 || out.tokens.is_empty() {
                prefill_steps += 1;
            }
        }
        assert_eq!(prefill_steps, steps_with_prefill, "{preset}");
    }
}

#[test]
fn a_reused_prefix_shortens_the_simulated_time_to_first_token() {
    let mut e = Engine::new(EngineConfig::for_preset("llama").unwrap()).unwrap();
    let p: Vec<u32> = (0..4000).map(|i| i % 5000).collect();
    let ttft = |e: &mut Engine| {
        e.add_request(req(p.clone(), 2)).unwrap();
        let (_, t) = run_all(e);
        t.iter()
            .find_map(|t| t.finished.as_ref().map(|f| f.ttft_s))
            .unwrap()
    };
    let cold = ttft(&mut e);
    let warm = ttft(&mut e);
    assert!(warm < cold / 5.0, "cold {cold} warm {warm}");
}

/// Steps until idle, moving the clock to the next pulled KV's arrival when nothing can run.
fn run_with_pulls(e: &mut Engine) -> Vec<kvroute_sim::TokenOut> {
    let mut tokens = Vec::new();
    for _ in 0..100_000 {
        if !e.has_work() {
            break;
        }
        let out = e.step();
        if out.scheduled_tokens == 0 {
            let next = e.next_ready_at().expect("a request waits for its pull");
            e.advance_to(next);
        }
        tokens.extend(out.tokens);
    }
    tokens
}

#[test]
fn a_decode_request_pulls_its_prompt_computes_only_the_last_token_and_reports_the_prefills_hit() {
    for preset in ["llama", "qwen3-next"] {
        let cfg = EngineConfig::for_preset(preset).unwrap();
        let per_token = cfg.time.kv_transfer_token_s;
        let p: Vec<u32> = (0..3000).map(|i| i % 1000 + 3).collect();
        let mut local = Engine::new(cfg.clone()).unwrap();
        local.add_request(req(p.clone(), 2)).unwrap();
        let computed = run_with_pulls(&mut local);
        let mut decode = Engine::new(cfg).unwrap();
        let mut r = req(p.clone(), 2);
        r.remote_kv = Some(kvroute_sim::RemoteKv { cached_tokens: 123 });
        decode.add_request(r).unwrap();
        let pulled = run_with_pulls(&mut decode);
        let done = |t: &[kvroute_sim::TokenOut]| {
            t.iter()
                .find_map(|t| t.finished.clone().map(|f| (f, t.num_cached_tokens)))
                .unwrap()
        };
        let ((fc, cached_c), (fp, cached_p)) = (done(&computed), done(&pulled));
        assert_eq!((cached_c, cached_p), (0, 123), "{preset}");
        assert_eq!(fp.completion_tokens, 2);
        // The pull of 2,999 tokens, then one token's step: far less than the prefill.
        assert!(fp.ttft_s >= 2999.0 * per_token, "{preset}: {}", fp.ttft_s);
        assert!(
            fp.ttft_s < fc.ttft_s / 4.0,
            "{preset}: {} vs {}",
            fp.ttft_s,
            fc.ttft_s
        );
        if preset == "llama" {
            // The pulled blocks are cached: the same prefix hits on the decode worker now.
            let mut next = p.clone();
            next.extend([7, 8, 9]);
            assert_eq!(decode.peek_hit(&next, None, None), 2992);
        }
    }
}

#[test]
fn a_request_arriving_during_a_step_counts_its_ttft_from_its_arrival_not_the_steps_end() {
    let mut e = Engine::new(EngineConfig::for_preset("llama").unwrap()).unwrap();
    e.add_request(req((0..2000).collect(), 1)).unwrap();
    // The first step prefills all 2,000 tokens (the budget is 2,048) and finishes the request;
    // the clock now reads that step's end.
    let first = e.step();
    assert!(first.duration_s > 0.0);
    let step_end = e.now();
    // A second request arrives halfway through that step and a third at its end.
    let mid = step_end - first.duration_s / 2.0;
    e.add_request_at(req((5000..5100).collect(), 1), mid)
        .unwrap();
    e.add_request(req((6000..6100).collect(), 1)).unwrap();
    let out = e.step();
    let ttfts: Vec<f64> = first
        .tokens
        .iter()
        .chain(&out.tokens)
        .filter_map(|t| t.finished.as_ref().map(|f| f.ttft_s))
        .collect();
    assert_eq!(ttfts.len(), 3, "one step prefills both short prompts");
    // Both short prompts finish at the second step's end; the one that arrived mid-step
    // waited half of the first step longer.
    let (waited, fresh) = (ttfts[1], ttfts[2]);
    assert!(
        (waited - fresh - first.duration_s / 2.0).abs() < 1e-9,
        "{ttfts:?}"
    );
    assert!((fresh - out.duration_s).abs() < 1e-9, "{ttfts:?}");
    // An arrival stamped after the clock reads as now.
    e.add_request_at(req((7000..7100).collect(), 1), e.now() + 5.0)
        .unwrap();
    let later = e.step();
    let f = later.tokens[0].finished.as_ref().unwrap();
    assert!((f.ttft_s - later.duration_s).abs() < 1e-9);
}

/// The first request's TTFT on a fresh `preset` engine: a `len`-token prompt alone, and the
/// same with a second `len`-token prompt (sharing nothing) arriving after its first step.
fn first_ttft_alone_and_followed(preset: &str, len: u32) -> (f64, f64) {
    let run = |follow: bool| {
        let mut e = Engine::new(EngineConfig::for_preset(preset).unwrap()).unwrap();
        let first = e.add_request(req((0..len).collect(), 1)).unwrap();
        let mut tokens = e.step().tokens;
        if follow {
            e.add_request(req((50_000..50_000 + len).collect(), 1))
                .unwrap();
        }
        tokens.extend(run_all(&mut e).1);
        tokens
            .iter()
            .find(|t| t.handle == first)
            .and_then(|t| t.finished.as_ref())
            .map(|f| f.ttft_s)
            .unwrap()
    };
    (run(false), run(true))
}

#[test]
fn a_later_prompt_shares_an_earlier_prompts_last_prefill_step_which_gdn_splits_off() {
    // Qwen3-Next (GDN, align mode, 544-token blocks): a 600-token prompt computes 544 tokens,
    // to the last boundary whose state it caches, then its last 56 in a step of their own; a
    // prompt that arrived meanwhile is scheduled into that step, 544 tokens of it.
    let (alone, followed) = first_ttft_alone_and_followed("qwen3-next", 600);
    let chunk = 544.0 * 60e-6;
    assert!(
        followed - alone > 0.9 * chunk,
        "alone {alone} followed {followed}"
    );
    // Full attention computes the same prompt in one step: what arrives later waits.
    let (alone, followed) = first_ttft_alone_and_followed("llama", 600);
    assert_eq!(alone, followed);
    // A prompt longer than a step's budget (2,048 tokens) ends in a step with room to spare,
    // which a later prompt fills, on full attention as well.
    let (alone, followed) = first_ttft_alone_and_followed("llama", 3000);
    assert!(
        followed - alone > 0.9 * 1096.0 * 60e-6,
        "alone {alone} followed {followed}"
    );
}

fn eagle(engine: kvroute_index::Engine) -> Engine {
    let mut cfg = EngineConfig::for_preset("llama").unwrap();
    cfg.engine = engine;
    cfg.speculative = Some(kvroute_index::Speculative {
        method: "eagle".into(),
        num_speculative_tokens: 2,
        num_nextn_predict_layers: None,
        disable_lookahead_block_hashes: false,
        disable_eagle_block_drop: false,
    });
    Engine::new(cfg).unwrap()
}

#[test]
fn an_eagle_request_holds_the_drafter_s_lookahead_slots_past_its_scheduled_tokens() {
    let mut e = eagle(kvroute_index::Engine::Vllm032);
    let h = e.add_request(req((0..16).collect(), 3)).unwrap();
    // One block of prompt, and two slots for the drafter's KV past it: a second block.
    assert_eq!(e.step().scheduled_tokens, 16);
    assert_eq!(e.kv.held_blocks(h), vec![2]);
    // Decoding token 17 needs slots up to 19: still two blocks.
    assert_eq!(e.step().scheduled_tokens, 1);
    assert_eq!(e.kv.held_blocks(h), vec![2]);
}

#[test]
fn a_speculative_admission_with_one_token_left_is_padded_to_a_decode_step_s_rows() {
    let mut e = eagle(kvroute_index::Engine::Vllm033);
    let prompt: Vec<u32> = (0..17).collect();
    e.add_request(req(prompt.clone(), 1)).unwrap();
    run_all(&mut e);
    // The repeat hits 16 of its 17 tokens: its one token is scheduled as 1 + k rows, whose
    // slots and the drafter's 2 past them take a second block; only the real token counts.
    let h = e.add_request(req(prompt, 2)).unwrap();
    let out = e.step();
    assert_eq!(out.scheduled_tokens, 3);
    assert_eq!(out.tokens.len(), 1);
    assert_eq!(out.tokens[0].num_cached_tokens, 16);
    assert_eq!(e.kv.held_blocks(h), vec![2]);
    assert_eq!(e.step().scheduled_tokens, 1);
}
