//! KV-cache transfer engine for disaggregated LLM serving.
//!
//! Prefill servers push the KV pages of a request, chunk by chunk and pipeline-parallel rank by rank,
//! into pages a decode server allocated; this crate moves those pages over UCX or NIXL and decides,
//! without I/O, when a request is complete or failed.
#![warn(missing_docs)]

pub mod control;
pub mod core;
#[cfg(feature = "etcd")]
pub mod discovery;
pub mod engine;
pub mod mem;
pub mod metrics;
pub mod transport;
