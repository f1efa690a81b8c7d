//! An image's life: create, open (read-only or as the one writer), grow, close, delete.
//! The IO path is in `io.rs`.

use std::collections::BTreeSet;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use ivdisk_crypto::{new_cipher, CipherParams, ImageId, SectorCipher, Suite, VolumeKey};
use ivdisk_header::{FormatSpec, Header, ImageParams, PbkdfRequest, FORMAT_VERSION};
use ivdisk_store::{
    Locker, NumberedNames, ObjectName, ObjectStore, ObjectStoreExt, ReadOp, ReadResult, ReadStep,
    SnapContext, SnapId, StoreError, WatchStatus, WriteOp, WriteStep,
};

use crate::allocation::LIST_ABOVE_OBJECTS;
use crate::header_object::HeaderRegion;
use crate::layout::{LayoutKind, ObjectGeometry, SectorLayout};
use crate::metadata_cache::{MetadataCache, DEFAULT_METADATA_CACHE_BYTES};
use crate::object_map::ObjectMap;
use crate::range_lock::RangeLocks;
use crate::snapshot::{SnapshotInfo, SnapshotTable};
use crate::writer_lock::{
    self, HolderRecord, WriterLock, DEFAULT_LOCK_DURATION, LOCK_HELD_MARGIN, LOCK_STALL_WAIT,
    WRITER_LOCK,
};
use crate::{ImageError, ImageUri};

/// Default bytes of data per object (as RBD).
pub const DEFAULT_OBJECT_SIZE: u64 = 4 << 20;
/// Largest object size: the stored object (data plus metadata) must stay under the stores'
/// 128 MiB object limit.
pub const MAX_OBJECT_SIZE: u64 = 64 << 20;
/// The largest image: NBD clients (qemu, libnbd) and file offsets (`off_t`) hold sizes as
/// signed 64-bit numbers; qemu refuses a larger export ("File too large").
pub const MAX_IMAGE_SIZE: u64 = i64::MAX as u64;
/// Nonces reserved in the header object at a time for suites with a write limit
/// (`aes-gcm-random`): a crash loses at most this many from the budget.
pub const NONCE_RESERVATION: u64 = 1 << 16;
/// Header-object omap key holding the reserved nonce count.
pub(crate) const NONCE_KEY: &[u8] = b"ivdisk.nonce_writes_reserved";

/// Name of an image's header object.
pub fn header_object_name(image_name: &str) -> String {
    format!("ivdisk_header.{image_name}")
}

/// Prefix of an image's data objects; object `n` is `{prefix}{n:016x}`.
pub fn data_object_prefix(image_id: &ImageId) -> String {
    format!("ivdisk_data.{}.", hex::encode(image_id.0))
}

/// What a new image is.
#[derive(Debug, Clone)]
pub struct CreateOptions {
    /// Size in bytes (a multiple of the sector size).
    pub size: u64,
    pub suite: Suite,
    /// `None`: `object-end` for suites with metadata, `none` otherwise.
    pub layout: Option<LayoutKind>,
    /// 4096 (default) or 512.
    pub sector_size: u32,
    /// Data bytes per object: a power of two from 4 KiB to 64 MiB.
    pub object_size: u64,
    /// Key derivation for the passphrase's keyslot.
    pub pbkdf: PbkdfRequest,
    /// Volume key length (`None`: the suite's default).
    pub key_len: Option<usize>,
}

impl CreateOptions {
    /// An image of `size` bytes with the default suite, layout, sector and object size.
    pub fn new(size: u64) -> Self {
        CreateOptions {
            size,
            suite: Suite::DEFAULT,
            layout: None,
            sector_size: 4096,
            object_size: DEFAULT_OBJECT_SIZE,
            pbkdf: PbkdfRequest::default(),
            key_len: None,
        }
    }
}

/// How to open an image.
#[derive(Debug, Clone)]
pub struct OpenOptions {
    /// Open without the writer lock; writes are refused.
    pub read_only: bool,
    /// How long the writer lock survives without renewal (it is renewed every third of it).
    pub lock_duration: Duration,
    /// Open this snapshot (by name) instead of the image's head: always read-only, with the
    /// size the image had when the snapshot was taken.
    pub snapshot: Option<String>,
    /// Bytes of per-sector metadata (`object-end` images) kept in memory while the writer
    /// lock is held, so small reads fetch the data alone and small writes on RADOS send whole
    /// metadata blocks (see `metadata_cache.rs`). 0 turns the cache off.
    pub metadata_cache_bytes: usize,
    /// How long a write waits while the writer lock is not renewed in time (the store did not
    /// answer: an OSD stalled or restarted) before it fails ([`LOCK_STALL_WAIT`]; zero: at
    /// once, as before writes waited).
    pub stalled_write_wait: Duration,
    /// Open an image whose shrink did not finish (refused otherwise, with
    /// [`ImageError::ShrinkUnfinished`]), to finish it with [`Image::resize`] to that size.
    pub finishing_shrink: bool,
}

impl Default for OpenOptions {
    fn default() -> Self {
        OpenOptions {
            read_only: false,
            lock_duration: DEFAULT_LOCK_DURATION,
            snapshot: None,
            metadata_cache_bytes: DEFAULT_METADATA_CACHE_BYTES,
            stalled_write_wait: LOCK_STALL_WAIT,
            finishing_shrink: false,
        }
    }
}

impl OpenOptions {
    pub fn read_only() -> Self {
        OpenOptions {
            read_only: true,
            ..OpenOptions::default()
        }
    }
}

/// What `ivdisk info` shows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageInfo {
    pub size: u64,
    pub suite: Suite,
    pub layout: LayoutKind,
    pub sector_size: u32,
    pub object_size: u64,
    pub image_id: ImageId,
    pub keyslots: Vec<u32>,
    /// Snapshots, oldest first (none for LUKS volumes made by other tools).
    pub snapshots: Vec<SnapshotInfo>,
    /// Why no open accepts the image, if a command that changes it as a whole stopped
    /// part-way (an import, a delete, a rollback, an incremental restore): that open's error.
    pub unfinished: Option<String>,
    /// One copy of the LUKS2 header is damaged or out of date and the other was read: what
    /// is wrong (the next header change rewrites both copies).
    pub header_warning: Option<String>,
}

/// An open image. Cheap to clone (clones share the open image); IO methods take `&self` and
/// may run concurrently. Close it with [`Image::close`] to flush and release the writer lock.
#[derive(Clone)]
pub struct Image {
    pub(crate) inner: Arc<Inner>,
}

impl std::fmt::Debug for Image {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Image")
            .field("image", &self.inner.name)
            .field("suite", &self.inner.suite)
            .field("layout", &self.inner.layout_kind)
            .field("size", &self.size())
            .finish()
    }
}

pub(crate) struct Inner {
    /// The image as the user addressed it (for messages).
    pub(crate) name: String,
    pub(crate) store: Arc<dyn ObjectStore>,
    pub(crate) header_object: ObjectName,
    pub(crate) data_prefix: NumberedNames,
    pub(crate) sector_size: usize,
    pub(crate) object_size: u64,
    /// Bytes before the image's first sector in the object address space (0 for ivdisk
    /// images; the header's length for librbd's LUKS images).
    pub(crate) data_offset: u64,
    /// Added to a sector's LBA to get the sector number its IV/AAD uses.
    pub(crate) iv_sector_base: u64,
    pub(crate) size: AtomicU64,
    pub(crate) suite: Suite,
    pub(crate) layout_kind: LayoutKind,
    pub(crate) layout: Box<dyn SectorLayout>,
    pub(crate) cipher: Box<dyn SectorCipher>,
    pub(crate) image_id: ImageId,
    pub(crate) ranges: RangeLocks,
    pub(crate) read_only: bool,
    pub(crate) lock: Mutex<Option<WriterLock>>,
    /// True while `lock` holds a lock that is not lost: the writes' fast check (false for
    /// read-only opens and after close; `check_writable` then says why).
    pub(crate) writes_allowed: Arc<AtomicBool>,
    /// The store's count of lost transactions when opened (`ObjectStore::lost_transactions`):
    /// once it changes, writes and flushes are refused (`ImageError::WritesLost`), and
    /// `loss_reported` says the error was logged.
    pub(crate) lost_at_open: Option<u64>,
    pub(crate) loss_reported: AtomicBool,
    /// Nonce writes reserved in the header object (suites with a write limit).
    pub(crate) nonces_reserved: AtomicU64,
    /// Nonces promised to writes since the open, counted from the saved reservation (suites
    /// with a write limit): what `reserve_nonces` compares against the reservation. The
    /// cipher's own count moves only as writes encrypt, so two writes that checked it before
    /// either encrypted could both fit under the reservation and together pass it.
    pub(crate) nonces_claimed: AtomicU64,
    pub(crate) nonce_reserve: tokio::sync::Mutex<()>,
    pub(crate) header_change: tokio::sync::Mutex<()>,
    /// A read-only open's mark that keeps what it reads from being removed (`readers.rs`).
    pub(crate) reader_mark: std::sync::Mutex<Option<crate::readers::ReaderHold>>,
    /// The mark is a watch, whose status every read checks (`check_reads_watched`).
    pub(crate) reads_watched: AtomicBool,
    /// The watch's registration for which what is read was last found still there (0: the
    /// first, checked at the open), and the one check at a time after a registration again.
    pub(crate) reads_watched_since: AtomicU64,
    pub(crate) reader_recheck: tokio::sync::Mutex<()>,
    /// Since when reads have found the watch lost (`watch_lost` says whether it is set, so
    /// that reads with the watch held take no lock).
    pub(crate) watch_lost_since: std::sync::Mutex<Option<std::time::Instant>>,
    pub(crate) watch_lost: AtomicBool,
    /// Where the image was opened from, when opened by address: a writer's snapshot
    /// removal asks that store for the snapshot's readers (`readers.rs`).
    pub(crate) uri: std::sync::OnceLock<ImageUri>,
    /// A LUKS volume made by another tool (cryptsetup file, librbd image): no resize.
    pub(crate) foreign: bool,
    /// Opened at this snapshot (name, id): reads go to the snapshot, writes are refused.
    pub(crate) snapshot: Option<(String, SnapId)>,
    /// The snapshot context every data write carries (`None`: the image has no snapshots).
    pub(crate) snap_context: std::sync::RwLock<Option<SnapContext>>,
    /// Whether `snap_context` is `Some`: writes read this first, so that an image without
    /// snapshots (the usual case) takes no read lock per write (each one a write to a line
    /// shared by the cores). Set with `snap_context`, under the whole range lock.
    pub(crate) has_snap_context: AtomicBool,
    /// The `object-end` or `omap-packed` metadata in memory (writers only; used while the
    /// lock is held).
    pub(crate) metadata_cache: Option<MetadataCache>,
    /// Which data objects may exist (writers and snapshots; `None` for read-only opens of the
    /// head, LUKS volumes of other tools and images of too many objects).
    pub(crate) object_map: Option<ObjectMap>,
    /// Whether reads use the cache. Not when it was turned off (0 bytes) and is there only
    /// because the layout writes through it (`omap-packed`): then every read goes to the store.
    pub(crate) metadata_cache_reads: bool,
}

/// The parts of an open image (see [`Image::from_spec`]).
pub(crate) struct EngineSpec {
    pub(crate) name: String,
    pub(crate) store: Arc<dyn ObjectStore>,
    /// The object holding the header and the writer lock.
    pub(crate) header_object: ObjectName,
    /// Data object `n` is `{data_prefix}{n:016x}`.
    pub(crate) data_prefix: NumberedNames,
    pub(crate) sector_size: usize,
    pub(crate) object_size: u64,
    pub(crate) data_offset: u64,
    pub(crate) iv_sector_base: u64,
    pub(crate) size: u64,
    pub(crate) suite: Suite,
    pub(crate) layout: LayoutKind,
    pub(crate) cipher: Box<dyn SectorCipher>,
    pub(crate) image_id: ImageId,
    pub(crate) read_only: bool,
    pub(crate) lock: Option<WriterLock>,
    pub(crate) nonces_reserved: u64,
    pub(crate) foreign: bool,
    pub(crate) snapshot: Option<(String, SnapId)>,
    pub(crate) snap_context: Option<SnapContext>,
    /// Bytes for the metadata cache (0: none).
    pub(crate) metadata_cache_bytes: usize,
}

/// How long reads wait for a lost reader's watch to be confirmed or registered again before
/// they are refused: librados pings a watch every `objecter_tick_interval` (5 s).
const LOST_WATCH_WAIT: Duration = Duration::from_secs(10);
/// How often a read waiting for a lost watch looks again.
const LOST_WATCH_POLL: Duration = Duration::from_millis(100);

/// Wait `duration` without a timer of the runtime's (the engine runs on any executor): on a
/// thread of its own. For rare waits only.
async fn pause(duration: Duration) {
    let (done, waited) = tokio::sync::oneshot::channel::<()>();
    let spawned = std::thread::Builder::new()
        .name("ivdisk-pause".into())
        .spawn(move || {
            std::thread::sleep(duration);
            let _ = done.send(());
        });
    match spawned {
        Ok(_) => drop(waited.await),
        // No thread: wait here, blocking this worker for that long.
        Err(_) => std::thread::sleep(duration),
    }
}

fn invalid(image: &str, reason: impl Into<String>) -> ImageError {
    ImageError::InvalidParameter {
        image: image.to_owned(),
        reason: reason.into(),
    }
}

pub(crate) fn object_name(image: &str, name: String) -> Result<ObjectName, ImageError> {
    ObjectName::new(name).map_err(ImageError::store(image))
}

/// The parameters an ivdisk header records, checked.
pub(crate) struct Parsed {
    pub(crate) suite: Suite,
    pub(crate) layout: LayoutKind,
    pub(crate) sector_size: u32,
    pub(crate) size: u64,
    pub(crate) params: ImageParams,
}

/// The header read again under the writer lock is of the image `unlocked` was read from,
/// and `volume_key` (recovered from `unlocked`) opens it; else `HeaderChanged`.
fn check_same_image(
    image: &str,
    unlocked: &Header,
    again: &Header,
    volume_key: &VolumeKey,
) -> Result<(), ImageError> {
    let (before, now) = (parse_header(image, unlocked)?, parse_header(image, again)?);
    let same = before.params.image_id == now.params.image_id
        && before.params.object_size == now.params.object_size
        && before.suite == now.suite
        && before.layout == now.layout
        && before.sector_size == now.sector_size
        && (again.has_volume_key_digest_of(unlocked)
            || again.unlock_with_volume_key(volume_key.as_bytes()).is_ok());
    if same {
        Ok(())
    } else {
        Err(ImageError::HeaderChanged {
            image: image.to_owned(),
        })
    }
}

pub(crate) fn parse_header(image: &str, header: &Header) -> Result<Parsed, ImageError> {
    let params = header
        .image_params()
        .map_err(ImageError::header(image))?
        .ok_or_else(|| ImageError::Corrupt {
            image: image.to_owned(),
            reason: "the header object holds a LUKS header without ivdisk image parameters".into(),
        })?;
    let segment = header.segment().map_err(ImageError::header(image))?;
    let suite = segment.suite().map_err(ImageError::header(image))?;
    let layout: LayoutKind = params
        .layout
        .parse()
        .map_err(|reason| ImageError::Corrupt {
            image: image.to_owned(),
            reason,
        })?;
    let size = segment.size.ok_or_else(|| ImageError::Corrupt {
        image: image.to_owned(),
        reason: "the data segment has no fixed size".into(),
    })?;
    // The size is the JSON's, whose checksum anyone can recompute: past the largest image
    // the arithmetic of the last object's range overflowed (a panic in a debug build, wrapped
    // extents in a release one, from NBD block status, export or verify).
    if size > MAX_IMAGE_SIZE || !size.is_multiple_of(segment.sector_size as u64) {
        return Err(ImageError::Corrupt {
            image: image.to_owned(),
            reason: format!(
                "the header's data size {size} is not a whole number of {}-byte sectors up to \
                 {MAX_IMAGE_SIZE} bytes",
                segment.sector_size
            ),
        });
    }
    if !layout.fits(suite.metadata_len()) || params.object_size > MAX_OBJECT_SIZE {
        return Err(ImageError::Corrupt {
            image: image.to_owned(),
            reason: format!(
                "layout {layout} with suite {suite} and object size {} is not a valid image",
                params.object_size
            ),
        });
    }
    Ok(Parsed {
        suite,
        layout,
        sector_size: segment.sector_size,
        size,
        params,
    })
}

fn too_large(size: u64) -> String {
    format!("size {size} is larger than the largest image, {MAX_IMAGE_SIZE} bytes (2^63 - 1)")
}

pub(crate) async fn read_header(
    store: &dyn ObjectStore,
    object: &ObjectName,
    image: &str,
) -> Result<(Header, HeaderRegion), ImageError> {
    let region = HeaderRegion::read(store, object)
        .await
        .map_err(ImageError::store(image))?
        .ok_or_else(|| ImageError::NotFound {
            image: image.to_owned(),
        })?;
    let header = Header::read(&region).map_err(ImageError::header(image))?;
    if let Some(warning) = header.warning() {
        // Once per image and process: a command reads the header more than once.
        static WARNED: Mutex<BTreeSet<(String, String)>> = Mutex::new(BTreeSet::new());
        let mut warned = WARNED.lock().unwrap_or_else(|e| e.into_inner());
        if warned.insert((image.to_owned(), warning.to_owned())) {
            tracing::warn!(image, warning, "image header");
        }
    }
    Ok((header, region))
}

impl Image {
    /// Create an image protected by `passphrase` and open it for writing.
    pub async fn create(
        uri: &ImageUri,
        options: &CreateOptions,
        passphrase: &[u8],
    ) -> Result<Image, ImageError> {
        Image::create_at(uri, options, passphrase, None).await
    }

    /// [`Image::create`] of an image this process goes on to fill (`what`, as errors name it:
    /// "an import of FILE"): until [`Image::mark_filled`], every other open of it fails with
    /// [`ImageError::FillUnfinished`], so an import killed part-way leaves an image that says
    /// so instead of one that looks complete. A failed fill that is not killed deletes the
    /// image itself.
    pub async fn create_to_fill(
        uri: &ImageUri,
        options: &CreateOptions,
        passphrase: &[u8],
        what: &str,
    ) -> Result<Image, ImageError> {
        Image::create_at(uri, options, passphrase, Some(what)).await
    }

    async fn create_at(
        uri: &ImageUri,
        options: &CreateOptions,
        passphrase: &[u8],
        filling: Option<&str>,
    ) -> Result<Image, ImageError> {
        let created = Image::create_with(
            uri.to_string(),
            uri.image_name(),
            options,
            passphrase,
            filling,
            || uri.open_store(true),
        )
        .await?;
        let _ = created.inner.uri.set(uri.clone());
        Ok(created)
    }

    /// Everything written to an image from [`Image::create_to_fill`] is durable, and it opens
    /// from now on: flushes, then removes the mark, durably.
    pub async fn mark_filled(&self) -> Result<(), ImageError> {
        let inner = &self.inner;
        self.flush().await?;
        let op = WriteOp::new()
            .step(WriteStep::AssertExists)
            .step(WriteStep::OmapRemoveKeys(vec![
                crate::backup::FILLING_KEY.to_vec()
            ]));
        inner
            .store
            .write_op(&inner.header_object, op)
            .await
            .map_err(ImageError::store(&inner.name))?;
        inner
            .store
            .flush()
            .await
            .map_err(ImageError::store(&inner.name))
    }

    /// [`Image::create`] of the image `image_name` (shown as `image`) in the store that
    /// `open_store` opens once the options are checked (also [`Image::create_on`]).
    pub(crate) async fn create_with<F, Fut>(
        image: String,
        image_name: &str,
        options: &CreateOptions,
        passphrase: &[u8],
        filling: Option<&str>,
        open_store: F,
    ) -> Result<Image, ImageError>
    where
        F: FnOnce() -> Fut,
        Fut: std::future::Future<Output = Result<Arc<dyn ObjectStore>, ImageError>>,
    {
        let layout = options
            .layout
            .unwrap_or_else(|| LayoutKind::default_for(options.suite.metadata_len()));
        if !layout.fits(options.suite.metadata_len()) {
            return Err(invalid(
                &image,
                format!(
                    "layout {layout} does not fit suite {} ({} bytes of metadata per sector): use {}",
                    options.suite,
                    options.suite.metadata_len(),
                    if options.suite.metadata_len() == 0 {
                        "--layout none".to_owned()
                    } else {
                        format!("--layout {}", LayoutKind::with_metadata_names())
                    }
                ),
            ));
        }
        if ![512, 4096].contains(&options.sector_size) {
            return Err(invalid(
                &image,
                format!("sector size {} is not 512 or 4096", options.sector_size),
            ));
        }
        let os = options.object_size;
        if !os.is_power_of_two() || !(4096..=MAX_OBJECT_SIZE).contains(&os) {
            return Err(invalid(
                &image,
                format!("object size {os} is not a power of two from 4 KiB to 64 MiB"),
            ));
        }
        if options.size == 0 || !options.size.is_multiple_of(options.sector_size as u64) {
            return Err(invalid(
                &image,
                format!(
                    "size {} is not a positive multiple of the {}-byte sector size",
                    options.size, options.sector_size
                ),
            ));
        }
        if options.size > MAX_IMAGE_SIZE {
            return Err(invalid(&image, too_large(options.size)));
        }
        let store = open_store().await?;
        let header_object = object_name(&image, header_object_name(image_name))?;
        if store
            .stat(&header_object)
            .await
            .map_err(ImageError::store(&image))?
            .is_some()
        {
            return Err(ImageError::Exists { image });
        }
        let mut id = [0u8; 16];
        ivdisk_crypto::fill_random(&mut id).map_err(ImageError::crypto(&image))?;
        let params = ImageParams {
            format_version: FORMAT_VERSION,
            layout: layout.name().to_owned(),
            object_size: os,
            image_id: ImageId(id),
        };
        let key_len = options
            .key_len
            .unwrap_or_else(|| options.suite.default_key_len());
        let volume_key = VolumeKey::generate(key_len).map_err(ImageError::crypto(&image))?;
        let mut spec = FormatSpec::new(options.suite, options.sector_size);
        spec.data_size = Some(options.size);
        spec.image = Some(params);
        spec.pbkdf = options.pbkdf;
        let mut region = HeaderRegion::new_object();
        let header = Header::format(&mut region, &spec, &volume_key, passphrase)
            .map_err(ImageError::header(&image))?;
        let mut op = region.write_op().expect("a new header writes bytes");
        if let Some(what) = filling {
            // In the operation that creates the header: no moment when it exists unmarked.
            op = op.omap_set(vec![(
                crate::backup::FILLING_KEY.to_vec(),
                what.as_bytes().to_vec(),
            )]);
        }
        match store.write_op(&header_object, op).await {
            Ok(outcome) => region.stored(outcome.version),
            Err(StoreError::Exists { .. }) => return Err(ImageError::Exists { image }),
            Err(e) => return Err(ImageError::store(&image)(e)),
        }
        tracing::info!(image = %image, suite = %options.suite, layout = %layout, size = options.size, "created image");
        let opened = Image::open_unlocked(
            image.clone(),
            store.clone(),
            header_object.clone(),
            &header,
            volume_key,
            &OpenOptions::default(),
            filling.is_some(),
        )
        .await;
        // An open that failed on the store (a RADOS timeout taking the writer lock) left a
        // new, empty image of the full size that anything else opens and reads zeros from:
        // the header goes again. Not after other failures: another process may hold the
        // image by then (its lock, a delete begun), and it is not ours to remove.
        if let Err(e @ (ImageError::Store { .. } | ImageError::Rados { .. })) = &opened {
            let remove = WriteOp::new()
                .step(WriteStep::AssertExists)
                .step(WriteStep::Remove);
            match store.write_op(&header_object, remove).await {
                Ok(_) => {
                    tracing::info!(image = %image, error = %e, "removed the image just created: its open failed")
                }
                Err(removal) => {
                    tracing::warn!(image = %image, error = %removal, "the image just created could not be removed after its open failed; delete it (`ivdisk delete`)")
                }
            }
        }
        opened
    }

    /// Open an image with a passphrase (or the contents of a key file).
    pub async fn open(
        uri: &ImageUri,
        passphrase: &[u8],
        options: &OpenOptions,
    ) -> Result<Image, ImageError> {
        let image = uri.to_string();
        if let Some(path) = crate::foreign::luks_file_path(uri) {
            // A LUKS file has no snapshots: opening "at" one must not give the head, writable.
            if let Some(snapshot) = &options.snapshot {
                return Err(ImageError::InvalidParameter {
                    image,
                    reason: format!(
                        "a LUKS file has no snapshots (`{snapshot}`); convert it with \
                         `ivdisk convert` to take snapshots"
                    ),
                });
            }
            return crate::foreign::open_file(&image, path, passphrase, options).await;
        }
        // Read-only (a snapshot always is): the store too, so that a local image opens on a
        // read-only directory and beside a writer in another process.
        let read_only = options.read_only || options.snapshot.is_some();
        let store = match read_only {
            true => uri.open_store_read_only().await?,
            false => uri.open_store(false).await?,
        };
        let opened = Image::open_in(image, store, uri.image_name(), passphrase, options).await?;
        let _ = opened.inner.uri.set(uri.clone());
        // Not on a librbd image's header: librbd takes every non-empty answer to its notifies
        // there for a lock owner's, and a second one broke its lock handover (`rbd snap
        // create` beside a running client failed with EINVAL). ivdisk removes no such image
        // anyway.
        if read_only && !opened.inner.foreign {
            opened.mark_reader(uri).await?;
        }
        Ok(opened)
    }

    /// Keep what this read-only open reads from being removed by another open while it is
    /// open (`readers.rs`). Once marked, it checks that what it opened is still there: a
    /// removal that ended before the mark was taken went unseen.
    async fn mark_reader(&self, uri: &ImageUri) -> Result<(), ImageError> {
        let inner = &self.inner;
        let Some(mark) = crate::readers::mark_reader(
            uri,
            inner.store.as_ref(),
            &inner.header_object,
            &inner.shown(),
            self.snapshot_id(),
        )
        .await?
        else {
            return Ok(());
        };
        inner.check_still_there().await?;
        let watched = matches!(mark, crate::readers::ReaderHold::Watching(_));
        *inner.reader_mark.lock().unwrap_or_else(|e| e.into_inner()) = Some(mark);
        inner.reads_watched.store(watched, Ordering::Release);
        Ok(())
    }

    /// [`Image::open`] of the image `image_name` (shown as `image`) in an open store (also
    /// [`Image::open_on`]).
    pub(crate) async fn open_in(
        image: String,
        store: Arc<dyn ObjectStore>,
        image_name: &str,
        passphrase: &[u8],
        options: &OpenOptions,
    ) -> Result<Image, ImageError> {
        let header_object = object_name(&image, header_object_name(image_name))?;
        let (header, region) = match read_header(store.as_ref(), &header_object, &image).await {
            // No ivdisk image by that name: a librbd image (`rbd_id.NAME`) perhaps.
            Err(ImageError::NotFound { .. }) => {
                return crate::foreign::open_rbd(store, image_name, &image, passphrase, options)
                    .await;
            }
            other => other?,
        };
        let unlocked = header
            .unlock(&region, passphrase)
            .map_err(ImageError::header(&image))?;
        Image::open_unlocked(
            image,
            store,
            header_object,
            &header,
            unlocked.volume_key,
            options,
            false,
        )
        .await
    }

    /// Open with the volume key already recovered (create, tests). `filling`: just created by
    /// [`Image::create_to_fill`], so its mark is expected.
    async fn open_unlocked(
        image: String,
        store: Arc<dyn ObjectStore>,
        header_object: ObjectName,
        header: &Header,
        volume_key: VolumeKey,
        options: &OpenOptions,
        filling: bool,
    ) -> Result<Image, ImageError> {
        // A snapshot is refused only for markers of the whole image (see `refuse_unfinished`).
        let refuse_unfinished = || {
            crate::backup::refuse_unfinished(
                store.as_ref(),
                &header_object,
                &image,
                filling,
                options.snapshot.is_none(),
                options.finishing_shrink,
            )
        };
        refuse_unfinished().await?;
        let table = SnapshotTable::read(store.as_ref(), &header_object, &image).await?;
        let snapshot = match &options.snapshot {
            None => None,
            Some(name) => {
                Some(
                    table
                        .find(name)
                        .cloned()
                        .ok_or_else(|| ImageError::SnapshotNotFound {
                            image: image.clone(),
                            snapshot: name.clone(),
                        })?,
                )
            }
        };
        // A snapshot is never written.
        let read_only = options.read_only || snapshot.is_some();
        let lock = if read_only {
            None
        } else {
            Some(
                WriterLock::acquire(
                    store.clone(),
                    header_object.clone(),
                    &image,
                    options.lock_duration,
                    HolderRecord::Keep,
                )
                .await
                .map(|mut lock| {
                    lock.set_stall_wait(options.stalled_write_wait);
                    lock
                })?,
            )
        };
        // Read again under the lock: another writer may have resized before we held it.
        let header = match &lock {
            Some(_) => {
                let again = read_header(store.as_ref(), &header_object, &image).await?.0;
                // The image unlocked may be gone meanwhile (the passphrase's key derivation
                // takes seconds): deleted and made again under the name, a header restored
                // over it. Its key then opened another image's header, wrote sectors that
                // key cannot have written and read that image's as integrity errors.
                check_same_image(&image, header, &again, &volume_key)?;
                // Markers checked before the lock: a delete, rollback or restore that
                // started since (or a dead holder's, taken over) is seen now.
                refuse_unfinished().await?;
                again
            }
            None => header.clone(),
        };
        let parsed = parse_header(&image, &header)?;
        // Under the lock the table cannot change any more (snapshot changes take it too).
        let table = match &lock {
            Some(_) => SnapshotTable::read(store.as_ref(), &header_object, &image).await?,
            None => table,
        };
        let mut cipher_params =
            CipherParams::new(parsed.sector_size as usize, parsed.params.image_id);
        let mut nonces_reserved = 0;
        if parsed.suite.write_limit().is_some() {
            let used = read_nonce_reservation(store.as_ref(), &header_object)
                .await
                .map_err(ImageError::store(&image))?;
            cipher_params.writes_used = used;
            nonces_reserved = used;
        }
        let cipher = new_cipher(parsed.suite, &volume_key, &cipher_params)
            .map_err(ImageError::crypto(&image))?;
        drop(volume_key);
        Ok(Image::from_spec(EngineSpec {
            data_prefix: NumberedNames::new(data_object_prefix(&parsed.params.image_id))
                .map_err(ImageError::store(&image))?,
            name: image,
            store,
            header_object,
            sector_size: parsed.sector_size as usize,
            object_size: parsed.params.object_size,
            data_offset: 0,
            iv_sector_base: 0,
            size: snapshot.as_ref().map_or(parsed.size, |s| s.size),
            suite: parsed.suite,
            layout: parsed.layout,
            cipher,
            image_id: parsed.params.image_id,
            read_only,
            lock,
            nonces_reserved,
            foreign: false,
            snap_context: table.context(),
            snapshot: snapshot.map(|s| (s.name, s.id)),
            metadata_cache_bytes: options.metadata_cache_bytes,
        }))
    }

    /// Assemble an open image from its parts (ivdisk images above; LUKS volumes made by other
    /// tools in `foreign.rs`).
    pub(crate) fn from_spec(spec: EngineSpec) -> Image {
        let geometry = ObjectGeometry {
            sector_size: spec.sector_size,
            metadata_len: spec.suite.metadata_len(),
            nonce_len: spec.suite.counted_nonce_len(),
            sectors_per_object: (spec.object_size / spec.sector_size as u64) as u32,
        };
        let writable_head = !(spec.read_only || spec.snapshot.is_some());
        let metadata_cache = match spec.layout.cached_region(geometry) {
            Some((region_offset, region_len, None)) if writable_head => MetadataCache::new(
                region_offset,
                region_len,
                spec.store.write_unit(),
                spec.metadata_cache_bytes,
            ),
            // A layout that writes whole blocks only cannot be written without the cache: it
            // gets at least the smallest one, whatever the option says.
            Some((region_offset, region_len, Some(block))) if writable_head => MetadataCache::new(
                region_offset,
                region_len,
                block,
                spec.metadata_cache_bytes
                    .max(crate::metadata_cache::minimum_bytes(block as usize)),
            ),
            _ => None,
        };
        // A LUKS volume's objects are slices of the volume (not listed by number). An image
        // of a few objects is stat'ed whole in less time than a RADOS pool of many other
        // images' objects takes to list.
        let objects = (spec.data_offset + spec.size).div_ceil(spec.object_size);
        let object_map = match (&spec.lock, &spec.snapshot) {
            _ if spec.data_offset != 0 || objects <= LIST_ABOVE_OBJECTS => None,
            (_, Some(_)) => ObjectMap::new(objects, true),
            (Some(_), None) => ObjectMap::new(objects, false),
            (None, None) => None,
        };
        let lost_at_open = spec.store.lost_transactions();
        let inner = Inner {
            object_map,
            metadata_cache,
            metadata_cache_reads: spec.metadata_cache_bytes > 0,
            data_prefix: spec.data_prefix,
            name: spec.name,
            store: spec.store,
            header_object: spec.header_object,
            sector_size: spec.sector_size,
            object_size: spec.object_size,
            data_offset: spec.data_offset,
            iv_sector_base: spec.iv_sector_base,
            size: AtomicU64::new(spec.size),
            suite: spec.suite,
            layout_kind: spec.layout,
            layout: spec.layout.build(geometry),
            cipher: spec.cipher,
            image_id: spec.image_id,
            ranges: RangeLocks::new(
                spec.object_size / spec.sector_size as u64,
                spec.data_offset / spec.sector_size as u64,
            ),
            read_only: spec.read_only,
            writes_allowed: spec
                .lock
                .as_ref()
                .map_or_else(|| Arc::new(AtomicBool::new(false)), WriterLock::healthy),
            lock: Mutex::new(spec.lock),
            lost_at_open,
            loss_reported: AtomicBool::new(false),
            nonces_reserved: AtomicU64::new(spec.nonces_reserved),
            nonces_claimed: AtomicU64::new(spec.nonces_reserved),
            nonce_reserve: tokio::sync::Mutex::new(()),
            header_change: tokio::sync::Mutex::new(()),
            reader_mark: std::sync::Mutex::new(None),
            reads_watched: AtomicBool::new(false),
            reads_watched_since: AtomicU64::new(0),
            reader_recheck: tokio::sync::Mutex::new(()),
            watch_lost_since: std::sync::Mutex::new(None),
            watch_lost: AtomicBool::new(false),
            uri: std::sync::OnceLock::new(),
            foreign: spec.foreign,
            snapshot: spec.snapshot,
            has_snap_context: AtomicBool::new(spec.snap_context.is_some()),
            snap_context: std::sync::RwLock::new(spec.snap_context),
        };
        tracing::debug!(image = %inner.name, read_only = inner.read_only, "opened image");
        Image {
            inner: Arc::new(inner),
        }
    }

    /// Flush, then release the writer lock. Other clones of this image stop being able to
    /// write.
    pub async fn close(self) -> Result<(), ImageError> {
        let name = self.inner.name.clone();
        let flushed = if self.inner.read_only {
            Ok(())
        } else {
            self.flush().await
        };
        self.inner.writes_allowed.store(false, Ordering::Release);
        // A reader's mark goes as a writer's lock does (clones of this handle read no more).
        drop(
            self.inner
                .reader_mark
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take(),
        );
        let lock = self
            .inner
            .lock
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take();
        if let Some(lock) = lock {
            let released = lock.release().await;
            // Again, now that the renewal thread is gone: one that found the lock renewed
            // after a failure may have allowed writes in between.
            self.inner.writes_allowed.store(false, Ordering::Release);
            released.map_err(ImageError::store(&name))?;
        }
        flushed
    }

    /// Why writes are refused, for an image open for writing whose writer lock was lost
    /// (broken, fenced, taken by another writer) or is not renewed in time, asking the store
    /// whether the lock is still this writer's; `None` while it is held, and for read-only
    /// opens.
    pub async fn writer_lock_lost(&self) -> Option<String> {
        let confirm = {
            let lock = self.inner.lock.lock().unwrap_or_else(|e| e.into_inner());
            lock.as_ref()?.confirm_held()
        };
        match confirm {
            Err(why) => Some(why),
            Ok(confirm) => confirm.await,
        }
    }

    /// The image as addressed when opened.
    pub fn name(&self) -> &str {
        &self.inner.name
    }

    /// Size in bytes.
    pub fn size(&self) -> u64 {
        self.inner.size.load(Ordering::Acquire)
    }

    pub fn sector_size(&self) -> usize {
        self.inner.sector_size
    }

    pub fn suite(&self) -> Suite {
        self.inner.suite
    }

    pub fn layout(&self) -> LayoutKind {
        self.inner.layout_kind
    }

    pub fn object_size(&self) -> u64 {
        self.inner.object_size
    }

    /// The longest range [`Image::allocation`] answers without listing the store's objects
    /// (wherever it starts): what a caller that asks again and again, as an NBD server's
    /// block status does, should ask about at most. Longer ranges without an object map list
    /// every object of the image (on RADOS, of the pool) each time.
    pub fn allocation_span_unlisted(&self) -> u64 {
        (LIST_ABOVE_OBJECTS - 1) * self.inner.object_size
    }

    pub fn image_id(&self) -> ImageId {
        self.inner.image_id
    }

    /// A LUKS volume made by another tool (cryptsetup, librbd), opened through the engine.
    /// Other tools read its sectors too, so zeros must be stored encrypted (see `foreign.rs`).
    pub fn is_foreign(&self) -> bool {
        self.inner.foreign
    }

    pub fn is_read_only(&self) -> bool {
        self.inner.read_only
    }

    /// The store object holding data object `n` (for tools and tests that look at objects).
    pub fn data_object(&self, n: u64) -> ObjectName {
        self.inner.data_object(n)
    }

    /// The store the image lives in.
    pub fn store(&self) -> &Arc<dyn ObjectStore> {
        &self.inner.store
    }

    /// Change the size. Shrinking discards the data past the new end and needs `allow_shrink`.
    pub async fn resize(&self, new_size: u64, allow_shrink: bool) -> Result<(), ImageError> {
        let inner = &self.inner;
        inner.check_writable()?;
        if inner.foreign {
            return Err(invalid(
                &inner.name,
                "resizing a LUKS volume made by another tool is not supported; resize it with that tool (cryptsetup, rbd)",
            ));
        }
        let ss = inner.sector_size as u64;
        if new_size == 0 || !new_size.is_multiple_of(ss) {
            return Err(invalid(
                &inner.name,
                format!(
                    "new size {new_size} is not a positive multiple of the {ss}-byte sector size"
                ),
            ));
        }
        if new_size > MAX_IMAGE_SIZE {
            return Err(invalid(&inner.name, too_large(new_size)));
        }
        let _change = inner.header_change.lock().await;
        // A shrink left unfinished is finished by a resize to its size, and only by one: a
        // resize to another size would leave what it discarded past its own end.
        let mark = ReadOp::new().step(ReadStep::OmapGetByKeys(vec![
            crate::backup::SHRINKING_KEY.to_vec()
        ]));
        if let Ok(results) = inner.store.read_op(&inner.header_object, mark).await {
            if let Some(ReadResult::Omap { pairs, .. }) = results.into_iter().next() {
                if let Some((_, size)) = pairs.first() {
                    let size = String::from_utf8_lossy(size).into_owned();
                    if size != new_size.to_string() {
                        return Err(ImageError::ShrinkUnfinished {
                            image: inner.name.clone(),
                            size,
                        });
                    }
                }
            }
        }
        let old = self.size();
        // Until the header says `new_size`, a shrink that fails (or is dropped) puts the old
        // size back: the header still has it, and a retry must see a shrink to make, and
        // discard what lies past the new end, or a later grow showed that data again.
        let mut restore = SizeRestore {
            size: &inner.size,
            old,
            armed: false,
        };
        let mut readers_held = None;
        if new_size < old {
            if !allow_shrink {
                return Err(invalid(
                    &inner.name,
                    format!(
                        "shrinking from {old} to {new_size} bytes destroys the data past the new end; pass the shrink flag (--allow-shrink) to do it"
                    ),
                ));
            }
            // Refused while another open reads the image: its size is fixed at its open, and
            // it read the discarded part as zeros without an error (an export wrote them into
            // its file and succeeded; a read-only server's clients copied them).
            readers_held = match inner.uri.get() {
                Some(uri) => {
                    crate::readers::hold_off_readers(
                        uri,
                        inner.store.as_ref(),
                        &inner.header_object,
                        &inner.name,
                        crate::readers::HeldOff::Head,
                    )
                    .await?
                }
                None => None,
            };
            // Recorded before the first discard, durably: a shrink killed part-way left the
            // old size over partly discarded objects, which every open took for whole.
            let op = WriteOp::new().step(WriteStep::AssertExists).omap_set(vec![(
                crate::backup::SHRINKING_KEY.to_vec(),
                new_size.to_string().into_bytes(),
            )]);
            let marked = async {
                inner.store.write_op(&inner.header_object, op).await?;
                inner.store.flush().await
            }
            .await;
            if let Err(e) = marked {
                crate::readers::end_hold(inner.store.as_ref(), &inner.header_object, readers_held)
                    .await;
                return Err(ImageError::store(&inner.name)(e));
            }
            // Stop IO past the new end first, then free what lies there.
            inner.size.store(new_size, Ordering::Release);
            restore.armed = true;
            let _all = inner.ranges.lock_exclusive(0, u64::MAX).await;
            // Only what holds data: a shrink of a sparse 8 EiB image must not visit 2^41
            // objects.
            for extent in self.allocation_unchecked(new_size, old - new_size).await? {
                if extent.allocated {
                    let end = extent.offset + extent.len;
                    inner.discard_sectors(extent.offset / ss, end / ss).await?;
                }
            }
            // The discards durable, and none lost, before the smaller size is: a store that
            // lost their commit (a full disk) and committed the header write after it left
            // the smaller size over objects still holding data, which a retry did not visit
            // and a later grow showed again.
            self.flush().await?;
        }
        let (mut header, mut region) =
            read_header(inner.store.as_ref(), &inner.header_object, &inner.name).await?;
        let made_from = region.digest();
        header
            .set_data_size(&mut region, Some(new_size))
            .map_err(ImageError::header(&inner.name))?;
        let op = region.write_op().expect("a resize changes the header");
        // The shrink's mark goes with the new size (none there: a no-op).
        let mut steps = op.steps[1..].to_vec();
        steps.push(WriteStep::OmapRemoveKeys(vec![
            crate::backup::SHRINKING_KEY.to_vec(),
        ]));
        // Stored while the header's bytes are those read, whatever the object's version: a
        // lock renewal (RADOS), a nonce reservation or a keyslot change's record moves it
        // without changing them, and the resize failed with a bare version mismatch.
        crate::header_object::store_unless_header_changed(
            inner.store.as_ref(),
            &inner.header_object,
            &inner.name,
            &made_from,
            region.version(),
            &steps,
        )
        .await?;
        restore.armed = false;
        inner.size.store(new_size, Ordering::Release);
        // Readers open again once the header has the new size.
        crate::readers::end_hold(inner.store.as_ref(), &inner.header_object, readers_held).await;
        tracing::info!(image = %inner.name, old, new = new_size, "resized image");
        Ok(())
    }

    /// What the header says about an image, read without a passphrase.
    pub async fn info(uri: &ImageUri) -> Result<ImageInfo, ImageError> {
        let image = uri.to_string();
        if let Some(path) = crate::foreign::luks_file_path(uri) {
            return crate::foreign::info_file(&image, path).await;
        }
        let store = uri.open_store_read_only().await?;
        let object = object_name(&image, header_object_name(uri.image_name()))?;
        let (header, _) = match read_header(store.as_ref(), &object, &image).await {
            // No ivdisk image by that name: a librbd image (`rbd_id.NAME`) perhaps.
            Err(ImageError::NotFound { .. }) => {
                return crate::foreign::info_rbd(store, uri.image_name(), &image).await;
            }
            other => other?,
        };
        let parsed = parse_header(&image, &header)?;
        Ok(ImageInfo {
            size: parsed.size,
            suite: parsed.suite,
            layout: parsed.layout,
            sector_size: parsed.sector_size,
            object_size: parsed.params.object_size,
            image_id: parsed.params.image_id,
            keyslots: header.keyslots().iter().map(|k| k.id).collect(),
            snapshots: SnapshotTable::read(store.as_ref(), &object, &image)
                .await?
                .snapshots,
            unfinished: crate::backup::refuse_unfinished_restore(store.as_ref(), &object, &image)
                .await
                .err()
                .map(|e| e.to_string()),
            header_warning: header.warning().map(str::to_owned),
        })
    }

    /// Delete an image: its data objects, then its header. Refused while a writer holds it.
    /// `progress` is called with (objects removed, objects in all).
    pub async fn delete(
        uri: &ImageUri,
        mut progress: impl FnMut(u64, u64),
    ) -> Result<(), ImageError> {
        if let Some(path) = crate::foreign::luks_file_path(uri) {
            return Err(ImageError::InvalidParameter {
                image: uri.to_string(),
                reason: format!(
                    "this is {}, not an ivdisk image: delete it as a file (rm); nothing was \
                     deleted",
                    crate::foreign::describe_file(path)
                ),
            });
        }
        // Holding the writer lock keeps a writer from opening while its objects go.
        let crate::snapshot::Locked {
            image,
            store,
            header_object,
            parsed,
            lock,
        } = crate::snapshot::lock_header(uri).await?;
        let snapshots = SnapshotTable::read(store.as_ref(), &header_object, &image).await?;
        if !snapshots.snapshots.is_empty() {
            drop(lock.release().await);
            return Err(ImageError::HasSnapshots {
                image,
                names: snapshots.snapshots.into_iter().map(|s| s.name).collect(),
            });
        }
        // Held to the end: no reader opens it meanwhile.
        let readers_held_off = crate::readers::hold_off_readers(
            uri,
            store.as_ref(),
            &header_object,
            &image,
            crate::readers::HeldOff::Everything,
        )
        .await;
        let _readers_held_off = match readers_held_off {
            Ok(hold) => hold,
            Err(e) => {
                drop(lock.release().await);
                return Err(e);
            }
        };
        // Recorded before the first object goes: a delete stopped part-way (a signal, a crash,
        // a store error) left an image that opened, served and verified, reading zeros where
        // its objects were removed. Only a delete goes on from there.
        let op = WriteOp::new()
            .step(WriteStep::AssertExists)
            .omap_set(vec![(crate::backup::DELETING_KEY.to_vec(), Vec::new())]);
        store
            .write_op(&header_object, op)
            .await
            .map_err(ImageError::store(&image))?;
        store.flush().await.map_err(ImageError::store(&image))?;
        let objects = store
            .list(&data_object_prefix(&parsed.params.image_id))
            .await
            .map_err(ImageError::store(&image))?;
        let total = objects.len() as u64;
        let mut done = 0;
        for batch in objects.chunks(32) {
            let results = futures_util::future::join_all(
                batch
                    .iter()
                    .map(|o| store.write_op(o, WriteOp::new().step(WriteStep::Remove))),
            )
            .await;
            for result in results {
                match result {
                    Ok(_) | Err(StoreError::NotFound { .. }) => {}
                    Err(e) => return Err(ImageError::store(&image)(e)),
                }
            }
            done += batch.len() as u64;
            progress(done, total);
        }
        // The header goes before the lock: a reader or writer opening in between would find
        // an image without data (a reader ignores the removal record once the lock is gone).
        let removed = lock.remove_locked_object().await;
        if let Err(why) = removed.map_err(ImageError::store(&image))? {
            return Err(ImageError::LockLost {
                image,
                reason: format!(
                    "{why}; the data objects are removed, the header is left: run the delete \
                     again"
                ),
            });
        }
        store.flush().await.map_err(ImageError::store(&image))?;
        tracing::info!(image = %image, objects = total, "deleted image");
        Ok(())
    }

    /// Who holds the image's writer lock, if anyone.
    pub async fn lock_holder(uri: &ImageUri) -> Result<Option<Locker>, ImageError> {
        if let Some(path) = crate::foreign::luks_file_path(uri) {
            return crate::foreign::lock_holder_file(&uri.to_string(), path).await;
        }
        let (image, store, object) = existing_header_object(uri, true).await?;
        writer_lock::holder(store.as_ref(), &object)
            .await
            .map_err(ImageError::store(&image))
    }

    /// Refuse with [`ImageError::Locked`] now what an open for writing would refuse later:
    /// a RADOS image whose writer lock another client holds for at least another
    /// [`LOCK_HELD_MARGIN`], found without a passphrase (`ivdisk serve` asks for one only
    /// after this). Other images pass: a local store names the process that has it open
    /// itself (`LocalStore::writing_process`), a LUKS file's flock is found by the open, and
    /// a lock about to expire is left to the open, which takes it once it has. A holder that
    /// does not answer within 5 s and is gone (killed on this host, or its watch timed out)
    /// is fenced and its lock broken instead (`writer_lock::take_over_if_silent`).
    pub async fn refuse_if_write_locked(uri: &ImageUri) -> Result<(), ImageError> {
        if !matches!(uri, ImageUri::Rados { .. }) {
            return Ok(());
        }
        // Not knowing is no refusal: the open decides.
        let Ok(Some(locker)) = Self::lock_holder(uri).await else {
            return Ok(());
        };
        if locker
            .expires_in
            .is_some_and(|left| left < LOCK_HELD_MARGIN)
        {
            return Ok(());
        }
        // A holder that does not answer is fenced and its lock taken away here, so the open
        // finds it free (and does not ask a second time).
        if let Ok((image, store, object)) = existing_header_object(uri, false).await {
            if writer_lock::take_over_if_silent(store.as_ref(), &object, &locker, &image).await {
                return Ok(());
            }
        }
        Err(ImageError::Locked {
            image: uri.to_string(),
            holder: writer_lock::describe(&locker),
            expires_in: locker.expires_in,
            breakable: true,
        })
    }

    /// Break the writer lock of a client that is gone. Returns the holder it removed, and
    /// where it was fenced. Without fencing, only do this when that client is dead: two
    /// writers corrupt nothing cryptographically but lose each other's writes.
    pub async fn break_lock(
        uri: &ImageUri,
        fencing: Fencing,
    ) -> Result<Option<BrokenLock>, ImageError> {
        Self::break_lock_of(uri, fencing, None).await
    }

    /// [`Image::break_lock`], only if the lock is still held by `confirmed` (its client and
    /// cookie), as a user who confirmed breaking that holder's lock saw it: a lock that
    /// changed hands meanwhile (a restarted server took it over) is not broken, nor its new
    /// holder fenced (`ImageError::Locked`, naming it). `None`: whoever holds it.
    pub async fn break_lock_of(
        uri: &ImageUri,
        fencing: Fencing,
        confirmed: Option<&Locker>,
    ) -> Result<Option<BrokenLock>, ImageError> {
        if crate::foreign::luks_file_path(uri).is_some() {
            return Err(ImageError::InvalidParameter {
                image: uri.to_string(),
                reason: "the writer lock of a LUKS file is a flock held by a live process; it \
                         goes away when that process exits, there is nothing to break"
                    .into(),
            });
        }
        let (image, store, object) = existing_header_object(uri, false).await?;
        let Some(holder) = writer_lock::holder(store.as_ref(), &object)
            .await
            .map_err(ImageError::store(&image))?
        else {
            return Ok(None);
        };
        if let Some(confirmed) = confirmed {
            if (&confirmed.client, &confirmed.cookie) != (&holder.client, &holder.cookie) {
                return Err(ImageError::Locked {
                    image,
                    holder: writer_lock::describe(&holder),
                    expires_in: None,
                    breakable: true,
                });
            }
        }
        let fenced_at = match (fencing, &holder.address) {
            (Fencing::Holder, Some(address)) => {
                let fenced = store.fence_client(&holder.client, address).await;
                match fenced.map_err(ImageError::store(&image))? {
                    true => {
                        writer_lock::remove_writer_record(store.as_ref(), &object, &holder.client)
                            .await;
                        Some(address.clone())
                    }
                    false => None,
                }
            }
            _ => None,
        };
        if let Some(address) = &fenced_at {
            tracing::warn!(image = %image, client = %holder.client, %address, "fenced the writer");
        }
        match store
            .break_lock(&object, WRITER_LOCK, &holder.client, &holder.cookie)
            .await
        {
            Ok(()) | Err(StoreError::NotLocked { .. }) => {}
            Err(e) => return Err(ImageError::store(&image)(e)),
        }
        tracing::warn!(image = %image, client = %holder.client, "broke the writer lock");
        Ok(Some(BrokenLock { holder, fenced_at }))
    }
}

/// Whether [`Image::break_lock`] first cuts the lock's holder off from the store.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fencing {
    /// Cut it off first (RADOS: blocklist its client, as librbd does when it breaks a lock),
    /// so that a holder that only seemed dead cannot write beside the next writer; the break
    /// fails if the store refuses (`StoreError::CannotFence`). Stores that need no fencing
    /// (local, memory) break at once.
    Holder,
    /// Break without: the caller knows the holder is stopped.
    Skip,
}

/// A writer lock [`Image::break_lock`] removed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BrokenLock {
    /// Who held it.
    pub holder: Locker,
    /// Where the holder's client was cut off from the store, if it was (RADOS: the address
    /// now on the cluster's blocklist).
    pub fenced_at: Option<String>,
}

/// The store (opened read-only if `read_only`) and the object holding the writer lock of an
/// existing image (`NotFound` if there is none), with the image's display name: its header
/// object, or for a librbd image on RADOS (which `rados://` opens too) its `rbd_header.ID`.
async fn existing_header_object(
    uri: &ImageUri,
    read_only: bool,
) -> Result<(String, Arc<dyn ObjectStore>, ObjectName), ImageError> {
    let image = uri.to_string();
    let store = match read_only {
        true => uri.open_store_read_only().await?,
        false => uri.open_store(false).await?,
    };
    let object = object_name(&image, header_object_name(uri.image_name()))?;
    if store
        .stat(&object)
        .await
        .map_err(ImageError::store(&image))?
        .is_none()
    {
        if let ImageUri::Rados { .. } = uri {
            let rbd = crate::foreign::lock_object_rbd(store.as_ref(), uri.image_name(), &image);
            if let Some(object) = rbd.await? {
                return Ok((image, store, object));
            }
        }
        return Err(ImageError::NotFound { image });
    }
    Ok((image, store, object))
}

async fn read_nonce_reservation(
    store: &dyn ObjectStore,
    object: &ObjectName,
) -> Result<u64, StoreError> {
    let op = ReadOp::new().step(ReadStep::OmapGetByKeys(vec![NONCE_KEY.to_vec()]));
    let results = store.read_op(object, op).await?;
    let value = match results.into_iter().next() {
        Some(ReadResult::Omap { pairs, .. }) => pairs.first().map(|(_, v)| v.to_vec()),
        _ => None,
    };
    match value {
        None => Ok(0),
        Some(v) => std::str::from_utf8(&v)
            .ok()
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| {
                StoreError::Corrupt(format!(
                    "header object `{object}`: the nonce reservation is not a number"
                ))
            }),
    }
}

impl Inner {
    pub(crate) fn data_object(&self, n: u64) -> ObjectName {
        self.data_prefix.name(n)
    }

    /// The snapshot context for a data write (a clone: writes own their operation).
    pub(crate) fn snap_context(&self) -> Option<SnapContext> {
        if !self.has_snap_context.load(Ordering::Acquire) {
            return None;
        }
        self.snap_context
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// The snapshot reads go to (`None`: the head).
    pub(crate) fn read_snap(&self) -> Option<SnapId> {
        self.snapshot.as_ref().map(|&(_, id)| id)
    }

    /// What this open reads is still there as it was opened: (`NotFound` once the header
    /// object is gone) the image under the name is the one opened (not deleted and made
    /// again since), no delete, rollback or restore began, and the snapshot read is not
    /// removed.
    async fn check_still_there(&self) -> Result<(), ImageError> {
        let store = self.store.as_ref();
        let (header, _) = read_header(store, &self.header_object, &self.name).await?;
        if parse_header(&self.name, &header)?.params.image_id != self.image_id {
            return Err(ImageError::HeaderChanged {
                image: self.name.clone(),
            });
        }
        let head = self.snapshot.is_none();
        crate::backup::refuse_unfinished(
            store,
            &self.header_object,
            &self.name,
            false,
            head,
            false,
        )
        .await?;
        let table = SnapshotTable::read(store, &self.header_object, &self.name).await?;
        if let Some((name, id)) = &self.snapshot {
            if table.find(name).map(|s| s.id) != Some(*id) {
                return Err(ImageError::SnapshotNotFound {
                    image: self.name.clone(),
                    snapshot: name.clone(),
                });
            }
        }
        Ok(())
    }

    /// Called once a read has its data, before it is handed out: a read-only open of a RADOS
    /// image counts on its watch of the header to keep what it reads from being removed
    /// (`readers.rs`), so its reads are good only if the OSD held that watch when they
    /// completed. A watch lost (this client cut off from the cluster, or stopped, for
    /// longer than the watch timeout) let a delete or `snap rm` elsewhere go on unseen, and
    /// the objects it removed read as holes, zeros: such reads wait until the watch is
    /// confirmed or registered again (and what is read is found still there), and are
    /// refused once it has been lost for `LOST_WATCH_WAIT`.
    pub(crate) async fn check_reads_watched(&self) -> Result<(), ImageError> {
        if !self.reads_watched.load(Ordering::Acquire) {
            return Ok(());
        }
        let lost = |removed: Option<&str>| ImageError::ReaderWatchLost {
            image: self.shown(),
            removed: removed.map(str::to_owned),
        };
        loop {
            let status = match &*self.reader_mark.lock().unwrap_or_else(|e| e.into_inner()) {
                Some(crate::readers::ReaderHold::Watching(watch)) => watch.status(),
                // Closed: nothing is kept from removal any more.
                _ => return Ok(()),
            };
            let registration = match status {
                WatchStatus::Held { registration } => {
                    // A load first: the usual read writes nothing shared.
                    if self.watch_lost.load(Ordering::Acquire)
                        && self.watch_lost.swap(false, Ordering::AcqRel)
                    {
                        *self
                            .watch_lost_since
                            .lock()
                            .unwrap_or_else(|e| e.into_inner()) = None;
                    }
                    registration
                }
                // Reads complete, so the cluster is reachable: librados confirms the watch at
                // its next ping, or hears that it is gone and registers it again.
                WatchStatus::Lost => {
                    let since = *self
                        .watch_lost_since
                        .lock()
                        .unwrap_or_else(|e| e.into_inner())
                        .get_or_insert_with(std::time::Instant::now);
                    self.watch_lost.store(true, Ordering::Release);
                    let waited = since.elapsed();
                    if waited >= LOST_WATCH_WAIT {
                        return Err(lost(None));
                    }
                    pause((LOST_WATCH_WAIT - waited).min(LOST_WATCH_POLL)).await;
                    continue;
                }
                WatchStatus::ObjectGone => return Err(lost(Some("it was deleted"))),
            };
            if registration == self.reads_watched_since.load(Ordering::Acquire) {
                return Ok(());
            }
            // Registered again: whatever was removed while it was lost shows in the header.
            let _one_check = self.reader_recheck.lock().await;
            if registration == self.reads_watched_since.load(Ordering::Acquire) {
                continue;
            }
            self.check_still_there().await.map_err(|e| match e {
                ImageError::NotFound { .. } => lost(Some("it was deleted")),
                ImageError::HeaderChanged { .. } => lost(Some(
                    "it was deleted (an image of the same name was made since)",
                )),
                ImageError::SnapshotNotFound { snapshot, .. } => {
                    lost(Some(&format!("its snapshot `{snapshot}` was removed")))
                }
                other => other,
            })?;
            crate::readers::refuse_if_removing(
                self.store.as_ref(),
                &self.header_object,
                &self.shown(),
                self.read_snap(),
            )
            .await?;
            tracing::info!(
                image = %self.shown(),
                "the watch on the image's header is registered again and the image is unchanged: reads go on"
            );
            // Checked for this registration; the loop asks again whether it still holds.
            self.reads_watched_since
                .store(registration, Ordering::Release);
        }
    }

    /// The image (and snapshot) as messages about reads name it.
    fn shown(&self) -> String {
        match &self.snapshot {
            Some((name, _)) => crate::uri::at_snapshot(&self.name, name),
            None => self.name.clone(),
        }
    }

    /// Refuse once the store has lost acknowledged writes since this open
    /// (`ImageError::WritesLost`); logged the first time.
    pub(crate) fn check_nothing_lost(&self) -> Result<(), ImageError> {
        if self.store.lost_transactions() == self.lost_at_open {
            return Ok(());
        }
        let error = ImageError::WritesLost {
            image: self.name.clone(),
        };
        if !self.loss_reported.swap(true, Ordering::AcqRel) {
            tracing::error!("{error}");
        }
        Err(error)
    }

    /// [`Inner::check_writable`] for a write about to start: while writes are refused only
    /// until the writer lock is renewed (the store did not answer a renewal in time), it
    /// waits for that, up to `OpenOptions::stalled_write_wait`, as librbd holds writes
    /// while it cannot renew its lock. A lock lost for good, or a wait that long, fails it.
    pub(crate) async fn wait_writable(&self) -> Result<(), ImageError> {
        let started = std::time::Instant::now();
        loop {
            let refused = match self.check_writable() {
                Err(e @ ImageError::LockLost { .. }) => e,
                other => return other,
            };
            let stalled = self
                .lock
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .as_ref()
                .and_then(WriterLock::stalled);
            let Some((changed, wait)) = stalled else {
                return Err(refused);
            };
            if started.elapsed() >= wait {
                return Err(refused);
            }
            let notified = changed.notified();
            let mut notified = std::pin::pin!(notified);
            // Registered before the state is looked at again, so no change is missed.
            notified.as_mut().enable();
            if self.writes_allowed.load(Ordering::Acquire) {
                continue;
            }
            // No timer here (the crate does not pick the runtime): the renewal thread tells
            // of every renewal that fails (a third of the lock's life apart, or the store's
            // timeout for one that hangs), and the bound is checked at each.
            notified.await;
        }
    }

    pub(crate) fn check_writable(&self) -> Result<(), ImageError> {
        if self.writes_allowed.load(Ordering::Acquire) {
            return self.check_nothing_lost();
        }
        if self.read_only {
            return Err(ImageError::ReadOnly {
                image: self.name.clone(),
            });
        }
        let lock = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        match lock.as_ref() {
            None => Err(ImageError::LockLost {
                image: self.name.clone(),
                reason: "the image was closed".into(),
            }),
            Some(lock) => match lock.lost() {
                Some(reason) => Err(ImageError::LockLost {
                    image: self.name.clone(),
                    reason,
                }),
                None => self.check_nothing_lost(),
            },
        }
    }

    /// Make sure `sectors` more nonces are reserved in the header object before they are
    /// used (suites with a write limit), so a crash never lets a nonce count repeat.
    pub(crate) async fn reserve_nonces(&self, sectors: u64) -> Result<(), ImageError> {
        if self.suite.write_limit().is_none() {
            return Ok(());
        }
        // Claimed before the check: writes in flight count whether or not they encrypted yet.
        // (A write that fails after claiming wastes its nonces, never reuses them.)
        let claimed = self.nonces_claimed.fetch_add(sectors, Ordering::AcqRel) + sectors;
        let needed = claimed.max(self.cipher.writes_used().unwrap_or(0) + sectors);
        if needed <= self.nonces_reserved.load(Ordering::Acquire) {
            return Ok(());
        }
        let _one = self.nonce_reserve.lock().await;
        let reserved = self.nonces_reserved.load(Ordering::Acquire);
        if needed <= reserved {
            return Ok(());
        }
        let new = needed.max(reserved) + NONCE_RESERVATION;
        let op = WriteOp::new().omap_set(vec![(NONCE_KEY.to_vec(), new.to_string().into_bytes())]);
        self.store
            .write_op(&self.header_object, op)
            .await
            .map_err(ImageError::store(&self.name))?;
        self.store
            .flush()
            .await
            .map_err(ImageError::store(&self.name))?;
        self.nonces_reserved.store(new, Ordering::Release);
        Ok(())
    }
}

/// Puts an image's size back to `old` when dropped while `armed` (`Image::resize`).
struct SizeRestore<'a> {
    size: &'a AtomicU64,
    old: u64,
    armed: bool,
}

impl Drop for SizeRestore<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.size.store(self.old, Ordering::Release);
        }
    }
}

#[cfg(test)]
mod reads_watched_tests {
    //! `Inner::check_reads_watched` with a watch whose status the test sets (a RADOS
    //! reader's watch, as `readers.rs` takes it, on a `mem:` image).
    use super::*;
    use crate::readers::ReaderHold;
    use ivdisk_store::{Watch, WatchRegistration};

    #[derive(Clone)]
    struct SetStatus(Arc<Mutex<WatchStatus>>);

    impl WatchRegistration for SetStatus {
        fn status(&self) -> WatchStatus {
            *self.0.lock().unwrap()
        }
    }

    impl SetStatus {
        fn set(&self, status: WatchStatus) {
            *self.0.lock().unwrap() = status;
        }
    }

    /// A 1 MiB `mem:` image whose first sector holds 7s, opened read-only with a watch whose
    /// status starts held (registration 0).
    async fn watched_reader() -> (Image, SetStatus, ImageUri) {
        let mut hex = [0u8; 6];
        getrandom::getrandom(&mut hex).unwrap();
        let uri = ImageUri::parse(&format!("mem:watched-{}", hex::encode(hex))).unwrap();
        let options = CreateOptions {
            pbkdf: PbkdfRequest::fast_for_tests(ivdisk_header::PbkdfKind::Pbkdf2),
            ..CreateOptions::new(1 << 20)
        };
        let writer = Image::create(&uri, &options, b"pw").await.unwrap();
        writer.write(0, &[7u8; 4096]).await.unwrap();
        writer.close().await.unwrap();
        let reader = Image::open(
            &uri,
            b"pw",
            &OpenOptions {
                read_only: true,
                ..OpenOptions::default()
            },
        )
        .await
        .unwrap();
        let status = SetStatus(Arc::new(Mutex::new(WatchStatus::Held { registration: 0 })));
        *reader.inner.reader_mark.lock().unwrap() =
            Some(ReaderHold::Watching(Watch::new(status.clone())));
        reader.inner.reads_watched.store(true, Ordering::Release);
        (reader, status, uri)
    }

    async fn first_sector(image: &Image) -> Result<Vec<u8>, ImageError> {
        image.read_owned(0, 4096).await
    }

    #[tokio::test]
    async fn reads_wait_for_a_lost_watch_and_go_on_once_it_is_held() {
        let (reader, status, _uri) = watched_reader().await;
        assert_eq!(first_sector(&reader).await.unwrap(), [7u8; 4096]);
        status.set(WatchStatus::Lost);
        let confirmed = status.clone();
        let confirmer = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(300));
            confirmed.set(WatchStatus::Held { registration: 0 });
        });
        let started = std::time::Instant::now();
        assert_eq!(first_sector(&reader).await.unwrap(), [7u8; 4096]);
        assert!(started.elapsed() >= Duration::from_millis(250));
        confirmer.join().unwrap();
        // Registered again, the image unchanged: checked, and reads go on.
        status.set(WatchStatus::Held { registration: 1 });
        assert_eq!(first_sector(&reader).await.unwrap(), [7u8; 4096]);
        assert_eq!(reader.inner.reads_watched_since.load(Ordering::Acquire), 1);
    }

    #[tokio::test]
    async fn reads_are_refused_once_the_watch_stays_lost() {
        let (reader, status, _uri) = watched_reader().await;
        status.set(WatchStatus::Lost);
        let started = std::time::Instant::now();
        let refused = first_sector(&reader).await.unwrap_err();
        assert!(
            matches!(refused, ImageError::ReaderWatchLost { removed: None, .. }),
            "{refused}"
        );
        assert!(started.elapsed() >= LOST_WATCH_WAIT);
        // Lost that long already: the next read is refused at once.
        let started = std::time::Instant::now();
        assert!(first_sector(&reader).await.is_err());
        assert!(started.elapsed() < LOST_WATCH_WAIT / 2);
        // And allocation queries, whose holes could be objects removed unseen.
        assert!(reader.allocation(0, 1 << 20).await.is_err());
        status.set(WatchStatus::Held { registration: 0 });
        assert_eq!(first_sector(&reader).await.unwrap(), [7u8; 4096]);
    }

    #[tokio::test]
    async fn reads_fail_for_good_once_the_image_was_deleted_unseen() {
        let (reader, status, uri) = watched_reader().await;
        status.set(WatchStatus::ObjectGone);
        let refused = first_sector(&reader).await.unwrap_err();
        assert!(
            matches!(&refused, ImageError::ReaderWatchLost { removed: Some(what), .. } if what == "it was deleted"),
            "{refused}"
        );
        // Registered again on an image deleted meanwhile (here: its header object made
        // again is not the one opened, or gone): refused, naming the deletion.
        status.set(WatchStatus::Held { registration: 1 });
        Image::delete(&uri, |_, _| {}).await.unwrap();
        let refused = first_sector(&reader).await.unwrap_err();
        assert!(
            matches!(&refused, ImageError::ReaderWatchLost { removed: Some(what), .. } if what == "it was deleted"),
            "{refused}"
        );
    }
}
