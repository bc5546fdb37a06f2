//! Helpers shared by the workspace tests.

pub mod procs;
pub mod small;
