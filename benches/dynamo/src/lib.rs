//! kvroute-bench-dynamo: empty library; the comparison lives in `benches/radix.rs`.
