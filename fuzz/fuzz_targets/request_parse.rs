//! Fuzzes the gateway's parse and validate stages with arbitrary request bodies, as completions
//! and as chat: they must never panic, a refusal is a client error (4xx) naming a field or
//! none, and a body that passes reaches the engine unchanged.
#![no_main]

use kvroute::gateway::request::parse;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let models = vec!["m".to_string(), "lora-a".to_string()];
    for chat in [false, true] {
        match parse(data, chat, &models) {
            Ok(p) => {
                let again: serde_json::Value =
                    serde_json::from_slice(data).expect("a body that passed is JSON");
                assert_eq!(p.body, again);
                assert!(models.contains(&p.model));
            }
            Err(e) => assert!(e.status.is_client_error()),
        }
    }
});
