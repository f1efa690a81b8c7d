//! `ivdisk serve`: open an image (read-write under its writer lock, or read-only) and export
//! it over NBD on a Unix socket or TCP until SIGINT/SIGTERM; then finish the requests in
//! flight, flush, release the lock and exit 0. `rbd://` images are librbd's (plain or with
//! librbd's LUKS), served through ivdisk-rbd by the same NBD server and shutdown.

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{anyhow, Context, Result};
use clap::Args;
use ivdisk_image::{shell_quoted, shell_word, Image, ImageError, ImageUri, OpenOptions};
use ivdisk_nbd::{
    serve_with_tls, BlockDevice, Export, ListenAddress, Listener, ServeStats, TlsCredentials,
    TlsKind,
};
use ivdisk_rbd::{RbdError, RbdImage, RbdOpenOptions, RbdUri};
use serde_json::json;
use tokio::runtime::Runtime;
use tokio::signal::unix::{signal, SignalKind};
use zeroize::Zeroizing;

use crate::images::{exact_size, image_at, image_or_rbd_help, info_at};
use crate::secrets::{with_spinner, PassphraseArgs};

#[derive(Args)]
pub struct ServeArgs {
    #[arg(help = image_or_rbd_help())]
    image: String,
    /// Listen on this Unix socket (created; a stale one left by a dead server is replaced).
    /// Only you (and root) can connect to it unless --socket-mode says otherwise. Without
    /// --socket or --listen: NAME.sock (NAME: the image's last path part) in
    /// $XDG_RUNTIME_DIR/ivdisk, or in /tmp/ivdisk-UID without XDG_RUNTIME_DIR; the ready line
    /// names it.
    #[arg(long, value_name = "PATH", conflicts_with = "listen")]
    socket: Option<PathBuf>,
    /// Permissions of the --socket file, in octal (default 600). Connecting needs write
    /// permission on it: 660 lets the file's group attach too (a hypervisor's user, say,
    /// after `chgrp`). Whoever can connect reads and writes the disk's plaintext.
    #[arg(long, value_name = "OCTAL", value_parser = parse_socket_mode, requires = "socket")]
    socket_mode: Option<u32>,
    /// Listen on TCP HOST:PORT (NBD's port is 10809: 127.0.0.1:10809). Without --tls-creds
    /// there is no encryption or authentication: anyone who can connect reads the plaintext,
    /// other users of this machine too. A HOST other machines can reach (0.0.0.0, a LAN
    /// address) needs --tls-creds, or --allow-remote.
    #[arg(long, value_name = "HOST:PORT")]
    listen: Option<String>,
    /// Require TLS of every client (NBD's STARTTLS), with x509 credentials in DIR laid out
    /// as for qemu's tls-creds-x509: server-cert.pem, server-key.pem, and ca-cert.pem, the
    /// authority whose certificate every client must present (clients without one, or
    /// without TLS, are refused). Or DIR holds keys.psk alone, as for qemu's tls-creds-psk:
    /// lines IDENTITY:HEXKEY, and a client needs an identity and its key (TLS 1.3).
    /// `scripts/tls-creds` makes either. With it, --listen may take an address other machines
    /// can reach. SIGHUP loads DIR again (renewed certificates, keys) for the connections that
    /// come next.
    #[arg(long, value_name = "DIR")]
    tls_creds: Option<PathBuf>,
    /// Let --listen take an address other machines can reach without --tls-creds. NBD then
    /// carries the disk's plaintext with no encryption and no authentication, so anyone who
    /// reaches the port reads and writes it: only on a network you trust. Safer: --tls-creds,
    /// or 127.0.0.1 through an SSH or WireGuard tunnel.
    #[arg(long, requires = "listen", conflicts_with = "tls_creds")]
    allow_remote: bool,
    /// Export read-only: no writer lock is taken, writes are refused (rbd://: opened with
    /// librbd's read-only open, no watch or exclusive lock).
    #[arg(long)]
    read_only: bool,
    /// The export's name (clients asking for "" get it too), at most 4096 bytes.
    #[arg(long, default_value = "", value_name = "NAME")]
    export_name: String,
    /// Memory for per-sector metadata of `object-end`, `omap-packed` and `omap-tail` images,
    /// held while serving for writing (the writer lock keeps other writers out): small reads
    /// then fetch only their data, and small writes send whole metadata blocks or values
    /// instead of a read-modify-write. 64 MiB covers 8 GiB of 4 KiB sectors; past that, blocks
    /// are evicted and loaded again when used. 0 turns it off for `object-end`; `omap-packed`
    /// and `omap-tail`, which write whole values only, keep a minimal one.
    #[arg(long, default_value_t = 64, value_name = "MiB")]
    metadata_cache_mib: usize,
    #[command(flatten)]
    passphrase: PassphraseArgs,
    /// Print one JSON line when ready (address, export, size, uri) instead of attach hints.
    #[arg(long)]
    json: bool,
}

// The help below names the server's connection limit.
const _: () = assert!(ivdisk_nbd::MAX_CONNECTIONS == 256);

pub fn after_help() -> String {
    String::from(
        "Runs in the foreground until SIGINT (Ctrl-C), SIGTERM or SIGQUIT, then finishes the requests in \
         flight, flushes, releases the writer lock and exits 0. Clients: qemu, qemu-img, nbdinfo, \
         nbdcopy, nbdfuse, fio (--ioengine=nbd), the kernel's nbd-client. Several clients may \
         attach at once (they share one open image, so a flush by one covers all), up to 256 \
         connections: one more is closed before the handshake, and the server logs why.\n\n\
         Without \
         --socket or --listen it listens on a Unix socket only you can reach, named after the \
         image: $XDG_RUNTIME_DIR/ivdisk/NAME.sock, or /tmp/ivdisk-UID/NAME.sock (a directory \
         of mode 700).\n\nrbd://POOL/IMAGE serves a \
         librbd image through librbd itself (for comparisons with ivdisk images behind the same \
         NBD server): encryption=auto (the default) loads librbd's LUKS1/LUKS2 when the image \
         starts with a LUKS header, asking for its passphrase, and serves other images plain \
         without asking; encryption=none serves the raw bytes.\n\nExample:\n  ivdisk serve \
         disk.ivd --socket /tmp/disk.sock --passphrase-file pw.txt\n  nbdinfo \
         'nbd+unix:///?socket=/tmp/disk.sock'\n  ivdisk serve 'rados://rbd/vm1?id=admin' --listen \
         0.0.0.0:10809 --tls-creds /etc/ivdisk/tls --export-name vm1   # TLS, client certificates\n  \
         ivdisk serve 'rbd://rbd/vm2?conf=/etc/ceph/ceph.conf' \
         --socket /tmp/vm2.sock --passphrase-file pw.txt   # librbd, LUKS detected"
    )
}

/// Where the hints put the clients' TLS credentials (their `ca-cert.pem`, `client-cert.pem`
/// and `client-key.pem`; or, with pre-shared keys, the directory of the client's `keys.psk`
/// and its identity in it), which the server does not know.
const CLIENT_CREDS: &str = "CLIENT_CREDS_DIR";
const CLIENT_IDENTITY: &str = "IDENTITY";

/// How clients reach the export, for humans.
fn attach_hints(
    address: &ListenAddress,
    export: &str,
    read_only: bool,
    tls: Option<TlsKind>,
) -> String {
    let ro = if read_only { " (read-only)" } else { "" };
    let uri = nbd_uri(address, export, tls);
    let qemu = match qemu_object(tls) {
        Some(object) => format!(
            "-object {object} -drive {}",
            shell_quoted(&qemu_drive(address, export, read_only, tls))
        ),
        None => format!(
            "-drive {}",
            shell_quoted(&qemu_drive(address, export, read_only, tls))
        ),
    };
    let nbd_client = if tls.is_some() {
        // nbd-client's TLS options differ between its builds; the hints stay with what was
        // checked (tests/nbd_clients.rs).
        String::new()
    } else {
        let export_flag = if export.is_empty() {
            String::new()
        } else {
            format!(" -N {}", shell_word(export))
        };
        match address {
            ListenAddress::Unix(path) => format!(
                "  nbd-client -unix {} /dev/nbd0{export_flag}   # as root, after modprobe nbd\n",
                shell_word(&path.to_string_lossy())
            ),
            ListenAddress::Tcp(addr) => {
                let addr = dial_address(addr);
                let (host, port) = addr.rsplit_once(':').unwrap_or((&addr, "10809"));
                format!(
                    "  nbd-client {} {port} /dev/nbd0{export_flag}   # as root, after modprobe nbd\n",
                    shell_word(host)
                )
            }
        }
    };
    let creds = match tls {
        Some(TlsKind::X509) => format!(
            "TLS: every client needs a certificate of the server's authority; {CLIENT_CREDS} \
             holds ca-cert.pem, client-cert.pem and client-key.pem (scripts/tls-creds makes \
             them).\n"
        ),
        Some(TlsKind::Psk) => format!(
            "TLS with pre-shared keys: every client needs an identity and its key from the \
             server's keys.psk; {CLIENT_CREDS}/keys.psk holds the client's line \
             ({CLIENT_IDENTITY}:HEXKEY).\n"
        ),
        None => String::new(),
    };
    // nbdfuse lets libnbd read no file a URI names: it takes certificates from libnbd's
    // default directory only, and cannot use a keys file at all.
    let nbdfuse = match tls {
        None => {
            format!(
                "  mkdir -p /tmp/disk && nbdfuse /tmp/disk {} &   # file /tmp/disk/nbd\n",
                shell_quoted(&uri)
            )
        }
        Some(TlsKind::X509) => format!(
            "  mkdir -p /tmp/disk && nbdfuse /tmp/disk {} &   # file /tmp/disk/nbd; the \
             client's files in ~/.pki/libnbd (root: /etc/pki/libnbd)\n",
            shell_quoted(uri.split('?').next().unwrap_or(&uri))
        ),
        Some(TlsKind::Psk) => String::new(),
    };
    format!(
        "{creds}Attach it{ro} with:\n  nbdinfo {}\n{nbdfuse}  \
         qemu-system-x86_64 ... {qemu}\n{nbd_client}\
         Stop with Ctrl-C or SIGTERM.",
        shell_quoted(&uri)
    )
}

/// qemu's `-drive` option for the export, raw (the export is the plaintext disk), on virtio:
/// the NBD URI as the image file; with TLS the nbd driver's own options, as qemu takes no
/// TLS in a URI. A read-only export needs `readonly=on`, or qemu refuses to start. Discards
/// are left at qemu's default (ignored): passing them on (`discard=unmap`) frees space but
/// shows the store which blocks the guest freed.
fn qemu_drive(
    address: &ListenAddress,
    export: &str,
    read_only: bool,
    tls: Option<TlsKind>,
) -> String {
    let readonly = if read_only { ",readonly=on" } else { "" };
    if tls.is_none() {
        return format!(
            "file={},format=raw,if=virtio{readonly}",
            qemu_option_value(&nbd_uri(address, export, None))
        );
    }
    let server = match address {
        ListenAddress::Unix(path) => format!(
            "server.type=unix,server.path={}",
            qemu_option_value(&path.to_string_lossy())
        ),
        ListenAddress::Tcp(addr) => {
            let addr = dial_address(addr);
            let (host, port) = addr.rsplit_once(':').unwrap_or((&addr, "10809"));
            let host = host.trim_start_matches('[').trim_end_matches(']');
            format!("server.type=inet,server.host={host},server.port={port}")
        }
    };
    format!(
        "driver=nbd,{server},export={},tls-creds=tls0,if=virtio{readonly}",
        qemu_option_value(export)
    )
}

/// The `-object` qemu needs beside [`qemu_drive`]'s option: the client's TLS credentials.
fn qemu_object(tls: Option<TlsKind>) -> Option<String> {
    Some(match tls? {
        TlsKind::X509 => format!("tls-creds-x509,id=tls0,endpoint=client,dir={CLIENT_CREDS}"),
        TlsKind::Psk => format!(
            "tls-creds-psk,id=tls0,endpoint=client,dir={CLIENT_CREDS},username={CLIENT_IDENTITY}"
        ),
    })
}

/// `HOST:PORT` as clients should dial it: an address that listens on every interface (0.0.0.0,
/// `::`) is no address to connect to from elsewhere, and with TLS it would not match the
/// server's certificate, so the machine's host name stands for it.
fn dial_address(addr: &str) -> String {
    let Some((host, port)) = addr.rsplit_once(':') else {
        return addr.to_owned();
    };
    let ip = host.trim_start_matches('[').trim_end_matches(']');
    match ip.parse::<std::net::IpAddr>() {
        Ok(ip) if ip.is_unspecified() => {
            let uname = rustix::system::uname();
            let name = uname.nodename().to_string_lossy();
            if name.is_empty() {
                addr.to_owned()
            } else {
                format!("{name}:{port}")
            }
        }
        _ => addr.to_owned(),
    }
}

/// The export's NBD URI (the NBD project's doc/uri.md); with TLS, the `nbds` schemes and
/// libnbd's `tls-certificates` parameter, or with pre-shared keys the client's identity as
/// the URI's user and libnbd's `tls-psk-file`.
/// `text` percent-encoded for a URI: every byte but the unreserved characters and `keep`
/// (RFC 3986), so a name or path with spaces, `?`, `#`, `&` or non-ASCII letters reads back as
/// itself (libnbd and qemu decode it).
fn uri_escape(text: &str, keep: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for &byte in text.as_bytes() {
        let c = byte as char;
        if c.is_ascii_alphanumeric() || "-._~".contains(c) || (c.is_ascii() && keep.contains(c)) {
            out.push(c);
        } else {
            out.push_str(&format!("%{byte:02X}"));
        }
    }
    out
}

/// A value inside a qemu option string: qemu splits options at commas, and reads `,,` as one.
fn qemu_option_value(text: &str) -> String {
    text.replace(',', ",,")
}

fn nbd_uri(address: &ListenAddress, export: &str, tls: Option<TlsKind>) -> String {
    let export = &uri_escape(export, "/");
    let (s, user, creds) = match tls {
        Some(TlsKind::X509) => ("s", "", format!("tls-certificates={CLIENT_CREDS}")),
        Some(TlsKind::Psk) => (
            "s",
            "IDENTITY@", // CLIENT_IDENTITY
            format!("tls-psk-file={CLIENT_CREDS}/keys.psk"),
        ),
        None => ("", "", String::new()),
    };
    let tls = tls.is_some();
    match address {
        ListenAddress::Unix(path) => {
            let sep = if tls { "&" } else { "" };
            format!(
                "nbd{s}+unix://{user}/{export}?socket={}{sep}{creds}",
                uri_escape(&path.to_string_lossy(), "/")
            )
        }
        ListenAddress::Tcp(addr) => {
            let query = if tls {
                format!("?{creds}")
            } else {
                String::new()
            };
            format!("nbd{s}://{user}{}/{export}{query}", dial_address(addr))
        }
    }
}

/// Where to listen. A TCP address other machines can reach is refused unless `--tls-creds`
/// (clients then need TLS and a certificate) or `--allow-remote` (logged as a warning) says
/// so: the point of ivdisk is that the plaintext never leaves the client machine unprotected.
fn listen_address(args: &ServeArgs) -> Result<ListenAddress> {
    let address = match (&args.socket, &args.listen) {
        (Some(path), _) => return Ok(ListenAddress::Unix(path.clone())),
        (None, Some(addr)) => addr.clone(),
        (None, None) => {
            let name = default_socket_name(&args.image);
            return Ok(ListenAddress::Unix(
                crate::control::runtime_dir()
                    .context("making the directory of the default socket (or give --socket)")?
                    .join(name),
            ));
        }
    };
    // Resolved once, and the address checked is the one bound: a name looked up again at
    // the bind may resolve elsewhere (a lookup that failed for a moment here once meant "not
    // reachable", and the bind's own lookup then listened on the network without TLS).
    let (bind, exposed) = resolve_listen(&address)?;
    if !exposed.is_empty() && args.tls_creds.is_none() {
        let ips = exposed
            .iter()
            .map(|ip| ip.to_string())
            .collect::<Vec<_>>()
            .join(", ");
        if !args.allow_remote {
            return Err(anyhow!(
                "refusing to listen on {address}: other machines can reach it ({ips}), and \
                 without TLS anyone who reaches it reads and writes the disk's plaintext. Add \
                 --tls-creds DIR (clients then need TLS and a certificate of DIR's authority; \
                 scripts/tls-creds makes a set), or listen on a Unix socket (--socket PATH) or \
                 on 127.0.0.1 and reach that through an SSH or WireGuard tunnel; on a network \
                 you trust, --allow-remote serves it without TLS"
            ));
        }
        tracing::warn!(
            "serving image {} on {address} ({ips}) with --allow-remote: anyone who reaches \
             it reads and writes the disk's plaintext (no TLS: --tls-creds would require it)",
            args.image
        );
    }
    Ok(ListenAddress::Tcp(bind))
}

/// The NBD protocol's strings (proto.md) are at most 4096 bytes: clients refuse to ask for a
/// longer export name, and a server listing one breaks their `NBD_OPT_LIST`.
fn check_export_name(name: &str) -> Result<()> {
    const MAX_EXPORT_NAME: usize = 4096;
    if name.len() > MAX_EXPORT_NAME {
        anyhow::bail!(
            "--export-name: the name is {} bytes; the NBD protocol allows at most \
             {MAX_EXPORT_NAME} (clients could not ask for it)",
            name.len()
        );
    }
    Ok(())
}

/// `--socket-mode`: octal permission bits, at most 777.
fn parse_socket_mode(text: &str) -> std::result::Result<u32, String> {
    let mode = u32::from_str_radix(text, 8)
        .ok()
        .filter(|mode| *mode <= 0o777)
        .ok_or_else(|| format!("{text:?} is not an octal mode from 0 to 777 (for example 660)"))?;
    if mode & 0o200 == 0 {
        return Err(format!(
            "{text}: without write permission for its owner (200) the socket's owner could not \
             connect (only root could); for example 600 or 660"
        ));
    }
    Ok(mode)
}

/// Where clients connect, the TLS they must use, and the signals that stop the server or
/// reload its credentials (taken over from their default actions as soon as the server binds,
/// before it says it is ready: a SIGHUP or SIGTERM just after that must not kill it
/// unflushed).
struct Endpoint {
    listener: Listener,
    tls: Option<TlsCredentials>,
    interrupt: tokio::signal::unix::Signal,
    terminate: tokio::signal::unix::Signal,
    /// SIGQUIT stops the server as SIGTERM does: by default it killed it unflushed (and
    /// `import`, `export` and the other long commands take it as an interrupt too).
    quit: tokio::signal::unix::Signal,
    hangup: tokio::signal::unix::Signal,
}

impl Endpoint {
    /// A stop signal that came while the image was being opened (at the passphrase prompt,
    /// during the key derivation): the handlers hold it from the bind on. Served, the export
    /// was announced ready (a ready line, READY=1) and stopped at once.
    fn stop_signal_pending(&mut self) -> Option<&'static str> {
        use futures_util::FutureExt;
        if self.interrupt.recv().now_or_never().is_some() {
            return Some("SIGINT");
        }
        if self.quit.recv().now_or_never().is_some() {
            return Some("SIGQUIT");
        }
        self.terminate.recv().now_or_never().map(|_| "SIGTERM")
    }
}

/// Load the TLS credentials and bind where the arguments say (both before any passphrase is
/// asked for: unusable credentials or a busy or refused address should not cost an unlock),
/// and give a Unix socket the mode `--socket-mode` asks for.
fn bind(args: &ServeArgs, rt: &Runtime) -> Result<Endpoint> {
    check_export_name(&args.export_name)?;
    let tls = match &args.tls_creds {
        Some(dir) => Some(TlsCredentials::from_dir(dir).map_err(|e| {
            anyhow!("{e}. Make a set with scripts/tls-creds, or give the directory that has them")
        })?),
        None => None,
    };
    let address = listen_address(args)?;
    let listener = rt.block_on(Listener::bind(&address))?;
    if let (Some(mode), ListenAddress::Unix(path)) = (args.socket_mode, &address) {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
            .with_context(|| format!("setting mode {mode:o} on socket {}", path.display()))?;
    }
    let _runtime = rt.enter();
    Ok(Endpoint {
        listener,
        tls,
        interrupt: signal(SignalKind::interrupt()).context("installing SIGINT handler")?,
        terminate: signal(SignalKind::terminate()).context("installing SIGTERM handler")?,
        quit: signal(SignalKind::quit()).context("installing SIGQUIT handler")?,
        hangup: signal(SignalKind::hangup()).context("installing SIGHUP handler")?,
    })
}

/// The default socket's file name: the image's last path part (a local directory's name, a
/// RADOS or rbd image's name, with `@SNAPSHOT`), `.sock` appended. Other images of that name
/// served at once need --socket: binding refuses a socket a live server answers on.
fn default_socket_name(image: &str) -> String {
    let address = image.split('?').next().unwrap_or_default();
    let address = address.trim_end_matches('/');
    let last = address.rsplit(['/', ':']).next().unwrap_or_default();
    let name: String = last
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "._@-".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect();
    match name.trim_start_matches('.') {
        "" => "image.sock".to_owned(),
        name => format!("{name}.sock"),
    }
}

/// `HOST:PORT` resolved: the socket address to bind (the first it resolves to) and, if it is
/// not a loopback address, its IP (the unspecified 0.0.0.0 and :: among them: they listen
/// on every interface). An address that does not resolve is an error.
fn resolve_listen(address: &str) -> Result<(String, Vec<std::net::IpAddr>)> {
    use std::net::ToSocketAddrs;
    let first = address
        .to_socket_addrs()
        .with_context(|| format!("--listen {address}: cannot resolve it (HOST:PORT)"))?
        .next()
        .ok_or_else(|| anyhow!("--listen {address} resolves to no address"))?;
    let ip = first.ip().to_canonical();
    Ok((
        first.to_string(),
        [ip].into_iter().filter(|ip| !ip.is_loopback()).collect(),
    ))
}

/// A local image that another process has open for writing, refused before the passphrase is
/// asked for and its key derivation run: its store would refuse the open after them, with
/// the same error.
fn refuse_a_second_local_writer(uri: &ImageUri) -> Result<()> {
    let ImageUri::Local { dir } = uri else {
        return Ok(());
    };
    if !dir.is_dir() {
        return Ok(()); // A LUKS file: its flock is taken (and its holder named) by the open.
    }
    match ivdisk_store::LocalStore::writing_process(dir) {
        Ok(Some(pid)) => Err(anyhow!(
            "{}",
            ImageError::Store {
                image: uri.to_string(),
                source: ivdisk_store::StoreError::AlreadyOpen {
                    path: dir.display().to_string(),
                    pid: pid.to_string(),
                },
            }
        )),
        // Not knowing is no refusal: the open decides.
        Ok(None) | Err(_) => Ok(()),
    }
}

pub fn run(args: ServeArgs, rt: &Runtime) -> Result<()> {
    if RbdUri::is_rbd(&args.image) {
        return run_rbd(args, rt);
    }
    let (uri, snapshot) = ImageUri::parse_with_snapshot(&args.image).map_err(|e| anyhow!("{e}"))?;
    let at_snapshot = snapshot.is_some();
    // A mistyped address is named before anything is bound or a passphrase asked for.
    info_at(rt, &uri, snapshot.as_deref())?;
    let mut endpoint = bind(&args, rt)
        .with_context(|| format!("serving image {}", image_at(&uri, snapshot.as_deref())))?;
    if !args.read_only && snapshot.is_none() {
        refuse_a_second_local_writer(&uri)?;
        rt.block_on(Image::refuse_if_write_locked(&uri))
            .map_err(|e| anyhow!("{e}"))?;
    }
    let passphrase = args.passphrase.existing()?;
    // A snapshot is always served read-only.
    let options = OpenOptions {
        read_only: args.read_only || snapshot.is_some(),
        snapshot,
        metadata_cache_bytes: args.metadata_cache_mib.saturating_mul(1 << 20),
        ..OpenOptions::default()
    };
    let image = with_spinner(
        "unlocking (the key derivation takes seconds by design)",
        || rt.block_on(Image::open(&uri, &passphrase, &options)),
    )
    .map_err(|e| {
        let hint = match &e {
            ImageError::Header { .. } => args.passphrase.unlock_hint(&passphrase),
            _ => String::new(),
        };
        anyhow!("{e}{hint}")
    })?;
    drop(passphrase);
    if let Some(signal) = rt.block_on(async { endpoint.stop_signal_pending() }) {
        let closed = rt.block_on(image.close()).map_err(|e| anyhow!("{e}"));
        closed?;
        anyhow::bail!("{signal} while the image was being opened: stopped before serving it");
    }

    // `ivdisk snap create` of this image reaches the writer through it (listening
    // before the server says it is ready).
    let control = (!image.is_read_only())
        .then(|| crate::control::ControlSocket::start(rt, &image, &uri))
        .flatten();
    let device: Arc<dyn BlockDevice> = Arc::new(image.clone());
    let export = Export {
        name: args.export_name.clone(),
        description: format!("ivdisk image {uri} ({})", image.suite().name()),
        device,
    };
    announce(
        &args,
        &endpoint,
        json!({
            "image": uri.to_string(),
            "snapshot": image.snapshot(),
            "size": image.size(),
            "sector_size": image.sector_size(),
            "cipher": image.suite().name(),
            "read_only": image.is_read_only(),
        }),
        format!(
            "image {uri}{} ({}, {}",
            image
                .snapshot()
                .map(|s| format!("@{s}"))
                .unwrap_or_default(),
            exact_size(image.size()),
            image.suite().name()
        ),
        image.is_read_only(),
    );
    let served = serve_until_signal(
        rt,
        endpoint,
        export,
        &match image.snapshot() {
            Some(snapshot) => uri.at_snapshot(snapshot),
            None => uri.to_string(),
        },
        "the writer lock expires by itself",
    );
    if let Some(control) = control {
        control.stop(rt);
    }
    // Whatever happened to the server, the image is flushed and its lock released.
    let lock_lost = rt.block_on(image.writer_lock_lost());
    let closed = rt.block_on(image.close()).map_err(|e| anyhow!("{e}"));
    // A writer fenced (`ivdisk lock break`, a successor) or cut off stops with an error: its
    // clients' writes were refused from then on, which a clean stop would hide.
    let closed = closed.and_then(|()| match lock_lost {
        Some(why) => Err(anyhow!(
            "image {uri}: closed, but its writer lock was lost while it was served ({why}): \
             the clients' writes were refused from then on (they saw I/O errors); what they \
             wrote before is in the image"
        )),
        None => Ok(()),
    });
    finish(&args, at_snapshot, served, closed)
}

/// Say that the export is ready: `ready` completed with where and how to reach it, as one
/// JSON line (--json); or `what` (an open parenthesis, closed here) with attach hints.
fn announce(
    args: &ServeArgs,
    endpoint: &Endpoint,
    mut ready: serde_json::Value,
    what: String,
    read_only: bool,
) {
    let address = &endpoint.listener.local_address();
    let tls = endpoint.tls.as_ref().map(TlsCredentials::kind);
    if args.json {
        ready["address"] = address.to_string().into();
        ready["tls"] = match tls {
            Some(TlsKind::X509) => "x509".into(),
            Some(TlsKind::Psk) => "psk".into(),
            None => serde_json::Value::Null,
        };
        ready["uri"] = nbd_uri(address, &args.export_name, tls).into();
        ready["qemu_drive"] = qemu_drive(address, &args.export_name, read_only, tls).into();
        if let Some(object) = qemu_object(tls) {
            ready["qemu_object"] = object.into();
        }
        ready["export"] = args.export_name.clone().into();
        say(&ready.to_string());
    } else {
        say(&format!(
            "Serving {what}{}) on {address}\n{}",
            if read_only { ", read-only" } else { "" },
            attach_hints(address, &args.export_name, read_only, tls)
        ));
    }
    notify_service_manager(&format!("READY=1\nSTATUS=serving on {address}"));
}

/// Print the ready line or the attach hints. A reader of standard output that has gone
/// (`ivdisk serve ... --json | head -1` in a script) does not stop the server: its clients
/// matter more than the announcement.
fn say(text: &str) {
    use std::io::Write;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{text}").and_then(|()| out.flush());
}

/// Tell systemd how the server is doing, as `sd_notify(3)` does: a datagram to the socket in
/// `$NOTIFY_SOCKET` (a path, or `@` and an abstract name). With `Type=notify` a unit is then
/// started once the export is ready (so a VM ordered after it finds the socket), and shown
/// as stopping while the requests in flight finish. Nothing without the variable.
fn notify_service_manager(state: &str) {
    use std::os::linux::net::SocketAddrExt;
    use std::os::unix::ffi::OsStrExt;
    use std::os::unix::net::{SocketAddr, UnixDatagram};
    let Some(target) = std::env::var_os("NOTIFY_SOCKET") else {
        return;
    };
    let sent = UnixDatagram::unbound().and_then(|socket| {
        let address = match target.as_bytes().strip_prefix(b"@") {
            Some(name) => SocketAddr::from_abstract_name(name)?,
            None => SocketAddr::from_pathname(&target)?,
        };
        socket.send_to_addr(state.as_bytes(), &address)
    });
    if let Err(e) = sent {
        tracing::warn!(
            socket = %target.to_string_lossy(),
            error = %e,
            "could not tell the service manager (NOTIFY_SOCKET) that the server is {}",
            if state.starts_with("READY") { "ready" } else { "stopping" }
        );
    }
}

/// Serve `export` until SIGINT/SIGTERM, then let the requests in flight finish. A second
/// signal exits at once (`killed`: what happens to the image then, for the message). SIGHUP
/// reloads the TLS credentials meanwhile.
fn serve_until_signal(
    rt: &Runtime,
    endpoint: Endpoint,
    export: Export,
    image: &str,
    killed: &'static str,
) -> Result<ServeStats> {
    let Endpoint {
        listener,
        tls,
        mut interrupt,
        mut terminate,
        mut quit,
        hangup,
    } = endpoint;
    tracing::info!(
        %image,
        address = %listener.local_address(),
        tls = ?tls.as_ref().map(|t| t.dir().display().to_string()),
        "serving"
    );
    let image = image.to_owned();
    rt.block_on(async {
        let stop = async move {
            let name = tokio::select! {
                _ = interrupt.recv() => "SIGINT",
                _ = terminate.recv() => "SIGTERM",
                _ = quit.recv() => "SIGQUIT",
            };
            tracing::info!(
                signal = name,
                "stopping: no new connections, finishing requests in flight"
            );
            notify_service_manager("STOPPING=1");
            note!(
                "ivdisk: {name}: finishing requests in flight, then flushing and closing {image} \
                 (a second signal exits at once, without flushing)"
            );
            // A request stuck on an unreachable store must not make the server unkillable.
            tokio::spawn(async move {
                // The shell's convention: 128 + the signal's number (SIGINT 2, SIGQUIT 3,
                // SIGTERM 15).
                let code = tokio::select! {
                    _ = interrupt.recv() => 130,
                    _ = quit.recv() => 131,
                    _ = terminate.recv() => 143,
                };
                note!("ivdisk: second signal: exiting without flushing; {killed}");
                std::process::exit(code);
            });
        };
        let reloader = tokio::spawn(reload_on_hangup(tls.clone(), hangup));
        let served = serve_with_tls(listener, vec![export], tls, stop)
            .await
            .map_err(|e| anyhow!("{e}"));
        reloader.abort();
        served
    })
}

/// SIGHUP: load the TLS credentials again (renewed certificates: `TlsCredentials::reload`),
/// for the connections that come next; if they cannot be used, say why and keep the ones in
/// use. Without TLS there is nothing to reload, and the signal (which would otherwise end the
/// process without a flush) is only logged.
async fn reload_on_hangup(tls: Option<TlsCredentials>, mut hangup: tokio::signal::unix::Signal) {
    while hangup.recv().await.is_some() {
        // Said on stderr as the stop signals are, whatever the log level: whoever sent it
        // wants to know it worked.
        let Some(tls) = &tls else {
            note!("ivdisk: SIGHUP: nothing to reload (no --tls-creds); still serving");
            continue;
        };
        match tls.reload() {
            Ok(()) => note!(
                "ivdisk: SIGHUP: TLS credentials reloaded from {}; new connections use them",
                tls.dir().display()
            ),
            Err(e) => tracing::error!("SIGHUP: {e}; the credentials loaded before stay in use"),
        }
    }
}

/// The end of a serve: the server's outcome first, then the image's close.
/// `at_snapshot`: the image was served at a snapshot (so read-only).
fn finish(
    args: &ServeArgs,
    at_snapshot: bool,
    served: Result<ServeStats>,
    closed: Result<()>,
) -> Result<()> {
    let stats = served?;
    closed?;
    tracing::info!(
        connections = stats.connections,
        protocol_errors = stats.protocol_errors,
        tls_failures = stats.tls_failures,
        "served"
    );
    // On stderr with --json too: stdout holds the one JSON line, and a script that stopped
    // the server learns from this line (and the exit code) that the flush happened.
    match args.read_only || at_snapshot {
        // A reader wrote nothing: "flushed" would say otherwise.
        true => note!(
            "ivdisk: image {} closed (read-only: nothing to flush)",
            args.image
        ),
        false => note!("ivdisk: image {} flushed and closed", args.image),
    }
    Ok(())
}

/// Open a librbd image: encryption as `encryption=` says; for `auto`, the passphrase is asked
/// for (when no file gives it) only once the image turns out to be LUKS.
fn open_rbd(args: &ServeArgs, uri: &RbdUri, rt: &Runtime) -> Result<RbdImage> {
    let mut passphrase = args.passphrase.read_files()?;
    if uri.encryption.needs_passphrase() && passphrase.is_none() {
        passphrase = Some(args.passphrase.existing()?);
    }
    let open = |passphrase: Option<&Zeroizing<Vec<u8>>>| {
        let encryption = uri
            .encryption
            .with_passphrase(passphrase.cloned())
            .expect("a passphrase is there when the encryption kind needs one");
        let options = RbdOpenOptions {
            image: uri.image.clone(),
            snapshot: uri.snapshot.clone(),
            read_only: args.read_only,
            encryption,
            exclusive: true,
        };
        with_spinner("opening (a LUKS unlock takes seconds by design)", || {
            rt.block_on(RbdImage::open(&uri.config, options))
        })
    };
    let opened = match open(passphrase.as_ref()) {
        Err(RbdError::PassphraseRequired { image, format }) => {
            let asked = args
                .passphrase
                .existing()
                .with_context(|| format!("rbd image {image} is {format}-encrypted (librbd)"))?;
            passphrase = Some(asked);
            open(passphrase.as_ref())
        }
        other => other,
    };
    opened.map_err(|e| match &e {
        RbdError::WrongPassphrase { .. } => {
            let secret = passphrase.as_ref().map_or(&[][..], |p| p.as_slice());
            anyhow!("{e}{}", args.passphrase.unlock_hint(secret))
        }
        _ => anyhow!("{e}"),
    })
}

fn run_rbd(args: ServeArgs, rt: &Runtime) -> Result<()> {
    let uri = RbdUri::parse(&args.image).map_err(|e| anyhow!("{e}"))?;
    let mut endpoint =
        bind(&args, rt).with_context(|| format!("serving rbd image {}", uri.spec()))?;
    let image = Arc::new(open_rbd(&args, &uri, rt)?);
    if let Some(signal) = rt.block_on(async { endpoint.stop_signal_pending() }) {
        anyhow::bail!("{signal} while the image was being opened: stopped before serving it");
    }
    let encryption = image.encryption().map_or("none", |f| f.name());
    let export = Export {
        name: args.export_name.clone(),
        description: format!("librbd image {} (encryption {encryption})", image.name()),
        device: image.clone(),
    };
    announce(
        &args,
        &endpoint,
        json!({
            "image": uri.to_string(),
            "size": image.size(),
            "encryption": encryption,
            "backend": "librbd",
            "read_only": image.is_read_only(),
        }),
        format!(
            "librbd image {} ({}, encryption {encryption}",
            image.name(),
            exact_size(image.size())
        ),
        image.is_read_only(),
    );
    let served = serve_until_signal(
        rt,
        endpoint,
        export,
        &uri.spec(),
        "librbd's exclusive lock passes to the next writer",
    );
    // The server has returned, so no connection holds the image any more: flush and close
    // it (and, in the unexpected case of a leftover reference, still flush it).
    let closed = rt.block_on(async {
        match Arc::try_unwrap(image) {
            Ok(image) => image.close().await,
            Err(image) => image.flush().await,
        }
    });
    let at_snapshot = uri.snapshot.is_some();
    finish(
        &args,
        at_snapshot,
        served,
        closed.map_err(|e| anyhow!("{e}")),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The words a POSIX shell (`sh`) makes of `line`, one per argument.
    fn shell_words_of(line: &str) -> Vec<String> {
        let out = std::process::Command::new("sh")
            .arg("-c")
            .arg(format!("printf '%s\\0' {line}"))
            .output()
            .expect("sh runs");
        assert!(out.status.success(), "sh refused {line}");
        let text = String::from_utf8(out.stdout).expect("UTF-8");
        text.split_terminator('\0').map(str::to_owned).collect()
    }

    /// What `shell_word` makes of an address comes back from the shell as one word, that
    /// address; plain names are left as they are.
    #[test]
    fn a_shell_word_is_read_back_by_the_shell_as_itself() {
        for text in [
            "disk.ivd",
            "rados://rbd/vm1?conf=/etc/ceph/ceph.conf&id=admin",
            "rados://rbd/vm1@snap?conf=/etc/ceph/my ceph.conf",
            "/srv/my disk.ivd",
            // Nothing here may do harm if a broken quoting lets the shell run it.
            "it's; true $HOME `true` \\ \"q\" * | :",
            "tab\there",
            "~user/disk",
            "",
        ] {
            assert_eq!(shell_words_of(&shell_word(text)), [text], "{text}");
        }
        assert_eq!(
            shell_word("/srv/vms/disk.ivd@monday"),
            "/srv/vms/disk.ivd@monday"
        );
        assert_eq!(shell_word("file:/srv/a,b"), "file:/srv/a,b");
    }

    /// Each hint is a command to paste into a shell: a socket path or export name with a
    /// space, a quote or an `&` stays one argument. The nbd-client line gave the path bare.
    #[test]
    fn hints_survive_the_shell_with_any_path_or_export_name() {
        let path = "/tmp/my vms/it's & more.sock";
        let export = "vm 1's";
        let address = ListenAddress::Unix(path.into());
        let hints = attach_hints(&address, export, true, None);
        let line = |client: &str| {
            let line = hints
                .lines()
                .find(|l| l.trim_start().starts_with(client))
                .unwrap_or_else(|| panic!("no {client} line in {hints}"));
            shell_words_of(line.split("   #").next().unwrap())
        };
        let uri = nbd_uri(&address, export, None);
        assert_eq!(line("nbdinfo"), ["nbdinfo", uri.as_str()]);
        assert_eq!(
            line("nbd-client"),
            ["nbd-client", "-unix", path, "/dev/nbd0", "-N", export]
        );
        let qemu = line("qemu-system-x86_64");
        assert_eq!(
            qemu.last().unwrap(),
            &qemu_drive(&address, export, true, None)
        );
        let nbdfuse = hints.lines().find(|l| l.contains("nbdfuse")).unwrap();
        let nbdfuse = nbdfuse
            .split("&& ")
            .nth(1)
            .unwrap()
            .split(" &   #")
            .next()
            .unwrap();
        assert_eq!(
            shell_words_of(nbdfuse),
            ["nbdfuse", "/tmp/disk", uri.as_str()]
        );
        // With TLS, qemu takes the socket's path as an option of its own, not in a URI.
        let tls = attach_hints(&address, export, false, Some(TlsKind::X509));
        let drive = tls
            .lines()
            .find(|l| l.contains("qemu-system-x86_64"))
            .unwrap()
            .split(" -drive ")
            .nth(1)
            .unwrap();
        assert_eq!(
            shell_words_of(drive),
            [qemu_drive(&address, export, false, Some(TlsKind::X509))]
        );
    }

    #[test]
    fn the_default_socket_is_named_after_the_image() {
        for (image, name) in [
            ("/srv/vms/disk.ivd", "disk.ivd.sock"),
            ("disk.ivd@monday", "disk.ivd@monday.sock"),
            ("file:/srv/vm1/", "vm1.sock"),
            ("rados://rbd/vm1?conf=/etc/ceph/ceph.conf", "vm1.sock"),
            ("rados://rbd/vm1@snap?id=admin", "vm1@snap.sock"),
            ("mem:scratch", "scratch.sock"),
            ("/srv/a b/../..", "image.sock"),
            ("/srv/my disk", "my_disk.sock"),
        ] {
            assert_eq!(default_socket_name(image), name, "{image}");
        }
    }

    #[test]
    fn hints_name_every_client() {
        for address in [
            ListenAddress::Unix("/tmp/x.sock".into()),
            ListenAddress::Tcp("127.0.0.1:10809".into()),
        ] {
            let hints = attach_hints(&address, "vm1", false, None);
            for client in ["nbdinfo", "nbdfuse", "qemu-system-x86_64", "nbd-client"] {
                assert!(hints.contains(client), "{client} missing for {address}");
            }
            assert!(hints.contains("vm1"));
            assert!(hints.contains(&format!(
                "-drive '{}'",
                qemu_drive(&address, "vm1", false, None)
            )));
            assert!(attach_hints(&address, "", true, None).contains(",readonly=on'"));
            let tls = attach_hints(&address, "vm1", false, Some(TlsKind::X509));
            assert!(tls.contains("/etc/pki/libnbd"), "{tls}");
            assert!(tls.contains("nbds"), "{tls}");
            assert!(tls.contains("tls-certificates=CLIENT_CREDS_DIR"), "{tls}");
            assert!(
                tls.contains("-object tls-creds-x509,id=tls0,endpoint=client"),
                "{tls}"
            );
            assert!(!tls.contains("nbd-client"), "{tls}");
            assert!(attach_hints(&address, "", true, Some(TlsKind::X509)).contains(",readonly=on'"));
            let psk = attach_hints(&address, "vm1", false, Some(TlsKind::Psk));
            assert!(psk.contains("IDENTITY@"), "{psk}");
            assert!(
                !psk.contains("nbdfuse"),
                "nbdfuse reads no keys file: {psk}"
            );
            assert!(
                psk.contains("tls-psk-file=CLIENT_CREDS_DIR/keys.psk"),
                "{psk}"
            );
            assert!(
                psk.contains("-object tls-creds-psk,id=tls0,endpoint=client,dir=CLIENT_CREDS_DIR,username=IDENTITY"),
                "{psk}"
            );
        }
        assert_eq!(
            qemu_drive(
                &ListenAddress::Unix("/tmp/x.sock".into()),
                "vm1",
                false,
                None
            ),
            "file=nbd+unix:///vm1?socket=/tmp/x.sock,format=raw,if=virtio"
        );
        assert_eq!(
            nbd_uri(&ListenAddress::Unix("/tmp/x.sock".into()), "", None),
            "nbd+unix:///?socket=/tmp/x.sock"
        );
        assert_eq!(
            nbd_uri(
                &ListenAddress::Unix("/tmp/x.sock".into()),
                "vm1",
                Some(TlsKind::X509)
            ),
            "nbds+unix:///vm1?socket=/tmp/x.sock&tls-certificates=CLIENT_CREDS_DIR"
        );
        assert_eq!(
            nbd_uri(
                &ListenAddress::Tcp("[::1]:10809".into()),
                "",
                Some(TlsKind::X509)
            ),
            "nbds://[::1]:10809/?tls-certificates=CLIENT_CREDS_DIR"
        );
        let host = rustix::system::uname()
            .nodename()
            .to_string_lossy()
            .into_owned();
        for any in ["0.0.0.0:10809", "[::]:10809"] {
            assert_eq!(
                nbd_uri(&ListenAddress::Tcp(any.into()), "", None),
                format!("nbd://{host}:10809/")
            );
        }
        assert_eq!(
            qemu_drive(
                &ListenAddress::Tcp("[::1]:10809".into()),
                "vm1",
                true,
                Some(TlsKind::Psk)
            ),
            "driver=nbd,server.type=inet,server.host=::1,server.port=10809,export=vm1,\
             tls-creds=tls0,if=virtio,readonly=on"
        );
        assert_eq!(
            nbd_uri(
                &ListenAddress::Unix("/tmp/x.sock".into()),
                "vm1",
                Some(TlsKind::Psk)
            ),
            "nbds+unix://IDENTITY@/vm1?socket=/tmp/x.sock&tls-psk-file=CLIENT_CREDS_DIR/keys.psk"
        );
    }

    /// Names and paths with characters a URI or a qemu option string gives a meaning to
    /// (checked by hand with nbdinfo and qemu-img against a server: `tests/nbd_clients.rs`
    /// attaches through the printed `uri`).
    #[test]
    fn hints_escape_what_uris_and_qemu_options_would_misread() {
        let odd = ListenAddress::Unix("/tmp/sp ace/a,b.sock".into());
        assert_eq!(
            nbd_uri(&odd, "vm 1/\u{e9}?#&", None),
            "nbd+unix:///vm%201/%C3%A9%3F%23%26?socket=/tmp/sp%20ace/a%2Cb.sock"
        );
        assert_eq!(
            qemu_drive(&odd, "a,b", false, None),
            "file=nbd+unix:///a%2Cb?socket=/tmp/sp%20ace/a%2Cb.sock,format=raw,if=virtio"
        );
        assert_eq!(
            qemu_drive(&odd, "a,b", false, Some(TlsKind::X509)),
            "driver=nbd,server.type=unix,server.path=/tmp/sp ace/a,,b.sock,export=a,,b,\
             tls-creds=tls0,if=virtio"
        );
    }

    #[test]
    fn only_loopback_addresses_stay_on_this_machine() {
        for local in [
            "127.0.0.1:10809",
            "127.1.2.3:0",
            "[::1]:10809",
            "[::ffff:127.0.0.1]:1",
        ] {
            assert!(exposed(local).is_empty(), "{local}");
        }
        let any4: std::net::IpAddr = "0.0.0.0".parse().unwrap();
        let any6: std::net::IpAddr = "::".parse().unwrap();
        let lan: std::net::IpAddr = "192.168.1.20".parse().unwrap();
        assert_eq!(exposed("0.0.0.0:10809"), vec![any4]);
        assert_eq!(exposed("[::]:10809"), vec![any6]);
        assert_eq!(exposed("192.168.1.20:0"), vec![lan]);
        assert_eq!(
            exposed("[::ffff:192.168.1.20]:0"),
            vec![lan],
            "an IPv4-mapped address is its IPv4 address"
        );
        // What is checked is what is bound: the address resolved.
        assert_eq!(
            resolve_listen("127.0.0.1:10809").unwrap().0,
            "127.0.0.1:10809"
        );
        // An address that does not resolve is refused here: judged "not reachable", it was
        // looked up again at the bind, which could then listen on the network.
        for bad in ["no port", "no-such-host.invalid:10809"] {
            let err = resolve_listen(bad).unwrap_err().to_string();
            assert!(err.contains("cannot resolve"), "{bad}: {err}");
        }
    }

    fn exposed(address: &str) -> Vec<std::net::IpAddr> {
        resolve_listen(address).unwrap().1
    }

    #[test]
    fn socket_modes_are_octal_permission_bits() {
        assert_eq!(parse_socket_mode("600"), Ok(0o600));
        assert_eq!(parse_socket_mode("0660"), Ok(0o660));
        assert_eq!(parse_socket_mode("777"), Ok(0o777));
        for unusable in ["0", "400", "077"] {
            let refused = parse_socket_mode(unusable).unwrap_err();
            assert!(
                refused.contains("could not connect"),
                "{unusable}: {refused}"
            );
        }
        for bad in ["1000", "8", "rw", "", "-1"] {
            assert!(parse_socket_mode(bad).is_err(), "{bad:?}");
        }
    }
}
