//! What the tests that run the `swarmgate` binary share, beyond [`testkit`]: gateways and
//! workers as processes ([`cluster`]), NATS servers of a test's own ([`nats`]) with operator
//! JWTs ([`jwt`]), and a PostgreSQL database of a test's own ([`postgres`]). Each test file uses
//! the part it needs.
#![allow(dead_code)]

pub mod cluster;
pub mod jwt;
pub mod nats;
pub mod postgres;
