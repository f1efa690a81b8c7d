//! `ivdisk import`, `export` and `verify`: whole-image passes through the image's IO path.
//!
//! Each pass cuts the image into chunks of at most one object (so each chunk is one store
//! operation per object touched) and keeps [`IN_FLIGHT`] of them going at once, each on a
//! runtime task of its own: the store round trips overlap, and encryption/decryption runs on
//! every runtime thread instead of only the one driving the pass.
//!
//! Sparseness, both ways: import writes only the sectors that hold a non-zero byte
//! ([`data_runs`]; an unwritten sector already reads as zeros); export skips the image's holes
//! ([`Image::allocation`]: objects that do not exist) and all-zero 4 KiB blocks, leaving holes
//! in the output file; verify reads only allocated objects
//! (a missing object holds nothing to authenticate).

use ivdisk_store::StoreError;
use std::fs::File;
use std::io::{IsTerminal, Seek, SeekFrom, Write};
use std::os::unix::fs::{FileExt, FileTypeExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{bail, Context, Result};
use clap::Args;
use futures_util::stream::{self, StreamExt};
use indicatif::{ProgressBar, ProgressStyle};
use ivdisk_image::{AllocationExtent, Image, ImageError, ImageUri, OpenOptions};
use ivdisk_store::data_runs;
use serde_json::json;
use tokio::runtime::Runtime;
use zeroize::Zeroizing;

use crate::images::{
    flat, human_size, image_at, info_at, parse_image_at, parse_uri, refuse_existing, FormatArgs,
    IMAGE_HELP,
};
use crate::secrets::{json_path, with_spinner, PassphraseArgs};

/// Chunks in flight at once.
pub(crate) const IN_FLIGHT: usize = 8;
/// Largest chunk: one object, but at most this (64 MiB objects would otherwise keep half a
/// GiB of buffers in flight).
const MAX_CHUNK: u64 = 8 << 20;

pub(crate) fn chunk_size(image: &Image) -> u64 {
    image.object_size().min(MAX_CHUNK)
}

/// Write the data runs ([`data_runs`], in sectors) of `buf` to `image` at `offset`; returns
/// the bytes written. A buffer that is data throughout is handed over whole (encrypted in
/// place, no second buffer).
pub(crate) async fn write_data_runs(image: &Image, offset: u64, buf: Vec<u8>) -> Result<u64> {
    let runs = data_runs(&buf, image.sector_size());
    if runs == [(0, buf.len())] {
        image.write_owned(offset, buf).await.map_err(flat)?;
        return Ok(runs[0].1 as u64);
    }
    let writes = runs
        .iter()
        .map(|&(at, n)| image.write(offset + at as u64, &buf[at..at + n]));
    for result in futures_util::future::join_all(writes).await {
        result.map_err(flat)?;
    }
    Ok(runs.iter().map(|&(_, n)| n as u64).sum())
}

/// A byte progress bar on a terminal's stderr; hidden otherwise and with --json.
pub(crate) fn progress(total: u64, what: &str, json: bool) -> ProgressBar {
    if json || !std::io::stderr().is_terminal() {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(total);
    bar.set_style(
        ProgressStyle::with_template(
            "{msg} {bar:40} {binary_bytes}/{binary_total_bytes} ({binary_bytes_per_sec}, {eta} left)",
        )
        .expect("a valid progress template"),
    );
    bar.set_message(what.to_owned());
    bar
}

/// `[offset, offset + len)` cut into pieces of at most `chunk` bytes.
fn pieces(offset: u64, len: u64, chunk: u64) -> impl Iterator<Item = (u64, u64)> {
    let end = offset + len;
    (offset..end)
        .step_by(chunk as usize)
        .map(move |at| (at, chunk.min(end - at)))
}

/// Open an image read-only with its passphrase (no writer lock: on RADOS, and on the local
/// store through a read-only store, this works while the image is served), at its head or at
/// a snapshot (`IMAGE@SNAP`, always read-only).
pub(crate) fn open_read_only_at(
    rt: &Runtime,
    uri: &ImageUri,
    snapshot: Option<&str>,
    passphrase: &PassphraseArgs,
) -> Result<Image> {
    unlock_read_only(rt, uri, snapshot, passphrase).map(|(image, _)| image)
}

/// [`open_read_only_at`], also returning the passphrase it used (convert protects the new
/// image with it).
pub(crate) fn unlock_read_only(
    rt: &Runtime,
    uri: &ImageUri,
    snapshot: Option<&str>,
    passphrase: &PassphraseArgs,
) -> Result<(Image, Zeroizing<Vec<u8>>)> {
    // Refused before the passphrase is asked for when the image (or snapshot) is not there.
    info_at(rt, uri, snapshot)?;
    let secret = passphrase.existing()?;
    let options = OpenOptions {
        snapshot: snapshot.map(str::to_owned),
        ..OpenOptions::read_only()
    };
    let image = with_spinner(
        "unlocking (the key derivation takes seconds by design)",
        || rt.block_on(Image::open(uri, &secret, &options)),
    )
    .map_err(|e| {
        let hint = match &e {
            ImageError::Header { .. } => passphrase.unlock_hint(&secret),
            _ => String::new(),
        };
        anyhow::anyhow!("{e}{hint}")
    })?;
    Ok((image, secret))
}

// ---------------------------------------------------------------------------------------------
// import

#[derive(Args)]
pub struct ImportArgs {
    /// The raw (plaintext) disk image to read: a regular file or a block device.
    file: PathBuf,
    /// The image to create (it must not exist). PATH or file:PATH (a new local store
    /// directory), rados://POOL/IMAGE?conf=PATH&id=CLIENT&namespace=NS, mem:NAME.
    image: String,
    #[command(flatten)]
    format: FormatArgs,
    #[command(flatten)]
    passphrase: PassphraseArgs,
    /// Print JSON: image, file, size, bytes, bytes_written, seconds, cipher, layout, sector_size; no progress bar.
    #[arg(long)]
    json: bool,
}

/// Refuse, before opening it, a source `path` that is not a regular file (nor, with
/// `devices`, a block device); `what` says what the command reads. Opening a FIFO waits for
/// a writer: a restore or import given one hung there, deaf to Ctrl-C. A path that cannot
/// be looked at is left to the open, which names the error.
pub(crate) fn check_source_kind(path: &Path, devices: bool, what: &str) -> Result<()> {
    let Ok(meta) = std::fs::metadata(path) else {
        return Ok(());
    };
    let kind = meta.file_type();
    if kind.is_file() || devices && kind.is_block_device() {
        return Ok(());
    }
    bail!(
        "{} is not a regular file{}: {what}",
        path.display(),
        if devices { " or block device" } else { "" }
    )
}

/// The size of a regular file or block device (whose metadata says 0).
pub(crate) fn source_len(path: &Path, file: &mut File) -> Result<u64> {
    let meta = file
        .metadata()
        .with_context(|| format!("reading the size of {}", path.display()))?;
    let kind = meta.file_type();
    if !(kind.is_file() || kind.is_block_device()) {
        bail!(
            "{} is not a regular file or block device: import reads a raw disk image whose size \
             is known",
            path.display()
        );
    }
    file.seek(SeekFrom::End(0))
        .with_context(|| format!("reading the size of {}", path.display()))
}

/// Set once SIGINT, SIGTERM, SIGHUP or SIGQUIT arrives after [`stop_copies_on_signals`].
pub(crate) static INTERRUPTED: AtomicBool = AtomicBool::new(false);

/// From here on SIGINT, SIGTERM, SIGHUP (a closed terminal: the usual end of a long copy
/// over ssh) and SIGQUIT do not kill the process: they stop the copy of `import`,
/// `convert` or `restore` between pieces (those in flight finish), whose caller then deletes the half-made
/// image as after any failed copy. Killed instead, the process would leave an image that
/// looks complete, holds part of the data, and verifies.
pub(crate) fn stop_copies_on_signals(rt: &Runtime) -> Result<()> {
    use tokio::signal::unix::{signal, SignalKind};
    let _runtime = rt.enter();
    let mut interrupt = signal(SignalKind::interrupt()).context("installing SIGINT handler")?;
    let mut terminate = signal(SignalKind::terminate()).context("installing SIGTERM handler")?;
    let mut hangup = signal(SignalKind::hangup()).context("installing SIGHUP handler")?;
    let mut quit = signal(SignalKind::quit()).context("installing SIGQUIT handler")?;
    rt.spawn(async move {
        tokio::select! {
            _ = interrupt.recv() => {}
            _ = terminate.recv() => {}
            _ = hangup.recv() => {}
            _ = quit.recv() => {}
        }
        INTERRUPTED.store(true, Ordering::Relaxed);
        // An export stuck in a write (a reader of standard output that stopped reading) or a
        // read (a cluster that does not answer) never reaches the check between pieces: it
        // is given up after a while. Nothing of it is worth keeping, unlike a half-made
        // image, which only its own cleanup may remove.
        tokio::time::sleep(EXPORT_GRACE).await;
        let abandoned = ABANDONABLE_EXPORT.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(partial) = &*abandoned {
            if let Some(partial) = partial {
                let _ = std::fs::remove_file(partial);
            }
            eprintln!(
                "ivdisk: {}; the export did not stop within {} s (stuck writing or reading), \
                 given up{}",
                interrupted_error(),
                EXPORT_GRACE.as_secs(),
                if partial.is_some() {
                    ", its partial file removed"
                } else {
                    ""
                }
            );
            std::process::exit(1);
        }
    });
    Ok(())
}

/// How long an export may take to stop after a signal before it is given up.
const EXPORT_GRACE: Duration = Duration::from_secs(5);

/// While an export runs: that it may be given up after a signal (see
/// [`stop_copies_on_signals`]), and its partial file (none for standard output). Taken
/// before the export is named: from then on it finishes.
static ABANDONABLE_EXPORT: std::sync::Mutex<Option<Option<PathBuf>>> = std::sync::Mutex::new(None);

/// Whether a copy must stop: a signal came (see [`stop_copies_on_signals`]).
pub(crate) fn interrupted() -> bool {
    INTERRUPTED.load(Ordering::Relaxed)
}

/// The error of a copy stopped by a signal.
pub(crate) fn interrupted_error() -> anyhow::Error {
    anyhow::anyhow!("interrupted (SIGINT, SIGTERM, SIGHUP or SIGQUIT)")
}

pub fn import(args: ImportArgs, rt: &Runtime) -> Result<()> {
    let uri = parse_uri(&args.image)?;
    check_source_kind(
        &args.file,
        true,
        "import reads a raw disk image whose size is known",
    )?;
    let mut file = File::open(&args.file)
        .with_context(|| format!("cannot open {} for reading", args.file.display()))?;
    let bytes = source_len(&args.file, &mut file)?;
    if bytes == 0 {
        bail!(
            "{} is empty: an image needs at least one sector",
            args.file.display()
        );
    }
    let ss = u64::from(args.format.sector_size);
    let size = bytes.div_ceil(ss) * ss;
    let options = args.format.options(&uri, size)?;
    refuse_existing(rt, &uri)?;
    // Imported as it is, ciphertext and all: say so before the passphrase is asked for.
    if let Ok(Some(version)) = crate::convert::luks_version(&args.file) {
        note!(
            "ivdisk: note: {} holds a LUKS{version} volume: import copies its bytes as they \
             are (its ciphertext, header included); to copy its plaintext, use `ivdisk \
             convert {} NEW`",
            args.file.display(),
            args.file.display()
        );
    }
    let passphrase = args.passphrase.new_passphrase()?;
    if size != bytes {
        note!(
            "ivdisk: note: {} is {bytes} bytes, not a multiple of the {ss}-byte sector size: \
             image {uri} is {size} bytes, rounded up, and its last {} byte(s) read as zeros",
            args.file.display(),
            size - bytes
        );
    }
    let made_dir = store_dir_to_make(&uri);
    // Before the image exists: a signal from here on deletes it again.
    stop_copies_on_signals(rt)?;
    let image = with_spinner(
        "creating (the key derivation benchmark takes seconds by design)",
        || {
            rt.block_on(Image::create_to_fill(
                &uri,
                &options,
                &passphrase,
                &format!("an import of {}", args.file.display()),
            ))
        },
    )
    .map_err(|e| crate::images::create_failed(&uri, made_dir.as_deref(), e))?;
    drop(passphrase);
    let (suite, layout, sector_size) = (image.suite(), image.layout(), image.sector_size());
    let bar = progress(bytes, "importing", args.json);
    let started = Instant::now();
    let target = NewImage {
        uri: &uri,
        made_dir: made_dir.as_deref(),
        image,
    };
    let written = fill_or_delete(rt, target, &args.file, file, bytes, &bar)?;
    let seconds = started.elapsed().as_secs_f64();
    crate::secrets::print(
        args.json,
        json!({"image": uri.to_string(), "file": json_path(&args.file), "size": size, "bytes": bytes,
               "bytes_written": written, "seconds": seconds, "cipher": suite.name(),
               "layout": layout.name(), "sector_size": sector_size}),
        format!(
            "imported {} ({}) into image {uri} ({suite}, layout {}, {sector_size}-byte sectors) \
             in {seconds:.1} s: {} written, the rest zeros left unwritten{}",
            args.file.display(),
            human_size(bytes),
            layout.name(),
            human_size(written),
            crate::images::fleeting_note(&uri)
        ),
    );
    Ok(())
}

/// Copy `len` bytes of `file` (at `path`) into the new image `image` of `uri` and close it;
/// if that fails, delete the image again (a half-imported image must not pass for a copy).
fn fill_or_delete(
    rt: &Runtime,
    target: NewImage<'_>,
    path: &Path,
    file: File,
    len: u64,
    bar: &ProgressBar,
) -> Result<u64> {
    let NewImage {
        uri,
        made_dir,
        image,
    } = target;
    let copied = rt.block_on(copy_in(&image, Arc::new(file), len, bar));
    bar.finish_and_clear();
    // Only now does the image open (an import killed before this leaves one that says it is
    // incomplete).
    let copied = copied.and_then(|w| rt.block_on(image.mark_filled()).map_err(flat).map(|()| w));
    // Closing flushes (only then is the import durable) and releases the writer lock, which
    // the delete below takes.
    let closed = rt.block_on(image.close()).map_err(flat);
    match copied.and_then(|w| closed.map(|()| w)) {
        Ok(written) => Ok(written),
        Err(e) => Err(delete_half_made(
            rt,
            uri,
            made_dir,
            e,
            &format!("importing {} into {uri}", path.display()),
        )),
    }
}

/// An image an import just created, open, and what to remove if the import fails.
struct NewImage<'a> {
    uri: &'a ImageUri,
    /// The local store directory made for it ([`store_dir_to_make`]).
    made_dir: Option<&'a Path>,
    image: Image,
}

/// The local store directory that creating an image at `uri` will make, if there is none yet:
/// a command that creates an image there and fails removes it again ([`remove_made_dir`]), so
/// a failed import leaves nothing behind.
pub(crate) fn store_dir_to_make(uri: &ImageUri) -> Option<PathBuf> {
    let ImageUri::Local { dir } = uri else {
        return None;
    };
    if std::fs::symlink_metadata(dir).is_err() {
        // The store makes the directories on its way too: the first that is missing is the
        // one to remove (its parents were left behind, `create a/b/img` left `a/b`).
        let first_missing = dir
            .ancestors()
            .take_while(|a| !a.as_os_str().is_empty() && std::fs::symlink_metadata(a).is_err())
            .last()
            .unwrap_or(dir);
        return Some(first_missing.to_path_buf());
    }
    // An empty directory given as the image's place is the user's: a failed command leaves it
    // as it was, empty (it left the half-made store's files there, having said the image was
    // deleted).
    let empty = std::fs::read_dir(dir).is_ok_and(|mut entries| entries.next().is_none());
    let real_dir = std::fs::symlink_metadata(dir).is_ok_and(|m| m.is_dir());
    if !(empty && real_dir) {
        return None;
    }
    GIVEN_EMPTY
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push(dir.clone());
    Some(dir.clone())
}

/// The directories [`store_dir_to_make`] found existing and empty: emptied again, not removed.
static GIVEN_EMPTY: std::sync::Mutex<Vec<PathBuf>> = std::sync::Mutex::new(Vec::new());

/// `e` (what made `what` fail) after deleting the half-made image `uri`, which must be closed
/// (the delete takes its writer lock): a half-made image must not pass for a copy. `made_dir`:
/// the local store directory the command made for it ([`store_dir_to_make`]), removed too.
pub(crate) fn delete_half_made(
    rt: &Runtime,
    uri: &ImageUri,
    made_dir: Option<&Path>,
    e: anyhow::Error,
    what: &str,
) -> anyhow::Error {
    match rt.block_on(Image::delete(uri, |_, _| {})) {
        Ok(()) => e.context(format!(
            "{what} failed; the half-made image {uri} was deleted{}",
            remove_made_dir(made_dir)
        )),
        // A directory this command made holds nothing but the half-made image: removed
        // whole. (On a full disk deleting through the store fails: its metadata cannot grow.)
        Err(d) if made_dir.is_some() => e.context(format!(
            "{what} failed; deleting the half-made image through its store failed ({d}){}",
            remove_made_dir(made_dir)
        )),
        Err(d) => e.context(format!(
            "{what} failed, and deleting the half-made image failed too ({d}); delete it with \
             `ivdisk delete {} --yes`",
            ivdisk_image::shell_word(&uri.to_string())
        )),
    }
}

/// `made_dir`, unless `e` says another process has the image there: it won a race to create
/// it in the directory this command made, which is then that process's to keep (removing it
/// deleted the winner's image, or let a third command open a second writer beside it).
pub(crate) fn made_dir_unless_taken<'a>(
    made_dir: Option<&'a Path>,
    e: &ImageError,
) -> Option<&'a Path> {
    let taken = matches!(
        e,
        ImageError::Exists { .. }
            | ImageError::Locked { .. }
            | ImageError::Store {
                source: ivdisk_store::StoreError::AlreadyOpen { .. },
                ..
            }
    );
    made_dir.filter(|_| !taken)
}

/// Remove `made_dir`, the local store directory a failed command made for its new image
/// ([`store_dir_to_make`]), once the image in it is gone; what happened, as the end of a
/// sentence ("" if the command failed before the directory was made).
pub(crate) fn remove_made_dir(made_dir: Option<&Path>) -> String {
    let Some(dir) = made_dir.filter(|d| std::fs::symlink_metadata(d).is_ok()) else {
        return String::new();
    };
    let given = GIVEN_EMPTY
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .iter()
        .any(|d| d == dir);
    if given {
        let emptied = std::fs::read_dir(dir).and_then(|entries| {
            entries.into_iter().try_for_each(|entry| {
                let entry = entry?;
                if entry.file_type()?.is_dir() {
                    std::fs::remove_dir_all(entry.path())
                } else {
                    std::fs::remove_file(entry.path())
                }
            })
        });
        return match emptied {
            Ok(()) => format!(
                ", and the directory {} left empty, as it was",
                dir.display()
            ),
            Err(r) => format!(
                ", but emptying the directory {} again failed ({r}); it was empty before",
                dir.display()
            ),
        };
    }
    match std::fs::remove_dir_all(dir) {
        Ok(()) => format!(", and the directory {} made for it removed", dir.display()),
        Err(r) => format!(
            ", but removing the directory {} made for it failed ({r}); remove it with `rm -r {}`",
            dir.display(),
            ivdisk_image::shell_word(&dir.to_string_lossy())
        ),
    }
}

/// Remove the partial files that exports to `file` killed outright (SIGKILL, a crash) left
/// beside it: hidden, each of the image's size, and no later export removed them. A file whose
/// export still runs is locked by it and stays (`ivdisk_image::remove_abandoned_partials`).
fn remove_abandoned_exports(file: &Path) {
    let name = file.file_name().unwrap_or_default().to_string_lossy();
    let dir = match file.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    for removed in ivdisk_image::remove_abandoned_partials(dir, &format!(".{name}.ivdisk-export-"))
    {
        tracing::info!(file = %removed.display(), "removed the partial file of an export that was killed");
    }
}

/// Copy `len` bytes of `file` into `image` from offset 0; returns the bytes written (the
/// chunks that were not all zeros). On an error, the chunks still in flight finish first, so
/// nothing writes to the image any more when it returns.
async fn copy_in(image: &Image, file: Arc<File>, len: u64, bar: &ProgressBar) -> Result<u64> {
    let chunk = chunk_size(image);
    let ss = image.sector_size() as u64;
    // Holes the file system knows of are not read at all: a sparse 64 GiB file took a minute
    // of reading zeros.
    let data = ivdisk_store::file_data_ranges(&file, 0, len);
    let holds_data = move |offset: u64, n: u64| match &data {
        Some(ranges) => {
            let next = ranges.partition_point(|&(_, stop)| stop <= offset);
            ranges
                .get(next)
                .is_some_and(|&(start, _)| start < offset + n)
        }
        None => true,
    };
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = stream::iter(pieces(0, len, chunk))
        .take_while(|_| std::future::ready(!stop.load(Ordering::Relaxed) && !interrupted()))
        .map(|(offset, n)| {
            let (image, file) = (image.clone(), file.clone());
            let read = holds_data(offset, n);
            tokio::spawn(async move {
                if !read {
                    return Ok((n, 0));
                }
                let buf = tokio::task::spawn_blocking(move || -> std::io::Result<Vec<u8>> {
                    // The last chunk is padded to a whole sector (the image was rounded up).
                    let mut buf = vec![0u8; n.div_ceil(ss) as usize * ss as usize];
                    file.read_exact_at(&mut buf[..n as usize], offset)?;
                    Ok(buf)
                })
                .await
                .context("the file reading task failed")?
                .map_err(|e| match e.kind() {
                    std::io::ErrorKind::UnexpectedEof => anyhow::anyhow!(
                        "the file got shorter while it was read: it now ends before byte {}",
                        offset + n
                    ),
                    _ => anyhow::Error::new(e)
                        .context(format!("reading bytes [{offset}, +{n}) of the file")),
                })?;
                let stored = write_data_runs(&image, offset, buf).await?;
                anyhow::Ok((n, stored))
            })
        })
        .buffer_unordered(IN_FLIGHT);
    let mut written = 0;
    let mut error = None;
    while let Some(done) = tasks.next().await {
        match done
            .context("an import task failed")
            .and_then(|result| result)
        {
            Ok((n, w)) => {
                bar.inc(n);
                written += w;
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
        None => Ok(written),
    }
}

// ---------------------------------------------------------------------------------------------
// export

#[derive(Args)]
pub struct ExportArgs {
    #[arg(help = IMAGE_HELP)]
    image: String,
    /// The raw (plaintext) file to write, the image's size, with holes where the image has
    /// none of its data; "-" writes to standard output (every byte, zeros included). A new
    /// file is readable by its owner only (mode 600).
    file: PathBuf,
    /// Overwrite FILE if it exists (the export replaces it once complete, with its
    /// permissions and, as far as allowed, its owner).
    #[arg(long)]
    force: bool,
    #[command(flatten)]
    passphrase: PassphraseArgs,
    /// Print JSON: image, snapshot, file, size, bytes_written, seconds, sparse; no progress bar. With
    /// FILE "-" the report goes to standard error.
    #[arg(long)]
    json: bool,
}

/// Where export writes.
enum Sink {
    /// A regular file: positioned writes of data, holes left where the image reads zeros.
    File(File),
    /// Standard output: every byte in order.
    Stdout(std::io::BufWriter<std::io::Stdout>),
}

/// Refuse `target` (a file a command writes) where it is local image `uri` itself (a LUKS
/// file) or inside its store directory: writing there destroys the image. `why` says what
/// the command would write over it.
pub(crate) fn refuse_target_in_image(
    uri: &ImageUri,
    shown: &str,
    target: &Path,
    why: &str,
) -> Result<()> {
    let ImageUri::Local { dir } = uri else {
        return Ok(());
    };
    let Ok(source) = std::fs::canonicalize(dir) else {
        return Ok(());
    };
    // A target not made yet is placed by its directory (commands write beside it first).
    let output = std::fs::canonicalize(target).or_else(|e| {
        let parent = match target.parent() {
            Some(parent) if !parent.as_os_str().is_empty() => parent,
            _ => Path::new("."),
        };
        match (std::fs::canonicalize(parent), target.file_name()) {
            (Ok(parent), Some(name)) => Ok(parent.join(name)),
            _ => Err(e),
        }
    });
    if let Ok(output) = output {
        if output.starts_with(&source) {
            bail!(
                "{} is image {shown} itself{}: {why}; name a file outside it",
                target.display(),
                if output == source {
                    ""
                } else {
                    " (a file of its store)"
                }
            );
        }
    }
    Ok(())
}

/// Refuse a new local image inside another one's store directory (`img.ivd/data/new`): its
/// files would mix with that store's, and `rm -r` of that image (what `delete` suggests for
/// a store it cannot open) would take the new one along.
pub(crate) fn refuse_inside_another_store(uri: &ImageUri) -> Result<()> {
    let ImageUri::Local { dir } = uri else {
        return Ok(());
    };
    let Ok(absolute) = std::path::absolute(dir) else {
        return Ok(());
    };
    // The nearest directory that exists holds the rest (made by the command).
    let Some(existing) = absolute.ancestors().skip(1).find(|a| a.is_dir()) else {
        return Ok(());
    };
    let Ok(existing) = std::fs::canonicalize(existing) else {
        return Ok(());
    };
    if let Some(store) = existing
        .ancestors()
        .find(|a| ivdisk_store::LocalStore::is_store_dir(a))
    {
        bail!(
            "{} lies inside {}, the store directory of another image: its files would mix with \
             that store's; pick a path outside it; nothing was created",
            dir.display(),
            store.display()
        );
    }
    Ok(())
}

/// Check the name a command writes its output file to (a new file renamed over it once
/// complete): `Some` with what is there for a regular file that `force` lets it replace,
/// `None` for a free name. Everything else is refused before any work, with the reason first:
/// `--force` was suggested for a directory too, and failed then (after the whole copy, for a
/// backup). `writes` says what the command writes, for what is neither file nor directory.
pub fn check_output_file(
    path: &Path,
    force: bool,
    writes: &str,
) -> Result<Option<std::fs::Metadata>> {
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return Ok(None);
    };
    let shown = path.display();
    if meta.is_dir() {
        bail!("{shown} is a directory; name a file (in it, or elsewhere)");
    }
    if meta.is_symlink() {
        // The new file is renamed to the name: over a link it replaces the link itself, and
        // what the link points to stays as it was.
        let target = std::fs::read_link(path)
            .map(|t| format!(" (to {})", t.display()))
            .unwrap_or_default();
        bail!(
            "{shown} is a symbolic link{target}; the output is a new file put in its place, \
             which would replace the link, not write where it points: name the file itself"
        );
    }
    if !meta.is_file() {
        bail!("{shown} is not a regular file; {writes}");
    }
    if !force {
        bail!("{shown} exists; pass --force to overwrite it, or pick another name");
    }
    Ok(Some(meta))
}

pub fn export(args: ExportArgs, rt: &Runtime) -> Result<()> {
    let (uri, snapshot) = parse_image_at(&args.image)?;
    let shown = image_at(&uri, snapshot.as_deref());
    let to_stdout = args.file == Path::new("-");
    // The file --force replaces: its permissions and owner, which the export takes over.
    let mut replacing: Option<std::fs::Metadata> = None;
    if to_stdout {
        if std::io::stdout().is_terminal() {
            bail!(
                "not writing the disk's bytes to a terminal: redirect standard output (ivdisk \
                 export {shown} - > FILE), or name a file"
            );
        }
    } else {
        replacing = check_output_file(
            &args.file,
            args.force,
            &format!(
                "export writes a raw file (to write a block device, ivdisk export {shown} - > \
                 DEVICE)"
            ),
        )?;
    }
    if !to_stdout {
        // Over its own source, a LUKS file (or a file of the local store) would be replaced
        // by the plaintext: the keyslots and the ciphertext gone, the data unencrypted on
        // disk.
        refuse_target_in_image(
            &uri,
            &shown,
            &args.file,
            "export writes the plaintext, which would replace the encrypted data",
        )?;
    }
    if to_stdout {
        crate::stdout_carries_data();
    }
    // The export goes into a new file beside the one named, which takes its name only once
    // it is complete (over it with --force, never over one made meanwhile without): written
    // at its final name, an interrupted export left a file of the image's size that read as
    // zeros where it had not got to, a copy that looked complete.
    let target = {
        let name = args.file.file_name().unwrap_or_default().to_string_lossy();
        args.file
            .with_file_name(format!(".{name}.ivdisk-export-{}", std::process::id()))
    };
    if !to_stdout {
        remove_abandoned_exports(&args.file);
    }
    // A signal stops the copy between pieces, and the partial file is removed.
    *ABANDONABLE_EXPORT.lock().unwrap_or_else(|e| e.into_inner()) =
        Some((!to_stdout).then(|| target.clone()));
    stop_copies_on_signals(rt)?;
    let image = open_read_only_at(rt, &uri, snapshot.as_deref(), &args.passphrase)?;
    let size = image.size();
    let mut sink = if to_stdout {
        Sink::Stdout(std::io::BufWriter::with_capacity(
            1 << 20,
            std::io::stdout(),
        ))
    } else {
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            // The plaintext of an encrypted disk: its owner's only, as cryptsetup's backups.
            .mode(0o600)
            .open(&target)
            .with_context(|| {
                format!(
                    "cannot create {} (an export is written under that hidden name beside {} \
                     and named when complete, so its directory must be writable)",
                    target.display(),
                    args.file.display()
                )
            })?;
        if let Some(old) = &replacing {
            keep_permissions(&file, old);
        }
        // Held while the export runs: a later export to the same name tells this file, still
        // being written, from one a killed export left (`remove_abandoned_exports`).
        ivdisk_image::mark_partial_in_progress(&file);
        // Every byte not written below stays a hole: the file reads as zeros there.
        if let Err(e) = file.set_len(size) {
            // An empty file must not pass for an export either.
            let _ = std::fs::remove_file(&target);
            return Err(anyhow::Error::new(e).context(format!(
                "setting the size of {} to {size} bytes, the image's (the file system may not \
                 hold a file this large: export to another one, or to standard output with -); \
                 the file was removed",
                target.display()
            )));
        }
        Sink::File(file)
    };
    let bar = progress(size, "exporting", args.json);
    let started = Instant::now();
    let copied = rt.block_on(copy_out(&image, &shown, &mut sink, &bar));
    bar.finish_and_clear();
    // From here on the export finishes (or fails) on its own: never given up half-named.
    ABANDONABLE_EXPORT
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .take();
    let mut complete = false;
    let finished = copied.and_then(|written| {
        match &mut sink {
            Sink::File(file) => {
                file.sync_all()
                    .with_context(|| format!("syncing {}", target.display()))?;
                complete = true;
                name_export(&target, &args.file, args.force)?;
            }
            Sink::Stdout(out) => out.flush().context("writing to standard output")?,
        }
        Ok(written)
    });
    let written = match finished {
        Ok(written) => written,
        Err(e) => {
            if let Sink::File(_) = sink {
                // An incomplete export must not pass for a copy of the image; a complete one
                // that could not be named is plaintext under a hidden name nobody looks for.
                let _ = std::fs::remove_file(&target);
                let what = if complete { "complete" } else { "incomplete" };
                return Err(e.context(if replacing.is_some() {
                    format!(
                        "exporting image {shown} failed; {} was left as it was (the {what} \
                         export was removed)",
                        args.file.display()
                    )
                } else {
                    format!(
                        "exporting image {shown} failed; the {what} {} was removed",
                        args.file.display()
                    )
                }));
            }
            if let Sink::Stdout(out) = sink {
                // Not flushed on the way out: a reader that stopped reading would hold the
                // process in that write for ever.
                let _ = out.into_parts();
            }
            return Err(e.context(format!(
                "exporting image {shown} failed; standard output got an incomplete copy"
            )));
        }
    };
    if !to_stdout {
        sync_export_name(&args.file)?;
    }
    let seconds = started.elapsed().as_secs_f64();
    let report = if args.json {
        json!({"image": uri.to_string(), "snapshot": snapshot, "file": json_path(&args.file), "size": size,
               "bytes_written": written, "seconds": seconds, "sparse": !to_stdout})
        .to_string()
    } else {
        format!(
            "exported image {shown} ({}) to {} in {seconds:.1} s: {} of data written{}",
            human_size(size),
            if to_stdout {
                "standard output".to_owned()
            } else {
                args.file.display().to_string()
            },
            human_size(written),
            if to_stdout { "" } else { ", holes elsewhere" }
        )
    };
    // Standard output carries the disk's bytes: the report goes to standard error then.
    if to_stdout {
        note!("{report}");
    } else {
        outln!("{report}");
    }
    Ok(())
}

/// Give a new export the permissions and owner of the file it is to replace, as an overwrite
/// in place would have kept them (the user chose them; a new file gets 0600). The owner only
/// as far as the system lets this process (root, or a group it is in); the rest stays.
fn keep_permissions(file: &std::fs::File, old: &std::fs::Metadata) {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    let _ = std::os::unix::fs::fchown(file, Some(old.uid()), Some(old.gid()))
        .or_else(|_| std::os::unix::fs::fchown(file, None, Some(old.gid())));
    let mode = old.mode() & 0o7777;
    if let Err(e) = file.set_permissions(std::fs::Permissions::from_mode(mode)) {
        tracing::warn!(error = %e, mode = format!("{mode:o}"), "the export keeps mode 600");
    }
}

/// Give the complete, synced export `target` its name `file` (over a file of that name only
/// with `overwrite`, never over one made meanwhile without it). [`sync_export_name`] then
/// makes the name durable: an export reported done must not vanish, or bring the old file
/// back, at a power cut.
///
/// Why not always a hard link, then unlink: file systems without hard links (vfat and exFAT,
/// the usual USB stick) refuse it, after the whole copy. `RENAME_NOREPLACE` is the way; where
/// it is not supported (EINVAL: FUSE file systems such as exfat-fuse, some network ones), a
/// link and unlink; where neither is, a rename after a look for the name (a file made in
/// between would be replaced: the one case no call can rule out there).
fn name_export(target: &Path, file: &Path, overwrite: bool) -> Result<()> {
    use rustix::fs::{renameat_with, RenameFlags, CWD};
    use rustix::io::Errno;
    let made_meanwhile = || {
        anyhow::anyhow!(
            "a file of that name was made meanwhile by another program; pass --force to \
             overwrite it, or pick another name"
        )
    };
    let named = if overwrite {
        std::fs::rename(target, file).map_err(anyhow::Error::new)
    } else {
        match renameat_with(CWD, target, CWD, file, RenameFlags::NOREPLACE) {
            Err(Errno::INVAL) => match std::fs::hard_link(target, file) {
                Ok(()) => {
                    let _ = std::fs::remove_file(target);
                    Ok(())
                }
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Err(made_meanwhile()),
                Err(e)
                    if [Errno::PERM, Errno::NOTSUP, Errno::NOSYS]
                        .contains(&Errno::from_io_error(&e).unwrap_or(Errno::IO)) =>
                {
                    match std::fs::symlink_metadata(file) {
                        Ok(_) => Err(made_meanwhile()),
                        Err(_) => std::fs::rename(target, file).map_err(anyhow::Error::new),
                    }
                }
                Err(e) => Err(anyhow::Error::new(e)),
            },
            Err(Errno::EXIST) => Err(made_meanwhile()),
            other => other.map_err(|e| anyhow::Error::new(std::io::Error::from(e))),
        }
    };
    named.with_context(|| {
        format!(
            "naming the export {} (it was written as {})",
            file.display(),
            target.display()
        )
    })
}

/// Sync the directory of the export `file` once it is named (see [`name_export`]).
fn sync_export_name(file: &Path) -> Result<()> {
    let dir = match file.parent() {
        Some(dir) if !dir.as_os_str().is_empty() => dir,
        _ => Path::new("."),
    };
    std::fs::File::open(dir)
        .and_then(|d| d.sync_all())
        .with_context(|| {
            format!(
                "syncing directory {} after naming the export {} (the file is complete, but a \
                 power cut now could lose its name: run `sync`)",
                dir.display(),
                file.display()
            )
        })
}

/// Copy the whole image into `sink`, in order; returns the bytes written that were not
/// zeros left as holes. `shown` names the image as the user gave it (`IMAGE@SNAP` for a
/// snapshot, which the image's own errors do not name).
async fn copy_out(image: &Image, shown: &str, sink: &mut Sink, bar: &ProgressBar) -> Result<u64> {
    let size = image.size();
    let chunk = chunk_size(image);
    let extents = image.allocation(0, size).await.map_err(flat)?;
    let dense = matches!(sink, Sink::Stdout(_));
    // Holes become one piece (nothing to read); on standard output, chunks of zeros.
    let items: Vec<(u64, u64, bool)> = extents
        .iter()
        .flat_map(
            |&AllocationExtent {
                 offset,
                 len,
                 allocated,
             }| {
                let step = if allocated || dense { chunk } else { len };
                pieces(offset, len, step).map(move |(at, n)| (at, n, allocated))
            },
        )
        .collect();
    let stop = Arc::new(AtomicBool::new(false));
    let mut reads = stream::iter(items)
        .take_while(|_| std::future::ready(!stop.load(Ordering::Relaxed) && !interrupted()))
        .map(|(offset, n, allocated)| {
            let image = image.clone();
            let shown = shown.to_owned();
            async move {
                if !allocated {
                    return Ok((offset, n, None));
                }
                // The image's own buffer: the store's, decrypted in place.
                let buf = tokio::spawn(async move { image.read_owned(offset, n as usize).await })
                    .await
                    .context("an export task failed")?
                    .map_err(|e| match e {
                        ImageError::Integrity { .. } => anyhow::anyhow!(
                            "{e}; run `ivdisk verify {}` to list every damaged sector",
                            ivdisk_image::shell_word(&shown)
                        ),
                        e => flat(e),
                    })?;
                anyhow::Ok((offset, n, Some(buf)))
            }
        })
        .buffered(IN_FLIGHT);
    let mut written = 0;
    let mut error = None;
    let zeros = vec![0u8; chunk as usize];
    while let Some(done) = reads.next().await {
        if error.is_some() {
            continue;
        }
        let result = done.and_then(|(offset, n, data)| {
            match (&mut *sink, data) {
                (Sink::File(file), Some(buf)) => {
                    // Zero blocks stay holes (the file was made empty, at its full size).
                    for (at, len) in data_runs(&buf, 4096) {
                        let at_file = offset + at as u64;
                        file.write_all_at(&buf[at..at + len], at_file)
                            .with_context(|| format!("writing bytes [{at_file}, +{len})"))?;
                        written += len as u64;
                    }
                }
                (Sink::File(_), _) => {}
                (Sink::Stdout(out), Some(buf)) => {
                    out.write_all(&buf).context("writing to standard output")?;
                    written += n;
                }
                (Sink::Stdout(out), None) => {
                    out.write_all(&zeros[..n as usize])
                        .context("writing to standard output")?;
                    written += n;
                }
            }
            Ok(n)
        });
        match result {
            Ok(n) => bar.inc(n),
            Err(e) => {
                stop.store(true, Ordering::Relaxed);
                error = Some(e);
            }
        }
    }
    match error {
        Some(e) => Err(e),
        None if interrupted() => Err(interrupted_error()),
        None => Ok(written),
    }
}

// ---------------------------------------------------------------------------------------------
// verify

#[derive(Args)]
pub struct VerifyArgs {
    #[arg(help = IMAGE_HELP)]
    image: String,
    #[command(flatten)]
    passphrase: PassphraseArgs,
    /// Print JSON: image, snapshot, sector_size, sectors_checked, bad_lbas, bad_offsets, ok,
    /// authenticated; no progress bar.
    #[arg(long)]
    json: bool,
}

/// What verify found.
struct Report {
    sector_size: u64,
    sectors_checked: u64,
    bad_lbas: Vec<u64>,
    /// Sectors the store could not read (its damage), with what it said.
    unreadable: Vec<(u64, String)>,
    authenticated: bool,
    suite: String,
}

/// `ivdisk verify`: exits 0 when every sector read back authentic, 1 when some did not
/// (listed), 2 on any other error. `main` maps every error to 1, so this one exits itself;
/// the image and its store are dropped first (a local store that is not closed counts as an
/// unclean stop on its next open).
pub fn verify(args: VerifyArgs, rt: &Runtime) -> Result<()> {
    let json = args.json;
    let (uri, snapshot) = match parse_image_at(&args.image) {
        Ok(parsed) => parsed,
        Err(e) => exit_with(2, &e),
    };
    let shown = image_at(&uri, snapshot.as_deref());
    let report = match check(&uri, snapshot.as_deref(), &args.passphrase, json, rt) {
        Ok(report) => report,
        Err(e) => exit_with(2, &e),
    };
    let ss = report.sector_size;
    let offsets: Vec<u64> = report.bad_lbas.iter().map(|l| l * ss).collect();
    // A header that opened from its second copy: damage too, which a job checking `ok`
    // must hear of before that copy goes as well (the log's warning alone went unseen).
    let header_warning = crate::images::info_of(rt, &uri)
        .ok()
        .and_then(|info| info.header_warning);
    let ok = report.bad_lbas.is_empty() && report.unreadable.is_empty() && header_warning.is_none();
    if json {
        let unreadable: Vec<_> = report
            .unreadable
            .iter()
            .map(|(lba, reason)| json!({"lba": lba, "offset": lba * ss, "reason": reason}))
            .collect();
        outln!(
            "{}",
            json!({"image": uri.to_string(), "snapshot": snapshot, "sector_size": ss,
                   "sectors_checked": report.sectors_checked, "bad_lbas": report.bad_lbas,
                   "bad_offsets": offsets, "unreadable": unreadable, "ok": ok,
                   "authenticated": report.authenticated, "header_warning": header_warning})
        );
    } else {
        if let Some(warning) = &header_warning {
            outln!("image {shown}: {warning}; {}", crate::images::HEADER_REPAIR);
        }
        if report.bad_lbas.is_empty() && report.unreadable.is_empty() {
            outln!(
                "image {shown}: {} sector(s) of {ss} bytes checked ({}: every sector of the \
                 {} that hold data), all {}",
                report.sectors_checked,
                human_size(report.sectors_checked * ss),
                match uri.luks_file().is_some() {
                    true => "ranges of the file",
                    false => "objects",
                },
                if report.authenticated {
                    "authentic"
                } else {
                    "readable"
                }
            );
        }
        if !report.bad_lbas.is_empty() {
            outln!(
                "image {shown}: {} of {} sector(s) of {ss} bytes failed authentication \
                 (changed, moved or damaged in the store); they read as errors{}:",
                report.bad_lbas.len(),
                report.sectors_checked,
                if report.unreadable.is_empty() {
                    ", the rest is intact"
                } else {
                    ""
                }
            );
            for (first, last) in lba_runs(report.bad_lbas.iter().copied()) {
                outln!("  {}", describe_lbas(first, last, ss));
            }
        }
        if !report.unreadable.is_empty() {
            outln!(
                "image {shown}: {} of {} sector(s) of {ss} bytes cannot be read: the store is \
                 damaged there; they read as errors:",
                report.unreadable.len(),
                report.sectors_checked
            );
            // A run of sectors a line (a cut segment made thousands of lines, each with the
            // same words); --json lists every sector with its own reason.
            let mut reasons = report.unreadable.iter();
            for (first, last) in lba_runs(report.unreadable.iter().map(|(lba, _)| *lba)) {
                let run: Vec<&String> = reasons
                    .by_ref()
                    .take((last - first + 1) as usize)
                    .map(|(_, reason)| reason)
                    .collect();
                let alike = match run.iter().all(|r| *r == run[0]) {
                    true => "",
                    false => " (the first sector's; --json gives each its own)",
                };
                outln!("  {}: {}{alike}", describe_lbas(first, last, ss), run[0]);
            }
        }
    }
    if !report.authenticated {
        note!(
            "ivdisk: note: suite {} has no MAC: verify found every sector readable, but cannot \
             tell changed data from the original (an authenticated suite such as \
             aegis128l-random can)",
            report.suite
        );
    }
    if !ok {
        std::io::stdout().flush().ok();
        std::process::exit(1);
    }
    Ok(())
}

/// Runs of consecutive LBAs, as (first, last), of ascending `lbas`.
fn lba_runs(lbas: impl Iterator<Item = u64>) -> Vec<(u64, u64)> {
    let mut runs: Vec<(u64, u64)> = Vec::new();
    for lba in lbas {
        match runs.last_mut() {
            Some((_, last)) if lba == *last + 1 => *last = lba,
            _ => runs.push((lba, lba)),
        }
    }
    runs
}

/// `LBA 3 (byte offset 12288)`, or `LBAs 3-5 (byte offsets 12288-24575, 3 sectors)`.
fn describe_lbas(first: u64, last: u64, sector_size: u64) -> String {
    match first == last {
        true => format!("LBA {first} (byte offset {})", first * sector_size),
        false => format!(
            "LBAs {first}-{last} (byte offsets {}-{}, {} sectors)",
            first * sector_size,
            (last + 1) * sector_size - 1,
            last - first + 1
        ),
    }
}

/// The sectors of the chunk of `n` bytes at `offset` read one by one: those that fail
/// authentication, and those the store cannot read because it is damaged (with its reason).
/// Any other error (the store gone, a cluster down) ends the verify as before.
async fn sector_by_sector(
    image: &Image,
    offset: u64,
    n: u64,
) -> Result<(Vec<u64>, Vec<(u64, String)>)> {
    let ss = image.sector_size() as u64;
    let (mut bad, mut unreadable) = (Vec::new(), Vec::new());
    for at in (offset..offset + n).step_by(ss as usize) {
        match image.read_reply(at, ss as usize).await {
            Ok(_) => {}
            Err(ImageError::Integrity { lbas, .. }) => bad.extend(lbas),
            Err(ImageError::Store {
                source: StoreError::Corrupt(reason),
                ..
            }) => unreadable.push((at / ss, reason)),
            Err(e) => return Err(flat(e)),
        }
    }
    Ok((bad, unreadable))
}

/// Report `e` as every failure is reported, and end with exit code `code`.
pub fn exit_with(code: i32, e: &anyhow::Error) -> ! {
    crate::report_failure(e);
    std::io::stdout().flush().ok();
    std::process::exit(code)
}

fn check(
    uri: &ImageUri,
    snapshot: Option<&str>,
    passphrase: &PassphraseArgs,
    json: bool,
    rt: &Runtime,
) -> Result<Report> {
    let image = open_read_only_at(rt, uri, snapshot, passphrase)?;
    let chunk = chunk_size(&image);
    let ss = image.sector_size() as u64;
    let extents = rt
        .block_on(image.allocation(0, image.size()))
        .map_err(flat)?;
    let allocated: u64 = extents.iter().filter(|e| e.allocated).map(|e| e.len).sum();
    let bar = progress(allocated, "verifying", json);
    let stop = Arc::new(AtomicBool::new(false));
    let scanned = rt.block_on(async {
        let mut reads = stream::iter(
            extents
                .iter()
                .filter(|e| e.allocated)
                .flat_map(|e| pieces(e.offset, e.len, chunk)),
        )
        .take_while(|_| std::future::ready(!stop.load(Ordering::Relaxed)))
        .map(|(offset, n)| {
            let image = image.clone();
            tokio::spawn(async move {
                // As the NBD server reads: an `unaligned` run stays in its slots, where it
                // was decrypted; nothing here needs its plaintext in one piece.
                match image.read_reply(offset, n as usize).await {
                    Ok(_) => Ok((n, Vec::new(), Vec::new())),
                    // The other sectors of the chunk were read and authenticated.
                    Err(ImageError::Integrity { lbas, .. }) => Ok((n, lbas, Vec::new())),
                    // Damage in the store (a segment cut short, say) is what verify is run to
                    // find: the chunk is read again sector by sector, so that the report
                    // names exactly what cannot be read and the pass goes on.
                    Err(ImageError::Store {
                        source: StoreError::Corrupt(_),
                        ..
                    }) => sector_by_sector(&image, offset, n)
                        .await
                        .map(|(bad, lost)| (n, bad, lost)),
                    Err(e) => Err(flat(e)),
                }
            })
        })
        .buffer_unordered(IN_FLIGHT);
        let mut bad = Vec::new();
        let mut unreadable = Vec::new();
        let mut error = None;
        while let Some(done) = reads.next().await {
            match done.context("a verify task failed").and_then(|r| r) {
                Ok((n, lbas, lost)) => {
                    bar.inc(n);
                    bad.extend(lbas);
                    unreadable.extend(lost);
                }
                Err(e) => {
                    stop.store(true, Ordering::Relaxed);
                    error.get_or_insert(e);
                }
            }
        }
        match error {
            Some(e) => Err(e),
            None => Ok((bad, unreadable)),
        }
    });
    bar.finish_and_clear();
    let (mut bad_lbas, mut unreadable) = scanned?;
    bad_lbas.sort_unstable();
    bad_lbas.dedup();
    unreadable.sort_unstable();
    Ok(Report {
        sector_size: ss,
        sectors_checked: allocated / ss,
        bad_lbas,
        unreadable,
        authenticated: image.suite().is_authenticated(),
        suite: image.suite().name().to_owned(),
    })
}

#[cfg(test)]
mod tests {
    use ivdisk_header::{PbkdfKind, PbkdfRequest};
    use ivdisk_image::CreateOptions;

    use super::*;

    #[test]
    fn lbas_are_told_in_runs() {
        assert_eq!(
            lba_runs([3, 4, 5, 9, 11, 12].into_iter()),
            vec![(3, 5), (9, 9), (11, 12)]
        );
        assert!(lba_runs(std::iter::empty()).is_empty());
        assert_eq!(describe_lbas(9, 9, 4096), "LBA 9 (byte offset 36864)");
        assert_eq!(
            describe_lbas(3, 5, 512),
            "LBAs 3-5 (byte offsets 1536-3071, 3 sectors)"
        );
    }

    #[test]
    fn a_failed_import_deletes_the_half_made_image() {
        let rt = runtime();
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("short.raw");
        // 64 KiB of data where 1 MiB was promised (a file that shrank, a failing disk): the
        // copy fails after writing some chunks.
        std::fs::write(&path, vec![0x5A; 64 << 10]).unwrap();
        let uri = ImageUri::parse("mem:transfer-failed-import").unwrap();
        let mut options = CreateOptions::new(1 << 20);
        options.object_size = 64 << 10;
        options.pbkdf = PbkdfRequest::fast_for_tests(PbkdfKind::Pbkdf2);
        let image = rt.block_on(Image::create(&uri, &options, b"pw")).unwrap();
        let file = File::open(&path).unwrap();
        let target = NewImage {
            uri: &uri,
            made_dir: None,
            image,
        };
        let err =
            fill_or_delete(&rt, target, &path, file, 1 << 20, &ProgressBar::hidden()).unwrap_err();
        let text = format!("{err:#}");
        assert!(text.contains("was deleted"), "{text}");
        assert!(text.contains("got shorter while it was read"), "{text}");
        assert!(matches!(
            rt.block_on(Image::info(&uri)),
            Err(ImageError::NotFound { .. })
        ));
    }

    fn runtime() -> Runtime {
        tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .unwrap()
    }

    #[test]
    fn pieces_cover_the_range_in_chunks() {
        let got: Vec<_> = pieces(10, 25, 10).collect();
        assert_eq!(got, vec![(10, 10), (20, 10), (30, 5)]);
        assert_eq!(pieces(0, 0, 10).count(), 0);
    }
}
