//! `ivdisk create`, `info`, `resize`, `delete` and `lock` as a user runs them: the built
//! binary on local-backend images in a temporary directory, passphrase files, exit codes
//! (1 for errors, 2 for usage errors) and messages.

use std::path::{Path, PathBuf};
use std::process::Command;

use serde_json::Value;

mod common;

use common::{fails, ivdisk, json, ok, p, Fixture, DIE_HOLDING_LOCK, FAST};

impl Fixture {
    /// `ivdisk create IMAGE --size SIZE EXTRA... --passphrase-file pw` with a fast keyslot.
    fn create(&self, image: &Path, size: &str, extra: &[&str]) -> Value {
        let mut args = vec!["create", p(image), "--size", size];
        args.extend(extra);
        args.extend(["--passphrase-file", p(&self.pw)]);
        args.extend(FAST);
        json(&args)
    }
}

fn info(image: &Path) -> Value {
    json(&["info", p(image)])
}

#[test]
fn info_shows_what_create_made_for_each_suite_and_layout() {
    let f = Fixture::new();
    // (suite, layout given, layout expected, sector size, object size given, in bytes)
    let cases = [
        (
            "aegis128l-random",
            None,
            "omap-packed",
            4096,
            None,
            4u64 << 20,
        ),
        (
            "aegis128l-random",
            Some("object-end"),
            "object-end",
            4096,
            Some("2M"),
            2 << 20,
        ),
        (
            "aes-xts-random",
            Some("omap"),
            "omap",
            512,
            Some("64K"),
            64 << 10,
        ),
        ("aes-xts-plain64", None, "none", 4096, Some("1M"), 1 << 20),
        (
            "aes-gcm-random",
            Some("unaligned"),
            "unaligned",
            4096,
            None,
            4 << 20,
        ),
    ];
    let mut ids = Vec::new();
    for (i, (suite, layout, expected_layout, sector, object, object_bytes)) in
        cases.into_iter().enumerate()
    {
        let image = f.path(&format!("disk{i}"));
        let sector = sector.to_string();
        let mut extra = vec!["--cipher", suite, "--sector-size", &sector];
        if let Some(layout) = layout {
            extra.extend(["--layout", layout]);
        }
        if let Some(object) = object {
            extra.extend(["--object-size", object]);
        }
        let created = f.create(&image, "96M", &extra);
        let shown = info(&image);
        for (key, want) in [
            ("size", Value::from(96u64 << 20)),
            ("cipher", Value::from(suite)),
            ("layout", Value::from(expected_layout)),
            ("sector_size", Value::from(sector.parse::<u64>().unwrap())),
            ("object_size", Value::from(object_bytes)),
            ("keyslots", serde_json::json!([0])),
        ] {
            assert_eq!(shown[key], want, "{suite}: info's {key}");
            assert_eq!(created[key], want, "{suite}: create's {key}");
        }
        for key in ["image", "image_id", "lock"] {
            assert!(
                shown.get(key).is_some(),
                "{suite}: info has no {key}: {shown}"
            );
        }
        assert_eq!(shown["lock"], Value::Null, "{suite}: nobody writes");
        let id = shown["image_id"].as_str().unwrap().to_owned();
        assert_eq!(id.len(), 32, "{id}");
        assert!(id.bytes().all(|b| b.is_ascii_hexdigit()), "{id}");
        assert_eq!(created["image_id"], shown["image_id"]);
        ids.push(id);

        // The human form: aligned `key: value` lines.
        let text = ok(&["info", p(&image)]);
        let cipher_line = text.lines().find(|l| l.starts_with("cipher:")).unwrap();
        assert!(cipher_line.ends_with(suite), "{text}");
        let value_column = |l: &str| l.len() - l.split_once(':').unwrap().1.trim_start().len();
        let first = value_column(text.lines().next().unwrap());
        assert!(
            text.lines().all(|l| value_column(l) == first),
            "values not aligned:\n{text}"
        );
        assert!(text.contains("size:") && text.contains("96 MiB"), "{text}");
    }
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), cases.len(), "every image gets its own id");
}

#[test]
fn a_layout_that_does_not_fit_the_suite_is_refused_before_anything_is_made() {
    let f = Fixture::new();
    let image = f.path("disk");
    for (suite, layout, advice) in [
        ("aes-xts-plain64", "object-end", "--layout none"),
        (
            "aegis128l-random",
            "none",
            "--layout object-end, unaligned, omap, omap-packed or omap-tail",
        ),
    ] {
        let mut args = vec![
            "create",
            p(&image),
            "--size",
            "64M",
            "--cipher",
            suite,
            "--layout",
            layout,
        ];
        args.extend(["--passphrase-file", p(&f.pw)]);
        args.extend(FAST);
        let err = fails(&args);
        assert!(
            err.contains(&format!("layout {layout} does not fit suite {suite}"))
                && err.contains(advice),
            "{err}"
        );
    }
    assert!(fails(&["info", p(&image)]).contains("does not exist"));
    // Values clap can check are usage errors: exit code 2.
    for bad in [
        &["--sector-size", "1024"][..],
        &["--cipher", "rot13"],
        &["--layout", "sideways"],
        &["--size", "12X"],
    ] {
        let mut args = vec!["create", p(&image), "--size", "64M"];
        args.extend(bad);
        let out = ivdisk(&args);
        assert_eq!(out.status.code(), Some(2), "{bad:?}");
        assert!(out.stdout.is_empty(), "{bad:?}");
        // With --json, the usage error is a JSON object on stdout too, as every other failure.
        args.push("--json");
        let out = ivdisk(&args);
        assert_eq!(out.status.code(), Some(2), "{bad:?}");
        let report: serde_json::Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("{bad:?}: {e}: {}", String::from_utf8_lossy(&out.stdout)));
        assert_eq!(report["ok"], false);
        let error = report["error"].as_str().unwrap();
        assert!(error.contains(bad[0]), "{bad:?}: {error}");
    }
    // A missing argument: the JSON error names it (it kept only clap's first line, "the
    // following required arguments were not provided:").
    let out = ivdisk(&["create", p(&image), "--json"]);
    assert_eq!(out.status.code(), Some(2));
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let error = report["error"].as_str().unwrap();
    assert!(error.contains("--size"), "{error}");
    // --help with --json is not an error: no JSON object.
    let out = ivdisk(&["create", "--help", "--json"]);
    assert_eq!(out.status.code(), Some(0));
    assert!(String::from_utf8_lossy(&out.stdout).contains("Usage"));
    // Checked by ivdisk before the passphrase is asked for: exit code 1.
    let err = fails(&["create", p(&image), "--size", "64M", "--object-size", "3M"]);
    assert!(err.contains("power of two"), "{err}");
    let err = fails(&["create", p(&image), "--size", "6000"]);
    assert!(
        err.contains("multiple of the 4096-byte sector size"),
        "{err}"
    );
}

#[test]
fn create_refuses_an_existing_image_and_leaves_it_alone() {
    let f = Fixture::new();
    let image = f.path("disk");
    let first = f.create(&image, "64M", &[]);
    let mut args = vec![
        "create",
        p(&image),
        "--size",
        "128M",
        "--passphrase-file",
        p(&f.pw),
    ];
    args.extend(FAST);
    let err = fails(&args);
    assert!(err.contains("already exists"), "{err}");
    assert!(
        err.contains(&format!("ivdisk delete {}", p(&image))),
        "{err}"
    );
    let after = info(&image);
    assert_eq!(after["image_id"], first["image_id"]);
    assert_eq!(after["size"], 64u64 << 20);
}

/// `DISK@NAME` means snapshot NAME of DISK: a new local image is not made under such a name,
/// where it would hide the snapshot (before, `export disk@monday` then read the new, empty
/// image), and nothing is left behind.
#[test]
fn create_refuses_a_name_that_reads_as_a_snapshot() {
    let f = Fixture::new();
    let image = f.path("disk");
    f.create(&image, "64M", &[]);
    let at = format!("{}@monday", p(&image));
    ok(&["snap", "create", &at]);
    let mut args = vec![
        "create",
        &at,
        "--size",
        "64M",
        "--passphrase-file",
        p(&f.pw),
    ];
    args.extend(FAST);
    let err = fails(&args);
    assert!(err.contains("must not contain '@'"), "{err}");
    assert!(!Path::new(&at).exists(), "{at} was made");
    let snaps = json(&["snap", "ls", p(&image)]);
    assert!(snaps.to_string().contains("monday"), "{snaps}");
    // What reads the snapshot names it (before, the reports named the image alone).
    let verified = json(&["verify", &at, "--passphrase-file", p(&f.pw)]);
    assert_eq!(verified["image"].as_str(), Some(p(&image)), "{verified}");
    assert_eq!(verified["snapshot"].as_str(), Some("monday"), "{verified}");
    let said = ok(&["verify", &at, "--passphrase-file", p(&f.pw)]);
    assert!(said.starts_with(&format!("image {at}: ")), "{said}");
    let exported = f.path("monday.raw");
    let said = ok(&["export", &at, p(&exported), "--passphrase-file", p(&f.pw)]);
    assert!(
        said.starts_with(&format!("exported image {at} (")),
        "{said}"
    );
    ok(&["snap", "rm", &at]);
}

/// A path written `//tmp/...` is the same directory as `/tmp/...`, for the read-only opens
/// (SQLite URIs) too: before, they read `//tmp` as a URI's authority and failed.
#[test]
fn a_path_with_two_leading_slashes_is_the_same_path() {
    let f = Fixture::new();
    let image = f.path("disk");
    let doubled = PathBuf::from(format!("/{}", p(&image)));
    assert!(p(&doubled).starts_with("//"));
    f.create(&doubled, "64M", &[]);
    assert_eq!(json(&["info", p(&doubled)])["size"], 64u64 << 20);
    assert_eq!(info(&image)["size"], 64u64 << 20);
}

/// A local store holds every segment file it appended over its life open while it is open for
/// writing (one per GiB appended and not reused), so past a thousand of them the usual soft
/// limit on open files ran out in every command but `serve` ("Too many open files"): each
/// command raises it to the hard limit. The store here has 200 segments (empty ones, as a
/// store's dead ones are once punched) and the command runs under a soft limit of 64.
#[test]
fn a_store_with_more_segments_than_the_soft_open_file_limit_opens_for_writing() {
    let f = Fixture::new();
    let image = f.path("disk");
    f.create(&image, "64M", &[]);
    for n in 2..=200 {
        std::fs::File::create(image.join("data").join(format!("seg-{n:08}"))).unwrap();
    }
    let out = Command::new("sh")
        .args(["-c", "ulimit -Sn 64 && exec \"$0\" \"$@\""])
        .arg(env!("CARGO_BIN_EXE_ivdisk"))
        .args(["resize", p(&image), "--size", "128M", "--json"])
        .args(["--passphrase-file", p(&f.pw)])
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "resize under a soft limit of 64 open files: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(info(&image)["size"], 128u64 << 20);
}

#[test]
fn resize_grows_and_shrinks_only_when_allowed() {
    let f = Fixture::new();
    let image = f.path("disk");
    f.create(&image, "64M", &[]);
    let grown = json(&[
        "resize",
        p(&image),
        "--size",
        "1G",
        "--passphrase-file",
        p(&f.pw),
    ]);
    assert_eq!(grown["old_size"], 64u64 << 20);
    assert_eq!(grown["size"], 1u64 << 30);
    assert_eq!(info(&image)["size"], 1u64 << 30);

    // Refused before the passphrase is asked for: there is none here, and no terminal.
    let err = fails(&["resize", p(&image), "--size", "32M"]);
    assert!(err.contains("--allow-shrink"), "{err}");
    assert_eq!(info(&image)["size"], 1u64 << 30);
    let err = fails(&["resize", p(&image), "--size", "1000"]);
    assert!(err.contains("4096-byte sector size"), "{err}");

    let text = ok(&[
        "resize",
        p(&image),
        "--size",
        "32M",
        "--allow-shrink",
        "--passphrase-file",
        p(&f.pw),
    ]);
    assert!(text.contains("from 1 GiB to 32 MiB"), "{text}");
    assert_eq!(info(&image)["size"], 32u64 << 20);
    // The writer lock was released on the way out.
    assert_eq!(info(&image)["lock"], Value::Null);
    // A size that is no whole number of MiB is not rounded to one ("32 MiB to 32 MiB").
    let text = ok(&[
        "resize",
        p(&image),
        "--size",
        "32772K",
        "--passphrase-file",
        p(&f.pw),
    ]);
    assert!(text.contains("from 32 MiB to 32772 KiB"), "{text}");
}

/// The NBD protocol's strings are at most 4096 bytes: a longer export name, which no client
/// could ask for, is refused before anything is opened.
#[test]
fn serve_refuses_an_export_name_clients_cannot_ask_for() {
    let f = Fixture::new();
    let image = f.path("disk");
    f.create(&image, "16M", &[]);
    let socket = f.path("s.sock");
    let long = "x".repeat(4097);
    let err = fails(&[
        "serve",
        p(&image),
        "--socket",
        p(&socket),
        "--export-name",
        &long,
    ]);
    assert!(
        err.contains("4097 bytes") && err.contains("at most 4096"),
        "{err}"
    );
    assert!(!socket.exists());
}

/// The largest size NBD clients take (2^63 bytes less a sector) is created and verified at
/// once (`verify` stat'ed each of its 2^41 objects before: it never ended); 8 EiB is refused
/// with its reason, by create and resize, and leaves nothing behind.
#[test]
fn the_largest_image_is_usable_and_a_larger_one_is_refused() {
    let f = Fixture::new();
    let too_big = f.path("too-big");
    let err = fails(&[
        "create",
        p(&too_big),
        "--size",
        "8E",
        "--passphrase-file",
        p(&f.pw),
    ]);
    assert!(err.contains("larger than the largest image"), "{err}");
    assert!(!too_big.exists());

    let image = f.path("largest");
    let largest = ((1u64 << 63) - 4096).to_string();
    f.create(&image, &largest, &[]);
    assert_eq!(info(&image)["size"], (1u64 << 63) - 4096);
    let err = fails(&[
        "resize",
        p(&image),
        "--size",
        "8E",
        "--passphrase-file",
        p(&f.pw),
    ]);
    assert!(err.contains("larger than the largest image"), "{err}");
    let report = json(&["verify", p(&image), "--passphrase-file", p(&f.pw)]);
    assert_eq!(report["sectors_checked"], 0, "{report}");
}

#[test]
fn a_wrong_passphrase_changes_nothing() {
    let f = Fixture::new();
    let image = f.path("disk");
    f.create(&image, "64M", &[]);
    let wrong = f.file("wrong", b"incorrect horse\n");
    let err = fails(&[
        "resize",
        p(&image),
        "--size",
        "128M",
        "--passphrase-file",
        p(&wrong),
    ]);
    assert!(err.contains("no keyslot matches this passphrase"), "{err}");
    assert!(err.contains("nothing was changed"), "{err}");
    assert!(!err.contains("incorrect horse"), "the secret leaked: {err}");
    assert_eq!(info(&image)["size"], 64u64 << 20);
    assert_eq!(info(&image)["lock"], Value::Null);

    // --key-file keeps the newline `--passphrase-file` drops, and says so when that fails.
    let err = fails(&[
        "resize",
        p(&image),
        "--size",
        "128M",
        "--key-file",
        p(&f.pw),
    ]);
    assert!(err.contains("trailing newline"), "{err}");
    assert_eq!(info(&image)["size"], 64u64 << 20);
    let exact = f.file("exact", b"correct horse");
    ok(&[
        "resize",
        p(&image),
        "--size",
        "128M",
        "--key-file",
        p(&exact),
    ]);
    assert_eq!(info(&image)["size"], 128u64 << 20);
}

#[test]
fn no_passphrase_and_no_terminal_is_a_clear_error() {
    let f = Fixture::new();
    let image = f.path("disk");
    let err = fails(&["create", p(&image), "--size", "64M"]);
    assert!(
        err.contains("--passphrase-file") && err.contains("--key-file"),
        "{err}"
    );
    assert!(fails(&["info", p(&image)]).contains("does not exist"));
    f.create(&image, "64M", &[]);
    let err = fails(&["resize", p(&image), "--size", "128M"]);
    assert!(err.contains("--passphrase-file"), "{err}");
}

#[test]
fn delete_asks_for_yes_then_removes_the_image() {
    let f = Fixture::new();
    let image = f.path("disk");
    f.create(&image, "64M", &[]);

    let err = fails(&["delete", p(&image)]);
    assert!(err.contains("pass --yes"), "{err}");
    assert_eq!(info(&image)["size"], 64u64 << 20, "still there");

    let deleted = json(&["delete", p(&image), "--yes"]);
    assert_eq!(deleted["deleted"], true);
    let err = fails(&["info", p(&image)]);
    assert!(err.contains("does not exist"), "{err}");
    assert!(err.contains("ivdisk create"), "{err}");
    // The store directory stays: what it is, and how to remove it, are said.
    assert!(err.contains("holds no image"), "{err}");
    assert!(err.contains("rm -r"), "{err}");
    assert!(fails(&["delete", p(&image), "--yes"]).contains("does not exist"));
    let err = fails(&["info", p(&f.path("never-made"))]);
    assert!(!err.contains("holds no image"), "{err}");

    // The directory can hold a new image afterwards.
    let again = f.create(&image, "32M", &[]);
    assert_eq!(info(&image)["image_id"], again["image_id"]);

    // A LUKS file is not an ivdisk image: refused as one, and left alone.
    let luks = f.path("luks.img");
    let mut args = vec!["header", "format", p(&luks), "--size", "16M", "--key-file"];
    args.push(p(&f.pw));
    args.extend(FAST);
    ok(&args);
    let err = fails(&["delete", p(&luks), "--yes"]);
    assert!(err.contains("LUKS file"), "{err}");
    assert!(err.contains("rm"), "{err}");
    assert!(luks.is_file());
    let notes = f.file("notes.txt", b"not a disk");
    let err = fails(&["delete", p(&notes), "--yes"]);
    assert!(err.contains("neither an ivdisk image"), "{err}");
    assert_eq!(std::fs::read(&notes).unwrap(), b"not a disk");
}

/// A mistyped image or snapshot is named before a passphrase is asked for (here, without a
/// terminal, the refusal to ask would come first otherwise).
#[test]
fn commands_name_a_missing_image_or_snapshot_before_asking_for_a_passphrase() {
    let f = Fixture::new();
    let image = f.path("disk");
    f.create(&image, "16M", &[]);
    let absent = f.path("absent");
    let socket = f.path("s.sock");
    let out = f.path("out.raw");
    let (missing, at_missing) = (p(&absent), format!("{}@nosnap", p(&image)));
    let commands: [&[&str]; 7] = [
        &["serve", missing, "--socket", p(&socket)],
        &["serve", &at_missing, "--socket", p(&socket)],
        &["passphrase", "test", missing],
        &["passphrase", "add", missing],
        &["export", missing, p(&out)],
        &["export", &at_missing, p(&out)],
        &["verify", missing],
    ];
    for args in commands {
        // (verify and passphrase test exit with 2 on an error, the others with 1.)
        let out = ivdisk(args);
        assert!(!out.status.success(), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        let named = err.contains("image ") && err.contains("does not exist")
            || err.contains("no snapshot named `nosnap`");
        assert!(
            named && !err.contains("no passphrase given"),
            "{args:?}: {err}"
        );
    }
    assert!(!socket.exists(), "nothing bound for a missing image");
}

/// A device given as an image (a LUKS volume on a loop device, say) is named as such, with
/// what to do instead: it read as "reading /dev/loop1/meta.sqlite: Not a directory".
#[test]
fn a_device_given_as_an_image_is_named_as_one() {
    let f = Fixture::new();
    for args in [
        vec!["info", "/dev/null"],
        vec!["serve", "/dev/null", "--socket", p(&f.path("x.sock"))],
        vec!["export", "/dev/null", p(&f.path("out.raw"))],
    ] {
        let err = fails(&args);
        assert!(
            err.contains("is a character device") && !err.contains("meta.sqlite"),
            "{args:?}: {err}"
        );
    }
}

#[test]
fn lock_status_and_break_without_a_holder() {
    let f = Fixture::new();
    let image = f.path("disk");
    f.create(&image, "64M", &[]);
    let status = json(&["lock", "status", p(&image)]);
    assert!(status.get("lock").is_some(), "{status}");
    assert_eq!(status["lock"], Value::Null);
    assert!(ok(&["lock", "status", p(&image)]).contains("no writer lock held"));
    let out = ok(&["lock", "break", p(&image)]);
    assert!(out.contains("nothing to break"), "{out}");
    assert!(fails(&["lock", "status", p(&f.path("absent"))]).contains("does not exist"));
}

/// librbd keeps an rbd:// image's writer lock: the lock commands name the rbd commands that
/// show it (they said only that rbd:// is not an ivdisk image).
#[test]
fn lock_commands_of_an_rbd_image_name_librbds_tools() {
    for args in [
        &[
            "lock",
            "status",
            "rbd://pool/vm?namespace=ns&conf=/nonexistent",
        ][..],
        &["lock", "break", "rbd://pool/vm?namespace=ns", "--yes"][..],
    ] {
        let err = fails(args);
        assert!(
            err.contains("librbd's exclusive lock")
                && err.contains("`rbd lock ls pool/ns/vm`")
                && err.contains("`rbd status pool/ns/vm`"),
            "{args:?}: {err}"
        );
    }
}

/// A writer that has the store open but no current lock record (one that stopped renewing
/// it: paused with SIGSTOP, hung) still keeps every other writer out: `lock status` and `info`
/// name it instead of saying that no lock is held. Here this test process is that writer.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_without_a_current_lock_record_is_still_named() {
    let f = Fixture::new();
    let image = f.path("disk");
    f.create(&image, "64M", &[]);
    let store = ivdisk_store::LocalStore::open(&image).unwrap();
    let ours = std::process::id();
    let status = json(&["lock", "status", p(&image)]);
    assert_eq!(status["lock"]["writing_process"], ours, "{status}");
    assert_eq!(status["lock"]["holder_gone"], false, "{status}");
    let said = ok(&["lock", "status", p(&image)]);
    assert!(
        said.contains(&format!("process {ours} has the store open for writing"))
            && !said.contains("no writer lock held"),
        "{said}"
    );
    let info = ok(&["info", p(&image)]);
    assert!(
        info.contains(&format!("process {ours} has the store open")),
        "{info}"
    );
    drop(store);
    assert_eq!(json(&["lock", "status", p(&image)])["lock"], Value::Null);
}

/// Not a test of its own (hence ignored): run by `a_dead_writers_lock_is_shown_and_broken`
/// with `DIE_HOLDING_LOCK` set, it opens that image for writing and exits without closing it,
/// as a writer that is killed.
#[test]
#[ignore = "a helper process of a_dead_writers_lock_is_shown_and_broken"]
fn helper_writer_that_dies_holding_the_lock() {
    let image =
        std::env::var(DIE_HOLDING_LOCK).expect("run by a_dead_writers_lock_is_shown_and_broken");
    let passphrase = std::env::var("IVDISK_TEST_PASSPHRASE").unwrap();
    let rt = tokio::runtime::Runtime::new().unwrap();
    let uri = ivdisk_image::ImageUri::parse(&image).unwrap();
    let options = ivdisk_image::OpenOptions {
        read_only: false,
        lock_duration: std::time::Duration::from_secs(3600),
        ..ivdisk_image::OpenOptions::default()
    };
    let opened = rt
        .block_on(ivdisk_image::Image::open(
            &uri,
            passphrase.as_bytes(),
            &options,
        ))
        .unwrap();
    // The local store commits in groups: make the lock durable, as a writer that ran a while.
    rt.block_on(opened.store().flush()).unwrap();
    std::mem::forget(opened);
    std::process::exit(0);
}

/// Run [`helper_writer_that_dies_holding_the_lock`] on `image`.
fn die_holding_the_lock(image: &std::path::Path) {
    let died = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "--ignored",
            "helper_writer_that_dies_holding_the_lock",
            "--test-threads=1",
        ])
        .env(DIE_HOLDING_LOCK, image)
        .env("IVDISK_TEST_PASSPHRASE", "correct horse")
        .output()
        .unwrap();
    assert!(
        died.status.success(),
        "{}",
        String::from_utf8_lossy(&died.stderr)
    );
}

#[test]
fn a_dead_writers_lock_is_shown_and_broken() {
    let f = Fixture::new();
    let image = f.path("disk");
    f.create(&image, "64M", &[]);
    die_holding_the_lock(&image);

    let status = json(&["lock", "status", p(&image)]);
    let client = status["lock"]["client"].as_str().unwrap().to_owned();
    assert!(
        status["lock"]["description"]
            .as_str()
            .unwrap()
            .contains("ivdisk pid"),
        "{status}"
    );
    assert!(status["lock"]["expires_in_secs"].as_u64().unwrap() > 3000);
    assert_eq!(status["lock"]["holder_gone"], true, "{status}");
    let said = ok(&["lock", "status", p(&image)]);
    assert!(said.contains("the holder is gone"), "{said}");
    let shown = info(&image);
    assert_eq!(shown["lock"]["client"], client.as_str());
    assert_eq!(
        shown["lock"]["holder_gone"], true,
        "info as lock status: {shown}"
    );
    let said = ok(&["info", p(&image)]);
    assert!(said.contains("the holder is gone"), "{said}");

    // `lock break` asks first.
    let err = fails(&["lock", "break", p(&image)]);
    assert!(err.contains("pass --yes") && err.contains(&client), "{err}");
    assert_eq!(
        json(&["lock", "status", p(&image)])["lock"]["client"],
        client.as_str()
    );

    let out = ivdisk(&["lock", "break", p(&image), "--yes"]);
    assert!(out.status.success());
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stdout.contains(&format!("broke the writer lock of client {client}")),
        "{stdout}"
    );
    assert!(stderr.contains("must really be gone"), "{stderr}");
    assert_eq!(json(&["lock", "status", p(&image)])["lock"], Value::Null);
    ok(&[
        "resize",
        p(&image),
        "--size",
        "128M",
        "--passphrase-file",
        p(&f.pw),
    ]);

    // On a local store no break is needed: the store has one writing process at a time, so
    // the next writer releases a dead one's lock at once, and says whose it was.
    die_holding_the_lock(&image);
    let dead = json(&["lock", "status", p(&image)])["lock"]["client"].clone();
    assert!(dead.is_string() && dead != client.as_str(), "{dead}");
    let out = ivdisk(&[
        "resize",
        p(&image),
        "--size",
        "256M",
        "--passphrase-file",
        p(&f.pw),
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stderr}");
    assert!(
        stderr.contains("released") && stderr.contains(dead.as_str().unwrap()),
        "{stderr}"
    );
    assert_eq!(info(&image)["size"], 256u64 << 20);
    assert_eq!(json(&["lock", "status", p(&image)])["lock"], Value::Null);
}

#[test]
fn image_addresses_are_checked() {
    let err = fails(&["info", "s3://bucket/disk"]);
    assert!(err.contains("unknown scheme"), "{err}");
    let err = fails(&["info", "rados://pool-without-image"]);
    assert!(err.contains("rados://POOL/IMAGE"), "{err}");
    // A snapshot where a command takes an image: named as one, with where snapshots go.
    for command in [
        &["delete", "rados://rbd/vm@monday?namespace=ns", "--yes"][..],
        &["resize", "rados://rbd/vm@monday", "--size", "1G"],
    ] {
        let err = fails(command);
        assert!(
            err.contains("names snapshot `monday` of image rados://rbd/vm")
                && err.contains("ivdisk snap rm"),
            "{err}"
        );
    }
    // rbd:// where an ivdisk image goes: what takes it, and how to make an ivdisk image of it.
    let err = fails(&["export", "rbd://rbd/vm", "/nonexistent/out.raw"]);
    assert!(err.contains("ivdisk convert rbd://"), "{err}");
    // A parameter twice is refused, not the last one taken; a missing keyring is named as one
    // (before any connection).
    let err = fails(&["info", "rados://rbd/vm?conf=/a.conf&conf=/b.conf"]);
    assert!(err.contains("`conf` is given twice"), "{err}");
    for scheme in ["rados", "rbd"] {
        let err = fails(&[
            "info",
            &format!("{scheme}://rbd/vm?keyring=/nonexistent/ceph.keyring"),
        ]);
        assert!(
            err.contains("keyring file /nonexistent/ceph.keyring")
                && err.contains("does not exist"),
            "{scheme}: {err}"
        );
        let err = fails(&["info", &format!("{scheme}://rbd/vm?id=a&id=b")]);
        assert!(err.contains("`id` is given twice"), "{scheme}: {err}");
    }
    // A local name with two '@' is offered no `create` it would refuse.
    let err = fails(&["snap", "ls", "/nonexistent/disk.ivd@a"]);
    assert!(!err.contains("ivdisk create"), "{err}");
    // A RADOS snapshot where an image goes is named as one (it read as a bad image name).
    let err = fails(&["snap", "ls", "rados://rbd/vm@a?conf=/nonexistent/ceph.conf"]);
    assert!(err.contains("this command takes an image"), "{err}");
    // `file:PATH` is the same image as `PATH`.
    let f = Fixture::new();
    let image = f.path("disk");
    let created = f.create(&image, "64M", &[]);
    let shown = json(&["info", &format!("file:{}", p(&image))]);
    assert_eq!(shown["image_id"], created["image_id"]);
    // A memory image lives as long as its process: created, then gone for the next command.
    let mut args = vec!["create", "mem:scratch", "--size", "1M", "--passphrase-file"];
    args.push(p(&f.pw));
    args.extend(FAST);
    let said = ok(&args);
    assert!(said.contains("gone now that ivdisk exits"), "{said}");
    assert!(fails(&["info", "mem:scratch"]).contains("does not exist"));
    // So do import's and convert's: they reported success without a word of it.
    let raw = f.file("small.raw", &[7u8; 8192]);
    for command in ["import", "convert"] {
        let mut args = vec![command, p(&raw), "mem:scratch", "--passphrase-file"];
        args.push(p(&f.pw));
        args.extend(FAST);
        if command == "convert" {
            args.extend(["--new-passphrase-file", p(&f.pw)]);
        }
        let said = ok(&args);
        assert!(
            said.contains("gone now that ivdisk exits"),
            "{command}: {said}"
        );
    }
}

/// A directory holding other files is not an image: opening it says so (not "create it",
/// which create then refuses), and neither open nor create leaves a store's files in it.
#[test]
fn a_directory_of_other_files_is_not_an_image() {
    let f = Fixture::new();
    let dir = f.path("photos");
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(dir.join("cat.jpg"), b"not a disk").unwrap();
    for command in ["info", "verify", "export"] {
        let mut args = vec![command, p(&dir)];
        let out = f.path("out.raw");
        if command == "export" {
            args.extend([p(&out), "--passphrase-file", p(&f.pw)]);
        }
        // `verify` exits 2 on errors other than failed sectors.
        let (_, err) = common::exits(if command == "verify" { 2 } else { 1 }, &args);
        assert!(err.contains("is not an ivdisk store"), "{command}: {err}");
        assert!(!err.contains("create it"), "{command}: {err}");
    }
    let mut args = vec![
        "create",
        p(&dir),
        "--size",
        "1M",
        "--passphrase-file",
        p(&f.pw),
    ];
    args.extend(FAST);
    let err = fails(&args);
    assert!(err.contains("is not an ivdisk store"), "{err}");
    let left: Vec<_> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(left, ["cat.jpg"]);
}

/// `ivdisk info disk.ivd | head -1`, and output redirected to a full disk: a reader that went
/// away ends the command quietly with SIGPIPE's status, as `ls` ends there (it panicked with a
/// backtrace before), and a write that fails otherwise is an error message, not a panic.
#[test]
fn output_to_a_closed_pipe_or_a_full_disk_is_no_panic() {
    let f = Fixture::new();
    let image = f.path("disk.ivd");
    f.create(&image, "1M", &[]);
    for args in [
        vec!["info", p(&image)],
        vec!["suites"],
        vec!["snap", "ls", p(&image)],
    ] {
        let (reader, writer) = std::io::pipe().unwrap();
        // The reader is gone before the command writes a byte, as when `head` has exited.
        drop(reader);
        let out = Command::new(env!("CARGO_BIN_EXE_ivdisk"))
            .args(&args)
            .stdout(writer)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(141), "{args:?}: {err}");
        assert!(err.is_empty(), "{args:?}: {err}");
    }
    let full = std::fs::OpenOptions::new()
        .write(true)
        .open("/dev/full")
        .unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_ivdisk"))
        .args(["info", p(&image)])
        .stdout(full)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("writing to standard output failed"), "{err}");
    assert!(!err.contains("panicked"), "{err}");
}

/// Creates of one new path at once: one wins, the others say another process has it or it
/// exists (never the store's internals, such as SQLite's "no such table"), and the image opens.
#[test]
fn concurrent_creates_of_one_path_leave_one_image_and_clear_errors() {
    let f = Fixture::new();
    let mut told_of_the_creator = 0;
    for round in 0..6 {
        let image = f.path(&format!("race-{round}"));
        let racers: Vec<_> = (0..4)
            .map(|_| {
                Command::new(env!("CARGO_BIN_EXE_ivdisk"))
                    .args(["create", p(&image), "--size", "1M", "--passphrase-file"])
                    .arg(&f.pw)
                    .args(FAST)
                    .stdin(std::process::Stdio::null())
                    .stdout(std::process::Stdio::piped())
                    .stderr(std::process::Stdio::piped())
                    .spawn()
                    .unwrap()
            })
            .collect();
        let outs: Vec<_> = racers
            .into_iter()
            .map(|r| r.wait_with_output().unwrap())
            .collect();
        let errors: Vec<String> = outs
            .iter()
            .filter(|o| !o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stderr).into_owned())
            .collect();
        assert_eq!(errors.len(), 3, "round {round}: {errors:?}");
        for err in &errors {
            assert!(
                err.contains("is creating it too (or has just created it")
                    || err.contains("already open for writing by process")
                    || err.contains("already exists"),
                "round {round}: {err}"
            );
        }
        assert_eq!(info(&image)["size"], 1u64 << 20);
        told_of_the_creator += errors
            .iter()
            .filter(|e| e.contains("is creating it too"))
            .count();
    }
    // Losers that meet the winner at work are told so (not "stop it first").
    assert!(told_of_the_creator > 0);
}

/// `command` run by a shell with a terminal of its own (`script`), for at most 20 s.
fn in_a_terminal(command: &str) -> std::process::Output {
    std::process::Command::new("timeout")
        .args(["20", "script", "-qec", command, "/dev/null"])
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap()
}

/// `--passphrase-file -` with standard input a terminal is refused at once, saying how to
/// type the passphrase unseen: read to its end from a terminal, the passphrase showed as it
/// was typed and kept the newline that ended the line. (`script` gives the command a
/// terminal.)
#[test]
fn a_secret_from_standard_input_is_not_read_from_a_terminal() {
    let f = Fixture::new();
    let image = f.path("image");
    let command = format!(
        "{} create {} --size 1M --passphrase-file -",
        env!("CARGO_BIN_EXE_ivdisk"),
        p(&image)
    );
    let out = in_a_terminal(&command);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("standard input is a terminal"),
        "{:?}: {text}",
        out.status
    );
    assert!(!image.exists());
}

/// A signal that ends `ivdisk` at its passphrase prompt (Ctrl-C, a SIGTERM) leaves the
/// terminal as it found it: the prompt turns echo off, and the process died with it off, so
/// the user's shell showed nothing they typed. (`script` gives the command a terminal; `sh`
/// runs it in the background with the terminal as its input, and SIGTERM, since a
/// background job of `sh` ignores SIGINT.)
#[test]
fn a_signal_at_the_passphrase_prompt_leaves_the_terminal_echoing() {
    let f = Fixture::new();
    let image = f.path("image");
    f.create(&image, "1M", &[]);
    let command = format!(
        "sh -c '{} passphrase test {} </dev/tty & pid=$!; sleep 1; kill -TERM $pid; \
         wait $pid; echo status=$?; stty -a'",
        env!("CARGO_BIN_EXE_ivdisk"),
        p(&image)
    );
    let out = in_a_terminal(&command);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(
        text.contains("Enter passphrase:") && text.contains("status=143"),
        "{:?}: {text}",
        out.status
    );
    let flags: Vec<&str> = text.split([' ', ';', '\r', '\n']).collect();
    assert!(
        flags.contains(&"echo") && !flags.contains(&"-echo"),
        "echo left off: {text}"
    );
}

/// With `--json` on a terminal, the unlock spinner is not drawn either: `script` gives the
/// command a terminal for both its outputs, and what it shows must be the one JSON object
/// (the spinner's frames came before it).
#[test]
fn json_on_a_terminal_draws_no_spinner() {
    let f = Fixture::new();
    let image = f.path("image");
    f.create(&image, "8M", &[]);
    let command = format!(
        "{} export {} {} --passphrase-file {} --json",
        env!("CARGO_BIN_EXE_ivdisk"),
        p(&image),
        p(&f.path("out.raw")),
        p(&f.pw)
    );
    let out = in_a_terminal(&command);
    assert!(out.status.success(), "{:?}", out);
    let text = String::from_utf8_lossy(&out.stdout);
    let object: Value = serde_json::from_str(text.trim())
        .unwrap_or_else(|e| panic!("not one JSON object ({e}): {text:?}"));
    assert_eq!(object["size"], 8u64 << 20, "{text}");
}

/// The command a message suggests (the text between backticks that starts with `start`),
/// run by `sh` as a user who pasted it would, with `ivdisk` standing for the built binary.
fn run_suggested(message: &str, start: &str, extra: &str) -> std::process::Output {
    let command = message
        .split('`')
        .skip(1)
        .step_by(2)
        .find(|c| c.starts_with(start))
        .unwrap_or_else(|| panic!("no `{start} ...` in: {message}"));
    let binary = env!("CARGO_BIN_EXE_ivdisk");
    let line = format!("{}{extra}", command.replacen("ivdisk", binary, 1));
    Command::new("sh")
        .arg("-c")
        .arg(&line)
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap()
}

/// Messages that suggest a command give one that runs as shown when pasted into a shell, with
/// the image's path as one word: a path with a space, a quote or an `&` was given bare (an
/// `&` sent part of the command to the background and ran the rest as another).
#[test]
fn suggested_commands_run_as_shown_in_a_shell() {
    let f = Fixture::new();
    let image = f.path("vm's disk & more.ivd");
    f.create(&image, "8M", &[]);
    let missing = format!("{}@nosuch", p(&image));
    let message = fails(&["info", &missing]);
    let listed = run_suggested(&message, "ivdisk snap ls", "");
    assert!(
        listed.status.success(),
        "{message}: {}",
        String::from_utf8_lossy(&listed.stderr)
    );
    assert!(
        String::from_utf8_lossy(&listed.stdout).contains("no snapshots"),
        "{}",
        String::from_utf8_lossy(&listed.stdout)
    );
    let mut again = vec!["create", p(&image), "--size", "8M", "--passphrase-file"];
    again.push(p(&f.pw));
    again.extend(FAST);
    let message = fails(&again);
    let deleted = run_suggested(&message, "ivdisk delete", " --yes");
    assert!(
        deleted.status.success(),
        "{message}: {}",
        String::from_utf8_lossy(&deleted.stderr)
    );
    let gone = fails(&["info", p(&image)]);
    assert!(gone.contains("does not exist"), "{gone}");
    // The store directory stays; the message says how to remove it.
    let message = String::from_utf8_lossy(&deleted.stdout).into_owned();
    let removed = run_suggested(&message, "rm -r", "");
    assert!(removed.status.success(), "{message}");
    assert!(!image.exists(), "the suggested rm -r removed the directory");
}

/// `create` over a LUKS volume that another tool made refuses without suggesting `ivdisk
/// delete` (which refuses such a file, and would be about an encrypted volume the user may
/// need), and says what to do instead.
#[test]
fn create_over_a_luks_file_suggests_no_delete() {
    let f = Fixture::new();
    let luks = f.path("vol.img");
    std::fs::write(&luks, vec![0u8; 20 << 20]).unwrap();
    let made = Command::new("cryptsetup")
        .args(["luksFormat", "--type", "luks2", "--batch-mode"])
        .args(["--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"])
        .args(["--key-file", p(&f.pw)])
        .arg(&luks)
        .output()
        .unwrap();
    assert!(made.status.success(), "{made:?}");
    let before = std::fs::read(&luks).unwrap();
    let mut args = vec!["create", p(&luks), "--size", "1M", "--passphrase-file"];
    args.push(p(&f.pw));
    args.extend(FAST);
    let err = fails(&args);
    assert!(err.contains("is a LUKS volume"), "{err}");
    assert!(!err.contains("ivdisk delete"), "{err}");
    assert!(
        std::fs::read(&luks).unwrap() == before,
        "the volume is untouched"
    );
}

/// A rollback stopped by SIGTERM says so, with the command that finishes it, and exits 1
/// (it died of the signal without a word before); the image is refused until then, and the
/// rollback run again finishes it.
#[test]
fn a_rollback_stopped_by_a_signal_says_how_to_finish_it() {
    let f = Fixture::new();
    let image = f.path("disk");
    // 16384 objects of 4 KiB: a rollback visits each, long enough to be caught running.
    let raw = f.file("disk.raw", &common::random(64 << 20, 5));
    let mut args = vec!["import", p(&raw), p(&image), "--object-size", "4K"];
    args.extend(["--passphrase-file", p(&f.pw)]);
    args.extend(FAST);
    ok(&args);
    let at = format!("{}@s", p(&image));
    ok(&["snap", "create", &at]);
    let mut rollback = Command::new(env!("CARGO_BIN_EXE_ivdisk"))
        .args(["snap", "rollback", &at])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    // Signalled once the rollback is recorded as under way (its objects are changing).
    let started = std::time::Instant::now();
    while info(&image)["unfinished"].is_null() {
        assert!(
            rollback.try_wait().unwrap().is_none(),
            "the rollback ended before it was seen running"
        );
        assert!(started.elapsed() < std::time::Duration::from_secs(60));
        std::thread::sleep(std::time::Duration::from_millis(5));
    }
    let sent = Command::new("kill")
        .args(["-TERM", &rollback.id().to_string()])
        .status()
        .unwrap();
    assert!(sent.success());
    let out = rollback.wait_with_output().unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{stderr}");
    assert!(
        stderr.contains("interrupted")
            && stderr.contains("stopped part-way")
            && stderr.contains(&format!("ivdisk snap rollback {at}")),
        "{stderr}"
    );
    let err = fails(&[
        "export",
        p(&image),
        p(&f.path("out.raw")),
        "--passphrase-file",
        p(&f.pw),
    ]);
    assert!(err.contains("did not finish"), "{err}");
    ok(&["snap", "rollback", &at]);
    assert!(info(&image)["unfinished"].is_null());
}
