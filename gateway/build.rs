//! Generates the gRPC service and its messages from `proto/`, with a protobuf compiler written in
//! Rust, so that building needs no `protoc` installed.

use std::error::Error;

const PROTO_ROOT: &str = "../proto";
const PROTOS: &[&str] = &["swarmgate/v1/inference.proto"];

fn main() -> Result<(), Box<dyn Error>> {
    println!("cargo:rerun-if-changed={PROTO_ROOT}");
    let descriptors = protox::compile(PROTOS, [PROTO_ROOT])?;
    tonic_prost_build::configure().compile_fds(descriptors)?;
    Ok(())
}
