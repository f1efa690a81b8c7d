//! NBD server for ivdisk images (the NBD project's doc/proto.md): fixed newstyle negotiation
//! (`GO`, `INFO`, `EXPORT_NAME`, `LIST`, `ABORT`, `STRUCTURED_REPLY`, `SET/LIST_META_CONTEXT`
//! with `base:allocation`), structured replies with error chunks, replies out of order,
//! `READ`, `WRITE`, `FLUSH`, `TRIM`, `WRITE_ZEROES` (`NO_HOLE`, `FAST_ZERO`), `FUA`,
//! `BLOCK_STATUS`; several connections per export (`CAN_MULTI_CONN`: they share one device,
//! so a flush on one covers writes completed on all); Unix sockets and TCP, with TLS
//! (`STARTTLS`, x509 credentials, client certificates required: [`serve_with_tls`]).
//!
//! - [`BlockDevice`]: what is exported (four required methods); ivdisk images implement it
//!   (`image.rs`), and so do librbd images (`rbd.rs`, ivdisk-rbd's `RbdImage`).
//! - [`serve`]: listen, serve, and on shutdown finish requests in flight.
//!
//! Layering: this crate knows NBD and the block-device trait; it never sees layouts, keys or
//! stores (docs/ARCHITECTURE.md).

#![deny(unsafe_code)]

mod device;
mod error;
mod ffi;
mod handshake;
mod image;
pub mod proto;
mod rbd;
mod server;
mod tls;
mod transmission;

pub use device::{BlockDevice, DeviceError, DeviceErrorKind, Extent};
pub use error::NbdError;
pub use handshake::MAX_PAYLOAD;
pub use server::{
    serve, serve_with_options, serve_with_tls, Export, ListenAddress, Listener, ServeOptions,
    ServeStats, DEFAULT_STALL_TIMEOUT, MAX_CONNECTIONS,
};
pub use tls::{TlsCredentials, TlsKind};
