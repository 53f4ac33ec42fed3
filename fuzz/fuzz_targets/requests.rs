//! libFuzzer entry point of [`swarmgate_fuzz::requests`].
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| swarmgate_fuzz::requests(data));
