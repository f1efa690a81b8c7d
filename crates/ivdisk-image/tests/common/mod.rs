//! What the image test files share: fast key derivation, unique image addresses on every
//! backend (memory, local directories, RADOS), a seeded RNG whose seed is printed when a test
//! fails, and raw access to a sector's stored ciphertext and metadata.
//!
//! RADOS: the cluster comes from the environment as in crates/ivdisk-rados/tests/common:
//! `CEPH_CONF` (from `scripts/ceph-dev-cluster start`), optionally `IVDISK_RADOS_POOL`
//! (default `rbd`). `IVDISK_NO_CEPH=1` skips the RADOS tests, loudly; without it a missing
//! cluster fails them.

#![allow(dead_code)]

use std::fmt;
use std::path::PathBuf;
use std::sync::OnceLock;

use ivdisk_crypto::Suite;
use ivdisk_header::{PbkdfKind, PbkdfRequest};
use ivdisk_image::{
    CreateOptions, Image, ImageError, ImageUri, LayoutKind, OpenOptions, PayloadPlacement,
    WritePayload,
};
use ivdisk_store::{ObjectName, ReadOp, ReadResult, ReadStep, WriteOp, WriteStep};

pub const PASS: &[u8] = b"correct horse battery staple";

/// Create options with a fast PBKDF (key derivation is not what these tests test).
pub fn options(
    size: u64,
    suite: Suite,
    layout: LayoutKind,
    sector_size: u32,
    object_size: u64,
) -> CreateOptions {
    CreateOptions {
        suite,
        layout: Some(layout),
        sector_size,
        object_size,
        pbkdf: PbkdfRequest::fast_for_tests(PbkdfKind::Pbkdf2),
        ..CreateOptions::new(size)
    }
}

/// Every suite × layout combination an image can have (`Suite::ALL` × `LayoutKind::ALL`,
/// filtered by whether the layout holds the suite's metadata).
pub fn combinations() -> Vec<(Suite, LayoutKind)> {
    let mut out = Vec::new();
    for suite in Suite::ALL {
        for layout in LayoutKind::ALL {
            if layout.fits(suite.metadata_len()) {
                out.push((suite, layout));
            }
        }
    }
    out
}

/// The AEAD suites (those whose metadata holds a MAC).
pub const AEAD_SUITES: [Suite; 3] = [
    Suite::Aegis128lRandom,
    Suite::Aegis256Random,
    Suite::AesGcmRandom,
];

fn random_hex(bytes: usize) -> String {
    let mut b = vec![0u8; bytes];
    getrandom::getrandom(&mut b).expect("random bytes");
    hex::encode(b)
}

/// A `mem:` address no other test uses.
pub fn mem_uri(prefix: &str) -> ImageUri {
    ImageUri::parse(&format!("mem:{prefix}-{}", random_hex(6))).unwrap()
}

/// A local image in a fresh temporary directory (a local store directory holds one image).
/// Keep the value alive as long as the image is used: dropping it deletes the directory.
pub struct LocalDir {
    _dir: tempfile::TempDir,
    pub path: PathBuf,
    pub uri: ImageUri,
}

pub fn local_dir() -> LocalDir {
    let dir = tempfile::tempdir().expect("a temporary directory");
    // A subdirectory the store creates itself, as `ivdisk create DIR` does.
    let path = dir.path().join("image.ivd");
    let uri = ImageUri::parse(path.to_str().expect("a UTF-8 temporary path")).unwrap();
    LocalDir {
        _dir: dir,
        path,
        uri,
    }
}

/// Where an image lives: the backends in this process, and RADOS.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    Memory,
    Local,
    Rados,
}

impl Backend {
    /// The backends in this process.
    pub const LOCAL: [Backend; 2] = [Backend::Memory, Backend::Local];
}

/// An address on `backend`, and what keeps it alive.
pub struct Place {
    pub uri: ImageUri,
    _local: Option<LocalDir>,
}

/// A fresh image address on `backend`. Panics for RADOS when it is skipped (check
/// [`rados_uri`] first).
pub fn place(backend: Backend, prefix: &str) -> Place {
    match backend {
        Backend::Rados => Place {
            uri: rados_uri(prefix).expect("RADOS tests are skipped"),
            _local: None,
        },
        Backend::Memory => Place {
            uri: mem_uri(prefix),
            _local: None,
        },
        Backend::Local => {
            let local = local_dir();
            Place {
                uri: local.uri.clone(),
                _local: Some(local),
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------
// RADOS

/// Why the RADOS tests do not run here, if they don't (printed loudly by [`rados_uri`]).
pub fn rados_skip_reason() -> Option<String> {
    (std::env::var("IVDISK_NO_CEPH").as_deref() == Ok("1"))
        .then(|| "IVDISK_NO_CEPH=1: no Ceph cluster, the RADOS image tests are skipped".into())
}

/// One namespace per test process, so reruns on a long-lived pool never meet old objects.
pub fn rados_namespace() -> &'static str {
    static NS: OnceLock<String> = OnceLock::new();
    NS.get_or_init(|| format!("ivdisk-image-test-{}", random_hex(4)))
}

/// `rados://POOL/IMAGE?conf=$CEPH_CONF&namespace=NS` for a fresh image name, or `None` (after
/// a loud message) when `IVDISK_NO_CEPH=1`. Panics with instructions when there is no cluster.
pub fn rados_uri(prefix: &str) -> Option<ImageUri> {
    if let Some(reason) = rados_skip_reason() {
        eprintln!("\n!!!!!!!!!! SKIPPED: {reason} !!!!!!!!!!\n");
        return None;
    }
    let conf = std::env::var("CEPH_CONF").unwrap_or_else(|_| {
        panic!(
            "the RADOS tests need a Ceph cluster: run `eval \"$(scripts/ceph-dev-cluster start)\"` \
             (which exports CEPH_CONF), or set IVDISK_NO_CEPH=1 to skip them"
        )
    });
    let pool = std::env::var("IVDISK_RADOS_POOL").unwrap_or_else(|_| "rbd".into());
    let text = format!(
        "rados://{pool}/{prefix}-{}?conf={conf}&namespace={}",
        random_hex(6),
        rados_namespace()
    );
    Some(ImageUri::parse(&text).unwrap_or_else(|e| panic!("{text}: {e}")))
}

/// The output of the `ceph` command with `args` on the test cluster (`CEPH_CONF`); panics
/// naming the command if it fails.
pub fn ceph(args: &[&str]) -> String {
    let out = std::process::Command::new("ceph")
        .args(args)
        .output()
        .unwrap_or_else(|e| panic!("running ceph {args:?}: {e}"));
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "ceph {args:?}: {text}");
    text
}

// ---------------------------------------------------------------------------------------------
// Seeded randomness

/// The seed of a randomized test: `IVDISK_TEST_SEED` (decimal or 0x-hex) to replay one, else
/// fresh. Keep the returned guard alive: it prints the seed if the test panics.
pub fn seed(test: &str) -> (u64, SeedGuard) {
    let seed = match std::env::var("IVDISK_TEST_SEED") {
        Ok(text) => {
            let text = text.trim();
            let parsed = match text.strip_prefix("0x") {
                Some(hex) => u64::from_str_radix(hex, 16),
                None => text.parse(),
            };
            parsed.unwrap_or_else(|_| panic!("IVDISK_TEST_SEED={text} is not a number"))
        }
        Err(_) => {
            let mut b = [0u8; 8];
            getrandom::getrandom(&mut b).expect("random bytes");
            u64::from_le_bytes(b)
        }
    };
    (
        seed,
        SeedGuard {
            test: test.to_owned(),
            seed,
        },
    )
}

/// Prints the seed of a failing randomized test (on drop while panicking).
pub struct SeedGuard {
    test: String,
    seed: u64,
}

impl Drop for SeedGuard {
    fn drop(&mut self) {
        if std::thread::panicking() {
            eprintln!(
                "\n*** {} failed with seed {:#x}; replay with `IVDISK_TEST_SEED={:#x} cargo test -p ivdisk-image {} -- --exact` ***\n",
                self.test, self.seed, self.seed, self.test
            );
        }
    }
}

/// SplitMix64: small, seedable, good enough for test inputs.
#[derive(Debug, Clone)]
pub struct Rng(u64);

impl Rng {
    pub fn new(seed: u64) -> Self {
        Rng(seed)
    }

    /// A generator for a sub-case, independent of the others derived from the same seed.
    pub fn derive(seed: u64, label: &str) -> Self {
        // FNV-1a of the label, mixed into the seed.
        let mut h: u64 = 0xcbf2_9ce4_8422_2325;
        for b in label.bytes() {
            h = (h ^ b as u64).wrapping_mul(0x0000_0100_0000_01b3);
        }
        let mut rng = Rng(seed ^ h);
        rng.next_u64();
        rng
    }

    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (`n > 0`).
    pub fn below(&mut self, n: u64) -> u64 {
        assert!(n > 0);
        ((self.next_u64() as u128 * n as u128) >> 64) as u64
    }

    /// Uniform in `lo..=hi`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        assert!(lo <= hi);
        lo + self.below(hi - lo + 1)
    }

    /// True with probability `num / den`.
    pub fn chance(&mut self, num: u64, den: u64) -> bool {
        self.below(den) < num
    }

    pub fn fill(&mut self, out: &mut [u8]) {
        for chunk in out.chunks_mut(8) {
            let v = self.next_u64().to_le_bytes();
            chunk.copy_from_slice(&v[..chunk.len()]);
        }
    }

    pub fn bytes(&mut self, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        self.fill(&mut v);
        v
    }
}

// ---------------------------------------------------------------------------------------------
// Raw sector access (the layouts of src/layout/*.rs)

/// Where sector `lba`'s ciphertext and metadata are stored.
#[derive(Debug, Clone)]
pub struct SectorPlace {
    pub object: ObjectName,
    /// Byte offset of the ciphertext in the object.
    pub data_offset: u64,
    pub metadata: MetadataPlace,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MetadataPlace {
    /// Bytes in the object's data at this offset.
    Bytes(u64),
    /// The value of this omap key.
    OmapKey(Vec<u8>),
    /// Bytes `at..at + metadata length` of the value of this omap key (`omap-packed`: 16
    /// sectors per value; no value, or an empty one, reads as zeros). `omap-tail`: where no
    /// value is stored, the run's slot at `tail` in the object's bytes (zeros: none).
    OmapValuePart {
        key: Vec<u8>,
        at: usize,
        tail: Option<std::ops::Range<u64>>,
    },
    /// No metadata (`none`).
    Nothing,
}

pub fn sector_place(image: &Image, lba: u64) -> SectorPlace {
    let ss = image.sector_size() as u64;
    let ml = image.suite().metadata_len() as u64;
    let spo = image.object_size() / ss;
    let (object, index) = (lba / spo, lba % spo);
    let (data_offset, metadata) = match image.layout() {
        LayoutKind::ObjectEnd => (index * ss, MetadataPlace::Bytes(spo * ss + index * ml)),
        LayoutKind::Unaligned => (
            index * (ss + ml),
            MetadataPlace::Bytes(index * (ss + ml) + ss),
        ),
        LayoutKind::Omap => (
            index * ss,
            MetadataPlace::OmapKey(format!("{index:08x}").into_bytes()),
        ),
        LayoutKind::OmapPacked | LayoutKind::OmapTail => (
            index * ss,
            MetadataPlace::OmapValuePart {
                key: format!("{:08x}", index / 16).into_bytes(),
                at: (index % 16 * ml) as usize,
                tail: (image.layout() == LayoutKind::OmapTail).then(|| {
                    let run = index / 16;
                    let stride = packed_slot_len(image, spo.min(16) as usize) as u64;
                    let start = spo * ss + run * stride;
                    start..start + packed_slot_len(image, (spo - run * 16).min(16) as usize) as u64
                }),
            },
        ),
        LayoutKind::None => (index * ss, MetadataPlace::Nothing),
    };
    SectorPlace {
        object: image.data_object(object),
        data_offset,
        metadata,
    }
}

fn dense(results: ReadResult, offset: u64, len: usize) -> Vec<u8> {
    let ReadResult::Extents(extents) = results else {
        panic!("expected extents, got {results:?}")
    };
    let mut out = vec![0u8; len];
    for e in extents {
        let at = (e.offset - offset) as usize;
        let n = e.data.len().min(len - at);
        out[at..at + n].copy_from_slice(&e.data[..n]);
    }
    out
}

/// The stored ciphertext and metadata of sector `lba` (zeros where nothing is stored), at the
/// snapshot the image was opened at, if any.
pub async fn raw_sector(image: &Image, lba: u64) -> (Vec<u8>, Vec<u8>) {
    let place = sector_place(image, lba);
    let (ss, ml) = (image.sector_size(), image.suite().metadata_len());
    let mut op = ReadOp::new().step(ReadStep::Read {
        offset: place.data_offset,
        len: ss as u64,
    });
    // An image opened at a snapshot shows the snapshot's stored bytes.
    op.snap = image.snapshot_id();
    op = match &place.metadata {
        MetadataPlace::Bytes(at) => op.step(ReadStep::Read {
            offset: *at,
            len: ml as u64,
        }),
        MetadataPlace::OmapKey(key) | MetadataPlace::OmapValuePart { key, .. } => {
            op.step(ReadStep::OmapGetByKeys(vec![key.clone()]))
        }
        MetadataPlace::Nothing => op,
    };
    if let MetadataPlace::OmapValuePart {
        tail: Some(tail), ..
    } = &place.metadata
    {
        op = op.step(ReadStep::Read {
            offset: tail.start,
            len: tail.end - tail.start,
        });
    }
    let mut results = image
        .store()
        .read_op(&place.object, op)
        .await
        .unwrap_or_else(|e| panic!("reading sector {lba} raw: {e}"))
        .into_iter();
    let data = dense(results.next().unwrap(), place.data_offset, ss);
    let metadata = match &place.metadata {
        MetadataPlace::Bytes(at) => dense(results.next().unwrap(), *at, ml),
        MetadataPlace::OmapKey(_) => match results.next().unwrap() {
            ReadResult::Omap { pairs, .. } => pairs
                .first()
                .map_or_else(|| vec![0u8; ml], |(_, v)| v.to_vec()),
            other => panic!("expected omap pairs, got {other:?}"),
        },
        MetadataPlace::OmapValuePart { at, tail, .. } => match results.next().unwrap() {
            ReadResult::Omap { pairs, .. } => {
                let value = match pairs.first() {
                    Some((_, v)) => v.to_vec(),
                    None => match tail {
                        Some(tail) => dense(
                            results.next().unwrap(),
                            tail.start,
                            (tail.end - tail.start) as usize,
                        ),
                        None => Vec::new(),
                    },
                };
                full_packed_value(image, lba, &value)[*at..*at + ml].to_vec()
            }
            other => panic!("expected omap pairs, got {other:?}"),
        },
        MetadataPlace::Nothing => Vec::new(),
    };
    (data, metadata)
}

/// The full form of an `omap-packed` value as stored (the value of sector `lba`'s run): a
/// compact value (the run's sectors sealed at once, their nonces counting up) is the first
/// sector's metadata, then each further sector's metadata without its nonce.
pub fn full_packed_value(image: &Image, lba: u64, stored: &[u8]) -> Vec<u8> {
    let ml = image.suite().metadata_len();
    let nl = image.suite().counted_nonce_len();
    let spo = image.object_size() / image.sector_size() as u64;
    let run_start = lba % spo / 16 * 16;
    let sectors = (spo - run_start).min(16) as usize;
    // No value, an empty one (`omap-tail`'s "unwritten") or a slot of zeros: unwritten.
    if stored.iter().all(|&b| b == 0) {
        return vec![0u8; sectors * ml];
    }
    if stored.len() == sectors * ml {
        return stored.to_vec();
    }
    assert!(
        nl > 0 && stored.len() == ml + (sectors - 1) * (ml - nl),
        "omap-packed value of {} bytes for {sectors} sectors of {ml} bytes",
        stored.len()
    );
    let mut full = stored[..ml].to_vec();
    let mut nonce = stored[..nl].to_vec();
    for rest in stored[ml..].chunks_exact(ml - nl) {
        ivdisk_crypto::nonce_add(&mut nonce, 1);
        full.extend_from_slice(&nonce);
        full.extend_from_slice(rest);
    }
    full
}

/// Bytes of the stored form of a run of `sectors` sectors' metadata in an `omap-tail` tail:
/// compact where the suite counts its nonces up and the run has two sectors or more.
fn packed_slot_len(image: &Image, sectors: usize) -> usize {
    let ml = image.suite().metadata_len();
    let nl = image.suite().counted_nonce_len();
    if nl > 0 && nl < ml && sectors >= 2 {
        ml + (sectors - 1) * (ml - nl)
    } else {
        sectors * ml
    }
}

/// Store `data` and `metadata` as sector `lba`'s, in one operation (as an attacker with
/// access to the store can).
pub async fn put_raw_sector(image: &Image, lba: u64, data: &[u8], metadata: &[u8]) {
    let place = sector_place(image, lba);
    let mut op = WriteOp::new().write(place.data_offset, data);
    op = match &place.metadata {
        MetadataPlace::Bytes(at) => op.write(*at, metadata),
        MetadataPlace::OmapKey(key) => op.omap_set(vec![(key.clone(), metadata.to_vec())]),
        MetadataPlace::OmapValuePart { key, at, tail } => {
            // The rest of the value as stored (zeros if none: every sector of it unwritten;
            // `omap-tail`: the tail's slot where no value is stored). Stored back as a value,
            // which wins over the tail.
            let mut read = ReadOp::new().step(ReadStep::OmapGetByKeys(vec![key.clone()]));
            if let Some(tail) = tail {
                read = read.step(ReadStep::Read {
                    offset: tail.start,
                    len: tail.end - tail.start,
                });
            }
            let stored = image.store().read_op(&place.object, read).await;
            let stored = match stored {
                Ok(mut results) => {
                    let mut results = results.drain(..);
                    let Some(ReadResult::Omap { pairs, .. }) = results.next() else {
                        panic!("expected omap pairs")
                    };
                    match (pairs.first(), tail) {
                        (Some((_, v)), _) => v.to_vec(),
                        (None, Some(tail)) => dense(
                            results.next().unwrap(),
                            tail.start,
                            (tail.end - tail.start) as usize,
                        ),
                        (None, None) => Vec::new(),
                    }
                }
                Err(_) => Vec::new(),
            };
            let mut value = full_packed_value(image, lba, &stored);
            // Stored back in full form, which every reader takes.
            value[*at..*at + metadata.len()].copy_from_slice(metadata);
            op.omap_set(vec![(key.clone(), value)])
        }
        MetadataPlace::Nothing => op,
    };
    image
        .store()
        .write_op(&place.object, op)
        .await
        .unwrap_or_else(|e| panic!("writing sector {lba} raw: {e}"));
}

/// Everything stored in an object: its bytes (holes as zeros) and its omap.
#[derive(Debug, Clone)]
pub struct RawObject {
    pub extents: Vec<ivdisk_store::Extent>,
    pub omap: Vec<(Vec<u8>, Vec<u8>)>,
}

pub async fn raw_object(image: &Image, object: &ObjectName) -> RawObject {
    let op = ReadOp::new()
        .step(ReadStep::Read {
            offset: 0,
            len: 2 * image.object_size() + (1 << 20),
        })
        .step(ReadStep::OmapGetRange {
            start: b"0".to_vec(),
            end: None,
            max: 1 << 20,
        });
    let mut results = image
        .store()
        .read_op(object, op)
        .await
        .unwrap_or_else(|e| panic!("reading object {object}: {e}"))
        .into_iter();
    let Some(ReadResult::Extents(extents)) = results.next() else {
        panic!("expected extents")
    };
    let Some(ReadResult::Omap { pairs, more }) = results.next() else {
        panic!("expected omap pairs")
    };
    assert!(!more);
    RawObject {
        extents,
        omap: pairs.to_vec(),
    }
}

/// Make `object` of `image` hold exactly `raw`, in one operation that overwrites every extent
/// and replaces the omap: the object must already have the same extents (true of fully
/// written data objects of two images with the same parameters), so that the copy is one
/// atomic write, as an attacker's would be.
pub async fn put_raw_object(image: &Image, object: &ObjectName, raw: &RawObject) {
    let target = raw_object(image, object).await;
    let shape = |r: &RawObject| {
        r.extents
            .iter()
            .map(|e| (e.offset, e.data.len()))
            .collect::<Vec<_>>()
    };
    assert_eq!(shape(&target), shape(raw), "{object} has another shape");
    let mut op = WriteOp::new();
    for e in &raw.extents {
        op = op.write(e.offset, e.data.clone());
    }
    // Every key the layouts set is hex digits.
    op.steps.push(WriteStep::OmapRemoveRange {
        start: b"0".to_vec(),
        end: b"g".to_vec(),
    });
    if !raw.omap.is_empty() {
        op = op.omap_set(raw.omap.clone());
    }
    image
        .store()
        .write_op(object, op)
        .await
        .unwrap_or_else(|e| panic!("writing {object}: {e}"));
    let written = raw_object(image, object).await;
    assert!(
        written.extents == raw.extents && written.omap == raw.omap,
        "{object} does not hold the copy"
    );
}

/// The first index at which two buffers differ, for readable failure messages.
pub fn first_difference(a: &[u8], b: &[u8]) -> Option<usize> {
    a.iter()
        .zip(b)
        .position(|(x, y)| x != y)
        .or((a.len() != b.len()).then(|| a.len().min(b.len())))
}

// ---------------------------------------------------------------------------------------------
// The model-based randomized test (model.rs, rados.rs)

/// One image and the operations run on it.
#[derive(Debug, Clone)]
pub struct Case {
    pub backend: Backend,
    pub suite: Suite,
    pub layout: LayoutKind,
    pub sector_size: u32,
    pub object_size: u64,
    /// Image size in bytes (not a multiple of the object size: the last object is partial).
    pub size: u64,
    pub ops: usize,
}

impl fmt::Display for Case {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:?}/{}/{}/ss{}/os{}k",
            self.backend,
            self.suite,
            self.layout,
            self.sector_size,
            self.object_size >> 10
        )
    }
}

impl Case {
    pub fn new(
        backend: Backend,
        suite: Suite,
        layout: LayoutKind,
        sector_size: u32,
        object_size: u64,
        ops: usize,
    ) -> Self {
        Case {
            backend,
            suite,
            layout,
            sector_size,
            object_size,
            // Three and a half objects (plus one sector): the last object is partial.
            size: 3 * object_size + object_size / 2 + sector_size as u64,
            ops,
        }
    }

    fn create_options(&self) -> CreateOptions {
        options(
            self.size,
            self.suite,
            self.layout,
            self.sector_size,
            self.object_size,
        )
    }
}

#[derive(Debug, Clone, Copy)]
enum Op {
    Read(u64, u64),
    Write(u64, u64),
    /// `Image::write_owned` or `Image::write_payload`: the buffer handed over (encrypted in
    /// place when it is whole sectors of one object; in slots where the image asks for them).
    WriteOwned(u64, u64),
    Discard(u64, u64),
    WriteZeroes(u64, u64, bool),
    Flush,
}

/// A byte range of the image of one of the shapes the IO path treats differently.
fn pick_range(rng: &mut Rng, size: u64, ss: u64, os: u64) -> (u64, u64) {
    let sectors = size / ss;
    let (offset, len) = match rng.below(7) {
        // Inside one sector.
        0 => {
            let sector = rng.below(sectors);
            let at = rng.below(ss);
            (sector * ss + at, rng.range(1, ss - at))
        }
        // A few bytes straddling a sector boundary.
        1 => {
            let boundary = rng.range(1, sectors - 1) * ss;
            let before = rng.range(1, ss.min(64));
            (boundary - before, before + rng.range(1, ss.min(64)))
        }
        // Whole sectors.
        2 => {
            let first = rng.below(sectors);
            let n = rng.range(1, (2 * os / ss).min(sectors - first));
            (first * ss, n * ss)
        }
        // Across an object boundary, unaligned.
        3 => {
            let boundaries = (size - 1) / os;
            let boundary = rng.range(1, boundaries) * os;
            let before = rng.range(1, 2 * ss);
            (boundary - before, before + rng.range(1, 2 * ss))
        }
        // Whole objects (the last one may be partial).
        4 => {
            let object = rng.below(size.div_ceil(os));
            (object * os, rng.range(1, 2) * os)
        }
        // Anything, up to a few objects.
        5 => {
            let offset = rng.below(size);
            (offset, rng.range(1, 3 * os))
        }
        // The end of the image.
        _ => {
            let len = rng.range(1, 2 * ss + 7);
            (size.saturating_sub(len), len)
        }
    };
    let offset = offset.min(size - 1);
    (offset, len.clamp(1, size - offset))
}

fn pick_op(rng: &mut Rng, size: u64, ss: u64, os: u64) -> Op {
    let (offset, len) = pick_range(rng, size, ss, os);
    match rng.below(100) {
        0..=29 => Op::Read(offset, len),
        30..=49 => Op::Write(offset, len),
        50..=64 => Op::WriteOwned(offset, len),
        65..=76 => Op::Discard(offset, len),
        77..=86 => Op::WriteZeroes(offset, len, true),
        87..=96 => Op::WriteZeroes(offset, len, false),
        _ => Op::Flush,
    }
}

/// Read all of `[offset, offset + len)` and compare with the model: into a buffer of ours
/// (`Image::read`) or, for about half of the ranges, into one the image returns
/// (`Image::read_owned`, as export reads, or `Image::read_reply`, as the NBD server reads:
/// its pieces in order).
async fn check(
    image: &Image,
    model: &[u8],
    offset: u64,
    len: u64,
    what: &str,
) -> Result<(), String> {
    let failed = |e: ImageError| format!("{what}: read [{offset}, +{len}) failed: {e}");
    let buf = if (offset / 512 + len / 512).is_multiple_of(4) {
        let reply = image
            .read_reply(offset, len as usize)
            .await
            .map_err(failed)?;
        let buf: Vec<u8> = reply.pieces().flatten().copied().collect();
        if buf.len() as u64 != len || reply.len() as u64 != len {
            return Err(format!(
                "{what}: read_reply [{offset}, +{len}) returned {} bytes in its pieces, \
                 says {}",
                buf.len(),
                reply.len()
            ));
        }
        buf
    } else if (offset / 512 + len / 512).is_multiple_of(2) {
        let buf = image
            .read_owned(offset, len as usize)
            .await
            .map_err(failed)?;
        if buf.len() as u64 != len {
            return Err(format!(
                "{what}: read_owned [{offset}, +{len}) returned {} bytes",
                buf.len()
            ));
        }
        buf
    } else {
        let mut buf = vec![0x5Au8; len as usize];
        image.read(offset, &mut buf).await.map_err(failed)?;
        buf
    };
    let expect = &model[offset as usize..(offset + len) as usize];
    if let Some(i) = first_difference(&buf, expect) {
        return Err(format!(
            "{what}: read [{offset}, +{len}) differs from the model first at image byte {} \
             (got {:#04x}, expected {:#04x}); {} bytes differ",
            offset + i as u64,
            buf[i],
            expect[i],
            buf.iter().zip(expect).filter(|(a, b)| a != b).count()
        ));
    }
    Ok(())
}

/// Run one case from `seed`. Errors name the case, the seed and the operation.
pub async fn run(case: &Case, uri: &ImageUri, seed: u64) -> Result<(), String> {
    let fail = |step: &str, e: String| format!("{case} (seed {seed:#x}) at {step}: {e}");
    let mut rng = Rng::derive(seed, &case.to_string());
    let (size, ss, os) = (case.size, case.sector_size as u64, case.object_size);
    let mut model = vec![0u8; size as usize];
    let mut image = Image::create(uri, &case.create_options(), PASS)
        .await
        .map_err(|e| fail("create", e.to_string()))?;
    if image.size() != size {
        return Err(fail("create", format!("size {} != {size}", image.size())));
    }
    // A new image reads as zeros.
    check(&image, &model, 0, size, "fresh image")
        .await
        .map_err(|e| fail("start", e))?;
    let reopen_at = case.ops / 2;
    for i in 0..case.ops {
        if i == reopen_at {
            image
                .close()
                .await
                .map_err(|e| fail("close", e.to_string()))?;
            image = Image::open(uri, PASS, &OpenOptions::default())
                .await
                .map_err(|e| fail("reopen", e.to_string()))?;
            check(&image, &model, 0, size, "after reopen")
                .await
                .map_err(|e| fail("reopen", e))?;
        }
        let op = pick_op(&mut rng, size, ss, os);
        let step = format!("op {i} {op:?}");
        let result = match op {
            Op::Read(offset, len) => {
                check(&image, &model, offset, len, "read")
                    .await
                    .map_err(|e| fail(&step, e))?;
                Ok(())
            }
            Op::Write(offset, len) => {
                let data = rng.bytes(len as usize);
                let r = image.write(offset, &data).await;
                model[offset as usize..(offset + len) as usize].copy_from_slice(&data);
                r
            }
            Op::WriteOwned(offset, len) => {
                let data = rng.bytes(len as usize);
                model[offset as usize..(offset + len) as usize].copy_from_slice(&data);
                if rng.below(2) == 0 {
                    // As an import hands a chunk over: with the room the image asks for.
                    let mut owned =
                        Vec::with_capacity(len as usize + image.write_headroom(offset, len));
                    owned.extend_from_slice(&data);
                    image.write_owned(offset, owned).await
                } else {
                    // As the NBD server receives a payload: placed as the image asks, the
                    // slots' tails (metadata to be) holding whatever was in the memory.
                    let payload = match image.write_placement(offset, len) {
                        PayloadPlacement::Contiguous { spare } => {
                            let mut owned = Vec::with_capacity(len as usize + spare);
                            owned.extend_from_slice(&data);
                            WritePayload::contiguous(owned)
                        }
                        PayloadPlacement::Slots { sector, slot } => {
                            let slots = data
                                .chunks_exact(sector)
                                .flat_map(|s| {
                                    s.iter()
                                        .copied()
                                        .chain(std::iter::repeat_n(0xa5, slot - sector))
                                })
                                .collect();
                            WritePayload::in_slots(slots, sector, slot)
                        }
                    };
                    image.write_payload(offset, payload).await
                }
            }
            Op::Discard(offset, len) => {
                let r = image.discard(offset, len).await;
                model[offset as usize..(offset + len) as usize].fill(0);
                r
            }
            Op::WriteZeroes(offset, len, may_unmap) => {
                let r = image.write_zeroes(offset, len, may_unmap).await;
                model[offset as usize..(offset + len) as usize].fill(0);
                r
            }
            Op::Flush => image.flush().await,
        };
        result.map_err(|e| fail(&step, e.to_string()))?;
    }
    check(&image, &model, 0, size, "final full read")
        .await
        .map_err(|e| fail("end", e))?;
    image
        .close()
        .await
        .map_err(|e| fail("close", e.to_string()))?;
    // What close flushed is there for a reader.
    let reader = Image::open(uri, PASS, &OpenOptions::read_only())
        .await
        .map_err(|e| fail("read-only open", e.to_string()))?;
    check(&reader, &model, 0, size, "read-only reopen")
        .await
        .map_err(|e| fail("end", e))?;
    reader
        .close()
        .await
        .map_err(|e| fail("close", e.to_string()))?;
    Ok(())
}

/// Run `cases` concurrently (each on its own image), failing with every failed case.
pub async fn run_all(test: &str, cases: Vec<Case>) {
    let (seed, _guard) = seed(test);
    let only = std::env::var("IVDISK_MODEL_ONLY").ok();
    let mut tasks = Vec::new();
    for case in cases {
        if only.as_ref().is_some_and(|o| !case.to_string().contains(o)) {
            continue;
        }
        tasks.push(tokio::spawn(async move {
            let place = place(case.backend, "model");
            let started = std::time::Instant::now();
            let mut result = run(&case, &place.uri, seed).await;
            if result.is_ok() && case.backend == Backend::Rados {
                // Leave nothing behind in the pool (the namespace is this process' own).
                result = ivdisk_image::Image::delete(&place.uri, |_, _| {})
                    .await
                    .map_err(|e| format!("{case}: deleting the image: {e}"));
            }
            (case, result, started.elapsed())
        }));
    }
    let mut failures = Vec::new();
    for task in tasks {
        let (case, result, took) = task.await.expect("a model case panicked");
        eprintln!("{case}: {} ops in {took:.2?}", case.ops);
        if let Err(e) = result {
            failures.push(e);
        }
    }
    assert!(
        failures.is_empty(),
        "{} model case(s) failed (seed {seed:#x}):\n{}",
        failures.len(),
        failures.join("\n")
    );
}

// ---------------------------------------------------------------------------------------------
// Faults below the unit under test

/// The memory store, listing at most `limit` omap pairs per range read (and saying `more`),
/// as a Ceph OSD lists at most `osd_max_omap_entries_per_request` (1024 by default) whatever
/// a read asks for.
pub struct ShortListings {
    inner: ivdisk_store::MemoryStore,
    limit: usize,
}

impl ShortListings {
    pub fn new(limit: usize) -> Self {
        ShortListings {
            inner: ivdisk_store::MemoryStore::new().unwrap(),
            limit,
        }
    }
}

ivdisk_store::object_store_forwarding_to_inner!(ShortListings {
    async fn write_op(
        &self,
        object: &ObjectName,
        op: WriteOp,
    ) -> Result<ivdisk_store::WriteOutcome, ivdisk_store::StoreError> {
        self.inner.write_op(object, op).await
    }
    async fn read_op(
        &self,
        object: &ObjectName,
        op: ReadOp,
    ) -> Result<Vec<ReadResult>, ivdisk_store::StoreError> {
        let ranges: Vec<bool> = op
            .steps
            .iter()
            .map(|s| matches!(s, ReadStep::OmapGetRange { .. }))
            .collect();
        let mut results = self.inner.read_op(object, op).await?;
        for (result, range) in results.iter_mut().zip(ranges) {
            if let (ReadResult::Omap { pairs, more }, true) = (result, range) {
                if pairs.len() > self.limit {
                    pairs.truncate(self.limit);
                    *more = true;
                }
            }
        }
        Ok(results)
    }
});

/// The real memory store, except that while armed some write operations fail: those on one
/// chosen object, or the n-th write operation (counting from 1 since it was armed).
pub struct FailingStore {
    inner: ivdisk_store::MemoryStore,
    victim: std::sync::Mutex<Option<ObjectName>>,
    fail_at: std::sync::atomic::AtomicUsize,
    writes: std::sync::atomic::AtomicUsize,
    armed: std::sync::atomic::AtomicBool,
    /// How many more failures are reported after the operation was applied.
    applied_first: std::sync::atomic::AtomicUsize,
    /// How many reads of the failing object fail once the next write failure is injected,
    /// and how many more fail now.
    reads_failing_after: std::sync::atomic::AtomicUsize,
    reads_failing: std::sync::atomic::AtomicUsize,
    /// Every write from the `fail_at`-th on fails, not that one alone.
    failing_on: std::sync::atomic::AtomicBool,
    /// Writes of this object never fail (on an OSD that stays up).
    spared: std::sync::Mutex<Option<ObjectName>>,
}

impl FailingStore {
    pub fn new() -> FailingStore {
        FailingStore {
            inner: ivdisk_store::MemoryStore::new().unwrap(),
            victim: std::sync::Mutex::new(None),
            fail_at: 0.into(),
            writes: 0.into(),
            armed: false.into(),
            applied_first: 0.into(),
            reads_failing_after: 0.into(),
            reads_failing: 0.into(),
            failing_on: false.into(),
            spared: std::sync::Mutex::new(None),
        }
    }

    /// The next `n` read operations on the failing object, after the next injected write
    /// failure, fail too (the cluster still down when the writer looks what became of it).
    pub fn fail_reads_after_next_failure(&self, n: usize) {
        self.reads_failing_after
            .store(n, std::sync::atomic::Ordering::SeqCst);
    }

    /// Failures from now on are reported after the operation was applied (a RADOS timeout
    /// whose operation went through), or before, as by default.
    pub fn apply_before_failing(&self, applied: bool) {
        let count = if applied { usize::MAX } else { 0 };
        self.applied_first
            .store(count, std::sync::atomic::Ordering::SeqCst);
    }

    /// The next failure only is reported after its operation was applied.
    pub fn apply_before_failing_once(&self) {
        self.applied_first
            .store(1, std::sync::atomic::Ordering::SeqCst);
    }

    /// From now on, every write operation on `object` fails.
    pub fn fail_object(&self, object: ObjectName) {
        *self.victim.lock().unwrap() = Some(object);
        self.arm(true);
    }

    /// From now on, the `n`-th write operation (counting from 1) fails.
    pub fn fail_nth_write(&self, n: usize) {
        self.fail_at.store(n, std::sync::atomic::Ordering::SeqCst);
        self.writes.store(0, std::sync::atomic::Ordering::SeqCst);
        self.arm(true);
    }

    /// From now on, the `n`-th write operation (counting from 1) and every one after fail
    /// (a store that goes down and stays down).
    pub fn fail_from_nth_write(&self, n: usize) {
        self.failing_on
            .store(true, std::sync::atomic::Ordering::SeqCst);
        self.fail_nth_write(n);
    }

    /// Writes of `object` never fail from now on.
    pub fn spare_object(&self, object: ObjectName) {
        *self.spared.lock().unwrap() = Some(object);
    }

    pub fn arm(&self, armed: bool) {
        self.armed.store(armed, std::sync::atomic::Ordering::SeqCst);
    }

    fn fails(&self, object: &ObjectName) -> bool {
        use std::sync::atomic::Ordering::SeqCst;
        let n = self.writes.fetch_add(1, SeqCst) + 1;
        self.spared.lock().unwrap().as_ref() != Some(object)
            && self.armed.load(SeqCst)
            && (self.victim.lock().unwrap().as_ref() == Some(object)
                || n == self.fail_at.load(SeqCst)
                || self.failing_on.load(SeqCst) && n >= self.fail_at.load(SeqCst))
    }
}

ivdisk_store::object_store_forwarding_to_inner!(FailingStore {
    async fn write_op(
        &self,
        object: &ObjectName,
        op: WriteOp,
    ) -> Result<ivdisk_store::WriteOutcome, ivdisk_store::StoreError> {
        if self.fails(object) {
            use std::sync::atomic::Ordering::SeqCst;
            if self
                .applied_first
                .fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1))
                .is_ok()
            {
                self.inner.write_op(object, op).await?;
            }
            let reads = self.reads_failing_after.swap(0, SeqCst);
            self.reads_failing.store(reads, SeqCst);
            return Err(ivdisk_store::StoreError::Io {
                context: format!("injected failure writing `{object}`"),
                source: std::io::ErrorKind::Other.into(),
            });
        }
        self.inner.write_op(object, op).await
    }
    async fn read_op(
        &self,
        object: &ObjectName,
        op: ReadOp,
    ) -> Result<Vec<ReadResult>, ivdisk_store::StoreError> {
        use std::sync::atomic::Ordering::SeqCst;
        let victim = self.victim.lock().unwrap().as_ref() == Some(object);
        if victim
            && self
                .reads_failing
                .fetch_update(SeqCst, SeqCst, |n| n.checked_sub(1))
                .is_ok()
        {
            return Err(ivdisk_store::StoreError::Io {
                context: format!("injected failure reading `{object}`"),
                source: std::io::ErrorKind::Other.into(),
            });
        }
        self.inner.read_op(object, op).await
    }
});

/// A memory store that says it writes in 4 KiB blocks, as RADOS does (`write_unit`), so the
/// image layer's whole-block metadata writes run in process; it records the steps of every
/// operation for tests that check what went out.
pub struct BlockStore {
    inner: ivdisk_store::MemoryStore,
    /// (object, offset, len) of every write step, in submission order.
    pub writes: std::sync::Mutex<Vec<(String, u64, usize)>>,
    /// (object, number of read steps) of every read operation.
    pub reads: std::sync::Mutex<Vec<(String, usize)>>,
    /// (object, what) of every omap step, in submission order: `set KEY:LEN,...` (values set),
    /// `remove KEY,...`, `get KEY,...` (read by keys).
    pub omap: std::sync::Mutex<Vec<(String, String)>>,
    /// While set, reads of this object wait (after they were recorded), as a read does that
    /// a caller gives up on.
    pub hold_reads_of: std::sync::Mutex<Option<String>>,
    /// The same for writes, which wait before they are applied.
    pub hold_writes_of: std::sync::Mutex<Option<String>>,
}

impl BlockStore {
    pub fn new() -> BlockStore {
        BlockStore {
            inner: ivdisk_store::MemoryStore::new().unwrap(),
            writes: Default::default(),
            reads: Default::default(),
            omap: Default::default(),
            hold_reads_of: Default::default(),
            hold_writes_of: Default::default(),
        }
    }

    fn reads_held(&self, object: &ObjectName) -> bool {
        self.hold_reads_of.lock().unwrap().as_deref() == Some(object.as_str())
    }

    fn writes_held(&self, object: &ObjectName) -> bool {
        self.hold_writes_of.lock().unwrap().as_deref() == Some(object.as_str())
    }

    /// Forget what was recorded so far.
    pub fn clear(&self) {
        self.writes.lock().unwrap().clear();
        self.reads.lock().unwrap().clear();
        self.omap.lock().unwrap().clear();
    }

    /// What was recorded of `object`'s omap steps.
    pub fn omap_of(&self, object: &str) -> Vec<String> {
        let omap = self.omap.lock().unwrap();
        omap.iter()
            .filter(|(o, _)| o == object)
            .map(|(_, what)| what.clone())
            .collect()
    }
}

fn key_list<'a>(keys: impl Iterator<Item = &'a [u8]>) -> String {
    keys.map(|k| String::from_utf8_lossy(k).into_owned())
        .collect::<Vec<_>>()
        .join(",")
}

ivdisk_store::object_store_forwarding_to_inner!(BlockStore {
    async fn write_op(
        &self,
        object: &ObjectName,
        op: WriteOp,
    ) -> Result<ivdisk_store::WriteOutcome, ivdisk_store::StoreError> {
        {
            let mut writes = self.writes.lock().unwrap();
            let mut omap = self.omap.lock().unwrap();
            for step in &op.steps {
                match step {
                    ivdisk_store::WriteStep::Write { offset, data } => {
                        writes.push((object.to_string(), *offset, data.len()))
                    }
                    ivdisk_store::WriteStep::OmapSet(pairs) => {
                        let set: Vec<String> = pairs
                            .iter()
                            .map(|(k, v)| format!("{}:{}", String::from_utf8_lossy(k), v.len()))
                            .collect();
                        omap.push((object.to_string(), format!("set {}", set.join(","))));
                    }
                    ivdisk_store::WriteStep::OmapRemoveKeys(keys) => omap.push((
                        object.to_string(),
                        format!("remove {}", key_list(keys.iter().map(|k| &k[..]))),
                    )),
                    ivdisk_store::WriteStep::OmapRemoveRange { start, end } => omap.push((
                        object.to_string(),
                        format!(
                            "remove {}..{}",
                            String::from_utf8_lossy(start),
                            String::from_utf8_lossy(end)
                        ),
                    )),
                    ivdisk_store::WriteStep::OmapClear => {
                        omap.push((object.to_string(), "clear".to_string()))
                    }
                    _ => {}
                }
            }
        }
        while self.writes_held(object) {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        self.inner.write_op(object, op).await
    }
    async fn read_op(
        &self,
        object: &ObjectName,
        op: ReadOp,
    ) -> Result<Vec<ReadResult>, ivdisk_store::StoreError> {
        let steps = op
            .steps
            .iter()
            .filter(|s| matches!(s, ReadStep::Read { .. }))
            .count();
        self.reads.lock().unwrap().push((object.to_string(), steps));
        for step in &op.steps {
            if let ReadStep::OmapGetByKeys(keys) = step {
                let what = format!("get {}", key_list(keys.iter().map(|k| &k[..])));
                self.omap.lock().unwrap().push((object.to_string(), what));
            }
        }
        while self.reads_held(object) {
            tokio::time::sleep(std::time::Duration::from_millis(5)).await;
        }
        self.inner.read_op(object, op).await
    }
    fn write_unit(&self) -> u64 {
        4096
    }
});
