//! Fuzzes the snapshot loader with arbitrary files: it must never panic, and whatever it
//! accepts holds only images the index can load (checked bounds).
#![no_main]

use kvroute::gateway::snapshot::parse;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(loaded) = parse(text) {
        let index = kvroute_index::Index::new();
        for (name, (_, ranks)) in &loaded.workers {
            for (rank, (_, image)) in ranks {
                assert!(image.check().is_ok());
                index
                    .import_rank(&name.as_str().into(), *rank, image)
                    .expect("a checked image loads");
            }
        }
    }
});
