//! Arbitrary bytes -> a plan and a sequence of events, invalid ones included; the driver panics
//! on any broken invariant, which is what libFuzzer reports.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    rolloutpipe_core_fuzz::events::run(data);
});
