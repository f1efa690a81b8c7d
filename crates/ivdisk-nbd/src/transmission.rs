//! The transmission phase of one connection. A reader loop takes requests off the socket and
//! starts each as its own task; tasks finish in any order and hand their reply to one writer
//! task, so a slow request never holds up a fast one (replies out of order, as NBD allows).
//! A budget bounds the requests and payload bytes in flight per connection: a reply keeps its
//! share until it is on the wire, so a client that stops reading replies stops being read.
//! A connection that stalls within a transfer while others wait for the server-wide budget
//! it holds is closed ([`ServerBudget`]).

use std::future::Future as _;
use std::os::fd::AsRawFd;
use std::sync::Arc;
use std::task::{Context as TaskContext, Poll};

use futures_util::FutureExt as _;
use ivdisk_image::{PayloadPlacement, ReadReply, WritePayload};

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt, BufWriter, Interest, ReadBuf};
use tokio::sync::{mpsc, watch, OwnedSemaphorePermit, Semaphore};

use crate::device::{BlockDevice, DeviceError, DeviceErrorKind};
use crate::ffi::SlotBuffer;
use crate::handshake::{Negotiated, MAX_PAYLOAD};
use crate::proto::*;
use crate::NbdError;

/// Budget units per connection: a request costs one unit plus one per 64 KiB of payload, so
/// this allows 4096 small requests or 256 MiB of payload in flight.
const BUDGET_UNITS: u32 = 4096;
const UNIT_BYTES: u32 = 64 * 1024;
/// Budget units of the whole server, shared by its connections (each request takes from its
/// connection's budget, then from this one): 1 GiB of payload in flight at most. Without it,
/// each connection that stopped reading its replies kept its 256 MiB (about 230 MB resident
/// each, measured), and 256 connections could ask for 64 GiB. Clients that do not read then
/// stall the others once they hold it all, which memory running out would not spare either.
const SERVER_BUDGET_UNITS: u32 = 4 * BUDGET_UNITS;

/// The server's budget ([`SERVER_BUDGET_UNITS`]), shared by its connections, and how many of
/// them wait for it now. A connection whose transfer stalls (a write's payload that stops
/// coming, replies the client stops reading) keeps what it took; while others wait, it is cut
/// off once it has made no progress for `stall` (see [`unless_stalled`]). Without that, 32
/// connections that each sent the header of a 32 MiB write and nothing more held the whole
/// budget, and every other client's requests waited for ever (the protocol says a payload of
/// up to 32 MiB should not be taken for an attack, so each one alone is legal). A client that
/// stalls alone (a copy suspended with Ctrl-Z) keeps its connection: it is in no one's way.
pub(crate) struct ServerBudget {
    units: Arc<Semaphore>,
    waiting: std::sync::atomic::AtomicUsize,
    stall: std::time::Duration,
}

impl ServerBudget {
    pub(crate) fn new(stall: std::time::Duration) -> ServerBudget {
        ServerBudget {
            units: Arc::new(Semaphore::new(SERVER_BUDGET_UNITS as usize)),
            waiting: std::sync::atomic::AtomicUsize::new(0),
            stall,
        }
    }

    /// `cost` units, counted among the waiters while they are not free.
    async fn acquire(&self, cost: u32) -> OwnedSemaphorePermit {
        if let Ok(permit) = self.units.clone().try_acquire_many_owned(cost) {
            return permit;
        }
        struct Waiting<'a>(&'a std::sync::atomic::AtomicUsize);
        impl Drop for Waiting<'_> {
            fn drop(&mut self) {
                self.0.fetch_sub(1, std::sync::atomic::Ordering::AcqRel);
            }
        }
        self.waiting
            .fetch_add(1, std::sync::atomic::Ordering::AcqRel);
        let _waiting = Waiting(&self.waiting);
        self.units
            .clone()
            .acquire_many_owned(cost)
            .await
            .expect("the server's budget semaphore is never closed")
    }

    /// Whether a connection waits for budget now.
    fn wanted(&self) -> bool {
        self.waiting.load(std::sync::atomic::Ordering::Acquire) > 0
    }
}

/// One side of a connection (its request reader, its reply writer) watched for stalls: a
/// timer that goes off every stall time while the side waits inside a transfer, and the
/// count of its steps (each finished step, and each new wait, is progress). Why one timer
/// per side, re-armed only when it goes off: a timer set and dropped at every wait (payloads
/// arrive in many reads) cost 64 KiB writes through `ivdisk serve` 1.5-3% more CPU.
pub(crate) struct StallWatch {
    budget: Arc<ServerBudget>,
    timer: Option<std::pin::Pin<Box<tokio::time::Sleep>>>,
    steps: u64,
    steps_at_arm: u64,
}

impl StallWatch {
    pub(crate) fn new(budget: Arc<ServerBudget>) -> StallWatch {
        StallWatch {
            budget,
            timer: None,
            steps: 0,
            steps_at_arm: 0,
        }
    }

    /// While a step waits: `Ready` with the error that ends the connection once a whole stall
    /// time went by without a step while another connection waits for the budget.
    fn poll_stalled(&mut self, cx: &mut TaskContext<'_>) -> Poll<std::io::Error> {
        let stall = self.budget.stall;
        let timer = match &mut self.timer {
            Some(timer) => timer,
            None => {
                self.steps_at_arm = self.steps;
                self.timer.insert(Box::pin(tokio::time::sleep(stall)))
            }
        };
        while timer.as_mut().poll(cx).is_ready() {
            if self.steps == self.steps_at_arm && self.budget.wanted() {
                return Poll::Ready(std::io::Error::new(
                    std::io::ErrorKind::TimedOut,
                    StalledWhileWanted(stall),
                ));
            }
            self.steps_at_arm = self.steps;
            timer.as_mut().reset(tokio::time::Instant::now() + stall);
        }
        Poll::Pending
    }
}

/// `io`, one step of a request's or a reply's transfer (a read or write that returns once
/// some bytes moved), failed with `TimedOut` if its side makes no progress for the budget's
/// stall time while another connection waits for the budget ([`ServerBudget`]).
async fn unless_stalled<T>(
    watch: &mut StallWatch,
    io: impl std::future::Future<Output = std::io::Result<T>>,
) -> std::io::Result<T> {
    let mut io = std::pin::pin!(io);
    let mut waited = false;
    std::future::poll_fn(|cx| {
        if let Poll::Ready(result) = io.as_mut().poll(cx) {
            watch.steps += 1;
            return Poll::Ready(result);
        }
        if !waited {
            // A new wait: what came before it was progress.
            waited = true;
            watch.steps += 1;
        }
        watch.poll_stalled(cx).map(Err)
    })
    .await
}

/// Why [`unless_stalled`] gave up: the connection is closed as [`NbdError::Stalled`].
#[derive(Debug)]
pub(crate) struct StalledWhileWanted(std::time::Duration);

impl std::fmt::Display for StalledWhileWanted {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "made no progress for {} s while other clients waited for the server's memory \
             budget, which it held",
            self.0.as_secs_f64()
        )
    }
}

impl std::error::Error for StalledWhileWanted {}

/// Whether `error` is [`unless_stalled`]'s.
fn is_stall(error: &std::io::Error) -> bool {
    error
        .get_ref()
        .is_some_and(|inner| inner.is::<StalledWhileWanted>())
}
/// The most one block-status reply covers, and the most descriptors it holds (the protocol
/// asks for no more than 2^20).
const BLOCK_STATUS_SPAN: u64 = 1 << 30;
const BLOCK_STATUS_EXTENTS: usize = 1 << 16;
/// After shutdown, how long replies already computed wait for a client that does not read.
const REPLY_GRACE: std::time::Duration = std::time::Duration::from_secs(10);

/// A request's budget: one unit, and one per 64 KiB of what it holds in memory. A
/// write-zeroes that writes data (`writes_data`: it may not unmap, or the device cannot zero
/// by unmapping) encrypts real zero sectors, a buffer as large as a write's payload (up to
/// 32 MiB at once, `ivdisk_image`'s zero batches): charged as a write of its length, or
/// thousands of them in flight asked for tens of gigabytes.
///
/// A block status is charged for the most it holds: the device's extents (at most
/// `BLOCK_STATUS_EXTENTS` of them for the span it is asked about) and a reply of as many
/// descriptors, 1.5 MiB. At one unit, a client that did not read its replies had 4096 of
/// them computed at once (2 GiB of replies queued, more in extent lists).
fn cost(request: &Request, writes_data: bool) -> u32 {
    const BLOCK_STATUS_BYTES: usize = STRUCTURED_HEADER_LEN
        + 4
        + BLOCK_STATUS_EXTENTS * (8 + std::mem::size_of::<crate::device::Extent>());
    match request.command {
        CMD_READ | CMD_WRITE => 1 + request.length.min(MAX_PAYLOAD) / UNIT_BYTES,
        CMD_WRITE_ZEROES | CMD_TRIM if writes_data => {
            1 + request.length.min(MAX_PAYLOAD) / UNIT_BYTES
        }
        CMD_BLOCK_STATUS => 1 + BLOCK_STATUS_BYTES.div_ceil(UNIT_BYTES as usize) as u32,
        _ => 1,
    }
}

struct Reply {
    frame: Frame,
    _budget: OwnedSemaphorePermit,
    _server_budget: OwnedSemaphorePermit,
}

/// A complete reply: its header (all of it, for a reply without data) and its data.
struct Frame {
    head: Vec<u8>,
    body: ReadReply,
}

impl From<Vec<u8>> for Frame {
    fn from(head: Vec<u8>) -> Frame {
        Frame {
            head,
            body: ReadReply::contiguous(Vec::new()),
        }
    }
}

/// How the connection ended.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum Ending {
    /// `NBD_CMD_DISC` or end of stream between requests.
    Disconnect,
    /// The server is shutting down.
    Shutdown,
}

/// Serve requests until the client disconnects, breaks the protocol or the server shuts
/// down; in every case requests already read are finished and their replies sent first.
pub(crate) async fn transmit<R, W>(
    reader: R,
    writer: W,
    peer: &str,
    negotiated: Negotiated,
    server_budget: Arc<ServerBudget>,
    mut shutdown: watch::Receiver<bool>,
) -> Result<Ending, NbdError>
where
    R: PayloadSource,
    W: AsyncWrite + Unpin + Send + 'static,
{
    let (replies, queue) = mpsc::unbounded_channel::<Reply>();
    let peer_name = peer.to_owned();
    // Set when the reply writer gives up because the client stopped reading while others
    // waited: the request loop then ends the connection.
    let (writer_failed, mut writer_gone) = watch::channel(false);
    let writer_task = tokio::spawn(write_replies(
        writer,
        queue,
        peer_name,
        server_budget.clone(),
        writer_failed,
    ));
    let budget = Arc::new(Semaphore::new(BUDGET_UNITS as usize));
    let context = Arc::new(Context {
        device: negotiated.export.device.clone(),
        structured: negotiated.structured,
        block_status: negotiated.block_status,
        io_failures: Default::default(),
        full_failures: Default::default(),
    });
    let mut reader = RequestReader::new(reader);
    let mut reading = StallWatch::new(server_budget.clone());
    let io = |source: std::io::Error| match is_stall(&source) {
        true => NbdError::Stalled {
            peer: peer.to_owned(),
            reason: source.to_string(),
        },
        false => NbdError::Io {
            peer: peer.to_owned(),
            source,
        },
    };
    let stalled_replies = || NbdError::Stalled {
        peer: peer.to_owned(),
        reason: format!(
            "did not read its replies: {}",
            StalledWhileWanted(server_budget.stall)
        ),
    };
    let protocol = |reason: String| NbdError::Protocol {
        peer: peer.to_owned(),
        reason,
    };
    let ending = loop {
        let mut header = [0u8; REQUEST_HEADER_LEN];
        tokio::select! {
            biased;
            _ = shutdown.wait_for(|stop| *stop) => break Ok(Ending::Shutdown),
            Ok(_) = writer_gone.wait_for(|gone| *gone) => break Err(stalled_replies()),
            read = read_header(&mut reader, &mut header, &mut reading) => match read {
                Ok(true) => {}
                Ok(false) => break Ok(Ending::Disconnect),
                Err(e) => break Err(io(e)),
            },
        }
        let Some(request) = Request::parse(&header) else {
            break Err(protocol(format!(
                "bad request magic {:#010x}",
                u32::from_be_bytes(header[0..4].try_into().expect("4 bytes"))
            )));
        };
        if request.command == CMD_DISC {
            break Ok(Ending::Disconnect);
        }
        reader.read_ahead(!(request.command == CMD_WRITE && request.length >= DIRECT_PAYLOAD_MIN));
        if request.command == CMD_WRITE && request.length > MAX_PAYLOAD {
            // Its payload would have to be read to stay in sync; refuse to buffer it.
            break Err(protocol(format!(
                "write of {} bytes is over the {MAX_PAYLOAD}-byte maximum",
                request.length
            )));
        }
        // Waiting for budget (a client that does not read its replies) and for a write's
        // payload (a client stalled mid-request) both give way to shutdown: such a request
        // was never fully received, so it is dropped unanswered.
        // A trim is a write-zeroes that may unmap: where that writes data (librbd under
        // LUKS encrypts zeros), it holds buffers as a write does.
        let zeroes_write_data = match request.command {
            CMD_WRITE_ZEROES => !context
                .device
                .fast_zero(request.flags & CMD_FLAG_NO_HOLE == 0),
            CMD_TRIM => !context.device.fast_zero(true),
            _ => false,
        };
        let cost = cost(&request, zeroes_write_data);
        let permit = tokio::select! {
            biased;
            _ = shutdown.wait_for(|stop| *stop) => break Ok(Ending::Shutdown),
            permit = budget.clone().acquire_many_owned(cost) => {
                permit.expect("the budget semaphore is never closed")
            }
        };
        let server_permit = tokio::select! {
            biased;
            _ = shutdown.wait_for(|stop| *stop) => break Ok(Ending::Shutdown),
            permit = server_budget.acquire(cost) => permit,
        };
        let mut payload = WritePayload::contiguous(Vec::new());
        if request.command == CMD_WRITE {
            let len = request.length as usize;
            tokio::select! {
                biased;
                _ = shutdown.wait_for(|stop| *stop) => break Ok(Ending::Shutdown),
                Ok(_) = writer_gone.wait_for(|gone| *gone) => break Err(stalled_replies()),
                read = receive_payload(
                    &mut reader,
                    len,
                    context.device.write_placement(request.offset, len),
                    &mut reading,
                ) => match read {
                    Ok(read) => payload = read,
                    Err(e) => break Err(io(e)),
                },
            }
        }
        let context = context.clone();
        let replies = replies.clone();
        tokio::spawn(async move {
            let frame = context.handle(request, payload).await;
            // The writer is gone only if the connection is; nothing to tell anyone then.
            let _ = replies.send(Reply {
                frame,
                _budget: permit,
                _server_budget: server_permit,
            });
        });
    };
    // Tasks in flight hold clones of `replies`; the writer ends after the last one's reply.
    // A task lets its clone go once its reply is queued, so the clones left count the
    // requests still on the device: what a slow shutdown waits for, the storage or the client.
    let on_device = replies.downgrade();
    drop(replies);
    let mut writer_task = writer_task;
    let written = tokio::select! {
        written = &mut writer_task => Some(written),
        // A client that does not read its replies cannot hold up a shutdown for long.
        _ = async {
            let _ = shutdown.wait_for(|stop| *stop).await;
            tokio::time::sleep(REPLY_GRACE).await;
        } => None,
    };
    match written {
        Some(Ok(Ok(()))) => {}
        Some(Ok(Err(e))) => tracing::debug!(peer, error = %e, "could not send every reply"),
        Some(Err(e)) => tracing::error!(peer, error = %e, "reply writer failed"),
        // Requests the device has not finished are the storage's doing, not the client's.
        None => match on_device.strong_count() {
            0 => {
                tracing::warn!(
                    peer,
                    "client did not take its replies within {} s of shutdown; dropping them",
                    REPLY_GRACE.as_secs()
                );
                writer_task.abort();
            }
            n => {
                tracing::warn!(
                    peer,
                    requests = n,
                    "{n} request(s) still wait for the storage {} s after shutdown began; \
                     waiting for them to end (a storage timeout ends them), then dropping \
                     their replies",
                    REPLY_GRACE.as_secs()
                );
                writer_task.abort();
            }
        },
    }
    // Every request task holds budget until its reply is written or dropped: once all of it
    // is back, no request of this connection still runs on the device.
    let _all = budget
        .acquire_many(BUDGET_UNITS)
        .await
        .expect("the budget semaphore is never closed");
    ending
}

/// Payloads of writes at least this large are read from the socket straight into their
/// buffer, past the request reader's buffer (see [`RequestReader`]).
const DIRECT_PAYLOAD_MIN: u32 = 32 * 1024;

/// How much a refill of [`RequestReader`]'s buffer reads ahead at most.
const READ_AHEAD: usize = 256 * 1024;

/// The read half of a connection, with a buffer for request headers and small payloads.
///
/// Why not tokio's `BufReader`: its refills read as much as its buffer holds, so under a
/// stream of writes the payloads that follow a header come off the socket into the buffer
/// and are then copied into the payload's own (a second copy of every byte, 6.6% of the
/// server's CPU under 64 KiB writes). Here a refill reads ahead the whole buffer only while
/// requests are small (many headers and small payloads per system call); after a large write
/// ([`DIRECT_PAYLOAD_MIN`], `read_ahead(false)`) it reads at most a header, so that the
/// payload of the next large write goes from the socket straight into its buffer.
pub(crate) struct RequestReader<R> {
    inner: R,
    buf: Box<[u8]>,
    pos: usize,
    filled: usize,
    ahead: usize,
}

impl<R> RequestReader<R> {
    pub(crate) fn new(inner: R) -> Self {
        RequestReader {
            inner,
            buf: vec![0u8; READ_AHEAD].into_boxed_slice(),
            pos: 0,
            filled: 0,
            ahead: READ_AHEAD,
        }
    }

    /// Let refills read ahead the whole buffer (`true`) or at most a request header.
    pub(crate) fn read_ahead(&mut self, whole: bool) {
        self.ahead = match whole {
            true => READ_AHEAD,
            false => REQUEST_HEADER_LEN,
        };
    }

    /// The bytes read off the socket and not taken yet.
    pub(crate) fn buffer(&self) -> &[u8] {
        &self.buf[self.pos..self.filled]
    }

    /// Take `n` bytes of [`buffer`](Self::buffer).
    pub(crate) fn consume(&mut self, n: usize) {
        self.pos = (self.pos + n).min(self.filled);
    }

    #[cfg(test)]
    pub(crate) fn get_ref(&self) -> &R {
        &self.inner
    }

    pub(crate) fn get_mut(&mut self) -> &mut R {
        &mut self.inner
    }
}

impl<R: AsyncRead + Unpin> AsyncRead for RequestReader<R> {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut TaskContext<'_>,
        out: &mut ReadBuf<'_>,
    ) -> Poll<std::io::Result<()>> {
        let this = self.get_mut();
        if this.pos == this.filled {
            // Nothing buffered: a read at least as large as a refill goes straight to the
            // caller's buffer.
            if out.remaining() >= this.ahead {
                return std::pin::Pin::new(&mut this.inner).poll_read(cx, out);
            }
            let mut fill = ReadBuf::new(&mut this.buf[..this.ahead]);
            std::task::ready!(std::pin::Pin::new(&mut this.inner).poll_read(cx, &mut fill))?;
            this.filled = fill.filled().len();
            this.pos = 0;
        }
        let n = out.remaining().min(this.filled - this.pos);
        out.put_slice(&this.buf[this.pos..this.pos + n]);
        this.pos += n;
        Poll::Ready(Ok(()))
    }
}

/// A connection's read half: bytes through [`AsyncRead`], and for a socket, vectored reads
/// of a write's payload straight into the slots a device asks for
/// ([`PayloadPlacement::Slots`]).
pub(crate) trait PayloadSource: AsyncRead + Unpin + Send + 'static {
    /// Read the next bytes of `slots`' payload from the socket once it is readable; `Ok(0)`
    /// at the end of the stream.
    fn poll_read_slots(
        &mut self,
        cx: &mut TaskContext<'_>,
        slots: &mut SlotBuffer,
    ) -> Poll<std::io::Result<usize>>;
}

/// [`PayloadSource`] for one half of a stream split in two (a TLS session): plain reads into
/// one slot's room at a time.
impl<T: AsyncRead + Send + 'static> PayloadSource for tokio::io::ReadHalf<T> {
    fn poll_read_slots(
        &mut self,
        cx: &mut TaskContext<'_>,
        slots: &mut SlotBuffer,
    ) -> Poll<std::io::Result<usize>> {
        slots.poll_read_next(self, cx)
    }
}

/// [`PayloadSource`] for the read half of a tokio socket (`as_ref` gives the socket).
macro_rules! socket_payload_source {
    ($half:ty) => {
        impl PayloadSource for $half {
            fn poll_read_slots(
                &mut self,
                cx: &mut TaskContext<'_>,
                slots: &mut SlotBuffer,
            ) -> Poll<std::io::Result<usize>> {
                let socket = (*self).as_ref();
                loop {
                    std::task::ready!(socket.poll_read_ready(cx))?;
                    let fd = socket.as_raw_fd();
                    // `try_io` clears the readiness on `WouldBlock`, so the next poll waits.
                    match socket.try_io(Interest::READABLE, || slots.read_from(fd)) {
                        Err(e)
                            if matches!(
                                e.kind(),
                                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
                            ) => {}
                        done => return Poll::Ready(done),
                    }
                }
            }
        }
    };
}

socket_payload_source!(tokio::net::tcp::OwnedReadHalf);
socket_payload_source!(tokio::net::unix::OwnedReadHalf);

/// Read a write's `len`-byte payload where the device asked for it: together (with spare
/// capacity), or in slots. A placement in slots that `len` does not fill (not whole sectors:
/// the device would refuse the request anyway) is read together.
async fn receive_payload<R: PayloadSource>(
    reader: &mut RequestReader<R>,
    len: usize,
    placement: PayloadPlacement,
    watch: &mut StallWatch,
) -> std::io::Result<WritePayload> {
    match placement {
        PayloadPlacement::Slots { sector, slot }
            if sector > 0 && sector <= slot && len.is_multiple_of(sector) =>
        {
            let slots = read_payload_in_slots(reader, len, sector, slot, watch).await?;
            Ok(WritePayload::in_slots(slots, sector, slot))
        }
        PayloadPlacement::Contiguous { spare } => Ok(WritePayload::contiguous(
            read_payload(reader, len, spare, watch).await?,
        )),
        PayloadPlacement::Slots { .. } => Ok(WritePayload::contiguous(
            read_payload(reader, len, 0, watch).await?,
        )),
    }
}

/// Read a write's `len`-byte payload into slots of `slot` bytes, `sector` bytes in each:
/// what the reader already holds is copied there, the rest read from the socket straight
/// into the slots (vectored reads), with no buffer in between.
async fn read_payload_in_slots<R: PayloadSource>(
    reader: &mut RequestReader<R>,
    len: usize,
    sector: usize,
    slot: usize,
    watch: &mut StallWatch,
) -> std::io::Result<Vec<u8>> {
    let mut slots = SlotBuffer::new(len, sector, slot);
    let took = slots.fill_from(reader.buffer());
    reader.consume(took);
    while slots.missing() > 0 {
        let read = std::future::poll_fn(|cx| reader.get_mut().poll_read_slots(cx, &mut slots));
        if unless_stalled(watch, read).await? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
    }
    Ok(slots.finish())
}

/// Read a write's `len`-byte payload into a buffer that is not zeroed first: the bytes read
/// fill it. Why: zeroing a fresh 4 MiB buffer (and faulting in its pages) showed as 4-5% of
/// the server's CPU under 4 MiB writes on RADOS (docs/BENCHMARKS.md, "Smaller metadata for
/// large writes"). The buffer has `headroom` bytes of spare capacity for the device
/// ([`PayloadPlacement::Contiguous`]).
async fn read_payload<R: AsyncRead + Unpin>(
    reader: &mut R,
    len: usize,
    headroom: usize,
    watch: &mut StallWatch,
) -> std::io::Result<Vec<u8>> {
    let mut payload = Vec::with_capacity(len + headroom);
    let mut limited = (&mut *reader).take(len as u64);
    while payload.len() < len {
        if unless_stalled(watch, limited.read_buf(&mut payload)).await? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
    }
    Ok(payload)
}

/// Read a request header; `Ok(false)` on a clean end of stream before its first byte.
/// Between requests a client may be idle as long as it likes; within one, it counts as
/// stalled ([`unless_stalled`]).
async fn read_header<R: AsyncRead + Unpin>(
    reader: &mut R,
    header: &mut [u8; REQUEST_HEADER_LEN],
    watch: &mut StallWatch,
) -> std::io::Result<bool> {
    let n = reader.read(&mut header[..]).await?;
    if n == 0 {
        return Ok(false);
    }
    unless_stalled(watch, reader.read_exact(&mut header[n..])).await?;
    Ok(true)
}

/// Bytes of replies gathered before they go to the socket together.
const REPLY_BUFFER: usize = 64 * 1024;

/// Buffers one vectored write takes at most (`IOV_MAX` on Linux).
const MAX_WRITE_PIECES: usize = 1024;

/// Queue one reply on `writer`: its header and its data's pieces (one, or one per sector when
/// the data is still in its slots) in vectored writes, so that a reply that does not fit the
/// buffer (a read of 64 KiB or more) goes out after whatever the buffer held with one system
/// call for its header and data. Why: written one after the other, the header went into the
/// buffer and was flushed alone before the data, two system calls per large read instead of
/// one.
async fn write_frame<W: AsyncWrite + Unpin>(
    writer: &mut BufWriter<W>,
    frame: &Frame,
    watch: &mut StallWatch,
) -> std::io::Result<()> {
    let mut body = frame.body.pieces();
    if body.len() <= 1 {
        // Every reply but a slotted read's: no list of pieces to allocate.
        let body = body.next().unwrap_or_default();
        return write_pieces(writer, &mut [&frame.head[..], body], watch).await;
    }
    let mut pieces: Vec<&[u8]> = std::iter::once(&frame.head[..]).chain(body).collect();
    write_pieces(writer, &mut pieces, watch).await
}

/// Write `pieces` in order, in vectored writes of at most [`MAX_WRITE_PIECES`] buffers.
async fn write_pieces<W: AsyncWrite + Unpin>(
    writer: &mut BufWriter<W>,
    pieces: &mut [&[u8]],
    watch: &mut StallWatch,
) -> std::io::Result<()> {
    let mut at = 0;
    while at < pieces.len() {
        if pieces[at].is_empty() {
            at += 1;
            continue;
        }
        let rest = &pieces[at..];
        let mut n = if rest.len() <= 2 {
            let next = rest.get(1).copied().unwrap_or_default();
            let slices = [std::io::IoSlice::new(rest[0]), std::io::IoSlice::new(next)];
            unless_stalled(watch, writer.write_vectored(&slices)).await?
        } else {
            let slices: Vec<std::io::IoSlice<'_>> = rest
                .iter()
                .take(MAX_WRITE_PIECES)
                .map(|piece| std::io::IoSlice::new(piece))
                .collect();
            unless_stalled(watch, writer.write_vectored(&slices)).await?
        };
        if n == 0 {
            return Err(std::io::ErrorKind::WriteZero.into());
        }
        while n > 0 {
            let piece = pieces[at];
            if n >= piece.len() {
                n -= piece.len();
                at += 1;
            } else {
                pieces[at] = &piece[n..];
                n = 0;
            }
        }
    }
    Ok(())
}

/// Write the replies as they come; on a failure, tell the request loop (`failed`) and drop
/// the replies still queued, which gives their budget back.
async fn write_replies<W: AsyncWrite + Unpin>(
    writer: W,
    mut queue: mpsc::UnboundedReceiver<Reply>,
    peer: String,
    budget: Arc<ServerBudget>,
    failed: watch::Sender<bool>,
) -> std::io::Result<()> {
    let mut writer = BufWriter::with_capacity(REPLY_BUFFER, writer);
    let mut watch = StallWatch::new(budget);
    let written = async {
        while let Some(reply) = queue.recv().await {
            write_frame(&mut writer, &reply.frame, &mut watch).await?;
            drop(reply);
            // Coalesce replies that are ready into one write to the socket.
            while let Ok(reply) = queue.try_recv() {
                write_frame(&mut writer, &reply.frame, &mut watch).await?;
            }
            unless_stalled(&mut watch, writer.flush()).await?;
        }
        Ok(())
    }
    .await;
    if let Err(e) = written {
        // Stalled: the request loop must end the connection too (the client may go on
        // sending requests). Other failures (the client went away) end it there anyway.
        if is_stall(&e) {
            let _ = failed.send(true);
        }
        return Err(e);
    }
    tracing::trace!(peer, "all replies sent");
    unless_stalled(&mut watch, writer.shutdown()).await
}

struct Context {
    device: Arc<dyn BlockDevice>,
    structured: bool,
    block_status: bool,
    /// Storage failures (IO, a full store) logged at most once per
    /// [`FAILURE_LOG_INTERVAL`] for each kind of request: a read's failure does not hide the
    /// different one of the write or flush after it.
    io_failures: [FailureLog; LOGGED_COMMANDS],
    full_failures: [FailureLog; LOGGED_COMMANDS],
}

/// Request kinds whose failures are counted apart (`NBD_CMD_*` up to block status; any later
/// command shares the last slot).
const LOGGED_COMMANDS: usize = 8;

/// The [`FailureLog`] of `command` among `logs`.
fn failure_log(logs: &[FailureLog; LOGGED_COMMANDS], command: u16) -> &FailureLog {
    &logs[usize::from(command).min(LOGGED_COMMANDS - 1)]
}

/// How often one kind of storage failure is logged at most. A full store or a storage outage
/// fails every request, and each was an ERROR line of its own: one 512 MiB fill gave 339, a
/// guest's small writes give thousands. Failed authentication is logged every time: each
/// names its sector.
const FAILURE_LOG_INTERVAL: std::time::Duration = std::time::Duration::from_secs(10);

/// When one kind of failure was last logged, and how many were left out since.
#[derive(Default)]
struct FailureLog {
    last: std::sync::Mutex<Option<std::time::Instant>>,
    left_out: std::sync::atomic::AtomicU64,
}

impl FailureLog {
    /// `Some(n)`: log this failure, after `n` left out since the last one logged; `None`:
    /// one was logged less than [`FAILURE_LOG_INTERVAL`] before `now`.
    fn admit(&self, now: std::time::Instant) -> Option<u64> {
        use std::sync::atomic::Ordering;
        let mut last = self.last.lock().unwrap_or_else(|e| e.into_inner());
        match *last {
            Some(at) if now.saturating_duration_since(at) < FAILURE_LOG_INTERVAL => {
                self.left_out.fetch_add(1, Ordering::Relaxed);
                None
            }
            _ => {
                *last = Some(now);
                Some(self.left_out.swap(0, Ordering::Relaxed))
            }
        }
    }
}

/// What a logged failure says of those of its kind left out before it.
fn left_out_note(left_out: u64) -> String {
    match left_out {
        0 => String::new(),
        n => format!(
            " ({n} more such failure(s) since the last one logged were not logged: at most one \
             per {} s)",
            FAILURE_LOG_INTERVAL.as_secs()
        ),
    }
}

/// A request refused before reaching the device.
fn refuse(kind: DeviceErrorKind, message: impl Into<String>) -> DeviceError {
    DeviceError::new(kind, message)
}

impl Context {
    /// Run one request and build its complete reply.
    async fn handle(&self, request: Request, payload: WritePayload) -> Frame {
        let write = matches!(request.command, CMD_WRITE | CMD_WRITE_ZEROES);
        // A panic below (a bug in the device) is answered, not left unanswered: the client
        // would wait for this reply for ever (a guest's IO hung).
        let result = std::panic::AssertUnwindSafe(self.run(&request, payload))
            .catch_unwind()
            .await
            .unwrap_or_else(|_| {
                Err(DeviceError::new(
                    DeviceErrorKind::Io,
                    "the server failed while handling this request (a bug: see its log)",
                ))
            });
        match result {
            Ok(frame) => frame,
            Err(error) => {
                let errno = error.errno(write);
                match error.kind {
                    DeviceErrorKind::Integrity { .. } => {
                        tracing::error!(cookie = request.cookie, offset = request.offset, length = request.length, error = %error.message, "request failed authentication")
                    }
                    DeviceErrorKind::Io => {
                        if let Some(left_out) = failure_log(&self.io_failures, request.command)
                            .admit(std::time::Instant::now())
                        {
                            tracing::error!(cookie = request.cookie, command = request.command, error = %error.message, "request failed{}", left_out_note(left_out))
                        }
                    }
                    // The client sees ENOSPC (qemu pauses its guest); whoever must free space
                    // learns it here.
                    DeviceErrorKind::NoSpace => {
                        if let Some(left_out) = failure_log(&self.full_failures, request.command)
                            .admit(std::time::Instant::now())
                        {
                            tracing::error!(cookie = request.cookie, command = request.command, error = %error.message, "request failed: the storage is full{}", left_out_note(left_out))
                        }
                    }
                    _ => {
                        tracing::debug!(cookie = request.cookie, command = request.command, error = %error.message, "request refused")
                    }
                }
                if self.structured {
                    let offset = match error.kind {
                        DeviceErrorKind::Integrity { offset } if request.command == CMD_READ => {
                            Some(offset.clamp(
                                request.offset,
                                request.offset + request.length.max(1) as u64 - 1,
                            ))
                        }
                        _ => None,
                    };
                    error_chunk(request.cookie, errno, offset, &error.message).into()
                } else {
                    let mut frame = Vec::with_capacity(SIMPLE_REPLY_LEN);
                    simple_reply(request.cookie, errno as u32, &mut frame);
                    frame.into()
                }
            }
        }
    }

    /// FUA is allowed on every command: the server advertises `NBD_FLAG_SEND_FUA`, and the
    /// protocol then requires it be accepted everywhere (a command that writes nothing has
    /// nothing to persist).
    fn check_flags(&self, request: &Request, allowed: u16) -> Result<(), DeviceError> {
        let allowed = allowed | CMD_FLAG_FUA;
        if request.flags & !allowed != 0 {
            return Err(refuse(
                DeviceErrorKind::Invalid,
                format!(
                    "flags {:#x} are not valid for command {}",
                    request.flags & !allowed,
                    request.command
                ),
            ));
        }
        Ok(())
    }

    fn check_range(&self, request: &Request) -> Result<(), DeviceError> {
        let size = self.device.size();
        let end = request.offset.checked_add(request.length as u64);
        if end.is_none_or(|end| end > size) {
            return Err(refuse(
                DeviceErrorKind::OutOfRange,
                format!(
                    "[{}, +{}) goes past the end of the {size}-byte export",
                    request.offset, request.length
                ),
            ));
        }
        Ok(())
    }

    fn check_writable(&self) -> Result<(), DeviceError> {
        if self.device.read_only() {
            return Err(refuse(DeviceErrorKind::ReadOnly, "the export is read-only"));
        }
        Ok(())
    }

    /// A success reply with no payload.
    fn done(&self, cookie: u64) -> Vec<u8> {
        let mut frame = Vec::with_capacity(STRUCTURED_HEADER_LEN);
        if self.structured {
            chunk_header(cookie, REPLY_FLAG_DONE, REPLY_TYPE_NONE, 0, &mut frame);
        } else {
            simple_reply(cookie, 0, &mut frame);
        }
        frame
    }

    async fn run(&self, request: &Request, payload: WritePayload) -> Result<Frame, DeviceError> {
        let device = self.device.as_ref();
        let fua = request.flags & CMD_FLAG_FUA != 0;
        match request.command {
            CMD_READ => {
                self.check_flags(request, CMD_FLAG_FUA | CMD_FLAG_DF)?;
                if request.length > MAX_PAYLOAD {
                    return Err(refuse(
                        DeviceErrorKind::Invalid,
                        format!(
                            "read of {} bytes is over the {MAX_PAYLOAD}-byte maximum",
                            request.length
                        ),
                    ));
                }
                self.check_range(request)?;
                let len = request.length as usize;
                // The data goes out in the device's own buffer (an ivdisk image decrypts the
                // store's in place), after a header of its own.
                let body = device.read_reply(request.offset, len).await?;
                if body.len() != len {
                    return Err(refuse(
                        DeviceErrorKind::Io,
                        format!(
                            "the device returned {} bytes for a {len}-byte read",
                            body.len()
                        ),
                    ));
                }
                if self.structured && len == 0 {
                    // An OFFSET_DATA chunk must carry data; an empty read is just "done".
                    return Ok(self.done(request.cookie).into());
                }
                let mut head;
                if self.structured {
                    head = Vec::with_capacity(STRUCTURED_HEADER_LEN + 8);
                    chunk_header(
                        request.cookie,
                        REPLY_FLAG_DONE,
                        REPLY_TYPE_OFFSET_DATA,
                        (8 + len) as u32,
                        &mut head,
                    );
                    head.extend_from_slice(&request.offset.to_be_bytes());
                } else {
                    head = Vec::with_capacity(SIMPLE_REPLY_LEN);
                    simple_reply(request.cookie, 0, &mut head);
                }
                Ok(Frame { head, body })
            }
            CMD_WRITE => {
                self.check_flags(request, CMD_FLAG_FUA)?;
                self.check_writable()?;
                self.check_range(request)?;
                // Handed over: an ivdisk image encrypts the payload in place.
                device.write_payload(request.offset, payload).await?;
                if fua {
                    device.flush().await?;
                }
                Ok(self.done(request.cookie).into())
            }
            CMD_FLUSH => {
                self.check_flags(request, CMD_FLAG_FUA)?;
                device.flush().await?;
                Ok(self.done(request.cookie).into())
            }
            CMD_TRIM => {
                self.check_flags(request, CMD_FLAG_FUA)?;
                self.check_writable()?;
                self.check_range(request)?;
                device
                    .discard(request.offset, request.length as u64)
                    .await?;
                if fua {
                    device.flush().await?;
                }
                Ok(self.done(request.cookie).into())
            }
            CMD_WRITE_ZEROES => {
                self.check_flags(
                    request,
                    CMD_FLAG_FUA | CMD_FLAG_NO_HOLE | CMD_FLAG_FAST_ZERO,
                )?;
                self.check_writable()?;
                self.check_range(request)?;
                let may_unmap = request.flags & CMD_FLAG_NO_HOLE == 0;
                if request.flags & CMD_FLAG_FAST_ZERO != 0 {
                    if !device.fast_zero(may_unmap) {
                        return Err(refuse(
                            DeviceErrorKind::NotSupported,
                            "zeroing without unmapping encrypts and writes every sector: not \
                             fast",
                        ));
                    }
                    // The part of a block a request covers is zeroed by a read-modify-write,
                    // which costs what a write costs (proto.md lets the answer depend on the
                    // alignment).
                    let block = u64::from(device.preferred_block_size()).max(1);
                    let end = request.offset + u64::from(request.length);
                    if !request.offset.is_multiple_of(block)
                        || (!end.is_multiple_of(block) && end != device.size())
                    {
                        return Err(refuse(
                            DeviceErrorKind::NotSupported,
                            "zeroing part of a sector reads, encrypts and writes that sector: \
                             not fast",
                        ));
                    }
                }
                device
                    .write_zeroes(request.offset, request.length as u64, may_unmap)
                    .await?;
                if fua {
                    device.flush().await?;
                }
                Ok(self.done(request.cookie).into())
            }
            CMD_BLOCK_STATUS => {
                self.check_flags(request, CMD_FLAG_REQ_ONE)?;
                if !self.block_status {
                    return Err(refuse(
                        DeviceErrorKind::Invalid,
                        "block status needs the base:allocation context (NBD_OPT_SET_META_CONTEXT)",
                    ));
                }
                if request.length == 0 {
                    return Err(refuse(DeviceErrorKind::Invalid, "block status of 0 bytes"));
                }
                self.check_range(request)?;
                // A reply may cover less than asked (the client asks again for the rest):
                // the device is asked about at most `BLOCK_STATUS_SPAN` bytes, and at most
                // `BLOCK_STATUS_EXTENTS` descriptors are sent. A request of nearly 4 GiB on
                // an image of 4 KiB objects, alternately written, made the device look at a
                // million objects and the server hold tens of megabytes per request, for one
                // unit of budget.
                // And no more than `BLOCK_STATUS_EXTENTS` of the device's preferred blocks, so
                // its list of extents stays within what the request was charged for (a device
                // whose extents are blocks, alternately written, gave 2^18 per GiB).
                let granule = u64::from(device.preferred_block_size().max(512));
                let span = (request.length as u64)
                    .min(BLOCK_STATUS_SPAN)
                    .min(BLOCK_STATUS_EXTENTS as u64 * granule)
                    .min(device.allocation_span().max(granule));
                let mut extents = device.allocation(request.offset, span).await?;
                extents.retain(|e| e.len > 0);
                extents.truncate(BLOCK_STATUS_EXTENTS);
                if request.flags & CMD_FLAG_REQ_ONE != 0 {
                    extents.truncate(1);
                }
                if extents.is_empty() {
                    return Err(refuse(
                        DeviceErrorKind::Io,
                        "the device reported no extents",
                    ));
                }
                let mut frame = Vec::with_capacity(STRUCTURED_HEADER_LEN + 4 + 8 * extents.len());
                chunk_header(
                    request.cookie,
                    REPLY_FLAG_DONE,
                    REPLY_TYPE_BLOCK_STATUS,
                    (4 + 8 * extents.len()) as u32,
                    &mut frame,
                );
                frame.extend_from_slice(&BASE_ALLOCATION_ID.to_be_bytes());
                let mut left = request.length as u64;
                for extent in extents {
                    // Never past the request (REQ_ONE requires it; harmless otherwise).
                    let len = extent.len.min(left);
                    if len == 0 {
                        break;
                    }
                    left -= len;
                    let flags = if extent.allocated {
                        0
                    } else {
                        STATE_HOLE | STATE_ZERO
                    };
                    frame.extend_from_slice(&(len as u32).to_be_bytes());
                    frame.extend_from_slice(&flags.to_be_bytes());
                }
                // Fix the chunk length if extents were cut short above.
                let payload = (frame.len() - STRUCTURED_HEADER_LEN) as u32;
                frame[16..20].copy_from_slice(&payload.to_be_bytes());
                Ok(frame.into())
            }
            other => Err(refuse(
                DeviceErrorKind::Invalid,
                format!("unknown command {other}"),
            )),
        }
    }
}

#[cfg(test)]
mod failure_log_tests {
    use super::*;
    use std::time::{Duration, Instant};

    /// Storage failures are logged once per interval, the next one saying how many were
    /// left out (a full disk logged every refused request).
    #[test]
    fn failures_are_logged_once_per_interval_counting_the_rest() {
        let log = FailureLog::default();
        let start = Instant::now();
        assert_eq!(log.admit(start), Some(0));
        for i in 1..=338u64 {
            assert_eq!(log.admit(start + Duration::from_millis(i)), None);
        }
        assert_eq!(log.admit(start + FAILURE_LOG_INTERVAL), Some(338));
        assert_eq!(log.admit(start + FAILURE_LOG_INTERVAL), None);
        assert_eq!(log.admit(start + FAILURE_LOG_INTERVAL * 3), Some(1));
        assert!(left_out_note(338).contains("338 more"));
        // Kinds of request apart: a write's failure is not hidden by a read's.
        let logs: [FailureLog; LOGGED_COMMANDS] = Default::default();
        assert_eq!(failure_log(&logs, CMD_READ).admit(start), Some(0));
        assert_eq!(failure_log(&logs, CMD_WRITE).admit(start), Some(0));
        assert_eq!(failure_log(&logs, CMD_FLUSH).admit(start), Some(0));
        assert_eq!(failure_log(&logs, CMD_READ).admit(start), None);
        assert_eq!(failure_log(&logs, 99).admit(start), Some(0));
        assert_eq!(left_out_note(0), "");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A side of a connection whose server budget no other connection waits for.
    fn idle_watch() -> StallWatch {
        StallWatch::new(Arc::new(ServerBudget::new(std::time::Duration::from_secs(
            20,
        ))))
    }
    use std::io::IoSlice;
    use std::pin::Pin;

    /// A socket that takes at most `max` bytes per call, vectored or not, and keeps them.
    struct Trickle {
        max: usize,
        got: Vec<u8>,
        calls: usize,
    }

    impl AsyncWrite for Trickle {
        fn poll_write(
            self: Pin<&mut Self>,
            cx: &mut TaskContext<'_>,
            buf: &[u8],
        ) -> Poll<std::io::Result<usize>> {
            self.poll_write_vectored(cx, &[IoSlice::new(buf)])
        }

        fn poll_write_vectored(
            mut self: Pin<&mut Self>,
            _cx: &mut TaskContext<'_>,
            bufs: &[IoSlice<'_>],
        ) -> Poll<std::io::Result<usize>> {
            let mut room = self.max;
            let mut taken = 0;
            for buf in bufs {
                let n = buf.len().min(room);
                self.got.extend_from_slice(&buf[..n]);
                (room, taken) = (room - n, taken + n);
            }
            self.calls += 1;
            Poll::Ready(Ok(taken))
        }

        fn is_write_vectored(&self) -> bool {
            true
        }

        fn poll_flush(self: Pin<&mut Self>, _: &mut TaskContext<'_>) -> Poll<std::io::Result<()>> {
            Poll::Ready(Ok(()))
        }

        fn poll_shutdown(
            self: Pin<&mut Self>,
            _: &mut TaskContext<'_>,
        ) -> Poll<std::io::Result<()>> {
            Poll::Ready(Ok(()))
        }
    }

    fn bytes(n: usize, s: u8) -> Vec<u8> {
        (0..n).map(|i| (i as u8).wrapping_mul(31) ^ s).collect()
    }

    fn frame(head: usize, body: usize, seed: u8) -> Frame {
        Frame {
            head: bytes(head, seed),
            body: ReadReply::contiguous(bytes(body, seed.wrapping_add(1))),
        }
    }

    /// A frame whose data is `sectors` sectors of `sector` bytes in slots `meta` bytes longer.
    fn slotted_frame(sectors: usize, sector: usize, meta: usize, seed: u8) -> Frame {
        let slots = bytes(sectors * (sector + meta), seed.wrapping_add(1));
        Frame {
            head: bytes(16, seed),
            body: ReadReply::in_slots(slots, sectors * sector, sector, sector + meta),
        }
    }

    /// `frames` written through a reply buffer onto a socket that takes at most `max` bytes
    /// per call: what arrived, and in how many calls.
    async fn send_through(frames: &[Frame], max: usize) -> (Vec<u8>, usize) {
        let socket = Trickle {
            max,
            got: Vec::new(),
            calls: 0,
        };
        let mut writer = BufWriter::with_capacity(REPLY_BUFFER, socket);
        for f in frames {
            write_frame(&mut writer, f, &mut idle_watch())
                .await
                .unwrap();
        }
        writer.flush().await.unwrap();
        let socket = writer.into_inner();
        (socket.got, socket.calls)
    }

    /// A stream read through `RequestReader`, which records how many bytes each read asked
    /// the socket for and hands out at most `chunk` per read (a socket's partial reads).
    struct RecordingSource {
        data: Vec<u8>,
        at: usize,
        chunk: usize,
        asked: Vec<usize>,
    }

    impl AsyncRead for RecordingSource {
        fn poll_read(
            self: Pin<&mut Self>,
            _cx: &mut TaskContext<'_>,
            out: &mut ReadBuf<'_>,
        ) -> Poll<std::io::Result<()>> {
            let this = self.get_mut();
            this.asked.push(out.remaining());
            let n = out
                .remaining()
                .min(this.chunk)
                .min(this.data.len() - this.at);
            out.put_slice(&this.data[this.at..this.at + n]);
            this.at += n;
            Poll::Ready(Ok(()))
        }
    }

    /// Reading ahead the whole buffer while requests are small; after a large write, at most a
    /// header: the next large payload then comes from the socket straight into its own buffer
    /// (each read asks for what is left of it), past the reader's. Every byte arrives in order
    /// either way, and the stream's end is an end.
    #[tokio::test]
    async fn large_payloads_bypass_the_request_buffer() {
        let data: Vec<u8> = (0..600_000u32).map(|i| (i * 31 % 251) as u8).collect();
        let mut reader = RequestReader::new(RecordingSource {
            data: data.clone(),
            at: 0,
            chunk: 50_000,
            asked: Vec::new(),
        });
        // Small requests: a header's read fills the buffer as far as it goes.
        let mut header = [0u8; REQUEST_HEADER_LEN];
        assert!(read_header(&mut reader, &mut header, &mut idle_watch())
            .await
            .unwrap());
        assert_eq!(reader.get_ref().asked, vec![READ_AHEAD]);
        assert!(header[..] == data[..REQUEST_HEADER_LEN]);
        let mut at = REQUEST_HEADER_LEN;
        let small = read_payload(&mut reader, 4096, 0, &mut idle_watch())
            .await
            .unwrap();
        assert!(small[..] == data[at..at + 4096]);
        at += 4096;
        assert_eq!(
            reader.get_ref().asked.len(),
            1,
            "a small payload comes from the buffer"
        );

        // A large write: what is buffered is taken, the rest read straight into the payload.
        reader.read_ahead(false);
        let len = 200_000;
        let buffered = reader.buffer().len();
        let large = read_payload(&mut reader, len, 0, &mut idle_watch())
            .await
            .unwrap();
        assert!(large[..] == data[at..at + len]);
        at += len;
        let asked = reader.get_ref().asked[1..].to_vec();
        assert_eq!(
            asked[0],
            len - buffered,
            "the rest of the payload in one read"
        );
        assert!(asked.windows(2).all(|w| w[1] == w[0] - 50_000), "{asked:?}");
        assert!(reader.buffer().is_empty());

        // The next header: nothing read ahead of it.
        let before = reader.get_ref().asked.len();
        assert!(read_header(&mut reader, &mut header, &mut idle_watch())
            .await
            .unwrap());
        assert!(header[..] == data[at..at + REQUEST_HEADER_LEN]);
        at += REQUEST_HEADER_LEN;
        assert_eq!(reader.get_ref().asked[before..], [REQUEST_HEADER_LEN]);
        let large = read_payload(&mut reader, 300_000, 0, &mut idle_watch())
            .await
            .unwrap();
        assert!(large[..] == data[at..at + 300_000]);
        at += 300_000;
        assert!(reader.get_ref().asked[before + 1] == 300_000);

        // Small again: the whole buffer ahead; the end of the stream is an end.
        reader.read_ahead(true);
        let rest = read_payload(&mut reader, data.len() - at, 0, &mut idle_watch())
            .await
            .unwrap();
        assert!(rest[..] == data[at..]);
        assert!(!read_header(&mut reader, &mut header, &mut idle_watch())
            .await
            .unwrap());
    }

    /// A write's payload is read whole, exactly its length (the next request's bytes stay in
    /// the reader), into a buffer with the device's headroom as spare capacity.
    #[tokio::test]
    async fn payload_is_read_exactly_with_room_to_spare() {
        let stream: Vec<u8> = (0..10_000u32).map(|i| i as u8).collect();
        let mut reader = &stream[..];
        let payload = read_payload(&mut reader, 8192, 4096, &mut idle_watch())
            .await
            .unwrap();
        assert!(payload[..] == stream[..8192]);
        assert!(payload.capacity() >= 8192 + 4096);
        assert_eq!(
            reader.len(),
            10_000 - 8192,
            "nothing past the payload was read"
        );
        let short = read_payload(&mut reader, 4096, 0, &mut idle_watch())
            .await
            .unwrap_err();
        assert_eq!(short.kind(), std::io::ErrorKind::UnexpectedEof);
    }

    /// A payload placed in slots comes off a real socket into them: the part the reader had
    /// buffered (the request header's read took it) and the rest read straight into the
    /// slots, however the client's writes split it; the next request's bytes stay in the
    /// reader; a stream that ends early is an error; slots that `len` does not fill are read
    /// together.
    #[tokio::test]
    async fn payload_is_received_into_slots() {
        let (sector, slot, sectors) = (4096, 4128, 300);
        let len = sector * sectors;
        let stream: Vec<u8> = (0..len + 100).map(|i| (i * 7 % 253) as u8).collect();
        let (client, server) = tokio::net::UnixStream::pair().unwrap();
        let (read_half, _write_half) = server.into_split();
        let mut reader = RequestReader::new(read_half);
        let sent = stream.clone();
        let sender = tokio::spawn(async move {
            let mut client = client;
            for piece in sent.chunks(50_001) {
                client.write_all(piece).await.unwrap();
                tokio::task::yield_now().await;
            }
            client
        });
        // As the request loop does: a read through the buffer first.
        let mut first = [0u8; 16];
        reader.read_exact(&mut first).await.unwrap();
        assert!(first[..] == stream[..16]);
        let placement = PayloadPlacement::Slots { sector, slot };
        let payload = receive_payload(&mut reader, len - sector, placement, &mut idle_watch())
            .await
            .unwrap();
        assert_eq!(payload.slots(), Some((sector, slot)));
        let slots = payload.into_buf();
        assert_eq!(slots.len(), (sectors - 1) * slot);
        for (i, s) in slots.chunks_exact(slot).enumerate() {
            assert!(
                s[..sector] == stream[16 + i * sector..][..sector],
                "sector {i}"
            );
            assert!(s[sector..].iter().all(|&b| b == 0), "slot {i}'s tail");
        }
        let mut rest = vec![0u8; sector - 16 + 100];
        reader.read_exact(&mut rest).await.unwrap();
        assert!(
            rest[..] == stream[len - sector + 16..],
            "the bytes after the payload"
        );
        // Not whole sectors: read together.
        let client = sender.await.unwrap();
        let mut client = client;
        client.write_all(&stream[..1000]).await.unwrap();
        let payload = receive_payload(&mut reader, 1000, placement, &mut idle_watch())
            .await
            .unwrap();
        assert_eq!(payload.slots(), None);
        assert!(payload.into_buf() == stream[..1000]);
        // Cut short.
        client.write_all(&stream[..5000]).await.unwrap();
        drop(client);
        let short = receive_payload(&mut reader, 2 * sector, placement, &mut idle_watch())
            .await
            .unwrap_err();
        assert_eq!(short.kind(), std::io::ErrorKind::UnexpectedEof);
    }

    /// Replies arrive whole and in order however the socket splits its writes, and a large
    /// reply after an empty buffer takes one call for its header and data together.
    #[tokio::test]
    async fn frames_arrive_in_order_through_partial_writes() {
        let frames = [
            frame(16, 0, 1),
            frame(16, 4096, 2),
            frame(16, REPLY_BUFFER + 4096, 3),
            frame(32, 0, 4),
            frame(16, 3 * REPLY_BUFFER, 5),
            slotted_frame(3, 512, 32, 6),
            slotted_frame(40, 4096, 32, 7),
        ];
        let sent = |frames: &[Frame]| -> Vec<u8> {
            frames
                .iter()
                .flat_map(|f| {
                    f.head
                        .iter()
                        .copied()
                        .chain(f.body.pieces().flatten().copied())
                })
                .collect()
        };
        let expected = sent(&frames);
        assert_eq!(
            expected.len(),
            frames
                .iter()
                .map(|f| f.head.len() + f.body.len())
                .sum::<usize>(),
            "only the sectors of slotted replies are sent, not their metadata"
        );
        for max in [1, 7, 4097, usize::MAX] {
            let (got, _) = send_through(&frames, max).await;
            assert!(got == expected, "socket taking {max} bytes per call");
        }
        let (_, calls) = send_through(&frames[2..3], usize::MAX).await;
        assert_eq!(calls, 1, "header and data of a large reply in one call");
        // Slots: a reply of 1500 sectors takes two calls of at most `MAX_WRITE_PIECES`
        // buffers, and arrives whole however the socket splits it.
        let large = [slotted_frame(1500, 512, 32, 8)];
        for max in [4097, 100_000, usize::MAX] {
            let (got, calls) = send_through(&large, max).await;
            assert!(got == sent(&large), "socket taking {max} bytes per call");
            if max == usize::MAX {
                assert_eq!(calls, 2, "1501 buffers in two calls");
            }
        }
    }
}
