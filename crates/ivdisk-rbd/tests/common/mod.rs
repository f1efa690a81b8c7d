//! What the librbd tests share: the test cluster, throwaway rbd images made and removed with
//! the `rbd` tool, and qemu's rbd driver (librbd with qemu's own encryption options) as the
//! judge of what our FFI wrote.
//!
//! The cluster comes from the environment as for the other Ceph tests: `CEPH_CONF` (from
//! `scripts/ceph-dev-cluster start`), `IVDISK_RADOS_POOL` (default `rbd`); `IVDISK_NO_CEPH=1`
//! skips these tests loudly, and without it a missing cluster fails them. Every image gets a
//! random name and is removed when its guard drops, also when a test fails.

#![allow(dead_code)]

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::Duration;

use ivdisk_rados::RadosConfig;
use ivdisk_rbd::{Encryption, RbdImage, RbdOpenOptions};
use zeroize::Zeroizing;

/// The passphrase, kept in a file without a newline: `rbd encryption format` and qemu's
/// `secret,file=` read exactly these bytes.
pub const PASS: &[u8] = b"ivdisk-rbd test passphrase";
pub const MIB: u64 = 1 << 20;
/// The object size of the test images (rbd's default).
pub const OBJECT: u64 = 4 * MIB;
/// The raw size of the LUKS test images.
pub const LUKS_SIZE: u64 = 64 * MIB;

/// The cluster's config file and pool, or `None` (skip) with IVDISK_NO_CEPH=1.
pub fn cluster() -> Option<(String, String)> {
    if std::env::var("IVDISK_NO_CEPH").as_deref() == Ok("1") {
        eprintln!("IVDISK_NO_CEPH=1: no Ceph cluster, the librbd tests are SKIPPED");
        return None;
    }
    let conf = std::env::var("CEPH_CONF").unwrap_or_else(|_| {
        panic!(
            "the librbd tests need a Ceph cluster: run `eval \"$(scripts/ceph-dev-cluster start)\"` \
             (which exports CEPH_CONF), or set IVDISK_NO_CEPH=1 to skip them"
        )
    });
    let pool = std::env::var("IVDISK_RADOS_POOL").unwrap_or_else(|_| "rbd".into());
    Some((conf, pool))
}

fn hint(program: &str) -> &'static str {
    match program {
        "rbd" => "apt-get install ceph-common",
        "qemu-img" | "qemu-io" => "apt-get install qemu-utils qemu-block-extra (qemu's rbd driver)",
        _ => "see scripts/install-deps.sh",
    }
}

fn run(program: &str, args: &[&str]) -> Output {
    Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "{program} is needed by this test and could not be run ({e}): {} \
                 (scripts/install-deps.sh installs it)",
                hint(program)
            )
        })
}

pub fn run_ok(program: &str, args: &[&str]) -> String {
    let out = run(program, args);
    if !out.status.success() {
        panic!(
            "{program} {args:?} failed ({}): {}{}",
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    String::from_utf8_lossy(&out.stdout).into_owned()
}

pub fn random(len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    for chunk in out.chunks_mut(1 << 16) {
        getrandom::getrandom(chunk).unwrap();
    }
    out
}

pub fn s(path: &Path) -> &str {
    path.to_str().unwrap()
}

pub fn secret(bytes: &[u8]) -> Zeroizing<Vec<u8>> {
    Zeroizing::new(bytes.to_vec())
}

/// One rbd image of this test run, removed (with its snapshots) when dropped.
pub struct TestImage {
    pub conf: String,
    pub pool: String,
    pub name: String,
    pub dir: tempfile::TempDir,
    pub passfile: PathBuf,
}

impl TestImage {
    /// `rbd create --size SIZE` (4 MiB objects), then `rbd encryption format IMAGE FORMAT
    /// PASSFILE` if `format` is given. Plain images get rbd's default features; encrypted
    /// ones no object-map/fast-diff: with fast-diff, qemu 7.2's rbd driver answers block
    /// status from the raw image's objects without the LUKS header's offset, so
    /// `qemu-img convert` skips encrypted data as holes (a qemu bug, not librbd's).
    pub fn create(tag: &str, size: u64, format: Option<&str>) -> Option<TestImage> {
        let (conf, pool) = cluster()?;
        let mut b = [0u8; 5];
        getrandom::getrandom(&mut b).unwrap();
        let dir = tempfile::tempdir().unwrap();
        let passfile = dir.path().join("passphrase");
        fs::write(&passfile, PASS).unwrap();
        let image = TestImage {
            conf,
            pool,
            name: format!("ivdisk-rbd-{tag}-{}", hex::encode(b)),
            dir,
            passfile,
        };
        let mut create = vec!["create", "--size"];
        let size = format!("{}M", size / MIB);
        create.push(&size);
        if format.is_some() {
            create.extend(["--image-feature", "layering,exclusive-lock,deep-flatten"]);
        }
        let spec = image.spec();
        create.push(&spec);
        image.rbd(&create);
        if let Some(format) = format {
            image.rbd(&[
                "encryption",
                "format",
                &image.spec(),
                format,
                s(&image.passfile),
            ]);
        }
        Some(image)
    }

    pub fn spec(&self) -> String {
        format!("{}/{}", self.pool, self.name)
    }

    pub fn rbd(&self, args: &[&str]) -> String {
        let mut all = vec!["--conf", &self.conf];
        all.extend(args);
        run_ok("rbd", &all)
    }

    pub fn config(&self) -> RadosConfig {
        RadosConfig {
            conf: Some(PathBuf::from(&self.conf)),
            connect_timeout: Duration::from_secs(20),
            ..RadosConfig::new(self.pool.clone())
        }
    }

    pub fn options(&self, encryption: Encryption) -> RbdOpenOptions {
        RbdOpenOptions {
            encryption,
            ..RbdOpenOptions::new(self.name.clone())
        }
    }

    /// Open with our FFI.
    pub async fn open(&self, encryption: Encryption) -> RbdImage {
        RbdImage::open(&self.config(), self.options(encryption))
            .await
            .unwrap_or_else(|e| panic!("opening {}: {e}", self.spec()))
    }

    /// The raw image, as `rbd export` writes it.
    pub fn export_raw(&self) -> Vec<u8> {
        let out = self.dir.path().join("export.raw");
        let _ = fs::remove_file(&out);
        self.rbd(&["export", "--no-progress", &self.spec(), s(&out)]);
        fs::read(&out).unwrap()
    }

    fn qemu_secret(&self) -> String {
        format!("secret,id=sec0,file={}", self.passfile.display())
    }

    /// qemu's rbd driver with librbd's encryption (qemu calls LUKS1 `luks`).
    fn qemu_rbd(&self, format: &str) -> String {
        let format = if format == "luks1" { "luks" } else { format };
        format!(
            "driver=rbd,pool={},image={},conf={},encrypt.format={format},encrypt.key-secret=sec0",
            self.pool, self.name, self.conf
        )
    }

    /// The plaintext librbd shows qemu, through `qemu-img convert`.
    pub fn qemu_read(&self, format: &str) -> Vec<u8> {
        let out = self.dir.path().join("qemu-out.raw");
        let _ = fs::remove_file(&out);
        run_ok(
            "qemu-img",
            &[
                "convert",
                "--object",
                &self.qemu_secret(),
                "--image-opts",
                &self.qemu_rbd(format),
                "-O",
                "raw",
                s(&out),
            ],
        );
        fs::read(&out).unwrap()
    }

    /// A `qemu-io` command on the image through qemu's rbd driver with encryption.
    pub fn qemu_io(&self, format: &str, command: &str) {
        run_ok(
            "qemu-io",
            &[
                "--object",
                &self.qemu_secret(),
                "--image-opts",
                &self.qemu_rbd(format),
                "-c",
                command,
            ],
        );
    }
}

impl Drop for TestImage {
    fn drop(&mut self) {
        let spec = self.spec();
        let quiet = |args: &[&str]| {
            let mut all = vec!["--conf", self.conf.as_str()];
            all.extend(args);
            let _ = Command::new("rbd").args(&all).output();
        };
        quiet(&["snap", "purge", "--no-progress", &spec]);
        quiet(&["rm", "--no-progress", &spec]);
    }
}

/// What an image should hold.
pub struct Model(pub Vec<u8>);

impl Model {
    pub fn new(size: u64) -> Model {
        Model(vec![0; size as usize])
    }

    pub fn write(&mut self, offset: u64, data: &[u8]) {
        self.0[offset as usize..][..data.len()].copy_from_slice(data);
    }

    pub fn zero(&mut self, offset: u64, len: u64) {
        self.0[offset as usize..][..len as usize].fill(0);
    }

    /// `got` equals the model; on failure, names the first differing byte.
    pub fn check(&self, got: &[u8], what: &str) {
        assert_eq!(got.len(), self.0.len(), "{what}: wrong size");
        if let Some(at) = got.iter().zip(&self.0).position(|(a, b)| a != b) {
            panic!(
                "{what}: byte {at} differs (got {:#04x}, expected {:#04x})",
                got[at], self.0[at]
            );
        }
    }
}
