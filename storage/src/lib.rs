//! Sluice's storage layer: partition logs made of segment files that hold Kafka RecordBatch v2
//! batches verbatim, with sparse offset and time indexes, crash recovery, rolling, sealing and
//! retention. The byte layout of every file is specified in `storage/FORMAT.md`.
//!
//! This crate owns files and bytes only; the offloaded part of a log is reached through the
//! [`RemoteLog`] trait, implemented by the object-store tier (`sluice-tier`). It knows nothing of topics, protocols or async
//! runtimes, depends on no other Sluice crate, and never acknowledges anything: the caller
//! decides when a commit (and its fsync) makes appended batches durable and visible.

mod batch;
mod clock;
mod compression;
mod direct;
mod error;
mod index;
mod io;
mod log;
mod mapped;
mod remote;
mod segment;

pub use batch::{
    BATCH_HEADER_LEN, BatchBuf, BatchError, BatchHeader, Compression, DecodedRecord, OneRecord,
    OpenBatch, PLACED_ENCODE_MIN, ProducerInfo, Record, decode_records, encode as encode_batch,
    encode_at as encode_batch_at, set_base_offset, split_batches, validate as validate_batch,
    validate_whole,
};
pub use clock::{Clock, ManualClock, SystemClock};
pub use compression::MAX_DECOMPRESSED_BYTES;
pub use direct::{DirectFsStorage, DirectStats};
pub use error::{Result, StorageError};
pub use index::SegmentMeta;
pub use io::{Faults, FaultyStorage, FsStorage, LogFile, Storage};
pub use log::{
    AppendInfo, CleanSettings, CleanStats, Cleaning, DetachedSegments, Fetched, LogConfig,
    LogReader, LogStats, MAX_SEGMENT_BYTES, PartitionLog, RecoveryReport, RetentionOutcome,
    ValidatedBatch,
};
pub use mapped::MappedBuf;
pub use remote::{
    Cut, RemoteLog, SealedSegmentFiles, SegmentIndexes, TimeScan, cut_batches, scan_for_timestamp,
};
