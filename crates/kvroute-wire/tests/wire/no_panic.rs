//! Arbitrary bytes never panic the decoders; mutated real batches never panic either, and a
//! well-formed batch of any shape loses no event.

use crate::common;

use common::*;
use kvroute_index::WorkerId;
use kvroute_wire::{decode_batch, decode_message, parse_replay_reply, Dialect};
use proptest::prelude::*;

fn sample_payload() -> Vec<u8> {
    batch(
        vec![
            good_stored(&[1, u64::MAX]),
            removed(&[3], Some(2)),
            M::A(vec![s("AllBlocksCleared")]),
            M::A(vec![
                s("BlockStored"),
                M::A(vec![M::I(-4)]),
                M::Nil,
                M::A(vec![M::U(1)]),
                M::U(1),
            ]),
        ],
        1,
    )
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 2000, ..ProptestConfig::default() })]

    #[test]
    fn arbitrary_bytes_never_panic_the_batch_decoder(bytes in proptest::collection::vec(any::<u8>(), 0..512)) {
        let w: WorkerId = "w".into();
        let _ = decode_batch(&w, &bytes, Dialect::Vllm);
        let _ = decode_batch(&w, &bytes, Dialect::Sglang);
    }

    #[test]
    fn arbitrary_frames_never_panic_the_message_parsers(
        frames in proptest::collection::vec(proptest::collection::vec(any::<u8>(), 0..64), 0..6)
    ) {
        let w: WorkerId = "w".into();
        let refs: Vec<&[u8]> = frames.iter().map(|f| f.as_slice()).collect();
        let _ = decode_message(&w, &refs);
        let _ = parse_replay_reply(&refs);
    }

    #[test]
    fn mutated_real_batches_never_panic(
        edits in proptest::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 1..8),
        cut in any::<prop::sample::Index>(),
    ) {
        let w: WorkerId = "w".into();
        let mut p = sample_payload();
        for (i, b) in edits {
            let at = i.index(p.len());
            p[at] = b;
        }
        let _ = decode_batch(&w, &p, Dialect::Vllm);
        let _ = decode_batch(&w, &p[..cut.index(p.len())], Dialect::Vllm);
    }

    #[test]
    fn well_formed_batches_of_any_shape_deliver_every_event(
        stores in proptest::collection::vec(proptest::collection::vec(any::<u64>(), 0..20), 0..20),
        rank in 0u32..8,
    ) {
        let w: WorkerId = "w".into();
        let events: Vec<M> = stores.iter().map(|h| good_stored(h)).collect();
        let b = decode_batch(&w, &batch(events, rank), Dialect::Vllm).expect("well-formed");
        prop_assert!(b.drops.is_empty());
        prop_assert_eq!(b.events.len(), stores.len());
        for (e, hashes) in b.events.iter().zip(&stores) {
            let kvroute_index::Event::Stored(s) = e else { panic!("store expected") };
            let got: Vec<u64> = s.hashes.iter().map(|h| h.value.0).collect();
            prop_assert_eq!(&got, hashes);
            prop_assert_eq!(s.dp_rank, rank);
        }
    }
}
