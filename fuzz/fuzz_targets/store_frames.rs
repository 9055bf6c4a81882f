//! `cargo +nightly fuzz run store_frames`: every byte string as a store request frame must be
//! answered or refused, never panic, and never allocate beyond its own size.
#![no_main]

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    ferrocomm::fuzzing::store_request(data);
});
