//! The device tier's memory is the process's from start-up: a running engine does not grow into
//! its KV budget as blocks are first used, so its resident size after start-up measures
//! everything else (the checks that a second identical load adds nothing rely on it). Alone in
//! its test binary, so that no other test's memory moves the figures.

mod common;

/// This process's resident memory, in MiB (Linux's `/proc/self/statm`, in pages).
fn resident_mb() -> usize {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: usize = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096 / (1024 * 1024)
}

#[test]
fn the_device_tier_is_resident_once_the_engine_starts() {
    const BUDGET_MB: usize = 1024;
    let before = resident_mb();
    let engine = engine::EngineHandle::start(&engine::EngineConfig {
        host_kv_cache_mb: 0,
        ..common::config(BUDGET_MB)
    })
    .unwrap();
    let grown = resident_mb() - before;
    // Lazily mapped, the budget would be missing from the figure: the rest is ~300 MiB.
    assert!(
        grown >= BUDGET_MB,
        "resident memory grew by {grown} MiB at start-up, less than the {BUDGET_MB} MiB KV budget"
    );
    drop(engine);
}
