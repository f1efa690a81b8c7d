//! Secrets and the terminal, shared by every command: key files and passphrase files, the
//! no-echo prompt, the key-derivation options for new keyslots, spinners, confirmations and
//! `--json` printing. Secrets live in `Zeroizing` buffers and never reach a log or an error.

use std::fs::File;
use std::io::{BufRead, IsTerminal, Read, Write};
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use ivdisk_header::{Hash, PbkdfKind, PbkdfRequest};
use zeroize::Zeroizing;

/// cryptsetup's default upper bound for a key file (`--keyfile-size` default 8 MiB).
const MAX_KEY_FILE: u64 = 8 << 20;

/// What `ivdisk header`/`ivdisk key` say when a passphrase is needed and there is no terminal.
pub const KEY_FILE_HINT: &str =
    "pass --key-file FILE (or \"-\" for standard input), or run on a terminal";

/// What the image commands say when a passphrase is needed and there is no terminal.
pub const IMAGE_SECRET_HINT: &str =
    "pass --passphrase-file FILE or --key-file FILE (\"-\" = standard input), or run on a terminal";

#[derive(Args, Debug, Clone)]
pub struct PbkdfArgs {
    /// Key derivation for new keyslots: argon2id (default), argon2i or pbkdf2.
    #[arg(long, default_value = "argon2id")]
    pbkdf: String,
    /// Target unlock time per keyslot on this machine, in milliseconds, at least 1
    /// (cryptsetup: 2000).
    #[arg(long, default_value_t = 2000, value_name = "MS")]
    iter_time: u64,
    /// Upper bound for Argon2 memory in KiB, at least 32 (cryptsetup: 1048576, and at most
    /// half the RAM).
    #[arg(long, default_value_t = 1024 * 1024, value_name = "KIB")]
    pbkdf_memory: u32,
    /// Upper bound for Argon2 threads, at least 1 (cryptsetup: 4, and at most the CPUs).
    #[arg(long, default_value_t = 4, value_name = "N",
          value_parser = clap::value_parser!(u32).range(1..))]
    pbkdf_parallel: u32,
    /// Skip the benchmark: Argon2 time cost or PBKDF2 iterations, as given.
    #[arg(long, value_name = "N")]
    pbkdf_force_iterations: Option<u32>,
    /// PBKDF2's hash: sha256 (default), sha512, sha1.
    #[arg(long, default_value = "sha256")]
    hash: String,
}

impl PbkdfArgs {
    pub fn request(&self) -> Result<PbkdfRequest> {
        let kind = self.pbkdf.parse::<PbkdfKind>()?;
        // Both made a keyslot without a word: 0 ms gave one that unlocks, and so is guessed,
        // in no time (cryptsetup takes 0 as its default instead), and 0 KiB one of 32 KiB.
        if self.iter_time == 0 && self.pbkdf_force_iterations.is_none() {
            bail!(
                "--iter-time 0 would make a keyslot that unlocks, and so can be guessed, in no \
                 time; give the milliseconds one unlock should take on this machine \
                 (cryptsetup's default, and ours: 2000)"
            );
        }
        if kind != PbkdfKind::Pbkdf2 && self.pbkdf_memory < ivdisk_header::ARGON2_MIN_MEMORY_KIB {
            bail!(
                "--pbkdf-memory {} is below Argon2's least memory, {} KiB; give the most memory \
                 one unlock may take, in KiB (the default, 1048576, is cryptsetup's)",
                self.pbkdf_memory,
                ivdisk_header::ARGON2_MIN_MEMORY_KIB
            );
        }
        let request = PbkdfRequest {
            kind,
            iter_time: Duration::from_millis(self.iter_time.max(1)),
            max_memory_kib: self.pbkdf_memory,
            max_parallel: self.pbkdf_parallel,
            forced_iterations: self.pbkdf_force_iterations,
            hash: self.hash.parse::<Hash>()?,
        };
        // Before anything is made: found by the key derivation, a forced cost out of range
        // came after a create's directories or a header file were made (and removed again).
        request.check_forced()?;
        Ok(request)
    }
}

/// How the image commands get the passphrase of an image: a passphrase file, a key file, or
/// the terminal.
#[derive(Args, Debug, Clone)]
pub struct PassphraseArgs {
    /// Read the passphrase from this file ("-" = standard input, not a terminal: without the
    /// option ivdisk asks on the terminal, without echo). One trailing newline (LF or CR LF)
    /// is dropped, so `echo secret > FILE` gives the passphrase typed as "secret" at the
    /// prompt.
    #[arg(long, value_name = "FILE", conflicts_with = "key_file")]
    pub passphrase_file: Option<PathBuf>,
    /// Use every byte of this file as the passphrase, newlines included ("-" = standard
    /// input), as cryptsetup's and `ivdisk key`'s --key-file. Without either option the
    /// passphrase is asked for on the terminal, without echo.
    #[arg(long, short = 'd', value_name = "FILE")]
    pub key_file: Option<PathBuf>,
}

/// The secret of a `--passphrase-file` (one trailing LF or CR LF dropped) or a `--key-file` (every
/// byte), `None` if neither was given.
fn read_secret_files(
    passphrase_file: &Option<PathBuf>,
    key_file: &Option<PathBuf>,
) -> Result<Option<Zeroizing<Vec<u8>>>> {
    if let Some(path) = key_file {
        return read_key_file(path).map(Some);
    }
    let Some(path) = passphrase_file else {
        return Ok(None);
    };
    let mut data = read_secret_file(path, "passphrase file")?;
    if data.ends_with(b"\n") {
        data.pop();
        if data.ends_with(b"\r") {
            data.pop();
        }
    }
    if data.is_empty() {
        bail!(
            "passphrase file {} holds only a newline: the passphrase is empty",
            path.display()
        );
    }
    Ok(Some(data))
}

impl PassphraseArgs {
    /// The secret of --passphrase-file or --key-file, `None` if neither was given (no prompt).
    pub fn read_files(&self) -> Result<Option<Zeroizing<Vec<u8>>>> {
        read_secret_files(&self.passphrase_file, &self.key_file)
    }

    fn reads_stdin(&self) -> bool {
        [&self.passphrase_file, &self.key_file]
            .into_iter()
            .any(|p| p.as_deref() == Some(Path::new("-")))
    }

    /// Said after "no keyslot matches": the one newline difference between the two file
    /// options, when it may be the cause (looks at the secret's last byte only).
    pub fn unlock_hint(&self, secret: &[u8]) -> String {
        if self.key_file.is_some() && secret.ends_with(b"\n") {
            return " (--key-file keeps the file's trailing newline as part of the passphrase; \
                    --passphrase-file drops it)"
                .to_owned();
        }
        // The other way round: cryptsetup's --key-file keeps the newline `echo` wrote, so a
        // volume it made with that file takes the passphrase with it.
        let dropped_newline = self
            .passphrase_file
            .as_deref()
            .filter(|path| *path != Path::new("-"))
            .and_then(|path| std::fs::read(path).ok().map(Zeroizing::new))
            .is_some_and(|bytes| bytes.ends_with(b"\n"));
        match dropped_newline {
            true => " (--passphrase-file dropped the file's trailing newline; a passphrase set \
                      from this file with cryptsetup's --key-file has it: pass --key-file FILE \
                      instead)"
                .to_owned(),
            false => String::new(),
        }
    }

    /// The passphrase of an existing image (asked once on a terminal).
    pub fn existing(&self) -> Result<Zeroizing<Vec<u8>>> {
        match self.read_files()? {
            Some(secret) => Ok(secret),
            None => prompt("Enter passphrase: ", IMAGE_SECRET_HINT),
        }
    }

    /// The passphrase of a new image (asked twice on a terminal).
    pub fn new_passphrase(&self) -> Result<Zeroizing<Vec<u8>>> {
        match self.read_files()? {
            Some(secret) => Ok(secret),
            None => prompt_twice(IMAGE_SECRET_HINT),
        }
    }
}

/// What the commands that add a passphrase say when the new one is needed and there is no
/// terminal.
pub const NEW_SECRET_HINT: &str =
    "pass --new-passphrase-file FILE or --new-key-file FILE (\"-\" = \
     standard input), or run on a terminal";

/// The new passphrase of `ivdisk passphrase add|change`: a file, or asked twice.
#[derive(Args, Debug, Clone)]
pub struct NewPassphraseArgs {
    /// Read the new passphrase from this file ("-" = standard input); one trailing newline is
    /// dropped, as with --passphrase-file.
    #[arg(long, value_name = "FILE", conflicts_with = "new_key_file")]
    pub new_passphrase_file: Option<PathBuf>,
    /// Use every byte of this file as the new passphrase, newlines included ("-" = standard
    /// input), as --key-file. Without either option the new passphrase is asked for twice on
    /// the terminal, without echo.
    #[arg(long, value_name = "FILE")]
    pub new_key_file: Option<PathBuf>,
}

impl NewPassphraseArgs {
    /// Whether the new secret comes from a file (or standard input), not the terminal.
    pub fn given(&self) -> bool {
        self.new_passphrase_file.is_some() || self.new_key_file.is_some()
    }

    /// Refuse both secrets from standard input before either is read: the first would
    /// swallow the second.
    pub fn check_against(&self, existing: &PassphraseArgs) -> Result<()> {
        let new_stdin = [&self.new_passphrase_file, &self.new_key_file]
            .into_iter()
            .any(|p| p.as_deref() == Some(Path::new("-")));
        if new_stdin && existing.reads_stdin() {
            bail!(
                "only one of the passphrases can come from standard input (\"-\"); put the \
                 other in a file"
            );
        }
        Ok(())
    }

    /// The new passphrase (asked twice on a terminal).
    pub fn read(&self) -> Result<Zeroizing<Vec<u8>>> {
        match read_secret_files(&self.new_passphrase_file, &self.new_key_file)? {
            Some(secret) => Ok(secret),
            None => prompt_twice(NEW_SECRET_HINT),
        }
    }
}

/// A secret from a file (all of it, as cryptsetup) or standard input.
pub fn read_key_file(path: &Path) -> Result<Zeroizing<Vec<u8>>> {
    read_secret_file(path, "key file")
}

/// All of the file `path` (or standard input), which messages call `what`.
fn read_secret_file(path: &Path, what: &str) -> Result<Zeroizing<Vec<u8>>> {
    // Room for all of it first where the size is known (a regular file), 64 KiB otherwise
    // (standard input, a pipe, `<(gpg -d ...)`): see `read_secret`.
    let room = match path == Path::new("-") {
        true => 64 << 10,
        false => std::fs::metadata(path)
            .ok()
            .filter(|m| m.is_file())
            .map_or(64 << 10, |m| m.len().min(MAX_KEY_FILE) as usize + 1),
    };
    if path == Path::new("-") && std::io::stdin().is_terminal() {
        // Read to its end from a terminal, the secret would show as it is typed (and keep
        // the newline that ends the line).
        bail!(
            "standard input is a terminal: to type the passphrase, leave out --passphrase-file \
             and --key-file (ivdisk then asks for it without showing it), or pipe it in"
        );
    }
    let data = if path == Path::new("-") {
        read_secret(&mut std::io::stdin().take(MAX_KEY_FILE + 1), room)
            .context("reading the passphrase from standard input")?
    } else {
        let file =
            File::open(path).with_context(|| format!("cannot open {what} {}", path.display()))?;
        read_secret(&mut file.take(MAX_KEY_FILE + 1), room)
            .with_context(|| format!("reading {what} {}", path.display()))?
    };
    if data.len() as u64 > MAX_KEY_FILE {
        bail!(
            "{what} {} is larger than {MAX_KEY_FILE} bytes; cryptsetup would refuse it too",
            path.display()
        );
    }
    if data.is_empty() {
        bail!("{what} {} is empty", path.display());
    }
    Ok(data)
}

/// All of `reader`, into a buffer of `room` bytes to start with. Grown, the bytes go into a
/// new buffer and the old one is wiped: `read_to_end` grows a vector by reallocating, which
/// leaves copies of the secret in the memory it outgrew (the allocator does not clear it),
/// and reads small inputs through a stack buffer first, which nothing clears either.
fn read_secret(reader: &mut impl Read, room: usize) -> std::io::Result<Zeroizing<Vec<u8>>> {
    let mut buf = Zeroizing::new(vec![0u8; room.max(64)]);
    let mut len = 0;
    loop {
        if len == buf.len() {
            let mut bigger = Zeroizing::new(vec![0u8; 2 * buf.len()]);
            bigger[..len].copy_from_slice(&buf[..len]);
            buf = bigger;
        }
        match reader.read(&mut buf[len..]) {
            Ok(0) => break,
            Ok(n) => len += n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    // Shortened in place: the bytes past `len` are zeros, and the whole capacity is wiped on
    // drop.
    buf.truncate(len);
    Ok(buf)
}

/// Ask for a passphrase on the terminal without echo; `hint` says what to do without one.
pub fn prompt(text: &str, hint: &str) -> Result<Zeroizing<Vec<u8>>> {
    if !std::io::stdin().is_terminal() {
        bail!("no passphrase given: {hint}");
    }
    // A signal at the prompt ends the process with the terminal's echo back on.
    let restore = crate::ffi::TerminalRestore::arm();
    let line = Zeroizing::new(rpassword::prompt_password(text).context("reading the passphrase")?);
    drop(restore);
    if line.is_empty() {
        bail!("empty passphrase");
    }
    Ok(Zeroizing::new(line.as_bytes().to_vec()))
}

/// Ask for a new passphrase twice; they must match.
pub fn prompt_twice(hint: &str) -> Result<Zeroizing<Vec<u8>>> {
    let first = prompt("Enter new passphrase: ", hint)?;
    let second = prompt("Verify passphrase: ", hint)?;
    if first != second {
        bail!("the passphrases do not match");
    }
    Ok(first)
}

/// The passphrase of an existing keyslot: `key_file` byte for byte, or asked once.
pub fn old_secret(key_file: &Option<PathBuf>) -> Result<Zeroizing<Vec<u8>>> {
    match key_file {
        Some(path) => read_key_file(path),
        None => prompt("Enter passphrase: ", KEY_FILE_HINT),
    }
}

/// A new passphrase: `key_file` byte for byte, or asked twice.
pub fn new_secret(key_file: &Option<PathBuf>) -> Result<Zeroizing<Vec<u8>>> {
    match key_file {
        Some(path) => read_key_file(path),
        None => prompt_twice(KEY_FILE_HINT),
    }
}

/// A spinner on a terminal while a KDF runs (seconds by design); nothing when piped.
pub fn with_spinner<T>(message: &str, work: impl FnOnce() -> T) -> T {
    // With --json no progress is drawn, as the commands' bars are not: a script that runs the
    // command on a terminal reads one JSON object, without a spinner's lines around it.
    if !std::io::stderr().is_terminal() || crate::json_requested() {
        return work();
    }
    let spinner = indicatif::ProgressBar::new_spinner();
    spinner.set_message(message.to_owned());
    spinner.enable_steady_tick(Duration::from_millis(100));
    let out = work();
    spinner.finish_and_clear();
    out
}

/// Print `value` as one line of JSON, or `text`.
/// A path as a JSON string. serde refuses paths that are not UTF-8 (a panic in `json!`, after
/// the command's work was done); the bytes that are not UTF-8 show as U+FFFD, as `display` does.
pub fn json_path(path: &std::path::Path) -> serde_json::Value {
    serde_json::Value::String(path.to_string_lossy().into_owned())
}

pub fn print(json: bool, value: serde_json::Value, text: String) {
    if json {
        outln!("{value}");
    } else {
        outln!("{text}");
    }
}

/// Ask `question` with a y/N answer on the terminal, unless `yes` (the `--yes` flag). Without
/// a terminal the command is refused with `refusal`, which says to pass --yes.
pub fn confirm(question: &str, yes: bool, refusal: &str) -> Result<bool> {
    if yes {
        return Ok(true);
    }
    if !std::io::stdin().is_terminal() {
        bail!("{refusal}");
    }
    eprint!("{question} [y/N] ");
    std::io::stderr().flush().ok();
    let mut answer = String::new();
    std::io::stdin()
        .lock()
        .read_line(&mut answer)
        .context("reading the answer")?;
    Ok(matches!(
        answer.trim().to_ascii_lowercase().as_str(),
        "y" | "yes"
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(passphrase_file: Option<&Path>, key_file: Option<&Path>) -> PassphraseArgs {
        PassphraseArgs {
            passphrase_file: passphrase_file.map(Path::to_path_buf),
            key_file: key_file.map(Path::to_path_buf),
        }
    }

    /// A key file that is a pipe (`--key-file <(gpg -d k.gpg)`) has no size to reserve for:
    /// the buffer starts at 64 KiB, not grown from one byte (each reallocation left a copy of
    /// the key behind); one grown past its start keeps every byte.
    #[test]
    fn a_key_from_a_pipe_is_read_into_room_made_first() {
        let dir = tempfile::tempdir().unwrap();
        let fifo = dir.path().join("key.fifo");
        let made = std::process::Command::new("mkfifo").arg(&fifo).status();
        assert!(made.is_ok_and(|s| s.success()), "mkfifo");
        for len in [4096usize, 200 << 10] {
            let key: Vec<u8> = (0..len).map(|i| (i * 7 % 251) as u8 + 1).collect();
            let (path, sent) = (fifo.clone(), key.clone());
            let writer = std::thread::spawn(move || std::fs::write(path, sent).unwrap());
            let data = read_key_file(&fifo).unwrap();
            writer.join().unwrap();
            assert!(*data == key, "{len} bytes read back");
            if len < 64 << 10 {
                assert_eq!(data.capacity(), 64 << 10, "room made before reading");
            }
        }
    }

    #[test]
    fn passphrase_files_lose_one_newline_key_files_none() {
        let dir = tempfile::tempdir().unwrap();
        let file = dir.path().join("pw");
        for (content, expected) in [
            (&b"secret\n"[..], &b"secret"[..]),
            (b"secret\r\n", b"secret"),
            (b"secret", b"secret"),
            (b"two\nlines\n\n", b"two\nlines\n"),
        ] {
            std::fs::write(&file, content).unwrap();
            assert_eq!(
                args(Some(&file), None).existing().unwrap().as_slice(),
                expected
            );
            assert_eq!(
                args(None, Some(&file)).existing().unwrap().as_slice(),
                content
            );
        }
        std::fs::write(&file, b"\n").unwrap();
        let err = args(Some(&file), None).existing().unwrap_err().to_string();
        assert!(err.contains("empty"), "{err}");
    }
}
