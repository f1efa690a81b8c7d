//! Local images on a read-only directory, as a user meets them: the built binary on an image
//! whose store directory is a read-only bind mount (we run as root, for whom permission bits
//! stop no write; `mount --bind` then `mount -o remount,bind,ro`, unmounted at the end, also
//! on failure; where mounting is impossible the files are made immutable with `chattr -R +i`
//! instead). `info`, `header backup`, `export`, `verify` and `serve --read-only` work (the
//! export read back with `qemu-img convert`, a write through it answered with an error);
//! `serve` without `--read-only` fails saying to use it; no file of the directory changes.
//! And beside a running `ivdisk serve` of an image, the commands that only read work too
//! (they see what the server flushed).

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::os::unix::fs::MetadataExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

use serde_json::Value;

mod common;

use common::{fails, ivdisk, json, ok, p, random, Fixture, FAST};

/// 16 sectors of 4096 bytes per object.
const OBJECT: u64 = 64 << 10;

/// 8 objects, some random, some zeros (holes after import), and a partial 9th of 3 sectors.
fn raw_disk() -> Vec<u8> {
    let o = OBJECT as usize;
    let mut disk = vec![0u8; 8 * o + 12288];
    disk[..2 * o].copy_from_slice(&random(2 * o, 1));
    disk[5 * o..5 * o + 3000].copy_from_slice(&random(3000, 2));
    disk[8 * o..].copy_from_slice(&random(12288, 3));
    disk
}

/// `ivdisk import` of `content` into the new image `name` (64 KiB objects, a fast keyslot).
fn import(f: &Fixture, name: &str, content: &[u8]) -> PathBuf {
    let raw = f.file(&format!("{name}.raw"), content);
    let image = f.path(name);
    let mut args = vec!["import", p(&raw), p(&image), "--object-size", "64K"];
    args.extend(["--passphrase-file", p(&f.pw)]);
    args.extend(FAST);
    json(&args);
    image
}

fn assert_same(got: &[u8], want: &[u8], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    if let Some(at) = got.iter().zip(want).position(|(a, b)| a != b) {
        panic!("{what}: first difference at byte {at}");
    }
}

// ---------------------------------------------------------------------------------------------
// The directory as files, and a read-only view of it.

type DirState = BTreeMap<PathBuf, (u64, i64, i64, Vec<u8>)>;

/// Every file and directory under `dir`: size, mtime, contents.
fn dir_state(dir: &Path) -> DirState {
    fn walk(root: &Path, dir: &Path, out: &mut DirState) {
        for entry in std::fs::read_dir(dir).unwrap() {
            let path = entry.unwrap().path();
            let m = std::fs::symlink_metadata(&path).unwrap();
            let contents = match m.is_file() {
                true => std::fs::read(&path).unwrap(),
                false => Vec::new(),
            };
            let rel = path.strip_prefix(root).unwrap().to_owned();
            out.insert(rel, (m.size(), m.mtime(), m.mtime_nsec(), contents));
            if m.is_dir() {
                walk(root, &path, out);
            }
        }
    }
    let mut out = DirState::new();
    walk(dir, dir, &mut out);
    out
}

fn run(program: &str, args: &[&str]) -> bool {
    Command::new(program)
        .args(args)
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success())
}

/// `source` made read-only until dropped (also on panic): a read-only bind mount at `path`,
/// or, where mounting is impossible, `source` itself made immutable (`path` = `source`).
struct ReadOnlyDir {
    path: PathBuf,
    source: PathBuf,
    mounted: bool,
}

impl ReadOnlyDir {
    fn new(source: &Path, at: &Path) -> ReadOnlyDir {
        std::fs::create_dir_all(at).unwrap();
        let (s, a) = (p(source), p(at));
        if run("mount", &["--bind", s, a]) {
            let view = ReadOnlyDir {
                path: at.to_owned(),
                source: source.to_owned(),
                mounted: true,
            };
            if run("mount", &["-o", "remount,bind,ro", a]) {
                println!("read-only view: a read-only bind mount at {a}");
                assert!(std::fs::write(at.join("probe"), b"x").is_err());
                return view;
            }
        }
        assert!(
            run("chattr", &["-R", "+i", s]),
            "neither a read-only bind mount nor chattr +i works here"
        );
        println!("read-only view: {s} made immutable (chattr +i; no mount possible)");
        assert!(std::fs::write(source.join("probe"), b"x").is_err());
        ReadOnlyDir {
            path: source.to_owned(),
            source: source.to_owned(),
            mounted: false,
        }
    }
}

impl Drop for ReadOnlyDir {
    fn drop(&mut self) {
        if self.mounted {
            let at = p(&self.path);
            if !run("umount", &[at]) {
                run("umount", &["-l", at]);
            }
        } else {
            run("chattr", &["-R", "-i", p(&self.source)]);
        }
    }
}

// ---------------------------------------------------------------------------------------------
// `ivdisk serve`

/// A running `ivdisk serve --json` on a Unix socket; killed on drop unless stopped.
struct Server {
    child: Child,
    ready: Value,
    socket: PathBuf,
    stopped: bool,
}

impl Server {
    fn start(f: &Fixture, image: &Path, extra: &[&str]) -> Server {
        static STARTED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = STARTED.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let socket = f.path(&format!("nbd-{n}.sock"));
        let mut child = Command::new(env!("CARGO_BIN_EXE_ivdisk"))
            .arg("serve")
            .arg(image)
            .args([
                "--socket",
                p(&socket),
                "--passphrase-file",
                p(&f.pw),
                "--json",
            ])
            .args(extra)
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, lines) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                let _ = tx.send(line);
            }
        });
        let mut server = Server {
            child,
            ready: Value::Null,
            socket,
            stopped: false,
        };
        let line = match lines.recv_timeout(Duration::from_secs(60)) {
            Ok(line) => line,
            Err(_) => {
                let mut stderr = String::new();
                let _ = server.child.kill();
                let _ = server.child.wait();
                server.stopped = true;
                let _ = server
                    .child
                    .stderr
                    .take()
                    .unwrap()
                    .read_to_string(&mut stderr);
                panic!("ivdisk serve was not ready: {stderr}");
            }
        };
        server.ready = serde_json::from_str(&line).unwrap();
        server
    }

    fn uri(&self) -> &str {
        self.ready["uri"].as_str().unwrap()
    }

    /// SIGTERM; the server must exit 0.
    fn stop(mut self) {
        let pid = libc::pid_t::try_from(self.child.id()).unwrap();
        // SAFETY: kill(2) with a valid signal on our own child, not yet waited for (so its
        // pid cannot have been reused).
        assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
        let status = self.child.wait().unwrap();
        self.stopped = true;
        let mut stderr = String::new();
        let _ = self
            .child
            .stderr
            .take()
            .unwrap()
            .read_to_string(&mut stderr);
        assert!(status.success(), "serve exited with {status}: {stderr}");
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if !self.stopped {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

fn tool(name: &str, args: &[&str]) -> std::process::Output {
    Command::new(name)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| panic!("{name} (qemu-utils) is needed by this test: {e}"))
}

/// Send one request (with `payload` for a write); returns the simple reply's error and data.
fn request(
    stream: &mut UnixStream,
    command: u16,
    cookie: u64,
    offset: u64,
    length: u32,
    payload: &[u8],
) -> (u32, Vec<u8>) {
    let mut out = Vec::new();
    out.extend_from_slice(&0x2560_9513u32.to_be_bytes());
    out.extend_from_slice(&0u16.to_be_bytes());
    out.extend_from_slice(&command.to_be_bytes());
    out.extend_from_slice(&cookie.to_be_bytes());
    out.extend_from_slice(&offset.to_be_bytes());
    out.extend_from_slice(&length.to_be_bytes());
    out.extend_from_slice(payload);
    stream.write_all(&out).unwrap();
    let mut reply = [0u8; 16];
    stream.read_exact(&mut reply).unwrap();
    assert_eq!(&reply[..4], &0x6744_6698u32.to_be_bytes(), "a simple reply");
    assert_eq!(&reply[8..16], &cookie.to_be_bytes());
    let error = u32::from_be_bytes(reply[4..8].try_into().unwrap());
    let mut data = Vec::new();
    if command == 0 && error == 0 {
        data = vec![0u8; length as usize];
        stream.read_exact(&mut data).unwrap();
    }
    (error, data)
}

// ---------------------------------------------------------------------------------------------
// The tests.

#[test]
fn a_local_image_on_a_read_only_directory_is_read_exported_verified_and_served_read_only() {
    let f = Fixture::new();
    let disk = raw_disk();
    let image = import(&f, "disk", &disk);
    let before = dir_state(&image);
    let view = ReadOnlyDir::new(&image, &f.path("ro"));
    let ro = &view.path;

    // info (and the writer lock it shows), without a passphrase.
    let info = json(&["info", p(ro)]);
    assert_eq!(info["size"], disk.len() as u64, "{info}");
    assert!(info["lock"].is_null(), "{info}");
    let text = ok(&["info", p(ro)]);
    assert!(text.contains("writer lock"), "{text}");

    // header backup
    let backup = f.path("disk.header");
    ok(&["header", "backup", p(ro), p(&backup)]);
    assert!(std::fs::metadata(&backup).unwrap().len() > 0);

    // export
    let out = f.path("out.raw");
    ok(&["export", p(ro), p(&out), "--passphrase-file", p(&f.pw)]);
    assert_same(&std::fs::read(&out).unwrap(), &disk, "export");

    // verify
    let report = json(&["verify", p(ro), "--passphrase-file", p(&f.pw)]);
    assert_eq!(report["ok"], true, "{report}");

    // serve without --read-only: refused, saying what to do.
    let socket = f.path("refused.sock");
    let err = fails(&[
        "serve",
        p(ro),
        "--socket",
        p(&socket),
        "--passphrase-file",
        p(&f.pw),
    ]);
    assert!(err.contains("--read-only"), "{err}");
    assert!(err.contains("cannot be opened for writing"), "{err}");
    // A backup of the head (under the writer lock) and a delete: refused, with what works
    // (their hint was serve's "open it read-only").
    let err = fails(&["backup", p(ro), p(&f.path("head.ivdbak"))]);
    assert!(err.contains("back up one of its snapshots"), "{err}");
    assert!(!err.contains("--read-only"), "{err}");
    let err = fails(&["delete", p(ro), "--yes"]);
    assert!(err.contains("make it writable"), "{err}");
    assert!(!err.contains("--read-only"), "{err}");

    // serve --read-only, read back by qemu-img.
    let server = Server::start(&f, ro, &["--read-only"]);
    assert_eq!(server.ready["read_only"], true, "{}", server.ready);
    let served = f.path("served.raw");
    let converted = tool(
        "qemu-img",
        &[
            "convert",
            "-f",
            "raw",
            "-O",
            "raw",
            server.uri(),
            p(&served),
        ],
    );
    assert!(
        converted.status.success(),
        "qemu-img convert: {}",
        String::from_utf8_lossy(&converted.stderr)
    );
    assert_same(&std::fs::read(&served).unwrap(), &disk, "qemu-img convert");
    // A write gets an error reply (EPERM), and the connection goes on: the data is unchanged
    // and a flush is fine.
    let mut client = common::raw_nbd_attach(&server.socket);
    let (error, _) = request(&mut client, 1, 1, 0, 4096, &[0x55; 4096]);
    assert_eq!(error, libc::EPERM as u32, "a write on a read-only export");
    let (error, data) = request(&mut client, 0, 2, 0, 4096, &[]);
    assert_eq!(error, 0);
    assert_same(&data, &disk[..4096], "read after the refused write");
    let (error, _) = request(&mut client, 3, 3, 0, 0, &[]);
    assert_eq!(error, 0, "flush");
    drop(client);
    // qemu-io refuses to write too.
    let refused = tool(
        "qemu-io",
        &["-f", "raw", server.uri(), "-c", "write -P 0x22 0 4096"],
    );
    let text = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success(), "qemu-io wrote: {text}");
    assert!(
        text.contains("Permission denied") || text.contains("read-only"),
        "{text}"
    );
    server.stop();

    drop(view);
    let after = dir_state(&image);
    assert_eq!(
        before.keys().collect::<Vec<_>>(),
        after.keys().collect::<Vec<_>>()
    );
    assert!(before == after, "a file of the image's directory changed");
    // The image is still whole, and writable where the directory is.
    let out = f.path("out2.raw");
    ok(&["export", p(&image), p(&out), "--passphrase-file", p(&f.pw)]);
    assert_same(&std::fs::read(&out).unwrap(), &disk, "export after");
}

/// A cryptsetup LUKS file on a read-only directory: `serve` without `--read-only` says to use
/// it, as for a local store (it said only "Read-only file system"), and `serve --read-only`
/// serves it.
#[test]
fn a_luks_file_on_a_read_only_directory_is_served_read_only() {
    let f = Fixture::new();
    let dir = f.path("luks");
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("luks.img");
    // The passphrase of `f.pw` without its newline, which `--passphrase-file` leaves out.
    let key = f.file("luks.key", b"correct horse");
    common::cryptsetup_luks2_file(&file, &key);
    let view = ReadOnlyDir::new(&dir, &f.path("luks-ro"));
    let on_view = view.path.join("luks.img");
    let err = fails(&[
        "serve",
        p(&on_view),
        "--socket",
        p(&f.path("luks-refused.sock")),
        "--passphrase-file",
        p(&f.pw),
    ]);
    assert!(err.contains("cannot be opened for writing"), "{err}");
    assert!(err.contains("--read-only"), "{err}");
    let server = Server::start(&f, &on_view, &["--read-only"]);
    assert_eq!(server.ready["read_only"], true, "{}", server.ready);
    let info = tool("nbdinfo", &["--size", server.uri()]);
    assert!(
        info.status.success(),
        "nbdinfo: {}",
        String::from_utf8_lossy(&info.stderr)
    );
    let size: u64 = String::from_utf8_lossy(&info.stdout)
        .trim()
        .parse()
        .unwrap();
    assert_eq!(
        size,
        8 << 20,
        "served size: the file less LUKS2's 16 MiB header"
    );
    server.stop();
}

#[test]
fn reading_commands_work_beside_a_running_server() {
    let f = Fixture::new();
    let disk = raw_disk();
    let image = import(&f, "disk", &disk);
    let server = Server::start(&f, &image, &[]);
    assert_eq!(server.ready["read_only"], false);
    // Written and flushed through the server.
    let written = tool(
        "qemu-io",
        &[
            "-f",
            "raw",
            server.uri(),
            "-c",
            "write -P 0x11 4096 8192",
            "-c",
            "flush",
        ],
    );
    assert!(
        written.status.success(),
        "qemu-io: {}",
        String::from_utf8_lossy(&written.stderr)
    );
    let mut want = disk.clone();
    want[4096..12288].fill(0x11);

    let info = json(&["info", p(&image)]);
    assert!(info["lock"].is_object(), "the server's writer lock: {info}");
    let out = f.path("out.raw");
    ok(&["export", p(&image), p(&out), "--passphrase-file", p(&f.pw)]);
    assert_same(
        &std::fs::read(&out).unwrap(),
        &want,
        "export beside the server",
    );
    let report = json(&["verify", p(&image), "--passphrase-file", p(&f.pw)]);
    assert_eq!(report["ok"], true, "{report}");
    // A second writer is still refused.
    let other = f.path("other.sock");
    let out = ivdisk(&[
        "serve",
        p(&image),
        "--socket",
        p(&other),
        "--passphrase-file",
        p(&f.pw),
    ]);
    assert!(!out.status.success());
    server.stop();
}

/// qemu-img's copy of what `server` serves.
fn read_served(f: &Fixture, server: &Server, name: &str) -> Vec<u8> {
    let out = f.path(name);
    let converted = tool(
        "qemu-img",
        &["convert", "-f", "raw", "-O", "raw", server.uri(), p(&out)],
    );
    assert!(
        converted.status.success(),
        "qemu-img convert: {}",
        String::from_utf8_lossy(&converted.stderr)
    );
    std::fs::read(&out).unwrap()
}

/// A read-only open writes nothing to the store, so only its mark keeps what it reads: `snap
/// rm` of a served snapshot and `delete` of an image served read-only are refused, naming the
/// server's process, and the server goes on serving the data. A snapshot no one reads goes
/// meanwhile; once the server stops, the others go too.
#[test]
fn a_served_image_or_snapshot_is_not_removed_under_its_reader() {
    let f = Fixture::new();
    let disk = raw_disk();
    let image = import(&f, "disk", &disk);
    let at = |snap: &str| format!("{}@{snap}", p(&image));
    ok(&["snap", "create", &at("kept")]);
    ok(&["snap", "create", &at("other")]);

    let server = Server::start(&f, Path::new(&at("kept")), &[]);
    assert_eq!(server.ready["read_only"], true, "{}", server.ready);
    let pid = server.child.id();
    let err = fails(&["snap", "rm", &at("kept")]);
    // Which reader, by its command line: the snapshot's server (the hint named only
    // `serve --read-only`).
    assert!(
        err.contains(&format!("open read-only by process {pid} (")) && err.contains(&at("kept")),
        "{err}"
    );
    assert!(err.contains("nothing was changed"), "{err}");
    // With a writer serving the image, `snap rm` asks that server, which refuses too.
    let writer = Server::start(&f, &image, &[]);
    assert_eq!(writer.ready["read_only"], false, "{}", writer.ready);
    let err = fails(&["snap", "rm", &at("kept")]);
    assert!(
        err.contains(&format!("open read-only by process {pid}")),
        "{err}"
    );
    ok(&["snap", "rm", &at("other")]);
    writer.stop();
    let names: Vec<Value> = json(&["snap", "ls", p(&image)])
        .as_array()
        .cloned()
        .unwrap_or_default();
    assert_eq!(names.len(), 1, "{names:?}");
    assert_same(
        &read_served(&f, &server, "kept.raw"),
        &disk,
        "served snapshot",
    );
    server.stop();
    ok(&["snap", "rm", &at("kept")]);

    let server = Server::start(&f, &image, &["--read-only"]);
    let pid = server.child.id();
    let err = fails(&["delete", p(&image), "--yes"]);
    assert!(
        err.contains(&format!("open read-only by process {pid}")),
        "{err}"
    );
    assert_eq!(json(&["info", p(&image)])["size"], disk.len() as u64);
    assert_same(&read_served(&f, &server, "head.raw"), &disk, "served image");
    server.stop();
    ok(&["delete", p(&image), "--yes"]);
    let err = fails(&["info", p(&image)]);
    assert!(err.contains("does not exist"), "{err}");
}

/// A shrink or a rollback of an image another open reads is refused, naming the reader's
/// process, and the reader goes on reading the data: its size is fixed at its open, and it
/// read the shrunk-away part as zeros (or both states of a rollback mixed) without an error,
/// so an export in progress wrote a wrong file and succeeded. Once the reader stops, both go;
/// a reader of a snapshot does not hold them up.
#[test]
fn a_served_image_is_not_shrunk_or_rolled_back_under_its_reader() {
    let f = Fixture::new();
    let disk = raw_disk();
    let image = import(&f, "disk", &disk);
    let at = format!("{}@before", p(&image));
    ok(&["snap", "create", &at]);
    let smaller = 4 * OBJECT; // half of it and a bit
    let half = smaller.to_string();
    let shrink = [
        "resize",
        p(&image),
        "--size",
        &half,
        "--allow-shrink",
        "--passphrase-file",
        p(&f.pw),
    ];
    let server = Server::start(&f, &image, &["--read-only"]);
    let pid = server.child.id();
    for (what, args) in [
        ("resize", &shrink[..]),
        ("rollback", &["snap", "rollback", &at][..]),
    ] {
        let err = fails(args);
        assert!(
            err.contains(&format!("open read-only by process {pid}")),
            "{what}: {err}"
        );
    }
    assert_eq!(json(&["info", p(&image)])["size"], disk.len() as u64);
    assert_same(&read_served(&f, &server, "head.raw"), &disk, "served image");
    server.stop();
    // A reader of a snapshot is in no one's way: its data stays.
    let snapshot_server = Server::start(&f, Path::new(&at), &[]);
    ok(&shrink);
    assert_eq!(json(&["info", p(&image)])["size"], smaller);
    ok(&["snap", "rollback", &at]);
    assert_eq!(json(&["info", p(&image)])["size"], disk.len() as u64);
    assert_same(
        &read_served(&f, &snapshot_server, "before.raw"),
        &disk,
        "served snapshot",
    );
    snapshot_server.stop();
}
