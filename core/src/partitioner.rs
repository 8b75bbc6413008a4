//! Key-to-partition mapping compatible with the Java Kafka client's default partitioner, so a
//! key lands on the same partition whichever protocol produced it.

/// Kafka's murmur2 (seed 0x9747b28c).
pub(crate) fn murmur2(data: &[u8]) -> i32 {
    const M: u32 = 0x5bd1_e995;
    const R: u32 = 24;
    let mut h: u32 = 0x9747_b28c ^ data.len() as u32;
    let mut chunks = data.chunks_exact(4);
    for c in &mut chunks {
        let mut k = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
        k = k.wrapping_mul(M);
        k ^= k >> R;
        k = k.wrapping_mul(M);
        h = h.wrapping_mul(M);
        h ^= k;
    }
    let tail = chunks.remainder();
    if !tail.is_empty() {
        for (i, &b) in tail.iter().enumerate().rev() {
            h ^= u32::from(b) << (8 * i);
        }
        h = h.wrapping_mul(M);
    }
    h ^= h >> 13;
    h = h.wrapping_mul(M);
    h ^= h >> 15;
    h as i32
}

/// Partition for `key` among `partitions`, as Kafka's `Utils.toPositive(murmur2(key)) % n`.
pub fn partition_for_key(key: &[u8], partitions: u32) -> u32 {
    (murmur2(key) & 0x7fff_ffff) as u32 % partitions
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Vectors from Kafka's own `UtilsTest.testMurmur2`.
    #[test]
    fn matches_kafka_murmur2() {
        let cases: [(&str, i32); 6] = [
            ("21", -973_932_308),
            ("foobar", -790_332_482),
            ("a-little-bit-long-string", -985_981_536),
            ("a-little-bit-longer-string", -1_486_304_829),
            (
                "lkjh234lh9fiuh90y23oiuhsafujhadof229phr9h19h89h8",
                -58_897_971,
            ),
            ("abc", 479_470_107),
        ];
        for (input, expected) in cases {
            assert_eq!(murmur2(input.as_bytes()), expected, "{input}");
        }
    }

    #[test]
    fn partition_is_stable_and_in_range() {
        for n in 1..20 {
            let p = partition_for_key(b"cameras/7/jpeg", n);
            assert!(p < n);
            assert_eq!(p, partition_for_key(b"cameras/7/jpeg", n));
        }
    }
}
