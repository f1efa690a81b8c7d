//! [`RbdImage`]: an open librbd image, plain or with librbd's LUKS encryption loaded, as a
//! byte-addressed async device, over the `ffi` module.

use std::ffi::CString;
use std::fmt;

use futures_channel::oneshot;
use ivdisk_header::{Header, MemoryHeaderIo};
use ivdisk_rados::{RadosConfig, RadosStore, RawIoContext};
use zeroize::Zeroizing;

use crate::ffi::{self, Errno, ImageHandle, Pending};
use crate::options::PROBE_LEN;
use crate::uri::image_spec;
use crate::{Encryption, LuksFormat, LuksInfo, RbdError, RbdInfo, RbdOpenOptions};

/// The largest LUKS2 binary header plus JSON area (LUKS2 allows 16 KiB to 4 MiB); both copies
/// are read for `inspect`.
const MAX_LUKS2_HDR_SIZE: u64 = 4 << 20;

/// An open librbd image.
///
/// Requests take `&self` and may run concurrently from any number of tasks and threads
/// (librbd's asynchronous calls are thread-safe); each is submitted on its future's first
/// poll and owns its buffers until librbd completes it, so dropping a future in flight is
/// safe (the request still completes, unseen). Offsets and lengths are bytes; librbd does
/// the read-modify-write of partial sectors itself, also under LUKS.
///
/// The size is read once at open (what an NBD export announces); a resize by another client
/// is not seen until the image is reopened.
pub struct RbdImage {
    // Declared before `_io`: the image is closed before the connection it runs on goes.
    handle: ImageHandle,
    /// The io context librbd dup'd at open, and with it the cluster connection.
    _io: RawIoContext,
    image: String,
    size: u64,
    encryption: Option<LuksFormat>,
    read_only: bool,
    snapshot: bool,
    /// Writes that cover part of a LUKS sector hold it alone, all others share it: librbd's
    /// crypto layer read-modify-writes such sectors and restarts when another write raced it
    /// (`ERANGE`), and 32 small overlapping ones at once slowed to a crawl or stopped
    /// altogether (both of librados' threads blocked in its throttle). rbd-nbd avoids them by
    /// a 4 KiB block size, which fio's nbd engine or a raw client do not honour.
    partial_sector_writes: tokio::sync::RwLock<()>,
}

impl fmt::Debug for RbdImage {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("RbdImage")
            .field("image", &self.image)
            .field("size", &self.size)
            .field("encryption", &self.encryption)
            .field("read_only", &self.read_only)
            .finish()
    }
}

/// Run a blocking librbd call (open, encryption load, close) on a helper thread, so that the
/// runtime's threads keep serving other requests meanwhile.
async fn blocking<T: Send + 'static>(
    image: &str,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, RbdError> {
    let (tx, rx) = oneshot::channel();
    std::thread::Builder::new()
        .name("ivdisk-rbd".into())
        .spawn(move || {
            let _ = tx.send(f());
        })
        .map_err(|e| RbdError::Closed {
            image: image.to_owned(),
            reason: format!("cannot start a thread for a librbd call: {e}"),
        })?;
    rx.await.map_err(|_| RbdError::Closed {
        image: image.to_owned(),
        reason: "a librbd call panicked".into(),
    })
}

/// `work`'s result; `notice` runs once if it takes longer than `after`.
async fn noticed_after<T>(
    after: std::time::Duration,
    work: impl std::future::Future<Output = T>,
    notice: impl FnOnce(),
) -> T {
    tokio::pin!(work);
    tokio::select! {
        done = &mut work => done,
        _ = tokio::time::sleep(after) => {
            notice();
            work.await
        }
    }
}

/// Close a handle that is no longer wanted (an open that failed halfway) on a helper thread,
/// then its connection (librbd still uses the cluster while it closes). Awaited, not left
/// to the background: a process that exits on the error would otherwise leave the image's
/// watch behind for the OSDs' watch timeout, and `rbd rm` refuses an image with watchers.
async fn close_quietly(image: &str, handle: ImageHandle, io: RawIoContext) {
    let closed = blocking(image, move || {
        let closed = handle.close();
        drop(io);
        closed
    })
    .await;
    if let Err(e) = closed
        .map_err(|e| e.to_string())
        .and_then(|r| r.map_err(|e| e.to_string()))
    {
        tracing::warn!(%image, error = %e, "closing an rbd image after a failed open");
    }
}

fn c_name(image: &str, what: &str, name: &str) -> Result<CString, RbdError> {
    ffi::c_string(name).map_err(|_| RbdError::InvalidUri {
        uri: image.to_owned(),
        reason: format!("the {what} name holds a NUL byte"),
    })
}

/// Wait for a submitted request; a completion librbd dropped is an error, not a hang.
async fn wait<T>(image: &str, pending: Pending<T>) -> Result<ffi::Done<T>, RbdError> {
    pending.await.map_err(|_| RbdError::Closed {
        image: image.to_owned(),
        reason: "librbd dropped a request without completing it".into(),
    })
}

impl RbdImage {
    /// Connect to the cluster `config` names (pool and namespace included), open the image
    /// and load its encryption as `options.encryption` says. Blocking librbd calls (open,
    /// the key derivation of a LUKS unlock: seconds by design) run on a helper thread.
    pub async fn open(config: &RadosConfig, options: RbdOpenOptions) -> Result<RbdImage, RbdError> {
        let RbdOpenOptions {
            image: name,
            snapshot,
            read_only,
            encryption,
            exclusive,
        } = options;
        let image = image_spec(config, &name, snapshot.as_deref());
        // `io` bound before `handle`, so that a future dropped at an await below drops the
        // handle (`rbd_close`) first: librbd's handle uses the connection `io` keeps up.
        let (opened, io) =
            open_handle(config, &image, &name, snapshot.as_deref(), read_only).await?;
        let handle = opened;
        let load = match choose_encryption(&image, &handle, encryption).await {
            Ok(load) => load,
            Err(e) => {
                close_quietly(&image, handle, io).await;
                return Err(e);
            }
        };
        let (handle, encryption) = match load {
            None => (handle, None),
            Some((format, passphrase)) => {
                let mut handle = handle;
                // The connection goes along and is given back after the handle: if this
                // future is dropped meanwhile, the thread closes the handle while it lives.
                let thread_io = io.clone();
                let (handle, loaded, _thread_io) = blocking(&image, move || {
                    let r = handle.encryption_load(format, &passphrase);
                    drop(passphrase);
                    (handle, r, thread_io)
                })
                .await?;
                if let Err(e) = loaded {
                    close_quietly(&image, handle, io).await;
                    return Err(match e.0 {
                        // libcryptsetup's "no key available with this passphrase".
                        libc::EPERM => RbdError::WrongPassphrase { image, format },
                        libc::ETIMEDOUT => open_error(&image, e),
                        _ => RbdError::EncryptionLoad {
                            image,
                            format,
                            source: e.io_error(),
                        },
                    });
                }
                (handle, Some(format))
            }
        };
        let size = match handle.size() {
            Ok(size) => size,
            Err(e) => {
                close_quietly(&image, handle, io).await;
                return Err(RbdError::Open {
                    image,
                    source: e.io_error(),
                });
            }
        };
        // NBD and `off_t` take sizes up to 2^63 - 1; librbd without an object map takes more.
        if size > i64::MAX as u64 {
            close_quietly(&image, handle, io).await;
            return Err(RbdError::Open {
                image,
                source: std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("its size, {size} bytes, is past the largest ivdisk serves (2^63 - 1)"),
                ),
            });
        }
        let handle = match exclusive && !read_only && snapshot.is_none() {
            true => {
                let thread_io = io.clone();
                // A holder that died answers no request to give the lock up; librbd takes it
                // over only once the OSDs drop that client's watch. Said, or a served image
                // stays silent for half a minute.
                let locking = blocking(&image, move || {
                    let r = handle.lock_exclusive();
                    (handle, r, thread_io)
                });
                let (handle, locked, _thread_io) = noticed_after(LOCK_WAIT_NOTICE, locking, || {
                    tracing::warn!(
                        %image,
                        "still waiting for librbd's exclusive lock of {image} after {} s: its \
                         holder does not give it up. If that client died, librbd takes the lock \
                         over once the OSDs drop its watch (about 30 s, \
                         osd_client_watch_timeout); `rbd status` lists the image's watchers",
                        LOCK_WAIT_NOTICE.as_secs()
                    )
                })
                .await?;
                match locked {
                    Ok(()) => {}
                    // The image has no exclusive-lock feature: nothing keeps writers apart.
                    Err(Errno(libc::EINVAL | libc::EOPNOTSUPP)) => tracing::warn!(
                        %image,
                        "the image has no exclusive-lock feature (`rbd feature enable {image} \
                         exclusive-lock`): librbd cannot keep a second writer out"
                    ),
                    Err(e @ Errno(libc::ETIMEDOUT)) => {
                        close_quietly(&image, handle, io).await;
                        return Err(open_error(&image, e));
                    }
                    // librbd's word for "another client keeps the lock" (its errno text,
                    // "Read-only file system", only misled).
                    Err(Errno(libc::EROFS | libc::EBUSY)) => {
                        close_quietly(&image, handle, io).await;
                        return Err(RbdError::OtherWriter { image });
                    }
                    Err(e) => {
                        close_quietly(&image, handle, io).await;
                        return Err(RbdError::Open {
                            image,
                            source: std::io::Error::new(
                                e.io_error().kind(),
                                format!("taking its exclusive lock failed: {e}"),
                            ),
                        });
                    }
                }
                handle
            }
            false => handle,
        };
        tracing::debug!(%image, size, ?encryption, read_only, "opened rbd image");
        Ok(RbdImage {
            handle,
            _io: io,
            image,
            size,
            encryption,
            read_only: read_only || snapshot.is_some(),
            snapshot: snapshot.is_some(),
            partial_sector_writes: tokio::sync::RwLock::new(()),
        })
    }

    /// Size and LUKS header of an image, without a passphrase (opens it read-only, reads its
    /// first bytes raw and parses a LUKS header found there).
    pub async fn inspect(
        config: &RadosConfig,
        name: &str,
        snapshot: Option<&str>,
    ) -> Result<RbdInfo, RbdError> {
        let image = image_spec(config, name, snapshot);
        // `io` bound before `handle`: dropped at an await, the handle is closed first.
        let (opened, io) = open_handle(config, &image, name, snapshot, true).await?;
        let handle = opened;
        let info = inspect_handle(&image, &handle).await;
        // Read-only opens hold no watch or lock: closing is quick, but still a librbd call,
        // with the connection kept up until it returns.
        blocking(&image, move || {
            let closed = handle.close();
            drop(io);
            closed
        })
        .await?
        .map_err(|e| RbdError::Close {
            image: image.clone(),
            source: e.io_error(),
        })?;
        info
    }

    /// `POOL/IMAGE[@SNAP]`.
    pub fn name(&self) -> &str {
        &self.image
    }

    /// Bytes readable at offsets from 0: for a LUKS image, the data after its header.
    pub fn size(&self) -> u64 {
        self.size
    }

    /// The encryption loaded at open (`None`: the raw image is served).
    pub fn encryption(&self) -> Option<LuksFormat> {
        self.encryption
    }

    /// Opened read-only, or at a snapshot.
    pub fn is_read_only(&self) -> bool {
        self.read_only
    }

    fn check(&self, offset: u64, len: u64) -> Result<(), RbdError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.size => Ok(()),
            _ => Err(RbdError::OutOfRange {
                image: self.image.clone(),
                offset,
                len,
                size: self.size,
            }),
        }
    }

    fn check_write(&self, offset: u64, len: u64) -> Result<(), RbdError> {
        if self.read_only {
            return Err(RbdError::ReadOnly {
                image: self.image.clone(),
                snapshot: self.snapshot,
            });
        }
        self.check(offset, len)
    }

    fn error(&self, what: &'static str, offset: u64, len: u64, e: Errno) -> RbdError {
        let image = self.image.clone();
        match e.0 {
            libc::EROFS if self.read_only => RbdError::ReadOnly {
                image,
                snapshot: self.snapshot,
            },
            // Opened read-write, yet refused: the message must not blame this handle's mode.
            libc::EROFS => RbdError::WriteRefused {
                image,
                what,
                offset,
            },
            libc::ETIMEDOUT => RbdError::OsdTimeout {
                image,
                what: crate::error::describe(what, offset, len),
                unsure: match what {
                    "read" => "",
                    "flush" => " (the writes before it may or may not have reached the OSDs)",
                    _ => " (the range may hold the old or the new data)",
                },
            },
            libc::ENOSPC | libc::EDQUOT => RbdError::NoSpace {
                image,
                what,
                offset,
                source: e.io_error(),
            },
            _ => RbdError::Io {
                image,
                what,
                offset,
                len,
                source: e.io_error(),
            },
        }
    }

    /// Run a write (or zeroing) of `[offset, offset + len)`: alone if it covers part of a
    /// LUKS sector (see `partial_sector_writes`), beside the others otherwise.
    async fn write_op<T>(
        &self,
        offset: u64,
        len: u64,
        op: impl std::future::Future<Output = T>,
    ) -> T {
        let sector = match self.encryption {
            None => return op.await,
            // Pacific's `rbd encryption format` makes LUKS2 with 4096-byte sectors; LUKS1
            // has 512-byte ones.
            Some(LuksFormat::Luks2) => 4096,
            Some(LuksFormat::Luks1) => 512,
        };
        if offset.is_multiple_of(sector) && len.is_multiple_of(sector) {
            let _shared = self.partial_sector_writes.read().await;
            op.await
        } else {
            let _alone = self.partial_sector_writes.write().await;
            op.await
        }
    }

    /// Wait for a request and turn a negative return value into an error.
    async fn finish<T>(
        &self,
        what: &'static str,
        offset: u64,
        len: u64,
        submitted: Result<Pending<T>, Errno>,
    ) -> Result<ffi::Done<T>, RbdError> {
        let pending = submitted.map_err(|e| self.error(what, offset, len, e))?;
        let done = wait(&self.image, pending).await?;
        if done.rval < 0 {
            let errno = i32::try_from(-done.rval).unwrap_or(libc::EIO);
            return Err(self.error(what, offset, len, Errno(errno)));
        }
        Ok(done)
    }

    /// Read `buf.len()` bytes at `offset` (unwritten ranges read as zeros).
    pub async fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), RbdError> {
        let len = buf.len() as u64;
        self.check(offset, len)?;
        if buf.is_empty() {
            return Ok(());
        }
        let done = self
            .finish("read", offset, len, self.handle.aio_read(offset, buf.len()))
            .await?;
        if done.rval as u64 != len {
            return Err(RbdError::Io {
                image: self.image.clone(),
                what: "read",
                offset,
                len,
                source: std::io::Error::new(
                    std::io::ErrorKind::UnexpectedEof,
                    format!("librbd returned {} bytes", done.rval),
                ),
            });
        }
        buf.copy_from_slice(&done.payload);
        Ok(())
    }

    /// Write `data` at `offset`.
    pub async fn write(&self, offset: u64, data: &[u8]) -> Result<(), RbdError> {
        let len = data.len() as u64;
        self.check_write(offset, len)?;
        if data.is_empty() {
            return Ok(());
        }
        self.write_op(offset, len, async {
            self.finish(
                "write",
                offset,
                len,
                self.handle.aio_write(offset, data.to_vec()),
            )
            .await
        })
        .await?;
        Ok(())
    }

    /// librbd's discard: frees whole objects and, by default, skips ranges smaller than its
    /// discard granularity (`rbd_discard_granularity_bytes`), which then keep their data.
    /// To make a range read as zeros, use [`RbdImage::write_zeroes`].
    pub async fn discard(&self, offset: u64, len: u64) -> Result<(), RbdError> {
        self.check_write(offset, len)?;
        if len == 0 {
            return Ok(());
        }
        self.write_op(offset, len, async {
            self.finish("discard", offset, len, self.handle.aio_discard(offset, len))
                .await
        })
        .await?;
        Ok(())
    }

    /// Make `[offset, offset + len)` read as zeros. `may_unmap`: librbd zeroes partial
    /// objects and deallocates whole ones; otherwise the range stays allocated (librbd's
    /// thick-provisioning write-zeroes, as qemu asks for when it must not unmap).
    pub async fn write_zeroes(
        &self,
        offset: u64,
        len: u64,
        may_unmap: bool,
    ) -> Result<(), RbdError> {
        self.check_write(offset, len)?;
        if len == 0 {
            return Ok(());
        }
        let n = usize::try_from(len).map_err(|_| RbdError::OutOfRange {
            image: self.image.clone(),
            offset,
            len,
            size: self.size,
        })?;
        self.write_op(offset, len, async {
            self.finish(
                "write-zeroes",
                offset,
                len,
                self.handle.aio_write_zeroes(offset, n, !may_unmap),
            )
            .await
        })
        .await?;
        Ok(())
    }

    /// Make every completed write durable (librbd's cache included).
    pub async fn flush(&self) -> Result<(), RbdError> {
        if self.read_only {
            return Ok(());
        }
        self.finish("flush", 0, 0, self.handle.aio_flush()).await?;
        Ok(())
    }

    /// Flush, then close the image (releasing librbd's exclusive lock and watch) and the
    /// cluster connection. Dropping an image closes it too, blocking the dropping thread.
    pub async fn close(self) -> Result<(), RbdError> {
        let flushed = self.flush().await;
        let RbdImage {
            handle, _io, image, ..
        } = self;
        // The connection kept up until the close returns, also if this future is dropped.
        let closed = blocking(&image, move || {
            let closed = handle.close();
            drop(_io);
            closed
        })
        .await?;
        flushed?;
        closed.map_err(|e| RbdError::Close {
            image,
            source: e.io_error(),
        })
    }
}

/// How long taking librbd's exclusive lock may take before the wait is logged.
const LOCK_WAIT_NOTICE: std::time::Duration = std::time::Duration::from_secs(5);

/// Connect and `rbd_open` (on a helper thread).
async fn open_handle(
    config: &RadosConfig,
    image: &str,
    name: &str,
    snapshot: Option<&str>,
    read_only: bool,
) -> Result<(ImageHandle, RawIoContext), RbdError> {
    let c_image = c_name(image, "image", name)?;
    let c_snap = snapshot.map(|s| c_name(image, "snapshot", s)).transpose()?;
    let store = RadosStore::open(config)
        .await
        .map_err(|source| RbdError::Rados {
            image: image.to_owned(),
            source,
        })?;
    let io = store.raw_io_context();
    // The store's other io contexts are not needed; `io` keeps the connection.
    drop(store);
    let read_only = read_only || snapshot.is_some();
    let c_namespace = match config.namespace.as_str() {
        "" => None,
        namespace => Some(c_name(image, "namespace", namespace)?),
    };
    let thread_io = io.clone();
    // The connection is given back after the result: if this future is dropped while the
    // thread opens, the handle it returns is closed while the connection still lives.
    let (opened, namespace_missing, _thread_io) = blocking(image, move || {
        let open = |snap: Option<&CString>| {
            ImageHandle::open(
                thread_io.as_ptr(),
                &c_image,
                snap.map(CString::as_c_str),
                read_only,
            )
        };
        let opened = match open(c_snap.as_ref()) {
            // ENOENT at a snapshot: the image or the snapshot? The head opening says which.
            Err(Errno(libc::ENOENT)) if c_snap.is_some() => match open(None) {
                Ok(head) => {
                    drop(head);
                    Err((Errno(libc::ENOENT), true))
                }
                Err(e) => Err((e, false)),
            },
            other => other.map_err(|e| (e, false)),
        };
        // Not found in a namespace: the namespace itself may be what is missing.
        let namespace_missing = match (&opened, &c_namespace) {
            (Err((Errno(libc::ENOENT), false)), Some(namespace)) => {
                ffi::namespace_exists(thread_io.as_ptr(), namespace) == Ok(false)
            }
            _ => false,
        };
        (opened, namespace_missing, thread_io)
    })
    .await?;
    match opened {
        Ok(handle) => Ok((handle, io)),
        Err((Errno(libc::ENOENT), true)) => Err(RbdError::NoSuchSnapshot {
            image: image_spec(config, name, None),
            snapshot: snapshot.unwrap_or_default().to_owned(),
        }),
        Err((Errno(libc::ENOENT), false)) if namespace_missing => Err(RbdError::NoSuchNamespace {
            pool: config.pool.clone(),
            namespace: config.namespace.clone(),
        }),
        Err((Errno(libc::ENOENT), false)) => Err(RbdError::NotFound {
            image: image.to_owned(),
            pool: match config.namespace.as_str() {
                "" => config.pool.clone(),
                namespace => format!("{}/{namespace}", config.pool),
            },
        }),
        Err((e, _)) => Err(open_error(image, e)),
    }
}

/// An error of opening `image` (or of the librbd calls right after it).
fn open_error(image: &str, e: Errno) -> RbdError {
    match e.0 {
        libc::ETIMEDOUT => RbdError::OsdTimeout {
            image: image.to_owned(),
            what: "opening it".into(),
            unsure: "",
        },
        _ => RbdError::Open {
            image: image.to_owned(),
            source: e.io_error(),
        },
    }
}

/// The first bytes of the raw image (before any encryption is loaded).
async fn read_raw(image: &str, handle: &ImageHandle, len: u64) -> Result<Vec<u8>, RbdError> {
    let size = handle.size().map_err(|e| RbdError::Open {
        image: image.to_owned(),
        source: e.io_error(),
    })?;
    let len = len.min(size) as usize;
    if len == 0 {
        return Ok(Vec::new());
    }
    let io_error = |e: Errno| match e.0 {
        // Part of the open (the LUKS header's detection), and said as such.
        libc::ETIMEDOUT => open_error(image, e),
        _ => RbdError::Io {
            image: image.to_owned(),
            what: "header read",
            offset: 0,
            len: len as u64,
            source: e.io_error(),
        },
    };
    let done = wait(image, handle.aio_read(0, len).map_err(io_error)?).await?;
    if done.rval < 0 {
        return Err(io_error(Errno(
            i32::try_from(-done.rval).unwrap_or(libc::EIO),
        )));
    }
    let mut bytes = done.payload;
    bytes.truncate(done.rval as usize);
    Ok(bytes)
}

/// The LUKS format at byte 0, if any.
async fn detect(image: &str, handle: &ImageHandle) -> Result<Option<LuksFormat>, RbdError> {
    let head = read_raw(image, handle, PROBE_LEN as u64).await?;
    LuksFormat::detect(&head).map_err(|version| RbdError::UnsupportedLuksVersion {
        image: image.to_owned(),
        version,
    })
}

/// What to load: `None` for plain, or a format and its passphrase.
async fn choose_encryption(
    image: &str,
    handle: &ImageHandle,
    encryption: Encryption,
) -> Result<Option<(LuksFormat, Zeroizing<Vec<u8>>)>, RbdError> {
    let (expected, passphrase) = match encryption {
        Encryption::None => return Ok(None),
        Encryption::Auto { passphrase } => match detect(image, handle).await? {
            None => return Ok(None),
            Some(format) => match passphrase {
                Some(passphrase) => return Ok(Some((format, passphrase))),
                None => {
                    return Err(RbdError::PassphraseRequired {
                        image: image.to_owned(),
                        format,
                    })
                }
            },
        },
        Encryption::Luks1 { passphrase } => (LuksFormat::Luks1, passphrase),
        Encryption::Luks2 { passphrase } => (LuksFormat::Luks2, passphrase),
    };
    // Checked here for a clear error: librbd would only say EINVAL.
    let found = detect(image, handle).await?;
    if found != Some(expected) {
        return Err(RbdError::NotEncrypted {
            image: image.to_owned(),
            expected,
            found,
        });
    }
    Ok(Some((expected, passphrase)))
}

async fn inspect_handle(image: &str, handle: &ImageHandle) -> Result<RbdInfo, RbdError> {
    let raw_size = handle.size().map_err(|e| RbdError::Open {
        image: image.to_owned(),
        source: e.io_error(),
    })?;
    let head = read_raw(image, handle, PROBE_LEN as u64).await?;
    let format = LuksFormat::detect(&head).map_err(|version| RbdError::UnsupportedLuksVersion {
        image: image.to_owned(),
        version,
    })?;
    let Some(format) = format else {
        return Ok(RbdInfo {
            image: image.to_owned(),
            raw_size,
            luks: None,
        });
    };
    // LUKS1's header fits in the first 4 KiB; LUKS2 needs both copies of binary header and
    // JSON area, whose size its binary header gives (bytes 8..16, big-endian).
    let bytes = match format {
        LuksFormat::Luks1 => head,
        LuksFormat::Luks2 => {
            let hdr_size = head
                .get(8..16)
                .map_or(0, |b| u64::from_be_bytes(b.try_into().expect("8 bytes")));
            read_raw(
                image,
                handle,
                2 * hdr_size.clamp(PROBE_LEN as u64, MAX_LUKS2_HDR_SIZE),
            )
            .await?
        }
    };
    let header_error = |source| RbdError::Header {
        image: image.to_owned(),
        format,
        source,
    };
    let header = Header::read(&MemoryHeaderIo(bytes)).map_err(header_error)?;
    let segment = header.segment().map_err(header_error)?;
    Ok(RbdInfo {
        image: image.to_owned(),
        raw_size,
        luks: Some(LuksInfo {
            format,
            cipher: segment.cipher,
            sector_size: segment.sector_size,
            data_offset: segment.offset,
            keyslots: header.keyslots().iter().map(|k| k.id).collect(),
        }),
    })
}
