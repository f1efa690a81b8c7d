//! The negotiation phase: fixed newstyle handshake, then options until the client picks an
//! export (`NBD_OPT_GO` or `NBD_OPT_EXPORT_NAME`) or leaves. Every malformed option gets an
//! error reply when the stream is still in sync and a closed connection when it is not.
//! A server with TLS credentials takes no other option before `NBD_OPT_STARTTLS`; the caller
//! (`server.rs`) runs the TLS handshake and the options again over TLS ([`TlsState`]).

use std::sync::Arc;

use tokio::io::{AsyncRead, AsyncReadExt, AsyncWrite, AsyncWriteExt};

use crate::proto::*;
use crate::server::Export;
use crate::NbdError;

/// Option payloads above this are refused without being read (nothing legitimate is close).
const MAX_OPTION_LEN: u32 = 64 * 1024;
/// Options one client may send before it must pick an export.
const MAX_OPTIONS: usize = 1000;

/// The largest request payload (read or write length) accepted; advertised as the maximum
/// block size. 32 MiB is also what clients assume when no maximum is advertised.
pub const MAX_PAYLOAD: u32 = 32 * 1024 * 1024;

/// What the client chose.
pub(crate) struct Negotiated {
    pub export: Arc<Export>,
    pub structured: bool,
    /// `base:allocation` was selected for this export.
    pub block_status: bool,
}

/// Flags advertised for an export.
pub(crate) fn transmission_flags(export: &Export, structured: bool) -> u16 {
    let mut flags = TF_HAS_FLAGS | TF_SEND_FLUSH | TF_SEND_FUA | TF_CAN_MULTI_CONN;
    if structured {
        flags |= TF_SEND_DF;
    }
    if export.device.read_only() {
        flags |= TF_READ_ONLY;
    } else {
        flags |= TF_SEND_TRIM | TF_SEND_WRITE_ZEROES | TF_SEND_FAST_ZERO;
    }
    flags
}

struct Reader<'a> {
    data: &'a [u8],
}

impl<'a> Reader<'a> {
    fn u16(&mut self) -> Option<u16> {
        let (head, rest) = self.data.split_first_chunk::<2>()?;
        self.data = rest;
        Some(u16::from_be_bytes(*head))
    }
    fn u32(&mut self) -> Option<u32> {
        let (head, rest) = self.data.split_first_chunk::<4>()?;
        self.data = rest;
        Some(u32::from_be_bytes(*head))
    }
    fn string(&mut self, len: u32) -> Option<&'a str> {
        if self.data.len() < len as usize {
            return None;
        }
        let (head, rest) = self.data.split_at(len as usize);
        self.data = rest;
        std::str::from_utf8(head).ok()
    }
    fn done(&self) -> bool {
        self.data.is_empty()
    }
}

struct Session<'a, S> {
    stream: &'a mut S,
    peer: &'a str,
    exports: &'a [Arc<Export>],
    structured: bool,
    /// Export name `base:allocation` was last selected for.
    meta_for: Option<String>,
}

/// Where a connection stands with TLS (the NBD project's doc/proto.md, "TLS support").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum TlsState {
    /// The server has no TLS credentials ('NOTLS'): `NBD_OPT_STARTTLS` is refused.
    Off,
    /// The server insists on TLS and the client has not started it yet ('FORCEDTLS'):
    /// every option but `NBD_OPT_STARTTLS` and `NBD_OPT_ABORT` is refused with
    /// `NBD_REP_ERR_TLS_REQD`, and `NBD_OPT_EXPORT_NAME`, which cannot be refused, closes.
    Required,
    /// TLS is running on the connection.
    Active,
}

/// How option haggling ended.
pub(crate) enum Haggled {
    /// The client picked an export.
    Chosen(Negotiated),
    /// The client aborted or went away before choosing.
    Ended,
    /// `NBD_OPT_STARTTLS` was acknowledged: the caller runs the TLS handshake on the stream,
    /// then haggles on over TLS ([`options`] with [`TlsState::Active`]).
    StartTls,
}

/// Send the greeting and read the client's flags. `Ok(None)`: the client left before
/// answering; `Ok(Some(no_zeroes))` otherwise.
pub(crate) async fn greet<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    peer: &str,
) -> Result<Option<bool>, NbdError> {
    let io = |source| NbdError::Io {
        peer: peer.to_owned(),
        source,
    };
    let mut greeting = Vec::with_capacity(18);
    greeting.extend_from_slice(&NBDMAGIC.to_be_bytes());
    greeting.extend_from_slice(&IHAVEOPT.to_be_bytes());
    greeting.extend_from_slice(&(FLAG_FIXED_NEWSTYLE | FLAG_NO_ZEROES).to_be_bytes());
    stream.write_all(&greeting).await.map_err(io)?;
    stream.flush().await.map_err(io)?;

    let client_flags = match stream.read_u32().await {
        Ok(flags) => flags,
        Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(None),
        Err(e) => return Err(io(e)),
    };
    if client_flags & !(CLIENT_FIXED_NEWSTYLE | CLIENT_NO_ZEROES) != 0 {
        return Err(protocol(
            peer,
            format!("unknown client flags {client_flags:#x}"),
        ));
    }
    Ok(Some(client_flags & CLIENT_NO_ZEROES != 0))
}

/// Haggle over options until the client picks an export, leaves, or (with `tls` at
/// [`TlsState::Required`]) asks for TLS.
pub(crate) async fn options<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    peer: &str,
    exports: &[Arc<Export>],
    no_zeroes: bool,
    tls: TlsState,
) -> Result<Haggled, NbdError> {
    let io = |source| NbdError::Io {
        peer: peer.to_owned(),
        source,
    };
    let mut session = Session {
        stream,
        peer,
        exports,
        structured: false,
        meta_for: None,
    };
    let mut refused_without_tls = false;
    for _ in 0..MAX_OPTIONS {
        let magic = match session.stream.read_u64().await {
            Ok(m) => m,
            Err(e) if e.kind() == std::io::ErrorKind::UnexpectedEof => return Ok(Haggled::Ended),
            Err(e) => return Err(io(e)),
        };
        if magic != IHAVEOPT {
            return Err(protocol(peer, format!("bad option magic {magic:#x}")));
        }
        let option = session.stream.read_u32().await.map_err(io)?;
        let len = session.stream.read_u32().await.map_err(io)?;
        if len > MAX_OPTION_LEN {
            // The payload is not read, so the stream is out of sync: say why, then close.
            // `NBD_OPT_EXPORT_NAME` has no option replies (its client reads an export's size
            // and flags next): refused by closing alone, as the protocol says.
            if option != OPT_EXPORT_NAME {
                session
                    .reply_error(option, REP_ERR_TOO_BIG, "option payload too large")
                    .await?;
            }
            return Err(protocol(
                peer,
                format!(
                    "option {} with {len} bytes, over the {MAX_OPTION_LEN}-byte limit",
                    option_name(option)
                ),
            ));
        }
        let mut data = vec![0u8; len as usize];
        session.stream.read_exact(&mut data).await.map_err(io)?;
        tracing::debug!(peer, option, len, "NBD option");
        match (option, tls) {
            (OPT_STARTTLS, TlsState::Off) => {
                session
                    .reply_error(
                        option,
                        REP_ERR_POLICY,
                        "TLS is not set up on this server (ivdisk serve --tls-creds DIR)",
                    )
                    .await?;
                continue;
            }
            (OPT_STARTTLS, TlsState::Active) => {
                session
                    .reply_error(option, REP_ERR_INVALID, "TLS is already running")
                    .await?;
                continue;
            }
            (OPT_STARTTLS, TlsState::Required) => {
                if !data.is_empty() {
                    session
                        .reply_error(option, REP_ERR_INVALID, "NBD_OPT_STARTTLS takes no data")
                        .await?;
                    continue;
                }
                session.reply(option, REP_ACK, &[]).await?;
                return Ok(Haggled::StartTls);
            }
            (OPT_EXPORT_NAME, TlsState::Required) => {
                // This option has no error reply: closing is the only answer.
                return Err(protocol(
                    peer,
                    "chose an export without TLS, which this server requires \
                     (NBD_OPT_EXPORT_NAME before NBD_OPT_STARTTLS)"
                        .to_owned(),
                ));
            }
            (OPT_ABORT, _) => {}
            (_, TlsState::Required) => {
                // Once per connection: a client may send up to MAX_OPTIONS of them.
                if !refused_without_tls {
                    refused_without_tls = true;
                    tracing::warn!(
                        peer,
                        option = %option_name(option),
                        "a client asked for an option without TLS, which this server requires"
                    );
                }
                session
                    .reply_error(
                        option,
                        REP_ERR_TLS_REQD,
                        "this server requires TLS: start it first (NBD_OPT_STARTTLS)",
                    )
                    .await?;
                continue;
            }
            _ => {}
        }
        match option {
            OPT_EXPORT_NAME => {
                let name = std::str::from_utf8(&data).unwrap_or("\u{fffd}");
                let Some(export) = session.find(name) else {
                    // This option has no error reply: closing is the only answer.
                    // Escaped (`{:?}`): the name is the client's, and is logged.
                    return Err(protocol(peer, format!("unknown export {name:?}")));
                };
                let flags = transmission_flags(&export, session.structured);
                let mut reply = Vec::with_capacity(134);
                reply.extend_from_slice(&export.device.size().to_be_bytes());
                reply.extend_from_slice(&flags.to_be_bytes());
                if !no_zeroes {
                    reply.extend_from_slice(&[0u8; 124]);
                }
                session.stream.write_all(&reply).await.map_err(io)?;
                session.stream.flush().await.map_err(io)?;
                let block_status = session.meta_for.as_deref() == Some(export.name.as_str());
                return Ok(Haggled::Chosen(Negotiated {
                    export,
                    structured: session.structured,
                    block_status,
                }));
            }
            OPT_ABORT => {
                // The client may already be gone; the acknowledgement is a courtesy.
                let _ = session.reply(option, REP_ACK, &[]).await;
                return Ok(Haggled::Ended);
            }
            OPT_LIST => {
                if !data.is_empty() {
                    session
                        .reply_error(option, REP_ERR_INVALID, "NBD_OPT_LIST takes no data")
                        .await?;
                    continue;
                }
                for export in session.exports {
                    let mut payload = Vec::new();
                    payload.extend_from_slice(&(export.name.len() as u32).to_be_bytes());
                    payload.extend_from_slice(export.name.as_bytes());
                    payload.extend_from_slice(export.description.as_bytes());
                    session.reply(option, REP_SERVER, &payload).await?;
                }
                session.reply(option, REP_ACK, &[]).await?;
            }
            OPT_INFO | OPT_GO => {
                if let Some(export) = session.info(option, &data).await? {
                    if option == OPT_GO {
                        let block_status =
                            session.meta_for.as_deref() == Some(export.name.as_str());
                        return Ok(Haggled::Chosen(Negotiated {
                            export,
                            structured: session.structured,
                            block_status,
                        }));
                    }
                }
            }
            OPT_STRUCTURED_REPLY => {
                if !data.is_empty() {
                    session
                        .reply_error(
                            option,
                            REP_ERR_INVALID,
                            "NBD_OPT_STRUCTURED_REPLY takes no data",
                        )
                        .await?;
                    continue;
                }
                session.structured = true;
                session.reply(option, REP_ACK, &[]).await?;
            }
            OPT_LIST_META_CONTEXT | OPT_SET_META_CONTEXT => {
                session.meta_context(option, &data).await?;
            }
            _ => {
                session
                    .reply_error(option, REP_ERR_UNSUP, "option not supported by this server")
                    .await?;
            }
        }
    }
    Err(protocol(peer, format!("more than {MAX_OPTIONS} options")))
}

/// An option's name for messages: `NBD_OPT_GO`, or its number when unknown.
fn option_name(option: u32) -> String {
    let name = match option {
        OPT_EXPORT_NAME => "NBD_OPT_EXPORT_NAME",
        OPT_ABORT => "NBD_OPT_ABORT",
        OPT_LIST => "NBD_OPT_LIST",
        OPT_STARTTLS => "NBD_OPT_STARTTLS",
        OPT_INFO => "NBD_OPT_INFO",
        OPT_GO => "NBD_OPT_GO",
        OPT_STRUCTURED_REPLY => "NBD_OPT_STRUCTURED_REPLY",
        OPT_LIST_META_CONTEXT => "NBD_OPT_LIST_META_CONTEXT",
        OPT_SET_META_CONTEXT => "NBD_OPT_SET_META_CONTEXT",
        _ => return format!("option {option}"),
    };
    name.to_owned()
}

fn protocol(peer: &str, reason: String) -> NbdError {
    NbdError::Protocol {
        peer: peer.to_owned(),
        reason,
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> Session<'_, S> {
    async fn reply(&mut self, option: u32, reply: u32, payload: &[u8]) -> Result<(), NbdError> {
        let frame = option_reply(option, reply, payload);
        let peer = self.peer;
        let io = |source| NbdError::Io {
            peer: peer.to_owned(),
            source,
        };
        self.stream.write_all(&frame).await.map_err(io)?;
        self.stream.flush().await.map_err(io)
    }

    async fn reply_error(
        &mut self,
        option: u32,
        reply: u32,
        message: &str,
    ) -> Result<(), NbdError> {
        tracing::debug!(peer = self.peer, option, message, "NBD option refused");
        self.reply(option, reply, truncate_utf8(message, 4096).as_bytes())
            .await
    }

    /// The export by name; "" names the first (default) export unless one is named "" (which
    /// could not be reached otherwise).
    fn find(&self, name: &str) -> Option<Arc<Export>> {
        let named = self.exports.iter().find(|e| e.name == name).cloned();
        match name.is_empty() {
            true => named.or_else(|| self.exports.first().cloned()),
            false => named,
        }
    }

    /// `NBD_OPT_INFO` / `NBD_OPT_GO`: the export's size, flags and block sizes.
    async fn info(&mut self, option: u32, data: &[u8]) -> Result<Option<Arc<Export>>, NbdError> {
        let mut r = Reader { data };
        let parsed = (|| {
            let name_len = r.u32()?;
            let name = r.string(name_len)?;
            let count = r.u16()?;
            let mut requests = Vec::with_capacity(count as usize);
            for _ in 0..count {
                requests.push(r.u16()?);
            }
            r.done().then_some((name.to_owned(), requests))
        })();
        let Some((name, requests)) = parsed else {
            self.reply_error(option, REP_ERR_INVALID, "malformed NBD_OPT_INFO/GO request")
                .await?;
            return Ok(None);
        };
        let Some(export) = self.find(&name) else {
            self.reply_error(
                option,
                REP_ERR_UNKNOWN,
                &format!("no export named {name:?}"),
            )
            .await?;
            return Ok(None);
        };
        let mut payload = Vec::with_capacity(12);
        payload.extend_from_slice(&INFO_EXPORT.to_be_bytes());
        payload.extend_from_slice(&export.device.size().to_be_bytes());
        payload.extend_from_slice(&transmission_flags(&export, self.structured).to_be_bytes());
        self.reply(option, REP_INFO, &payload).await?;
        if requests.contains(&INFO_NAME) {
            let mut payload = INFO_NAME.to_be_bytes().to_vec();
            payload.extend_from_slice(export.name.as_bytes());
            self.reply(option, REP_INFO, &payload).await?;
        }
        if requests.contains(&INFO_DESCRIPTION) && !export.description.is_empty() {
            let mut payload = INFO_DESCRIPTION.to_be_bytes().to_vec();
            payload.extend_from_slice(export.description.as_bytes());
            self.reply(option, REP_INFO, &payload).await?;
        }
        // Always sent: the device takes any byte alignment (sub-sector IO is a
        // read-modify-write), so minimum 1, and the sector size is what it prefers.
        let mut payload = INFO_BLOCK_SIZE.to_be_bytes().to_vec();
        payload.extend_from_slice(&1u32.to_be_bytes());
        payload.extend_from_slice(&export.device.preferred_block_size().to_be_bytes());
        payload.extend_from_slice(&MAX_PAYLOAD.to_be_bytes());
        self.reply(option, REP_INFO, &payload).await?;
        self.reply(option, REP_ACK, &[]).await?;
        Ok(Some(export))
    }

    /// `NBD_OPT_LIST_META_CONTEXT` / `NBD_OPT_SET_META_CONTEXT`: only `base:allocation`.
    async fn meta_context(&mut self, option: u32, data: &[u8]) -> Result<(), NbdError> {
        if option == OPT_SET_META_CONTEXT {
            // Whatever happens next replaces the previous selection.
            self.meta_for = None;
        }
        if !self.structured {
            return self
                .reply_error(
                    option,
                    REP_ERR_INVALID,
                    "negotiate NBD_OPT_STRUCTURED_REPLY before metadata contexts",
                )
                .await;
        }
        let mut r = Reader { data };
        let parsed = (|| {
            let name_len = r.u32()?;
            let name = r.string(name_len)?;
            let count = r.u32()?;
            let mut queries = Vec::new();
            for _ in 0..count {
                let len = r.u32()?;
                queries.push(r.string(len)?.to_owned());
            }
            r.done().then_some((name.to_owned(), queries))
        })();
        let Some((name, queries)) = parsed else {
            return self
                .reply_error(
                    option,
                    REP_ERR_INVALID,
                    "malformed metadata context request",
                )
                .await;
        };
        let Some(export) = self.find(&name) else {
            return self
                .reply_error(
                    option,
                    REP_ERR_UNKNOWN,
                    &format!("no export named {name:?}"),
                )
                .await;
        };
        let selected = if option == OPT_SET_META_CONTEXT {
            queries.iter().any(|q| q == BASE_ALLOCATION)
        } else {
            // Listing: no query means "all"; "base:" is the namespace wildcard.
            queries.is_empty() || queries.iter().any(|q| q == "base:" || q == BASE_ALLOCATION)
        };
        if selected {
            // A listing names contexts without selecting them: its id is reserved, zero.
            let id = match option {
                OPT_SET_META_CONTEXT => BASE_ALLOCATION_ID,
                _ => 0,
            };
            let mut payload = id.to_be_bytes().to_vec();
            payload.extend_from_slice(BASE_ALLOCATION.as_bytes());
            self.reply(option, REP_META_CONTEXT, &payload).await?;
            if option == OPT_SET_META_CONTEXT {
                self.meta_for = Some(export.name.clone());
            }
        }
        self.reply(option, REP_ACK, &[]).await
    }
}
