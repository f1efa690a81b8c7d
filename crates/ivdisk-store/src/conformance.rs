//! The conformance suite: the one set of tests every [`ObjectStore`] backend runs (memory,
//! local, RADOS against a real cluster), so that the image layer can rely on the same promises
//! whichever store it is given.
//!
//! A backend's test file provides a factory and expands the suite:
//!
//! ```ignore
//! async fn store() -> ivdisk_store::conformance::Clients<MyStore> { /* a fresh store */ }
//! mod conformance {
//!     ivdisk_store::conformance_tests!(super::store);
//! }
//! ```
//!
//! Each case is also a public `async fn` taking [`Clients`], for a backend that wants to run a
//! case by hand. Cases panic on failure.
//!
//! Objects: every case names its objects under its own prefix (`conformance.<run>.<case>/`,
//! where `<run>` is random per process), because the cases of one run share a store (a RADOS
//! pool) and run in parallel; a case never assumes the store is empty outside its prefix.
//!
//! Semantics the suite pins down where the trait's docs leave room:
//! - Snapshots follow RADOS self-managed snapshots. A write preserves the object's state for a
//!   snapshot only if it runs under a [`SnapContext`] naming that snapshot and newer than the
//!   object's last snapshotted write. A write **without** a snap context preserves nothing: a
//!   read at a snapshot that has no preserved state of the object sees the object as it is now
//!   (the head), or `NotFound` if the object was created or removed under a context newer than
//!   that snapshot.
//! - `OmapSet` creates the object (as in RADOS); `WriteFull` keeps the omap (as in RADOS).
//! - Versions are per object and strictly increase with every successful write operation,
//!   across a removal too (a recreated object never reuses an earlier version); operations a
//!   store applied as one ([`ObjectStore::merges_operations`]) share their version.
//! - Extents returned by a sparse read may be split or merged at any boundary: the suite merges
//!   touching extents before comparing.
//! - "Submitted" (for the ordering promise) means the operation's future was first polled.

use std::any::Any;
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use futures_util::future::join_all;

use crate::{
    Extent, LockRequest, Locker, ObjectName, ObjectStore, ObjectStoreExt, ReadOp, ReadResult,
    ReadStep, SnapContext, SnapId, Stat, StoreError, WriteOp, WriteStep, MAX_OBJECT_SIZE,
};

/// Two clients of one fresh, empty store (`b` is a second client identity on the same store,
/// for locks); `guard` keeps backing resources (temp dirs, clusters) alive. It is dropped after
/// the clients.
pub struct Clients<S> {
    pub a: S,
    pub b: S,
    pub guard: Box<dyn Any + Send>,
}

impl<S> Clients<S> {
    pub fn new(a: S, b: S, guard: impl Any + Send) -> Self {
        Clients {
            a,
            b,
            guard: Box::new(guard),
        }
    }
}

/// Expands, in the caller's module, to one `#[tokio::test]` per conformance case, each running
/// the case on `$factory().await` (an `async fn() -> Clients<S>` giving a fresh store). The
/// caller needs `tokio` (features `macros`, `rt-multi-thread`) among its dev-dependencies.
///
/// With `skip_if: $skip` (a `fn() -> Option<String>`), each case first asks `$skip()` and, given
/// a reason, says loudly on stderr that it is skipped and why, and passes without running.
#[macro_export]
macro_rules! conformance_tests {
    ($factory:path) => {
        $crate::conformance_tests!($factory, skip_if: $crate::conformance::never_skip);
    };
    ($factory:path, skip_if: $skip:path) => {
        $crate::conformance_tests!(@cases $factory, $skip;
            write_and_read,
            sparse_reads,
            truncate_shrinks_and_grows,
            remove_deletes_data_and_omap,
            create_exclusive_and_asserts,
            versions_increase,
            multi_step_ops_are_atomic,
            omap,
            concurrent_ops_stay_atomic,
            ops_apply_in_submission_order,
            many_objects_in_flight,
            list_by_prefix,
            bad_input,
            snapshot_reads,
            snapshot_rollback,
            snapshot_remove,
            snapshot_without_context,
            list_at_snapshot,
            locks,
            lock_expiry,
            flush,
        );
    };
    // Every public case of this module, by name: add new cases to the list above too.
    (@cases $factory:path, $skip:path; $($case:ident),* $(,)?) => {
        $(
            #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
            async fn $case() {
                if let Some(reason) = $skip() {
                    eprintln!(
                        "SKIPPED: conformance case {} not run: {reason}",
                        stringify!($case)
                    );
                    return;
                }
                $crate::conformance::$case($factory().await).await;
            }
        )*
    };
}

/// The default of `conformance_tests!`: run every case.
pub fn never_skip() -> Option<String> {
    None
}

// ---------------------------------------------------------------------------------------------
// Helpers

/// Panics unless `$result` is an `Err` matching the pattern (and guard); fields bind by
/// reference.
macro_rules! assert_err {
    ($result:expr, $($pattern:tt)+) => {
        match $result {
            Err(ref e) if matches!(e, $($pattern)+) => {}
            ref other => panic!(
                "expected Err({}), got {:?}",
                stringify!($($pattern)+),
                other
            ),
        }
    };
}

/// 4 KiB: extents in the sparse tests are aligned to it, so that stores which track allocation
/// in blocks (BlueStore) report exactly what was written.
const K: u64 = 4096;

/// Reads of a "whole" object cover this much (test objects are smaller).
const WHOLE: u64 = 1 << 20;

/// Random per process, so that reruns against a persistent pool never meet old objects.
fn run_token() -> &'static str {
    static TOKEN: OnceLock<String> = OnceLock::new();
    TOKEN.get_or_init(|| {
        let mut bytes = [0u8; 4];
        getrandom::getrandom(&mut bytes).expect("a random run token");
        hex::encode(bytes)
    })
}

/// The prefix of every object of one case.
fn case_prefix(case: &str) -> String {
    format!("conformance.{}.{case}/", run_token())
}

fn name(prefix: &str, suffix: impl fmt::Display) -> ObjectName {
    ObjectName::new(format!("{prefix}{suffix}")).expect("a valid test object name")
}

/// `len` bytes that differ with `seed` and with position (no period shorter than 64 KiB).
fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed) ^ (i >> 8) as u8)
        .collect()
}

fn zeros(len: u64) -> Vec<u8> {
    vec![0; len as usize]
}

fn kv(key: impl AsRef<[u8]>, value: impl AsRef<[u8]>) -> (Vec<u8>, Vec<u8>) {
    (key.as_ref().to_vec(), value.as_ref().to_vec())
}

fn ext(offset: u64, data: impl AsRef<[u8]>) -> (u64, Vec<u8>) {
    (offset, data.as_ref().to_vec())
}

fn concat(parts: &[&[u8]]) -> Vec<u8> {
    parts.concat()
}

/// Checks that extents are well formed (non-empty, sorted, disjoint, inside `[start, end)`)
/// and merges touching ones, since a store may split or join extents at any boundary.
fn normalize(extents: &[Extent], start: u64, end: u64) -> Vec<(u64, Vec<u8>)> {
    let mut out: Vec<(u64, Vec<u8>)> = Vec::new();
    let mut previous_end = start;
    for Extent { offset, data } in extents {
        let extent_end = offset + data.len() as u64;
        assert!(!data.is_empty(), "empty extent at {offset}");
        assert!(
            previous_end <= *offset && extent_end <= end,
            "extent [{offset}, {extent_end}) overlaps the previous one (ending at \
             {previous_end}) or lies outside the range read [{start}, {end})"
        );
        match out.last_mut() {
            Some((last, bytes)) if *last + bytes.len() as u64 == *offset => {
                bytes.extend_from_slice(data)
            }
            _ => out.push((*offset, data.clone())),
        }
        previous_end = extent_end;
    }
    out
}

/// The written extents of `[offset, offset + len)`, normalized, as compared with the expected
/// extents. On a backend that cannot tell holes from written zeros
/// ([`ObjectStore::distinguishes_holes`] is false) the comparison is of the bytes instead:
/// both sides filled out with zeros over the range read, clipped to the object's size.
async fn sparse<S: ObjectStore>(store: &S, object: &ObjectName, offset: u64, len: u64) -> Sparse {
    let extents = store.read_sparse(object, offset, len).await.unwrap();
    let extents = normalize(&extents, offset, offset + len);
    let dense = if store.distinguishes_holes() {
        None
    } else {
        let end = stat_of(store, object).await.size.min(offset + len);
        Some((offset, end.max(offset)))
    };
    Sparse { extents, dense }
}

/// What [`sparse`] read: compares equal to the expected extents (see there).
struct Sparse {
    extents: Vec<(u64, Vec<u8>)>,
    /// The range compared byte by byte, on a backend without holes.
    dense: Option<(u64, u64)>,
}

fn densify(extents: &[(u64, Vec<u8>)], start: u64, end: u64) -> Vec<u8> {
    let mut out = zeros(end - start);
    for (offset, data) in extents {
        for (i, byte) in data.iter().enumerate() {
            let at = offset + i as u64;
            if (start..end).contains(&at) {
                out[(at - start) as usize] = *byte;
            }
        }
    }
    out
}

impl PartialEq<Vec<(u64, Vec<u8>)>> for Sparse {
    fn eq(&self, expected: &Vec<(u64, Vec<u8>)>) -> bool {
        match self.dense {
            None => self.extents == *expected,
            Some((start, end)) => {
                densify(&self.extents, start, end) == densify(expected, start, end)
            }
        }
    }
}

impl fmt::Debug for Sparse {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.extents)?;
        if let Some((start, end)) = self.dense {
            write!(f, " (compared as bytes over [{start}, {end}))")?;
        }
        Ok(())
    }
}

fn stat(size: u64, version: u64) -> Stat {
    Stat { size, version }
}

/// Size and version of an object that must exist.
async fn stat_of<S: ObjectStore>(store: &S, object: &ObjectName) -> Stat {
    store
        .stat(object)
        .await
        .unwrap()
        .unwrap_or_else(|| panic!("{object:?} should exist"))
}

/// An object's whole state as one read sees it (versions aside).
#[derive(Clone, PartialEq, Eq)]
struct State {
    size: u64,
    data: Vec<u8>,
    omap: Vec<(Vec<u8>, Vec<u8>)>,
}

impl State {
    fn new(data: impl AsRef<[u8]>, mut omap: Vec<(Vec<u8>, Vec<u8>)>) -> State {
        omap.sort();
        let data = data.as_ref().to_vec();
        State {
            size: data.len() as u64,
            data,
            omap,
        }
    }
}

/// Bytes as runs (`'A'x100 00x12 ...`), so that a failed comparison stays readable.
struct Runs<'a>(&'a [u8]);

impl fmt::Debug for Runs<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mut rest = self.0;
        let mut first = true;
        while let Some(&byte) = rest.first() {
            let run = rest.iter().take_while(|&&b| b == byte).count();
            let sep = if first { "" } else { " " };
            if byte.is_ascii_graphic() {
                write!(f, "{sep}'{}'", byte as char)?;
            } else {
                write!(f, "{sep}{byte:02x}")?;
            }
            if run > 1 {
                write!(f, "x{run}")?;
            }
            rest = &rest[run..];
            first = false;
        }
        Ok(())
    }
}

impl fmt::Debug for State {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let omap: Vec<_> = self.omap.iter().map(|(k, v)| (Runs(k), Runs(v))).collect();
        f.debug_struct("State")
            .field("size", &self.size)
            .field("data", &Runs(&self.data))
            .field("omap", &omap)
            .finish()
    }
}

/// Reads data, size and omap in one operation, at the head or at a snapshot.
async fn read_state<S: ObjectStore>(
    store: &S,
    object: &ObjectName,
    snap: Option<SnapId>,
) -> Result<State, StoreError> {
    let op = ReadOp {
        steps: vec![
            ReadStep::Stat,
            ReadStep::Read {
                offset: 0,
                len: WHOLE,
            },
            ReadStep::OmapGetRange {
                start: Vec::new(),
                end: None,
                max: 100_000,
            },
        ],
        snap,
    };
    let results = store.read_op(object, op).await?;
    let [ReadResult::Stat(stat), ReadResult::Extents(extents), ReadResult::Omap { pairs, more: false }] =
        results.as_slice()
    else {
        panic!("a stat + read + omap read returned {results:?}");
    };
    assert!(stat.size <= WHOLE, "test object larger than expected");
    let mut data = zeros(stat.size);
    for (offset, bytes) in normalize(extents, 0, stat.size) {
        data[offset as usize..offset as usize + bytes.len()].copy_from_slice(&bytes);
    }
    Ok(State {
        size: stat.size,
        data,
        omap: pairs.to_vec(),
    })
}

/// The single result of a one-step read.
async fn read_one<S: ObjectStore>(store: &S, object: &ObjectName, step: ReadStep) -> ReadResult {
    let mut results = store
        .read_op(object, ReadOp::new().step(step))
        .await
        .unwrap();
    assert_eq!(results.len(), 1, "one result per step");
    results.pop().unwrap()
}

/// The values of these keys, in key order.
async fn omap_get<S: ObjectStore>(
    store: &S,
    object: &ObjectName,
    keys: &[&[u8]],
) -> Vec<(Vec<u8>, Vec<u8>)> {
    let keys = keys.iter().map(|k| k.to_vec()).collect();
    match read_one(store, object, ReadStep::OmapGetByKeys(keys)).await {
        ReadResult::Omap { pairs, .. } => {
            let mut pairs = pairs.to_vec();
            pairs.sort();
            pairs
        }
        other => panic!("an omap read returned {other:?}"),
    }
}

/// Pairs and `more` of an omap range read.
async fn omap_range<S: ObjectStore>(
    store: &S,
    object: &ObjectName,
    start: &[u8],
    end: Option<&[u8]>,
    max: usize,
) -> (Vec<(Vec<u8>, Vec<u8>)>, bool) {
    let step = ReadStep::OmapGetRange {
        start: start.to_vec(),
        end: end.map(<[u8]>::to_vec),
        max,
    };
    match read_one(store, object, step).await {
        ReadResult::Omap { pairs, more } => (pairs.to_vec(), more),
        other => panic!("an omap read returned {other:?}"),
    }
}

fn lock_request(cookie: &str, duration: Option<Duration>, renew: bool) -> LockRequest {
    LockRequest {
        name: "lk".into(),
        cookie: cookie.into(),
        description: "d".into(),
        duration,
        renew,
    }
}

// ---------------------------------------------------------------------------------------------
// Data

/// Writes at offsets grow the object; a dense read shows holes as zeros and stops at the size;
/// stat reports the size and the version the last write returned; `WriteFull` replaces the
/// content (keeping the omap); a zero-length write creates an empty object.
pub async fn write_and_read<S: ObjectStore>(c: Clients<S>) {
    let p = case_prefix("write_and_read");
    let s = &c.a;
    let o = name(&p, "obj");

    assert_eq!(s.stat(&o).await.unwrap(), None);
    let v1 = s.write(&o, 0, b"hello").await.unwrap().version;
    let v2 = s.write(&o, 10, b"world").await.unwrap().version;
    assert!(v1 < v2);
    assert_eq!(stat_of(s, &o).await, stat(15, v2));
    assert_eq!(s.read(&o, 0, 100).await.unwrap(), b"hello\0\0\0\0\0world");
    assert_eq!(s.read(&o, 3, 4).await.unwrap(), b"lo\0\0");
    assert_eq!(
        s.read(&o, 12, 100).await.unwrap(),
        b"rld",
        "reads stop at the size"
    );
    assert_eq!(s.read(&o, 15, 10).await.unwrap(), b"");
    assert_eq!(s.read(&o, 1000, 10).await.unwrap(), b"");
    assert_eq!(s.read(&o, 0, 0).await.unwrap(), b"");

    // Overwrite across data and hole.
    s.write(&o, 4, b"XYZ").await.unwrap();
    assert_eq!(s.read(&o, 0, 100).await.unwrap(), b"hellXYZ\0\0\0world");

    // A larger write at an unaligned offset past the end.
    let big = pattern(7, 10_000);
    s.write(&o, 5_001, &big).await.unwrap();
    assert_eq!(stat_of(s, &o).await.size, 15_001);
    assert_eq!(s.read(&o, 5_001, 20_000).await.unwrap(), big);
    assert_eq!(s.read(&o, 15, 4_986).await.unwrap(), zeros(4_986));
    assert_eq!(s.read(&o, 0, 15).await.unwrap(), b"hellXYZ\0\0\0world");

    // WriteFull replaces the content, shrinking the object; the omap stays.
    s.write_op(&o, WriteOp::new().omap_set(vec![kv(b"key", b"value")]))
        .await
        .unwrap();
    let v = s
        .write_op(
            &o,
            WriteOp::new().step(WriteStep::WriteFull(b"new".to_vec())),
        )
        .await
        .unwrap()
        .version;
    assert_eq!(stat_of(s, &o).await, stat(3, v));
    assert_eq!(
        read_state(s, &o, None).await.unwrap(),
        State::new(b"new", vec![kv(b"key", b"value")])
    );
    // Growing again does not bring old bytes back.
    s.write(&o, 10, b"!").await.unwrap();
    assert_eq!(s.read(&o, 0, 100).await.unwrap(), b"new\0\0\0\0\0\0\0!");

    // A zero-length write creates an empty object.
    let empty = name(&p, "empty");
    let v = s.write(&empty, 0, b"").await.unwrap().version;
    assert_eq!(stat_of(s, &empty).await, stat(0, v));
    assert_eq!(s.read(&empty, 0, 10).await.unwrap(), b"");
    assert_eq!(sparse(s, &empty, 0, 10).await, vec![]);

    // WriteFull of nothing creates an empty object too.
    let empty_full = name(&p, "empty-full");
    s.write_op(
        &empty_full,
        WriteOp::new().step(WriteStep::WriteFull(Vec::new())),
    )
    .await
    .unwrap();
    assert_eq!(stat_of(s, &empty_full).await.size, 0);
}

/// `ReadStep::Read` returns only written extents: written zeros are an extent, holes are not;
/// `Zero` punches a hole (size unchanged) that sparse reads then skip; extents are clipped to
/// the range read and to the size.
pub async fn sparse_reads<S: ObjectStore>(c: Clients<S>) {
    let p = case_prefix("sparse_reads");
    let s = &c.a;
    let o = name(&p, "obj");
    let a = pattern(1, 3 * K as usize);
    let b = pattern(2, K as usize);

    // [0, 3K) data, [3K, 4K) hole, [4K, 5K) written zeros, [5K, 7K) hole, [7K, 8K) data.
    s.write(&o, 0, &a).await.unwrap();
    s.write(&o, 4 * K, &zeros(K)).await.unwrap();
    s.write(&o, 7 * K, &b).await.unwrap();
    assert_eq!(stat_of(s, &o).await.size, 8 * K);
    assert_eq!(
        sparse(s, &o, 0, 8 * K).await,
        vec![ext(0, &a), ext(4 * K, zeros(K)), ext(7 * K, &b)]
    );

    // Clipped to the range read.
    let start = K + 100;
    assert_eq!(
        sparse(s, &o, start, 6 * K).await,
        vec![
            ext(start, &a[start as usize..]),
            ext(4 * K, zeros(K)),
            ext(7 * K, &b[..100]),
        ]
    );
    // Clipped to the size.
    assert_eq!(sparse(s, &o, 7 * K, 100 * K).await, vec![ext(7 * K, &b)]);
    // Holes, the end, beyond the end, nothing.
    assert_eq!(sparse(s, &o, 3 * K, K).await, vec![]);
    assert_eq!(sparse(s, &o, 5 * K, 2 * K).await, vec![]);
    assert_eq!(sparse(s, &o, 8 * K, K).await, vec![]);
    assert_eq!(sparse(s, &o, 100 * K, K).await, vec![]);
    assert_eq!(sparse(s, &o, 0, 0).await, vec![]);

    // Zero punches holes; the size stays.
    s.write_op(
        &o,
        WriteOp::new().step(WriteStep::Zero {
            offset: 4 * K,
            len: K,
        }),
    )
    .await
    .unwrap();
    s.write_op(
        &o,
        WriteOp::new().step(WriteStep::Zero { offset: K, len: K }),
    )
    .await
    .unwrap();
    assert_eq!(stat_of(s, &o).await.size, 8 * K);
    assert_eq!(
        sparse(s, &o, 0, 8 * K).await,
        vec![
            ext(0, &a[..K as usize]),
            ext(2 * K, &a[2 * K as usize..]),
            ext(7 * K, &b),
        ]
    );
    let expected = concat(&[&a[..K as usize], &zeros(K), &a[2 * K as usize..]]);
    assert_eq!(s.read(&o, 0, 3 * K).await.unwrap(), expected);

    // Writing zeros into the hole makes it an extent again.
    s.write(&o, K, &zeros(K)).await.unwrap();
    assert_eq!(
        sparse(s, &o, 0, 8 * K).await,
        vec![
            ext(
                0,
                concat(&[&a[..K as usize], &zeros(K), &a[2 * K as usize..]])
            ),
            ext(7 * K, &b),
        ]
    );

    // A Zero that reaches the end: what it covers reads as zeros, what is before it as it
    // was. The size stays, or is cut to the Zero's start (RADOS turns such a ZERO into a
    // TRUNCATE): callers must not tell an object's end from its size after one.
    let end = name(&p, "zero-to-end");
    s.write(&end, 0, &a[..(2 * K) as usize]).await.unwrap();
    s.write_op(
        &end,
        WriteOp::new().step(WriteStep::Zero { offset: K, len: K }),
    )
    .await
    .unwrap();
    let size = stat_of(s, &end).await.size;
    assert!(size == 2 * K || size == K, "size {size}");
    assert_eq!(
        s.read(&end, 0, 2 * K).await.unwrap()[..],
        concat(&[&a[..K as usize], &zeros(size - K)])[..]
    );

    // Steps of no length are accepted and change nothing: Zero inside the object or past
    // its end (on RADOS such a ZERO, sent, aborted the OSD), Write inside it. (A Write of no
    // length past the end grows the object on every backend, RADOS included; not relied on.)
    let before = s.read(&o, 0, 8 * K).await.unwrap();
    s.write_op(
        &o,
        WriteOp::new()
            .step(WriteStep::Zero {
                offset: 3 * K,
                len: 0,
            })
            .step(WriteStep::Zero {
                offset: 100 * K,
                len: 0,
            })
            .write(2 * K, Vec::new()),
    )
    .await
    .unwrap();
    s.write_op(
        &o,
        WriteOp::new().step(WriteStep::Zero {
            offset: 5 * K,
            len: 0,
        }),
    )
    .await
    .unwrap();
    assert_eq!(stat_of(s, &o).await.size, 8 * K);
    assert_eq!(s.read(&o, 0, 8 * K).await.unwrap(), before);
}

/// Truncate shrinks (the data beyond is gone: growing again reads zeros, as a hole) and grows
/// (the new part is a hole); truncating to 0 leaves an existing, empty object.
pub async fn truncate_shrinks_and_grows<S: ObjectStore>(c: Clients<S>) {
    let p = case_prefix("truncate_shrinks_and_grows");
    let s = &c.a;
    let o = name(&p, "obj");
    let data = pattern(3, 2 * K as usize);
    let truncate = |size| WriteOp::new().step(WriteStep::Truncate(size));

    let v0 = s.write(&o, 0, &data).await.unwrap().version;
    let v1 = s.write_op(&o, truncate(3000)).await.unwrap().version;
    assert!(v0 < v1);
    assert_eq!(stat_of(s, &o).await, stat(3000, v1));
    assert_eq!(s.read(&o, 0, 2 * K).await.unwrap(), &data[..3000]);

    // Regrow: the dropped bytes do not come back, the new part is a hole.
    s.write_op(&o, truncate(2 * K)).await.unwrap();
    assert_eq!(stat_of(s, &o).await.size, 2 * K);
    let expected = concat(&[&data[..3000], &zeros(2 * K - 3000)]);
    assert_eq!(s.read(&o, 0, 2 * K).await.unwrap(), expected);
    assert_eq!(sparse(s, &o, 0, 2 * K).await, vec![ext(0, &data[..3000])]);

    // Grow far.
    s.write_op(&o, truncate(100 * K)).await.unwrap();
    assert_eq!(stat_of(s, &o).await.size, 100 * K);
    assert_eq!(sparse(s, &o, 0, 100 * K).await, vec![ext(0, &data[..3000])]);
    assert_eq!(s.read(&o, 99 * K, 2 * K).await.unwrap(), zeros(K));

    // Truncate to 0: exists, empty.
    s.write_op(&o, truncate(0)).await.unwrap();
    assert_eq!(stat_of(s, &o).await.size, 0);
    assert_eq!(s.read(&o, 0, K).await.unwrap(), b"");
    assert_eq!(sparse(s, &o, 0, K).await, vec![]);
}

/// Remove deletes data and omap (stat `None`, reads `NotFound`, version 0 reported); a
/// recreated object starts empty; removing a missing object is `NotFound`.
pub async fn remove_deletes_data_and_omap<S: ObjectStore>(c: Clients<S>) {
    let p = case_prefix("remove_deletes_data_and_omap");
    let s = &c.a;
    let o = name(&p, "obj");

    s.write_op(
        &o,
        WriteOp::new()
            .write(0, pattern(4, 5000))
            .omap_set(vec![kv(b"a", b"1"), kv(b"b", b"2")]),
    )
    .await
    .unwrap();
    assert_eq!(s.remove(&o).await.unwrap().version, 0);
    assert_eq!(s.stat(&o).await.unwrap(), None);
    assert_err!(s.read(&o, 0, 10).await, StoreError::NotFound { object } if object == o.as_str());
    assert_err!(s.read_sparse(&o, 0, 10).await, StoreError::NotFound { .. });
    assert_err!(s.omap_all(&o).await, StoreError::NotFound { .. });
    assert_err!(read_state(s, &o, None).await, StoreError::NotFound { .. });

    // Recreate: nothing of the old object is left.
    s.write(&o, 0, b"x").await.unwrap();
    assert_eq!(
        read_state(s, &o, None).await.unwrap(),
        State::new(b"x", vec![])
    );

    // Removing what does not exist.
    s.remove(&o).await.unwrap();
    assert_err!(s.remove(&o).await, StoreError::NotFound { object } if object == o.as_str());
    assert_err!(
        s.remove(&name(&p, "never")).await,
        StoreError::NotFound { .. }
    );
}

/// `CreateExclusive` creates an empty object and fails `Exists` when it exists;
/// `AssertExists` fails `NotFound` on a missing object; `AssertVersion` fails
/// `VersionMismatch` reporting both versions. A failing assertion stops the whole operation.
pub async fn create_exclusive_and_asserts<S: ObjectStore>(c: Clients<S>) {
    let p = case_prefix("create_exclusive_and_asserts");
    let s = &c.a;
    let o = name(&p, "obj");
    let create = || WriteOp::new().step(WriteStep::CreateExclusive);

    let v = s.write_op(&o, create()).await.unwrap().version;
    assert_eq!(stat_of(s, &o).await, stat(0, v));
    assert_eq!(s.omap_all(&o).await.unwrap(), vec![]);
    assert_err!(s.write_op(&o, create()).await, StoreError::Exists { object } if object == o.as_str());
    s.write(&o, 0, b"data").await.unwrap();
    assert_err!(
        s.write_op(&o, create().write(0, b"XXXX")).await,
        StoreError::Exists { .. }
    );
    assert_eq!(s.read(&o, 0, 10).await.unwrap(), b"data");

    // CreateExclusive followed by more steps on a missing object.
    let o2 = name(&p, "created-with-data");
    s.write_op(
        &o2,
        create().write(0, b"abc").omap_set(vec![kv(b"k", b"v")]),
    )
    .await
    .unwrap();
    assert_eq!(
        read_state(s, &o2, None).await.unwrap(),
        State::new(b"abc", vec![kv(b"k", b"v")])
    );

    // AssertExists.
    let missing = name(&p, "missing");
    let assert_exists = || WriteOp::new().step(WriteStep::AssertExists);
    assert_err!(
        s.write_op(&missing, assert_exists().write(0, b"x")).await,
        StoreError::NotFound { object } if object == missing.as_str()
    );
    assert_eq!(s.stat(&missing).await.unwrap(), None);
    s.write_op(&o, assert_exists().write(4, b"!"))
        .await
        .unwrap();
    assert_eq!(s.read(&o, 0, 10).await.unwrap(), b"data!");

    // AssertVersion.
    let current = stat_of(s, &o).await.version;
    let assert_version = |v| WriteOp::new().step(WriteStep::AssertVersion(v));
    let next = s
        .write_op(&o, assert_version(current).write(0, b"D"))
        .await
        .unwrap()
        .version;
    assert!(next > current);
    for wrong in [current, next + 1000] {
        assert_err!(
            s.write_op(&o, assert_version(wrong).write(0, b"?")).await,
            StoreError::VersionMismatch { expected, actual, .. }
                if *expected == wrong && *actual == next
        );
    }
    assert_eq!(stat_of(s, &o).await, stat(5, next));
    assert_eq!(s.read(&o, 0, 10).await.unwrap(), b"Data!");
    // On a missing object it is `NotFound` (to the OSD a missing object is at version 0, a
    // mismatch), and creates nothing.
    let missing = name(&p, "never-made");
    assert_err!(
        s.write_op(&missing, assert_version(5).write(0, b"x")).await,
        StoreError::NotFound { .. }
    );
    assert!(s.stat(&missing).await.unwrap().is_none());
}

/// Every successful write operation, whatever its steps, returns a version greater than the
/// object's previous one, and stat reports it; reads and failed operations change nothing,
/// version included; a recreated object continues above its earlier versions.
pub async fn versions_increase<S: ObjectStore>(c: Clients<S>) {
    let p = case_prefix("versions_increase");
    let s = &c.a;
    let o = name(&p, "obj");

    let ops = [
        WriteOp::new().step(WriteStep::CreateExclusive),
        WriteOp::new().write(0, pattern(5, 3000)),
        WriteOp::new().write(0, pattern(5, 3000)), // same bytes again: still a new version
        WriteOp::new().step(WriteStep::WriteFull(b"full".to_vec())),
        WriteOp::new().omap_set(vec![kv(b"k", b"v")]),
        WriteOp::new().step(WriteStep::OmapRemoveKeys(vec![b"k".to_vec()])),
        WriteOp::new().step(WriteStep::OmapRemoveRange {
            start: b"a".to_vec(),
            end: b"z".to_vec(),
        }),
        WriteOp::new().step(WriteStep::OmapClear),
        WriteOp::new().step(WriteStep::Zero { offset: 0, len: 2 }),
        WriteOp::new().step(WriteStep::Truncate(10)),
        WriteOp::new().step(WriteStep::Truncate(10)),
        WriteOp::new().step(WriteStep::AssertExists).write(0, b"x"),
    ];
    let mut last = 0;
    for op in ops {
        let what = format!("{op:?}");
        let v = s.write_op(&o, op).await.unwrap().version;
        assert!(v > last, "{what} returned version {v}, not above {last}");
        assert_eq!(stat_of(s, &o).await.version, v);
        last = v;
    }

    // Reads change nothing.
    let before = read_state(s, &o, None).await.unwrap();
    assert_eq!(stat_of(s, &o).await.version, last);

    // Failed operations change nothing, version included.
    let failing = [
        WriteOp::new()
            .write(0, b"y")
            .step(WriteStep::CreateExclusive),
        WriteOp::new()
            .write(0, b"y")
            .step(WriteStep::AssertVersion(last + 1)),
        WriteOp::new()
            .omap_set(vec![kv(b"k", b"v")])
            .write(MAX_OBJECT_SIZE, b"y"),
    ];
    for op in failing {
        let what = format!("{op:?}");
        assert!(s.write_op(&o, op).await.is_err(), "{what} should fail");
        assert_eq!(stat_of(s, &o).await.version, last, "after failing {what}");
        assert_eq!(read_state(s, &o, None).await.unwrap(), before);
    }

    // Removal reports 0; the recreated object's versions continue above the old ones (an
    // AssertVersion taken before the removal can never match the new object).
    assert_eq!(s.remove(&o).await.unwrap().version, 0);
    let v = s.write(&o, 0, b"again").await.unwrap().version;
    assert!(v > last, "recreated at version {v}, not above {last}");
}

/// The steps of one operation apply in order and all or nothing: an operation whose last
/// step fails leaves no write and no omap change behind (on an existing or a missing object);
/// one that succeeds applies every step.
pub async fn multi_step_ops_are_atomic<S: ObjectStore>(c: Clients<S>) {
    let p = case_prefix("multi_step_ops_are_atomic");
    let s = &c.a;
    let o = name(&p, "obj");

    let v0 = s
        .write_op(
            &o,
            WriteOp::new()
                .write(0, vec![b'A'; K as usize])
                .omap_set(vec![kv(b"k", b"old")]),
        )
        .await
        .unwrap()
        .version;
    let before = State::new(vec![b'A'; K as usize], vec![kv(b"k", b"old")]);

    let doomed = |last: WriteStep| {
        WriteOp::new()
            .write(0, vec![b'B'; K as usize])
            .omap_set(vec![kv(b"k", b"new"), kv(b"k2", b"added")])
            .write(8 * K, vec![b'C'; K as usize])
            .step(last)
    };
    assert_err!(
        s.write_op(&o, doomed(WriteStep::AssertVersion(v0 + 1))).await,
        StoreError::VersionMismatch { actual, .. } if *actual == v0
    );
    assert_err!(
        s.write_op(&o, doomed(WriteStep::CreateExclusive)).await,
        StoreError::Exists { .. }
    );
    assert_err!(
        s.write_op(
            &o,
            doomed(WriteStep::Write {
                offset: MAX_OBJECT_SIZE,
                data: b"!".to_vec(),
            })
        )
        .await,
        StoreError::OutOfRange { .. }
    );
    assert_eq!(read_state(s, &o, None).await.unwrap(), before);
    assert_eq!(stat_of(s, &o).await.version, v0);

    // On a missing object, a failed operation does not create it.
    let missing = name(&p, "missing");
    assert_err!(
        s.write_op(
            &missing,
            doomed(WriteStep::Write {
                offset: MAX_OBJECT_SIZE,
                data: b"!".to_vec(),
            })
        )
        .await,
        StoreError::OutOfRange { .. }
    );
    assert_eq!(s.stat(&missing).await.unwrap(), None);

    // A successful operation applies every step, in order.
    let op = WriteOp::new()
        .write(0, vec![b'X'; 100])
        .write(200, vec![b'Y'; 100])
        .write(50, b"zz")
        .omap_set(vec![kv(b"a", b"1"), kv(b"b", b"2"), kv(b"c", b"3")])
        .step(WriteStep::OmapRemoveKeys(vec![b"b".to_vec()]))
        .omap_set(vec![kv(b"c", b"33")])
        .step(WriteStep::Truncate(250));
    let v1 = s.write_op(&o, op).await.unwrap().version;
    assert!(v1 > v0);
    let mut data = vec![b'X'; 100];
    data[50..52].copy_from_slice(b"zz");
    data.extend(concat(&[&[b'A'; 100], &[b'Y'; 50]]));
    assert_eq!(
        read_state(s, &o, None).await.unwrap(),
        State::new(
            data,
            vec![kv(b"a", b"1"), kv(b"c", b"33"), kv(b"k", b"old")]
        )
    );

    // Order matters within an operation.
    let op = WriteOp::new()
        .step(WriteStep::Truncate(0))
        .write(0, b"first")
        .omap_set(vec![kv(b"gone", b"")])
        .step(WriteStep::OmapRemoveKeys(vec![b"gone".to_vec()]))
        .step(WriteStep::OmapRemoveKeys(vec![b"back".to_vec()]))
        .omap_set(vec![kv(b"back", b"here")]);
    s.write_op(&o, op).await.unwrap();
    assert_eq!(
        read_state(s, &o, None).await.unwrap(),
        State::new(
            b"first",
            vec![
                kv(b"a", b"1"),
                kv(b"back", b"here"),
                kv(b"c", b"33"),
                kv(b"k", b"old")
            ]
        )
    );
}

// ---------------------------------------------------------------------------------------------
// Omap

/// The omap: `OmapSet` creates the object, sets and overwrites; get by keys leaves missing keys
/// out; ranges honour start (inclusive), end (exclusive), max and report `more` only when keys
/// beyond `max` are in range; keys and ranges remove; a clear removes every key and leaves the
/// data alone, also on an object with no keys; a clear and removals of keys or of a range are
/// `NotFound` on a missing object; keys are
/// binary (0x00, 0xff) and ordered bytewise; `omap_all` pages over more than 1024 keys.
pub async fn omap<S: ObjectStore>(c: Clients<S>) {
    let p = case_prefix("omap");
    let s = &c.a;

    // Set, overwrite, get.
    let o = name(&p, "obj");
    let keys: Vec<String> = (0..10).map(|i| format!("r{i:02}")).collect();
    let pairs: Vec<_> = keys.iter().map(|k| kv(k, format!("v-{k}"))).collect();
    s.write_op(&o, WriteOp::new().omap_set(pairs))
        .await
        .unwrap();
    assert_eq!(
        stat_of(s, &o).await.size,
        0,
        "OmapSet creates an empty object"
    );
    s.write_op(&o, WriteOp::new().omap_set(vec![kv(b"r01", b"changed")]))
        .await
        .unwrap();
    assert_eq!(
        omap_get(s, &o, &[b"r03", b"missing", b"r01"]).await,
        vec![kv(b"r01", b"changed"), kv(b"r03", b"v-r03")]
    );
    assert_eq!(omap_get(s, &o, &[b"r1", b"r001"]).await, vec![]);

    // Ranges.
    let range = |from: usize, to: usize| -> Vec<(Vec<u8>, Vec<u8>)> {
        (from..to)
            .map(|i| {
                let value = if i == 1 {
                    "changed".into()
                } else {
                    format!("v-r{i:02}")
                };
                kv(format!("r{i:02}"), value)
            })
            .collect()
    };
    assert_eq!(
        omap_range(s, &o, b"r03", Some(b"r07"), 10).await,
        (range(3, 7), false)
    );
    assert_eq!(
        omap_range(s, &o, b"r03", Some(b"r07"), 2).await,
        (range(3, 5), true)
    );
    assert_eq!(
        omap_range(s, &o, b"r03", Some(b"r07"), 4).await,
        (range(3, 7), false),
        "exactly max keys in range, more keys beyond the end: not `more`"
    );
    assert_eq!(
        omap_range(s, &o, b"r035", Some(b"r06"), 10).await,
        (range(4, 6), false)
    );
    assert_eq!(
        omap_range(s, &o, b"r03", Some(b"r07"), usize::MAX).await,
        (range(3, 7), false),
        "no limit (usize::MAX) is all keys in range"
    );
    assert_eq!(omap_range(s, &o, b"", None, 3).await, (range(0, 3), true));
    assert_eq!(
        omap_range(s, &o, b"", None, 10).await,
        (range(0, 10), false)
    );
    assert_eq!(
        omap_range(s, &o, b"r09", None, 1).await,
        (range(9, 10), false)
    );
    assert_eq!(omap_range(s, &o, b"r10", None, 5).await, (vec![], false));
    assert_eq!(
        omap_range(s, &o, b"r05", Some(b"r05"), 5).await,
        (vec![], false)
    );

    // Remove keys (missing ones are fine) and a range [start, end).
    s.write_op(
        &o,
        WriteOp::new().step(WriteStep::OmapRemoveKeys(vec![
            b"r01".to_vec(),
            b"r02".to_vec(),
            b"nope".to_vec(),
        ])),
    )
    .await
    .unwrap();
    s.write_op(
        &o,
        WriteOp::new().step(WriteStep::OmapRemoveRange {
            start: b"r04".to_vec(),
            end: b"r07".to_vec(),
        }),
    )
    .await
    .unwrap();
    let left: Vec<_> = [0, 3, 7, 8, 9]
        .iter()
        .flat_map(|&i| range(i, i + 1))
        .collect();
    assert_eq!(s.omap_all(&o).await.unwrap(), left);

    // Clear: every key goes, the data stays; again on no keys; a missing object is NotFound.
    let cleared = name(&p, "cleared");
    s.write_op(
        &cleared,
        WriteOp::new()
            .write(0, b"data")
            .omap_set(vec![kv(b"a", b"1"), kv([0xff], b"2")]),
    )
    .await
    .unwrap();
    for _ in 0..2 {
        s.write_op(&cleared, WriteOp::new().step(WriteStep::OmapClear))
            .await
            .unwrap();
        assert_eq!(s.omap_all(&cleared).await.unwrap(), vec![]);
        assert_eq!(s.read(&cleared, 0, 10).await.unwrap(), b"data");
    }
    s.write_op(
        &cleared,
        WriteOp::new()
            .step(WriteStep::OmapClear)
            .omap_set(vec![kv(b"b", b"3")]),
    )
    .await
    .unwrap();
    assert_eq!(s.omap_all(&cleared).await.unwrap(), vec![kv(b"b", b"3")]);
    assert_err!(
        s.write_op(
            &name(&p, "missing"),
            WriteOp::new().step(WriteStep::OmapClear)
        )
        .await,
        StoreError::NotFound { .. }
    );
    // So are removals of keys and of ranges (RADOS answers ENOENT), which is why a coalescing
    // store does not merge them into other operations.
    for step in [
        WriteStep::OmapRemoveKeys(vec![b"a".to_vec()]),
        WriteStep::OmapRemoveRange {
            start: b"a".to_vec(),
            end: b"z".to_vec(),
        },
    ] {
        assert_err!(
            s.write_op(&name(&p, "missing"), WriteOp::new().step(step))
                .await,
            StoreError::NotFound { .. }
        );
    }

    // Binary keys and values, ordered bytewise (0x80 after 0x7f, shorter before longer).
    let bin = name(&p, "binary");
    let binary_pairs = vec![
        kv([0xff], [0x00, 0xff]),
        kv([0x00], b""),
        kv([0x00, 0x00], [0x00]),
        kv(b"a", b"text"),
        kv([b'a', 0x00, b'b'], [0xfe; 3]),
        kv([0x7f], b"7f"),
        kv([0x80], b"80"),
        kv([0xff, 0x00], [0x01]),
    ];
    s.write_op(&bin, WriteOp::new().omap_set(binary_pairs))
        .await
        .unwrap();
    let sorted = vec![
        kv([0x00], b""),
        kv([0x00, 0x00], [0x00]),
        kv(b"a", b"text"),
        kv([b'a', 0x00, b'b'], [0xfe; 3]),
        kv([0x7f], b"7f"),
        kv([0x80], b"80"),
        kv([0xff], [0x00, 0xff]),
        kv([0xff, 0x00], [0x01]),
    ];
    assert_eq!(s.omap_all(&bin).await.unwrap(), sorted);
    assert_eq!(
        omap_get(
            s,
            &bin,
            &[&[0x00], &[0x00, 0x00, 0x00], &[b'a', 0x00, b'b']]
        )
        .await,
        vec![sorted[0].clone(), sorted[3].clone()]
    );
    assert_eq!(
        omap_range(s, &bin, &[0x00, 0x00], Some(&[0x80]), 10).await,
        (sorted[1..5].to_vec(), false)
    );
    assert_eq!(
        omap_range(s, &bin, &[0x00], None, 100).await,
        (sorted.clone(), false),
        "the start key is included"
    );
    assert_eq!(
        omap_range(s, &bin, &[0xff], None, 100).await,
        (sorted[6..].to_vec(), false)
    );
    s.write_op(
        &bin,
        WriteOp::new().step(WriteStep::OmapRemoveRange {
            start: vec![0x7f],
            end: vec![0xff],
        }),
    )
    .await
    .unwrap();
    let mut expected = sorted[..4].to_vec();
    expected.extend_from_slice(&sorted[6..]);
    assert_eq!(s.omap_all(&bin).await.unwrap(), expected);

    // Many keys: omap_all pages in 1024s.
    let many = name(&p, "many");
    let all: Vec<_> = (0..2500u32)
        .map(|i| kv(format!("key{i:05}"), pattern(i as u8, (i % 40) as usize)))
        .collect();
    s.write_op(&many, WriteOp::new().omap_set(all.clone()))
        .await
        .unwrap();
    let (first, more) = omap_range(s, &many, b"", None, 1024).await;
    assert_eq!((first.as_slice(), more), (&all[..1024], true));
    assert_eq!(s.omap_all(&many).await.unwrap(), all);
    // With no limit a store may still list fewer (RADOS: 1024 per operation), and says
    // `more`: paging on from the last key (listed again) reaches every key, and the last
    // page says no more.
    let (mut got, mut more) = omap_range(s, &many, b"", None, usize::MAX).await;
    assert!(!got.is_empty() && (more || got.len() == all.len()));
    while more {
        let start = got.last().unwrap().0.clone();
        let (page, m) = omap_range(s, &many, &start, None, usize::MAX).await;
        assert_eq!(page[0].0, start, "the start key is included");
        assert!(page.len() > 1, "paging goes on");
        got.extend(page.into_iter().skip(1));
        more = m;
    }
    assert_eq!(got, all);
    // Paging as librbd's headers are read (`foreign/rbd.rs`): from right after a key (the
    // key and a NUL byte), 1024 at a time.
    let after = [b"key00009".as_slice(), &[0]].concat();
    let (page, more) = omap_range(s, &many, &after, None, 1024).await;
    assert!(!page.is_empty() && page.len() <= 1024);
    assert_eq!(page.as_slice(), &all[10..10 + page.len()]);
    assert!(more);
}

// ---------------------------------------------------------------------------------------------
// Concurrency and ordering

/// Atomicity under concurrency: 16 tasks × 20 operations, each writing one pattern to two
/// distant extents and the same id to an omap key, race with readers reading both extents and
/// the key in one operation (through both clients); every read sees one operation's whole
/// effect, never a mix.
pub async fn concurrent_ops_stay_atomic<S: ObjectStore + 'static>(c: Clients<S>) {
    const WRITERS: u16 = 16;
    const OPS: u16 = 20;
    const READERS: usize = 4;
    const LEN: u64 = 4096;
    const FAR: u64 = 65536;

    fn fill(id: u16) -> Vec<u8> {
        id.to_le_bytes().repeat(LEN as usize / 2)
    }
    fn op(id: u16) -> WriteOp {
        WriteOp::new()
            .write(0, fill(id))
            .write(FAR, fill(id))
            .omap_set(vec![kv(b"tag", id.to_le_bytes())])
    }
    /// The id an extent read holds, if it is one whole write's pattern.
    fn id_of(extents: &[Extent], offset: u64) -> Option<u16> {
        match normalize(extents, offset, offset + LEN).as_slice() {
            [(at, data)] if *at == offset && data.len() as u64 == LEN => {
                let id = u16::from_le_bytes([data[0], data[1]]);
                (*data == fill(id)).then_some(id)
            }
            _ => None,
        }
    }
    fn check(results: &[ReadResult]) -> u16 {
        let [ReadResult::Extents(near), ReadResult::Extents(far), ReadResult::Omap { pairs, .. }] =
            results
        else {
            panic!("a three-step read returned {results:?}");
        };
        let (Some((key, value)), 1) = (pairs.first(), pairs.len()) else {
            panic!("the tag key: {pairs:?}");
        };
        assert_eq!(key, b"tag");
        let tag = u16::from_le_bytes(value.try_into().expect("a 2-byte tag"));
        assert_eq!(
            (id_of(near, 0), id_of(far, FAR)),
            (Some(tag), Some(tag)),
            "a read saw a mix of operations (tag {tag})"
        );
        tag
    }

    let p = case_prefix("concurrent_ops_stay_atomic");
    let object = Arc::new(name(&p, "obj"));
    let a = Arc::new(c.a);
    let b = Arc::new(c.b);
    a.write_op(&object, op(u16::MAX)).await.unwrap();
    let read = ReadOp::new()
        .step(ReadStep::Read {
            offset: 0,
            len: LEN,
        })
        .step(ReadStep::Read {
            offset: FAR,
            len: LEN,
        })
        .step(ReadStep::OmapGetByKeys(vec![b"tag".to_vec()]));

    let done = Arc::new(AtomicBool::new(false));
    let readers: Vec<_> = (0..READERS)
        .map(|r| {
            let store = if r % 2 == 0 { a.clone() } else { b.clone() };
            let (object, done, read) = (object.clone(), done.clone(), read.clone());
            tokio::spawn(async move {
                let mut reads = 0u64;
                loop {
                    let last = done.load(Ordering::SeqCst);
                    check(&store.read_op(&object, read.clone()).await.unwrap());
                    reads += 1;
                    if last {
                        return reads;
                    }
                    tokio::task::yield_now().await;
                }
            })
        })
        .collect();
    let writers: Vec<_> = (0..WRITERS)
        .map(|w| {
            let store = if w % 2 == 0 { a.clone() } else { b.clone() };
            let object = object.clone();
            tokio::spawn(async move {
                let mut last = 0;
                for i in 0..OPS {
                    let v = store
                        .write_op(&object, op(w * OPS + i))
                        .await
                        .unwrap()
                        .version;
                    assert!(v > last, "versions of one task's operations decrease");
                    last = v;
                }
                last
            })
        })
        .collect();

    let mut newest = 0;
    for writer in writers {
        newest = newest.max(writer.await.expect("a writer task failed"));
    }
    done.store(true, Ordering::SeqCst);
    for reader in readers {
        assert!(reader.await.expect("a reader task failed") > 0);
    }

    // The final state is some task's last operation, and its version the newest.
    let tag = check(&a.read_op(&object, read).await.unwrap());
    assert_eq!(
        tag % OPS,
        OPS - 1,
        "the final state is not a task's last operation"
    );
    assert_eq!(stat_of(&*a, &object).await.version, newest);
}

/// Operations on one object apply in the order they were submitted: 200 operations started
/// together (futures built in order, then joined) leave the last one's content, every omap
/// key, and versions strictly increasing in submission order.
pub async fn ops_apply_in_submission_order<S: ObjectStore>(c: Clients<S>) {
    const N: u64 = 200;
    let p = case_prefix("ops_apply_in_submission_order");
    let s = &c.a;
    let o = &name(&p, "obj");

    let ops: Vec<_> = (0..N)
        .map(|i| {
            let op = WriteOp::new()
                .write(0, i.to_be_bytes())
                .omap_set(vec![kv(format!("k{i:03}"), i.to_be_bytes())])
                .omap_set(vec![kv(b"last", i.to_be_bytes())]);
            s.write_op(o, op)
        })
        .collect();
    let versions: Vec<u64> = join_all(ops)
        .await
        .into_iter()
        .map(|outcome| outcome.unwrap().version)
        .collect();
    // Operations a store sent as one share its version.
    let merges = s.merges_operations();
    for (i, pair) in versions.windows(2).enumerate() {
        assert!(
            pair[0] < pair[1] || (merges && pair[0] == pair[1]),
            "operation {} got version {} after operation {i} got {}",
            i + 1,
            pair[1],
            pair[0]
        );
    }
    assert_eq!(s.read(o, 0, 100).await.unwrap(), (N - 1).to_be_bytes());
    let mut omap: Vec<_> = (0..N)
        .map(|i| kv(format!("k{i:03}"), i.to_be_bytes()))
        .collect();
    omap.push(kv(b"last", (N - 1).to_be_bytes()));
    assert_eq!(s.omap_all(o).await.unwrap(), omap);
    assert_eq!(stat_of(s, o).await.version, *versions.last().unwrap());
}

/// Many objects in flight: 64 objects written concurrently all read back whole, and are all
/// listed.
pub async fn many_objects_in_flight<S: ObjectStore>(c: Clients<S>) {
    const OBJECTS: usize = 64;
    let p = case_prefix("many_objects_in_flight");
    let s = &c.a;
    let names: Vec<ObjectName> = (0..OBJECTS)
        .map(|i| name(&p, format!("obj{i:02}")))
        .collect();
    let expected = |i: usize| {
        let offset = i * 512;
        State::new(
            concat(&[&zeros(offset as u64), &pattern(i as u8, 20_000)]),
            vec![kv(b"i", [i as u8])],
        )
    };

    let writes = names.iter().enumerate().map(|(i, o)| {
        let op = WriteOp::new()
            .write(i as u64 * 512, pattern(i as u8, 20_000))
            .omap_set(vec![kv(b"i", [i as u8])]);
        s.write_op(o, op)
    });
    for outcome in join_all(writes).await {
        outcome.unwrap();
    }
    let reads = names.iter().map(|o| read_state(s, o, None));
    for (i, state) in join_all(reads).await.into_iter().enumerate() {
        assert_eq!(state.unwrap(), expected(i), "object {i}");
    }
    assert_eq!(s.list(&p).await.unwrap(), names);
}

// ---------------------------------------------------------------------------------------------
// Listing and bad input

/// `list(prefix)` returns exactly the existing objects whose names start with the prefix
/// (a plain byte prefix: `_`, `%`, `*`, `[` are not patterns), sorted; removed objects are
/// not listed; empty objects are.
pub async fn list_by_prefix<S: ObjectStore>(c: Clients<S>) {
    let p = case_prefix("list_by_prefix");
    let s = &c.a;
    let names = |suffixes: &[&str]| -> Vec<ObjectName> {
        suffixes.iter().map(|suffix| name(&p, suffix)).collect()
    };
    let list = |prefix: String| async move { s.list(&prefix).await.unwrap() };

    // Created out of order; "q" is empty.
    s.write_op(
        &name(&p, "q"),
        WriteOp::new().step(WriteStep::CreateExclusive),
    )
    .await
    .unwrap();
    for suffix in ["p2/c", "p/b", "p/a"] {
        s.write(&name(&p, suffix), 0, b"x").await.unwrap();
    }
    assert_eq!(list(p.clone()).await, names(&["p/a", "p/b", "p2/c", "q"]));
    assert_eq!(list(format!("{p}p")).await, names(&["p/a", "p/b", "p2/c"]));
    assert_eq!(list(format!("{p}p/")).await, names(&["p/a", "p/b"]));
    assert_eq!(list(format!("{p}p/a")).await, names(&["p/a"]));
    assert_eq!(list(format!("{p}p/a/")).await, names(&[]));
    assert_eq!(list(format!("{p}r")).await, names(&[]));
    let everything: Vec<_> = list(String::new())
        .await
        .into_iter()
        .filter(|o| o.as_str().starts_with(&p))
        .collect();
    assert_eq!(everything, names(&["p/a", "p/b", "p2/c", "q"]));

    // Removed objects are not listed.
    s.remove(&name(&p, "p/b")).await.unwrap();
    assert_eq!(list(format!("{p}p")).await, names(&["p/a", "p2/c"]));

    // Characters that are wildcards in SQL LIKE or GLOB match only themselves.
    for suffix in ["u_v", "uav", "u%w", "u*z", "u?z", "u[1]", "u1"] {
        s.write(&name(&p, suffix), 0, b"x").await.unwrap();
    }
    assert_eq!(list(format!("{p}u_")).await, names(&["u_v"]));
    assert_eq!(list(format!("{p}u%")).await, names(&["u%w"]));
    assert_eq!(list(format!("{p}u*")).await, names(&["u*z"]));
    assert_eq!(list(format!("{p}u?")).await, names(&["u?z"]));
    assert_eq!(list(format!("{p}u[")).await, names(&["u[1]"]));
    assert_eq!(
        list(format!("{p}u")).await,
        names(&["u%w", "u*z", "u1", "u?z", "u[1]", "u_v", "uav"])
    );
}

/// Bad input is refused without effect: invalid names (`InvalidName`), writes or truncates
/// past `MAX_OBJECT_SIZE` or past `u64::MAX` (`OutOfRange`, nothing changes, a missing object
/// is not created); a write ending exactly at the limit is fine; reading a missing object is
/// `NotFound`.
pub async fn bad_input<S: ObjectStore>(c: Clients<S>) {
    let p = case_prefix("bad_input");
    let s = &c.a;

    let long = "a".repeat(1025);
    for bad in [
        "",
        &long,
        "a b",
        "a\0b",
        "caf\u{e9}",
        "tab\t",
        "line\n",
        "\x7f",
    ] {
        assert_err!(ObjectName::new(bad), StoreError::InvalidName { .. });
    }
    ObjectName::new("a".repeat(1024)).unwrap();
    ObjectName::new("!#$%&'()*+,-./:;<=>?@[\\]^_`{|}~").unwrap();

    let o = name(&p, "obj");
    s.write_op(
        &o,
        WriteOp::new()
            .write(0, b"keep")
            .omap_set(vec![kv(b"k", b"v")]),
    )
    .await
    .unwrap();
    let before = read_state(s, &o, None).await.unwrap();
    let version = stat_of(s, &o).await.version;
    let too_far = [
        WriteOp::new().write(MAX_OBJECT_SIZE - 2, [1, 2, 3, 4]),
        WriteOp::new().write(MAX_OBJECT_SIZE, b"x"),
        WriteOp::new().write(u64::MAX - 1, [0; 4]),
        WriteOp::new().step(WriteStep::Truncate(MAX_OBJECT_SIZE + 1)),
    ];
    for op in too_far {
        let what = format!("{op:?}");
        let missing = name(&p, "missing");
        assert_err!(
            s.write_op(&o, op.clone()).await,
            StoreError::OutOfRange { limit, .. } if *limit == MAX_OBJECT_SIZE
        );
        assert_err!(
            s.write_op(&missing, op).await,
            StoreError::OutOfRange { .. }
        );
        assert_eq!(
            s.stat(&missing).await.unwrap(),
            None,
            "{what} created an object"
        );
    }
    assert_eq!(read_state(s, &o, None).await.unwrap(), before);
    assert_eq!(stat_of(s, &o).await.version, version);

    // Up to the limit is fine.
    let edge = name(&p, "edge");
    s.write(&edge, MAX_OBJECT_SIZE - 1, b"z").await.unwrap();
    assert_eq!(stat_of(s, &edge).await.size, MAX_OBJECT_SIZE);
    assert_eq!(
        sparse(s, &edge, MAX_OBJECT_SIZE - 10, 100).await,
        vec![ext(MAX_OBJECT_SIZE - 1, b"z")]
    );

    // Missing objects.
    let missing = name(&p, "missing");
    assert_err!(
        s.read(&missing, 0, 10).await,
        StoreError::NotFound { object } if object == missing.as_str()
    );
    assert_err!(s.omap_all(&missing).await, StoreError::NotFound { .. });
    assert_err!(
        s.read_op(
            &missing,
            ReadOp::new().step(ReadStep::OmapGetByKeys(vec![b"k".to_vec()]))
        )
        .await,
        StoreError::NotFound { .. }
    );
    assert_eq!(s.stat(&missing).await.unwrap(), None);
}

// ---------------------------------------------------------------------------------------------
// Snapshots

/// Snapshot reads: a write under a context naming snapshot s preserves the object's data,
/// size and omap as of s (once: a second write under the same context does not overwrite the
/// preserved state); an object created after s is `NotFound` at s; one removed after s still
/// reads at s (and is not listed); an object untouched since s reads its head at s; with two
/// snapshots each sees its own state, and one preserved state serves every snapshot it spans.
pub async fn snapshot_reads<S: ObjectStore>(c: Clients<S>) {
    let p = case_prefix("snapshot_reads");
    let s = &c.a;
    let [changed, created, removed, untouched, shared] =
        ["changed", "created", "removed", "untouched", "shared"].map(|n| name(&p, n));
    let old = State::new(b"old data", vec![kv(b"k", b"old")]);
    for o in [&changed, &removed, &untouched, &shared] {
        s.write_op(
            o,
            WriteOp::new()
                .write(0, b"old data")
                .omap_set(vec![kv(b"k", b"old")]),
        )
        .await
        .unwrap();
    }

    let s1 = s.snap_create().await.unwrap();
    let ctx1 = SnapContext {
        seq: s1,
        snaps: vec![s1],
    };
    let under = |ctx: &SnapContext, op: WriteOp| op.with_snap_context(ctx.clone());

    // Changed after s1: s1 keeps the old data, size and omap.
    let op = WriteOp::new()
        .write(0, b"NEW")
        .write(20, b"tail")
        .omap_set(vec![kv(b"k", b"new"), kv(b"k2", b"added")]);
    s.write_op(&changed, under(&ctx1, op)).await.unwrap();
    let new_omap = vec![kv(b"k", b"new"), kv(b"k2", b"added")];
    let new1 = State::new(
        concat(&[b"NEW data", &zeros(12), b"tail"]),
        new_omap.clone(),
    );
    assert_eq!(read_state(s, &changed, Some(s1)).await.unwrap(), old);
    assert_eq!(read_state(s, &changed, None).await.unwrap(), new1);

    // A second write under the same context: s1 still sees the state before the first.
    s.write_op(&changed, under(&ctx1, WriteOp::new().write(0, b"NEWER")))
        .await
        .unwrap();
    let new2 = State::new(concat(&[b"NEWERata", &zeros(12), b"tail"]), new_omap);
    assert_eq!(read_state(s, &changed, Some(s1)).await.unwrap(), old);
    assert_eq!(read_state(s, &changed, None).await.unwrap(), new2);
    assert_eq!(read_state(&c.b, &changed, Some(s1)).await.unwrap(), old);

    // Created after s1: not there at s1.
    s.write_op(&created, under(&ctx1, WriteOp::new().write(0, b"born")))
        .await
        .unwrap();
    assert_err!(
        read_state(s, &created, Some(s1)).await,
        StoreError::NotFound { .. }
    );
    let born = State::new(b"born", vec![]);
    assert_eq!(read_state(s, &created, None).await.unwrap(), born);

    // Removed after s1: gone at the head, still there at s1.
    let op = WriteOp::new().step(WriteStep::Remove);
    assert_eq!(
        s.write_op(&removed, under(&ctx1, op))
            .await
            .unwrap()
            .version,
        0
    );
    assert_eq!(s.stat(&removed).await.unwrap(), None);
    assert_eq!(read_state(s, &removed, Some(s1)).await.unwrap(), old);
    assert!(!s.list(&p).await.unwrap().contains(&removed));

    // Untouched since s1: s1 sees the head.
    assert_eq!(read_state(s, &untouched, Some(s1)).await.unwrap(), old);

    // A second snapshot: each sees its own state.
    let s2 = s.snap_create().await.unwrap();
    assert!(s2 > s1, "snapshot ids increase: {s1} then {s2}");
    let ctx2 = SnapContext {
        seq: s2,
        snaps: vec![s2, s1],
    };
    let op = WriteOp::new()
        .step(WriteStep::WriteFull(b"v2".to_vec()))
        .step(WriteStep::OmapRemoveKeys(vec![b"k2".to_vec()]))
        .omap_set(vec![kv(b"k", b"v2")]);
    s.write_op(&changed, under(&ctx2, op)).await.unwrap();
    assert_eq!(read_state(s, &changed, Some(s1)).await.unwrap(), old);
    assert_eq!(read_state(s, &changed, Some(s2)).await.unwrap(), new2);
    assert_eq!(
        read_state(s, &changed, None).await.unwrap(),
        State::new(b"v2", vec![kv(b"k", b"v2")])
    );

    // First change since before s1, under ctx2: one preserved state serves s1 and s2.
    s.write_op(&shared, under(&ctx2, WriteOp::new().write(0, b"SHARED")))
        .await
        .unwrap();
    assert_eq!(read_state(s, &shared, Some(s1)).await.unwrap(), old);
    assert_eq!(read_state(s, &shared, Some(s2)).await.unwrap(), old);
    assert_eq!(s.read(&shared, 0, 100).await.unwrap(), b"SHAREDta");

    // Created between s1 and s2: there at s2 (its head), not at s1.
    assert_eq!(read_state(s, &created, Some(s2)).await.unwrap(), born);
    assert_err!(
        read_state(s, &created, Some(s1)).await,
        StoreError::NotFound { .. }
    );
}

/// Rollback: `Rollback(s)` puts data, size and omap back as they were at s, deletes an object
/// that did not exist at s, and (under a context) preserves the pre-rollback state for newer
/// snapshots.
pub async fn snapshot_rollback<S: ObjectStore>(c: Clients<S>) {
    let p = case_prefix("snapshot_rollback");
    let s = &c.a;
    let [o, created, untouched] = ["obj", "created", "untouched"].map(|n| name(&p, n));
    let old = State::new(b"old data", vec![kv(b"k", b"old")]);
    for object in [&o, &untouched] {
        s.write_op(
            object,
            WriteOp::new()
                .write(0, b"old data")
                .omap_set(vec![kv(b"k", b"old")]),
        )
        .await
        .unwrap();
    }

    let s1 = s.snap_create().await.unwrap();
    let ctx1 = SnapContext {
        seq: s1,
        snaps: vec![s1],
    };
    let op = WriteOp::new()
        .step(WriteStep::WriteFull(b"much longer new data".to_vec()))
        .omap_set(vec![kv(b"k", b"new"), kv(b"k2", b"added")]);
    s.write_op(&o, op.with_snap_context(ctx1.clone()))
        .await
        .unwrap();
    s.write_op(
        &created,
        WriteOp::new().write(0, b"born").with_snap_context(ctx1),
    )
    .await
    .unwrap();
    let at_s2 = State::new(
        b"much longer new data",
        vec![kv(b"k", b"new"), kv(b"k2", b"added")],
    );

    let s2 = s.snap_create().await.unwrap();
    let ctx2 = SnapContext {
        seq: s2,
        snaps: vec![s2, s1],
    };
    s.write_op(
        &o,
        WriteOp::new()
            .write(100, b"far")
            .with_snap_context(ctx2.clone()),
    )
    .await
    .unwrap();

    let rollback = |snap| {
        WriteOp::new()
            .step(WriteStep::Rollback(snap))
            .with_snap_context(ctx2.clone())
    };
    let before = stat_of(s, &o).await.version;
    let v = s.write_op(&o, rollback(s1)).await.unwrap().version;
    assert!(v > before);
    assert_eq!(read_state(s, &o, None).await.unwrap(), old);
    assert_eq!(read_state(s, &o, Some(s1)).await.unwrap(), old);
    assert_eq!(read_state(s, &o, Some(s2)).await.unwrap(), at_s2);

    // Did not exist at s1: rollback deletes it; s2 still has it.
    s.write_op(&created, rollback(s1)).await.unwrap();
    assert_eq!(s.stat(&created).await.unwrap(), None);
    assert_eq!(
        read_state(s, &created, Some(s2)).await.unwrap(),
        State::new(b"born", vec![])
    );

    // Unchanged since s1: rollback leaves it as it is.
    s.write_op(&untouched, rollback(s1)).await.unwrap();
    assert_eq!(read_state(s, &untouched, None).await.unwrap(), old);

    // Later writes go on from the rolled-back state.
    s.write_op(&o, WriteOp::new().write(0, b"OLD").with_snap_context(ctx2))
        .await
        .unwrap();
    assert_eq!(s.read(&o, 0, 100).await.unwrap(), b"OLD data");
    assert_eq!(read_state(s, &o, Some(s1)).await.unwrap(), old);
}

/// `snap_remove`: reading at a removed snapshot fails `NoSuchSnapshot` (or `NotFound`: RADOS
/// cannot tell a removed snapshot from one at which the object did not exist); the other snapshots
/// keep their states (including a state shared with the removed one); ids are never reused.
pub async fn snapshot_remove<S: ObjectStore>(c: Clients<S>) {
    let p = case_prefix("snapshot_remove");
    let s = &c.a;
    let [o, shared] = ["obj", "shared"].map(|n| name(&p, n));
    for object in [&o, &shared] {
        s.write(object, 0, b"v0").await.unwrap();
    }

    let s1 = s.snap_create().await.unwrap();
    let ctx1 = SnapContext {
        seq: s1,
        snaps: vec![s1],
    };
    s.write_op(&o, WriteOp::new().write(0, b"v1").with_snap_context(ctx1))
        .await
        .unwrap();
    let s2 = s.snap_create().await.unwrap();
    let ctx2 = SnapContext {
        seq: s2,
        snaps: vec![s2, s1],
    };
    for object in [&o, &shared] {
        s.write_op(
            object,
            WriteOp::new()
                .write(0, b"v2")
                .with_snap_context(ctx2.clone()),
        )
        .await
        .unwrap();
    }
    let v = |data: &[u8]| State::new(data, vec![]);

    s.snap_remove(s1).await.unwrap();
    match read_state(s, &o, Some(s1)).await {
        Err(StoreError::NoSuchSnapshot(snap)) if snap == s1 => {}
        Err(StoreError::NotFound { .. }) => {}
        other => panic!("a read at removed snapshot {s1} gave {other:?}"),
    }
    assert_eq!(read_state(s, &o, Some(s2)).await.unwrap(), v(b"v1"));
    assert_eq!(read_state(s, &shared, Some(s2)).await.unwrap(), v(b"v0"));
    assert_eq!(read_state(s, &o, None).await.unwrap(), v(b"v2"));

    // The remaining snapshot goes on working under the reduced context.
    let ctx = SnapContext {
        seq: s2,
        snaps: vec![s2],
    };
    s.write_op(&o, WriteOp::new().write(0, b"v3").with_snap_context(ctx))
        .await
        .unwrap();
    assert_eq!(read_state(s, &o, Some(s2)).await.unwrap(), v(b"v1"));

    s.snap_remove(s2).await.unwrap();
    match read_state(s, &o, Some(s2)).await {
        Err(StoreError::NoSuchSnapshot(snap)) if snap == s2 => {}
        Err(StoreError::NotFound { .. }) => {}
        other => panic!("a read at removed snapshot {s2} gave {other:?}"),
    }
    assert_eq!(read_state(s, &o, None).await.unwrap(), v(b"v3"));
    let s3 = s.snap_create().await.unwrap();
    assert!(s3 > s2, "snapshot ids are not reused: {s3} after {s2}");

    // A context librados would refuse (a snapshot newer than its seq, snapshots not newest
    // first) is refused by every backend, and the operation writes nothing.
    for bad in [
        SnapContext {
            seq: s2,
            snaps: vec![s3],
        },
        SnapContext {
            seq: s3,
            snaps: vec![s2, s3],
        },
    ] {
        let op = WriteOp::new()
            .write(0, b"bad")
            .with_snap_context(bad.clone());
        match s.write_op(&o, op).await {
            Err(StoreError::InvalidOperation { .. }) => {}
            other => panic!("a write under {bad:?} gave {other:?}"),
        }
    }
    assert_eq!(read_state(s, &o, None).await.unwrap(), v(b"v3"));
}

/// Writes without a snap context preserve nothing: a snapshot taken before such a write reads
/// the object's head (its current state, including objects created after the snapshot), while
/// states already preserved stay.
pub async fn snapshot_without_context<S: ObjectStore>(c: Clients<S>) {
    let p = case_prefix("snapshot_without_context");
    let s = &c.a;
    let [plain, preserved, late] = ["plain", "preserved", "late"].map(|n| name(&p, n));
    for object in [&plain, &preserved] {
        s.write(object, 0, b"old").await.unwrap();
    }
    let s1 = s.snap_create().await.unwrap();

    s.write(&plain, 0, b"new").await.unwrap();
    assert_eq!(
        read_state(s, &plain, Some(s1)).await.unwrap(),
        State::new(b"new", vec![])
    );

    s.write(&late, 0, b"late").await.unwrap();
    assert_eq!(
        read_state(s, &late, Some(s1)).await.unwrap(),
        State::new(b"late", vec![])
    );

    let ctx1 = SnapContext {
        seq: s1,
        snaps: vec![s1],
    };
    s.write_op(
        &preserved,
        WriteOp::new().write(0, b"mid").with_snap_context(ctx1),
    )
    .await
    .unwrap();
    s.write(&preserved, 0, b"new").await.unwrap();
    assert_eq!(
        read_state(s, &preserved, Some(s1)).await.unwrap(),
        State::new(b"old", vec![])
    );
    assert_eq!(s.read(&preserved, 0, 10).await.unwrap(), b"new");
}

/// `list_at(prefix, s)` lists exactly the objects a read at s finds: those that existed at s,
/// removed ones included, not those created since under a context naming s (one written
/// without a context reads its head at s, and is listed); under the prefix only, sorted. A
/// removed snapshot is `NoSuchSnapshot`, or (RADOS, which cannot tell) listed as reads at it
/// answer.
pub async fn list_at_snapshot<S: ObjectStore>(c: Clients<S>) {
    let p = case_prefix("list_at_snapshot");
    let s = &c.a;
    let [changed, created, kept, late, removed] =
        ["changed", "created", "kept", "late", "removed"].map(|n| name(&p, n));
    // Not under the prefix, though its name starts with the prefix' letters.
    let other = name(p.trim_end_matches('/'), "-other");
    for o in [&changed, &kept, &removed, &other] {
        s.write(o, 0, b"old").await.unwrap();
    }
    let s1 = s.snap_create().await.unwrap();
    let ctx1 = SnapContext {
        seq: s1,
        snaps: vec![s1],
    };
    let under = |op: WriteOp| op.with_snap_context(ctx1.clone());
    s.write_op(&changed, under(WriteOp::new().write(0, b"new")))
        .await
        .unwrap();
    s.write_op(&created, under(WriteOp::new().write(0, b"born")))
        .await
        .unwrap();
    s.write_op(&removed, under(WriteOp::new().step(WriteStep::Remove)))
        .await
        .unwrap();
    s.write(&late, 0, b"late").await.unwrap();

    let prefix = p;
    let at_s1 = s.list_at(&prefix, s1).await.unwrap();
    assert_eq!(at_s1, [&changed, &kept, &late, &removed].map(|o| o.clone()));
    assert_eq!(
        s.list(&prefix).await.unwrap(),
        [&changed, &created, &kept, &late].map(|o| o.clone())
    );
    for o in [&changed, &created, &kept, &late, &removed] {
        let found = read_state(s, o, Some(s1)).await.is_ok();
        assert_eq!(
            found,
            at_s1.contains(o),
            "{o}: read at s1 and list_at disagree"
        );
    }
    // The other client sees the same.
    assert_eq!(c.b.list_at(&prefix, s1).await.unwrap(), at_s1);

    // A newer snapshot lists the head as it is.
    let s2 = s.snap_create().await.unwrap();
    assert_eq!(
        s.list_at(&prefix, s2).await.unwrap(),
        [&changed, &created, &kept, &late].map(|o| o.clone())
    );
    // One that does not exist: refused, or (RADOS) listed as reads at it answer.
    s.snap_remove(s1).await.unwrap();
    match s.list_at(&prefix, s1).await {
        Err(StoreError::NoSuchSnapshot(id)) => assert_eq!(id, s1),
        Ok(names) => {
            for o in [&changed, &created, &kept, &late, &removed] {
                let found = read_state(s, o, Some(s1)).await.is_ok();
                assert_eq!(found, names.contains(o), "{o}: removed snapshot");
            }
        }
        Err(e) => panic!("list_at a removed snapshot: {e}"),
    }
}

// ---------------------------------------------------------------------------------------------
// Locks

/// Lockers as compared here: where a store names its clients' addresses (RADOS), those
/// differ from run to run.
fn without_address(lockers: Vec<Locker>) -> Vec<Locker> {
    lockers
        .into_iter()
        .map(|l| Locker { address: None, ..l })
        .collect()
}

/// Advisory exclusive locks: a second client is refused `Busy` (naming the holder);
/// `list_lockers` shows exactly the holder; the holder renews but cannot lock again without
/// `renew`; unlocking with a wrong cookie or as another client is `NotLocked`; after
/// `break_lock` another client can lock; locks of different names are independent.
pub async fn locks<S: ObjectStore>(c: Clients<S>) {
    let p = case_prefix("locks");
    let (a, b) = (&c.a, &c.b);
    let o = name(&p, "obj");
    a.write(&o, 0, b"x").await.unwrap();
    let (a_id, b_id) = (a.client_id().to_string(), b.client_id().to_string());
    assert_ne!(a_id, b_id, "the two clients need different identities");
    let locker = |client: &str, cookie: &str| Locker {
        client: client.into(),
        cookie: cookie.into(),
        description: "d".into(),
        expires_in: None,
        address: None,
    };

    a.lock_exclusive(&o, lock_request("c1", None, false))
        .await
        .unwrap();
    for cookie in ["c2", "c1"] {
        assert_err!(
            b.lock_exclusive(&o, lock_request(cookie, None, false)).await,
            StoreError::Busy { object, lock, holder }
                if object == o.as_str() && lock == "lk" && holder.contains(&a_id)
        );
    }
    assert_eq!(
        without_address(a.list_lockers(&o, "lk").await.unwrap()),
        vec![locker(&a_id, "c1")]
    );
    assert_eq!(
        without_address(b.list_lockers(&o, "lk").await.unwrap()),
        vec![locker(&a_id, "c1")]
    );
    assert_eq!(a.list_lockers(&o, "other").await.unwrap(), vec![]);

    // Renewal, and no second lock without it.
    a.lock_exclusive(&o, lock_request("c1", None, true))
        .await
        .unwrap();
    assert_eq!(
        without_address(a.list_lockers(&o, "lk").await.unwrap()),
        vec![locker(&a_id, "c1")]
    );
    assert_err!(
        a.lock_exclusive(&o, lock_request("c1", None, false)).await,
        StoreError::Busy { .. }
    );
    assert_err!(
        a.lock_exclusive(&o, lock_request("c9", None, false)).await,
        StoreError::Busy { .. }
    );

    // Unlocking what one does not hold.
    assert_err!(
        a.unlock(&o, "lk", "wrong").await,
        StoreError::NotLocked { cookie, .. } if cookie == "wrong"
    );
    assert_err!(b.unlock(&o, "lk", "c1").await, StoreError::NotLocked { .. });
    assert_err!(
        b.break_lock(&o, "lk", &a_id, "wrong").await,
        StoreError::NotLocked { .. }
    );
    assert_eq!(
        without_address(a.list_lockers(&o, "lk").await.unwrap()),
        vec![locker(&a_id, "c1")]
    );

    // Another lock name on the same object is independent.
    b.lock_exclusive(
        &o,
        LockRequest {
            name: "lk2".into(),
            ..lock_request("c2", None, false)
        },
    )
    .await
    .unwrap();
    b.unlock(&o, "lk2", "c2").await.unwrap();

    // Breaking a's lock lets b in, and a's renewal then fails instead of re-taking it.
    b.break_lock(&o, "lk", &a_id, "c1").await.unwrap();
    assert_eq!(b.list_lockers(&o, "lk").await.unwrap(), vec![]);
    assert_err!(
        a.lock_exclusive(&o, lock_request("c1", None, true)).await,
        StoreError::NotLocked { cookie, .. } if cookie == "c1"
    );
    assert_eq!(b.list_lockers(&o, "lk").await.unwrap(), vec![]);
    b.lock_exclusive(&o, lock_request("c2", None, false))
        .await
        .unwrap();
    assert_eq!(
        without_address(a.list_lockers(&o, "lk").await.unwrap()),
        vec![locker(&b_id, "c2")]
    );
    assert_err!(a.unlock(&o, "lk", "c1").await, StoreError::NotLocked { .. });

    // Unlock frees it.
    b.unlock(&o, "lk", "c2").await.unwrap();
    assert_eq!(a.list_lockers(&o, "lk").await.unwrap(), vec![]);
    a.lock_exclusive(&o, lock_request("c3", None, false))
        .await
        .unwrap();
    a.unlock(&o, "lk", "c3").await.unwrap();
    assert_eq!(a.list_lockers(&o, "lk").await.unwrap(), vec![]);
}

/// Lock expiry: a lock taken for 1 s lists `expires_in` of at most 1 s, refuses another
/// client until it expires, then lets it in and is no longer listed.
pub async fn lock_expiry<S: ObjectStore>(c: Clients<S>) {
    let p = case_prefix("lock_expiry");
    let (a, b) = (&c.a, &c.b);
    let o = name(&p, "obj");
    a.write(&o, 0, b"x").await.unwrap();
    let duration = Duration::from_secs(1);

    a.lock_exclusive(&o, lock_request("c1", Some(duration), false))
        .await
        .unwrap();
    let lockers = b.list_lockers(&o, "lk").await.unwrap();
    let [Locker {
        client,
        cookie,
        expires_in: Some(left),
        ..
    }] = lockers.as_slice()
    else {
        panic!("one expiring locker expected, got {lockers:?}");
    };
    assert_eq!((client.as_str(), cookie.as_str()), (a.client_id(), "c1"));
    assert!(
        *left <= duration,
        "expires in {left:?}, more than {duration:?}"
    );
    assert_err!(
        b.lock_exclusive(&o, lock_request("c2", None, false)).await,
        StoreError::Busy { .. }
    );

    tokio::time::sleep(Duration::from_millis(1500)).await;
    assert_eq!(
        a.list_lockers(&o, "lk").await.unwrap(),
        vec![],
        "expired, still listed"
    );
    b.lock_exclusive(&o, lock_request("c2", None, false))
        .await
        .unwrap();
    let lockers = without_address(a.list_lockers(&o, "lk").await.unwrap());
    assert_eq!(
        lockers,
        vec![Locker {
            client: b.client_id().into(),
            cookie: "c2".into(),
            description: "d".into(),
            expires_in: None,
            address: None,
        }]
    );
}

/// `flush` succeeds (with and without operations pending, from either client) and the data
/// stays readable.
pub async fn flush<S: ObjectStore>(c: Clients<S>) {
    let p = case_prefix("flush");
    let s = &c.a;
    let o = name(&p, "obj");
    let data = pattern(9, 3 * K as usize);
    s.flush().await.unwrap();
    s.write_op(
        &o,
        WriteOp::new()
            .write(0, data.clone())
            .omap_set(vec![kv(b"k", b"v")]),
    )
    .await
    .unwrap();
    s.flush().await.unwrap();
    c.b.flush().await.unwrap();
    s.flush().await.unwrap();
    assert_eq!(
        read_state(s, &o, None).await.unwrap(),
        State::new(data, vec![kv(b"k", b"v")])
    );
}
