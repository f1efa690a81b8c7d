use std::io;

/// Everything that can go wrong reading, unlocking or changing an image header.
///
/// Variants name the part of the header at fault and, where the user can act, what to do.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum HeaderError {
    #[error("reading the header failed at byte {offset}: {source}")]
    Io {
        offset: u64,
        #[source]
        source: io::Error,
    },

    /// Writing or syncing the header (or its keyslot areas) failed: the device's own error
    /// (no space, read-only, an IO error), not damage in what was read.
    #[error("writing the header failed at byte {offset}: {source}")]
    Write {
        offset: u64,
        #[source]
        source: io::Error,
    },

    #[error(
        "the header is truncated: {needed} bytes are needed at byte {offset}, but the device \
         ends before that"
    )]
    Truncated { offset: u64, needed: u64 },

    #[error(
        "{NO_LUKS_HEADER}; if this held an image, restore a header backup with `ivdisk header \
         restore`"
    )]
    NotLuks,

    #[error("unsupported LUKS version {0} (ivdisk reads LUKS1 and LUKS2)")]
    UnsupportedVersion(u16),

    #[error("{which} header is invalid: {reason}")]
    BinaryHeader { which: &'static str, reason: String },

    #[error("{which} LUKS2 header checksum does not match (the header is damaged)")]
    Checksum { which: &'static str },

    #[error(
        "{}; restore a header backup with `ivdisk header restore`",
        both_damaged(primary, secondary)
    )]
    BothHeadersDamaged { primary: String, secondary: String },

    #[error("LUKS2 JSON metadata is invalid: {0}")]
    Json(String),

    #[error("LUKS2 metadata is out of spec: {0}")]
    Metadata(String),

    #[error(
        "unsupported key derivation function `{0}` (ivdisk supports argon2id, argon2i and pbkdf2)"
    )]
    UnsupportedKdf(String),

    #[error("unsupported hash `{0}` (ivdisk supports sha1, sha256, sha512)")]
    UnsupportedHash(String),

    #[error("unsupported cipher `{0}` for {1} (ivdisk supports aes-xts-plain64 there)")]
    UnsupportedCipher(String, &'static str),

    #[error("key derivation failed: {0}")]
    Kdf(String),

    #[error(
        "no keyslot matches this passphrase ({tried} keyslot(s) tried{})",
        no_keyslots_note(*tried, *unusable)
    )]
    WrongPassphrase { tried: usize, unusable: usize },

    #[error("keyslot {0} does not exist")]
    NoSuchKeyslot(u32),

    #[error("keyslot {slot} does not match this passphrase")]
    KeyslotMismatch { slot: u32 },

    #[error(
        "keyslot {0} holds a key that is not the volume's (an unbound key, as `cryptsetup \
         luksAddKey --unbound` makes): it does not open the volume; name another keyslot"
    )]
    UnboundKeyslot(u32),

    #[error("keyslot {0} is already in use")]
    KeyslotInUse(u32),

    #[error("all {0} keyslots are in use; remove one first")]
    KeyslotsFull(usize),

    #[error("the keyslots area has no room for another {needed}-byte keyslot; remove one first")]
    KeyslotAreaFull { needed: u64 },

    #[error("the volume key does not match the header's digest (wrong volume key file?)")]
    VolumeKeyMismatch,

    #[error(
        "the volume key given is {given} bytes long, and this volume's key is {expected} bytes \
         (wrong volume key file? it holds the raw key, as `cryptsetup luksDump \
         --dump-volume-key --volume-key-file FILE` writes it)"
    )]
    VolumeKeyLength { given: usize, expected: usize },

    #[error(
        "keyslot {0} is the last one: removing it makes the image unopenable forever; pass \
         --force if that is what you want"
    )]
    LastKeyslot(u32),

    #[error("{0}")]
    InvalidParameter(String),

    /// The LUKS2 header carries mandatory requirements other than ivdisk's own (for example
    /// those of a cryptsetup reencryption that has not finished): ivdisk neither reads the
    /// data behind it nor changes it.
    #[error("{}", unmet_requirements(.0))]
    UnmetRequirements(Vec<String>),

    #[error(
        "this is a LUKS1 header; ivdisk opens LUKS1 volumes but changes keyslots only in LUKS2: \
         change them with cryptsetup (`cryptsetup luksAddKey`, `luksChangeKey`, `luksKillSlot`), \
         or convert the volume first (`cryptsetup convert --type luks2 FILE`, with a header \
         backup made before)"
    )]
    Luks1ReadOnly,

    #[error("the header backup is not usable: {0}")]
    Backup(String),

    #[error(transparent)]
    Crypto(#[from] ivdisk_crypto::CryptoError),

    #[error("the system random source failed: {0}")]
    Random(String),
}

/// What a header's foreign requirements mean and what to do about them.
fn unmet_requirements(requirements: &[String]) -> String {
    let list = requirements.join(", ");
    if requirements
        .iter()
        .any(|r| r.starts_with("online-reencrypt"))
    {
        format!(
            "a cryptsetup reencryption of this LUKS volume has started and not finished \
             (requirement {list}): part of its sectors may be under the new key and part under \
             the old; finish it with cryptsetup first (`cryptsetup reencrypt --resume-only \
             DEVICE`, or for a file `cryptsetup reencrypt --resume-only \
             --force-offline-reencrypt FILE`)"
        )
    } else {
        format!(
            "the LUKS volume carries requirements ivdisk does not know ({list}); finish or undo \
             what set them with the tool that set them first"
        )
    }
}

/// What follows the count of keyslots tried: why none was usable, or that there are none.
fn no_keyslots_note(tried: usize, unusable: usize) -> String {
    if tried == 0 {
        return ": the header has no keyslots left (the last one was removed), so no passphrase \
                opens it; restore a header backup made before (`ivdisk header restore`), or, \
                with the volume key in a file, add a keyslot with `ivdisk key add HEADER \
                --volume-key-file FILE` (of an image: `ivdisk header backup IMAGE HEADER` first, \
                then `ivdisk header restore IMAGE HEADER`)"
            .to_owned();
    }
    unusable_note(unusable)
}

fn unusable_note(unusable: usize) -> String {
    if unusable == 0 {
        String::new()
    } else {
        format!(", {unusable} of them unusable: see the log with IVDISK_LOG=warn")
    }
}

impl HeaderError {
    /// What is wrong, without the advice to restore a header backup: for a caller that has
    /// just restored one over it.
    pub fn damage(&self) -> String {
        match self {
            HeaderError::NotLuks => NO_LUKS_HEADER.to_owned(),
            HeaderError::BothHeadersDamaged { primary, secondary } => {
                both_damaged(primary, secondary)
            }
            other => other.to_string(),
        }
    }

    pub(crate) fn io(offset: u64, len: usize) -> impl FnOnce(io::Error) -> HeaderError {
        move |source| {
            if source.kind() == io::ErrorKind::UnexpectedEof {
                HeaderError::Truncated {
                    offset,
                    needed: len as u64,
                }
            } else {
                HeaderError::Io { offset, source }
            }
        }
    }
}

const NO_LUKS_HEADER: &str =
    "no LUKS header found (no LUKS magic at byte 0 or at any secondary header offset)";

fn both_damaged(primary: &str, secondary: &str) -> String {
    format!(
        "both LUKS2 headers are damaged ({}; {})",
        labelled("primary", primary),
        labelled("secondary", secondary)
    )
}

/// `text` with `which: ` in front, unless it already starts by naming that copy.
fn labelled(which: &str, text: &str) -> String {
    match text.starts_with(which) {
        true => text.to_owned(),
        false => format!("{which}: {text}"),
    }
}
