//! LUKS1/LUKS2 files made by cryptsetup open through ivdisk's engine (`Image::open` of a file
//! path), and the bytes are the other tools' bytes (issue 6, point 3), judged by independent
//! implementations only:
//!
//! - qemu's own userspace LUKS driver (`qemu-img convert`, `qemu-io` with `driver=luks`), which
//!   reads and writes LUKS1;
//! - cryptsetup's userspace data path: `cryptsetup reencrypt` (offline) decrypts every sector
//!   and encrypts it again, and `cryptsetup reencrypt --encrypt` encrypts a plaintext file.
//!
//! qemu 7.2 has no LUKS2, and this machine has no device mapper, so a LUKS2 file is read back
//! by a chain: `cryptsetup convert --type luks1` (512-byte sectors; only the header changes),
//! or for 4096-byte sectors first `cryptsetup reencrypt --sector-size 512` (cryptsetup
//! decrypts ivdisk's 4096-byte sectors) and another `reencrypt` (so that the digest is id 0
//! again, which `convert` needs), then qemu reads it.
//!
//! Every tool must be installed (scripts/install-deps.sh: cryptsetup-bin, qemu-utils); a
//! missing one fails these tests with the package to install.

use std::fs;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};

use ivdisk_crypto::Suite;
use ivdisk_image::{Image, ImageError, ImageUri, LayoutKind, OpenOptions};

const PASS: &[u8] = b"ivdisk foreign LUKS test passphrase";
const MIB: u64 = 1 << 20;

fn hint(program: &str) -> &'static str {
    match program {
        "cryptsetup" => "apt-get install cryptsetup-bin",
        "qemu-img" | "qemu-io" => "apt-get install qemu-utils",
        "flock" => "apt-get install util-linux",
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

fn run_ok(program: &str, args: &[&str]) -> Vec<u8> {
    let out = run(program, args);
    assert!(
        out.status.success(),
        "{program} {args:?} failed ({}): {}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

fn random(len: usize) -> Vec<u8> {
    let mut out = vec![0u8; len];
    for chunk in out.chunks_mut(1 << 16) {
        getrandom::getrandom(chunk).unwrap();
    }
    out
}

fn s(path: &Path) -> &str {
    path.to_str().unwrap()
}

/// The LUKS variants under test.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Luks1,
    Luks2 { sector: u32 },
}

impl Kind {
    fn data_offset(self) -> u64 {
        match self {
            Kind::Luks1 => 2 * MIB,
            Kind::Luks2 { .. } => 16 * MIB,
        }
    }
    fn sector_size(self) -> u64 {
        match self {
            Kind::Luks1 => 512,
            Kind::Luks2 { sector } => sector as u64,
        }
    }
}

const FAST_PBKDF: [&str; 4] = ["--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"];

struct Scratch {
    dir: tempfile::TempDir,
    passfile: PathBuf,
}

impl Scratch {
    fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let passfile = dir.path().join("passphrase");
        fs::write(&passfile, PASS).unwrap();
        Scratch { dir, passfile }
    }

    fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    fn key(&self) -> &str {
        s(&self.passfile)
    }

    fn uri(&self, path: &Path) -> ImageUri {
        ImageUri::parse(&format!("file:{}", path.display())).unwrap()
    }

    /// `cryptsetup luksFormat` on a new sparse file with `data` bytes after the header.
    fn luks_format(&self, name: &str, kind: Kind, data: u64, extra: &[&str]) -> PathBuf {
        let path = self.path(name);
        fs::File::create(&path)
            .unwrap()
            .set_len(kind.data_offset() + data)
            .unwrap();
        let sector = kind.sector_size().to_string();
        let mut args = vec!["luksFormat", "--batch-mode", "--key-file", self.key()];
        match kind {
            Kind::Luks1 => args.extend(["--type", "luks1", "--pbkdf-force-iterations", "1000"]),
            Kind::Luks2 { .. } => {
                args.extend(["--type", "luks2", "--sector-size", &sector]);
                args.extend(FAST_PBKDF);
            }
        }
        args.extend(extra);
        args.push(s(&path));
        run_ok("cryptsetup", &args);
        path
    }

    fn qemu_secret(&self) -> String {
        format!("secret,id=sec0,file={}", self.key())
    }

    fn qemu_luks(&self, path: &Path) -> String {
        format!(
            "driver=luks,key-secret=sec0,file.filename={}",
            path.display()
        )
    }

    /// qemu's plaintext view of a LUKS1 file.
    fn qemu_read(&self, path: &Path) -> Vec<u8> {
        let out = self.path("qemu-out.raw");
        let _ = fs::remove_file(&out);
        run_ok(
            "qemu-img",
            &[
                "convert",
                "--object",
                &self.qemu_secret(),
                "--image-opts",
                &self.qemu_luks(path),
                "-O",
                "raw",
                s(&out),
            ],
        );
        fs::read(&out).unwrap()
    }

    /// Write `plain` over the whole data area of a LUKS1 file with qemu.
    fn qemu_write_all(&self, path: &Path, plain: &[u8]) {
        let src = self.path("qemu-in.raw");
        fs::write(&src, plain).unwrap();
        run_ok(
            "qemu-img",
            &[
                "convert",
                "-n",
                "-S",
                "0",
                "--object",
                &self.qemu_secret(),
                "-f",
                "raw",
                s(&src),
                "--target-image-opts",
                &self.qemu_luks(path),
            ],
        );
    }

    fn qemu_io(&self, path: &Path, command: &str) {
        run_ok(
            "qemu-io",
            &[
                "--object",
                &self.qemu_secret(),
                "--image-opts",
                &self.qemu_luks(path),
                "-c",
                command,
            ],
        );
    }

    /// `cryptsetup reencrypt` offline: cryptsetup decrypts every sector and encrypts it again
    /// under a new volume key (and `extra`, e.g. a new sector size).
    fn reencrypt(&self, path: &Path, extra: &[&str]) {
        let mut args = vec![
            "reencrypt",
            "--batch-mode",
            "--force-offline-reencrypt",
            "--key-file",
            self.key(),
        ];
        args.extend(FAST_PBKDF);
        args.extend(extra);
        args.push(s(path));
        run_ok("cryptsetup", &args);
    }

    /// The plaintext of a LUKS file's data area as the other tools see it (see the module
    /// documentation). Works on a copy; `path` is left as it is.
    fn independent_read(&self, path: &Path, kind: Kind) -> Vec<u8> {
        if kind == Kind::Luks1 {
            return self.qemu_read(path);
        }
        let copy = self.path("chain-copy.img");
        fs::copy(path, &copy).unwrap();
        if kind.sector_size() != 512 {
            self.reencrypt(&copy, &["--sector-size", "512"]);
            // The digest of the new key is id 1 now; `convert` wants id 0.
            self.reencrypt(&copy, &[]);
        }
        run_ok(
            "cryptsetup",
            &["convert", "--batch-mode", "--type", "luks1", s(&copy)],
        );
        let plain = self.qemu_read(&copy);
        fs::remove_file(&copy).unwrap();
        plain
    }
}

/// What the image should hold: plaintext, and which sectors were ever written.
struct Model {
    bytes: Vec<u8>,
    known: Vec<bool>,
    sector: u64,
}

impl Model {
    fn new(size: u64, sector: u64) -> Self {
        Model {
            bytes: vec![0; size as usize],
            known: vec![false; (size / sector) as usize],
            sector,
        }
    }

    fn all_known(bytes: Vec<u8>, sector: u64) -> Self {
        let n = bytes.len() as u64 / sector;
        Model {
            bytes,
            known: vec![true; n as usize],
            sector,
        }
    }

    /// A write covers whole sectors: the bytes it does not name keep their content (zeros
    /// for never-written sectors, which the engine reads as zeros).
    fn write(&mut self, offset: u64, data: &[u8]) {
        self.bytes[offset as usize..offset as usize + data.len()].copy_from_slice(data);
        let end = offset + data.len() as u64;
        for lba in offset / self.sector..end.div_ceil(self.sector) {
            self.known[lba as usize] = true;
        }
    }

    /// Compare the known sectors with `got` (another tool's view), naming the first mismatch.
    fn check(&self, got: &[u8], what: &str) {
        assert!(
            got.len() >= self.bytes.len(),
            "{what}: {} bytes, expected at least {}",
            got.len(),
            self.bytes.len()
        );
        let ss = self.sector as usize;
        let mut checked = 0;
        for (lba, _) in self.known.iter().enumerate().filter(|(_, k)| **k) {
            let range = lba * ss..(lba + 1) * ss;
            assert!(
                got[range.clone()] == self.bytes[range.clone()],
                "{what}: sector {lba} (bytes {range:?}) differs"
            );
            checked += 1;
        }
        assert!(checked > 0, "{what}: nothing was compared");
    }
}

/// Writes at awkward places: a sector, inside one sector, across the engine's object
/// boundary, the image's last bytes, one byte.
fn awkward_writes(size: u64, data_offset: u64) -> Vec<(u64, usize)> {
    const OBJECT: u64 = 4 * MIB; // LuksFileStore's object size
    let boundary = OBJECT - data_offset % OBJECT;
    vec![
        (0, 4096),
        (3 * 4096 + 100, 700),
        (boundary - 5000, 12_000),
        (size - 3000, 3000),
        (size / 2 + 1, 1),
        (512 * 9 + 3, 5000),
    ]
}

async fn open_rw(uri: &ImageUri) -> Image {
    Image::open(uri, PASS, &OpenOptions::default())
        .await
        .unwrap_or_else(|e| panic!("opening {uri}: {e}"))
}

async fn read_all(image: &Image) -> Vec<u8> {
    let mut buf = vec![0u8; image.size() as usize];
    image.read(0, &mut buf).await.unwrap();
    buf
}

/// ivdisk writes into a volume fresh from `cryptsetup luksFormat`; qemu (through
/// cryptsetup's conversions for LUKS2) reads exactly those bytes. For LUKS2, cryptsetup then
/// re-encrypts the volume under a new key and ivdisk reads the same plaintext again.
async fn ivdisk_writes_others_read(kind: Kind) {
    let scratch = Scratch::new();
    let data = 8 * MIB;
    let path = scratch.luks_format("vol.img", kind, data, &[]);
    let uri = scratch.uri(&path);

    let info = Image::info(&uri).await.unwrap();
    assert_eq!(
        info.size, data,
        "dynamic segment: file size minus data offset"
    );
    assert_eq!(info.sector_size as u64, kind.sector_size());
    assert_eq!(info.suite, Suite::AesXtsPlain64);
    assert_eq!(info.layout, LayoutKind::None);

    let image = open_rw(&uri).await;
    assert_eq!(image.size(), data);
    assert_eq!(image.sector_size() as u64, kind.sector_size());
    let mut model = Model::new(data, kind.sector_size());
    for (offset, len) in awkward_writes(data, kind.data_offset()) {
        let bytes = random(len);
        image.write(offset, &bytes).await.unwrap();
        model.write(offset, &bytes);
    }
    model.check(&read_all(&image).await, "ivdisk's own read-back");
    // Unwritten sectors (zeros in the file) read as zeros.
    assert!(
        read_all(&image).await[(data / 2 + 4096 * 4) as usize..][..4096]
            .iter()
            .all(|&b| b == 0)
    );
    image.close().await.unwrap();

    // The header is untouched: cryptsetup still opens the volume with the passphrase.
    run_ok(
        "cryptsetup",
        &[
            "open",
            "--test-passphrase",
            "--key-file",
            scratch.key(),
            s(&path),
        ],
    );
    model.check(
        &scratch.independent_read(&path, kind),
        &format!("{kind:?}: qemu's read of what ivdisk wrote"),
    );

    if let Kind::Luks2 { .. } = kind {
        // cryptsetup rewrites every sector under a new volume key; ivdisk reads it.
        scratch.reencrypt(&path, &[]);
        let image = Image::open(&uri, PASS, &OpenOptions::read_only())
            .await
            .unwrap();
        model.check(
            &read_all(&image).await,
            &format!("{kind:?}: ivdisk's read after cryptsetup reencrypt"),
        );
        image.close().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn luks1_file_ivdisk_writes_qemu_reads() {
    ivdisk_writes_others_read(Kind::Luks1).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn luks2_file_512_ivdisk_writes_cryptsetup_and_qemu_read() {
    ivdisk_writes_others_read(Kind::Luks2 { sector: 512 }).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn luks2_file_4096_ivdisk_writes_cryptsetup_and_qemu_read() {
    ivdisk_writes_others_read(Kind::Luks2 { sector: 4096 }).await;
}

/// A LUKS1 file's data starts 2 MiB into its first 4 MiB object, so its objects straddle the
/// data area's 4 MiB marks. A read-modify-write of a sector beside a whole-sector write of it
/// in the same object: each round ends as one of the two serial orders (the write's bytes
/// everywhere but, perhaps, the one byte the read-modify-write patched). The write once took
/// no lock where the read-modify-write looked for it, and the read-modify-write put back the
/// sector as it was before the write (seen in about one run of three; the range locks' unit
/// test `granules_are_objects_when_the_data_starts_inside_one` shows it every time).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn luks1_file_partial_writes_beside_whole_ones_lose_nothing() {
    let scratch = Scratch::new();
    let path = scratch.luks_format("vol.img", Kind::Luks1, 16 * MIB, &[]);
    let image = std::sync::Arc::new(open_rw(&scratch.uri(&path)).await);
    for round in 0..300u32 {
        let byte = (round % 255) as u8 | 1;
        let whole = {
            let image = image.clone();
            tokio::spawn(async move { image.write(4 * MIB - 1024, &[byte; 2048]).await })
        };
        let partial = {
            let image = image.clone();
            tokio::spawn(async move { image.write(4 * MIB + 5, &[0xEE]).await })
        };
        whole.await.unwrap().unwrap();
        partial.await.unwrap().unwrap();
        let mut sector = vec![0; 512];
        image.read(4 * MIB, &mut sector).await.unwrap();
        for (i, &b) in sector.iter().enumerate() {
            match i {
                5 => assert!(b == 0xEE || b == byte, "round {round}: byte 5 is {b:#x}"),
                _ => assert_eq!(b, byte, "round {round}: byte {i} lost the whole write"),
            }
        }
    }
}

/// Partial-sector writes through ivdisk over data another tool wrote (read-modify-write of
/// their sectors), then the other tool's view of the whole image.
async fn patch_and_check(scratch: &Scratch, path: &Path, kind: Kind, model: &mut Model) {
    let uri = scratch.uri(path);
    let image = open_rw(&uri).await;
    model.check(&read_all(&image).await, &format!("{kind:?}: ivdisk's read"));
    // The part of the image the model knows (all of it, or what cryptsetup kept).
    let size = model.bytes.len() as u64;
    for (offset, len) in [(77u64, 10usize), (4096 * 3 + 4000, 200), (size - 4097, 2)] {
        let bytes = random(len);
        image.write(offset, &bytes).await.unwrap();
        model.write(offset, &bytes);
    }
    image.close().await.unwrap();
    model.check(
        &scratch.independent_read(path, kind),
        &format!("{kind:?}: qemu's read after ivdisk patched the other tool's sectors"),
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn luks1_file_qemu_writes_ivdisk_reads() {
    let scratch = Scratch::new();
    let data = 8 * MIB;
    let path = scratch.luks_format("vol.img", Kind::Luks1, data, &[]);
    let mut plain = random(data as usize);
    plain[(2 * MIB) as usize..(3 * MIB) as usize].fill(0); // zeros written by qemu
    scratch.qemu_write_all(&path, &plain);
    // qemu's own sub-sector write.
    scratch.qemu_io(&path, "write -P 0xab 1000 3000");
    plain[1000..4000].fill(0xab);
    let mut model = Model::all_known(plain, 512);
    patch_and_check(&scratch, &path, Kind::Luks1, &mut model).await;
}

/// `cryptsetup reencrypt --encrypt` turns a plaintext file into a LUKS2 volume (cryptsetup
/// encrypts every sector); ivdisk reads the plaintext, patches it, the chain reads it back.
async fn cryptsetup_encrypts_ivdisk_reads(sector: u32) {
    let kind = Kind::Luks2 { sector };
    let scratch = Scratch::new();
    let path = scratch.path("encrypted.img");
    // cryptsetup keeps the first (file size - reduction) bytes: the header goes in front.
    let kept = 8 * MIB;
    let mut plain = random(kept as usize);
    plain[MIB as usize..(MIB + 64 * 1024) as usize].fill(0);
    let mut file = plain.clone();
    file.resize((kept + 32 * MIB) as usize, 0);
    fs::write(&path, &file).unwrap();
    let sector_arg = sector.to_string();
    let mut args = vec![
        "reencrypt",
        "--batch-mode",
        "--encrypt",
        "--type",
        "luks2",
        "--sector-size",
        &sector_arg,
        "--reduce-device-size",
        "32M",
        "--key-file",
        scratch.key(),
    ];
    args.extend(FAST_PBKDF);
    args.push(s(&path));
    run_ok("cryptsetup", &args);

    let image = Image::open(&scratch.uri(&path), PASS, &OpenOptions::read_only())
        .await
        .unwrap();
    assert_eq!(image.size(), kept + 32 * MIB - 16 * MIB);
    image.close().await.unwrap();
    let mut model = Model::all_known(plain, sector as u64);
    patch_and_check(&scratch, &path, kind, &mut model).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn luks2_file_512_cryptsetup_writes_ivdisk_reads() {
    cryptsetup_encrypts_ivdisk_reads(512).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn luks2_file_4096_cryptsetup_writes_ivdisk_reads() {
    cryptsetup_encrypts_ivdisk_reads(4096).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn wrong_passphrase_is_a_header_error_and_touches_nothing() {
    let scratch = Scratch::new();
    let path = scratch.luks_format("vol.img", Kind::Luks2 { sector: 4096 }, 4 * MIB, &[]);
    let before = fs::read(&path).unwrap();
    let uri = scratch.uri(&path);
    for options in [OpenOptions::default(), OpenOptions::read_only()] {
        let err = Image::open(&uri, b"not the passphrase", &options)
            .await
            .unwrap_err();
        assert!(matches!(err, ImageError::Header { .. }), "{err}");
    }
    assert!(fs::read(&path).unwrap() == before, "the file changed");
    // No lock was left behind.
    open_rw(&uri).await.close().await.unwrap();
}

/// A detached header (`luksFormat --header`) has its data on another device: opened as a
/// volume it would have made the header's own bytes the disk, and a write at LBA 0 would have
/// overwritten its keyslots.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_detached_header_is_not_opened_as_a_volume() {
    let scratch = Scratch::new();
    for (name, kind) in [("luks2.hdr", "luks2"), ("luks1.hdr", "luks1")] {
        let header = scratch.path(name);
        let data = scratch.path(&format!("{name}.data"));
        fs::File::create(&data).unwrap().set_len(8 * MIB).unwrap();
        let mut args = vec!["luksFormat", "--batch-mode", "--key-file", scratch.key()];
        args.extend(["--type", kind, "--header", s(&header)]);
        if kind == "luks1" {
            args.extend(["--pbkdf-force-iterations", "1000"]);
        } else {
            args.extend(FAST_PBKDF);
        }
        args.push(s(&data));
        run_ok("cryptsetup", &args);
        let before = fs::read(&header).unwrap();
        let uri = scratch.uri(&header);
        for err in [
            Image::open(&uri, PASS, &OpenOptions::default())
                .await
                .unwrap_err(),
            Image::open(&uri, PASS, &OpenOptions::read_only())
                .await
                .unwrap_err(),
            Image::info(&uri).await.unwrap_err(),
        ] {
            let text = err.to_string();
            assert!(matches!(err, ImageError::InvalidParameter { .. }), "{text}");
            assert!(text.contains("detached LUKS header"), "{name}: {text}");
        }
        assert!(fs::read(&header).unwrap() == before, "{name} changed");
        // cryptsetup still reads it as the header it is.
        run_ok("cryptsetup", &["luksDump", s(&header)]);
    }
}

/// A LUKS file has no snapshots: opened "at" one it is refused, where it opened the head,
/// writable (a snapshot open promises read-only and never head data).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_luks_file_does_not_open_at_a_snapshot() {
    let scratch = Scratch::new();
    let path = scratch.luks_format("vol.img", Kind::Luks2 { sector: 512 }, 4 * MIB, &[]);
    let uri = scratch.uri(&path);
    for base in [OpenOptions::default(), OpenOptions::read_only()] {
        let options = OpenOptions {
            snapshot: Some("x".into()),
            ..base
        };
        let err = Image::open(&uri, PASS, &options).await.unwrap_err();
        let text = err.to_string();
        assert!(matches!(err, ImageError::InvalidParameter { .. }), "{text}");
        assert!(text.contains("no snapshots"), "{text}");
    }
}

/// A LUKS file cut short while open (by another program) fails the reads, where the part
/// cut off read as unwritten sectors: zeros, which a convert copied and verified.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_luks_file_cut_short_while_open_fails_reads() {
    let scratch = Scratch::new();
    let kind = Kind::Luks2 { sector: 4096 };
    let path = scratch.luks_format("vol.img", kind, 4 * MIB, &[]);
    let uri = scratch.uri(&path);
    let image = open_rw(&uri).await;
    image.write(0, &random(4 * MIB as usize)).await.unwrap();
    image.flush().await.unwrap();
    let reader = Image::open(&uri, PASS, &OpenOptions::read_only())
        .await
        .unwrap();
    image.close().await.unwrap();
    fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(kind.data_offset() + MIB)
        .unwrap();
    let mut tail = vec![0u8; MIB as usize];
    let err = reader.read(3 * MIB, &mut tail).await.unwrap_err();
    assert!(err.to_string().contains("cut short"), "{err}");
}

/// A write at the end of a LUKS file cut short while open fails too: written, it grew the file
/// back over a hole, and the part cut off then read as zeros without an error.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_write_to_a_luks_file_cut_short_while_open_fails_and_leaves_it_short() {
    let scratch = Scratch::new();
    let kind = Kind::Luks2 { sector: 4096 };
    let path = scratch.luks_format("vol.img", kind, 4 * MIB, &[]);
    let uri = scratch.uri(&path);
    let image = open_rw(&uri).await;
    image.write(0, &random(4 * MIB as usize)).await.unwrap();
    image.flush().await.unwrap();
    let cut = kind.data_offset() + MIB;
    fs::OpenOptions::new()
        .write(true)
        .open(&path)
        .unwrap()
        .set_len(cut)
        .unwrap();
    // A guest rewriting its backup GPT: whole sectors at the end of the disk.
    let err = image.write(4 * MIB - 4096, &[1; 4096]).await.unwrap_err();
    assert!(err.to_string().contains("cut short"), "{err}");
    assert_eq!(
        fs::metadata(&path).unwrap().len(),
        cut,
        "the write grew the file"
    );
    let mut middle = vec![0u8; MIB as usize];
    let err = image.read(MIB, &mut middle).await.unwrap_err();
    assert!(err.to_string().contains("cut short"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn other_ciphers_are_refused_clearly() {
    let scratch = Scratch::new();
    let path = scratch.luks_format(
        "cbc.img",
        Kind::Luks2 { sector: 512 },
        4 * MIB,
        &["--cipher", "aes-cbc-essiv:sha256", "--key-size", "256"],
    );
    let uri = scratch.uri(&path);
    let before = fs::read(&path).unwrap();
    let err = Image::open(&uri, PASS, &OpenOptions::default())
        .await
        .unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, ImageError::InvalidParameter { .. }), "{text}");
    assert!(
        text.contains("aes-cbc-essiv:sha256") && text.contains("aes-xts-plain64"),
        "{text}"
    );
    assert!(Image::info(&uri)
        .await
        .unwrap_err()
        .to_string()
        .contains("aes-cbc-essiv"));
    assert!(fs::read(&path).unwrap() == before, "the file changed");
}

/// A reencryption cryptsetup started and did not finish leaves a header whose segments are
/// not a plain volume's: the refusal says what it is and how to finish it (not which JSON
/// field the parser missed), changes nothing, and the command it names makes the file open.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unfinished_cryptsetup_reencryption_is_named_with_the_command_that_finishes_it() {
    let scratch = Scratch::new();
    let path = scratch.luks_format("vol.img", Kind::Luks2 { sector: 4096 }, 4 * MIB, &[]);
    let mut init = vec!["reencrypt", "--init-only", "--batch-mode", "--key-file"];
    init.push(scratch.key());
    init.extend(FAST_PBKDF);
    init.push(s(&path));
    run_ok("cryptsetup", &init);
    let uri = scratch.uri(&path);
    let before = fs::read(&path).unwrap();
    for options in [OpenOptions::default(), OpenOptions::read_only()] {
        let text = Image::open(&uri, PASS, &options)
            .await
            .unwrap_err()
            .to_string();
        assert!(
            text.contains("reencryption")
                && text.contains("online-reencrypt")
                && text.contains("--resume-only --force-offline-reencrypt")
                && !text.contains("missing field"),
            "{text}"
        );
    }
    let info = Image::info(&uri).await.unwrap_err().to_string();
    assert!(info.contains("--resume-only"), "{info}");
    assert!(fs::read(&path).unwrap() == before, "the file changed");
    // The advice as given.
    let mut finish = vec!["reencrypt", "--resume-only", "--force-offline-reencrypt"];
    finish.extend(["--batch-mode", "--key-file", scratch.key(), s(&path)]);
    run_ok("cryptsetup", &finish);
    open_rw(&uri).await.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_regular_file_without_luks_magic_is_named_in_the_error() {
    let scratch = Scratch::new();
    let path = scratch.path("plain.bin");
    fs::write(&path, random(64 * 1024)).unwrap();
    let uri = scratch.uri(&path);
    for err in [
        Image::open(&uri, PASS, &OpenOptions::read_only())
            .await
            .unwrap_err(),
        Image::info(&uri).await.unwrap_err(),
    ] {
        let text = err.to_string();
        assert!(matches!(err, ImageError::InvalidParameter { .. }), "{text}");
        assert!(text.contains(s(&path)) && text.contains("LUKS"), "{text}");
    }
    // An empty file too.
    let empty = scratch.path("empty.bin");
    fs::write(&empty, b"").unwrap();
    let text = Image::open(&scratch.uri(&empty), PASS, &OpenOptions::read_only())
        .await
        .unwrap_err()
        .to_string();
    assert!(text.contains(s(&empty)) && text.contains("LUKS"), "{text}");
}

struct KillOnDrop(Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_writer_per_file_across_processes() {
    let scratch = Scratch::new();
    let path = scratch.luks_format("vol.img", Kind::Luks1, 4 * MIB, &[]);
    let uri = scratch.uri(&path);

    // Within this process: the second writer is refused, readers are fine.
    let writer = open_rw(&uri).await;
    let err = Image::open(&uri, PASS, &OpenOptions::default())
        .await
        .unwrap_err();
    assert!(matches!(err, ImageError::Locked { .. }), "{err}");
    let reader = Image::open(&uri, PASS, &OpenOptions::read_only())
        .await
        .unwrap();
    writer.write(0, b"first writer").await.unwrap();
    let mut buf = [0u8; 12];
    reader.read(0, &mut buf).await.unwrap();
    assert_eq!(&buf, b"first writer");
    reader.close().await.unwrap();
    writer.close().await.unwrap();

    // Another process holding the flock (util-linux flock(1); `-o`: the lock stays with
    // flock itself, not with the `sleep` it runs) keeps ivdisk from writing.
    let child = Command::new("flock")
        .args(["-o", s(&path), "sleep", "60"])
        .spawn()
        .unwrap_or_else(|e| panic!("flock could not be run ({e}): {}", hint("flock")));
    let child = KillOnDrop(child);
    let pid = child.0.id();
    let mut refused = None;
    for _ in 0..100 {
        match Image::open(&uri, PASS, &OpenOptions::default()).await {
            Ok(image) => {
                image.close().await.unwrap();
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            Err(e) => {
                refused = Some(e);
                break;
            }
        }
    }
    let err = refused.expect("the writer was never refused while flock(1) held the file");
    let text = err.to_string();
    assert!(matches!(err, ImageError::Locked { .. }), "{text}");
    assert!(text.contains(&format!("process {pid}")), "{text}");
    // `ivdisk lock break` refuses a LUKS file: the advice is to stop the holder.
    assert!(
        text.contains("flock") && !text.contains("lock break"),
        "{text}"
    );
    Image::open(&uri, PASS, &OpenOptions::read_only())
        .await
        .unwrap()
        .close()
        .await
        .unwrap();
    drop(child);
    open_rw(&uri).await.close().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resize_and_out_of_range_are_refused() {
    let scratch = Scratch::new();
    let path = scratch.luks_format("vol.img", Kind::Luks2 { sector: 4096 }, 4 * MIB, &[]);
    let len = fs::metadata(&path).unwrap().len();
    let image = open_rw(&scratch.uri(&path)).await;
    let err = image.resize(8 * MIB, false).await.unwrap_err();
    assert!(err.to_string().contains("cryptsetup"), "{err}");
    let err = image.write(4 * MIB - 10, &[1u8; 20]).await.unwrap_err();
    assert!(matches!(err, ImageError::OutOfRange { .. }), "{err}");
    image.write(4 * MIB - 10, &[1u8; 10]).await.unwrap();
    image.close().await.unwrap();
    assert_eq!(
        fs::metadata(&path).unwrap().len(),
        len,
        "the file did not grow"
    );
    let image = Image::open(&scratch.uri(&path), PASS, &OpenOptions::read_only())
        .await
        .unwrap();
    let err = image.write(0, b"x").await.unwrap_err();
    assert!(matches!(err, ImageError::ReadOnly { .. }), "{err}");
    image.close().await.unwrap();
}

/// A LUKS file's objects are slices of it, which cannot be listed: a range over more objects
/// than an NBD request covers (where images use a listing) is mapped by stats, all data.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_luks_file_is_mapped_as_data() {
    let scratch = Scratch::new();
    let data = 5 << 30;
    let path = scratch.luks_format("vol.img", Kind::Luks2 { sector: 4096 }, data, &[]);
    let image = Image::open(&scratch.uri(&path), PASS, &OpenOptions::read_only())
        .await
        .unwrap();
    assert_eq!(image.size(), data);
    let extents = image.allocation(0, data).await.unwrap();
    assert_eq!(
        extents,
        [ivdisk_image::AllocationExtent {
            offset: 0,
            len: data,
            allocated: true
        }]
    );
    image.close().await.unwrap();
}
