//! The server against a hand-written client over a real Unix socket, with an in-memory device
//! below it (the unit under test is the protocol, not the image). Covers the negotiation
//! options, every command, out-of-order replies, misbehaving clients, shutdown, and TLS
//! (certificates made by `scripts/tls-creds`, the client's side by OpenSSL).

use std::collections::HashSet;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use async_trait::async_trait;
use ivdisk_header::{PbkdfKind, PbkdfRequest};
use ivdisk_image::{CreateOptions, Image, ImageUri, LayoutKind, OpenOptions};
use ivdisk_nbd::proto::*;
use ivdisk_nbd::{
    serve_with_options, serve_with_tls, BlockDevice, DeviceError, DeviceErrorKind, Export, Extent,
    ListenAddress, Listener, NbdError, ServeOptions, ServeStats, TlsCredentials, TlsKind,
    MAX_PAYLOAD,
};
use openssl::ssl::{SslConnector, SslFiletype, SslMethod};
use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};
use tokio::net::UnixStream;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

const SIZE: u64 = 1 << 20;
const SLOW_OFFSET: u64 = 0x8000;
const BAD_OFFSET: u64 = 0x4000;

/// Memory with a slow spot (a read at SLOW_OFFSET waits until another read was served, 5 s
/// at most; a write there takes 300 ms), a bad sector (reads touching [BAD_OFFSET, +4096) fail
/// authentication) and a flush counter.
#[derive(Default)]
struct MemoryDevice {
    bytes: Mutex<Vec<u8>>,
    flushes: AtomicU64,
    /// Reads served (the slow read waits for one).
    served: AtomicU64,
    /// A write at SLOW_OFFSET has reached the device.
    slow_write_entered: AtomicBool,
    read_only: bool,
    /// 4 KiB blocks ever written, for block status.
    written: Mutex<HashSet<u64>>,
}

impl MemoryDevice {
    fn new(read_only: bool) -> Arc<Self> {
        Arc::new(MemoryDevice {
            bytes: Mutex::new(vec![0u8; SIZE as usize]),
            read_only,
            ..Default::default()
        })
    }
}

#[async_trait]
impl BlockDevice for MemoryDevice {
    fn size(&self) -> u64 {
        SIZE
    }
    fn read_only(&self) -> bool {
        self.read_only
    }
    async fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), DeviceError> {
        if offset == SLOW_OFFSET {
            // Overtaken for sure, however slow the machine: only a server that answers in
            // order waits here the whole time (and then fails the test that relies on this).
            let before = self.served.load(Ordering::SeqCst);
            let started = std::time::Instant::now();
            while self.served.load(Ordering::SeqCst) == before
                && started.elapsed() < Duration::from_secs(5)
            {
                tokio::time::sleep(Duration::from_millis(2)).await;
            }
            // (And for its reply to be sent.)
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        let end = offset + buf.len() as u64;
        if offset < BAD_OFFSET + 4096 && end > BAD_OFFSET {
            return Err(DeviceError::new(
                DeviceErrorKind::Integrity { offset: BAD_OFFSET },
                "sector 4 failed authentication",
            ));
        }
        buf.copy_from_slice(&self.bytes.lock().unwrap()[offset as usize..end as usize]);
        self.served.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
    async fn write(&self, offset: u64, data: &[u8]) -> Result<(), DeviceError> {
        if offset == SLOW_OFFSET {
            self.slow_write_entered.store(true, Ordering::SeqCst);
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        self.bytes.lock().unwrap()[offset as usize..offset as usize + data.len()]
            .copy_from_slice(data);
        let mut written = self.written.lock().unwrap();
        for block in offset / 4096..(offset + data.len() as u64).div_ceil(4096) {
            written.insert(block);
        }
        Ok(())
    }
    async fn flush(&self) -> Result<(), DeviceError> {
        self.flushes.fetch_add(1, Ordering::SeqCst);
        Ok(())
    }
    async fn allocation(&self, offset: u64, len: u64) -> Result<Vec<Extent>, DeviceError> {
        let written = self.written.lock().unwrap();
        let mut out: Vec<Extent> = Vec::new();
        let mut at = offset;
        while at < offset + len {
            let stop = ((at / 4096 + 1) * 4096).min(offset + len);
            let allocated = written.contains(&(at / 4096));
            match out.last_mut() {
                Some(last) if last.allocated == allocated => last.len += stop - at,
                _ => out.push(Extent {
                    len: stop - at,
                    allocated,
                }),
            }
            at = stop;
        }
        Ok(out)
    }
}

struct Server {
    path: PathBuf,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<ServeStats>,
    _dir: tempfile::TempDir,
}

impl Server {
    async fn start(device: Arc<dyn BlockDevice>) -> Server {
        Server::start_with(device, None).await
    }

    async fn start_with(device: Arc<dyn BlockDevice>, tls: Option<TlsCredentials>) -> Server {
        let exports = vec![Export {
            name: "disk".into(),
            description: "test disk".into(),
            device,
        }];
        Server::start_exports(exports, tls).await
    }

    async fn start_exports(exports: Vec<Export>, tls: Option<TlsCredentials>) -> Server {
        let options = ServeOptions {
            tls,
            ..ServeOptions::default()
        };
        Server::start_with_options(exports, options).await
    }

    /// A server that closes connections stalled in others' way after `stall`.
    async fn start_stalling(device: Arc<dyn BlockDevice>, stall: Duration) -> Server {
        let exports = vec![Export {
            name: "disk".into(),
            description: "test disk".into(),
            device,
        }];
        let options = ServeOptions {
            tls: None,
            stall_timeout: stall,
        };
        Server::start_with_options(exports, options).await
    }

    async fn start_with_options(exports: Vec<Export>, options: ServeOptions) -> Server {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("nbd.sock");
        let listener = Listener::bind(&ListenAddress::Unix(path.clone()))
            .await
            .unwrap();
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(async move {
            serve_with_options(listener, exports, options, async {
                let _ = stopped.await;
            })
            .await
            .unwrap()
        });
        Server {
            path,
            stop: Some(stop),
            task,
            _dir: dir,
        }
    }

    async fn stop(mut self) -> ServeStats {
        self.stop.take().unwrap().send(()).unwrap();
        tokio::time::timeout(Duration::from_secs(10), &mut self.task)
            .await
            .expect("server stops")
            .unwrap()
    }
}

/// A client's connection: a socket, or TLS over one.
trait Connection: AsyncRead + AsyncWrite + Unpin + Send {}
impl<T: AsyncRead + AsyncWrite + Unpin + Send> Connection for T {}

/// A hand-written client, one step at a time.
struct Client {
    stream: Box<dyn Connection>,
}

#[derive(Debug)]
struct OptionReply {
    option: u32,
    kind: u32,
    data: Vec<u8>,
}

#[derive(Debug, PartialEq)]
enum Chunk {
    Simple {
        cookie: u64,
        error: u32,
    },
    Structured {
        flags: u16,
        kind: u16,
        cookie: u64,
        payload: Vec<u8>,
    },
}

impl Client {
    async fn connect(server: &Server) -> Client {
        let mut stream = UnixStream::connect(&server.path).await.unwrap();
        assert_eq!(stream.read_u64().await.unwrap(), NBDMAGIC);
        assert_eq!(stream.read_u64().await.unwrap(), IHAVEOPT);
        let flags = stream.read_u16().await.unwrap();
        assert_eq!(flags, FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES);
        stream
            .write_u32(CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES)
            .await
            .unwrap();
        Client {
            stream: Box::new(stream),
        }
    }

    /// `NBD_OPT_STARTTLS`, then the TLS handshake as a client holding `creds`' certificate
    /// (`ca-cert.pem`, and `client-cert.pem` with `client-key.pem` where present), checking
    /// the server's certificate against `localhost`.
    async fn start_tls(mut self, creds: &Path) -> Result<Client, String> {
        self.option(OPT_STARTTLS, &[]).await;
        let reply = self.option_reply().await;
        assert_eq!((reply.option, reply.kind), (OPT_STARTTLS, REP_ACK));
        let mut connector = SslConnector::builder(SslMethod::tls_client()).unwrap();
        connector.set_ca_file(creds.join("ca-cert.pem")).unwrap();
        if creds.join("client-cert.pem").exists() {
            connector
                .set_certificate_chain_file(creds.join("client-cert.pem"))
                .unwrap();
            connector
                .set_private_key_file(creds.join("client-key.pem"), SslFiletype::PEM)
                .unwrap();
        }
        let ssl = connector
            .build()
            .configure()
            .unwrap()
            .into_ssl("localhost")
            .unwrap();
        let mut tls = tokio_openssl::SslStream::new(ssl, self.stream).unwrap();
        Pin::new(&mut tls)
            .connect()
            .await
            .map_err(|e| e.to_string())?;
        // TLS 1.3 reports a refused client certificate only with the server's first record:
        // make sure there is one (a harmless option) before calling the handshake done.
        let mut client = Client {
            stream: Box::new(tls),
        };
        client.option(OPT_LIST, &[]).await;
        let mut byte = [0u8; 8];
        match client.stream.read_exact(&mut byte).await {
            Ok(_) => assert_eq!(u64::from_be_bytes(byte), OPTION_REPLY_MAGIC),
            Err(e) => return Err(e.to_string()),
        }
        let mut rest = [0u8; 12];
        client.stream.read_exact(&mut rest).await.unwrap();
        let len = u32::from_be_bytes(rest[8..12].try_into().unwrap());
        let mut data = vec![0u8; len as usize];
        client.stream.read_exact(&mut data).await.unwrap();
        let kind = u32::from_be_bytes(rest[4..8].try_into().unwrap());
        if kind == REP_SERVER {
            assert_eq!(client.option_reply().await.kind, REP_ACK);
        }
        Ok(client)
    }

    async fn option(&mut self, option: u32, data: &[u8]) {
        let mut frame = IHAVEOPT.to_be_bytes().to_vec();
        frame.extend_from_slice(&option.to_be_bytes());
        frame.extend_from_slice(&(data.len() as u32).to_be_bytes());
        frame.extend_from_slice(data);
        self.stream.write_all(&frame).await.unwrap();
    }

    async fn option_reply(&mut self) -> OptionReply {
        assert_eq!(self.stream.read_u64().await.unwrap(), OPTION_REPLY_MAGIC);
        let option = self.stream.read_u32().await.unwrap();
        let kind = self.stream.read_u32().await.unwrap();
        let len = self.stream.read_u32().await.unwrap();
        let mut data = vec![0u8; len as usize];
        self.stream.read_exact(&mut data).await.unwrap();
        OptionReply { option, kind, data }
    }

    /// Replies to one option up to and including the final one (ACK or an error).
    async fn option_replies(&mut self) -> Vec<OptionReply> {
        let mut out = Vec::new();
        loop {
            let reply = self.option_reply().await;
            let last = reply.kind == REP_ACK || reply.kind & (1 << 31) != 0;
            out.push(reply);
            if last {
                return out;
            }
        }
    }

    fn name_request(name: &str, tail: &[u8]) -> Vec<u8> {
        let mut data = (name.len() as u32).to_be_bytes().to_vec();
        data.extend_from_slice(name.as_bytes());
        data.extend_from_slice(tail);
        data
    }

    async fn structured(&mut self) {
        self.option(OPT_STRUCTURED_REPLY, &[]).await;
        assert_eq!(self.option_reply().await.kind, REP_ACK);
    }

    async fn set_meta(&mut self, name: &str) -> Vec<OptionReply> {
        let mut queries = 1u32.to_be_bytes().to_vec();
        queries.extend_from_slice(&(BASE_ALLOCATION.len() as u32).to_be_bytes());
        queries.extend_from_slice(BASE_ALLOCATION.as_bytes());
        self.option(OPT_SET_META_CONTEXT, &Client::name_request(name, &queries))
            .await;
        self.option_replies().await
    }

    /// NBD_OPT_GO; returns (size, transmission flags).
    async fn go(&mut self, name: &str) -> (u64, u16) {
        self.option(OPT_GO, &Client::name_request(name, &0u16.to_be_bytes()))
            .await;
        let replies = self.option_replies().await;
        assert_eq!(replies.last().unwrap().kind, REP_ACK, "{replies:?}");
        let export = replies
            .iter()
            .find(|r| r.kind == REP_INFO && r.data[0..2] == INFO_EXPORT.to_be_bytes())
            .expect("NBD_INFO_EXPORT");
        (
            u64::from_be_bytes(export.data[2..10].try_into().unwrap()),
            u16::from_be_bytes(export.data[10..12].try_into().unwrap()),
        )
    }

    async fn attach(server: &Server, structured: bool) -> Client {
        let mut client = Client::connect(server).await;
        if structured {
            client.structured().await;
            let replies = client.set_meta("disk").await;
            assert_eq!(replies[0].kind, REP_META_CONTEXT);
        }
        client.go("disk").await;
        client
    }

    async fn send(&mut self, command: u16, flags: u16, cookie: u64, offset: u64, length: u32) {
        let request = Request {
            flags,
            command,
            cookie,
            offset,
            length,
        };
        self.stream.write_all(&request.encode()).await.unwrap();
    }

    async fn write(&mut self, cookie: u64, offset: u64, data: &[u8], flags: u16) {
        self.send(CMD_WRITE, flags, cookie, offset, data.len() as u32)
            .await;
        self.stream.write_all(data).await.unwrap();
    }

    /// Next reply; for simple read replies pass the expected data length.
    async fn reply(&mut self, simple_read_len: usize) -> (Chunk, Vec<u8>) {
        let magic = self.stream.read_u32().await.unwrap();
        if magic == SIMPLE_REPLY_MAGIC {
            let error = self.stream.read_u32().await.unwrap();
            let cookie = self.stream.read_u64().await.unwrap();
            let mut data = vec![0u8; if error == 0 { simple_read_len } else { 0 }];
            self.stream.read_exact(&mut data).await.unwrap();
            return (Chunk::Simple { cookie, error }, data);
        }
        assert_eq!(magic, STRUCTURED_REPLY_MAGIC);
        let flags = self.stream.read_u16().await.unwrap();
        let kind = self.stream.read_u16().await.unwrap();
        let cookie = self.stream.read_u64().await.unwrap();
        let len = self.stream.read_u32().await.unwrap();
        let mut payload = vec![0u8; len as usize];
        self.stream.read_exact(&mut payload).await.unwrap();
        (
            Chunk::Structured {
                flags,
                kind,
                cookie,
                payload,
            },
            Vec::new(),
        )
    }

    /// The error number of a final reply (0 = success).
    async fn status(&mut self) -> (u64, u32) {
        match self.reply(0).await.0 {
            Chunk::Simple { cookie, error } => (cookie, error),
            Chunk::Structured {
                flags,
                kind,
                cookie,
                payload,
            } => {
                assert_eq!(flags & REPLY_FLAG_DONE, REPLY_FLAG_DONE);
                if kind & (1 << 15) != 0 {
                    (
                        cookie,
                        u32::from_be_bytes(payload[0..4].try_into().unwrap()),
                    )
                } else {
                    (cookie, 0)
                }
            }
        }
    }

    async fn closed(&mut self) -> bool {
        let mut byte = [0u8; 1];
        matches!(
            tokio::time::timeout(Duration::from_secs(5), self.stream.read(&mut byte)).await,
            Ok(Ok(0)) | Ok(Err(_))
        )
    }
}

fn pattern(len: usize, seed: u8) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed)
        .collect()
}

/// A block-status chunk's descriptors (after its context id): (length, flags).
fn descriptors(payload: &[u8]) -> Vec<(u32, u32)> {
    payload[4..]
        .chunks(8)
        .map(|d| {
            (
                u32::from_be_bytes(d[0..4].try_into().unwrap()),
                u32::from_be_bytes(d[4..8].try_into().unwrap()),
            )
        })
        .collect()
}

#[tokio::test]
async fn negotiation_lists_informs_and_refuses_unknown_things() {
    let server = Server::start(MemoryDevice::new(false)).await;
    let mut client = Client::connect(&server).await;

    client.option(OPT_LIST, &[]).await;
    let replies = client.option_replies().await;
    assert_eq!(replies[0].kind, REP_SERVER);
    assert_eq!(&replies[0].data[4..8], b"disk");
    assert_eq!(replies.last().unwrap().kind, REP_ACK);

    // Metadata contexts need structured replies first.
    let replies = client.set_meta("disk").await;
    assert_eq!(replies[0].kind, REP_ERR_INVALID);

    // Unknown options and unknown exports get errors, and the session goes on.
    client.option(99, b"whatever").await;
    let reply = client.option_reply().await;
    assert_eq!((reply.option, reply.kind), (99, REP_ERR_UNSUP));
    client
        .option(OPT_INFO, &Client::name_request("nope", &0u16.to_be_bytes()))
        .await;
    assert_eq!(client.option_reply().await.kind, REP_ERR_UNKNOWN);
    // The name a client chose is escaped in the message (which the server also logs): no
    // raw control characters to forge log lines or drive a terminal.
    client
        .option(
            OPT_INFO,
            &Client::name_request("a\nFORGED \x1b[2J", &0u16.to_be_bytes()),
        )
        .await;
    let reply = client.option_reply().await;
    assert_eq!(reply.kind, REP_ERR_UNKNOWN);
    let text = String::from_utf8_lossy(&reply.data).into_owned();
    assert!(
        text.contains("FORGED") && !text.chars().any(|c| c.is_control()),
        "{text:?}"
    );
    // A malformed INFO (name length past the data) is refused, not misread.
    client.option(OPT_INFO, &[0, 0, 0, 200, b'd']).await;
    assert_eq!(client.option_reply().await.kind, REP_ERR_INVALID);

    // INFO with block sizes: minimum 1, preferred 4096, maximum 32 MiB.
    client
        .option(
            OPT_INFO,
            &Client::name_request(
                "disk",
                &[0, 2, 0, INFO_BLOCK_SIZE as u8, 0, INFO_NAME as u8],
            ),
        )
        .await;
    let replies = client.option_replies().await;
    let block = replies
        .iter()
        .find(|r| r.kind == REP_INFO && r.data[0..2] == INFO_BLOCK_SIZE.to_be_bytes())
        .expect("block size info");
    assert_eq!(&block.data[2..6], &1u32.to_be_bytes());
    assert_eq!(&block.data[6..10], &4096u32.to_be_bytes());
    assert_eq!(&block.data[10..14], &MAX_PAYLOAD.to_be_bytes());
    assert!(replies
        .iter()
        .any(|r| r.kind == REP_INFO && r.data[..] == [&[0u8, 1][..], b"disk"].concat()));

    // "" names the default export.
    client.structured().await;
    // Listing metadata contexts (no query: all) names base:allocation with the reserved id
    // zero; only setting one gives it an id.
    client
        .option(
            OPT_LIST_META_CONTEXT,
            &Client::name_request("disk", &0u32.to_be_bytes()),
        )
        .await;
    let replies = client.option_replies().await;
    assert_eq!(replies[0].kind, REP_META_CONTEXT);
    assert_eq!(&replies[0].data[..4], &[0, 0, 0, 0]);
    assert_eq!(&replies[0].data[4..], BASE_ALLOCATION.as_bytes());
    let replies = client.set_meta("disk").await;
    assert_eq!(replies[0].kind, REP_META_CONTEXT);
    assert_ne!(&replies[0].data[..4], &[0, 0, 0, 0]);
    let (size, flags) = client.go("").await;
    assert_eq!(size, SIZE);
    for flag in [
        TF_HAS_FLAGS,
        TF_SEND_FLUSH,
        TF_SEND_FUA,
        TF_SEND_TRIM,
        TF_SEND_WRITE_ZEROES,
        TF_CAN_MULTI_CONN,
        TF_SEND_DF,
    ] {
        assert_eq!(flags & flag, flag, "flag {flag:#x} missing");
    }
    assert_eq!(flags & TF_READ_ONLY, 0);
    client.send(CMD_DISC, 0, 1, 0, 0).await;
    assert!(client.closed().await);
    server.stop().await;
}

#[tokio::test]
async fn export_name_option_and_abort() {
    let server = Server::start(MemoryDevice::new(true)).await;
    let mut client = Client::connect(&server).await;
    client.option(OPT_EXPORT_NAME, b"disk").await;
    let size = client.stream.read_u64().await.unwrap();
    let flags = client.stream.read_u16().await.unwrap();
    assert_eq!(size, SIZE);
    assert_eq!(flags & TF_READ_ONLY, TF_READ_ONLY);
    // Simple replies: a read brings its data right after the header.
    client.send(CMD_READ, 0, 5, 0, 512).await;
    let (chunk, data) = client.reply(512).await;
    assert_eq!(
        chunk,
        Chunk::Simple {
            cookie: 5,
            error: 0
        }
    );
    assert_eq!(data, vec![0u8; 512]);
    // Writes on a read-only export: EPERM, and the payload is consumed (stream stays in sync).
    client.write(6, 0, &[1u8; 4096], 0).await;
    assert_eq!(client.status().await, (6, Errno::Perm as u32));
    client.send(CMD_TRIM, 0, 7, 0, 4096).await;
    assert_eq!(client.status().await, (7, Errno::Perm as u32));

    let mut other = Client::connect(&server).await;
    other.option(OPT_ABORT, &[]).await;
    assert_eq!(other.option_reply().await.kind, REP_ACK);
    assert!(other.closed().await);
    // An unknown name with EXPORT_NAME can only be answered by closing.
    let mut third = Client::connect(&server).await;
    third.option(OPT_EXPORT_NAME, b"nope").await;
    assert!(third.closed().await);
    server.stop().await;
}

/// An export named "" is the one "" asks for; the first export is the default only where no
/// export has that name. "" reached the first export, and the one named "" never.
#[tokio::test]
async fn an_export_named_empty_is_reached_by_the_empty_name() {
    let export = |name: &str, read_only| Export {
        name: name.into(),
        description: String::new(),
        device: MemoryDevice::new(read_only),
    };
    let both = vec![export("disk", false), export("", true)];
    let server = Server::start_exports(both, None).await;
    let mut client = Client::connect(&server).await;
    let (_, flags) = client.go("").await;
    assert_eq!(flags & TF_READ_ONLY, TF_READ_ONLY, "\"\" reached \"disk\"");
    let mut client = Client::connect(&server).await;
    let (_, flags) = client.go("disk").await;
    assert_eq!(flags & TF_READ_ONLY, 0);
    server.stop().await;
    // Without one named "", the first.
    let server = Server::start_exports(vec![export("disk", true)], None).await;
    let mut client = Client::connect(&server).await;
    let (_, flags) = client.go("").await;
    assert_eq!(flags & TF_READ_ONLY, TF_READ_ONLY);
    server.stop().await;
}

#[tokio::test]
async fn commands_do_what_they_say() {
    let device = MemoryDevice::new(false);
    let server = Server::start(device.clone()).await;
    let mut client = Client::attach(&server, true).await;
    let data = pattern(8192, 3);

    client.write(1, 65536, &data, CMD_FLAG_FUA).await;
    assert_eq!(client.status().await, (1, 0));
    assert_eq!(device.flushes.load(Ordering::SeqCst), 1, "FUA flushes");

    client.send(CMD_READ, CMD_FLAG_DF, 2, 65536, 8192).await;
    let (chunk, _) = client.reply(0).await;
    let Chunk::Structured {
        flags,
        kind,
        cookie,
        payload,
    } = chunk
    else {
        panic!()
    };
    assert_eq!(
        (flags, kind, cookie),
        (REPLY_FLAG_DONE, REPLY_TYPE_OFFSET_DATA, 2)
    );
    assert_eq!(&payload[0..8], &65536u64.to_be_bytes());
    assert_eq!(&payload[8..], &data[..]);

    client.send(CMD_FLUSH, 0, 3, 0, 0).await;
    assert_eq!(client.status().await, (3, 0));
    assert_eq!(device.flushes.load(Ordering::SeqCst), 2);

    // Block status: written blocks are data, the rest holes that read as zeros.
    client.send(CMD_BLOCK_STATUS, 0, 4, 61440, 16384).await;
    let Chunk::Structured { kind, payload, .. } = client.reply(0).await.0 else {
        panic!()
    };
    assert_eq!(kind, REPLY_TYPE_BLOCK_STATUS);
    assert_eq!(&payload[0..4], &BASE_ALLOCATION_ID.to_be_bytes());
    let descriptors = descriptors(&payload);
    assert_eq!(
        descriptors,
        vec![
            (4096, STATE_HOLE | STATE_ZERO),
            (8192, 0),
            (4096, STATE_HOLE | STATE_ZERO)
        ]
    );
    client
        .send(CMD_BLOCK_STATUS, CMD_FLAG_REQ_ONE, 5, 61440, 16384)
        .await;
    let Chunk::Structured { payload, .. } = client.reply(0).await.0 else {
        panic!()
    };
    assert_eq!(payload.len(), 12, "REQ_ONE: one descriptor");
    // FUA is valid on every command once NBD_FLAG_SEND_FUA is advertised, even where it has
    // nothing to persist.
    client
        .send(
            CMD_BLOCK_STATUS,
            CMD_FLAG_REQ_ONE | CMD_FLAG_FUA,
            51,
            61440,
            4096,
        )
        .await;
    let Chunk::Structured { kind, payload, .. } = client.reply(0).await.0 else {
        panic!("block status with FUA")
    };
    assert_eq!(kind, REPLY_TYPE_BLOCK_STATUS, "block status with FUA");
    assert_eq!(payload.len(), 12, "block status with FUA: one descriptor");

    // Write-zeroes: with FAST_ZERO and NO_HOLE the default device says "not fast".
    client
        .send(
            CMD_WRITE_ZEROES,
            CMD_FLAG_NO_HOLE | CMD_FLAG_FAST_ZERO,
            6,
            65536,
            4096,
        )
        .await;
    assert_eq!(client.status().await, (6, Errno::NotSup as u32));
    client
        .send(CMD_WRITE_ZEROES, CMD_FLAG_NO_HOLE, 7, 65536, 4096)
        .await;
    assert_eq!(client.status().await, (7, 0));
    client.send(CMD_TRIM, 0, 8, 69632, 4096).await;
    assert_eq!(client.status().await, (8, 0));
    assert!(device.bytes.lock().unwrap()[65536..73728]
        .iter()
        .all(|&b| b == 0));

    // Out of range: EINVAL for reads, ENOSPC for writes; unknown commands and flags: EINVAL.
    client.send(CMD_READ, 0, 9, SIZE - 512, 1024).await;
    assert_eq!(client.status().await, (9, Errno::Inval as u32));
    client.write(10, SIZE - 512, &[7u8; 1024], 0).await;
    assert_eq!(client.status().await, (10, Errno::NoSpc as u32));
    client.send(CMD_READ, 0, 11, u64::MAX - 10, 512).await;
    assert_eq!(client.status().await, (11, Errno::Inval as u32));
    client.send(42, 0, 12, 0, 0).await;
    assert_eq!(client.status().await, (12, Errno::Inval as u32));
    client.send(CMD_FLUSH, 1 << 9, 13, 0, 0).await;
    assert_eq!(client.status().await, (13, Errno::Inval as u32));
    // A read over the maximum payload is refused, and the connection goes on.
    client.send(CMD_READ, 0, 14, 0, MAX_PAYLOAD + 1).await;
    assert_eq!(client.status().await, (14, Errno::Inval as u32));
    client.send(CMD_FLUSH, 0, 15, 0, 0).await;
    assert_eq!(client.status().await, (15, 0));
    server.stop().await;
}

#[tokio::test]
async fn a_bad_sector_fails_only_its_request() {
    let server = Server::start(MemoryDevice::new(false)).await;
    let mut client = Client::attach(&server, true).await;
    client.send(CMD_READ, 0, 1, BAD_OFFSET - 4096, 12288).await;
    let Chunk::Structured {
        flags,
        kind,
        cookie,
        payload,
    } = client.reply(0).await.0
    else {
        panic!()
    };
    assert_eq!(
        (flags, kind, cookie),
        (REPLY_FLAG_DONE, REPLY_TYPE_ERROR_OFFSET, 1)
    );
    assert_eq!(&payload[0..4], &(Errno::Io as u32).to_be_bytes());
    let message_len = u16::from_be_bytes(payload[4..6].try_into().unwrap()) as usize;
    assert!(std::str::from_utf8(&payload[6..6 + message_len])
        .unwrap()
        .contains("authentication"));
    assert_eq!(&payload[6 + message_len..], &BAD_OFFSET.to_be_bytes());
    // The neighbours read fine, on the same connection.
    client.send(CMD_READ, 0, 2, BAD_OFFSET + 4096, 4096).await;
    assert_eq!(client.status().await, (2, 0));

    // Without structured replies the error is a simple reply with EIO and no data.
    let mut simple = Client::attach(&server, false).await;
    simple.send(CMD_READ, 0, 3, BAD_OFFSET, 4096).await;
    assert_eq!(
        simple.reply(4096).await.0,
        Chunk::Simple {
            cookie: 3,
            error: Errno::Io as u32
        }
    );
    simple.send(CMD_READ, 0, 4, 0, 4096).await;
    assert_eq!(
        simple.reply(4096).await.0,
        Chunk::Simple {
            cookie: 4,
            error: 0
        }
    );
    server.stop().await;
}

#[tokio::test]
async fn replies_come_back_out_of_order() {
    let server = Server::start(MemoryDevice::new(false)).await;
    let mut client = Client::attach(&server, true).await;
    client.send(CMD_READ, 0, 1, SLOW_OFFSET, 4096).await;
    client.send(CMD_READ, 0, 2, 0, 4096).await;
    assert_eq!(
        client.status().await.0,
        2,
        "the fast read overtakes the slow one"
    );
    assert_eq!(client.status().await.0, 1);
    server.stop().await;
}

#[tokio::test]
async fn misbehaving_clients_are_cut_off_and_others_carry_on() {
    let device = MemoryDevice::new(false);
    let server = Server::start(device.clone()).await;
    let mut good = Client::attach(&server, true).await;

    // Bad request magic.
    let mut bad = Client::attach(&server, true).await;
    bad.stream
        .write_all(&[0xde; REQUEST_HEADER_LEN])
        .await
        .unwrap();
    assert!(bad.closed().await);

    // A write over the maximum payload.
    let mut big = Client::attach(&server, true).await;
    big.send(CMD_WRITE, 0, 1, 0, MAX_PAYLOAD + 4096).await;
    assert!(big.closed().await);

    // Gone in the middle of a write's payload.
    let mut quitter = Client::attach(&server, true).await;
    quitter.send(CMD_WRITE, 0, 1, 0, 8192).await;
    quitter.stream.write_all(&[9u8; 100]).await.unwrap();
    drop(quitter);

    // Bad option magic during negotiation, and an oversized option.
    let mut early = Client::connect(&server).await;
    early.stream.write_all(&[0u8; 16]).await.unwrap();
    assert!(early.closed().await);
    let mut huge = Client::connect(&server).await;
    huge.stream
        .write_all(&IHAVEOPT.to_be_bytes())
        .await
        .unwrap();
    huge.stream.write_all(&OPT_GO.to_be_bytes()).await.unwrap();
    huge.stream
        .write_all(&u32::MAX.to_be_bytes())
        .await
        .unwrap();
    assert_eq!(huge.option_reply().await.kind, REP_ERR_TOO_BIG);
    assert!(huge.closed().await);
    // An oversized `NBD_OPT_EXPORT_NAME`, which has no option replies: closed, nothing sent
    // (a reply would be read as the export's size and flags).
    let mut huge_name = Client::connect(&server).await;
    let mut option = IHAVEOPT.to_be_bytes().to_vec();
    option.extend_from_slice(&OPT_EXPORT_NAME.to_be_bytes());
    option.extend_from_slice(&70_000u32.to_be_bytes());
    huge_name.stream.write_all(&option).await.unwrap();
    let mut rest = Vec::new();
    let read = tokio::time::timeout(
        Duration::from_secs(5),
        huge_name.stream.read_to_end(&mut rest),
    )
    .await
    .expect("the connection was closed");
    assert!(read.is_err() || rest.is_empty(), "sent {rest:?}");
    // Unknown client flags.
    let mut stream = UnixStream::connect(&server.path).await.unwrap();
    let mut greeting = [0u8; 18];
    stream.read_exact(&mut greeting).await.unwrap();
    stream.write_u32(0xff).await.unwrap();
    let mut client = Client {
        stream: Box::new(stream),
    };
    assert!(client.closed().await);

    // The well-behaved client never noticed, and the partial write was not applied.
    let data = pattern(4096, 9);
    good.write(1, 0, &data, 0).await;
    assert_eq!(good.status().await, (1, 0));
    good.send(CMD_READ, 0, 2, 0, 4096).await;
    let Chunk::Structured { payload, .. } = good.reply(0).await.0 else {
        panic!()
    };
    assert_eq!(&payload[8..], &data[..]);
    let stats = server.stop().await;
    assert!(stats.protocol_errors >= 5, "{stats:?}");
}

#[tokio::test]
async fn shutdown_finishes_requests_in_flight() {
    let device = MemoryDevice::new(false);
    let server = Server::start(device.clone()).await;
    let mut client = Client::attach(&server, true).await;
    let data = pattern(4096, 5);
    client.write(1, SLOW_OFFSET, &data, 0).await;
    // Let the request reach the device, then stop the server while it sleeps there.
    while !device.slow_write_entered.load(Ordering::SeqCst) {
        tokio::time::sleep(Duration::from_millis(2)).await;
    }
    let path = server.path.clone();
    let stats = server.stop().await;
    assert_eq!(stats.connections, 1);
    assert_eq!(
        client.status().await,
        (1, 0),
        "the write in flight was answered"
    );
    assert!(client.closed().await);
    assert_eq!(
        &device.bytes.lock().unwrap()[SLOW_OFFSET as usize..][..4096],
        &data[..]
    );
    assert!(!path.exists(), "the socket file is removed");
}

/// A device that counts the bytes being zeroed at once, zeroes by unmapping only when
/// allowed, and panics on a read at `PANIC_OFFSET` (a bug below the server).
#[derive(Default)]
struct ProbeDevice {
    zeroing: AtomicU64,
    peak: AtomicU64,
    /// Set: no zeroing is fast, unmapping or not (librbd under LUKS writes encrypted zeros
    /// for a discard too).
    never_fast: std::sync::atomic::AtomicBool,
    /// The longest range `allocation` was asked about.
    allocation_asked: AtomicU64,
    /// How many times `allocation` was called.
    allocation_calls: AtomicU64,
    /// Reads at `GATED_OFFSET` wait until the gate opens, then fail (they hold the server's
    /// budget meanwhile, and no memory); `gated` counts those that reached the device.
    gate: tokio::sync::Notify,
    gate_opened: AtomicBool,
    gated: AtomicU64,
}

const GATED_OFFSET: u64 = 4096;

const PANIC_OFFSET: u64 = 1 << 20;

#[async_trait]
impl BlockDevice for ProbeDevice {
    fn size(&self) -> u64 {
        1 << 40
    }
    async fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), DeviceError> {
        assert_ne!(offset, PANIC_OFFSET, "a bug in the device");
        if offset == GATED_OFFSET {
            self.gated.fetch_add(1, Ordering::SeqCst);
            loop {
                let opened = self.gate.notified();
                if self.gate_opened.load(Ordering::SeqCst) {
                    return Err(DeviceError::new(DeviceErrorKind::Io, "the gate opened"));
                }
                opened.await;
            }
        }
        buf.fill(0);
        Ok(())
    }
    async fn write(&self, _: u64, _: &[u8]) -> Result<(), DeviceError> {
        Ok(())
    }
    async fn flush(&self) -> Result<(), DeviceError> {
        Ok(())
    }
    async fn write_zeroes(&self, _: u64, len: u64, _: bool) -> Result<(), DeviceError> {
        let now = self.zeroing.fetch_add(len, Ordering::SeqCst) + len;
        self.peak.fetch_max(now, Ordering::SeqCst);
        tokio::time::sleep(Duration::from_millis(50)).await;
        self.zeroing.fetch_sub(len, Ordering::SeqCst);
        Ok(())
    }
    fn fast_zero(&self, may_unmap: bool) -> bool {
        may_unmap && !self.never_fast.load(Ordering::SeqCst)
    }
    /// Data and holes alternating every 4 KiB (an image of 4 KiB objects, every other one
    /// written): one extent per 4 KiB.
    async fn allocation(&self, offset: u64, len: u64) -> Result<Vec<Extent>, DeviceError> {
        self.allocation_asked.fetch_max(len, Ordering::SeqCst);
        self.allocation_calls.fetch_add(1, Ordering::SeqCst);
        let mut out = Vec::new();
        let mut at = offset;
        while at < offset + len {
            let stop = ((at / 4096 + 1) * 4096).min(offset + len);
            out.push(Extent {
                len: stop - at,
                allocated: (at / 4096).is_multiple_of(2),
            });
            at = stop;
        }
        Ok(out)
    }
}

/// One block-status request of nearly 4 GiB on a fragmented device: the device is asked
/// about at most 1 GiB and the reply holds at most 2^16 descriptors (it may cover less than
/// asked; the client asks again for the rest). Before, the whole range went to the device
/// and the reply held a million descriptors, for one unit of the client's budget.
#[tokio::test]
async fn block_status_replies_are_bounded() {
    let device = Arc::new(ProbeDevice::default());
    let server = Server::start(device.clone()).await;
    let mut client = Client::attach(&server, true).await;
    client.send(CMD_BLOCK_STATUS, 0, 1, 8192, 0xFFFF_F000).await;
    let Chunk::Structured { kind, payload, .. } = client.reply(0).await.0 else {
        panic!("a structured reply")
    };
    assert_eq!(kind, REPLY_TYPE_BLOCK_STATUS);
    let descriptors = descriptors(&payload);
    assert!(
        !descriptors.is_empty() && descriptors.len() <= 1 << 16,
        "{}",
        descriptors.len()
    );
    assert!(descriptors.iter().all(|&(len, _)| len == 4096));
    assert_eq!(descriptors[0].1, 0, "8192 is data");
    assert_eq!(descriptors[1].1, STATE_HOLE | STATE_ZERO);
    let asked = device.allocation_asked.load(Ordering::SeqCst);
    assert!(asked <= 1 << 30, "the device was asked about {asked} bytes");
    server.stop().await;
}

/// A block-status request on an image of small objects asks the image about no more than it
/// answers without listing the store: 256 MiB of 64 KiB objects (a read-only open, which has
/// no object map) listed every object of the image, of the pool on RADOS, at every request.
#[tokio::test]
async fn block_status_of_small_objects_covers_what_needs_no_listing() {
    const OBJECT: u64 = 64 << 10;
    let uri = ImageUri::parse("mem:protocol-small-objects").unwrap();
    let options = CreateOptions {
        object_size: OBJECT,
        pbkdf: PbkdfRequest::fast_for_tests(PbkdfKind::Pbkdf2),
        ..CreateOptions::new(16 << 30)
    };
    let writer = Image::create(&uri, &options, b"pw").await.unwrap();
    writer.write(0, &[1u8; 4096]).await.unwrap();
    writer.close().await.unwrap();
    let image = Image::open(&uri, b"pw", &OpenOptions::read_only())
        .await
        .unwrap();
    let span = image.allocation_span_unlisted();
    assert!(span < 256 << 20);
    let server = Server::start(Arc::new(image)).await;
    let mut client = Client::attach(&server, true).await;
    client.send(CMD_BLOCK_STATUS, 0, 1, 0, 256 << 20).await;
    let Chunk::Structured { kind, payload, .. } = client.reply(0).await.0 else {
        panic!("a structured reply")
    };
    assert_eq!(kind, REPLY_TYPE_BLOCK_STATUS);
    let descriptors = descriptors(&payload);
    let covered: u64 = descriptors.iter().map(|&(len, _)| u64::from(len)).sum();
    assert_eq!(covered, span, "{descriptors:?}");
    assert_eq!(descriptors[0].1, 0, "object 0 holds data");
    server.stop().await;
}

/// Block status requests are charged for what they hold (up to 2^16 extents and a reply of
/// as many descriptors): a client that sends many and reads no reply gets a bounded number
/// of them computed (its budget of 256 MiB). They were charged one unit each: all 2000 ran,
/// each a reply of 512 KiB queued for a client that did not read.
#[tokio::test]
async fn block_status_requests_are_charged_for_their_replies() {
    let device = Arc::new(ProbeDevice::default());
    let server = Server::start(device.clone()).await;
    let mut client = Client::attach(&server, true).await;
    // Sent from a task of its own: the server stops reading requests once the budget is
    // spent, and the socket's buffer then fills.
    let sender = tokio::spawn(async move {
        for i in 0..2000u64 {
            client.send(CMD_BLOCK_STATUS, 0, i, 8192, 0xFFFF_F000).await;
        }
        client
    });
    tokio::time::sleep(Duration::from_millis(500)).await;
    let calls = device.allocation_calls.load(Ordering::SeqCst);
    // 4096 units a connection, 25 a request: 163, and a few whose replies the socket's
    // buffer took.
    assert!(
        (1..300).contains(&calls),
        "{calls} block status requests computed for a client that reads no reply"
    );
    sender.abort();
    let _ = sender.await;
    server.stop().await;
}

/// A write-zeroes that must write data (`NO_HOLE`, or a device that cannot unmap) encrypts
/// real zero sectors: the server charges it like a write of its length, so a client's many
/// large ones cannot ask for more memory than its budget of 256 MiB. They were charged one
/// unit each: 40 of 32 MiB ran at once (1.25 GiB).
#[tokio::test]
async fn a_write_zeroes_that_writes_data_is_charged_like_a_write() {
    let device = Arc::new(ProbeDevice::default());
    let server = Server::start(device.clone()).await;
    let mut client = Client::attach(&server, true).await;
    const LEN: u32 = 32 << 20;
    for i in 0..40u64 {
        client
            .send(CMD_WRITE_ZEROES, CMD_FLAG_NO_HOLE, i, i * LEN as u64, LEN)
            .await;
    }
    for _ in 0..40 {
        assert_eq!(client.status().await.1, 0);
    }
    let peak = device.peak.load(Ordering::SeqCst);
    assert!(peak <= 256 << 20, "{peak} bytes zeroed with data at once");
    // Zeroing by unmapping holds no such buffer: not charged so.
    device.peak.store(0, Ordering::SeqCst);
    for i in 0..40u64 {
        client
            .send(CMD_WRITE_ZEROES, 0, i, i * LEN as u64, LEN)
            .await;
    }
    for _ in 0..40 {
        assert_eq!(client.status().await.1, 0);
    }
    assert!(device.peak.load(Ordering::SeqCst) > 256 << 20);
    server.stop().await;
}

/// A trim on a device whose discard writes data (librbd under LUKS writes every object of the
/// range as encrypted zeros) is charged like a write of its length too. It was charged one
/// unit: 40 of 32 MiB ran at once (1.25 GiB), and a client could send thousands.
#[tokio::test]
async fn a_trim_that_writes_data_is_charged_like_a_write() {
    let device = Arc::new(ProbeDevice::default());
    device.never_fast.store(true, Ordering::SeqCst);
    let server = Server::start(device.clone()).await;
    let mut client = Client::attach(&server, true).await;
    const LEN: u32 = 32 << 20;
    for i in 0..40u64 {
        client.send(CMD_TRIM, 0, i, i * LEN as u64, LEN).await;
    }
    for _ in 0..40 {
        assert_eq!(client.status().await.1, 0);
    }
    let peak = device.peak.load(Ordering::SeqCst);
    assert!(peak <= 256 << 20, "{peak} bytes zeroed with data at once");
    server.stop().await;
}

/// A request whose handling panics (a bug below the server) gets EIO; it once got no reply at
/// all, and its client waited for ever. The connection goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_request_that_panics_is_answered_with_eio() {
    let server = Server::start(Arc::new(ProbeDevice::default())).await;
    let mut client = Client::attach(&server, true).await;
    client.send(CMD_READ, 0, 1, PANIC_OFFSET, 4096).await;
    client.send(CMD_READ, 0, 2, 0, 4096).await;
    let mut replies = Vec::new();
    for _ in 0..2 {
        let reply = tokio::time::timeout(Duration::from_secs(10), client.status())
            .await
            .expect("every request is answered");
        replies.push(reply);
    }
    replies.sort();
    assert_eq!(replies, [(1, Errno::Io as u32), (2, 0)]);
    server.stop().await;
}

/// The socket file lets only its owner connect (mode 0600 under the usual umask 022, which
/// would give 0755), and binding leaves nothing else beside it.
#[tokio::test]
async fn the_socket_is_private_to_its_owner() {
    use std::os::unix::fs::PermissionsExt;
    let server = Server::start(MemoryDevice::new(false)).await;
    let mode = std::fs::metadata(&server.path)
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o600, "socket mode {mode:o}");
    let dir = server.path.parent().unwrap();
    let names: Vec<_> = std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, ["nbd.sock"], "the staging directory is gone");
    let mut client = Client::attach(&server, false).await;
    client.send(CMD_FLUSH, 0, 1, 0, 0).await;
    assert_eq!(client.status().await, (1, 0));
    client.send(CMD_DISC, 0, 2, 0, 0).await;
    server.stop().await;
}

#[tokio::test]
async fn a_live_socket_is_not_taken_over_and_a_stale_one_is() {
    let server = Server::start(MemoryDevice::new(false)).await;
    let err = match Listener::bind(&ListenAddress::Unix(server.path.clone())).await {
        Err(e) => e.to_string(),
        Ok(_) => panic!("bound over a live server"),
    };
    assert!(err.contains("another server is listening"), "{err}");
    server.stop().await;

    let dir = tempfile::tempdir().unwrap();
    let stale = dir.path().join("stale.sock");
    drop(std::os::unix::net::UnixListener::bind(&stale).unwrap());
    assert!(stale.exists());
    let listener = Listener::bind(&ListenAddress::Unix(stale.clone()))
        .await
        .unwrap();
    drop(listener);
    // A live server whose accept queue is full (behind on its accepts) refuses connects with
    // EAGAIN: its socket is live, not stale.
    let busy = dir.path().join("busy.sock");
    let listener = std::os::unix::net::UnixListener::bind(&busy).unwrap();
    rustix::net::listen(&listener, 0).unwrap();
    let mut queued = Vec::new();
    loop {
        match tokio::net::UnixStream::connect(&busy).await {
            Ok(stream) => queued.push(stream),
            Err(e) => {
                assert_eq!(e.kind(), std::io::ErrorKind::WouldBlock, "{e}");
                break;
            }
        }
        assert!(queued.len() < 64, "the accept queue does not fill");
    }
    let err = match Listener::bind(&ListenAddress::Unix(busy.clone())).await {
        Err(e) => e.to_string(),
        Ok(_) => panic!("bound over a live server with a full accept queue"),
    };
    assert!(err.contains("may be listening"), "{err}");
    assert!(busy.exists());
    drop((listener, queued));
    let file = dir.path().join("file");
    std::fs::write(&file, b"x").unwrap();
    let err = match Listener::bind(&ListenAddress::Unix(file.clone())).await {
        Err(e) => e.to_string(),
        Ok(_) => panic!("bound over a file"),
    };
    assert!(err.contains("not a socket"), "{err}");
    assert_eq!(std::fs::read(&file).unwrap(), b"x");
}

/// An ivdisk image in layout `unaligned` behind the server, which receives its writes of
/// whole sectors inside one object straight into slots: writes of a whole object, inside one,
/// across two and of partial sectors, sent back to back, read back as written; writes past the
/// end or past 2^64 (whose placement the server asks for before it checks the range) are
/// refused and the connection goes on.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unaligned_image_receives_payloads_in_slots() {
    unaligned_image_round_trip(None).await;
}

/// The same through TLS: the payload comes out of the TLS session's reads into the slots.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unaligned_image_receives_payloads_in_slots_through_tls() {
    let creds = TestCreds::new();
    unaligned_image_round_trip(Some(&creds)).await;
}

async fn unaligned_image_round_trip(tls: Option<&TestCreds>) {
    const OBJECT: u64 = 256 << 10;
    let name = if tls.is_some() {
        "mem:protocol-unaligned-tls"
    } else {
        "mem:protocol-unaligned"
    };
    let uri = ImageUri::parse(name).unwrap();
    let options = CreateOptions {
        layout: Some(LayoutKind::Unaligned),
        object_size: OBJECT,
        pbkdf: PbkdfRequest::fast_for_tests(PbkdfKind::Pbkdf2),
        ..CreateOptions::new(SIZE)
    };
    let image = Image::create(&uri, &options, b"pw").await.unwrap();
    let server = Server::start_with(Arc::new(image.clone()), tls.map(|t| t.server())).await;
    let mut client = match tls {
        None => Client::attach(&server, false).await,
        Some(creds) => {
            let mut client = Client::connect(&server)
                .await
                .start_tls(&creds.client())
                .await
                .unwrap();
            client.go("disk").await;
            client
        }
    };
    let mut model = vec![0u8; SIZE as usize];
    // The writes do not overlap: they are all in flight at once, and NBD leaves the order in
    // which a server applies overlapping writes in flight open (each request is its own task
    // here), so overlapping ones would make the expected image a race.
    let writes = [
        (0, OBJECT as usize),
        (OBJECT + 4096, 64 << 10),
        (2 * OBJECT - 8192, 16384),
        (OBJECT + (128 << 10) + 100, 5000),
        (2 * OBJECT + (64 << 10), 4096),
        (3 * OBJECT, OBJECT as usize),
    ];
    for (i, &(a, a_len)) in writes.iter().enumerate() {
        for &(b, b_len) in &writes[i + 1..] {
            assert!(
                a + a_len as u64 <= b || b + b_len as u64 <= a,
                "writes overlap"
            );
        }
    }
    for (i, &(offset, len)) in writes.iter().enumerate() {
        let data = pattern(len, i as u8 + 1);
        model[offset as usize..offset as usize + len].copy_from_slice(&data);
        client.write(i as u64 + 1, offset, &data, 0).await;
    }
    let mut done = HashSet::new();
    for _ in 0..writes.len() {
        let (cookie, error) = client.status().await;
        assert_eq!(error, 0, "write {cookie}");
        done.insert(cookie);
    }
    assert_eq!(done.len(), writes.len());
    let mut back = Vec::new();
    for k in 0..SIZE / OBJECT {
        client
            .send(CMD_READ, 0, 100 + k, k * OBJECT, OBJECT as u32)
            .await;
        let (chunk, data) = client.reply(OBJECT as usize).await;
        assert!(matches!(chunk, Chunk::Simple { error: 0, .. }), "{chunk:?}");
        back.extend_from_slice(&data);
    }
    assert!(back == model, "the image does not read back as written");

    client.write(200, SIZE - 4096, &[7u8; 8192], 0).await;
    assert_eq!(client.status().await, (200, Errno::NoSpc as u32));
    for (cookie, offset) in [(201, !4095u64), (202, u64::MAX - 4096 * 3 + 1)] {
        client.write(cookie, offset, &[7u8; 8192], 0).await;
        let (got, error) = client.status().await;
        assert_eq!(got, cookie);
        assert!(
            error == Errno::NoSpc as u32 || error == Errno::Inval as u32,
            "write at {offset:#x}: error {error}"
        );
    }
    client.send(CMD_FLUSH, 0, 203, 0, 0).await;
    assert_eq!(client.status().await, (203, 0));
    let mut back = vec![0u8; SIZE as usize];
    image.read(0, &mut back).await.unwrap();
    assert!(back == model, "a refused write changed the image");
    client.send(CMD_DISC, 0, 204, 0, 0).await;
    assert!(client.closed().await);
    server.stop().await;
}

/// Credentials made by `scripts/tls-creds` in a temporary directory: an authority, the
/// server's certificate, one client's.
struct TestCreds {
    dir: tempfile::TempDir,
}

impl TestCreds {
    fn new() -> TestCreds {
        let dir = tempfile::tempdir().unwrap();
        make_creds(dir.path(), &[]);
        TestCreds { dir }
    }

    fn server(&self) -> TlsCredentials {
        TlsCredentials::from_dir(&self.dir.path().join("server")).unwrap()
    }

    fn client(&self) -> PathBuf {
        self.dir.path().join("client")
    }

    fn path(&self) -> &Path {
        self.dir.path()
    }

    /// A client directory `name` that trusts the server's authority and holds the client
    /// certificate and key of `certificate_from` (none without it).
    fn client_trusting_the_server(&self, name: &str, certificate_from: Option<&Path>) -> PathBuf {
        let dir = self.path().join(name);
        std::fs::create_dir(&dir).unwrap();
        std::fs::copy(self.client().join("ca-cert.pem"), dir.join("ca-cert.pem")).unwrap();
        for file in ["client-cert.pem", "client-key.pem"] {
            if let Some(from) = certificate_from {
                std::fs::copy(from.join(file), dir.join(file)).unwrap();
            }
        }
        dir
    }
}

fn make_creds(dir: &Path, args: &[&str]) {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/tls-creds");
    let out = std::process::Command::new(script)
        .arg(dir)
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "scripts/tls-creds: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// FORCEDTLS: before `NBD_OPT_STARTTLS` every option is refused with `NBD_REP_ERR_TLS_REQD`
/// (and the session goes on), `NBD_OPT_EXPORT_NAME` closes the connection, and after TLS
/// everything works, over TLS, while a second `NBD_OPT_STARTTLS` is refused as invalid.
#[tokio::test]
async fn tls_is_required_before_anything_else() {
    let creds = TestCreds::new();
    let device = MemoryDevice::new(false);
    let server = Server::start_with(device.clone(), Some(creds.server())).await;

    let mut client = Client::connect(&server).await;
    client.option(OPT_LIST, &[]).await;
    let reply = client.option_reply().await;
    assert_eq!((reply.option, reply.kind), (OPT_LIST, REP_ERR_TLS_REQD));
    assert!(
        String::from_utf8_lossy(&reply.data).contains("requires TLS"),
        "{reply:?}"
    );
    for option in [OPT_GO, OPT_INFO] {
        client
            .option(option, &Client::name_request("disk", &0u16.to_be_bytes()))
            .await;
        let reply = client.option_reply().await;
        assert_eq!((reply.option, reply.kind), (option, REP_ERR_TLS_REQD));
    }
    client.option(OPT_STRUCTURED_REPLY, &[]).await;
    assert_eq!(client.option_reply().await.kind, REP_ERR_TLS_REQD);
    client.option(99, b"whatever").await;
    assert_eq!(client.option_reply().await.kind, REP_ERR_TLS_REQD);
    client.option(OPT_STARTTLS, b"x").await;
    assert_eq!(client.option_reply().await.kind, REP_ERR_INVALID);

    let mut client = client.start_tls(&creds.client()).await.unwrap();
    client.option(OPT_STARTTLS, &[]).await;
    let reply = client.option_reply().await;
    assert_eq!((reply.option, reply.kind), (OPT_STARTTLS, REP_ERR_INVALID));
    client.structured().await;
    let replies = client.set_meta("disk").await;
    assert_eq!(replies[0].kind, REP_META_CONTEXT);
    let (size, _) = client.go("disk").await;
    assert_eq!(size, SIZE);
    // A payload larger than a TLS record (16 KiB) and than the server's read-ahead, clear of
    // the device's bad and slow spots.
    const AT: usize = 0x20000;
    let data = pattern(512 << 10, 9);
    client.write(1, AT as u64, &data, 0).await;
    assert_eq!(client.status().await, (1, 0));
    client.send(CMD_FLUSH, 0, 2, 0, 0).await;
    assert_eq!(client.status().await, (2, 0));
    assert!(device.bytes.lock().unwrap()[AT..AT + data.len()] == data[..]);
    client
        .send(CMD_READ, 0, 3, AT as u64, data.len() as u32)
        .await;
    let (chunk, _) = client.reply(0).await;
    let Chunk::Structured { kind, payload, .. } = chunk else {
        panic!("{chunk:?}");
    };
    assert_eq!(kind, REPLY_TYPE_OFFSET_DATA);
    assert!(payload[8..] == data[..], "read back differs");
    client.send(CMD_DISC, 0, 4, 0, 0).await;
    assert!(client.closed().await);

    // EXPORT_NAME cannot be refused: the connection closes.
    let mut plain = Client::connect(&server).await;
    plain.option(OPT_EXPORT_NAME, b"disk").await;
    assert!(plain.closed().await);
    let stats = server.stop().await;
    assert_eq!((stats.protocol_errors, stats.tls_failures), (1, 0));
}

/// A client without a certificate, or with one of another authority, gets no session; the
/// server carries on with the others and counts the failures.
#[tokio::test]
async fn clients_without_a_certificate_of_the_authority_are_refused() {
    let creds = TestCreds::new();
    let server = Server::start_with(MemoryDevice::new(false), Some(creds.server())).await;

    let anonymous = creds.client_trusting_the_server("anonymous", None);
    let refused = Client::connect(&server).await.start_tls(&anonymous).await;
    assert!(refused.is_err(), "a client without a certificate got in");

    // Trusts the server, but its certificate comes from an authority of its own.
    let other = tempfile::tempdir().unwrap();
    make_creds(other.path(), &[]);
    let stranger = creds.client_trusting_the_server("stranger", Some(&other.path().join("client")));
    let refused = Client::connect(&server).await.start_tls(&stranger).await;
    assert!(refused.is_err(), "a client of another authority got in");

    let mut good = Client::connect(&server)
        .await
        .start_tls(&creds.client())
        .await
        .unwrap();
    good.go("disk").await;
    good.send(CMD_DISC, 0, 1, 0, 0).await;
    assert!(good.closed().await);
    let stats = server.stop().await;
    assert_eq!(stats.tls_failures, 2, "{stats:?}");
}

/// Without credentials, STARTTLS is refused by policy and the session goes on in the clear.
#[tokio::test]
async fn without_credentials_starttls_is_refused_by_policy() {
    let server = Server::start(MemoryDevice::new(false)).await;
    let mut client = Client::connect(&server).await;
    client.option(OPT_STARTTLS, &[]).await;
    let reply = client.option_reply().await;
    assert_eq!((reply.option, reply.kind), (OPT_STARTTLS, REP_ERR_POLICY));
    let (size, _) = client.go("disk").await;
    assert_eq!(size, SIZE);
    client.send(CMD_DISC, 0, 1, 0, 0).await;
    assert!(client.closed().await);
    server.stop().await;
}

/// Credentials that cannot work are refused when loaded, naming the file.
#[test]
fn unusable_credentials_are_refused_naming_the_file() {
    let creds = TestCreds::new();
    let other = TestCreds::new();
    let server = creds.path().join("server");
    let broken = creds.path().join("broken");
    std::fs::create_dir(&broken).unwrap();
    for file in ["ca-cert.pem", "server-cert.pem"] {
        std::fs::copy(server.join(file), broken.join(file)).unwrap();
    }
    let reason = |dir: &Path| match TlsCredentials::from_dir(dir) {
        Err(NbdError::TlsCredentials { reason, .. }) => reason,
        other => panic!("{other:?}"),
    };
    assert!(reason(&broken).contains("server-key.pem is missing"));
    // Another server's key.
    std::fs::copy(
        other.path().join("server/server-key.pem"),
        broken.join("server-key.pem"),
    )
    .unwrap();
    assert!(
        reason(&broken).contains("server-key.pem is not the key of"),
        "{}",
        reason(&broken)
    );
    std::fs::write(broken.join("server-key.pem"), "not a key").unwrap();
    assert!(
        reason(&broken).contains("server-key.pem"),
        "{}",
        reason(&broken)
    );
    assert!(TlsCredentials::from_dir(&server).is_ok());

    // Pre-shared keys: every malformed line named by its number, the key never shown.
    let psk = creds.path().join("psk");
    std::fs::create_dir(&psk).unwrap();
    let key = "00112233445566778899aabbccddeeff";
    for (text, expected) in [
        (format!("alice {key}\n"), "line 1: no `:`"),
        (format!("alice:{key}\n:{key}\n"), "line 2: no identity"),
        ("\nalice:0011zz\n".to_owned(), "line 2: the key is not hex"),
        ("alice:00112233\n".to_owned(), "shorter than 16 bytes"),
        ("\n\n".to_owned(), "holds no key"),
    ] {
        std::fs::write(psk.join("keys.psk"), &text).unwrap();
        let why = reason(&psk);
        assert!(why.contains(expected), "{text:?}: {why}");
        assert!(!why.contains("0011"), "a key is shown: {why}");
    }
    std::fs::write(psk.join("keys.psk"), format!("alice:{key}\r\nbob:{key}\n")).unwrap();
    let loaded = TlsCredentials::from_dir(&psk).unwrap();
    assert_eq!(loaded.kind(), TlsKind::Psk);
    assert_eq!(
        TlsCredentials::from_dir(&server).unwrap().kind(),
        TlsKind::X509
    );
}

/// A copy of `creds`' server directory whose certificate (same key, same authority) is valid
/// from `not_before` to `not_after` (Unix seconds).
fn server_dir_valid(creds: &TestCreds, not_before: i64, not_after: i64) -> PathBuf {
    use openssl::asn1::Asn1Time;
    use openssl::bn::BigNum;
    use openssl::hash::MessageDigest;
    use openssl::pkey::PKey;
    use openssl::x509::{X509Builder, X509NameBuilder, X509};
    let read = |path: &str| std::fs::read(creds.path().join(path)).unwrap();
    let ca_key = PKey::private_key_from_pem(&read("ca/ca-key.pem")).unwrap();
    let ca = X509::from_pem(&read("ca/ca-cert.pem")).unwrap();
    let key = PKey::private_key_from_pem(&read("server/server-key.pem")).unwrap();
    let mut name = X509NameBuilder::new().unwrap();
    name.append_entry_by_text("CN", "localhost").unwrap();
    let name = name.build();
    let mut cert = X509Builder::new().unwrap();
    cert.set_version(2).unwrap();
    let serial = BigNum::from_u32(7).unwrap().to_asn1_integer().unwrap();
    cert.set_serial_number(&serial).unwrap();
    cert.set_subject_name(&name).unwrap();
    cert.set_issuer_name(ca.subject_name()).unwrap();
    cert.set_pubkey(&key).unwrap();
    cert.set_not_before(&Asn1Time::from_unix(not_before).unwrap())
        .unwrap();
    cert.set_not_after(&Asn1Time::from_unix(not_after).unwrap())
        .unwrap();
    cert.sign(&ca_key, MessageDigest::sha256()).unwrap();
    let dir = creds
        .path()
        .join(format!("server-{not_before}-{not_after}"));
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(dir.join("server-cert.pem"), cert.build().to_pem().unwrap()).unwrap();
    for file in ["ca-cert.pem", "server-key.pem"] {
        std::fs::copy(creds.path().join("server").join(file), dir.join(file)).unwrap();
    }
    dir
}

/// A server certificate that has expired, or is not valid yet, is refused when loaded (every
/// client would refuse it, each with an error of its own); one valid now is taken, even if it
/// ends soon (that is only warned about).
#[test]
fn certificates_outside_their_validity_are_refused() {
    let creds = TestCreds::new();
    let now = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs() as i64;
    let day = 86_400;
    let reason = |dir: &Path| match TlsCredentials::from_dir(dir) {
        Err(NbdError::TlsCredentials { reason, .. }) => reason,
        other => panic!("{other:?}"),
    };
    let expired = server_dir_valid(&creds, now - 400 * day, now - day);
    assert!(
        reason(&expired).contains("expired on"),
        "{}",
        reason(&expired)
    );
    let early = server_dir_valid(&creds, now + day, now + 400 * day);
    assert!(
        reason(&early).contains("not valid before"),
        "{}",
        reason(&early)
    );
    let ending_soon = server_dir_valid(&creds, now - day, now + 10 * day);
    assert!(TlsCredentials::from_dir(&ending_soon).is_ok());
}

/// Connections that never finish their handshake (before TLS, not yet authenticated) get a
/// few slots per address, not all of them: a ninth silent connection from one address is
/// closed at once, and a client gets in again as soon as one of the eight leaves (256 silent
/// connects used to lock every client out).
#[tokio::test]
async fn connections_that_never_negotiate_cannot_lock_others_out() {
    use tokio::net::TcpStream;
    let listener = Listener::bind(&ListenAddress::Tcp("127.0.0.1:0".into()))
        .await
        .unwrap();
    let ListenAddress::Tcp(address) = listener.local_address() else {
        panic!("a TCP listener")
    };
    let (stop, stopped) = oneshot::channel::<()>();
    let exports = vec![Export {
        name: "disk".into(),
        description: String::new(),
        device: MemoryDevice::new(false),
    }];
    let task = tokio::spawn(async move {
        serve_with_tls(listener, exports, None, async {
            let _ = stopped.await;
        })
        .await
        .unwrap()
    });
    let greeted = |mut stream: TcpStream| async move {
        let greeting = tokio::time::timeout(Duration::from_secs(5), stream.read_u64()).await;
        matches!(greeting, Ok(Ok(NBDMAGIC))).then_some(stream)
    };

    let mut silent = Vec::new();
    for i in 0..8 {
        let stream = TcpStream::connect(&address).await.unwrap();
        silent.push(
            greeted(stream)
                .await
                .unwrap_or_else(|| panic!("connection {i}")),
        );
    }
    let ninth = TcpStream::connect(&address).await.unwrap();
    assert!(
        greeted(ninth).await.is_none(),
        "a ninth silent connection from one address was served"
    );

    drop(silent.pop());
    let deadline = std::time::Instant::now() + Duration::from_secs(5);
    loop {
        let stream = TcpStream::connect(&address).await.unwrap();
        if greeted(stream).await.is_some() {
            break;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "no client got in after a silent one left"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    drop(silent);
    stop.send(()).unwrap();
    tokio::time::timeout(Duration::from_secs(10), task)
        .await
        .expect("server stops")
        .unwrap();
}

/// A Unix socket path longer than a socket address holds is refused when binding (it was
/// bound through a shorter staging path, and no client could connect to it).
#[tokio::test]
async fn a_socket_path_too_long_for_an_address_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s".repeat(120));
    let Err(err) = Listener::bind(&ListenAddress::Unix(path.clone())).await else {
        panic!("bound a {}-byte path", path.as_os_str().len())
    };
    assert!(err.to_string().contains("pick a shorter path"), "{err}");
    assert!(!path.exists());
}

/// Connections holding the server's whole budget with write headers whose payloads never
/// come: 31 writes of 32 MiB hold all but 481 of its 16384 units, and the 32nd waits for 513.
async fn stall_the_budget(server: &Server) -> Vec<Client> {
    let mut stalled = Vec::new();
    for i in 0..32u64 {
        let mut client = Client::attach(server, true).await;
        client.send(CMD_WRITE, 0, 100 + i, 0, MAX_PAYLOAD).await;
        stalled.push(client);
    }
    stalled
}

/// A client that stops sending a write's payload keeps its connection while it is in no
/// one's way (a copy suspended with Ctrl-Z); once others wait for the server budget it holds,
/// it is cut off after the stall time and they go on. 32 stalled 32 MiB write headers held
/// the whole budget, and every other client's requests waited for ever.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_stalled_in_the_way_of_others_are_cut_off() {
    let device = MemoryDevice::new(false);
    let stall = Duration::from_millis(500);
    let server = Server::start_stalling(device.clone(), stall).await;

    // Alone: half a payload, then a pause of many stall times, then the rest.
    let mut paused = Client::attach(&server, true).await;
    let data = pattern(8192, 3);
    paused.send(CMD_WRITE, 0, 1, 0, 8192).await;
    paused.stream.write_all(&data[..4096]).await.unwrap();
    tokio::time::sleep(4 * stall).await;
    paused.stream.write_all(&data[4096..]).await.unwrap();
    assert_eq!(
        paused.status().await,
        (1, 0),
        "the paused write went through"
    );
    assert_eq!(&device.bytes.lock().unwrap()[..8192], &data[..]);

    // In the way: a client with a 4 KiB read gets its answer, the stalled ones are closed.
    // The server takes each connection's header when it gets to it: the pause gives it time
    // to take all 32 before the read comes, so the read usually waits behind them.
    let mut stalled = stall_the_budget(&server).await;
    tokio::time::sleep(stall / 5).await;
    let mut victim = Client::attach(&server, true).await;
    victim.send(CMD_READ, 0, 7, 0, 4096).await;
    let answered = tokio::time::timeout(Duration::from_secs(30), victim.reply(0))
        .await
        .expect("a read waited for ever behind stalled writes");
    let Chunk::Structured { payload, .. } = answered.0 else {
        panic!("{answered:?}")
    };
    assert_eq!(&payload[8..], &data[..4096]);
    // The paused client's connection, idle between requests, was left alone.
    paused.send(CMD_READ, 0, 2, 0, 4096).await;
    assert!(matches!(paused.reply(0).await.0, Chunk::Structured { .. }));
    // As many stalled connections were closed as the others needed (at least one), and no
    // more: the rest are in no one's way now. Had the server taken the read before the 32nd
    // write's header, that write waits now: it is the one a stalled connection gives way to,
    // within the stall time.
    tokio::time::sleep(3 * stall).await;
    let stats = server.stop().await;
    assert!((1..32).contains(&stats.stalled), "{stats:?}");
    assert_eq!(stats.protocol_errors, 0, "{stats:?}");
    let mut closed = 0;
    for client in &mut stalled {
        closed += client.closed().await as usize;
    }
    assert_eq!(closed, 32, "the server's stop closed the rest");
}

/// A client that stops reading its replies holds their budget; once others wait for it, its
/// connection is closed after the stall time (its replies dropped), and they go on. Here it
/// is the only connection stalled: the rest of the budget is held by reads waiting in the
/// device, which are in no one's way.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_client_that_reads_no_replies_in_the_way_of_others_is_cut_off() {
    let device = Arc::new(ProbeDevice::default());
    let stall = Duration::from_millis(500);
    let server = Server::start_stalling(device.clone(), stall).await;
    // 40 reads of 1 MiB (17 units each): the first replies fill the socket, the rest wait.
    let mut deaf = Client::attach(&server, true).await;
    let reads = 40u64;
    for cookie in 0..reads {
        deaf.send(CMD_READ, 0, cookie, 0, SIZE as u32).await;
    }
    // Reads that wait in the device (16 units each): three connections of 256 take 12288
    // units, a fourth takes the rest and waits for more, from its own task.
    let gated_len = (SIZE - GATED_OFFSET) as u32; // 16 units
    let mut holders = Vec::new();
    for _ in 0..3 {
        let mut holder = Client::attach(&server, true).await;
        for cookie in 0..256 {
            holder
                .send(CMD_READ, 0, cookie, GATED_OFFSET, gated_len)
                .await;
        }
        holders.push(holder);
    }
    let mut waiter = Client::attach(&server, true).await;
    for cookie in 0..256 {
        waiter
            .send(CMD_READ, 0, cookie, GATED_OFFSET, gated_len)
            .await;
    }
    // The deaf client's budget goes to the waiting reads once it is cut off: all 256 of the
    // fourth client's reach the device.
    let all_in = async {
        while device.gated.load(Ordering::SeqCst) < 4 * 256 {
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(20), all_in)
        .await
        .unwrap_or_else(|_| {
            panic!(
                "{} of 1024 waiting reads reached the device",
                device.gated.load(Ordering::SeqCst)
            )
        });
    // Reading at last, the deaf client finds part of its replies, then the end of its
    // connection.
    let mut got = 0u64;
    loop {
        let mut head = [0u8; 20];
        let read = tokio::time::timeout(Duration::from_secs(20), deaf.stream.read_exact(&mut head))
            .await
            .expect("the connection of a client that reads no replies was not closed");
        if read.is_err() {
            break;
        }
        let len = u32::from_be_bytes(head[16..20].try_into().unwrap()) as usize;
        let mut payload = vec![0u8; len];
        if deaf.stream.read_exact(&mut payload).await.is_err() {
            break;
        }
        if u16::from_be_bytes(head[4..6].try_into().unwrap()) & REPLY_FLAG_DONE != 0 {
            got += 1;
        }
    }
    assert!(
        got < reads,
        "all {got} replies came: the connection was not cut"
    );
    device.gate_opened.store(true, Ordering::SeqCst);
    device.gate.notify_waiters();
    drop((holders, waiter));
    let stats = server.stop().await;
    assert_eq!(stats.stalled, 1, "{stats:?}");
}

/// A fast write-zeroes (`NBD_CMD_FLAG_FAST_ZERO`) over part of a sector is refused with
/// ENOTSUP and changes nothing: that part is read, decrypted, encrypted and written as any
/// write is, not fast (it was done and answered as fast). Whole sectors are fast.
#[tokio::test]
async fn a_fast_zero_of_part_of_a_sector_is_not_fast() {
    let uri = ImageUri::parse("mem:protocol-fast-zero").unwrap();
    let options = CreateOptions {
        pbkdf: PbkdfRequest::fast_for_tests(PbkdfKind::Pbkdf2),
        ..CreateOptions::new(16 << 20)
    };
    let image = Arc::new(Image::create(&uri, &options, b"pw").await.unwrap());
    assert_eq!(image.sector_size(), 4096);
    image.write(0, &[0x55u8; 8192]).await.unwrap();
    let server = Server::start(image.clone()).await;
    let mut client = Client::attach(&server, true).await;
    for (cookie, offset, len) in [(1, 100, 1000), (2, 0, 1000), (3, 100, 8092)] {
        client
            .send(CMD_WRITE_ZEROES, CMD_FLAG_FAST_ZERO, cookie, offset, len)
            .await;
        assert_eq!(
            client.status().await,
            (cookie, Errno::NotSup as u32),
            "{offset}+{len}"
        );
    }
    let mut back = vec![0u8; 8192];
    image.read(0, &mut back).await.unwrap();
    assert!(back.iter().all(|&b| b == 0x55), "a refused zero wrote");
    client
        .send(CMD_WRITE_ZEROES, CMD_FLAG_FAST_ZERO, 4, 4096, 4096)
        .await;
    assert_eq!(client.status().await, (4, 0));
    image.read(0, &mut back).await.unwrap();
    assert!(back[..4096].iter().all(|&b| b == 0x55));
    assert!(back[4096..].iter().all(|&b| b == 0));
    server.stop().await;
}
