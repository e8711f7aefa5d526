//! Byte-exact Python `pickle.dumps(obj, protocol=5)` for the values vLLM hashes.
//!
//! Owns: the subset of CPython's C pickler that block hashing reaches — `None`, ints of any
//! width, `bytes`, `str` and tuples — including protocol-4+ framing (a new frame once one reaches
//! 64 KiB at an object boundary; frames under 4 bytes are written unframed, as `_pickle.c`
//! does) and MEMOIZE after every bytes, str and non-empty tuple.
//! Invariant: `dumps(v)` equals CPython 3.8+'s output for the same value; the test suite checks
//! it against Python itself on random inputs.
//! Must not: memoize by value in general: CPython memoizes by identity, and the only values here
//! that repeat by identity are its singleton strings (`""`, one Latin-1 character), which are
//! handled. Multimodal tags, which also repeat, are not produced by the router.

/// A Python value as vLLM builds it for hashing.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PyValue {
    None,
    Int(i128),
    Bytes(Vec<u8>),
    Str(String),
    Tuple(Vec<PyValue>),
}

const FRAME_SIZE_TARGET: usize = 64 * 1024;
const FRAME_SIZE_MIN: usize = 4;
const FRAME_HEADER: usize = 9;

struct Pickler {
    out: Vec<u8>,
    /// Memo slots handed out so far.
    memo_len: u32,
    /// Slots of strings CPython keeps as singletons (`""` and one Latin-1 character), which
    /// therefore repeat by identity whenever they repeat by value.
    singletons: Vec<(String, u32)>,
    /// Start of the open frame's header in `out`, if a frame is open.
    frame_start: Option<usize>,
}

impl Pickler {
    fn write(&mut self, bytes: &[u8]) {
        if self.frame_start.is_none() {
            self.frame_start = Some(self.out.len());
            self.out.extend_from_slice(&[0u8; FRAME_HEADER]);
        }
        self.out.extend_from_slice(bytes);
    }

    fn commit_frame(&mut self) {
        let Some(start) = self.frame_start.take() else {
            return;
        };
        let len = self.out.len() - start - FRAME_HEADER;
        if len >= FRAME_SIZE_MIN {
            self.out[start] = 0x95;
            self.out[start + 1..start + FRAME_HEADER].copy_from_slice(&(len as u64).to_le_bytes());
        } else {
            self.out.drain(start..start + FRAME_HEADER);
        }
    }

    fn memoize(&mut self, s: Option<&str>) {
        self.write(&[0x94]);
        if let Some(s) = s {
            if is_singleton(s) {
                self.singletons.push((s.to_string(), self.memo_len));
            }
        }
        self.memo_len += 1;
    }

    fn singleton_slot(&self, s: &str) -> Option<u32> {
        self.singletons
            .iter()
            .find(|(v, _)| v == s)
            .map(|(_, slot)| *slot)
    }

    fn opcode_boundary(&mut self) {
        if let Some(start) = self.frame_start {
            if self.out.len() - start - FRAME_HEADER >= FRAME_SIZE_TARGET {
                self.commit_frame();
            }
        }
    }

    fn save(&mut self, v: &PyValue) {
        // CPython checks the frame at the start of every save, before the object's opcodes.
        self.opcode_boundary();
        match v {
            PyValue::None => self.write(b"N"),
            PyValue::Int(i) => self.save_int(*i),
            PyValue::Bytes(b) => {
                if b.len() < 256 {
                    self.write(&[b'C', b.len() as u8]);
                } else {
                    let mut h = vec![b'B'];
                    h.extend_from_slice(&(b.len() as u32).to_le_bytes());
                    self.write(&h);
                }
                self.write(b);
                self.memoize(None);
            }
            PyValue::Str(s) => {
                if let Some(slot) = self.singleton_slot(s) {
                    if slot < 256 {
                        self.write(&[b'h', slot as u8]);
                    } else {
                        let mut h = vec![b'j'];
                        h.extend_from_slice(&slot.to_le_bytes());
                        self.write(&h);
                    }
                    return;
                }
                let b = s.as_bytes();
                if b.len() < 256 {
                    self.write(&[0x8c, b.len() as u8]);
                } else {
                    let mut h = vec![b'X'];
                    h.extend_from_slice(&(b.len() as u32).to_le_bytes());
                    self.write(&h);
                }
                self.write(b);
                self.memoize(Some(s));
            }
            PyValue::Tuple(items) => match items.len() {
                0 => self.write(b")"),
                n @ 1..=3 => {
                    for it in items {
                        self.save(it);
                    }
                    self.write(&[[0x85, 0x86, 0x87][n - 1]]);
                    self.memoize(None);
                }
                _ => {
                    self.write(b"(");
                    for it in items {
                        self.save(it);
                    }
                    self.write(b"t");
                    self.memoize(None);
                }
            },
        }
    }

    fn save_int(&mut self, i: i128) {
        if (0..=0xff).contains(&i) {
            self.write(&[b'K', i as u8]);
        } else if (0..=0xffff).contains(&i) {
            let b = (i as u16).to_le_bytes();
            self.write(&[b'M', b[0], b[1]]);
        } else if i >= i32::MIN as i128 && i <= i32::MAX as i128 {
            let b = (i as i32).to_le_bytes();
            self.write(&[b'J', b[0], b[1], b[2], b[3]]);
        } else if (0..=u32::MAX as i128).contains(&i) {
            // Token ids of 2^31 and above: LONG1 with 5 bytes (a zero sign byte).
            let b = (i as u32).to_le_bytes();
            self.write(&[0x8a, 5, b[0], b[1], b[2], b[3], 0]);
        } else {
            let enc = long_bytes(i);
            let mut h = vec![0x8a, enc.len() as u8];
            h.extend_from_slice(&enc);
            self.write(&h);
        }
    }
}

/// CPython shares one object for the empty string and for each Latin-1 character.
fn is_singleton(s: &str) -> bool {
    let mut chars = s.chars();
    match (chars.next(), chars.next()) {
        (None, _) => true,
        (Some(c), None) => (c as u32) < 256,
        _ => false,
    }
}

/// Minimal two's-complement little-endian bytes of `i`, as `pickle.encode_long` writes them.
fn long_bytes(i: i128) -> Vec<u8> {
    let all = i.to_le_bytes();
    let mut n = all.len();
    // Drop redundant sign-extension bytes while the sign stays intact.
    while n > 1 {
        let last = all[n - 1];
        let prev_sign = all[n - 2] & 0x80;
        if (last == 0x00 && prev_sign == 0) || (last == 0xff && prev_sign != 0) {
            n -= 1;
        } else {
            break;
        }
    }
    all[..n].to_vec()
}

/// Appends each token's int opcode (`K`, `M`, `J` or a 5-byte `LONG1`) to `out`: the bytes
/// `save_int` writes one token at a time, in one pass without a branch per token's width
/// (every token is written as 8 bytes over a scratch tail, then the tail is cut).
fn put_tokens(out: &mut Vec<u8>, tokens: &[u32]) {
    let start = out.len();
    out.resize(start + tokens.len() * 7 + 8, 0);
    let mut at = start;
    for &t in tokens {
        let (word, len) = if t <= 0x7fff_ffff {
            // 0: K + 1 byte, 1: M + 2 bytes, 2: J + 4 bytes.
            let class = u32::from(t > 0xff) + u32::from(t > 0xffff);
            // The opcodes K, M, J packed by class; lengths 2, 3, 5.
            let op = (0x004a_4d4b_u32 >> (8 * class)) & 0xff;
            let len = 2 + class + (class >> 1);
            (u64::from(op) | (u64::from(t) << 8), len as usize)
        } else {
            // LONG1, 5 bytes, the last a zero sign byte.
            (0x8a | (5 << 8) | (u64::from(t) << 16), 7)
        };
        out[at..at + 8].copy_from_slice(&word.to_le_bytes());
        at += len;
    }
    out.truncate(at);
}

impl Pickler {
    /// Saves `tuple(tokens)` exactly as `save(PyValue::Tuple(ints))` would, without building
    /// the value.
    fn save_token_tuple(&mut self, tokens: &[u32]) {
        self.opcode_boundary();
        match tokens.len() {
            0 => self.write(b")"),
            n @ 1..=3 => {
                for t in tokens {
                    self.opcode_boundary();
                    self.save_int(*t as i128);
                }
                self.write(&[[0x85, 0x86, 0x87][n - 1]]);
                self.memoize(None);
            }
            n => {
                self.write(b"(");
                let open = self
                    .frame_start
                    .map_or(0, |start| self.out.len() - start - FRAME_HEADER);
                // Seven bytes at most per token: when the whole tuple cannot reach the frame
                // target, no boundary inside it can start a frame, so the tokens are written in
                // one pass (the same bytes `save_int` writes one by one).
                if open + n * 7 < FRAME_SIZE_TARGET {
                    put_tokens(&mut self.out, tokens);
                } else {
                    for t in tokens {
                        self.opcode_boundary();
                        self.save_int(*t as i128);
                    }
                }
                self.write(b"t");
                self.memoize(None);
            }
        }
    }

    /// `save` of a `bytes` value, without building a `PyValue` for it.
    fn save_bytes(&mut self, b: &[u8]) {
        self.opcode_boundary();
        if b.len() < 256 {
            self.write(&[b'C', b.len() as u8]);
        } else {
            self.write(b"B");
            self.write(&(b.len() as u32).to_le_bytes());
        }
        self.write(b);
        self.memoize(None);
    }
}

/// `pickle.dumps((parent, tuple(tokens), extra), protocol=5)`: a block's hash input, written
/// into `out` (cleared first, so a chain reuses one buffer) without materializing the token
/// tuple (the hot path of request hashing).
pub fn dumps_block_into(out: &mut Vec<u8>, parent: &[u8], tokens: &[u32], extra: &PyValue) {
    out.clear();
    out.reserve(64 + tokens.len() * 7);
    let mut p = Pickler {
        out: std::mem::take(out),
        frame_start: None,
        memo_len: 0,
        singletons: Vec::new(),
    };
    p.out.extend_from_slice(&[0x80, 0x05]);
    // save(outer tuple of 3): boundary, the three items, TUPLE3, MEMOIZE.
    p.opcode_boundary();
    p.save_bytes(parent);
    p.save_token_tuple(tokens);
    p.save(extra);
    p.write(&[0x87]);
    p.memoize(None);
    p.write(b".");
    p.commit_frame();
    *out = p.out;
}

/// `pickle.dumps(v, protocol=5)`.
pub fn dumps(v: &PyValue) -> Vec<u8> {
    let mut p = Pickler {
        out: Vec::with_capacity(64),
        frame_start: None,
        memo_len: 0,
        singletons: Vec::new(),
    };
    p.out.extend_from_slice(&[0x80, 0x05]);
    p.save(v);
    p.write(b".");
    p.commit_frame();
    p.out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dumps_block(parent: &[u8], tokens: &[u32], extra: &PyValue) -> Vec<u8> {
        let mut out = Vec::new();
        dumps_block_into(&mut out, parent, tokens, extra);
        out
    }

    #[test]
    fn a_small_block_pickles_like_cpython() {
        // python3 -c "import pickle; print(pickle.dumps((b'\x01'*3,(1,300,70000,-5,2**40),(('cache_salt','x'),)),protocol=5).hex())"
        let v = PyValue::Tuple(vec![
            PyValue::Bytes(vec![1, 1, 1]),
            PyValue::Tuple(vec![
                PyValue::Int(1),
                PyValue::Int(300),
                PyValue::Int(70000),
                PyValue::Int(-5),
                PyValue::Int(1 << 40),
            ]),
            PyValue::Tuple(vec![PyValue::Tuple(vec![
                PyValue::Str("cache_salt".into()),
                PyValue::Str("x".into()),
            ])]),
        ]);
        let hex: String = dumps(&v).iter().map(|b| format!("{b:02x}")).collect();
        assert_eq!(
            hex,
            concat!(
                "8005953800000000000000430301010194284b014d2c014a701101004afbffffff",
                "8a0600000000000174948c0a63616368655f73616c74948c0178948694859487942e"
            )
        );
    }

    #[test]
    fn the_block_fast_path_writes_the_same_bytes_as_the_generic_pickler() {
        let parent = [7u8; 32];
        for n in [0usize, 1, 2, 3, 4, 16, 13_106, 13_107, 13_110, 30_000] {
            let tokens: Vec<u32> = (0..n as u32)
                .map(|i| i.wrapping_mul(2_654_435_761))
                .collect();
            for extra in [
                PyValue::None,
                PyValue::Tuple(vec![PyValue::Tuple(vec![
                    PyValue::Str("cache_salt".into()),
                    PyValue::Str("".into()),
                ])]),
            ] {
                let generic = dumps(&PyValue::Tuple(vec![
                    PyValue::Bytes(parent.to_vec()),
                    PyValue::Tuple(tokens.iter().map(|t| PyValue::Int(*t as i128)).collect()),
                    extra.clone(),
                ]));
                assert_eq!(dumps_block(&parent, &tokens, &extra), generic, "{n} tokens");
            }
        }
    }

    fn token_of_any_width() -> impl proptest::strategy::Strategy<Value = u32> {
        use proptest::prelude::*;
        prop_oneof![
            0u32..0x100,
            0x100u32..0x1_0000,
            0x1_0000u32..0x8000_0000,
            0x8000_0000u32..=u32::MAX
        ]
    }

    proptest::proptest! {
        #[test]
        fn tokens_of_every_width_pickle_as_the_generic_pickler_writes_them(
            tokens in proptest::collection::vec(token_of_any_width(), 0..80),
            parent in proptest::collection::vec(proptest::num::u8::ANY, 32),
        ) {
            let generic = dumps(&PyValue::Tuple(vec![
                PyValue::Bytes(parent.clone()),
                PyValue::Tuple(tokens.iter().map(|t| PyValue::Int(*t as i128)).collect()),
                PyValue::None,
            ]));
            let mut reused = vec![0xee; 3];
            dumps_block_into(&mut reused, &parent, &tokens, &PyValue::None);
            proptest::prop_assert_eq!(reused, generic);
        }
    }

    #[test]
    fn long_ints_use_minimal_twos_complement() {
        assert_eq!(long_bytes(1 << 31), vec![0, 0, 0, 0x80, 0]);
        assert_eq!(
            long_bytes(-(1 << 31) - 1),
            vec![0xff, 0xff, 0xff, 0x7f, 0xff]
        );
        assert_eq!(
            long_bytes(u32::MAX as i128),
            vec![0xff, 0xff, 0xff, 0xff, 0]
        );
    }
}
