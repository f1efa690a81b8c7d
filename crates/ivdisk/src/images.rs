//! `ivdisk create`, `info`, `resize`, `delete` and `lock`: images on any store, through
//! `ivdisk-image`. Each command is synchronous code that prompts and prints, and hands the
//! store work to the one tokio runtime `main` builds for it.
//!
//! Options are checked, and the image looked up, before a passphrase is asked for, so that a
//! typo never costs a passphrase entry (or two).

use std::cell::Cell;
use std::io::IsTerminal;

use anyhow::{bail, Result};
use clap::{Args, Subcommand};
use ivdisk_crypto::Suite;
use ivdisk_image::{
    BrokenLock, CreateOptions, Fencing, Image, ImageError, ImageInfo, ImageUri, LayoutKind,
    OpenOptions, DEFAULT_LOCK_DURATION, MAX_OBJECT_SIZE,
};
use ivdisk_rbd::{RbdImage, RbdUri};
use ivdisk_store::{Locker, StoreError};
use serde_json::{json, Value};
use tokio::runtime::Runtime;

use crate::secrets::{confirm, print, with_spinner, PassphraseArgs, PbkdfArgs};

/// What IMAGE may be, for `--help`.
pub const IMAGE_HELP: &str = "The image: PATH or file:PATH (local backend: a directory holding \
    one image), rados://POOL/IMAGE?conf=PATH&id=CLIENT&namespace=NS (Ceph), mem:NAME (this \
    process' memory; only useful in tests)";

/// What IMAGE may be for the commands that also take librbd images (`serve`, `info`).
pub fn image_or_rbd_help() -> String {
    format!(
        "{IMAGE_HELP}; or rbd://POOL/IMAGE[@SNAP]?conf=PATH&id=CLIENT&keyring=PATH&namespace=NS&\
         encryption=auto|none|luks1|luks2 (a librbd image, plain or with librbd's LUKS \
         encryption, through librbd)"
    )
}

/// Layouts for `ivdisk create --help`.
pub fn layouts_help() -> String {
    let mut text = String::from(
        "Layouts (--layout: where each sector's IV/MAC lives; default omap-packed for suites with \
         metadata, none for the others):\n",
    );
    for layout in LayoutKind::ALL {
        text.push_str(&format!("  {:<18} {}\n", layout.name(), layout.summary()));
    }
    text
}

/// Help of `ivdisk lock`: when to break a lock.
pub fn lock_help() -> String {
    format!(
        "Opening an image for writing (ivdisk serve, resize, restore...) takes its writer \
         lock: one writer per image. The writer renews the lock while it runs; a lock that is not \
         renewed expires by itself after {} s. `lock break` is for a writer that died (killed, \
         crashed, host down) when you cannot wait for the expiry.\n\nOn RADOS, `lock break` \
         first fences the holder, as librbd does when it breaks a lock: it blocklists that \
         client on the cluster (for an hour), so a writer that only seemed dead (hung, or cut \
         off by the network) cannot write beside the next one; its IO fails instead. That needs \
         the monitor capability `osd blocklist` (`profile rbd` grants it); without it the \
         break is refused, and `--no-fence` breaks without fencing. Never break without \
         fencing the lock of a writer that still runs: two writers lose each other's \
         writes. A writer that opens an image whose lock holder does not answer within 5 s and \
         is gone (its process on this host ended, or the OSDs dropped its watch: about 30 s \
         after it was killed, paused or cut off elsewhere) fences that holder the same way and \
         takes its lock, without waiting for the expiry; so does one that takes a lock which \
         expired without its holder closing. A holder that does not answer but still watches \
         (paused or overloaded for a moment) keeps its lock, as librbd leaves it.\n\nOn the local backend \
         a store directory is open for writing in one process at a time: while a writer runs \
         there, `lock break` and other writers fail, naming the process that has the store \
         open; `lock status` and `info` work beside it, and `lock status` says when the \
         holder is gone (no process has the store open for writing). The next writer \
         of a local image takes over a lock left by a dead process at once (with a warning \
         naming it): no process but itself has the store open for writing, so no break is \
         needed there.\n\nExample:\n  ivdisk lock \
         status disk.ivd\n  ivdisk lock break 'rados://rbd/vm1?id=admin' --yes",
        DEFAULT_LOCK_DURATION.as_secs()
    )
}

fn parse_size_arg(text: &str) -> Result<u64, String> {
    crate::parse_size(text).map_err(|e| format!("{e:#}"))
}

fn parse_sector_size(text: &str) -> Result<u32, String> {
    match text {
        "4096" => Ok(4096),
        "512" => Ok(512),
        _ => Err(format!("{text}: expected 4096 or 512")),
    }
}

fn parse_suite(text: &str) -> Result<Suite, String> {
    text.parse()
        .map_err(|e: ivdisk_crypto::CryptoError| e.to_string())
}

/// What a new image is made of: the options `create` and `import` share.
#[derive(Args)]
pub struct FormatArgs {
    /// Cipher suite (below).
    #[arg(long, default_value = Suite::DEFAULT.name(), value_parser = parse_suite)]
    cipher: Suite,
    /// Where per-sector metadata lives (below); default omap-packed, or none for suites
    /// without metadata.
    #[arg(long, value_parser = |s: &str| s.parse::<LayoutKind>())]
    layout: Option<LayoutKind>,
    /// Sector size in bytes: 4096 or 512.
    #[arg(long, default_value = "4096", value_parser = parse_sector_size)]
    pub sector_size: u32,
    /// Data bytes per object: a power of two from 4K to 64M.
    #[arg(long, default_value = "4M", value_parser = parse_size_arg)]
    object_size: u64,
    #[command(flatten)]
    pbkdf: PbkdfArgs,
}

impl FormatArgs {
    /// The options of a new image of `size` bytes, checked as `Image::create` checks them:
    /// here, before the passphrase is asked for, so that a typo never costs a passphrase
    /// entry (or two).
    pub fn options(&self, uri: &ImageUri, size: u64) -> Result<CreateOptions> {
        let suite = self.cipher;
        let layout = self
            .layout
            .unwrap_or_else(|| LayoutKind::default_for(suite.metadata_len()));
        if !layout.fits(suite.metadata_len()) {
            bail!(
                "image {uri}: layout {layout} does not fit suite {suite} ({} bytes of metadata per \
                 sector): use {}",
                suite.metadata_len(),
                if suite.metadata_len() == 0 {
                    "--layout none (or leave --layout out)".to_owned()
                } else {
                    format!(
                        "--layout {} (or leave --layout out)",
                        LayoutKind::with_metadata_names()
                    )
                }
            );
        }
        let os = self.object_size;
        if !os.is_power_of_two() || !(4096..=MAX_OBJECT_SIZE).contains(&os) {
            bail!("--object-size {os}: expected a power of two from 4K to 64M");
        }
        if size == 0 || !size.is_multiple_of(u64::from(self.sector_size)) {
            bail!(
                "--size {size}: expected a positive multiple of the {}-byte sector size",
                self.sector_size
            );
        }
        let mut options = CreateOptions::new(size);
        options.suite = suite;
        options.layout = Some(layout);
        options.sector_size = self.sector_size;
        options.object_size = os;
        options.pbkdf = self.pbkdf.request()?;
        Ok(options)
    }
}

/// Refuse an image that exists, before asking for a passphrase.
/// A file holding a LUKS volume, or an image whose header does not read, is not one `ivdisk
/// delete` removes: the refusal suggests no delete then (it sent users to a command that
/// refused, about an encrypted volume they may well need).
pub fn refuse_existing(rt: &Runtime, uri: &ImageUri) -> Result<()> {
    crate::transfer::refuse_inside_another_store(uri)?;
    match rt.block_on(Image::info(uri)) {
        Ok(_) if uri.luks_file().is_some() => bail!(
            "{uri} is a LUKS volume (a file another tool made, such as cryptsetup), not a place \
             for a new image; pick a path that does not exist yet; nothing was created"
        ),
        Ok(_) => Err(flat(ImageError::Exists {
            image: uri.to_string(),
        })),
        Err(ImageError::NotFound { .. }) => Ok(()),
        // A header object that does not parse is still an image in the way.
        Err(e @ (ImageError::Header { .. } | ImageError::Corrupt { .. })) => bail!(
            "image {uri} already exists, but its header does not read ({}); pick another name, \
             or restore its header from a backup (`ivdisk header restore {} FILE`); nothing \
             was created",
            flat(e),
            ivdisk_image::shell_word(&uri.to_string())
        ),
        Err(e) => Err(flat(e)),
    }
}

#[derive(Args)]
pub struct CreateArgs {
    #[arg(help = IMAGE_HELP)]
    image: String,
    /// Size, e.g. 10G, 512M (binary units K, M, G, T, P, E); a multiple of the sector size,
    /// below 8E (NBD clients hold sizes as signed 64-bit numbers).
    #[arg(long, value_parser = parse_size_arg, allow_hyphen_values = true)]
    size: u64,
    #[command(flatten)]
    format: FormatArgs,
    #[command(flatten)]
    passphrase: PassphraseArgs,
    /// Print JSON: what was made, as `ivdisk info --json` names it (image, size, cipher,
    /// layout, sector_size, object_size, image_id, keyslots, snapshots).
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct InfoArgs {
    #[arg(help = image_or_rbd_help())]
    image: String,
    /// Print JSON: size, cipher, layout, sector_size, object_size, keyslots, image_id, lock
    /// (rbd://: size, raw_size, encryption, cipher, sector_size, data_offset, keyslots).
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct ResizeArgs {
    #[arg(help = IMAGE_HELP)]
    image: String,
    /// The new size, e.g. 20G; a multiple of the sector size.
    #[arg(long, value_parser = parse_size_arg, allow_hyphen_values = true)]
    size: u64,
    /// Allow a smaller size: the data past the new end is destroyed.
    #[arg(long)]
    allow_shrink: bool,
    #[command(flatten)]
    passphrase: PassphraseArgs,
    /// Print JSON: image, old_size, size.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct DeleteArgs {
    #[arg(help = IMAGE_HELP)]
    image: String,
    /// Do not ask for confirmation (needed when standard input is not a terminal).
    #[arg(long, short = 'y')]
    yes: bool,
    /// Print JSON; no progress bar.
    #[arg(long)]
    json: bool,
}

#[derive(Subcommand)]
pub enum LockCommand {
    /// Show who holds the image's writer lock, and for how long without renewal.
    #[command(
        after_help = "Example:\n  ivdisk lock status disk.ivd\n  ivdisk lock status rados://rbd/vm1 --json | jq .lock"
    )]
    Status {
        #[arg(help = IMAGE_HELP)]
        image: String,
        /// Print JSON: image, lock (null, or client, address (RADOS, else null),
        /// description, expires_in_secs, and holder_gone for a local store).
        #[arg(long)]
        json: bool,
    },
    /// Remove the writer lock of a writer that died, at once instead of waiting for its expiry.
    #[command(after_help = lock_help())]
    Break {
        #[arg(help = IMAGE_HELP)]
        image: String,
        /// Do not ask for confirmation (needed when standard input is not a terminal).
        #[arg(long, short = 'y')]
        yes: bool,
        /// Break without fencing the holder first (on RADOS: without blocklisting its
        /// client). Only for a writer you know is stopped, when your cephx user may not
        /// blocklist clients.
        #[arg(long)]
        no_fence: bool,
        /// Print JSON: image, broken (null, or the lock removed), fenced_at (null, or the
        /// address of the holder's client now on the cluster's blocklist).
        #[arg(long)]
        json: bool,
    },
}

/// An ImageError as a one-line anyhow error: its message already holds its sources, so
/// anyhow's `{:#}` must not print them a second time.
pub fn flat(e: ImageError) -> anyhow::Error {
    anyhow::anyhow!("{e}")
}

/// [`flat`] for a failed `Image::create`: a refusal because another process holds the new
/// image's store says what that process most likely does, as the image was not there a
/// moment before: it creates the same image.
/// `e`, from creating the image `uri`, after removing `made_dir`, the local store directory
/// the command made for it ([`crate::transfer::store_dir_to_make`]; not if another process's
/// image took it meanwhile): a create that failed (a full disk) leaves nothing behind.
pub(crate) fn create_failed(
    uri: &ImageUri,
    made_dir: Option<&std::path::Path>,
    e: ImageError,
) -> anyhow::Error {
    match crate::transfer::remove_made_dir(crate::transfer::made_dir_unless_taken(made_dir, &e)) {
        removed if removed.is_empty() => flat_create(e),
        removed => flat_create(e).context(format!("creating {uri} failed{removed}")),
    }
}

pub fn flat_create(e: ImageError) -> anyhow::Error {
    match &e {
        ImageError::Store {
            image,
            source: ivdisk_store::StoreError::AlreadyOpen { pid, .. },
        } => anyhow::anyhow!(
            "image {image}: process {pid} is creating it too (or has just created it and holds \
             it open); this command made nothing"
        ),
        _ => flat(e),
    }
}

pub fn parse_uri(text: &str) -> Result<ImageUri> {
    ImageUri::parse(text).map_err(|e| {
        // `IMAGE@SNAP` where only an image goes (delete, resize, ...): say so, rather than
        // that image names hold no '@'.
        match ImageUri::parse_with_snapshot(text) {
            Ok((image, Some(snap))) => anyhow::anyhow!(
                "`{text}` names snapshot `{snap}` of image {image}, and this command takes an \
                 image; snapshots are removed with `ivdisk snap rm {}`, read with `serve`, \
                 `export`, `verify`, `backup` or `convert`",
                ivdisk_image::shell_word(text)
            ),
            _ => flat(e),
        }
    })
}

/// `IMAGE` or `IMAGE@SNAP` (commands that only read accept a snapshot).
pub fn parse_image_at(text: &str) -> Result<(ImageUri, Option<String>)> {
    ImageUri::parse_with_snapshot(text).map_err(flat)
}

/// `IMAGE` or `IMAGE@SNAP`: what a command reads, as its messages name it.
pub fn image_at(uri: &ImageUri, snapshot: Option<&str>) -> String {
    match snapshot {
        Some(name) => uri.at_snapshot(name),
        None => uri.to_string(),
    }
}

/// The image's header, without a passphrase.
pub fn info_of(rt: &Runtime, uri: &ImageUri) -> Result<ImageInfo> {
    rt.block_on(Image::info(uri)).map_err(flat)
}

/// [`info_of`], refused if `snapshot` (if any) is not one of the image's: what commands
/// check before they ask for a passphrase.
pub(crate) fn info_at(rt: &Runtime, uri: &ImageUri, snapshot: Option<&str>) -> Result<ImageInfo> {
    let info = info_of(rt, uri)?;
    if let Some(name) = snapshot {
        if !info.snapshots.iter().any(|s| s.name == name) {
            return Err(flat(ImageError::SnapshotNotFound {
                image: uri.to_string(),
                snapshot: name.to_owned(),
            }));
        }
    }
    Ok(info)
}

const SIZE_UNITS: [&str; 7] = ["bytes", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"];

/// An amount, rounded: 1073741824 → "1 GiB", 1536 → "1.5 KiB" (for what is measured, such
/// as disk usage or bytes copied; sizes a user gives are written with [`exact_size`]).
pub fn human_size(bytes: u64) -> String {
    let mut unit = 0;
    while unit + 1 < SIZE_UNITS.len() && bytes >= 1 << (10 * (unit + 1)) {
        unit += 1;
    }
    if unit == 0 {
        return format!("{bytes} bytes");
    }
    let scale = 1u64 << (10 * unit);
    if bytes.is_multiple_of(scale) {
        format!("{} {}", bytes / scale, SIZE_UNITS[unit])
    } else {
        let text = format!("{:.2}", bytes as f64 / scale as f64);
        format!(
            "{} {}",
            text.trim_end_matches('0').trim_end_matches('.'),
            SIZE_UNITS[unit]
        )
    }
}

/// A size as given, in the largest binary unit that holds it whole: 12289 KiB stays
/// "12289 KiB" (rounded, "12 MiB" would hide the odd KiB), 7 << 60 is "7 EiB".
pub fn exact_size(bytes: u64) -> String {
    let unit = (1..SIZE_UNITS.len())
        .rev()
        .find(|&unit| bytes != 0 && bytes.is_multiple_of(1 << (10 * unit)))
        .unwrap_or(0);
    format!("{} {}", bytes >> (10 * unit), SIZE_UNITS[unit])
}

fn locker_json(locker: &Locker) -> Value {
    json!({
        "client": locker.client,
        "address": locker.address,
        "description": locker.description,
        "expires_in_secs": locker.expires_in.map(|d| d.as_secs()),
    })
}

/// The writer lock as `info` and `lock status` show it: JSON (with `holder_gone` for a local
/// store, whose one writing process is known) and text.
fn lock_report(uri: &ImageUri, holder: Option<&Locker>) -> Result<(Value, String)> {
    let Some(holder) = holder else {
        // No current lock record, yet a local store's writer may still have it open: one
        // that stopped renewing its lock (paused, hung) keeps every other writer out for as
        // long as it runs, which "none" would hide.
        if let ImageUri::Local { dir } = uri {
            if let Ok(Some(pid)) = ivdisk_store::LocalStore::writing_process(dir) {
                let description = format!(
                    "process {pid} has the store open for writing but holds no current lock \
                     record: it is starting, or it stopped renewing its lock (paused, hung, \
                     overloaded); other writers are refused while it runs"
                );
                let json = json!({
                    "client": Value::Null,
                    "address": Value::Null,
                    "description": description,
                    "expires_in_secs": 0,
                    "writing_process": pid,
                    "holder_gone": false,
                });
                return Ok((json, description));
            }
        }
        return Ok((Value::Null, "none".to_owned()));
    };
    let mut json = locker_json(holder);
    let mut text = describe_locker(holder);
    // A local store has one writing process: without one, the holder is gone. (A LUKS file,
    // also a local path, names the live process holding its flock.)
    if let ImageUri::Local { dir } = uri {
        if dir.is_dir() {
            let gone = ivdisk_store::LocalStore::writing_process(dir)
                .map_err(|e| anyhow::anyhow!("{e}"))?
                .is_none();
            json["holder_gone"] = gone.into();
            if gone {
                text.push_str(
                    "; no process has the image open for writing: the holder is gone, and the \
                     next writer takes the lock over (no `lock break` needed)",
                );
            }
        }
    }
    Ok((json, text))
}

fn describe_locker(locker: &Locker) -> String {
    let mut text = format!("client {}", locker.client);
    if let Some(address) = &locker.address {
        text.push_str(&format!(" at {address}"));
    }
    if !locker.description.is_empty() {
        text.push_str(&format!(" ({})", locker.description));
    }
    match locker.expires_in {
        Some(d) => text.push_str(&format!(", expires in {} s unless renewed", d.as_secs())),
        None => text.push_str(", never expires by itself"),
    }
    text
}

/// What a command that made a `mem:` image says after its report: the image went with the
/// process (import and convert reported success on images gone as they said it).
pub(crate) fn fleeting_note(uri: &ImageUri) -> &'static str {
    match uri {
        ImageUri::Memory { .. } => {
            "\nnote: a mem: image lives in this process's memory: it is gone now that ivdisk \
             exits (tests and benchmarks use it inside one process)"
        }
        _ => "",
    }
}

/// How a user rewrites both copies of a header one of whose copies is damaged.
pub(crate) const HEADER_REPAIR: &str = "`ivdisk passphrase change` (with the same passphrase \
     as the new one, if you like) rewrites both copies";

fn info_json(uri: &ImageUri, info: &ImageInfo) -> Value {
    // A LUKS volume file has no objects and no image id: `info` shows neither (a 4 MiB
    // object size and an id of zeros misled).
    let luks_file = uri.luks_file().is_some();
    let mut value = json!({
        "image": uri.to_string(),
        "format": if luks_file { "luks-file" } else { "ivdisk" },
        "size": info.size,
        "cipher": info.suite.name(),
        "layout": info.layout.name(),
        "sector_size": info.sector_size,
        "object_size": info.object_size,
        "keyslots": info.keyslots,
        "image_id": hex::encode(info.image_id.0),
        "snapshots": info.snapshots.iter().map(crate::snapshots::snapshot_json).collect::<Vec<_>>(),
        "unfinished": info.unfinished,
        "header_warning": info.header_warning,
    });
    if luks_file {
        value["object_size"] = Value::Null;
        value["image_id"] = Value::Null;
    }
    value
}

fn info_lines(uri: &ImageUri, info: &ImageInfo) -> Vec<(&'static str, String)> {
    let keyslots: Vec<String> = info.keyslots.iter().map(u32::to_string).collect();
    let mut lines = vec![
        ("image", uri.to_string()),
        (
            "size",
            format!("{} bytes ({})", info.size, human_size(info.size)),
        ),
        ("cipher", info.suite.name().to_owned()),
        ("layout", info.layout.name().to_owned()),
        ("sector size", format!("{} bytes", info.sector_size)),
        (
            "object size",
            format!(
                "{} bytes ({})",
                info.object_size,
                human_size(info.object_size)
            ),
        ),
        (
            "keyslots",
            match keyslots.is_empty() {
                // After `passphrase remove --force` of the last one.
                true => "none: no passphrase opens this image".to_owned(),
                false => keyslots.join(", "),
            },
        ),
        ("image id", hex::encode(info.image_id.0)),
        (
            "snapshots",
            if info.snapshots.is_empty() {
                "none".to_owned()
            } else {
                info.snapshots
                    .iter()
                    .map(|s| s.name.as_str())
                    .collect::<Vec<_>>()
                    .join(", ")
            },
        ),
    ];
    if let Some(why) = &info.unfinished {
        lines.push(("unfinished", why.clone()));
    }
    if let Some(warning) = &info.header_warning {
        lines.push(("header", format!("{warning}; {HEADER_REPAIR}")));
    }
    if uri.luks_file().is_some() {
        lines.retain(|(key, _)| !matches!(*key, "object size" | "image id"));
        lines.insert(
            1,
            (
                "format",
                "LUKS volume file (cryptsetup's format: the same sectors as under \
                 cryptsetup open, no objects, no image id)"
                    .to_owned(),
            ),
        );
    }
    lines
}

fn aligned(lines: &[(&str, String)]) -> String {
    let width = lines.iter().map(|(k, _)| k.len()).max().unwrap_or(0) + 1;
    lines
        .iter()
        .map(|(k, v)| format!("{:<width$} {v}", format!("{k}:")))
        .collect::<Vec<_>>()
        .join("\n")
}

pub fn create(args: CreateArgs, rt: &Runtime) -> Result<()> {
    let uri = parse_uri(&args.image)?;
    let options = args.format.options(&uri, args.size)?;
    refuse_existing(rt, &uri)?;
    let passphrase = args.passphrase.new_passphrase()?;
    tracing::debug!(image = %uri, suite = %options.suite, layout = ?options.layout, size = args.size, "creating image");
    let made_dir = crate::transfer::store_dir_to_make(&uri);
    with_spinner(
        "creating (the key derivation benchmark takes seconds by design)",
        || {
            rt.block_on(async {
                let image = Image::create(&uri, &options, &passphrase).await?;
                image.close().await
            })
        },
    )
    .map_err(|e| create_failed(&uri, made_dir.as_deref(), e))?;
    drop(passphrase);
    let info = info_of(rt, &uri)?;
    let fleeting = fleeting_note(&uri);
    print(
        args.json,
        info_json(&uri, &info),
        format!(
            "created image {uri}: {}, cipher {}, layout {}, {}-byte sectors, {} objects, keyslot {}{fleeting}",
            exact_size(info.size),
            info.suite,
            info.layout,
            info.sector_size,
            exact_size(info.object_size),
            info.keyslots
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(", ")
        ),
    );
    Ok(())
}

/// What a local image's store takes on its file system (data and metadata allocated, holes
/// free); `None` for other stores (RADOS: `rbd du`-like sums would read every object's size)
/// and for LUKS files.
fn disk_usage(uri: &ImageUri) -> Option<ivdisk_store::DiskUsage> {
    match uri {
        ImageUri::Local { dir } if dir.is_dir() => ivdisk_store::LocalStore::disk_usage(dir)
            .map_err(|e| tracing::debug!("disk usage of {}: {e}", dir.display()))
            .ok(),
        _ => None,
    }
}

/// `ivdisk info rbd://...`: what librbd stores and the LUKS header at its start, read raw
/// without a passphrase.
fn info_rbd(args: InfoArgs, rt: &Runtime) -> Result<()> {
    let uri = RbdUri::parse(&args.image).map_err(|e| anyhow::anyhow!("{e}"))?;
    let info = rt
        .block_on(RbdImage::inspect(
            &uri.config,
            &uri.image,
            uri.snapshot.as_deref(),
        ))
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let luks = info.luks.as_ref();
    let encryption = luks.map_or("none", |l| l.format.name());
    if args.json {
        outln!(
            "{}",
            json!({
                "image": uri.to_string(),
                "format": "librbd",
                "size": info.size(),
                "raw_size": info.raw_size,
                "encryption": encryption,
                "cipher": luks.map(|l| l.cipher.clone()),
                "sector_size": luks.map(|l| l.sector_size),
                "data_offset": luks.map(|l| l.data_offset),
                "keyslots": luks.map(|l| l.keyslots.clone()),
            })
        );
        return Ok(());
    }
    let mut lines = vec![
        ("image", format!("{uri} (librbd)")),
        (
            "size",
            format!("{} bytes ({})", info.size(), human_size(info.size())),
        ),
    ];
    match luks {
        None => lines.push((
            "encryption",
            "none (served plain by encryption=auto)".into(),
        )),
        Some(l) => {
            let keyslots: Vec<String> = l.keyslots.iter().map(u32::to_string).collect();
            lines.extend([
                (
                    "raw size",
                    format!("{} bytes ({})", info.raw_size, human_size(info.raw_size)),
                ),
                ("encryption", format!("{} (librbd)", l.format.name())),
                ("cipher", l.cipher.clone()),
                ("sector size", format!("{} bytes", l.sector_size)),
                (
                    "data offset",
                    format!("{} bytes ({})", l.data_offset, human_size(l.data_offset)),
                ),
                ("keyslots", keyslots.join(", ")),
            ]);
        }
    }
    outln!("{}", aligned(&lines));
    Ok(())
}

pub fn info(args: InfoArgs, rt: &Runtime) -> Result<()> {
    if RbdUri::is_rbd(&args.image) {
        return info_rbd(args, rt);
    }
    let (uri, snapshot) = parse_image_at(&args.image)?;
    let mut info = info_of(rt, &uri)?;
    // IMAGE@SNAP: the image as that snapshot reads (its size).
    let snapshot = match snapshot {
        None => None,
        Some(name) => {
            let snap = info
                .snapshots
                .iter()
                .find(|s| s.name == name)
                .cloned()
                .ok_or_else(|| {
                    flat(ImageError::SnapshotNotFound {
                        image: uri.to_string(),
                        snapshot: name,
                    })
                })?;
            info.size = snap.size;
            Some(snap)
        }
    };
    let holder = rt.block_on(Image::lock_holder(&uri)).map_err(flat)?;
    let (lock, lock_text) = lock_report(&uri, holder.as_ref())?;
    let usage = disk_usage(&uri);
    if args.json {
        let mut value = info_json(&uri, &info);
        value["disk_usage"] = usage.map_or(
            Value::Null,
            |u| json!({"data": u.data, "metadata": u.metadata, "reserved": u.reserved, "total": u.total()}),
        );
        value["snapshot"] = snapshot
            .as_ref()
            .map_or(Value::Null, crate::snapshots::snapshot_json);
        value["lock"] = lock;
        outln!("{value}");
    } else {
        let mut lines = info_lines(&uri, &info);
        if let Some(snap) = &snapshot {
            lines.insert(
                1,
                (
                    "snapshot",
                    format!("{} (id {}, read-only)", snap.name, snap.id),
                ),
            );
        }
        if let Some(u) = usage {
            let reserved = match u.reserved {
                0 => String::new(),
                n => format!(
                    ", {} reserved for its commits (held while open for writing, or left by a \
                     writer that did not close)",
                    human_size(n)
                ),
            };
            lines.push((
                "disk usage",
                format!(
                    "{} ({} data, {} metadata{reserved})",
                    human_size(u.total()),
                    human_size(u.data),
                    human_size(u.metadata)
                ),
            ));
        }
        lines.push(("writer lock", lock_text));
        outln!("{}", aligned(&lines));
    }
    Ok(())
}

pub fn resize(args: ResizeArgs, rt: &Runtime) -> Result<()> {
    let uri = parse_uri(&args.image)?;
    // What can be refused without the passphrase is refused before asking for it.
    let before = info_of(rt, &uri)?;
    let ss = u64::from(before.sector_size);
    if args.size == 0 || !args.size.is_multiple_of(ss) {
        bail!(
            "image {uri}: --size {}: expected a positive multiple of the image's {ss}-byte sector size",
            args.size
        );
    }
    if args.size < before.size && !args.allow_shrink {
        bail!(
            "image {uri}: shrinking from {} to {} destroys the data past the new end; pass \
             --allow-shrink to do it",
            exact_size(before.size),
            exact_size(args.size)
        );
    }
    let passphrase = args.passphrase.existing()?;
    let image = with_spinner(
        "unlocking (the key derivation takes seconds by design)",
        || {
            // A shrink left unfinished opens for this resize, which finishes it.
            let options = OpenOptions {
                finishing_shrink: true,
                ..OpenOptions::default()
            };
            rt.block_on(Image::open(&uri, &passphrase, &options))
        },
    )
    .map_err(|e| {
        let hint = match &e {
            ImageError::Header { .. } => args.passphrase.unlock_hint(&passphrase),
            _ => String::new(),
        };
        anyhow::anyhow!("{e}; nothing was changed{hint}")
    })?;
    drop(passphrase);
    let old = image.size();
    let resized = rt.block_on(image.resize(args.size, args.allow_shrink));
    let closed = rt.block_on(image.close());
    resized.map_err(flat)?;
    closed.map_err(flat)?;
    print(
        args.json,
        json!({"image": uri.to_string(), "old_size": old, "size": args.size}),
        format!(
            "resized image {uri} from {} to {}",
            exact_size(old),
            exact_size(args.size)
        ),
    );
    Ok(())
}

pub fn delete(args: DeleteArgs, rt: &Runtime) -> Result<()> {
    let uri = parse_uri(&args.image)?;
    if uri.luks_file().is_some() {
        // The delete refuses a file (a LUKS volume, or no image at all), saying what it is;
        // before `info`, which fails on a file that is no LUKS volume.
        rt.block_on(Image::delete(&uri, |_, _| {})).map_err(flat)?;
    }
    let info = info_of(rt, &uri)?;
    let question = format!(
        "Delete image {uri} ({}, {})? All of its data is destroyed",
        exact_size(info.size),
        info.suite
    );
    let refusal = format!(
        "not deleting image {uri} without confirmation: standard input is not a terminal; pass \
         --yes to delete it"
    );
    if !confirm(&question, args.yes, &refusal)? {
        bail!("image {uri} not deleted (answer y to delete it)");
    }
    let bar = if args.json || !std::io::stderr().is_terminal() {
        indicatif::ProgressBar::hidden()
    } else {
        let bar = indicatif::ProgressBar::new(0);
        bar.set_style(
            indicatif::ProgressStyle::with_template(
                "deleting {bar:40} {pos}/{len} objects ({eta} left)",
            )
            .expect("a valid progress template"),
        );
        bar
    };
    let objects = Cell::new(0u64);
    let deleted = rt.block_on(Image::delete(&uri, |done, total| {
        bar.set_length(total);
        bar.set_position(done);
        objects.set(total);
    }));
    bar.finish_and_clear();
    deleted.map_err(|e| match e {
        // Its own hint ("open it read-only") does not apply to a deletion.
        ImageError::Store {
            image,
            source: StoreError::NotWritable { path, reason },
        } => anyhow::anyhow!(
            "image {image}: the store at {path} cannot be opened for writing ({reason}); \
             deleting the image writes to it: make it writable (a read-write mount, its \
             permissions), then delete again. Nothing was deleted"
        ),
        e => flat(e),
    })?;
    crate::control::remove_stale(&info.image_id, &uri);
    let mut text = format!(
        "deleted image {uri} ({} data object(s) removed)",
        objects.get()
    );
    if let ImageUri::Local { dir } = &uri {
        text.push_str(&format!(
            "\nthe local store directory {} stays (now without an image); `ivdisk create` can \
             reuse it, or remove it with `rm -r {}`",
            dir.display(),
            ivdisk_image::shell_word(&dir.to_string_lossy())
        ));
    }
    print(
        args.json,
        json!({"image": uri.to_string(), "deleted": true, "objects": objects.get()}),
        text,
    );
    Ok(())
}

pub fn lock(command: LockCommand, rt: &Runtime) -> Result<()> {
    let image = match &command {
        LockCommand::Status { image, .. } | LockCommand::Break { image, .. } => image,
    };
    if RbdUri::is_rbd(image) {
        // librbd keeps its images' writer lock itself; its own tools show and break it.
        let spec = RbdUri::parse(image)
            .map(|uri| uri.spec())
            .unwrap_or_else(|_| "POOL/IMAGE".into());
        bail!(
            "image address `{image}`: an rbd:// image's writer lock is librbd's exclusive lock, \
             not ivdisk's: `rbd lock ls {spec}` shows its holder and `rbd status {spec}` the \
             image's watchers. A holder that died loses it by itself once the OSDs drop its \
             watch (about 30 s), and `ivdisk serve` then takes it over"
        );
    }
    match command {
        LockCommand::Status { image, json } => {
            let uri = parse_uri(&image)?;
            let holder = rt.block_on(Image::lock_holder(&uri)).map_err(flat)?;
            let (lock, described) = lock_report(&uri, holder.as_ref())?;
            let text = match (&holder, lock.is_null()) {
                (None, true) => format!("image {uri}: no writer lock held"),
                (None, false) => format!("image {uri}: {described}"),
                (Some(_), _) => format!("image {uri}: writer lock held by {described}"),
            };
            print(json, json!({"image": uri.to_string(), "lock": lock}), text);
        }
        LockCommand::Break {
            image,
            yes,
            no_fence,
            json,
        } => {
            let uri = parse_uri(&image)?;
            let nothing =
                json!({"image": uri.to_string(), "broken": Value::Null, "fenced_at": Value::Null});
            let Some(holder) = rt.block_on(Image::lock_holder(&uri)).map_err(flat)? else {
                print(
                    json,
                    nothing,
                    format!("image {uri}: no writer lock held; nothing to break"),
                );
                return Ok(());
            };
            let fences = matches!(uri, ImageUri::Rados { .. }) && !no_fence;
            let question = if fences {
                format!(
                    "Break the writer lock of {} on image {uri}? Its client is blocklisted \
                     first: if it still runs, its IO fails from now on",
                    describe_locker(&holder)
                )
            } else {
                format!(
                    "Break the writer lock of {} on image {uri}? Only if that client is really \
                     gone: a writer that still runs would lose writes",
                    describe_locker(&holder)
                )
            };
            let refusal = format!(
                "not breaking the writer lock of image {uri} (held by {}) without confirmation: \
                 standard input is not a terminal; pass --yes to break it",
                describe_locker(&holder)
            );
            if !confirm(&question, yes, &refusal)? {
                bail!("the writer lock of image {uri} was left in place");
            }
            let fencing = match no_fence {
                true => Fencing::Skip,
                false => Fencing::Holder,
            };
            // Only the holder confirmed: one that took the lock over while the question
            // waited (a restarted server) is a live writer, not to be fenced or broken.
            let broken = match rt.block_on(Image::break_lock_of(&uri, fencing, Some(&holder))) {
                Err(
                    e @ ImageError::Store {
                        source: StoreError::CannotFence { .. },
                        ..
                    },
                ) => bail!(
                    "{e}; the lock was left in place. If you know that writer is stopped, run \
                     `ivdisk lock break {} --no-fence`",
                    ivdisk_image::shell_word(&image.to_string())
                ),
                Err(e @ ImageError::Locked { .. }) => bail!(
                    "the writer lock changed hands while you confirmed (it was {}'s): {e}. \
                     Nothing was broken or fenced",
                    describe_locker(&holder)
                ),
                other => other.map_err(flat)?,
            };
            match &broken {
                None => print(
                    json,
                    nothing,
                    format!("image {uri}: the writer lock was released meanwhile; nothing broken"),
                ),
                Some(BrokenLock {
                    holder: removed,
                    fenced_at,
                }) => {
                    let described = match removed.description.is_empty() {
                        true => String::new(),
                        false => format!(" ({})", removed.description),
                    };
                    let text = match fenced_at {
                        Some(address) => format!(
                            "image {uri}: fenced {} at {address} (the cluster refuses its \
                             operations for an hour; `ceph osd blocklist rm {address}` lifts \
                             that early) and broke its writer lock{described}",
                            removed.client
                        ),
                        None => format!(
                            "image {uri}: broke the writer lock of client {}{described}",
                            removed.client
                        ),
                    };
                    print(
                        json,
                        json!({
                            "image": uri.to_string(),
                            "broken": locker_json(removed),
                            "fenced_at": fenced_at,
                        }),
                        text,
                    );
                    if fenced_at.is_none() {
                        note!(
                            "ivdisk: warning: client {} must really be gone (process stopped, \
                             host down): if it still runs, it and the next writer lose each \
                             other's writes",
                            removed.client
                        );
                    }
                    if removed.client != holder.client {
                        note!(
                            "ivdisk: warning: the lock changed hands while you confirmed: the \
                             lock broken was {}'s, not {}'s",
                            removed.client,
                            holder.client
                        );
                    }
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_print_in_binary_units() {
        assert_eq!(human_size(512), "512 bytes");
        assert_eq!(human_size(4096), "4 KiB");
        assert_eq!(human_size(1536), "1.5 KiB");
        assert_eq!(human_size(10 << 30), "10 GiB");
        assert_eq!(human_size(3 << 40), "3 TiB");
        assert_eq!(human_size(7 << 60), "7 EiB");
        assert_eq!(exact_size(12289 << 10), "12289 KiB");
        assert_eq!(exact_size(64 << 20), "64 MiB");
        assert_eq!(exact_size(7 << 60), "7 EiB");
        assert_eq!(exact_size(1536), "1536 bytes");
        assert_eq!(exact_size(0), "0 bytes");
    }

    #[test]
    fn help_names_every_layout() {
        let help = layouts_help();
        for layout in LayoutKind::ALL {
            assert!(help.contains(layout.name()), "{layout} missing");
            assert!(help.contains(layout.summary()), "{layout} summary missing");
        }
        assert!(lock_help().contains("30 s"));
    }
}
