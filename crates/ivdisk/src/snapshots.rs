//! `ivdisk snap create|ls|rm|rollback`: snapshots of an image, by `IMAGE@SNAP`. No passphrase
//! is needed (a snapshot copies ciphertext, it never decrypts); create, rm and rollback take
//! the image's writer lock, so they refuse while the image is open for writing, except that
//! create and rm ask an `ivdisk serve` of this machine holding it to do it itself
//! (`control.rs`).

use anyhow::{bail, Result};
use clap::{Args, Subcommand};
use indicatif::{ProgressBar, ProgressStyle};
use ivdisk_image::{Image, ImageUri, SnapshotInfo};
use serde_json::{json, Value};
use tokio::runtime::Runtime;

use crate::control::{ask_the_server, held_by_a_writer};
use crate::images::{exact_size, flat};

#[derive(Subcommand)]
pub enum SnapCommand {
    /// Take a snapshot: what IMAGE reads now, kept read-only under NAME.
    #[command(
        after_help = "Example:\n  ivdisk snap create disk.ivd@before-upgrade\n  ivdisk snap create 'rados://rbd/vm1@nightly?id=admin' --json\n\nWhile `ivdisk serve` on this machine holds the image open for writing, the server takes the snapshot (through its control socket): it waits for the writes in flight, flushes, and keeps the snapshot from then on. The snapshot holds every write the server acknowledged, as after a power cut: what a guest still had in its own cache is not in it. An image open for writing elsewhere refuses."
    )]
    Create(SnapArgs),
    /// List an image's snapshots, oldest first.
    #[command(
        after_help = "Example:\n  ivdisk snap ls disk.ivd\n  ivdisk snap ls disk.ivd --json | jq '.[].name'"
    )]
    Ls(ListArgs),
    /// Remove a snapshot; the data only it kept is freed.
    #[command(
        after_help = "Example:\n  ivdisk snap rm disk.ivd@before-upgrade\n\nWhile `ivdisk serve` on this machine holds the image open for writing, the server removes it (through its control socket). Refused while another command reads the snapshot (`ivdisk serve IMAGE@SNAP`, an export, a backup), naming that process (and its host, on RADOS)."
    )]
    Rm(SnapArgs),
    /// Put IMAGE back to a snapshot (its data and its size); later snapshots stay.
    #[command(
        after_help = "Example:\n  ivdisk snap rollback disk.ivd@before-upgrade\n\nEverything written since the snapshot is lost unless another snapshot keeps it. The image must not be open for writing, and no other command may be reading it (`ivdisk serve --read-only`, an export, a verify of the image itself; readers of its snapshots do not count): the rollback is refused, naming that process. An image restored from backups takes no further incremental restores after a rollback (restore a full backup)."
    )]
    Rollback(SnapArgs),
}

#[derive(Args)]
pub struct SnapArgs {
    /// IMAGE@SNAP: the image (PATH, rados://POOL/IMAGE?..., mem:NAME) and the snapshot name
    /// (rados://POOL/IMAGE@SNAP?conf=...).
    image: String,
    /// Print JSON instead of text; no progress bar.
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct ListArgs {
    /// The image (PATH, rados://POOL/IMAGE?..., mem:NAME).
    image: String,
    /// Print a JSON array (name, id, size, created) instead of a table.
    #[arg(long)]
    json: bool,
}

fn image_at(text: &str) -> Result<(ImageUri, String)> {
    let (uri, snapshot) = ImageUri::parse_with_snapshot(text).map_err(flat)?;
    match snapshot {
        Some(name) => Ok((uri, name)),
        None => bail!("`{text}` names no snapshot: write IMAGE@SNAP (e.g. disk.ivd@monday)"),
    }
}

/// The snapshot in a server's answer to `snap-create`.
fn snapshot_info(reply: &Value) -> Result<SnapshotInfo> {
    let snapshot = &reply["snapshot"];
    let Some(name) = snapshot["name"].as_str() else {
        bail!("the server answered {reply}");
    };
    Ok(SnapshotInfo {
        name: name.to_owned(),
        id: snapshot["id"].as_u64().unwrap_or_default(),
        size: snapshot["size"].as_u64().unwrap_or_default(),
        created: snapshot["created"].as_u64().unwrap_or_default(),
        uid: snapshot["uid"].as_str().map(str::to_owned),
    })
}

pub fn snapshot_json(s: &SnapshotInfo) -> Value {
    json!({"name": s.name, "id": s.id, "size": s.size, "created": s.created, "uid": s.uid})
}

pub fn run(command: SnapCommand, rt: &Runtime) -> Result<()> {
    match command {
        SnapCommand::Create(args) => {
            let (uri, name) = image_at(&args.image)?;
            let snap = match rt.block_on(Image::create_snapshot_of(&uri, &name)) {
                Ok(snap) => snap,
                Err(e) if held_by_a_writer(&e) => {
                    let request = json!({"command": "snap-create", "snapshot": name});
                    let reply =
                        ask_the_server(&uri, request, rt).unwrap_or_else(|| Err(flat(e)))?;
                    snapshot_info(&reply)?
                }
                Err(e) => return Err(flat(e)),
            };
            if args.json {
                outln!(
                    "{}",
                    json!({"image": uri.to_string(), "snapshot": snapshot_json(&snap)})
                );
            } else {
                outln!(
                    "created snapshot {} ({}); open it read-only as {}",
                    uri.at_snapshot(&snap.name),
                    exact_size(snap.size),
                    uri.at_snapshot(&snap.name)
                );
            }
        }
        SnapCommand::Ls(args) => {
            let uri = crate::images::parse_uri(&args.image)?;
            let snaps = rt.block_on(Image::snapshots(&uri)).map_err(flat)?;
            if args.json {
                outln!(
                    "{}",
                    Value::Array(snaps.iter().map(snapshot_json).collect())
                );
            } else if snaps.is_empty() {
                outln!("image {uri} has no snapshots");
            } else {
                outln!("{:<24} {:>6} {:>12}  created (UTC)", "name", "id", "size");
                for s in &snaps {
                    outln!(
                        "{:<24} {:>6} {:>12}  {}",
                        s.name,
                        s.id,
                        exact_size(s.size),
                        utc(s.created)
                    );
                }
            }
        }
        SnapCommand::Rm(args) => {
            let (uri, name) = image_at(&args.image)?;
            match rt.block_on(Image::remove_snapshot(&uri, &name)) {
                Ok(()) => {}
                Err(e) if held_by_a_writer(&e) => {
                    let request = json!({"command": "snap-rm", "snapshot": name});
                    ask_the_server(&uri, request, rt).unwrap_or_else(|| Err(flat(e)))?;
                }
                Err(e) => return Err(flat(e)),
            }
            if args.json {
                outln!("{}", json!({"image": uri.to_string(), "removed": name}));
            } else {
                outln!("removed snapshot {}", uri.at_snapshot(&name));
            }
        }
        SnapCommand::Rollback(args) => {
            let (uri, name) = image_at(&args.image)?;
            let bar = if args.json {
                ProgressBar::hidden()
            } else {
                let bar = ProgressBar::new(0);
                bar.set_style(
                    ProgressStyle::with_template(
                        "rolling back {bar:40} {pos}/{len} objects ({eta} left)",
                    )
                    .expect("a valid progress template"),
                );
                bar
            };
            let rollback = Image::rollback_snapshot(&uri, &name, |done, all| {
                bar.set_length(all);
                bar.set_position(done);
            });
            let snap = rt.block_on(unless_interrupted(rollback));
            bar.finish_and_clear();
            let Some(snap) = snap? else {
                // Stopped before the rollback was recorded, it changed nothing.
                let recorded = rt
                    .block_on(Image::info(&uri))
                    .map_or(true, |info| info.unfinished.is_some());
                if !recorded {
                    bail!(
                        "{}: the rollback of image {uri} to snapshot {name} was stopped before it \
                         changed anything; the image is as it was",
                        crate::transfer::interrupted_error()
                    );
                }
                let at = uri.at_snapshot(&name);
                let again = ivdisk_image::shell_word(&at);
                bail!(
                    "{}: the rollback of image {uri} to snapshot {name} stopped part-way; until \
                     it is finished every open refuses the image (its objects are of two \
                     states): run `ivdisk snap rollback {again}` again to finish it",
                    crate::transfer::interrupted_error()
                );
            };
            let snap = snap.map_err(flat)?;
            if args.json {
                outln!(
                    "{}",
                    json!({"image": uri.to_string(), "rolled_back_to": snapshot_json(&snap)})
                );
            } else {
                outln!(
                    "image {uri} rolled back to snapshot {} ({})",
                    snap.name,
                    exact_size(snap.size)
                );
            }
        }
    }
    Ok(())
}

/// `work` to its end, or `None` when a SIGINT, SIGTERM, SIGHUP or SIGQUIT comes first (the
/// work is dropped where it was): a rollback that died of the signal said nothing, and left
/// the user to find out from the next command that it had not finished.
async fn unless_interrupted<T>(work: impl std::future::Future<Output = T>) -> Result<Option<T>> {
    use tokio::signal::unix::{signal, SignalKind};
    let mut interrupt = signal(SignalKind::interrupt())?;
    let mut terminate = signal(SignalKind::terminate())?;
    let mut hangup = signal(SignalKind::hangup())?;
    let mut quit = signal(SignalKind::quit())?;
    Ok(tokio::select! {
        done = work => Some(done),
        _ = interrupt.recv() => None,
        _ = terminate.recv() => None,
        _ = hangup.recv() => None,
        _ = quit.recv() => None,
    })
}

/// Seconds since the epoch as `YYYY-MM-DD HH:MM:SS` (UTC), without a date crate.
fn utc(secs: u64) -> String {
    let days = (secs / 86_400) as i64;
    let rem = secs % 86_400;
    // Howard Hinnant's civil-from-days.
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let day = doy - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + (month <= 2) as i64;
    format!(
        "{year:04}-{month:02}-{day:02} {:02}:{:02}:{:02}",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn utc_dates() {
        assert_eq!(utc(0), "1970-01-01 00:00:00");
        assert_eq!(utc(951_782_400), "2000-02-29 00:00:00");
        assert_eq!(utc(1_795_000_000), "2026-11-18 11:06:40");
    }
}
