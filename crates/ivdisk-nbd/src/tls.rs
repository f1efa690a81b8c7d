//! TLS for NBD connections (`NBD_OPT_STARTTLS`), with x509 credentials laid out as qemu's
//! `tls-creds-x509` object lays them out in a directory, so one directory serves qemu-nbd and
//! ivdisk alike: `server-cert.pem` (the server's certificate, with its chain after it),
//! `server-key.pem`, and `ca-cert.pem`, the authority whose certificates clients must present.
//!
//! Why clients must present one: an export carries the disk's plaintext, so encrypting the
//! wire but letting anyone who reaches the port read the disk would protect nothing. The
//! server runs in the protocol's FORCEDTLS mode: a client that does not start TLS gets
//! `NBD_REP_ERR_TLS_REQD` for every option.
//!
//! A directory may instead hold pre-shared keys, as qemu's `tls-creds-psk` lays them out:
//! `keys.psk`, lines of `IDENTITY:HEXKEY` (the format of GnuTLS' `psktool`, which libnbd's
//! `tls-psk-file` reads too). Then a client must know one of the keys, under its identity,
//! and the session is TLS 1.3.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, RwLock};

use openssl::asn1::Asn1Time;
use openssl::ssl::{SslAcceptor, SslFiletype, SslMethod, SslOptions, SslVerifyMode, SslVersion};
use openssl::x509::{X509Name, X509};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_openssl::SslStream;
use zeroize::Zeroizing;

use crate::NbdError;

/// The files of a credentials directory (qemu's names).
pub const CA_CERT: &str = "ca-cert.pem";
pub const SERVER_CERT: &str = "server-cert.pem";
pub const SERVER_KEY: &str = "server-key.pem";
/// Pre-shared keys (qemu's `tls-creds-psk` name).
pub const PSK_KEYS: &str = "keys.psk";

/// What a credentials directory holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TlsKind {
    /// x509: the server's certificate and key, and the authority of the clients'.
    X509,
    /// Pre-shared keys, one per client identity.
    Psk,
}

/// Days before its end from which a server certificate is warned about at every load.
const EXPIRY_WARNING_DAYS: u32 = 30;

/// A server's TLS credentials, loaded and checked; cheap to clone, and clones share them, so
/// that [`TlsCredentials::reload`] on one (a server's SIGHUP) reaches the server holding
/// another. Connections already running keep the session they started with.
#[derive(Clone)]
pub struct TlsCredentials {
    acceptor: Arc<RwLock<Arc<SslAcceptor>>>,
    dir: PathBuf,
    kind: TlsKind,
}

impl std::fmt::Debug for TlsCredentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsCredentials")
            .field("dir", &self.dir)
            .finish_non_exhaustive()
    }
}

impl TlsCredentials {
    /// Load `dir`'s `server-cert.pem`, `server-key.pem` and `ca-cert.pem`. Fails, naming the
    /// file, when one is missing or unreadable, the key does not belong to the certificate,
    /// or the certificate is not valid now; warns when it ends within 30 days.
    ///
    /// A directory with `keys.psk` and no `server-cert.pem` holds pre-shared keys instead
    /// ([`TlsKind::Psk`]); the file fails to load when a line is not `IDENTITY:HEXKEY`.
    pub fn from_dir(dir: &Path) -> Result<TlsCredentials, NbdError> {
        let kind = kind_of(dir);
        Ok(TlsCredentials {
            acceptor: Arc::new(RwLock::new(Arc::new(load_acceptor(dir, kind)?))),
            dir: dir.to_owned(),
            kind,
        })
    }

    /// Certificates or pre-shared keys.
    pub fn kind(&self) -> TlsKind {
        self.kind
    }

    /// Load the directory's files again (renewed certificates, another authority) and use
    /// them for the connections that come from now on. On failure the credentials in use
    /// stay, and the error says why.
    pub fn reload(&self) -> Result<(), NbdError> {
        let fresh = Arc::new(load_acceptor(&self.dir, self.kind)?);
        *self.acceptor.write().unwrap_or_else(|e| e.into_inner()) = fresh;
        Ok(())
    }

    /// The directory the credentials come from.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// The credentials in use now.
    fn current(&self) -> Arc<SslAcceptor> {
        self.acceptor
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone()
    }

    /// Run the server's side of the TLS handshake on `stream`.
    pub(crate) async fn accept<S: AsyncRead + AsyncWrite + Unpin>(
        &self,
        stream: S,
        peer: &str,
    ) -> Result<SslStream<S>, NbdError> {
        let failed = |reason: String| NbdError::TlsHandshake {
            peer: peer.to_owned(),
            reason,
        };
        let ssl =
            openssl::ssl::Ssl::new(self.current().context()).map_err(|e| failed(e.to_string()))?;
        let mut tls = SslStream::new(ssl, stream).map_err(|e| failed(e.to_string()))?;
        match Pin::new(&mut tls).accept().await {
            Ok(()) => Ok(tls),
            Err(e) => {
                let verify = tls.ssl().verify_result();
                Err(failed(if verify != openssl::x509::X509VerifyResult::OK {
                    format!(
                        "its certificate was refused ({}): clients need one issued by the \
                         authority in {}",
                        verify.error_string(),
                        CA_CERT
                    )
                } else if self.kind == TlsKind::Psk {
                    format!(
                        "{} (clients need an identity and its key from {PSK_KEYS}, over TLS \
                         1.3)",
                        handshake_reason(&e)
                    )
                } else {
                    handshake_reason(&e)
                }))
            }
        }
    }
}

/// Pre-shared keys when the directory has `keys.psk` and no server certificate.
fn kind_of(dir: &Path) -> TlsKind {
    if !dir.join(SERVER_CERT).exists() && dir.join(PSK_KEYS).is_file() {
        TlsKind::Psk
    } else {
        TlsKind::X509
    }
}

/// Build the acceptor of `dir`'s credentials (see [`TlsCredentials::from_dir`]).
fn load_acceptor(dir: &Path, kind: TlsKind) -> Result<SslAcceptor, NbdError> {
    let fail = |reason: String| NbdError::TlsCredentials {
        dir: dir.display().to_string(),
        reason,
    };
    if kind == TlsKind::Psk {
        return load_psk_acceptor(dir, &fail);
    }
    for name in [SERVER_CERT, SERVER_KEY, CA_CERT] {
        if !dir.join(name).is_file() {
            return Err(fail(format!(
                "{name} is missing (the directory needs {CA_CERT}, {SERVER_CERT} and \
                 {SERVER_KEY}, as for qemu's tls-creds-x509; or {PSK_KEYS} alone, as for \
                 tls-creds-psk)"
            )));
        }
    }
    warn_if_key_readable_by_others(&dir.join(SERVER_KEY));
    check_validity(dir, &fail)?;
    let openssl = |what: &str, e: openssl::error::ErrorStack| {
        fail(match first_reason(&e).as_deref() {
            Some("key values mismatch") => {
                format!("{SERVER_KEY} is not the key of the certificate in {SERVER_CERT}")
            }
            Some(reason) => format!("{what}: {reason}"),
            None => format!("{what}: {e}"),
        })
    };
    let mut builder = SslAcceptor::mozilla_intermediate_v5(SslMethod::tls_server())
        .map_err(|e| openssl("setting up TLS", e))?;
    builder
        .set_min_proto_version(Some(SslVersion::TLS1_2))
        .map_err(|e| openssl("setting up TLS", e))?;
    // No renegotiation (TLS 1.2): nothing needs it, and it is an attack surface.
    builder.set_options(SslOptions::NO_RENEGOTIATION);
    builder
        .set_certificate_chain_file(dir.join(SERVER_CERT))
        .map_err(|e| openssl(SERVER_CERT, e))?;
    builder
        .set_private_key_file(dir.join(SERVER_KEY), SslFiletype::PEM)
        .map_err(|e| openssl(SERVER_KEY, e))?;
    builder
        .check_private_key()
        .map_err(|e| openssl(SERVER_KEY, e))?;
    builder
        .set_ca_file(dir.join(CA_CERT))
        .map_err(|e| openssl(CA_CERT, e))?;
    let names =
        X509Name::load_client_ca_file(dir.join(CA_CERT)).map_err(|e| openssl(CA_CERT, e))?;
    builder.set_client_ca_list(names);
    builder.set_verify(SslVerifyMode::PEER | SslVerifyMode::FAIL_IF_NO_PEER_CERT);
    // Sessions resumed by a client that presented a certificate need a context id, or
    // OpenSSL fails the resumption.
    builder
        .set_session_id_context(b"ivdisk-nbd")
        .map_err(|e| openssl("setting up TLS", e))?;
    Ok(builder.build())
}

/// The acceptor of a pre-shared-keys directory: TLS 1.3 only, no certificate; a client is in
/// when its identity is in `keys.psk` and it knows the key.
fn load_psk_acceptor(
    dir: &Path,
    fail: &dyn Fn(String) -> NbdError,
) -> Result<SslAcceptor, NbdError> {
    let keys = read_psk_keys(&dir.join(PSK_KEYS), fail)?;
    warn_if_key_readable_by_others(&dir.join(PSK_KEYS));
    let setup = |e: openssl::error::ErrorStack| {
        fail(format!(
            "setting up TLS: {}",
            first_reason(&e).unwrap_or_else(|| e.to_string())
        ))
    };
    let mut builder = SslAcceptor::mozilla_modern_v5(SslMethod::tls_server()).map_err(setup)?;
    builder
        .set_min_proto_version(Some(SslVersion::TLS1_3))
        .map_err(setup)?;
    builder.set_psk_server_callback(move |_ssl, identity, out| {
        // 0: no such identity (or a key too long for OpenSSL), and the handshake fails.
        let Some(key) = identity.and_then(|identity| keys.get(identity)) else {
            tracing::warn!(
                // Quoted and escaped: the client chose these bytes, and they must not
                // forge log lines or reach a terminal as control sequences.
                identity = ?String::from_utf8_lossy(identity.unwrap_or_default()),
                "a TLS client's identity is not in {PSK_KEYS}"
            );
            return Ok(0);
        };
        if key.len() > out.len() {
            return Ok(0);
        }
        out[..key.len()].copy_from_slice(key);
        Ok(key.len())
    });
    Ok(builder.build())
}

/// `keys.psk`: one `IDENTITY:HEXKEY` per line (empty lines skipped). A line that is not is
/// named by its number, never shown: it may hold a key.
fn read_psk_keys(
    path: &Path,
    fail: &dyn Fn(String) -> NbdError,
) -> Result<HashMap<Vec<u8>, Zeroizing<Vec<u8>>>, NbdError> {
    let text = Zeroizing::new(
        std::fs::read_to_string(path).map_err(|e| fail(format!("{PSK_KEYS}: {e}")))?,
    );
    let mut keys = HashMap::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim_end_matches('\r');
        if line.is_empty() {
            continue;
        }
        let bad = |why: &str| {
            fail(format!(
                "{PSK_KEYS} line {}: {why} (lines are IDENTITY:HEXKEY, as psktool writes them)",
                n + 1
            ))
        };
        let (identity, key) = line.rsplit_once(':').ok_or_else(|| bad("no `:`"))?;
        if identity.is_empty() {
            return Err(bad("no identity"));
        }
        let key = Zeroizing::new(hex::decode(key).map_err(|_| bad("the key is not hex"))?);
        if key.len() < 16 {
            return Err(bad("the key is shorter than 16 bytes"));
        }
        keys.insert(identity.as_bytes().to_vec(), key);
    }
    if keys.is_empty() {
        return Err(fail(format!("{PSK_KEYS} holds no key")));
    }
    Ok(keys)
}

/// The server certificate must be valid now (clients would refuse it anyway, each with an
/// error of its own); one that ends within [`EXPIRY_WARNING_DAYS`] is warned about.
fn check_validity(dir: &Path, fail: &dyn Fn(String) -> NbdError) -> Result<(), NbdError> {
    let pem =
        std::fs::read(dir.join(SERVER_CERT)).map_err(|e| fail(format!("{SERVER_CERT}: {e}")))?;
    let cert = X509::from_pem(&pem).map_err(|e| {
        fail(format!(
            "{SERVER_CERT}: {}",
            first_reason(&e).unwrap_or_default()
        ))
    })?;
    let now = Asn1Time::days_from_now(0).map_err(|e| fail(e.to_string()))?;
    let soon = Asn1Time::days_from_now(EXPIRY_WARNING_DAYS).map_err(|e| fail(e.to_string()))?;
    if cert.not_before() > now {
        return Err(fail(format!(
            "the certificate in {SERVER_CERT} is not valid before {}",
            cert.not_before()
        )));
    }
    if cert.not_after() < now {
        return Err(fail(format!(
            "the certificate in {SERVER_CERT} expired on {}: renew it (scripts/tls-creds makes \
             a new set), then start the server again or send it SIGHUP",
            cert.not_after()
        )));
    }
    if cert.not_after() < soon {
        tracing::warn!(
            certificate = %dir.join(SERVER_CERT).display(),
            expires = %cert.not_after(),
            "the server's TLS certificate expires within {EXPIRY_WARNING_DAYS} days: renew it \
             and send the server SIGHUP"
        );
    }
    Ok(())
}

/// OpenSSL's reason for the first error of `stack` ("key values mismatch", "no start line"),
/// without the library's file names and line numbers.
fn first_reason(stack: &openssl::error::ErrorStack) -> Option<String> {
    stack
        .errors()
        .first()
        .and_then(|error| error.reason().map(str::to_owned))
}

/// What went wrong in a handshake, in words: OpenSSL's reason for the first error it queued
/// (not its whole error stack, with file names and line numbers), or the IO error.
fn handshake_reason(e: &openssl::ssl::Error) -> String {
    let first = e.ssl_error().and_then(first_reason);
    match (first, e.io_error()) {
        (Some(reason), _) if reason == "peer did not return a certificate" => format!(
            "the client presented no certificate (clients need one issued by the authority \
             in {CA_CERT})"
        ),
        (Some(reason), _) => reason,
        (None, Some(io)) => io.to_string(),
        (None, None) => "the client closed the connection".to_owned(),
    }
}

/// A private key others can read is worth a warning (not a refusal: a group may be meant
/// to share it, as with qemu's).
fn warn_if_key_readable_by_others(path: &Path) {
    use std::os::unix::fs::PermissionsExt;
    if let Ok(meta) = std::fs::metadata(path) {
        let mode = meta.permissions().mode() & 0o777;
        if mode & 0o004 != 0 {
            tracing::warn!(
                path = %path.display(),
                mode = format!("{mode:o}"),
                "the TLS private key is readable by every user of this machine; chmod 600 it"
            );
        }
    }
}
