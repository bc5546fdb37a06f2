//! Support code of the `kvbench` binary and of the workspace tests: a loopback cluster of one decode
//! engine and several prefill PP engines with byte-exact verification, the benchmark's workloads and
//! baselines, and the multi-process roles.
#![warn(missing_docs)]

pub mod bench;
pub mod cluster;
pub mod roles;
