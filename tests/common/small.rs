//! The small cluster the in-process fault tests share: its model, prompt, bounds, and two requests'
//! pages (A healthy, B the one a test disturbs).
// Each test file uses the part it needs.
#![allow(dead_code)]

use kvbench::cluster::Shape;
use std::time::Duration;
use transfer_engine::core::RequestId;
use transfer_engine::core::planner::RegionKind;

/// A small GQA-like model: 8 layers (two per rank), split K and V, 16-token pages.
pub const SHAPE: Shape = Shape {
    layers: 8,
    bytes_per_token: 512,
    page_tokens: 16,
    regions: RegionKind::SplitKv,
};
pub const PP: u16 = 4;
/// Four pages, two chunks per rank.
pub const PROMPT: u32 = 64;
pub const CHUNK: u32 = 32;
pub const CHUNKS: u32 = PROMPT / CHUNK;
/// A deadline that must not be what ends a request.
pub const LONG: Duration = Duration::from_secs(20);
/// Bound on everything else a test waits for.
pub const BOUND: Duration = Duration::from_secs(10);

pub const A: RequestId = RequestId(1);
pub const B: RequestId = RequestId(2);
pub const SRC_A: [u32; 4] = [0, 1, 2, 3];
pub const DST_A: [u32; 4] = [1, 3, 5, 7];
pub const SRC_B: [u32; 4] = [7, 6, 5, 4];
pub const DST_B: [u32; 4] = [8, 10, 12, 14];
