//! `ivdisk convert SRC DST`: the plaintext of any disk ivdisk can read, copied into a NEW
//! random-IV image and then read back whole and compared (issue 9, point 5).
//!
//! Sources, opened read-only, all seen through the NBD crate's [`BlockDevice`] (a byte range
//! reader with an allocation map): a LUKS1/LUKS2 file of cryptsetup and any ivdisk image
//! ([`Image`], which also opens librbd LUKS images on `rados://`), a librbd image through
//! librbd ([`RbdImage`], `rbd://`, plain or LUKS), and an unencrypted raw file or block
//! device ([`RawFile`], holes found with `SEEK_DATA`/`SEEK_HOLE`).
//!
//! The copy uses `import`'s machinery (`transfer.rs`): chunks of at most one destination
//! object, [`IN_FLIGHT`] at once on runtime tasks, all-zero sectors not written (an unwritten
//! sector reads as zeros), and a failed copy deletes the half-made image. Where the source
//! says a range holds no data, it is not even read. Then every byte of the destination is
//! read back and compared with the source (read again where it holds data); a difference
//! deletes the destination too, naming the first differing offset.
//!
//! Everything that can be refused without a passphrase (addresses, options, SRC == DST, DST
//! in the way) is refused before one is asked for, and nothing is created or deleted before
//! the source is open (a wrong passphrase leaves everything as it was).

use std::fs::File;
use std::io::Read;
use std::os::unix::fs::MetadataExt;
use std::os::unix::fs::{FileExt, FileTypeExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{anyhow, bail, Context, Result};
use async_trait::async_trait;
use clap::{Args, ValueEnum};
use futures_util::stream::{self, StreamExt};
use indicatif::ProgressBar;
use ivdisk_image::{Image, ImageError, ImageUri};
use ivdisk_nbd::{BlockDevice, DeviceError, DeviceErrorKind, Extent};
use ivdisk_rbd::{LuksFormat, RbdError, RbdImage, RbdOpenOptions, RbdUri};
use serde_json::json;
use tokio::runtime::Runtime;
use zeroize::Zeroizing;

use crate::images::{exact_size, flat, human_size, parse_image_at, parse_uri, FormatArgs};
use crate::secrets::{prompt_twice, with_spinner, NewPassphraseArgs, PassphraseArgs};
use crate::transfer::{
    chunk_size, delete_half_made, interrupted, interrupted_error, progress, source_len,
    stop_copies_on_signals, store_dir_to_make, unlock_read_only, write_data_runs, IN_FLIGHT,
};
use ivdisk_store::all_zero;

/// The body of `ivdisk convert --help` (main.rs adds the suites and layouts).
pub fn after_help() -> String {
    "Examples:\n  \
     ivdisk convert luks.img disk.ivd                    # a cryptsetup LUKS1/LUKS2 file; its passphrase protects the new image too\n  \
     ivdisk convert 'rbd://rbd/vm2?conf=/etc/ceph/ceph.conf' 'rados://rbd/vm2-ivd?conf=/etc/ceph/ceph.conf' --passphrase-file pw.txt\n  \
     ivdisk convert vm.raw disk.ivd --new-passphrase-file new.txt     # an unencrypted raw disk\n  \
     ivdisk convert old.ivd new.ivd --cipher aes-xts-random --layout omap --new-passphrase-file new.txt --json\n\n\
     SRC is opened read-only. A file is unlocked when it starts with a LUKS header and read \
     as unencrypted raw data otherwise (said on standard error; --source-format raw reads \
     every byte as it is, a LUKS header included). A block device is read as raw data; one \
     with a LUKS header is refused (open it with `cryptsetup open` and convert \
     /dev/mapper/NAME). rbd:// images go \
     through librbd (encryption=auto loads librbd's LUKS1/LUKS2 when there is a header).\n\n\
     DST is a new ivdisk image, made as `ivdisk create` makes one (--cipher, --layout, \
     --sector-size, --object-size, key derivation options). Its size is SRC's size rounded up \
     to DST's sector size (the added bytes read as zeros). Ranges SRC reports unallocated are \
     not read, and all-zero sectors are not written (an unwritten sector reads as zeros). Then \
     every byte of DST is read back and compared with SRC; if any differs, or the copy fails or \
     is stopped by Ctrl-C (SIGINT), SIGTERM or SIGHUP, DST is deleted and convert exits 1 (naming the first differing offset); killed outright \
     (SIGKILL, a crash), it leaves DST marked unfinished, refused by every open until deleted \
     (`ivdisk delete DST --yes`). A DST that exists is refused unless --force, which deletes it (an ivdisk image; never a file) once \
     SRC is open. SRC and DST may not be the same image.\n\n\
     Passphrases: SRC's comes from --passphrase-file/--key-file or the terminal, and protects \
     DST too unless --new-passphrase-file/--new-key-file gives DST its own. An unencrypted SRC \
     (raw, plain rbd) needs none: DST's then comes from --new-passphrase-file, \
     --passphrase-file (or the key file options), or is asked for twice on the terminal."
        .to_owned()
}

/// How a file or block device SRC is read.
#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum SourceFormat {
    /// A LUKS header is unlocked; anything else is read as unencrypted raw data.
    Auto,
    /// Every byte as it is, a LUKS header included.
    Raw,
}

#[derive(Args)]
pub struct ConvertArgs {
    /// What to read (opened read-only): a LUKS1/LUKS2 file made by cryptsetup; a librbd image
    /// rbd://POOL/IMAGE[@SNAP]?conf=PATH&id=CLIENT&namespace=NS&encryption=auto|none|luks1|luks2;
    /// an unencrypted raw file or block device; or an ivdisk image (PATH of a local store
    /// directory, rados://POOL/IMAGE?conf=PATH&id=CLIENT&namespace=NS, mem:NAME).
    source: String,
    /// The new ivdisk image: PATH or file:PATH (a new local store directory),
    /// rados://POOL/IMAGE?conf=PATH&id=CLIENT&namespace=NS, mem:NAME.
    destination: String,
    #[command(flatten)]
    format: FormatArgs,
    /// How to read a file or block device SRC: auto (unlock a LUKS header, read anything else
    /// as unencrypted raw) or raw (every byte as it is).
    #[arg(long, value_enum, default_value_t = SourceFormat::Auto)]
    source_format: SourceFormat,
    /// Delete DST first if it exists (an ivdisk image; a file in its place is never deleted).
    #[arg(long)]
    force: bool,
    #[command(flatten)]
    passphrase: PassphraseArgs,
    #[command(flatten)]
    new: NewPassphraseArgs,
    /// Print one JSON object at the end (source, source_kind, destination, size, source_size,
    /// bytes_written, bytes_skipped, verified, seconds, cipher, layout); no progress bars.
    #[arg(long)]
    json: bool,
}

// ---------------------------------------------------------------------------------------------
// Sources

/// What SRC names, before anything is opened.
#[derive(Debug)]
enum Spec {
    /// A librbd image, through librbd.
    Rbd(RbdUri),
    /// An ivdisk image (at a snapshot: `IMAGE@SNAP`), or a LUKS file (`Image::open` tells
    /// them apart).
    Image(ImageUri, Option<String>),
    /// Unencrypted bytes of a regular file or block device.
    Raw(PathBuf),
}

/// `Some(version)` when a file starts with the LUKS magic, or holds a LUKS2 secondary header
/// where one can be (its primary damaged: the header reads from the secondary, as
/// `ivdisk serve` and cryptsetup read it; taken for raw, its ciphertext was copied as data).
pub(crate) fn luks_version(path: &Path) -> Result<Option<u16>> {
    let mut head = Vec::with_capacity(8);
    let file = File::open(path).with_context(|| format!("cannot read {}", path.display()))?;
    (&file)
        .take(8)
        .read_to_end(&mut head)
        .with_context(|| format!("cannot read {}", path.display()))?;
    let secondary = || {
        ivdisk_header::binary::HEADER_SIZES.iter().any(|&offset| {
            let mut magic = [0u8; 6];
            file.read_exact_at(&mut magic, offset).is_ok()
                && magic == ivdisk_header::binary::MAGIC_SECONDARY
        })
    };
    Ok(match LuksFormat::detect(&head) {
        Ok(None) if secondary() => Some(2),
        Ok(None) => None,
        Ok(Some(format)) => Some(match format {
            LuksFormat::Luks1 => 1,
            LuksFormat::Luks2 => 2,
        }),
        Err(version) => Some(version),
    })
}

/// Tell what SRC is. With `auto`, a file without a LUKS header is read as raw, said on stderr.
fn classify(text: &str, format: SourceFormat) -> Result<Spec> {
    let raw = format == SourceFormat::Raw;
    if RbdUri::is_rbd(text) {
        if raw {
            bail!(
                "--source-format raw is for files and block devices; for the raw bytes of an rbd \
                 image add encryption=none to its address"
            );
        }
        return Ok(Spec::Rbd(RbdUri::parse(text).map_err(|e| anyhow!("{e}"))?));
    }
    let (uri, snapshot) = parse_image_at(text)?;
    if let Some(name) = snapshot {
        if raw {
            bail!(
                "--source-format raw is for files and block devices, not snapshot {}",
                uri.at_snapshot(&name)
            );
        }
        return Ok(Spec::Image(uri, Some(name)));
    }
    let ImageUri::Local { dir: path } = &uri else {
        if raw {
            bail!("--source-format raw is for files and block devices, not image {uri}");
        }
        return Ok(Spec::Image(uri, None));
    };
    let meta = std::fs::metadata(path)
        .with_context(|| format!("cannot read the source {}", path.display()))?;
    let kind = meta.file_type();
    if kind.is_dir() {
        if raw {
            bail!(
                "--source-format raw is for files and block devices; {} is a directory (an \
                 ivdisk image's local store)",
                path.display()
            );
        }
        return Ok(Spec::Image(uri, None));
    }
    if !(kind.is_file() || kind.is_block_device()) {
        bail!(
            "{} is not a regular file, block device or directory (a local ivdisk store): \
             convert reads disks whose size is known",
            path.display()
        );
    }
    if raw {
        return Ok(Spec::Raw(path.clone()));
    }
    match luks_version(path)? {
        Some(_) if kind.is_file() => Ok(Spec::Image(uri, None)),
        Some(_) => bail!(
            "{} is a block device with a LUKS header: ivdisk unlocks LUKS files, not devices; \
             open it with `cryptsetup open` and convert /dev/mapper/NAME (read as raw), or pass \
             --source-format raw to copy its ciphertext as it is",
            path.display()
        ),
        None => {
            note!(
                "ivdisk: note: {} has no LUKS header: reading it as an unencrypted raw disk \
                 (--source-format raw says so and skips this note)",
                path.display()
            );
            Ok(Spec::Raw(path.clone()))
        }
    }
}

/// A regular file or block device read as a disk: positioned reads on blocking threads, the
/// allocation map from `SEEK_DATA`/`SEEK_HOLE` (where the file system answers them), no
/// writes.
pub struct RawFile {
    file: Arc<File>,
    size: u64,
    path: PathBuf,
}

impl RawFile {
    pub fn open(path: &Path) -> Result<RawFile> {
        let mut file = File::open(path)
            .with_context(|| format!("cannot open {} for reading", path.display()))?;
        let size = source_len(path, &mut file)?;
        Ok(RawFile {
            file: Arc::new(file),
            size,
            path: path.to_owned(),
        })
    }

    fn error(&self, kind: DeviceErrorKind, what: String, e: std::io::Error) -> DeviceError {
        DeviceError::new(kind, format!("{} of {}: {e}", what, self.path.display()))
    }

    /// The data ranges of `[offset, end)` as the file system knows them; `None` where it
    /// cannot tell (then everything counts as data).
    fn data_ranges(&self, offset: u64, end: u64) -> Option<Vec<(u64, u64)>> {
        ivdisk_store::file_data_ranges(&self.file, offset, end)
    }
}

#[async_trait]
impl BlockDevice for RawFile {
    fn size(&self) -> u64 {
        self.size
    }

    fn read_only(&self) -> bool {
        true
    }

    async fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), DeviceError> {
        let file = self.file.clone();
        let len = buf.len();
        let data = tokio::task::spawn_blocking(move || {
            let mut data = vec![0u8; len];
            file.read_exact_at(&mut data, offset).map(|()| data)
        })
        .await
        .map_err(|e| DeviceError::new(DeviceErrorKind::Io, format!("a read task failed: {e}")))?
        .map_err(|e| match e.kind() {
            // Said plainly ("failed to fill whole buffer" was all there was).
            std::io::ErrorKind::UnexpectedEof => DeviceError::new(
                DeviceErrorKind::Io,
                format!(
                    "{} got shorter while it was read: it was {} bytes, it now ends before \
                     byte {}",
                    self.path.display(),
                    self.size,
                    offset + len as u64
                ),
            ),
            _ => self.error(DeviceErrorKind::Io, "reading".into(), e),
        })?;
        buf.copy_from_slice(&data);
        Ok(())
    }

    async fn write(&self, _offset: u64, _data: &[u8]) -> Result<(), DeviceError> {
        Err(DeviceError::new(
            DeviceErrorKind::ReadOnly,
            format!("{} is read-only here", self.path.display()),
        ))
    }

    async fn flush(&self) -> Result<(), DeviceError> {
        Ok(())
    }

    async fn allocation(&self, offset: u64, len: u64) -> Result<Vec<Extent>, DeviceError> {
        let end = offset + len;
        let Some(ranges) = self.data_ranges(offset, end) else {
            return Ok(vec![Extent {
                len,
                allocated: true,
            }]);
        };
        let mut extents = Vec::new();
        let mut at = offset;
        for (start, stop) in ranges {
            if start > at {
                extents.push(Extent {
                    len: start - at,
                    allocated: false,
                });
            }
            extents.push(Extent {
                len: stop - start,
                allocated: true,
            });
            at = stop;
        }
        if at < end {
            extents.push(Extent {
                len: end - at,
                allocated: false,
            });
        }
        Ok(extents)
    }
}

/// What closes the source once the copy and the verify are done.
enum Handle {
    Image(Image),
    Rbd(Arc<RbdImage>),
    Raw,
}

/// An open source.
struct Source {
    device: Arc<dyn BlockDevice>,
    handle: Handle,
    /// The passphrase that opened it (or was given for it): the new image's by default.
    secret: Option<Zeroizing<Vec<u8>>>,
    /// For --json: luks1-file, luks2-file, ivdisk, librbd-luks (rados://), rbd-luks1,
    /// rbd-luks2, rbd-plain, raw.
    kind: String,
    /// For messages.
    name: String,
}

impl Source {
    /// What it is, for humans.
    fn describe(&self) -> String {
        let what = match self.kind.as_str() {
            "luks1-file" => "LUKS1 file",
            "luks2-file" => "LUKS2 file",
            "ivdisk" => "ivdisk image",
            "librbd-luks" => "librbd LUKS image",
            "rbd-luks1" => "librbd image, LUKS1",
            "rbd-luks2" => "librbd image, LUKS2",
            "rbd-plain" => "librbd image, unencrypted",
            _ => "raw file, unencrypted",
        };
        format!("{} ({what})", self.name)
    }

    fn close(self, rt: &Runtime) -> Result<()> {
        let Source { device, handle, .. } = self;
        drop(device);
        match handle {
            Handle::Image(image) => rt.block_on(image.close()).map_err(flat),
            Handle::Rbd(image) => match Arc::try_unwrap(image) {
                Ok(image) => rt.block_on(image.close()).map_err(|e| anyhow!("{e}")),
                // A task still holds it (only after a failure): dropping closes it.
                Err(_) => Ok(()),
            },
            Handle::Raw => Ok(()),
        }
    }
}

fn open_source(rt: &Runtime, spec: &Spec, args: &ConvertArgs) -> Result<Source> {
    match spec {
        Spec::Raw(path) => {
            let file = RawFile::open(path)?;
            Ok(Source {
                device: Arc::new(file),
                handle: Handle::Raw,
                secret: None,
                kind: "raw".into(),
                name: path.display().to_string(),
            })
        }
        Spec::Image(uri, snapshot) => open_image(rt, uri, snapshot.as_deref(), &args.passphrase),
        Spec::Rbd(uri) => open_rbd(rt, uri, &args.passphrase),
    }
}

/// An ivdisk image or a LUKS file, read-only.
fn open_image(
    rt: &Runtime,
    uri: &ImageUri,
    snapshot: Option<&str>,
    passphrase: &PassphraseArgs,
) -> Result<Source> {
    // A missing image or snapshot is refused before the passphrase is asked for.
    let (image, secret) = unlock_read_only(rt, uri, snapshot, passphrase)?;
    let kind = match uri.luks_file() {
        Some(path) => match luks_version(path)? {
            Some(1) => "luks1-file",
            _ => "luks2-file",
        },
        None if image.is_foreign() => "librbd-luks",
        None => "ivdisk",
    };
    Ok(Source {
        device: Arc::new(image.clone()),
        handle: Handle::Image(image),
        secret: Some(secret),
        kind: kind.into(),
        name: crate::images::image_at(uri, snapshot),
    })
}

/// A librbd image, read-only: encryption as `encryption=` says; for `auto`, the passphrase is
/// asked for (when no file gives it) only once the image turns out to be LUKS.
fn open_rbd(rt: &Runtime, uri: &RbdUri, passphrase: &PassphraseArgs) -> Result<Source> {
    let mut secret = passphrase.read_files()?;
    if uri.encryption.needs_passphrase() && secret.is_none() {
        secret = Some(passphrase.existing()?);
    }
    let open = |secret: Option<&Zeroizing<Vec<u8>>>| {
        let encryption = uri
            .encryption
            .with_passphrase(secret.cloned())
            .expect("a passphrase is there when the encryption kind needs one");
        let options = RbdOpenOptions {
            image: uri.image.clone(),
            snapshot: uri.snapshot.clone(),
            read_only: true,
            encryption,
            exclusive: false,
        };
        with_spinner("opening (a LUKS unlock takes seconds by design)", || {
            rt.block_on(RbdImage::open(&uri.config, options))
        })
    };
    let opened = match open(secret.as_ref()) {
        Err(RbdError::PassphraseRequired { image, format }) => {
            let asked = passphrase
                .existing()
                .with_context(|| format!("rbd image {image} is {format}-encrypted (librbd)"))?;
            secret = Some(asked);
            open(secret.as_ref())
        }
        other => other,
    };
    let image = opened.map_err(|e| match &e {
        RbdError::WrongPassphrase { .. } => {
            let given = secret.as_ref().map_or(&[][..], |p| p.as_slice());
            anyhow!("{e}{}", passphrase.unlock_hint(given))
        }
        _ => anyhow!("{e}"),
    })?;
    let kind = match image.encryption() {
        Some(format) => format!("rbd-{}", format.name()),
        None => "rbd-plain".into(),
    };
    let image = Arc::new(image);
    Ok(Source {
        device: image.clone(),
        handle: Handle::Rbd(image),
        secret,
        kind,
        name: uri.to_string(),
    })
}

// ---------------------------------------------------------------------------------------------
// SRC, DST and the plan

/// Whether SRC and DST name the same image or file.
fn same_image(src: &Spec, dst: &ImageUri) -> bool {
    // Device and inode too: a bind mount of SRC is another path to the same directory.
    let same_path = |a: &Path, b: &Path| match (std::fs::metadata(a), std::fs::metadata(b)) {
        (Ok(x), Ok(y)) if x.dev() == y.dev() && x.ino() == y.ino() => true,
        _ => match (a.canonicalize(), b.canonicalize()) {
            (Ok(a), Ok(b)) => a == b,
            _ => a == b,
        },
    };
    match (src, dst) {
        (
            Spec::Rbd(rbd),
            ImageUri::Rados {
                pool,
                image,
                namespace,
                ..
            },
        ) => rbd.config.pool == *pool && rbd.image == *image && rbd.config.namespace == *namespace,
        (
            Spec::Image(
                ImageUri::Rados {
                    pool: p1,
                    image: i1,
                    namespace: n1,
                    ..
                },
                _,
            ),
            ImageUri::Rados {
                pool,
                image,
                namespace,
                ..
            },
        ) => p1 == pool && i1 == image && n1 == namespace,
        (Spec::Image(ImageUri::Memory { name: a }, _), ImageUri::Memory { name }) => a == name,
        (Spec::Image(ImageUri::Local { dir: a }, _) | Spec::Raw(a), ImageUri::Local { dir }) => {
            same_path(a, dir)
        }
        _ => false,
    }
}

/// Whether DST exists (refused unless `force`). A file in its place is always refused.
fn destination_exists(rt: &Runtime, dst: &ImageUri, force: bool) -> Result<bool> {
    if let ImageUri::Local { dir } = dst {
        if std::fs::metadata(dir).is_ok_and(|m| !m.is_dir()) {
            bail!(
                "{} exists and is not a directory: convert creates a new ivdisk image (a local \
                 store directory); pick another name (--force deletes ivdisk images, never files)",
                dir.display()
            );
        }
    }
    let exists = match rt.block_on(Image::info(dst)) {
        Ok(_) => true,
        Err(ImageError::NotFound { .. }) => false,
        // A header that does not parse is still an image in the way.
        Err(ImageError::Header { .. } | ImageError::Corrupt { .. }) => true,
        Err(e) => return Err(flat(e)),
    };
    if exists && !force {
        bail!(
            "image {dst} already exists; pass --force to delete it and convert into a new one, or \
             pick another name"
        );
    }
    Ok(exists)
}

/// A piece of the copy or the verify: within one destination chunk (so one object).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Piece {
    offset: u64,
    len: u64,
    /// Whether the source may hold data here (else it reads as zeros: not read).
    data: bool,
}

/// The source's data ranges within `[0, size)`, widened to whole `sector`s and merged. The
/// source is `source_len` bytes (at most `size`); extents missing at its end count as data.
fn data_ranges(extents: &[Extent], source_len: u64, size: u64, sector: u64) -> Vec<(u64, u64)> {
    let mut out: Vec<(u64, u64)> = Vec::new();
    let mut push = |start: u64, end: u64| {
        let start = start / sector * sector;
        let end = (end.div_ceil(sector) * sector).min(size);
        match out.last_mut() {
            Some(last) if start <= last.1 => last.1 = last.1.max(end),
            _ => out.push((start, end)),
        }
    };
    let mut at = 0;
    for extent in extents {
        let (start, end) = (at, (at + extent.len).min(source_len));
        at += extent.len;
        if extent.allocated && start < end {
            push(start, end);
        }
    }
    if at < source_len {
        push(at, source_len);
    }
    out
}

/// `[start, end)` cut at multiples of `chunk`.
fn grid(start: u64, end: u64, chunk: u64, data: bool, out: &mut Vec<Piece>) {
    let mut at = start;
    while at < end {
        let stop = ((at / chunk + 1) * chunk).min(end);
        out.push(Piece {
            offset: at,
            len: stop - at,
            data,
        });
        at = stop;
    }
}

/// `[0, size)` as pieces: data ranges cut at multiples of `chunk`; holes in one piece each
/// (the verify cuts them where it reads them, `verify_pieces`).
fn plan(data: &[(u64, u64)], size: u64, chunk: u64) -> Vec<Piece> {
    let mut out = Vec::new();
    let hole = |start: u64, end: u64, out: &mut Vec<Piece>| {
        if start < end {
            out.push(Piece {
                offset: start,
                len: end - start,
                data: false,
            });
        }
    };
    let mut at = 0;
    for &(start, end) in data {
        hole(at, start, &mut out);
        grid(start, end, chunk, true, &mut out);
        at = end;
    }
    hole(at, size, &mut out);
    out
}

/// What the verify reads, as (piece, skipped): the source's data pieces as planned; its holes
/// cut at `chunk` where the copy has data objects, and where it has none (`unbacked`: they
/// read as zeros) one skipped piece each. Lazily, hole by hole: cut up front, the holes of a
/// sparse source of 2^63 bytes were 2^41 pieces (48 TiB of plan) before any was skipped.
fn verify_pieces(
    pieces: Vec<Piece>,
    unbacked: Vec<(u64, u64)>,
    chunk: u64,
) -> impl Iterator<Item = (Piece, bool)> {
    pieces.into_iter().flat_map(move |piece| {
        if piece.data {
            return vec![(piece, false)];
        }
        let (mut out, mut cut) = (Vec::new(), Vec::new());
        let end = piece.offset + piece.len;
        let mut at = piece.offset;
        let mut next = unbacked.partition_point(|&(_, e)| e <= at);
        while at < end {
            match unbacked.get(next) {
                Some(&(start, stop)) if start <= at => {
                    let stop = stop.min(end);
                    let len = stop - at;
                    out.push((
                        Piece {
                            offset: at,
                            len,
                            data: false,
                        },
                        true,
                    ));
                    at = stop;
                    next += 1;
                }
                following => {
                    let stop = following.map_or(end, |&(start, _)| start.min(end));
                    grid(at, stop, chunk, false, &mut cut);
                    out.extend(cut.drain(..).map(|p| (p, false)));
                    at = stop;
                }
            }
        }
        out
    })
}

fn device_error(e: DeviceError) -> anyhow::Error {
    anyhow!("{}", e.message)
}

/// Read `[offset, offset + buf.len())` of the source; past its end, zeros.
async fn read_source(
    source: &dyn BlockDevice,
    offset: u64,
    buf: &mut [u8],
    name: &str,
) -> Result<()> {
    let end = (offset + buf.len() as u64).min(source.size());
    if end > offset {
        let n = (end - offset) as usize;
        source
            .read(offset, &mut buf[..n])
            .await
            .map_err(device_error)
            .with_context(|| format!("reading bytes [{offset}, +{n}) of {name}"))?;
    }
    Ok(())
}

// ---------------------------------------------------------------------------------------------
// Copy and verify

/// Bytes written and skipped (holes and all-zero sectors).
#[derive(Debug, Default, Clone, Copy)]
struct Copied {
    written: u64,
    skipped: u64,
}

/// Copy the source's data pieces into `image`. On an error, the pieces in flight finish
/// first, so nothing writes to the image any more when it returns.
async fn copy(
    source: &Arc<dyn BlockDevice>,
    name: &str,
    image: &Image,
    pieces: Vec<Piece>,
    bar: &ProgressBar,
) -> Result<Copied> {
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = stream::iter(pieces)
        .take_while(|_| std::future::ready(!stop.load(Ordering::Relaxed) && !interrupted()))
        .map(|piece| {
            let (source, image, name) = (source.clone(), image.clone(), name.to_owned());
            tokio::spawn(async move {
                if !piece.data {
                    return anyhow::Ok((piece.len, 0));
                }
                let mut buf = vec![0u8; piece.len as usize];
                read_source(source.as_ref(), piece.offset, &mut buf, &name).await?;
                let written = write_data_runs(&image, piece.offset, buf).await?;
                Ok((piece.len, written))
            })
        })
        .buffer_unordered(IN_FLIGHT);
    let mut copied = Copied::default();
    let mut error = None;
    while let Some(done) = tasks.next().await {
        match done.context("a copy task failed").and_then(|r| r) {
            Ok((n, written)) => {
                bar.inc(n);
                copied.written += written;
                copied.skipped += n - written;
            }
            Err(e) => {
                stop.store(true, Ordering::Relaxed);
                error.get_or_insert(e);
            }
        }
    }
    match error {
        Some(e) => Err(e),
        None if interrupted() => Err(interrupted_error()),
        None => Ok(copied),
    }
}

/// Read every byte of `image` back and compare it with the source (read again where it may
/// hold data, zeros elsewhere). `Ok(None)`: identical; `Ok(Some(offset))`: the first byte
/// that differs.
async fn verify(
    source: &Arc<dyn BlockDevice>,
    name: &str,
    image: &Image,
    pieces: Vec<Piece>,
    chunk: u64,
    bar: &ProgressBar,
) -> Result<Option<u64>> {
    let stop = Arc::new(AtomicBool::new(false));
    // Where the copy has no data object at all it reads as zeros without reading anything:
    // those parts of the source's holes are not read back (they were a minute per 64 GiB of
    // holes), the rest of them are.
    let unbacked: Vec<(u64, u64)> = image
        .allocation(0, image.size())
        .await
        .map_err(flat)?
        .into_iter()
        .filter(|e| !e.allocated)
        .map(|e| (e.offset, e.offset + e.len))
        .collect();
    // In order (`buffered`): the first difference met is the first in the image.
    let mut tasks = stream::iter(verify_pieces(pieces, unbacked, chunk))
        .take_while(|_| std::future::ready(!stop.load(Ordering::Relaxed) && !interrupted()))
        .map(|(piece, skipped)| {
            let (source, image, name) = (source.clone(), image.clone(), name.to_owned());
            tokio::spawn(async move {
                if skipped {
                    return anyhow::Ok((piece.len, None));
                }
                let n = piece.len as usize;
                let mut copy = vec![0u8; n];
                image
                    .read(piece.offset, &mut copy)
                    .await
                    .map_err(flat)
                    .with_context(|| {
                        format!("reading back bytes [{}, +{n}) of the copy", piece.offset)
                    })?;
                let differs = if piece.data {
                    let mut original = vec![0u8; n];
                    read_source(source.as_ref(), piece.offset, &mut original, &name).await?;
                    copy.iter().zip(&original).position(|(a, b)| a != b)
                } else if all_zero(&copy) {
                    None
                } else {
                    copy.iter().position(|&b| b != 0)
                };
                anyhow::Ok((piece.len, differs.map(|at| piece.offset + at as u64)))
            })
        })
        .buffered(IN_FLIGHT);
    while let Some(done) = tasks.next().await {
        let result = done.context("a verify task failed").and_then(|r| r);
        match result {
            Ok((n, None)) => bar.inc(n),
            Ok((_, Some(at))) => {
                stop.store(true, Ordering::Relaxed);
                while tasks.next().await.is_some() {}
                return Ok(Some(at));
            }
            Err(e) => {
                stop.store(true, Ordering::Relaxed);
                while tasks.next().await.is_some() {}
                return Err(e);
            }
        }
    }
    if interrupted() {
        return Err(interrupted_error());
    }
    Ok(None)
}

// ---------------------------------------------------------------------------------------------
// The command

/// The new image's passphrase: --new-passphrase-file/--new-key-file; else the source's; else
/// --passphrase-file/--key-file; else asked twice on the terminal.
fn new_secret(args: &ConvertArgs, source: &mut Source) -> Result<Zeroizing<Vec<u8>>> {
    if args.new.given() {
        return args.new.read();
    }
    if let Some(secret) = source.secret.take() {
        return Ok(secret);
    }
    match args.passphrase.read_files()? {
        Some(secret) => Ok(secret),
        None => prompt_twice(&format!(
            "{} is not encrypted, so the new image needs a passphrase of its own: pass \
             --new-passphrase-file FILE (or --passphrase-file FILE), or run on a terminal",
            source.name
        )),
    }
}

pub fn convert(args: ConvertArgs, rt: &Runtime) -> Result<()> {
    let dst = parse_uri(&args.destination)?;
    let spec = classify(&args.source, args.source_format)?;
    if same_image(&spec, &dst) {
        bail!(
            "SRC {} and DST {dst} are the same image: convert writes a NEW image; pick another \
             name for DST",
            args.source
        );
    }
    // A file of DST's store as SRC: `--force` deleted DST, and the file with it, then
    // copied and "verified" the zeros left of it.
    if let Spec::Raw(path) | Spec::Image(ImageUri::Local { dir: path }, _) = &spec {
        crate::transfer::refuse_target_in_image(
            &dst,
            &dst.to_string(),
            path,
            "convert replaces DST, and SRC would go with it",
        )?;
    }
    crate::transfer::refuse_inside_another_store(&dst)?;
    // The options are checked (with a one-sector size) before any passphrase is asked for.
    let sector = u64::from(args.format.sector_size);
    args.format.options(&dst, sector)?;
    args.new.check_against(&args.passphrase)?;
    let replace = destination_exists(rt, &dst, args.force)?;

    let mut source = open_source(rt, &spec, &args).map_err(|e| {
        e.context(format!(
            "cannot open SRC {}; DST {dst} was not created",
            args.source
        ))
    })?;
    let result = convert_open(&args, rt, &dst, &mut source, replace);
    let closed = source.close(rt);
    let report = result?;
    closed?;
    outln!("{report}");
    Ok(())
}

/// The conversion once the source is open; returns what to print.
fn convert_open(
    args: &ConvertArgs,
    rt: &Runtime,
    dst: &ImageUri,
    source: &mut Source,
    replace: bool,
) -> Result<String> {
    let source_len = source.device.size();
    if source_len == 0 {
        bail!(
            "{} is empty: an image needs at least one sector",
            source.name
        );
    }
    let sector = u64::from(args.format.sector_size);
    let size = source_len.div_ceil(sector) * sector;
    let options = args.format.options(dst, size)?;
    let secret = new_secret(args, source)?;
    if size != source_len {
        note!(
            "ivdisk: note: {} is {source_len} bytes, not a multiple of the {sector}-byte sector \
             size: image {dst} is {size} bytes, rounded up, and its last {} byte(s) read as zeros",
            source.name,
            size - source_len
        );
    }
    let extents = rt
        .block_on(source.device.allocation(0, source_len))
        .map_err(device_error)
        .with_context(|| format!("reading the allocation map of {}", source.name))?;
    // Before the existing DST is deleted: a signal then lets the deletion finish (cut short,
    // it left the old DST openable with zeros where objects were gone) and stops after it.
    stop_copies_on_signals(rt)?;
    if replace {
        with_spinner("deleting the existing DST (--force)", || {
            rt.block_on(Image::delete(dst, |_, _| {}))
        })
        .map_err(|e| match e {
            ImageError::NotFound { .. } => anyhow!(
                "{dst} is in the way but is not an ivdisk image (a librbd image?): `ivdisk \
                 delete` cannot remove it; remove it with the tool that made it, or pick another \
                 name"
            ),
            e => flat(e),
        })
        .context("--force: deleting the existing DST failed")?;
        if interrupted() {
            bail!(
                "{}: the existing {dst} was deleted (--force), nothing was made",
                interrupted_error()
            );
        }
    }
    let made_dir = store_dir_to_make(dst);
    // A signal from here on deletes the image made below again.
    let image = with_spinner(
        "creating (the key derivation benchmark takes seconds by design)",
        || {
            rt.block_on(Image::create_to_fill(
                dst,
                &options,
                &secret,
                &format!("a conversion from {}", source.name),
            ))
        },
    )
    .map_err(|e| crate::images::create_failed(dst, made_dir.as_deref(), e))?;
    drop(secret);

    let chunk = chunk_size(&image);
    let data = data_ranges(&extents, source_len, size, sector);
    let started = Instant::now();
    let bar = progress(size, "converting", args.json);
    let copied = rt.block_on(copy(
        &source.device,
        &source.name,
        &image,
        plan(&data, size, chunk),
        &bar,
    ));
    bar.finish_and_clear();
    let checked = copied.and_then(|copied| {
        rt.block_on(image.flush()).map_err(flat)?;
        let bar = progress(size, "verifying", args.json);
        let verified = rt.block_on(verify(
            &source.device,
            &source.name,
            &image,
            plan(&data, size, chunk),
            chunk,
            &bar,
        ));
        bar.finish_and_clear();
        match verified? {
            None => {
                // Only now does the image open (a conversion killed before this leaves one
                // that says it is incomplete).
                rt.block_on(image.mark_filled()).map_err(flat)?;
                Ok(copied)
            }
            Some(at) => Err(anyhow!(
                "verification failed: {dst} differs from {} at byte offset {at} (the first \
                 difference; was the source changed during the copy?)",
                source.name
            )),
        }
    });
    // Closing flushes and releases the writer lock, which a delete takes.
    let closed = rt.block_on(image.close()).map_err(flat);
    let copied = match checked.and_then(|c| closed.map(|()| c)) {
        Ok(copied) => copied,
        Err(e) => {
            return Err(delete_half_made(
                rt,
                dst,
                made_dir.as_deref(),
                e,
                &format!("converting {} into {dst}", source.name),
            ))
        }
    };
    let seconds = started.elapsed().as_secs_f64();
    Ok(if args.json {
        json!({
            "source": source.name, "source_kind": source.kind, "destination": dst.to_string(),
            "size": size, "source_size": source_len, "bytes_written": copied.written,
            "bytes_skipped": copied.skipped, "verified": true, "seconds": seconds,
            "cipher": options.suite.name(),
            "layout": options.layout.map(|l| l.name()),
        })
        .to_string()
    } else {
        format!(
            "converted {} into image {dst} ({}, {}, layout {}) in {seconds:.1} s: {} written, {} \
             of holes and zeros skipped; verified: every byte reads back as in the source{}",
            source.describe(),
            exact_size(size),
            options.suite,
            options.layout.map_or("?", |l| l.name()),
            human_size(copied.written),
            human_size(copied.skipped),
            crate::images::fleeting_note(dst),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn extent(len: u64, allocated: bool) -> Extent {
        Extent { len, allocated }
    }

    #[test]
    fn data_ranges_widen_to_sectors_merge_and_clip() {
        // 10000 bytes: data at [100, 200) and [4200, 5000), a hole, data [9000, 10000).
        let extents = [
            extent(100, false),
            extent(100, true),
            extent(4000, false),
            extent(800, true),
            extent(4000, false),
            extent(1000, true),
        ];
        let size = 12288;
        // Widened to 4096-byte sectors the three touch: one range, up to the rounded size.
        assert_eq!(data_ranges(&extents, 10000, size, 4096), vec![(0, 12288)]);
        assert_eq!(
            data_ranges(&extents, 10000, size, 512),
            vec![(0, 512), (4096, 5120), (8704, 10240)]
        );
        // Extents that stop short of the end: the rest counts as data.
        assert_eq!(
            data_ranges(&[extent(512, false)], 2048, 2048, 512),
            vec![(512, 2048)]
        );
        assert!(data_ranges(&[extent(2048, false)], 2048, 2048, 512).is_empty());
    }

    #[test]
    fn plans_cover_the_image_and_stay_within_chunks() {
        let data = [(4096, 20480), (40960, 45056)];
        let size = 65536;
        {
            let pieces = plan(&data, size, 8192);
            let mut at = 0;
            for piece in &pieces {
                assert_eq!(piece.offset, at, "{pieces:?}");
                if piece.data {
                    assert_eq!(
                        piece.offset / 8192,
                        (piece.offset + piece.len - 1) / 8192,
                        "{piece:?} crosses a chunk"
                    );
                }
                let in_data = data
                    .iter()
                    .any(|&(s, e)| piece.offset >= s && piece.offset + piece.len <= e);
                assert_eq!(piece.data, in_data, "{piece:?}");
                at += piece.len;
            }
            assert_eq!(at, size);
        }
        assert_eq!(
            plan(&data, size, 8192)[0],
            Piece {
                offset: 0,
                len: 4096,
                data: false
            }
        );
        assert_eq!(plan(&[], 8192, 4096).len(), 1);
    }

    /// The verify's pieces cover the image in order; a hole is cut at the chunk size only
    /// where the copy has data objects, and skipped whole where it has none; data pieces
    /// stay as planned. The largest sparse image, with a little data, makes a handful of
    /// pieces: cut up front, its holes were 2^41 pieces (48 TiB of plan) and the verify ran
    /// out of memory after the copy was made.
    #[test]
    fn verify_pieces_cut_only_what_the_copy_backs() {
        let size = (i64::MAX as u64) / 4096 * 4096;
        let chunk = 4 << 20;
        let data = [(8 << 20, 9 << 20), (size - 4096, size)];
        // The copy has objects 2 (the data) and 5, and the last one.
        let last = size / chunk * chunk;
        let unbacked = vec![(0, 8 << 20), (12 << 20, 20 << 20), (24 << 20, last)];
        let pieces: Vec<_> =
            verify_pieces(plan(&data, size, chunk), unbacked.clone(), chunk).collect();
        assert!(pieces.len() < 16, "{} pieces", pieces.len());
        let mut at = 0;
        for (piece, skipped) in &pieces {
            assert_eq!(piece.offset, at, "{pieces:?}");
            let end = piece.offset + piece.len;
            let within_unbacked = unbacked.iter().any(|&(s, e)| s <= piece.offset && end <= e);
            assert_eq!(*skipped, !piece.data && within_unbacked, "{piece:?}");
            if !skipped {
                assert_eq!(
                    piece.offset / chunk,
                    (end - 1) / chunk,
                    "{piece:?} crosses a chunk"
                );
            }
            at = end;
        }
        assert_eq!(at, size);
    }

    #[test]
    fn raw_files_report_their_data_and_read_zeros_in_holes() {
        let rt = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("sparse.raw");
        let file = File::create(&path).unwrap();
        file.set_len(8 << 20).unwrap();
        file.write_all_at(&[7u8; 4096], 5 << 20).unwrap();
        drop(file);
        let raw = RawFile::open(&path).unwrap();
        assert_eq!(raw.size(), 8 << 20);
        let extents = rt.block_on(raw.allocation(0, 8 << 20)).unwrap();
        assert_eq!(extents.iter().map(|e| e.len).sum::<u64>(), 8 << 20);
        // The written block is data whatever the file system says about holes.
        let mut at = 0;
        let mut covered = false;
        for e in &extents {
            if e.allocated && at <= 5 << 20 && at + e.len >= (5 << 20) + 4096 {
                covered = true;
            }
            at += e.len;
        }
        assert!(covered, "{extents:?}");
        let mut buf = vec![1u8; 8192];
        rt.block_on(raw.read((5 << 20) - 4096, &mut buf)).unwrap();
        assert!(buf[..4096].iter().all(|&b| b == 0));
        assert!(buf[4096..].iter().all(|&b| b == 7));
        assert!(rt.block_on(raw.write(0, &[0])).is_err());
        // Reading past the end fails, naming the file.
        let err = rt.block_on(raw.read(8 << 20, &mut buf)).unwrap_err();
        assert!(err.message.contains("sparse.raw"), "{}", err.message);
    }

    #[test]
    fn verify_names_the_first_difference_also_in_holes() {
        use ivdisk_header::{PbkdfKind, PbkdfRequest};
        use ivdisk_image::CreateOptions;

        let rt = tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("src.raw");
        let size: u64 = 1 << 20;
        let mut bytes = vec![0u8; size as usize];
        bytes[70_000..200_000].fill(0x5a);
        std::fs::write(&path, &bytes).unwrap();
        let source: Arc<dyn BlockDevice> = Arc::new(RawFile::open(&path).unwrap());
        let uri = ImageUri::parse("mem:convert-verify").unwrap();
        let mut options = CreateOptions::new(size);
        options.object_size = 64 << 10;
        options.pbkdf = PbkdfRequest::fast_for_tests(PbkdfKind::Pbkdf2);
        let image = rt.block_on(Image::create(&uri, &options, b"pw")).unwrap();
        let extents = rt.block_on(source.allocation(0, size)).unwrap();
        let data = data_ranges(&extents, size, size, 4096);
        let chunk = chunk_size(&image);
        let hidden = ProgressBar::hidden();
        let copied = rt
            .block_on(copy(
                &source,
                "src",
                &image,
                plan(&data, size, chunk),
                &hidden,
            ))
            .unwrap();
        assert_eq!(copied.written + copied.skipped, size);
        assert!(
            copied.written >= 130_000 && copied.written < size,
            "{copied:?}"
        );
        let check = |image: &Image| {
            rt.block_on(verify(
                &source,
                "src",
                image,
                plan(&data, size, chunk),
                chunk,
                &hidden,
            ))
            .unwrap()
        };
        assert_eq!(check(&image), None);
        // A changed byte where the source has data, and one where it has none (read from
        // the copy only): the first is named.
        rt.block_on(image.write(150_001, &[1])).unwrap();
        rt.block_on(image.write(900_000, &[1])).unwrap();
        assert_eq!(check(&image), Some(150_001));
        rt.block_on(image.write(150_001, &[0x5a])).unwrap();
        assert_eq!(check(&image), Some(900_000));
        rt.block_on(image.close()).unwrap();
    }

    #[test]
    fn help_has_examples() {
        let help = after_help();
        assert!(help.contains("Examples:") && help.contains("ivdisk convert"));
    }
}
