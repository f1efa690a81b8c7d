//! Nothing but a home for `benches/local_store.rs`, the local store's write bench (issue 4,
//! docs/BENCHMARKS.md "Local store writes vs `pwrite`"); see this package's `Cargo.toml` for
//! why it is not in `ivdisk-store`.
