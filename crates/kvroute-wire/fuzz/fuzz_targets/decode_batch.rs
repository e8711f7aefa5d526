//! Fuzzes the batch decoder with both dialects: it must never panic, and a decoded batch must
//! account for each event exactly once (delivered or dropped with an event-costing reason).
//!
//! Structure-aware: half the mutations decode the input as MessagePack (the seeds are real
//! vLLM 0.32/0.33 and SGLang payloads), change one value of the tree — a boundary integer, a
//! wrong type, an element dropped, duplicated, swapped or copied from elsewhere in the batch —
//! and encode it again, so most inputs stay well-formed batches that reach the event decoders;
//! the other half are libFuzzer's byte mutations.
#![no_main]

use kvroute_index::WorkerId;
use kvroute_wire::{decode_batch, Cost, Dialect};
use libfuzzer_sys::{fuzz_mutator, fuzz_target, fuzzer_mutate};
use rmpv::Value;

fuzz_target!(|data: &[u8]| {
    let worker: WorkerId = "fuzz".into();
    for dialect in [Dialect::Vllm, Dialect::Sglang] {
        if let Ok(batch) = decode_batch(&worker, data, dialect) {
            let refused = batch
                .drops
                .iter()
                .filter(|d| d.reason.cost() == Cost::Event)
                .count();
            // Every event-costing drop names a distinct event, so the two sets never overlap.
            assert!(batch.events.len() + refused <= data.len());
        }
    }
});

fuzz_mutator!(|data: &mut [u8], size: usize, max_size: usize, seed: u32| {
    let mut rng = Rng(u64::from(seed).wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1);
    if rng.below(2) == 0 {
        return fuzzer_mutate(data, size, max_size);
    }
    let Ok(mut tree) = rmpv::decode::read_value(&mut &data[..size]) else {
        return fuzzer_mutate(data, size, max_size);
    };
    let nodes = count(&tree);
    let donor = nth(&tree, rng.below(nodes)).cloned().unwrap_or(Value::Nil);
    let target = rng.below(nodes);
    if let Some(node) = nth_mut(&mut tree, target) {
        mutate(node, donor, &mut rng);
    }
    let mut out = Vec::with_capacity(size);
    if rmpv::encode::write_value(&mut out, &tree).is_err() || out.len() > max_size {
        return fuzzer_mutate(data, size, max_size);
    }
    data[..out.len()].copy_from_slice(&out);
    out.len()
});

/// xorshift64: enough randomness for choosing mutations, seeded by libFuzzer.
struct Rng(u64);

impl Rng {
    fn below(&mut self, n: usize) -> usize {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        (self.0 % n.max(1) as u64) as usize
    }
}

fn children(v: &Value) -> Vec<&Value> {
    match v {
        Value::Array(a) => a.iter().collect(),
        Value::Map(m) => m.iter().flat_map(|(k, v)| [k, v]).collect(),
        _ => Vec::new(),
    }
}

fn count(v: &Value) -> usize {
    1 + children(v).into_iter().map(count).sum::<usize>()
}

/// The `n`th node in pre-order.
fn nth(v: &Value, n: usize) -> Option<&Value> {
    let mut left = n;
    fn go<'a>(v: &'a Value, left: &mut usize) -> Option<&'a Value> {
        if *left == 0 {
            return Some(v);
        }
        *left -= 1;
        children(v).into_iter().find_map(|c| go(c, left))
    }
    go(v, &mut left)
}

fn nth_mut(v: &mut Value, n: usize) -> Option<&mut Value> {
    fn go<'a>(v: &'a mut Value, left: &mut usize) -> Option<&'a mut Value> {
        if *left == 0 {
            return Some(v);
        }
        *left -= 1;
        match v {
            Value::Array(a) => a.iter_mut().find_map(|c| go(c, left)),
            Value::Map(m) => m
                .iter_mut()
                .flat_map(|(k, v)| [k, v])
                .find_map(|c| go(c, left)),
            _ => None,
        }
    }
    let mut left = n;
    go(v, &mut left)
}

const BOUNDARY: [i64; 9] = [0, 1, -1, 255, 65_536, u32::MAX as i64, u32::MAX as i64 + 1, i64::MAX, i64::MIN];

/// One change to one node; `donor` is a copy of another node of the same batch.
fn mutate(node: &mut Value, donor: Value, rng: &mut Rng) {
    match rng.below(8) {
        0 => *node = donor,
        1 => *node = Value::from(BOUNDARY[rng.below(BOUNDARY.len())]),
        2 => *node = Value::from(u64::MAX - rng.below(3) as u64),
        3 => {
            *node = match rng.below(5) {
                0 => Value::Nil,
                1 => Value::from(true),
                2 => Value::from(f64::NAN),
                3 => Value::from("GPU"),
                _ => Value::Binary(vec![0xff; rng.below(40)]),
            }
        }
        4 => *node = Value::Array(vec![std::mem::replace(node, Value::Nil)]),
        _ => match node {
            Value::Array(a) if !a.is_empty() => {
                let i = rng.below(a.len());
                match rng.below(4) {
                    0 => {
                        a.remove(i);
                    }
                    1 => {
                        let c = a[i].clone();
                        a.insert(i, c);
                    }
                    2 => {
                        let j = rng.below(a.len());
                        a.swap(i, j);
                    }
                    _ => a.truncate(i),
                }
            }
            Value::Map(m) if !m.is_empty() => {
                let i = rng.below(m.len());
                m.remove(i);
            }
            Value::Integer(n) => {
                let x = n.as_i64().unwrap_or(0);
                *node = Value::from(x.wrapping_add(rng.below(5) as i64 - 2));
            }
            Value::String(_) => *node = Value::from(["", "BlockStored", "BlockRemoved", "AllBlocksCleared", "cpu", "CPU"][rng.below(6)]),
            other => *other = donor,
        },
    }
}
