//! The APIs and versions this server implements: the one table that ApiVersions advertises and
//! the decoder enforces. `docs/KAFKA_COMPAT.md` explains each range.

use kafka_protocol::messages::ApiKey;
use kafka_protocol::messages::api_versions_response::ApiVersion;
use kafka_protocol::protocol::VersionRange;

pub(crate) const UNSUPPORTED_VERSION: i16 = 35;

/// (API, min, max). Minimums are the codec's (Kafka 4 dropped older request formats); maximums
/// stop before versions that address topics by id only, which Sluice does not assign.
const TABLE: &[(ApiKey, i16, i16)] = &[
    (ApiKey::Produce, 3, 9),
    (ApiKey::Fetch, 4, 12),
    (ApiKey::ListOffsets, 1, 6),
    (ApiKey::Metadata, 0, 9),
    (ApiKey::OffsetCommit, 2, 8),
    (ApiKey::OffsetFetch, 1, 7),
    (ApiKey::FindCoordinator, 0, 3),
    (ApiKey::JoinGroup, 0, 7),
    (ApiKey::Heartbeat, 0, 4),
    (ApiKey::LeaveGroup, 0, 4),
    (ApiKey::SyncGroup, 0, 5),
    (ApiKey::DescribeGroups, 0, 5),
    (ApiKey::ListGroups, 0, 4),
    (ApiKey::SaslHandshake, 0, 1),
    (ApiKey::ApiVersions, 0, 3),
    (ApiKey::CreateTopics, 2, 5),
    (ApiKey::DeleteTopics, 1, 5),
    (ApiKey::DeleteRecords, 0, 2),
    (ApiKey::CreatePartitions, 0, 3),
    (ApiKey::InitProducerId, 0, 4),
    (ApiKey::DescribeConfigs, 1, 4),
    (ApiKey::AlterConfigs, 0, 2),
    (ApiKey::IncrementalAlterConfigs, 0, 1),
    (ApiKey::SaslAuthenticate, 0, 2),
    (ApiKey::DescribeCluster, 0, 1),
];

/// What a relay's read-only listener answers (`KafkaServer::read_only`): enough for a relay
/// below it, or any plain reader, to find a topic, its offsets and its records. Writes and
/// consumer groups belong to the upstream, which keeps the durable state. Produce is listed
/// but refused (`POLICY_VIOLATION`): librdkafka reads the v2 record format only from a broker
/// that advertises Produce v3 beside Fetch v4 (rdkafka_feature.c), and without it fell back to
/// Fetch v0, which no Sluice node speaks.
const READ_ONLY: &[ApiKey] = &[
    ApiKey::Produce,
    ApiKey::ApiVersions,
    ApiKey::Metadata,
    ApiKey::ListOffsets,
    ApiKey::Fetch,
    ApiKey::DescribeCluster,
    ApiKey::SaslHandshake,
    ApiKey::SaslAuthenticate,
];

/// Whether a read-only listener answers `key`.
pub(crate) fn on_read_only(key: ApiKey) -> bool {
    READ_ONLY.contains(&key)
}

/// The version range implemented for `key`, if any.
pub(crate) fn supported(key: ApiKey) -> Option<VersionRange> {
    TABLE
        .iter()
        .find(|(k, _, _)| *k == key)
        .map(|&(_, min, max)| VersionRange { min, max })
}

/// The ApiVersions list: every API, or with `read_only` only those [`on_read_only`] answers,
/// so a client knows before it asks that a relay has no consumer groups.
pub(crate) fn advertised(read_only: bool) -> Vec<ApiVersion> {
    TABLE
        .iter()
        .filter(|&&(key, _, _)| !read_only || on_read_only(key))
        .map(|&(key, min, max)| {
            let mut v = ApiVersion::default();
            v.api_key = key as i16;
            v.min_version = min;
            v.max_version = max;
            v
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every advertised range lies inside what the codec can decode and encode.
    #[test]
    fn advertised_ranges_fit_the_codec() {
        for &(key, min, max) in TABLE {
            let codec = key.valid_versions();
            assert!(min <= max, "{key:?}");
            assert!(
                codec.min <= min && max <= codec.max,
                "{key:?} {min}-{max} outside {codec}"
            );
        }
    }

    #[test]
    fn a_read_only_listener_advertises_reads_only() {
        let keys =
            |read_only| -> Vec<i16> { advertised(read_only).iter().map(|v| v.api_key).collect() };
        assert_eq!(keys(false).len(), TABLE.len());
        let reads = keys(true);
        assert_eq!(reads.len(), READ_ONLY.len(), "every read is implemented");
        // Produce too, for librdkafka's record format probe; it is refused when it comes.
        for key in [
            ApiKey::Fetch,
            ApiKey::Metadata,
            ApiKey::ListOffsets,
            ApiKey::Produce,
        ] {
            assert!(reads.contains(&(key as i16)), "{key:?}");
        }
        for key in [
            ApiKey::FindCoordinator,
            ApiKey::CreateTopics,
            ApiKey::DeleteTopics,
            ApiKey::OffsetCommit,
            ApiKey::JoinGroup,
            ApiKey::InitProducerId,
        ] {
            assert!(!reads.contains(&(key as i16)), "{key:?}");
        }
    }

    /// librdkafka enables compression codecs, idempotence and consumer groups only when these
    /// versions are inside the advertised ranges (rdkafka_feature.c).
    #[test]
    fn librdkafka_feature_probes_pass() {
        let has = |key, v| supported(key).is_some_and(|r| r.min <= v && v <= r.max);
        assert!(has(ApiKey::Produce, 3) && has(ApiKey::Fetch, 4), "MsgVer2");
        assert!(has(ApiKey::Produce, 7) && has(ApiKey::Fetch, 10), "ZSTD");
        assert!(has(ApiKey::FindCoordinator, 0), "LZ4 and group coordinator");
        assert!(has(ApiKey::InitProducerId, 0), "idempotent producer");
        assert!(has(ApiKey::ListOffsets, 1), "offsets by time");
        for key in [
            ApiKey::JoinGroup,
            ApiKey::SyncGroup,
            ApiKey::Heartbeat,
            ApiKey::LeaveGroup,
        ] {
            assert!(has(key, 0), "balanced consumer: {key:?}");
        }
        assert!(has(ApiKey::OffsetCommit, 2) && has(ApiKey::OffsetFetch, 1));
        assert!(has(ApiKey::SaslHandshake, 1) && has(ApiKey::SaslAuthenticate, 0));
    }
}
