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
