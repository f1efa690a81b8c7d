/// What serving can fail with. Per-request failures are not errors here: they go to the
/// client as NBD error replies and the connection carries on.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum NbdError {
    /// Could not listen on the address.
    #[error("cannot listen on {address}: {source}")]
    Bind {
        address: String,
        #[source]
        source: std::io::Error,
    },

    /// The Unix socket path is in use by a live server, or is not a socket.
    #[error("cannot listen on {path}: {reason}")]
    SocketInUse { path: String, reason: String },

    /// The client broke the protocol; its connection was closed (other clients carry on).
    #[error("client {peer} broke the NBD protocol: {reason}; connection closed")]
    Protocol { peer: String, reason: String },

    /// The client stopped sending a request or reading its replies while other clients
    /// waited for the server budget it held; its connection was closed so that they go on.
    #[error("client {peer} {reason}; connection closed so that the others can go on")]
    Stalled { peer: String, reason: String },

    /// The TLS handshake with a client failed (no certificate, one of another authority, no
    /// common protocol version); its connection was closed.
    #[error("TLS with client {peer} failed: {reason}; connection closed")]
    TlsHandshake { peer: String, reason: String },

    /// The connection failed (reset, closed in the middle of a message).
    #[error("connection to {peer}: {source}")]
    Io {
        peer: String,
        #[source]
        source: std::io::Error,
    },

    /// TLS credentials that cannot be used (a file missing, unreadable, or not matching).
    #[error("TLS credentials in {dir}: {reason}")]
    TlsCredentials { dir: String, reason: String },

    /// Server configuration that cannot work (no exports, duplicate names).
    #[error("NBD server: {0}")]
    Config(String),
}
