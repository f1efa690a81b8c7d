//! LUKS1/LUKS2 files made by cryptsetup (`cryptsetup luksFormat FILE`, `cryptsetup reencrypt
//! --encrypt FILE`, qemu's `luks` format), opened through the engine over [`LuksFileStore`].
//!
//! **Locking**: one writer per file, enforced with `flock(LOCK_EX | LOCK_NB)` on a descriptor of
//! its own, taken as the image's writer lock. A flock is held by an open file description, so
//! it refuses a second writer in another process *and* a second open in this process, and the
//! kernel drops it when the holder exits (a crashed writer never leaves a stale lock behind, so
//! there is nothing to break). It is advisory: it keeps ivdisk writers apart; qemu (byte-range
//! OFD locks) and dm-crypt do not look at it, so do not write a file with them while ivdisk
//! has it open for writing. Read-only opens take no lock.

use std::fs::{File, OpenOptions as FsOpenOptions};
use std::io;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use ivdisk_header::{Header, HeaderError};
use ivdisk_store::process_flock::{lock_exclusive, FlockRefused, HeldFlock};
use ivdisk_store::{
    Extent, LockRequest, Locker, NumberedNames, ObjectName, ObjectStore, ReadOp, ReadResult,
    ReadStep, SnapId, Stat, StoreError, WriteOp, WriteOutcome, WriteStep,
};

use super::{check_segment, data_size, invalid, open_segment};
use crate::image::{EngineSpec, Image};
use crate::writer_lock::{HolderRecord, WriterLock};
use crate::{ImageError, ImageInfo, ImageUri, LayoutKind, OpenOptions};

/// Bytes of the file per object of [`LuksFileStore`]: only how the engine splits IO.
pub(crate) const FILE_OBJECT_SIZE: u64 = 4 << 20;
/// Object `n` of a LUKS file is `{FILE_DATA_PREFIX}{n:016x}`.
const FILE_DATA_PREFIX: &str = "luks_file_data.";
/// The object the writer lock is taken on (the flock).
const FILE_LOCK_OBJECT: &str = "luks_file_header";

/// The path of a local image that is a regular file (a LUKS volume, or an error), `None` for
/// directories (ivdisk stores) and paths that do not exist.
pub(crate) fn luks_file_path(uri: &ImageUri) -> Option<&Path> {
    match uri {
        ImageUri::Local { dir } if std::fs::metadata(dir).is_ok_and(|m| m.is_file()) => {
            Some(dir.as_path())
        }
        _ => None,
    }
}

/// What the regular file `path` is, for messages that refuse it as an ivdisk image: "a LUKS
/// file (...)" when it starts with the LUKS magic, else "a file that is no image".
pub(crate) fn describe_file(path: &Path) -> &'static str {
    let mut magic = [0u8; 6];
    let is_luks = std::fs::File::open(path)
        .and_then(|mut f| std::io::Read::read_exact(&mut f, &mut magic))
        .is_ok()
        && magic == ivdisk_header::binary::MAGIC_PRIMARY;
    match is_luks {
        true => "a LUKS file (made by cryptsetup or `ivdisk header format`)",
        false => "a file that is neither an ivdisk image (a directory) nor a LUKS volume",
    }
}

fn io_error(image: &str, context: String) -> impl FnOnce(io::Error) -> ImageError + '_ {
    move |source| ImageError::Store {
        image: image.to_owned(),
        source: StoreError::from_io(context, source),
    }
}

/// The file's LUKS header, or a clear error for a file that is not LUKS.
fn read_header(image: &str, path: &Path, file: &File) -> Result<Header, ImageError> {
    match Header::read(file) {
        Ok(header) => {
            if let Some(warning) = header.warning() {
                tracing::warn!(image, warning, "LUKS header");
            }
            Ok(header)
        }
        Err(HeaderError::NotLuks) => Err(invalid(
            image,
            format!(
                "{} is a regular file without a LUKS header (no LUKS magic at its start): a \
                 local image is either a directory (an ivdisk store) or a LUKS1/LUKS2 file made \
                 by cryptsetup",
                path.display()
            ),
        )),
        Err(e) => Err(ImageError::header(image)(e)),
    }
}

fn file_len(image: &str, path: &Path, file: &File) -> Result<u64, ImageError> {
    file.metadata().map(|m| m.len()).map_err(io_error(
        image,
        format!("reading the size of {}", path.display()),
    ))
}

/// What `ivdisk info` shows for a LUKS file (no passphrase needed).
pub(crate) async fn info_file(image: &str, path: &Path) -> Result<ImageInfo, ImageError> {
    let file = File::open(path).map_err(io_error(image, format!("opening {}", path.display())))?;
    let header = read_header(image, path, &file)?;
    let segment = check_segment(image, &header)?;
    let size = data_size(image, &segment, file_len(image, path, &file)?)?;
    Ok(super::info(&header, &segment, size, FILE_OBJECT_SIZE))
}

/// Who holds a LUKS file's writer lock (its flock), without a passphrase.
pub(crate) async fn lock_holder_file(
    image: &str,
    path: &Path,
) -> Result<Option<ivdisk_store::Locker>, ImageError> {
    let file = File::open(path).map_err(io_error(image, format!("opening {}", path.display())))?;
    let store = LuksFileStore::new(path, file, 0, 0, false);
    let object = store.lock_object.clone();
    Ok(store
        .list_lockers(&object, crate::WRITER_LOCK)
        .await
        .map_err(ImageError::store(image))?
        .pop())
}

/// Open a LUKS file with a passphrase: header from the file, data through the engine.
pub(crate) async fn open_file(
    image: &str,
    path: &Path,
    passphrase: &[u8],
    options: &OpenOptions,
) -> Result<Image, ImageError> {
    let file = FsOpenOptions::new()
        .read(true)
        .write(!options.read_only)
        .open(path)
        .map_err(|e| match e.kind() {
            // A read-only mount, no permission, an immutable file: said as for a local store,
            // with the read-only open that works (it read as a bare "Read-only file system").
            io::ErrorKind::ReadOnlyFilesystem | io::ErrorKind::PermissionDenied
                if !options.read_only =>
            {
                ImageError::Store {
                    image: image.to_owned(),
                    source: StoreError::NotWritable {
                        path: path.display().to_string(),
                        reason: format!("opening it for writing: {e}"),
                    },
                }
            }
            _ => io_error(image, format!("opening {}", path.display()))(e),
        })?;
    let header = read_header(image, path, &file)?;
    let segment = check_segment(image, &header)?;
    let size = data_size(image, &segment, file_len(image, path, &file)?)?;
    let unlocked = header
        .unlock(&file, passphrase)
        .map_err(ImageError::header(image))?;
    let (data, iv_sector_base) = open_segment(image, &header, &unlocked.volume_key)?;
    drop(unlocked);
    let store = Arc::new(LuksFileStore::new(
        path,
        file,
        segment.offset,
        segment.offset + size,
        !options.read_only,
    ));
    let header_object = store.lock_object.clone();
    let store: Arc<dyn ObjectStore> = store;
    let lock = match options.read_only {
        true => None,
        false => Some(
            WriterLock::acquire(
                store.clone(),
                header_object.clone(),
                image,
                options.lock_duration,
                HolderRecord::None,
            )
            .await
            .map_err(|e| match e {
                ImageError::Locked {
                    image,
                    holder,
                    expires_in,
                    ..
                } => ImageError::Locked {
                    image,
                    holder: format!(
                        "{holder} (the lock of a LUKS file is a flock: it ends with its process)"
                    ),
                    expires_in,
                    breakable: false,
                },
                other => other,
            })?,
        ),
    };
    tracing::info!(
        image,
        version = header.version(),
        size,
        sector_size = segment.sector_size,
        "opened a LUKS file"
    );
    Ok(Image::from_spec(EngineSpec {
        name: image.to_owned(),
        store,
        header_object,
        data_prefix: NumberedNames::new(FILE_DATA_PREFIX).map_err(ImageError::store(image))?,
        sector_size: segment.sector_size as usize,
        object_size: FILE_OBJECT_SIZE,
        data_offset: segment.offset,
        iv_sector_base,
        size,
        suite: data.suite,
        layout: LayoutKind::None,
        cipher: data.cipher,
        image_id: Default::default(),
        read_only: options.read_only,
        lock,
        nonces_reserved: 0,
        foreign: true,
        snapshot: None,
        snap_context: None,
        metadata_cache_bytes: 0,
    }))
}

/// The held flock: its own descriptor (dropping it releases the lock) and the cookie of the
/// writer lock it stands for.
struct HeldLock {
    _file: HeldFlock,
    name: String,
    cookie: String,
    description: String,
}

/// An [`ObjectStore`] over one LUKS file: object `{prefix}{n:016x}` is the file's bytes
/// `[n * object_size, (n + 1) * object_size)`, so the engine's `data_offset` is the LUKS data
/// offset unchanged. Only what the engine's `none` layout needs works:
///
/// - reads return the bytes as they are (a file has no holes to report:
///   [`ObjectStore::distinguishes_holes`] is `false`); an object past the end is `NotFound`;
/// - writes and zeroing are `pwrite`s, refused outside the LUKS data area
///   `[data_start, data_end)` so the header can never be overwritten through the engine; one
///   operation is not atomic across a crash (as with dm-crypt: a sector is old or new, a
///   multi-sector write may be torn);
/// - `flush` is `fdatasync`;
/// - the writer lock is a `flock` (see the module documentation);
/// - listing, snapshots, omap, remove and truncate are `InvalidOperation`.
pub(crate) struct LuksFileStore {
    file: File,
    path: PathBuf,
    object_size: u64,
    data_start: u64,
    data_end: u64,
    writable: bool,
    lock_object: ObjectName,
    client: String,
    lock: Mutex<Option<HeldLock>>,
}

impl LuksFileStore {
    pub(crate) fn new(
        path: &Path,
        file: File,
        data_start: u64,
        data_end: u64,
        writable: bool,
    ) -> Self {
        LuksFileStore {
            file,
            path: path.to_path_buf(),
            object_size: FILE_OBJECT_SIZE,
            data_start,
            data_end,
            writable,
            lock_object: ObjectName::new(FILE_LOCK_OBJECT).expect("a valid name"),
            client: format!("luks-file.pid{}", std::process::id()),
            lock: Mutex::new(None),
        }
    }

    fn refuse(&self, object: &ObjectName, reason: impl Into<String>) -> StoreError {
        StoreError::InvalidOperation {
            object: object.to_string(),
            reason: format!("{} (LUKS file {})", reason.into(), self.path.display()),
        }
    }

    fn io(&self, what: &str) -> impl FnOnce(io::Error) -> StoreError {
        let context = format!("{what} LUKS file {}", self.path.display());
        move |source| StoreError::from_io(context, source)
    }

    /// The file offset of object `object`'s first byte.
    fn base(&self, object: &ObjectName) -> Result<u64, StoreError> {
        object
            .as_str()
            .strip_prefix(FILE_DATA_PREFIX)
            .filter(|n| n.len() == 16)
            .and_then(|n| u64::from_str_radix(n, 16).ok())
            .and_then(|n| n.checked_mul(self.object_size))
            .ok_or_else(|| {
                self.refuse(
                    object,
                    format!("only the data objects `{FILE_DATA_PREFIX}<16 hex digits>` exist"),
                )
            })
    }

    fn len(&self) -> Result<u64, StoreError> {
        Ok(self
            .file
            .metadata()
            .map_err(self.io("reading the size of"))?
            .len())
    }

    /// Check that `[offset, offset + len)` of an object lies in it and in the data area.
    fn check_write(
        &self,
        object: &ObjectName,
        base: u64,
        offset: u64,
        len: u64,
    ) -> Result<u64, StoreError> {
        let end = offset.checked_add(len).filter(|&e| e <= self.object_size);
        let at = base + offset;
        match end {
            Some(_) if at >= self.data_start && at + len <= self.data_end => Ok(at),
            _ => Err(self.refuse(
                object,
                format!(
                    "a write of [{offset}, +{len}) would reach outside the LUKS data area \
                     [{}, {}) of the file",
                    self.data_start, self.data_end
                ),
            )),
        }
    }

    fn write_zeros(&self, mut at: u64, len: u64) -> Result<(), StoreError> {
        const CHUNK: u64 = 1 << 20;
        let zeros = vec![0u8; CHUNK.min(len) as usize];
        let end = at + len;
        while at < end {
            let n = (end - at).min(CHUNK) as usize;
            self.file
                .write_all_at(&zeros[..n], at)
                .map_err(self.io("writing"))?;
            at += n as u64;
        }
        Ok(())
    }

    /// Refuse to go on with a file shorter than the data area measured at the open: one cut
    /// short since (by another program) would read as unwritten sectors, zeros, which a
    /// convert would copy and verify; and a write at its end would grow it back over a hole,
    /// so that the part cut off read as zeros from then on without an error.
    fn refuse_if_cut_short(&self, file_len: u64, doing: &str) -> Result<(), StoreError> {
        if file_len >= self.data_end {
            return Ok(());
        }
        Err(self.io(doing)(io::Error::new(
            io::ErrorKind::UnexpectedEof,
            format!(
                "the file is {file_len} bytes now, but its data area ends at byte {} (was it \
                 cut short while open?)",
                self.data_end
            ),
        )))
    }

    /// Who holds the flock on the file, from /proc/locks (best effort).
    fn flock_holder(&self) -> Option<String> {
        self.flock_holder_pid().map(|pid| format!("process {pid}"))
    }

    /// The process that took the flock held on the file, from /proc/locks (best effort).
    fn flock_holder_pid(&self) -> Option<u32> {
        let meta = std::fs::metadata(&self.path).ok()?;
        ivdisk_store::process_flock::exclusive_holder(&meta)
            .ok()
            .flatten()
    }
}

#[async_trait::async_trait]
impl ObjectStore for LuksFileStore {
    async fn write_op(&self, object: &ObjectName, op: WriteOp) -> Result<WriteOutcome, StoreError> {
        if !self.writable {
            return Err(self.refuse(object, "the file is open read-only"));
        }
        if op.snap_context.is_some() {
            return Err(self.refuse(object, "a LUKS file has no snapshots"));
        }
        let base = self.base(object)?;
        // Check every step before applying any.
        for step in &op.steps {
            match step {
                WriteStep::AssertExists => {}
                WriteStep::Write { offset, data } => {
                    self.check_write(object, base, *offset, data.len() as u64)?;
                }
                WriteStep::Zero { offset, len } => {
                    self.check_write(object, base, *offset, *len)?;
                }
                other => {
                    return Err(self.refuse(
                        object,
                        format!(
                            "{other:?} is not supported on a LUKS file (only writes and zeroing)"
                        ),
                    ))
                }
            }
        }
        self.refuse_if_cut_short(self.len()?, "writing")?;
        for step in op.steps {
            match step {
                WriteStep::AssertExists => {
                    if base >= self.len()? {
                        return Err(StoreError::NotFound {
                            object: object.to_string(),
                        });
                    }
                }
                WriteStep::Write { offset, data } => self
                    .file
                    .write_all_at(&data, base + offset)
                    .map_err(self.io("writing"))?,
                WriteStep::Zero { offset, len } => self.write_zeros(base + offset, len)?,
                _ => unreachable!("checked above"),
            }
        }
        Ok(WriteOutcome { version: 0 })
    }

    async fn read_op(
        &self,
        object: &ObjectName,
        op: ReadOp,
    ) -> Result<Vec<ReadResult>, StoreError> {
        if op.snap.is_some() {
            return Err(self.refuse(object, "a LUKS file has no snapshots"));
        }
        let base = self.base(object)?;
        let file_len = self.len()?;
        self.refuse_if_cut_short(file_len, "reading")?;
        if base >= file_len {
            return Err(StoreError::NotFound {
                object: object.to_string(),
            });
        }
        let size = (file_len - base).min(self.object_size);
        let mut results = Vec::with_capacity(op.steps.len());
        for step in op.steps {
            results.push(match step {
                ReadStep::Read { offset, len } => {
                    let end = offset.saturating_add(len).min(size);
                    if offset >= end {
                        ReadResult::Extents(Vec::new())
                    } else {
                        let mut data = vec![0u8; (end - offset) as usize];
                        self.file
                            .read_exact_at(&mut data, base + offset)
                            .map_err(self.io("reading"))?;
                        ReadResult::Extents(vec![Extent { offset, data }])
                    }
                }
                ReadStep::Stat => ReadResult::Stat(Stat { size, version: 0 }),
                ReadStep::OmapGetByKeys(_) | ReadStep::OmapGetRange { .. } => {
                    return Err(self.refuse(object, "a LUKS file has no key/value maps"))
                }
            });
        }
        Ok(results)
    }

    async fn list(&self, prefix: &str) -> Result<Vec<ObjectName>, StoreError> {
        Err(StoreError::InvalidOperation {
            object: prefix.to_owned(),
            reason: format!(
                "a LUKS file ({}) is not an object store: its objects cannot be listed",
                self.path.display()
            ),
        })
    }

    async fn snap_create(&self) -> Result<SnapId, StoreError> {
        Err(self.refuse(&self.lock_object, "a LUKS file has no snapshots"))
    }

    async fn snap_remove(&self, _snap: SnapId) -> Result<(), StoreError> {
        Err(self.refuse(&self.lock_object, "a LUKS file has no snapshots"))
    }

    async fn lock_exclusive(
        &self,
        object: &ObjectName,
        request: LockRequest,
    ) -> Result<(), StoreError> {
        if object != &self.lock_object {
            return Err(self.refuse(object, "only the file itself can be locked"));
        }
        let mut held = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(lock) = held.as_ref() {
            if request.renew && lock.name == request.name && lock.cookie == request.cookie {
                // A flock does not expire: nothing to renew.
                return Ok(());
            }
            return Err(StoreError::Busy {
                object: object.to_string(),
                lock: request.name,
                holder: format!("this process ({})", self.client),
            });
        }
        let file = File::open(&self.path).map_err(self.io("opening (to lock)"))?;
        // A flock last taken by this process and held by no open of it: a child forked by
        // one of our threads shares it until its exec (see `process_flock`).
        let ours = std::process::id();
        let file = match lock_exclusive(file, |_| self.flock_holder_pid() == Some(ours)) {
            Ok(lock) => lock,
            Err((_, FlockRefused::HeldHere)) => {
                return Err(StoreError::Busy {
                    object: object.to_string(),
                    lock: request.name,
                    holder: format!("another open of the file in this process ({ours})"),
                })
            }
            Err((_, FlockRefused::HeldElsewhere)) => {
                return Err(StoreError::Busy {
                    object: object.to_string(),
                    lock: request.name,
                    holder: self.flock_holder().unwrap_or_else(|| {
                        "another open of the file (a flock is held on it)".to_owned()
                    }),
                })
            }
            Err((_, FlockRefused::Io(e))) => return Err(self.io("locking")(e)),
        };
        *held = Some(HeldLock {
            _file: file,
            name: request.name,
            cookie: request.cookie,
            description: request.description,
        });
        Ok(())
    }

    async fn unlock(
        &self,
        object: &ObjectName,
        lock: &str,
        cookie: &str,
    ) -> Result<(), StoreError> {
        let mut held = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        match held.as_ref() {
            Some(h) if object == &self.lock_object && h.name == lock && h.cookie == cookie => {
                // Closing the descriptor releases the flock.
                *held = None;
                Ok(())
            }
            _ => Err(StoreError::NotLocked {
                object: object.to_string(),
                lock: lock.to_owned(),
                client: self.client.clone(),
                cookie: cookie.to_owned(),
            }),
        }
    }

    async fn list_lockers(
        &self,
        object: &ObjectName,
        lock: &str,
    ) -> Result<Vec<Locker>, StoreError> {
        if object != &self.lock_object {
            return Ok(Vec::new());
        }
        let held = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(h) = held.as_ref().filter(|h| h.name == lock) {
            return Ok(vec![Locker {
                client: self.client.clone(),
                cookie: h.cookie.clone(),
                description: h.description.clone(),
                expires_in: None,
                address: None,
            }]);
        }
        Ok(self
            .flock_holder()
            .map(|holder| Locker {
                client: holder,
                cookie: String::new(),
                description: format!(
                    "flock on {}, released when that process exits",
                    self.path.display()
                ),
                expires_in: None,
                address: None,
            })
            .into_iter()
            .collect())
    }

    async fn break_lock(
        &self,
        object: &ObjectName,
        _lock: &str,
        _client: &str,
        _cookie: &str,
    ) -> Result<(), StoreError> {
        Err(self.refuse(
            object,
            "the writer lock of a LUKS file is a flock held by a live process; it goes away when \
             that process exits, there is nothing to break",
        ))
    }

    async fn flush(&self) -> Result<(), StoreError> {
        if self.writable {
            self.file.sync_data().map_err(self.io("syncing"))?;
        }
        Ok(())
    }

    fn client_id(&self) -> &str {
        &self.client
    }

    fn distinguishes_holes(&self) -> bool {
        false
    }
}
