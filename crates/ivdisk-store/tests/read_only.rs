//! Read-only opening of the local backend (`LocalStore::open_read_only`): it reads what was
//! written (data, omap, snapshots, lockers), refuses every change with `StoreError::ReadOnly`,
//! changes no file of the directory (names, sizes, mtimes and contents compared before and
//! after), and works on a read-only mount, beside a writer in another process or in this one,
//! and after an unclean stop (a writer child killed with SIGKILL, as in `crash.rs`).
//!
//! A truly read-only directory: the tests run as root, for whom permission bits stop no write,
//! so the store is bind-mounted read-only elsewhere (`mount --bind`, then
//! `mount -o remount,bind,ro`) and unmounted when the test ends, also when it fails. Where
//! mounting is impossible the files are made immutable instead (`chattr -R +i`, undone at the
//! end); the tests say which they used.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader};
use std::os::unix::fs::MetadataExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use ivdisk_store::{
    LocalStore, LocalStoreOptions, LockRequest, ObjectName, ObjectStore, ObjectStoreExt, ReadOp,
    ReadResult, ReadStep, SnapContext, StoreError, WriteOp, WriteStep,
};

const CHILD_ENV: &str = "IVDISK_READ_ONLY_WRITER_CHILD";
const CHILD_TEST: &str = "writer_child";
/// Objects the writer child rewrites, round after round.
const OBJECTS: usize = 4;

fn name(s: &str) -> ObjectName {
    ObjectName::new(s).unwrap()
}

fn object(k: usize) -> ObjectName {
    name(&format!("gen/obj{k}"))
}

fn create(path: &Path) -> LocalStore {
    LocalStore::open_with(path, &LocalStoreOptions { create: true }).unwrap()
}

// ---------------------------------------------------------------------------------------------
// Generations: object `k` at generation `g` has a size and a fill byte that depend on both, and
// omap `gen` = g, all written by one operation; a read that mixes two states shows.

fn gen_size(k: usize, g: u64) -> u64 {
    4096 * (1 + (g + k as u64) % 16)
}

fn gen_byte(g: u64) -> u8 {
    (g % 251) as u8 + 1
}

fn gen_op(k: usize, g: u64) -> WriteOp {
    WriteOp::new()
        .step(WriteStep::WriteFull(vec![
            gen_byte(g);
            gen_size(k, g) as usize
        ]))
        .omap_set(vec![(b"gen".to_vec(), g.to_string().into_bytes())])
}

/// Object `k`'s generation, read in one operation and checked whole (size, every byte, omap).
/// 0 if it does not exist.
async fn read_gen(store: &dyn ObjectStore, k: usize) -> Result<u64, String> {
    let op = ReadOp::new()
        .step(ReadStep::Stat)
        .step(ReadStep::Read {
            offset: 0,
            len: 1 << 20,
        })
        .step(ReadStep::OmapGetByKeys(vec![b"gen".to_vec()]));
    let results = match store.read_op(&object(k), op).await {
        Ok(r) => r,
        Err(StoreError::NotFound { .. }) => return Ok(0),
        Err(e) => return Err(format!("reading object {k}: {e}")),
    };
    let [ReadResult::Stat(stat), ReadResult::Extents(extents), ReadResult::Omap { pairs, .. }] =
        results.as_slice()
    else {
        return Err(format!("object {k}: unexpected results {results:?}"));
    };
    let g: u64 = match (pairs.first(), pairs.len()) {
        (Some((_, v)), 1) => std::str::from_utf8(v).unwrap().parse().unwrap(),
        _ => return Err(format!("object {k}: omap {pairs:?}")),
    };
    if stat.size != gen_size(k, g) {
        return Err(format!(
            "object {k}: generation {g} in the omap but size {} (torn)",
            stat.size
        ));
    }
    let mut dense = vec![0u8; stat.size as usize];
    for e in extents {
        dense[e.offset as usize..e.offset as usize + e.data.len()].copy_from_slice(&e.data);
    }
    if let Some(at) = dense.iter().position(|&b| b != gen_byte(g)) {
        return Err(format!(
            "object {k}: generation {g} in the omap but byte {at} is {} (torn)",
            dense[at]
        ));
    }
    Ok(g)
}

async fn read_gens(store: &dyn ObjectStore) -> Vec<u64> {
    let mut gens = Vec::new();
    for k in 0..OBJECTS {
        gens.push(read_gen(store, k).await.unwrap());
    }
    gens
}

// ---------------------------------------------------------------------------------------------
// The writer child: rewrites every object, round after round, flushing every 8th round, until
// killed (or after a minute).

#[test]
fn writer_child() {
    // Only as a child of the tests below.
    let Some(dir) = std::env::var_os(CHILD_ENV) else {
        return;
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async move {
        let store = create(Path::new(&dir));
        let start = read_gens(&store).await.into_iter().max().unwrap_or(0);
        let began = Instant::now();
        let mut g = start + 1;
        while began.elapsed() < Duration::from_secs(60) {
            for k in 0..OBJECTS {
                store.write_op(&object(k), gen_op(k, g)).await.unwrap();
            }
            if g % 8 == 0 {
                store.flush().await.unwrap();
                println!("FLUSHED {g}");
            }
            g += 1;
        }
    });
    std::process::exit(0);
}

/// A writer child on a store directory; killed (SIGKILL) when dropped.
struct Writer {
    child: Child,
    lines: mpsc::Receiver<String>,
}

impl Writer {
    fn spawn(dir: &Path) -> Writer {
        // At most 64 bytes of omap changes held (less than one change): each commit of the
        // writer writes a piece back and deletes the pending rows it empties, which the
        // readers must follow.
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([CHILD_TEST, "--exact", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, dir)
            .env("IVDISK_STORE_OMAP_HELD_MAX", "64")
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .expect("spawning the writer child");
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                let _ = tx.send(line);
            }
        });
        Writer { child, lines }
    }

    /// Wait until the child has flushed generation `at_least`; returns the one it flushed.
    fn flushed(&self, at_least: u64) -> u64 {
        let deadline = Instant::now() + Duration::from_secs(60);
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = self
                .lines
                .recv_timeout(left)
                .expect("the writer child flushes");
            if let Some(g) = line.trim().strip_prefix("FLUSHED ") {
                let g: u64 = g.parse().unwrap();
                if g >= at_least {
                    return g;
                }
            }
        }
    }

    fn kill(mut self) {
        self.child.kill().unwrap();
        self.child.wait().unwrap();
    }
}

impl Drop for Writer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A store left by a writer killed after it flushed generation `at_least`, with later
/// operations unflushed: the log and its index are there, no clean-stop marker. Returns the
/// generation flushed last.
fn killed_writer(dir: &Path, at_least: u64) -> u64 {
    let writer = Writer::spawn(dir);
    let flushed = writer.flushed(at_least);
    writer.kill();
    assert!(dir.join("meta.sqlite-wal").exists());
    assert!(dir.join("meta.sqlite-shm").exists());
    assert!(!dir.join("CLEAN").exists());
    flushed
}

// ---------------------------------------------------------------------------------------------
// The directory as files: what a read-only open must not change.

type DirState = BTreeMap<PathBuf, (u64, i64, i64, Vec<u8>)>;

/// Every file and directory under `dir`: size, mtime (s, ns), contents.
fn dir_state(dir: &Path) -> DirState {
    fn walk(root: &Path, dir: &Path, out: &mut DirState) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            let m = std::fs::symlink_metadata(&path).unwrap();
            let contents = if m.is_file() {
                std::fs::read(&path).unwrap()
            } else {
                Vec::new()
            };
            let rel = path.strip_prefix(root).unwrap().to_owned();
            out.insert(rel, (m.size(), m.mtime(), m.mtime_nsec(), contents));
            if m.is_dir() {
                walk(root, &path, out);
            }
        }
    }
    let mut out = DirState::new();
    let m = std::fs::metadata(dir).unwrap();
    out.insert(
        PathBuf::from("."),
        (0, m.mtime(), m.mtime_nsec(), Vec::new()),
    );
    walk(dir, dir, &mut out);
    out
}

fn assert_unchanged(before: &DirState, after: &DirState) {
    let names = |s: &DirState| s.keys().cloned().collect::<Vec<_>>();
    assert_eq!(names(before), names(after), "files were created or removed");
    for (path, (size, sec, nsec, contents)) in before {
        let (size2, sec2, nsec2, contents2) = &after[path];
        assert_eq!(
            (size, sec, nsec),
            (size2, sec2, nsec2),
            "{} changed",
            path.display()
        );
        assert!(
            contents == contents2,
            "{}: contents changed",
            path.display()
        );
    }
}

// ---------------------------------------------------------------------------------------------
// A read-only view of a directory.

enum How {
    BindMount,
    Immutable,
}

/// `source` made read-only for the test's duration: bind-mounted read-only at another path,
/// or (where mounting fails) made immutable in place. Undone on drop, also on panic.
struct ReadOnlyDir {
    path: PathBuf,
    source: PathBuf,
    how: How,
}

fn run(program: &str, args: &[&str]) -> bool {
    Command::new(program)
        .args(args)
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

impl ReadOnlyDir {
    /// A read-only bind mount of `source` at `at`, if this machine allows one.
    fn bind_mount(source: &Path, at: &Path) -> Option<ReadOnlyDir> {
        std::fs::create_dir_all(at).unwrap();
        let (s, a) = (source.to_str().unwrap(), at.to_str().unwrap());
        if !run("mount", &["--bind", s, a]) {
            return None;
        }
        let view = ReadOnlyDir {
            path: at.to_owned(),
            source: source.to_owned(),
            how: How::BindMount,
        };
        if !run("mount", &["-o", "remount,bind,ro", a]) {
            return None; // dropping `view` unmounts
        }
        // Really read-only, even for root.
        assert!(std::fs::write(at.join("probe"), b"x").is_err());
        Some(view)
    }

    /// A bind mount as above, or `source` itself made immutable (`chattr -R +i`).
    fn new(source: &Path, at: &Path) -> ReadOnlyDir {
        if let Some(view) = Self::bind_mount(source, at) {
            println!("read-only view: a read-only bind mount at {}", at.display());
            return view;
        }
        let s = source.to_str().unwrap();
        assert!(
            run("chattr", &["-R", "+i", s]),
            "neither a read-only bind mount nor chattr +i works here"
        );
        println!("read-only view: {s} made immutable (chattr +i; no mount possible)");
        let view = ReadOnlyDir {
            path: source.to_owned(),
            source: source.to_owned(),
            how: How::Immutable,
        };
        assert!(std::fs::write(source.join("probe"), b"x").is_err());
        view
    }
}

impl Drop for ReadOnlyDir {
    fn drop(&mut self) {
        match self.how {
            How::BindMount => {
                let at = self.path.to_str().unwrap();
                if !run("umount", &[at]) {
                    // Busy (a failing test left a store open): detach it lazily.
                    run("umount", &["-l", at]);
                }
            }
            How::Immutable => {
                run("chattr", &["-R", "-i", self.source.to_str().unwrap()]);
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The tests.

fn assert_read_only<T: std::fmt::Debug>(result: Result<T, StoreError>, what: &str) {
    match result {
        Err(e @ StoreError::ReadOnly { .. }) => {
            assert!(
                e.to_string().contains("the store was opened read-only"),
                "{what}: {e}"
            );
        }
        other => panic!("{what}: expected ReadOnly, got {other:?}"),
    }
}

fn lock_request(name: &str) -> LockRequest {
    LockRequest {
        name: name.into(),
        cookie: "c".into(),
        description: "test".into(),
        duration: None,
        renew: false,
    }
}

#[tokio::test]
async fn reads_a_store_written_before_refuses_changes_and_changes_no_file() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("store");
    let (data, empty, gone, locked) = (
        name("a/data"),
        name("a/empty"),
        name("a/gone"),
        name("a/lock"),
    );
    let before_snap: Vec<u8> = (0..10_000u32).map(|i| (i % 253) as u8).collect();
    let snap = {
        let store = create(&path);
        store
            .write_op(
                &data,
                WriteOp::new()
                    .write(0, before_snap.clone())
                    .write(200_000, vec![7u8; 4096])
                    .omap_set(vec![
                        (b"k1".to_vec(), b"v1".to_vec()),
                        (b"k2".to_vec(), b"v2".to_vec()),
                    ]),
            )
            .await
            .unwrap();
        store
            .write_op(&empty, WriteOp::new().step(WriteStep::CreateExclusive))
            .await
            .unwrap();
        store
            .write(&gone, 0, b"only in the snapshot")
            .await
            .unwrap();
        let snap = store.snap_create().await.unwrap();
        let context = SnapContext {
            seq: snap,
            snaps: vec![snap],
        };
        store
            .write_op(
                &data,
                WriteOp::new()
                    .write(0, vec![9u8; 5000])
                    .with_snap_context(context.clone()),
            )
            .await
            .unwrap();
        store
            .write_op(
                &gone,
                WriteOp::new()
                    .step(WriteStep::Remove)
                    .with_snap_context(context),
            )
            .await
            .unwrap();
        store.write(&locked, 0, b"locked").await.unwrap();
        store
            .lock_exclusive(&locked, lock_request("writer"))
            .await
            .unwrap();
        store.flush().await.unwrap();
        snap
    };
    let before = dir_state(&path);
    assert!(!path.join("meta.sqlite-wal").exists(), "a clean stop");

    let store = LocalStore::open_read_only(&path).unwrap();
    assert!(store.is_read_only());
    assert_eq!(store.recovery_report(), Default::default());
    // Head: data, hole, omap.
    let mut head = vec![9u8; 5000];
    head.extend_from_slice(&before_snap[5000..]);
    assert_eq!(store.read(&data, 0, 10_000).await.unwrap(), head);
    let extents = store.read_sparse(&data, 0, 1 << 20).await.unwrap();
    assert_eq!(
        extents.iter().map(|e| e.offset).collect::<Vec<_>>(),
        [0, 200_000],
        "the hole between the writes"
    );
    assert_eq!(store.stat(&data).await.unwrap().unwrap().size, 204_096);
    assert_eq!(
        store.omap_all(&data).await.unwrap(),
        [
            (b"k1".to_vec(), b"v1".to_vec()),
            (b"k2".to_vec(), b"v2".to_vec())
        ]
    );
    assert_eq!(store.stat(&empty).await.unwrap().unwrap().size, 0);
    assert!(store.stat(&gone).await.unwrap().is_none());
    assert_eq!(
        store.list("a/").await.unwrap(),
        [data.clone(), empty.clone(), locked.clone()]
    );
    // The snapshot.
    let at_snap = store
        .read_op(
            &data,
            ReadOp::new().at_snap(snap).step(ReadStep::Read {
                offset: 0,
                len: 10_000,
            }),
        )
        .await
        .unwrap();
    let [ReadResult::Extents(extents)] = at_snap.as_slice() else {
        panic!("{at_snap:?}")
    };
    assert_eq!(extents[0].data, before_snap);
    let gone_at_snap = store
        .read_op(
            &gone,
            ReadOp::new().at_snap(snap).step(ReadStep::Read {
                offset: 0,
                len: 100,
            }),
        )
        .await
        .unwrap();
    let [ReadResult::Extents(extents)] = gone_at_snap.as_slice() else {
        panic!("{gone_at_snap:?}")
    };
    assert_eq!(extents[0].data, b"only in the snapshot");
    // Lockers are listed.
    let lockers = store.list_lockers(&locked, "writer").await.unwrap();
    assert_eq!(lockers.len(), 1);

    // Every change is refused, whoever asks.
    let other = store.another_client();
    assert!(other.is_read_only());
    for s in [&store, &other] {
        assert_read_only(s.write(&data, 0, b"x").await, "write");
        assert_read_only(s.remove(&data).await, "remove");
        assert_read_only(
            s.write_op(
                &name("a/new"),
                WriteOp::new().step(WriteStep::CreateExclusive),
            )
            .await,
            "create",
        );
        assert_read_only(s.snap_create().await, "snap_create");
        assert_read_only(s.snap_remove(snap).await, "snap_remove");
        assert_read_only(
            s.lock_exclusive(&locked, lock_request("other")).await,
            "lock_exclusive",
        );
        assert_read_only(s.unlock(&locked, "writer", "c").await, "unlock");
        let holder = &lockers[0];
        assert_read_only(
            s.break_lock(&locked, "writer", &holder.client, &holder.cookie)
                .await,
            "break_lock",
        );
        s.flush().await.unwrap();
    }
    // Still all there.
    assert_eq!(store.read(&data, 0, 10_000).await.unwrap(), head);
    drop(other);
    drop(store);
    assert_unchanged(&before, &dir_state(&path));

    // Opening for writing afterwards finds everything as it was (a clean stop).
    let store = LocalStore::open(&path).unwrap();
    assert_eq!(store.recovery_report(), Default::default());
    assert_eq!(store.read(&data, 0, 10_000).await.unwrap(), head);
    assert_eq!(
        store.list_lockers(&locked, "writer").await.unwrap().len(),
        1
    );
}

#[tokio::test]
async fn a_directory_without_a_store_is_not_found_and_stays_empty() {
    let tmp = tempfile::tempdir().unwrap();
    let empty = tmp.path().join("empty");
    std::fs::create_dir(&empty).unwrap();
    match LocalStore::open_read_only(&empty) {
        Err(StoreError::Io { source, .. }) => {
            assert_eq!(source.kind(), std::io::ErrorKind::NotFound)
        }
        Err(e) => panic!("expected NotFound, got {e}"),
        Ok(_) => panic!("opened a store in an empty directory"),
    }
    assert_eq!(std::fs::read_dir(&empty).unwrap().count(), 0);
    assert!(LocalStore::open_read_only(tmp.path().join("missing")).is_err());
    assert!(!tmp.path().join("missing").exists());
}

#[tokio::test]
async fn on_a_read_only_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("store");
    {
        let store = create(&path);
        for k in 0..OBJECTS {
            store.write_op(&object(k), gen_op(k, 5)).await.unwrap();
        }
        store.flush().await.unwrap();
    }
    let before = dir_state(&path);
    let view = ReadOnlyDir::new(&path, &tmp.path().join("ro"));

    // Opening for writing fails, saying what to do instead, and changes nothing.
    match LocalStore::open(&view.path) {
        Err(e @ StoreError::NotWritable { .. }) => {
            let message = e.to_string();
            assert!(message.contains("read-only"), "{message}");
            assert!(message.contains("--read-only"), "{message}");
        }
        Err(e) => panic!("expected NotWritable, got {e}"),
        Ok(_) => panic!("opened a read-only directory for writing"),
    }
    let store = LocalStore::open_read_only(&view.path).unwrap();
    assert_eq!(read_gens(&store).await, [5; OBJECTS]);
    assert_eq!(store.list("gen/").await.unwrap().len(), OBJECTS);
    assert_read_only(store.write(&object(0), 0, b"x").await, "write");
    // Two stores of one directory in one process.
    let second = LocalStore::open_read_only(&view.path).unwrap();
    assert_eq!(read_gens(&second).await, [5; OBJECTS]);
    drop((store, second));
    drop(view);
    assert_unchanged(&before, &dir_state(&path));
}

#[tokio::test]
async fn after_an_unclean_stop() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("store");
    let flushed = killed_writer(&path, 24);
    let before = dir_state(&path);

    // The committed state: at least what was flushed, each object whole.
    let store = LocalStore::open_read_only(&path).unwrap();
    let gens = read_gens(&store).await;
    assert!(
        gens.iter().all(|&g| g >= flushed),
        "{gens:?} lost flushed generation {flushed}"
    );
    assert_eq!(read_gens(&store).await, gens, "the state stays put");
    drop(store);

    // The same through a read-only view.
    {
        let view = ReadOnlyDir::new(&path, &tmp.path().join("ro"));
        let store = LocalStore::open_read_only(&view.path).unwrap();
        assert_eq!(read_gens(&store).await, gens);
        drop(store);
    }

    // A copy without SQLite's index of the log (`-shm`): read from the log alone.
    let copy = copy_without_index(&path, &tmp.path().join("copy"));
    let copy_before = dir_state(&copy);
    let store = LocalStore::open_read_only(&copy).unwrap();
    assert_eq!(read_gens(&store).await, gens);
    drop(store);
    assert_unchanged(&copy_before, &dir_state(&copy));

    // An index of zeros beside a log of commits (a writer killed as it built the index): no
    // writer holds it, and SQLite reads the log's commits into an index of its own.
    let zeroed = copy_without_index(&path, &tmp.path().join("zeroed"));
    let index_len = std::fs::metadata(path.join("meta.sqlite-shm"))
        .unwrap()
        .len();
    std::fs::write(
        zeroed.join("meta.sqlite-shm"),
        vec![0u8; index_len as usize],
    )
    .unwrap();
    let store = LocalStore::open_read_only(&zeroed).unwrap();
    assert_eq!(read_gens(&store).await, gens);
    drop(store);
    let log_header = std::fs::read(path.join("meta.sqlite-wal")).unwrap()[..32].to_vec();

    assert_unchanged(&before, &dir_state(&path));
    // Recovery keeps exactly the committed state the read-only opens saw.
    let store = LocalStore::open(&path).unwrap();
    assert_eq!(read_gens(&store).await, gens);
    drop(store);

    // Killed right after it opened, a writer leaves a log of its header alone (no commit in
    // it) beside an index of zeros. Read through that index, SQLite failed every read with
    // "locking protocol" after 10 s (no read-only command worked until a writer opened the
    // store again); the database file holds every commit.
    std::fs::write(path.join("meta.sqlite-wal"), &log_header).unwrap();
    std::fs::write(path.join("meta.sqlite-shm"), vec![0u8; index_len as usize]).unwrap();
    let store = LocalStore::open_read_only(&path).unwrap();
    assert_eq!(read_gens(&store).await, gens);
}

/// A copy of the store at `from` in `to` without SQLite's index of the log (`-shm`).
fn copy_without_index(from: &Path, to: &Path) -> PathBuf {
    std::fs::create_dir_all(to.join("data")).unwrap();
    for entry in std::fs::read_dir(from).unwrap() {
        let entry = entry.unwrap();
        let name = entry.file_name();
        if entry.file_type().unwrap().is_file() && name != "meta.sqlite-shm" {
            std::fs::copy(entry.path(), to.join(&name)).unwrap();
        }
    }
    for entry in std::fs::read_dir(from.join("data")).unwrap() {
        let entry = entry.unwrap();
        std::fs::copy(entry.path(), to.join("data").join(entry.file_name())).unwrap();
    }
    to.to_path_buf()
}

#[tokio::test]
async fn beside_a_writer_in_another_process() {
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join("store");
    {
        let store = create(&path);
        for k in 0..OBJECTS {
            store.write_op(&object(k), gen_op(k, 1)).await.unwrap();
        }
    }
    // A view of the directory that the writer cannot change through, if mounts work here.
    let view = ReadOnlyDir::bind_mount(&path, &tmp.path().join("ro"));
    // Opened before the writer starts (the database file alone), then during.
    let early = LocalStore::open_read_only(&path).unwrap();
    assert_eq!(read_gens(&early).await, [1; OBJECTS]);
    let writer = Writer::spawn(&path);
    writer.flushed(8);
    let during = LocalStore::open_read_only(&path).unwrap();
    let mounted = view
        .as_ref()
        .map(|v| LocalStore::open_read_only(&v.path).unwrap());
    if mounted.is_none() {
        println!("no read-only bind mount here: reading the writer's path only");
    }
    let mut stores: Vec<(&str, &LocalStore)> = vec![("early", &early), ("during", &during)];
    if let Some(m) = &mounted {
        stores.push(("mounted", m));
    }

    // Every read is whole, and no store goes back in time. Each object is read twice at
    // once, all objects together, so that the store takes the reads in bursts (a read-only
    // store makes a burst's reads in one query, checked as one).
    let mut last = vec![[0u64; OBJECTS]; stores.len()];
    let began = Instant::now();
    let mut reads = 0;
    while began.elapsed() < Duration::from_secs(3) {
        for ((what, store), last) in stores.iter().zip(last.iter_mut()) {
            let round = (0..2 * OBJECTS).map(|i| read_gen(*store, i % OBJECTS));
            let gens = futures_util::future::join_all(round).await;
            let mut lowest = [u64::MAX; OBJECTS];
            for (i, g) in gens.into_iter().enumerate() {
                let (k, g) = (i % OBJECTS, g.unwrap_or_else(|e| panic!("{what}: {e}")));
                assert!(
                    g >= last[k],
                    "{what}: object {k} went back from {} to {g}",
                    last[k]
                );
                lowest[k] = lowest[k].min(g);
                reads += 1;
            }
            *last = lowest;
        }
    }
    // What the writer flushed is seen by every store.
    let flushed = writer.flushed(0);
    for (what, store) in &stores {
        let gens = read_gens(*store).await;
        assert!(
            gens.iter().all(|&g| g >= flushed),
            "{what}: {gens:?} does not show flushed generation {flushed}"
        );
        assert_eq!(store.list("gen/").await.unwrap().len(), OBJECTS);
        assert_read_only(store.write(&object(0), 0, b"x").await, what);
    }
    println!("{reads} whole reads beside the writer, up to generation {flushed}");
    // The writer dies (SIGKILL): the readers go on reading its last committed state.
    writer.kill();
    for (what, store) in &stores {
        let gens = read_gens(*store).await;
        assert!(gens.iter().all(|&g| g >= flushed), "{what}: {gens:?}");
        assert_eq!(read_gens(*store).await, gens, "{what}: the state stays put");
    }
    drop(stores);
    drop((early, during, mounted));
    drop(view);
}

#[tokio::test]
async fn a_writer_in_this_process_beside_readers() {
    let tmp = tempfile::tempdir().unwrap();

    // After an unclean stop a reader reads the log through SQLite's index read-only; a writer
    // opened later in the same process must still get a writable one.
    let path = tmp.path().join("unclean");
    let flushed = killed_writer(&path, 8);
    let reader = LocalStore::open_read_only(&path).unwrap();
    let gens = read_gens(&reader).await;
    assert!(gens.iter().all(|&g| g >= flushed));
    let writer = LocalStore::open(&path).unwrap();
    assert!(!writer.is_read_only());
    let next = gens.iter().max().unwrap() + 1;
    for k in 0..OBJECTS {
        writer.write_op(&object(k), gen_op(k, next)).await.unwrap();
    }
    writer.flush().await.unwrap();
    // The reader sees what the writer committed; a reader opened now too.
    assert_eq!(read_gens(&reader).await, [next; OBJECTS]);
    let second = LocalStore::open_read_only(&path).unwrap();
    assert_eq!(read_gens(&second).await, [next; OBJECTS]);
    assert_read_only(second.write(&object(0), 0, b"x").await, "write");
    drop(writer);
    assert_eq!(read_gens(&reader).await, [next; OBJECTS]);
    assert_eq!(read_gens(&second).await, [next; OBJECTS]);
    drop((reader, second));

    // After a clean stop (the database file alone), the same.
    let path = tmp.path().join("clean");
    {
        let store = create(&path);
        for k in 0..OBJECTS {
            store.write_op(&object(k), gen_op(k, 3)).await.unwrap();
        }
    }
    let reader = LocalStore::open_read_only(&path).unwrap();
    assert_eq!(read_gens(&reader).await, [3; OBJECTS]);
    let writer = LocalStore::open(&path).unwrap();
    for k in 0..OBJECTS {
        writer.write_op(&object(k), gen_op(k, 4)).await.unwrap();
    }
    writer.flush().await.unwrap();
    assert_eq!(read_gens(&reader).await, [4; OBJECTS]);
    drop(writer);
    assert_eq!(read_gens(&reader).await, [4; OBJECTS]);
}

/// A database another process is still creating (no schema yet, or no version row yet) is no
/// store yet for a reader: the open says the directory holds none (NotFound), not that SQLite
/// failed, so `ivdisk create` racing with another goes on to the writer's lock, which tells.
#[test]
fn a_store_being_created_reads_as_none_yet() {
    for schema in [
        "",
        "CREATE TABLE meta (key TEXT PRIMARY KEY, value INTEGER);",
    ] {
        let dir = tempfile::tempdir().unwrap();
        let db = rusqlite::Connection::open(dir.path().join("meta.sqlite")).unwrap();
        db.execute_batch(schema).unwrap();
        drop(db);
        match LocalStore::open_read_only(dir.path()) {
            Err(StoreError::Io { context, source }) => {
                assert_eq!(source.kind(), std::io::ErrorKind::NotFound, "{context}");
                assert!(context.contains("holds no ivdisk store"), "{context}");
            }
            Err(e) => panic!("schema {schema:?}: expected no store, got {e}"),
            Ok(_) => panic!("schema {schema:?}: opened"),
        }
    }
}

/// A reader opened on a store last written by an older version (no pending-change tables)
/// sees what a current writer, opening it afterwards, writes: that writer keeps its changes in
/// the tables it creates, which the reader took as absent for as long as it ran (zeros for a
/// new object, the old bytes of an overwritten one).
#[tokio::test]
async fn a_reader_of_an_older_store_follows_a_newer_writer() {
    let dir = tempfile::tempdir().unwrap();
    let a = name("a");
    let b = name("b");
    {
        let store = create(dir.path());
        store.write(&a, 0, &[1u8; 8192]).await.unwrap();
        store.flush().await.unwrap();
    }
    let db = rusqlite::Connection::open(dir.path().join("meta.sqlite")).unwrap();
    db.execute_batch("DROP TABLE omap_pending; DROP TABLE extents_pending;")
        .unwrap();
    drop(db);
    let reader = LocalStore::open_read_only(dir.path()).unwrap();
    assert_eq!(reader.read(&a, 0, 8192).await.unwrap(), vec![1u8; 8192]);
    let writer = LocalStore::open(dir.path()).unwrap();
    writer.write(&a, 0, &[2u8; 8192]).await.unwrap();
    writer.write(&b, 0, &[3u8; 8192]).await.unwrap();
    writer.flush().await.unwrap();
    assert!(
        reader.read(&a, 0, 8192).await.unwrap() == vec![2u8; 8192],
        "a"
    );
    assert!(
        reader.read(&b, 0, 8192).await.unwrap() == vec![3u8; 8192],
        "b"
    );
    drop(writer);
}
