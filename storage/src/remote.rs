//! The seam between a partition log and the copy of its older segments in an object store.
//!
//! This crate stays synchronous and runtime-free: it defines what a log reader asks of the
//! remote part ([`RemoteLog`]) and the pure byte-level helpers a remote reader needs to serve
//! the same answers from fetched ranges as the local files give ([`SegmentIndexes`],
//! [`cut_batches`], [`scan_for_timestamp`]). The object-store side lives in `sluice-tier`.

use std::fmt::Debug;
use std::path::PathBuf;

use bytes::Bytes;

use crate::batch::{self, BATCH_HEADER_LEN, BatchError, BatchHeader};
use crate::error::Result;
use crate::index::{SegmentIndex, SegmentMeta};

/// The offloaded part of one partition's log. Calls block (they may wait on the network) and
/// are made from blocking threads, as local reads are.
pub trait RemoteLog: Send + Sync + Debug {
    /// Whole batches from the one holding `offset`, up to `max_bytes` but always at least one
    /// batch, and the offset after the last one returned. `offset` lies in the range last given
    /// to [`crate::LogReader::set_remote_range`].
    fn read(&self, offset: u64, max_bytes: usize) -> Result<(Bytes, u64)>;

    /// The first offset held remotely whose record timestamp is at or after `timestamp`, with
    /// that record's timestamp; `None` when every remote record is older.
    fn offset_for_timestamp(&self, timestamp: i64) -> Result<Option<(u64, i64)>>;
}

/// The files of one sealed segment, for an uploader.
#[derive(Debug, Clone)]
pub struct SealedSegmentFiles {
    pub meta: SegmentMeta,
    pub log: PathBuf,
    pub index: PathBuf,
    pub time_index: PathBuf,
    pub seal: PathBuf,
}

/// The decoded `.index` and `.timeindex` of a segment whose bytes are elsewhere.
#[derive(Debug, Clone)]
pub struct SegmentIndexes {
    base_offset: u64,
    index: SegmentIndex,
}

impl SegmentIndexes {
    /// Decodes both index files as `storage/FORMAT.md` lays them out; `None` when either is
    /// damaged, belongs to another segment or points past `segment_len`.
    pub fn decode(
        offsets: &[u8],
        times: &[u8],
        base_offset: u64,
        segment_len: u64,
    ) -> Option<Self> {
        SegmentIndex::decode(offsets, times, base_offset, segment_len)
            .map(|index| Self { base_offset, index })
    }

    /// Byte position to scan from for the batch holding `offset`.
    pub fn position_of(&self, offset: u64) -> u64 {
        let rel = offset
            .saturating_sub(self.base_offset)
            .min(u64::from(u32::MAX)) as u32;
        u64::from(self.index.lookup_offset(rel))
    }

    /// Byte position to scan from for the first batch whose max timestamp is at or after
    /// `timestamp`.
    pub fn position_for_time(&self, timestamp: i64) -> u64 {
        u64::from(self.index.lookup_time(timestamp))
    }

    /// Approximate memory held, for caches that count bytes.
    pub fn weight(&self) -> usize {
        64 + self.index.offsets.len() * 8 + self.index.times.len() * 16
    }
}

/// What [`cut_batches`] found in a buffer that starts on a batch boundary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Cut {
    /// `data[start..end]` holds whole batches, the first holding the wanted offset;
    /// `next_offset` follows the last.
    Batches {
        start: usize,
        end: usize,
        next_offset: u64,
    },
    /// The buffer ends before the first wanted batch is whole: this many bytes from its start
    /// are needed.
    NeedBytes(usize),
}

fn header_at(data: &[u8], pos: usize) -> Result<(BatchHeader, usize), BatchError> {
    let h = BatchHeader::parse(&data[pos..])?;
    let len = h.total_len().ok_or(BatchError::LengthMismatch {
        declared: i64::from(h.batch_length),
        actual: 0,
    })?;
    if h.base_offset < 0 {
        return Err(BatchError::LengthMismatch {
            declared: h.base_offset,
            actual: 0,
        });
    }
    Ok((h, len))
}

/// Cuts whole batches out of `data` (which starts on a batch boundary at or before `offset`):
/// from the batch holding `offset`, up to `max_bytes` but at least that one batch. Batches that
/// end before `offset` are skipped; a batch at or past `limit_offset` ends the cut (an
/// exclusive bound such as the high watermark).
pub fn cut_batches(data: &[u8], offset: u64, max_bytes: usize, limit_offset: u64) -> Result<Cut> {
    let mut pos = 0usize;
    let start = loop {
        if pos + BATCH_HEADER_LEN > data.len() {
            return Ok(Cut::NeedBytes(pos + BATCH_HEADER_LEN));
        }
        let (h, len) = header_at(data, pos)?;
        if (h.last_offset() as u64) < offset {
            pos += len;
            continue;
        }
        if h.base_offset as u64 >= limit_offset {
            return Ok(Cut::Batches {
                start: pos,
                end: pos,
                next_offset: offset,
            });
        }
        if pos + len > data.len() {
            return Ok(Cut::NeedBytes(pos + len));
        }
        break pos;
    };
    let mut end = start;
    let mut next_offset = offset;
    while end + BATCH_HEADER_LEN <= data.len() {
        let (h, len) = header_at(data, end)?;
        if h.base_offset as u64 >= limit_offset
            || end + len > data.len()
            || (end > start && end + len - start > max_bytes)
        {
            break;
        }
        end += len;
        next_offset = h.last_offset() as u64 + 1;
    }
    Ok(Cut::Batches {
        start,
        end,
        next_offset,
    })
}

/// What [`scan_for_timestamp`] found.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TimeScan {
    /// The first record at or after the timestamp: its offset and timestamp.
    Found(u64, i64),
    /// More bytes from the buffer's start are needed to go on.
    NeedBytes(usize),
    /// Every batch in the buffer, which held the whole rest of the segment, is older.
    NotHere,
}

/// Looks through whole batches of `data` (starting on a batch boundary; `complete` when it runs
/// to the end of the segment) for the first record whose timestamp is at or after `timestamp`.
pub fn scan_for_timestamp(data: &Bytes, timestamp: i64, complete: bool) -> Result<TimeScan> {
    let mut pos = 0usize;
    loop {
        if pos + BATCH_HEADER_LEN > data.len() {
            return Ok(if complete && pos >= data.len() {
                TimeScan::NotHere
            } else {
                TimeScan::NeedBytes(pos + BATCH_HEADER_LEN)
            });
        }
        let (h, len) = header_at(data, pos)?;
        if h.max_timestamp < timestamp {
            pos += len;
            continue;
        }
        if pos + len > data.len() {
            return Ok(TimeScan::NeedBytes(pos + len));
        }
        let records = batch::decode_records(&data.slice(pos..pos + len))?;
        if let Some(r) = records.iter().find(|r| r.record.timestamp >= timestamp) {
            return Ok(TimeScan::Found(r.offset as u64, r.record.timestamp));
        }
        pos += len;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::batch::{ProducerInfo, Record, encode, set_base_offset};

    fn batches(n: u64, per: usize) -> Vec<u8> {
        let mut out = Vec::new();
        for i in 0..n {
            let records: Vec<Record> = (0..per)
                .map(|j| Record {
                    timestamp: 1000 + (i * per as u64 + j as u64) as i64 * 10,
                    key: None,
                    value: Some(Bytes::from(vec![b'x'; 100])),
                    headers: Vec::new(),
                })
                .collect();
            let mut b = encode(&records, ProducerInfo::NONE);
            set_base_offset(&mut b, (i * per as u64) as i64);
            out.extend_from_slice(&b);
        }
        out
    }

    #[test]
    fn cuts_from_the_batch_holding_the_offset_within_the_budget() {
        let data = batches(4, 3);
        let one = data.len() / 4;
        // Offset 4 is in the second batch; a budget of one and a half batches gives one.
        let cut = cut_batches(&data, 4, one + one / 2, u64::MAX).unwrap();
        assert_eq!(
            cut,
            Cut::Batches {
                start: one,
                end: 2 * one,
                next_offset: 6
            }
        );
        // A budget smaller than a batch still gives the whole first batch.
        let cut = cut_batches(&data, 0, 1, u64::MAX).unwrap();
        assert_eq!(
            cut,
            Cut::Batches {
                start: 0,
                end: one,
                next_offset: 3
            }
        );
        // The limit stops before a batch at or past it.
        let cut = cut_batches(&data, 0, usize::MAX, 6).unwrap();
        assert_eq!(
            cut,
            Cut::Batches {
                start: 0,
                end: 2 * one,
                next_offset: 6
            }
        );
    }

    #[test]
    fn a_torn_first_batch_asks_for_its_whole_length() {
        let data = batches(2, 3);
        let one = data.len() / 2;
        assert_eq!(
            cut_batches(&data[..one + 70], 3, usize::MAX, u64::MAX).unwrap(),
            Cut::NeedBytes(2 * one)
        );
        assert_eq!(
            cut_batches(&data[..20], 0, usize::MAX, u64::MAX).unwrap(),
            Cut::NeedBytes(BATCH_HEADER_LEN)
        );
    }

    #[test]
    fn finds_the_first_record_at_or_after_a_timestamp() {
        let data = Bytes::from(batches(3, 4));
        // Record 5 has timestamp 1050.
        assert_eq!(
            scan_for_timestamp(&data, 1045, true).unwrap(),
            TimeScan::Found(5, 1050)
        );
        assert_eq!(
            scan_for_timestamp(&data, 99_999, true).unwrap(),
            TimeScan::NotHere
        );
        assert!(matches!(
            scan_for_timestamp(&data.slice(..data.len() - 1), 1105, false).unwrap(),
            TimeScan::NeedBytes(_)
        ));
    }

    #[test]
    fn garbage_is_an_error_not_a_panic() {
        let mut data = batches(1, 1);
        data[8..12].copy_from_slice(&(-5i32).to_be_bytes());
        assert!(cut_batches(&data, 0, usize::MAX, u64::MAX).is_err());
        assert!(scan_for_timestamp(&Bytes::from(data), 0, true).is_err());
    }
}
