//! Readers of RADOS images keep them from being removed (crates/ivdisk-image/src/readers.rs):
//! here, a reader whose watch the OSD dropped while its process was paused (as a VM host or
//! a stopped container pauses one) is seen again once it runs: its watch is registered
//! again, and `snap rm` refuses once more; and one paused while its image or snapshot was
//! removed reads none of it as zeros.
//!
//! A second writer is refused before it asks for a passphrase, naming the holder. A writer
//! whose lock `ivdisk lock break` removes is fenced first (blocklisted): it writes nothing
//! from then on, beside the next writer.
//!
//! A client whose OSD caps allow no writes may not watch: it still reads (as librbd's
//! read-only opens do), with a warning that removals will not see it.
//!
//! The cluster comes from the environment as for the other Ceph tests (`CEPH_CONF`,
//! `IVDISK_RADOS_POOL`); `IVDISK_NO_CEPH=1` skips this test loudly. Paused readers run with
//! a 4 s watch timeout (`osd_client_watch_timeout` in a conf file of their own).

mod common;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use common::{fails, json, ok, p, Fixture, FAST};

/// The pool, or `None` (skip) with IVDISK_NO_CEPH=1; `CEPH_CONF` names the cluster.
fn pool() -> Option<String> {
    if std::env::var("IVDISK_NO_CEPH").as_deref() == Ok("1") {
        eprintln!("IVDISK_NO_CEPH=1: no Ceph cluster, the RADOS readers test is SKIPPED");
        return None;
    }
    assert!(
        std::env::var_os("CEPH_CONF").is_some(),
        "this test needs a Ceph cluster: run `eval \"$(scripts/ceph-dev-cluster start)\"` \
         (which exports CEPH_CONF), or set IVDISK_NO_CEPH=1 to skip it"
    );
    Some(std::env::var("IVDISK_RADOS_POOL").unwrap_or_else(|_| "rbd".into()))
}

/// A server process, killed (and continued first, if paused) when dropped.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        // (Exited already, after the test's SIGTERM: nothing to continue or kill.)
        let _ = Command::new("kill")
            .args(["-CONT", &self.0.id().to_string()])
            .stderr(Stdio::null())
            .status();
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn signal(child: &Child, which: &str) {
    let status = Command::new("kill")
        .args([which, &child.id().to_string()])
        .status()
        .unwrap();
    assert!(status.success(), "kill {which}");
}

/// A new 8 MiB image, removed (with its snapshot) when the returned guard drops.
fn create(f: &Fixture, image: &str) -> Cleanup {
    let mut args = vec!["create", image, "--size", "8M"];
    args.extend(["--passphrase-file", p(&f.pw)]);
    args.extend(FAST);
    ok(&args);
    Cleanup(image.to_owned())
}

/// `ivdisk serve IMAGE [EXTRA]` on socket `name` in the fixture's directory, once it serves.
fn serve(f: &Fixture, image: &str, name: &str, extra: &[&str]) -> Server {
    let mut child = Command::new(env!("CARGO_BIN_EXE_ivdisk"))
        .args(["serve", image, "--passphrase-file", p(&f.pw)])
        .args(["--socket", p(&f.path(name))])
        .args(extra)
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let stdout = child.stdout.take().unwrap();
    let server = Server(child);
    // Read to the end, so that the server never writes into a closed pipe.
    let (started, ready) = std::sync::mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stdout).lines().map_while(Result::ok) {
            if line.starts_with("Serving image") {
                let _ = started.send(());
            }
        }
    });
    ready
        .recv_timeout(Duration::from_secs(120))
        .expect("the server did not start");
    server
}

/// Removes the test's image (and its snapshot) at the end, also when the test fails.
struct Cleanup(String);

impl Drop for Cleanup {
    fn drop(&mut self) {
        let _ = common::ivdisk(&["snap", "rm", &format!("{}@kept", self.0)]);
        let _ = common::ivdisk(&["delete", &self.0, "--yes"]);
    }
}

#[test]
fn a_paused_reader_is_seen_again_once_it_runs() {
    let Some(pool) = pool() else {
        return;
    };
    let f = Fixture::new();
    let name = format!("readers-{}", std::process::id());
    let image = format!("rados://{pool}/{name}");
    let _cleanup = create(&f, &image);
    let kept = format!("{image}@kept");
    ok(&["snap", "create", &kept]);

    // With a 4 s watch timeout (30 s by default) and a ping every second.
    let conf = conf_with_watch_timeout(&f, 4);
    let server = serve(&f, &format!("{kept}?conf={}", p(&conf)), "kept.sock", &[]);
    let pid = server.0.id();
    let refused = fails(&["snap", "rm", &kept]);
    assert!(
        refused.contains(&format!("open read-only by process {pid} on host")),
        "{refused}"
    );

    // Paused past its watch timeout: the OSD drops its watch.
    signal(&server.0, "-STOP");
    std::thread::sleep(Duration::from_secs(8));
    signal(&server.0, "-CONT");
    // librados finds the watch gone (the OSD's word, or its next ping) and the server
    // registers it again.
    std::thread::sleep(Duration::from_secs(5));
    let refused = fails(&["snap", "rm", &kept]);
    assert!(
        refused.contains(&format!("open read-only by process {pid} on host")),
        "the paused reader was not seen again: {refused}"
    );
    // Stopped as a user stops it, it unregisters its watch: the snapshot goes at once.
    let mut server = server;
    signal(&server.0, "-TERM");
    assert!(server.0.wait().unwrap().success());
    ok(&["snap", "rm", &kept]);
}

/// A copy of the cluster's conf file in which clients keep watches for `timeout_s` seconds
/// and confirm them every second (`objecter_tick_interval`), so that a paused reader's
/// watch is lost in seconds rather than the default 30.
fn conf_with_watch_timeout(f: &Fixture, timeout_s: u32) -> std::path::PathBuf {
    let conf = std::fs::read_to_string(std::env::var_os("CEPH_CONF").unwrap()).unwrap();
    let extra =
        format!("\n[client]\nosd_client_watch_timeout = {timeout_s}\nobjecter_tick_interval = 1\n");
    f.file("short-watch.conf", (conf + &extra).as_bytes())
}

/// A read-only server whose process is paused past its watch timeout while its image, or
/// the snapshot it serves, is removed reads none of what is gone as zeros: once it runs
/// again its reads fail (EIO) for good. One paused while nothing is removed reads again
/// once its watch is registered again.
#[test]
fn a_reader_paused_past_its_watch_reads_nothing_removed_meanwhile() {
    let Some(pool) = pool() else {
        return;
    };
    let f = Fixture::new();
    let name = format!("unseen-{}", std::process::id());
    let image = format!("rados://{pool}/{name}");
    let cleanup = create(&f, &image);
    let writer = serve(&f, &image, "writer.sock", &[]);
    let wrote = qemu_io(&f.path("writer.sock"), "write -P 0xab 0 64k");
    assert!(wrote.contains("wrote 65536/65536"), "{wrote}");
    let mut writer = writer;
    signal(&writer.0, "-TERM");
    assert!(writer.0.wait().unwrap().success());
    ok(&["snap", "create", &format!("{image}@kept")]);

    let conf = conf_with_watch_timeout(&f, 4);
    let reads_back = |sock: &str| {
        let read = qemu_io_read_only(&f.path(sock), "read -P 0xab 0 64k");
        read.contains("read 65536/65536") && !read.contains("verification failed")
    };
    // Paused for twice the watch timeout (the OSD drops the watch), then continued.
    let paused = |server: &Server, meanwhile: &dyn Fn()| {
        signal(&server.0, "-STOP");
        std::thread::sleep(Duration::from_secs(8));
        meanwhile();
        signal(&server.0, "-CONT");
    };
    // Every read for 10 s after it runs again fails: none returns zeros for removed data.
    let reads_fail_for_good = |sock: &str, what: &str| {
        let until = std::time::Instant::now() + Duration::from_secs(10);
        while std::time::Instant::now() < until {
            let read = qemu_io_read_only(&f.path(sock), "read -P 0xab 0 64k");
            assert!(
                read.contains("read failed") && !read.contains("read 65536"),
                "{what}: a read after it ran again: {read}"
            );
            std::thread::sleep(Duration::from_millis(500));
        }
    };

    // Nothing removed: reads go on once the watch is registered again.
    let head = format!("{image}?conf={}", p(&conf));
    let reader = serve(&f, &head, "head.sock", &["--read-only"]);
    assert!(reads_back("head.sock"));
    paused(&reader, &|| {});
    let until = std::time::Instant::now() + Duration::from_secs(30);
    while !reads_back("head.sock") {
        assert!(
            std::time::Instant::now() < until,
            "reads did not go on after the watch was registered again"
        );
        std::thread::sleep(Duration::from_millis(500));
    }

    // The snapshot it serves removed meanwhile.
    let at_snap = format!("{image}@kept?conf={}", p(&conf));
    let snap_reader = serve(&f, &at_snap, "snap.sock", &["--read-only"]);
    assert!(reads_back("snap.sock"));
    paused(&snap_reader, &|| {
        ok(&["snap", "rm", &format!("{image}@kept")]);
    });
    reads_fail_for_good("snap.sock", "the removed snapshot");
    drop(snap_reader);

    // The image it serves deleted meanwhile.
    paused(&reader, &|| {
        ok(&["delete", &image, "--yes"]);
    });
    reads_fail_for_good("head.sock", "the deleted image");
    drop(reader);
    drop(cleanup);
}

/// A backup of a snapshot paused past its watch timeout (its watch lost, so removals do
/// not see it) is refused once it runs again if that snapshot was removed meanwhile, and
/// leaves no file; if nothing was removed it completes.
#[test]
fn a_backup_paused_while_its_snapshot_is_removed_is_refused() {
    let Some(pool) = pool() else {
        return;
    };
    let f = Fixture::new();
    let image = format!("rados://{pool}/paused-backup-{}", std::process::id());
    // 128 MiB in 2048 objects: a backup of it takes seconds on the test cluster.
    let raw = f.file("data.raw", &common::random(128 << 20, 7));
    let mut args = vec!["import", p(&raw), &image, "--object-size", "64K"];
    args.extend(["--passphrase-file", p(&f.pw)]);
    args.extend(FAST);
    ok(&args);
    let _cleanup = Cleanup(image.clone());
    let kept = format!("{image}@kept");
    ok(&["snap", "create", &kept]);
    let conf = conf_with_watch_timeout(&f, 4);

    // A backup paused for twice its watch timeout once it has begun writing its file, with
    // `meanwhile` run before it goes on: its output.
    let paused_backup = |name: &str, meanwhile: &dyn Fn()| {
        let file = f.path(name);
        let child = Command::new(env!("CARGO_BIN_EXE_ivdisk"))
            .args(["backup", &format!("{kept}?conf={}", p(&conf)), p(&file)])
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let partial = f.path(&format!("{name}.partial.{}", child.id()));
        let until = std::time::Instant::now() + Duration::from_secs(60);
        while !partial.exists() {
            assert!(
                std::time::Instant::now() < until,
                "the backup did not start"
            );
            std::thread::sleep(Duration::from_millis(5));
        }
        signal(&child, "-STOP");
        let mut child = child;
        assert!(
            child.try_wait().unwrap().is_none(),
            "the backup ended before it was paused: make the image larger"
        );
        std::thread::sleep(Duration::from_secs(8));
        meanwhile();
        signal(&child, "-CONT");
        let out = child.wait_with_output().unwrap();
        assert!(!partial.exists(), "the partial file was left");
        (out, file)
    };

    let (out, file) = paused_backup("whole.backup", &|| {});
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "nothing was removed: {stderr}");
    assert!(file.exists());

    let (out, file) = paused_backup("removed.backup", &|| {
        ok(&["snap", "rm", &kept]);
    });
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "the snapshot was removed: {stderr}");
    assert!(stderr.contains("no snapshot named `kept`"), "{stderr}");
    assert!(!file.exists(), "a backup file was left");
}

/// Deletes a Ceph client's key at the end, also when the test fails.
struct CephClient(String);

/// A new cephx user `client.<id>` with these monitor and OSD capabilities, and its keyring
/// in the fixture's directory.
fn ceph_client(f: &Fixture, id: &str, mon: &str, osd: &str) -> (CephClient, std::path::PathBuf) {
    let out = Command::new("ceph")
        .args(["auth", "get-or-create", &format!("client.{id}")])
        .args(["mon", mon, "osd", osd])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let client = CephClient(format!("client.{id}"));
    (client, f.file(&format!("{id}.keyring"), &out.stdout))
}

impl Drop for CephClient {
    fn drop(&mut self) {
        let _ = Command::new("ceph")
            .args(["auth", "del", &self.0])
            .stderr(Stdio::null())
            .status();
    }
}

#[test]
fn a_client_with_read_only_caps_reads_unwatched() {
    let Some(pool) = pool() else {
        return;
    };
    let f = Fixture::new();
    let name = format!("readers-ro-{}", std::process::id());
    let image = format!("rados://{pool}/{name}");
    let _cleanup = create(&f, &image);

    let client = format!("ivdisk-test-ro-{}", std::process::id());
    let osd = format!("profile rbd-read-only pool={pool}");
    let (_client, keyring) = ceph_client(&f, &client, "profile rbd", &osd);
    let read_only = format!("{image}?id={client}&keyring={}", p(&keyring));

    // Writing is refused by the cluster; reading works, and says what it lacks.
    let out = common::ivdisk(&["verify", &read_only, "--passphrase-file", p(&f.pw)]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(stderr.contains("may not watch"), "{stderr}");
    let exported = f.path("out.raw");
    let mut args = vec!["export", &read_only, p(&exported)];
    args.extend(["--passphrase-file", p(&f.pw)]);
    ok(&args);
    assert_eq!(std::fs::metadata(&exported).unwrap().len(), 8 << 20);
}

/// A second `ivdisk serve` of a RADOS image that a server writes is refused before it asks
/// for a passphrase (none is given here), naming the holder; a read-only one starts beside
/// it, and once the first stops, a writer starts.
#[test]
fn a_second_writer_is_refused_before_its_passphrase() {
    let Some(pool) = pool() else {
        return;
    };
    let f = Fixture::new();
    let image = format!("rados://{pool}/writers-{}", std::process::id());
    let _cleanup = create(&f, &image);

    let first = serve(&f, &image, "first.sock", &[]);
    let other = f.path("other.sock");
    let refused = fails(&["serve", &image, "--socket", p(&other)]);
    // librados names a client by its instance (client.4167); the description by its process.
    assert!(
        refused.contains("is open for writing by client client.")
            && refused.contains(&format!("(ivdisk pid {} on", first.0.id()))
            && refused.contains("ivdisk lock break"),
        "{refused}"
    );
    assert!(!other.exists(), "the refused server left its socket behind");
    drop(serve(&f, &image, "reader.sock", &["--read-only"]));

    let mut first = first;
    signal(&first.0, "-TERM");
    assert!(first.0.wait().unwrap().success());
    drop(serve(&f, &image, "second.sock", &[]));
}

/// `qemu-io` with one command on the NBD socket `sock`; its stdout and stderr.
fn qemu_io(sock: &std::path::Path, command: &str) -> String {
    qemu_io_with(sock, command, &[])
}

/// [`qemu_io`] of a read-only export.
fn qemu_io_read_only(sock: &std::path::Path, command: &str) -> String {
    qemu_io_with(sock, command, &["-r"])
}

fn qemu_io_with(sock: &std::path::Path, command: &str, extra: &[&str]) -> String {
    let out = Command::new("qemu-io")
        .args(extra)
        .args(["-f", "raw", "-c", command])
        .arg(format!("nbd+unix:///?socket={}", sock.display()))
        .output()
        .expect("qemu-io (apt install qemu-utils)");
    String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr)
}

fn blocklist() -> String {
    let out = Command::new("ceph")
        .args(["osd", "blocklist", "ls"])
        .output()
        .unwrap();
    assert!(out.status.success(), "ceph osd blocklist ls");
    String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr)
}

/// `lock break` of a writer that still runs fences it first: its client is blocklisted, so
/// nothing it sends is applied beside the next writer (without fencing, its writes went on
/// until its lock renewal noticed, up to 10 s). `--no-fence` breaks without.
#[test]
fn a_broken_lock_fences_its_writer_before_the_next_one_writes() {
    let Some(pool) = pool() else {
        return;
    };
    let f = Fixture::new();
    let image = format!("rados://{pool}/fence-{}", std::process::id());
    let _cleanup = create(&f, &image);
    let (first_sock, second_sock) = (f.path("first.sock"), f.path("second.sock"));
    let mut first = serve(&f, &image, "first.sock", &[]);
    let wrote = qemu_io(&first_sock, "write -P 0xaa 0 64k");
    assert!(wrote.contains("wrote 65536/65536"), "{wrote}");

    let broken = json(&["lock", "break", &image, "--yes"]);
    let description = broken["broken"]["description"].as_str().unwrap();
    assert!(
        description.contains(&format!("ivdisk pid {} on", first.0.id())),
        "{broken}"
    );
    let fenced_at = broken["fenced_at"].as_str().expect("fenced").to_owned();
    assert!(
        blocklist().contains(&fenced_at),
        "{fenced_at}: {}",
        blocklist()
    );

    let refused = qemu_io(&first_sock, "write -P 0xcc 0 64k");
    assert!(
        refused.contains("write failed"),
        "the fenced writer: {refused}"
    );
    let second = serve(&f, &image, "second.sock", &[]);
    let wrote = qemu_io(&second_sock, "write -P 0xbb 64k 64k");
    assert!(wrote.contains("wrote 65536/65536"), "{wrote}");
    let refused = qemu_io(&first_sock, "write -P 0xcc 64k 64k");
    assert!(
        refused.contains("write failed"),
        "the fenced writer: {refused}"
    );
    for (command, what) in [
        (
            "read -P 0xaa 0 64k",
            "what the first wrote before it was fenced",
        ),
        ("read -P 0xbb 64k 64k", "what the second wrote"),
    ] {
        let read = qemu_io(&second_sock, command);
        assert!(
            read.contains("read 65536/65536") && !read.contains("verification failed"),
            "{what}: {read}"
        );
    }
    // The fenced server stops with an error (exit 1): its clients' writes were refused since
    // the break, which a clean stop ("flushed and closed", exit 0) hid.
    signal(&first.0, "-TERM");
    assert_eq!(first.0.wait().unwrap().code(), Some(1));

    // The text form says what it did, and how to lift the blocklisting.
    let text = ok(&["lock", "break", &image, "--yes"]);
    assert!(
        text.contains("fenced client.")
            && text.contains("ceph osd blocklist rm")
            && text.contains("and broke its writer lock"),
        "{text}"
    );
    let refused = qemu_io(&second_sock, "write -P 0xdd 0 4k");
    assert!(
        refused.contains("write failed"),
        "the fenced second writer: {refused}"
    );
    drop(second);
}

/// A cephx user that may not blocklist clients cannot fence: `lock break` refuses, leaves the
/// lock in place and names `--no-fence`, which then breaks it without fencing.
#[test]
fn a_break_that_cannot_fence_is_refused_and_names_no_fence() {
    let Some(pool) = pool() else {
        return;
    };
    let f = Fixture::new();
    let image = format!("rados://{pool}/nofence-{}", std::process::id());
    let _cleanup = create(&f, &image);
    let client = format!("ivdisk-test-nofence-{}", std::process::id());
    let (_client, keyring) = ceph_client(&f, &client, "allow r", &format!("allow rwx pool={pool}"));
    let as_client = format!("{image}?id={client}&keyring={}", p(&keyring));

    let writer = serve(&f, &image, "writer.sock", &[]);
    let refused = fails(&["lock", "break", &as_client, "--yes"]);
    assert!(
        refused.contains(&format!("client.{client} may not blocklist"))
            && refused.contains("the lock was left in place")
            && refused.contains("--no-fence"),
        "{refused}"
    );
    let status = json(&["lock", "status", &image]);
    let holder = status["lock"]["description"].as_str().unwrap_or_default();
    assert!(
        holder.contains(&format!("ivdisk pid {} on", writer.0.id())),
        "{status}"
    );

    let broken = json(&["lock", "break", &as_client, "--yes", "--no-fence"]);
    assert!(broken["fenced_at"].is_null(), "{broken}");
    assert!(broken["broken"]["client"].is_string(), "{broken}");
    assert!(json(&["lock", "status", &image])["lock"].is_null());
    drop(writer);
}

/// A writer that does not answer but still watches the header (paused, as a VM host or a
/// stopped container pauses one) keeps its lock: the next writer is refused, naming it, and
/// the paused one writes on once it runs again (it was fenced after 5 s, and every request of
/// its clients failed from then on). Once the OSDs drop its watch it is gone: then the next
/// writer fences it and takes its lock, and once the paused one runs again nothing it sends
/// is applied. One killed on this host is taken over at once, without waiting for its watch.
#[test]
fn a_silent_writer_is_fenced_only_once_it_is_gone() {
    let Some(pool) = pool() else {
        return;
    };
    let f = Fixture::new();
    let image = format!("rados://{pool}/silent-{}", std::process::id());
    let _cleanup = create(&f, &image);
    let socket = |name: &str| f.path(name);
    let holder_at = || {
        let status = json(&["lock", "status", &image]);
        status["lock"]["address"]
            .as_str()
            .expect("an address")
            .to_owned()
    };

    let mut paused = serve(&f, &image, "paused.sock", &[]);
    let wrote = qemu_io(&socket("paused.sock"), "write -P 0xaa 0 64k");
    assert!(wrote.contains("wrote 65536/65536"), "{wrote}");
    let paused_at = holder_at();
    signal(&paused.0, "-STOP");
    // Paused for seconds: still watching, so it keeps its lock.
    // (Under `timeout`: a server that took the lock would serve on.)
    let out = Command::new("timeout")
        .args(["60", env!("CARGO_BIN_EXE_ivdisk"), "serve", &image])
        .args(["--passphrase-file", p(&f.pw)])
        .args(["--socket", p(&socket("refused.sock"))])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let refused = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{refused}");
    assert!(
        refused.contains("is open for writing by") && refused.contains("still connected"),
        "{refused}"
    );
    assert!(!blocklist().contains(&paused_at), "{}", blocklist());
    signal(&paused.0, "-CONT");
    let wrote = qemu_io(&socket("paused.sock"), "write -P 0xaa 0 64k");
    assert!(
        wrote.contains("wrote 65536/65536"),
        "after the pause: {wrote}"
    );
    // Paused past the OSDs' watch timeout (30 s here): gone, fenced, its lock taken.
    signal(&paused.0, "-STOP");
    std::thread::sleep(Duration::from_secs(36));
    let started = std::time::Instant::now();
    let mut next = serve(&f, &image, "next.sock", &[]);
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(20),
        "took {took:?}, as if waiting for the lock's expiry"
    );
    assert!(
        blocklist().contains(&paused_at),
        "{paused_at}: {}",
        blocklist()
    );
    signal(&paused.0, "-CONT");
    let refused = qemu_io(&socket("paused.sock"), "write -P 0xcc 0 64k");
    assert!(
        refused.contains("write failed"),
        "the paused writer: {refused}"
    );
    let wrote = qemu_io(&socket("next.sock"), "write -P 0xbb 64k 64k");
    assert!(wrote.contains("wrote 65536/65536"), "{wrote}");
    for command in ["read -P 0xaa 0 64k", "read -P 0xbb 64k 64k"] {
        let read = qemu_io(&socket("next.sock"), command);
        assert!(
            read.contains("read 65536/65536") && !read.contains("verification failed"),
            "{command}: {read}"
        );
    }
    // Fenced, it stops with an error: its clients' writes were refused since.
    signal(&paused.0, "-TERM");
    assert_eq!(paused.0.wait().unwrap().code(), Some(1));

    // Killed on this host: its process is gone, so it is fenced at once, without waiting
    // for its watch to time out; what it acknowledged stays.
    let killed_at = holder_at();
    signal(&next.0, "-KILL");
    let _ = next.0.wait();
    let started = std::time::Instant::now();
    let last = serve(&f, &image, "last.sock", &[]);
    let took = started.elapsed();
    assert!(
        took < Duration::from_secs(20),
        "took {took:?}, as if waiting for the killed writer's watch"
    );
    assert!(
        blocklist().contains(&killed_at),
        "{killed_at}: {}",
        blocklist()
    );
    let read = qemu_io(&socket("last.sock"), "read -P 0xbb 64k 64k");
    assert!(
        read.contains("read 65536/65536") && !read.contains("verification failed"),
        "{read}"
    );
    drop(last);
}

/// On RADOS too, a shrink or a rollback of an image that a read-only open reads is refused,
/// naming the reader's process, while a reader of a snapshot does not hold them up; once the
/// head's reader stops, both go and readers open again at once (the record that held them
/// off is removed).
#[test]
fn a_head_reader_holds_off_shrinks_and_rollbacks() {
    let Some(pool) = pool() else {
        return;
    };
    let f = Fixture::new();
    let name = format!("shrink-readers-{}", std::process::id());
    let image = format!("rados://{pool}/{name}");
    let _cleanup = create(&f, &image);
    let kept = format!("{image}@kept");
    ok(&["snap", "create", &kept]);
    let shrink = [
        "resize",
        &image,
        "--size",
        "4M",
        "--allow-shrink",
        "--passphrase-file",
        p(&f.pw),
    ];
    let head = serve(&f, &image, "head.sock", &["--read-only"]);
    let pid = head.0.id();
    for (what, args) in [
        ("resize", &shrink[..]),
        ("rollback", &["snap", "rollback", &kept][..]),
    ] {
        let refused = fails(args);
        assert!(
            refused.contains(&format!("open read-only by process {pid} on host")),
            "{what}: {refused}"
        );
    }
    assert_eq!(json(&["info", &image])["size"], 8u64 << 20);
    let mut head = head;
    signal(&head.0, "-TERM");
    assert!(head.0.wait().unwrap().success());
    let snapshot = serve(&f, &kept, "kept.sock", &[]);
    ok(&shrink);
    assert_eq!(json(&["info", &image])["size"], 4u64 << 20);
    ok(&["snap", "rollback", &kept]);
    assert_eq!(json(&["info", &image])["size"], 8u64 << 20);
    // The head opens for reading again at once. Stopped as users stop them, the readers
    // unregister their watches (the cleanup's delete then goes at once).
    for mut reader in [serve(&f, &image, "again.sock", &["--read-only"]), snapshot] {
        signal(&reader.0, "-TERM");
        assert!(reader.0.wait().unwrap().success());
    }
}

/// A delete on a healthy cluster says nothing of lost watches: the writer lock's watch on the
/// header object is given up before that object is removed (the OSD dropped it with the
/// object, and librados' report read as a sick cluster: two warnings on every delete).
#[test]
fn a_delete_warns_of_no_lost_watch() {
    let Some(pool) = pool() else {
        return;
    };
    let f = Fixture::new();
    let image = format!("rados://{pool}/cli-delete-quiet-{}", std::process::id());
    let cleanup = create(&f, &image);
    let out = common::ivdisk(&["delete", &image, "--yes"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(!stderr.contains("watch"), "{stderr}");
    drop(cleanup);
}
