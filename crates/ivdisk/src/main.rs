//! `ivdisk`: the command line. It lists the cipher suites, manages LUKS2-format headers and
//! their keyslots (`header`, `key`), creates, shows, resizes and deletes images on any store
//! and manages their writer lock and passphrases (`create`, `info`, `resize`, `delete`, `lock`,
//! `passphrase`), copies plaintext in and out and checks every sector (`import`, `export`,
//! `verify`), backs them up and restores them without the passphrase (`backup`, `restore`),
//! and serves images over NBD (`serve`).
//!
//! The image commands run the image layer's async code on one tokio runtime, built here for
//! them only; `suites`, `header` and `key` stay synchronous.

#![deny(unsafe_code)]

/// mimalloc instead of glibc's malloc: under `ivdisk serve` every request allocates its
/// payload, ciphertext, operation and reply buffers on the runtime threads, and glibc's
/// malloc and free were 8-9% of the server's CPU samples under random 4 KiB writes. With
/// mimalloc the server's CPU per such write fell by 9% (median of 12 alternating rounds
/// each; docs/BENCHMARKS.md, "mimalloc in the binary").
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// `println!` for the commands' output. When the reader of standard output has gone
/// (`ivdisk snap ls disk.ivd | head -1`), the process ends as `ls` or `cat` would there: at
/// once, quietly, with the status a shell shows for SIGPIPE (141); `println!` would panic with a
/// backtrace. Any other failure to write (a full disk behind `> FILE`) is an error message
/// and status 1. A command prints its report once its work is done, so ending there loses
/// nothing.
macro_rules! outln {
    ($($arg:tt)*) => {
        $crate::print_line(format_args!($($arg)*))
    };
}

/// A line on standard error that never panics: `eprintln!` panics when stderr is gone (a
/// closed terminal: EIO; a log pipe whose reader died: EPIPE), and in `ivdisk serve`, where
/// SIGHUP is survived on purpose, the message of the SIGTERM that followed unwound the main
/// thread before the shutdown flush (exit 101, the writer lock left to expire). A message
/// nobody can read is dropped instead.
macro_rules! note {
    ($($arg:tt)*) => {{
        use std::io::Write as _;
        let _ = writeln!(std::io::stderr().lock(), $($arg)*);
    }};
}

mod backup;
mod control;
mod convert;
#[allow(unsafe_code)]
mod ffi;
mod images;
mod keys;
mod passphrases;
mod secrets;
mod serve;
mod snapshots;
mod transfer;

use std::io::IsTerminal;
use std::process::ExitCode;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand};
use ivdisk_crypto::{Suite, GCM_RANDOM_NONCE_WRITE_LIMIT};

#[derive(Parser)]
#[command(
    name = "ivdisk",
    version,
    about = "Client-side encrypted virtual disks with a fresh random IV (and a MAC) per sector write",
    long_about = None,
    after_help = "Logs: set IVDISK_LOG (e.g. IVDISK_LOG=debug); they go to stderr and never contain secrets.\nWith --json, a command that fails before printing its result prints {\"ok\":false,\"error\":\"...\"} on standard output (and the message on stderr)."
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

fn suites_help() -> String {
    let mut text = String::from("Cipher suites (--cipher):\n");
    for suite in Suite::ALL {
        text.push_str(&format!("  {:<18} {}\n", suite.name(), suite.summary()));
    }
    text.push_str(&format!(
        "\naes-gcm-random draws a random 96-bit nonce per write; NIST SP 800-38D caps such nonces at \
         {GCM_RANDOM_NONCE_WRITE_LIMIT} (2^32) writes per key. The suite counts writes per key (continuing \
         from the count kept with the image) and refuses writes past that bound: re-encrypt to a new key, or prefer aegis128l-random/aegis256-random \
         whose nonces have no practical limit.\n"
    ));
    text
}

#[derive(Subcommand)]
enum Command {
    /// List the cipher suites with their metadata size, key sizes and properties.
    #[command(after_help = "Example:\n  ivdisk suites\n  ivdisk suites --json | jq '.[].name'")]
    Suites {
        /// Print JSON (one object per suite) instead of a table.
        #[arg(long)]
        json: bool,
    },
    /// LUKS2-format headers: format, dump, backup, restore.
    #[command(subcommand)]
    Header(keys::HeaderCommand),
    /// Keyslots: add, remove, change and test passphrases, key files and volume keys.
    #[command(subcommand)]
    Key(keys::KeyCommand),
    /// Create an encrypted image (asks for its passphrase twice on a terminal).
    #[command(after_help = format!(
        "Example:\n  ivdisk create disk.ivd --size 10G\n  ivdisk create 'rados://rbd/vm1?id=admin' --size 100G --cipher aes-xts-random --layout omap --passphrase-file pw.txt\n\n{}\n{}",
        suites_help(),
        images::layouts_help()
    ))]
    Create(images::CreateArgs),
    /// Show an image's size, cipher, layout, keyslots, writer lock and, for a local image, what
    /// its store takes on disk (no passphrase needed); for rbd:// images, size and librbd
    /// encryption format.
    #[command(
        after_help = "Example:\n  ivdisk info disk.ivd\n  ivdisk info 'rados://rbd/vm1?conf=/etc/ceph/ceph.conf' --json | jq .size\n  ivdisk info 'rbd://rbd/vm2?conf=/etc/ceph/ceph.conf'   # a librbd image: size, LUKS format"
    )]
    Info(images::InfoArgs),
    /// Grow an image, or shrink it with --allow-shrink (opens it for writing: needs the
    /// passphrase and the writer lock).
    #[command(
        after_help = "Example:\n  ivdisk resize disk.ivd --size 20G\n  ivdisk resize disk.ivd --size 5G --allow-shrink --passphrase-file pw.txt\n\nA shrink is refused while another command reads the image (`ivdisk serve --read-only`, an export, a verify; readers of its snapshots do not count), naming that process: it would read the shrunk-away part as zeros."
    )]
    Resize(images::ResizeArgs),
    /// Delete an image: its data objects, then its header (asks first unless --yes).
    #[command(
        after_help = "Example:\n  ivdisk delete disk.ivd\n  ivdisk delete rados://rbd/vm1 --yes\n\nRefused while the image has snapshots, while a writer holds it, and while another command reads it or one of its snapshots (`ivdisk serve --read-only`, an export, a verify), naming that process (and its host, on RADOS)."
    )]
    Delete(images::DeleteArgs),
    /// The image's writer lock (one writer per image): show it, or break a dead writer's.
    #[command(subcommand, after_help = images::lock_help())]
    Lock(images::LockCommand),
    /// Passphrases of an image (ivdisk image or LUKS file): add, remove, change, test.
    #[command(subcommand)]
    Passphrase(passphrases::PassphraseCommand),
    /// Create an image from a raw disk file, copying its bytes in (all-zero sectors skipped).
    #[command(after_help = format!(
        "Example:\n  ivdisk import disk.raw disk.ivd\n  ivdisk import vm.raw 'rados://rbd/vm1?id=admin' --cipher aes-xts-random --layout omap --passphrase-file pw.txt --json\n\nThe image is FILE's size rounded up to the sector size. If the copy fails, the half-made image is deleted (with the local store directory, if the import made it; an empty directory given as IMAGE is left empty); so does Ctrl-C (SIGINT), SIGTERM or SIGHUP (a closed terminal); only an import killed outright (SIGKILL, a crash) leaves it behind, marked unfinished: every open refuses it until it is deleted (`ivdisk delete IMAGE --yes`).\n\n{}\n{}",
        suites_help(),
        images::layouts_help()
    ))]
    Import(transfer::ImportArgs),
    /// Write an image's plaintext to a raw file, leaving holes where it holds no data (opens
    /// it read-only, without the writer lock: on RADOS it works while the image is served).
    #[command(
        after_help = "Example:\n  ivdisk export disk.ivd disk.raw\n  ivdisk export 'rados://rbd/vm1?id=admin' - --passphrase-file pw.txt | gzip > vm1.raw.gz\n\nA sector that fails authentication stops the export (and the incomplete FILE is removed): `ivdisk verify IMAGE` lists them all."
    )]
    Export(transfer::ExportArgs),
    /// Read every allocated sector of an image and list those that fail authentication (and
    /// those a damaged store cannot read), and a damaged copy of its header; exit code 0 if
    /// none, 1 if some, 2 on other errors (opens it read-only).
    #[command(
        after_help = "Example:\n  ivdisk verify disk.ivd\n  ivdisk verify 'rados://rbd/vm1?id=admin' --passphrase-file pw.txt --json | jq .bad_lbas\n\nOnly suites with a MAC (aegis128l-random, aegis256-random, aes-gcm-random) detect changed sectors; with the others, verify only shows that every sector reads."
    )]
    Verify(transfer::VerifyArgs),
    /// Copy the plaintext of a LUKS file, an rbd:// image, a raw file or another ivdisk image
    /// into a NEW random-IV image (zeros skipped), then read it all back and compare.
    #[command(after_help = format!(
        "{}\n\n{}\n{}",
        convert::after_help(),
        suites_help(),
        images::layouts_help()
    ))]
    Convert(convert::ConvertArgs),
    /// Snapshots of an image (IMAGE@SNAP): create, ls, rm, rollback. Open one read-only as
    /// IMAGE@SNAP with serve, export, verify, info.
    #[command(subcommand)]
    Snap(snapshots::SnapCommand),
    /// Back up an image or snapshot (IMAGE[@SNAP]) into one portable file: header, ciphertext
    /// and metadata of the written sectors, no passphrase needed; --since for an increment.
    #[command(after_help = backup::backup_help())]
    Backup(backup::BackupArgs),
    /// Restore a backup file (`ivdisk backup`) into a new image on any store (checked whole
    /// first), or apply an incremental one onto the image restored from its base.
    #[command(after_help = backup::restore_help())]
    Restore(backup::RestoreArgs),
    /// Export an image over NBD (Unix socket or TCP) until SIGINT/SIGTERM/SIGQUIT; rbd:// images
    /// through librbd.
    #[command(after_help = serve::after_help())]
    Serve(serve::ServeArgs),
}

pub(crate) fn parse_size(text: &str) -> Result<u64> {
    const UNITS: [&str; 7] = ["", "K", "M", "G", "T", "P", "E"];
    let text = text.trim();
    if text.starts_with('-') {
        bail!("size '{text}': a size cannot be negative");
    }
    if text.get(..2).is_some_and(|p| p.eq_ignore_ascii_case("0x")) {
        bail!("size '{text}': write sizes in decimal, with an optional unit K, M, G, T, P, E");
    }
    let split = text
        .find(|c: char| !c.is_ascii_digit() && c != '.')
        .unwrap_or(text.len());
    let (number, unit) = text.split_at(split);
    let unit = unit.trim().to_ascii_uppercase();
    // `G`, `GiB`; `B` alone is bytes; `GB` is decimal to some tools.
    let (unit_letter, decimal) = match unit.strip_suffix("IB").filter(|l| l.len() == 1) {
        Some(letter) => (letter, false),
        None => match unit.strip_suffix('B') {
            Some(letter) => (letter, !letter.is_empty()),
            None => (unit.as_str(), false),
        },
    };
    let Some(power) = UNITS.iter().position(|u| *u == unit_letter) else {
        bail!("size '{text}': unknown unit '{unit_letter}', expected K, M, G, T, P or E");
    };
    // `GB` is 10^9 bytes to coreutils (`truncate -s 1GB`) and 2^30 to others, and qemu-img
    // refuses it: refused here too, rather than read one way without a word.
    if decimal {
        bail!(
            "size '{text}': {unit} means 10^{} bytes to some tools and 2^{} to others; write \
             {number}{unit_letter} or {number}{unit_letter}iB for the binary unit (2^{1} bytes \
             each)",
            3 * power,
            10 * power,
        );
    }
    let shift = 10 * power as u32;
    if number.contains('.') {
        // The same size in the largest smaller unit that holds it whole, if one does.
        let exact = number.parse::<f64>().ok().and_then(|v| {
            (0..power).rev().find_map(|smaller| {
                let whole = v * 2f64.powi(10 * (power - smaller) as i32);
                (whole.fract() == 0.0 && whole < 9e15)
                    .then(|| format!(" (write {whole}{})", UNITS[smaller]))
            })
        });
        bail!(
            "size '{text}': whole numbers only{}",
            exact.unwrap_or_default()
        );
    }
    let n: u64 = number.parse().with_context(|| {
        format!("size '{text}': expected a number with an optional unit K, M, G, T, P, E")
    })?;
    n.checked_mul(1 << shift)
        .with_context(|| format!("size '{text}' is too large"))
}

fn list_suites(json: bool) {
    if json {
        let list: Vec<_> = Suite::ALL
            .iter()
            .map(|s| {
                serde_json::json!({
                    "name": s.name(),
                    "metadata_bytes": s.metadata_len(),
                    "key_bytes": s.key_lens(),
                    "authenticated": s.is_authenticated(),
                    "randomized": s.is_randomized(),
                    "write_limit": s.write_limit(),
                    "default": *s == Suite::DEFAULT,
                })
            })
            .collect();
        outln!("{}", serde_json::Value::Array(list));
    } else {
        outln!(
            "{:<18} {:>8} {:>10}  summary",
            "suite",
            "metadata",
            "key bytes"
        );
        for s in Suite::ALL {
            let keys = s
                .key_lens()
                .iter()
                .map(|k| k.to_string())
                .collect::<Vec<_>>()
                .join("/");
            outln!(
                "{:<18} {:>7}B {:>10}  {}",
                s.name(),
                s.metadata_len(),
                keys,
                s.summary()
            );
        }
    }
}

/// Whether the command line asked for JSON (`--json` before any `--`), and whether anything
/// was printed on standard output: a failure then prints a JSON error object there
/// ([`report_failure`]) unless the command printed its own.
static JSON_REQUESTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
static STDOUT_WRITTEN: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
/// Standard output carries data ([`stdout_carries_data`]).
static STDOUT_DATA: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Whether the command line asked for JSON output.
pub(crate) fn json_requested() -> bool {
    JSON_REQUESTED.load(std::sync::atomic::Ordering::Relaxed)
}

/// Say why the command failed: on stderr, and with `--json` also as `{"ok":false,"error":...}`
/// on stdout when nothing was printed there, so scripts always read one JSON object.
pub(crate) fn report_failure(e: &anyhow::Error) {
    use std::sync::atomic::Ordering;
    let text = error_text(e);
    if JSON_REQUESTED.load(Ordering::Relaxed) {
        let object = serde_json::json!({"ok": false, "error": text});
        if STDOUT_DATA.load(Ordering::Relaxed) {
            note!("{object}");
        } else if !STDOUT_WRITTEN.load(Ordering::Relaxed) {
            outln!("{object}");
        }
    }
    note!("ivdisk: {text}");
}

/// Standard output carries data (`export IMAGE -`): a failure's JSON object must not go
/// there, into the disk's bytes (a device's partition table); it goes to standard error
/// with the message.
pub(crate) fn stdout_carries_data() {
    STDOUT_WRITTEN.store(true, std::sync::atomic::Ordering::Relaxed);
    STDOUT_DATA.store(true, std::sync::atomic::Ordering::Relaxed);
}

/// [`outln!`]'s work.
fn print_line(line: std::fmt::Arguments) {
    use std::io::Write;
    STDOUT_WRITTEN.store(true, std::sync::atomic::Ordering::Relaxed);
    let mut out = std::io::stdout().lock();
    if let Err(e) = writeln!(out, "{line}").and_then(|()| out.flush()) {
        if e.kind() == std::io::ErrorKind::BrokenPipe {
            std::process::exit(141);
        }
        note!("ivdisk: writing to standard output failed: {e}");
        std::process::exit(1);
    }
}

/// The one runtime of the process, for the image commands.
fn runtime() -> Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("ivdisk-rt")
        .build()
        .context("starting the async runtime")
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Header(command) => keys::run_header(command),
        Command::Key(command) => keys::run_key(command),
        Command::Suites { json } => {
            list_suites(json);
            Ok(())
        }
        Command::Create(args) => images::create(args, &runtime()?),
        Command::Info(args) => images::info(args, &runtime()?),
        Command::Resize(args) => images::resize(args, &runtime()?),
        Command::Delete(args) => images::delete(args, &runtime()?),
        Command::Lock(command) => images::lock(command, &runtime()?),
        Command::Passphrase(command) => passphrases::run(command, &runtime()?),
        Command::Import(args) => transfer::import(args, &runtime()?),
        Command::Export(args) => transfer::export(args, &runtime()?),
        Command::Verify(args) => transfer::verify(args, &runtime()?),
        Command::Convert(args) => convert::convert(args, &runtime()?),
        Command::Serve(args) => serve::run(args, &runtime()?),
        Command::Snap(command) => snapshots::run(command, &runtime()?),
        Command::Backup(args) => backup::backup(args, &runtime()?),
        Command::Restore(args) => backup::restore(args, &runtime()?),
    }
}

/// An error and its causes on one line, as anyhow's `{:#}` writes them, but a cause that the
/// text so far already ends with is not written again (errors whose message includes their
/// source's: "cannot listen on X: No such file or directory (os error 2)").
pub(crate) fn error_text(e: &anyhow::Error) -> String {
    let mut text = String::new();
    for cause in e.chain() {
        let said = cause.to_string();
        if text.is_empty() {
            text = said;
        } else if !text.ends_with(&said) {
            text.push_str(": ");
            text.push_str(&said);
        }
    }
    text
}

/// Raise the soft limit on open files to the hard one, as servers do, for every command: each
/// NBD connection is one, librados holds one per OSD and monitor it talks to, and a local
/// store holds every segment file of 1 GiB it has appended over its life, so the usual soft
/// limit of 1024 ran out at a few hundred clients, on a large cluster, or (for import,
/// convert, restore as much as serve) on a store past a thousand segments.
fn raise_open_file_limit() {
    use rustix::process::{getrlimit, setrlimit, Resource};
    // The kernel refuses more than fs.nr_open, 2^20 by default, and "unlimited".
    const MOST: u64 = 1 << 20;
    let limit = getrlimit(Resource::Nofile);
    let Some(raised) = limit.maximum.or(Some(MOST)).map(|m| m.min(MOST)) else {
        return;
    };
    if limit.current.is_some_and(|c| c >= raised) {
        return;
    }
    let wanted = rustix::process::Rlimit {
        current: Some(raised),
        ..limit
    };
    match setrlimit(Resource::Nofile, wanted) {
        Ok(()) => tracing::debug!(from = ?limit.current, to = raised, "raised the open file limit"),
        Err(e) => tracing::warn!(error = %e, "could not raise the open file limit"),
    }
}

fn main() -> ExitCode {
    // Usage errors exit with clap's 2; everything else that fails exits with 1.
    JSON_REQUESTED.store(
        std::env::args_os()
            .skip(1)
            .take_while(|a| a != "--")
            .any(|a| a == "--json"),
        std::sync::atomic::Ordering::Relaxed,
    );
    let cli = match Cli::try_parse() {
        Ok(cli) => cli,
        Err(e) => {
            // A usage error keeps the --json promise too (one JSON object on stdout); help
            // and version are not errors.
            if e.use_stderr() && JSON_REQUESTED.load(std::sync::atomic::Ordering::Relaxed) {
                let text = e.kind().as_str().map_or_else(
                    || "invalid command line".to_owned(),
                    |kind| format!("invalid command line: {kind}"),
                );
                // The error line and what it lists below it (the arguments missing, say),
                // without the usage that follows.
                let rendered = e.render().to_string();
                let mut lines = rendered.lines().skip_while(|l| !l.starts_with("error: "));
                let text = match lines.next() {
                    Some(first) => std::iter::once(first.trim_start_matches("error: "))
                        .chain(lines.take_while(|l| !l.trim().is_empty()).map(str::trim))
                        .collect::<Vec<_>>()
                        .join(" "),
                    None => text,
                };
                outln!("{}", serde_json::json!({"ok": false, "error": text}));
            }
            e.exit()
        }
    };
    // Without IVDISK_LOG: warnings and errors. Sectors that fail authentication are logged
    // where a server runs; the other commands report them in their result (an export's error
    // names the first one, verify lists them all), not a second time as log lines.
    let default_filter = match cli.command {
        Command::Serve(_) => "warn".to_owned(),
        _ => format!("warn,{}=off", ivdisk_image::INTEGRITY_LOG_TARGET),
    };
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("IVDISK_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default_filter)),
        )
        .with_writer(std::io::stderr)
        .with_ansi(std::io::stderr().is_terminal())
        .init();
    raise_open_file_limit();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            report_failure(&e);
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_error_text_says_each_cause_once() {
        let source = || std::io::Error::from_raw_os_error(libc::ENOENT);
        let said = source().to_string();
        // A cause its context already ends with.
        let e = anyhow::Error::new(source()).context(format!("cannot listen on s.sock: {said}"));
        assert_eq!(error_text(&e), format!("cannot listen on s.sock: {said}"));
        // A cause it does not.
        let e = anyhow::Error::new(source()).context("reading disk.raw");
        assert_eq!(error_text(&e), format!("reading disk.raw: {said}"));
        assert_eq!(error_text(&e), format!("{e:#}"));
    }

    #[test]
    fn sizes_parse_with_binary_units() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("10G").unwrap(), 10 << 30);
        assert_eq!(parse_size("512MiB").unwrap(), 512 << 20);
        assert_eq!(parse_size("1t").unwrap(), 1 << 40);
        assert_eq!(parse_size("2P").unwrap(), 2 << 50);
        assert_eq!(parse_size("7EiB").unwrap(), 7 << 60);
        assert!(parse_size("16E").is_err());
        assert!(parse_size("12X")
            .unwrap_err()
            .to_string()
            .contains("unknown unit"));
        assert!(parse_size("G").is_err());
        assert_eq!(parse_size("4096B").unwrap(), 4096);
        assert_eq!(parse_size("3gib").unwrap(), 3 << 30);
        assert!(parse_size("10BB")
            .unwrap_err()
            .to_string()
            .contains("unknown unit 'B'"));
        assert!(parse_size("10iB").is_err());
        let ambiguous = parse_size("10GB").unwrap_err().to_string();
        assert!(
            ambiguous.contains("10^9 bytes to some tools and 2^30 to others")
                && ambiguous.contains("write 10G or 10GiB"),
            "{ambiguous}"
        );
        assert!(parse_size("1mb").unwrap_err().to_string().contains("10^6"));
        let said = |text: &str| parse_size(text).unwrap_err().to_string();
        assert!(said("-5").contains("cannot be negative"), "{}", said("-5"));
        assert!(said("0x1000").contains("decimal"), "{}", said("0x1000"));
        assert!(said("1.5G").contains("(write 1536M)"), "{}", said("1.5G"));
        assert!(said("0.5K").contains("(write 512)"), "{}", said("0.5K"));
        assert!(
            said("1.3").contains("whole numbers only"),
            "{}",
            said("1.3")
        );
        assert!(
            said("1.2.3M").contains("whole numbers only"),
            "{}",
            said("1.2.3M")
        );
        assert!(parse_size("99999999999T")
            .unwrap_err()
            .to_string()
            .contains("too large"));
    }

    #[test]
    fn help_names_every_suite_and_the_gcm_bound() {
        let help = suites_help();
        for s in Suite::ALL {
            assert!(help.contains(s.name()), "{s} missing from --help");
        }
        assert!(help.contains("4294967296"));
    }
}
