//! W3C trace context (`traceparent`, `tracestate`): reading a client's and writing the one an
//! engine receives.
//!
//! Owns: [`parse_traceparent`] (version `00` exactly; a later version by its first four fields,
//! as the recommendation asks of a reader that knows only `00`), [`format_traceparent`], and
//! [`client_parent`], which reads a request's headers into the remote parent of its spans.
//! Invariants: nothing here panics on what a client sends; a header that is not one valid
//! `traceparent` (absent, repeated, malformed, all-zero ids, version `ff`) is no parent, and a
//! malformed one is reported as such so the caller can count it; `tracestate` is read only
//! beside a valid `traceparent`, and an invalid `tracestate` is dropped, never the parent.
//! Must not: start spans or know about exporters (that is the parent module's).

use axum::http::HeaderMap;
use opentelemetry::trace::{SpanContext, SpanId, TraceFlags, TraceId, TraceState};
use std::str::FromStr;

/// The parts of a valid `traceparent`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TraceParent {
    pub trace_id: [u8; 16],
    pub span_id: [u8; 8],
    pub flags: u8,
}

/// Why a `traceparent` was ignored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum Malformed {
    #[error("traceparent is not version-traceid-spanid-flags in lowercase hex")]
    Shape,
    #[error("traceparent version ff is invalid")]
    Version,
    #[error("traceparent has an all-zero trace id or span id")]
    ZeroId,
    #[error("more than one traceparent header")]
    Repeated,
}

/// Lowercase hex digits into bytes; `None` on any other character or an odd length.
fn hex<const N: usize>(s: &[u8]) -> Option<[u8; N]> {
    if s.len() != 2 * N {
        return None;
    }
    let digit = |c: u8| match c {
        b'0'..=b'9' => Some(c - b'0'),
        b'a'..=b'f' => Some(c - b'a' + 10),
        _ => None,
    };
    let mut out = [0u8; N];
    for (i, pair) in s.chunks_exact(2).enumerate() {
        out[i] = (digit(pair[0])? << 4) | digit(pair[1])?;
    }
    Some(out)
}

/// Reads one `traceparent` value (`00-<32 hex>-<16 hex>-<2 hex>`, surrounding blanks allowed).
pub fn parse_traceparent(value: &[u8]) -> Result<TraceParent, Malformed> {
    let v = value.trim_ascii();
    // version(2) - trace id(32) - span id(16) - flags(2): 55 bytes; a later version may append
    // fields after one more dash.
    if v.len() < 55 || [2, 35, 52].iter().any(|&i| v[i] != b'-') {
        return Err(Malformed::Shape);
    }
    let version = hex::<1>(&v[0..2]).ok_or(Malformed::Shape)?[0];
    if version == 0xff {
        return Err(Malformed::Version);
    }
    if (version == 0 && v.len() != 55) || (v.len() > 55 && v[55] != b'-') {
        return Err(Malformed::Shape);
    }
    let trace_id = hex::<16>(&v[3..35]).ok_or(Malformed::Shape)?;
    let span_id = hex::<8>(&v[36..52]).ok_or(Malformed::Shape)?;
    let flags = hex::<1>(&v[53..55]).ok_or(Malformed::Shape)?[0];
    if trace_id == [0; 16] || span_id == [0; 8] {
        return Err(Malformed::ZeroId);
    }
    Ok(TraceParent {
        trace_id,
        span_id,
        flags,
    })
}

/// The version-`00` `traceparent` naming `span_id` of `trace_id` as the parent.
pub fn format_traceparent(trace_id: TraceId, span_id: SpanId, flags: TraceFlags) -> String {
    format!(
        "00-{trace_id}-{span_id}-{:02x}",
        flags.to_u8() & TraceFlags::SAMPLED.to_u8()
    )
}

/// The request's remote parent: `Ok(None)` without a `traceparent`, `Err` when the header is
/// there but is not one valid `traceparent` (the request then starts a trace of its own).
pub fn client_parent(headers: &HeaderMap) -> Result<Option<SpanContext>, Malformed> {
    let mut values = headers.get_all("traceparent").iter();
    let Some(first) = values.next() else {
        return Ok(None);
    };
    if values.next().is_some() {
        return Err(Malformed::Repeated);
    }
    let p = parse_traceparent(first.as_bytes())?;
    // Several tracestate headers are one list, joined by commas.
    let state: Vec<&str> = headers
        .get_all("tracestate")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .collect();
    let state = TraceState::from_str(&state.join(",")).unwrap_or_default();
    Ok(Some(SpanContext::new(
        TraceId::from_bytes(p.trace_id),
        SpanId::from_bytes(p.span_id),
        TraceFlags::new(p.flags),
        true,
        state,
    )))
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    const GOOD: &str = "00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01";

    #[test]
    fn a_version_00_traceparent_reads_into_its_ids_and_flags() {
        let p = parse_traceparent(GOOD.as_bytes()).unwrap();
        assert_eq!(
            TraceId::from_bytes(p.trace_id).to_string(),
            "4bf92f3577b34da6a3ce929d0e0e4736"
        );
        assert_eq!(
            SpanId::from_bytes(p.span_id).to_string(),
            "00f067aa0ba902b7"
        );
        assert_eq!(p.flags, 1);
        assert_eq!(
            format_traceparent(
                TraceId::from_bytes(p.trace_id),
                SpanId::from_bytes(p.span_id),
                TraceFlags::new(p.flags)
            ),
            GOOD
        );
        assert!(parse_traceparent(format!("  {GOOD}\t").as_bytes()).is_ok());
    }

    #[test]
    fn a_later_version_is_read_by_its_first_four_fields() {
        let later = "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-what-comes-next";
        assert_eq!(parse_traceparent(later.as_bytes()).unwrap().flags, 1);
        let glued = "01-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01x";
        assert_eq!(parse_traceparent(glued.as_bytes()), Err(Malformed::Shape));
    }

    #[test]
    fn malformed_traceparents_are_refused_without_a_panic() {
        let cases: &[(&[u8], Malformed)] = &[
            (b"", Malformed::Shape),
            (b"00", Malformed::Shape),
            (
                b"garbage-garbage-garbage-garbage-garbage-garbage-garbage",
                Malformed::Shape,
            ),
            (
                b"00-4BF92F3577B34DA6A3CE929D0E0E4736-00f067aa0ba902b7-01",
                Malformed::Shape,
            ),
            (
                b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01-extra",
                Malformed::Shape,
            ),
            (
                b"ff-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01",
                Malformed::Version,
            ),
            (
                b"00-00000000000000000000000000000000-00f067aa0ba902b7-01",
                Malformed::ZeroId,
            ),
            (
                b"00-4bf92f3577b34da6a3ce929d0e0e4736-0000000000000000-01",
                Malformed::ZeroId,
            ),
            (
                b"00_4bf92f3577b34da6a3ce929d0e0e4736_00f067aa0ba902b7_01",
                Malformed::Shape,
            ),
            (
                "00-4bf92f3577b34da6a3ce929d0e0e47é-00f067aa0ba902b7-01".as_bytes(),
                Malformed::Shape,
            ),
        ];
        for (value, why) in cases {
            assert_eq!(
                parse_traceparent(value),
                Err(*why),
                "{}",
                String::from_utf8_lossy(value)
            );
        }
    }

    #[test]
    fn the_clients_parent_carries_its_tracestate_and_a_repeated_header_is_refused() {
        let mut h = HeaderMap::new();
        assert_eq!(client_parent(&h), Ok(None));
        h.insert("traceparent", HeaderValue::from_static(GOOD));
        h.append("tracestate", HeaderValue::from_static("vendor=a"));
        h.append("tracestate", HeaderValue::from_static("other=b"));
        let sc = client_parent(&h).unwrap().unwrap();
        assert!(sc.is_remote() && sc.is_sampled());
        assert_eq!(sc.trace_state().header(), "vendor=a,other=b");
        // An invalid tracestate costs the state, not the parent.
        h.insert(
            "tracestate",
            HeaderValue::from_static("Upper=case,no-equals-sign"),
        );
        let sc = client_parent(&h).unwrap().unwrap();
        assert_eq!(sc.trace_state().header(), "");
        h.append("traceparent", HeaderValue::from_static(GOOD));
        assert_eq!(client_parent(&h), Err(Malformed::Repeated));
    }
}
