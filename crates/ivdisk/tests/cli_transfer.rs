//! `ivdisk import`, `export`, `verify`, `passphrase` and `header backup|restore` on images, as
//! a user runs them: the built binary on local-backend images in a temporary directory,
//! passphrase files, exit codes and messages. Damage is done the way anyone with access to
//! the store can: through the store API on the image's objects, while no ivdisk process has
//! the store open. cryptsetup judges what `ivdisk passphrase` does to its LUKS2 files.

use std::os::unix::fs::{MetadataExt, PermissionsExt};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use ivdisk_image::{Image, ImageUri, OpenOptions};
use ivdisk_store::{ObjectName, ObjectStoreExt, OmapPairs, WriteOp};
use serde_json::Value;

mod common;

use common::{
    cryptsetup, exits, fails, ivdisk, json, ok, ok_bytes, p, random, Fixture, DIE_HOLDING_LOCK,
    FAST,
};

/// 16 sectors of 4096 bytes per object: small images still span many objects.
const OBJECT: u64 = 64 << 10;
const SECTOR: u64 = 4096;

/// A raw disk of 10 objects and a partial 11th (12345 bytes: not a multiple of the object
/// or the sector size): objects 0 and 8 and the tail random, object 4 random in its first
/// 1000 bytes, the rest zeros.
fn raw_disk(seed: u64) -> Vec<u8> {
    let mut disk = vec![0u8; (10 * OBJECT + 12345) as usize];
    let o = OBJECT as usize;
    disk[..o].copy_from_slice(&random(o, seed));
    disk[4 * o..4 * o + 1000].copy_from_slice(&random(1000, seed + 1));
    disk[8 * o..9 * o].copy_from_slice(&random(o, seed + 2));
    disk[10 * o..].copy_from_slice(&random(12345, seed + 3));
    disk
}

impl Fixture {
    /// `ivdisk import` of `content` (as the file `NAME.raw`) into the new image `NAME`, with
    /// 64 KiB objects and a fast keyslot. Returns the image and import's JSON.
    fn import(&self, name: &str, content: &[u8]) -> (PathBuf, Value) {
        let raw = self.file(&format!("{name}.raw"), content);
        let image = self.path(name);
        let mut args = vec!["import", p(&raw), p(&image), "--object-size", "64K"];
        args.extend(["--passphrase-file", p(&self.pw)]);
        args.extend(FAST);
        let report = json(&args);
        (image, report)
    }

    /// `ivdisk export IMAGE FILE` with the fixture's passphrase; returns the file's bytes.
    fn export(&self, image: &Path, name: &str) -> (PathBuf, Vec<u8>) {
        let out = self.path(name);
        ok_bytes(&[
            "export",
            p(image),
            p(&out),
            "--passphrase-file",
            p(&self.pw),
        ]);
        let bytes = std::fs::read(&out).unwrap();
        (out, bytes)
    }
}

fn info(image: &Path) -> Value {
    json(&["info", p(image)])
}

/// Run `work` on the image's store (opened read-only with `passphrase`) in this process, then
/// close it again so the next ivdisk process can open the store.
fn with_store(image: &Path, passphrase: &[u8], work: impl AsyncFnOnce(&Image)) {
    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let uri = ImageUri::parse(p(image)).unwrap();
        // A read-write store held open first: the read-only image below shares it (a
        // read-only open alone gets a store that refuses writes), and takes no writer lock.
        let _writable = uri.open_store(false).await.unwrap();
        let opened = Image::open(&uri, passphrase, &OpenOptions::read_only())
            .await
            .unwrap();
        work(&opened).await;
        opened.store().flush().await.unwrap();
        opened.close().await.unwrap();
    });
}

/// Flip one byte of a stored object.
async fn flip(image: &Image, object: &ObjectName, at: u64) {
    let store = image.store();
    let mut byte = store.read(object, at, 1).await.unwrap();
    assert_eq!(byte.len(), 1, "{object} holds byte {at}");
    byte[0] ^= 0x40;
    store.write(object, at, &byte).await.unwrap();
}

/// Flip one byte of an omap value of a stored object.
async fn flip_omap(image: &Image, object: &ObjectName, key: &[u8], at: usize) {
    let store = image.store();
    let pairs = store.omap_all(object).await.unwrap();
    let (_, mut value) = pairs
        .into_iter()
        .find(|(k, _)| k == key)
        .unwrap_or_else(|| panic!("{object} has no omap key {key:?}"));
    assert!(at < value.len(), "{object}'s value {key:?} holds byte {at}");
    value[at] ^= 0x40;
    let mut pairs = OmapPairs::new();
    pairs.push(key, &value);
    store
        .write_op(object, WriteOp::new().omap_set(pairs))
        .await
        .unwrap();
}

#[test]
fn import_then_export_gives_the_same_bytes_with_holes() {
    let f = Fixture::new();
    let disk = raw_disk(1);
    let (image, imported) = f.import("disk", &disk);
    let size = disk.len() as u64;
    let rounded = size.div_ceil(SECTOR) * SECTOR;
    assert_eq!(imported["bytes"], size);
    assert_eq!(imported["size"], rounded);
    assert!(imported["seconds"].as_f64().unwrap() >= 0.0);
    // Objects 0 and 8, the sector of object 4 that holds data and the tail (padded to whole
    // sectors) are written; zero sectors are not, also within a chunk that holds data.
    let tail = 12345u64.div_ceil(SECTOR) * SECTOR;
    assert_eq!(imported["bytes_written"], 2 * OBJECT + SECTOR + tail);
    let shown = info(&image);
    assert_eq!(shown["size"], rounded);
    assert_eq!(shown["object_size"], OBJECT);
    // The report says what was made, as info does.
    for field in ["cipher", "layout", "sector_size"] {
        assert_eq!(
            imported[field], shown[field],
            "{field}: {imported} vs {shown}"
        );
    }
    assert_eq!(imported["cipher"], "aegis128l-random");

    let (out, exported) = f.export(&image, "out.raw");
    assert_eq!(exported.len() as u64, rounded);
    // Plaintext: for its owner only.
    assert_eq!(std::fs::metadata(&out).unwrap().mode() & 0o777, 0o600);
    assert!(
        exported[..disk.len()] == disk[..],
        "the export differs from the imported file"
    );
    assert!(exported[disk.len()..].iter().all(|&b| b == 0));
    // The seven zero objects are holes in the export (allocated or not in the image).
    let allocated = std::fs::metadata(&out).unwrap().blocks() * 512;
    assert!(
        allocated + 7 * OBJECT / 2 <= rounded,
        "{allocated} bytes allocated for a {rounded}-byte export with 7 empty objects"
    );

    // Standard output gets every byte, zeros included, and nothing else (the report goes to
    // standard error).
    let out_dash = ivdisk(&[
        "export",
        p(&image),
        "-",
        "--passphrase-file",
        p(&f.pw),
        "--json",
    ]);
    assert!(out_dash.status.success());
    assert!(
        out_dash.stdout == exported,
        "export to standard output differs"
    );
    let report: Value = serde_json::from_slice(&out_dash.stderr).unwrap();
    assert_eq!(report["sparse"], false);
    assert_eq!(report["bytes_written"], rounded);

    // An existing file is left alone unless --force.
    let err = fails(&["export", p(&image), p(&out), "--passphrase-file", p(&f.pw)]);
    assert!(err.contains("exists") && err.contains("--force"), "{err}");
    std::fs::write(&out, b"old").unwrap();
    // The file replaced keeps the permissions its user gave it (a new export gets 0600).
    assert_eq!(mode(&out_new_mode(&f, &image)), 0o600);
    std::fs::set_permissions(&out, std::fs::Permissions::from_mode(0o640)).unwrap();
    let report = json(&export_over(&image, &out, &f.pw));
    assert_eq!(report["size"], rounded);
    assert_eq!(report["sparse"], true);
    assert!(std::fs::read(&out).unwrap() == exported);
    assert_eq!(mode(&out), 0o640, "--force changed the file's permissions");

    // An existing image is left alone by import.
    let raw = f.path("disk.raw");
    let mut args = vec!["import", p(&raw), p(&image), "--passphrase-file", p(&f.pw)];
    args.extend(FAST);
    let err = fails(&args);
    assert!(err.contains("already exists"), "{err}");
    assert_eq!(info(&image)["image_id"], shown["image_id"]);
}

/// A sparse file of 1 TiB and a bit, with data in three places (one crossing a chunk
/// boundary, one ending the file mid-sector): import reads only what the file system says is
/// data (it read every hole before: a minute per 64 GiB), the export gives those bytes back,
/// sparse too, and so does convert.
#[test]
fn a_sparse_terabyte_imports_without_reading_its_holes() {
    use std::os::unix::fs::FileExt;
    let f = Fixture::new();
    let len = (1u64 << 40) + 5000;
    let pieces: [(u64, Vec<u8>); 3] = [
        (0, random(1000, 7)),
        ((5 << 30) + (4 << 20) - 12345, random(100_000, 8)),
        (len - 3000, random(3000, 9)),
    ];
    let raw = f.path("sparse.raw");
    let file = std::fs::File::create(&raw).unwrap();
    file.set_len(len).unwrap();
    for (at, bytes) in &pieces {
        file.write_all_at(bytes, *at).unwrap();
    }
    drop(file);
    let image = f.path("sparse");
    let mut args = vec!["import", p(&raw), p(&image), "--passphrase-file", p(&f.pw)];
    args.extend(FAST);
    let report = json(&args);
    assert_eq!(report["bytes"], len);
    let written = report["bytes_written"].as_u64().unwrap();
    assert!(
        written <= 4 * (4 << 20),
        "{written} bytes written for 103 KB of data"
    );

    let out = f.path("sparse.out");
    ok_bytes(&["export", p(&image), p(&out), "--passphrase-file", p(&f.pw)]);
    let exported = std::fs::File::open(&out).unwrap();
    assert_eq!(
        exported.metadata().unwrap().len(),
        len.div_ceil(SECTOR) * SECTOR
    );
    assert!(exported.metadata().unwrap().blocks() * 512 <= 64 << 20);
    for (at, bytes) in &pieces {
        // The piece and a little on either side (zeros there).
        let from = at.saturating_sub(100);
        let mut back = vec![0u8; (at - from) as usize + bytes.len() + 100];
        exported.read_exact_at(&mut back, from).unwrap();
        let mut want = vec![0u8; back.len()];
        want[(at - from) as usize..][..bytes.len()].copy_from_slice(bytes);
        assert!(back == want, "the piece at {at} differs after export");
    }

    // convert reads the same holes as holes, and its check does not read back the copy's
    // missing objects (it read 8 s per 64 GiB of them before).
    let converted = f.path("converted");
    let mut args = vec!["convert", p(&raw), p(&converted), "--source-format", "raw"];
    args.extend(["--passphrase-file", p(&f.pw)]);
    args.extend(FAST);
    let report = json(&args);
    assert_eq!(report["verified"], true, "{report}");
}

#[test]
fn import_into_other_formats_and_an_empty_file() {
    let f = Fixture::new();
    let disk = raw_disk(7);
    let raw = f.file("disk.raw", &disk);
    let image = f.path("gcm");
    let mut args = vec!["import", p(&raw), p(&image), "--cipher", "aes-gcm-random"];
    args.extend(["--layout", "omap", "--sector-size", "512"]);
    args.extend(["--object-size", "64K", "--passphrase-file", p(&f.pw)]);
    args.extend(FAST);
    let imported = json(&args);
    // 512-byte sectors: 12345 bytes round up to 12800.
    assert_eq!(imported["size"], 10 * OBJECT + 12800);
    let shown = info(&image);
    assert_eq!(shown["cipher"], "aes-gcm-random");
    assert_eq!(shown["layout"], "omap");
    let (_, exported) = f.export(&image, "gcm.out");
    assert!(exported[..disk.len()] == disk[..]);

    let empty = f.file("empty.raw", b"");
    let none = f.path("none");
    let err = fails(&["import", p(&empty), p(&none), "--passphrase-file", p(&f.pw)]);
    assert!(err.contains("is empty"), "{err}");
    assert!(fails(&["info", p(&none)]).contains("does not exist"));
}

/// An export killed outright (SIGKILL) leaves its hidden partial file of the image's size
/// beside the one it was to write; the next export to that name removes it. One whose export
/// still runs (it holds its lock) stays.
#[test]
fn an_export_removes_the_partial_files_of_killed_exports() {
    let f = Fixture::new();
    let disk = raw_disk(9);
    let (image, _) = f.import("disk", &disk);
    let out = f.path("out.raw");
    let abandoned = f.file(".out.raw.ivdisk-export-4000000", &[1u8; 4096]);
    let running = f.file(".out.raw.ivdisk-export-4000001", &[2u8; 4096]);
    let held = std::fs::File::open(&running).unwrap();
    held.try_lock().unwrap();
    let other = f.file(".other.raw.ivdisk-export-4000002", &[3u8; 4096]);
    ok_bytes(&["export", p(&image), p(&out), "--passphrase-file", p(&f.pw)]);
    assert_eq!(std::fs::read(&out).unwrap()[..disk.len()], disk[..]);
    assert!(!abandoned.exists(), "a killed export's partial file stayed");
    assert!(
        running.exists(),
        "a running export's partial file was removed"
    );
    assert!(other.exists(), "another name's partial file was removed");
}

/// An export or backup onto a directory, a symbolic link or a device is refused before any
/// work, with the reason, also with `--force`: `--force` was suggested for a directory and
/// then failed (a backup's only after the whole copy), and a link was called "not a regular
/// file". Nothing is written there.
#[test]
fn an_output_that_is_no_regular_file_is_refused_with_the_reason() {
    let f = Fixture::new();
    let (image, _) = f.import("disk", &raw_disk(3));
    let dir = f.path("somedir");
    std::fs::create_dir(&dir).unwrap();
    let kept = f.file("kept.raw", b"kept");
    let link = f.path("link.raw");
    std::os::unix::fs::symlink(&kept, &link).unwrap();
    for force in [&[][..], &["--force"][..]] {
        for command in ["export", "backup"] {
            let run = |target: &Path| {
                let mut args = vec![command, p(&image), p(target)];
                if command == "export" {
                    args.extend(["--passphrase-file", p(&f.pw)]);
                }
                args.extend(force);
                fails(&args)
            };
            let err = run(&dir);
            assert!(
                err.contains("is a directory") && !err.contains("--force"),
                "{command} {force:?}: {err}"
            );
            let err = run(&link);
            assert!(
                err.contains("is a symbolic link") && err.contains("kept.raw"),
                "{command} {force:?}: {err}"
            );
            let err = run(Path::new("/dev/null"));
            assert!(
                err.contains("is not a regular file") && !err.contains("--force"),
                "{command} {force:?}: {err}"
            );
        }
    }
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
    assert_eq!(std::fs::read(&kept).unwrap(), b"kept");
    assert!(std::fs::symlink_metadata(&link).unwrap().is_symlink());
}

/// A segment file cut short (damage in the store, not tampering) does not end the verify with
/// a bare read error: the sectors that cannot be read are listed as such, with the store's
/// reason, the rest is checked, and the exit code is 1.
#[test]
fn verify_lists_the_sectors_a_damaged_store_cannot_read() {
    let f = Fixture::new();
    let (image, _) = f.import("disk", &raw_disk(5));
    let segment = image.join("data").join("seg-00000001");
    let len = std::fs::metadata(&segment).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&segment)
        .unwrap()
        .set_len(len - 32 * 1024)
        .unwrap();
    let (out, _) = exits(
        1,
        &["verify", p(&image), "--passphrase-file", p(&f.pw), "--json"],
    );
    let report: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(report["ok"], false, "{out}");
    assert_eq!(report["bad_lbas"], serde_json::json!([]), "{out}");
    let unreadable = report["unreadable"].as_array().unwrap();
    // 32 KiB cut: at least the 8 sectors it held, and not every one of the 52 checked.
    assert!(
        (8..52).contains(&unreadable.len()),
        "{} unreadable: {out}",
        unreadable.len()
    );
    for sector in unreadable {
        assert!(
            sector["reason"].as_str().unwrap().contains("seg-00000001"),
            "{out}"
        );
        assert_eq!(sector["offset"], sector["lba"].as_u64().unwrap() * SECTOR);
    }
    let (text, _) = exits(1, &["verify", p(&image), "--passphrase-file", p(&f.pw)]);
    assert!(
        text.contains(&format!("{} of 52 sector(s)", unreadable.len()))
            && text.contains("cannot be read"),
        "{text}"
    );
    // A run of sectors a line, not a line (and the same long reason) per sector.
    let lines = text.lines().filter(|l| l.starts_with("  LBA")).count();
    assert!(
        lines < unreadable.len() && text.contains(" sectors): "),
        "{lines} lines for {} sectors: {text}",
        unreadable.len()
    );
}

#[test]
fn verify_names_exactly_the_tampered_sectors() {
    let f = Fixture::new();
    let disk = raw_disk(2);
    let (image, _) = f.import("disk", &disk);
    let report = json(&["verify", p(&image), "--passphrase-file", p(&f.pw)]);
    assert_eq!(report["ok"], true);
    assert_eq!(report["bad_lbas"], serde_json::json!([]));
    assert_eq!(report["authenticated"], true);
    // Objects 0, 4, 8 and 10 exist: 16 + 16 + 16 + 4 sectors (the last object is partial;
    // object 4 holds one written sector, the others read as zeros).
    assert_eq!(report["sectors_checked"], 3 * 16 + 4);
    let (text, _) = exits(0, &["verify", p(&image), "--passphrase-file", p(&f.pw)]);
    assert!(text.contains("all authentic"), "{text}");

    // Ciphertext of LBA 3 (object 0) and LBA 131 (object 8, sector 3), the tag of LBA 140
    // (object 8, sector 12), and the nonce of LBA 64 (object 4): omap-packed (the default
    // layout) keeps sector i at i * 4096, the metadata of sectors 0-15 in the omap value of
    // key "00000000", and import seals each 16-sector object in one run, so that value is
    // compact (the first sector's nonce and tag, then the other 15 sectors' tags); object 4's
    // one sector leads its value either way.
    assert_eq!(info(&image)["layout"], "omap-packed");
    with_store(&image, b"correct horse", async |image| {
        let ml = image.suite().metadata_len();
        let nl = image.suite().counted_nonce_len();
        let omap = image.store().omap_all(&image.data_object(8)).await;
        assert_eq!(omap.unwrap()[0].1.len(), ml + 15 * (ml - nl));
        flip(image, &image.data_object(0), 3 * SECTOR + 100).await;
        flip(image, &image.data_object(8), 3 * SECTOR).await;
        let tag_of_12 = ml + 11 * (ml - nl);
        flip_omap(image, &image.data_object(8), b"00000000", tag_of_12 + 1).await;
        flip_omap(image, &image.data_object(4), b"00000000", 2).await;
    });
    let (out, _) = exits(
        1,
        &["verify", p(&image), "--passphrase-file", p(&f.pw), "--json"],
    );
    let report: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(report["ok"], false);
    let bad: Vec<u64> = vec![3, 64, 131, 140];
    assert_eq!(report["bad_lbas"], serde_json::json!(bad));
    let offsets: Vec<u64> = bad.iter().map(|lba| lba * SECTOR).collect();
    assert_eq!(report["bad_offsets"], serde_json::json!(offsets));
    let (text, _) = exits(1, &["verify", p(&image), "--passphrase-file", p(&f.pw)]);
    assert!(text.contains("4 of 52 sector(s)"), "{text}");
    // Exit code 1 is not a crash: the store was closed first (its clean-stop marker is there).
    assert!(
        image.join("CLEAN").exists(),
        "verify left the store unclean"
    );
    assert!(
        text.contains(&format!("LBA 131 (byte offset {})", 131 * SECTOR)),
        "{text}"
    );

    // Export refuses to pass damaged data off as the disk, and leaves no partial file.
    let out = f.path("damaged.raw");
    let err = fails(&["export", p(&image), p(&out), "--passphrase-file", p(&f.pw)]);
    assert!(err.contains("integrity check failed"), "{err}");
    // Said once, in the error, not also as log lines (those are for a server's log).
    assert!(!err.contains("ERROR"), "{err}");
    assert!(err.contains("ivdisk verify"), "{err}");
    assert!(!out.exists(), "an incomplete export was left behind");
    // With --force over a file that exists, a failed export leaves that file as it was.
    std::fs::write(&out, b"precious").unwrap();
    let err = fails(&export_over(&image, &out, &f.pw));
    assert!(err.contains("left as it was"), "{err}");
    assert_eq!(std::fs::read(&out).unwrap(), b"precious");
    let leftovers: Vec<_> = std::fs::read_dir(out.parent().unwrap())
        .unwrap()
        .filter_map(|e| e.ok())
        .filter(|e| e.file_name().to_string_lossy().contains("ivdisk-export"))
        .collect();
    assert!(leftovers.is_empty(), "{leftovers:?}");
    // Of a snapshot, the advice names the snapshot: `verify IMAGE` would check the head.
    let at_snapshot = format!("{}@damaged", p(&image));
    ok(&["snap", "create", &at_snapshot]);
    let err = fails(&[
        "export",
        &at_snapshot,
        p(&out),
        "--force",
        "--passphrase-file",
        p(&f.pw),
    ]);
    assert!(
        err.contains(&format!("run `ivdisk verify {at_snapshot}`")),
        "{err}"
    );
    ok(&["snap", "rm", &at_snapshot]);

    // Anything else is exit code 2: a wrong passphrase, a missing image.
    let wrong = f.file("wrong", b"incorrect horse\n");
    let (_, err) = exits(2, &["verify", p(&image), "--passphrase-file", p(&wrong)]);
    assert!(err.contains("no keyslot matches"), "{err}");
    let (_, err) = exits(
        2,
        &[
            "verify",
            p(&f.path("absent")),
            "--passphrase-file",
            p(&f.pw),
        ],
    );
    assert!(err.contains("does not exist"), "{err}");
}

#[test]
fn passphrases_are_added_changed_and_removed() {
    let f = Fixture::new();
    let (image, _) = f.import("disk", &raw_disk(3));
    let two = f.file("two", b"second passphrase\n");
    let three = f.file("three", b"third passphrase");
    let opens = |pw: &Path| ivdisk(&["verify", p(&image), "--passphrase-file", p(pw)]);

    let mut args = vec![
        "passphrase",
        "add",
        p(&image),
        "--passphrase-file",
        p(&f.pw),
    ];
    args.extend(["--new-passphrase-file", p(&two)]);
    args.extend(FAST);
    let added = json(&args);
    assert_eq!(added["keyslot"], 1);
    assert_eq!(added["keyslots"], serde_json::json!([0, 1]));
    assert_eq!(info(&image)["keyslots"], serde_json::json!([0, 1]));
    assert!(opens(&two).status.success());

    // A wrong existing passphrase adds nothing.
    let wrong = f.file("wrong", b"incorrect horse\n");
    let mut args = vec![
        "passphrase",
        "add",
        p(&image),
        "--passphrase-file",
        p(&wrong),
    ];
    args.extend(["--new-passphrase-file", p(&three)]);
    args.extend(FAST);
    let err = fails(&args);
    assert!(
        err.contains("no keyslot matches") && err.contains("nothing was changed"),
        "{err}"
    );
    assert!(!err.contains("incorrect horse"), "the secret leaked: {err}");
    assert_eq!(info(&image)["keyslots"], serde_json::json!([0, 1]));

    // `passphrase test` says which keyslot a passphrase opens, or that none does (on stdout
    // with --json, and by the exit code), changing nothing.
    let tested = json(&[
        "passphrase",
        "test",
        p(&image),
        "--passphrase-file",
        p(&two),
    ]);
    assert_eq!(tested["ok"], true);
    assert_eq!(tested["keyslot"], 1);
    let (out, err) = exits(
        1,
        &[
            "passphrase",
            "test",
            p(&image),
            "--passphrase-file",
            p(&wrong),
            "--json",
        ],
    );
    let refused: Value = serde_json::from_str(&out).unwrap();
    assert_eq!(refused["ok"], false);
    assert_eq!(refused["keyslot"], Value::Null);
    assert!(err.contains("no keyslot matches"), "{err}");
    assert!(!err.contains("incorrect horse") && !out.contains("incorrect horse"));
    // (An error, not the answer "no": exit code 2.)
    let (_, err) = common::exits(2, &["key", "test", p(&image), "--key-file", p(&two)]);
    assert!(err.contains("ivdisk passphrase test"), "{err}");

    // Change: keyslot 1 opens with the third passphrase (a key file, byte for byte), not the
    // second any more.
    let mut args = vec![
        "passphrase",
        "change",
        p(&image),
        "--passphrase-file",
        p(&two),
    ];
    args.extend(["--new-key-file", p(&three)]);
    args.extend(FAST);
    let changed = json(&args);
    assert_eq!(changed["keyslot"], 1);
    assert_eq!(opens(&two).status.code(), Some(2));
    assert!(ivdisk(&["verify", p(&image), "--key-file", p(&three)])
        .status
        .success());

    // Remove the keyslot the first passphrase opens; it stops opening the image.
    let removed = json(&[
        "passphrase",
        "remove",
        p(&image),
        "--passphrase-file",
        p(&f.pw),
    ]);
    assert_eq!(removed["removed"], 0);
    assert_eq!(removed["keyslots"], serde_json::json!([1]));
    assert_eq!(opens(&f.pw).status.code(), Some(2));

    // The last keyslot stays without --force (refused before any passphrase is needed).
    let err = fails(&["passphrase", "remove", p(&image)]);
    assert!(err.contains("last one") && err.contains("--force"), "{err}");
    let err = fails(&[
        "passphrase",
        "remove",
        p(&image),
        "--key-file",
        p(&three),
        "--key-slot",
        "1",
    ]);
    assert!(err.contains("last one"), "{err}");
    assert_eq!(info(&image)["keyslots"], serde_json::json!([1]));
    assert!(ivdisk(&["verify", p(&image), "--key-file", p(&three)])
        .status
        .success());
    // No terminal and no file for the new passphrase: a clear error, nothing asked.
    let err = fails(&["passphrase", "add", p(&image), "--key-file", p(&three)]);
    assert!(err.contains("--new-passphrase-file"), "{err}");
    assert_eq!(info(&image)["keyslots"], serde_json::json!([1]));

    // With --force the last one goes; `info` says nothing opens the image any more.
    let mut args = vec!["passphrase", "remove", p(&image), "--key-file", p(&three)];
    args.push("--force");
    let removed = json(&args);
    assert_eq!(removed["keyslots"], serde_json::json!([]));
    let text = ok(&["info", p(&image)]);
    assert!(text.contains("no passphrase opens this image"), "{text}");
}

#[test]
fn a_header_backup_brings_back_a_destroyed_header() {
    let f = Fixture::new();
    let disk = raw_disk(4);
    let (image, _) = f.import("disk", &disk);
    let id = info(&image)["image_id"].clone();
    let backup = f.path("disk.header");
    let saved = json(&["header", "backup", p(&image), p(&backup)]);
    assert_eq!(saved["image_id"], id);
    assert_eq!(saved["bytes"], 16u64 << 20);
    assert_eq!(std::fs::metadata(&backup).unwrap().len(), 16 << 20);
    // Keyslots: for the owner only.
    assert_eq!(std::fs::metadata(&backup).unwrap().mode() & 0o777, 0o600);
    // A LUKS2 header file: `header dump` reads it and finds the image's parameters.
    let dump: Value =
        serde_json::from_slice(&ok_bytes(&["header", "dump", p(&backup), "--json"])).unwrap();
    assert_eq!(dump["image"]["image_id"], id);
    // `header dump` of the image itself reads its header object: the same header.
    let direct: Value =
        serde_json::from_slice(&ok_bytes(&["header", "dump", p(&image), "--json"])).unwrap();
    assert_eq!(direct, dump);
    let err = fails(&["header", "backup", p(&image), p(&backup)]);
    assert!(err.contains("must not exist"), "{err}");

    // A passphrase added after the backup does not survive its restore.
    let later = f.file("later", b"added later\n");
    let mut args = vec![
        "passphrase",
        "add",
        p(&image),
        "--passphrase-file",
        p(&f.pw),
    ];
    args.extend(["--new-passphrase-file", p(&later)]);
    args.extend(FAST);
    ok_bytes(&args);

    // Both binary headers destroyed: nothing opens the image.
    with_store(&image, b"correct horse", async |image| {
        let header = ObjectName::new(ivdisk_image::header_object_name(
            ivdisk_image::LOCAL_IMAGE_NAME,
        ))
        .unwrap();
        image
            .store()
            .write(&header, 0, &[0x55; 4096])
            .await
            .unwrap();
        image
            .store()
            .write(&header, 16 << 10, &[0x55; 4096])
            .await
            .unwrap();
    });
    let err = fails(&["info", p(&image)]);
    assert!(err.contains("ivdisk header restore"), "{err}");
    let err = fails(&["header", "dump", p(&image)]);
    assert!(err.contains("ivdisk header restore"), "{err}");
    exits(2, &["verify", p(&image), "--passphrase-file", p(&f.pw)]);

    let restored = json(&["header", "restore", p(&image), p(&backup)]);
    assert_eq!(restored["replaced"], "unreadable");
    assert_eq!(restored["image_id"], id);
    assert_eq!(info(&image)["keyslots"], serde_json::json!([0]));
    let (_, exported) = f.export(&image, "out.raw");
    assert!(exported[..disk.len()] == disk[..], "data lost");
    assert!(
        ivdisk(&["verify", p(&image), "--passphrase-file", p(&f.pw)])
            .status
            .success()
    );
    assert_eq!(
        ivdisk(&["verify", p(&image), "--passphrase-file", p(&later)])
            .status
            .code(),
        Some(2)
    );
    // Restoring over an intact header of the same image is fine.
    assert_eq!(
        json(&["header", "restore", p(&image), p(&backup)])["replaced"],
        "same"
    );
    // The header holds the size: a backup from before a resize brings the old size back,
    // and the restore says so.
    let size = info(&image)["size"].as_u64().unwrap();
    let grown = (size + (64 << 20)).to_string();
    let mut args = vec!["resize", p(&image), "--size", &grown];
    args.extend(["--passphrase-file", p(&f.pw)]);
    ok_bytes(&args);
    let restored = json(&["header", "restore", p(&image), p(&backup)]);
    assert_eq!(restored["size"], size);
    assert_eq!(restored["old_size"], size + (64 << 20));
    ok_bytes(&args);
    let text = String::from_utf8(ok_bytes(&["header", "restore", p(&image), p(&backup)])).unwrap();
    assert!(text.contains("size is now"), "{text}");
    assert!(
        text.contains(&format!("--size {}", size + (64 << 20))),
        "{text}"
    );

    // Restored after a delete: the header comes back, the data does not, and it says so.
    ok_bytes(&["delete", p(&image), "--yes"]);
    let restored = json(&["header", "restore", p(&image), p(&backup)]);
    assert_eq!(restored["replaced"], "missing");
    assert_eq!(restored["data_objects"], 0);
    ok_bytes(&["delete", p(&image), "--yes"]);
    let text = String::from_utf8(ok_bytes(&["header", "restore", p(&image), p(&backup)])).unwrap();
    assert!(
        text.contains("WARNING") && text.contains("reads as zeros everywhere"),
        "{text}"
    );
}

#[test]
fn another_images_header_backup_needs_force() {
    let f = Fixture::new();
    let (one, _) = f.import("one", &raw_disk(5));
    let (two, _) = f.import("two", &raw_disk(6));
    let (id_one, id_two) = (
        info(&one)["image_id"].clone(),
        info(&two)["image_id"].clone(),
    );
    assert_ne!(id_one, id_two);
    let backup = f.path("one.header");
    ok_bytes(&["header", "backup", p(&one), p(&backup)]);

    let err = fails(&["header", "restore", p(&two), p(&backup)]);
    assert!(
        err.contains(&format!("belongs to image id {}", id_one.as_str().unwrap()))
            && err.contains("--force"),
        "{err}"
    );
    assert_eq!(info(&two)["image_id"], id_two);

    // Nor over a header that no longer reads: its JSON still names image two, or, with the
    // whole header gone, the store's data objects do. Restored, it would show none of them.
    let two_header = f.path("two.header");
    ok_bytes(&["header", "backup", p(&two), p(&two_header)]);
    for (wiped, found) in [(4096, "damaged header"), (64 << 10, "data objects")] {
        with_store(&two, b"correct horse", async |image| {
            let header = ObjectName::new(ivdisk_image::header_object_name(
                ivdisk_image::LOCAL_IMAGE_NAME,
            ))
            .unwrap();
            for at in [0, 16 << 10] {
                let wipe = vec![0x55; wiped];
                image.store().write(&header, at, &wipe).await.unwrap();
            }
        });
        fails(&["info", p(&two)]);
        let err = fails(&["header", "restore", p(&two), p(&backup)]);
        assert!(
            err.contains(&format!("belongs to image id {}", id_one.as_str().unwrap()))
                && err.contains(&format!("{found} "))
                && err.contains(id_two.as_str().unwrap())
                && err.contains("--force"),
            "{err}"
        );
        assert_eq!(
            json(&["header", "restore", p(&two), p(&two_header)])["replaced"],
            "unreadable"
        );
        assert_eq!(info(&two)["image_id"], id_two);
    }

    let forced = json(&["header", "restore", p(&two), p(&backup), "--force"]);
    assert_eq!(
        forced["replaced"],
        format!("other:{}", id_two.as_str().unwrap())
    );
    assert_eq!(info(&two)["image_id"], id_one);

    // Not a header at all: refused, nothing changed.
    let junk = f.file("junk", &[7u8; 8192]);
    let err = fails(&["header", "restore", p(&one), p(&junk)]);
    assert!(err.contains("header backup is not usable"), "{err}");
    assert_eq!(info(&one)["image_id"], id_one);
}

/// Not a test of its own (hence ignored): run by `restore_is_refused_while_a_writer_holds_the_image`
/// with `DIE_HOLDING_LOCK` set, it opens that image for writing, says `open` on stdout and
/// holds the image until it is killed.
#[test]
#[ignore = "a helper process of restore_is_refused_while_a_writer_holds_the_image"]
fn helper_writer_that_dies_holding_the_lock() {
    let image = std::env::var(DIE_HOLDING_LOCK).expect("run by the restore test");
    let rt = tokio::runtime::Runtime::new().unwrap();
    let uri = ImageUri::parse(&image).unwrap();
    let options = OpenOptions {
        read_only: false,
        lock_duration: std::time::Duration::from_secs(3600),
        ..OpenOptions::default()
    };
    let opened = rt
        .block_on(Image::open(&uri, b"correct horse", &options))
        .unwrap();
    rt.block_on(opened.store().flush()).unwrap();
    println!("open");
    std::thread::sleep(std::time::Duration::from_secs(600));
    drop(opened);
}

#[test]
fn restore_is_refused_while_a_writer_holds_the_image() {
    let f = Fixture::new();
    let (image, _) = f.import("disk", &raw_disk(8));
    let backup = f.path("disk.header");
    ok_bytes(&["header", "backup", p(&image), p(&backup)]);
    let mut writer = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "--ignored",
            "helper_writer_that_dies_holding_the_lock",
            "--test-threads=1",
            "--nocapture",
        ])
        .env(DIE_HOLDING_LOCK, &image)
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    // The test harness prints its own lines first.
    let said = std::io::BufRead::lines(std::io::BufReader::new(writer.stdout.take().unwrap()))
        .map(Result::unwrap)
        .find(|line| line.ends_with("open"));
    assert!(said.is_some(), "the writer opened the image");
    let err = fails(&["header", "restore", p(&image), p(&backup)]);
    assert!(err.contains("already open for writing by process"), "{err}");
    let status = json(&["lock", "status", p(&image)]);
    assert_eq!(
        status["lock"]["holder_gone"], false,
        "a live writer: {status}"
    );

    // Killed, the writer leaves its lock behind; the next writer releases it and says so.
    writer.kill().unwrap();
    writer.wait().unwrap();
    assert!(
        info(&image)["lock"]["client"].is_string(),
        "the dead writer's lock"
    );
    let status = json(&["lock", "status", p(&image)]);
    assert_eq!(
        status["lock"]["holder_gone"], true,
        "a dead writer: {status}"
    );
    let out = ivdisk(&["header", "restore", p(&image), p(&backup), "--json"]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("released") && stderr.contains("ivdisk pid"),
        "{stderr}"
    );
    let restored: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(restored["replaced"], "same");
    assert_eq!(
        info(&image)["lock"],
        Value::Null,
        "restore let go of the lock"
    );
}

/// A 24 MiB LUKS2 file made by `cryptsetup luksFormat`, its keyslot 0 opened by `key`.
fn cryptsetup_luks2_file(f: &Fixture, key: &Path) -> PathBuf {
    let volume = f.path("vol.luks");
    common::cryptsetup_luks2_file(&volume, key);
    volume
}

/// A keyslot removal whose header switch went through and whose wipe of the old keyslot area
/// failed (here: writes past 256 KiB refused, `RLIMIT_FSIZE`, where keyslot 1's area lies)
/// says the header was changed. It said "nothing was changed" while the keyslot was gone.
#[test]
fn a_change_that_fails_after_the_header_switch_says_so() {
    let f = Fixture::new();
    let first = f.file("first.key", b"cryptsetup's passphrase");
    let second = f.file("second.key", b"the second one");
    let volume = cryptsetup_luks2_file(&f, &first);
    let out = cryptsetup(&[
        "luksAddKey",
        "--batch-mode",
        "--pbkdf",
        "pbkdf2",
        "--pbkdf-force-iterations",
        "1000",
        "--key-file",
        p(&first),
        p(&volume),
        p(&second),
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let out = Command::new("sh")
        .args([
            "-c",
            "trap '' XFSZ; exec prlimit --fsize=262144 \"$@\"",
            "sh",
        ])
        .arg(env!("CARGO_BIN_EXE_ivdisk"))
        .args(["passphrase", "remove", p(&volume), "--key-file", p(&second)])
        .stdin(Stdio::null())
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "the wipe past 256 KiB went through: {err}"
    );
    let dump = cryptsetup(&["luksDump", p(&volume)]);
    let dump = String::from_utf8_lossy(&dump.stdout);
    // The header (below 32 KiB) was written: keyslot 1 is gone.
    assert!(!dump.contains("  1: luks2"), "{dump}");
    assert!(
        err.contains("WAS changed") && !err.contains("nothing was changed"),
        "{err}"
    );
}

#[test]
fn a_cryptsetup_luks2_file_gets_passphrases_cryptsetup_accepts() {
    let f = Fixture::new();
    let first = f.file("first.key", b"cryptsetup's passphrase");
    let added = f.file("added.key", b"added by ivdisk");
    let volume = cryptsetup_luks2_file(&f, &first);
    let test = |key: &Path| {
        cryptsetup(&[
            "luksOpen",
            "--test-passphrase",
            "--key-file",
            p(key),
            p(&volume),
        ])
        .status
        .success()
    };
    assert!(!test(&added), "not yet a passphrase");

    let mut args = vec!["passphrase", "add", p(&volume), "--key-file", p(&first)];
    args.extend(["--new-key-file", p(&added)]);
    args.extend(FAST);
    let report = json(&args);
    assert_eq!(report["keyslots"], serde_json::json!([0, 1]));
    assert!(
        test(&added),
        "cryptsetup refuses the passphrase ivdisk added"
    );
    assert!(test(&first));

    // Removing cryptsetup's own keyslot through ivdisk: cryptsetup agrees it is gone.
    let removed = json(&["passphrase", "remove", p(&volume), "--key-file", p(&first)]);
    assert_eq!(removed["removed"], 0);
    assert!(
        !test(&first),
        "the removed passphrase still opens the volume"
    );
    assert!(test(&added));
    let err = fails(&["passphrase", "remove", p(&volume), "--key-file", p(&added)]);
    assert!(err.contains("last one"), "{err}");
    assert!(test(&added));
}

/// `header dump` lists a LUKS2 header's tokens, as `cryptsetup luksDump` does: another
/// tool's (here one imported with `cryptsetup token import`, as systemd's TPM2 enrollment
/// leaves one) with the keyslots it names, and after ivdisk removes a keyslot the token no
/// longer names it, for cryptsetup either.
#[test]
fn header_dump_lists_tokens_as_luksdump_does() {
    let f = Fixture::new();
    let first = f.file("first.key", b"cryptsetup's passphrase");
    let added = f.file("added.key", b"added by ivdisk");
    let volume = cryptsetup_luks2_file(&f, &first);
    let token = f.file(
        "token.json",
        br#"{"type":"example-tpm2","keyslots":["0"],"sealed":"abc"}"#,
    );
    let out = cryptsetup(&["token", "import", "--json-file", p(&token), p(&volume)]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let luks_dump = |what: &str| {
        let out = cryptsetup(&["luksDump", p(&volume)]);
        assert!(
            out.status.success(),
            "{what}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let theirs = luks_dump("imported");
    assert!(theirs.contains("0: example-tpm2"), "{theirs}");
    let ours = ok(&["header", "dump", p(&volume)]);
    assert!(
        ours.contains("Tokens:\n   0: example-tpm2, keyslots 0\n"),
        "{ours}"
    );

    let mut args = vec!["passphrase", "add", p(&volume), "--key-file", p(&first)];
    args.extend(["--new-key-file", p(&added)]);
    args.extend(FAST);
    json(&args);
    let removed = json(&["passphrase", "remove", p(&volume), "--key-file", p(&first)]);
    assert_eq!(removed["removed"], 0);
    let ours = ok(&["header", "dump", p(&volume)]);
    assert!(ours.contains("   0: example-tpm2, no keyslots\n"), "{ours}");
    let theirs = luks_dump("after the removal");
    let token_part = theirs.split("Tokens:").nth(1).unwrap_or_default();
    let token_part = token_part.split("Digests:").next().unwrap_or_default();
    assert!(
        token_part.contains("example-tpm2") && !token_part.contains("Keyslot:"),
        "cryptsetup still sees the removed keyslot in the token: {theirs}"
    );
}

/// `header dump` marks what `cryptsetup luksDump` marks of a keyslot: a priority other than
/// normal (`cryptsetup config --priority`) and a key that opens no data segment
/// (`luksAddKey --unbound`); a normal keyslot gets neither mark.
#[test]
fn header_dump_marks_keyslot_priorities_and_unbound_keys() {
    let f = Fixture::new();
    let first = f.file("first.key", b"cryptsetup's passphrase");
    let second = f.file("second.key", b"another one");
    let volume = cryptsetup_luks2_file(&f, &first);
    let pbkdf = ["--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"];
    let steps: [&[&str]; 4] = [
        &[
            "luksAddKey",
            "--batch-mode",
            "--key-file",
            p(&first),
            p(&volume),
            p(&second),
        ],
        &[
            "config",
            "--key-slot",
            "0",
            "--priority",
            "prefer",
            p(&volume),
        ],
        &[
            "config",
            "--key-slot",
            "1",
            "--priority",
            "ignore",
            p(&volume),
        ],
        &[
            "luksAddKey",
            "--batch-mode",
            "--unbound",
            "--key-size",
            "256",
            p(&volume),
            p(&second),
        ],
    ];
    for step in steps {
        let mut args = step.to_vec();
        if args[0] == "luksAddKey" {
            args.extend(pbkdf);
        }
        let out = cryptsetup(&args);
        assert!(
            out.status.success(),
            "{args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let ours = ok(&["header", "dump", p(&volume)]);
    let line = |slot: &str| {
        ours.lines()
            .find(|l| l.trim_start().starts_with(&format!("{slot}: ")))
            .unwrap_or_else(|| panic!("no keyslot {slot}: {ours}"))
            .to_owned()
    };
    assert!(line("0").contains("priority prefer"), "{ours}");
    assert!(line("1").contains("priority ignore"), "{ours}");
    assert!(line("2").contains("unbound"), "{ours}");
    for (slot, not) in [("0", "unbound"), ("1", "unbound"), ("2", "priority")] {
        assert!(!line(slot).contains(not), "{ours}");
    }
    let dump = json(&["header", "dump", p(&volume)]);
    let slots = dump["keyslots"].as_array().unwrap();
    let fields: Vec<(u64, Value, bool)> = slots
        .iter()
        .map(|k| {
            let id = k["id"].as_u64().unwrap();
            (id, k["priority"].clone(), k["unbound"].as_bool().unwrap())
        })
        .collect();
    assert_eq!(
        fields,
        [
            (0, Value::from(2), false),
            (1, Value::from(0), false),
            (2, Value::Null, true)
        ],
        "{dump}"
    );
}

/// Commands that create an image and fail on a full file system say so, with what to do, and
/// leave nothing behind: not the half-made image, and not the local store directory they
/// made for it. A directory that was there before stays.
#[test]
fn commands_that_fail_on_a_full_disk_leave_nothing_behind() {
    let f = Fixture::new();
    let raw = f.file("disk.raw", &random(24 << 20, 11));
    let image = f.path("source.ivd");
    let pw = p(&f.pw);
    let mut import_args = vec!["import", p(&raw), p(&image), "--passphrase-file", pw];
    import_args.extend(FAST);
    ok_bytes(&import_args);
    let backup = f.path("source.ivbk");
    ok_bytes(&["backup", p(&image), p(&backup)]);

    let small = ivdisk_store::small_fs::SmallFileSystem::mount(&f.path("small"), "16m");
    let target = small.path().join("new.ivd");
    let t = p(&target);
    let mut commands = vec![
        vec!["import", p(&raw), t, "--passphrase-file", pw],
        vec![
            "convert",
            p(&raw),
            t,
            "--source-format",
            "raw",
            "--passphrase-file",
            pw,
        ],
        vec!["restore", p(&backup), t],
    ];
    commands[0].extend(FAST);
    commands[1].extend(FAST);
    let everything_in = |dir: &Path| -> Vec<String> {
        let mut names: Vec<String> = std::fs::read_dir(dir)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .collect();
        names.sort();
        names
    };
    for args in &commands {
        let err = fails(args);
        assert!(
            err.contains("no space left") && err.contains("free space and retry"),
            "{args:?}: {err}"
        );
        // Deleted through the store, or (when the full disk refuses that too) removed whole.
        assert!(
            err.contains("made for it removed") || err.contains("made for it was removed"),
            "{args:?}: {err}"
        );
        assert!(
            everything_in(small.path()).is_empty(),
            "{args:?} left {:?} behind: {err}",
            everything_in(small.path())
        );
    }

    // `create` on a disk with almost no room left: filled to the last byte, then 96 KiB freed.
    let filler = small.path().join("filler");
    {
        use std::io::Write;
        let mut file = std::fs::File::create(&filler).unwrap();
        while file.write_all(&[7u8; 64 << 10]).is_ok() {}
        let len = file.metadata().unwrap().len();
        file.set_len(len - (96 << 10)).unwrap();
    }
    let mut create_args = vec!["create", t, "--size", "64M", "--passphrase-file", pw];
    create_args.extend(FAST);
    let err = fails(&create_args);
    assert!(err.contains("no space left"), "{err}");
    assert!(err.contains("made for it removed"), "{err}");
    assert_eq!(
        everything_in(small.path()),
        vec!["filler".to_owned()],
        "{err}"
    );
    // So do the commands that copy into a new image, failing while they create it (import
    // and convert left the directory they made).
    for args in &commands {
        let err = fails(args);
        assert!(err.contains("no space left"), "{args:?}: {err}");
        assert_eq!(
            everything_in(small.path()),
            vec!["filler".to_owned()],
            "{args:?}: {err}"
        );
    }

    // An empty directory the user made stays, empty: the half-made store's files (its lock,
    // database, segments) were left in it.
    std::fs::remove_file(&filler).unwrap();
    std::fs::create_dir(&target).unwrap();
    let err = fails(&commands[0]);
    assert!(err.contains("was deleted"), "{err}");
    assert!(!err.contains("made for it"), "{err}");
    assert!(err.contains("left empty, as it was"), "{err}");
    assert!(target.is_dir(), "the user's directory was removed: {err}");
    assert!(
        everything_in(&target).is_empty(),
        "left {:?} behind: {err}",
        everything_in(&target)
    );
    let gone = fails(&["info", t]);
    assert!(gone.contains("does not exist"), "{gone}");
}

/// `ivdisk info` of a local image says what its store takes on disk: the data it was given
/// (encrypted, nothing for all-zero chunks, which import skips) and its metadata.
#[test]
fn info_shows_what_a_local_image_takes_on_disk() {
    let f = Fixture::new();
    let dense = random(8 << 20, 77);
    let (full, _) = f.import("dense", &dense);
    let (empty, _) = f.import("zeros", &vec![0u8; 8 << 20]);
    let usage = |image: &Path| {
        let shown = info(image);
        let u = &shown["disk_usage"];
        let (data, metadata) = (u["data"].as_u64().unwrap(), u["metadata"].as_u64().unwrap());
        // Closed: no room is held for commits.
        assert_eq!(u["reserved"].as_u64(), Some(0), "{shown}");
        assert_eq!(u["total"].as_u64(), Some(data + metadata), "{shown}");
        assert!(metadata > 0, "{shown}");
        (data, metadata)
    };
    let (data, _) = usage(&full);
    assert!(
        (8 << 20..12 << 20).contains(&data),
        "8 MiB imported, {data} bytes of data on disk"
    );
    let (data, _) = usage(&empty);
    assert!(
        data < 1 << 20,
        "8 MiB of zeros imported, {data} bytes of data on disk"
    );
    let text = ivdisk(&["info", p(&full)]);
    let out = String::from_utf8_lossy(&text.stdout);
    assert!(
        out.lines()
            .any(|l| l.starts_with("disk usage:") && l.contains("data") && l.contains("metadata")),
        "{out}"
    );
}

/// `ivdisk export IMAGE FILE --force` with the passphrase file `pw`.
/// An export onto exFAT, a file system without hard links (the usual USB stick): it was made
/// in full, then failed to be named (a hard link) and removed, with advice (--force) that did
/// not help. An existing file is still overwritten with --force only.
#[test]
fn export_onto_a_file_system_without_hard_links() {
    let f = Fixture::new();
    let mut content = raw_disk(21);
    let (image, _) = f.import("disk", &content);
    // The image is the disk padded to whole sectors.
    content.resize(
        (content.len() as u64).div_ceil(SECTOR) as usize * SECTOR as usize,
        0,
    );
    let stick = ivdisk_store::small_fs::SmallFileSystem::mount_exfat(
        &f.path("stick"),
        &f.path("stick.img"),
        16,
    );
    let out = stick.path().join("disk.raw");
    let pw = p(&f.pw);
    ok_bytes(&["export", p(&image), p(&out), "--passphrase-file", pw]);
    assert!(
        std::fs::read(&out).unwrap() == content,
        "the export differs"
    );
    let left: Vec<_> = std::fs::read_dir(stick.path())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left, [std::ffi::OsString::from("disk.raw")], "files left");
    // Overwritten with --force only.
    let text = fails(&["export", p(&image), p(&out), "--passphrase-file", pw]);
    assert!(
        text.contains("exists") && text.contains("--force"),
        "{text}"
    );
    std::fs::write(&out, b"old").unwrap();
    ok_bytes(&export_over(&image, &out, &f.pw));
    assert!(
        std::fs::read(&out).unwrap() == content,
        "the export differs"
    );
}

/// A file's permission bits.
fn mode(path: &Path) -> u32 {
    std::fs::metadata(path).unwrap().permissions().mode() & 0o7777
}

/// A new export of `image` (no file there before).
fn out_new_mode(f: &Fixture, image: &Path) -> PathBuf {
    let out = f.path("fresh-export.raw");
    ok(&["export", p(image), p(&out), "--passphrase-file", p(&f.pw)]);
    out
}

fn export_over<'a>(image: &'a Path, file: &'a Path, pw: &'a Path) -> [&'a str; 6] {
    [
        "export",
        p(image),
        p(file),
        "--force",
        "--passphrase-file",
        p(pw),
    ]
}

/// Ctrl-C (SIGINT) or SIGTERM amid `import` or `convert`: the copy stops and the half-made
/// image is deleted, as after any failed copy; before, the process died and left an image
/// that looked complete, held part of the data, and verified. The signal comes at a few
/// moments; whichever the copy had reached, the image is either complete or gone.
/// `ivdisk ARGS`, sent `signal` (`-INT`, `-TERM`) after `delay_ms`; what it left.
fn signalled(args: &[&str], delay_ms: u64, signal: &str) -> std::process::Output {
    let child = Command::new(env!("CARGO_BIN_EXE_ivdisk"))
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(std::time::Duration::from_millis(delay_ms));
    let _ = Command::new("kill")
        .args([signal, &child.id().to_string()])
        .status();
    child.wait_with_output().unwrap()
}

#[test]
fn a_signal_amid_import_or_convert_leaves_no_half_made_image() {
    let f = Fixture::new();
    let disk = random(384 << 20, 11);
    let raw = f.file("big.raw", &disk);
    let mut interrupted = 0;
    for (round, delay_ms) in [200u64, 350, 500, 800, 1200].into_iter().enumerate() {
        // SIGHUP: the terminal of an ssh session closed (it killed the copy, leaving a
        // half-made image that looked complete).
        for (command, signal) in [("import", "-INT"), ("convert", "-TERM"), ("import", "-HUP")] {
            let image = f.path(&format!("{command}{signal}-{round}"));
            let mut args = vec![command, p(&raw), p(&image), "--passphrase-file", p(&f.pw)];
            args.extend(FAST);
            let out = signalled(&args, delay_ms, signal);
            let err = String::from_utf8_lossy(&out.stderr);
            if out.status.success() {
                let (_, exported) = f.export(&image, &format!("{command}{signal}-{round}.raw"));
                assert!(exported[..disk.len()] == disk[..], "{command}: data lost");
            } else if out.status.code().is_none() {
                // Killed before it took the signals over, which it does before it makes the
                // image: none was made.
                assert!(!image.exists(), "{command} left {}", image.display());
            } else {
                // Not killed by the signal: a clear error, and the image is gone.
                assert_eq!(
                    out.status.code(),
                    Some(1),
                    "{command} after {delay_ms} ms: {err}"
                );
                assert!(err.contains("interrupted"), "{err}");
                assert!(err.contains("was deleted"), "{err}");
                assert!(!image.exists(), "{command} left {}", image.display());
                interrupted += 1;
            }
        }
    }
    // At least one signal must land amid a copy for the test to say anything.
    assert!(interrupted > 0, "every copy ended before its signal");

    // A restore stops too, and removes what it wrote (killed, it left data objects without a
    // header, which no command removes).
    let source = f.path("source");
    let mut args = vec!["import", p(&raw), p(&source), "--passphrase-file", p(&f.pw)];
    args.extend(FAST);
    ok_bytes(&args);
    let backup = f.path("big.ivbk");
    ok_bytes(&["backup", p(&source), p(&backup)]);
    let mut interrupted = 0;
    for delay_ms in [300u64, 600, 1000, 1600, 2400] {
        let image = f.path(&format!("restored-{delay_ms}"));
        let out = signalled(&["restore", p(&backup), p(&image)], delay_ms, "-TERM");
        let err = String::from_utf8_lossy(&out.stderr);
        match out.status.code() {
            Some(0) => {
                let (_, exported) = f.export(&image, &format!("restored-{delay_ms}.raw"));
                assert!(exported[..disk.len()] == disk[..], "restore: data lost");
            }
            None => assert!(!image.exists(), "a killed restore left {}", image.display()),
            Some(code) => {
                assert_eq!(code, 1, "restore after {delay_ms} ms: {err}");
                assert!(err.contains("interrupted"), "{err}");
                assert!(!image.exists(), "restore left {}", image.display());
                interrupted += 1;
            }
        }
    }
    assert!(interrupted > 0, "every restore ended before its signal");
}

/// SIGKILL amid `import` or `convert` (or the machine stopping): nothing can delete the
/// half-made image, so it says it is half made. Before, it opened, served and exported, with
/// zeros for whatever was not copied yet. Whatever moment the kill comes at, the image is
/// absent, complete, or refused by every open with an error that says what to do, and
/// `ivdisk delete` removes it.
#[test]
fn an_import_or_convert_killed_leaves_an_image_no_open_takes_for_complete() {
    let f = Fixture::new();
    let disk = random(384 << 20, 12);
    let raw = f.file("big.raw", &disk);
    let mut half_made = 0;
    for (round, delay_ms) in [300u64, 500, 800, 1200, 1800].into_iter().enumerate() {
        for command in ["import", "convert"] {
            let image = f.path(&format!("{command}-killed-{round}"));
            let mut args = vec![command, p(&raw), p(&image), "--passphrase-file", p(&f.pw)];
            args.extend(FAST);
            let out = signalled(&args, delay_ms, "-KILL");
            if out.status.success() {
                let (_, exported) = f.export(&image, &format!("{command}-{round}.raw"));
                assert!(exported[..disk.len()] == disk[..], "{command}: data lost");
                assert_eq!(info(&image)["unfinished"], Value::Null);
                continue;
            }
            assert_eq!(out.status.code(), None, "{command} was not killed");
            if !image.exists() {
                continue;
            }
            let half = f.path(&format!("half-{command}-{round}.raw"));
            let out = Command::new(env!("CARGO_BIN_EXE_ivdisk"))
                .args(["export", p(&image), p(&half)])
                .args(["--passphrase-file", p(&f.pw)])
                .output()
                .unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            if out.status.success() {
                // Killed after it marked the image filled (between that and its exit).
                let exported = std::fs::read(&half).unwrap();
                assert!(exported[..disk.len()] == disk[..], "{command}: data lost");
                continue;
            }
            if err.contains("does not exist") {
                // Killed while it created the image: its directory made, no header yet.
                continue;
            }
            assert!(err.contains("has not finished"), "{command}: {err}");
            // `info` shows it too, and says the same.
            let unfinished = info(&image)["unfinished"].as_str().unwrap_or("").to_owned();
            assert!(
                unfinished.contains("has not finished"),
                "{command}: {unfinished}"
            );
            assert!(
                err.contains(&format!("`ivdisk delete {} --yes`", image.display())),
                "{err}"
            );
            ok_bytes(&["delete", p(&image), "--yes"]);
            let err = fails(&["info", p(&image)]);
            assert!(err.contains("does not exist"), "{err}");
            half_made += 1;
        }
    }
    assert!(half_made > 0, "no kill landed amid a copy");
}

/// An export whose standard output is not read any more (a stalled `ssh`) stops after a
/// signal all the same: stuck in the write, it never reached the check between pieces, and
/// every later signal was only recorded; only SIGKILL ended it.
#[test]
fn an_export_stuck_writing_stops_after_a_signal() {
    let f = Fixture::new();
    let image = f.path("img");
    let mut args = vec![
        "create",
        p(&image),
        "--size",
        "64M",
        "--passphrase-file",
        p(&f.pw),
    ];
    args.extend(FAST);
    ok_bytes(&args);
    let mut child = Command::new(env!("CARGO_BIN_EXE_ivdisk"))
        .args(["export", p(&image), "-", "--passphrase-file", p(&f.pw)])
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // The pipe fills (nobody reads it) and the export blocks in its write.
    std::thread::sleep(std::time::Duration::from_millis(1500));
    assert!(
        child.try_wait().unwrap().is_none(),
        "the export ended unread"
    );
    let term = Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    assert!(term.success());
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(30);
    let status = loop {
        if let Some(status) = child.try_wait().unwrap() {
            break status;
        }
        if std::time::Instant::now() > deadline {
            let _ = child.kill();
            panic!("the export did not stop within 30 s of SIGTERM");
        }
        std::thread::sleep(std::time::Duration::from_millis(100));
    };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut child.stderr.take().unwrap(), &mut err).unwrap();
    assert_eq!(status.code(), Some(1), "{err}");
    assert!(
        err.contains("interrupted") && err.contains("given up"),
        "{err}"
    );
}

/// An export stopped by a signal leaves no file under the name asked for, nor its partial
/// file beside it: written at that name, it left a file of the image's size that read as
/// zeros past where it got, a copy that looked complete. And with `-` (the disk's bytes on
/// standard output) a failure's `--json` object goes to standard error, not into the data.
#[test]
fn an_interrupted_export_leaves_no_file_and_data_on_stdout_gets_no_json() {
    let f = Fixture::new();
    let disk = random(384 << 20, 12);
    let raw = f.file("big.raw", &disk);
    let image = f.path("img");
    let mut args = vec!["import", p(&raw), p(&image), "--passphrase-file", p(&f.pw)];
    args.extend(FAST);
    ok_bytes(&args);
    let mut interrupted = 0;
    for delay_ms in [150u64, 300, 500, 800, 1200] {
        let file = f.path(&format!("out-{delay_ms}.raw"));
        let out = signalled(
            &["export", p(&image), p(&file), "--passphrase-file", p(&f.pw)],
            delay_ms,
            "-INT",
        );
        let err = String::from_utf8_lossy(&out.stderr);
        match out.status.code() {
            Some(0) => assert!(std::fs::read(&file).unwrap() == disk, "export: data lost"),
            // Killed before it took the signals over, which it does before it makes a file.
            None => assert!(!file.exists(), "a killed export left {}", file.display()),
            Some(code) => {
                assert_eq!(code, 1, "export after {delay_ms} ms: {err}");
                assert!(err.contains("interrupted"), "{err}");
                assert!(
                    !file.exists(),
                    "an interrupted export left {}",
                    file.display()
                );
                interrupted += 1;
            }
        }
        let partial: Vec<_> = std::fs::read_dir(f.dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|name| name.contains("ivdisk-export"))
            .collect();
        assert!(partial.is_empty(), "left behind: {partial:?}");
    }
    assert!(interrupted > 0, "every export ended before its signal");

    let wrong = f.file("wrong", b"not the passphrase\n");
    let out = Command::new(env!("CARGO_BIN_EXE_ivdisk"))
        .args([
            "export",
            p(&image),
            "-",
            "--json",
            "--passphrase-file",
            p(&wrong),
        ])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    assert!(
        out.stdout.is_empty(),
        "standard output carries the disk: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    assert!(String::from_utf8_lossy(&out.stderr).contains("passphrase"));
}

/// File names that are not UTF-8 (Linux allows any bytes but `/` and NUL): `import`, `export
/// --json` and `header backup --json` finish and report. Before, the JSON summary (built by
/// serde, which refuses such paths) panicked with exit code 101 after the work was done, so a
/// script saw a failure for an import that had happened.
#[test]
fn file_names_that_are_not_utf8_are_reported_not_panicked_on() {
    use std::ffi::OsStr;
    use std::os::unix::ffi::OsStrExt;
    let f = Fixture::new();
    let disk = random(100_000, 3);
    let raw = f.dir.path().join(OsStr::from_bytes(b"disk\xff.raw"));
    std::fs::write(&raw, &disk).unwrap();
    let image = f.path("image");
    let run = |args: &[&OsStr]| {
        let out = Command::new(env!("CARGO_BIN_EXE_ivdisk"))
            .args(args)
            .stdin(Stdio::null())
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "ivdisk {args:?}: {:?} {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let os = |s: &'static str| OsStr::new(s);
    let mut args = vec![os("import"), raw.as_os_str(), image.as_os_str()];
    args.extend([os("--passphrase-file"), f.pw.as_os_str()]);
    args.extend(FAST.map(OsStr::new));
    let text = run(&args);
    assert!(text.contains("disk\u{fffd}.raw"), "{text}");

    let out = f.dir.path().join(OsStr::from_bytes(b"out\xfe.raw"));
    let mut args = vec![os("export"), image.as_os_str(), out.as_os_str()];
    args.extend([os("--passphrase-file"), f.pw.as_os_str(), os("--json")]);
    let report: Value = serde_json::from_str(&run(&args)).unwrap();
    assert!(report["file"]
        .as_str()
        .unwrap()
        .ends_with("/out\u{fffd}.raw"));
    assert!(std::fs::read(&out).unwrap()[..disk.len()] == disk[..]);

    let backup = f.dir.path().join(OsStr::from_bytes(b"header\xfd.bak"));
    let args = [
        os("header"),
        os("backup"),
        image.as_os_str(),
        backup.as_os_str(),
        os("--json"),
    ];
    let report: Value = serde_json::from_str(&run(&args)).unwrap();
    assert!(report["backup"]
        .as_str()
        .unwrap()
        .ends_with("/header\u{fffd}.bak"));
}

/// `export --force` onto its own source: refused, the LUKS volume left as it was. Before, the
/// plaintext was written beside it and renamed over it: keyslots and ciphertext gone, the
/// data unencrypted on disk. A file inside a local image's store directory is refused too.
#[test]
fn export_over_its_own_source_is_refused() {
    let f = Fixture::new();
    let key = f.file("vol.key", b"the volume's passphrase");
    let volume = cryptsetup_luks2_file(&f, &key);
    let before = std::fs::read(&volume).unwrap();
    let args = [
        "export",
        p(&volume),
        p(&volume),
        "--force",
        "--key-file",
        p(&key),
    ];
    let err = fails(&args);
    assert!(err.contains("itself"), "{err}");
    assert!(
        std::fs::read(&volume).unwrap() == before,
        "the volume changed"
    );

    let image = f.path("image");
    let mut args = vec![
        "create",
        p(&image),
        "--size",
        "1M",
        "--passphrase-file",
        p(&f.pw),
    ];
    args.extend(FAST);
    ok(&args);
    let inside = std::fs::read_dir(&image)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.is_file())
        .unwrap();
    let before = std::fs::read(&inside).unwrap();
    let args = [
        "export",
        p(&image),
        p(&inside),
        "--force",
        "--passphrase-file",
        p(&f.pw),
    ];
    let err = fails(&args);
    assert!(err.contains("a file of its store"), "{err}");
    assert!(
        std::fs::read(&inside).unwrap() == before,
        "{inside:?} changed"
    );
}

/// `export IMAGE - --json` that fails: its stdout carries the disk's bytes, so the JSON error
/// goes to standard error (as the help says); it was printed nowhere.
#[test]
fn an_export_to_stdout_that_fails_reports_json_on_stderr() {
    let f = Fixture::new();
    let image = f.path("img");
    let mut args = vec!["create", p(&image), "--size", "1M", "--passphrase-file"];
    args.push(p(&f.pw));
    args.extend(FAST);
    ok_bytes(&args);
    let wrong = f.file("wrong", b"not it\n");
    let out = common::ivdisk(&[
        "export",
        p(&image),
        "-",
        "--passphrase-file",
        p(&wrong),
        "--json",
    ]);
    assert_eq!(out.status.code(), Some(1));
    assert!(out.stdout.is_empty(), "nothing but data on stdout");
    let err = String::from_utf8_lossy(&out.stderr);
    let report: Value = err
        .lines()
        .find_map(|l| serde_json::from_str(l).ok())
        .unwrap_or_else(|| panic!("no JSON object on stderr: {err}"));
    assert_eq!(report["ok"], false, "{report}");
    assert!(
        report["error"].as_str().unwrap().contains("passphrase"),
        "{report}"
    );
}
