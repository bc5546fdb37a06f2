//! Support code of the `kvbench` binary and of the workspace tests: a loopback cluster of one decode
//! engine and several prefill PP engines, the byte pattern every request carries and its checks, the
//! benchmark's workloads and baselines, and the multi-process roles.
#![warn(missing_docs)]

pub mod bench;
pub mod cluster;
pub mod etcd_server;
pub mod register;
pub mod roles;
pub mod sweep;
pub mod tp;
pub mod verify;
