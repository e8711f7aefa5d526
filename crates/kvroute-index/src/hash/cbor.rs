//! Canonical CBOR (`cbor2.dumps(obj, canonical=True)`) for the values vLLM hashes.
//!
//! Owns: the encoding of `PyValue` (None, ints, bytes, str, tuples as arrays) with minimal
//! length headers, as cbor2 writes them. Ints outside the 64-bit ranges become bignums (tags 2
//! and 3), as cbor2 does.
//! Must not: emit maps or floats (vLLM's block hash input never contains them).

use super::pickle::PyValue;

fn header(out: &mut Vec<u8>, major: u8, len: u64) {
    let m = major << 5;
    if len < 24 {
        out.push(m | len as u8);
    } else if len <= 0xff {
        out.extend_from_slice(&[m | 24, len as u8]);
    } else if len <= 0xffff {
        out.push(m | 25);
        out.extend_from_slice(&(len as u16).to_be_bytes());
    } else if len <= 0xffff_ffff {
        out.push(m | 26);
        out.extend_from_slice(&(len as u32).to_be_bytes());
    } else {
        out.push(m | 27);
        out.extend_from_slice(&len.to_be_bytes());
    }
}

fn encode_into(out: &mut Vec<u8>, v: &PyValue) {
    match v {
        PyValue::None => out.push(0xf6),
        PyValue::Int(i) => {
            let i = *i;
            if i >= 0 && i <= u64::MAX as i128 {
                header(out, 0, i as u64);
            } else if i < 0 && (-1 - i) <= u64::MAX as i128 {
                header(out, 1, (-1 - i) as u64);
            } else {
                let (tag, mag) = if i >= 0 {
                    (0xc2, i as u128)
                } else {
                    (0xc3, (-1 - i) as u128)
                };
                let be = mag.to_be_bytes();
                let first = be.iter().position(|b| *b != 0).unwrap_or(be.len() - 1);
                out.push(tag);
                header(out, 2, (be.len() - first) as u64);
                out.extend_from_slice(&be[first..]);
            }
        }
        PyValue::Bytes(b) => {
            header(out, 2, b.len() as u64);
            out.extend_from_slice(b);
        }
        PyValue::Str(s) => {
            header(out, 3, s.len() as u64);
            out.extend_from_slice(s.as_bytes());
        }
        PyValue::Tuple(items) => {
            header(out, 4, items.len() as u64);
            for it in items {
                encode_into(out, it);
            }
        }
    }
}

/// `cbor2.dumps((parent, tuple(tokens), extra), canonical=True)` written into `out` (cleared
/// first, so a chain reuses one buffer) without materializing the token tuple.
pub fn dumps_block_into(out: &mut Vec<u8>, parent: &[u8], tokens: &[u32], extra: &PyValue) {
    out.clear();
    out.reserve(48 + tokens.len() * 5);
    header(out, 4, 3);
    header(out, 2, parent.len() as u64);
    out.extend_from_slice(parent);
    header(out, 4, tokens.len() as u64);
    put_tokens(out, tokens);
    encode_into(out, extra);
}

/// Appends each token as an unsigned int with its minimal header (`header(out, 0, t)` for
/// each), in one pass without a branch per token's width: every token is written as 8 bytes
/// over a scratch tail, then the tail is cut.
fn put_tokens(out: &mut Vec<u8>, tokens: &[u32]) {
    let start = out.len();
    out.resize(start + tokens.len() * 5 + 8, 0);
    let mut at = start;
    for &t in tokens {
        let class = u32::from(t >= 24) + u32::from(t > 0xff) + u32::from(t > 0xffff);
        // The value itself under 24, else a one-byte header (24 + class − 1) and the value's
        // big-endian bytes; lengths 1, 2, 3, 5 (all four built, one picked: no branch).
        let words = [
            u64::from(t),
            0x18 | (u64::from(t) << 8),
            0x19 | (u64::from((t as u16).swap_bytes()) << 8),
            0x1a | (u64::from(t.swap_bytes()) << 8),
        ];
        let word = words[class as usize];
        out[at..at + 8].copy_from_slice(&word.to_le_bytes());
        at += (1 + class + ((class >> 1) & class)) as usize;
    }
    out.truncate(at);
}

/// `cbor2.dumps(v, canonical=True)`.
pub fn dumps(v: &PyValue) -> Vec<u8> {
    let mut out = Vec::with_capacity(64);
    encode_into(&mut out, v);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_block_fast_path_writes_the_same_bytes_as_the_generic_encoder() {
        let tokens: Vec<u32> = vec![0, 23, 24, 255, 256, 65_535, 65_536, u32::MAX];
        let generic = dumps(&PyValue::Tuple(vec![
            PyValue::Bytes(vec![1; 32]),
            PyValue::Tuple(tokens.iter().map(|t| PyValue::Int(*t as i128)).collect()),
            PyValue::None,
        ]));
        let mut out = Vec::new();
        dumps_block_into(&mut out, &[1; 32], &tokens, &PyValue::None);
        assert_eq!(out, generic);
    }

    proptest::proptest! {
        #[test]
        fn tokens_of_every_width_encode_as_the_generic_encoder_writes_them(
            tokens in proptest::collection::vec(
                proptest::prop_oneof![
                    0u32..24,
                    24u32..0x100,
                    0x100u32..0x1_0000,
                    0x1_0000u32..=u32::MAX
                ],
                0..80,
            ),
        ) {
            let generic = dumps(&PyValue::Tuple(vec![
                PyValue::Bytes(vec![3; 32]),
                PyValue::Tuple(tokens.iter().map(|t| PyValue::Int(*t as i128)).collect()),
                PyValue::None,
            ]));
            let mut reused = vec![0xee; 3];
            dumps_block_into(&mut reused, &[3; 32], &tokens, &PyValue::None);
            proptest::prop_assert_eq!(reused, generic);
        }
    }

    #[test]
    fn headers_are_minimal() {
        assert_eq!(dumps(&PyValue::Int(23)), vec![0x17]);
        assert_eq!(dumps(&PyValue::Int(24)), vec![0x18, 24]);
        assert_eq!(dumps(&PyValue::Int(-1)), vec![0x20]);
        assert_eq!(dumps(&PyValue::Int(65536)), vec![0x1a, 0, 1, 0, 0]);
        assert_eq!(dumps(&PyValue::None), vec![0xf6]);
        assert_eq!(
            dumps(&PyValue::Tuple(vec![
                PyValue::Str("a".into()),
                PyValue::Bytes(vec![7])
            ])),
            vec![0x82, 0x61, b'a', 0x41, 7]
        );
    }
}
