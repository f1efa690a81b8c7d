//! Bad input for the local backend: invalid names, extents past the object size limit, a second
//! opener (in this process and in another one), a full disk, and reopening after a clean close.
//!
//! The full-disk tests mount a small tmpfs and so need root (CAP_SYS_ADMIN); they fail, loudly,
//! without it.

use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::Command;

use ivdisk_store::small_fs::SmallFileSystem;
use ivdisk_store::{
    Extent, LocalStore, LocalStoreOptions, ObjectName, ObjectStore, ObjectStoreExt, ReadOp,
    ReadResult, ReadStep, SnapContext, Stat, StoreError, WriteOp, WriteStep, MAX_NAME_LEN,
    MAX_OBJECT_SIZE,
};

const CREATE: LocalStoreOptions = LocalStoreOptions { create: true };

fn name(s: &str) -> ObjectName {
    ObjectName::new(s).unwrap()
}

/// `len` bytes of a pattern that depends on `seed` and the position.
fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len as u64)
        .map(|i| {
            (i.wrapping_mul(31).wrapping_add(seed.wrapping_mul(0x9E37)) >> 3) as u8 ^ seed as u8
        })
        .collect()
}

/// Everything observable about an object at the head.
#[derive(Debug, PartialEq, Eq)]
struct State {
    stat: Stat,
    extents: Vec<Extent>,
    omap: Vec<(Vec<u8>, Vec<u8>)>,
}

async fn state(store: &LocalStore, object: &ObjectName) -> State {
    State {
        stat: store
            .stat(object)
            .await
            .unwrap()
            .expect("the object exists"),
        extents: store.read_sparse(object, 0, MAX_OBJECT_SIZE).await.unwrap(),
        omap: store.omap_all(object).await.unwrap(),
    }
}

// ---------------------------------------------------------------------------------------------
// Names.

#[test]
fn invalid_object_names() {
    let too_long = "a".repeat(MAX_NAME_LEN + 1);
    for (bad, why) in [
        ("", "empty"),
        (too_long.as_str(), "1025 bytes"),
        ("a b", "a space"),
        ("a\0b", "a NUL"),
        ("caf\u{e9}", "non-ASCII"),
        ("\u{1F600}", "non-ASCII (4-byte)"),
        ("a\tb", "a tab"),
        ("a\nb", "a newline"),
        ("a\u{7f}b", "DEL"),
    ] {
        let result = ObjectName::new(bad);
        assert!(
            matches!(result, Err(StoreError::InvalidName { .. })),
            "a name with {why} must be InvalidName, got {result:?}"
        );
    }
    let Err(StoreError::InvalidName { reason, .. }) = ObjectName::new("") else {
        unreachable!()
    };
    assert_eq!(reason, "it is empty");
    let Err(StoreError::InvalidName { reason, .. }) = ObjectName::new(too_long) else {
        unreachable!()
    };
    assert_eq!(reason, "it is longer than 1024 bytes");
    let Err(e @ StoreError::InvalidName { .. }) = ObjectName::new("a\0b") else {
        unreachable!()
    };
    // The offending byte is shown escaped, not raw.
    assert!(e.to_string().contains("a\\0b"), "{e}");
    // The limits themselves are fine.
    assert!(ObjectName::new("a".repeat(MAX_NAME_LEN)).is_ok());
    assert!(ObjectName::new("!").is_ok());
    assert!(ObjectName::new("rbd_data.1234/~{}|").is_ok());
}

// ---------------------------------------------------------------------------------------------
// Extents past MAX_OBJECT_SIZE.

fn assert_out_of_range<T: std::fmt::Debug>(
    result: Result<T, StoreError>,
    want_offset: u64,
    want_len: u64,
    what: &str,
) {
    match result {
        Err(StoreError::OutOfRange {
            offset, len, limit, ..
        }) => {
            assert_eq!(
                (offset, len),
                (want_offset, want_len),
                "{what}: reported range"
            );
            assert_eq!(limit, MAX_OBJECT_SIZE, "{what}: reported limit");
        }
        other => panic!("{what}: expected OutOfRange, got {other:?}"),
    }
}

#[tokio::test]
async fn extents_past_max_object_size() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store");
    let store = LocalStore::open_with(&path, &CREATE).unwrap();
    let obj = name("big/obj");
    store
        .write_op(
            &obj,
            WriteOp::new()
                .write(0, pattern(1, 10_000))
                .write(MAX_OBJECT_SIZE - 4096, pattern(2, 4096))
                .omap_set(vec![(b"k".to_vec(), b"v".to_vec())]),
        )
        .await
        .unwrap();
    let before = state(&store, &obj).await;
    assert_eq!(before.stat.size, MAX_OBJECT_SIZE);
    let max = MAX_OBJECT_SIZE;

    let cases: Vec<(&str, WriteOp, u64, u64)> = vec![
        (
            "Write at MAX-1 of 2 bytes",
            WriteOp::new().write(max - 1, vec![9u8; 2]),
            max - 1,
            2,
        ),
        (
            "Write at MAX of 1 byte",
            WriteOp::new().write(max, vec![9u8]),
            max,
            1,
        ),
        (
            "Write whose end overflows u64",
            WriteOp::new().write(u64::MAX, vec![9u8; 2]),
            u64::MAX,
            2,
        ),
        (
            "WriteFull of MAX+1 bytes",
            WriteOp::new().step(WriteStep::WriteFull(vec![0u8; max as usize + 1])),
            0,
            max + 1,
        ),
        (
            "Truncate to MAX+1",
            WriteOp::new().step(WriteStep::Truncate(max + 1)),
            max + 1,
            0,
        ),
        (
            "Truncate to u64::MAX",
            WriteOp::new().step(WriteStep::Truncate(u64::MAX)),
            u64::MAX,
            0,
        ),
        (
            "Zero at MAX-1 of 2 bytes",
            WriteOp::new().step(WriteStep::Zero {
                offset: max - 1,
                len: 2,
            }),
            max - 1,
            2,
        ),
        (
            "Zero starting past MAX",
            WriteOp::new().step(WriteStep::Zero {
                offset: max + 4096,
                len: 4096,
            }),
            max + 4096,
            4096,
        ),
        (
            "Zero whose end overflows u64",
            WriteOp::new().step(WriteStep::Zero {
                offset: 1,
                len: u64::MAX,
            }),
            1,
            u64::MAX,
        ),
        // Atomicity: valid steps before the bad one are not applied either (their appended
        // data is taken back).
        (
            "valid writes + omap, then an out-of-range write",
            WriteOp::new()
                .write(0, vec![0xEE; 300_000])
                .write(5, vec![0xEE; 10])
                .omap_set(vec![(b"k".to_vec(), b"changed".to_vec())])
                .step(WriteStep::Zero {
                    offset: 0,
                    len: 100,
                })
                .write(max - 1, vec![0xEE; 2]),
            max - 1,
            2,
        ),
        (
            "truncate, then an out-of-range truncate",
            WriteOp::new()
                .step(WriteStep::Truncate(0))
                .step(WriteStep::Truncate(max + 1)),
            max + 1,
            0,
        ),
    ];
    for (what, op, offset, len) in cases {
        assert_out_of_range(store.write_op(&obj, op).await, offset, len, what);
        assert_eq!(
            state(&store, &obj).await,
            before,
            "{what}: the object changed (version, size, data or omap)"
        );
    }

    // An out-of-range write to a missing object does not create it.
    let missing = name("big/missing");
    let result = store
        .write_op(
            &missing,
            WriteOp::new()
                .write(0, vec![1u8; 4096])
                .write(max, vec![1u8]),
        )
        .await;
    assert_out_of_range(result, max, 1, "a write to a missing object");
    assert_eq!(store.stat(&missing).await.unwrap(), None);
    assert_eq!(store.list("big/").await.unwrap(), vec![obj.clone()]);

    // The limits themselves are fine.
    let edge = name("big/edge");
    store.write(&edge, max - 1, &[7]).await.unwrap();
    assert_eq!(store.stat(&edge).await.unwrap().unwrap().size, max);
    assert_eq!(store.read(&edge, max - 1, 10).await.unwrap(), vec![7]);
    store
        .write_op(&edge, WriteOp::new().step(WriteStep::Truncate(max)))
        .await
        .unwrap();
    store
        .write_op(
            &edge,
            WriteOp::new().step(WriteStep::Zero {
                offset: max - 1,
                len: 1,
            }),
        )
        .await
        .unwrap();
    assert_eq!(store.read_sparse(&edge, 0, max).await.unwrap(), vec![]);

    // And nothing of the failed operations comes back after a reopen (their appended data was
    // taken back, not left for recovery to misread).
    drop(store);
    let store = LocalStore::open(&path).unwrap();
    assert_eq!(state(&store, &obj).await, before);
    assert_eq!(store.stat(&missing).await.unwrap(), None);
    store.write(&obj, 0, &[1, 2, 3]).await.unwrap();
    assert_eq!(
        store.read(&obj, 0, 4).await.unwrap(),
        vec![1, 2, 3, before.extents[0].data[3]]
    );
}

/// An operation that fails after its first append started a new data segment. Filling the
/// first 1 GiB segment takes a few seconds (overwrites: the dead data is punched, so little disk
/// is used).
#[tokio::test]
async fn out_of_range_after_segment_rotation() {
    let dir = tempfile::tempdir().unwrap();
    let store = LocalStore::open_with(dir.path().join("store"), &CREATE).unwrap();
    let obj = name("rot");
    let mib = vec![7u8; 1 << 20];
    for i in 0..1024 {
        store.write(&obj, 0, &mib).await.unwrap();
        if i % 64 == 63 {
            store.flush().await.unwrap();
        }
    }
    store.flush().await.unwrap();
    // The first append of this operation starts segment 2; the operation then fails.
    let op = WriteOp::new()
        .write(0, vec![1u8])
        .write(MAX_OBJECT_SIZE - 1, vec![0u8; 2]);
    assert_out_of_range(
        store.write_op(&obj, op).await,
        MAX_OBJECT_SIZE - 1,
        2,
        "after a rotation",
    );
    store
        .flush()
        .await
        .expect("the store survives a failed operation");
    assert_eq!(store.read(&obj, 0, 2).await.unwrap(), vec![7, 7]);
    store.write(&obj, 0, &[1]).await.unwrap();
    store.flush().await.unwrap();
    assert_eq!(store.read(&obj, 0, 2).await.unwrap(), vec![1, 7]);
}

// ---------------------------------------------------------------------------------------------
// Two openers.

#[tokio::test]
async fn second_opener_in_this_process_gets_already_open() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store");
    let store = LocalStore::open_with(&path, &CREATE).unwrap();
    store.write(&name("o"), 0, b"first").await.unwrap();
    for options in [LocalStoreOptions { create: false }, CREATE] {
        let started = std::time::Instant::now();
        match LocalStore::open_with(&path, &options) {
            Err(e @ StoreError::AlreadyOpen { .. }) => {
                // Not the wait for a lock a forked child shares (see the next test).
                assert!(
                    started.elapsed() < std::time::Duration::from_secs(4),
                    "the refusal took {:?}",
                    started.elapsed()
                );
                let StoreError::AlreadyOpen { path: p, pid } = &e else {
                    unreachable!()
                };
                assert_eq!(pid, &std::process::id().to_string(), "names our pid");
                assert_eq!(Path::new(p), path.as_path());
                let message = e.to_string();
                assert!(message.contains("stop it first"), "{message}");
            }
            Err(e) => panic!("expected AlreadyOpen, got {e}"),
            Ok(_) => panic!("a second opener in the same process got the store"),
        }
    }
    // The failed opens did not disturb the open store.
    store.write(&name("o"), 5, b", second").await.unwrap();
    assert_eq!(
        store.read(&name("o"), 0, 100).await.unwrap(),
        b"first, second"
    );
    drop(store);
    let store = LocalStore::open(&path).unwrap();
    assert_eq!(
        store.read(&name("o"), 0, 100).await.unwrap(),
        b"first, second"
    );
}

const OPENER_CHILD_ENV: &str = "IVDISK_BAD_INPUT_OPENER";
const OPENER_TEST: &str = "second_opener_process_gets_already_open";

/// In the child: try to open the store, report on stdout, exit with a code saying what happened.
fn opener_child(dir: PathBuf) -> ! {
    let code = match LocalStore::open(&dir) {
        Err(StoreError::AlreadyOpen { pid, .. }) => {
            println!("OPENER already-open pid={pid}");
            10
        }
        Ok(store) => {
            drop(store);
            println!("OPENER opened");
            11
        }
        Err(e) => {
            println!("OPENER error {e}");
            12
        }
    };
    std::process::exit(code)
}

/// Run the opener child on `dir`: its exit code and its report line.
fn run_opener(dir: &Path) -> (i32, String) {
    let out = Command::new(std::env::current_exe().unwrap())
        .args([OPENER_TEST, "--exact", "--nocapture", "--test-threads=1"])
        .env(OPENER_CHILD_ENV, dir)
        .output()
        .expect("running the opener child");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let line = stdout
        .lines()
        .find_map(|l| l.find("OPENER ").map(|at| l[at..].to_owned()))
        .unwrap_or_else(|| {
            panic!(
                "the child reported nothing: {:?}\nstdout: {stdout}\nstderr: {}",
                out.status,
                String::from_utf8_lossy(&out.stderr)
            )
        });
    (out.status.code().unwrap_or(-1), line)
}

#[tokio::test]
async fn second_opener_process_gets_already_open() {
    if let Some(dir) = std::env::var_os(OPENER_CHILD_ENV) {
        opener_child(PathBuf::from(dir));
    }
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store");
    let store = LocalStore::open_with(&path, &CREATE).unwrap();
    store.write(&name("o"), 0, b"held").await.unwrap();

    let (code, line) = run_opener(&path);
    assert_eq!(
        (code, line.as_str()),
        (
            10,
            format!("OPENER already-open pid={}", std::process::id()).as_str()
        ),
        "another process must get AlreadyOpen naming us"
    );
    // Its LOCK file removed (taken for a stale one), the store is still ours: the next opener
    // would make a new LOCK and get its flock; the directory's own keeps it out.
    std::fs::remove_file(path.join("LOCK")).unwrap();
    let (code, line) = run_opener(&path);
    assert_eq!(code, 10, "a second writer got the store: {line}");
    assert!(
        line.starts_with(&format!("OPENER already-open pid={} (", std::process::id())),
        "{line}"
    );
    assert_eq!(
        LocalStore::writing_process(&path).unwrap(),
        Some(std::process::id())
    );
    store.write(&name("o"), 4, b"!").await.unwrap();

    drop(store);
    let (code, line) = run_opener(&path);
    assert_eq!(
        (code, line.as_str()),
        (11, "OPENER opened"),
        "after we closed it"
    );
    // The child closed it too, and nothing was lost.
    let store = LocalStore::open(&path).unwrap();
    assert_eq!(store.read(&name("o"), 0, 10).await.unwrap(), b"held!");
}

// ---------------------------------------------------------------------------------------------
// A full disk.

/// A small tmpfs on a fresh directory ([`SmallFileSystem`]), unmounted on drop.
struct Tmpfs {
    fs: SmallFileSystem,
    _dir: tempfile::TempDir,
}

impl Tmpfs {
    fn mount(size: &str) -> Tmpfs {
        let dir = tempfile::tempdir().unwrap();
        Tmpfs {
            fs: SmallFileSystem::mount(dir.path(), size),
            _dir: dir,
        }
    }

    fn path(&self) -> &Path {
        self.fs.path()
    }

    fn fill(&self, name: &str) -> PathBuf {
        self.fs.fill(name)
    }

    fn free_bytes(&self) -> u64 {
        let s = rustix::fs::statvfs(self.path()).unwrap();
        s.f_bavail * s.f_frsize
    }
}

/// Bytes allocated to the store's data segments.
fn segment_blocks(store_dir: &Path) -> u64 {
    std::fs::read_dir(store_dir.join("data"))
        .unwrap()
        .map(|e| e.unwrap().metadata().unwrap().blocks() * 512)
        .sum()
}

const MIB: usize = 1 << 20;

fn full_name(n: usize) -> ObjectName {
    name(&format!("full/o{n:03}"))
}

async fn check_full_object(store: &LocalStore, n: usize) {
    let o = full_name(n);
    let data = store.read(&o, 0, MIB as u64).await.unwrap();
    assert!(
        data == pattern(n as u64, MIB),
        "object {n} reads back wrong"
    );
    assert_eq!(
        store.omap_all(&o).await.unwrap(),
        vec![(b"n".to_vec(), (n as u64).to_be_bytes().to_vec())],
        "object {n}'s omap"
    );
}

/// Write 1 MiB objects with a flush after each until something fails. Returns the objects
/// acknowledged before the last successful flush.
async fn fill(store: &LocalStore, first: usize) -> Vec<usize> {
    let mut durable = Vec::new();
    for n in first..first + 64 {
        let op = WriteOp::new()
            .write(0, pattern(n as u64, MIB))
            .omap_set(vec![(b"n".to_vec(), (n as u64).to_be_bytes().to_vec())]);
        match store.write_op(&full_name(n), op).await {
            Ok(_) => {}
            Err(e @ StoreError::NoSpace { .. }) => {
                let message = e.to_string();
                println!("full disk: write of object {n} failed: {message}");
                assert!(
                    message.contains("free space and retry"),
                    "the error says what to do: {message}"
                );
                assert!(message.contains("not applied"), "{message}");
                assert_eq!(
                    store.stat(&full_name(n)).await.unwrap(),
                    None,
                    "a write that failed NoSpace was not applied"
                );
                return durable;
            }
            Err(e) => panic!("object {n}: a write on a full disk must fail NoSpace, got {e:?}"),
        }
        match store.flush().await {
            Ok(()) => durable.push(n),
            Err(e) => {
                // The failure surfaced at commit: the flush reports it (and what to do).
                let message = e.to_string();
                println!("full disk: flush after object {n} failed: {message}");
                assert!(
                    message.contains("free space"),
                    "the flush error says what to do: {message}"
                );
                return durable;
            }
        }
    }
    panic!("64 MiB written to a 24 MiB tmpfs without running out of space");
}

#[tokio::test]
async fn full_disk_fails_no_space_then_recovers() {
    let fs = Tmpfs::mount("24m");
    let path = fs.path().join("store");
    let store = LocalStore::open_with(&path, &CREATE).unwrap();

    let durable = fill(&store, 0).await;
    assert!(
        durable.len() >= 16,
        "only {} MiB fit in 24 MiB",
        durable.len()
    );
    println!(
        "full disk: {} objects durable, {} bytes free",
        durable.len(),
        fs.free_bytes()
    );
    for &n in &durable {
        check_full_object(&store, n).await;
    }

    // Free half: the dead data is punched out of the segments at the durable commit.
    let before = segment_blocks(&path);
    let (removed, kept): (Vec<usize>, Vec<usize>) = durable.iter().partition(|&&n| n % 2 == 0);
    for &n in &removed {
        store
            .remove(&full_name(n))
            .await
            .unwrap_or_else(|e| panic!("removing object {n} on a full disk: {e:?}"));
    }
    store.flush().await.expect("a flush after removing objects");
    let after = segment_blocks(&path);
    println!(
        "full disk: removing {} objects took the segments from {before} to {after} bytes; {} \
         bytes free",
        removed.len(),
        fs.free_bytes()
    );
    assert!(
        before - after >= (removed.len() * MIB) as u64 * 9 / 10,
        "removing {} MiB freed only {} bytes of segment space",
        removed.len(),
        before - after
    );
    for &n in &removed {
        assert_eq!(store.stat(&full_name(n)).await.unwrap(), None);
    }
    for &n in &kept {
        check_full_object(&store, n).await;
    }

    // New objects fit again: as many as were removed, give or take the one that failed.
    let first_new = 100;
    let again = fill(&store, first_new).await;
    assert!(
        again.len() + 1 >= removed.len(),
        "after freeing {} MiB only {} new objects fit",
        removed.len(),
        again.len()
    );
    for &n in kept.iter().chain(&again) {
        check_full_object(&store, n).await;
    }

    // A clean close and a reopen on the (still full) disk keep everything.
    drop(store);
    let store = LocalStore::open(&path).unwrap();
    for &n in kept.iter().chain(&again) {
        check_full_object(&store, n).await;
    }
    drop(store);
    drop(fs);
}

/// Operations that need metadata space (big omap values) when the data has filled the disk:
/// those whose commit could not fit are refused before they are acknowledged
/// (`Engine::check_commit_room`), so the flush after them loses nothing, and once space is
/// freed the store works again. (Before, all eight were acknowledged and their commit lost
/// them; with early commits counted by their bytes, some were committed one by one until the
/// room was gone, and the commit that freed space found none.)
#[tokio::test]
async fn full_disk_during_metadata_updates() {
    let fs = Tmpfs::mount("24m");
    let path = fs.path().join("store");
    let store = LocalStore::open_with(&path, &CREATE).unwrap();
    let durable = fill(&store, 0).await;
    let meta = name("full/meta");
    // Everything that goes wrong is collected (and printed), so that one run shows it all.
    let mut problems: Vec<String> = Vec::new();
    let mut acked = Vec::new();
    let mut failures = 0;
    // Built beforehand, so that the updates follow each other quickly (several in one group
    // commit).
    let updates: Vec<Vec<(Vec<u8>, Vec<u8>)>> = (0..8u32)
        .map(|i| {
            (0..64u32)
                .map(|j| {
                    (
                        format!("k{i:02}.{j:02}").into_bytes(),
                        pattern(i as u64, 16 << 10),
                    )
                })
                .collect()
        })
        .collect();
    for (i, pairs) in updates.into_iter().enumerate() {
        let result = store.write_op(&meta, WriteOp::new().omap_set(pairs)).await;
        println!("full disk: omap update {i}: {result:?}");
        match result {
            Ok(_) => acked.push(i),
            Err(e @ StoreError::NoSpace { .. }) => {
                if !e.to_string().contains("free space") {
                    problems.push(format!(
                        "update {i}: the error does not say what to do: {e}"
                    ));
                }
                failures += 1;
            }
            Err(e) => problems.push(format!(
                "omap update {i} on a full disk: expected Ok or NoSpace, got {e:?}"
            )),
        }
    }
    println!(
        "full disk: {} omap updates acknowledged, {failures} failed NoSpace",
        acked.len()
    );
    // The acknowledged updates are durable now.
    let flushed = store.flush().await;
    println!("full disk: flush after the omap updates: {flushed:?}");
    match flushed {
        Ok(()) => {
            let omap = store.omap_all(&meta).await.unwrap_or_default();
            for &i in &acked {
                if !omap
                    .iter()
                    .any(|(k, _)| k == format!("k{i:02}.00").as_bytes())
                {
                    problems.push(format!(
                        "update {i} was acknowledged and flushed but is gone"
                    ));
                }
            }
        }
        Err(e) => problems.push(format!(
            "the flush after the omap updates lost acknowledged ones (they must be refused \
             before they are acknowledged): {e}"
        )),
    }
    for &n in &durable {
        check_full_object(&store, n).await;
    }
    // Free space; the store works again.
    for &n in &durable[..durable.len() / 2] {
        if let Err(e) = store.remove(&full_name(n)).await {
            problems.push(format!("removing object {n}: {e:?}"));
        }
    }
    if let Err(e) = store.flush().await {
        problems.push(format!("the flush after freeing space: {e:?}"));
    }
    let result = store
        .write_op(
            &meta,
            WriteOp::new().omap_set(vec![(b"after".to_vec(), b"ok".to_vec())]),
        )
        .await;
    if let Err(e) = result {
        problems.push(format!("an omap update after freeing space: {e:?}"));
    }
    if let Err(e) = store.flush().await {
        problems.push(format!("the last flush: {e:?}"));
    }
    drop(store);
    drop(fs);
    assert!(problems.is_empty(), "problems:\n{}", problems.join("\n"));
}

/// A commit that fails for lack of space loses its transaction (SQLite rolls it back): the
/// ranges its changes had found dead are live again and must not be punched at the next
/// durable commit (they were, zeroing the old data); the loss is counted
/// (`lost_transactions`), and a write built before it (`unless_lost_since`) is refused.
///
/// The store keeps room for its commits (`reserved-space`), so it takes another program
/// filling the disk twice: the first time the room goes to the commit, the second time
/// nothing is left for it.
#[tokio::test]
async fn a_commit_lost_for_lack_of_space_frees_nothing_and_is_counted() {
    let fs = Tmpfs::mount("16m");
    let path = fs.path().join("store");
    let store = LocalStore::open_with(&path, &CREATE).unwrap();
    let (a, b, c) = (name("lost/a"), name("lost/b"), name("lost/c"));
    let old = pattern(1, 256 << 10);
    store.write(&a, 0, &old).await.unwrap();
    store.flush().await.unwrap();
    let room = path.join("reserved-space");
    assert!(room.is_file(), "no room held for the commits");
    assert!(LocalStore::disk_usage(&path).unwrap().reserved >= 1 << 20);
    let before = store.lost_transactions();
    assert_eq!(before, Some(0));

    // The disk fills up: the commit gets the room, and writes needing new space are refused.
    store.write(&c, 0, b"kept").await.unwrap();
    let filler = fs.fill("filler");
    store
        .flush()
        .await
        .expect("the commit after the disk filled up has the store's room");
    assert!(!room.exists(), "the room was not given to the commit");
    let refused = store.write(&c, 4096, &pattern(3, 256 << 10)).await;
    assert!(
        matches!(&refused, Err(StoreError::NoSpace { context }) if context.contains("kept for the store's metadata")),
        "{refused:?}"
    );

    // Zeroed in the open transaction (the old extent is now dead in it), then the disk
    // fills up again and the commit fails.
    store
        .write_op(
            &a,
            WriteOp::new().step(WriteStep::Zero {
                offset: 0,
                len: old.len() as u64,
            }),
        )
        .await
        .unwrap();
    let filler_again = fs.fill("filler-again");
    let flushed = store.flush().await;
    println!("the flush on the full disk: {flushed:?}");
    assert!(
        matches!(&flushed, Err(StoreError::NoSpace { context }) if context.contains("lost")),
        "{flushed:?}"
    );
    assert_eq!(store.lost_transactions(), Some(1), "the loss is counted");
    assert_eq!(
        store.read(&a, 0, old.len() as u64).await.unwrap(),
        old,
        "the overwrite was lost: the old data is back"
    );

    // A write built before the loss is refused, not applied; one built after it goes in.
    std::fs::remove_file(&filler).unwrap();
    std::fs::remove_file(&filler_again).unwrap();
    let stale = WriteOp {
        unless_lost_since: before,
        ..WriteOp::new().write(0, b"stale".to_vec())
    };
    let refused = store.write_op(&b, stale).await;
    assert!(
        matches!(&refused, Err(StoreError::NoSpace { context }) if context.contains("built on")),
        "{refused:?}"
    );
    assert_eq!(
        store.stat(&b).await.unwrap(),
        None,
        "the refused write was applied"
    );
    let fresh = WriteOp {
        unless_lost_since: store.lost_transactions(),
        ..WriteOp::new().write(0, b"fresh".to_vec())
    };
    store.write_op(&b, fresh).await.unwrap();

    // A durable commit with space again: what the lost transaction found dead stays.
    store.flush().await.unwrap();
    assert_eq!(store.read(&a, 0, old.len() as u64).await.unwrap(), old);
    drop(store);
    let store = LocalStore::open(&path).unwrap();
    assert_eq!(
        store.read(&a, 0, old.len() as u64).await.unwrap(),
        old,
        "after a reopen"
    );
    assert_eq!(store.read(&b, 0, 5).await.unwrap(), b"fresh");
    assert_eq!(
        store.read(&c, 0, 4).await.unwrap(),
        b"kept",
        "the write whose commit had the room"
    );
    drop(store);
    // Closed, the store holds no room (it took it again at the commit after the fillers went).
    assert!(!room.exists(), "a closed store holds its room");
    assert_eq!(LocalStore::disk_usage(&path).unwrap().reserved, 0);
    drop(fs);
}

/// The room a store keeps for its commits (`reserved-space`) is held only while it is open
/// for writing; one left by a store that did not close (a crash) is taken over: made whole at
/// the first commit, removed at the clean close.
#[tokio::test]
async fn the_room_for_commits_is_held_while_open_and_a_leftover_is_taken_over() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store");
    let room = path.join("reserved-space");
    let store = LocalStore::open_with(&path, &CREATE).unwrap();
    store.write(&name("o"), 0, b"one").await.unwrap();
    store.flush().await.unwrap();
    let held = std::fs::metadata(&room).expect("no room held while open");
    assert!(
        held.len() >= 1 << 20 && held.blocks() * 512 >= held.len(),
        "{held:?}"
    );
    drop(store);
    assert!(!room.exists(), "the room outlived the store's clean close");

    std::fs::write(&room, b"left by a crash").unwrap();
    let store = LocalStore::open(&path).unwrap();
    store.write(&name("o"), 0, b"two").await.unwrap();
    store.flush().await.unwrap();
    let taken = std::fs::metadata(&room).unwrap();
    assert_eq!(taken.len(), held.len(), "the leftover was not made whole");
    drop(store);
    assert!(!room.exists(), "the leftover outlived the clean close");
}

/// While the store does not hold its room (it gave it to a commit on a full disk, and takes
/// it again only once twice its size is free), appends of new data leave that much free,
/// whatever happened since the store last looked: another program that took space meanwhile
/// is seen at the next append (it was not, and writes were acknowledged that the next commit
/// had no room for).
#[tokio::test]
async fn appends_leave_the_room_free_while_the_store_does_not_hold_it() {
    let fs = Tmpfs::mount("128m");
    let path = fs.path().join("store");
    let room = path.join("reserved-space");
    let store = LocalStore::open_with(&path, &CREATE).unwrap();
    let (a, b) = (name("room/a"), name("room/b"));
    store.write(&a, 0, b"first").await.unwrap();
    store.flush().await.unwrap();
    let size = std::fs::metadata(&room).expect("no room held").len();

    // The disk fills up; the next commit gets the room.
    store.write(&a, 0, b"second").await.unwrap();
    let filler = fs.fill("filler");
    store.flush().await.unwrap();
    assert!(!room.exists(), "the room was not given to the commit");
    // Space comes back, less than twice the room: the store does not take it again.
    let leave = |file: &Path, free: u64| {
        let now = fs.free_bytes();
        let f = std::fs::OpenOptions::new().write(true).open(file).unwrap();
        let len = f.metadata().unwrap().len();
        let to = (len + now).saturating_sub(free);
        match to > len {
            // Allocated, not sparse.
            true => rustix::fs::fallocate(&f, rustix::fs::FallocateFlags::empty(), len, to - len)
                .unwrap(),
            false => f.set_len(to).unwrap(),
        }
    };
    leave(&filler, size * 7 / 4);
    let len = 256 << 10;
    store
        .write(&b, 0, &pattern(1, len))
        .await
        .expect("an append that leaves the room free");
    // Another program takes space: what is left is less than this append and the room.
    let other = fs.path().join("other");
    std::fs::write(&other, b"").unwrap();
    leave(&other, size + len as u64 / 2);
    let refused = store.write(&b, len as u64, &pattern(2, len)).await;
    assert!(
        matches!(&refused, Err(StoreError::NoSpace { context }) if context.contains("kept for the store's metadata")),
        "{refused:?} with {} bytes free and a room of {size}",
        fs.free_bytes()
    );
    store.flush().await.unwrap();
    assert_eq!(
        store.read(&b, 0, len as u64).await.unwrap(),
        pattern(1, len)
    );
    assert_eq!(store.read(&a, 0, 6).await.unwrap(), b"second");
    drop(store);
    drop(fs);
}

/// A clean close on a nearly full disk leaves the metadata changes the store holds in their
/// log rows, for the next open to replay, instead of writing them back: that write-back took
/// the last blocks of a disk the store's data had filled, and the next open, which commits to
/// take an image's writer lock, found no room at all.
#[tokio::test]
async fn a_clean_close_on_a_nearly_full_disk_leaves_its_room_to_the_next_open() {
    let fs = Tmpfs::mount("32m");
    let path = fs.path().join("store");
    let store = LocalStore::open_with(&path, &CREATE).unwrap();
    // Many small writes with omap values, as an image's: held in memory, in pending rows.
    for batch in 0..250usize {
        let names: Vec<ObjectName> = (0..8)
            .map(|i| name(&format!("close/{batch}.{i}")))
            .collect();
        let ops = names.iter().enumerate().map(|(i, o)| {
            let n = (batch * 8 + i) as u64;
            store.write_op(
                o,
                WriteOp::new()
                    .write(0, pattern(n, 4096))
                    .omap_set(vec![(b"meta".to_vec(), pattern(n, 200))]),
            )
        });
        for result in futures_util::future::join_all(ops).await {
            result.unwrap();
        }
    }
    store.flush().await.unwrap();
    // Another program leaves 1 MiB free.
    let filler = fs.fill("filler");
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(&filler)
        .unwrap();
    f.set_len(f.metadata().unwrap().len() - (1 << 20)).unwrap();
    drop(f);
    // The room the store held comes back at the close.
    let before = fs.free_bytes() + LocalStore::disk_usage(&path).unwrap().reserved;
    drop(store);
    let after = fs.free_bytes();
    println!("free before the close (and the store's room): {before}, after: {after}");
    assert!(
        after + (64 << 10) >= before,
        "the close took {} bytes of a nearly full disk",
        before.saturating_sub(after)
    );
    let store = LocalStore::open(&path).unwrap();
    let o = name("close/after");
    store
        .write_op(
            &o,
            WriteOp::new()
                .write(0, b"small".to_vec())
                .omap_set(vec![(b"k".to_vec(), b"v".to_vec())]),
        )
        .await
        .unwrap();
    store.flush().await.expect("a commit after the reopen");
    for n in [0u64, 999, 1999] {
        let (batch, i) = (n as usize / 8, n as usize % 8);
        let o = name(&format!("close/{batch}.{i}"));
        assert_eq!(store.read(&o, 0, 4096).await.unwrap(), pattern(n, 4096));
        assert_eq!(
            store.omap_all(&o).await.unwrap(),
            vec![(b"meta".to_vec(), pattern(n, 200))]
        );
    }
    drop(store);
    drop(fs);
}

/// A child process forked by any thread shares the open file description of the store's
/// `LOCK`, and with it the `flock`, until it `exec`s. A store closed and reopened in that
/// window must wait for it, not report that the store is open: the test holds the lock on
/// another description of the file, as such a child does, and lets it go after a while.
#[tokio::test]
async fn a_lock_only_a_forking_child_shares_is_waited_for() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store");
    let store = LocalStore::open_with(&path, &CREATE).unwrap();
    store.write(&name("o"), 0, b"kept").await.unwrap();
    drop(store);

    let hold = |for_how_long: std::time::Duration| {
        let lock = std::fs::File::open(path.join("LOCK")).unwrap();
        // Free once the store is closed, but for a moment more if another test's thread
        // forked (a child spawned) while it was open: that child shares it until its exec.
        let free_by = std::time::Instant::now() + std::time::Duration::from_secs(5);
        while let Err(e) = lock.try_lock() {
            assert!(
                std::time::Instant::now() < free_by,
                "the store's lock is still held 5 s after it was closed: {e}"
            );
            std::thread::sleep(std::time::Duration::from_millis(5));
        }
        std::thread::spawn(move || {
            std::thread::sleep(for_how_long);
            drop(lock);
        })
    };
    let child = hold(std::time::Duration::from_millis(300));
    let started = std::time::Instant::now();
    let store = LocalStore::open(&path).expect("the reopen waits for the child's exec");
    assert!(
        started.elapsed() >= std::time::Duration::from_millis(250),
        "the lock was held by another description, the open cannot have had it at once"
    );
    assert_eq!(store.read(&name("o"), 0, 10).await.unwrap(), b"kept");
    drop(store);
    child.join().unwrap();

    // A holder that never lets go (a child that does not exec) is reported, naming our pid.
    let child = hold(std::time::Duration::from_secs(8));
    match LocalStore::open(&path) {
        Err(StoreError::AlreadyOpen { pid, .. }) => {
            assert_eq!(pid, std::process::id().to_string())
        }
        Err(e) => panic!("expected AlreadyOpen, got {e}"),
        Ok(_) => panic!("opened a store whose lock another description holds"),
    }
    child.join().unwrap();
    LocalStore::open(&path).expect("the lock is free again");
}

// ---------------------------------------------------------------------------------------------
// Reopening after a clean close.

#[tokio::test]
async fn reopen_after_clean_close_keeps_everything() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store");
    let store = LocalStore::open_with(&path, &CREATE).unwrap();
    let (a, b, c) = (name("img/a"), name("img/b"), name("img/c"));

    // `a`: data with holes, a zeroed range, a truncation, and more omap pairs than one page.
    let pairs: Vec<(Vec<u8>, Vec<u8>)> = (0..1500u32)
        .map(|i| {
            (
                format!("key{i:05}").into_bytes(),
                pattern(i as u64, (i % 50) as usize),
            )
        })
        .collect();
    store
        .write_op(
            &a,
            WriteOp::new()
                .write(0, pattern(1, 300_000))
                .write(1 << 20, pattern(2, 5000))
                .step(WriteStep::Zero {
                    offset: 4096,
                    len: 8192,
                })
                .write(3 << 20, pattern(3, 100))
                .step(WriteStep::Truncate((3 << 20) + 50))
                .omap_set(pairs.clone())
                .step(WriteStep::OmapRemoveRange {
                    start: b"key00100".to_vec(),
                    end: b"key00200".to_vec(),
                }),
        )
        .await
        .unwrap();
    store.write(&c, 0, &pattern(4, 70_000)).await.unwrap();

    // A snapshot, then changes under its context: `a` rewritten, `b` born, `c` removed.
    let snap = store.snap_create().await.unwrap();
    let context = SnapContext {
        seq: snap,
        snaps: vec![snap],
    };
    let at_snap_a = state(&store, &a).await;
    let at_snap_c = state(&store, &c).await;
    store
        .write_op(
            &a,
            WriteOp::new()
                .write(100, pattern(5, 200_000))
                .omap_set(vec![(b"key00000".to_vec(), b"new".to_vec())])
                .step(WriteStep::OmapRemoveKeys(vec![b"key01499".to_vec()]))
                .with_snap_context(context.clone()),
        )
        .await
        .unwrap();
    store
        .write_op(
            &b,
            WriteOp::new()
                .write(10, b"born after".to_vec())
                .with_snap_context(context.clone()),
        )
        .await
        .unwrap();
    store
        .write_op(
            &c,
            WriteOp::new()
                .step(WriteStep::Remove)
                .with_snap_context(context.clone()),
        )
        .await
        .unwrap();
    let head_a = state(&store, &a).await;
    let head_b = state(&store, &b).await;
    assert_ne!(head_a, at_snap_a);
    assert_eq!(head_a.omap.len(), 1500 - 100 - 1);

    /// The state of an object at a snapshot.
    async fn state_at(store: &LocalStore, object: &ObjectName, snap: u64) -> Option<State> {
        let op = ReadOp::new()
            .at_snap(snap)
            .step(ReadStep::Stat)
            .step(ReadStep::Read {
                offset: 0,
                len: MAX_OBJECT_SIZE,
            })
            .step(ReadStep::OmapGetRange {
                start: vec![],
                end: None,
                max: 100_000,
            });
        match store.read_op(object, op).await {
            Ok(results) => match &results[..] {
                [ReadResult::Stat(stat), ReadResult::Extents(extents), ReadResult::Omap { pairs, more: false }] => {
                    Some(State {
                        stat: *stat,
                        extents: extents.clone(),
                        omap: pairs.to_vec(),
                    })
                }
                other => panic!("a snapshot read returned {other:?}"),
            },
            Err(StoreError::NotFound { .. }) => None,
            Err(e) => panic!("reading {object} at snapshot {snap}: {e}"),
        }
    }
    assert_eq!(state_at(&store, &a, snap).await.as_ref(), Some(&at_snap_a));
    assert_eq!(state_at(&store, &b, snap).await, None);
    assert_eq!(state_at(&store, &c, snap).await.as_ref(), Some(&at_snap_c));

    // A clean close (no flush: closing commits durably) and a reopen.
    drop(store);
    let store = LocalStore::open(&path).unwrap();
    assert_eq!(state(&store, &a).await, head_a, "head of a");
    assert_eq!(state(&store, &b).await, head_b, "head of b");
    assert_eq!(store.stat(&c).await.unwrap(), None, "c was removed");
    assert_eq!(
        store.list("img/").await.unwrap(),
        vec![a.clone(), b.clone()]
    );
    assert_eq!(
        state_at(&store, &a, snap).await.as_ref(),
        Some(&at_snap_a),
        "a at the snapshot"
    );
    assert_eq!(state_at(&store, &b, snap).await, None, "b at the snapshot");
    assert_eq!(
        state_at(&store, &c, snap).await.as_ref(),
        Some(&at_snap_c),
        "c at the snapshot"
    );
    assert_eq!(
        store.read(&a, 0, 10).await.unwrap(),
        pattern(1, 300_000)[..10].to_vec(),
        "dense read of a"
    );

    // Ids and versions continue where they were.
    let next = store.snap_create().await.unwrap();
    assert!(next > snap, "snapshot ids go on increasing after a reopen");
    let v = store.write(&b, 0, b"x").await.unwrap().version;
    assert!(
        v > head_a.stat.version && v > head_b.stat.version,
        "versions go on increasing"
    );

    // Removing the snapshot frees its preserved states, also after a reopen.
    store.reclaim_space().await.unwrap();
    let before = segment_blocks(&path);
    store.snap_remove(snap).await.unwrap();
    store.reclaim_space().await.unwrap();
    let after = segment_blocks(&path);
    assert!(
        before >= after + 60_000,
        "removing the snapshot freed {} bytes (its preserved states hold ~270 KB of dead data)",
        before as i64 - after as i64
    );
    assert_eq!(
        state_at(&store, &c, next).await,
        None,
        "c at the later snapshot"
    );
    assert!(matches!(
        store.read_op(&a, ReadOp::new().at_snap(snap).step(ReadStep::Stat)).await,
        Err(StoreError::NoSuchSnapshot(s)) if s == snap
    ));
    drop(store);
    let store = LocalStore::open(&path).unwrap();
    assert_eq!(state(&store, &a).await, head_a);
    assert!(matches!(
        store.snap_remove(snap).await,
        Err(StoreError::NoSuchSnapshot(s)) if s == snap
    ));
}

/// Small writes (gathered in memory before they reach the segment file) on a disk that fills
/// up: the write that does not fit fails itself with `NoSpace`, and nothing acknowledged
/// before it is lost, flushed or not.
#[tokio::test]
async fn full_disk_small_writes_fail_themselves() {
    let fs = Tmpfs::mount("24m");
    let path = fs.path().join("store");
    let store = LocalStore::open_with(&path, &CREATE).unwrap();
    // Room for the metadata's commits after the data filled the disk: freed at the end.
    let ballast = fs.path().join("ballast");
    std::fs::write(&ballast, vec![7u8; 2 * MIB]).unwrap();
    // Under the size the store gathers, off block boundaries.
    let len = 60_000;
    let mut acknowledged = Vec::new();
    let mut refused = None;
    for n in 0..1000usize {
        match store.write(&full_name(n), 0, &pattern(n as u64, len)).await {
            Ok(_) => acknowledged.push(n),
            Err(e @ StoreError::NoSpace { .. }) => {
                refused = Some(e);
                break;
            }
            Err(e) => panic!("write {n}: {e:?}"),
        }
        // Every other write: the gathered appends then reach the file at the flushes' commits
        // (which would lose every write since the last flush, were their space not allocated
        // ahead), not when they fill the gathering buffer.
        if n % 2 == 1 {
            store
                .flush()
                .await
                .unwrap_or_else(|e| panic!("a flush after write {n} (not a write) failed: {e:?}"));
        }
    }
    let refused = refused.expect("24 MiB filled without a write refused");
    println!(
        "full disk: {} small writes acknowledged, then: {refused}",
        acknowledged.len()
    );
    assert!(
        acknowledged.len() >= 100,
        "only {} writes fit",
        acknowledged.len()
    );
    std::fs::remove_file(&ballast).unwrap();
    store
        .flush()
        .await
        .expect("the flush after the refused write");
    for &n in &acknowledged {
        assert_eq!(
            store.read(&full_name(n), 0, len as u64).await.unwrap(),
            pattern(n as u64, len),
            "acknowledged write {n} reads back wrong"
        );
    }
    drop(store);
    let store = LocalStore::open(&path).unwrap();
    for &n in &acknowledged {
        assert_eq!(
            store.read(&full_name(n), 0, len as u64).await.unwrap(),
            pattern(n as u64, len),
            "acknowledged write {n} reads back wrong after a reopen"
        );
    }
}

/// A segment file cut short behind the store's back (a bad copy, a truncate) is damage said
/// as such: the read of an extent past its end names the file and the sizes (it read "failed
/// to fill whole buffer"), on read-write and read-only opens, and the extents before the cut
/// still read.
#[tokio::test]
async fn a_segment_cut_short_is_named_as_damage() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s");
    let len = 1 << 20;
    {
        let store = LocalStore::open_with(&path, &CREATE).unwrap();
        for (i, object) in ["whole", "cut"].into_iter().enumerate() {
            let op = WriteOp::new().step(WriteStep::Write {
                offset: 0,
                data: pattern(i as u64, len),
            });
            store.write_op(&name(object), op).await.unwrap();
        }
        store.flush().await.unwrap();
    }
    let segment = path.join("data").join("seg-00000001");
    let cut_to = std::fs::metadata(&segment).unwrap().len() - len as u64 / 2;
    std::fs::OpenOptions::new()
        .write(true)
        .open(&segment)
        .unwrap()
        .set_len(cut_to)
        .unwrap();
    for read_only in [false, true] {
        let store = if read_only {
            LocalStore::open_read_only(&path).unwrap()
        } else {
            LocalStore::open(&path).unwrap()
        };
        assert_eq!(
            store.read(&name("whole"), 0, len as u64).await.unwrap(),
            pattern(0, len),
            "read-only {read_only}"
        );
        let err = store.read(&name("cut"), 0, len as u64).await.unwrap_err();
        let text = err.to_string();
        assert!(
            matches!(err, StoreError::Corrupt(_))
                && text.contains("seg-00000001")
                && text.contains(&format!("holds {cut_to} bytes")),
            "read-only {read_only}: {text}"
        );
    }
}

/// A segment file deleted behind the store's back is damage named with its path and what to
/// do: it read as "an extent points into missing segment 1", naming neither, and a writer's
/// open made the last one again, empty.
#[tokio::test]
async fn a_missing_segment_is_named_with_what_to_do() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s");
    {
        let store = LocalStore::open_with(&path, &CREATE).unwrap();
        store
            .write(&name("o"), 0, &pattern(1, 256 << 10))
            .await
            .unwrap();
        store.flush().await.unwrap();
    }
    let segment = path.join("data").join("seg-00000001");
    std::fs::remove_file(&segment).unwrap();
    for read_only in [false, true] {
        let opened = if read_only {
            LocalStore::open_read_only(&path)
        } else {
            LocalStore::open(&path)
        };
        let err = match opened {
            Ok(store) => store.read(&name("o"), 0, 4096).await.unwrap_err(),
            Err(e) => e,
        };
        let text = err.to_string();
        assert!(
            matches!(err, StoreError::Corrupt(_))
                && text.contains(&format!("{} is missing", segment.display()))
                && text.contains("restore the image from a backup"),
            "read-only {read_only}: {text}"
        );
        // A writer's open made it again, empty: the data in it then read as cut short, and
        // appends went on behind a hole.
        assert!(
            !segment.exists(),
            "read-only {read_only}: the open made the segment again"
        );
    }
}

/// The store's database or data directory deleted under an open store: the writes after go
/// into files nothing will read again, and every flush said they were durable. Now flushes
/// fail, naming what is gone.
#[tokio::test]
async fn flushes_fail_once_the_store_files_are_deleted_under_it() {
    for gone in ["meta.sqlite", "data"] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s");
        let store = LocalStore::open_with(&path, &CREATE).unwrap();
        store.write(&name("o"), 0, &pattern(1, 8192)).await.unwrap();
        store.flush().await.unwrap();
        let removed = path.join(gone);
        match gone {
            "data" => std::fs::remove_dir_all(&removed).unwrap(),
            _ => std::fs::remove_file(&removed).unwrap(),
        }
        store.write(&name("o"), 0, &pattern(2, 8192)).await.unwrap();
        let err = store.flush().await.unwrap_err();
        let text = err.to_string();
        assert!(
            text.contains(&format!("{} was deleted or replaced", removed.display())),
            "{gone}: {text}"
        );
        // And every flush after.
        let again = store.flush().await.unwrap_err().to_string();
        assert!(again.contains("was deleted or replaced"), "{gone}: {again}");
    }
}

/// A store whose metadata database was removed while its data segments stayed is named as
/// damaged by every open, and a create over it is refused: it was taken for no store at all
/// ("does not exist"), and a store created there cut the old segments to nothing.
/// The same with the database cut to nothing (a crash, a full disk, a stray `: > file`):
/// SQLite takes an empty file for a new database, and so the store took it for no store.
#[tokio::test]
async fn segments_without_their_database_are_damage_not_an_empty_directory() {
    for cut_to_nothing in [false, true] {
        segments_without_their_database(cut_to_nothing).await;
    }
}

async fn segments_without_their_database(cut_to_nothing: bool) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("store");
    let store = LocalStore::open_with(&path, &CREATE).unwrap();
    store
        .write(&name("o"), 0, &vec![7u8; 256 << 10])
        .await
        .unwrap();
    store.flush().await.unwrap();
    drop(store);
    for file in ["meta.sqlite", "meta.sqlite-wal", "meta.sqlite-shm"] {
        let _ = std::fs::remove_file(path.join(file));
    }
    if cut_to_nothing {
        std::fs::write(path.join("meta.sqlite"), b"").unwrap();
    }
    let segments = || {
        std::fs::read_dir(path.join("data"))
            .unwrap()
            .map(|e| e.unwrap().metadata().unwrap().len())
            .collect::<Vec<_>>()
    };
    let before = segments();
    assert!(before.iter().sum::<u64>() >= 256 << 10, "{before:?}");
    let opens = [
        LocalStore::open_with(&path, &LocalStoreOptions { create: false }).map(drop),
        LocalStore::open_with(&path, &CREATE).map(drop),
        LocalStore::open_read_only(&path).map(drop),
    ];
    for open in opens {
        match open {
            Err(e @ StoreError::Corrupt(_)) => {
                let text = e.to_string();
                assert!(
                    text.contains("no metadata database") && text.contains("meta.sqlite"),
                    "{text}"
                );
            }
            other => panic!("expected Corrupt, got {other:?}"),
        }
    }
    assert_eq!(segments(), before, "the segments changed");
    let database = std::fs::metadata(path.join("meta.sqlite")).map(|m| m.len());
    match cut_to_nothing {
        false => assert!(database.is_err(), "a database was made"),
        true => assert_eq!(database.unwrap(), 0, "a database was made"),
    }
}
