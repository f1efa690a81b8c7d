//! `ivdisk header …` and `ivdisk key …` as a user runs them: the built binary, key files,
//! exit codes and messages; cryptsetup checks the results where it can.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

const FAST: [&str; 4] = ["--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "1000"];

fn ivdisk(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_ivdisk"))
        .args(args)
        .output()
        .unwrap()
}

fn ok(args: &[&str]) -> String {
    let out = ivdisk(args);
    assert!(
        out.status.success(),
        "ivdisk {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

fn fails(args: &[&str]) -> String {
    let out = ivdisk(args);
    assert!(!out.status.success(), "ivdisk {args:?} should fail");
    String::from_utf8(out.stderr).unwrap()
}

/// A command that exits with status 1: its (stdout, stderr).
fn exits_1(args: &[&str]) -> (String, String) {
    let out = ivdisk(args);
    assert_eq!(out.status.code(), Some(1), "ivdisk {args:?}");
    (
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

fn key(dir: &Path, name: &str, content: &[u8]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, content).unwrap();
    path
}

fn p(path: &Path) -> &str {
    path.to_str().unwrap()
}

/// A 64 MiB header with one fast PBKDF2 keyslot for the passphrase in `key_file`.
fn format_header(header: &Path, key_file: &Path) {
    let mut args = vec!["header", "format", p(header), "--size", "64M"];
    args.extend(["--key-file", p(key_file)]);
    args.extend(FAST);
    ok(&args);
}

fn keyslot_ids(header: &Path) -> Vec<u64> {
    let dump: Value = serde_json::from_str(&ok(&["header", "dump", "--json", p(header)])).unwrap();
    dump["keyslots"]
        .as_array()
        .unwrap()
        .iter()
        .map(|k| k["id"].as_u64().unwrap())
        .collect()
}

#[test]
fn keyslot_lifecycle_through_the_command_line() {
    let dir = tempfile::tempdir().unwrap();
    let hdr = dir.path().join("disk.hdr");
    let one = key(dir.path(), "one", b"first passphrase");
    let two = key(
        dir.path(),
        "two",
        b"second\npassphrase with a newline, kept as is",
    );
    let three = key(dir.path(), "three", b"third");
    let wrong = key(dir.path(), "wrong", b"nope");

    let mut args = vec![
        "header",
        "format",
        p(&hdr),
        "--size",
        "1G",
        "--key-file",
        p(&one),
        "--json",
    ];
    args.extend(FAST);
    let made: Value = serde_json::from_str(&ok(&args)).unwrap();
    assert_eq!(made["keyslot"], 0);
    // The layout `ivdisk create` would choose for the default suite.
    let dump: Value = serde_json::from_str(&ok(&["header", "dump", "--json", p(&hdr)])).unwrap();
    assert_eq!(dump["image"]["layout"], "omap-packed", "{dump}");
    assert!(fails(&[
        "header",
        "format",
        p(&hdr),
        "--size",
        "1G",
        "--key-file",
        p(&one)
    ])
    .contains("--force"));

    let mut args = vec![
        "key",
        "add",
        p(&hdr),
        "--key-file",
        p(&one),
        "--new-key-file",
        p(&two),
        "--json",
    ];
    args.extend(FAST);
    let added: Value = serde_json::from_str(&ok(&args)).unwrap();
    assert_eq!(added["keyslot"], 1);
    assert_eq!(keyslot_ids(&hdr), vec![0, 1]);
    assert_eq!(added["keyslots"], serde_json::json!([0, 1]), "{added}");

    let tested: Value = serde_json::from_str(&ok(&[
        "key",
        "test",
        p(&hdr),
        "--key-file",
        p(&two),
        "--json",
    ]))
    .unwrap();
    assert_eq!(tested["keyslot"], 1);
    let err = fails(&["key", "test", p(&hdr), "--key-file", p(&wrong)]);
    assert!(
        err.contains("no keyslot matches this passphrase (2 keyslot(s) tried)"),
        "{err}"
    );
    // With --json, "no" is an answer on stdout too (and the exit status says it).
    let (out, err) = exits_1(&["key", "test", p(&hdr), "--key-file", p(&wrong), "--json"]);
    let answer: Value = serde_json::from_str(&out).unwrap_or_else(|e| panic!("{e}: {out}"));
    assert_eq!(answer["ok"], false, "{answer}");
    assert_eq!(answer["keyslot"], Value::Null, "{answer}");
    assert!(
        answer["reason"]
            .as_str()
            .unwrap()
            .contains("no keyslot matches"),
        "{answer}"
    );
    assert!(err.contains("no keyslot matches"), "{err}");

    let mut args = vec![
        "key",
        "change",
        p(&hdr),
        "--key-file",
        p(&two),
        "--new-key-file",
        p(&three),
    ];
    args.extend(FAST);
    assert!(ok(&args).contains("keyslot 1"));
    fails(&["key", "test", p(&hdr), "--key-file", p(&two)]);
    ok(&["key", "test", p(&hdr), "--key-file", p(&three)]);

    // Remove by number needs a passphrase of some keyslot; the last keyslot needs --force.
    let err = fails(&[
        "key",
        "remove",
        p(&hdr),
        "--key-slot",
        "0",
        "--key-file",
        p(&wrong),
    ]);
    assert!(err.contains("needs a passphrase"), "{err}");
    ok(&[
        "key",
        "remove",
        p(&hdr),
        "--key-slot",
        "0",
        "--key-file",
        p(&three),
    ]);
    assert_eq!(keyslot_ids(&hdr), vec![1]);
    // Refusals name the file, as the `passphrase` commands name the image.
    let err = fails(&["key", "remove", p(&hdr), "--key-file", p(&three)]);
    assert!(
        err.contains("last one") && err.contains("--force") && err.contains(p(&hdr)),
        "{err}"
    );
    assert_eq!(keyslot_ids(&hdr), vec![1]);
    let mut args = vec!["key", "add", p(&hdr), "--key-file", p(&three)];
    args.extend(["--new-key-file", p(&one), "--new-key-slot", "32"]);
    args.extend(FAST);
    let err = fails(&args);
    assert!(
        err.contains("out of range") && err.contains(p(&hdr)),
        "{err}"
    );

    // cryptsetup agrees with what the command line did.
    let out = Command::new("cryptsetup")
        .args([
            "luksOpen",
            "--test-passphrase",
            "--key-file",
            p(&three),
            p(&hdr),
        ])
        .output()
        .expect("cryptsetup must be installed");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

#[test]
fn volume_key_file_recovers_access() {
    let dir = tempfile::tempdir().unwrap();
    let hdr = dir.path().join("disk.hdr");
    let vk = key(dir.path(), "vk", &[0x11; 16]);
    let lost = key(dir.path(), "lost", b"forgotten");
    let fresh = key(dir.path(), "fresh", b"new start");
    let mut args = vec![
        "header",
        "format",
        p(&hdr),
        "--size",
        "64M",
        "--cipher",
        "aegis128l-random",
        "--volume-key-file",
        p(&vk),
        "--key-file",
        p(&lost),
    ];
    args.extend(FAST);
    ok(&args);
    let wrong_vk = key(dir.path(), "wrong_vk", &[0x12; 16]);
    let err = fails(&["key", "test", p(&hdr), "--volume-key-file", p(&wrong_vk)]);
    assert!(err.contains("volume key does not match"), "{err}");
    let (out, _) = exits_1(&[
        "key",
        "test",
        p(&hdr),
        "--volume-key-file",
        p(&wrong_vk),
        "--json",
    ]);
    assert!(out.contains(r#""ok":false"#), "{out}");
    // A file of another length (a passphrase file given for the key, say) is named as such:
    // it once read as a key that merely differs.
    let long_vk = key(dir.path(), "long_vk", &[0x11; 32]);
    let err = fails(&["key", "test", p(&hdr), "--volume-key-file", p(&long_vk)]);
    assert!(
        err.contains("is 32 bytes long, and this volume's key is 16 bytes"),
        "{err}"
    );
    let (out, _) = exits_1(&[
        "key",
        "test",
        p(&hdr),
        "--volume-key-file",
        p(&long_vk),
        "--json",
    ]);
    assert!(out.contains(r#""ok":false"#), "{out}");
    // A failure that is no answer (no such file) is an error object, not a mismatch, and
    // exit code 2.
    let out = ivdisk(&[
        "key",
        "test",
        p(&dir.path().join("none")),
        "--key-file",
        p(&lost),
        "--json",
    ]);
    assert_eq!(out.status.code(), Some(2));
    let failed: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(failed["ok"], false, "{failed}");
    assert!(
        failed["error"]
            .as_str()
            .is_some_and(|e| e.contains("No such file")),
        "{failed}"
    );
    assert!(failed.get("keyslot").is_none(), "{failed}");
    let mut args = vec![
        "key",
        "add",
        p(&hdr),
        "--volume-key-file",
        p(&vk),
        "--new-key-file",
        p(&fresh),
    ];
    args.extend(FAST);
    ok(&args);
    ok(&["key", "test", p(&hdr), "--key-file", p(&fresh)]);
}

#[test]
fn header_backup_and_restore_through_the_command_line() {
    let dir = tempfile::tempdir().unwrap();
    let hdr = dir.path().join("disk.hdr");
    let backup = dir.path().join("disk.backup");
    let pw = key(dir.path(), "pw", b"pw");
    format_header(&hdr, &pw);
    ok(&["header", "backup", p(&hdr), p(&backup)]);
    let mode =
        std::os::unix::fs::PermissionsExt::mode(&std::fs::metadata(&backup).unwrap().permissions());
    assert_eq!(mode & 0o777, 0o600, "keyslots: for the owner only");
    assert!(fails(&["header", "backup", p(&hdr), p(&backup)]).contains("must not exist"));

    // Both copies gone: the error says how to recover, and the backup does it.
    std::os::unix::fs::FileExt::write_all_at(
        &std::fs::OpenOptions::new().write(true).open(&hdr).unwrap(),
        &vec![0xee; 32 << 10],
        0,
    )
    .unwrap();
    let err = fails(&["key", "test", p(&hdr), "--key-file", p(&pw)]);
    assert!(err.contains("ivdisk header restore"), "{err}");
    ok(&["header", "restore", p(&hdr), p(&backup)]);
    ok(&["key", "test", p(&hdr), "--key-file", p(&pw)]);
}

#[test]
fn missing_passphrase_without_a_terminal_is_a_clear_error() {
    let dir = tempfile::tempdir().unwrap();
    let hdr = dir.path().join("disk.hdr");
    let pw = key(dir.path(), "pw", b"pw");
    format_header(&hdr, &pw);
    let out = Command::new(env!("CARGO_BIN_EXE_ivdisk"))
        .args(["key", "test", p(&hdr)])
        .stdin(std::process::Stdio::null())
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--key-file"));
}

/// A passphrase file that cannot be used is called a passphrase file (a key file keeps its own
/// name), and the image is not created.
#[test]
fn an_unusable_passphrase_file_is_named_as_such() {
    let dir = tempfile::tempdir().unwrap();
    let image = dir.path().join("disk");
    let missing = dir.path().join("missing.txt");
    let empty = key(dir.path(), "empty.txt", b"");
    for (file, said) in [
        (&missing, "cannot open passphrase file"),
        (&empty, "is empty"),
    ] {
        let err = fails(&[
            "create",
            p(&image),
            "--size",
            "1M",
            "--passphrase-file",
            p(file),
        ]);
        assert!(err.contains(said), "{err}");
        assert!(err.contains("passphrase file"), "{err}");
        assert!(!err.contains("key file"), "{err}");
        assert!(!image.exists(), "{err}");
    }
    let err = fails(&[
        "create",
        p(&image),
        "--size",
        "1M",
        "--key-file",
        p(&missing),
    ]);
    assert!(err.contains("cannot open key file"), "{err}");
}

/// Costs OpenSSL cannot count (PBKDF2's iterations are a C int) are refused before anything is
/// written: no panic, no 16 MiB file of zeros left where the header was to be, and a later
/// format of the same name works without --force.
#[test]
fn impossible_and_weak_kdf_costs_are_refused_and_leave_no_file() {
    let dir = tempfile::tempdir().unwrap();
    let pass = key(dir.path(), "pass", b"correct horse");
    let header = dir.path().join("disk.hdr");
    let mut args = vec!["header", "format", p(&header), "--size", "64M"];
    args.extend(["--key-file", p(&pass)]);
    args.extend([
        "--pbkdf",
        "pbkdf2",
        "--pbkdf-force-iterations",
        "3000000000",
    ]);
    let err = fails(&args);
    assert!(err.contains("2147483647"), "{err}");
    assert!(
        !header.exists(),
        "a failed format left {}",
        header.display()
    );
    format_header(&header, &pass);

    let mut args = vec!["key", "add", p(&header), "--key-file", p(&pass)];
    let new = key(dir.path(), "new", b"battery staple");
    args.extend(["--new-key-file", p(&new)]);
    args.extend([
        "--pbkdf",
        "pbkdf2",
        "--pbkdf-force-iterations",
        "2147483648",
    ]);
    let err = fails(&args);
    assert!(err.contains("2147483647"), "{err}");
    assert_eq!(keyslot_ids(&header), vec![0]);

    // No time and no memory made weak keyslots without a word (time cost 4 at 721 KiB, and
    // 32 KiB); refused, naming the option, before the benchmark and before any file.
    let image = dir.path().join("weak.ivd");
    for (weak, said) in [
        (["--iter-time", "0"], "--iter-time 0"),
        (
            ["--pbkdf-memory", "0"],
            "--pbkdf-memory 0 is below Argon2's least memory",
        ),
        // No threads was taken as one.
        (["--pbkdf-parallel", "0"], "'--pbkdf-parallel <N>'"),
    ] {
        let mut args = vec!["create", p(&image), "--size", "16M"];
        args.extend(["--passphrase-file", p(&pass)]);
        args.extend(weak);
        let err = fails(&args);
        assert!(err.contains(said), "{err}");
        assert!(!image.exists(), "a refused create left {}", image.display());
        let mut args = vec!["key", "add", p(&header), "--key-file", p(&pass)];
        args.extend(["--new-key-file", p(&new)]);
        args.extend(weak);
        let err = fails(&args);
        assert!(err.contains(said), "{err}");
        assert_eq!(keyslot_ids(&header), vec![0]);
    }
}

/// `ivdisk key` is for LUKS files; on an ivdisk image (a directory) it says what to use.
#[test]
fn key_commands_on_an_ivdisk_image_point_to_passphrase() {
    let dir = tempfile::tempdir().unwrap();
    let pass = key(dir.path(), "pass", b"correct horse");
    let image = dir.path().join("disk.ivd");
    let mut args = vec!["create", p(&image), "--size", "64M"];
    args.extend(["--passphrase-file", p(&pass)]);
    args.extend(FAST);
    ok(&args);
    let err = fails(&["key", "test", p(&image), "--key-file", p(&pass)]);
    assert!(err.contains("ivdisk passphrase"), "{err}");
}

/// A keyslot change takes the file's `flock` and reads the header again under it before it
/// writes, as cryptsetup does (it locks a LUKS file itself): while another program holds it,
/// the change waits, so two changes made at once cannot overwrite each other (one keyslot was
/// lost before, while both commands said they added theirs).
#[test]
fn a_keyslot_change_waits_for_another_programs_lock_on_the_file() {
    use std::time::{Duration, Instant};
    let dir = tempfile::tempdir().unwrap();
    let hdr = dir.path().join("disk.hdr");
    let one = key(dir.path(), "one", b"first passphrase");
    let two = key(dir.path(), "two", b"second passphrase");
    format_header(&hdr, &one);

    // Released when `holder` is dropped.
    let holder = std::fs::File::open(&hdr).unwrap();
    rustix::fs::flock(&holder, rustix::fs::FlockOperation::LockExclusive).unwrap();
    let started = Instant::now();
    let mut add = Command::new(env!("CARGO_BIN_EXE_ivdisk"))
        .args(["passphrase", "add", p(&hdr), "--key-file", p(&one)])
        .args(["--new-key-file", p(&two)])
        .args(FAST)
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    assert!(
        add.try_wait().unwrap().is_none(),
        "the change did not wait for the lock"
    );
    assert_eq!(keyslot_ids(&hdr), [0], "nothing written while locked");
    drop(holder);
    let out = add.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(started.elapsed() >= Duration::from_millis(1500));
    assert_eq!(keyslot_ids(&hdr), [0, 1]);
}

/// `header restore` onto a LUKS file takes the file's lock as keyslot changes do: it waits
/// for another program's change to end, where it wrote at once (a change made meanwhile from
/// an older read then undid the restore, or mixed with it).
#[test]
fn a_header_restore_waits_for_another_programs_lock_on_the_file() {
    use std::time::{Duration, Instant};
    let dir = tempfile::tempdir().unwrap();
    let hdr = dir.path().join("disk.hdr");
    let one = key(dir.path(), "one", b"first passphrase");
    let two = key(dir.path(), "two", b"second passphrase");
    format_header(&hdr, &one);
    let backup = dir.path().join("disk.backup");
    ok(&["header", "backup", p(&hdr), p(&backup)]);
    let mut args = vec!["passphrase", "add", p(&hdr), "--key-file", p(&one)];
    args.extend(["--new-key-file", p(&two)]);
    args.extend(FAST);
    ok(&args);
    assert_eq!(keyslot_ids(&hdr), [0, 1]);

    let holder = std::fs::File::open(&hdr).unwrap();
    rustix::fs::flock(&holder, rustix::fs::FlockOperation::LockExclusive).unwrap();
    let started = Instant::now();
    let restore = Command::new(env!("CARGO_BIN_EXE_ivdisk"))
        .args(["header", "restore", p(&hdr), p(&backup)])
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(1500));
    assert_eq!(
        keyslot_ids(&hdr),
        [0, 1],
        "the restore wrote while another program held the file's lock"
    );
    drop(holder);
    let out = restore.wait_with_output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(started.elapsed() >= Duration::from_millis(1500));
    assert_eq!(keyslot_ids(&hdr), [0]);
}

/// A `header backup` of a LUKS file that fails part-way (the file ends inside its keyslots
/// area) removes what it wrote: the partial file held valid header copies and read as a
/// header, and a second try said it must not exist.
#[test]
fn a_failed_header_backup_leaves_no_file() {
    let dir = tempfile::tempdir().unwrap();
    let hdr = dir.path().join("disk.hdr");
    let one = key(dir.path(), "one", b"first passphrase");
    format_header(&hdr, &one);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&hdr)
        .unwrap()
        .set_len(2 << 20)
        .unwrap();
    let backup = dir.path().join("disk.backup");
    let err = fails(&["header", "backup", p(&hdr), p(&backup)]);
    assert!(err.contains("partial backup was removed"), "{err}");
    assert!(!backup.exists(), "a partial backup was left behind");
}

/// `header format --force` over a header leaves it as it was when the new one cannot be
/// made (here a volume key of the wrong length): the file was truncated first, and the old
/// header, a detached volume's only key material, was gone.
#[test]
fn a_forced_header_format_that_fails_keeps_the_old_header() {
    let dir = tempfile::tempdir().unwrap();
    let hdr = dir.path().join("vol.hdr");
    let pw = key(dir.path(), "pw", b"passphrase");
    format_header(&hdr, &pw);
    let before = std::fs::read(&hdr).unwrap();
    let bad = key(dir.path(), "bad.key", b"12345");
    let mut args = vec!["header", "format", p(&hdr), "--size", "1M", "--force"];
    args.extend(["--key-file", p(&pw), "--volume-key-file", p(&bad)]);
    args.extend(FAST);
    let err = fails(&args);
    assert!(err.contains("left as it was"), "{err}");
    assert!(
        std::fs::read(&hdr).unwrap() == before,
        "the old header is intact"
    );
    let left: Vec<_> = std::fs::read_dir(dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|name| name.contains("ivdisk-format"))
        .collect();
    assert!(left.is_empty(), "left behind: {left:?}");
    // A good format with --force replaces it.
    let mut args = vec!["header", "format", p(&hdr), "--size", "1M", "--force"];
    args.extend(["--key-file", p(&pw)]);
    args.extend(FAST);
    ok(&args);
    assert!(std::fs::read(&hdr).unwrap() != before);
    assert_eq!(keyslot_ids(&hdr), vec![0]);
    // A size no other command takes (8E and up: `create` refuses it too) is refused here, and
    // the header stays.
    let before = std::fs::read(&hdr).unwrap();
    let mut args = vec!["header", "format", p(&hdr), "--size", "8E", "--force"];
    args.extend(["--key-file", p(&pw)]);
    args.extend(FAST);
    let err = fails(&args);
    assert!(err.contains("below 8E"), "{err}");
    assert!(std::fs::read(&hdr).unwrap() == before);
}

/// `header format --force` replaces detached header files, not LUKS volumes holding their
/// data: over a cryptsetup volume it is refused and the volume stays whole (it was cut to a
/// 16 MiB detached header, its data gone).
#[test]
fn a_forced_header_format_leaves_a_luks_volume_with_data_alone() {
    let dir = tempfile::tempdir().unwrap();
    let pw = key(dir.path(), "pw", b"passphrase");
    let volume = dir.path().join("vol.img");
    std::fs::File::create(&volume)
        .unwrap()
        .set_len(32 << 20)
        .unwrap();
    let made = Command::new("cryptsetup")
        .args(["luksFormat", "--batch-mode", "--type", "luks2"])
        .args(FAST)
        .args(["--key-file", p(&pw), p(&volume)])
        .output()
        .expect("cryptsetup must be installed (apt-get install cryptsetup-bin)");
    assert!(made.status.success(), "{made:?}");
    let before = std::fs::read(&volume).unwrap();
    let mut args = vec!["header", "format", p(&volume), "--size", "16M", "--force"];
    args.extend(["--key-file", p(&pw)]);
    args.extend(FAST);
    let err = fails(&args);
    assert!(
        err.contains("LUKS volume with") && err.contains("would destroy that data"),
        "{err}"
    );
    assert!(
        std::fs::read(&volume).unwrap() == before,
        "the volume is intact"
    );
    ok(&["key", "test", p(&volume), "--key-file", p(&pw)]);
}

/// A header file holds keyslots, which allow guessing the passphrase offline: `header format`
/// makes it its owner's only (mode 0600, as cryptsetup), `--force` keeps the mode of the file
/// it replaces (the rename left 0644), and through a symbolic link it replaces the file the
/// link names (it replaced the link, and the real header kept its old keyslots).
#[test]
fn header_format_keeps_header_files_private_and_follows_links() {
    use std::os::unix::fs::PermissionsExt;
    let dir = tempfile::tempdir().unwrap();
    let one = key(dir.path(), "one", b"first passphrase");
    let two = key(dir.path(), "two", b"second passphrase");
    let mode = |path: &Path| std::fs::metadata(path).unwrap().permissions().mode() & 0o777;
    let hdr = dir.path().join("disk.hdr");
    format_header(&hdr, &one);
    assert_eq!(mode(&hdr), 0o600, "a new header file");
    std::fs::set_permissions(&hdr, std::fs::Permissions::from_mode(0o640)).unwrap();
    let mut args = vec!["header", "format", p(&hdr), "--size", "64M", "--force"];
    args.extend(["--key-file", p(&two)]);
    args.extend(FAST);
    ok(&args);
    assert_eq!(mode(&hdr), 0o640, "the replaced file's mode");

    let link = dir.path().join("link.hdr");
    std::os::unix::fs::symlink(&hdr, &link).unwrap();
    let before = std::fs::read(&hdr).unwrap();
    let mut args = vec!["header", "format", p(&link), "--size", "64M", "--force"];
    args.extend(["--key-file", p(&one)]);
    args.extend(FAST);
    ok(&args);
    assert!(
        std::fs::symlink_metadata(&link)
            .unwrap()
            .file_type()
            .is_symlink(),
        "the link stays a link"
    );
    assert!(
        std::fs::read(&hdr).unwrap() != before,
        "the named file is new"
    );
    assert_eq!(mode(&hdr), 0o640);
    // The new header opens with the new passphrase only.
    let mut test = vec!["passphrase", "test", p(&hdr), "--key-file"];
    test.push(p(&one));
    ok(&test);
}

/// A header file cut short inside its keyslots area (a copy that stopped part-way) is refused
/// by every keyslot change, which would write past its end and grow it into a file that looks
/// whole; the file stays as it was, byte for byte and in length.
#[test]
fn a_keyslot_change_of_a_file_cut_short_is_refused_and_grows_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let first = key(dir.path(), "first.key", b"first");
    let second = key(dir.path(), "second.key", b"second");
    let header = dir.path().join("disk.hdr");
    format_header(&header, &first);
    let mut add = vec!["key", "add", p(&header), "--key-file", p(&first)];
    add.extend(["--new-key-file", p(&second)]);
    add.extend(FAST);
    ok(&add);
    // Keyslot 1's material lies past 1 MiB: a cut there keeps keyslot 0 whole.
    std::fs::OpenOptions::new()
        .write(true)
        .open(&header)
        .unwrap()
        .set_len(1 << 20)
        .unwrap();
    let before = std::fs::read(&header).unwrap();
    let mut change = vec!["key", "change", p(&header), "--key-file", p(&first)];
    change.extend(["--new-key-file", p(&second)]);
    change.extend(FAST);
    let remove = vec!["key", "remove", p(&header), "--key-file", p(&second)];
    for args in [&add, &change, &remove] {
        let err = fails(args);
        assert!(
            err.contains("cut short") && err.contains("nothing was changed"),
            "{args:?}: {err}"
        );
        assert!(
            std::fs::read(&header).unwrap() == before,
            "{args:?} changed the file"
        );
    }
}

/// `key test` and `passphrase test` answer "no" with exit code 1 and fail otherwise with 2,
/// as `verify` does: a script tells a wrong passphrase from a file or image it could not read
/// (both were 1).
#[test]
fn test_commands_tell_no_from_failure_by_exit_code() {
    let dir = tempfile::tempdir().unwrap();
    let pw = key(dir.path(), "pw", b"right");
    let wrong = key(dir.path(), "wrong", b"wrong");
    let absent = dir.path().join("absent");
    let hdr = dir.path().join("disk.hdr");
    format_header(&hdr, &pw);
    let code = |args: &[&str]| ivdisk(args).status.code();
    assert_eq!(
        code(&["key", "test", p(&hdr), "--key-file", p(&pw)]),
        Some(0)
    );
    assert_eq!(
        code(&["key", "test", p(&hdr), "--key-file", p(&wrong)]),
        Some(1)
    );
    assert_eq!(
        code(&["key", "test", p(&absent), "--key-file", p(&pw)]),
        Some(2)
    );
    assert_eq!(
        code(&["key", "test", p(&hdr), "--key-file", p(&absent)]),
        Some(2)
    );

    let image = dir.path().join("disk.ivd");
    let mut args = vec!["create", p(&image), "--size", "16M", "--key-file", p(&pw)];
    args.extend(FAST);
    ok(&args);
    let test = |image: &Path, secret: &Path| {
        ivdisk(&[
            "passphrase",
            "test",
            p(image),
            "--key-file",
            p(secret),
            "--json",
        ])
    };
    assert_eq!(test(&image, &pw).status.code(), Some(0));
    let no = test(&image, &wrong);
    assert_eq!(no.status.code(), Some(1));
    let answer: Value = serde_json::from_slice(&no.stdout).unwrap();
    assert_eq!(answer["ok"], false, "{answer}");
    assert!(answer["reason"].is_string(), "{answer}");
    for (image, secret) in [(&absent, &pw), (&image, &absent)] {
        let failed = test(image, secret);
        assert_eq!(
            failed.status.code(),
            Some(2),
            "{}",
            String::from_utf8_lossy(&failed.stderr)
        );
        let error: Value = serde_json::from_slice(&failed.stdout).unwrap();
        assert_eq!(error["ok"], false, "{error}");
        assert!(error["error"].is_string(), "{error}");
    }
}

/// A file given as a header backup that holds no LUKS header is named as such, without the
/// advice to restore a header backup with `ivdisk header restore`: the command that failed.
#[test]
fn a_restore_from_a_file_that_is_no_backup_gives_no_circular_advice() {
    let dir = tempfile::tempdir().unwrap();
    let pw = key(dir.path(), "pw", b"right");
    let hdr = dir.path().join("disk.hdr");
    format_header(&hdr, &pw);
    let zeros = key(dir.path(), "zeros", &[0u8; 100_000]);
    let image = dir.path().join("disk.ivd");
    let mut args = vec!["create", p(&image), "--size", "16M", "--key-file", p(&pw)];
    args.extend(FAST);
    ok(&args);
    for target in [&hdr, &image] {
        let err = fails(&["header", "restore", p(target), p(&zeros)]);
        assert!(
            err.contains("no LUKS header found") && !err.contains("ivdisk header restore"),
            "{err}"
        );
    }
    ok(&["key", "test", p(&hdr), "--key-file", p(&pw)]);
}

/// A forced key-derivation cost out of range is refused before anything is made: found by
/// the key derivation, it came after `create` had made the image's directories (its parents
/// stayed behind).
#[test]
fn a_forced_cost_out_of_range_is_refused_before_anything_is_made() {
    let dir = tempfile::tempdir().unwrap();
    let pw = key(dir.path(), "pw", b"right");
    let image = dir.path().join("a").join("b").join("img");
    for forced in [
        ["--pbkdf", "argon2id", "--pbkdf-force-iterations", "1"],
        ["--pbkdf", "pbkdf2", "--pbkdf-force-iterations", "999"],
    ] {
        let mut args = vec!["create", p(&image), "--size", "16M", "--key-file", p(&pw)];
        args.extend(forced);
        let err = fails(&args);
        assert!(err.contains("(got "), "{forced:?}: {err}");
        assert!(
            !dir.path().join("a").exists(),
            "{forced:?} made directories"
        );
        let hdr = dir.path().join("x.hdr");
        let mut args = vec![
            "header",
            "format",
            p(&hdr),
            "--size",
            "16M",
            "--key-file",
            p(&pw),
        ];
        args.extend(forced);
        let err = fails(&args);
        assert!(
            err.contains("(got ") && !err.contains("removed"),
            "{forced:?}: {err}"
        );
        assert!(!hdr.exists());
    }
}
