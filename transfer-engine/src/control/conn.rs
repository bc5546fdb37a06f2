//! Control connections over tokio TCP: connect with retry, listen, send, receive, handshake.

use std::fmt;
use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::tcp::{OwnedReadHalf, OwnedWriteHalf};
use tokio::net::{TcpListener, TcpStream, ToSocketAddrs};
use tokio::time::Instant;

use super::auth::{Challenge, Proof, Secret, Side};
use super::channel::{ChannelError, Handshake, Opener, Sealer};
use super::frame::{
    DEFAULT_MAX_FRAME_LEN, FrameDecoder, FrameError, MsgKind, PROTOCOL_VERSION, encode_frame,
};
use super::msg::{
    Hello, HelloAck, Msg, Reject, RejectReason, Role, check_hello, check_self_consistent,
};

/// What went wrong on a control connection.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ControlError {
    /// Connecting failed with an error that retrying would not fix.
    #[error("connecting to {addr} failed")]
    Connect {
        /// Address as given.
        addr: String,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The deadline passed before any connection attempt succeeded.
    #[error("no connection to {addr} before the deadline after {attempts} attempts")]
    ConnectTimeout {
        /// Address as given.
        addr: String,
        /// Attempts made.
        attempts: u32,
        /// The last attempt's error, if an attempt finished.
        #[source]
        last: Option<io::Error>,
    },
    /// Binding the listener failed.
    #[error("binding {addr} failed")]
    Bind {
        /// Address as given.
        addr: String,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// Accepting a connection failed.
    #[error("accepting on {local} failed")]
    Accept {
        /// The listener's address.
        local: SocketAddr,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// Reading from or writing to the peer failed.
    #[error("{op} with {peer} failed")]
    Io {
        /// "read", "write", "flush", "shutdown".
        op: &'static str,
        /// The peer.
        peer: SocketAddr,
        /// The OS error.
        #[source]
        source: io::Error,
    },
    /// The peer sent bytes that are not a valid frame, or a message could not be framed.
    #[error("bad frame from or for {peer}")]
    Frame {
        /// The peer.
        peer: SocketAddr,
        /// What was wrong.
        #[source]
        source: FrameError,
    },
    /// An earlier fatal frame error left the stream out of step; nothing more can be read.
    #[error("connection to {peer} is unusable after an earlier framing error")]
    Broken {
        /// The peer.
        peer: SocketAddr,
    },
    /// The peer closed the connection during the handshake.
    #[error("{peer} closed the connection during the handshake, waiting for {waiting_for}")]
    PeerClosed {
        /// The peer.
        peer: SocketAddr,
        /// What the handshake was waiting for.
        waiting_for: &'static str,
    },
    /// The peer sent a message the handshake did not expect.
    #[error("{peer} sent {got} during the handshake, expected {expected}")]
    Unexpected {
        /// The peer.
        peer: SocketAddr,
        /// What was expected.
        expected: &'static str,
        /// What came.
        got: MsgKind,
    },
    /// The peer refused our Hello.
    #[error("{peer} refused us during the handshake: {reason}")]
    PeerRejected {
        /// The peer.
        peer: SocketAddr,
        /// The peer's reason.
        reason: RejectReason,
    },
    /// We refused the peer's Hello (and told it why).
    #[error("refused {peer} during the handshake: {reason}")]
    RejectedPeer {
        /// The peer.
        peer: SocketAddr,
        /// Our reason.
        reason: RejectReason,
    },
    /// The authenticated peer sent [`Msg::Probe`] in place of its Hello: it read ours and
    /// wanted nothing more ([`probe`]). Not a failure; the connection is over.
    #[error("{peer} probed us and left")]
    Probed {
        /// The peer.
        peer: SocketAddr,
    },
    /// The handshake did not finish before its deadline.
    #[error("handshake with {peer} did not finish before the deadline")]
    HandshakeTimeout {
        /// The peer.
        peer: SocketAddr,
    },
    /// The peer sent nothing, not even a heartbeat, for `after`: its host is gone or the link
    /// to it half-open.
    #[error("{peer} sent nothing for {after:?}")]
    Silent {
        /// The peer.
        peer: SocketAddr,
        /// How long it was silent.
        after: Duration,
    },
    /// The encrypted channel refused a record (a changed, dropped or forged byte): the connection
    /// is unusable from here on. Counted in [`channel::refused_records`](super::channel::refused_records).
    #[error("the channel with {peer} failed")]
    Channel {
        /// The peer.
        peer: SocketAddr,
        /// What failed.
        #[source]
        source: ChannelError,
    },
}

impl ControlError {
    /// Whether the handshake failed on authentication: we refused the peer's proof, or it
    /// refused ours.
    pub fn is_auth_failure(&self) -> bool {
        matches!(
            self,
            ControlError::RejectedPeer {
                reason: RejectReason::AuthFailed,
                ..
            } | ControlError::PeerRejected {
                reason: RejectReason::AuthFailed,
                ..
            }
        )
    }

    /// Whether one side refused the other's Hello for a reason trying again cannot change (another
    /// protocol version, role, layout, PP or TP configuration or backend, a wrong secret, a Hello
    /// that contradicts itself), as opposed to one that may pass later (a rank or sender still
    /// held, an instance not served yet) or a connection that failed.
    pub fn is_permanent_refusal(&self) -> bool {
        let reason = match self {
            ControlError::RejectedPeer { reason, .. }
            | ControlError::PeerRejected { reason, .. } => reason,
            _ => return false,
        };
        matches!(
            reason,
            RejectReason::VersionMismatch { .. }
                | RejectReason::RoleMismatch(_)
                | RejectReason::LayoutMismatch(_)
                | RejectReason::PpMismatch(_)
                | RejectReason::TpMismatch(_)
                | RejectReason::BackendMismatch { .. }
                | RejectReason::AuthFailed
                | RejectReason::InvalidHello(_)
        )
    }

    /// Whether accepting failed for one connection's own reason, its peer gone before the
    /// connection could be taken or set up (reset, aborted, no longer connected): that says
    /// nothing about the next connection, so the listener goes on at once. Any other accept error
    /// (no descriptors, buffers or memory; a broken listener) fails every accept alike for a while,
    /// and the listener pauses.
    pub fn is_peer_gone(&self) -> bool {
        matches!(
            self,
            ControlError::Accept { source, .. } if matches!(
                source.raw_os_error(),
                Some(libc::ENOTCONN | libc::ECONNABORTED | libc::ECONNRESET | libc::EPROTO)
            )
        )
    }
}

/// Connection errors worth retrying until the deadline: the peer may not be listening yet, or
/// its network may still be coming up.
fn retryable(kind: io::ErrorKind) -> bool {
    use io::ErrorKind as K;
    matches!(
        kind,
        K::ConnectionRefused
            | K::ConnectionReset
            | K::ConnectionAborted
            | K::TimedOut
            | K::Interrupted
            | K::HostUnreachable
            | K::NetworkUnreachable
    )
}

/// TCP keepalive: idle time before the first probe, time between probes, probes before the kernel
/// ends the connection (about 60 s for a vanished host).
const KEEPALIVE_IDLE: Duration = Duration::from_secs(30);
const KEEPALIVE_INTERVAL: Duration = Duration::from_secs(10);
const KEEPALIVE_PROBES: u32 = 3;

const FIRST_BACKOFF: Duration = Duration::from_millis(10);
const MAX_BACKOFF: Duration = Duration::from_millis(500);

/// The receiving half of a control connection.
#[derive(Debug)]
pub struct ControlReader {
    io: OwnedReadHalf,
    decoder: FrameDecoder,
    peer: SocketAddr,
    eof: bool,
    /// After the handshake: every byte read is a sealed record, opened into `decoder`.
    opener: Option<Opener>,
    /// The channel failed: nothing more is read.
    broken: bool,
}

impl ControlReader {
    /// The next message, or `None` once the peer closed the stream at a frame boundary.
    ///
    /// # Errors
    /// [`ControlError::Io`] on a socket error; [`ControlError::Frame`] on a bad frame (a
    /// truncated stream is [`FrameError::Truncated`]). After a fatal frame error (see
    /// [`FrameError::is_fatal`]) every later call returns [`ControlError::Broken`]; after a
    /// payload error the next call reads the next frame.
    ///
    /// # Cancel safety
    /// Cancel-safe. Bytes read so far, partial frames included, stay in the reader's buffer, so
    /// dropping this future (in `select!` or on a timeout) loses nothing and the next call
    /// resumes where this one stopped.
    pub async fn recv(&mut self) -> Result<Option<Msg>, ControlError> {
        let peer = self.peer;
        if self.decoder.is_poisoned() || self.broken {
            return Err(ControlError::Broken { peer });
        }
        loop {
            match self.decoder.decode_next() {
                Ok(Some(msg)) => return Ok(Some(msg)),
                Ok(None) => {}
                Err(source) => return Err(ControlError::Frame { peer, source }),
            }
            if self.eof {
                let partial_record = self
                    .opener
                    .as_mut()
                    .is_some_and(|o| !o.raw_mut().is_empty());
                return match self.decoder.finish() {
                    None if !partial_record => Ok(None),
                    None => Err(ControlError::Frame {
                        peer,
                        source: FrameError::Truncated { needed: 1, got: 0 },
                    }),
                    Some(source) => Err(ControlError::Frame { peer, source }),
                };
            }
            // Reserve only what the current frame (or record) still needs, capped, so a peer's
            // declared length never turns into an allocation before its bytes arrive.
            let (hint, buf) = match self.opener.as_mut() {
                Some(o) => (o.read_hint(), o.raw_mut()),
                None => (self.decoder.read_hint(), self.decoder.buf_mut()),
            };
            buf.reserve(hint.min(super::frame::READ_CHUNK));
            // read_buf is cancel-safe: if this future is dropped here, no byte was consumed.
            let n = self
                .io
                .read_buf(buf)
                .await
                .map_err(|source| ControlError::Io {
                    op: "read",
                    peer,
                    source,
                })?;
            if n == 0 {
                self.eof = true;
            }
            if let Some(o) = self.opener.as_mut()
                && let Err(source) = o.open(self.decoder.buf_mut())
            {
                self.broken = true;
                tracing::warn!(%peer, error = %source, "control channel refused a record: closing");
                return Err(ControlError::Channel { peer, source });
            }
        }
    }

    /// Reads everything after this point as sealed records. Bytes already buffered past the last
    /// frame read are the first of them.
    fn seal(&mut self, opener: Opener) -> Result<(), ControlError> {
        let peer = self.peer;
        let mut opener = opener;
        let early = std::mem::take(self.decoder.buf_mut());
        opener.raw_mut().extend_from_slice(&early);
        let opened = opener.open(self.decoder.buf_mut());
        self.opener = Some(opener);
        opened.map_err(|source| {
            self.broken = true;
            ControlError::Channel { peer, source }
        })
    }

    /// [`recv`](Self::recv), bounded by `silence` when it is given: a peer that sends nothing for
    /// that long ends with [`ControlError::Silent`].
    ///
    /// # Errors
    /// As [`recv`](Self::recv), and [`ControlError::Silent`].
    ///
    /// # Cancel safety
    /// Cancel-safe, as [`recv`](Self::recv).
    pub async fn recv_within(
        &mut self,
        silence: Option<Duration>,
    ) -> Result<Option<Msg>, ControlError> {
        let Some(after) = silence else {
            return self.recv().await;
        };
        let peer = self.peer;
        tokio::time::timeout(after, self.recv())
            .await
            .unwrap_or(Err(ControlError::Silent { peer, after }))
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> SocketAddr {
        self.peer
    }
}

/// The sending half of a control connection.
#[derive(Debug)]
pub struct ControlWriter {
    io: OwnedWriteHalf,
    /// Encoded (and, after the handshake, sealed) bytes not yet handed to the socket, starting at
    /// `written`.
    pending: Vec<u8>,
    written: usize,
    max_len: u32,
    peer: SocketAddr,
    /// After the handshake: every frame is sealed into records before it is queued.
    sealer: Option<Sealer>,
    /// A frame's plaintext, before sealing.
    plain: Vec<u8>,
}

impl ControlWriter {
    /// Sends one message.
    ///
    /// # Errors
    /// [`ControlError::Frame`] if the message would exceed the frame cap (nothing is sent);
    /// [`ControlError::Io`] on a socket error.
    ///
    /// # Cancel safety
    /// Not cancel-safe in the sense that a cancelled message may still be delivered: the stream
    /// never carries a torn frame, because whatever part of a frame was not yet written stays
    /// queued and is written first by the next `send` or [`flush`](Self::flush). So after a
    /// cancel, a message was sent whole, or will be by the next call, or (if the writer is
    /// dropped) not at all.
    pub async fn send(&mut self, msg: &Msg) -> Result<(), ControlError> {
        let peer = self.peer;
        self.flush_pending().await?;
        match self.sealer.as_mut() {
            None => encode_frame(msg, self.max_len, &mut self.pending)
                .map_err(|source| ControlError::Frame { peer, source })?,
            Some(sealer) => {
                self.plain.clear();
                encode_frame(msg, self.max_len, &mut self.plain)
                    .map_err(|source| ControlError::Frame { peer, source })?;
                sealer
                    .seal(&self.plain, &mut self.pending)
                    .map_err(|source| ControlError::Channel { peer, source })?;
                if self.plain.capacity() > 1 << 20 {
                    self.plain = Vec::new();
                }
            }
        }
        self.flush_pending().await
    }

    /// Writes whatever a cancelled `send` left queued.
    ///
    /// # Errors
    /// [`ControlError::Io`] on a socket error.
    ///
    /// # Cancel safety
    /// Cancel-safe: progress is recorded after every write, and the rest stays queued.
    pub async fn flush(&mut self) -> Result<(), ControlError> {
        self.flush_pending().await
    }

    /// Sends [`Msg::Close`] and shuts down the sending direction (the peer's `recv` then ends
    /// with `None`).
    ///
    /// # Errors
    /// As [`send`](Self::send), and [`ControlError::Io`] if the shutdown fails.
    ///
    /// # Cancel safety
    /// As [`send`](Self::send): a cancelled close may leave Close queued but unsent.
    pub async fn close(mut self) -> Result<(), ControlError> {
        self.send(&Msg::Close).await?;
        let peer = self.peer;
        self.io.shutdown().await.map_err(|source| ControlError::Io {
            op: "shutdown",
            peer,
            source,
        })
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> SocketAddr {
        self.peer
    }

    async fn flush_pending(&mut self) -> Result<(), ControlError> {
        let peer = self.peer;
        while self.written < self.pending.len() {
            // Each `write` either completes with a count or does nothing, so updating `written`
            // right after it keeps the queue exact across cancellation.
            let n = self
                .io
                .write(&self.pending[self.written..])
                .await
                .map_err(|source| ControlError::Io {
                    op: "write",
                    peer,
                    source,
                })?;
            if n == 0 {
                return Err(ControlError::Io {
                    op: "write",
                    peer,
                    source: io::ErrorKind::WriteZero.into(),
                });
            }
            self.written += n;
        }
        self.pending.clear();
        self.written = 0;
        // Don't keep a large Hello's buffer for the connection's life.
        if self.pending.capacity() > 1 << 20 {
            self.pending = Vec::new();
        }
        Ok(())
    }
}

/// A control connection: a framed, message-level view of one TCP stream.
#[derive(Debug)]
pub struct Connection {
    reader: ControlReader,
    writer: ControlWriter,
    side: Side,
    /// The Noise prologue's label of the protocol this connection speaks (the control
    /// connection's unless set with [`set_label`](Self::set_label)).
    label: Option<&'static [u8]>,
}

impl Connection {
    /// Connects to `addr`, retrying refused or unreachable attempts with a growing backoff until
    /// `deadline`, since the peer may start later than we do.
    ///
    /// # Errors
    /// [`ControlError::ConnectTimeout`] when the deadline passes (with the last attempt's
    /// error), [`ControlError::Connect`] at once for errors that retrying would not fix (an
    /// unresolvable name, an invalid address).
    ///
    /// # Cancel safety
    /// Cancel-safe: nothing is held between attempts; a dropped future leaves no connection.
    pub async fn connect<A>(addr: A, deadline: Instant) -> Result<Self, ControlError>
    where
        A: ToSocketAddrs + fmt::Display,
    {
        let mut attempts = 0u32;
        let mut last = None;
        let mut backoff = FIRST_BACKOFF;
        loop {
            attempts += 1;
            match tokio::time::timeout_at(deadline, TcpStream::connect(&addr)).await {
                Ok(Ok(stream)) => {
                    tracing::debug!(%addr, attempts, "control connection established");
                    return Self::from_stream(stream, Side::Dialer).map_err(|source| {
                        ControlError::Connect {
                            addr: addr.to_string(),
                            source,
                        }
                    });
                }
                Ok(Err(e)) if retryable(e.kind()) => {
                    tracing::trace!(%addr, attempts, error = %e, "control connect failed, retrying");
                    last = Some(e);
                }
                Ok(Err(source)) => {
                    return Err(ControlError::Connect {
                        addr: addr.to_string(),
                        source,
                    });
                }
                Err(_) => break,
            }
            let now = Instant::now();
            if now >= deadline {
                break;
            }
            tokio::time::sleep_until((now + backoff).min(deadline)).await;
            backoff = (backoff * 2).min(MAX_BACKOFF);
        }
        Err(ControlError::ConnectTimeout {
            addr: addr.to_string(),
            attempts,
            last,
        })
    }

    /// Wraps an established stream, with the default frame cap. `side` says which end connected
    /// (it enters the authentication transcript).
    ///
    /// # Errors
    /// The OS error if the peer address cannot be read (the socket is not connected).
    pub fn from_stream(stream: TcpStream, side: Side) -> io::Result<Self> {
        let peer = stream.peer_addr()?;
        // Control messages are small and latency-bound; do not let Nagle hold them back.
        stream.set_nodelay(true)?;
        // Beside the engines' heartbeats: the kernel, too, probes a connection that carries
        // nothing, so even an engine with heartbeats off learns of a host that vanished.
        socket2::SockRef::from(&stream).set_tcp_keepalive(
            &socket2::TcpKeepalive::new()
                .with_time(KEEPALIVE_IDLE)
                .with_interval(KEEPALIVE_INTERVAL)
                .with_retries(KEEPALIVE_PROBES),
        )?;
        let (r, w) = stream.into_split();
        Ok(Self {
            reader: ControlReader {
                io: r,
                decoder: FrameDecoder::new(DEFAULT_MAX_FRAME_LEN),
                peer,
                eof: false,
                opener: None,
                broken: false,
            },
            writer: ControlWriter {
                io: w,
                pending: Vec::new(),
                written: 0,
                max_len: DEFAULT_MAX_FRAME_LEN,
                peer,
                sealer: None,
                plain: Vec::new(),
            },
            side,
            label: None,
        })
    }

    /// Makes this connection's handshake speak the protocol of `label` (see
    /// [`channel::MESH_LABEL`](super::channel::MESH_LABEL)): both ends must set the same one, or
    /// authentication fails. Call before the handshake.
    pub fn set_label(&mut self, label: &'static [u8]) {
        self.label = Some(label);
    }

    /// Which end of the TCP connection this side is.
    pub fn side(&self) -> Side {
        self.side
    }

    /// Sets the payload cap for both directions (a frame above it is refused unread, and we
    /// refuse to send one).
    #[must_use]
    pub fn with_max_frame_len(mut self, max_len: u32) -> Self {
        self.writer.max_len = max_len;
        self.reader.decoder.set_max_len(max_len);
        self
    }

    /// The peer's address.
    pub fn peer_addr(&self) -> SocketAddr {
        self.reader.peer
    }

    /// Sends one message; see [`ControlWriter::send`].
    ///
    /// # Errors
    /// As [`ControlWriter::send`].
    ///
    /// # Cancel safety
    /// As [`ControlWriter::send`]: no torn frame, but a cancelled message may still go out.
    pub async fn send(&mut self, msg: &Msg) -> Result<(), ControlError> {
        self.writer.send(msg).await
    }

    /// Receives one message; see [`ControlReader::recv`].
    ///
    /// # Errors
    /// As [`ControlReader::recv`].
    ///
    /// # Cancel safety
    /// Cancel-safe, as [`ControlReader::recv`].
    pub async fn recv(&mut self) -> Result<Option<Msg>, ControlError> {
        self.reader.recv().await
    }

    /// Sends Close and shuts down our sending direction; see [`ControlWriter::close`].
    ///
    /// # Errors
    /// As [`ControlWriter::close`].
    ///
    /// # Cancel safety
    /// As [`ControlWriter::close`].
    pub async fn close(self) -> Result<(), ControlError> {
        self.writer.close().await
    }

    /// Splits into halves that two tasks can own, one receiving, one sending.
    pub fn into_split(self) -> (ControlReader, ControlWriter) {
        (self.reader, self.writer)
    }
}

/// Accepts control connections.
#[derive(Debug)]
pub struct Listener {
    inner: TcpListener,
    local: SocketAddr,
}

impl Listener {
    /// Binds to `addr` (port 0 picks a free port; see [`local_addr`](Self::local_addr)).
    ///
    /// # Errors
    /// [`ControlError::Bind`].
    ///
    /// # Cancel safety
    /// Cancel-safe: a dropped future binds nothing that outlives it.
    pub async fn bind<A>(addr: A) -> Result<Self, ControlError>
    where
        A: ToSocketAddrs + fmt::Display,
    {
        let bind_err = |source| ControlError::Bind {
            addr: addr.to_string(),
            source,
        };
        let inner = TcpListener::bind(&addr).await.map_err(bind_err)?;
        let local = inner.local_addr().map_err(|source| ControlError::Bind {
            addr: addr.to_string(),
            source,
        })?;
        Ok(Self { inner, local })
    }

    /// Takes over a socket that is already bound and listening (its port was held from the moment
    /// it was bound, so nothing else could take it in between). Must run inside a tokio runtime.
    ///
    /// # Errors
    /// [`ControlError::Bind`] when the socket cannot be made non-blocking or registered with the
    /// runtime.
    pub fn from_std(socket: std::net::TcpListener) -> Result<Self, ControlError> {
        let addr = socket
            .local_addr()
            .map_or_else(|_| "a pre-bound socket".to_string(), |a| a.to_string());
        let bind_err = |source| ControlError::Bind {
            addr: addr.clone(),
            source,
        };
        socket.set_nonblocking(true).map_err(bind_err)?;
        let local = socket.local_addr().map_err(bind_err)?;
        let inner = TcpListener::from_std(socket).map_err(bind_err)?;
        Ok(Self { inner, local })
    }

    /// The bound address.
    pub fn local_addr(&self) -> SocketAddr {
        self.local
    }

    /// Waits for the next peer.
    ///
    /// # Errors
    /// [`ControlError::Accept`].
    ///
    /// # Cancel safety
    /// Cancel-safe, as tokio's `TcpListener::accept`: no connection is lost if the future is
    /// dropped.
    pub async fn accept(&self) -> Result<Connection, ControlError> {
        let local = self.local;
        let (stream, _) = self
            .inner
            .accept()
            .await
            .map_err(|source| ControlError::Accept { local, source })?;
        Connection::from_stream(stream, Side::Listener)
            .map_err(|source| ControlError::Accept { local, source })
    }
}

/// Runs the symmetric handshake with [`check_hello`] as the only acceptance rule.
///
/// See [`handshake_with`].
///
/// # Errors
/// As [`handshake_with`].
///
/// # Cancel safety
/// Not cancel-safe: a dropped handshake leaves the connection mid-protocol; drop the connection
/// too. Pass a deadline instead of wrapping it in a timeout.
pub async fn handshake(
    conn: &mut Connection,
    local: &Hello,
    secret: &Secret,
    deadline: Instant,
) -> Result<Hello, ControlError> {
    handshake_with(conn, local, secret, deadline, |_| Ok(())).await
}

/// Largest frame accepted before the peer is authenticated: a challenge, a proof or a reject.
const AUTH_MAX_FRAME: u32 = 1024;

/// Authenticates the peer, then runs the symmetric Hello exchange, and returns the peer's Hello
/// once both sides accepted.
///
/// Both sides:
/// 1. send a [`Challenge`] (fresh nonce, role) and read the peer's; frames above 1 KiB are refused
///    until step 2 is done, so an unauthenticated peer cannot make us buffer more;
/// 2. the dialer sends its proof of `secret` over both challenges ([`Secret::prove`]); the listener
///    checks it and only then sends its own, which the dialer checks; a wrong proof is answered with
///    [`RejectReason::AuthFailed`]. So a client that merely connects gets no proof to guess the secret
///    from; nothing but challenges and proofs has been sent so far;
/// 3. send Hello; read the peer's Hello; check that it claims the role of its challenge, then check
///    it with [`check_hello`] and with `accept` (for what only the application knows, such as a rank
///    already connected); send HelloAck or Reject; read the peer's verdict.
///
/// A side that rejects still reads the peer's verdict before returning, so its Reject is not lost
/// to a reset when the caller drops the connection. A frame with another protocol version is
/// answered with [`RejectReason::VersionMismatch`], since the header layout and the Reject kind are
/// the same in every version.
///
/// # Errors
/// [`ControlError::RejectedPeer`] if we refused the peer (our reason is sent to it; a failed proof
/// is [`RejectReason::AuthFailed`]); [`ControlError::PeerRejected`] if it refused us (its reason);
/// [`ControlError::HandshakeTimeout`] at the deadline; [`ControlError::PeerClosed`],
/// [`ControlError::Unexpected`], [`ControlError::Frame`] or [`ControlError::Io`] when the peer
/// misbehaves or goes away.
///
/// # Cancel safety
/// Not cancel-safe: a dropped handshake leaves the connection mid-protocol; drop the connection
/// too. Pass a deadline instead of wrapping it in a timeout.
pub async fn handshake_with<F>(
    conn: &mut Connection,
    local: &Hello,
    secret: &Secret,
    deadline: Instant,
    accept: F,
) -> Result<Hello, ControlError>
where
    F: FnOnce(&Hello) -> Result<(), RejectReason>,
{
    handshake_timed(conn, local, secret, deadline, accept, false).await
}

/// [`handshake_with`] for a listener that also answers probes: an authenticated dialer that sends
/// [`Msg::Probe`] in place of its Hello has read ours and leaves, and this returns
/// [`ControlError::Probed`] (see [`probe`]). Other listeners refuse a Probe as a protocol error.
///
/// # Errors
/// As [`handshake_with`], and [`ControlError::Probed`].
///
/// # Cancel safety
/// Not cancel-safe, as [`handshake_with`].
pub async fn handshake_serving_probes<F>(
    conn: &mut Connection,
    local: &Hello,
    secret: &Secret,
    deadline: Instant,
    accept: F,
) -> Result<Hello, ControlError>
where
    F: FnOnce(&Hello) -> Result<(), RejectReason>,
{
    handshake_timed(conn, local, secret, deadline, accept, true).await
}

async fn handshake_timed<F>(
    conn: &mut Connection,
    local: &Hello,
    secret: &Secret,
    deadline: Instant,
    accept: F,
    probes: bool,
) -> Result<Hello, ControlError>
where
    F: FnOnce(&Hello) -> Result<(), RejectReason>,
{
    let peer = conn.peer_addr();
    let inner = handshake_inner(conn, local, secret, accept, probes);
    match tokio::time::timeout_at(deadline, inner).await {
        Ok(Ok(remote)) => {
            tracing::debug!(%peer, remote_engine = %remote.engine_id, role = %remote.role, pp_rank = remote.pp_rank, "control handshake accepted");
            Ok(remote)
        }
        Ok(Err(e @ ControlError::Probed { .. })) => {
            tracing::debug!(%peer, "probed: the peer read our Hello and left");
            Err(e)
        }
        Ok(Err(e)) => {
            tracing::warn!(%peer, error = %e, "control handshake failed");
            Err(e)
        }
        Err(_) => Err(ControlError::HandshakeTimeout { peer }),
    }
}

/// Reads the first message of a handshake step, turning what is not `want` into the right error.
async fn expect_step<T>(
    conn: &mut Connection,
    want: &'static str,
    pick: impl FnOnce(Msg) -> Option<T>,
) -> Result<T, ControlError> {
    let peer = conn.peer_addr();
    match conn.recv().await {
        Ok(Some(Msg::Reject(r))) => Err(ControlError::PeerRejected {
            peer,
            reason: r.reason,
        }),
        Ok(Some(msg)) => {
            let got = msg.kind();
            match pick(msg) {
                Some(t) => Ok(t),
                None => {
                    let reason = RejectReason::Protocol(format!("expected {want}, got {got}"));
                    refuse(conn, reason, true).await
                }
            }
        }
        Ok(None) => Err(ControlError::PeerClosed {
            peer,
            waiting_for: want,
        }),
        Err(ControlError::Frame {
            source: FrameError::UnsupportedVersion { got, .. },
            ..
        }) => {
            let reason = RejectReason::VersionMismatch {
                local: PROTOCOL_VERSION,
                remote: got,
            };
            // The stream is out of step, so do not wait for a verdict we could not read.
            refuse(conn, reason, false).await
        }
        Err(e) => Err(e),
    }
}

/// Reads the listener's Hello and nothing more: authenticates as a dialer of `role` with
/// `secret` (as [`handshake`] does, so nothing but challenges and proofs crosses before the
/// listener proved the secret too), sends [`Msg::Probe`] in place of a Hello, reads the
/// listener's Hello, checks it does not contradict itself, and closes. The listener sees
/// [`ControlError::Probed`]. For a peer that must learn what the listener's application says
/// ([`Hello::app`]) before it can build its own Hello.
///
/// # Errors
/// As [`handshake`]: a failed proof either way, the peer's Reject, a Hello that contradicts
/// itself, a closed connection, or the deadline.
pub async fn probe(
    conn: &mut Connection,
    role: Role,
    secret: &Secret,
    deadline: Instant,
) -> Result<Hello, ControlError> {
    let peer = conn.peer_addr();
    if conn.side != Side::Dialer {
        return Err(ControlError::Unexpected {
            peer,
            expected: "a dialer's probe",
            got: MsgKind::Probe,
        });
    }
    let run = async {
        let theirs = authenticate(conn, role, secret).await?;
        conn.send(&Msg::Probe).await?;
        let remote = expect_step(conn, "Hello", |m| match m {
            Msg::Hello(h) => Some(h),
            _ => None,
        })
        .await?;
        if remote.role != theirs.role {
            let reason = RejectReason::Protocol(format!(
                "the peer's challenge said {}, its hello says {}",
                theirs.role, remote.role
            ));
            return Err(ControlError::RejectedPeer { peer, reason });
        }
        check_self_consistent(&remote)
            .map_err(|reason| ControlError::RejectedPeer { peer, reason })?;
        let _ = conn.writer.io.shutdown().await;
        Ok(remote)
    };
    match tokio::time::timeout_at(deadline, run).await {
        Ok(r) => r,
        Err(_) => Err(ControlError::HandshakeTimeout { peer }),
    }
}

/// Steps 1 and 2 of the handshake: challenges, then the Noise proofs; seals the connection and
/// returns the peer's challenge.
async fn authenticate(
    conn: &mut Connection,
    role: Role,
    secret: &Secret,
) -> Result<Challenge, ControlError> {
    let peer = conn.peer_addr();
    let side = conn.side;
    let cap = conn.reader.decoder.max_len();
    conn.reader.decoder.set_max_len(AUTH_MAX_FRAME.min(cap));
    let ours = Challenge::fresh(role, side);
    conn.send(&Msg::Challenge(ours.clone())).await?;
    let theirs = expect_step(conn, "Challenge", |m| match m {
        Msg::Challenge(c) => Some(c),
        _ => None,
    })
    .await?;
    if theirs.side != side.peer() || theirs.nonce == ours.nonce {
        // Both ends claiming one side, or our own nonce sent back: a reflection, not a peer.
        let reason = RejectReason::Protocol("the peer's challenge mirrors ours".into());
        return refuse(conn, reason, true).await;
    }
    let (dialer, listener) = match side {
        Side::Dialer => (&ours, &theirs),
        Side::Listener => (&theirs, &ours),
    };
    // Noise NNpsk0: the dialer's message first, the listener's answer only once the dialer's
    // authenticated, so a client that merely connects never obtains a message to guess the secret
    // from offline.
    let channel = |source| ControlError::Channel { peer, source };
    let mut noise = match conn.label {
        Some(label) => Handshake::labelled(label, secret, side, dialer, listener),
        None => Handshake::new(secret, side, dialer, listener),
    }
    .map_err(channel)?;
    if side == Side::Dialer {
        let msg = noise.write().map_err(channel)?;
        conn.send(&Msg::Proof(Proof { msg })).await?;
    }
    let proof = expect_step(conn, "Proof", |m| match m {
        Msg::Proof(p) => Some(p),
        _ => None,
    })
    .await?;
    if !noise.read(&proof.msg) {
        return refuse(conn, RejectReason::AuthFailed, true).await;
    }
    if side == Side::Listener {
        let msg = noise.write().map_err(channel)?;
        conn.send(&Msg::Proof(Proof { msg })).await?;
    }
    // Both messages went: everything from here on is sealed, in both directions.
    let (sealer, opener) = noise.finish().map_err(channel)?;
    conn.writer.sealer = Some(sealer);
    conn.reader.seal(opener)?;
    conn.reader.decoder.set_max_len(cap);
    Ok(theirs)
}

async fn handshake_inner<F>(
    conn: &mut Connection,
    local: &Hello,
    secret: &Secret,
    accept: F,
    probes: bool,
) -> Result<Hello, ControlError>
where
    F: FnOnce(&Hello) -> Result<(), RejectReason>,
{
    let peer = conn.peer_addr();
    let side = conn.side;
    let theirs = authenticate(conn, local.role, secret).await?;

    // Authenticated: from here on the peer may learn how to reach our memory.
    conn.send(&Msg::Hello(local.clone())).await?;
    let remote = expect_step(conn, "Hello", |m| match m {
        Msg::Hello(h) => Some(Some(h)),
        // A dialer that only reads our Hello (`probe`).
        Msg::Probe if probes && side == Side::Listener => Some(None),
        _ => None,
    })
    .await?;
    let Some(remote) = remote else {
        return Err(ControlError::Probed { peer });
    };
    let verdict = if remote.role == theirs.role {
        check_hello(local, &remote).and_then(|()| accept(&remote))
    } else {
        Err(RejectReason::Protocol(format!(
            "the peer's challenge said {}, its hello says {}",
            theirs.role, remote.role
        )))
    };
    match verdict {
        Ok(()) => {
            conn.send(&Msg::HelloAck(HelloAck {
                engine_id: local.engine_id.clone(),
            }))
            .await?;
            match conn.recv().await? {
                Some(Msg::HelloAck(_)) => Ok(remote),
                Some(Msg::Reject(r)) => Err(ControlError::PeerRejected {
                    peer,
                    reason: r.reason,
                }),
                Some(other) => Err(ControlError::Unexpected {
                    peer,
                    expected: "HelloAck or Reject",
                    got: other.kind(),
                }),
                None => Err(ControlError::PeerClosed {
                    peer,
                    waiting_for: "HelloAck or Reject",
                }),
            }
        }
        Err(reason) => refuse(conn, reason, true).await,
    }
}

/// How long a side that refused waits for the peer's last bytes before giving up on them.
const LINGER: Duration = Duration::from_millis(250);

/// Sends Reject, lingers briefly for the peer's last bytes, and returns
/// [`ControlError::RejectedPeer`] unless sending failed.
///
/// The linger exists because closing a socket with unread data makes the OS send a reset, which
/// can destroy our Reject before the peer reads it. `in_step` says whether the stream can still
/// be read as frames (to take the peer's verdict) or must be drained as raw bytes.
async fn refuse<T>(
    conn: &mut Connection,
    reason: RejectReason,
    in_step: bool,
) -> Result<T, ControlError> {
    let peer = conn.peer_addr();
    conn.send(&Msg::Reject(Reject {
        reason: reason.clone(),
    }))
    .await?;
    // Errors and timeouts here are ignored on purpose: our own reason is what gets reported.
    if in_step {
        let _ = tokio::time::timeout(LINGER, conn.recv()).await;
    } else {
        let _ = conn.writer.io.shutdown().await;
        let drain = async {
            let mut scratch = [0u8; 4096];
            while let Ok(n) = conn.reader.io.read(&mut scratch).await {
                if n == 0 {
                    break;
                }
            }
        };
        let _ = tokio::time::timeout(LINGER, drain).await;
    }
    Err(ControlError::RejectedPeer { peer, reason })
}
