//! `ivdisk backup` and `ivdisk restore` as a user runs them: the built binary on local-backend
//! images in a temporary directory. A backup restored into a new directory exports the same
//! plaintext with the same passphrase; a snapshot's backup restores the snapshot; an increment
//! brings a restored image to a newer snapshot; a damaged file is refused with exit code 1 and
//! nothing is created.

use std::path::PathBuf;

use ivdisk_image::{Image, ImageUri, OpenOptions};
use serde_json::Value;

mod common;

use common::{fails, ivdisk, json, ok, ok_bytes, p, random, Fixture, FAST};

const OBJECT: u64 = 64 << 10;

/// 10 objects: objects 0, 4 (its first 1000 bytes) and 8 random, the rest zeros.
fn raw_disk(seed: u64) -> Vec<u8> {
    let o = OBJECT as usize;
    let mut disk = vec![0u8; 10 * o];
    disk[..o].copy_from_slice(&random(o, seed));
    disk[4 * o..4 * o + 1000].copy_from_slice(&random(1000, seed + 1));
    disk[8 * o..9 * o].copy_from_slice(&random(o, seed + 2));
    disk
}

impl Fixture {
    /// `ivdisk import` of `content` into the new local image `NAME` (64 KiB objects).
    fn imported(&self, name: &str, content: &[u8], cipher: &str) -> PathBuf {
        let raw = self.file(&format!("{name}.raw"), content);
        let image = self.path(name);
        let mut args = vec!["import", p(&raw), p(&image), "--object-size", "64K"];
        args.extend(["--cipher", cipher, "--passphrase-file", p(&self.pw)]);
        args.extend(FAST);
        ok(&args);
        image
    }

    /// The plaintext of an image (or `IMAGE@SNAP`), through `ivdisk export`.
    fn exported(&self, image: &str, name: &str) -> Vec<u8> {
        let out = self.path(name);
        ok_bytes(&["export", image, p(&out), "--passphrase-file", p(&self.pw)]);
        std::fs::read(&out).unwrap()
    }
}

fn hex64(v: &Value) -> bool {
    v.as_str()
        .is_some_and(|s| s.len() == 64 && s.bytes().all(|b| b.is_ascii_hexdigit()))
}

#[test]
fn a_backup_restores_into_a_new_directory_and_reads_the_same() {
    let fx = Fixture::new();
    let disk = raw_disk(11);
    let image = fx.imported("disk.ivd", &disk, "aes-gcm-random");
    let file = fx.path("disk.ivdbak");
    let made = json(&["backup", p(&image), p(&file)]);
    assert_eq!(made["kind"], "full");
    assert_eq!(made["image"], p(&image));
    assert_eq!(made["file"], p(&file));
    assert_eq!(made["size"], 10 * OBJECT);
    // Named as create, info, import and convert name it.
    assert_eq!(made["cipher"], "aes-gcm-random", "{made}");
    assert_eq!(made["objects"], 3, "{made}");
    assert_eq!(made["removed"], 0);
    assert_eq!(made["bytes"], std::fs::metadata(&file).unwrap().len());
    // The header's keyslots are in it: for the owner only.
    let mode =
        std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&file).unwrap().permissions());
    assert_eq!(mode & 0o777, 0o600);
    assert!(made["data_bytes"].as_u64().unwrap() >= 2 * OBJECT + 1000);
    assert!(made["seconds"].is_f64());
    assert!(hex64(&made["sha256"]), "{made}");
    assert!(made["snapshot"].is_null() && made["base"].is_null());
    let partials: Vec<_> = std::fs::read_dir(fx.path("."))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.starts_with("disk.ivdbak.partial"))
        .collect();
    assert!(partials.is_empty(), "{partials:?}");

    let copy = fx.path("copy.ivd");
    let restored = json(&["restore", p(&file), p(&copy)]);
    assert_eq!(restored["sha256"], made["sha256"]);
    assert_eq!(restored["objects"], 3);
    assert_eq!(restored["image"], p(&copy));
    assert_eq!(restored["kind"], "full");
    assert_eq!(fx.exported(p(&copy), "copy.raw"), disk);
    assert_eq!(fx.exported(p(&image), "disk.out"), disk);
    let (a, b) = (json(&["info", p(&image)]), json(&["info", p(&copy)]));
    assert_eq!(a["image_id"], b["image_id"]);
    assert_eq!(a["cipher"], b["cipher"]);
    assert_eq!(a["size"], b["size"]);

    // Again into the same directory: refused, the image is there.
    let err = fails(&["restore", p(&file), p(&copy)]);
    assert!(err.contains("already exists"), "{err}");
    // An existing backup file needs --force.
    let err = fails(&["backup", p(&image), p(&file)]);
    assert!(err.contains("--force"), "{err}");
    ok(&["backup", p(&image), p(&file), "--force"]);
}

#[test]
fn a_damaged_file_is_refused_and_nothing_is_left() {
    let fx = Fixture::new();
    let image = fx.imported("disk.ivd", &raw_disk(5), "aegis128l-random");
    let file = fx.path("disk.ivdbak");
    ok(&["backup", p(&image), p(&file)]);
    let good = std::fs::read(&file).unwrap();
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("flipped", {
            let mut b = good.clone();
            let at = b.len() * 2 / 3;
            b[at] ^= 0x10;
            b
        }),
        ("truncated", good[..good.len() - 30].to_vec()),
        ("flipped in the description", {
            let mut b = good.clone();
            b[40] ^= 1;
            b
        }),
    ];
    for (what, bytes) in cases {
        let bad = fx.file("bad.ivdbak", &bytes);
        let target = fx.path("target.ivd");
        let out = ivdisk(&["restore", p(&bad), p(&target), "--json"]);
        assert_eq!(out.status.code(), Some(1), "{what}");
        // With --json a failure is a JSON error object on stdout too (and text on stderr).
        let report: Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("{what}: no JSON error on stdout ({e}): {out:?}"));
        assert_eq!(report["ok"], false, "{what}: {report}");
        assert!(
            report["error"]
                .as_str()
                .is_some_and(|e| e.contains("nothing was restored")),
            "{what}: {report}"
        );
        let err = String::from_utf8(out.stderr).unwrap();
        assert!(err.contains("nothing was restored"), "{what}: {err}");
        assert!(!target.exists(), "{what}: the target directory was created");
    }
    let err = fails(&[
        "restore",
        p(&fx.file("zeros", &[0u8; 100])),
        p(&fx.path("t2")),
    ]);
    assert!(err.contains("not an ivdisk backup"), "{err}");
}

#[test]
fn snapshots_and_increments() {
    let fx = Fixture::new();
    let disk = raw_disk(21);
    let image = fx.imported("disk.ivd", &disk, "aegis128l-random");
    let at = |snap: &str| format!("{}@{snap}", p(&image));
    ok(&["snap", "create", &at("one")]);
    // Change the image after "one": an object rewritten, a bigger size.
    let patch = random(5000, 99);
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let uri = ImageUri::parse(p(&image)).unwrap();
        let opened = Image::open(&uri, b"correct horse", &OpenOptions::default())
            .await
            .unwrap();
        opened.write(4 * OBJECT + 100, &patch).await.unwrap();
        opened.resize(12 * OBJECT, false).await.unwrap();
        opened.close().await.unwrap();
    });
    ok(&["snap", "create", &at("two")]);

    let one = fx.path("one.ivdbak");
    let made = json(&["backup", &at("one"), p(&one)]);
    assert_eq!(made["snapshot"], "one");
    assert_eq!(made["size"], 10 * OBJECT, "the snapshot's size");
    let inc = fx.path("one-two.ivdbak");
    let made_inc = json(&["backup", &at("two"), p(&inc), "--since", "one"]);
    assert_eq!(made_inc["kind"], "incremental");
    assert_eq!(made_inc["base"]["snapshot"], "one");
    assert_eq!(made_inc["objects"], 1, "{made_inc}");
    assert!(made_inc["bytes"].as_u64().unwrap() < made["bytes"].as_u64().unwrap());
    // --since without IMAGE@SNAP is a mistake.
    let err = fails(&["backup", p(&image), p(&fx.path("x")), "--since", "one"]);
    assert!(err.contains("IMAGE@SNAP"), "{err}");

    // An increment onto no image: says to restore the full backup first (and makes nothing).
    let nowhere = fx.path("nowhere.ivd");
    let err = fails(&["restore", p(&inc), p(&nowhere)]);
    assert!(err.contains("incremental backup"), "{err}");
    assert!(err.contains("restore the full backup"), "{err}");
    assert!(!nowhere.exists());
    // Standard output is no backup file.
    let err = fails(&["backup", &at("one"), "-"]);
    assert!(err.contains("not to standard output"), "{err}");

    let copy = fx.path("copy.ivd");
    ok(&["restore", p(&one), p(&copy)]);
    assert_eq!(fx.exported(p(&copy), "copy1.raw"), disk);
    let applied = json(&["restore", p(&inc), p(&copy)]);
    assert_eq!(applied["kind"], "incremental");
    let mut expected = disk.clone();
    expected.resize(12 * OBJECT as usize, 0);
    let at_patch = 4 * OBJECT as usize + 100;
    expected[at_patch..at_patch + patch.len()].copy_from_slice(&patch);
    assert_eq!(fx.exported(p(&copy), "copy2.raw"), expected);
    assert_eq!(fx.exported(&at("two"), "two.raw"), expected);
    // Twice: the copy is at "two" now.
    let err = fails(&["restore", p(&inc), p(&copy)]);
    assert!(err.contains("does not apply"), "{err}");
}

#[test]
fn help_shows_examples() {
    for command in ["backup", "restore"] {
        let help = ok(&[command, "--help"]);
        assert!(help.contains("Examples:"), "{command}: {help}");
        assert!(help.contains("--json"), "{command}: {help}");
    }
}

/// A backup killed outright (SIGKILL, a crash) leaves its FILE.partial.PID behind, up to the
/// image's size; the next backup to FILE removes it. One whose backup still runs (it holds
/// its lock) stays, and so does another file's.
#[test]
fn a_backup_removes_the_partial_files_of_killed_backups() {
    let fx = Fixture::new();
    let image = fx.imported("small.ivd", &random(1 << 20, 5), "aegis128l-random");
    let file = fx.path("small.ivdbak");
    let partial = |name: &str, pid: u32| {
        let path = fx.path(&format!("{name}.partial.{pid}"));
        std::fs::write(&path, [7u8; 4096]).unwrap();
        path
    };
    // Process ids no process has (above the kernel's largest, 4194304).
    let abandoned = partial("small.ivdbak", 4_194_400);
    let running = partial("small.ivdbak", 4_194_401);
    let held = std::fs::File::open(&running).unwrap();
    held.try_lock().unwrap();
    let other = partial("other.ivdbak", 4_194_402);
    ok(&["backup", p(&image), p(&file)]);
    assert!(file.exists());
    assert!(!abandoned.exists(), "a killed backup's partial file stayed");
    assert!(
        running.exists(),
        "a running backup's partial file was removed"
    );
    assert!(other.exists(), "another file's partial file was removed");
}

/// A full restore killed outright (SIGKILL) while it writes leaves an image that says it is
/// unfinished, which `ivdisk delete` removes; the restore then runs again. It wrote the
/// header last, so a killed one left hundreds of megabytes of data objects that no command
/// saw or removed, and the next restore was refused over them.
#[test]
fn a_restore_killed_part_way_is_deleted_and_run_again() {
    use std::os::unix::fs::MetadataExt;
    let fx = Fixture::new();
    let disk = random(128 << 20, 41);
    let image = fx.imported("big.ivd", &disk, "aegis128l-random");
    let file = fx.path("big.ivdbak");
    ok(&["backup", p(&image), p(&file)]);
    let target = fx.path("restored.ivd");
    let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_ivdisk"))
        .args(["restore", p(&file), p(&target)])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    // Killed once its data objects are being written (the whole file is checked first).
    let segment = target.join("data").join("seg-00000001");
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(120);
    while !std::fs::metadata(&segment).is_ok_and(|m| m.blocks() * 512 > 8 << 20) {
        if let Some(status) = child.try_wait().unwrap() {
            panic!("the restore ended ({status}) before it was killed");
        }
        assert!(std::time::Instant::now() < deadline, "no data written");
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    child.kill().unwrap();
    child.wait().unwrap();
    let out = fx.path("unfinished.raw");
    let err = fails(&[
        "export",
        p(&target),
        p(&out),
        "--passphrase-file",
        p(&fx.pw),
    ]);
    assert!(err.contains("has not finished"), "{err}");
    assert!(err.contains("ivdisk delete"), "{err}");
    ok(&["delete", p(&target), "--yes"]);
    ok(&["restore", p(&file), p(&target)]);
    assert!(fx.exported(p(&target), "restored.raw") == disk);
}

/// A FIFO given as the backup file of `restore`, or as the raw disk of `import`, is refused
/// at once and nothing is created: opening it waited for a writer, for ever and deaf to
/// Ctrl-C (and `restore` had made the target's directory first).
#[test]
fn a_fifo_is_refused_as_a_source() {
    let fx = Fixture::new();
    let fifo = fx.path("pipe");
    let made = std::process::Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap();
    assert!(made.success());
    let target = fx.path("from-fifo.ivd");
    for args in [
        vec!["restore", p(&fifo), p(&target)],
        vec![
            "import",
            p(&fifo),
            p(&target),
            "--passphrase-file",
            p(&fx.pw),
        ],
    ] {
        let mut child = std::process::Command::new(env!("CARGO_BIN_EXE_ivdisk"))
            .args(&args)
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
        let status = loop {
            if let Some(status) = child.try_wait().unwrap() {
                break status;
            }
            if std::time::Instant::now() > deadline {
                child.kill().unwrap();
                child.wait().unwrap();
                panic!("{args:?} waited on the FIFO");
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        };
        let mut err = String::new();
        std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
        assert_eq!(status.code(), Some(1), "{args:?}: {err}");
        assert!(err.contains("is not a regular file"), "{args:?}: {err}");
        assert!(!target.exists(), "{args:?} created the target");
    }
}

/// A backup file named inside the image's own store is refused, also with `--force`, and the
/// image is untouched: over `meta.sqlite` a backup destroyed the image, said it had made a
/// backup, and the next open of the store wrecked that backup too.
#[test]
fn a_backup_into_its_own_store_is_refused() {
    let fx = Fixture::new();
    let disk = random(1 << 20, 7);
    let image = fx.imported("own.ivd", &disk, "aegis128l-random");
    ok(&["snap", "create", &format!("{}@s", p(&image))]);
    for (target, force) in [
        (image.join("meta.sqlite"), true),
        (image.join("data").join("seg-00000001"), true),
        (image.join("new.ivdbak"), false),
    ] {
        for source in [p(&image).to_owned(), format!("{}@s", p(&image))] {
            let mut args = vec!["backup", source.as_str(), p(&target)];
            if force {
                args.push("--force");
            }
            let err = fails(&args);
            assert!(err.contains("a file of its store"), "{err}");
        }
    }
    assert!(!image.join("new.ivdbak").exists());
    assert_eq!(fx.exported(p(&image), "own.raw"), disk);
}

/// Ctrl-C (SIGINT), SIGTERM, SIGHUP (a closed terminal) or SIGQUIT amid a backup: it stops,
/// and its FILE.partial is removed, as
/// after a failed backup (killed outright, the process left it behind); no FILE either.
/// The signal comes at a few moments; whichever the backup had reached, the file is either
/// complete (restore checks its digest) or absent.
#[test]
fn a_signal_amid_a_backup_leaves_no_partial_file() {
    let fx = Fixture::new();
    let disk = random(256 << 20, 31);
    let image = fx.imported("big.ivd", &disk, "aegis128l-random");
    let mut interrupted = 0;
    for (round, delay_ms) in [100u64, 200, 350, 600, 1000].into_iter().enumerate() {
        let signal = ["-INT", "-TERM", "-HUP", "-QUIT"][round % 4];
        let file = fx.path(&format!("big-{round}.ivdbak"));
        let child = std::process::Command::new(env!("CARGO_BIN_EXE_ivdisk"))
            .args(["backup", p(&image), p(&file)])
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        std::thread::sleep(std::time::Duration::from_millis(delay_ms));
        let _ = std::process::Command::new("kill")
            .args([signal, &child.id().to_string()])
            .status();
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        // FILE.partial.PID, of the child's process id.
        let prefix = format!("big-{round}.ivdbak.partial.");
        let partials: Vec<_> = std::fs::read_dir(fx.path(""))
            .unwrap()
            .map(|entry| entry.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|name| name.starts_with(&prefix))
            .collect();
        assert!(
            partials.is_empty(),
            "round {round} ({signal}): {partials:?} left; {err}"
        );
        if out.status.success() {
            // (Also when the signal came after the file was renamed into place: it is made.)
            let restored = fx.path(&format!("restored-{round}.ivd"));
            ok(&["restore", p(&file), p(&restored)]);
        } else if out.status.code().is_some() {
            assert_eq!(out.status.code(), Some(1), "round {round}: {err}");
            assert!(err.contains("interrupted"), "{err}");
            assert!(!file.exists(), "round {round}: {err}");
            interrupted += 1;
        } else {
            // Killed before it took the signals over, which it does before it writes.
            assert!(!file.exists(), "round {round}");
        }
    }
    assert!(interrupted > 0, "every backup ended before its signal");
    // The image's writer lock went with each stopped backup.
    assert!(json(&["info", p(&image)])["lock"].is_null());
}
