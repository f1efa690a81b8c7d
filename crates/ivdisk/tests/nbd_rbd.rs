//! `ivdisk serve rbd://POOL/IMAGE`: librbd images (one formatted by `rbd encryption format
//! luks2`, one plain) behind ivdisk's NBD server, as the Ceph benchmark runs them. qemu-img
//! writes a random raw file into the export and reads it back; qemu's own rbd driver with
//! librbd's LUKS2 (`encrypt.format=luks2`) must see the same plaintext; SIGTERM exits 0;
//! a wrong or missing passphrase fails at start, saying so.
//!
//! The cluster comes from the environment as for the other Ceph tests: `CEPH_CONF`,
//! `IVDISK_RADOS_POOL` (default `rbd`); `IVDISK_NO_CEPH=1` skips these tests loudly. Every
//! image gets a random name and is removed at the end, also when a test fails.

mod common;

use std::fs;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::thread;
use std::time::{Duration, Instant};

use common::{p, Fixture};
use serde_json::Value;

const MIB: u64 = 1 << 20;
/// In a file without a newline: `rbd encryption format`, ivdisk's --passphrase-file and
/// qemu's `secret,file=` all read these bytes.
const PASS: &[u8] = b"ivdisk nbd rbd test passphrase";
const READY_LIMIT: Duration = Duration::from_secs(120);
const STOP_LIMIT: Duration = Duration::from_secs(60);

/// The cluster's config file and pool, or `None` (skip) with IVDISK_NO_CEPH=1.
fn cluster() -> Option<(String, String)> {
    if std::env::var("IVDISK_NO_CEPH").as_deref() == Ok("1") {
        eprintln!("IVDISK_NO_CEPH=1: no Ceph cluster, the rbd:// serve tests are SKIPPED");
        return None;
    }
    let conf = std::env::var("CEPH_CONF").unwrap_or_else(|_| {
        panic!(
            "the rbd:// serve tests need a Ceph cluster: run `eval \"$(scripts/ceph-dev-cluster \
             start)\"` (which exports CEPH_CONF), or set IVDISK_NO_CEPH=1 to skip them"
        )
    });
    let pool = std::env::var("IVDISK_RADOS_POOL").unwrap_or_else(|_| "rbd".into());
    Some((conf, pool))
}

/// Run a tool that must succeed; its stdout. A missing tool fails with its package.
fn tool(program: &str, args: &[&str]) -> String {
    let out = Command::new(program)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .unwrap_or_else(|e| {
            panic!(
                "{program} could not be run ({e}): apt-get install ceph-common qemu-utils \
                 qemu-block-extra (scripts/install-deps.sh installs them)"
            )
        });
    assert!(
        out.status.success(),
        "{program} {args:?} failed ({}): {}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// A throwaway rbd image, removed when dropped.
struct Rbd {
    conf: String,
    pool: String,
    name: String,
    f: Fixture,
    passfile: PathBuf,
}

impl Rbd {
    /// 64 MiB; `rbd encryption format` with `format` if given. No object-map/fast-diff: with
    /// fast-diff qemu 7.2's rbd driver takes the raw image's holes for the encrypted ones and
    /// `qemu-img convert` skips data (its bug, see crates/ivdisk-rbd/tests/common).
    fn create(tag: &str, format: Option<&str>) -> Option<Rbd> {
        let (conf, pool) = cluster()?;
        let f = Fixture::new();
        let passfile = f.file("passphrase", PASS);
        let mut b = [0u8; 5];
        fs::File::open("/dev/urandom")
            .and_then(|mut r| std::io::Read::read_exact(&mut r, &mut b))
            .unwrap();
        let rbd = Rbd {
            conf,
            pool,
            name: format!("ivdisk-serve-{tag}-{}", hex::encode(b)),
            f,
            passfile,
        };
        rbd.rbd(&[
            "create",
            "--size",
            "64M",
            "--image-feature",
            "layering,exclusive-lock,deep-flatten",
            &rbd.spec(),
        ]);
        if let Some(format) = format {
            rbd.rbd(&[
                "encryption",
                "format",
                &rbd.spec(),
                format,
                p(&rbd.passfile),
            ]);
        }
        Some(rbd)
    }

    fn spec(&self) -> String {
        format!("{}/{}", self.pool, self.name)
    }

    fn uri(&self) -> String {
        format!("rbd://{}/{}?conf={}", self.pool, self.name, self.conf)
    }

    fn rbd(&self, args: &[&str]) -> String {
        let mut all = vec!["--conf", &self.conf];
        all.extend(args);
        tool("rbd", &all)
    }

    /// librbd's plaintext through qemu's rbd driver with LUKS2 loaded by librbd.
    fn qemu_luks2_read(&self) -> Vec<u8> {
        let out = self.f.path("qemu-rbd.raw");
        tool(
            "qemu-img",
            &[
                "convert",
                "--object",
                &format!("secret,id=sec0,file={}", p(&self.passfile)),
                "--image-opts",
                &format!(
                    "driver=rbd,pool={},image={},conf={},encrypt.format=luks2,\
                     encrypt.key-secret=sec0",
                    self.pool, self.name, self.conf
                ),
                "-O",
                "raw",
                p(&out),
            ],
        );
        fs::read(&out).unwrap()
    }

    fn serve_command(&self, extra: &[&str]) -> (Command, PathBuf) {
        self.serve_command_at("nbd.sock", extra)
    }

    /// `serve_command` on the socket `name` in the fixture's directory.
    fn serve_command_at(&self, name: &str, extra: &[&str]) -> (Command, PathBuf) {
        let socket = self.f.path(name);
        let mut command = Command::new(env!("CARGO_BIN_EXE_ivdisk"));
        command
            .args(["serve", &self.uri(), "--socket", p(&socket), "--json"])
            .args(extra)
            .stdin(Stdio::null());
        (command, socket)
    }

    /// `ivdisk serve ... --json`, once its ready line is out.
    fn serve(&self, extra: &[&str]) -> Ready {
        let (mut command, socket) = self.serve_command(extra);
        let stderr_path = self.f.path("serve.stderr");
        command
            .stdout(Stdio::piped())
            .stderr(fs::File::create(&stderr_path).unwrap());
        let mut child = command.spawn().unwrap();
        let stdout = child.stdout.take().unwrap();
        let (tx, rx) = mpsc::channel();
        thread::spawn(move || {
            let mut line = String::new();
            let _ = BufReader::new(stdout).read_line(&mut line);
            let _ = tx.send(line);
        });
        let server = Server {
            child,
            stopped: false,
            stderr_path,
        };
        let line = rx.recv_timeout(READY_LIMIT).unwrap_or_default();
        let ready: Value = serde_json::from_str(&line).unwrap_or_else(|e| {
            panic!(
                "ivdisk serve {} gave no ready line ({e}): {line:?}; stderr: {}",
                self.uri(),
                server.stderr()
            )
        });
        assert_eq!(
            ready["uri"],
            format!("nbd+unix:///?socket={}", p(&socket)),
            "{ready}"
        );
        Ready { server, ready }
    }

    /// `ivdisk serve` that must fail at start (exit 1, no ready line); its stderr.
    fn serve_fails(&self, extra: &[&str]) -> String {
        let (mut command, _) = self.serve_command(extra);
        let out = command.output().unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr).into_owned();
        assert_eq!(out.status.code(), Some(1), "{stderr}");
        // No ready line: nothing, or (with --json) the JSON error object.
        assert!(
            out.stdout.is_empty() || out.stdout.starts_with(br#"{"error":"#),
            "no ready line expected: {out:?}"
        );
        stderr
    }
}

impl Drop for Rbd {
    fn drop(&mut self) {
        let _ = Command::new("rbd")
            .args(["--conf", &self.conf, "rm", "--no-progress", &self.spec()])
            .output();
    }
}

/// A running `ivdisk serve`, killed on drop unless it stopped.
struct Server {
    child: Child,
    stopped: bool,
    stderr_path: PathBuf,
}

struct Ready {
    server: Server,
    ready: Value,
}

impl Server {
    fn stderr(&self) -> String {
        fs::read_to_string(&self.stderr_path).unwrap_or_default()
    }
}

impl Ready {
    fn uri(&self) -> &str {
        self.ready["uri"].as_str().unwrap()
    }

    /// SIGTERM: the server finishes, flushes, closes the image and exits 0.
    fn stop(mut self) -> String {
        let pid = libc::pid_t::try_from(self.server.child.id()).unwrap();
        // SAFETY: kill(2) on our own child, not yet waited for (its pid cannot be reused).
        assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
        let deadline = Instant::now() + STOP_LIMIT;
        let status = loop {
            if let Some(status) = self.server.child.try_wait().unwrap() {
                break status;
            }
            assert!(
                Instant::now() < deadline,
                "no exit within {STOP_LIMIT:?} of SIGTERM: {}",
                self.server.stderr()
            );
            thread::sleep(Duration::from_millis(20));
        };
        self.server.stopped = true;
        let stderr = self.server.stderr();
        assert!(status.success(), "exit {status} after SIGTERM: {stderr}");
        assert!(stderr.contains("SIGTERM"), "{stderr}");
        stderr
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

/// A raw file the size of the export: random data with zero runs (which qemu-img writes as
/// zeroes requests) and an unaligned tail.
fn random_file(dir: &Path, size: u64) -> PathBuf {
    let mut data = vec![0u8; size as usize];
    fs::File::open("/dev/urandom")
        .and_then(|mut r| std::io::Read::read_exact(&mut r, &mut data))
        .unwrap();
    data[(MIB as usize)..(5 * MIB as usize)].fill(0);
    data[(20 * MIB as usize + 4097)..(20 * MIB as usize + 9000)].fill(0);
    let path = dir.join("random.raw");
    fs::write(&path, &data).unwrap();
    path
}

/// qemu-img writes `src` into the export and reads it back; `qemu-img compare` of `src`
/// with the export and with the copy read out says identical.
fn qemu_round_trip(rbd: &Rbd, server: &Ready, src: &Path) {
    tool(
        "qemu-img",
        &[
            "convert",
            "-n",
            "-f",
            "raw",
            "-O",
            "raw",
            p(src),
            server.uri(),
        ],
    );
    let back = rbd.f.path("back.raw");
    tool(
        "qemu-img",
        &["convert", "-f", "raw", "-O", "raw", server.uri(), p(&back)],
    );
    for other in [server.uri(), p(&back)] {
        let compared = tool(
            "qemu-img",
            &["compare", "-f", "raw", "-F", "raw", p(src), other],
        );
        assert!(compared.contains("Images are identical"), "{compared}");
    }
}

#[test]
fn serve_rbd_luks2_image_matches_qemus_librbd_and_stops_cleanly() {
    let Some(rbd) = Rbd::create("luks2", Some("luks2")) else {
        return;
    };
    let size = 48 * MIB; // 64 MiB less librbd's 16 MiB LUKS2 header region
    let info = common::json(&["info", &rbd.uri()]);
    assert_eq!(info["encryption"], "luks2", "{info}");
    assert_eq!(info["size"], size, "{info}");
    assert_eq!(info["data_offset"], 16 * MIB, "{info}");

    // No passphrase and no terminal: refused at once, saying what the image is.
    let stderr = rbd.serve_fails(&[]);
    assert!(
        stderr.contains("LUKS2-encrypted") && stderr.contains("--passphrase-file"),
        "{stderr}"
    );
    // The wrong passphrase: refused, naming the image.
    let wrong = rbd.f.file("wrong", b"not it\n");
    let stderr = rbd.serve_fails(&["--passphrase-file", p(&wrong)]);
    assert!(
        stderr.contains("opens no LUKS2 keyslot") && stderr.contains(&rbd.spec()),
        "{stderr}"
    );

    let server = rbd.serve(&["--passphrase-file", p(&rbd.passfile)]);
    assert_eq!(server.ready["encryption"], "luks2", "{}", server.ready);
    assert_eq!(server.ready["size"], size, "{}", server.ready);
    assert_eq!(server.ready["read_only"], false, "{}", server.ready);
    let src = random_file(rbd.f.dir.path(), size);
    qemu_round_trip(&rbd, &server, &src);
    server.stop();

    // librbd's own LUKS2, through qemu, sees what went through ivdisk's NBD server.
    assert!(
        rbd.qemu_luks2_read() == fs::read(&src).unwrap(),
        "qemu's rbd+luks2 read differs from what was written over NBD"
    );
}

#[test]
fn serve_rbd_plain_image_asks_no_passphrase() {
    let Some(rbd) = Rbd::create("plain", None) else {
        return;
    };
    let size = 64 * MIB;
    let info = common::json(&["info", &rbd.uri()]);
    assert_eq!(info["encryption"], "none", "{info}");
    assert_eq!(info["size"], size, "{info}");
    let text = common::ok(&["info", &rbd.uri()]);
    assert!(
        text.contains("encryption:") && text.contains("none"),
        "{text}"
    );

    // Standard input is closed: any prompt would fail the start.
    let server = rbd.serve(&[]);
    assert_eq!(server.ready["encryption"], "none", "{}", server.ready);
    assert_eq!(server.ready["size"], size, "{}", server.ready);
    let src = random_file(rbd.f.dir.path(), size);
    qemu_round_trip(&rbd, &server, &src);
    server.stop();

    let exported = rbd.f.path("export.raw");
    rbd.rbd(&["export", "--no-progress", &rbd.spec(), p(&exported)]);
    assert!(
        fs::read(&exported).unwrap() == fs::read(&src).unwrap(),
        "rbd export differs from what was written over NBD"
    );

    // Read-only: the export says so and writes fail.
    let server = rbd.serve(&["--read-only"]);
    assert_eq!(server.ready["read_only"], true, "{}", server.ready);
    let out = Command::new("qemu-io")
        .args(["-f", "raw", server.uri(), "-c", "write 0 4096"])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let said = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        !out.status.success() || said.contains("failed"),
        "a write to a read-only export went through: {said}"
    );
    server.stop();
}

/// A second writable `serve` of one rbd:// image is refused, naming what to do: librbd's
/// cooperative exclusive lock let two servers of one image take it in turn, and both wrote
/// (a guest's file system on it would be corrupted). A read-only one beside it is fine.
#[test]
fn a_second_writer_of_an_rbd_image_is_refused() {
    let Some(rbd) = Rbd::create("twice", None) else {
        return;
    };
    let first = rbd.serve(&[]);
    let (mut second, _) = rbd.serve_command_at("second.sock", &[]);
    let stderr_path = rbd.f.path("second.stderr");
    let mut second = second
        .stdout(Stdio::null())
        .stderr(fs::File::create(&stderr_path).unwrap())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + READY_LIMIT;
    let status = loop {
        if let Some(status) = second.try_wait().unwrap() {
            break Some(status);
        }
        if Instant::now() >= deadline {
            let _ = second.kill();
            let _ = second.wait();
            break None;
        }
        thread::sleep(Duration::from_millis(50));
    };
    let stderr = fs::read_to_string(&stderr_path).unwrap_or_default();
    assert_eq!(
        status.and_then(|s| s.code()),
        Some(1),
        "the second writer was not refused: {stderr}"
    );
    // librbd's errno for it (EROFS) is not shown: "Read-only file system" misled.
    assert!(
        stderr.contains("has another writer")
            && stderr.contains("--read-only")
            && !stderr.contains("os error"),
        "{stderr}"
    );
    let (mut reader, _) = rbd.serve_command_at("reader.sock", &["--read-only"]);
    let mut reader = reader.stdout(Stdio::piped()).spawn().unwrap();
    let mut line = String::new();
    BufReader::new(reader.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(line.contains("\"read_only\":true"), "the reader: {line}");
    let _ = reader.kill();
    let _ = reader.wait();
    // The first still writes.
    let wrote = tool(
        "qemu-io",
        &["-f", "raw", first.uri(), "-c", "write -P 0x5a 0 64k"],
    );
    assert!(wrote.contains("wrote 65536/65536"), "{wrote}");
    first.stop();
}

/// A writer killed outright leaves librbd's exclusive lock to a client that no longer
/// answers; the next `serve` waits until the OSDs drop its watch and says so meanwhile
/// (it said nothing for half a minute), then takes the lock and writes.
#[test]
fn a_killed_writers_lock_is_taken_over_with_a_notice() {
    let Some(rbd) = Rbd::create("killed", None) else {
        return;
    };
    let mut first = rbd.serve(&[]);
    let wrote = tool(
        "qemu-io",
        &["-f", "raw", first.uri(), "-c", "write -P 0x11 0 64k"],
    );
    assert!(wrote.contains("wrote 65536/65536"), "{wrote}");
    first.server.child.kill().unwrap();
    first.server.child.wait().unwrap();
    first.server.stopped = true;
    let started = Instant::now();
    let second = rbd.serve(&[]);
    let waited = started.elapsed();
    let stderr = second.server.stderr();
    assert!(
        stderr.contains("still waiting for librbd's exclusive lock")
            && stderr.contains("osd_client_watch_timeout"),
        "no notice after {waited:?} of waiting: {stderr}"
    );
    let read = tool(
        "qemu-io",
        &["-f", "raw", second.uri(), "-c", "read -P 0x11 0 64k"],
    );
    assert!(read.contains("read 65536/65536"), "{read}");
    let wrote = tool(
        "qemu-io",
        &["-f", "raw", second.uri(), "-c", "write -P 0x22 0 4k"],
    );
    assert!(wrote.contains("wrote 4096/4096"), "{wrote}");
    second.stop();
}

/// `scripts/ceph-dev-cluster` on the cluster in `IVDISK_CEPH_DIR` (for the fault test below).
fn cluster_script(args: &[&str]) {
    let dir = std::env::var("IVDISK_CEPH_DIR").expect(
        "IVDISK_CEPH_DIR must name the directory of a cluster from scripts/ceph-dev-cluster \
         (this test kills its OSDs); scripts/test-all.sh sets it",
    );
    let script = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../scripts/ceph-dev-cluster"
    );
    let status = Command::new("bash")
        .arg(script)
        .args(args)
        .args(["--dir", &dir])
        .status()
        .unwrap();
    assert!(status.success(), "ceph-dev-cluster {args:?}: {status}");
}

/// The ids of the OSDs of the cluster in `IVDISK_CEPH_DIR` (its `osd.N` directories).
fn osd_ids() -> Vec<String> {
    let dir = std::env::var("IVDISK_CEPH_DIR").unwrap_or_default();
    let mut ids: Vec<String> = fs::read_dir(&dir)
        .unwrap_or_else(|e| panic!("IVDISK_CEPH_DIR={dir}: {e}"))
        .filter_map(|e| {
            let name = e.ok()?.file_name().into_string().ok()?;
            Some(name.strip_prefix("osd.")?.to_owned())
        })
        .collect();
    ids.sort();
    assert!(!ids.is_empty(), "no OSD in {dir}");
    ids
}

/// Starts the OSDs again if the test fails while they are down, so later tests (and the
/// image's removal) find a cluster.
struct OsdsBackOnPanic(bool);

impl Drop for OsdsBackOnPanic {
    fn drop(&mut self) {
        if self.0 && thread::panicking() {
            for id in osd_ids() {
                cluster_script(&["osd-start", &id]);
            }
        }
    }
}

/// With every OSD down, librbd would wait forever: `info` hung, and so did a served image's
/// requests (the client saw nothing, the server logged nothing). Now each fails after
/// `rados_osd_op_timeout` (60 s by default; 3 s here from the config file, which takes
/// precedence) with an error naming the OSDs and what to check; the server keeps running, and
/// serves again once they are back.
#[test]
#[ignore = "kills the OSDs of the cluster in IVDISK_CEPH_DIR; run by scripts/test-all.sh"]
fn with_every_osd_down_rbd_requests_fail_in_time_naming_the_osds() {
    let Some(mut rbd) = Rbd::create("osds-down", None) else {
        return;
    };
    let cluster_conf = fs::read_to_string(&rbd.conf).unwrap();
    let conf_with = |name: &str, secs: u32| {
        let conf = rbd.f.path(name);
        let text = format!("{cluster_conf}\n[client]\nrados_osd_op_timeout = {secs}\n");
        fs::write(&conf, text).unwrap();
        p(&conf).to_owned()
    };
    let (short, long) = (conf_with("short.conf", 3), conf_with("long.conf", 16));
    // A read-only server whose requests outlast the shutdown's 10 s of grace for replies.
    rbd.conf = long;
    let (mut command, reader_socket) = rbd.serve_command_at("reader.sock", &["--read-only"]);
    let reader_stderr = rbd.f.path("reader.stderr");
    let mut reader = command
        .stdout(Stdio::piped())
        .stderr(fs::File::create(&reader_stderr).unwrap())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(reader.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(line.contains("\"read_only\":true"), "the reader: {line}");
    rbd.conf = short;
    let server = rbd.serve(&[]);
    let wrote = tool(
        "qemu-io",
        &["-f", "raw", server.uri(), "-c", "write -P 0x3c 0 1M"],
    );
    assert!(wrote.contains("wrote 1048576/1048576"), "{wrote}");

    let mut guard = OsdsBackOnPanic(true);
    for id in osd_ids() {
        cluster_script(&["osd-kill", &id]);
    }
    let started = Instant::now();
    let out = Command::new("timeout")
        .args(["120", "qemu-io", "-f", "raw", server.uri()])
        .args(["-c", "read -P 0x3c 0 64k", "-c", "write -P 0x4d 1M 64k"])
        .output()
        .unwrap();
    let said =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "the client waited {:?}: {said}",
        started.elapsed()
    );
    assert!(
        said.contains("read failed: Input/output error")
            && said.contains("write failed: Input/output error"),
        "{said}"
    );
    let log = server.server.stderr();
    assert!(
        log.contains("the read of 65536 bytes at offset 0 got no answer from the OSDs in time")
            && log.contains("ceph osd tree"),
        "{log}"
    );
    // librbd's cache may take the write and leave the failure to the flush qemu-io sends
    // after it (writethrough): either way the client hears of it, and what may be lost.
    assert!(
        (log.contains("the write of 65536 bytes at offset 1048576 got no answer")
            && log.contains("the range may hold the old or the new data"))
            || (log.contains("the flush got no answer")
                && log.contains("the writes before it may or may not have reached the OSDs")),
        "{log}"
    );
    let info = Command::new(env!("CARGO_BIN_EXE_ivdisk"))
        .args(["info", &rbd.uri()])
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&info.stderr);
    assert_eq!(info.status.code(), Some(1), "info: {stderr}");
    assert!(
        stderr.contains("opening it got no answer from the OSDs in time")
            && stderr.contains("ceph -s"),
        "{stderr}"
    );

    // SIGTERM while a request waits for the OSDs: once the grace for replies is over, the
    // server says it waits for the storage (it blamed the client for not taking its
    // replies), then exits when the request's timeout ends it.
    let reader_uri = format!("nbd+unix:///?socket={}", p(&reader_socket));
    let stalled_read = thread::spawn(move || {
        Command::new("timeout")
            .args(["120", "qemu-io", "-r", "-f", "raw", &reader_uri])
            .args(["-c", "read 0 64k"])
            .output()
            .unwrap()
    });
    thread::sleep(Duration::from_secs(2));
    let pid = libc::pid_t::try_from(reader.id()).unwrap();
    // SAFETY: kill(2) on our own child, not yet waited for.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    let deadline = Instant::now() + Duration::from_secs(60);
    while reader.try_wait().unwrap().is_none() {
        assert!(Instant::now() < deadline, "the reader did not exit");
        thread::sleep(Duration::from_millis(50));
    }
    let read = stalled_read.join().unwrap();
    assert!(!read.status.success(), "{read:?}");
    let log = fs::read_to_string(&reader_stderr).unwrap();
    assert!(
        log.contains("1 request(s) still wait for the storage")
            && !log.contains("did not take its replies"),
        "{log}"
    );

    for id in osd_ids() {
        cluster_script(&["osd-start", &id]);
    }
    guard.0 = false;
    // The same server serves again: what was written before the outage reads back.
    let read = tool(
        "qemu-io",
        &["-f", "raw", server.uri(), "-c", "read -P 0x3c 0 1M"],
    );
    assert!(read.contains("read 1048576/1048576"), "{read}");
    server.stop();
}
