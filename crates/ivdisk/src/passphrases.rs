//! `ivdisk passphrase add|remove|change|test IMAGE`: the keyslots of an image, with the image
//! commands' secret options (`--passphrase-file`/`--key-file` for a passphrase that opens the
//! image, `--new-passphrase-file`/`--new-key-file` for the new one, a no-echo prompt on a
//! terminal otherwise).
//!
//! ivdisk images change through `ivdisk-image` (the header object, one version-asserted store
//! operation; while `ivdisk serve` holds a local image open, the server stores the change this
//! command made, through its control socket); LUKS files made by cryptsetup through the
//! header-file code of `ivdisk key` ([`HeaderFile`]), their keyslots being in the file.
//!
//! When the new passphrase is typed, the existing one is checked first, so that a typo in it
//! is reported before the new one is asked for twice (at the cost of one more key derivation;
//! with files nothing is typed, and the change itself checks it).

use anyhow::{bail, Result};
use clap::{Args, Subcommand};
use ivdisk_header::HeaderError;
use ivdisk_image::{HeaderChange, Image, ImageError, ImageUri};
use serde_json::json;
use tokio::runtime::Runtime;
use zeroize::Zeroizing;

use crate::control::{ask_the_server, held_by_a_writer};
use crate::images::{flat, info_of, parse_uri};
use crate::keys::HeaderFile;
use crate::secrets::{print, with_spinner, NewPassphraseArgs, PassphraseArgs, PbkdfArgs};

/// What IMAGE may be for `ivdisk passphrase`.
const PASSPHRASE_IMAGE_HELP: &str = "The image: PATH or file:PATH (a local store directory, or a \
    LUKS2 file made by cryptsetup), rados://POOL/IMAGE?conf=PATH&id=CLIENT&namespace=NS, mem:NAME";

const KEYSLOT_NOTE: &str = "An image has up to 32 keyslots, each opening it with its own \
    passphrase; every keyslot holds the same volume key, so the data is not re-encrypted, and an \
    image being served keeps running (while `ivdisk serve` on this machine holds a local image \
    open, the command makes the keyslot change and the server stores it; a change of a LUKS \
    file being served is refused, naming its server: stop it first). A header backup made earlier still opens with \
    the passphrases valid when it was made.";

#[derive(Subcommand)]
pub enum PassphraseCommand {
    /// Add a passphrase (a new keyslot), authorised by a passphrase that opens the image.
    #[command(after_help = format!(
        "Example:\n  ivdisk passphrase add disk.ivd\n  ivdisk passphrase add 'rados://rbd/vm1?id=admin' --passphrase-file old.txt --new-passphrase-file new.txt --json\n\n{KEYSLOT_NOTE}"
    ))]
    Add(AddArgs),
    /// Remove the keyslot a passphrase opens (or the one named by --key-slot). The last
    /// keyslot stays unless --force: without any, nothing opens the image ever again.
    #[command(after_help = format!(
        "Example:\n  ivdisk passphrase remove disk.ivd --passphrase-file old.txt\n  ivdisk passphrase remove disk.ivd --key-slot 0 --passphrase-file other.txt\n\n{KEYSLOT_NOTE}"
    ))]
    Remove(RemoveArgs),
    /// Replace a passphrase by a new one, keeping its keyslot number.
    #[command(after_help = format!(
        "Example:\n  ivdisk passphrase change disk.ivd\n  ivdisk passphrase change disk.ivd --passphrase-file old.txt --new-passphrase-file new.txt\n\n{KEYSLOT_NOTE}"
    ))]
    Change(ChangeArgs),
    /// Check that a passphrase opens the image, and which keyslot it opens; changes nothing.
    /// Exit code 0 if it opens the image, 1 if it does not (with --json, `ok` says which), 2 on
    /// other errors (no such image, an unreadable passphrase file, a damaged header).
    #[command(
        after_help = "Example:\n  ivdisk passphrase test disk.ivd --passphrase-file pw.txt --json"
    )]
    Test(TestArgs),
}

#[derive(Args)]
pub struct TestArgs {
    #[arg(help = PASSPHRASE_IMAGE_HELP)]
    image: String,
    #[command(flatten)]
    passphrase: PassphraseArgs,
    /// Print JSON on standard output, also when the passphrase opens no keyslot: image, ok,
    /// keyslot (null when not ok).
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct AddArgs {
    #[arg(help = PASSPHRASE_IMAGE_HELP)]
    image: String,
    #[command(flatten)]
    passphrase: PassphraseArgs,
    #[command(flatten)]
    new: NewPassphraseArgs,
    #[command(flatten)]
    pbkdf: PbkdfArgs,
    /// Print JSON: image, keyslot (the new one), keyslots (all).
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct RemoveArgs {
    #[arg(help = PASSPHRASE_IMAGE_HELP)]
    image: String,
    #[command(flatten)]
    passphrase: PassphraseArgs,
    /// Remove this keyslot; the passphrase given may be that of any keyslot (it authorises the
    /// removal).
    #[arg(long, short = 'S', value_name = "N")]
    key_slot: Option<u32>,
    /// Allow removing the last keyslot: the image can then never be opened again.
    #[arg(long)]
    force: bool,
    /// Print JSON: image, removed, keyslots (those left).
    #[arg(long)]
    json: bool,
}

#[derive(Args)]
pub struct ChangeArgs {
    #[arg(help = PASSPHRASE_IMAGE_HELP)]
    image: String,
    #[command(flatten)]
    passphrase: PassphraseArgs,
    #[command(flatten)]
    new: NewPassphraseArgs,
    /// Change only this keyslot (the current passphrase must open it).
    #[arg(long, short = 'S', value_name = "N")]
    key_slot: Option<u32>,
    #[command(flatten)]
    pbkdf: PbkdfArgs,
    /// Print JSON: image, keyslot, keyslots.
    #[arg(long)]
    json: bool,
}

/// An image error with "nothing was changed" and, for a passphrase that matched no keyslot,
/// the newline hint of the secret options.
fn unchanged(e: ImageError, args: &PassphraseArgs, secret: &[u8]) -> anyhow::Error {
    let hint = match &e {
        ImageError::Header {
            source: HeaderError::WrongPassphrase { .. } | HeaderError::KeyslotMismatch { .. },
            ..
        } => args.unlock_hint(secret),
        _ => String::new(),
    };
    match e {
        // Its message already says so.
        ImageError::HeaderChanged { .. } => flat(e),
        e => anyhow::anyhow!("{e}; nothing was changed{hint}"),
    }
}

/// Store a keyslot change of an ivdisk image: through its store, or, while `ivdisk serve` on
/// this machine holds the local image open (a local store is open in one process at a time),
/// through that server's control socket (`control.rs`), which checks that it changes nothing
/// but keyslots. Either way it is stored in one operation asserting the header's version.
fn store_change(rt: &Runtime, uri: &ImageUri, change: HeaderChange) -> Result<()> {
    let e = match rt.block_on(change.store()) {
        Ok(()) => return Ok(()),
        Err(e) => e,
    };
    let request = match crate::control::header_change_request(&change) {
        Some(request) if held_by_a_writer(&e) => request,
        _ => return Err(unchanged_store(e)),
    };
    match ask_the_server(uri, request, rt) {
        Some(Ok(_)) => {
            tracing::info!(image = %uri, bytes = change.bytes(), "the image's server stored the keyslot change");
            Ok(())
        }
        // The server's answer says what happened (a refusal: that nothing was changed).
        Some(Err(refused)) => Err(refused.context(format!(
            "image {uri}: the `ivdisk serve` holding it open did not store the keyslot change"
        ))),
        None => Err(unchanged_store(e)),
    }
}

/// A keyslot change that could not be stored: nothing was.
fn unchanged_store(e: ImageError) -> anyhow::Error {
    match e {
        ImageError::HeaderChanged { .. } => flat(e),
        e => anyhow::anyhow!("{e}; nothing was changed"),
    }
}

/// The same for a LUKS file (errors of the header-file code).
fn file_unchanged(
    e: anyhow::Error,
    file: &HeaderFile,
    args: &PassphraseArgs,
    secret: &[u8],
) -> anyhow::Error {
    let hint = match e.downcast_ref::<HeaderError>() {
        Some(HeaderError::WrongPassphrase { .. } | HeaderError::KeyslotMismatch { .. }) => {
            args.unlock_hint(secret)
        }
        _ => String::new(),
    };
    // A change writes the new header, then wipes the old keyslot area: a failure after the
    // switch (the wipe, a sync) has changed the keyslots, and saying "nothing was changed"
    // sent the user off with a passphrase that no longer opens anything.
    if file.changed_on_disk() {
        return anyhow::anyhow!(
            "{}: {e:#}; the header WAS changed before this failed (see `ivdisk header dump {}` \
             for its keyslots now; a keyslot's old area may not have been wiped)",
            file.path().display(),
            ivdisk_image::shell_word(&file.path().to_string_lossy())
        );
    }
    anyhow::anyhow!(
        "{}: {e:#}; nothing was changed{hint}",
        file.path().display()
    )
}

fn slots(keyslots: &[u32]) -> String {
    keyslots
        .iter()
        .map(u32::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// The keyslots of an ivdisk image or LUKS file after a change.
fn keyslots_now(rt: &Runtime, uri: &ImageUri) -> Result<Vec<u32>> {
    Ok(info_of(rt, uri)?.keyslots)
}

/// Refuse, before any passphrase is asked for, a removal `remove_keyslot` would refuse.
fn check_removal(uri: &ImageUri, keyslots: &[u32], slot: Option<u32>, force: bool) -> Result<()> {
    if let Some(slot) = slot {
        if !keyslots.contains(&slot) {
            bail!(
                "image {uri}: keyslot {slot} does not exist (keyslots in use: {}); nothing was \
                 changed",
                slots(keyslots)
            );
        }
    }
    if keyslots.len() == 1 && !force {
        bail!(
            "image {uri}: {}; nothing was changed (and no passphrase was read or checked)",
            HeaderError::LastKeyslot(keyslots[0])
        );
    }
    Ok(())
}

pub fn run(command: PassphraseCommand, rt: &Runtime) -> Result<()> {
    match command {
        PassphraseCommand::Add(args) => add(args, rt),
        PassphraseCommand::Remove(args) => remove(args, rt),
        PassphraseCommand::Change(args) => change(args, rt),
        PassphraseCommand::Test(args) => test(args, rt),
    }
}

/// Exit code 1 is the answer "no" (the passphrase opens no keyslot); 2 any other failure, as
/// `verify`'s: a script tells a wrong passphrase from an image it could not read.
fn test(args: TestArgs, rt: &Runtime) -> Result<()> {
    match test_passphrase(args, rt) {
        Ok(Answer::Yes) => Ok(()),
        Ok(Answer::No(refusal)) => Err(refusal),
        Err(e) => crate::transfer::exit_with(2, &e),
    }
}

/// What `passphrase test` found out.
enum Answer {
    Yes,
    /// The passphrase opens no keyslot: why, said as the error.
    No(anyhow::Error),
}

fn test_passphrase(args: TestArgs, rt: &Runtime) -> Result<Answer> {
    let uri = parse_uri(&args.image)?;
    if uri.luks_file().is_none() {
        // A mistyped address is named before a passphrase is asked for.
        info_of(rt, &uri)?;
    }
    let secret = args.passphrase.existing()?;
    let opened = if let Some(path) = uri.luks_file() {
        let file = HeaderFile::open(path)?;
        file.unlock(&secret, None)
            .map(|(slot, _)| slot)
            .map_err(|e| match e.downcast::<HeaderError>() {
                Ok(e) => ImageError::Header {
                    image: uri.to_string(),
                    source: e,
                },
                Err(e) => ImageError::InvalidParameter {
                    image: uri.to_string(),
                    reason: format!("{e:#}"),
                },
            })
    } else {
        with_spinner(
            "checking the passphrase (the key derivation takes seconds by design)",
            || rt.block_on(Image::check_passphrase(&uri, &secret)),
        )
    };
    match opened {
        Ok(slot) => print(
            args.json,
            json!({"image": uri.to_string(), "ok": true, "keyslot": slot}),
            format!("image {uri}: keyslot {slot} opens with this passphrase"),
        ),
        Err(
            e @ ImageError::Header {
                source: HeaderError::WrongPassphrase { .. } | HeaderError::KeyslotMismatch { .. },
                ..
            },
        ) => {
            let hint = args.passphrase.unlock_hint(&secret);
            if args.json {
                outln!(
                    "{}",
                    json!({"image": uri.to_string(), "ok": false, "keyslot": null, "reason": e.to_string()})
                );
            }
            return Ok(Answer::No(anyhow::anyhow!("{e}{hint}")));
        }
        Err(e) => return Err(flat(e)),
    }
    Ok(Answer::Yes)
}

fn add(args: AddArgs, rt: &Runtime) -> Result<()> {
    let uri = parse_uri(&args.image)?;
    let pbkdf = args.pbkdf.request()?;
    args.new.check_against(&args.passphrase)?;
    let (slot, keyslots) = if let Some(path) = uri.luks_file() {
        let mut file = HeaderFile::open_for_change(path)?;
        let existing = args.passphrase.existing()?;
        let (_, key) = file
            .unlock(&existing, None)
            .map_err(|e| file_unchanged(e, &file, &args.passphrase, &existing))?;
        drop(existing);
        let new = args.new.read()?;
        // The key is checked against the header read under the lock (its digest).
        file.lock()?;
        let slot = file
            .add(&key, &new, None, &pbkdf)
            .map_err(|e| file_unchanged(e, &file, &args.passphrase, &[]))?;
        (slot, file.keyslots())
    } else {
        info_of(rt, &uri)?;
        let existing = args.passphrase.existing()?;
        if !args.new.given() {
            check_first(rt, &uri, &args.passphrase, &existing)?;
        }
        let new = args.new.read()?;
        let (slot, change) = with_spinner(
            "making the new keyslot (the key derivation takes seconds by design)",
            || rt.block_on(Image::prepare_add_passphrase(&uri, &existing, &new, &pbkdf)),
        )
        .map_err(|e| unchanged(e, &args.passphrase, &existing))?;
        store_change(rt, &uri, change)?;
        (slot, keyslots_now(rt, &uri)?)
    };
    print(
        args.json,
        json!({"image": uri.to_string(), "keyslot": slot, "keyslots": keyslots}),
        format!(
            "image {uri}: keyslot {slot} added; keyslots in use: {}",
            slots(&keyslots)
        ),
    );
    Ok(())
}

/// Check the existing passphrase of an ivdisk image before the new one is typed.
fn check_first(
    rt: &Runtime,
    uri: &ImageUri,
    args: &PassphraseArgs,
    existing: &Zeroizing<Vec<u8>>,
) -> Result<()> {
    with_spinner(
        "checking the passphrase (the key derivation takes seconds by design)",
        || rt.block_on(Image::check_passphrase(uri, existing)),
    )
    .map_err(|e| unchanged(e, args, existing))?;
    Ok(())
}

fn remove(args: RemoveArgs, rt: &Runtime) -> Result<()> {
    let uri = parse_uri(&args.image)?;
    let (removed, keyslots) = if let Some(path) = uri.luks_file() {
        let mut file = HeaderFile::open_for_change(path)?;
        check_removal(&uri, &file.keyslots(), args.key_slot, args.force)?;
        let secret = args.passphrase.existing()?;
        // Unlocked under the lock: which keyslot a passphrase opens is read there.
        if file.lock()? {
            check_removal(&uri, &file.keyslots(), args.key_slot, args.force)?;
        }
        let (opened, _) = file
            .unlock(&secret, None)
            .map_err(|e| file_unchanged(e, &file, &args.passphrase, &secret))?;
        let slot = args.key_slot.unwrap_or(opened);
        file.remove(slot, args.force)
            .map_err(|e| file_unchanged(e, &file, &args.passphrase, &secret))?;
        (slot, file.keyslots())
    } else {
        let before = info_of(rt, &uri)?;
        check_removal(&uri, &before.keyslots, args.key_slot, args.force)?;
        let secret = args.passphrase.existing()?;
        let (slot, change) = with_spinner(
            "unlocking (the key derivation takes seconds by design)",
            || {
                rt.block_on(Image::prepare_remove_passphrase(
                    &uri,
                    &secret,
                    args.key_slot,
                    args.force,
                ))
            },
        )
        .map_err(|e| unchanged(e, &args.passphrase, &secret))?;
        store_change(rt, &uri, change)?;
        (slot, keyslots_now(rt, &uri)?)
    };
    print(
        args.json,
        json!({"image": uri.to_string(), "removed": removed, "keyslots": keyslots}),
        format!(
            "image {uri}: keyslot {removed} removed; keyslots left: {}",
            if keyslots.is_empty() {
                "none (nothing opens this image any more)".to_owned()
            } else {
                slots(&keyslots)
            }
        ),
    );
    Ok(())
}

fn change(args: ChangeArgs, rt: &Runtime) -> Result<()> {
    let uri = parse_uri(&args.image)?;
    let pbkdf = args.pbkdf.request()?;
    args.new.check_against(&args.passphrase)?;
    let (slot, keyslots) = if let Some(path) = uri.luks_file() {
        let mut file = HeaderFile::open_for_change(path)?;
        let old = args.passphrase.existing()?;
        if !args.new.given() {
            file.unlock(&old, args.key_slot)
                .map_err(|e| file_unchanged(e, &file, &args.passphrase, &old))?;
        }
        let new = args.new.read()?;
        file.lock()?;
        let slot = file
            .change(&old, &new, args.key_slot, &pbkdf)
            .map_err(|e| file_unchanged(e, &file, &args.passphrase, &old))?;
        (slot, file.keyslots())
    } else {
        info_of(rt, &uri)?;
        let old = args.passphrase.existing()?;
        if !args.new.given() {
            check_first(rt, &uri, &args.passphrase, &old)?;
        }
        let new = args.new.read()?;
        let (slot, change) = with_spinner(
            "changing the passphrase (the key derivations take seconds by design)",
            || {
                rt.block_on(Image::prepare_change_passphrase(
                    &uri,
                    &old,
                    &new,
                    args.key_slot,
                    &pbkdf,
                ))
            },
        )
        .map_err(|e| unchanged(e, &args.passphrase, &old))?;
        store_change(rt, &uri, change)?;
        (slot, keyslots_now(rt, &uri)?)
    };
    print(
        args.json,
        json!({"image": uri.to_string(), "keyslot": slot, "keyslots": keyslots}),
        format!("image {uri}: keyslot {slot} now opens with the new passphrase; the old one no longer opens it"),
    );
    Ok(())
}
