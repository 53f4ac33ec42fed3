//! Command-line tools built into the binary.

pub mod bench;
pub mod eval_verifier;
pub mod generate;
pub mod openapi;
pub mod plan;
