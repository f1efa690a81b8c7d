//! The control socket of `ivdisk serve`: how commands reach an image that a server holds open
//! for writing. The writer lock keeps every other process from changing the image, and a
//! snapshot must be taken by the writer itself (it flushes, holds new writes off, and from
//! then on preserves the snapshot with every write), so `ivdisk snap create` asks the server;
//! `ivdisk snap rm` too (the writer's writes stop preserving the snapshot). `ivdisk passphrase
//! add|remove|change` of a local image make their keyslot change themselves (the key
//! derivations run in the command, not in the server) and, as a local store is open in one
//! process at a time, hand the server the header bytes to store.
//!
//! One socket per served image, named by the image id and where the image is (a copy of a
//! local image, or an image restored from a backup, has the same id), in a directory only the
//! user can enter (`$XDG_RUNTIME_DIR/ivdisk`, else `/tmp/ivdisk-UID`, mode 700; clients look
//! in both, and in `/run/user/UID/ivdisk`): whoever may connect may already change the image's
//! store. One JSON line each way per connection:
//! `{"command":"snap-create","snapshot":NAME,"location":WHERE}` gets `{"snapshot":{...}}`,
//! `"snap-rm"` gets `{"removed":NAME}`; `{"command":"header-change","version":V,"ranges":
//! [[OFFSET,HEX],...]}` gets `{"stored":true}` (the server checks that the bytes change
//! nothing but keyslots, `Image::apply_header_change`); `"ping"` gets `{"pid":PID}` (who
//! serves it, for refusals that name the server); any of them `{"error":TEXT}`. The server
//! checks that `location` is its image's.

use std::io::{BufRead, BufReader, ErrorKind, Write};
use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use anyhow::{anyhow, bail, Context, Result};
use ivdisk_crypto::ImageId;
use ivdisk_image::{Image, ImageError, ImageUri};
use ivdisk_store::StoreError;
use serde_json::{json, Value};
use tokio::io::{AsyncBufReadExt, AsyncWriteExt};
use tokio::runtime::Runtime;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

use crate::snapshots::snapshot_json;

/// A request line longer than this is refused: a header change in hex (a keyslot's area and
/// the two JSON copies, well under 1 MiB for ivdisk's keyslots; the whole 16 MiB header
/// region of an image at most).
const MAX_REQUEST: u64 = 34 << 20;
/// How long a client waits for the answer: a snapshot waits for the writes in flight and a
/// flush, which on a cluster in trouble takes up to the operation timeout.
const ANSWER_LIMIT: Duration = Duration::from_secs(120);

/// The directory of the control sockets and of `ivdisk serve`'s default NBD socket, made
/// (mode 700) if missing; refused if someone else owns it or others may enter it (another
/// user could then answer in the server's name, or reach the plaintext).
pub fn runtime_dir() -> Result<PathBuf> {
    let dir = runtime_dirs().swap_remove(0);
    match std::fs::DirBuilder::new().mode(0o700).create(&dir) {
        Ok(()) => {}
        Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => {}
        Err(e) => return Err(e).with_context(|| format!("making {}", dir.display())),
    }
    if !is_private(&dir) {
        bail!(
            "{} is not a directory of this user (uid {}) that only it can enter; remove it",
            dir.display(),
            rustix::process::getuid().as_raw()
        );
    }
    Ok(dir)
}

/// Where a server of this user may have made its runtime directory, the one it makes first:
/// `$XDG_RUNTIME_DIR/ivdisk` (if set), else `/tmp/ivdisk-UID`. A client looks in all of them,
/// as its environment may not be the server's (`sudo` drops `XDG_RUNTIME_DIR`; a systemd
/// service has none while an administrator's login shell has `/run/user/UID`).
fn runtime_dirs() -> Vec<PathBuf> {
    let uid = rustix::process::getuid().as_raw();
    let mut dirs: Vec<PathBuf> = std::env::var_os("XDG_RUNTIME_DIR")
        .filter(|d| !d.is_empty())
        .map(|runtime| Path::new(&runtime).join("ivdisk"))
        .into_iter()
        .chain([
            PathBuf::from(format!("/tmp/ivdisk-{uid}")),
            PathBuf::from(format!("/run/user/{uid}/ivdisk")),
        ])
        .collect();
    dirs.dedup();
    dirs
}

/// A directory this user owns and only it can enter (a socket in it speaks for this user).
fn is_private(dir: &Path) -> bool {
    std::fs::symlink_metadata(dir).is_ok_and(|meta| {
        meta.is_dir()
            && meta.uid() == rustix::process::getuid().as_raw()
            && meta.permissions().mode() & 0o077 == 0
    })
}

/// Where the image is, the same however the address was spelled (a relative path, the
/// options of a `rados://` address); `None` for memory images, which live in one process.
/// A RADOS image's includes the cluster's configuration file (as librados finds it): two
/// clusters may hold an image of the same pool, name and id (one restored from a backup of
/// the other), and a snapshot asked of one must not reach the other's server.
pub fn location(uri: &ImageUri) -> Option<String> {
    match uri {
        ImageUri::Local { dir } => {
            let dir = std::fs::canonicalize(dir).unwrap_or_else(|_| dir.clone());
            Some(format!("local:{}", dir.display()))
        }
        ImageUri::Rados {
            pool,
            namespace,
            image,
            conf,
            ..
        } => {
            let conf = conf
                .clone()
                .or_else(|| std::env::var_os("CEPH_CONF").map(PathBuf::from))
                .unwrap_or_else(|| {
                    let home = std::env::var_os("HOME").map(PathBuf::from);
                    let cwd = std::env::current_dir().unwrap_or_default();
                    default_conf(home.as_deref(), &cwd)
                });
            let conf = std::fs::canonicalize(&conf).unwrap_or(conf);
            Some(format!(
                "rados:{pool}/{namespace}/{image}?conf={}",
                conf.display()
            ))
        }
        ImageUri::Memory { .. } => None,
    }
}

/// The configuration file librados reads when none is named: the first that exists of
/// /etc/ceph/ceph.conf, ~/.ceph/ceph.conf and ./ceph.conf. Taken as /etc/ceph/ceph.conf
/// always, two servers of two clusters found through the others (another HOME, another
/// directory) had one location, and a snapshot asked of one reached the other's server.
fn default_conf(home: Option<&Path>, cwd: &Path) -> PathBuf {
    let system = PathBuf::from("/etc/ceph/ceph.conf");
    [
        Some(system.clone()),
        home.map(|h| h.join(".ceph/ceph.conf")),
        Some(cwd.join("ceph.conf")),
    ]
    .into_iter()
    .flatten()
    .find(|candidate| candidate.exists())
    .unwrap_or(system)
}

fn socket_name(image_id: &ImageId, location: &str) -> String {
    // FNV-1a: stable across builds, unlike std's hasher; the id keeps names apart anyway.
    let hash = location.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    });
    format!("{}-{hash:016x}.sock", hex::encode(image_id.0))
}

/// A running control socket; [`ControlSocket::stop`] ends it.
pub struct ControlSocket {
    path: PathBuf,
    /// The socket file's (device, inode): removed at the end only while the path still names
    /// it (another server may have taken the path over after a `lock break`).
    file: Option<(u64, u64)>,
    stop: Option<oneshot::Sender<()>>,
    task: Option<JoinHandle<()>>,
}

impl ControlSocket {
    /// Listen for commands to `image` (open for writing, at `uri`). `None` (with a warning)
    /// if the socket cannot be made: the image is served anyway, only without live snapshots.
    pub fn start(rt: &Runtime, image: &Image, uri: &ImageUri) -> Option<ControlSocket> {
        let location = location(uri)?;
        let listen = || -> Result<(PathBuf, tokio::net::UnixListener)> {
            let path = runtime_dir()?.join(socket_name(&image.image_id(), &location));
            // Left by a server that died: this process holds the writer lock now.
            match std::fs::remove_file(&path) {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(e).with_context(|| format!("removing {}", path.display()))
                }
                _ => {}
            }
            let _guard = rt.enter();
            let listener = tokio::net::UnixListener::bind(&path)
                .with_context(|| format!("listening on {}", path.display()))?;
            std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600))?;
            Ok((path, listener))
        };
        let (path, listener) = match listen() {
            Ok(listening) => listening,
            Err(e) => {
                tracing::warn!(error = %format!("{e:#}"), "no control socket: `ivdisk snap create` cannot reach this server");
                return None;
            }
        };
        let file = std::fs::symlink_metadata(&path)
            .ok()
            .map(|m| (m.dev(), m.ino()));
        tracing::debug!(path = %path.display(), "control socket listening");
        let (stop, mut stopped) = oneshot::channel();
        let image = image.clone();
        let task = rt.spawn(async move {
            loop {
                // One request at a time, each answered before the server stops: a snapshot is
                // never cut off half made.
                let connection = tokio::select! {
                    _ = &mut stopped => return,
                    accepted = listener.accept() => accepted,
                };
                match connection {
                    Ok((stream, _)) => answer(stream, &image, &location).await,
                    Err(e) => {
                        tracing::warn!(error = %e, "control socket: accept failed");
                        tokio::time::sleep(Duration::from_millis(100)).await;
                    }
                }
            }
        });
        Some(ControlSocket {
            path,
            file,
            stop: Some(stop),
            task: Some(task),
        })
    }

    /// Stop listening (after the request being answered, if any) and remove the socket.
    pub fn stop(mut self, rt: &Runtime) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(task) = self.task.take() {
            let _ = rt.block_on(task);
        }
    }
}

impl Drop for ControlSocket {
    fn drop(&mut self) {
        if let Some(task) = self.task.take() {
            task.abort();
        }
        let ours = std::fs::symlink_metadata(&self.path)
            .is_ok_and(|m| Some((m.dev(), m.ino())) == self.file);
        if ours {
            let _ = std::fs::remove_file(&self.path);
        }
    }
}

async fn answer(stream: tokio::net::UnixStream, image: &Image, location: &str) {
    let (read, mut write) = stream.into_split();
    let mut line = String::new();
    let reply = match tokio::time::timeout(
        Duration::from_secs(10),
        tokio::io::BufReader::new(tokio::io::AsyncReadExt::take(read, MAX_REQUEST))
            .read_line(&mut line),
    )
    .await
    {
        Ok(Ok(_)) => execute(&line, image, location).await,
        Ok(Err(e)) => json!({"error": format!("reading the request: {e}")}),
        Err(_) => json!({"error": "no request within 10 s"}),
    };
    send_reply(&mut write, &reply, REPLY_WITHIN).await;
}

/// How long a client has to take its answer. Requests are answered one at a time, and the
/// server's stop waits for the one being answered: a client that never read its answer held
/// every later request off, and the shutdown with its flush for ever.
const REPLY_WITHIN: Duration = Duration::from_secs(10);

/// Send `reply`; false if the client did not take it within `within`.
async fn send_reply<W: AsyncWriteExt + Unpin>(
    write: &mut W,
    reply: &Value,
    within: Duration,
) -> bool {
    let text = format!("{reply}\n");
    match tokio::time::timeout(within, write.write_all(text.as_bytes())).await {
        Ok(sent) => sent.is_ok(),
        Err(_) => {
            tracing::warn!("control socket: a client did not read its answer; dropped");
            false
        }
    }
}

/// A part of a request, for an answer: at most 200 characters (a request can be MiBs).
fn shown(value: &Value) -> String {
    let text = value.to_string();
    match text.char_indices().nth(200) {
        Some((at, _)) => format!("{}...", &text[..at]),
        None => text,
    }
}

async fn execute(line: &str, image: &Image, location: &str) -> Value {
    let request: Value = match serde_json::from_str(line) {
        Ok(request) => request,
        Err(e) => return json!({"error": format!("not a JSON request line: {e}")}),
    };
    if request["location"].as_str() != Some(location) {
        return json!({"error": format!(
            "this server serves {location}, not {}", shown(&request["location"])
        )});
    }
    match (request["command"].as_str(), request["snapshot"].as_str()) {
        (Some("snap-create"), Some(name)) => match image.create_snapshot(name).await {
            Ok(info) => {
                tracing::info!(snapshot = name, "snapshot created for `ivdisk snap create`");
                json!({"snapshot": snapshot_json(&info)})
            }
            Err(e) => json!({"error": e.to_string()}),
        },
        (Some("snap-rm"), Some(name)) => match image.remove_own_snapshot(name).await {
            Ok(()) => {
                tracing::info!(snapshot = name, "snapshot removed for `ivdisk snap rm`");
                json!({"removed": name})
            }
            Err(e) => json!({"error": e.to_string()}),
        },
        (Some("header-change"), None) => {
            let change = request["version"]
                .as_u64()
                .zip(header_ranges(&request["ranges"]));
            match change {
                Some((version, ranges)) => {
                    let made_from: Option<[u8; 32]> = request["made_from"]
                        .as_str()
                        .and_then(|h| hex::decode(h).ok())
                        .and_then(|d| d.try_into().ok());
                    match image
                        .apply_header_change(version, made_from.as_ref(), &ranges)
                        .await
                    {
                        Ok(()) => json!({"stored": true}),
                        Err(e) => json!({"error": e.to_string()}),
                    }
                }
                None => json!({"error": "a header change needs `version` and `ranges` \
                    ([[offset, hex bytes], ...])"}),
            }
        }
        (Some("ping"), None) => json!({"pid": std::process::id()}),
        _ => json!({"error": format!("unknown request: command {}", shown(&request["command"]))}),
    }
}

/// The process id of the `ivdisk serve` of this machine that holds the image at `uri` open
/// for writing, if one answers its control socket.
pub(crate) fn serving_process(uri: &ImageUri) -> Option<u64> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .ok()?;
    let reply = ask_the_server(uri, json!({"command": "ping"}), &rt)?.ok()?;
    reply["pid"].as_u64()
}

/// Whether `e` says another process holds the image open for writing (its writer lock; on
/// the local store, the store itself).
pub(crate) fn held_by_a_writer(e: &ImageError) -> bool {
    matches!(
        e,
        ImageError::Locked { .. }
            | ImageError::Store {
                source: StoreError::AlreadyOpen { .. },
                ..
            }
    )
}

/// `request` answered by the `ivdisk serve` of this machine that holds `uri` open for
/// writing, through its control socket (an `error` in the answer is an error here); `None` if
/// no such server answers.
pub(crate) fn ask_the_server(
    uri: &ImageUri,
    request: Value,
    rt: &Runtime,
) -> Option<Result<Value>> {
    let info = rt.block_on(Image::info(uri)).ok()?;
    let reply = match crate::control::request(&info.image_id, uri, request)? {
        Ok(reply) => reply,
        Err(e) => return Some(Err(e)),
    };
    tracing::debug!(%reply, "the server's answer");
    Some(match reply["error"].as_str() {
        Some(error) => Err(anyhow::anyhow!("{error}")),
        None => Ok(reply),
    })
}

/// The ranges of a `header-change` request: `[[offset, "hex"], ...]`.
fn header_ranges(ranges: &Value) -> Option<Vec<(u64, Vec<u8>)>> {
    ranges
        .as_array()?
        .iter()
        .map(|range| {
            let offset = range.get(0)?.as_u64()?;
            let bytes = hex::decode(range.get(1)?.as_str()?).ok()?;
            Some((offset, bytes))
        })
        .collect()
}

/// A `header-change` request for `change` (see the module's comment).
pub fn header_change_request(change: &ivdisk_image::HeaderChange) -> Option<Value> {
    let ranges: Vec<Value> = change
        .ranges()
        .iter()
        .map(|(offset, bytes)| json!([offset, hex::encode(bytes)]))
        .collect();
    Some(json!({
        "command": "header-change",
        "version": change.version()?,
        "made_from": hex::encode(change.made_from()),
        "ranges": ranges,
    }))
}

/// Send `request` (its `location` set here) to the server holding the image `image_id` at
/// `uri` open for writing on this machine. `None` if no server listens for it (none runs
/// here, or it died).
pub fn request(image_id: &ImageId, uri: &ImageUri, mut request: Value) -> Option<Result<Value>> {
    let location = location(uri)?;
    let (path, mut stream) = socket_paths(&socket_name(image_id, &location))
        .find_map(|path| UnixStream::connect(&path).ok().map(|s| (path, s)))?;
    request["location"] = location.into();
    Some(
        exchange(&mut stream, &request, ANSWER_LIMIT)
            .with_context(|| format!("asking the server at {}", path.display())),
    )
}

/// Where a control socket named `name` may be: in each private runtime directory.
fn socket_paths(name: &str) -> impl Iterator<Item = PathBuf> + '_ {
    runtime_dirs()
        .into_iter()
        .filter(|dir| is_private(dir))
        .map(move |dir| dir.join(name))
}

/// Remove the control socket a server of image `image_id` at `uri` left behind when it was
/// killed (nobody listens on it): after `ivdisk delete` no server of that image comes to
/// replace it, and such files would pile up in the runtime directory.
pub fn remove_stale(image_id: &ImageId, uri: &ImageUri) {
    let Some(location) = location(uri) else {
        return;
    };
    for path in socket_paths(&socket_name(image_id, &location)) {
        let refused = matches!(
            UnixStream::connect(&path),
            Err(e) if e.kind() == ErrorKind::ConnectionRefused
        );
        if refused && std::fs::remove_file(&path).is_ok() {
            tracing::debug!(path = %path.display(), "removed a dead server's control socket");
        }
    }
}

/// Send one request line on `stream` and read the answer line, waiting at most `limit`.
fn exchange(stream: &mut UnixStream, request: &Value, limit: Duration) -> Result<Value> {
    stream.set_read_timeout(Some(limit))?;
    stream.write_all(format!("{request}\n").as_bytes())?;
    let mut line = String::new();
    match BufReader::new(&*stream).read_line(&mut line) {
        Ok(_) => {}
        // The server works on: a snapshot it creates or removes (on a cluster that is slow
        // to answer) may still be made, so "failed" would be wrong, and a retry then found it.
        Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => bail!(
            "no answer within {limit:?}; the server may still carry the request out: check \
             the outcome (`ivdisk snap ls`) before trying again"
        ),
        Err(e) => return Err(e.into()),
    }
    serde_json::from_str(&line).map_err(|e| anyhow!("the server's answer {line:?}: {e}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A server that does not answer in time: the error says the request may still be carried
    /// out, not only "Resource temporarily unavailable" (read as a failure, and a retry found
    /// the snapshot made).
    #[test]
    fn a_late_answer_says_the_request_may_still_be_carried_out() {
        let (mut client, _server) = UnixStream::pair().unwrap();
        let request = serde_json::json!({"command": "snap-create", "snapshot": "s"});
        let err = exchange(&mut client, &request, Duration::from_millis(100)).unwrap_err();
        assert!(
            err.to_string().contains("may still carry the request out"),
            "{err:#}"
        );
    }

    /// A client that does not read its answer is dropped after a while: requests are answered
    /// one at a time and the server's stop waits for the one in hand, so such a client held
    /// off the shutdown (and its flush) for ever. Answers do not echo a request's MiBs.
    #[tokio::test]
    async fn a_client_that_reads_no_answer_is_dropped() {
        let (client, server) = tokio::net::UnixStream::pair().unwrap();
        let (_read, mut write) = server.into_split();
        let huge = json!({"error": "x".repeat(8 << 20)});
        let started = std::time::Instant::now();
        assert!(!send_reply(&mut write, &huge, Duration::from_millis(300)).await);
        assert!(started.elapsed() < Duration::from_secs(5));
        drop(client);
        let echoed = shown(&json!("y".repeat(1 << 20)));
        assert!(echoed.len() < 300, "{} bytes echoed", echoed.len());
    }

    /// Two clusters can each hold an image of the same pool, name and id (a restore keeps the
    /// id): their servers' sockets and locations differ by the configuration file.
    #[test]
    fn rados_locations_differ_by_cluster() {
        let a = ImageUri::parse("rados://rbd/vm1?conf=/etc/ceph/a.conf").unwrap();
        let b = ImageUri::parse("rados://rbd/vm1?conf=/etc/ceph/b.conf").unwrap();
        let again = ImageUri::parse("rados://rbd/vm1?id=admin&conf=/etc/ceph/a.conf").unwrap();
        assert_ne!(location(&a), location(&b));
        assert_eq!(location(&a), location(&again));
    }

    /// Without conf= or CEPH_CONF, the location names the file librados reads: one in HOME
    /// or the working directory when /etc/ceph has none.
    #[test]
    fn the_default_conf_is_the_one_librados_reads() {
        if Path::new("/etc/ceph/ceph.conf").exists() {
            eprintln!("SKIPPED: /etc/ceph/ceph.conf exists here, which librados reads first");
            return;
        }
        let (a, b) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
        std::fs::create_dir(a.path().join(".ceph")).unwrap();
        std::fs::write(a.path().join(".ceph/ceph.conf"), b"").unwrap();
        std::fs::write(b.path().join("ceph.conf"), b"").unwrap();
        assert_eq!(
            default_conf(Some(a.path()), b.path()),
            a.path().join(".ceph/ceph.conf")
        );
        assert_eq!(default_conf(None, b.path()), b.path().join("ceph.conf"));
        assert_eq!(
            default_conf(None, a.path()),
            PathBuf::from("/etc/ceph/ceph.conf")
        );
    }

    /// A control socket that stops removes its file only while the path still names it: a
    /// server that took the path over (after a `lock break`) keeps its socket.
    #[test]
    fn a_stopping_socket_leaves_a_successors_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("s.sock");
        let first = std::os::unix::net::UnixListener::bind(&path).unwrap();
        let meta = std::fs::symlink_metadata(&path).unwrap();
        let old = ControlSocket {
            path: path.clone(),
            file: Some((meta.dev(), meta.ino())),
            stop: None,
            task: None,
        };
        std::fs::remove_file(&path).unwrap();
        let _second = std::os::unix::net::UnixListener::bind(&path).unwrap();
        drop(old);
        assert!(path.exists(), "the successor's socket was removed");
        drop(first);
        let meta = std::fs::symlink_metadata(&path).unwrap();
        let own = ControlSocket {
            path: path.clone(),
            file: Some((meta.dev(), meta.ino())),
            stop: None,
            task: None,
        };
        drop(own);
        assert!(!path.exists(), "its own socket goes");
    }
}
