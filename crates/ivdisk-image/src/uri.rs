//! Image addresses (`PATH`, `file:PATH`, `rados://POOL/IMAGE?...`, `mem:NAME`) and the store
//! each one opens.

use std::collections::HashMap;
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex, OnceLock, Weak};
use std::time::Duration;

use ivdisk_rados::{RadosConfig, RadosStore};
use ivdisk_store::{CoalescingStore, LocalStore, LocalStoreOptions, MemoryStore, ObjectStore};

use crate::ImageError;

/// The name of the one image a local store directory holds.
pub const LOCAL_IMAGE_NAME: &str = "image";

/// Where an image lives.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ImageUri {
    /// A directory holding a local embedded store with one image (`PATH` or `file:PATH`).
    Local { dir: PathBuf },
    /// An image in a RADOS pool (`rados://POOL/IMAGE?conf=PATH&id=CLIENT`).
    Rados {
        pool: String,
        image: String,
        /// `namespace=` (default: the pool's default namespace).
        namespace: String,
        /// `conf=` (default: librados' search: `$CEPH_CONF`, /etc/ceph/ceph.conf, ...).
        conf: Option<PathBuf>,
        /// `id=`: the cephx user without `client.` (default `admin`).
        client_id: String,
        /// `keyring=` (default: from the conf file).
        keyring: Option<PathBuf>,
    },
    /// An image in this process' memory store (`mem:NAME`; tests and benchmarks).
    Memory { name: String },
}

impl ImageUri {
    /// Parse an address as the command line takes it. A string without a scheme is a path.
    pub fn parse(text: &str) -> Result<ImageUri, ImageError> {
        let bad = |reason: &str| ImageError::InvalidUri {
            uri: text.to_owned(),
            reason: reason.to_owned(),
        };
        if let Some(rest) = text.strip_prefix("rados://") {
            let (path, query) = rest.split_once('?').unwrap_or((rest, ""));
            let (pool, image) = path
                .split_once('/')
                .ok_or_else(|| bad("expected rados://POOL/IMAGE"))?;
            let valid = |s: &str| {
                !s.is_empty()
                    && s.bytes()
                        .all(|b| b.is_ascii_graphic() && b != b'/' && b != b'@')
            };
            if !valid(pool) || !valid(image) {
                return Err(bad(
                    "pool and image names must be non-empty printable ASCII without spaces, '/' or '@'",
                ));
            }
            let mut uri = ImageUri::Rados {
                pool: pool.to_owned(),
                image: image.to_owned(),
                namespace: String::new(),
                conf: None,
                client_id: "admin".to_owned(),
                keyring: None,
            };
            if let ImageUri::Rados {
                namespace,
                conf,
                client_id,
                keyring,
                ..
            } = &mut uri
            {
                let mut seen = Vec::new();
                for pair in query.split('&').filter(|p| !p.is_empty()) {
                    let (key, value) = pair
                        .split_once('=')
                        .ok_or_else(|| bad(&format!("query part `{pair}` is not KEY=VALUE")))?;
                    if seen.contains(&key) {
                        return Err(bad(&format!("parameter `{key}` is given twice")));
                    }
                    seen.push(key);
                    match key {
                        "conf" => *conf = Some(PathBuf::from(value)),
                        "id" => *client_id = value.trim_start_matches("client.").to_owned(),
                        "keyring" => *keyring = Some(PathBuf::from(value)),
                        "namespace" => *namespace = value.to_owned(),
                        other => {
                            return Err(bad(&format!(
                                "unknown parameter `{other}` (known: conf, id, keyring, namespace)"
                            )))
                        }
                    }
                }
            }
            return Ok(uri);
        }
        if let Some(name) = text.strip_prefix("mem:") {
            if name.is_empty() || !name.bytes().all(|b| b.is_ascii_graphic()) {
                return Err(bad("expected mem:NAME with a printable name"));
            }
            return Ok(ImageUri::Memory {
                name: name.to_owned(),
            });
        }
        let path = match text.strip_prefix("file:") {
            // `file://HOST/PATH` (RFC 8089): only this machine's files, `file:///PATH` and
            // `file://localhost/PATH`; another host's name is not a directory here.
            Some(rest) if rest.starts_with("//") => {
                let after = &rest[2..];
                if after.starts_with('/') {
                    after
                } else if after.starts_with("localhost/") {
                    &after["localhost".len()..]
                } else {
                    return Err(bad(
                        "`file://HOST/PATH` names another machine's file; write file:PATH, \
                         file:///ABSOLUTE/PATH or a plain path",
                    ));
                }
            }
            Some(rest) => rest,
            None => text,
        };
        if path.is_empty() {
            return Err(bad("the path is empty"));
        }
        if text == "-" {
            // Standard input or output to other commands (`export IMAGE -`): here it made a
            // store directory named `-`.
            return Err(bad(
                "`-` stands for standard input or output elsewhere, and an image is a directory \
                 or file; for one at a path of that name, write ./-",
            ));
        }
        if let Some((scheme, _)) = path.split_once("://") {
            if scheme == "rbd" {
                return Err(bad(
                    "rbd:// names a librbd image, which `serve`, `info` and `convert` (as its \
                     source) take; this command takes an ivdisk image (PATH, file:PATH, \
                     rados://POOL/IMAGE, mem:NAME): `ivdisk convert rbd://POOL/IMAGE NEW` makes \
                     one of a librbd image",
                ));
            }
            return Err(bad(&format!(
                "unknown scheme `{scheme}://` (known: file:, rados://, mem:; librbd's own \
                 images: rbd://, with `serve`, `info` and `convert`)"
            )));
        }
        // `rados:pool/image` is a slip for `rados://pool/image`, not a new local directory
        // (unless one by that name exists).
        for scheme in ["rados", "rbd"] {
            let slip = path
                .strip_prefix(scheme)
                .and_then(|rest| rest.strip_prefix(':'));
            if let Some(rest) = slip.filter(|_| !Path::new(path).exists()) {
                return Err(bad(&format!(
                    "did you mean {scheme}://{}? (a local path starting `{scheme}:` must \
                     exist already)",
                    rest.trim_start_matches('/')
                )));
            }
        }
        Ok(ImageUri::Local {
            dir: PathBuf::from(path),
        })
    }

    /// Parse `IMAGE` or `IMAGE@SNAPSHOT` (`rados://POOL/IMAGE@SNAP?...`, `PATH@SNAP`,
    /// `mem:NAME@SNAP`). A local path that exists as written is never split, so a directory
    /// whose name holds `@` still opens.
    pub fn parse_with_snapshot(text: &str) -> Result<(ImageUri, Option<String>), ImageError> {
        let (base, query) = match text.split_once('?') {
            Some((base, query)) if text.starts_with("rados://") => (base, Some(query)),
            _ => (text, None),
        };
        let split = match base.rsplit_once('@') {
            Some((image, snap)) if !snap.contains('/') => Some((image, snap)),
            _ => None,
        };
        let Some((image, snap)) = split else {
            return Ok((ImageUri::parse(text)?, None));
        };
        let whole = ImageUri::parse(text);
        if let Ok(ImageUri::Local { dir }) = &whole {
            if dir.exists() {
                return Ok((whole?, None));
            }
        }
        let rest = match query {
            Some(q) => format!("{image}?{q}"),
            None => image.to_owned(),
        };
        let uri = ImageUri::parse(&rest)?;
        crate::snapshot::check_name(&rest, snap)?;
        Ok((uri, Some(snap.to_owned())))
    }

    /// The address of snapshot `snapshot` of this image, as [`ImageUri::parse_with_snapshot`]
    /// reads it back.
    pub fn at_snapshot(&self, snapshot: &str) -> String {
        at_snapshot(&self.to_string(), snapshot)
    }

    /// The image's name inside its store (its header object is named from it).
    pub fn image_name(&self) -> &str {
        match self {
            ImageUri::Local { .. } => LOCAL_IMAGE_NAME,
            ImageUri::Rados { image, .. } => image,
            ImageUri::Memory { name } => name,
        }
    }

    /// The file this address names when it is a regular file (a LUKS volume made by
    /// cryptsetup, whose header and keyslots live in the file itself), `None` for stores.
    pub fn luks_file(&self) -> Option<&Path> {
        crate::foreign::luks_file_path(self)
    }

    /// Open the store this image lives in. `create` makes a local store directory if missing.
    pub async fn open_store(&self, create: bool) -> Result<Arc<dyn ObjectStore>, ImageError> {
        self.open_store_as(create, false).await
    }

    /// Open the store this image lives in to read only. A local store is opened read-only
    /// (`LocalStore::open_read_only`: nothing in its directory is written or locked, so this
    /// works on a read-only mount and beside a writer in another process), or shares a store
    /// this process already has open for the directory. Other stores open as
    /// [`ImageUri::open_store`] opens them.
    pub async fn open_store_read_only(&self) -> Result<Arc<dyn ObjectStore>, ImageError> {
        self.open_store_as(false, true).await
    }

    async fn open_store_as(
        &self,
        create: bool,
        read_only: bool,
    ) -> Result<Arc<dyn ObjectStore>, ImageError> {
        let image = self.to_string();
        let local_kind = match self {
            ImageUri::Local { dir } => not_a_store_or_file(dir),
            _ => None,
        };
        if let Some(kind) = local_kind {
            return Err(ImageError::InvalidUri {
                uri: image,
                reason: format!(
                    "it is {kind}: ivdisk opens local images (directories) and LUKS files, not \
                     devices; for a LUKS device, `cryptsetup open` it and read \
                     /dev/mapper/NAME as a raw disk (`ivdisk import`, or `ivdisk convert \
                     --source-format raw`), or copy it into a file first"
                ),
            });
        }
        match self {
            // `DIR@SNAP` names snapshot SNAP of DIR unless DIR@SNAP exists, so a new store
            // directory named so would shadow a snapshot, or be shadowed by one later.
            ImageUri::Local { dir }
                if create
                    && !dir.exists()
                    && dir
                        .file_name()
                        .is_some_and(|n| n.as_encoded_bytes().contains(&b'@')) =>
            {
                Err(ImageError::InvalidUri {
                    uri: image,
                    reason: "a new local image's directory name must not contain '@' \
                             (IMAGE@SNAP names a snapshot of IMAGE)"
                        .into(),
                })
            }
            ImageUri::Local { dir } => open_local(dir, create, read_only).map_err(|e| match e {
                ivdisk_store::StoreError::Io { source, .. }
                    if !create && source.kind() == std::io::ErrorKind::NotFound =>
                {
                    ImageError::NotFound { image }
                }
                other => ImageError::store(&image)(other),
            }),
            ImageUri::Memory { .. } => Ok(memory_store()),
            ImageUri::Rados {
                pool,
                namespace,
                conf,
                client_id,
                keyring,
                ..
            } => {
                if let Some(missing) = keyring.as_ref().filter(|k| !k.exists()) {
                    return Err(ImageError::InvalidUri {
                        uri: image,
                        reason: format!(
                            "keyring file {} (keyring= in the address) does not exist",
                            missing.display()
                        ),
                    });
                }
                let mut config = RadosConfig::new(pool.clone());
                config.namespace = namespace.clone();
                config.conf = conf.clone();
                config.client_id = client_id.clone();
                config.keyring = keyring.clone();
                config.op_timeout = Some(Duration::from_secs(60));
                config.inflight_bytes_headroom_permille = RADOS_INFLIGHT_HEADROOM_PERMILLE;
                let store = RadosStore::open(&config)
                    .await
                    .map_err(|source| ImageError::Rados { image, source })?;
                // Writes that queue behind one in flight on the same object go out as one
                // operation: the OSDs pay per operation (docs/BENCHMARKS.md, issue 8).
                Ok(Arc::new(CoalescingStore::new(store)))
            }
        }
    }
}

impl fmt::Display for ImageUri {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ImageUri::Local { dir } => write!(f, "{}", dir.display()),
            ImageUri::Memory { name } => write!(f, "mem:{name}"),
            ImageUri::Rados {
                pool,
                image,
                namespace,
                ..
            } if namespace.is_empty() => write!(f, "rados://{pool}/{image}"),
            ImageUri::Rados {
                pool,
                image,
                namespace,
                ..
            } => write!(f, "rados://{pool}/{image}?namespace={namespace}"),
        }
    }
}

/// How much wider than configured librados' budget of bytes in flight is for an image: the
/// budget (100 MiB by default) counts the metadata a write carries with its data, so at 4 MiB
/// the default suite's writes (20 KiB of metadata each) kept 24 in flight where librbd's kept
/// 25, 4% fewer (docs/BENCHMARKS.md, "the client's budget of bytes in flight"). 2% covers
/// metadata up to 80 KiB per 4 MiB write (the default suite's: 20 KiB) and is half a 4 MiB
/// operation of the default budget, so an image never keeps more than one operation more in
/// flight than the configured budget would hold of its data alone.
const RADOS_INFLIGHT_HEADROOM_PERMILLE: u32 = 20;

/// `image` (an image address as displayed) with `@snapshot`: before the query of a
/// `rados://` address (`rados://POOL/IMAGE@SNAP?conf=...`; after it, the `@` would be read as
/// part of the last parameter), at the end of any other.
pub fn at_snapshot(image: &str, snapshot: &str) -> String {
    match image.split_once('?') {
        Some((base, query)) if image.starts_with("rados://") => {
            format!("{base}@{snapshot}?{query}")
        }
        _ => format!("{image}@{snapshot}"),
    }
}

/// `text` as one word of a POSIX shell command line: as it is when it holds only characters no
/// shell treats specially, else single-quoted (each `'` in it closed, escaped and reopened).
/// Why: messages suggest commands to run (`ivdisk lock break IMAGE`), and an address such as
/// `rados://rbd/vm1?conf=/etc/ceph/ceph.conf&id=admin` pasted bare ran its part before `&` in
/// the background and dropped the rest; a path with a space split in two.
pub fn shell_word(text: &str) -> std::borrow::Cow<'_, str> {
    let plain = |c: char| c.is_ascii_alphanumeric() || "@%+=:,./_-".contains(c);
    if !text.is_empty() && text.chars().all(plain) {
        return std::borrow::Cow::Borrowed(text);
    }
    std::borrow::Cow::Owned(shell_quoted(text))
}

/// `text` single-quoted for a shell whatever it holds, each `'` in it closed, escaped and
/// reopened ([`shell_word`] quotes only where needed).
pub fn shell_quoted(text: &str) -> String {
    format!("'{}'", text.replace('\'', "'\\''"))
}

/// One memory store per process: `mem:` images live as long as the process. Each opener gets
/// its own client identity, so writer locks between two opens behave as between two hosts.
fn memory_store() -> Arc<dyn ObjectStore> {
    static STORE: OnceLock<MemoryStore> = OnceLock::new();
    let store =
        STORE.get_or_init(|| MemoryStore::new().expect("an in-memory SQLite database opens"));
    Arc::new(store.another_client())
}

/// A local store may be opened for writing by one process at a time; within the process, every
/// opener of a directory shares the open store (with a client identity of its own). A reader
/// (`read_only`) shares any open store of the directory, preferring one open for writing (it
/// sees this process' writes at once, not at their commit); a writer never gets a read-only
/// store: it opens the directory for writing beside it.
fn open_local(
    dir: &Path,
    create: bool,
    read_only: bool,
) -> Result<Arc<dyn ObjectStore>, ivdisk_store::StoreError> {
    // Every live client of each open directory: any of them can make another (the store stays
    // open while one lives), whichever opened it first.
    static OPEN: OnceLock<Mutex<HashMap<PathBuf, Vec<Weak<LocalStore>>>>> = OnceLock::new();
    let key = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.to_path_buf());
    let mut open = OPEN
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    open.retain(|_, clients| {
        clients.retain(|c| c.strong_count() > 0);
        !clients.is_empty()
    });
    if let Some(clients) = open.get_mut(&key) {
        let live: Vec<Arc<LocalStore>> = clients.iter().filter_map(Weak::upgrade).collect();
        let shared = live
            .iter()
            .find(|s| !s.is_read_only())
            .or(live.first().filter(|_| read_only));
        if let Some(live) = shared {
            let store = Arc::new(live.another_client());
            clients.push(Arc::downgrade(&store));
            return Ok(store);
        }
    }
    if !dir.join("meta.sqlite").exists() {
        // Never scatter a store's files into a directory that holds something else; and do
        // not tell to create an image where that would be refused.
        // (A store's own files without its database: another process is creating it.)
        let occupied = match std::fs::read_dir(dir) {
            Ok(entries) => entries.flatten().any(|e| {
                !ivdisk_store::LOCAL_STORE_FILES
                    .iter()
                    .any(|f| e.file_name() == *f)
            }),
            Err(_) => create && dir.exists(),
        };
        if occupied {
            return Err(ivdisk_store::StoreError::Io {
                context: format!(
                    "{} exists and is not an ivdisk store (a local image is a directory of its \
                     own): give an image's directory, or a new path to create one",
                    dir.display()
                ),
                source: std::io::Error::new(
                    std::io::ErrorKind::AlreadyExists,
                    "it holds other files and no meta.sqlite",
                ),
            });
        }
    }
    let store = Arc::new(match read_only {
        true => LocalStore::open_read_only(dir)?,
        false => LocalStore::open_with(dir, &LocalStoreOptions { create })?,
    });
    let key = std::fs::canonicalize(dir).unwrap_or(key);
    open.entry(key).or_default().push(Arc::downgrade(&store));
    Ok(store)
}

/// What a local image's path is when it is neither a directory (a store) nor a regular
/// file (a LUKS file), nor absent: a block device, say, which read as "reading
/// /dev/loop1/meta.sqlite: Not a directory".
fn not_a_store_or_file(path: &std::path::Path) -> Option<&'static str> {
    use std::os::unix::fs::FileTypeExt;
    let kind = std::fs::metadata(path).ok()?.file_type();
    match () {
        _ if kind.is_dir() || kind.is_file() => None,
        _ if kind.is_block_device() => Some("a block device"),
        _ if kind.is_char_device() => Some("a character device"),
        _ if kind.is_fifo() => Some("a named pipe"),
        _ if kind.is_socket() => Some("a socket"),
        _ => Some("neither a directory nor a file"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// At librados' default budget, 25 writes of 4 MiB with up to 80 KiB of metadata each fit,
    /// as 25 of librbd's 4 MiB writes do; 26 of the data alone do not.
    #[test]
    fn rados_headroom_fits_as_many_4_mib_writes_as_librbd() {
        let configured: u64 = 100 << 20;
        let widened = configured + configured / 1000 * u64::from(RADOS_INFLIGHT_HEADROOM_PERMILLE);
        let data = 4u64 << 20;
        assert_eq!(configured / data, 25);
        assert!(25 * (data + (80 << 10)) <= widened);
        assert!(26 * data > widened);
    }

    #[test]
    fn snapshots_follow_the_last_at_sign() {
        let (uri, snap) =
            ImageUri::parse_with_snapshot("rados://rbd/vm1@monday?conf=/etc/ceph/c.conf").unwrap();
        assert_eq!(snap.as_deref(), Some("monday"));
        match uri {
            ImageUri::Rados { image, conf, .. } => {
                assert_eq!(image, "vm1");
                assert_eq!(conf.as_deref(), Some(Path::new("/etc/ceph/c.conf")));
            }
            other => panic!("{other:?}"),
        }
        let (uri, snap) = ImageUri::parse_with_snapshot("mem:a@b").unwrap();
        assert_eq!((uri.image_name(), snap.as_deref()), ("a", Some("b")));
        let (uri, snap) = ImageUri::parse_with_snapshot("/no/such/dir/disk.ivd@s1").unwrap();
        assert_eq!(
            (uri, snap.as_deref()),
            (
                ImageUri::Local {
                    dir: "/no/such/dir/disk.ivd".into()
                },
                Some("s1")
            )
        );
        // What `at_snapshot` writes reads back as the image and the snapshot (as displayed:
        // without `conf=`, `id=` and `keyring=`).
        for text in ["rados://rbd/vm?namespace=ns", "rados://rbd/vm", "mem:a"] {
            let uri = ImageUri::parse(text).unwrap();
            let (back, snap) = ImageUri::parse_with_snapshot(&uri.at_snapshot("s1")).unwrap();
            assert_eq!((back, snap.as_deref()), (uri, Some("s1")), "{text}");
        }
        // No snapshot: plain addresses, and an '@' inside a directory name.
        assert_eq!(ImageUri::parse_with_snapshot("disk.ivd").unwrap().1, None);
        assert_eq!(
            ImageUri::parse_with_snapshot("/tmp/x@y/disk.ivd")
                .unwrap()
                .1,
            None
        );
        let dir = tempfile::tempdir().unwrap();
        let odd = dir.path().join("disk@2");
        std::fs::create_dir(&odd).unwrap();
        let (uri, snap) = ImageUri::parse_with_snapshot(odd.to_str().unwrap()).unwrap();
        assert_eq!((uri, snap), (ImageUri::Local { dir: odd }, None));
        // A bad snapshot name is refused.
        assert!(ImageUri::parse_with_snapshot("mem:a@").is_err());
        assert!(ImageUri::parse_with_snapshot("rados://rbd/vm@?x=1").is_err());
    }

    #[test]
    fn parses_every_scheme() {
        assert_eq!(
            ImageUri::parse("disk.ivd").unwrap(),
            ImageUri::Local {
                dir: "disk.ivd".into()
            }
        );
        assert_eq!(
            ImageUri::parse("file:/a/b").unwrap(),
            ImageUri::Local { dir: "/a/b".into() }
        );
        // RFC 8089's forms of a local file; another host's is refused, not made here.
        for local in ["file:///a/b", "file://localhost/a/b"] {
            assert_eq!(
                ImageUri::parse(local).unwrap(),
                ImageUri::Local { dir: "/a/b".into() },
                "{local}"
            );
        }
        assert!(matches!(
            ImageUri::parse("file://otherhost/a/b"),
            Err(ImageError::InvalidUri { .. })
        ));
        assert_eq!(
            ImageUri::parse("mem:x").unwrap(),
            ImageUri::Memory { name: "x".into() }
        );
        let uri =
            ImageUri::parse("rados://rbd/vm1?conf=/etc/c.conf&id=client.u&namespace=ns").unwrap();
        assert_eq!(
            uri,
            ImageUri::Rados {
                pool: "rbd".into(),
                image: "vm1".into(),
                namespace: "ns".into(),
                conf: Some("/etc/c.conf".into()),
                client_id: "u".into(),
                keyring: None,
            }
        );
        assert_eq!(uri.to_string(), "rados://rbd/vm1?namespace=ns");
        assert_eq!(uri.image_name(), "vm1");
    }

    #[test]
    fn rejects_bad_addresses() {
        for bad in [
            "",
            "rados://pool",
            "rados:///img",
            "rados://p/i?color=red",
            "rados://p/i?conf",
            "mem:",
            "s3://bucket/x",
            "file:",
            "rados:rbd/vm1",
            "rbd:/rbd/vm1",
            "-",
        ] {
            let err = ImageUri::parse(bad).unwrap_err();
            assert!(
                matches!(err, ImageError::InvalidUri { .. }),
                "{bad:?} gave {err}"
            );
        }
        // A store directory named `-` was made for `ivdisk import disk.raw -`.
        let err = ImageUri::parse("-").unwrap_err().to_string();
        assert!(err.contains("write ./-"), "{err}");
        assert_eq!(ImageUri::parse("./-").unwrap().to_string(), "./-");
        let err = ImageUri::parse("rados:rbd/vm1").unwrap_err().to_string();
        assert!(err.contains("did you mean rados://rbd/vm1?"), "{err}");
    }
}
