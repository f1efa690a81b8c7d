//! `ivdisk convert SRC DST` as a user runs it: the built binary, passphrase and key files,
//! exit codes and messages. Sources are made by the real tools: sparse raw files, LUKS1/LUKS2
//! files from `cryptsetup luksFormat` filled by qemu's LUKS driver (LUKS1) or by qemu-img
//! through `ivdisk serve` (LUKS2; qemu 7.2 has no LUKS2 driver), ivdisk images, and a librbd
//! LUKS2 image from `rbd create` + `rbd encryption format` filled by qemu's rbd driver. The
//! judge of every conversion is `ivdisk export` of the new image against the source's
//! plaintext, byte for byte.
//!
//! The rbd test needs a Ceph cluster, found as crates/ivdisk/tests/nbd_rbd.rs finds it
//! (`CEPH_CONF`, `IVDISK_RADOS_POOL`, default `rbd`; `IVDISK_NO_CEPH=1` skips it loudly, and
//! without either it fails saying how to start one).

mod common;

use std::fs;
use std::io::{BufRead, BufReader};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use common::{fails, ivdisk, json, ok, p, random, Fixture, FAST};
use ivdisk_image::{Image, ImageUri, OpenOptions};
use ivdisk_store::ObjectStoreExt;
use serde_json::Value;

const MIB: u64 = 1 << 20;
const KIB: u64 = 1 << 10;
/// The passphrase of the LUKS and rbd sources, in a key file without a newline:
/// cryptsetup's `--key-file`, qemu's `secret,file=`, `rbd encryption format` and ivdisk's
/// `--key-file` all read exactly these bytes.
const KEY: &[u8] = b"correct horse battery staple";

/// `size` bytes: zeros, with random bytes in the runs `(offset, len)`.
fn content(size: u64, runs: &[(u64, u64)], seed: u64) -> Vec<u8> {
    let mut bytes = vec![0u8; size as usize];
    for (i, &(offset, len)) in runs.iter().enumerate() {
        bytes[offset as usize..(offset + len) as usize]
            .copy_from_slice(&random(len as usize, seed + i as u64));
    }
    bytes
}

/// `got` equals `want`; on failure, the first differing byte (not megabytes of output).
fn assert_same(got: &[u8], want: &[u8], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths differ");
    if let Some(at) = got.iter().zip(want).position(|(a, b)| a != b) {
        panic!(
            "{what}: byte {at} differs (got {:#04x}, expected {:#04x})",
            got[at], want[at]
        );
    }
}

/// The installed program (also looked for in the sbin directories, where cryptsetup lives
/// and which a user's PATH may lack); a missing one fails the test naming its package.
fn program(name: &str) -> PathBuf {
    use std::os::unix::fs::PermissionsExt;
    let path = std::env::var_os("PATH").unwrap_or_default();
    std::env::split_paths(&path)
        .chain(["/usr/sbin", "/sbin"].map(PathBuf::from))
        .map(|dir| dir.join(name))
        .find(|p| fs::metadata(p).is_ok_and(|m| m.is_file() && m.permissions().mode() & 0o111 != 0))
        .unwrap_or_else(|| {
            let package = match name {
                "cryptsetup" => "cryptsetup-bin",
                "qemu-img" => "qemu-utils qemu-block-extra",
                "rbd" => "ceph-common",
                _ => "see scripts/install-deps.sh",
            };
            panic!(
                "`{name}` is needed by this test and is not installed: apt-get install {package} \
                 (scripts/install-deps.sh installs every tool the tests use)"
            )
        })
}

/// Run a tool that must succeed; its stdout.
fn tool(name: &str, args: &[&str]) -> String {
    let out = Command::new(program(name))
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{name} {args:?} failed ({}): {}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// `ivdisk convert SRC DST ARGS.. --json` that must succeed: its report and its stderr.
fn convert(src: &str, dst: &Path, extra: &[&str]) -> (Value, String) {
    let mut args = vec!["convert", src, p(dst)];
    args.extend(FAST);
    args.extend(extra);
    args.push("--json");
    let out = ivdisk(&args);
    let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "ivdisk {args:?}: {stderr}");
    let report: Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("ivdisk {args:?}: not JSON ({e}): {:?}", out.stdout));
    assert_eq!(report["verified"], true, "{report}");
    assert_eq!(
        report["bytes_written"].as_u64().unwrap() + report["bytes_skipped"].as_u64().unwrap(),
        report["size"].as_u64().unwrap(),
        "every byte is either written or skipped: {report}"
    );
    (report, stderr)
}

/// `ivdisk export IMAGE` with `secret` (e.g. ["--key-file", KEYFILE]): the plaintext.
fn export(f: &Fixture, image: &Path, secret: &[&str]) -> Vec<u8> {
    let out = f.path("export.raw");
    let _ = fs::remove_file(&out);
    let mut args = vec!["export", p(image), p(&out)];
    args.extend(secret);
    ok(&args);
    fs::read(&out).unwrap()
}

fn info(image: &Path) -> Value {
    json(&["info", p(image)])
}

/// The fixture's key file (no newline).
fn key_file(f: &Fixture) -> PathBuf {
    f.file("key", KEY)
}

// ---------------------------------------------------------------------------------------------
// LUKS files

#[derive(Debug, Clone, Copy)]
enum Luks {
    V1,
    V2 { sector: u32 },
}

impl Luks {
    /// cryptsetup's default data offsets for small files.
    fn data_offset(self) -> u64 {
        match self {
            Luks::V1 => 2 * MIB,
            Luks::V2 { .. } => 16 * MIB,
        }
    }
}

/// `cryptsetup luksFormat` of a new sparse file with `data` bytes after the header.
fn luks_format(f: &Fixture, name: &str, kind: Luks, data: u64) -> PathBuf {
    let path = f.path(name);
    fs::File::create(&path)
        .unwrap()
        .set_len(kind.data_offset() + data)
        .unwrap();
    let key = key_file(f);
    let sector;
    let mut args = vec!["luksFormat", "--batch-mode", "--key-file", p(&key)];
    match kind {
        Luks::V1 => args.extend(["--type", "luks1", "--pbkdf-force-iterations", "1000"]),
        Luks::V2 { sector: s } => {
            sector = s.to_string();
            args.extend(["--type", "luks2", "--sector-size", &sector]);
            args.extend(FAST);
        }
    }
    args.push(p(&path));
    tool("cryptsetup", &args);
    path
}

/// Write `plain` over the whole data area of a LUKS1 file with qemu's LUKS driver, zeros
/// included as data (`-S 0`: never-written sectors of a LUKS file are ciphertext zeros, which
/// ivdisk reads as zeros and qemu as noise).
fn qemu_write_luks1(f: &Fixture, path: &Path, plain: &[u8]) {
    let src = f.file("qemu-in.raw", plain);
    tool(
        "qemu-img",
        &[
            "convert",
            "-n",
            "-S",
            "0",
            "--object",
            &format!("secret,id=sec0,file={}", p(&key_file(f))),
            "-f",
            "raw",
            p(&src),
            "--target-image-opts",
            &format!("driver=luks,key-secret=sec0,file.filename={}", p(path)),
        ],
    );
}

/// Write `plain` over the whole data area of a LUKS file through `ivdisk serve`, with qemu-img
/// on the NBD export (zeros included as data), then stop the server with SIGTERM.
fn serve_write(f: &Fixture, path: &Path, plain: &[u8]) {
    let src = f.file("nbd-in.raw", plain);
    let socket = f.path("nbd.sock");
    let mut child = Command::new(env!("CARGO_BIN_EXE_ivdisk"))
        .args(["serve", p(path), "--socket", p(&socket), "--json"])
        .args(["--key-file", p(&key_file(f))])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let mut line = String::new();
        let _ = BufReader::new(stdout).read_line(&mut line);
        let _ = tx.send(line);
    });
    let line = rx.recv_timeout(Duration::from_secs(60)).unwrap_or_default();
    let ready: Value = match serde_json::from_str(&line) {
        Ok(ready) => ready,
        Err(e) => {
            let _ = child.kill();
            let _ = child.wait();
            panic!(
                "ivdisk serve {} gave no ready line ({e}): {line:?}",
                p(path)
            );
        }
    };
    let uri = ready["uri"].as_str().unwrap().to_owned();
    let written = Command::new(program("qemu-img"))
        .args([
            "convert",
            "-n",
            "-S",
            "0",
            "-f",
            "raw",
            p(&src),
            "-O",
            "raw",
        ])
        .arg(&uri)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let pid = libc::pid_t::try_from(child.id()).unwrap();
    // SAFETY: kill(2) on our own child, not yet waited for (its pid cannot be reused).
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    let deadline = Instant::now() + Duration::from_secs(60);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("ivdisk serve did not stop within 60 s of SIGTERM");
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(
        written.status.success(),
        "qemu-img into {uri}: {}",
        String::from_utf8_lossy(&written.stderr)
    );
    assert!(
        status.success(),
        "ivdisk serve exited {status} after SIGTERM"
    );
}

/// A LUKS file with `plain` in it becomes an image with the default suite whose export is
/// `plain`, unlocked with the LUKS passphrase.
fn luks_file_converts(kind: Luks, plain: &[u8], write: fn(&Fixture, &Path, &[u8])) {
    let f = Fixture::new();
    let luks = luks_format(&f, "luks.img", kind, plain.len() as u64);
    write(&f, &luks, plain);
    // `info` of the file: no objects, no image id (it showed 4 MiB objects and an id of
    // zeros), and its format said.
    let shown = info(&luks);
    assert_eq!(shown["format"], "luks-file", "{shown}");
    assert!(
        shown["object_size"].is_null() && shown["image_id"].is_null(),
        "{shown}"
    );
    assert_eq!(shown["size"], plain.len() as u64, "{shown}");
    let text = tool(env!("CARGO_BIN_EXE_ivdisk"), &["info", p(&luks)]);
    assert!(
        text.contains("LUKS volume file")
            && !text
                .lines()
                .any(|l| l.starts_with("image id:") || l.starts_with("object size:")),
        "{text}"
    );
    let key = key_file(&f);
    // `import` copies its ciphertext, as it copies any file, and now says so.
    let imported = f.path("imported");
    let mut args = vec!["import", p(&luks), p(&imported), "--key-file", p(&key)];
    args.extend(FAST);
    let out = ivdisk(&args);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("volume: import copies its bytes as they are")
            && stderr.contains("convert"),
        "{stderr}"
    );
    let dst = f.path("converted");
    let (report, _) = convert(p(&luks), &dst, &["--key-file", p(&key)]);
    let expected_kind = match kind {
        Luks::V1 => "luks1-file",
        Luks::V2 { .. } => "luks2-file",
    };
    assert_eq!(report["source_kind"], expected_kind, "{report}");
    assert_eq!(report["size"], plain.len() as u64, "{report}");
    assert_eq!(report["cipher"], "aegis128l-random", "{report}");
    let shown = info(&dst);
    assert_eq!(shown["cipher"], "aegis128l-random", "{shown}");
    assert_eq!(shown["layout"], "omap-packed", "{shown}");
    // The zero runs were encrypted by the other tool, but are zeros in plaintext: the 4 MiB
    // chunk of them was not written.
    assert!(
        report["bytes_written"].as_u64().unwrap() <= plain.len() as u64 - 4 * MIB,
        "{report}"
    );
    // The LUKS passphrase protects the new image.
    assert_same(
        &export(&f, &dst, &["--key-file", p(&key)]),
        plain,
        &format!("{kind:?}: the converted image's plaintext"),
    );
    // The source is unchanged: it still converts to the same.
    let again = f.path("again");
    convert(p(&luks), &again, &["--key-file", p(&key)]);
    assert_same(
        &export(&f, &again, &["--key-file", p(&key)]),
        plain,
        &format!("{kind:?}: a second conversion"),
    );
}

#[test]
fn luks2_file_of_cryptsetup_converts_to_the_default_suite() {
    // 12 MiB: the middle 4 MiB (one chunk of the new image's 4 MiB objects) all zeros.
    let size = 12 * MIB;
    let plain = content(
        size,
        &[(0, MIB), (3 * MIB + 100, 200 * KIB), (size - 4096, 4096)],
        11,
    );
    luks_file_converts(Luks::V2 { sector: 4096 }, &plain, serve_write);
}

/// A LUKS2 file whose primary header is damaged (its first bytes overwritten) still reads
/// from its secondary header, as `ivdisk serve` and cryptsetup read it: convert unlocks it.
/// Taken for a raw disk (no magic at byte 0), its ciphertext was copied as the data, and
/// "verified".
#[test]
fn a_luks2_file_with_a_damaged_primary_header_converts_from_the_secondary() {
    let f = Fixture::new();
    let plain = content(4 * MIB, &[(0, MIB), (3 * MIB, 4096)], 12);
    let luks = luks_format(
        &f,
        "luks.img",
        Luks::V2 { sector: 4096 },
        plain.len() as u64,
    );
    serve_write(&f, &luks, &plain);
    let file = fs::OpenOptions::new().write(true).open(&luks).unwrap();
    std::os::unix::fs::FileExt::write_all_at(&file, &[0u8; 4096], 0).unwrap();
    drop(file);
    let key = key_file(&f);
    let dst = f.path("converted");
    let (report, stderr) = convert(p(&luks), &dst, &["--key-file", p(&key)]);
    assert_eq!(report["source_kind"], "luks2-file", "{report} {stderr}");
    assert_same(
        &export(&f, &dst, &["--key-file", p(&key)]),
        &plain,
        "the plaintext, not the ciphertext",
    );

    // `verify` and `info` tell of the damaged copy (verify said "ok", exit 0, and only a
    // log line spoke of it); a passphrase change rewrites both copies, and then all is well.
    let said = "the primary LUKS2 header is damaged";
    let (out, _) = common::exits(1, &["verify", p(&luks), "--key-file", p(&key), "--json"]);
    let report: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(report["ok"], false, "{report}");
    assert!(
        report["header_warning"].as_str().unwrap().contains(said),
        "{report}"
    );
    assert!(info(&luks)["header_warning"]
        .as_str()
        .unwrap()
        .contains(said));
    let mut change = vec!["passphrase", "change", p(&luks), "--key-file", p(&key)];
    change.extend(["--new-key-file", p(&key)]);
    change.extend(FAST);
    ok(&change);
    let report = json(&["verify", p(&luks), "--key-file", p(&key)]);
    assert_eq!(report["ok"], true, "{report}");
    assert!(report["header_warning"].is_null(), "{report}");
}

#[test]
fn luks1_file_of_cryptsetup_converts_to_the_default_suite() {
    let size = 12 * MIB;
    let plain = content(
        size,
        &[(512, 700 * KIB), (4 * MIB - 1024, 1024), (size - 512, 512)],
        21,
    );
    luks_file_converts(Luks::V1, &plain, qemu_write_luks1);
}

// ---------------------------------------------------------------------------------------------
// Raw files and ivdisk images

/// A sparse raw file of 6 MiB + 1000 bytes (not a multiple of the sector size): data runs,
/// a MiB of zeros written as data, holes elsewhere. Returns the file and its bytes.
fn sparse_raw(f: &Fixture, name: &str, seed: u64) -> (PathBuf, Vec<u8>) {
    let size = 6 * MIB + 1000;
    let runs = [(0, 100 * KIB), (3 * MIB + 5, 70_000), (size - 3000, 3000)];
    let bytes = content(size, &runs, seed);
    let path = f.path(name);
    let file = fs::File::create(&path).unwrap();
    file.set_len(size).unwrap();
    for &(offset, len) in &runs {
        file.write_all_at(&bytes[offset as usize..(offset + len) as usize], offset)
            .unwrap();
    }
    file.write_all_at(&vec![0u8; MIB as usize], MIB).unwrap();
    (path, bytes)
}

/// How many 64 KiB chunks of `bytes` hold anything but zeros.
fn chunks_with_data(bytes: &[u8]) -> u64 {
    bytes
        .chunks(64 * KIB as usize)
        .filter(|c| c.iter().any(|&b| b != 0))
        .count() as u64
}

#[test]
fn raw_file_with_holes_converts_and_exports_byte_for_byte() {
    let f = Fixture::new();
    let (raw, bytes) = sparse_raw(&f, "disk.raw", 1);
    let dst = f.path("disk.ivd");
    let (report, stderr) = convert(
        p(&raw),
        &dst,
        &["--object-size", "64K", "--passphrase-file", p(&f.pw)],
    );
    // Read as unencrypted raw, said on stderr; the size rounded up to whole sectors, said too.
    assert!(
        stderr.contains("no LUKS header") && stderr.contains("unencrypted raw"),
        "{stderr}"
    );
    assert!(stderr.contains("rounded up"), "{stderr}");
    let size = (bytes.len() as u64).div_ceil(4096) * 4096;
    assert_eq!(report["source_kind"], "raw", "{report}");
    assert_eq!(report["source_size"], bytes.len() as u64, "{report}");
    assert_eq!(report["size"], size, "{report}");
    assert_eq!(report["source"], p(&raw), "{report}");
    assert_eq!(report["destination"], p(&dst), "{report}");
    assert!(report["seconds"].as_f64().unwrap() >= 0.0, "{report}");
    // Holes and the zeros written as data were skipped: at most the 64 KiB chunks holding
    // data were written, at least the data.
    let written = report["bytes_written"].as_u64().unwrap();
    let nonzero = bytes.iter().filter(|&&b| b != 0).count() as u64;
    assert!(
        written >= nonzero && written <= chunks_with_data(&bytes) * 64 * KIB,
        "{written} bytes written for {nonzero} bytes of data: {report}"
    );
    assert!(written < size / 4, "{report}");
    let shown = info(&dst);
    assert_eq!(shown["object_size"], 64 * KIB, "{shown}");

    let exported = export(&f, &dst, &["--passphrase-file", p(&f.pw)]);
    assert_eq!(exported.len() as u64, size);
    assert_same(
        &exported[..bytes.len()],
        &bytes,
        "the export of the raw file",
    );
    assert!(exported[bytes.len()..].iter().all(|&b| b == 0));

    // --source-format raw: the same, without the note.
    let dst2 = f.path("disk2.ivd");
    let (_, stderr) = convert(
        p(&raw),
        &dst2,
        &["--source-format", "raw", "--passphrase-file", p(&f.pw)],
    );
    assert!(!stderr.contains("no LUKS header"), "{stderr}");

    // A raw source needs a passphrase for the new image: with none and no terminal, refused
    // before anything is created.
    let dst3 = f.path("disk3.ivd");
    let err = fails(&["convert", p(&raw), p(&dst3)]);
    assert!(
        err.contains("--new-passphrase-file") && err.contains("not encrypted"),
        "{err}"
    );
    assert!(!dst3.exists());
}

#[test]
fn ivdisk_image_converts_to_aes_xts_omap_with_a_new_passphrase() {
    let f = Fixture::new();
    let (raw, bytes) = sparse_raw(&f, "disk.raw", 2);
    let src = f.path("src.ivd");
    convert(p(&raw), &src, &["--passphrase-file", p(&f.pw)]);
    let new_pw = f.file("new-pw", b"battery staple\n");
    let dst = f.path("dst.ivd");
    let (report, _) = convert(
        p(&src),
        &dst,
        &[
            "--cipher",
            "aes-xts-random",
            "--layout",
            "omap",
            "--object-size",
            "1M",
            "--passphrase-file",
            p(&f.pw),
            "--new-passphrase-file",
            p(&new_pw),
        ],
    );
    assert_eq!(report["source_kind"], "ivdisk", "{report}");
    assert_eq!(report["cipher"], "aes-xts-random", "{report}");
    assert_eq!(report["layout"], "omap", "{report}");
    let shown = info(&dst);
    assert_eq!(shown["cipher"], "aes-xts-random", "{shown}");
    assert_eq!(shown["layout"], "omap", "{shown}");
    assert_eq!(shown["object_size"], MIB, "{shown}");
    assert_ne!(shown["image_id"], info(&src)["image_id"]);

    // The old passphrase does not open the new image; the new one does.
    let out = f.path("old-pw.raw");
    let err = fails(&["export", p(&dst), p(&out), "--passphrase-file", p(&f.pw)]);
    assert!(err.contains("no keyslot matches"), "{err}");
    let exported = export(&f, &dst, &["--passphrase-file", p(&new_pw)]);
    assert_same(
        &exported[..bytes.len()],
        &bytes,
        "the export of the converted image",
    );
    assert!(exported[bytes.len()..].iter().all(|&b| b == 0));
    // The source still opens with its own passphrase.
    assert_same(
        &export(&f, &src, &["--passphrase-file", p(&f.pw)])[..bytes.len()],
        &bytes,
        "the source after the conversion",
    );
}

#[test]
fn an_existing_destination_needs_force() {
    let f = Fixture::new();
    let (one, one_bytes) = sparse_raw(&f, "one.raw", 3);
    let (two, two_bytes) = sparse_raw(&f, "two.raw", 4);
    let dst = f.path("dst.ivd");
    convert(p(&one), &dst, &["--passphrase-file", p(&f.pw)]);
    let id = info(&dst)["image_id"].clone();

    let mut args = vec!["convert", p(&two), p(&dst), "--passphrase-file", p(&f.pw)];
    args.extend(FAST);
    let err = fails(&args);
    assert!(
        err.contains("already exists") && err.contains("--force"),
        "{err}"
    );
    assert_eq!(info(&dst)["image_id"], id, "refused, yet the image changed");
    assert_same(
        &export(&f, &dst, &["--passphrase-file", p(&f.pw)])[..one_bytes.len()],
        &one_bytes,
        "the image a refused convert left alone",
    );

    convert(p(&two), &dst, &["--force", "--passphrase-file", p(&f.pw)]);
    assert_ne!(info(&dst)["image_id"], id, "--force makes a new image");
    assert_same(
        &export(&f, &dst, &["--passphrase-file", p(&f.pw)])[..two_bytes.len()],
        &two_bytes,
        "the image --force made",
    );

    // A file in DST's place is never deleted, --force or not.
    let file = f.file("plain-file", b"keep me");
    let mut args = vec!["convert", p(&one), p(&file), "--force"];
    args.extend(["--passphrase-file", p(&f.pw)]);
    let err = fails(&args);
    assert!(err.contains("not a directory"), "{err}");
    assert_eq!(fs::read(&file).unwrap(), b"keep me");
}

#[test]
fn a_wrong_passphrase_or_the_same_image_creates_nothing() {
    let f = Fixture::new();
    let (raw, _) = sparse_raw(&f, "disk.raw", 5);
    let src = f.path("src.ivd");
    convert(p(&raw), &src, &["--passphrase-file", p(&f.pw)]);
    let wrong = f.file("wrong", b"incorrect horse\n");
    let dst = f.path("dst.ivd");
    let err = fails(&["convert", p(&src), p(&dst), "--passphrase-file", p(&wrong)]);
    assert!(
        err.contains("no keyslot matches") && err.contains("was not created"),
        "{err}"
    );
    assert!(!dst.exists(), "a wrong passphrase left {} behind", p(&dst));

    // The same for a LUKS file.
    let luks = luks_format(&f, "luks.img", Luks::V2 { sector: 4096 }, MIB);
    let err = fails(&["convert", p(&luks), p(&dst), "--passphrase-file", p(&wrong)]);
    assert!(err.contains("no keyslot matches"), "{err}");
    assert!(!dst.exists());
    // A volume cryptsetup made from a file `echo` wrote has the newline in its passphrase;
    // --passphrase-file drops it, and the refusal says so.
    let echoed = f.file("echoed", b"typed with echo\n");
    let volume = f.path("echoed.img");
    fs::File::create(&volume)
        .unwrap()
        .set_len(17 * MIB)
        .unwrap();
    let mut args = vec!["luksFormat", "--batch-mode", "--key-file", p(&echoed)];
    args.extend(["--type", "luks2"]);
    args.extend(FAST);
    args.push(p(&volume));
    tool("cryptsetup", &args);
    let err = fails(&[
        "convert",
        p(&volume),
        p(&dst),
        "--passphrase-file",
        p(&echoed),
    ]);
    assert!(
        err.contains("no keyslot matches") && err.contains("pass --key-file FILE instead"),
        "{err}"
    );
    assert!(!dst.exists());
    convert(p(&volume), &dst, &["--key-file", p(&echoed)]);
    ok(&["delete", p(&dst), "--yes"]);

    // SRC == DST, also under another spelling of the path, and through a bind mount of it
    // (only the reader guard kept --force from deleting SRC there): refused, the image
    // unchanged.
    let id = info(&src)["image_id"].clone();
    let other_spelling = format!("{}/./src.ivd", f.dir.path().display());
    let bind = f.path("bind");
    std::fs::create_dir(&bind).unwrap();
    let mounted = std::process::Command::new("mount")
        .args(["--bind", p(&src), p(&bind)])
        .status()
        .unwrap();
    assert!(mounted.success(), "mount --bind (the tests run as root)");
    struct Unmount(PathBuf);
    impl Drop for Unmount {
        fn drop(&mut self) {
            let _ = std::process::Command::new("umount").arg(&self.0).status();
        }
    }
    let _unmount = Unmount(bind.clone());
    for same in [p(&src).to_owned(), other_spelling, p(&bind).to_owned()] {
        let err = fails(&[
            "convert",
            p(&src),
            &same,
            "--force",
            "--passphrase-file",
            p(&f.pw),
        ]);
        assert!(err.contains("same image"), "{err}");
    }
    assert_eq!(info(&src)["image_id"], id);

    // A file of DST's store as SRC: --force deleted DST, the file with it, and "verified"
    // the zeros left. Refused; and a DST inside another image's store too.
    let segment = std::fs::read_dir(src.join("data"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.file_name().unwrap().to_str().unwrap().starts_with("seg-"))
        .expect("a data segment");
    for inside in [src.join("meta.sqlite"), segment] {
        let err = fails(&[
            "convert",
            p(&inside),
            p(&src),
            "--source-format",
            "raw",
            "--force",
            "--passphrase-file",
            p(&f.pw),
        ]);
        assert!(err.contains("(a file of its store)"), "{err}");
    }
    assert_eq!(info(&src)["image_id"], id);
    let nested = src.join("data").join("nested");
    let err = fails(&[
        "convert",
        p(&luks),
        p(&nested),
        "--key-file",
        p(&key_file(&f)),
    ]);
    assert!(
        err.contains("the store directory of another image"),
        "{err}"
    );
    assert!(!nested.exists());
}

#[test]
fn a_failed_copy_deletes_the_half_made_destination() {
    let f = Fixture::new();
    let (raw, _) = sparse_raw(&f, "disk.raw", 6);
    let src = f.path("src.ivd");
    convert(
        p(&raw),
        &src,
        &["--object-size", "64K", "--passphrase-file", p(&f.pw)],
    );
    // Damage one byte of a data object of the source (aegis128l-random authenticates every
    // sector): reading it fails, after other chunks were copied.
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let uri = ImageUri::parse(p(&src)).unwrap();
        // Held open first so that the read-only image shares a store that takes writes.
        let _writable = uri.open_store(false).await.unwrap();
        let image = Image::open(&uri, b"correct horse", &OpenOptions::read_only())
            .await
            .unwrap();
        let object = image.data_object(48); // 3 MiB: the second data run
        let store = image.store();
        let mut byte = store.read(&object, 100, 1).await.unwrap();
        byte[0] ^= 0x40;
        store.write(&object, 100, &byte).await.unwrap();
        store.flush().await.unwrap();
        image.close().await.unwrap();
    });
    drop(rt);

    let dst = f.path("dst.ivd");
    let mut args = vec!["convert", p(&src), p(&dst), "--passphrase-file", p(&f.pw)];
    args.extend(FAST);
    let err = fails(&args);
    assert!(
        err.contains("integrity check failed") && err.contains("was deleted"),
        "{err}"
    );
    let out = ivdisk(&["info", p(&dst)]);
    assert!(!out.status.success(), "the half-made image is still there");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("does not exist"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn help_shows_examples() {
    let help = ok(&["convert", "--help"]);
    for words in [
        "Examples:",
        "ivdisk convert luks.img",
        "rbd://",
        "--source-format",
        "--new-passphrase-file",
        "--force",
        "rounded up",
        "aegis128l-random",
        "omap",
    ] {
        assert!(help.contains(words), "`{words}` missing from --help");
    }
}

// ---------------------------------------------------------------------------------------------
// librbd

/// The cluster's config file and pool, or `None` (skip) with IVDISK_NO_CEPH=1.
fn cluster() -> Option<(String, String)> {
    if std::env::var("IVDISK_NO_CEPH").as_deref() == Ok("1") {
        eprintln!("IVDISK_NO_CEPH=1: no Ceph cluster, the rbd:// convert test is SKIPPED");
        return None;
    }
    let conf = std::env::var("CEPH_CONF").unwrap_or_else(|_| {
        panic!(
            "the rbd:// convert test needs a Ceph cluster: run `eval \"$(scripts/ceph-dev-cluster \
             start)\"` (which exports CEPH_CONF), or set IVDISK_NO_CEPH=1 to skip it"
        )
    });
    let pool = std::env::var("IVDISK_RADOS_POOL").unwrap_or_else(|_| "rbd".into());
    Some((conf, pool))
}

/// A throwaway rbd image, removed when dropped (also when the test fails).
struct Rbd {
    conf: String,
    spec: String,
}

impl Drop for Rbd {
    fn drop(&mut self) {
        let _ = Command::new("rbd")
            .args(["--conf", &self.conf, "rm", "--no-progress", &self.spec])
            .output();
    }
}

#[test]
fn librbd_luks2_image_converts_to_an_ivdisk_image() {
    let Some((conf, pool)) = cluster() else {
        return;
    };
    let f = Fixture::new();
    let key = key_file(&f);
    let mut b = [0u8; 5];
    fs::File::open("/dev/urandom")
        .and_then(|mut r| std::io::Read::read_exact(&mut r, &mut b))
        .unwrap();
    let name = format!("ivdisk-convert-{}", hex::encode(b));
    let rbd = Rbd {
        conf: conf.clone(),
        spec: format!("{pool}/{name}"),
    };
    // No object-map/fast-diff: with fast-diff qemu 7.2's rbd driver takes the raw image's
    // holes for the encrypted ones (see crates/ivdisk-rbd/tests/common).
    tool(
        "rbd",
        &[
            "--conf",
            &conf,
            "create",
            "--size",
            "64M",
            "--image-feature",
            "layering,exclusive-lock,deep-flatten",
            &rbd.spec,
        ],
    );
    tool(
        "rbd",
        &[
            "--conf",
            &conf,
            "encryption",
            "format",
            &rbd.spec,
            "luks2",
            p(&key),
        ],
    );
    // 64 MiB less librbd's 16 MiB LUKS2 header region; written whole by qemu's rbd driver
    // with librbd's LUKS2 loaded.
    let size = 48 * MIB;
    let plain = content(
        size,
        &[(0, 2 * MIB), (10 * MIB + 4096, 3 * MIB), (size - MIB, MIB)],
        31,
    );
    let src = f.file("rbd-in.raw", &plain);
    tool(
        "qemu-img",
        &[
            "convert",
            "-n",
            "-S",
            "0",
            "--object",
            &format!("secret,id=sec0,file={}", p(&key)),
            "-f",
            "raw",
            p(&src),
            "--target-image-opts",
            &format!(
                "driver=rbd,pool={pool},image={name},conf={conf},encrypt.format=luks2,\
                 encrypt.key-secret=sec0"
            ),
        ],
    );

    let uri = format!("rbd://{pool}/{name}?conf={conf}");
    let dst = f.path("from-rbd.ivd");
    let (report, _) = convert(&uri, &dst, &["--key-file", p(&key)]);
    assert_eq!(report["source_kind"], "rbd-luks2", "{report}");
    assert_eq!(report["size"], size, "{report}");
    assert!(report["bytes_written"].as_u64().unwrap() < size, "{report}");
    assert_eq!(info(&dst)["cipher"], "aegis128l-random");
    assert_same(
        &export(&f, &dst, &["--key-file", p(&key)]),
        &plain,
        "the ivdisk image converted from librbd LUKS2",
    );
    drop(rbd);
}

/// The largest sparse image (2^63 - 4096 bytes, nothing written) converts and verifies in
/// moments. The verify cut every hole of the source into 4 MiB pieces up front: 2^41 of
/// them, and the process ran out of memory after the copy was made (which it left behind).
#[test]
fn the_largest_sparse_image_converts_and_verifies() {
    let f = Fixture::new();
    let size = ((i64::MAX as u64) / 4096 * 4096).to_string();
    let big = f.path("big");
    let mut args = vec![
        "create",
        p(&big),
        "--size",
        &size,
        "--passphrase-file",
        p(&f.pw),
    ];
    args.extend(FAST);
    ok(&args);
    let dst = f.path("dst");
    let out = Command::new("timeout")
        .arg("120")
        .arg(env!("CARGO_BIN_EXE_ivdisk"))
        .args([
            "convert",
            p(&big),
            p(&dst),
            "--passphrase-file",
            p(&f.pw),
            "--json",
        ])
        .args(FAST)
        .stdin(Stdio::null())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{:?}: {}",
        out.status,
        String::from_utf8_lossy(&out.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["verified"], true);
    assert_eq!(report["size"].as_u64().unwrap().to_string(), size);
    assert_eq!(report["bytes_written"], 0);
}
