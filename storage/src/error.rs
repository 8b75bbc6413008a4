use std::io;
use std::path::PathBuf;

use crate::batch::BatchError;

/// Errors of the partition log.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StorageError {
    #[error("{op} {path}: {source}")]
    Io {
        op: &'static str,
        path: PathBuf,
        #[source]
        source: io::Error,
    },
    #[error("partition log {path} refuses writes after a failed fsync; restart to recover")]
    Poisoned { path: PathBuf },
    #[error("invalid record batch: {0}")]
    InvalidBatch(#[from] BatchError),
    #[error("offset {offset} is outside the log [{log_start}, {high_watermark}]")]
    OffsetOutOfRange {
        offset: u64,
        log_start: u64,
        high_watermark: u64,
    },
    #[error("batch of {size} bytes is larger than a segment can hold ({limit} bytes)")]
    BatchTooLarge { size: usize, limit: u64 },
    /// The offloaded part of the log could not be read (the object store failed or holds
    /// something other than its manifest says): the same read may succeed later.
    #[error("remote segment read failed: {reason}")]
    Remote { reason: String },
    /// Cluster mode: the group was not made durable in the object store and etcd (fenced, or
    /// either failing), so it was not written here either.
    #[error("not committed to the cluster: {reason}")]
    Uncommitted { reason: String },
}

impl StorageError {
    pub(crate) fn io(op: &'static str, path: impl Into<PathBuf>) -> impl FnOnce(io::Error) -> Self {
        let path = path.into();
        move |source| Self::Io { op, path, source }
    }
}

pub type Result<T, E = StorageError> = std::result::Result<T, E>;
