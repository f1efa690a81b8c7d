//! Per-core throughput of every suite on 4 KiB sectors, in runs of 1 and 256 sectors.
//!
//! `scripts/bench-crypto` runs this next to `openssl speed -evp` and prints the ratios that
//! docs/BENCHMARKS.md records. Benchmark ids: `<target>/<encrypt|decrypt>/<run length>`, where
//! target is a suite name, or `<suite>+sector-nonce` for the deterministic counterpart of a
//! randomized suite (same code, the sector number in place of the random nonce: shows what the
//! random source costs; insecure, bench only). Suites run with their default key size (AES-256
//! for XTS and GCM); `aes-gcm-random@aes128` is GCM with a 128-bit key. Encryption runs in place,
//! decryption out of place (`decrypt_sectors_to`; suites without an out-of-place engine copy
//! first, as the image engine's reads make them do); both on buffers that stay in the cache.
//! Suites with metadata also encrypt 16 sectors into slots (`<suite>/encrypt-slots/16`, and
//! `encrypt-slots+16/16` 16 bytes past a cache line; `encrypt_sectors_to_slots`, the
//! `unaligned` layout's form), out of place. `<suite>/encrypt-cold/256` and `decrypt-cold/256`
//! run 1 MiB out of place between buffers that are not in the cache (64 pairs in turn).

use std::time::Duration;

use cpu_time::ThreadTime;
use criterion::measurement::{Measurement, ValueFormatter};
use criterion::{
    criterion_group, criterion_main, BenchmarkGroup, BenchmarkId, Criterion, Throughput,
};
use ivdisk_crypto::{
    insecure_cipher_with_sector_number_nonces, new_cipher, CipherParams, ImageId, SectorCipher,
    Suite, VolumeKey,
};

const SECTOR: usize = 4096;

/// Criterion measures this thread's CPU time, not wall time: on a shared virtual machine the
/// time the host gives to other guests (steal) would otherwise land in our numbers at random.
/// `openssl speed` divides by CPU time as well, so the ratios compare like with like.
struct ThreadCpuTime;

impl Measurement for ThreadCpuTime {
    type Intermediate = ThreadTime;
    type Value = Duration;

    fn start(&self) -> Self::Intermediate {
        ThreadTime::now()
    }
    fn end(&self, start: Self::Intermediate) -> Self::Value {
        start.elapsed()
    }
    fn add(&self, v1: &Self::Value, v2: &Self::Value) -> Self::Value {
        *v1 + *v2
    }
    fn zero(&self) -> Self::Value {
        Duration::ZERO
    }
    fn to_f64(&self, value: &Self::Value) -> f64 {
        value.as_nanos() as f64
    }
    fn formatter(&self) -> &dyn ValueFormatter {
        criterion::measurement::WallTime.formatter()
    }
}
const FIRST_SECTOR: u64 = 1000;

fn bench_cipher(c: &mut Criterion<ThreadCpuTime>, name: &str, cipher: &dyn SectorCipher) {
    let mut group = c.benchmark_group(name);
    for run in [1usize, 256] {
        let mut data = vec![0xa5u8; run * SECTOR];
        let mut metadata = vec![0u8; run * cipher.metadata_len()];
        group.throughput(Throughput::Bytes((run * SECTOR) as u64));
        group.bench_with_input(BenchmarkId::new("encrypt", run), &run, |b, _| {
            b.iter(|| {
                cipher
                    .encrypt_sectors(FIRST_SECTOR, &mut data, &mut metadata)
                    .unwrap()
            })
        });
        // Decrypt real ciphertext (AEAD tags must verify), out of place: from one buffer into
        // another, both reused every iteration and so in the cache, as `openssl speed -decrypt`
        // decrypts one buffer over and over, and as the image engine decrypts a read (from the
        // store's buffer into the caller's). In place, every iteration would need a fresh copy
        // of the ciphertext; criterion makes those copies ahead of the timed loop, thousands of
        // 4 KiB buffers that are no longer in the cache when their turn comes (measured: about
        // 8% slower for a single AEGIS-128L sector than this, while encryption, in place on one
        // buffer, paid nothing of the kind).
        cipher
            .encrypt_sectors(FIRST_SECTOR, &mut data, &mut metadata)
            .unwrap();
        let mut plaintext = vec![0u8; data.len()];
        group.bench_with_input(BenchmarkId::new("decrypt", run), &run, |b, _| {
            b.iter(|| {
                cipher
                    .decrypt_sectors_to(FIRST_SECTOR, &data, &mut plaintext, &metadata)
                    .unwrap()
            })
        });
    }
    bench_cold(&mut group, cipher);
    if cipher.metadata_len() > 0 {
        // Into the slots of the `unaligned` layout (each sector's ciphertext, then its
        // metadata), as its writes do: a buffer reused every iteration, so in the cache as
        // above. With 32 bytes of metadata every other slot starts 32 bytes past where the
        // first does. The first at a cache line's start (`encrypt-slots`), and 16 bytes past
        // one (`encrypt-slots+16`), where glibc's malloc puts many buffers.
        let run = SLOTS_RUN;
        let plaintext = vec![0xa5u8; run * SECTOR];
        let len = run * (SECTOR + cipher.metadata_len());
        let mut space = vec![0u8; len + 128];
        let line = space.as_ptr().align_offset(64);
        group.throughput(Throughput::Bytes((run * SECTOR) as u64));
        for (name, past) in [("encrypt-slots", 0), ("encrypt-slots+16", 16)] {
            let slots = &mut space[line + past..line + past + len];
            group.bench_with_input(BenchmarkId::new(name, run), &run, |b, _| {
                b.iter(|| {
                    cipher
                        .encrypt_sectors_to_slots(FIRST_SECTOR, &plaintext, slots)
                        .unwrap()
                })
            });
        }
    }
    group.finish();
}

/// Runs of 256 sectors (1 MiB) out of place between buffers that are not in the cache, as the
/// image's library calls meet them from 1 MiB up (a caller's buffer, fresh memory):
/// `encrypt-cold/256` encrypts from one of [`COLD_BUFFERS`] sources into its target
/// (`encrypt_sectors_to`), `decrypt-cold/256` back (`decrypt_sectors_to`), the next pair each
/// iteration. What the cipher pays for memory shows against `encrypt/256` and `decrypt/256`.
fn bench_cold(group: &mut BenchmarkGroup<'_, ThreadCpuTime>, cipher: &dyn SectorCipher) {
    let run = 256;
    let mut pairs = ColdPairs::new(run * SECTOR, run * cipher.metadata_len());
    group.throughput(Throughput::Bytes((run * SECTOR) as u64));
    let mut next = 0;
    group.bench_with_input(BenchmarkId::new("encrypt-cold", run), &run, |b, _| {
        b.iter(|| {
            pairs.seal(cipher, next);
            next += 1;
        })
    });
    // Every target sealed, whether or not the case above ran.
    for i in 0..COLD_BUFFERS {
        pairs.seal(cipher, i);
    }
    group.bench_with_input(BenchmarkId::new("decrypt-cold", run), &run, |b, _| {
        b.iter(|| {
            pairs.open(cipher, next);
            next += 1;
        })
    });
}

/// [`COLD_BUFFERS`] sources and targets of `len` bytes, and each pair's metadata.
struct ColdPairs {
    sources: Vec<u8>,
    targets: Vec<u8>,
    metadata: Vec<u8>,
    len: usize,
    meta_len: usize,
}

impl ColdPairs {
    fn new(len: usize, meta_len: usize) -> ColdPairs {
        // Every page written here, so none is first touched inside an iteration.
        ColdPairs {
            sources: vec![0x5a; COLD_BUFFERS * len],
            targets: vec![0x3c; COLD_BUFFERS * len],
            metadata: vec![0; COLD_BUFFERS * meta_len],
            len,
            meta_len,
        }
    }

    /// Where pair `i` (taken round) starts in the sources and targets, and in the metadata.
    fn at(&self, i: usize) -> (std::ops::Range<usize>, std::ops::Range<usize>) {
        let (d, m) = (
            (i % COLD_BUFFERS) * self.len,
            (i % COLD_BUFFERS) * self.meta_len,
        );
        (d..d + self.len, m..m + self.meta_len)
    }

    /// Encrypt pair `i`'s source into its target.
    fn seal(&mut self, cipher: &dyn SectorCipher, i: usize) {
        let (d, m) = self.at(i);
        cipher
            .encrypt_sectors_to(
                FIRST_SECTOR,
                &self.sources[d.clone()],
                &mut self.targets[d],
                &mut self.metadata[m],
            )
            .unwrap();
    }

    /// Decrypt pair `i`'s target into its source.
    fn open(&mut self, cipher: &dyn SectorCipher, i: usize) {
        let (d, m) = self.at(i);
        cipher
            .decrypt_sectors_to(
                FIRST_SECTOR,
                &self.targets[d.clone()],
                &mut self.sources[d],
                &self.metadata[m],
            )
            .unwrap();
    }
}

/// Buffer pairs `bench_cold` goes round: 64 MiB each way, past the 2 MiB of L2 a core has on
/// the machines measured and most of the L3 a core gets on a shared host.
const COLD_BUFFERS: usize = 64;

/// Sectors per run into slots: 64 KiB, the size where the image engine's overhead is measured
/// first (issue 6).
const SLOTS_RUN: usize = 16;

fn suites(c: &mut Criterion<ThreadCpuTime>) {
    let params = CipherParams::new(SECTOR, ImageId([9; 16]));
    for suite in Suite::ALL {
        let key = VolumeKey::generate(suite.default_key_len()).expect("OS random source");
        let cipher = new_cipher(suite, &key, &params).expect("valid parameters");
        bench_cipher(c, suite.name(), cipher.as_ref());
        if suite == Suite::AesGcmRandom {
            // GCM also with a 128-bit key, to compare with `openssl speed -evp aes-128-gcm`.
            let key = VolumeKey::generate(16).expect("OS random source");
            let cipher = new_cipher(suite, &key, &params).expect("valid parameters");
            bench_cipher(c, "aes-gcm-random@aes128", cipher.as_ref());
            let det = insecure_cipher_with_sector_number_nonces(suite, &key, &params)
                .expect("valid parameters");
            bench_cipher(c, "aes-gcm-random@aes128+sector-nonce", det.as_ref());
        }
        if suite.is_randomized() {
            let det = insecure_cipher_with_sector_number_nonces(suite, &key, &params)
                .expect("valid parameters");
            bench_cipher(c, &format!("{}+sector-nonce", suite.name()), det.as_ref());
        }
    }
}

criterion_group! {
    name = benches;
    config = Criterion::default()
        .with_measurement(ThreadCpuTime)
        .warm_up_time(Duration::from_millis(500))
        .measurement_time(Duration::from_secs(2));
    targets = suites
}
criterion_main!(benches);
