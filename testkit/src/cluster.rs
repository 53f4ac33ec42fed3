//! What a test needs to name a cluster of its own on the machine's NATS server (`make test`
//! starts one when none runs): the server's URL, a cluster name no other test uses, and a free
//! port for a server of the test's. Tests that run gateways and workers as processes
//! (`cli/tests/support/cluster.rs`) and tests that run them in process both use these.

use std::net::TcpListener;

pub const NATS_URL: &str = "nats://127.0.0.1:4222";

/// A cluster name of its own for one test.
pub fn cluster(test: &str) -> String {
    format!(
        "t{}-{test}",
        &uuid::Uuid::new_v4().simple().to_string()[..8]
    )
}

/// A port nothing listens on now.
pub fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .expect("a free port")
        .port()
}
