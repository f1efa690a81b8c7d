//! Listening (Unix socket or TCP), one task per connection, and shutdown: stop accepting,
//! let every connection finish the requests it has read, then return so the caller can
//! flush and close what it exported.

use std::fmt;
use std::future::Future;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Duration;

use tokio::io::{AsyncRead, AsyncWrite};
use tokio::net::{TcpListener, UnixListener, UnixStream};
use tokio::sync::watch;
use tokio::task::JoinSet;

use crate::device::BlockDevice;
use crate::handshake::{greet, options, Haggled, Negotiated, TlsState};
use crate::tls::TlsCredentials;
use crate::transmission::{transmit, Ending, PayloadSource, ServerBudget};
use crate::NbdError;

/// A client must pick an export within this time after connecting (qemu-nbd's default
/// handshake limit).
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(10);
/// The longest path a Unix socket address holds (`sun_path` less its terminating NUL).
const SUN_PATH_MAX: usize = 107;
/// Connections served at once; more are closed right after accept.
pub const MAX_CONNECTIONS: usize = 256;
/// Connections still in their handshake (not yet attached to an export: with `--tls-creds`,
/// not yet authenticated), in all and from one address: more are closed right after accept,
/// so connections that never finish their handshake cannot take every slot from clients
/// that would (they did: 256 silent connects locked out a client with valid certificates).
const MAX_NEGOTIATING: usize = 64;
const MAX_NEGOTIATING_PER_ADDRESS: usize = 8;
/// TCP keepalive: a client gone without closing (its host crashed, the network split) is
/// found out and its connection closed after about `KEEPALIVE_IDLE` + 6 x 10 s of silence,
/// instead of holding its slot for ever.
const KEEPALIVE_IDLE: Duration = Duration::from_secs(60);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
const KEEPALIVE_PROBES: u32 = 6;
/// How long a connection may make no progress within a request or a reply while other
/// connections wait for the server budget it holds, before it is closed (see
/// `transmission::ServerBudget`). Alone, it may stall as long as it likes.
pub const DEFAULT_STALL_TIMEOUT: Duration = Duration::from_secs(20);

/// How [`serve_with_options`] serves.
#[derive(Clone)]
pub struct ServeOptions {
    /// Require TLS of every client (see [`serve_with_tls`]).
    pub tls: Option<TlsCredentials>,
    /// See [`DEFAULT_STALL_TIMEOUT`].
    pub stall_timeout: Duration,
}

impl Default for ServeOptions {
    fn default() -> ServeOptions {
        ServeOptions {
            tls: None,
            stall_timeout: DEFAULT_STALL_TIMEOUT,
        }
    }
}

/// Connections in their handshake, counted in all and by client address (TCP).
#[derive(Default)]
struct Negotiating {
    counts: std::sync::Mutex<(usize, std::collections::HashMap<std::net::IpAddr, usize>)>,
}

/// One connection's place among the negotiating ones, given back when dropped (the handshake
/// ended, either way).
struct NegotiatingSlot {
    negotiating: Arc<Negotiating>,
    address: Option<std::net::IpAddr>,
}

impl Negotiating {
    /// A place for a connection from `address`, or why there is none.
    fn enter(
        self: &Arc<Self>,
        address: Option<std::net::IpAddr>,
    ) -> Result<NegotiatingSlot, &'static str> {
        let mut counts = self.counts.lock().unwrap_or_else(|e| e.into_inner());
        if counts.0 >= MAX_NEGOTIATING {
            return Err("too many connections still in their handshake");
        }
        if let Some(address) = address {
            let from_there = counts.1.entry(address).or_insert(0);
            if *from_there >= MAX_NEGOTIATING_PER_ADDRESS {
                return Err("too many connections from this address still in their handshake");
            }
            *from_there += 1;
        }
        counts.0 += 1;
        Ok(NegotiatingSlot {
            negotiating: self.clone(),
            address,
        })
    }
}

impl Drop for NegotiatingSlot {
    fn drop(&mut self) {
        let mut counts = self
            .negotiating
            .counts
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        counts.0 -= 1;
        if let Some(address) = self.address {
            if let std::collections::hash_map::Entry::Occupied(mut entry) = counts.1.entry(address)
            {
                *entry.get_mut() -= 1;
                if *entry.get() == 0 {
                    entry.remove();
                }
            }
        }
    }
}

/// One export: a name clients ask for and the device behind it.
pub struct Export {
    pub name: String,
    pub description: String,
    pub device: Arc<dyn BlockDevice>,
}

impl fmt::Debug for Export {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Export")
            .field("name", &self.name)
            .field("size", &self.device.size())
            .finish()
    }
}

/// Where to listen.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ListenAddress {
    Unix(PathBuf),
    /// `HOST:PORT`.
    Tcp(String),
}

impl fmt::Display for ListenAddress {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ListenAddress::Unix(path) => write!(f, "unix:{}", path.display()),
            ListenAddress::Tcp(addr) => write!(f, "tcp:{addr}"),
        }
    }
}

/// A bound listening socket. A Unix socket's file is removed when the listener is dropped.
pub enum Listener {
    Unix {
        listener: UnixListener,
        path: PathBuf,
    },
    Tcp(TcpListener),
}

impl Drop for Listener {
    fn drop(&mut self) {
        if let Listener::Unix { path, .. } = self {
            let _ = std::fs::remove_file(path);
        }
    }
}

impl Listener {
    /// Bind. A Unix socket path left behind by a server that died is reused; one that a live
    /// server answers on, or a path that is not a socket, is refused. A Unix socket is made
    /// with mode 0600 whatever the umask: only its owner (and root) can connect, as an export
    /// carries the disk's plaintext; loosen it with `set_permissions` after the bind.
    pub async fn bind(address: &ListenAddress) -> Result<Listener, NbdError> {
        match address {
            ListenAddress::Unix(path) => {
                use std::os::unix::ffi::OsStrExt;
                let len = path.as_os_str().as_bytes().len();
                if len > SUN_PATH_MAX {
                    // Bound through a shorter staging path it would be made, and no client
                    // could connect to it.
                    return Err(NbdError::Bind {
                        address: address.to_string(),
                        source: std::io::Error::new(
                            std::io::ErrorKind::InvalidInput,
                            format!(
                                "the path is {len} bytes long, and a Unix socket's address \
                                 holds {SUN_PATH_MAX} at most: pick a shorter path"
                            ),
                        ),
                    });
                }
                clear_stale_socket(path).await?;
                let listener = bind_private_unix(path).map_err(|source| NbdError::Bind {
                    address: address.to_string(),
                    source,
                })?;
                Ok(Listener::Unix {
                    listener,
                    path: path.clone(),
                })
            }
            ListenAddress::Tcp(addr) => {
                let listener = TcpListener::bind(addr)
                    .await
                    .map_err(|source| NbdError::Bind {
                        address: address.to_string(),
                        source,
                    })?;
                Ok(Listener::Tcp(listener))
            }
        }
    }

    /// The address actually bound (the port chosen when binding port 0).
    pub fn local_address(&self) -> ListenAddress {
        match self {
            Listener::Unix { path, .. } => ListenAddress::Unix(path.clone()),
            Listener::Tcp(listener) => ListenAddress::Tcp(
                listener
                    .local_addr()
                    .map(|a| a.to_string())
                    .unwrap_or_default(),
            ),
        }
    }
}

/// Bind a Unix socket at `path` with mode 0600, whatever the umask (connecting needs write
/// permission on the socket file). It is bound in a fresh directory of mode 0700 beside
/// `path`, given its mode there and then linked into place, so no other user can connect in
/// between: a `chmod` after binding at `path` would leave a moment in which another user's
/// connection is queued, to be served later. Linking fails if `path` exists (a server that
/// bound it meanwhile keeps it). Where the staged path would be too long for a socket
/// address, or the file system refuses the link, the socket is bound at `path` and its mode
/// set at once.
fn bind_private_unix(path: &Path) -> std::io::Result<UnixListener> {
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    use std::sync::atomic::{AtomicU32, Ordering};
    static STAGING: AtomicU32 = AtomicU32::new(0);
    let private = || std::fs::Permissions::from_mode(0o600);
    let parent = match path.parent() {
        Some(parent) if !parent.as_os_str().is_empty() => parent,
        _ => Path::new("."),
    };
    // A name no one can guess ahead: a directory of the name left by a process killed in
    // between (in a container the server's pid repeats at every start), or made by another
    // user in a shared /tmp, failed the bind with "File exists" for a path that did not exist.
    let staging_dir = || {
        // std's hash keys: random (from the OS) for each process.
        let salt = std::hash::BuildHasher::hash_one(&std::hash::RandomState::new(), 0u8) as u32;
        parent.join(format!(
            ".ivdisk-{}-{}-{salt:08x}",
            std::process::id(),
            STAGING.fetch_add(1, Ordering::Relaxed)
        ))
    };
    let mut dir = staging_dir();
    let bind_in_place = || {
        let listener = UnixListener::bind(path)?;
        if let Err(e) = std::fs::set_permissions(path, private()) {
            let _ = std::fs::remove_file(path);
            return Err(e);
        }
        Ok(listener)
    };
    // (The longest staged name: the counter has at most 10 digits.)
    if dir.as_os_str().as_bytes().len() + 12 > SUN_PATH_MAX {
        return bind_in_place();
    }
    let mut attempts = 0;
    loop {
        match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
            Ok(()) => break,
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists && attempts < 8 => {
                attempts += 1;
                dir = staging_dir();
            }
            Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => return bind_in_place(),
            Err(e) => return Err(e),
        }
    }
    let staged = dir.join("s");
    let clean_up = || {
        let _ = std::fs::remove_file(&staged);
        let _ = std::fs::remove_dir(&dir);
    };
    let listener = match UnixListener::bind(&staged)
        .and_then(|listener| std::fs::set_permissions(&staged, private()).map(|()| listener))
    {
        Ok(listener) => listener,
        Err(e) => {
            clean_up();
            return Err(e);
        }
    };
    let linked = std::fs::hard_link(&staged, path);
    clean_up();
    match linked {
        Ok(()) => Ok(listener),
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => Err(e),
        Err(_) => {
            drop(listener);
            bind_in_place()
        }
    }
}

async fn clear_stale_socket(path: &Path) -> Result<(), NbdError> {
    use std::os::unix::fs::FileTypeExt;
    let Ok(meta) = std::fs::symlink_metadata(path) else {
        return Ok(());
    };
    let in_use = |reason: &str| NbdError::SocketInUse {
        path: path.display().to_string(),
        reason: reason.to_owned(),
    };
    if !meta.file_type().is_socket() {
        return Err(in_use(
            "the path exists and is not a socket; pick another path",
        ));
    }
    // Only a refusal says nobody listens. A full accept queue (EAGAIN: a live server behind
    // on its accepts) or EACCES (another user's socket) is a live socket: unlinked, its
    // clients would reach this server's disk, and its server would remove this socket later.
    match UnixStream::connect(path).await {
        Ok(_) => {
            return Err(in_use(
                "another server is listening there; stop it or pick another path",
            ))
        }
        Err(e)
            if matches!(
                e.kind(),
                std::io::ErrorKind::ConnectionRefused | std::io::ErrorKind::NotFound
            ) => {}
        Err(e) => {
            return Err(in_use(&format!(
                "a server may be listening there (connecting to it failed: {e}); stop it or \
                 pick another path"
            )))
        }
    }
    tracing::info!(path = %path.display(), "removing a stale socket left by a server that is gone");
    std::fs::remove_file(path).map_err(|source| NbdError::Bind {
        address: path.display().to_string(),
        source,
    })
}

/// Summary of a server run.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct ServeStats {
    pub connections: u64,
    /// Connections closed because the client broke the protocol.
    pub protocol_errors: u64,
    /// Connections closed because their TLS handshake failed.
    pub tls_failures: u64,
    /// Connections closed because they stalled in the way of others ([`NbdError::Stalled`]).
    pub stalled: u64,
}

impl ServeStats {
    /// Count a connection's outcome.
    fn count(&mut self, outcome: &Result<(), NbdError>) {
        match outcome {
            Err(NbdError::Protocol { .. }) => self.protocol_errors += 1,
            Err(NbdError::TlsHandshake { .. }) => self.tls_failures += 1,
            Err(NbdError::Stalled { .. }) => self.stalled += 1,
            _ => {}
        }
    }
}

/// Serve `exports` on `listener` until `shutdown` completes, then stop accepting, let every
/// connection finish the requests it has read (their replies are sent), and return.
pub async fn serve(
    listener: Listener,
    exports: Vec<Export>,
    shutdown: impl Future<Output = ()>,
) -> Result<ServeStats, NbdError> {
    serve_with_tls(listener, exports, None, shutdown).await
}

/// [`serve`], with TLS required of every client when `tls` is given (FORCEDTLS: options
/// before `NBD_OPT_STARTTLS` are refused, and a client must present a certificate of the
/// credentials' authority).
pub async fn serve_with_tls(
    listener: Listener,
    exports: Vec<Export>,
    tls: Option<TlsCredentials>,
    shutdown: impl Future<Output = ()>,
) -> Result<ServeStats, NbdError> {
    let options = ServeOptions {
        tls,
        ..ServeOptions::default()
    };
    serve_with_options(listener, exports, options, shutdown).await
}

/// [`serve`] with every option.
pub async fn serve_with_options(
    listener: Listener,
    exports: Vec<Export>,
    options: ServeOptions,
    shutdown: impl Future<Output = ()>,
) -> Result<ServeStats, NbdError> {
    let ServeOptions { tls, stall_timeout } = options;
    if exports.is_empty() {
        return Err(NbdError::Config("no exports".into()));
    }
    for (i, export) in exports.iter().enumerate() {
        if exports[..i].iter().any(|e| e.name == export.name) {
            return Err(NbdError::Config(format!(
                "export name `{}` given twice",
                export.name
            )));
        }
    }
    let exports: Arc<[Arc<Export>]> = exports.into_iter().map(Arc::new).collect();
    let (stop, stopped) = watch::channel(false);
    let mut connections = JoinSet::new();
    let mut stats = ServeStats::default();
    let mut next_id = 0u64;
    let negotiating = Arc::new(Negotiating::default());
    let mut refusals = Refusals::default();
    let server_budget = Arc::new(ServerBudget::new(stall_timeout));
    tokio::pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            _ = &mut shutdown => break,
            Some(done) = connections.join_next(), if !connections.is_empty() => {
                if let Ok(outcome) = done {
                    stats.count(&outcome);
                }
                continue;
            }
            accepted = accept(&listener) => accepted,
        };
        let (stream, peer) = match accepted {
            Ok(pair) => pair,
            Err(e) => {
                // EMFILE and friends: back off instead of spinning.
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(100)).await;
                continue;
            }
        };
        next_id += 1;
        stats.connections += 1;
        let peer = format!("{peer}#{next_id}");
        if connections.len() >= MAX_CONNECTIONS {
            refusals.note(&peer, "too many connections");
            continue;
        }
        let address = match &stream {
            Stream::Tcp(s) => s.peer_addr().ok().map(|a| a.ip().to_canonical()),
            Stream::Unix(_) => None,
        };
        let slot = match negotiating.enter(address) {
            Ok(slot) => slot,
            Err(reason) => {
                refusals.note(&peer, reason);
                continue;
            }
        };
        let exports = exports.clone();
        let stopped = stopped.clone();
        let tls = tls.clone();
        let server_budget = server_budget.clone();
        connections.spawn(async move {
            let tls = tls.as_ref();
            let limits = Limits {
                negotiating: slot,
                server_budget,
            };
            let result = match stream {
                Stream::Unix(s) => connection(s, &peer, &exports, tls, limits, stopped).await,
                Stream::Tcp(s) => connection(s, &peer, &exports, tls, limits, stopped).await,
            };
            match &result {
                Ok(()) => tracing::info!(peer, "client disconnected"),
                Err(
                    e @ (NbdError::Protocol { .. }
                    | NbdError::TlsHandshake { .. }
                    | NbdError::Stalled { .. }),
                ) => {
                    tracing::warn!(peer, error = %e, "client dropped")
                }
                Err(e) => tracing::info!(peer, error = %e, "connection ended"),
            }
            result
        });
    }
    drop(listener);
    let _ = stop.send(true);
    tracing::info!(
        connections = connections.len(),
        "shutting down: finishing requests in flight"
    );
    while let Some(done) = connections.join_next().await {
        if let Ok(outcome) = done {
            stats.count(&outcome);
        }
    }
    Ok(stats)
}

enum Stream {
    Unix(UnixStream),
    Tcp(tokio::net::TcpStream),
}

async fn accept(listener: &Listener) -> std::io::Result<(Stream, String)> {
    match listener {
        Listener::Unix { listener, .. } => {
            let (stream, _) = listener.accept().await?;
            Ok((Stream::Unix(stream), "unix".to_owned()))
        }
        Listener::Tcp(listener) => {
            let (stream, addr) = listener.accept().await?;
            // Replies are whole messages already; Nagle would only delay them.
            stream.set_nodelay(true)?;
            keep_alive(&stream)?;
            Ok((Stream::Tcp(stream), addr.to_string()))
        }
    }
}

/// Connections closed at accept, logged at most once a second with how many went unlogged
/// (a flood of connects must not flood the log too).
#[derive(Default)]
struct Refusals {
    last_logged: Option<std::time::Instant>,
    unlogged: u64,
}

impl Refusals {
    fn note(&mut self, peer: &str, reason: &str) {
        let now = std::time::Instant::now();
        if self
            .last_logged
            .is_some_and(|at| now.duration_since(at) < Duration::from_secs(1))
        {
            self.unlogged += 1;
            return;
        }
        tracing::warn!(
            peer,
            refused_since_last_logged = self.unlogged,
            "{reason}; closing this one"
        );
        self.last_logged = Some(now);
        self.unlogged = 0;
    }
}

/// Turn TCP keepalive on (see [`KEEPALIVE_IDLE`]).
fn keep_alive(stream: &tokio::net::TcpStream) -> std::io::Result<()> {
    use rustix::net::sockopt;
    sockopt::set_socket_keepalive(stream, true)?;
    sockopt::set_tcp_keepidle(stream, KEEPALIVE_IDLE)?;
    sockopt::set_tcp_keepintvl(stream, KEEPALIVE_INTERVAL)?;
    sockopt::set_tcp_keepcnt(stream, KEEPALIVE_PROBES)?;
    Ok(())
}

/// What a connection holds of the server's shared limits.
struct Limits {
    /// Its place among the connections in their handshake, given back once attached.
    negotiating: NegotiatingSlot,
    server_budget: Arc<ServerBudget>,
}

/// A client's socket, which the transmission phase takes apart into halves of its own: the
/// read half stays a socket, so a write's payload can be read straight into the slots a
/// device asks for ([`PayloadSource`]).
trait ClientSocket: AsyncRead + AsyncWrite + Unpin + Send + 'static {
    type Reader: PayloadSource;
    type Writer: AsyncWrite + Unpin + Send + 'static;
    fn into_halves(self) -> (Self::Reader, Self::Writer);
}

impl ClientSocket for UnixStream {
    type Reader = tokio::net::unix::OwnedReadHalf;
    type Writer = tokio::net::unix::OwnedWriteHalf;
    fn into_halves(self) -> (Self::Reader, Self::Writer) {
        self.into_split()
    }
}

impl ClientSocket for tokio::net::TcpStream {
    type Reader = tokio::net::tcp::OwnedReadHalf;
    type Writer = tokio::net::tcp::OwnedWriteHalf;
    fn into_halves(self) -> (Self::Reader, Self::Writer) {
        self.into_split()
    }
}

/// [`ClientSocket`] for a TLS connection: its halves share the TLS session (a lock between
/// them), and a write's payload comes through the session's reads, decrypted, into its slots.
impl<S: AsyncRead + AsyncWrite + Unpin + Send + 'static> ClientSocket
    for tokio_openssl::SslStream<S>
{
    type Reader = tokio::io::ReadHalf<tokio_openssl::SslStream<S>>;
    type Writer = tokio::io::WriteHalf<tokio_openssl::SslStream<S>>;
    fn into_halves(self) -> (Self::Reader, Self::Writer) {
        tokio::io::split(self)
    }
}

/// A TLS session's socket, buffered both ways below the session: OpenSSL reads a record's
/// header and then its body, and writes each record (16 KiB at most) on its own, so without
/// the buffers a 1 MiB read reply took some 64 system calls, each pushing its frames out.
type TlsSocket<S> = tokio::io::BufStream<S>;

/// Bytes buffered below a TLS session, each way: several records (16 KiB and a few bytes).
const TLS_SOCKET_BUFFER: usize = 256 << 10;

/// What a connection's handshake ended with.
enum Attached<S: ClientSocket> {
    Plain(S, Negotiated),
    Tls(tokio_openssl::SslStream<TlsSocket<S>>, Negotiated),
}

/// The handshake: greeting, options, and with `tls` the TLS handshake once the client asks
/// for it, then the rest of the options over TLS. `Ok(None)`: the client left without
/// choosing an export.
async fn handshake<S: ClientSocket>(
    mut stream: S,
    peer: &str,
    exports: &[Arc<Export>],
    tls: Option<&TlsCredentials>,
) -> Result<Option<Attached<S>>, NbdError> {
    let Some(no_zeroes) = greet(&mut stream, peer).await? else {
        return Ok(None);
    };
    let state = if tls.is_some() {
        TlsState::Required
    } else {
        TlsState::Off
    };
    match options(&mut stream, peer, exports, no_zeroes, state).await? {
        Haggled::Ended => Ok(None),
        Haggled::Chosen(negotiated) => Ok(Some(Attached::Plain(stream, negotiated))),
        Haggled::StartTls => {
            let credentials = tls.expect("STARTTLS is only acknowledged with credentials");
            let socket = TlsSocket::with_capacity(TLS_SOCKET_BUFFER, TLS_SOCKET_BUFFER, stream);
            let mut secured = credentials.accept(socket, peer).await?;
            tracing::debug!(peer, "TLS started");
            match options(&mut secured, peer, exports, no_zeroes, TlsState::Active).await? {
                Haggled::Ended => Ok(None),
                Haggled::Chosen(negotiated) => Ok(Some(Attached::Tls(secured, negotiated))),
                Haggled::StartTls => unreachable!("STARTTLS is refused once TLS runs"),
            }
        }
    }
}

async fn connection<S: ClientSocket>(
    stream: S,
    peer: &str,
    exports: &[Arc<Export>],
    tls: Option<&TlsCredentials>,
    limits: Limits,
    mut stopped: watch::Receiver<bool>,
) -> Result<(), NbdError> {
    tracing::debug!(peer, "client connected");
    let Limits {
        negotiating,
        server_budget,
    } = limits;
    let attached = tokio::select! {
        _ = stopped.wait_for(|stop| *stop) => return Ok(()),
        result = tokio::time::timeout(HANDSHAKE_TIMEOUT, handshake(stream, peer, exports, tls)) => match result {
            Err(_) => {
                return Err(NbdError::Protocol {
                    peer: peer.to_owned(),
                    reason: format!("no export chosen within {} s", HANDSHAKE_TIMEOUT.as_secs()),
                })
            }
            Ok(result) => result?,
        },
    };
    drop(negotiating);
    let Some(attached) = attached else {
        return Ok(());
    };
    let ending = match attached {
        Attached::Plain(stream, negotiated) => {
            attached_log(peer, &negotiated, false);
            let (reader, writer) = stream.into_halves();
            transmit(reader, writer, peer, negotiated, server_budget, stopped).await?
        }
        Attached::Tls(stream, negotiated) => {
            attached_log(peer, &negotiated, true);
            let (reader, writer) = stream.into_halves();
            transmit(reader, writer, peer, negotiated, server_budget, stopped).await?
        }
    };
    match ending {
        Ending::Disconnect | Ending::Shutdown => Ok(()),
    }
}

fn attached_log(peer: &str, negotiated: &Negotiated, tls: bool) {
    tracing::info!(
        peer,
        export = %negotiated.export.name,
        structured = negotiated.structured,
        tls,
        "client attached"
    );
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::fs::PermissionsExt;

    fn mode(path: &Path) -> u32 {
        std::fs::metadata(path).unwrap().permissions().mode() & 0o777
    }

    /// A path that leaves no room for the staging directory is bound in place, still 0600;
    /// a path that exists is refused and left as it was; nothing is left beside either.
    #[tokio::test]
    async fn long_paths_are_bound_in_place_and_existing_ones_refused() {
        let dir = tempfile::tempdir().unwrap();
        // A directory whose path is 100 bytes long: `long` fits a socket address (102 bytes
        // of the 107), the staging directory's socket beside it would not.
        let room = 100 - dir.path().as_os_str().as_bytes().len() - 1;
        let deep = dir.path().join("d".repeat(room));
        std::fs::create_dir(&deep).unwrap();
        let long = deep.join("s");
        let listener = bind_private_unix(&long).unwrap();
        assert_eq!(mode(&long), 0o600);
        UnixStream::connect(&long).await.unwrap();
        drop(listener);

        let taken = dir.path().join("taken");
        std::fs::write(&taken, b"mine").unwrap();
        let err = bind_private_unix(&taken).unwrap_err();
        assert_eq!(err.kind(), std::io::ErrorKind::AlreadyExists, "{err}");
        assert_eq!(std::fs::read(&taken).unwrap(), b"mine");
        let beside: Vec<_> = std::fs::read_dir(&deep).unwrap().collect();
        assert_eq!(beside.len(), 1, "only the socket: {beside:?}");
        let mut names: Vec<_> = std::fs::read_dir(dir.path())
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        names.sort();
        assert_eq!(names, ["d".repeat(room), "taken".into()]);
    }

    /// Staging directories of the names a server would pick (left by a process killed while
    /// binding, whose pid a container's next server has again, or made ahead by another user
    /// in /tmp) do not stop the bind: it failed with "File exists" for a path that did not.
    #[tokio::test]
    async fn a_staging_name_taken_ahead_does_not_stop_the_bind() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile::tempdir().unwrap();
        for n in 0..4096 {
            let name = format!(".ivdisk-{}-{n}", std::process::id());
            std::fs::create_dir(dir.path().join(name)).unwrap();
        }
        let path = dir.path().join("s");
        let listener = bind_private_unix(&path).unwrap();
        let mode = std::fs::metadata(&path).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        UnixStream::connect(&path).await.unwrap();
        drop(listener);
    }
}
