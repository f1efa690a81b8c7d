//! `ivdisk serve`: open an image (read-write under its writer lock, or read-only) and export
//! it over NBD on a Unix socket or TCP until SIGINT/SIGTERM; then finish the requests in
//! flight, flush, release the lock and exit 0.

use std::path::PathBuf;

use anyhow::{anyhow, Context, Result};
use clap::Args;
use ivdisk_image::{Image, ImageError, ImageUri, OpenOptions};
use ivdisk_nbd::{serve, BlockDevice, Export, ListenAddress, Listener};
use serde_json::json;
use tokio::runtime::Runtime;
use tokio::signal::unix::{signal, SignalKind};

use crate::images::{human_size, IMAGE_HELP};
use crate::secrets::{with_spinner, PassphraseArgs};

/// The NBD port (IANA), used when neither --socket nor --listen is given.
pub const DEFAULT_LISTEN: &str = "127.0.0.1:10809";

#[derive(Args)]
pub struct ServeArgs {
    #[arg(help = IMAGE_HELP)]
    image: String,
    /// Listen on this Unix socket (created; a stale one left by a dead server is replaced).
    #[arg(long, value_name = "PATH", conflicts_with = "listen")]
    socket: Option<PathBuf>,
    /// Listen on TCP HOST:PORT (default 127.0.0.1:10809 when --socket is not given). There is
    /// no TLS or authentication: anyone who can connect reads the plaintext.
    #[arg(long, value_name = "HOST:PORT")]
    listen: Option<String>,
    /// Export read-only: no writer lock is taken, writes are refused.
    #[arg(long)]
    read_only: bool,
    /// The export's name (clients asking for "" get it too).
    #[arg(long, default_value = "", value_name = "NAME")]
    export_name: String,
    #[command(flatten)]
    passphrase: PassphraseArgs,
    /// Print one JSON line when ready (address, export, size, uri) instead of attach hints.
    #[arg(long)]
    json: bool,
}

pub fn after_help() -> String {
    format!(
        "Runs in the foreground until SIGINT (Ctrl-C) or SIGTERM, then finishes the requests in \
         flight, flushes, releases the writer lock and exits 0. Clients: qemu, qemu-img, nbdinfo, \
         nbdcopy, nbdfuse, fio (--ioengine=nbd), the kernel's nbd-client. Several clients may \
         attach at once (they share one open image, so a flush by one covers all).\n\nWithout \
         --socket or --listen it listens on TCP {DEFAULT_LISTEN}.\n\nExample:\n  ivdisk serve \
         disk.ivd --socket /tmp/disk.sock --passphrase-file pw.txt\n  nbdinfo \
         'nbd+unix:///?socket=/tmp/disk.sock'\n  ivdisk serve 'rados://rbd/vm1?id=admin' --listen \
         0.0.0.0:10809 --export-name vm1"
    )
}

/// How clients reach the export, for humans.
fn attach_hints(address: &ListenAddress, export: &str, read_only: bool) -> String {
    let ro = if read_only { " (read-only)" } else { "" };
    match address {
        ListenAddress::Unix(path) => {
            let path = path.display();
            let qemu_export = if export.is_empty() {
                String::new()
            } else {
                format!(",export={export}")
            };
            let nbd_client_export = if export.is_empty() {
                String::new()
            } else {
                format!(" -N {export}")
            };
            format!(
                "Attach it{ro} with:\n  nbdinfo 'nbd+unix:///{export}?socket={path}'\n  \
                 mkdir -p /tmp/disk && nbdfuse /tmp/disk 'nbd+unix:///{export}?socket={path}' &   # file /tmp/disk/nbd\n  \
                 qemu-system-x86_64 ... -drive driver=nbd,server.type=unix,server.path={path}{qemu_export},format=raw,if=virtio\n  \
                 nbd-client -unix {path} /dev/nbd0{nbd_client_export}   # as root, after modprobe nbd\n\
                 Stop with Ctrl-C or SIGTERM."
            )
        }
        ListenAddress::Tcp(addr) => {
            let (host, port) = addr.rsplit_once(':').unwrap_or((addr, "10809"));
            let nbd_client_export = if export.is_empty() {
                String::new()
            } else {
                format!(" -N {export}")
            };
            format!(
                "Attach it{ro} with:\n  nbdinfo 'nbd://{addr}/{export}'\n  \
                 mkdir -p /tmp/disk && nbdfuse /tmp/disk 'nbd://{addr}/{export}' &   # file /tmp/disk/nbd\n  \
                 qemu-system-x86_64 ... -drive file=nbd://{addr}/{export},format=raw,if=virtio\n  \
                 nbd-client {host} {port} /dev/nbd0{nbd_client_export}   # as root, after modprobe nbd\n\
                 Stop with Ctrl-C or SIGTERM."
            )
        }
    }
}

fn nbd_uri(address: &ListenAddress, export: &str) -> String {
    match address {
        ListenAddress::Unix(path) => format!("nbd+unix:///{export}?socket={}", path.display()),
        ListenAddress::Tcp(addr) => format!("nbd://{addr}/{export}"),
    }
}

pub fn run(args: ServeArgs, rt: &Runtime) -> Result<()> {
    let uri = ImageUri::parse(&args.image).map_err(|e| anyhow!("{e}"))?;
    let address = match (&args.socket, &args.listen) {
        (Some(path), _) => ListenAddress::Unix(path.clone()),
        (None, Some(addr)) => ListenAddress::Tcp(addr.clone()),
        (None, None) => ListenAddress::Tcp(DEFAULT_LISTEN.to_owned()),
    };
    // Bind before asking for the passphrase: a busy address should not cost an unlock.
    let listener = rt
        .block_on(Listener::bind(&address))
        .with_context(|| format!("serving image {uri}"))?;
    let address = listener.local_address();
    let passphrase = args.passphrase.existing()?;
    let options = if args.read_only {
        OpenOptions::read_only()
    } else {
        OpenOptions::default()
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

    let device: std::sync::Arc<dyn BlockDevice> = std::sync::Arc::new(image.clone());
    let export = Export {
        name: args.export_name.clone(),
        description: format!("ivdisk image {uri} ({})", image.suite().name()),
        device,
    };
    if args.json {
        println!(
            "{}",
            json!({
                "image": uri.to_string(),
                "address": address.to_string(),
                "uri": nbd_uri(&address, &args.export_name),
                "export": args.export_name,
                "size": image.size(),
                "sector_size": image.sector_size(),
                "cipher": image.suite().name(),
                "read_only": image.is_read_only(),
            })
        );
    } else {
        println!(
            "Serving image {uri} ({}, {}{}) on {address}\n{}",
            human_size(image.size()),
            image.suite().name(),
            if image.is_read_only() {
                ", read-only"
            } else {
                ""
            },
            attach_hints(&address, &args.export_name, image.is_read_only())
        );
    }
    tracing::info!(image = %uri, %address, "serving");

    let served = rt.block_on(async {
        let mut interrupt = signal(SignalKind::interrupt()).context("installing SIGINT handler")?;
        let mut terminate = signal(SignalKind::terminate()).context("installing SIGTERM handler")?;
        let stop = async move {
            let name = tokio::select! {
                _ = interrupt.recv() => "SIGINT",
                _ = terminate.recv() => "SIGTERM",
            };
            tracing::info!(signal = name, "stopping: no new connections, finishing requests in flight");
            eprintln!(
                "ivdisk: {name}: finishing requests in flight, then flushing and closing {uri} \
                 (a second signal exits at once, without flushing)"
            );
            // A request stuck on an unreachable store must not make the server unkillable.
            tokio::spawn(async move {
                tokio::select! {
                    _ = interrupt.recv() => {}
                    _ = terminate.recv() => {}
                }
                eprintln!("ivdisk: second signal: exiting without flushing; the writer lock expires by itself");
                std::process::exit(130);
            });
        };
        serve(listener, vec![export], stop)
            .await
            .map_err(|e| anyhow!("{e}"))
    });
    // Whatever happened to the server, the image is flushed and its lock released.
    let closed = rt.block_on(image.close());
    let stats = served?;
    closed.map_err(|e| anyhow!("{e}"))?;
    tracing::info!(
        connections = stats.connections,
        protocol_errors = stats.protocol_errors,
        "served"
    );
    if !args.json {
        eprintln!("ivdisk: image {} flushed and closed", args.image);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hints_name_every_client() {
        for address in [
            ListenAddress::Unix("/tmp/x.sock".into()),
            ListenAddress::Tcp("127.0.0.1:10809".into()),
        ] {
            let hints = attach_hints(&address, "vm1", false);
            for client in ["nbdinfo", "nbdfuse", "qemu-system-x86_64", "nbd-client"] {
                assert!(hints.contains(client), "{client} missing for {address}");
            }
            assert!(hints.contains("vm1"));
        }
        assert_eq!(
            nbd_uri(&ListenAddress::Unix("/tmp/x.sock".into()), ""),
            "nbd+unix:///?socket=/tmp/x.sock"
        );
    }
}
