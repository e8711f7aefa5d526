//! The W3C trace context each completion request arrived with, kept so a test can check which
//! trace an engine was asked to join (vLLM joins the `traceparent` it receives when started
//! with `--otlp-traces-endpoint`; the simulator only records it).
//!
//! Owns: [`TraceContexts`], the last [`KEPT`] completion requests' `traceparent` and
//! `tracestate` headers as received (absent ones as `None`), and how many arrived in all.
//! Invariants: values are stored as they came (lossily as UTF-8), never parsed; the store is
//! bounded.
//! Must not: influence a request's handling.

use parking_lot::Mutex;
use serde::Serialize;
use std::collections::VecDeque;

/// How many requests' trace contexts are kept.
pub const KEPT: usize = 256;

/// One completion request's trace context, as received.
#[derive(Clone, Debug, Serialize, PartialEq, Eq)]
pub struct Received {
    /// Position among all completion requests this worker recorded (from 0).
    pub seq: u64,
    /// The response's `id` (`cmpl-sim-N`, `chatcmpl-sim-N`).
    pub request_id: String,
    pub traceparent: Option<String>,
    pub tracestate: Option<String>,
}

/// The last [`KEPT`] trace contexts received, oldest first, and the total.
#[derive(Default)]
pub struct TraceContexts(Mutex<(VecDeque<Received>, u64)>);

impl TraceContexts {
    pub fn record(&self, request_id: &str, traceparent: Option<&[u8]>, tracestate: Option<&[u8]>) {
        let text = |v: Option<&[u8]>| v.map(|b| String::from_utf8_lossy(b).into_owned());
        let mut g = self.0.lock();
        let (kept, total) = &mut *g;
        kept.push_back(Received {
            seq: *total,
            request_id: request_id.to_string(),
            traceparent: text(traceparent),
            tracestate: text(tracestate),
        });
        *total += 1;
        while kept.len() > KEPT {
            kept.pop_front();
        }
    }

    /// What is kept, oldest first, and how many were recorded in all.
    pub fn snapshot(&self) -> (Vec<Received>, u64) {
        let g = self.0.lock();
        (g.0.iter().cloned().collect(), g.1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_store_keeps_the_last_requests_as_they_came() {
        let t = TraceContexts::default();
        t.record("a", Some(b"00-x"), None);
        for i in 0..KEPT {
            t.record(&format!("r{i}"), None, Some(b"k=v"));
        }
        let (kept, total) = t.snapshot();
        assert_eq!((kept.len(), total), (KEPT, KEPT as u64 + 1));
        assert_eq!(kept[0].request_id, "r0");
        assert_eq!(kept[0].seq, 1);
        assert_eq!(kept[0].tracestate.as_deref(), Some("k=v"));
        assert_eq!(kept[0].traceparent, None);
    }
}
