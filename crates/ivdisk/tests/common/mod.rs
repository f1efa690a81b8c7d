//! What the CLI tests share: running the built binary with standard input closed (nothing may
//! prompt), checking its exit code, and a temporary directory with a passphrase file.
//! Each test binary uses a part of it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};

use serde_json::Value;

/// The cheapest keyslot: PBKDF2 at cryptsetup's minimum, no benchmark.
pub const FAST: [&str; 4] = ["--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"];

/// Set in the environment of a test binary re-run as a writer that dies holding the lock.
pub const DIE_HOLDING_LOCK: &str = "IVDISK_TEST_DIE_HOLDING_LOCK";

/// Runs with standard input closed (no terminal: nothing may prompt).
pub fn ivdisk(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ivdisk"))
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap()
}

/// Runs a command that must succeed; returns its stdout.
pub fn ok_bytes(args: &[&str]) -> Vec<u8> {
    let out = ivdisk(args);
    assert!(
        out.status.success(),
        "ivdisk {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out.stdout
}

pub fn ok(args: &[&str]) -> String {
    String::from_utf8(ok_bytes(args)).unwrap()
}

/// Runs a command that must exit with `code`; returns its stdout and stderr.
pub fn exits(code: i32, args: &[&str]) -> (String, String) {
    let out = ivdisk(args);
    assert_eq!(
        out.status.code(),
        Some(code),
        "ivdisk {args:?} should exit with {code}; stdout {} stderr {}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

/// Runs a command that must fail with exit code 1 (not a usage error); returns its stderr.
pub fn fails(args: &[&str]) -> String {
    exits(1, args).1
}

/// Runs a command with `--json` added; returns the parsed output.
pub fn json(args: &[&str]) -> Value {
    let mut args = args.to_vec();
    args.push("--json");
    let text = ok(&args);
    serde_json::from_str(&text).unwrap_or_else(|e| panic!("ivdisk {args:?}: {e}: {text}"))
}

pub fn p(path: &Path) -> &str {
    path.to_str().unwrap()
}

/// A temporary directory with a passphrase file.
pub struct Fixture {
    pub dir: tempfile::TempDir,
    /// A passphrase file as `echo` writes it: "correct horse\n".
    pub pw: PathBuf,
}

impl Fixture {
    pub fn new() -> Fixture {
        let dir = tempfile::tempdir().unwrap();
        let pw = dir.path().join("pw");
        std::fs::write(&pw, b"correct horse\n").unwrap();
        Fixture { dir, pw }
    }

    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    pub fn file(&self, name: &str, content: &[u8]) -> PathBuf {
        let path = self.path(name);
        std::fs::write(&path, content).unwrap();
        path
    }
}

/// Deterministic bytes (xorshift), so a failure reproduces.
pub fn random(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            (x >> 24) as u8
        })
        .collect()
}

/// A bare NBD client on a Unix socket, attached to the default export (fixed newstyle,
/// `NBD_OPT_GO`, no structured replies): for client behaviour no tool produces on demand (a
/// client that stalls mid-request) and to see the server's own answer to a write that qemu-io
/// and libnbd refuse before sending on a read-only export.
pub fn raw_nbd_attach(socket: &Path) -> std::os::unix::net::UnixStream {
    use std::io::{Read, Write};
    let mut stream = std::os::unix::net::UnixStream::connect(socket).unwrap();
    stream
        .set_read_timeout(Some(std::time::Duration::from_secs(30)))
        .unwrap();
    let mut greeting = [0u8; 18];
    stream.read_exact(&mut greeting).unwrap();
    assert_eq!(&greeting[..8], b"NBDMAGIC");
    // Client flags: FIXED_NEWSTYLE | NO_ZEROES.
    stream.write_all(&3u32.to_be_bytes()).unwrap();
    // NBD_OPT_GO (7): export name "" and no information requests.
    let mut option = Vec::new();
    option.extend_from_slice(&0x4948_4156_454F_5054u64.to_be_bytes());
    option.extend_from_slice(&7u32.to_be_bytes());
    option.extend_from_slice(&6u32.to_be_bytes());
    option.extend_from_slice(&0u32.to_be_bytes());
    option.extend_from_slice(&0u16.to_be_bytes());
    stream.write_all(&option).unwrap();
    loop {
        let mut header = [0u8; 20];
        stream.read_exact(&mut header).unwrap();
        let reply = u32::from_be_bytes(header[12..16].try_into().unwrap());
        let len = u32::from_be_bytes(header[16..20].try_into().unwrap());
        let mut payload = vec![0u8; len as usize];
        stream.read_exact(&mut payload).unwrap();
        assert_eq!(reply & 0x8000_0000, 0, "NBD_OPT_GO refused: {reply:#x}");
        if reply == 1 {
            return stream; // NBD_REP_ACK
        }
    }
}

/// `cryptsetup ARGS`, standard input closed.
pub fn cryptsetup(args: &[&str]) -> Output {
    Command::new("cryptsetup")
        .args(args)
        .stdin(Stdio::null())
        .output()
        .expect("cryptsetup must be installed (apt-get install cryptsetup-bin)")
}

/// A new 24 MiB LUKS2 file at `path` made by `cryptsetup luksFormat` (8 MiB of data after
/// its 16 MiB header), its keyslot 0 opened by `key` (the file's bytes, newline and all).
pub fn cryptsetup_luks2_file(path: &Path, key: &Path) {
    std::fs::File::create(path)
        .unwrap()
        .set_len(24 << 20)
        .unwrap();
    let out = cryptsetup(&[
        "luksFormat",
        "--batch-mode",
        "--type",
        "luks2",
        "--pbkdf",
        "pbkdf2",
        "--pbkdf-force-iterations",
        "1000",
        "--key-file",
        p(key),
        p(path),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}
