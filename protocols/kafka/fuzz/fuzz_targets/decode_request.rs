//! Feeds arbitrary bytes to the Kafka request decoder, as a frame without its length prefix.
//! Run: `cargo fuzz run decode_request` in protocols/kafka (cargo-fuzz; see docs/KAFKA_COMPAT.md).
#![no_main]

/// As in the gateway: a claimed two-billion-element array is address space, not an abort.
#[global_allocator]
static ALLOC: sluice_alloc_guard::GuardedAlloc = sluice_alloc_guard::GuardedAlloc;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    sluice_kafka::fuzz_decode_request(data);
});
