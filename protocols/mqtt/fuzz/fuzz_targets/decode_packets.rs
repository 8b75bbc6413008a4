//! Feeds arbitrary bytes to the MQTT packet decoders (the protocol level of a leading CONNECT
//! picks v3.1.1 or v5; anything else is read as v5), packet after packet.
//! Run: `RUSTC_BOOTSTRAP=1 cargo fuzz run decode_packets` in protocols/mqtt.
#![no_main]

/// As in the gateway: a claimed huge length is address space, not an abort.
#[global_allocator]
static ALLOC: sluice_alloc_guard::GuardedAlloc = sluice_alloc_guard::GuardedAlloc;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    sluice_mqtt::fuzz_decode(data);
});
