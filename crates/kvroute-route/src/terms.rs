//! The cost terms: each one named function of a candidate's figures, with what it estimates,
//! its default and where the measurement behind that default is.
//!
//! Owns: every charge and credit the `ttft` cost adds to a candidate's predicted time to first
//! token; their sum, where the `[weights]` switches decide which count, is
//! [`crate::rank::cost_ms`].
//! Terms measured: `docs/routing.md` ("The policy") describes each model; the A/B runs behind
//! the defaults are in `docs/routing-analyses.md`, named per term below.
//! Invariants: every term is finite and non-negative (a figure that is not a finite number
//! counts as 0); a term that is switched off is still computed (it is reported as evidence)
//! unless computing it is the expensive part (`next_arrivals_ms`, `eviction_ms`: 0 when off).
//! Must not: read clocks, locks or the index: the figures come in the snapshot.

use crate::work::{Fit, Work};

/// The load time of the part of a hit a CPU tier serves (ms): `tier` tokens at
/// `cpu_load_us_per_token` µs each, part of the predicted TTFT. Default 5 µs a token (an
/// 8B-class model's KV over PCIe 4.0 ×16); docs/routing.md, "A CPU tier beside every worker".
pub fn tier_load_ms(tier: u64, cpu_load_us_per_token: f64) -> f64 {
    tier as f64 * cpu_load_us_per_token / 1000.0
}

/// The wait a worker's load adds to a request sent there now, and that load's own prediction:
/// the fit's TTFT for `work` with no prefill of its own (`busy`), less an idle worker's
/// (`(max(busy − idle, 0), busy)`). Always on: it is part of the predicted TTFT.
pub fn load_delay_ms(fit: &Fit, work: &Work) -> (f64, f64) {
    let loaded = Work {
        own_tokens: 0,
        pairs: 0.0,
        ..*work
    };
    let busy = fit.ttft_ms(&loaded);
    let idle = fit.ttft_ms(&Work::default());
    ((busy - idle).max(0.0), busy)
}

/// The junction tokens a hybrid-aware candidate is credited with: the full-attention prefix it
/// holds (`prefix`, counting prompts in flight on it) beyond both what it will serve (`cached`)
/// and what the best worker of the fleet serves (`fleet_best`; both also counting in-flight
/// prompts). Sent there, the request makes vLLM checkpoint that prefix
/// (`shared_prefix_boundary`), so later requests sharing it reuse it — worth something only
/// where no worker can serve it yet. A worker that merely lost state another worker still holds
/// earns nothing, so the one that can serve it wins. Priced at `weights.junction` (μ, default
/// 0: the A/B found it ahead on `tenants`, behind on `agentic`) times the worker's prefill
/// rate; docs/routing.md ("The policy", "The default-on cost terms, A/B").
pub fn junction_credit(prefix: u64, cached: u64, fleet_best: u64) -> u64 {
    prefix.saturating_sub(cached.max(fleet_best))
}

/// Delay to others (`weights.delay_to_others`, off by default: the A/B found it ahead on
/// `shared-prefix`, behind on `tenants`; docs/routing.md, "The default-on cost terms, A/B"):
/// the wait a request's own prefill (`own_ms`, milliseconds of the worker's time) adds to the
/// requests reaching its worker (`per_ms` requests per millisecond) before its first token, `ttft_ms` from now:
/// `own_ms × per_ms × ttft_ms`. An engine schedules waiting requests first come, first served,
/// so they all wait for it. A lower bound of the whole delay (it leaves out requests arriving
/// after the first token while the queue drains). docs/routing.md ("Delay to others").
pub fn delay_to_others_ms(own_ms: f64, per_ms: f64, ttft_ms: f64) -> f64 {
    finite(own_ms.max(0.0) * per_ms.max(0.0) * ttft_ms.max(0.0))
}

/// Next arrivals (`weights.next_arrivals`, off by default: it moves waiting from short prompts
/// to long ones without lowering the mean; docs/routing-analyses.md, "The next arrivals'
/// wait"): the wait a placement adds to the requests that reach the fleet (`per_ms` requests
/// per millisecond, all workers together) while its least-loaded worker drains, if each goes
/// where it waits least and brings no work of its own: `per_ms · (m'² − m²) / 2`, where `m` is
/// the smallest of `waits` (each worker's wait now, ms) and `m'` the smallest once worker `at`
/// has `own_ms` more. 0 where the placement leaves the smallest wait as it is. A wait that is
/// not a finite number counts as no worker.
pub fn next_arrivals_ms(waits: &[f64], at: usize, own_ms: f64, per_ms: f64) -> f64 {
    let own = if own_ms.is_finite() {
        own_ms.max(0.0)
    } else {
        0.0
    };
    let (mut before, mut after) = (f64::INFINITY, f64::INFINITY);
    for (i, w) in waits.iter().enumerate() {
        if !w.is_finite() {
            continue;
        }
        let w = w.max(0.0);
        before = before.min(w);
        after = after.min(if i == at { w + own } else { w });
    }
    let x = per_ms.max(0.0) * (after * after - before * before) / 2.0;
    if x.is_finite() {
        x.max(0.0)
    } else {
        0.0
    }
}

/// The utilisation past which the queueing model stops following `1 / (1 − ρ)` (a queue that
/// grows without bound): beyond it the wait grows along its tangent, finite and convex.
pub const RHO_MAX: f64 = 0.95;

/// The mean wait of a follow-up in a queue kept busy a fraction `rho` by follow-ups of `s`
/// ms each: `s · ρ / (2 · (1 − ρ))` (M/D/1), continued along its tangent past [`RHO_MAX`].
pub fn follow_up_wait_ms(rho: f64, s: f64) -> f64 {
    if !rho.is_finite() || !s.is_finite() || s <= 0.0 {
        return 0.0;
    }
    let r = rho.max(0.0);
    if r <= RHO_MAX {
        return s * r / (2.0 * (1.0 - r));
    }
    let at = s * RHO_MAX / (2.0 * (1.0 - RHO_MAX));
    let slope = s / (2.0 * (1.0 - RHO_MAX) * (1.0 - RHO_MAX));
    at + slope * (r - RHO_MAX)
}

/// What one more conversation on a worker with `live` conversations costs the later turns
/// there, its own and theirs, over `k` expected follow-ups (turn cycle `gap`, follow-up
/// prefill `s`, both ms): `k · (W(L·ρ₁) + L · (W(L·ρ₁) − W((L−1)·ρ₁)))`, and its own part.
pub fn conversation_cost_ms(live: f64, k: f64, gap: f64, s: f64) -> (f64, f64) {
    if !(k > 0.0 && gap > 0.0 && s > 0.0 && live.is_finite()) {
        return (0.0, 0.0);
    }
    let l = live.max(0.0);
    let rho1 = s / gap;
    let own = follow_up_wait_ms(l * rho1, s);
    let theirs = l * (own - follow_up_wait_ms((l - 1.0).max(0.0) * rho1, s));
    let cost = k * (own + theirs.max(0.0));
    if cost.is_finite() {
        (cost, k * own)
    } else {
        (0.0, 0.0)
    }
}

/// Upper bound on a conversation's expected follow-ups (`p` ≥ 0.94): beyond it the load a
/// worker shows now says nothing about what a conversation's distant turns will meet.
pub const MAX_FOLLOW_UPS: f64 = 16.0;

/// The further requests a conversation is expected to bring after this one, when a fraction
/// `p` of the fleet's requests are follow-ups: sessions whose length is geometric with
/// continuation probability `p` bring `p / (1 − p)` more, bounded by [`MAX_FOLLOW_UPS`] (0 for
/// a fraction that is not a positive number). The horizon of [`later_turns_ms`].
pub fn expected_follow_ups(p: f64) -> f64 {
    if !p.is_finite() || p <= 0.0 {
        return 0.0;
    }
    if p >= 1.0 {
        return MAX_FOLLOW_UPS;
    }
    (p / (1.0 - p)).min(MAX_FOLLOW_UPS)
}

/// A new conversation's expected remaining life (ms): its `k` expected follow-ups, one per
/// turn cycle `G` (`cycle`'s first figure), `k · G`; `None` with no follow-ups expected or no
/// cycle learned yet (nothing then lives, or fades, anywhere).
pub fn conversation_life_ms(k: f64, cycle: Option<(f64, f64)>) -> Option<f64> {
    cycle.filter(|_| k > 0.0).map(|(gap, _)| k * gap)
}

/// The conversations still living on a worker: `weight` of them added `age_ms` ago, each
/// fading with a conversation's expected remaining life `life_ms` (0 for a life that is not
/// positive and finite).
pub fn faded(weight: f64, age_ms: f64, life_ms: f64) -> f64 {
    if life_ms <= 0.0 || !life_ms.is_finite() {
        return 0.0;
    }
    weight * (-age_ms / life_ms).exp()
}

/// Later turns (`weights.later_turns`, on by default): a new conversation's `k` expected
/// follow-ups follow its cache to the worker chosen now, and each waits what the worker's load
/// has recently added (`load_wait_ms`) or, if larger, what the turns of the `live`
/// conversations living there make it wait; theirs wait for it in turn
/// ([`conversation_cost_ms`], with the fleet's turn cycle `(gap, s)`):
/// `k · max(load_wait, W(L·ρ₁)) + k · L · (W(L·ρ₁) − W((L−1)·ρ₁))`. 0 for a follow-up
/// (`k = 0`). docs/routing.md ("Later turns"; its default: "The default-on cost terms, A/B").
pub fn later_turns_ms(live: f64, k: f64, cycle: Option<(f64, f64)>, load_wait_ms: f64) -> f64 {
    let (conversation_ms, own_turns_ms) =
        cycle.map_or((0.0, 0.0), |(gap, s)| conversation_cost_ms(live, k, gap, s));
    conversation_ms - own_turns_ms + (k * load_wait_ms).max(own_turns_ms)
}

/// What a request is expected to generate: the fleet's mean answer, capped by the request's
/// own `max_tokens`; its `max_tokens` before any answer was seen; else 0.
pub fn expected_output(mean: Option<f64>, max_tokens: Option<u64>) -> f64 {
    match (mean, max_tokens) {
        (Some(m), Some(cap)) => m.min(cap as f64),
        (Some(m), None) => m,
        (None, Some(cap)) => cap as f64,
        (None, None) => 0.0,
    }
}

/// Decode interference (`weights.decode_interference`, off by default): the end-to-end latency
/// a request decoding `output_tokens` (`O`) adds where `running` (`R`) others run, each
/// lengthening a token by `delta_ms` (`δ`) and each with a remaining answer spread evenly up to
/// `mean_output` (`Ō`) tokens: `2·δ·R·(O − O²/(2·Ō))` for `O ≤ Ō`, `δ·R·Ō` beyond.
/// docs/routing.md ("Decode interference"; its default: "The default-on cost terms, A/B").
pub fn decode_interference_ms(
    delta_ms: f64,
    output_tokens: f64,
    mean_output: f64,
    running: f64,
) -> f64 {
    let o = output_tokens.max(0.0);
    let m = mean_output.max(0.0);
    let overlap = if o >= m {
        m / 2.0
    } else {
        o - o * o / (2.0 * m)
    };
    finite(2.0 * delta_ms.max(0.0) * overlap * running.max(0.0))
}

/// Prefill stall (`weights.prefill_stall`, `later-turns` by default, docs/routing.md, "The
/// default-on cost terms, A/B"; `all` measured within the noise, docs/routing-analyses.md,
/// "The prefill stall"): the end-to-end latency a prefill of `prefill_ms` adds to the
/// `running` requests decoding beside it — each decodes in the steps that carry its chunks, so
/// each answer is `prefill_ms` later.
pub fn prefill_stall_ms(prefill_ms: f64, running: f64) -> f64 {
    finite(prefill_ms.max(0.0) * running.max(0.0))
}

/// Eviction (`weights.eviction`, off by default: even to worse on the eviction-heavy cells,
/// docs/routing-analyses.md, "The eviction charge"): the prefill later requests will spend on
/// what `uncached` new tokens push out of a full pool (ms): `uncached · rate · ms_per_token`,
/// `rate` the worker's re-prefill rate learned from its events.
pub fn eviction_ms(uncached: f64, rate: f64, ms_per_token: f64) -> f64 {
    let v = uncached * rate * ms_per_token;
    if v.is_finite() && v > 0.0 {
        v
    } else {
        0.0
    }
}

fn finite(x: f64) -> f64 {
    if x.is_finite() {
        x
    } else {
        0.0
    }
}
