//! Model-based randomized test: random sequences of read, write, discard, write-zeroes (both
//! `may_unmap` values) and flush at random byte offsets and lengths, checked against a plain
//! `Vec<u8>` after every read, across a close and reopen, and with a full read at the end;
//! for every suite × layout combination, on the memory and local backends, with 4096- and
//! 512-byte sectors and small objects so that requests cross objects.
//!
//! Replay a failure with the seed it prints: `IVDISK_TEST_SEED=0x... cargo test -p
//! ivdisk-image --test model TEST`; `IVDISK_MODEL_ONLY=SUBSTRING` runs only the cases whose
//! name contains it.

mod common;

use common::{run_all, Backend, Case};
use ivdisk_crypto::Suite;

/// Every combination, with two object sizes; `ops` operations each.
fn matrix(backend: Backend, sector_size: u32, object_sizes: [u64; 2], ops: usize) -> Vec<Case> {
    let combos = common::combinations();
    let mut cases = Vec::new();
    for (suite, layout) in combos {
        for object_size in object_sizes {
            cases.push(Case::new(
                backend,
                suite,
                layout,
                sector_size,
                object_size,
                ops,
            ));
        }
    }
    cases
}

#[test]
fn the_matrix_has_every_combination() {
    let combos = common::combinations();
    // Four suites with metadata x five layouts, two without x `none`.
    assert_eq!(combos.len(), 22, "{combos:?}");
    for suite in Suite::ALL {
        let layouts = combos.iter().filter(|(s, _)| *s == suite).count();
        let expect = if suite.metadata_len() == 0 { 1 } else { 5 };
        assert_eq!(layouts, expect, "{suite}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_memory_4k() {
    run_all(
        "model_memory_4k",
        matrix(Backend::Memory, 4096, [16 << 10, 64 << 10], 120),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_memory_512() {
    run_all(
        "model_memory_512",
        matrix(Backend::Memory, 512, [4 << 10, 16 << 10], 120),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_local_4k() {
    run_all(
        "model_local_4k",
        matrix(Backend::Local, 4096, [16 << 10, 64 << 10], 120),
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn model_local_512() {
    run_all(
        "model_local_512",
        matrix(Backend::Local, 512, [4 << 10, 16 << 10], 120),
    )
    .await;
}
