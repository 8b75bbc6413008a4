//! A partition's manifest: which offset ranges live in the object store, under which keys.
//! Layout in `storage/FORMAT.md` ("Object store").

use serde::{Deserialize, Serialize};
use sluice_storage::SegmentMeta;

/// The manifest format this code writes and reads.
pub const MANIFEST_FORMAT: u32 = 1;

/// One offloaded segment: its seal record's facts.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ManifestSegment {
    pub base_offset: u64,
    pub last_offset: u64,
    pub min_timestamp: i64,
    pub max_timestamp: i64,
    pub size_bytes: u64,
    pub record_count: u64,
    pub batch_count: u32,
    pub sealed_at_ms: i64,
}

impl From<&SegmentMeta> for ManifestSegment {
    fn from(m: &SegmentMeta) -> Self {
        Self {
            base_offset: m.base_offset,
            last_offset: m.last_offset,
            min_timestamp: m.min_timestamp,
            max_timestamp: m.max_timestamp,
            size_bytes: m.size_bytes,
            record_count: m.record_count,
            batch_count: m.batch_count,
            sealed_at_ms: m.sealed_at_ms,
        }
    }
}

/// Version `version` of one partition's manifest. Segments are contiguous and in offset order.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: u32,
    pub version: u64,
    pub topic: String,
    pub partition: u32,
    /// The topic's creation time (ms): a topic deleted and made again under the same name
    /// gets new keys.
    pub incarnation: i64,
    pub segments: Vec<ManifestSegment>,
}

impl Manifest {
    pub fn empty(topic: &str, partition: u32, incarnation: i64) -> Self {
        Self {
            format: MANIFEST_FORMAT,
            version: 0,
            topic: topic.to_owned(),
            partition,
            incarnation,
            segments: Vec::new(),
        }
    }

    /// Offsets `start..end` held remotely (equal when none).
    pub fn range(&self) -> (u64, u64) {
        match (self.segments.first(), self.segments.last()) {
            (Some(first), Some(last)) => (first.base_offset, last.last_offset + 1),
            _ => (0, 0),
        }
    }

    pub fn bytes(&self) -> u64 {
        self.segments.iter().map(|s| s.size_bytes).sum()
    }

    /// The segment holding `offset`.
    pub fn find(&self, offset: u64) -> Option<&ManifestSegment> {
        let i = self
            .segments
            .partition_point(|s| s.base_offset <= offset)
            .checked_sub(1)?;
        let s = &self.segments[i];
        (offset <= s.last_offset).then_some(s)
    }

    /// The segment after the one based at `base`.
    pub fn after(&self, base: u64) -> Option<&ManifestSegment> {
        let i = self.segments.partition_point(|s| s.base_offset <= base);
        self.segments.get(i)
    }

    /// The next version with `segment` appended. A segment that does not follow the last one
    /// (the segments between were deleted by retention before they could be offloaded) starts
    /// the list over: the older ones are past retention too.
    pub fn appended(&self, segment: ManifestSegment) -> Self {
        let mut next = self.next_version();
        if next.range().1 != segment.base_offset {
            next.segments.clear();
        }
        next.segments.push(segment);
        next
    }

    /// The next version without the segments that end below `offset`.
    pub fn trimmed_below(&self, offset: u64) -> Self {
        let mut next = self.next_version();
        next.segments.retain(|s| s.last_offset >= offset);
        next
    }

    fn next_version(&self) -> Self {
        Self {
            version: self.version + 1,
            format: MANIFEST_FORMAT,
            ..self.clone()
        }
    }

    /// Checks what a decoded manifest must hold to be believed.
    pub fn check(&self, topic: &str, partition: u32, incarnation: i64) -> Result<(), String> {
        if self.format != MANIFEST_FORMAT {
            return Err(format!(
                "manifest format {} is not {MANIFEST_FORMAT}",
                self.format
            ));
        }
        if self.topic != topic || self.partition != partition || self.incarnation != incarnation {
            return Err(format!(
                "manifest of {}/{} ({}) found for {topic}/{partition} ({incarnation})",
                self.topic, self.partition, self.incarnation
            ));
        }
        let contiguous = self
            .segments
            .windows(2)
            .all(|w| w[0].last_offset + 1 == w[1].base_offset);
        let sane = self
            .segments
            .iter()
            .all(|s| s.last_offset >= s.base_offset && s.size_bytes > 0);
        if !(contiguous && sane) {
            return Err("manifest segments are not contiguous".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seg(base: u64, last: u64) -> ManifestSegment {
        ManifestSegment {
            base_offset: base,
            last_offset: last,
            min_timestamp: 0,
            max_timestamp: 0,
            size_bytes: 100,
            record_count: last - base + 1,
            batch_count: 1,
            sealed_at_ms: 0,
        }
    }

    #[test]
    fn appends_find_and_trim() {
        let m = Manifest::empty("t", 0, 1)
            .appended(seg(0, 9))
            .appended(seg(10, 19));
        assert_eq!((m.version, m.range()), (2, (0, 20)));
        assert_eq!(m.find(15).map(|s| s.base_offset), Some(10));
        assert_eq!(m.find(20), None);
        assert_eq!(m.after(0).map(|s| s.base_offset), Some(10));
        let t = m.trimmed_below(10);
        assert_eq!((t.version, t.range()), (3, (10, 20)));
        m.check("t", 0, 1).unwrap();
        assert!(m.check("t", 1, 1).is_err());
    }

    #[test]
    fn a_gap_starts_the_list_over() {
        let m = Manifest::empty("t", 0, 1)
            .appended(seg(0, 9))
            .appended(seg(30, 39));
        assert_eq!(m.range(), (30, 40));
        assert_eq!(m.segments.len(), 1);
    }
}
