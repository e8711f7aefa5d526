//! Test helpers: a tiny msgpack writer (able to write what no real encoder would), builders
//! for well-formed vLLM 0.32 events and batches, and what every integration suite shares
//! (`wait`, `python`).
#![allow(dead_code)]

pub mod publisher;
#[path = "../../../kvroute/tests/common/python.rs"]
pub mod python;
pub mod sink;
#[path = "../../../kvroute/tests/common/wait.rs"]
pub mod wait;

/// A msgpack value to encode, including deliberately broken pieces.
#[derive(Clone, Debug)]
pub enum M {
    Nil,
    B(bool),
    U(u64),
    I(i64),
    F(f64),
    S(String),
    /// A str whose bytes may not be UTF-8.
    RawStr(Vec<u8>),
    Bin(Vec<u8>),
    A(Vec<M>),
    Map(Vec<(M, M)>),
    /// Bytes copied verbatim.
    Raw(Vec<u8>),
}

pub fn s(v: &str) -> M {
    M::S(v.to_string())
}

impl M {
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::new();
        self.write(&mut out);
        out
    }

    fn write(&self, out: &mut Vec<u8>) {
        match self {
            M::Nil => out.push(0xc0),
            M::B(b) => out.push(if *b { 0xc3 } else { 0xc2 }),
            M::U(v) => {
                out.push(0xcf);
                out.extend_from_slice(&v.to_be_bytes());
            }
            M::I(v) => {
                out.push(0xd3);
                out.extend_from_slice(&v.to_be_bytes());
            }
            M::F(v) => {
                out.push(0xcb);
                out.extend_from_slice(&v.to_be_bytes());
            }
            M::S(v) => write_str(out, v.as_bytes()),
            M::RawStr(v) => write_str(out, v),
            M::Bin(v) => {
                out.push(0xc6);
                out.extend_from_slice(&(v.len() as u32).to_be_bytes());
                out.extend_from_slice(v);
            }
            M::A(items) => {
                out.push(0xdd);
                out.extend_from_slice(&(items.len() as u32).to_be_bytes());
                items.iter().for_each(|i| i.write(out));
            }
            M::Map(items) => {
                out.push(0xdf);
                out.extend_from_slice(&(items.len() as u32).to_be_bytes());
                for (k, v) in items {
                    k.write(out);
                    v.write(out);
                }
            }
            M::Raw(b) => out.extend_from_slice(b),
        }
    }
}

fn write_str(out: &mut Vec<u8>, b: &[u8]) {
    out.push(0xdb);
    out.extend_from_slice(&(b.len() as u32).to_be_bytes());
    out.extend_from_slice(b);
}

/// The fields of a well-formed 0.32 `BlockStored` map, in wire order.
pub fn stored_fields(hashes: &[u64], group: u32) -> Vec<(&'static str, M)> {
    vec![
        ("type", s("BlockStored")),
        (
            "block_hashes",
            M::A(hashes.iter().map(|h| M::U(*h)).collect()),
        ),
        ("parent_block_hash", M::Nil),
        (
            "token_ids",
            M::A((0..hashes.len() as u64 * 4).map(M::U).collect()),
        ),
        ("block_size", M::U(4)),
        ("lora_id", M::Nil),
        ("medium", s("GPU")),
        ("lora_name", M::Nil),
        ("extra_keys", M::A(hashes.iter().map(|_| M::Nil).collect())),
        ("group_idx", M::U(u64::from(group))),
        ("kv_cache_spec_kind", s("sliding_window")),
        ("kv_cache_spec_sliding_window", M::U(8)),
    ]
}

/// A map event from fields; `edit` replaces (Some) or removes (None) a key, or appends it.
pub fn map_event(mut fields: Vec<(&'static str, M)>, edits: &[(&'static str, Option<M>)]) -> M {
    for (k, v) in edits {
        match (fields.iter().position(|(fk, _)| fk == k), v) {
            (Some(i), Some(v)) => fields[i].1 = v.clone(),
            (Some(i), None) => {
                fields.remove(i);
            }
            (None, Some(v)) => fields.push((k, v.clone())),
            (None, None) => {}
        }
    }
    M::Map(fields.into_iter().map(|(k, v)| (s(k), v)).collect())
}

pub fn good_stored(hashes: &[u64]) -> M {
    map_event(stored_fields(hashes, 0), &[])
}

pub fn removed(hashes: &[u64], group: Option<u32>) -> M {
    let mut f = vec![
        (s("type"), s("BlockRemoved")),
        (
            s("block_hashes"),
            M::A(hashes.iter().map(|h| M::U(*h)).collect()),
        ),
        (s("medium"), s("GPU")),
    ];
    if let Some(g) = group {
        f.push((s("group_idx"), M::U(u64::from(g))));
    }
    M::Map(f)
}

/// `[ts, events, dp_rank]`.
pub fn batch(events: Vec<M>, dp_rank: u32) -> Vec<u8> {
    M::A(vec![
        M::F(1_700_000_000.5),
        M::A(events),
        M::U(u64::from(dp_rank)),
    ])
    .encode()
}

pub fn good_batch() -> Vec<u8> {
    batch(vec![good_stored(&[1, 2]), removed(&[1], Some(0))], 0)
}
