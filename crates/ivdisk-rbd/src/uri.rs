//! `rbd://POOL/IMAGE[@SNAP]?conf=PATH&id=CLIENT&keyring=PATH&namespace=NS&encryption=KIND`:
//! librbd images, addressed in the style (and with the query keys) of ivdisk's
//! `rados://POOL/IMAGE` image addresses, plus a snapshot and the encryption to load.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

use ivdisk_rados::RadosConfig;

use crate::{EncryptionKind, RbdError};

/// The scheme of librbd image addresses.
pub const SCHEME: &str = "rbd://";

/// How long a request may wait for the OSDs before it fails (`ETIMEDOUT`), unless the Ceph
/// config file sets `rados_osd_op_timeout` itself; the same bound rados:// images have.
pub const RBD_OP_TIMEOUT: Duration = Duration::from_secs(60);

/// A parsed `rbd://` address.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RbdUri {
    /// Pool, namespace, conf, client id and keyring (connect timeout and the rest: defaults).
    pub config: RadosConfig,
    pub image: String,
    pub snapshot: Option<String>,
    /// `encryption=` (default `auto`).
    pub encryption: EncryptionKind,
}

impl RbdUri {
    /// Whether `text` is an `rbd://` address (so callers can route it here).
    pub fn is_rbd(text: &str) -> bool {
        text.starts_with(SCHEME)
    }

    pub fn parse(text: &str) -> Result<RbdUri, RbdError> {
        let bad = |reason: &str| RbdError::InvalidUri {
            uri: text.to_owned(),
            reason: reason.to_owned(),
        };
        let rest = text
            .strip_prefix(SCHEME)
            .ok_or_else(|| bad("expected rbd://POOL/IMAGE"))?;
        let (path, query) = rest.split_once('?').unwrap_or((rest, ""));
        let (pool, image) = path
            .split_once('/')
            .ok_or_else(|| bad("expected rbd://POOL/IMAGE[@SNAP]"))?;
        let (image, snapshot) = match image.split_once('@') {
            Some((image, snap)) => (image, Some(snap)),
            None => (image, None),
        };
        // rbd itself refuses '/' and '@' in pool and image names; '@' is the snapshot mark.
        let valid = |s: &str| {
            !s.is_empty()
                && s.bytes()
                    .all(|b| b.is_ascii_graphic() && b != b'/' && b != b'@')
        };
        if !valid(pool) || !valid(image) {
            return Err(bad(
                "pool and image names must be non-empty printable ASCII without '/' or '@'",
            ));
        }
        if snapshot.is_some_and(|s| !valid(s)) {
            return Err(bad(
                "the snapshot name after '@' must be non-empty printable ASCII without '/' or '@'",
            ));
        }
        let mut config = RadosConfig::new(pool);
        // As rados:// images: with every OSD of an object down, librbd would wait forever
        // (opens, reads, writes, the close), and so would the command or the NBD client.
        config.op_timeout = Some(RBD_OP_TIMEOUT);
        let mut uri = RbdUri {
            config,
            image: image.to_owned(),
            snapshot: snapshot.map(str::to_owned),
            encryption: EncryptionKind::Auto,
        };
        let mut seen = Vec::new();
        for pair in query.split('&').filter(|p| !p.is_empty()) {
            let (key, value) = pair
                .split_once('=')
                .ok_or_else(|| bad(&format!("query part `{pair}` is not KEY=VALUE")))?;
            // Not the last one taken: `encryption=luks2&encryption=none` served the raw image,
            // header and all, writable.
            if seen.contains(&key) {
                return Err(bad(&format!("parameter `{key}` is given twice")));
            }
            seen.push(key);
            match key {
                "conf" => uri.config.conf = Some(PathBuf::from(value)),
                "id" => uri.config.client_id = value.trim_start_matches("client.").to_owned(),
                "keyring" => uri.config.keyring = Some(PathBuf::from(value)),
                "namespace" => uri.config.namespace = value.to_owned(),
                "encryption" => uri.encryption = value.parse().map_err(|e: String| bad(&e))?,
                other => {
                    return Err(bad(&format!(
                        "unknown parameter `{other}` (known: conf, id, keyring, namespace, \
                         encryption)"
                    )))
                }
            }
        }
        Ok(uri)
    }

    /// `POOL/IMAGE[@SNAP]`, as the `rbd` tool names images (namespace: `POOL/NS/IMAGE`).
    pub fn spec(&self) -> String {
        image_spec(&self.config, &self.image, self.snapshot.as_deref())
    }
}

/// `POOL[/NS]/IMAGE[@SNAP]`, the `rbd` tool's image spec.
pub fn image_spec(config: &RadosConfig, image: &str, snapshot: Option<&str>) -> String {
    let mut spec = config.pool.clone();
    if !config.namespace.is_empty() {
        spec.push('/');
        spec.push_str(&config.namespace);
    }
    spec.push('/');
    spec.push_str(image);
    if let Some(snap) = snapshot {
        spec.push('@');
        spec.push_str(snap);
    }
    spec
}

impl fmt::Display for RbdUri {
    /// The address without conf, id and keyring (which say nothing about the image).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{SCHEME}{}/{}", self.config.pool, self.image)?;
        if let Some(snap) = &self.snapshot {
            write!(f, "@{snap}")?;
        }
        let mut sep = '?';
        if !self.config.namespace.is_empty() {
            write!(f, "{sep}namespace={}", self.config.namespace)?;
            sep = '&';
        }
        if self.encryption != EncryptionKind::Auto {
            write!(f, "{sep}encryption={}", self.encryption)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn addresses_parse_with_their_query_keys() {
        let uri = RbdUri::parse(
            "rbd://rbd/vm1@snap1?conf=/etc/ceph/c.conf&id=client.bench&keyring=/k&namespace=ns&encryption=luks2",
        )
        .unwrap();
        assert_eq!(uri.config.pool, "rbd");
        assert_eq!(uri.image, "vm1");
        assert_eq!(uri.snapshot.as_deref(), Some("snap1"));
        assert_eq!(uri.config.conf, Some(PathBuf::from("/etc/ceph/c.conf")));
        assert_eq!(uri.config.client_id, "bench");
        assert_eq!(uri.config.keyring, Some(PathBuf::from("/k")));
        assert_eq!(uri.config.namespace, "ns");
        assert_eq!(uri.encryption, EncryptionKind::Luks2);
        assert_eq!(uri.spec(), "rbd/ns/vm1@snap1");
        assert_eq!(
            uri.to_string(),
            "rbd://rbd/vm1@snap1?namespace=ns&encryption=luks2"
        );

        let plain = RbdUri::parse("rbd://pool/img").unwrap();
        assert_eq!(plain.encryption, EncryptionKind::Auto);
        assert_eq!(plain.config.client_id, "admin");
        assert_eq!(plain.snapshot, None);
        assert_eq!(plain.spec(), "pool/img");
        assert_eq!(plain.to_string(), "rbd://pool/img");
        assert!(RbdUri::is_rbd("rbd://x/y") && !RbdUri::is_rbd("rados://x/y"));
    }

    #[test]
    fn bad_addresses_say_what_is_wrong() {
        for (text, words) in [
            ("rbd://pool", "POOL/IMAGE"),
            ("rbd:///img", "non-empty"),
            ("rbd://pool/", "non-empty"),
            ("rbd://pool/a/b", "without '/'"),
            ("rbd://pool/img@", "snapshot"),
            ("rbd://pool/img@a@b", "snapshot"),
            ("rbd://pool/img?conf", "KEY=VALUE"),
            ("rbd://pool/img?size=1", "unknown parameter `size`"),
            ("rbd://pool/img?encryption=luks3", "luks2"),
            ("rados://pool/img", "rbd://"),
            (
                "rbd://pool/img?encryption=luks2&encryption=none",
                "given twice",
            ),
            ("rbd://pool/img?conf=/a&conf=/b", "given twice"),
        ] {
            let err = RbdUri::parse(text).unwrap_err().to_string();
            assert!(err.contains(words), "{text}: `{words}` missing from: {err}");
            assert!(
                err.contains(text),
                "{text}: the address missing from: {err}"
            );
        }
    }
}
