//! librbd images for ivdisk: our own minimal FFI to librbd's C API (`ffi`, the only module
//! with `unsafe`), so that `ivdisk serve rbd://POOL/IMAGE` puts librbd (plain, or with its
//! own LUKS1/LUKS2 encryption) behind the same NBD server as ivdisk images, and a benchmark
//! compares the two through one front end.
//!
//! - [`RbdUri`], the address: `rbd://POOL/IMAGE[@SNAP]?conf=&id=&keyring=&namespace=&encryption=`.
//! - [`RbdImage`]: open (connecting through ivdisk-rados, whose io context librbd takes),
//!   encryption detected or chosen ([`Encryption`]), async byte-range IO from many tasks at
//!   once, flush, close; [`RbdImage::inspect`] for size and LUKS header without a passphrase.
//! - [`RbdError`], one enum, matchable, messages naming `POOL/IMAGE`.
//!
//! The `librbd` feature (default) links librbd (Debian: `librbd-dev`) and librados. Without
//! it the crate builds and [`RbdImage::open`] fails with [`RbdError::NotBuilt`].

#![deny(unsafe_code)]

mod error;
mod options;
mod uri;

#[cfg(feature = "librbd")]
mod ffi;
#[cfg(feature = "librbd")]
mod image;
#[cfg(not(feature = "librbd"))]
mod image_disabled;

pub use error::RbdError;
#[cfg(feature = "librbd")]
pub use image::RbdImage;
#[cfg(not(feature = "librbd"))]
pub use image_disabled::RbdImage;
pub use options::{
    Encryption, EncryptionKind, LuksFormat, LuksInfo, RbdInfo, RbdOpenOptions, LUKS_MAGIC,
    PROBE_LEN,
};
pub use uri::{image_spec, RbdUri, RBD_OP_TIMEOUT, SCHEME};
