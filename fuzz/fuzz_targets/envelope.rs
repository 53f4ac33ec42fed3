//! libFuzzer entry point of [`swarmgate_fuzz::envelope`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| swarmgate_fuzz::envelope(data));
