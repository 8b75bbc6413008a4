//! Log compaction, as Kafka's log cleaner does it: the sealed segments of a compacted log are
//! rewritten so that each key keeps only its latest record, every kept record at its own offset
//! (the gaps left are normal, and every reader steps over them).
//!
//! A pass has two halves. [`LogReader::prepare_clean`] runs beside the writer, on segments that
//! no longer change: it decides whether the log is due (its dirty ratio), builds a bounded map
//! of each key's latest offset over the dirty segments, and writes the cleaned copies of the
//! segments up to there, grouped to at most a segment's size, as `.cleaned` files.
//! [`PartitionLog::install_cleaned`] then runs on the writer and swaps each group in:
//!
//! 1. the `.cleaned` files are renamed `.swap`, the log file last: once `NNN.log.swap` exists
//!    the swap is decided, and recovery finishes it;
//! 2. the segment list takes the new segment in place of the group (readers that read through
//!    an old one notice and read again);
//! 3. the group's other segments are deleted and the `.swap` files renamed over the first's,
//!    the log file last.
//!
//! A crash before step 1 leaves `.cleaned` files that recovery deletes: the old segments stand.
//! A crash after it leaves a `.log.swap` that recovery completes: the new one stands. Never a
//! mix. The offset up to which the log is clean is kept in [`CLEAN_OFFSET_FILE`].

use std::collections::HashMap;
use std::hash::BuildHasher;
use std::path::Path;

use tracing::{info, warn};

use super::*;
use crate::batch::DecodedRecord;
use crate::error::StorageError;
use crate::index::{SegmentIndex, SegmentMeta};
use crate::segment::{SegmentFile, SegmentPaths};

/// The file in a partition's directory that keeps the offset below which the log is clean.
pub(crate) const CLEAN_OFFSET_FILE: &str = "clean-offset";

/// Bytes read from a segment at a time while cleaning.
const READ_CHUNK: usize = 1 << 20;

/// How a compacted log is cleaned (a compacted topic's policy, and the engine's map bound).
#[derive(Debug, Clone, PartialEq)]
pub struct CleanSettings {
    /// Tombstones (records with a null value) are kept this long after the newest record of
    /// their segment, so readers get to see the deletion, then cleaned away.
    pub delete_retention_ms: i64,
    /// A record is never cleaned away while younger than this: the dirty part that is cleaned
    /// ends at the first segment holding a record this young.
    pub min_compaction_lag_ms: i64,
    /// Clean only once the dirty part is at least this share of the sealed log's bytes.
    pub min_cleanable_dirty_ratio: f64,
    /// Most keys the map of one pass holds (Kafka's dedupe buffer): a dirty part with more
    /// keys is cleaned over several passes. The first dirty segment is always taken whole.
    pub max_keys: usize,
    /// Cleaned segments are grouped to at most this many bytes of originals each.
    pub segment_bytes: u64,
    /// Bytes between sparse index entries of a cleaned segment.
    pub index_interval_bytes: u64,
}

/// What one pass did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CleanStats {
    /// Segments read (to build the map, and to rewrite) and their bytes.
    pub segments_read: u64,
    pub bytes_read: u64,
    /// Bytes of the cleaned segments written.
    pub bytes_written: u64,
    /// Records cleaned away: superseded by a later record of their key, tombstones past their
    /// retention, and records without a key (which a compacted log cannot keep).
    pub records_removed: u64,
    pub tombstones_removed: u64,
    pub keyless_removed: u64,
    /// Distinct keys in the pass's map (its memory: about 40 bytes each).
    pub keys: u64,
    /// Segments swapped out for cleaned copies.
    pub segments_replaced: u64,
}

/// The cleaned copies of one pass, written and waiting to be swapped in.
#[derive(Debug)]
pub struct Cleaning {
    groups: Vec<CleanedGroup>,
    /// Offsets below this are clean once every group is in.
    cleaned_to: u64,
    stats: CleanStats,
}

/// One cleaned segment and the segments it replaces.
#[derive(Debug)]
struct CleanedGroup {
    replaces: Vec<Arc<Segment>>,
    meta: SegmentMeta,
    index: SegmentIndex,
}

impl Cleaning {
    /// What preparing it did so far.
    pub fn stats(&self) -> CleanStats {
        self.stats
    }
}

/// The 128-bit digest a key is known by in a pass's map: two SipHashes under random keys (a
/// collision would clean away a live key's record, so 64 bits were not enough; Kafka uses
/// 128-bit MD5).
struct KeyDigest(std::hash::RandomState, std::hash::RandomState);

impl KeyDigest {
    fn new() -> Self {
        Self(std::hash::RandomState::new(), std::hash::RandomState::new())
    }

    fn of(&self, key: &[u8]) -> u128 {
        (u128::from(self.0.hash_one(key)) << 64) | u128::from(self.1.hash_one(key))
    }
}

/// Reads every batch of a sealed segment, in order, handing each to `f`.
fn each_batch(segment: &Segment, mut f: impl FnMut(Bytes) -> Result<()>) -> Result<u64> {
    let mut offset = segment.base_offset;
    let mut bytes = 0u64;
    while let Some(chunk) = segment.read_from(offset, READ_CHUNK, u64::MAX)? {
        if chunk.data.is_empty() {
            break;
        }
        bytes += chunk.data.len() as u64;
        offset = chunk.next_offset;
        for batch in batch::split_batches(chunk.data)? {
            f(batch)?;
        }
    }
    Ok(bytes)
}

impl LogReader {
    /// The offset below which the log is clean (0 before its first pass).
    pub fn cleaned_to(&self) -> u64 {
        self.shared.cleaned_to.load(Ordering::Acquire)
    }

    /// Prepares one cleaning pass of a compacted log, beside its writer: `None` when the log
    /// is not due (too little dirty, or nothing old enough). The cleaned copies are written as
    /// `.cleaned` files; [`PartitionLog::install_cleaned`] swaps them in, or they are deleted
    /// by the next pass or the next start.
    pub fn prepare_clean(
        &self,
        storage: &Arc<dyn Storage>,
        now_ms: i64,
        settings: &CleanSettings,
    ) -> Result<Option<Cleaning>> {
        let mut sealed: Vec<Arc<Segment>> = self.shared.segments.read().clone();
        sealed.pop();
        sealed.retain(|s| s.sealed.get().is_some());
        let Some(last) = sealed.last() else {
            return Ok(None);
        };
        let active_base = last.sealed.get().map_or(0, |m| m.last_offset + 1);
        let cleaned_to = self.cleaned_to();
        let meta = |s: &Segment| *s.sealed.get().expect("only sealed segments are kept");
        let total: u64 = sealed.iter().map(|s| meta(s).size_bytes).sum();
        let dirty: Vec<&Arc<Segment>> = sealed
            .iter()
            .filter(|s| meta(s).last_offset >= cleaned_to)
            .collect();
        let dirty_bytes: u64 = dirty.iter().map(|s| meta(s).size_bytes).sum();
        if total == 0 || (dirty_bytes as f64) < settings.min_cleanable_dirty_ratio * total as f64 {
            return Ok(None);
        }
        // The map: each key's latest offset over the dirty segments old enough to clean, as
        // many whole segments as the map holds.
        let digest = KeyDigest::new();
        let mut latest: HashMap<u128, u64> = HashMap::new();
        let mut stats = CleanStats::default();
        let mut end = None;
        let young = now_ms.saturating_sub(settings.min_compaction_lag_ms);
        for (i, s) in dirty.iter().enumerate() {
            let m = meta(s);
            if m.max_timestamp > young
                || (i > 0 && latest.len() + m.record_count as usize > settings.max_keys)
            {
                break;
            }
            let read = each_batch(s, |batch| {
                for r in batch::decode_records(&batch)? {
                    if let Some(key) = &r.record.key {
                        latest.insert(digest.of(key), r.offset as u64);
                    }
                }
                Ok(())
            })?;
            stats.bytes_read += read;
            stats.segments_read += 1;
            end = Some(
                dirty
                    .get(i + 1)
                    .map_or(active_base, |next| next.base_offset),
            );
        }
        let Some(end) = end else {
            return Ok(None);
        };
        stats.keys = latest.len() as u64;
        let horizon = now_ms.saturating_sub(settings.delete_retention_ms);
        let mut groups = Vec::new();
        let mut pending: Vec<Arc<Segment>> = Vec::new();
        let mut pending_bytes = 0u64;
        let to_clean: Vec<Arc<Segment>> = sealed
            .iter()
            .filter(|s| s.base_offset < end)
            .cloned()
            .collect();
        for (i, s) in to_clean.iter().enumerate() {
            pending_bytes += meta(s).size_bytes;
            pending.push(s.clone());
            let next = to_clean.get(i + 1);
            let full =
                next.is_none_or(|n| pending_bytes + meta(n).size_bytes > settings.segment_bytes);
            if full {
                let group_end = next.map_or(end, |n| n.base_offset);
                let replaces = std::mem::take(&mut pending);
                pending_bytes = 0;
                let written = self.write_cleaned(
                    storage,
                    replaces,
                    group_end,
                    (&latest, &digest, horizon, now_ms),
                    settings.index_interval_bytes,
                    &mut stats,
                );
                match written {
                    Ok(group) => groups.push(group),
                    Err(e) => {
                        for g in &groups {
                            remove_cleaned(storage.as_ref(), &self.shared.dir, g.meta.base_offset);
                        }
                        return Err(e);
                    }
                }
            }
        }
        Ok(Some(Cleaning {
            groups,
            cleaned_to: end,
            stats,
        }))
    }

    /// Writes the cleaned copy of `replaces` (consecutive sealed segments covering offsets up
    /// to `group_end`) as `.cleaned` files.
    fn write_cleaned(
        &self,
        storage: &Arc<dyn Storage>,
        replaces: Vec<Arc<Segment>>,
        group_end: u64,
        (latest, digest, horizon, now_ms): (&HashMap<u128, u64>, &KeyDigest, i64, i64),
        index_interval: u64,
        stats: &mut CleanStats,
    ) -> Result<CleanedGroup> {
        let dir = &self.shared.dir;
        let base = replaces[0].base_offset;
        remove_cleaned(storage.as_ref(), dir, base);
        let paths = SegmentPaths::with_suffix(dir, base, ".cleaned");
        let file = storage
            .open(&paths.log, true)
            .map_err(StorageError::io("create", &paths.log))?;
        let (mut min_ts, mut max_ts) = (i64::MAX, i64::MIN);
        for s in &replaces {
            let m = *s.sealed.get().expect("only sealed segments are cleaned");
            min_ts = min_ts.min(m.min_timestamp);
            max_ts = max_ts.max(m.max_timestamp);
            let tombstones_expire = m.max_timestamp < horizon;
            let read = each_batch(s, |batch| {
                let records = batch::decode_records(&batch)?;
                let kept: Vec<DecodedRecord> = records
                    .iter()
                    .filter(|r| {
                        let Some(key) = &r.record.key else {
                            stats.keyless_removed += 1;
                            return false;
                        };
                        if latest
                            .get(&digest.of(key))
                            .is_some_and(|&newest| (r.offset as u64) < newest)
                        {
                            return false;
                        }
                        if r.record.value.is_none() && tombstones_expire {
                            stats.tombstones_removed += 1;
                            return false;
                        }
                        true
                    })
                    .cloned()
                    .collect();
                stats.records_removed += (records.len() - kept.len()) as u64;
                let out = if kept.len() == records.len() {
                    BytesMut::from(&batch[..])
                } else if kept.is_empty() {
                    return Ok(());
                } else {
                    batch::filtered(&batch, &kept)?
                };
                stats.bytes_written += out.len() as u64;
                file.append(&[std::io::IoSlice::new(&out)])
                    .map_err(StorageError::io("write", &paths.log))
            })?;
            stats.bytes_read += read;
            stats.segments_read += 1;
        }
        file.sync_data()
            .map_err(StorageError::io("fsync", &paths.log))?;
        let scan = Segment::scan_validate(file.as_ref(), &paths.log, base, index_interval)?;
        drop(file);
        let meta = SegmentMeta {
            base_offset: base,
            // The whole range the group covered, so the next segment still follows it.
            last_offset: group_end - 1,
            min_timestamp: if scan.batch_count > 0 {
                scan.min_timestamp
            } else {
                min_ts
            },
            max_timestamp: if scan.batch_count > 0 {
                scan.max_timestamp
            } else {
                max_ts
            },
            size_bytes: scan.valid_len,
            record_count: scan.record_count,
            batch_count: scan.batch_count,
            sealed_at_ms: now_ms,
        };
        for (path, bytes) in [
            (&paths.index, scan.index.encode_offsets(base)),
            (&paths.time_index, scan.index.encode_times(base)),
            (&paths.seal, meta.encode().to_vec()),
        ] {
            storage
                .write_file_atomic(path, &bytes)
                .map_err(StorageError::io("write", path))?;
        }
        Ok(CleanedGroup {
            replaces,
            meta,
            index: scan.index,
        })
    }
}

/// Deletes the `.cleaned` files of a group starting at `base`, if any.
fn remove_cleaned(storage: &dyn Storage, dir: &Path, base: u64) {
    for path in SegmentPaths::with_suffix(dir, base, ".cleaned").all() {
        let _ = storage.remove_file(path);
    }
}

impl PartitionLog {
    /// Swaps the cleaned copies of a pass in, group by group (see the module's steps), then
    /// records how far the log is clean. A group whose segments changed meanwhile (retention
    /// deleted some) is not swapped in, nor any after it; its files are deleted.
    pub fn install_cleaned(&mut self, cleaning: Cleaning) -> Result<CleanStats> {
        let mut stats = cleaning.stats;
        let dir = self.shared.dir.clone();
        let mut groups = cleaning.groups.into_iter();
        let mut complete = true;
        for group in groups.by_ref() {
            if !self.still_in_place(&group) {
                remove_cleaned(self.storage.as_ref(), &dir, group.meta.base_offset);
                complete = false;
                break;
            }
            stats.segments_replaced += group.replaces.len() as u64;
            self.swap_in(group)?;
        }
        for rest in groups {
            remove_cleaned(self.storage.as_ref(), &dir, rest.meta.base_offset);
        }
        if complete {
            let path = dir.join(CLEAN_OFFSET_FILE);
            self.storage
                .write_file_atomic(&path, cleaning.cleaned_to.to_string().as_bytes())
                .map_err(StorageError::io("write", &path))?;
            self.shared
                .cleaned_to
                .store(cleaning.cleaned_to, Ordering::Release);
        }
        Ok(stats)
    }

    /// Whether the group's segments are still in the log, one after another, as they were.
    fn still_in_place(&self, group: &CleanedGroup) -> bool {
        let list = self.shared.segments.read();
        let Some(i) = list.iter().position(|s| Arc::ptr_eq(s, &group.replaces[0])) else {
            return false;
        };
        // The active segment is never part of a group.
        list.len() > i + group.replaces.len()
            && list[i..i + group.replaces.len()]
                .iter()
                .zip(&group.replaces)
                .all(|(a, b)| Arc::ptr_eq(a, b))
    }

    fn swap_in(&mut self, group: CleanedGroup) -> Result<()> {
        let storage = self.storage.clone();
        let dir = self.shared.dir.clone();
        let base = group.meta.base_offset;
        let cleaned = SegmentPaths::with_suffix(&dir, base, ".cleaned");
        let swap = SegmentPaths::with_suffix(&dir, base, ".swap");
        let fin = SegmentPaths::new(&dir, base);
        let rename = |from: &Path, to: &Path| {
            storage
                .rename(from, to)
                .map_err(StorageError::io("rename", from))
        };
        // 1. Decided: the log's `.swap` is the last to appear.
        for (from, to) in cleaned.all().into_iter().zip(swap.all()) {
            rename(from, to)?;
        }
        storage
            .sync_dir(&dir)
            .map_err(StorageError::io("sync directory", &dir))?;
        // 2. The new segment reads its file through the handle opened now, whatever its name
        // becomes, until step 3 is done.
        let file = storage
            .open(&swap.log, false)
            .map_err(StorageError::io("open", &swap.log))?;
        let segment = Segment::new(base, SegmentFile::new(storage.clone(), file), fin.clone());
        *segment.index.write() = group.index;
        segment.size.store(group.meta.size_bytes, Ordering::Release);
        segment
            .next_offset
            .store(group.meta.last_offset + 1, Ordering::Release);
        segment
            .max_timestamp
            .store(group.meta.max_timestamp, Ordering::Release);
        let _ = segment.sealed.set(group.meta);
        let segment = Arc::new(segment);
        {
            let mut list = self.shared.segments.write();
            let i = list
                .iter()
                .position(|s| Arc::ptr_eq(s, &group.replaces[0]))
                .expect("checked in place under the writer");
            list.splice(i..i + group.replaces.len(), [segment.clone()]);
            for old in &group.replaces {
                old.replaced.store(true, Ordering::Release);
            }
        }
        // 3. The rest of the group goes, and the new files take the first one's names.
        let others: Vec<Arc<Segment>> = group
            .replaces
            .iter()
            .filter(|s| s.base_offset != base)
            .cloned()
            .collect();
        super::retention::remove_segment_files(storage.as_ref(), &others)?;
        for (from, to) in swap.all().into_iter().zip(fin.all()) {
            rename(from, to)?;
        }
        storage
            .sync_dir(&dir)
            .map_err(StorageError::io("sync directory", &dir))?;
        segment.file.release();
        info!(
            segment = %fin.log.display(),
            replaced = group.replaces.len(),
            bytes = segment.size(),
            "swapped in a cleaned segment"
        );
        Ok(())
    }

    /// Finishes or undoes what a cleaning pass left in `dir` when the process stopped: a group
    /// whose log file reached `.swap` is swapped in (its other old segments deleted, its files
    /// renamed), anything else it left (`.cleaned` files, `.swap` files of an undecided
    /// group) is deleted. Runs before the segments are opened.
    pub(super) fn finish_swaps(storage: &dyn Storage, dir: &Path, names: &[String]) -> Result<()> {
        let decided: Vec<u64> = names
            .iter()
            .filter_map(|n| n.strip_suffix(".log.swap"))
            .filter_map(|stem| stem.parse().ok())
            .collect();
        for &base in &decided {
            let swap = SegmentPaths::with_suffix(dir, base, ".swap");
            let fin = SegmentPaths::new(dir, base);
            let seal = storage
                .read_file(&swap.seal)
                .or_else(|_| storage.read_file(&fin.seal))
                .ok()
                .and_then(|b| SegmentMeta::decode(&b));
            let Some(seal) = seal else {
                warn!(dir = %dir.display(), base, "a decided cleaned segment has no seal; keeping the old segments");
                for path in swap.all() {
                    let _ = storage.remove_file(path);
                }
                continue;
            };
            for name in names {
                let Some((old, "log")) = name.split_once('.').and_then(|(stem, ext)| {
                    (stem.len() == 20).then(|| stem.parse::<u64>().ok().map(|b| (b, ext)))?
                }) else {
                    continue;
                };
                if old > base && old <= seal.last_offset {
                    for path in SegmentPaths::new(dir, old).all() {
                        let _ = storage.remove_file(path);
                    }
                }
            }
            for (from, to) in swap.all().into_iter().zip(fin.all()) {
                match storage.rename(from, to) {
                    // Renamed before the stop.
                    Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
                    r => r.map_err(StorageError::io("rename", from))?,
                }
            }
            info!(dir = %dir.display(), base, "finished swapping in a cleaned segment after a restart");
        }
        for name in names {
            let undecided = name.ends_with(".swap")
                && !decided
                    .iter()
                    .any(|b| name.starts_with(&format!("{b:020}.")));
            if name.ends_with(".cleaned") || undecided {
                let _ = storage.remove_file(&dir.join(name));
            }
        }
        storage
            .sync_dir(dir)
            .map_err(StorageError::io("sync directory", dir))
    }

    /// The clean offset a pass left in [`CLEAN_OFFSET_FILE`] (0 when none or unreadable: the
    /// whole log then counts as dirty, which costs a pass, never data).
    pub(super) fn load_cleaned_to(storage: &dyn Storage, dir: &Path) -> u64 {
        storage
            .read_file(&dir.join(CLEAN_OFFSET_FILE))
            .ok()
            .and_then(|b| std::str::from_utf8(&b).ok()?.trim().parse().ok())
            .unwrap_or(0)
    }
}
