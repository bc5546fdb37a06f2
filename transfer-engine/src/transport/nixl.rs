//! The NIXL backend (being written).
