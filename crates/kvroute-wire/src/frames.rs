//! ZMQ message layouts: live `[topic, seq, payload]` messages and replay replies.
//!
//! Owns: [`decode_message`], [`split_live`], [`parse_replay_reply`], [`replay_request`] and
//! [`FrameError`].
//! Invariants: a message with the wrong frame count or a sequence frame that is not exactly 8
//! bytes costs that message only; a payload that does not decode still reports its topic and
//! sequence (so the caller can account for the lost batch); the replay end marker is the
//! all-ones sequence, whatever its payload.
//! Must not: track sequences, own sockets or count metrics.

use crate::decode::{decode_batch_with, DecodedBatch};
use crate::reasons::{BatchError, Dialect, Limits};
use kvroute_index::WorkerId;
use std::fmt;

/// The sequence number that ends a replay reply.
pub const END_SEQ: u64 = u64::MAX;

/// Why a ZMQ message was refused.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    #[error("wrong frame count: {got} frames, expected {expected}")]
    WrongFrameCount { got: usize, expected: &'static str },
    #[error("replay reply does not start with an empty delimiter frame")]
    MissingDelimiter,
    #[error("sequence frame is {len} bytes, expected 8")]
    InvalidSeq { len: usize },
    #[error("batch seq {seq} undecodable: {error}")]
    Batch {
        topic: Vec<u8>,
        seq: u64,
        error: BatchError,
    },
}

impl FrameError {
    /// Every reason name, in a fixed order (metric labels).
    pub const NAMES: &'static [&'static str] = &[
        "wrong_frame_count",
        "missing_delimiter",
        "invalid_seq",
        "undecodable_batch",
    ];

    /// The stable metric label.
    pub fn name(&self) -> &'static str {
        match self {
            FrameError::WrongFrameCount { .. } => "wrong_frame_count",
            FrameError::MissingDelimiter => "missing_delimiter",
            FrameError::InvalidSeq { .. } => "invalid_seq",
            FrameError::Batch { .. } => "undecodable_batch",
        }
    }
}

/// The three frames of a live message, not yet decoded.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct LiveFrames<'a> {
    pub topic: &'a [u8],
    pub seq: u64,
    pub payload: &'a [u8],
}

/// Splits a live message: exactly `[topic, seq (8 bytes BE), payload]`.
pub fn split_live<'a>(frames: &[&'a [u8]]) -> Result<LiveFrames<'a>, FrameError> {
    match frames {
        [topic, seq, payload] => Ok(LiveFrames {
            topic,
            seq: read_seq(seq)?,
            payload,
        }),
        _ => Err(FrameError::WrongFrameCount {
            got: frames.len(),
            expected: "3",
        }),
    }
}

/// Decodes a live message with the vLLM dialect and default limits: `(topic, seq, batch)`.
pub fn decode_message(
    worker: &WorkerId,
    frames: &[&[u8]],
) -> Result<(Vec<u8>, u64, DecodedBatch), FrameError> {
    decode_message_with(worker, frames, Dialect::Vllm, &Limits::default())
}

/// Decodes a live message: `(topic, seq, batch)`.
pub fn decode_message_with(
    worker: &WorkerId,
    frames: &[&[u8]],
    dialect: Dialect,
    limits: &Limits,
) -> Result<(Vec<u8>, u64, DecodedBatch), FrameError> {
    let live = split_live(frames)?;
    match decode_batch_with(worker, live.payload, dialect, limits) {
        Ok(batch) => Ok((live.topic.to_vec(), live.seq, batch)),
        Err(error) => Err(FrameError::Batch {
            topic: live.topic.to_vec(),
            seq: live.seq,
            error,
        }),
    }
}

/// One message of a replay reply.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReplayReply<'a> {
    /// A buffered batch. `topic` is present in the vLLM 0.32 layout only.
    Batch {
        topic: Option<&'a [u8]>,
        seq: u64,
        payload: &'a [u8],
    },
    /// The end marker (`seq` = [`END_SEQ`]).
    End,
}

/// Parses one replay reply as a DEALER receives it: `["", topic, seq, payload]` (vLLM 0.32)
/// or `["", seq, payload]` (vLLM ≤ 0.25, SGLang).
pub fn parse_replay_reply<'a>(frames: &[&'a [u8]]) -> Result<ReplayReply<'a>, FrameError> {
    let (topic, seq, payload) = match frames {
        [delim, topic, seq, payload] => {
            if !delim.is_empty() {
                return Err(FrameError::MissingDelimiter);
            }
            (Some(*topic), read_seq(seq)?, *payload)
        }
        [delim, seq, payload] => {
            if !delim.is_empty() {
                return Err(FrameError::MissingDelimiter);
            }
            (None, read_seq(seq)?, *payload)
        }
        _ => {
            return Err(FrameError::WrongFrameCount {
                got: frames.len(),
                expected: "3 or 4",
            })
        }
    };
    if seq == END_SEQ {
        return Ok(ReplayReply::End);
    }
    Ok(ReplayReply::Batch {
        topic,
        seq,
        payload,
    })
}

/// The request a DEALER sends to a replay ROUTER: `["", start_seq (8 bytes BE)]`.
pub fn replay_request(start_seq: u64) -> [Vec<u8>; 2] {
    [Vec::new(), start_seq.to_be_bytes().to_vec()]
}

fn read_seq(frame: &[u8]) -> Result<u64, FrameError> {
    let bytes: [u8; 8] = frame
        .try_into()
        .map_err(|_| FrameError::InvalidSeq { len: frame.len() })?;
    Ok(u64::from_be_bytes(bytes))
}

/// Renders a topic for logs: UTF-8 when it is, hex otherwise.
pub struct TopicDisplay<'a>(pub &'a [u8]);

impl fmt::Display for TopicDisplay<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match std::str::from_utf8(self.0) {
            Ok(s) => write!(f, "{s:?}"),
            Err(_) => {
                f.write_str("0x")?;
                self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_replay_layouts_and_the_end_marker_are_recognized() {
        let seq = 7u64.to_be_bytes();
        let end = END_SEQ.to_be_bytes();
        assert_eq!(
            parse_replay_reply(&[b"", b"kv", &seq, b"p"]),
            Ok(ReplayReply::Batch {
                topic: Some(b"kv"),
                seq: 7,
                payload: b"p"
            })
        );
        assert_eq!(
            parse_replay_reply(&[b"", &seq, b"p"]),
            Ok(ReplayReply::Batch {
                topic: None,
                seq: 7,
                payload: b"p"
            })
        );
        assert_eq!(
            parse_replay_reply(&[b"", b"", &end, b""]),
            Ok(ReplayReply::End)
        );
        assert_eq!(parse_replay_reply(&[b"", &end, b""]), Ok(ReplayReply::End));
    }

    #[test]
    fn replay_replies_without_the_delimiter_or_with_odd_counts_are_refused() {
        let seq = 7u64.to_be_bytes();
        assert_eq!(
            parse_replay_reply(&[b"x", &seq, b"p"]),
            Err(FrameError::MissingDelimiter)
        );
        assert!(matches!(
            parse_replay_reply(&[&seq, b"p"]),
            Err(FrameError::WrongFrameCount { got: 2, .. })
        ));
        assert_eq!(
            parse_replay_reply(&[b"", b"1234", b"p"]),
            Err(FrameError::InvalidSeq { len: 4 })
        );
    }
}
