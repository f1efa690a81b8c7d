//! `ivdisk backup` and `ivdisk restore`: an image's ciphertext, metadata and header in one
//! portable file, and back into an image on any store, without the passphrase (the library
//! side, file format included, is `ivdisk_image`'s `backup.rs`).

use std::io::IsTerminal;
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use indicatif::{ProgressBar, ProgressStyle};
use ivdisk_image::{
    BackupOptions, BackupPhase, BackupProgress, BackupSummary, Image, ImageError, ImageUri,
};
use serde_json::{json, Value};
use tokio::runtime::Runtime;

use crate::images::{exact_size, flat, human_size, image_at, parse_image_at, parse_uri};

pub fn backup_help() -> &'static str {
    "Examples:\n  ivdisk backup disk.ivd disk.ivdbak\n  ivdisk snap create 'rados://rbd/vm1@nightly?id=admin'\n  ivdisk backup 'rados://rbd/vm1@nightly?id=admin' vm1-nightly.ivdbak --json\n  ivdisk backup 'rados://rbd/vm1@tuesday?id=admin' vm1-mon-tue.ivdbak --since nightly\n\n\
     No passphrase is needed: the file holds the image's header (its keyslots) and the \
     ciphertext and per-sector metadata of the sectors ever written, nothing decrypted; holes \
     and unwritten sectors take no space. It is written to FILE.partial.PID and renamed when \
     complete (a failure, Ctrl-C, SIGTERM, SIGHUP or SIGQUIT removes FILE.partial.PID; one that a backup killed outright left is removed by the next backup to FILE), and ends with a SHA-256 of its content (shown, and checked by `ivdisk restore`).\n\n\
     The head is read under the writer lock (refused while the image is served for writing); \
     a snapshot (IMAGE@SNAP) is read without it, with the size it had. With --since OLDER, only \
     the objects that changed between snapshot OLDER and SNAP go in (an incremental backup, \
     restored onto an image restored from OLDER's backup)."
}

pub fn restore_help() -> &'static str {
    "Examples:\n  ivdisk restore disk.ivdbak copy.ivd\n  ivdisk restore vm1-nightly.ivdbak 'rados://rbd/vm1-copy?id=admin' --json\n  ivdisk restore vm1-mon-tue.ivdbak 'rados://rbd/vm1-copy?id=admin'   # the increment, after the full backup\n\n\
     The whole file is checked first (its SHA-256, every record's checksum, its structure): a \
     truncated or changed file is refused before anything is created. A full backup creates \
     IMAGE (which must not exist): its header first, marked unfinished (every open refuses \
     it, and `ivdisk delete` removes a restore killed outright), under the image's writer lock \
     (`ivdisk lock status` names the restore), then the data; it removes everything it wrote \
     if it fails. The image opens with the passphrases it had when it was backed up, and keeps \
     its image id, so a store can hold one restore of an image. An incremental backup updates \
     an image restored from the backup of its --since snapshot, and is refused anywhere else \
     (another image, another snapshot, or an image written since its restore where the \
     increment changes it)."
}

#[derive(Args)]
pub struct BackupArgs {
    /// The image, or one of its snapshots as IMAGE@SNAP: PATH, rados://POOL/IMAGE?..., mem:NAME.
    image: String,
    /// The backup file to write.
    file: PathBuf,
    /// Incremental: only what changed since this older snapshot of the image (needs
    /// IMAGE@SNAP).
    #[arg(long, value_name = "SNAP")]
    since: Option<String>,
    /// Overwrite FILE if it exists.
    #[arg(long)]
    force: bool,
    /// Print JSON: image, file, kind, snapshot, base, image_id, cipher, layout, size, objects,
    /// removed, data_bytes, bytes, seconds, sha256; no progress bar.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct RestoreArgs {
    /// The backup file (from `ivdisk backup`).
    file: PathBuf,
    /// The image to create (full backup) or update (incremental backup): PATH or file:PATH
    /// (a new local store directory), rados://POOL/IMAGE?conf=PATH&id=CLIENT&namespace=NS,
    /// mem:NAME.
    image: String,
    /// Print JSON: image, file, kind, snapshot, base, image_id, cipher, layout, size, objects,
    /// removed, data_bytes, bytes, seconds, sha256; no progress bar.
    #[arg(long)]
    json: bool,
}

/// A progress bar on a terminal's stderr that follows the phases; hidden otherwise.
struct Bar {
    bar: ProgressBar,
    phase: Option<BackupPhase>,
}

impl Bar {
    fn new(json: bool) -> Bar {
        let bar = if json || !std::io::stderr().is_terminal() {
            ProgressBar::hidden()
        } else {
            ProgressBar::new(0)
        };
        Bar { bar, phase: None }
    }

    fn update(&mut self, p: BackupProgress) {
        if self.phase != Some(p.phase) {
            self.phase = Some(p.phase);
            let (template, message) = match p.phase {
                BackupPhase::Reading => (
                    "{msg} {bar:40} {pos}/{len} objects ({per_sec}, {eta} left)",
                    "backing up",
                ),
                BackupPhase::Verifying => (
                    "{msg} {bar:40} {binary_bytes}/{binary_total_bytes} ({binary_bytes_per_sec}, {eta} left)",
                    "checking the file",
                ),
                BackupPhase::Writing => (
                    "{msg} {bar:40} {binary_bytes}/{binary_total_bytes} ({binary_bytes_per_sec}, {eta} left)",
                    "restoring",
                ),
            };
            self.bar.set_style(
                ProgressStyle::with_template(template).expect("a valid progress template"),
            );
            self.bar.set_message(message);
            self.bar.reset();
        }
        self.bar.set_length(p.total);
        self.bar.set_position(p.done);
    }
}

fn summary_json(s: &BackupSummary) -> Value {
    let d = &s.description;
    json!({
        "kind": d.kind,
        "snapshot": d.snapshot,
        "base": d.base.as_ref().map(|b| json!({"snapshot": b.snapshot, "size": b.size})),
        "image_id": d.image_id,
        "cipher": d.suite,
        "layout": d.layout,
        "size": d.size,
        "objects": s.objects,
        "removed": s.removed,
        "data_bytes": s.data_bytes,
        "bytes": s.file_bytes,
        "seconds": s.seconds,
        "sha256": s.sha256,
    })
}

fn what(s: &BackupSummary) -> String {
    let d = &s.description;
    let source = match &d.snapshot {
        Some(snap) => ivdisk_image::at_snapshot(&d.image, snap),
        None => d.image.clone(),
    };
    match &d.base {
        Some(base) => format!(
            "the changes of {source} since snapshot {}: {} object(s) changed, {} removed",
            base.snapshot, s.objects, s.removed
        ),
        None => format!(
            "{source} ({}, {} object(s) with data)",
            exact_size(d.size),
            s.objects
        ),
    }
}

pub fn backup(args: BackupArgs, rt: &Runtime) -> Result<()> {
    if args.file == std::path::Path::new("-") {
        // Not a file named '-' (as before): a backup only exists once complete (renamed
        // from FILE.partial.PID), which a stream cannot promise.
        anyhow::bail!(
            "a backup is written to a file (FILE.partial.PID, renamed when complete), not to \
             standard output; give a file name, and copy the file where it goes (scp, rsync)"
        );
    }
    let (uri, snapshot) = parse_image_at(&args.image)?;
    if args.since.is_some() && snapshot.is_none() {
        anyhow::bail!(
            "--since needs the newer snapshot too: write IMAGE@SNAP (an increment goes from \
             snapshot {} to SNAP)",
            args.since.as_deref().unwrap_or_default()
        );
    }
    crate::transfer::check_output_file(
        &args.file,
        args.force,
        "a backup is a regular file (FILE.partial.PID, renamed when complete)",
    )?;
    // Written over a file of its own store (`--force`), a backup destroyed the image (and,
    // once the store was opened again, the backup itself), and said it had made one.
    crate::transfer::refuse_target_in_image(
        &uri,
        &image_at(&uri, snapshot.as_deref()),
        &args.file,
        "a backup written there would destroy the image it backs up",
    )?;
    let options = BackupOptions {
        snapshot,
        since: args.since.clone(),
        overwrite: args.force,
    };
    let mut bar = Bar::new(args.json);
    // SIGINT, SIGTERM, SIGHUP or SIGQUIT stops the backup (its future is dropped at an await: the writer lock
    // of a head backup is released as it drops) and its FILE.partial.PID is removed, as after a
    // failed backup; killed outright, the process left it behind. Once FILE.partial.PID has been
    // renamed to FILE the backup is made: then it finishes.
    let identity =
        |path: &std::path::Path| std::fs::metadata(path).ok().map(|m| (m.dev(), m.ino()));
    let file_before = identity(&args.file);
    let finished = rt
        .block_on(async {
            use tokio::signal::unix::{signal, SignalKind};
            let mut interrupt = signal(SignalKind::interrupt())?;
            let mut terminate = signal(SignalKind::terminate())?;
            // As the other copying commands: a closed terminal (SIGHUP) killed a backup
            // outright, and SIGQUIT was not heard.
            let mut hangup = signal(SignalKind::hangup())?;
            let mut quit = signal(SignalKind::quit())?;
            let mut backup =
                std::pin::pin!(Image::backup(&uri, &options, &args.file, |p| bar.update(p)));
            tokio::select! {
                biased;
                result = &mut backup => return Ok(Some(result)),
                _ = interrupt.recv() => {}
                _ = terminate.recv() => {}
                _ = hangup.recv() => {}
                _ = quit.recv() => {}
            }
            // (The backup is not running meanwhile: it waits at an await.)
            if identity(&args.file) != file_before {
                return Ok(Some(backup.await));
            }
            Ok::<_, std::io::Error>(None)
        })
        .context("installing the signal handlers")?;
    bar.bar.finish_and_clear();
    let Some(result) = finished else {
        let partial = ivdisk_image::partial_path(&args.file);
        let _ = std::fs::remove_file(&partial);
        anyhow::bail!(
            "interrupted (a signal): no backup was made, and {} was removed",
            partial.display()
        );
    };
    let summary = result.map_err(|e| backup_error(e, &uri))?;
    let mut value = summary_json(&summary);
    value["image"] = json!(uri.to_string());
    value["file"] = crate::secrets::json_path(&args.file);
    crate::secrets::print(
        args.json,
        value,
        format!(
            "backed up {} into {} ({}) in {:.1} s; SHA-256 {}",
            what(&summary),
            args.file.display(),
            human_size(summary.file_bytes),
            summary.seconds,
            summary.sha256
        ),
    );
    Ok(())
}

/// The library's error, with a hint where the command line knows one.
fn backup_error(e: ImageError, uri: &ImageUri) -> anyhow::Error {
    match e {
        ImageError::Locked { .. } => anyhow::anyhow!(
            "{e}; or back up a snapshot, which needs no lock: `ivdisk snap create {}` (a \
             running `ivdisk serve` on this machine takes it live), then `ivdisk backup {} \
             FILE`",
            ivdisk_image::shell_word(&uri.at_snapshot("NAME")),
            ivdisk_image::shell_word(&uri.at_snapshot("NAME"))
        ),
        // Its own hint ("open it read-only") does not apply: the head is read under the
        // writer lock.
        ImageError::Store {
            image,
            source: ivdisk_store::StoreError::NotWritable { path, reason },
        } => anyhow::anyhow!(
            "image {image}: the store at {path} cannot be opened for writing ({reason}), and a \
             backup of the head takes the image's writer lock; back up one of its snapshots \
             (`ivdisk backup {} FILE`, read without the lock), or make the store writable",
            ivdisk_image::shell_word(&uri.at_snapshot("NAME"))
        ),
        e => flat(e),
    }
}

pub fn restore(args: RestoreArgs, rt: &Runtime) -> Result<()> {
    let uri = parse_uri(&args.image)?;
    crate::transfer::check_source_kind(
        &args.file,
        false,
        "restore reads a backup file (made by `ivdisk backup`) twice: checked whole, then \
         written",
    )?;
    // A full restore makes the image: not inside another's store (an increment goes onto
    // an image that exists).
    if let Err(ImageError::NotFound { .. }) = rt.block_on(Image::info(&uri)) {
        crate::transfer::refuse_inside_another_store(&uri)?;
    }
    let mut bar = Bar::new(args.json);
    // A failed full restore removes what it wrote; a local store directory made for it goes too.
    let made_dir = crate::transfer::store_dir_to_make(&uri);
    // SIGINT, SIGTERM, SIGHUP or SIGQUIT stops it between records, and it cleans up as after a
    // failure (killed outright, a full restore leaves its image marked unfinished, which
    // `ivdisk delete` removes).
    crate::transfer::stop_copies_on_signals(rt)?;
    let result = rt.block_on(Image::restore_backup_until(
        &args.file,
        &uri,
        |p| bar.update(p),
        &crate::transfer::INTERRUPTED,
    ));
    bar.bar.finish_and_clear();
    let summary = result.map_err(|e| {
        let removed = crate::transfer::remove_made_dir(crate::transfer::made_dir_unless_taken(
            made_dir.as_deref(),
            &e,
        ));
        if matches!(e, ImageError::Stopped { .. }) {
            return anyhow::anyhow!(
                "restoring {} was interrupted (a signal): a full backup's restore \
                 removes what it wrote{removed}; an incremental one is finished by running the \
                 same restore again",
                args.file.display()
            );
        }
        match removed {
            removed if removed.is_empty() => flat(e),
            removed => flat(e).context(format!(
                "restoring {} into {uri} failed; what it wrote was removed{removed}",
                args.file.display()
            )),
        }
    })?;
    let mut value = summary_json(&summary);
    value["image"] = json!(uri.to_string());
    value["file"] = crate::secrets::json_path(&args.file);
    crate::secrets::print(
        args.json,
        value,
        format!(
            "restored {} from {} into image {uri} in {:.1} s (file SHA-256 {} checked); it opens \
             with the passphrases it had when backed up",
            what(&summary),
            args.file.display(),
            summary.seconds,
            summary.sha256
        ),
    );
    Ok(())
}
