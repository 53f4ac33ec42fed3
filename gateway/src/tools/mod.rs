//! Command-line tools built into the binary.

pub mod bench;
pub mod eval;
pub mod generate;
pub mod openapi;
pub mod plan;
