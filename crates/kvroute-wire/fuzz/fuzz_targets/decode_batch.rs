//! Fuzzes the batch decoder with both dialects: it must never panic, and a decoded batch must
//! account for each event exactly once (delivered or dropped with an event-costing reason).
#![no_main]

use kvroute_index::WorkerId;
use kvroute_wire::{decode_batch, Cost, Dialect};
use libfuzzer_sys::fuzz_target;

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
