//! `ivdisk header …` and `ivdisk key …`: LUKS2 header and keyslot management, with
//! cryptsetup's habits (key files are used byte for byte, passphrases typed on a terminal lose
//! their newline, the last keyslot stays unless forced).

use std::fs::{File, OpenOptions};
use std::io::Read;
use std::os::unix::fs::{FileExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::{Args, Subcommand};
use ivdisk_crypto::{ImageId, Suite, VolumeKey};
use ivdisk_header::{FormatSpec, Header, HeaderError, ImageParams, PbkdfRequest, FORMAT_VERSION};
use ivdisk_image::{Image, ImageUri, ReplacedHeader};
use serde_json::json;

use crate::images::flat;
use crate::secrets::{
    json_path, new_secret, old_secret, print, read_key_file, with_spinner, PbkdfArgs,
};

/// What IMAGE may be for `header dump`, `header backup` and `header restore`.
const HEADER_IMAGE_HELP: &str = "A LUKS header file or LUKS volume (a file or block device), or \
    an ivdisk image: a local store directory (PATH or file:PATH), rados://POOL/IMAGE?conf=PATH&\
    id=CLIENT&namespace=NS, mem:NAME";

/// Largest header backup read back: the largest LUKS2 binary headers (2 x 4 MiB) and keyslots
/// area (128 MiB) cryptsetup makes.
const MAX_BACKUP_LEN: u64 = (8 << 20) + (128 << 20);

/// How the user proves they may open the header.
#[derive(Args, Debug, Clone)]
pub struct UnlockArgs {
    /// Read the passphrase from this file, every byte of it ("-" = standard input); otherwise
    /// it is asked for on the terminal.
    #[arg(long, short = 'd', value_name = "FILE")]
    key_file: Option<PathBuf>,
    /// Use the raw volume key in this file instead of a passphrase (recovery).
    #[arg(long, value_name = "FILE", conflicts_with = "key_file")]
    volume_key_file: Option<PathBuf>,
    /// Try only this keyslot.
    #[arg(long, short = 'S', value_name = "N")]
    key_slot: Option<u32>,
}

#[derive(Subcommand)]
pub enum HeaderCommand {
    /// Write a new LUKS2-format header (detached: data elsewhere) with one keyslot.
    #[command(
        after_help = "Example:\n  ivdisk header format disk.hdr --size 10G --key-file pass.txt"
    )]
    Format {
        /// The header file to create (must not exist unless --force).
        file: PathBuf,
        /// Cipher suite of the data.
        #[arg(long, default_value = Suite::DEFAULT.name())]
        cipher: String,
        /// Sector size in bytes: 4096 or 512.
        #[arg(long, default_value_t = 4096)]
        sector_size: u32,
        /// Data size, e.g. 10G.
        #[arg(long)]
        size: String,
        /// Per-sector metadata layout recorded for the image layer.
        #[arg(long)]
        layout: Option<String>,
        /// Passphrase file for keyslot 0 ("-" = stdin); otherwise asked twice on the terminal.
        #[arg(long, short = 'd', value_name = "FILE")]
        key_file: Option<PathBuf>,
        /// Use this volume key instead of a fresh random one.
        #[arg(long, value_name = "FILE")]
        volume_key_file: Option<PathBuf>,
        /// Overwrite an existing file.
        #[arg(long)]
        force: bool,
        #[command(flatten)]
        pbkdf: PbkdfArgs,
        /// Print JSON: file, uuid, keyslot, cipher.
        #[arg(long)]
        json: bool,
    },
    /// Show the header: version, data segment, image parameters, keyslots, tokens.
    #[command(
        after_help = "Example:\n  ivdisk header dump disk.hdr\n  ivdisk header dump disk.ivd\n  ivdisk header dump 'rados://rbd/vm1?id=admin' --json | jq .keyslots"
    )]
    Dump {
        #[arg(help = HEADER_IMAGE_HELP)]
        image: String,
        /// Print the header as JSON (`image` holds the ivdisk image parameters, null for a
        /// LUKS volume).
        #[arg(long)]
        json: bool,
    },
    /// Copy the header and keyslots area to a backup file: of a LUKS header or volume, or
    /// of an ivdisk image (its header object).
    #[command(
        after_help = "Example:\n  ivdisk header backup disk.ivd disk.ivd.header\n  ivdisk header backup 'rados://rbd/vm1?id=admin' vm1.header --json\n  ivdisk header backup disk.hdr disk.hdr.backup\n\nThe backup is a LUKS2 header file (ivdisk header dump and cryptsetup luksDump read it). Keep it away from the image: with a passphrase that was valid when it was made, it opens the image's data even after that passphrase was removed or changed."
    )]
    Backup {
        #[arg(help = HEADER_IMAGE_HELP)]
        image: String,
        /// The backup file to create (must not exist).
        backup: PathBuf,
        /// Print JSON: image, backup, bytes, uuid (and image_id for ivdisk images).
        #[arg(long)]
        json: bool,
    },
    /// Write a header backup back over the header of a LUKS header or volume, or of an ivdisk
    /// image (also when its header object is damaged or missing).
    #[command(
        after_help = "Example:\n  ivdisk header restore disk.ivd disk.ivd.header\n  ivdisk header restore disk.hdr disk.hdr.backup\n\nFor an ivdisk image the restore takes the image's writer lock: it is refused while a writer has the image open (stop it; if it died, `ivdisk lock break IMAGE`). The keyslots of the backup replace the current ones: passphrases added since the backup stop working, removed ones work again. The size recorded in the backup comes back too (a resize since is undone; the restore says so). The count of writes kept for aes-gcm-random images is never lowered. A backup is never restored under a second name while the image it came from still has its header in the same store (the two names would share its data)."
    )]
    Restore {
        #[arg(help = HEADER_IMAGE_HELP)]
        image: String,
        /// The backup file (from `ivdisk header backup` or `cryptsetup luksHeaderBackup`).
        backup: PathBuf,
        /// Replace a header that belongs to another volume or image; for an aes-gcm-random
        /// image whose header object is missing, restore although its count of writes is lost.
        #[arg(long)]
        force: bool,
        /// Print JSON: image, backup, uuid (and image_id, keyslots, replaced, size, old_size
        /// for ivdisk images; data_objects, the image's data objects found, when its header
        /// was missing: 0 means it reads as zeros).
        #[arg(long)]
        json: bool,
    },
}

/// What `ivdisk key` works on.
const KEY_HEADER_HELP: &str = "A LUKS1/LUKS2 header file or volume (a file or block device, \
    as cryptsetup takes it). For an ivdisk image use `ivdisk passphrase`, or change a `header \
    backup` of it and `header restore` that";

#[derive(Subcommand)]
pub enum KeyCommand {
    /// Add a keyslot for a new passphrase or key file (up to 32).
    #[command(
        after_help = "Example:\n  ivdisk key add disk.hdr --key-file old.txt --new-key-file new.key"
    )]
    Add {
        #[arg(help = KEY_HEADER_HELP)]
        image: PathBuf,
        #[command(flatten)]
        unlock: UnlockArgs,
        /// The new passphrase's file ("-" = stdin); otherwise asked twice on the terminal.
        #[arg(long, value_name = "FILE")]
        new_key_file: Option<PathBuf>,
        /// Put the new keyslot here instead of the first free one.
        #[arg(long, value_name = "N")]
        new_key_slot: Option<u32>,
        #[command(flatten)]
        pbkdf: PbkdfArgs,
        /// Print JSON: image, keyslot (the new one), keyslots (all in use).
        #[arg(long)]
        json: bool,
    },
    /// Remove the keyslot a passphrase opens, or the one named by --key-slot.
    #[command(
        after_help = "Example:\n  ivdisk key remove disk.hdr --key-file old.txt\n  ivdisk key remove disk.hdr --key-slot 3 --key-file other.txt"
    )]
    Remove {
        #[arg(help = KEY_HEADER_HELP)]
        image: PathBuf,
        /// The keyslot to remove; its removal is authorised by a passphrase of any keyslot.
        #[arg(long, short = 'S', value_name = "N")]
        key_slot: Option<u32>,
        /// Passphrase file ("-" = stdin); otherwise asked on the terminal.
        #[arg(long, short = 'd', value_name = "FILE")]
        key_file: Option<PathBuf>,
        /// Allow removing the last keyslot (the image can then never be opened again), and
        /// removing --key-slot without any passphrase.
        #[arg(long)]
        force: bool,
        /// Print JSON: image, removed (the keyslot), keyslots (those left).
        #[arg(long)]
        json: bool,
    },
    /// Change the passphrase of a keyslot, keeping its number.
    #[command(
        after_help = "Example:\n  ivdisk key change disk.hdr --key-file old.txt --new-key-file new.txt"
    )]
    Change {
        #[arg(help = KEY_HEADER_HELP)]
        image: PathBuf,
        /// The current passphrase's file; otherwise asked on the terminal.
        #[arg(long, short = 'd', value_name = "FILE")]
        key_file: Option<PathBuf>,
        /// The new passphrase's file; otherwise asked twice on the terminal.
        #[arg(long, value_name = "FILE")]
        new_key_file: Option<PathBuf>,
        /// The keyslot to change (its current passphrase must open it); otherwise the one the
        /// current passphrase opens.
        #[arg(long, short = 'S', value_name = "N")]
        key_slot: Option<u32>,
        #[command(flatten)]
        pbkdf: PbkdfArgs,
        /// Print JSON: image, keyslot, keyslots (all in use).
        #[arg(long)]
        json: bool,
    },
    /// Check a passphrase, key file or volume key without changing anything. Exit code 0 if it
    /// matches, 1 if it does not, 2 on other errors (an unreadable file, a damaged header).
    #[command(after_help = "Example:\n  ivdisk key test disk.hdr --key-file pass.txt && echo ok")]
    Test {
        #[arg(help = KEY_HEADER_HELP)]
        image: PathBuf,
        #[command(flatten)]
        unlock: UnlockArgs,
        /// Print JSON on standard output, also when nothing matches: image, ok, keyslot.
        #[arg(long)]
        json: bool,
    },
}

fn open_read(path: &Path) -> Result<File> {
    File::open(path).with_context(|| format!("cannot open {}", path.display()))
}

fn open_write(path: &Path) -> Result<File> {
    OpenOptions::new()
        .read(true)
        .write(true)
        .open(path)
        .with_context(|| format!("cannot open {} for writing", path.display()))
}

fn read_header(path: &Path) -> Result<(Header, File)> {
    if path.is_dir() {
        // Most likely a local ivdisk image: `ivdisk key` works on LUKS files only.
        bail!(
            "{0} is a directory, not a LUKS header file or volume; if it is an ivdisk image, \
             its passphrases are tested with `ivdisk passphrase test {0}` and changed with \
             `ivdisk passphrase add/remove/change {0}`",
            ivdisk_image::shell_word(&path.to_string_lossy())
        );
    }
    let file = open_read(path)?;
    let header = Header::read(&file).map_err(|e| match e {
        HeaderError::NotLuks => anyhow::anyhow!("{}: {e}", path.display()),
        e => {
            anyhow::Error::new(e).context(format!("{}: the header cannot be read", path.display()))
        }
    })?;
    if let Some(w) = header.warning() {
        note!("ivdisk: warning: {}: {w}", path.display());
    }
    Ok((header, file))
}

/// A LUKS header file or LUKS volume opened for a keyslot change: the code path `ivdisk key`
/// and `ivdisk passphrase` (on LUKS files) share.
pub struct HeaderFile {
    path: PathBuf,
    header: Header,
    device: File,
    /// For a change: the file's `flock`, held from before the header is read again until
    /// this is dropped (see [`HeaderFile::lock`]).
    _lock: Option<File>,
    /// The file's first [`HEADER_PROBE`] bytes as the header was read: whether it changed by
    /// the time the lock is taken.
    probe: Vec<u8>,
}

/// Bytes of a LUKS file compared to tell whether its header changed between two reads: the
/// LUKS1 header with its keyslot table, or LUKS2's binary headers, whose checksums cover the
/// JSON (sequence number included) that every keyslot change rewrites.
const HEADER_PROBE: usize = 64 << 10;

/// The first [`HEADER_PROBE`] bytes of `device` (fewer if it is shorter).
fn header_probe(device: &File) -> Result<Vec<u8>> {
    let mut probe = vec![0u8; HEADER_PROBE];
    let mut filled = 0;
    while filled < probe.len() {
        match device.read_at(&mut probe[filled..], filled as u64)? {
            0 => break,
            n => filled += n,
        }
    }
    probe.truncate(filled);
    Ok(probe)
}

/// How long a keyslot change waits for another program's lock on a LUKS file.
const HEADER_LOCK_WAIT: std::time::Duration = std::time::Duration::from_secs(10);

/// Refuse a keyslot change of a LUKS file that an `ivdisk serve` on this machine holds open
/// for writing (it answers on its control socket): the server holds the file's lock for as
/// long as it runs, so waiting for it is no use.
fn refuse_if_served(path: &Path) -> Result<()> {
    let uri = ImageUri::Local {
        dir: path.to_path_buf(),
    };
    match crate::control::serving_process(&uri) {
        Some(pid) => bail!(
            "{} is served by `ivdisk serve` (process {pid}), which holds its lock for as long \
             as it runs: the keyslots of a served LUKS file change only while it is stopped \
             (cryptsetup's changes too); nothing was changed: stop the server, run this again, \
             then serve the file again",
            path.display()
        ),
        None => Ok(()),
    }
}

/// Take `flock(LOCK_EX)` on a regular file, as cryptsetup does before it changes a LUKS
/// file's metadata (it locks the file itself; block devices it locks by device number under
/// /run/cryptsetup). Waits up to [`HEADER_LOCK_WAIT`]; `None` for what is not a regular file.
fn lock_header_file(path: &Path) -> Result<Option<File>> {
    use rustix::fs::{flock, FlockOperation};
    if !std::fs::metadata(path).is_ok_and(|m| m.is_file()) {
        return Ok(None);
    }
    let file = open_write(path)?;
    let deadline = std::time::Instant::now() + HEADER_LOCK_WAIT;
    let mut asked = false;
    loop {
        match flock(&file, FlockOperation::NonBlockingLockExclusive) {
            Ok(()) => return Ok(Some(file)),
            // An `ivdisk serve` of the file holds the lock for as long as it runs: said at
            // once rather than after the wait.
            Err(rustix::io::Errno::WOULDBLOCK) if !std::mem::replace(&mut asked, true) => {
                refuse_if_served(path)?;
            }
            Err(rustix::io::Errno::WOULDBLOCK) if std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
            Err(rustix::io::Errno::WOULDBLOCK) => bail!(
                "{} is locked by another program (cryptsetup changing its keyslots, or an \
                 `ivdisk serve` of it) and stayed locked for {} s; nothing was changed: retry \
                 when it is done, or stop the server first",
                path.display(),
                HEADER_LOCK_WAIT.as_secs()
            ),
            Err(e) => {
                return Err(anyhow::Error::new(std::io::Error::from(e))
                    .context(format!("locking {}", path.display())))
            }
        }
    }
}

/// Refuse a keyslot change of a regular file that ends inside its header's region (a copy cut
/// short, a truncation): the change would write keyslot material past its end, growing a
/// damaged file into one that looks whole up to there (cryptsetup refuses such a file too).
fn refuse_cut_short(path: &Path, header: &Header, device: &File) -> Result<()> {
    let Ok(meta) = device.metadata() else {
        return Ok(()); // The change's own IO says what is wrong.
    };
    let needed = header.metadata_end();
    if meta.is_file() && meta.len() < needed {
        bail!(
            "{} ends at byte {}, inside its LUKS header, which ends at byte {needed}: the file \
             was cut short (a copy that stopped, a truncation), and a keyslot change would \
             write past its end; nothing was changed: restore the file, or its header from a \
             backup (`ivdisk header restore`)",
            path.display(),
            meta.len()
        );
    }
    Ok(())
}

impl HeaderFile {
    pub fn open(path: &Path) -> Result<HeaderFile> {
        let (header, device) = read_header(path)?;
        let probe = header_probe(&device)
            .with_context(|| format!("reading the header of {}", path.display()))?;
        Ok(HeaderFile {
            path: path.to_path_buf(),
            header,
            device,
            _lock: None,
            probe,
        })
    }

    /// Open for a keyslot change, refused at once if an `ivdisk serve` holds the file (before
    /// any passphrase is asked for); [`HeaderFile::lock`] takes the lock before the change.
    /// Whether the header on disk is no longer the one this read (or last wrote): after a
    /// failed change, whether it failed before the header was switched or after (the wipe of
    /// a keyslot's old area, a sync). `true` when the file cannot be read either.
    pub fn changed_on_disk(&self) -> bool {
        header_probe(&self.device).map_or(true, |now| now != self.probe)
    }

    pub fn open_for_change(path: &Path) -> Result<HeaderFile> {
        let file = HeaderFile::open(path)?;
        if file.device.metadata().is_ok_and(|m| m.is_file()) {
            refuse_if_served(path)?;
        }
        Ok(file)
    }

    /// Before a keyslot change: take the file's lock and read the header again under it; the
    /// lock is held until this is dropped, so a concurrent change (cryptsetup's, another
    /// ivdisk's) cannot be overwritten by one made from an older read: it waits, or this one
    /// does. Passphrases are read before, without the lock, so that a prompt never holds it
    /// (cryptsetup's prompts do not either). Returns whether the header changed since
    /// [`HeaderFile::open`] read it: a keyslot found open then may be another one now.
    pub fn lock(&mut self) -> Result<bool> {
        let lock = lock_header_file(&self.path)?;
        let (header, device) = read_header(&self.path)?;
        refuse_cut_short(&self.path, &header, &device)?;
        let probe = header_probe(&device)
            .with_context(|| format!("reading the header of {}", self.path.display()))?;
        let changed = probe != self.probe;
        *self = HeaderFile {
            path: self.path.clone(),
            header,
            device,
            _lock: lock,
            probe,
        };
        Ok(changed)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The keyslots in use.
    pub fn keyslots(&self) -> Vec<u32> {
        self.header.keyslots().iter().map(|k| k.id).collect()
    }

    /// Unlock with a passphrase: any keyslot, or only `slot`. Returns the keyslot it opened.
    pub fn unlock(&self, secret: &[u8], slot: Option<u32>) -> Result<(u32, VolumeKey)> {
        with_spinner(
            "unlocking (the key derivation takes a few seconds by design)",
            || match slot {
                Some(slot) => self
                    .header
                    .unlock_keyslot(&self.device, slot, secret)
                    .map(|k| (slot, k)),
                None => self
                    .header
                    .unlock(&self.device, secret)
                    .map(|u| (u.keyslot, u.volume_key)),
            },
        )
        .map_err(Into::into)
    }

    /// Add a keyslot for `new` holding `key` (from [`HeaderFile::unlock`]); `slot` or the
    /// first free one.
    pub fn add(
        &mut self,
        key: &VolumeKey,
        new: &[u8],
        slot: Option<u32>,
        pbkdf: &PbkdfRequest,
    ) -> Result<u32> {
        let path = self.path.clone();
        let header = &mut self.header;
        with_spinner("writing the new keyslot", || {
            header
                .add_keyslot(&mut open_write(&path)?, key, new, slot, pbkdf)
                .map_err(anyhow::Error::from)
        })
    }

    /// Remove a keyslot (the last one only with `force`).
    pub fn remove(&mut self, slot: u32, force: bool) -> Result<()> {
        self.header
            .remove_keyslot(&mut open_write(&self.path)?, slot, force)?;
        Ok(())
    }

    /// Change the passphrase of the keyslot `old` opens (or of `slot`), keeping its number.
    pub fn change(
        &mut self,
        old: &[u8],
        new: &[u8],
        slot: Option<u32>,
        pbkdf: &PbkdfRequest,
    ) -> Result<u32> {
        let path = self.path.clone();
        let header = &mut self.header;
        with_spinner("changing the passphrase", || {
            header
                .change_passphrase(&mut open_write(&path)?, old, new, slot, pbkdf)
                .map_err(anyhow::Error::from)
        })
    }
}

/// Where `header backup`/`restore` work: a header file or LUKS volume (as cryptsetup), or an
/// ivdisk image's header object.
enum HeaderTarget {
    File(PathBuf),
    Image(ImageUri),
}

fn header_target(text: &str) -> HeaderTarget {
    match ImageUri::parse(text) {
        // A local path is an ivdisk image only when it is a store directory: files and block
        // devices (and paths that do not exist) keep their meaning of before.
        Ok(ImageUri::Local { dir }) if !dir.is_dir() => HeaderTarget::File(dir),
        Ok(uri) => HeaderTarget::Image(uri),
        Err(_) => HeaderTarget::File(PathBuf::from(text)),
    }
}

/// The header of an ivdisk image (its header object), for `header dump`: read as the
/// backup would be, so a dump shows exactly what `header backup` would save.
fn read_image_header(uri: &ImageUri) -> Result<Header> {
    let rt = crate::runtime()?;
    let (bytes, _) = rt.block_on(Image::backup_header(uri)).map_err(flat)?;
    let header = Header::read(&ivdisk_header::MemoryHeaderIo(bytes))
        .with_context(|| format!("{uri}: the header cannot be read"))?;
    if let Some(w) = header.warning() {
        note!("ivdisk: warning: {uri}: {w}");
    }
    Ok(header)
}

/// `header backup` of an ivdisk image: its header object's region into a new file, sparse
/// (the unused keyslot area is zeros and stays a hole).
fn backup_image_header(uri: &ImageUri, backup: &Path, json: bool) -> Result<()> {
    let rt = crate::runtime()?;
    let (bytes, info) = rt.block_on(Image::backup_header(uri)).map_err(flat)?;
    let out = OpenOptions::new()
        .write(true)
        .create_new(true)
        // Keyslots: material for guessing the passphrase offline (cryptsetup: 0400).
        .mode(0o600)
        .open(backup)
        .with_context(|| {
            format!(
                "cannot create backup file {} (it must not exist)",
                backup.display()
            )
        })?;
    let written = (|| -> std::io::Result<()> {
        for (i, block) in bytes.chunks(4096).enumerate() {
            if block.iter().any(|&b| b != 0) {
                out.write_all_at(block, i as u64 * 4096)?;
            }
        }
        out.set_len(bytes.len() as u64)?;
        out.sync_all()
    })();
    if let Err(e) = written {
        // Never leave a backup behind that looks complete and is not.
        let _ = std::fs::remove_file(backup);
        return Err(anyhow::Error::new(e).context(format!(
            "writing backup file {} (removed again)",
            backup.display()
        )));
    }
    let image_id = hex::encode(info.image_id.0);
    print(
        json,
        json!({"image": uri.to_string(), "backup": json_path(backup), "bytes": info.len, "uuid": info.uuid,
               "image_id": image_id, "keyslots": info.keyslots}),
        format!(
            "{} bytes of the header of image {uri} (id {image_id}, LUKS UUID {}) saved to {}",
            info.len,
            info.uuid,
            backup.display()
        ),
    );
    Ok(())
}

/// `header restore` to an ivdisk image.
fn restore_image_header(uri: &ImageUri, backup: &Path, force: bool, json: bool) -> Result<()> {
    let file = open_read(backup)?;
    let len = file
        .metadata()
        .with_context(|| format!("reading the size of {}", backup.display()))?
        .len();
    if len > MAX_BACKUP_LEN {
        bail!(
            "{} is {len} bytes, larger than any LUKS2 header region ({MAX_BACKUP_LEN} bytes at \
             most): it is not a header backup",
            backup.display()
        );
    }
    let mut bytes = Vec::with_capacity(len as usize);
    file.take(MAX_BACKUP_LEN)
        .read_to_end(&mut bytes)
        .with_context(|| format!("reading {}", backup.display()))?;
    let rt = crate::runtime()?;
    // The header holds the image's size: a backup made before a resize brings the old size
    // back, which the user is told.
    let size_before = rt.block_on(Image::info(uri)).ok().map(|i| i.size);
    let restored = rt
        .block_on(Image::restore_header(uri, &bytes, force))
        .map_err(flat)?;
    let size_after = rt.block_on(Image::info(uri)).ok().map(|i| i.size);
    let size_note = match (size_before, size_after) {
        (Some(before), Some(after)) if before != after => format!(
            "; the image's size is now {after} bytes, as when the backup was made (it was \
             {before}: `ivdisk resize {} --size {before}` brings it back)",
            ivdisk_image::shell_word(&uri.to_string())
        ),
        _ => String::new(),
    };
    let info = &restored.restored;
    let image_id = hex::encode(info.image_id.0);
    let (replaced, note) = match &restored.replaced {
        ReplacedHeader::Same => ("same".to_owned(), String::new()),
        ReplacedHeader::Other(id) => (
            format!("other:{}", hex::encode(id.0)),
            format!(
                " (replacing the header of image id {}, as forced)",
                hex::encode(id.0)
            ),
        ),
        ReplacedHeader::Unreadable(reason) => (
            "unreadable".to_owned(),
            format!(" (the header in place did not read: {reason})"),
        ),
        ReplacedHeader::Missing => (
            "missing".to_owned(),
            match restored.data_objects {
                Some(0) => " (the header object was missing). WARNING: the store holds no data \
                            object of this image, so it reads as zeros everywhere: if the image \
                            was deleted, its data is gone with it (`ivdisk restore` of a backup \
                            made with `ivdisk backup` brings an image back whole)"
                    .to_owned(),
                _ => " (the header object was missing)".to_owned(),
            },
        ),
    };
    print(
        json,
        json!({"image": uri.to_string(), "backup": json_path(backup), "uuid": info.uuid,
               "image_id": image_id, "keyslots": info.keyslots, "replaced": replaced,
               "data_objects": restored.data_objects,
               "size": size_after, "old_size": size_before}),
        format!(
            "header of image id {image_id} (LUKS UUID {}) restored to image {uri} from {}{note}; \
             keyslots: {}{size_note}",
            info.uuid,
            backup.display(),
            info.keyslots
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        ),
    );
    Ok(())
}

fn unlock(header: &Header, device: &File, args: &UnlockArgs) -> Result<(Option<u32>, VolumeKey)> {
    if let Some(path) = &args.volume_key_file {
        let key = read_key_file(path)?;
        let key = header
            .unlock_with_volume_key(&key)
            .with_context(|| format!("volume key file {}", path.display()))?;
        return Ok((None, key));
    }
    let secret = old_secret(&args.key_file)?;
    with_spinner(
        "unlocking (the key derivation takes a few seconds by design)",
        || match args.key_slot {
            Some(slot) => header
                .unlock_keyslot(device, slot, &secret)
                .map(|k| (Some(slot), k)),
            None => header
                .unlock(device, &secret)
                .map(|u| (Some(u.keyslot), u.volume_key)),
        },
    )
    .map_err(Into::into)
}

/// `header format --force` replaces a detached header file. A LUKS volume that holds its data
/// after its header is no such file: replaced, the volume and its data would be gone.
fn refuse_volume_with_data(file: &Path) -> Result<()> {
    let Ok(existing) = File::open(file) else {
        return Ok(());
    };
    let Ok(header) = Header::read(&existing) else {
        return Ok(());
    };
    let Ok(segment) = header.segment() else {
        return Ok(());
    };
    let size = existing.metadata().map_or(0, |m| m.len());
    if segment.offset > 0 && size > segment.offset {
        bail!(
            "{} is a LUKS volume with {} bytes of data after its header (from byte {}): \
             `header format` writes a detached header, and replacing the volume with one \
             would destroy that data, --force or not. Its passphrases are changed with \
             `ivdisk passphrase`; to discard the volume, remove the file first",
            file.display(),
            size - segment.offset,
            segment.offset
        );
    }
    Ok(())
}

pub fn run_header(command: HeaderCommand) -> Result<()> {
    match command {
        HeaderCommand::Format {
            file,
            cipher,
            sector_size,
            size,
            layout,
            key_file,
            volume_key_file,
            force,
            pbkdf,
            json,
        } => {
            let suite: Suite = cipher.parse()?;
            if !matches!(sector_size, 512 | 4096) {
                bail!("--sector-size {sector_size}: expected 4096 or 512");
            }
            let bytes = crate::parse_size(&size)?;
            if bytes == 0 || bytes % sector_size as u64 != 0 {
                bail!("--size {size}: must be a non-zero multiple of the {sector_size}-byte sector size");
            }
            // As `ivdisk create` refuses: every command that opens the header refused it.
            if bytes > ivdisk_image::MAX_IMAGE_SIZE {
                bail!(
                    "--size {size}: must be below 8E ({} bytes at most: NBD clients hold sizes \
                     as signed 64-bit numbers)",
                    ivdisk_image::MAX_IMAGE_SIZE
                        - ivdisk_image::MAX_IMAGE_SIZE % sector_size as u64
                );
            }
            // As `ivdisk create` chooses.
            let layout = layout.unwrap_or_else(|| {
                ivdisk_image::LayoutKind::default_for(suite.metadata_len())
                    .name()
                    .to_owned()
            });
            let fits = layout
                .parse::<ivdisk_image::LayoutKind>()
                .is_ok_and(|l| l.fits(suite.metadata_len()));
            if !fits {
                bail!(
                    "--layout {layout}: {suite} needs {}",
                    if suite.metadata_len() == 0 {
                        "layout none".to_owned()
                    } else {
                        ivdisk_image::LayoutKind::with_metadata_names()
                    }
                );
            }
            let key = match &volume_key_file {
                Some(path) => VolumeKey::new(read_key_file(path)?.to_vec()),
                None => VolumeKey::generate(suite.default_key_len())?,
            };
            let passphrase = new_secret(&key_file)?;
            let mut image_id = [0u8; 16];
            ivdisk_crypto::fill_random(&mut image_id)?;
            let mut spec = FormatSpec::new(suite, sector_size);
            spec.data_size = Some(bytes);
            spec.pbkdf = pbkdf.request()?;
            spec.image = Some(ImageParams {
                format_version: FORMAT_VERSION,
                layout,
                object_size: 4 << 20,
                image_id: ImageId(image_id),
            });
            // A regular file overwritten (--force) stays as it was until the new header is
            // complete: it is made beside it and renamed over it. Truncated first, a format
            // that then failed (a volume key of the wrong length) left neither header.
            let replacing = force && std::fs::metadata(&file).is_ok_and(|m| m.is_file());
            if replacing {
                refuse_volume_with_data(&file)?;
            }
            // Through a symbolic link, the file it names is replaced, not the link (the real
            // header kept the old keyslots, which a format meant to revoke).
            let replaced = match replacing {
                true => std::fs::canonicalize(&file)
                    .with_context(|| format!("resolving {}", file.display()))?,
                false => file.clone(),
            };
            let target = match replacing {
                true => {
                    let name = replaced.file_name().unwrap_or_default().to_string_lossy();
                    replaced.with_file_name(format!(".{name}.ivdisk-format-{}", std::process::id()))
                }
                false => file.clone(),
            };
            let made_here = replacing || !file.exists();
            // Keyslots allow offline guessing of the passphrase: a new header file is its
            // owner's only (as cryptsetup makes one), a replaced one keeps its mode.
            let mode = match replacing {
                true => std::fs::metadata(&replaced)
                    .map(|m| m.permissions().mode() & 0o7777)
                    .unwrap_or(0o600),
                false => 0o600,
            };
            let mut out = OpenOptions::new()
                .read(true)
                .write(true)
                .create(true)
                .truncate(force && !replacing)
                .create_new(!force || replacing)
                .mode(mode)
                .open(&target)
                .with_context(|| match force || !file.exists() {
                    true => format!("cannot create {}", target.display()),
                    false => format!(
                        "cannot create {} (use --force to overwrite)",
                        file.display()
                    ),
                })?;
            let formatted = with_spinner("benchmarking the key derivation", || {
                Header::format(&mut out, &spec, &key, &passphrase)
            })
            .map_err(anyhow::Error::new)
            .and_then(|header| {
                if replacing {
                    // The mode asked at creation is cut by the umask.
                    out.set_permissions(std::fs::Permissions::from_mode(mode))
                        .with_context(|| format!("setting the mode of {}", target.display()))?;
                    out.sync_all()
                        .with_context(|| format!("syncing {}", target.display()))?;
                    std::fs::rename(&target, &replaced).with_context(|| {
                        format!("renaming {} to {}", target.display(), replaced.display())
                    })?;
                }
                Ok(header)
            });
            let header = match formatted {
                Ok(header) => header,
                // Never leave a file behind that looks like a header and is not one.
                Err(e) if made_here => {
                    let _ = std::fs::remove_file(&target);
                    return Err(e.context(match replacing {
                        true => format!("formatting {}; it was left as it was", file.display()),
                        false => format!("formatting {} (removed again)", file.display()),
                    }));
                }
                Err(e) => return Err(e),
            };
            print(
                json,
                json!({"file": json_path(&file), "uuid": header.uuid(), "keyslot": 0, "cipher": suite.name()}),
                format!(
                    "{}: LUKS2 header {} written, keyslot 0",
                    file.display(),
                    header.uuid()
                ),
            );
        }
        HeaderCommand::Dump { image, json } => {
            let header = match header_target(&image) {
                HeaderTarget::Image(uri) => read_image_header(&uri)?,
                HeaderTarget::File(path) => read_header(&path)?.0,
            };
            if json {
                outln!("{}", header.to_json());
            } else {
                print_dump(&header);
            }
        }
        HeaderCommand::Backup {
            image,
            backup,
            json,
        } => {
            let image = match header_target(&image) {
                HeaderTarget::Image(uri) => return backup_image_header(&uri, &backup, json),
                HeaderTarget::File(path) => path,
            };
            let (header, device) = read_header(&image)?;
            let mut out = OpenOptions::new()
                .read(true)
                .write(true)
                .create_new(true)
                // Keyslots: material for guessing the passphrase offline (cryptsetup: 0400).
                .mode(0o600)
                .open(&backup)
                .with_context(|| {
                    format!(
                        "cannot create backup file {} (it must not exist)",
                        backup.display()
                    )
                })?;
            let len = match header.backup(&device, &mut out) {
                Ok(len) => len,
                Err(e) => {
                    // Never a backup left behind that looks complete and is not.
                    drop(out);
                    let removed = std::fs::remove_file(&backup).is_ok();
                    return Err(anyhow::Error::new(e).context(format!(
                        "saving the header of {} to {}{}",
                        image.display(),
                        backup.display(),
                        if removed {
                            " (the partial backup was removed)"
                        } else {
                            ""
                        }
                    )));
                }
            };
            print(
                json,
                json!({"image": json_path(&image), "backup": json_path(&backup), "bytes": len, "uuid": header.uuid()}),
                format!(
                    "{} bytes of header {} saved to {}",
                    len,
                    header.uuid(),
                    backup.display()
                ),
            );
        }
        HeaderCommand::Restore {
            image,
            backup,
            force,
            json,
        } => {
            let image = match header_target(&image) {
                HeaderTarget::Image(uri) => {
                    return restore_image_header(&uri, &backup, force, json)
                }
                HeaderTarget::File(path) => path,
            };
            let source = open_read(&backup)?;
            // As a keyslot change: not under a running server (which holds the file's lock
            // and its keys), and under the file's lock, so a change another process makes
            // meanwhile (cryptsetup's, ivdisk's) neither undoes the restore nor mixes with it.
            let is_file = std::fs::metadata(&image).is_ok_and(|m| m.is_file());
            if is_file {
                refuse_if_served(&image)?;
            }
            let _lock = lock_header_file(&image)?;
            let header =
                Header::restore(&mut open_write(&image)?, &source, force).with_context(|| {
                    format!("restoring {} from {}", image.display(), backup.display())
                })?;
            print(
                json,
                json!({"image": json_path(&image), "backup": json_path(&backup), "uuid": header.uuid()}),
                format!("header {} restored to {}", header.uuid(), image.display()),
            );
        }
    }
    Ok(())
}

/// What `header dump` adds after a keyslot's line, as `cryptsetup luksDump` marks it: a
/// priority other than normal, a key that opens no data segment.
fn keyslot_notes(k: &ivdisk_header::KeyslotInfo) -> String {
    let mut notes = String::new();
    match k.priority {
        Some(0) => notes.push_str(", priority ignore (passphrases are not tried on it; cryptsetup tries it only with --key-slot)"),
        Some(2) => notes.push_str(", priority prefer (tried first)"),
        _ => {}
    }
    if k.unbound {
        notes.push_str(", unbound (its key opens no data segment)");
    }
    notes
}

fn print_dump(header: &Header) {
    outln!("LUKS header version {}", header.version());
    outln!("UUID:      {}", header.uuid());
    if !header.label().is_empty() {
        outln!("Label:     {}", header.label());
    }
    if header.version() == 2 {
        outln!("Seqid:     {}", header.seqid());
    }
    match header.segment() {
        Ok(s) => {
            outln!("Cipher:    {}", s.cipher);
            outln!("Sector:    {} bytes", s.sector_size);
            outln!(
                "Data:      offset {} bytes, size {}",
                s.offset,
                s.size.map_or("dynamic".into(), |n| format!("{n} bytes"))
            );
        }
        Err(e) => outln!("Data:      unusable: {e}"),
    }
    match header.image_params() {
        Ok(Some(p)) => outln!(
            "Image:     ivdisk format {}, layout {}, object size {}, id {}",
            p.format_version,
            p.layout,
            p.object_size,
            hex::encode(p.image_id.0)
        ),
        Ok(None) => outln!("Image:     (a LUKS volume not made by ivdisk)"),
        Err(e) => outln!("Image:     unusable: {e}"),
    }
    if let Some(m) = header.metadata() {
        let reqs = m.config.mandatory_requirements();
        if !reqs.is_empty() {
            outln!("Requires:  {}", reqs.join(", "));
        }
    }
    outln!("Keyslots:");
    for k in header.keyslots() {
        outln!(
            "  {:>2}: {} ({}), {}-bit key, area {}+{}{}",
            k.id,
            k.kdf,
            k.kdf_params,
            k.key_size * 8,
            k.area_offset,
            k.area_size,
            keyslot_notes(&k)
        );
    }
    // Every token, ivdisk's own (`Image:` above) and other tools' (systemd's TPM2 or FIDO2
    // enrollments, `cryptsetup token import`), as `cryptsetup luksDump` lists them.
    if let Some(m) = header.metadata().filter(|m| !m.tokens.is_empty()) {
        outln!("Tokens:");
        for (id, token) in &m.tokens {
            let kind = token
                .get("type")
                .and_then(serde_json::Value::as_str)
                .unwrap_or("(no type)");
            let slots: Vec<&str> = token
                .get("keyslots")
                .and_then(serde_json::Value::as_array)
                .map(|slots| slots.iter().filter_map(serde_json::Value::as_str).collect())
                .unwrap_or_default();
            match slots.is_empty() {
                true => outln!("  {id:>2}: {kind}, no keyslots"),
                false => outln!("  {id:>2}: {kind}, keyslots {}", slots.join(", ")),
            }
        }
    }
}

pub fn run_key(command: KeyCommand) -> Result<()> {
    match command {
        KeyCommand::Add {
            image,
            unlock: unlock_args,
            new_key_file,
            new_key_slot,
            pbkdf,
            json,
        } => {
            let mut file = HeaderFile::open_for_change(&image)?;
            let (_, key) = unlock(&file.header, &file.device, &unlock_args)
                .with_context(|| image.display().to_string())?;
            let secret = new_secret(&new_key_file)?;
            let request = pbkdf.request()?;
            // The key is checked against the header read under the lock (its digest).
            file.lock()?;
            let slot = file
                .add(&key, &secret, new_key_slot, &request)
                .with_context(|| image.display().to_string())?;
            print(
                json,
                json!({"image": json_path(&image), "keyslot": slot, "keyslots": file.keyslots()}),
                format!("keyslot {slot} added"),
            );
        }
        KeyCommand::Remove {
            image,
            key_slot,
            key_file,
            force,
            json,
        } => {
            let mut file = HeaderFile::open_for_change(&image)?;
            let secret = match (key_slot, force && key_file.is_none()) {
                (Some(_), true) => None,
                _ => Some(old_secret(&key_file)?),
            };
            file.lock()?;
            // Unlocked under the lock: which keyslot a passphrase opens is read there.
            let slot = match (key_slot, &secret) {
                (Some(slot), None) => slot,
                (Some(slot), Some(secret)) => {
                    file.unlock(secret, None)
                        .context("removing a keyslot by number needs a passphrase of any keyslot (or --force)")?;
                    slot
                }
                (None, Some(secret)) => {
                    file.unlock(secret, None)
                        .with_context(|| image.display().to_string())?
                        .0
                }
                (None, None) => unreachable!("a secret is read unless a keyslot is forced"),
            };
            file.remove(slot, force)
                .with_context(|| image.display().to_string())?;
            print(
                json,
                json!({"image": json_path(&image), "removed": slot, "keyslots": file.keyslots()}),
                format!("keyslot {slot} removed"),
            );
        }
        KeyCommand::Change {
            image,
            key_file,
            new_key_file,
            key_slot,
            pbkdf,
            json,
        } => {
            let mut file = HeaderFile::open_for_change(&image)?;
            let old = old_secret(&key_file)?;
            let new = new_secret(&new_key_file)?;
            let request = pbkdf.request()?;
            file.lock()?;
            let slot = file
                .change(&old, &new, key_slot, &request)
                .with_context(|| image.display().to_string())?;
            print(
                json,
                json!({"image": json_path(&image), "keyslot": slot, "keyslots": file.keyslots()}),
                format!("keyslot {slot} now opens with the new passphrase"),
            );
        }
        KeyCommand::Test {
            image,
            unlock: unlock_args,
            json,
        } => {
            // Exit code 1 is the answer "no"; 2 any other failure (as `verify`'s): a script
            // tells a wrong passphrase from a file it could not read.
            let (header, device) = match read_header(&image) {
                Ok(read) => read,
                Err(e) => crate::transfer::exit_with(2, &e),
            };
            let (slot, _) = match unlock(&header, &device, &unlock_args) {
                Ok(unlocked) => unlocked,
                Err(e) => {
                    // A script asks for the answer, and "no" is one: said on stdout as "yes"
                    // is (and by the exit status); other failures are errors only.
                    let mismatch = e.chain().any(|cause| {
                        matches!(
                            cause.downcast_ref::<HeaderError>(),
                            Some(
                                HeaderError::WrongPassphrase { .. }
                                    | HeaderError::KeyslotMismatch { .. }
                                    | HeaderError::VolumeKeyMismatch
                                    | HeaderError::VolumeKeyLength { .. }
                            )
                        )
                    });
                    if !mismatch {
                        crate::transfer::exit_with(2, &e.context(image.display().to_string()));
                    }
                    if json {
                        let reason = format!("{e:#}");
                        outln!(
                            "{}",
                            json!({"image": json_path(&image), "keyslot": null, "ok": false, "reason": reason})
                        );
                    }
                    return Err(e.context(image.display().to_string()));
                }
            };
            let text = match slot {
                Some(s) => format!("keyslot {s} opens with this passphrase"),
                None => "the volume key matches".to_owned(),
            };
            print(
                json,
                json!({"image": json_path(&image), "keyslot": slot, "ok": true}),
                text,
            );
        }
    }
    Ok(())
}
