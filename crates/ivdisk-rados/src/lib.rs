//! The RADOS backend of ivdisk: an [`ivdisk_store::ObjectStore`] on a Ceph pool, through our
//! own minimal FFI to librados' C API (`ffi`, the only module with `unsafe`).
//!
//! RADOS gives natively what the store trait promises: one operation on one object applies
//! all its writes and omap changes atomically, operations on one object apply in submission
//! order, self-managed snapshots and `cls_lock` advisory locks. Where librados' C API falls
//! short of the trait, the store says so (see [`RadosStore`]).
//!
//! The `librados` feature (default) links librados (Debian: `librados-dev`). Without it the
//! crate builds and [`RadosStore::open`] fails with [`RadosError::NotBuilt`].

#![deny(unsafe_code)]

mod config;
mod error;
// Only the librados store decodes lock info (its unit tests run in the default build).
#[cfg(feature = "librados")]
mod lock_info;

#[cfg(feature = "librados")]
mod ffi;
#[cfg(feature = "librados")]
mod store;
#[cfg(not(feature = "librados"))]
mod store_disabled;

pub use config::RadosConfig;
pub use error::RadosError;
#[cfg(feature = "librados")]
pub use store::{RadosStore, RawIoContext};
#[cfg(not(feature = "librados"))]
pub use store_disabled::RadosStore;
