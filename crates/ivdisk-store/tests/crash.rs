//! Crash consistency of the local backend under SIGKILL.
//!
//! The test binary re-executes itself as a writer child (env `IVDISK_CRASH_CHILD=<dir>`), kills
//! it with SIGKILL at a random moment, reopens the store and checks, for every object:
//!
//! - durability: the object's generation `G` (omap key "gen") is at least the generation the
//!   child had acknowledged before its last completed `flush()` (the "watermark" files);
//! - atomicity: the object's whole state (dense content, size, all omap pairs) is exactly the
//!   state of replaying generations `1..=G` in memory: a prefix of whole operations.
//!
//! Every operation is a deterministic function of (object, generation), so the verifier can
//! recompute it. Most children are killed 30..300 ms after they are ready; one in eight while
//! starting (opening and recovering the store); every twelfth after 0.6..1.4 s (so that kills
//! also land around checkpoints of the metadata log). `IVDISK_CRASH_ROUNDS` sets the number of
//! kills (default 100); `IVDISK_CRASH_SEED` fixes the parent's timing choices.

mod common;

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{BufRead, BufReader, Write};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{mpsc, Arc};
use std::time::{Duration, Instant};

use common::{check_object, current_gen, mix, object_name, object_op, Model, Rng};
use ivdisk_store::{
    LocalStore, LocalStoreOptions, ObjectStore, ObjectStoreExt, RecoveryReport, StoreError,
};

const TEST_NAME: &str = "sigkill_crash_consistency";
const CHILD_ENV: &str = "IVDISK_CRASH_CHILD";
const ROUNDS_ENV: &str = "IVDISK_CRASH_ROUNDS";
const SEED_ENV: &str = "IVDISK_CRASH_SEED";
const READY: &str = "IVDISK_CRASH_CHILD_READY";
/// The store's idle time before it compacts its metadata (read by the store as it opens).
const COMPACT_IDLE_ENV: &str = "IVDISK_STORE_COMPACT_IDLE_MS";

const OBJECTS: usize = 8;
/// Concurrent writer chains in the child (each owns objects `t` and `t + WRITERS`).
const WRITERS: usize = 4;
/// Every operation stays inside `[0, SPAN)`.
const SPAN: u64 = 1 << 20;
const MAX_WRITE: u64 = 256 << 10;
/// Writes up to this long are "small".
const SMALL_WRITE: u64 = 4096;
/// Object names: `PREFIX/o<k>`.
const OBJECT_PREFIX: &str = "crash";

// ---------------------------------------------------------------------------------------------
// Files the child leaves for the parent.

/// The durable watermark: written atomically and durably after each completed flush.
const WATERMARK: &str = "watermark";
/// The same, written (atomically, not synced) right after the flush returns and before the
/// durable one: a SIGKILL cannot lose it (the page cache survives), and it narrows the window
/// between a flush completing and its claim being on record to microseconds.
const WATERMARK_FAST: &str = "watermark.fast";

fn acked_path(root: &Path) -> PathBuf {
    root.join("acked")
}

fn store_path(root: &Path) -> PathBuf {
    root.join("store")
}

/// Replace the watermark file `name` atomically (write a temporary file, rename it over), and
/// durably if `durable` (sync the file before the rename and the directory after it).
fn write_watermark(
    root: &Path,
    name: &str,
    gens: &[u64; OBJECTS],
    durable: bool,
) -> std::io::Result<()> {
    let tmp = root.join(format!("{name}.tmp"));
    let mut f = File::create(&tmp)?;
    let text: Vec<String> = gens.iter().map(|g| g.to_string()).collect();
    writeln!(f, "{}", text.join(" "))?;
    if durable {
        f.sync_all()?;
    }
    drop(f);
    std::fs::rename(&tmp, root.join(name))?;
    if durable {
        File::open(root)?.sync_all()?;
    }
    Ok(())
}

fn read_watermark(root: &Path, name: &str) -> [u64; OBJECTS] {
    let mut out = [0; OBJECTS];
    match std::fs::read_to_string(root.join(name)) {
        Ok(text) => {
            let values: Vec<u64> = text
                .split_whitespace()
                .map(|v| v.parse().expect("a watermark is a number"))
                .collect();
            assert_eq!(
                values.len(),
                OBJECTS,
                "watermark file `{text}` is malformed"
            );
            out.copy_from_slice(&values);
        }
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
        Err(e) => panic!("reading the watermark: {e}"),
    }
    out
}

/// The generations the child had acknowledged when it died (not synced: page cache survives a
/// SIGKILL), or `None` if it died before writing them.
fn read_acked(root: &Path) -> Option<[u64; OBJECTS]> {
    let bytes = std::fs::read(acked_path(root)).ok()?;
    if bytes.len() != 8 * OBJECTS {
        return None;
    }
    let mut out = [0; OBJECTS];
    for (k, v) in out.iter_mut().enumerate() {
        *v = u64::from_le_bytes(bytes[8 * k..8 * k + 8].try_into().unwrap());
    }
    Some(out)
}

// ---------------------------------------------------------------------------------------------
// The child: writes until killed.

fn child_main(root: PathBuf) -> ! {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    runtime.block_on(async move {
        let store = LocalStore::open_with(store_path(&root), &LocalStoreOptions { create: true })
            .unwrap_or_else(|e| panic!("child: opening the store: {e}"));
        let store = Arc::new(store);
        let mut start = [0u64; OBJECTS];
        for (k, g) in start.iter_mut().enumerate() {
            *g = current_gen(&store, k).await;
        }
        let acked_file = Arc::new(File::create(acked_path(&root)).unwrap());
        let bytes: Vec<u8> = start.iter().flat_map(|g| g.to_le_bytes()).collect();
        acked_file.write_all_at(&bytes, 0).unwrap();
        let acked: Arc<Vec<AtomicU64>> =
            Arc::new(start.iter().map(|&g| AtomicU64::new(g)).collect());
        let mut seed = Rng(mix(std::process::id() as u64)
            ^ std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64);

        println!("{READY}");
        std::io::stdout().flush().unwrap();

        let compacting = std::env::var(COMPACT_IDLE_ENV).is_ok_and(|v| v == "0");
        let mut tasks = Vec::new();
        for t in 0..WRITERS {
            let (store, acked, acked_file) = (store.clone(), acked.clone(), acked_file.clone());
            let mut rng = Rng(seed.next());
            tasks.push(tokio::spawn(async move {
                loop {
                    let k = if rng.below(2) == 0 { t } else { t + WRITERS };
                    let g = acked[k].load(Ordering::SeqCst) + 1;
                    let op = object_op(k, g);
                    if let Err(e) = store.write_op(&object_name(k), op).await {
                        panic!("child: operation {g} on object {k} failed: {e}");
                    }
                    acked[k].store(g, Ordering::SeqCst);
                    acked_file
                        .write_all_at(&g.to_le_bytes(), 8 * k as u64)
                        .unwrap();
                    if compacting {
                        tokio::time::sleep(Duration::from_millis(rng.below(4))).await;
                    }
                }
            }));
        }
        {
            let (store, acked, root) = (store.clone(), acked.clone(), root.clone());
            let mut rng = Rng(seed.next());
            tasks.push(tokio::spawn(async move {
                loop {
                    tokio::time::sleep(Duration::from_millis(rng.below(40))).await;
                    let mut before = [0u64; OBJECTS];
                    for (k, g) in before.iter_mut().enumerate() {
                        *g = acked[k].load(Ordering::SeqCst);
                    }
                    if let Err(e) = store.flush().await {
                        panic!("child: flush failed: {e}");
                    }
                    write_watermark(&root, WATERMARK_FAST, &before, false).unwrap();
                    write_watermark(&root, WATERMARK, &before, true).unwrap();
                }
            }));
        }
        for task in tasks {
            if let Err(e) = task.await {
                eprintln!("child: a task failed: {e}");
                std::process::exit(101);
            }
        }
    });
    eprintln!("child: the writers stopped");
    std::process::exit(102);
}

// ---------------------------------------------------------------------------------------------
// The parent.

/// The number of data segment files and the bytes allocated to them.
fn segment_usage(store: &Path) -> (u64, u64) {
    use std::os::unix::fs::MetadataExt;
    let Ok(dir) = std::fs::read_dir(store.join("data")) else {
        return (0, 0);
    };
    let mut count = 0;
    let mut allocated = 0;
    for entry in dir.filter_map(|e| e.ok()) {
        if let Ok(meta) = entry.metadata() {
            count += 1;
            allocated += meta.blocks() * 512;
        }
    }
    (count, allocated)
}

/// The bytes of the objects' written extents (what the segments must hold).
async fn live_bytes(store: &Path) -> u64 {
    let store = LocalStore::open(store).unwrap();
    let mut live = 0;
    for k in 0..OBJECTS {
        match store.read_sparse(&object_name(k), 0, SPAN).await {
            Ok(extents) => live += extents.iter().map(|e| e.data.len() as u64).sum::<u64>(),
            Err(StoreError::NotFound { .. }) => {}
            Err(e) => panic!("reading object {k}: {e}"),
        }
    }
    live
}

/// Counts by bucket, for the report.
#[derive(Default)]
struct Histogram(BTreeMap<&'static str, u64>);

impl Histogram {
    fn add(&mut self, v: u64) {
        let bucket = match v {
            0 => "0",
            1 => "1",
            2..=4 => "2-4",
            5..=16 => "5-16",
            17..=64 => "17-64",
            _ => ">64",
        };
        *self.0.entry(bucket).or_default() += 1;
    }
}

impl std::fmt::Display for Histogram {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for bucket in ["0", "1", "2-4", "5-16", "17-64", ">64"] {
            write!(
                f,
                " [{bucket}]: {}",
                self.0.get(bucket).copied().unwrap_or(0)
            )?;
        }
        Ok(())
    }
}

/// Spawn the writer child; returns it and a channel that gets `()` when it is ready. Every
/// other child holds at most 2 KiB of omap changes in memory (the default is 128 MiB, which
/// these writes never reach): each of its commits then writes a piece back and deletes the
/// pending rows it empties, so that kills land in the middle of those too. Every third child
/// compacts its store's metadata whenever no write is waiting (idle time 0 instead of 10 s;
/// its writers pause 0..3 ms after each operation): write-backs of everything held, rebuilds
/// without free pages and log truncations run between the writes, and kills land in them.
fn spawn_child(root: &Path) -> (std::process::Child, mpsc::Receiver<()>) {
    static SPAWNED: AtomicU64 = AtomicU64::new(0);
    let exe = std::env::current_exe().unwrap();
    let mut command = Command::new(exe);
    let spawned = SPAWNED.fetch_add(1, Ordering::Relaxed);
    if spawned % 2 == 1 {
        command.env("IVDISK_STORE_OMAP_HELD_MAX", "2048");
    }
    if spawned % 3 == 2 {
        command.env(COMPACT_IDLE_ENV, "0");
    }
    let mut child = command
        .args([TEST_NAME, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, root)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .expect("spawning the writer child");
    let stdout = child.stdout.take().unwrap();
    let (ready_tx, ready_rx) = mpsc::channel();
    std::thread::spawn(move || {
        // Drain the pipe until the child dies (EOF).
        for line in BufReader::new(stdout).lines() {
            let Ok(line) = line else { break };
            if line.trim_end().ends_with(READY) {
                let _ = ready_tx.send(());
            }
        }
    });
    (child, ready_rx)
}

#[test]
fn sigkill_crash_consistency() {
    if let Some(root) = std::env::var_os(CHILD_ENV) {
        child_main(PathBuf::from(root));
    }
    let rounds: u64 = std::env::var(ROUNDS_ENV)
        .ok()
        .map(|v| v.parse().expect("IVDISK_CRASH_ROUNDS is a number"))
        .unwrap_or(100);
    let seed: u64 = std::env::var(SEED_ENV)
        .ok()
        .map(|v| v.parse().expect("IVDISK_CRASH_SEED is a number"))
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    println!("crash test: {rounds} rounds, {SEED_ENV}={seed}");
    let mut rng = Rng(seed);
    let tmp = tempfile::tempdir().unwrap();
    let root = tmp.path().to_owned();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();

    let started = Instant::now();
    let mut models: Vec<Model> = (0..OBJECTS).map(|_| Model::new()).collect();
    // What the parent verified last round and then closed cleanly: durable too.
    let mut verified = [0u64; OBJECTS];
    let mut kills = 0u64;
    let mut startup_kills = 0u64;
    let mut long_rounds = 0u64;
    let mut rounds_with_progress = 0u64;
    let mut past_flush = Histogram::default();
    let mut lost_acked = Histogram::default();
    let mut total_lost_acked = 0u64;
    let mut verify_time = Duration::ZERO;
    // What the store's own recovery said it dropped at each reopen.
    let mut recovery = RecoveryReport::default();
    let mut rounds_log_discarded = 0u64;
    let mut failure: Option<String> = None;

    'rounds: for round in 0..rounds {
        let _ = std::fs::remove_file(acked_path(&root));
        let (mut child, ready) = spawn_child(&root);
        // One round in eight kills the child early, while it starts (opening and recovering
        // the store); the others kill it while it writes.
        let early = round % 12 != 11 && rng.below(8) == 0;
        if early {
            std::thread::sleep(Duration::from_millis(rng.between(1, 40)));
            startup_kills += 1;
        } else {
            if ready.recv_timeout(Duration::from_secs(30)).is_err() {
                let status = child.try_wait().unwrap();
                let _ = child.kill();
                let _ = child.wait();
                failure = Some(format!(
                    "round {round}: the child did not get ready (exit status {status:?})"
                ));
                break 'rounds;
            }
            // Every twelfth round runs long enough for the metadata log to be checkpointed and
            // restarted (and maybe killed in the middle of that).
            let ms = if round % 12 == 11 {
                long_rounds += 1;
                rng.between(600, 1400)
            } else {
                rng.between(30, 300)
            };
            std::thread::sleep(Duration::from_millis(ms));
        }
        if let Some(status) = child.try_wait().unwrap() {
            failure = Some(format!(
                "round {round}: the child exited by itself ({status}) instead of being killed"
            ));
            break 'rounds;
        }
        child.kill().expect("SIGKILL to the child");
        let status = child.wait().unwrap();
        assert!(!status.success(), "a killed child reports failure");
        kills += 1;

        let (durable, fast) = (
            read_watermark(&root, WATERMARK),
            read_watermark(&root, WATERMARK_FAST),
        );
        let watermark: [u64; OBJECTS] = std::array::from_fn(|k| durable[k].max(fast[k]));
        let acked = read_acked(&root);
        let t = Instant::now();
        let result: Result<[u64; OBJECTS], String> = runtime.block_on(async {
            let store =
                LocalStore::open_with(store_path(&root), &LocalStoreOptions { create: true })
                    .map_err(|e| format!("reopening the store: {e}"))?;
            let report = store.recovery_report();
            recovery.replayed_commits += report.replayed_commits;
            recovery.discarded_log_bytes += report.discarded_log_bytes;
            recovery.dropped_data_bytes += report.dropped_data_bytes;
            rounds_log_discarded += (report.discarded_log_bytes > 0) as u64;
            let mut gens = [0u64; OBJECTS];
            for k in 0..OBJECTS {
                let g = current_gen(&store, k).await;
                gens[k] = g;
                let w = watermark[k];
                if g < w {
                    return Err(format!(
                        "object {k}: generation {g} is older than {w}, acknowledged before a \
                         completed flush (durability; watermark files: durable {}, fast {})",
                        durable[k], fast[k]
                    ));
                }
                if g < verified[k] {
                    return Err(format!(
                        "object {k}: generation {g} is older than {}, verified and closed \
                         cleanly before this round",
                        verified[k]
                    ));
                }
                if let Some(acked) = acked {
                    if g > acked[k] + 1 {
                        return Err(format!(
                            "object {k}: generation {g} committed but the child had only \
                             acknowledged {} (and never submitted past the next one)",
                            acked[k]
                        ));
                    }
                }
                models[k].advance_to(k, g);
                check_object(&store, k, &models[k])
                    .await
                    .map_err(|e| format!("object {k} at generation {g}: {e} (atomicity)"))?;
            }
            Ok(gens)
        });
        verify_time += t.elapsed();
        let gens = match result {
            Ok(gens) => gens,
            Err(e) => {
                failure = Some(format!("round {round}: {e}"));
                break 'rounds;
            }
        };
        if gens.iter().zip(&verified).any(|(g, v)| g > v) {
            rounds_with_progress += 1;
        }
        for k in 0..OBJECTS {
            if !early {
                past_flush.add(gens[k] - watermark[k]);
            }
            if let Some(acked) = acked {
                let lost = acked[k].saturating_sub(gens[k]);
                lost_acked.add(lost);
                total_lost_acked += lost;
            }
        }
        verified = gens;
    }

    let elapsed = started.elapsed();
    let total_gens: u64 = verified.iter().sum();
    let (segments, allocated) = segment_usage(&store_path(&root));
    let live = if failure.is_none() {
        runtime.block_on(live_bytes(&store_path(&root)))
    } else {
        0
    };
    println!(
        "crash test: {kills} kills ({startup_kills} during start-up, {long_rounds} after a long run) in {:.1} s ({:.1} s \
         verifying); {rounds_with_progress} rounds made progress; {total_gens} operations \
         committed in all, final generations {verified:?}; {segments} data segment(s)",
        elapsed.as_secs_f64(),
        verify_time.as_secs_f64()
    );
    println!(
        "  space: {:.1} MiB allocated in the data segments for {:.1} MiB of live extents \
         (the rest is dead data never punched: partial blocks, \
         and frees pending at a kill)",
        allocated as f64 / (1 << 20) as f64,
        live as f64 / (1 << 20) as f64
    );
    println!(
        "  operations committed past the last completed flush (G - watermark), per object and \
         write-phase kill:{past_flush}"
    );
    println!(
        "  acknowledged operations lost to the kill (acked - G), per object and kill:{lost_acked} \
         ({total_lost_acked} in all)"
    );
    println!(
        "  recovery reports: {} commits replayed from the metadata log; {} bytes of log past \
         its last valid commit discarded (in {rounds_log_discarded} reopens); {} bytes of \
         unreferenced segment data dropped",
        recovery.replayed_commits, recovery.discarded_log_bytes, recovery.dropped_data_bytes
    );
    if let Some(failure) = failure {
        let kept = tmp.keep();
        panic!(
            "{failure}\n(the store is kept in {} for inspection)",
            kept.display()
        );
    }
    let t = Instant::now();
    drop(tmp);
    println!(
        "  removing the test directory took {:.1} s",
        t.elapsed().as_secs_f64()
    );
    assert_eq!(kills, rounds);
    assert!(
        rounds < 10 || rounds_with_progress * 2 >= rounds,
        "too few rounds made progress: the test does not exercise the store"
    );
}
