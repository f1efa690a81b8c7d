//! Faults on a real cluster: OSDs killed and restarted while operations are in flight.
//!
//! These kill the OSDs of the cluster in `IVDISK_CEPH_DIR` (one started by
//! scripts/ceph-dev-cluster), so they are `#[ignore]`d in a plain `cargo test` and run by
//! scripts/test-all.sh, alone, after every other test:
//!
//!     cargo test -p ivdisk-rados --test faults -- --ignored --test-threads=1

mod common;

use std::path::PathBuf;
use std::process::Command;
use std::time::{Duration, Instant};

use futures_util::future::join_all;
use ivdisk_rados::{RadosConfig, RadosStore};
use ivdisk_store::{ObjectName, ObjectStore, ObjectStoreExt, StoreError, WriteOp};

const SCRIPT: &str = concat!(
    env!("CARGO_MANIFEST_DIR"),
    "/../../scripts/ceph-dev-cluster"
);

fn cluster_dir() -> PathBuf {
    let dir = std::env::var_os("IVDISK_CEPH_DIR").expect(
        "IVDISK_CEPH_DIR must name the directory of a cluster from scripts/ceph-dev-cluster \
         (these tests kill its OSDs); scripts/test-all.sh sets it",
    );
    PathBuf::from(dir)
}

/// The ids of the cluster's OSDs (its `osd.N` directories).
fn osd_ids() -> Vec<u32> {
    let mut ids: Vec<u32> = std::fs::read_dir(cluster_dir())
        .expect("the cluster directory")
        .filter_map(|e| {
            e.ok()?
                .file_name()
                .to_str()?
                .strip_prefix("osd.")?
                .parse()
                .ok()
        })
        .collect();
    ids.sort();
    assert!(!ids.is_empty(), "no OSD in {}", cluster_dir().display());
    ids
}

fn script(args: &[&str]) {
    let dir = cluster_dir();
    let status = Command::new("bash")
        .arg(SCRIPT)
        .args(args)
        .arg("--dir")
        .arg(&dir)
        .status()
        .expect("running scripts/ceph-dev-cluster");
    assert!(
        status.success(),
        "ceph-dev-cluster {args:?} failed: {status}"
    );
}

fn kill_all_osds() {
    for id in osd_ids() {
        script(&["osd-kill", &id.to_string()]);
    }
}

/// Start every OSD again; the last start waits until all PGs are active+clean.
fn start_all_osds() {
    let ids = osd_ids();
    for (i, id) in ids.iter().enumerate() {
        if i + 1 < ids.len() {
            script(&["osd-start", &id.to_string(), "--no-wait"]);
        } else {
            script(&["osd-start", &id.to_string()]);
        }
    }
}

/// Restarts the OSDs if a test fails while they are down, so later tests find a cluster.
struct RestartOnPanic {
    armed: bool,
}

impl Drop for RestartOnPanic {
    fn drop(&mut self) {
        if self.armed && std::thread::panicking() {
            start_all_osds();
        }
    }
}

fn name(test: &str, i: usize) -> ObjectName {
    ObjectName::new(format!("faults.{test}/obj-{i:03}")).unwrap()
}

/// Write i's data: 8 KiB that differ per object and round.
fn data(i: usize, round: u8) -> Vec<u8> {
    (0..8192)
        .map(|j| (j as u8) ^ (i as u8) ^ round.wrapping_mul(37))
        .collect()
}

/// Write i of `round`: data plus an omap key naming the round, in one atomic operation.
fn op(i: usize, round: u8) -> WriteOp {
    WriteOp::new()
        .write(4096, data(i, round))
        .omap_set(vec![(b"round".to_vec(), vec![round])])
}

/// What object i holds: `None` if it does not exist, else the round its omap names, checked
/// against its data (an operation is all or nothing: a mix is a failure).
async fn round_of(store: &RadosStore, object: &ObjectName, i: usize) -> Option<u8> {
    let bytes = match store.read(object, 4096, 8192).await {
        Ok(bytes) => bytes,
        Err(StoreError::NotFound { .. }) => return None,
        Err(e) => panic!("reading {object} back: {e}"),
    };
    let omap = store.omap_all(object).await.unwrap();
    let [(key, round)] = omap.as_slice() else {
        panic!("{object}: omap {omap:?}")
    };
    assert_eq!(key, b"round");
    let round = round[0];
    assert!(
        bytes == data(i, round),
        "{object}: data is not that of round {round}"
    );
    Some(round)
}

/// Objects 0..n of `test` written in round `round`, all acknowledged.
async fn write_round(store: &RadosStore, test: &str, n: usize, round: u8) {
    for (i, r) in join_all((0..n).map(|i| store.write_op_owned(name(test, i), op(i, round))))
        .await
        .into_iter()
        .enumerate()
    {
        r.unwrap_or_else(|e| panic!("{test} write {i} of round {round}: {e}"));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "kills OSDs of the cluster in IVDISK_CEPH_DIR; run by scripts/test-all.sh"]
async fn operations_in_flight_complete_after_the_osds_return() {
    if let Some(reason) = common::skip_reason() {
        eprintln!("SKIPPED: {reason}");
        return;
    }
    let store = common::open().await;
    const N: usize = 32;
    // Round 1, all acknowledged before the outage.
    write_round(&store, "inflight", N, 1).await;

    let mut guard = RestartOnPanic { armed: true };
    kill_all_osds();
    // Round 2: 32 operations in flight while no OSD runs.
    let writes = tokio::spawn(async move {
        let store = &store;
        let results =
            join_all((0..N).map(|i| store.write_op_owned(name("inflight", i), op(i, 2)))).await;
        (results, Instant::now())
    });
    tokio::time::sleep(Duration::from_secs(3)).await;
    assert!(
        !writes.is_finished(),
        "writes completed with every OSD down"
    );
    let restarted = Instant::now();
    start_all_osds();
    guard.armed = false;
    let (results, finished) = tokio::time::timeout(Duration::from_secs(120), writes)
        .await
        .expect("the writes finish once the OSDs are back")
        .unwrap();
    assert!(finished >= restarted);
    for (i, r) in results.into_iter().enumerate() {
        r.unwrap_or_else(|e| panic!("write {i} failed across the restart: {e}"));
    }

    // Every acknowledged write is there, whole.
    let store = common::open().await;
    for i in 0..N {
        assert_eq!(round_of(&store, &name("inflight", i), i).await, Some(2));
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "kills OSDs of the cluster in IVDISK_CEPH_DIR; run by scripts/test-all.sh"]
async fn with_an_op_timeout_operations_fail_clearly_and_apply_whole_or_not() {
    if let Some(reason) = common::skip_reason() {
        eprintln!("SKIPPED: {reason}");
        return;
    }
    let timeout = Duration::from_secs(3);
    let store = RadosStore::open(&RadosConfig {
        op_timeout: Some(timeout),
        ..common::config()
    })
    .await
    .unwrap();
    const N: usize = 16;
    write_round(&store, "timeout", N, 1).await;

    let mut guard = RestartOnPanic { armed: true };
    kill_all_osds();
    let started = Instant::now();
    let results =
        join_all((0..N).map(|i| store.write_op_owned(name("timeout", i), op(i, 2)))).await;
    let elapsed = started.elapsed();
    let read_result = store.read(&name("timeout", 0), 0, 10).await;
    start_all_osds();
    guard.armed = false;

    assert!(
        elapsed >= timeout && elapsed < timeout * 10,
        "the writes gave up after {elapsed:?} with a {timeout:?} timeout"
    );
    let mut acknowledged = [false; N];
    for (i, r) in results.into_iter().enumerate() {
        match r {
            Ok(_) => acknowledged[i] = true,
            Err(e) => {
                let message = e.to_string();
                assert!(matches!(e, StoreError::Io { .. }), "write {i}: {e:?}");
                assert!(
                    message.contains("did not answer within the operation timeout")
                        && message.contains(name("timeout", i).as_str()),
                    "write {i}: unclear error: {message}"
                );
            }
        }
    }
    assert!(
        acknowledged.iter().all(|a| !a),
        "writes were acknowledged with every OSD down"
    );
    let e = read_result.expect_err("a read with every OSD down");
    assert!(e.to_string().contains("did not answer"), "{e}");

    // Nothing half-applied; an acknowledged write would have to be there.
    let store = common::open().await;
    for (i, acknowledged) in acknowledged.into_iter().enumerate() {
        let round = round_of(&store, &name("timeout", i), i).await;
        assert!(
            round == Some(1) || round == Some(2),
            "object {i}: round {round:?}"
        );
        if acknowledged {
            assert_eq!(round, Some(2));
        }
    }
}

/// Owned-argument write, so that futures can be built in closures and moved into tasks.
trait WriteOwned {
    fn write_op_owned(
        &self,
        object: ObjectName,
        op: WriteOp,
    ) -> impl std::future::Future<Output = Result<ivdisk_store::WriteOutcome, StoreError>> + Send;
}

impl<S: ObjectStore> WriteOwned for S {
    async fn write_op_owned(
        &self,
        object: ObjectName,
        op: WriteOp,
    ) -> Result<ivdisk_store::WriteOutcome, StoreError> {
        self.write_op(&object, op).await
    }
}

/// `ceph ARGS...` against the test cluster (CEPH_CONF).
fn ceph(args: &[&str]) {
    let out = Command::new("ceph")
        .args(args)
        .output()
        .expect("running ceph (package ceph-common)");
    assert!(
        out.status.success(),
        "ceph {args:?} failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// A pool over its quota: writes fail at once with `NoSpace` naming the pool (librados waits
/// for space by default, until the operation timeout says "timed out": the store sets
/// FULL_TRY), what is stored still reads, and once the quota is lifted writes go through.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "makes a pool with a quota on the cluster in IVDISK_CEPH_DIR; run by scripts/test-all.sh"]
async fn a_pool_over_its_quota_is_no_space_at_once_until_the_quota_is_lifted() {
    if let Some(reason) = common::skip_reason() {
        eprintln!("SKIPPED: {reason}");
        return;
    }
    let pool = format!("ivdisk-quota-{}", common::namespace());
    ceph(&["osd", "pool", "create", &pool, "8"]);
    ceph(&[
        "osd",
        "pool",
        "set",
        &pool,
        "size",
        "1",
        "--yes-i-really-mean-it",
    ]);
    ceph(&["osd", "pool", "application", "enable", &pool, "rados"]);
    ceph(&["osd", "pool", "set-quota", &pool, "max_objects", "3"]);
    let timeout = Duration::from_secs(60);
    let store = RadosStore::open(&RadosConfig {
        op_timeout: Some(timeout),
        ..RadosConfig {
            pool: pool.clone(),
            ..common::config()
        }
    })
    .await
    .unwrap();

    // New objects until the monitors mark the pool full (they learn its use every few
    // seconds).
    let deadline = Instant::now() + Duration::from_secs(120);
    let mut n = 0;
    let (e, took) = loop {
        let started = Instant::now();
        match store.write(&name("quota", n), 0, b"data").await {
            Ok(_) => n += 1,
            Err(e) => break (e, started.elapsed()),
        }
        assert!(
            Instant::now() < deadline,
            "the pool never filled ({n} objects)"
        );
        tokio::time::sleep(Duration::from_millis(250)).await;
    };
    assert!(matches!(e, StoreError::NoSpace { .. }), "{e:?}");
    assert!(e.to_string().contains(&pool), "{e}");
    assert!(took < timeout / 2, "refused after {took:?}");
    assert_eq!(store.read(&name("quota", 0), 0, 4).await.unwrap(), b"data");

    ceph(&["osd", "pool", "set-quota", &pool, "max_objects", "0"]);
    loop {
        match store.write(&name("quota", n), 0, b"after").await {
            Ok(_) => break,
            Err(StoreError::NoSpace { .. }) => {}
            Err(e) => panic!("after the quota was lifted: {e}"),
        }
        assert!(Instant::now() < deadline, "the pool stayed full");
        tokio::time::sleep(Duration::from_millis(250)).await;
    }
    assert_eq!(store.read(&name("quota", n), 0, 5).await.unwrap(), b"after");
}

/// A reader's watch dropped while every OSD is down (a read-only image closed in an outage):
/// the drop returns after a bounded wait instead of waiting for the OSDs, and the watch is
/// gone once they are back.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "kills OSDs of the cluster in IVDISK_CEPH_DIR; run by scripts/test-all.sh"]
async fn a_watch_dropped_while_the_osds_are_down_does_not_hang() {
    if let Some(reason) = common::skip_reason() {
        eprintln!("SKIPPED: {reason}");
        return;
    }
    let (reader, remover) = (common::open().await, common::open().await);
    let object = name("watch-outage", 0);
    remover
        .write_op(&object, WriteOp::new().write(0, b"h".to_vec()))
        .await
        .unwrap();
    let watch = reader.watch(&object, b"r".to_vec()).await.unwrap().unwrap();
    let notify = |timeout| remover.notify(&object, timeout);
    assert_eq!(
        notify(Duration::from_secs(5)).await.unwrap().replies.len(),
        1
    );

    let mut guard = RestartOnPanic { armed: true };
    kill_all_osds();
    let started = Instant::now();
    tokio::task::spawn_blocking(move || drop(watch))
        .await
        .unwrap();
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(30),
        "dropping the watch took {took:?} with the OSDs down"
    );
    start_all_osds();
    guard.armed = false;

    let gone_by = Instant::now() + Duration::from_secs(90);
    loop {
        let answers = notify(Duration::from_secs(5)).await.unwrap();
        if answers.replies.is_empty() && answers.unanswered.is_empty() {
            break;
        }
        assert!(
            Instant::now() < gone_by,
            "the dropped watch still answers: {answers:?}"
        );
        tokio::time::sleep(Duration::from_secs(1)).await;
    }
}

/// A read still in flight when its store is dropped (its future given up first) is
/// cancelled, and the drop returns once its completion has fired: librados takes no
/// reference to the io context for a read, and the completion reaches the context, which
/// was destroyed with the store at once (librados then read freed memory).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "kills OSDs of the cluster in IVDISK_CEPH_DIR; run by scripts/test-all.sh"]
async fn a_read_in_flight_when_its_store_is_dropped_completes_before_the_drop_returns() {
    use futures_util::FutureExt;
    if let Some(reason) = common::skip_reason() {
        eprintln!("SKIPPED: {reason}");
        return;
    }
    let store = common::open().await;
    let object = name("read-outlives-store", 0);
    store
        .write_op(&object, WriteOp::new().write(0, b"r".to_vec()))
        .await
        .unwrap();
    let before = RadosStore::reads_in_flight();
    let mut guard = RestartOnPanic { armed: true };
    kill_all_osds();
    // Submitted at its first poll, then given up; with every OSD down it stays in flight.
    assert!(store.read(&object, 0, 1).now_or_never().is_none());
    assert_eq!(RadosStore::reads_in_flight(), before + 1);
    let started = Instant::now();
    tokio::task::spawn_blocking(move || drop(store))
        .await
        .unwrap();
    let took = started.elapsed();
    assert_eq!(
        RadosStore::reads_in_flight(),
        before,
        "the store was dropped with its read still in flight"
    );
    assert!(
        took < Duration::from_secs(5),
        "dropping the store took {took:?}: its read was waited for, not cancelled"
    );
    start_all_osds();
    guard.armed = false;
    let again = common::open().await;
    assert_eq!(again.read(&object, 0, 1).await.unwrap(), b"r");
}
