//! Fuzzes the live-message and replay-reply parsers. The input is split into frames at each
//! 0xFF 0x00 pair, so the fuzzer controls both the frame count and every frame's bytes.
#![no_main]

use kvroute_index::WorkerId;
use kvroute_wire::{decode_message, parse_replay_reply};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let mut frames: Vec<&[u8]> = Vec::new();
    let mut start = 0;
    let mut i = 0;
    while i + 1 < data.len() {
        if data[i] == 0xff && data[i + 1] == 0x00 {
            frames.push(&data[start..i]);
            start = i + 2;
            i += 2;
        } else {
            i += 1;
        }
    }
    frames.push(&data[start..]);
    let worker: WorkerId = "fuzz".into();
    let _ = decode_message(&worker, &frames);
    let _ = parse_replay_reply(&frames);
});
