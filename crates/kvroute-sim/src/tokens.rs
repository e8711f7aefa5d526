//! The built-in deterministic tokenizer, chat rendering and generated-token spelling.
//!
//! Owns: `tokenize` (text → ids), `detokenize` (ids → text), `render_chat` (messages → ids)
//! and `sample_id` (the id space generated tokens come from).
//! Invariants: the same text always yields the same ids on every worker; generated tokens
//! (ids from `FIRST_WORD` up) spell as `" " + syllables` and tokenize back to exactly the same
//! ids, so a conversation that sends the assistant's text back reuses its cached blocks.
//! Ids: 0 pad, 1 BOS, 2 message start, 3 message end, 4..260 the bytes, then words.
//! Must not: pretend to be any real model's tokenizer.

/// Beginning of sequence (added to completions when `add_special_tokens`).
pub const BOS: u32 = 1;
pub const MSG_START: u32 = 2;
pub const MSG_END: u32 = 3;
const BYTE_BASE: u32 = 4;
/// The first word id.
pub const FIRST_WORD: u32 = BYTE_BASE + 256;

const CONSONANTS: &[u8] = b"bdfghjklmnprstvz";
const VOWELS: &[u8] = b"aeiou";
const SYLLABLES: u32 = 80;

fn word_space(vocab: u32) -> u32 {
    vocab.saturating_sub(FIRST_WORD)
}

/// The spelling of word id `id` (`FIRST_WORD ≤ id < vocab`): a space and 1+ syllables.
fn spell(id: u32) -> String {
    let mut n = id - FIRST_WORD;
    let mut syl = Vec::new();
    loop {
        let s = n % SYLLABLES;
        syl.push(s);
        n /= SYLLABLES;
        if n == 0 {
            break;
        }
        n -= 1;
    }
    let mut out = String::from(" ");
    for s in syl.iter().rev() {
        out.push(CONSONANTS[(s / 5) as usize] as char);
        out.push(VOWELS[(s % 5) as usize] as char);
    }
    out
}

/// The word id spelled by `piece`, if it is a canonical spelling.
fn parse(piece: &str, vocab: u32) -> Option<u32> {
    let body = piece.strip_prefix(' ')?.as_bytes();
    if body.is_empty() || body.len() % 2 != 0 {
        return None;
    }
    let mut n: u64 = 0;
    for (k, pair) in body.chunks(2).enumerate() {
        let c = CONSONANTS.iter().position(|x| *x == pair[0])? as u64;
        let v = VOWELS.iter().position(|x| *x == pair[1])? as u64;
        let s = c * 5 + v;
        n = if k == 0 {
            s
        } else {
            (n + 1) * SYLLABLES as u64 + s
        };
        if n >= u64::from(word_space(vocab)) {
            return None;
        }
    }
    let id = FIRST_WORD + n as u32;
    (spell(id) == piece).then_some(id)
}

fn word_id(piece: &str, vocab: u32) -> u32 {
    if let Some(id) = parse(piece, vocab) {
        return id;
    }
    let space = word_space(vocab).max(1);
    FIRST_WORD + (xxhash_rust::xxh3::xxh3_64(piece.as_bytes()) % u64::from(space)) as u32
}

/// Splits text into pieces: an optional leading space plus a run of ASCII letters and digits
/// is one word; every other character is its bytes.
pub fn tokenize(text: &str, vocab: u32) -> Vec<u32> {
    let bytes = text.as_bytes();
    let mut out = Vec::new();
    let mut i = 0;
    let alnum = |b: u8| b.is_ascii_alphanumeric();
    while i < bytes.len() {
        let start = i;
        let lead = bytes[i] == b' ' && i + 1 < bytes.len() && alnum(bytes[i + 1]);
        if lead || alnum(bytes[i]) {
            i += 1;
            while i < bytes.len() && alnum(bytes[i]) {
                i += 1;
            }
            if vocab > FIRST_WORD {
                out.push(word_id(&text[start..i], vocab));
            } else {
                out.extend(bytes[start..i].iter().map(|b| byte_id(*b, vocab)));
            }
        } else {
            out.push(byte_id(bytes[i], vocab));
            i += 1;
        }
    }
    out
}

fn byte_id(b: u8, vocab: u32) -> u32 {
    (BYTE_BASE + u32::from(b)) % vocab.max(1)
}

/// Text for ids: words spelled, bytes as bytes (lossy UTF-8), specials dropped.
pub fn detokenize(ids: &[u32]) -> String {
    let mut bytes = Vec::new();
    for id in ids {
        if *id >= FIRST_WORD {
            bytes.extend_from_slice(spell(*id).as_bytes());
        } else if *id >= BYTE_BASE {
            bytes.push((*id - BYTE_BASE) as u8);
        }
    }
    String::from_utf8_lossy(&bytes).into_owned()
}

/// A generated token id from 64 random bits: a word whenever the vocabulary has words.
pub fn sample_id(bits: u64, vocab: u32) -> u32 {
    let space = word_space(vocab);
    if space > 0 {
        FIRST_WORD + (bits % u64::from(space)) as u32
    } else {
        (bits % u64::from(vocab.max(1))) as u32
    }
}

/// One chat message.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    pub role: String,
    pub content: String,
}

/// The built-in chat template: `MSG_START role "\n" content MSG_END` per message, then
/// `MSG_START "assistant" "\n"` when a generation prompt is asked for.
pub fn render_chat(messages: &[Message], add_generation_prompt: bool, vocab: u32) -> Vec<u32> {
    let mut out = Vec::new();
    for m in messages {
        out.push(MSG_START);
        out.extend(tokenize(&m.role, vocab));
        out.extend(tokenize("\n", vocab));
        out.extend(tokenize(&m.content, vocab));
        out.push(MSG_END);
    }
    if add_generation_prompt {
        out.push(MSG_START);
        out.extend(tokenize("assistant", vocab));
        out.extend(tokenize("\n", vocab));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn generated_words_tokenize_back_to_the_same_ids() {
        for vocab in [1024u32, 151_936] {
            let ids: Vec<u32> = (0..500u64)
                .map(|i| sample_id(i.wrapping_mul(0x9e37_79b9_7f4a_7c15), vocab))
                .collect();
            assert_eq!(tokenize(&detokenize(&ids), vocab), ids, "vocab {vocab}");
        }
    }

    #[test]
    fn the_same_text_always_gives_the_same_tokens_in_the_vocabulary() {
        let a = tokenize("Hello, world! The answer is 42.", 1024);
        assert_eq!(a, tokenize("Hello, world! The answer is 42.", 1024));
        assert!(a.iter().all(|t| *t < 1024));
        assert_eq!(a.len(), 9);
    }

    #[test]
    fn chat_rendering_wraps_each_message_and_the_generation_prompt() {
        let m = [Message {
            role: "user".into(),
            content: "hi".into(),
        }];
        let ids = render_chat(&m, true, 1024);
        assert_eq!(ids[0], MSG_START);
        assert_eq!(ids.iter().filter(|t| **t == MSG_START).count(), 2);
        assert_eq!(ids.iter().filter(|t| **t == MSG_END).count(), 1);
    }
}
