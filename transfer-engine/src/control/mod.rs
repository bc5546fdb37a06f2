//! The control plane: a tokio TCP connection per peer carrying the handshake, page allocations
//! (transfer requests), aborts, PP votes and close, as length-prefixed, versioned, size-capped
//! frames, sealed after the handshake in an authenticated, encrypted channel ([`channel`]).
//!
//! ```
//! use std::time::Duration;
//! use tokio::time::Instant;
//! use transfer_engine::control::{
//!     BackendInfo, BackendKind, Connection, Hello, LayoutInfo, Listener, Msg, Role, Secret, TpMode,
//!     TransferRequest, handshake,
//! };
//!
//! # #[tokio::main(flavor = "current_thread")]
//! # async fn main() -> Result<(), Box<dyn std::error::Error>> {
//! let layout = LayoutInfo {
//!     num_layers: 32, first_layer: 0, layers: 32, kv_regions: 2, page_tokens: 16,
//!     bytes_per_token_per_layer: 4096, pages: 1024, kv_heads: 8, tp_mode: TpMode::Identical,
//!     model_kv_heads: 8, token_major: true, key_column_bytes: 0,
//! };
//! let backend = BackendInfo {
//!     kind: BackendKind::Ucx, worker_or_agent: vec![1, 2, 3], agent_name: String::new(), regions: vec![], landing: None,
//! };
//! let decode = Hello::new("decode-0", Role::Decode, layout.clone(), backend.clone());
//! let prefill = Hello::new("prefill-0", Role::Prefill, layout, backend);
//!
//! let secret = Secret::new(b"shared by every engine of the deployment");
//! let server_secret = secret.clone();
//! let listener = Listener::bind("127.0.0.1:0").await?;
//! let addr = listener.local_addr();
//! let deadline = Instant::now() + Duration::from_secs(5);
//! let server = tokio::spawn(async move {
//!     let mut conn = listener.accept().await?;
//!     let peer = handshake(&mut conn, &prefill, &server_secret, deadline).await?;
//!     assert_eq!(peer.role, Role::Decode);
//!     let msg = conn.recv().await?;
//!     Ok::<_, transfer_engine::control::ControlError>(msg)
//! });
//!
//! let mut conn = Connection::connect(addr, deadline).await?;
//! handshake(&mut conn, &decode, &secret, deadline).await?;
//! let req = TransferRequest { request: 7, prompt_tokens: 32, chunk_tokens: 16, dst_pages: vec![3, 4], prefix_tokens: 0, deadline_ms: 1000, landing: None };
//! conn.send(&Msg::TransferRequest(req.clone())).await?;
//! let Some(Msg::TransferRequest(got)) = server.await?? else { panic!("expected a transfer request") };
//! assert_eq!(got, req);
//! # Ok(())
//! # }
//! ```
//!
//! Frame layout, message list and handshake rules: `docs/control-plane.md`.
//!
//! # Library dependency
//! tokio only (TCP); no UCX or NIXL. Backend metadata travels as opaque bytes.
//!
//! # Thread safety
//! [`Connection`], [`ControlReader`] and [`ControlWriter`] are `Send`; split a connection with
//! [`Connection::into_split`] to receive in one task and send in another. Each half is used by
//! one task at a time (`&mut self`).
//!
//! # Resource cleanup
//! Dropping a connection closes the socket. [`Connection::close`] / [`ControlWriter::close`]
//! send [`Msg::Close`] and shut down the sending direction first, so the peer sees a clean end
//! (`recv` returns `None`) rather than a reset.

mod auth;
pub mod channel;
mod conn;
mod frame;
mod msg;

pub use auth::{Challenge, Proof, Secret, Side};
pub use conn::{
    Connection, ControlError, ControlReader, ControlWriter, Listener, handshake,
    handshake_serving_probes, handshake_with, probe,
};
pub use frame::{
    DEFAULT_MAX_FRAME_LEN, FrameDecoder, FrameError, FrameHeader, HEADER_LEN, MAGIC, MsgKind,
    PROTOCOL_VERSION, decode_payload, encode_frame, encode_to_vec,
};
pub use msg::{
    Abort, AbortAck, AuxData, BackendInfo, BackendKind, Hello, HelloAck, Landed, Landing,
    LayoutInfo, MAX_APP_INFO, MAX_AUX_LEN, Msg, Reject, RejectReason, RemoteRegion, Role, TpMode,
    TransferReject, TransferRejectReason, TransferRequest, Vote, check_hello, validate_landing,
    validate_prefix, validate_transfer_request,
};
