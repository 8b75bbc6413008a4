//! The retention plan of a pass: what may go from the whole log and from the local copies of
//! offloaded segments.

use sluice_storage::LogStats;

use super::*;

/// What retention allows to go: everything below `remote_below` in the whole log, and local
/// copies below `local_below`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct Plan {
    pub(super) remote_below: u64,
    pub(super) local_below: u64,
}

/// Retention over the whole log (offloaded segments not held locally, then local ones; the
/// active segment never goes) and over local copies of offloaded segments.
pub(super) fn plan(
    m: &Manifest,
    local: &[SegmentMeta],
    stats: LogStats,
    p: PassPolicy,
    now_ms: i64,
) -> Plan {
    let (remote_start, remote_end) = m.range();
    let local_start = stats.local_start;
    let local_sealed: u64 = local.iter().map(|s| s.size_bytes).sum();
    let active = stats.bytes.saturating_sub(local_sealed);
    // Offloaded segments that no longer reach the local ones are past retention already.
    let connected = remote_end >= local_start;
    let whole: Vec<(u64, i64, u64)> = m
        .segments
        .iter()
        .filter(|s| connected && s.base_offset < local_start)
        .map(|s| (s.last_offset, s.max_timestamp, s.size_bytes))
        .chain(
            local
                .iter()
                .map(|s| (s.last_offset, s.max_timestamp, s.size_bytes)),
        )
        .collect();
    let mut total: u64 = whole.iter().map(|w| w.2).sum::<u64>() + active;
    let mut boundary = if connected && remote_start < remote_end {
        remote_start.min(local_start)
    } else {
        local_start
    };
    for (last, max_ts, size) in whole {
        let too_old = p
            .retention_ms
            .is_some_and(|ms| max_ts < now_ms.saturating_sub(ms));
        let too_big = p.retention_bytes.is_some_and(|limit| total - size >= limit);
        if !(too_old || too_big) {
            break;
        }
        total -= size;
        boundary = last + 1;
    }
    let remote_below = if connected { boundary } else { remote_end };
    let mut local_total = stats.bytes;
    let mut local_boundary = local_start;
    for s in local {
        if s.last_offset >= remote_end || remote_start == remote_end {
            break;
        }
        let too_old = p
            .local_retention_ms
            .is_some_and(|ms| s.max_timestamp < now_ms.saturating_sub(ms));
        let too_big = p
            .local_retention_bytes
            .is_some_and(|limit| local_total - s.size_bytes >= limit);
        if !(too_old || too_big) {
            break;
        }
        local_total -= s.size_bytes;
        local_boundary = s.last_offset + 1;
    }
    Plan {
        remote_below,
        local_below: boundary.max(local_boundary),
    }
}
