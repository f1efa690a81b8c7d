//! Crash consistency of the local backend under simulated power loss.
//!
//! Where `crash.rs` kills a writer with SIGKILL (the page cache survives, so every write the
//! process made is kept), this test drops what a power cut drops: writes that were not synced.
//! The store runs in this process on a directory `live` whose files all go through the
//! fault-injecting layer of `ivdisk_store::fault_io` (feature `fault-io`): the data segments
//! through hooks in the local backend, SQLite's database, log and journal through a shim VFS
//! registered as SQLite's default (`ivdisk_store::ffi_vfs`, wrapping the `unix` VFS). Every
//! write, truncation and punch is recorded per file; when a file is synced its recorded changes
//! are applied to a shadow directory `disk`, which therefore always holds what a disk keeps.
//!
//! Each round: the store opens on `live` (recovering from the previous cut, itself recorded, so
//! cuts also land in recovery), the state is checked against an in-memory model, four writers
//! run random multi-extent + omap operations (self-describing: each is a function of (object,
//! generation), as in `crash.rs`) with a flusher beside them, and at a random moment the power
//! is cut: recording stops, and the disk image is what was synced, plus, in half the cuts, a
//! random subset of the unsynced writes, split into 512-byte sectors, each kept or not (real
//! disks persist some unsynced writes, in any order, torn at sector boundaries). The image
//! becomes the next round's `live`. One cut in eight lands while the store opens and recovers;
//! one round in ten runs 0.55..0.95 s flushing rarely, so that the store's own group commits
//! (in test builds every 500 ms, the log synced every second) leave unsynced commits in
//! SQLite's log; SQLite checkpoints its log every few rounds (the log grows from round to
//! round). After each cut the reopened store must:
//!
//! - open, and say what it dropped: a power cut is the normal case recovery exists for, not
//!   bad input. A torn or half-persisted log tail is exactly what `tests/recovery.rs`'s rule
//!   covers ("a damaged or torn metadata log: the store opens at the last valid commit and
//!   says so", `RecoveryReport::discarded_log_bytes`), and unreferenced segment data is
//!   dropped (`dropped_data_bytes`). Refusing to open would turn every power cut into a manual
//!   repair, and there is nothing a user could do that recovery does not;
//! - durability: hold every operation acknowledged before a flush that had completed when the
//!   power was cut, and everything the previous round had verified (it was on the disk);
//! - atomicity: every object's whole state (content, size, omap) equals the model after a
//!   prefix of whole operations, and never an operation that was not yet submitted;
//! - stay usable: the next round writes on it; after the last cut, the store writes, stops
//!   cleanly, and a clean reopen finds every acknowledged operation and nothing to repair.
//!
//! Tried against deliberately broken stores, the test fails on: committing metadata before
//! syncing the segments it references (atomicity, within a few rounds), a flush that does not
//! sync SQLite's log (durability, first round), and `PRAGMA synchronous = OFF` (a checkpoint's
//! database writes unsynced when the log restarts: inconsistent state after a random-subset
//! cut, within ~15 rounds).
//!
//! Why a file layer and not a block device: the kernel of the machines CI runs on has no
//! device mapper (`dmsetup targets` fails, no `modprobe`), so dm-log-writes or dm-flakey are
//! not available (and where it is, each cut needs a replay and a file system mount and check);
//! a recording layer is exact about what each sync covers and fast (100 cuts in about 40 s). What it does not model: file system
//! metadata beyond file sizes and existence (the file layer's module doc lists its rules).
//!
//! `IVDISK_POWER_ROUNDS` sets the number of cuts (default 100); `IVDISK_POWER_SEED` fixes the
//! random choices of the test (timing still varies).

mod common;

use std::fs::{File, OpenOptions};
use std::os::unix::fs::FileExt;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{mpsc, Arc, Mutex};
use std::time::{Duration, Instant};

use common::{check_object, current_gen, object_name, object_op, Model, Rng};
use ivdisk_store::fault_io::{self, Op};
use ivdisk_store::{LocalStore, LocalStoreOptions, ObjectStore, RecoveryReport};

const ROUNDS_ENV: &str = "IVDISK_POWER_ROUNDS";
const SEED_ENV: &str = "IVDISK_POWER_SEED";

const OBJECTS: usize = 8;
/// Concurrent writer chains (each owns objects `t` and `t + WRITERS`).
const WRITERS: usize = 4;
/// Every operation stays inside `[0, SPAN)`.
const SPAN: u64 = 256 << 10;
const MAX_WRITE: u64 = 32 << 10;
/// Writes up to this long are "small".
const SMALL_WRITE: u64 = 4096;
/// Object names: `PREFIX/o<k>`.
const OBJECT_PREFIX: &str = "power";
/// The unit a disk persists whole (or not at all) in the random-subset rounds.
const SECTOR: u64 = 512;

// ---------------------------------------------------------------------------------------------
// The disk image after a cut.

/// Put the unsynced changes the cut left on the disk image `disk`: none (`keep` is `None`), or
/// each 512-byte sector of each write (and each truncation and punch) with probability
/// `tenths / 10`, in the order they were made. Returns (kept, dropped) pieces.
fn take(keep: &mut Option<(&mut Rng, u64)>) -> bool {
    match keep {
        None => false,
        Some((rng, tenths)) => rng.below(10) < *tenths,
    }
}

fn materialize(
    disk: &Path,
    cut: &fault_io::Cut,
    mut keep: Option<(&mut Rng, u64)>,
) -> std::io::Result<(u64, u64)> {
    let (mut kept, mut dropped) = (0u64, 0u64);
    for (rel, ops) in &cut.pending {
        let mut file: Option<File> = None;
        for op in ops {
            let pieces: Vec<Op> = match op {
                Op::Write { offset, data } => {
                    // Sectors, each kept or not; runs of kept ones are written at once. An
                    // empty write (creating the CLEAN marker) is one piece.
                    let end = offset + data.len() as u64;
                    let mut pieces = Vec::new();
                    let mut run: Option<u64> = None;
                    let mut at = *offset;
                    loop {
                        let stop = end.min((at / SECTOR + 1) * SECTOR);
                        if take(&mut keep) {
                            kept += 1;
                            run.get_or_insert(at);
                        } else {
                            dropped += 1;
                            if let Some(from) = run.take() {
                                pieces.push((from, at));
                            }
                        }
                        at = stop;
                        if at >= end {
                            break;
                        }
                    }
                    if let Some(from) = run {
                        pieces.push((from, end));
                    }
                    pieces
                        .into_iter()
                        .map(|(from, to)| Op::Write {
                            offset: from,
                            data: data[(from - offset) as usize..(to - offset) as usize].to_vec(),
                        })
                        .collect()
                }
                other => match take(&mut keep) {
                    true => {
                        kept += 1;
                        vec![other.clone()]
                    }
                    false => {
                        dropped += 1;
                        Vec::new()
                    }
                },
            };
            for piece in pieces {
                if file.is_none() {
                    let path = disk.join(rel);
                    if let Some(parent) = path.parent() {
                        std::fs::create_dir_all(parent)?;
                    }
                    file = Some(
                        OpenOptions::new()
                            .write(true)
                            .create(true)
                            .truncate(false)
                            .open(&path)?,
                    );
                }
                piece.apply(file.as_ref().expect("just opened"))?;
            }
        }
    }
    Ok((kept, dropped))
}

/// Copy a file keeping its holes (the segments are sparse: dead data is punched out).
fn copy_sparse(from: &Path, to: &Path) -> std::io::Result<()> {
    use rustix::fs::{seek, SeekFrom};
    let src = File::open(from)?;
    let len = src.metadata()?.len();
    let dst = File::create(to)?;
    dst.set_len(len)?;
    let mut pos = 0;
    let mut buf = vec![0u8; 1 << 20];
    while pos < len {
        let data = match seek(&src, SeekFrom::Data(pos)) {
            Ok(at) => at,
            Err(rustix::io::Errno::NXIO) => break,
            Err(e) => return Err(e.into()),
        };
        let hole = seek(&src, SeekFrom::Hole(data))?.min(len);
        let mut at = data;
        while at < hole {
            let n = ((hole - at) as usize).min(buf.len());
            src.read_exact_at(&mut buf[..n], at)?;
            dst.write_all_at(&buf[..n], at)?;
            at += n as u64;
        }
        pos = hole;
    }
    Ok(())
}

fn copy_tree(from: &Path, to: &Path) -> std::io::Result<()> {
    std::fs::create_dir_all(to)?;
    for entry in std::fs::read_dir(from)? {
        let entry = entry?;
        let target = to.join(entry.file_name());
        if entry.file_type()?.is_dir() {
            copy_tree(&entry.path(), &target)?;
        } else {
            copy_sparse(&entry.path(), &target)?;
        }
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// One round: open, check, write until the power is cut.

/// What the writers share with the thread that cuts the power.
struct Shared {
    /// The highest generation of each object that may have been submitted.
    submitted: Vec<AtomicU64>,
    /// The generation of each object last acknowledged.
    acked: Vec<AtomicU64>,
    /// The generations acknowledged before the start of the last completed flush.
    watermark: Mutex<[u64; OBJECTS]>,
    /// Set right after the cut: the writers stop.
    stop: AtomicBool,
    /// Set once the store's open (or creation) has returned.
    opened: AtomicBool,
}

fn snapshot(values: &[AtomicU64]) -> [u64; OBJECTS] {
    std::array::from_fn(|k| values[k].load(Ordering::SeqCst))
}

/// What the cut thread saw.
struct CutRecord {
    /// The store's open had returned before the cut: a store created in this round exists.
    opened: bool,
    watermark: [u64; OBJECTS],
    submitted: [u64; OBJECTS],
    acked: [u64; OBJECTS],
    cut: Result<fault_io::Cut, String>,
}

/// What a round's opening found, checked against the constraints of the cut before it.
struct Expect {
    /// Every object's generation must be at least this (flushed or verified before).
    at_least: [u64; OBJECTS],
    /// ... and at most this (submitted).
    at_most: [u64; OBJECTS],
}

/// How a round runs.
#[derive(Clone, Copy)]
struct Plan {
    /// Create the store: the first round, and the next ones until a cut lands after the
    /// creation returned (a cut before that may leave no store, or a partial one).
    create: bool,
    /// Seed of the writers' and flusher's choices.
    seed: u64,
    /// Flush every 0.3..2 s instead of every 0..40 ms.
    rare_flushes: bool,
    /// The store compacts its metadata whenever no write is waiting (its idle time 0 instead
    /// of 10 s): write-backs of held changes, rebuilds without free pages and log
    /// truncations run between the writes (which pause 0..3 ms each), so that cuts land in
    /// them too.
    compacting: bool,
}

/// Open the store on `live`, check it against the models, then write until `shared.stop`.
/// Returns the generations found at opening, the recovery report and the store (closed while
/// the disk image is built).
async fn run_round(
    live: &Path,
    expect: &Expect,
    models: &mut [Model],
    shared: Arc<Shared>,
    ready: mpsc::Sender<()>,
    plan: Plan,
) -> Result<([u64; OBJECTS], RecoveryReport, Arc<LocalStore>), String> {
    // Read by the store as it opens (one test per process: no other store opens meanwhile).
    std::env::set_var(
        "IVDISK_STORE_COMPACT_IDLE_MS",
        if plan.compacting { "0" } else { "10000" },
    );
    let store = LocalStore::open_with(
        live,
        &LocalStoreOptions {
            create: plan.create,
        },
    )
    .map_err(|e| format!("reopening the store after the cut: {e}"))?;
    shared.opened.store(true, Ordering::SeqCst);
    let report = store.recovery_report();
    let mut gens = [0u64; OBJECTS];
    for k in 0..OBJECTS {
        let g = current_gen(&store, k).await;
        gens[k] = g;
        if g < expect.at_least[k] {
            return Err(format!(
                "object {k}: generation {g} is older than {}, acknowledged before a completed \
                 flush or verified in an earlier round (durability)",
                expect.at_least[k]
            ));
        }
        if g > expect.at_most[k] {
            return Err(format!(
                "object {k}: generation {g} is newer than {}, the last one submitted",
                expect.at_most[k]
            ));
        }
        models[k].advance_to(k, g);
        check_object(&store, k, &models[k])
            .await
            .map_err(|e| format!("object {k} at generation {g}: {e} (atomicity)"))?;
        shared.submitted[k].store(g, Ordering::SeqCst);
        shared.acked[k].store(g, Ordering::SeqCst);
    }
    *shared.watermark.lock().unwrap() = gens;
    let _ = ready.send(());

    let store = Arc::new(store);
    let mut rng = Rng(plan.seed);
    let mut tasks = Vec::new();
    for t in 0..WRITERS {
        let (store, shared) = (store.clone(), shared.clone());
        let mut rng = Rng(rng.next());
        let mut next = [gens[t] + 1, gens[t + WRITERS] + 1];
        tasks.push(tokio::spawn(async move {
            while !shared.stop.load(Ordering::SeqCst) {
                let which = rng.below(2) as usize;
                let k = t + which * WRITERS;
                let g = next[which];
                shared.submitted[k].store(g, Ordering::SeqCst);
                store
                    .write_op(&object_name(k), object_op(k, g))
                    .await
                    .map_err(|e| format!("operation {g} on object {k} failed: {e}"))?;
                shared.acked[k].store(g, Ordering::SeqCst);
                next[which] += 1;
                if plan.compacting {
                    tokio::time::sleep(Duration::from_millis(rng.below(4))).await;
                }
            }
            Ok::<(), String>(())
        }));
    }
    {
        let (store, shared) = (store.clone(), shared.clone());
        let mut rng = Rng(rng.next());
        tasks.push(tokio::spawn(async move {
            while !shared.stop.load(Ordering::SeqCst) {
                let pause = match plan.rare_flushes {
                    true => rng.between(300, 2000),
                    false => rng.below(40),
                };
                let until = Instant::now() + Duration::from_millis(pause);
                while Instant::now() < until && !shared.stop.load(Ordering::SeqCst) {
                    tokio::time::sleep(Duration::from_millis(5)).await;
                }
                if shared.stop.load(Ordering::SeqCst) {
                    break;
                }
                let before = snapshot(&shared.acked);
                store
                    .flush()
                    .await
                    .map_err(|e| format!("flush failed: {e}"))?;
                *shared.watermark.lock().unwrap() = before;
            }
            Ok(())
        }));
    }
    let mut result = Ok(());
    for task in tasks {
        let outcome = task.await.map_err(|e| format!("a task failed: {e}"))?;
        if result.is_ok() {
            result = outcome;
        }
    }
    result?;
    Ok((gens, report, store))
}

/// Which image the cut of `round` leaves: 0 what was synced, 1 also a random subset of the
/// rest. Flipped every ten rounds, so that both follow each kind of round.
fn variant(round: u64) -> usize {
    (round + round / 10) as usize % 2
}

/// Totals for the report.
#[derive(Default)]
struct Totals {
    cuts: [u64; 2],
    early: u64,
    /// Cuts before the store's creation had returned.
    cut_while_creating: u64,
    long: u64,
    rare_flushes: u64,
    compacting: u64,
    checkpoints: u64,
    open_check_time: Duration,
    image_time: Duration,
    syncs: u64,
    kept: u64,
    dropped: u64,
    past_flush: u64,
    replayed_commits: u64,
    reopens_log_discarded: [u64; 2],
    discarded_log_bytes: u64,
    dropped_data_bytes: u64,
}

#[test]
fn power_loss_consistency() {
    let rounds: u64 = std::env::var(ROUNDS_ENV)
        .ok()
        .map(|v| v.parse().expect("IVDISK_POWER_ROUNDS is a number"))
        .unwrap_or(100);
    let seed: u64 = std::env::var(SEED_ENV)
        .ok()
        .map(|v| v.parse().expect("IVDISK_POWER_SEED is a number"))
        .unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .unwrap()
                .as_nanos() as u64
        });
    println!("power-loss test: {rounds} cuts, {SEED_ENV}={seed}");
    ivdisk_store::ffi_vfs::register_default().expect("registering the fault-injecting VFS");
    let mut rng = Rng(seed);
    let tmp = tempfile::tempdir().unwrap();
    // The paths SQLite uses are canonical: so must the recorded directory's be.
    let root = tmp.path().canonicalize().unwrap();
    let live = root.join("live");
    let disk = root.join("disk");
    std::fs::create_dir_all(&disk).unwrap();
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();

    // A store survives a cut right after its creation returned, before anything was written
    // or flushed (what `ivdisk create` and any other creator count on).
    {
        let (live, disk) = (root.join("created-live"), root.join("created-disk"));
        std::fs::create_dir_all(&disk).unwrap();
        fault_io::start(&live, &disk);
        let store = LocalStore::open_with(&live, &LocalStoreOptions { create: true })
            .expect("creating a store");
        let cut = fault_io::cut().expect("the cut right after creating the store");
        drop(store);
        assert!(
            cut.syncs
                .get(Path::new("meta.sqlite"))
                .is_some_and(|&n| n > 0),
            "creating the store synced its metadata: {:?}",
            cut.syncs
        );
        let after = LocalStore::open(&disk)
            .unwrap_or_else(|e| panic!("the store created before the cut is gone: {e}"));
        runtime.block_on(async {
            assert_eq!(after.list("").await.unwrap(), Vec::new());
        });
    }

    let started = Instant::now();
    let mut models: Vec<Model> = (0..OBJECTS).map(|_| Model::new()).collect();
    let mut expect = Expect {
        at_least: [0; OBJECTS],
        at_most: [0; OBJECTS],
    };
    let mut totals = Totals::default();
    let mut failure: Option<String> = None;
    let mut final_acked = [0u64; OBJECTS];
    let mut created = false;

    for round in 0..=rounds {
        let last = round == rounds;
        fault_io::start(&live, &disk);
        let shared = Arc::new(Shared {
            submitted: expect.at_most.iter().map(|&g| AtomicU64::new(g)).collect(),
            acked: expect.at_least.iter().map(|&g| AtomicU64::new(g)).collect(),
            watermark: Mutex::new(expect.at_least),
            stop: AtomicBool::new(false),
            opened: AtomicBool::new(false),
        });
        let (ready_tx, ready_rx) = mpsc::channel();
        // One cut in eight lands early, while the store opens and recovers. One round in ten
        // runs long and flushes rarely, so that the store's own group commits (in test builds
        // every 500 ms, the log synced every second) leave unsynced commits in the log at the
        // cut. (SQLite checkpoints its log in any round: the log grows from round to round.)
        let long = !last && round % 10 == 9;
        let rare_flushes = long;
        let early = !last && !long && rng.below(8) == 0;
        let delay = match (early, long) {
            (true, _) => Duration::from_micros(rng.below(30_000)),
            (false, true) => Duration::from_millis(rng.between(550, 950)),
            (false, false) => Duration::from_millis(rng.between(10, 150)),
        };
        totals.rare_flushes += rare_flushes as u64;
        let compacting = round % 3 == 1;
        totals.compacting += compacting as u64;
        totals.early += early as u64;
        totals.long += long as u64;
        let cutter = {
            let shared = shared.clone();
            std::thread::spawn(move || {
                if last {
                    // No cut: the last round checks the last image, writes a while, then
                    // stops cleanly.
                    if ready_rx.recv().is_ok() {
                        std::thread::sleep(Duration::from_millis(100));
                    }
                } else if early || ready_rx.recv().is_ok() {
                    std::thread::sleep(delay);
                }
                // Read before the cut: a flush counts only if it had completed, a creation
                // only if it had returned.
                let watermark = *shared.watermark.lock().unwrap();
                let opened = shared.opened.load(Ordering::SeqCst);
                let cut = if last {
                    Err("no cut".into())
                } else {
                    fault_io::cut()
                };
                let record = CutRecord {
                    opened,
                    watermark,
                    // Read after the cut: every operation the image can hold was submitted.
                    submitted: snapshot(&shared.submitted),
                    acked: snapshot(&shared.acked),
                    cut,
                };
                shared.stop.store(true, Ordering::SeqCst);
                record
            })
        };
        let t = Instant::now();
        let result = runtime.block_on(run_round(
            &live,
            &expect,
            &mut models,
            shared.clone(),
            ready_tx,
            Plan {
                create: !created,
                seed: rng.next(),
                rare_flushes,
                compacting,
            },
        ));
        // A round that failed before the writers started: release the cut thread.
        shared.stop.store(true, Ordering::SeqCst);
        totals.open_check_time += t.elapsed();
        let record = cutter.join().expect("the cut thread");
        let (gens, report, store) = match result {
            Ok(r) => r,
            Err(e) => {
                let after = match round.checked_sub(1).map(variant) {
                    None => "creating the store",
                    Some(0) => "after a cut keeping synced writes only",
                    Some(_) => {
                        "after a cut keeping synced writes and a random subset of the others"
                    }
                };
                failure = Some(format!("round {round} ({after}): {e}"));
                break;
            }
        };
        if round > 0 {
            let variant = variant(round - 1);
            totals.replayed_commits += report.replayed_commits;
            totals.discarded_log_bytes += report.discarded_log_bytes;
            totals.reopens_log_discarded[variant] += (report.discarded_log_bytes > 0) as u64;
            totals.dropped_data_bytes += report.dropped_data_bytes;
        }
        if last {
            final_acked = snapshot(&shared.acked);
            break;
        }
        created |= record.opened;
        totals.cut_while_creating += !created as u64;
        let cut = match record.cut {
            Ok(cut) => cut,
            Err(e) => {
                failure = Some(format!("round {round}: the cut failed: {e}"));
                break;
            }
        };
        totals.syncs += cut.syncs.values().sum::<u64>();
        // SQLite syncs the database file only when it checkpoints its log.
        totals.checkpoints += (cut
            .syncs
            .get(Path::new("meta.sqlite"))
            .copied()
            .unwrap_or(0)
            > 0) as u64;
        let t = Instant::now();
        // Half the cuts keep only what was synced; the others also a random subset of the rest.
        let variant = variant(round);
        totals.cuts[variant] += 1;
        let tenths = rng.between(1, 9);
        // The store, stopped cleanly after the cut (nothing of that is recorded), closes while
        // the image is built; `live` is replaced once it has.
        let closing = std::thread::spawn(move || drop(store));
        let kept = match variant {
            0 => materialize(&disk, &cut, None),
            _ => materialize(&disk, &cut, Some((&mut rng, tenths))),
        };
        match kept {
            Ok((kept, dropped)) => {
                totals.kept += kept;
                totals.dropped += dropped;
            }
            Err(e) => {
                failure = Some(format!("round {round}: building the disk image: {e}"));
                break;
            }
        }
        closing.join().expect("closing the store");
        std::fs::remove_dir_all(&live).unwrap();
        copy_tree(&disk, &live).unwrap();
        totals.image_time += t.elapsed();
        for (acked, flushed) in record.acked.iter().zip(&record.watermark) {
            totals.past_flush += acked.saturating_sub(*flushed);
        }
        expect = Expect {
            at_least: std::array::from_fn(|k| record.watermark[k].max(gens[k])),
            at_most: record.submitted,
        };
    }

    let elapsed = started.elapsed();
    println!(
        "power-loss test: {} cuts keeping synced writes only, {} also keeping a random subset of \
         the unsynced ones ({} early, in opening/recovery, {} of them while creating the store; {} after a long run; {} with rare \
         flushes; {} compacting between writes) in {:.1} s ({:.1} s opening, checking and writing, {:.1} s closing and building disk images); final \
         generations {:?}",
        totals.cuts[0],
        totals.cuts[1],
        totals.early,
        totals.cut_while_creating,
        totals.long,
        totals.rare_flushes,
        totals.compacting,
        elapsed.as_secs_f64(),
        totals.open_check_time.as_secs_f64(),
        totals.image_time.as_secs_f64(),
        expect.at_least,
    );
    println!(
        "  {} syncs recorded ({} rounds checkpointed SQLite's log); unsynced pieces (512-byte sectors, truncations, punches) kept {} \
         / dropped {}; acknowledged operations past the last completed flush at the cuts: {}",
        totals.syncs, totals.checkpoints, totals.kept, totals.dropped, totals.past_flush
    );
    println!(
        "  recovery: {} commits replayed; log past its last valid commit discarded in {} + {} \
         reopens (synced-only + subset cuts), {} bytes; {} bytes of unreferenced segment data \
         dropped",
        totals.replayed_commits,
        totals.reopens_log_discarded[0],
        totals.reopens_log_discarded[1],
        totals.discarded_log_bytes,
        totals.dropped_data_bytes,
    );
    if let Some(failure) = failure {
        let kept = tmp.keep();
        panic!(
            "{failure}\n(IVDISK_POWER_SEED={seed}; the store is kept in {} for inspection)",
            kept.display()
        );
    }
    // Usable after all that: the last round wrote, flushed and closed cleanly; a clean reopen
    // finds nothing to repair and the same state.
    runtime.block_on(async {
        let store = LocalStore::open(&live).expect("reopening after a clean stop");
        // (`dropped_data_bytes` may be non-zero: data appended and killed by the same
        // operation, a write then a truncation, is dead at the segment's end.)
        let report = store.recovery_report();
        assert_eq!(
            (report.discarded_log_bytes, report.reclaimed_bytes),
            (0, 0),
            "a clean stop leaves nothing to repair: {report:?}"
        );
        for k in 0..OBJECTS {
            let g = current_gen(&store, k).await;
            assert_eq!(
                g, final_acked[k],
                "object {k}: a clean stop keeps every acknowledged operation"
            );
            models[k].advance_to(k, g);
            check_object(&store, k, &models[k])
                .await
                .unwrap_or_else(|e| panic!("object {k} after the clean stop: {e}"));
        }
    });
    assert_eq!(totals.cuts.iter().sum::<u64>(), rounds);
}
