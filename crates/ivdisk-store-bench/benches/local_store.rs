//! Write throughput of the local store at queue depth 32, next to plain `pwrite` on one file.
//!
//! For each write size (4 KiB .. 4 MiB):
//! - **store**: `write_op` on a [`LocalStore`], 32 operations in flight (32 tokio tasks), each
//!   operation two `Write` steps of size/2 at distinct offsets inside a 4 MiB object (one of 256
//!   objects of one image, at random) plus one `OmapSet` of an 8-byte key to a 32-byte value;
//!   for a fixed time after a warm-up, then `flush()`, counted in the time. `WriteStep::Write`
//!   owns its bytes, so each operation copies its extents out of a shared buffer, on the tokio
//!   threads (as a caller holding borrowed data would). Every object is written in full first
//!   (untimed, one 4 MiB `WriteFull` each, flushed), as the raw file is: so both sides measure
//!   overwrites of data in use, which leave dead data behind (reused or punched by the store).
//! - **raw**: the same sizes written with `pwrite` (`write_all_at`) by 32 threads at random
//!   size-aligned offsets of one file as large as the store's objects together (1 GiB), then one
//!   `sync_data()`, counted in the time: both sides end durable. The file is written in full
//!   once first (untimed, synced), as an image file in use is, in writes of the measured size:
//!   without the fill, how fast the first touch of each page-cache page goes depends on what ran
//!   before (on a VM whose balloon takes free pages back, copying into a fresh page-cache page
//!   was up to 10x slower than into a cached one), and raw swung 0.4..5 GB/s between
//!   repetitions; filled in 4 MiB writes, the page cache holds large folios, and 4 KiB writes
//!   into those cost ext4 20x (70 instead of 1700 MB/s).
//!   Raw overwrites a 1 GiB region that stays in the page cache, so it runs at memory speed and
//!   writes at most 1 GiB to the device at the end, whereas the store, which never writes over
//!   live data, has to write every byte it was given.
//! - **raw O_DIRECT** (only with `IVDISK_BENCH_RAW_DIRECT=1`): the same with `O_DIRECT`, so
//!   every byte reaches the device: what the disk takes at QD 32, the ceiling of a store that
//!   must write all its data; two more columns give it and store/O_DIRECT.
//!
//! Store, raw (and raw O_DIRECT) take turns going first per size, `IVDISK_BENCH_REPS` times
//! (default 3), each for `IVDISK_BENCH_SECONDS` (default 3); the table gives medians and the
//! store/raw ratio of each repetition (median, min..max). Samples go to
//! `target/bench-local-store.json`. Files live in a temporary directory under `target/` (on the
//! disk, not a tmpfs `/tmp`), fresh per measurement.
//!
//! The store is built as the `ivdisk` binary builds it (this package's `Cargo.toml` says why
//! the bench is not in `ivdisk-store`), and the process runs on the binary's allocator.
//!
//! ```text
//! cargo bench -p ivdisk-store-bench --bench local_store
//! IVDISK_BENCH_SIZES=4,1024 IVDISK_BENCH_ONLY=store cargo bench -p ivdisk-store-bench --bench local_store
//! ```
//!
//! `IVDISK_BENCH_SIZES` picks sizes (KiB, comma-separated), `IVDISK_BENCH_ONLY` one side
//! (`store` or `raw`; for profiling). Without `--bench` (as `cargo test --all-targets` runs it)
//! it does one short pass at 64 KiB, writes no JSON: a smoke test.

use std::fmt::Write as _;
use std::fs::{File, OpenOptions};
use std::os::unix::fs::{FileExt, OpenOptionsExt};
use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use ivdisk_bench_support::{
    env_or, filesystem_of, json_list, json_str, machine, median, min_max, size_label,
    sizes_from_env, target_dir, Rng, Run,
};
use ivdisk_store::{LocalStore, LocalStoreOptions, ObjectName, ObjectStore, WriteOp, WriteStep};

/// The product's allocator (`crates/ivdisk/src/main.rs`): the store is measured with the
/// buffers its callers hand it as they are allocated in `ivdisk serve`.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

const SIZES: [usize; 6] = [4 << 10, 16 << 10, 64 << 10, 256 << 10, 1 << 20, 4 << 20];
const QUEUE_DEPTH: usize = 32;
const OBJECTS: u64 = 256;
const OBJECT_SIZE: u64 = 4 << 20;
/// The raw file is as large as the store's objects together.
const FOOTPRINT: u64 = OBJECTS * OBJECT_SIZE;

struct Config {
    seconds: f64,
    warmup: f64,
    reps: usize,
    sizes: Vec<usize>,
    store: bool,
    raw: bool,
    raw_direct: bool,
    json: bool,
}

impl Config {
    fn from_env() -> Config {
        let bench = std::env::args().any(|a| a == "--bench");
        let sizes = sizes_from_env().unwrap_or_else(|| {
            if bench {
                SIZES.to_vec()
            } else {
                vec![64 << 10]
            }
        });
        let only = std::env::var("IVDISK_BENCH_ONLY").unwrap_or_default();
        assert!(
            ["", "store", "raw"].contains(&only.as_str()),
            "IVDISK_BENCH_ONLY is `store` or `raw`"
        );
        let (seconds, reps) = if bench {
            (
                env_or("IVDISK_BENCH_SECONDS", 3.0),
                env_or("IVDISK_BENCH_REPS", 3),
            )
        } else {
            (0.2, 1)
        };
        assert!(seconds > 0.0 && reps > 0);
        Config {
            seconds,
            warmup: (seconds / 4.0).min(0.5),
            reps,
            sizes,
            store: only != "raw",
            raw: only != "store",
            raw_direct: only != "store" && std::env::var_os("IVDISK_BENCH_RAW_DIRECT").is_some(),
            json: bench,
        }
    }
}

/// Incompressible-looking bytes to write (zero pages would flatter both sides), 4 KiB-aligned
/// (as `O_DIRECT` wants).
struct Pattern {
    buf: Vec<u8>,
    at: usize,
    len: usize,
}

impl Pattern {
    fn new(len: usize) -> Pattern {
        let mut rng = Rng(0x1d15c);
        let mut buf = Vec::with_capacity(len + 4096);
        while buf.len() < len + 4096 {
            buf.extend_from_slice(&rng.next_u64().to_le_bytes());
        }
        let at = buf.as_ptr().align_offset(4096);
        Pattern { buf, at, len }
    }
    fn bytes(&self) -> &[u8] {
        &self.buf[self.at..self.at + self.len]
    }
}

/// The operation of the store side: two extents of size/2 at distinct slots of one object and
/// one omap key (the first extent's offset) set to a 32-byte value.
fn store_op(rng: &mut Rng, data: &[u8], size: usize, seq: u64) -> (u64, WriteOp) {
    let half = (size / 2) as u64;
    let slots = OBJECT_SIZE / half;
    let first = rng.below(slots);
    let second = (first + 1 + rng.below(slots - 1)) % slots;
    let object = rng.below(OBJECTS);
    let mut value = [0u8; 32];
    value[..8].copy_from_slice(&seq.to_le_bytes());
    value[8..16].copy_from_slice(&object.to_le_bytes());
    let half = half as usize;
    let op = WriteOp::new()
        .step(WriteStep::Write {
            offset: first * half as u64,
            data: data[..half].to_vec(),
        })
        .step(WriteStep::Write {
            offset: second * half as u64,
            data: data[half..2 * half].to_vec(),
        })
        .omap_set(vec![(
            (first * half as u64).to_be_bytes().to_vec(),
            value.to_vec(),
        )]);
    (object, op)
}

/// 32 tasks issue operations until `duration` has passed, then one flush.
async fn store_phase(
    store: &Arc<LocalStore>,
    names: &Arc<Vec<ObjectName>>,
    data: &Arc<Vec<u8>>,
    size: usize,
    duration: Duration,
    seed: u64,
) -> Run {
    let start = Instant::now();
    let deadline = start + duration;
    let tasks: Vec<_> = (0..QUEUE_DEPTH as u64)
        .map(|task| {
            let (store, names, data) = (store.clone(), names.clone(), data.clone());
            tokio::spawn(async move {
                let mut rng = Rng(seed.wrapping_mul(1000).wrapping_add(task));
                let mut ops = 0u64;
                while Instant::now() < deadline {
                    let (object, op) = store_op(&mut rng, &data, size, ops);
                    store
                        .write_op(&names[object as usize], op)
                        .await
                        .expect("store write");
                    ops += 1;
                }
                ops
            })
        })
        .collect();
    let mut ops = 0;
    for task in tasks {
        ops += task.await.expect("store task");
    }
    store.flush().await.expect("store flush");
    Run {
        ops,
        elapsed: start.elapsed(),
    }
}

/// 32 threads `pwrite` until `duration` has passed, then one `sync_data`.
fn raw_phase(file: &File, data: &[u8], size: usize, duration: Duration, seed: u64) -> Run {
    let start = Instant::now();
    let deadline = start + duration;
    let slots = FOOTPRINT / size as u64;
    let ops: u64 = std::thread::scope(|s| {
        let threads: Vec<_> = (0..QUEUE_DEPTH as u64)
            .map(|t| {
                s.spawn(move || {
                    let mut rng = Rng(seed.wrapping_mul(1000).wrapping_add(t));
                    let mut ops = 0u64;
                    while Instant::now() < deadline {
                        let offset = rng.below(slots) * size as u64;
                        file.write_all_at(&data[..size], offset)
                            .expect("raw pwrite");
                        ops += 1;
                    }
                    ops
                })
            })
            .collect();
        threads
            .into_iter()
            .map(|t| t.join().expect("raw thread"))
            .sum()
    });
    file.sync_data().expect("raw sync");
    Run {
        ops,
        elapsed: start.elapsed(),
    }
}

fn measure_store(
    runtime: &tokio::runtime::Runtime,
    dir: &Path,
    cfg: &Config,
    data: &Arc<Vec<u8>>,
    size: usize,
    seed: u64,
) -> Run {
    let path = dir.join(format!("store-{seed}"));
    let run = runtime.block_on(async {
        let store = Arc::new(
            LocalStore::open_with(&path, &LocalStoreOptions { create: true })
                .expect("opening the store"),
        );
        let names: Arc<Vec<ObjectName>> = Arc::new(
            (0..OBJECTS)
                .map(|i| ObjectName::new(format!("rbd_data.bench.{i:016x}")).expect("name"))
                .collect(),
        );
        // Every object written in full first (untimed), as the raw file is: an image in
        // use, whose overwrites leave dead data behind for the store to reuse or punch.
        let full = vec![0x5au8; OBJECT_SIZE as usize];
        for name in names.iter() {
            let op = WriteOp::new().step(WriteStep::WriteFull(full.clone()));
            store.write_op(name, op).await.expect("filling the store");
        }
        store.flush().await.expect("store flush after the fill");
        let warmup = Duration::from_secs_f64(cfg.warmup);
        store_phase(&store, &names, data, size, warmup, !seed).await;
        store_phase(
            &store,
            &names,
            data,
            size,
            Duration::from_secs_f64(cfg.seconds),
            seed,
        )
        .await
        // Dropping the store joins its worker (a last durable commit), outside the time.
    });
    settle(dir, &path);
    run
}

fn measure_raw(dir: &Path, cfg: &Config, data: &[u8], size: usize, seed: u64, direct: bool) -> Run {
    let path = dir.join(format!("{}-{seed}", if direct { "direct" } else { "raw" }));
    let mut options = OpenOptions::new();
    options.read(true).write(true).create_new(true);
    if direct {
        options.custom_flags(libc::O_DIRECT);
    }
    let file = options.open(&path).expect("creating the raw file");
    // Write the whole file once, untimed: buffered in writes of the measured size, so that the
    // page cache holds the folios such writes make (see the top of this file).
    let chunk = &data[..if direct { 4 << 20 } else { size }];
    for at in (0..FOOTPRINT).step_by(chunk.len()) {
        file.write_all_at(chunk, at).expect("filling the raw file");
    }
    file.sync_data().expect("syncing the raw file");
    raw_phase(
        &file,
        data,
        size,
        Duration::from_secs_f64(cfg.warmup),
        !seed,
    );
    let run = raw_phase(
        &file,
        data,
        size,
        Duration::from_secs_f64(cfg.seconds),
        seed,
    );
    drop(file);
    settle(dir, &path);
    run
}

/// Remove a measurement's files and let the file system catch up before the next one.
fn settle(dir: &Path, path: &Path) {
    if path.is_dir() {
        std::fs::remove_dir_all(path).expect("removing the store");
    } else {
        std::fs::remove_file(path).expect("removing the raw file");
    }
    let d = File::open(dir).expect("opening the bench directory");
    rustix::fs::syncfs(&d).expect("syncfs");
}

#[derive(Default)]
struct Samples {
    store_ops: Vec<f64>,
    store_mb: Vec<f64>,
    raw_mb: Vec<f64>,
    ratio: Vec<f64>,
    direct_mb: Vec<f64>,
    direct_ratio: Vec<f64>,
}

fn main() {
    let cfg = Config::from_env();
    let target = target_dir(env!("CARGO_MANIFEST_DIR"));
    std::fs::create_dir_all(&target).expect("creating target/");
    let target = target.canonicalize().expect("resolving target/");
    let tmp = tempfile::Builder::new()
        .prefix("bench-local-store-")
        .tempdir_in(&target)
        .expect("creating a temporary directory under target/");
    let m = machine();
    let filesystem = filesystem_of(tmp.path());
    println!(
        "local store vs pwrite, queue depth {QUEUE_DEPTH}: {} CPUs ({}), Linux {}",
        m.cpus, m.cpu_model, m.kernel
    );
    println!("directory: {} on {}", tmp.path().display(), filesystem);
    println!(
        "{} s per measurement after {} s of warm-up, {} repetitions; MB = 10^6 bytes",
        cfg.seconds, cfg.warmup, cfg.reps
    );

    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("tokio runtime");
    // At least 4 MiB: the raw files are filled in 4 MiB writes.
    let pattern = Pattern::new(cfg.sizes.iter().copied().fold(4 << 20, usize::max));
    let data = Arc::new(pattern.bytes().to_vec());
    let mut samples: Vec<Samples> = cfg.sizes.iter().map(|_| Samples::default()).collect();
    let mut seed = 1u64;
    for rep in 0..cfg.reps {
        for (i, &size) in cfg.sizes.iter().enumerate() {
            seed += 1;
            // Rotate which side goes first, so none always inherits another's aftermath.
            let (mut store, mut raw, mut direct) = (None, None, None);
            for side in 0..3 {
                match (side + rep) % 3 {
                    0 if cfg.store => {
                        store = Some(measure_store(&runtime, tmp.path(), &cfg, &data, size, seed))
                    }
                    1 if cfg.raw => {
                        let bytes = pattern.bytes();
                        raw = Some(measure_raw(tmp.path(), &cfg, bytes, size, seed, false))
                    }
                    2 if cfg.raw_direct => {
                        let bytes = pattern.bytes();
                        direct = Some(measure_raw(tmp.path(), &cfg, bytes, size, seed, true))
                    }
                    _ => {}
                }
            }
            let s = &mut samples[i];
            let mut line = format!("rep {} {:>7}:", rep + 1, size_label(size));
            if let Some(r) = store {
                s.store_ops.push(r.ops_per_s());
                s.store_mb.push(r.mb_per_s(size));
                let _ = write!(
                    line,
                    " store {:.0} ops/s {:.1} MB/s ({} ops, {:.2} s)",
                    r.ops_per_s(),
                    r.mb_per_s(size),
                    r.ops,
                    r.elapsed.as_secs_f64()
                );
            }
            for (name, run, mb, ratio) in [
                ("raw", raw, &mut s.raw_mb, &mut s.ratio),
                ("O_DIRECT", direct, &mut s.direct_mb, &mut s.direct_ratio),
            ] {
                let Some(r) = run else { continue };
                mb.push(r.mb_per_s(size));
                let _ = write!(
                    line,
                    "  {name} {:.1} MB/s ({:.2} s)",
                    r.mb_per_s(size),
                    r.elapsed.as_secs_f64()
                );
                if let Some(st) = store {
                    let q = st.mb_per_s(size) / r.mb_per_s(size);
                    ratio.push(q);
                    let _ = write!(line, " ratio {q:.2}");
                }
            }
            eprintln!("{line}");
        }
    }

    let cell = |v: &[f64], digits: usize| {
        if v.is_empty() {
            "-".to_owned()
        } else {
            format!("{:.*}", digits, median(v))
        }
    };
    let spread = |v: &[f64]| {
        if v.is_empty() {
            "-".to_owned()
        } else {
            let (lo, hi) = min_max(v);
            format!("{:.2} ({lo:.2}..{hi:.2})", median(v))
        }
    };
    println!();
    let (extra_head, extra_rule) = if cfg.raw_direct {
        (" raw O_DIRECT MB/s | store/O_DIRECT |", "---:|---|")
    } else {
        ("", "")
    };
    println!(
        "| size | store ops/s | store MB/s | raw MB/s | ratio (median, min..max) |{extra_head}"
    );
    println!("|---:|---:|---:|---:|---|{extra_rule}");
    for (&size, s) in cfg.sizes.iter().zip(&samples) {
        let extra = if cfg.raw_direct {
            format!(" {} | {} |", cell(&s.direct_mb, 1), spread(&s.direct_ratio))
        } else {
            String::new()
        };
        println!(
            "| {} | {} | {} | {} | {} |{extra}",
            size_label(size),
            cell(&s.store_ops, 0),
            cell(&s.store_mb, 1),
            cell(&s.raw_mb, 1),
            spread(&s.ratio)
        );
    }

    if cfg.json {
        let mut json = String::from("{\n");
        let _ = writeln!(
            json,
            "  \"machine\": {{\"cpus\": {}, \"cpu_model\": {}, \"kernel\": {}, \"filesystem\": {}}},",
            m.cpus,
            json_str(&m.cpu_model),
            json_str(&m.kernel),
            json_str(&filesystem)
        );
        let _ = writeln!(
            json,
            "  \"queue_depth\": {QUEUE_DEPTH}, \"seconds\": {}, \"warmup_seconds\": {}, \"reps\": {},",
            cfg.seconds, cfg.warmup, cfg.reps
        );
        json.push_str("  \"sizes\": [\n");
        for (n, (&size, s)) in cfg.sizes.iter().zip(&samples).enumerate() {
            let _ = writeln!(
                json,
                "    {{\"size\": {size}, \"store_ops_per_s\": {}, \"store_mb_per_s\": {}, \
                 \"raw_mb_per_s\": {}, \"ratio\": {}, \"raw_direct_mb_per_s\": {}, \
                 \"ratio_direct\": {}}}{}",
                json_list(&s.store_ops, 3),
                json_list(&s.store_mb, 3),
                json_list(&s.raw_mb, 3),
                json_list(&s.ratio, 3),
                json_list(&s.direct_mb, 3),
                json_list(&s.direct_ratio, 3),
                if n + 1 < cfg.sizes.len() { "," } else { "" }
            );
        }
        json.push_str("  ]\n}\n");
        let out = target.join("bench-local-store.json");
        std::fs::write(&out, json).expect("writing the JSON samples");
        println!("\nsamples: {}", out.display());
    }
}
