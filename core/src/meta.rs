//! Where topic metadata lives. Kept behind [`MetadataStore`] so that a coordination service
//! (etcd) can hold it when Sluice runs on several nodes; the embedded default is a JSON file per
//! topic in the data directory (`storage/FORMAT.md`, "Topic metadata").

use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::{Deserialize, Serialize};
use sluice_storage::Storage;
use tracing::warn;

use crate::error::{CoreError, Result};
use crate::policy::TopicPolicy;

const META_VERSION: u32 = 1;
const META_FILE: &str = "topic.json";
const RESOURCES_DIR: &str = "resources";

/// The persisted description of a topic.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TopicMeta {
    pub version: u32,
    pub name: String,
    pub partitions: u32,
    pub created_at_ms: i64,
    pub policy: TopicPolicy,
}

impl TopicMeta {
    pub(crate) fn new(name: &str, partitions: u32, policy: TopicPolicy, now_ms: i64) -> Self {
        Self {
            version: META_VERSION,
            name: name.to_owned(),
            partitions,
            created_at_ms: now_ms,
            policy,
        }
    }
}

/// Durable topic metadata and the location of each partition's log.
pub trait MetadataStore: Send + Sync + fmt::Debug + 'static {
    /// Every topic, after clearing whatever a crash left half done.
    fn load_topics(&self) -> Result<Vec<TopicMeta>>;
    /// Creates or replaces a topic's metadata atomically.
    fn save_topic(&self, meta: &TopicMeta) -> Result<()>;
    /// Removes a topic's metadata and data; atomic with respect to crashes.
    fn delete_topic(&self, name: &str) -> Result<()>;
    fn partition_dir(&self, topic: &str, partition: u32) -> PathBuf;
    /// Every saved resource of `kind` (cameras, ...): the gateway's other runtime objects that
    /// must survive a restart, each a JSON document under a name the caller has validated.
    fn load_resources(&self, kind: &str) -> Result<Vec<Vec<u8>>>;
    /// Creates or replaces one resource atomically.
    fn save_resource(&self, kind: &str, name: &str, json: &[u8]) -> Result<()>;
    /// Removes one resource; removing one that is not there is no error.
    fn delete_resource(&self, kind: &str, name: &str) -> Result<()>;
}

/// Metadata as `topics/<name>/topic.json` under the data directory.
#[derive(Debug)]
pub struct FileMetadataStore {
    root: PathBuf,
    storage: Arc<dyn Storage>,
}

impl FileMetadataStore {
    pub fn new(data_dir: &Path, storage: Arc<dyn Storage>) -> Self {
        Self {
            root: data_dir.to_path_buf(),
            storage,
        }
    }

    fn topics_dir(&self) -> PathBuf {
        self.root.join("topics")
    }

    fn trash_dir(&self) -> PathBuf {
        self.root.join("trash")
    }

    fn topic_dir(&self, name: &str) -> PathBuf {
        self.topics_dir().join(name)
    }

    fn resource_path(&self, kind: &str, name: &str) -> Result<PathBuf> {
        // Names become file names: nothing that could leave the directory or hide in it.
        let plain = |s: &str| {
            !s.is_empty()
                && !s.starts_with('.')
                && s.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b))
        };
        let path = self
            .root
            .join(RESOURCES_DIR)
            .join(kind)
            .join(format!("{name}.json"));
        if !plain(kind) || !plain(name) {
            return Err(CoreError::metadata(path)(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "a resource's kind and name must be plain file names",
            )));
        }
        Ok(path)
    }
}

impl MetadataStore for FileMetadataStore {
    fn load_topics(&self) -> Result<Vec<TopicMeta>> {
        let s = &self.storage;
        let (topics, trash) = (self.topics_dir(), self.trash_dir());
        for dir in [&topics, &trash] {
            s.create_dir_all(dir).map_err(CoreError::metadata(dir))?;
        }
        for name in s.list_dir(&trash).map_err(CoreError::metadata(&trash))? {
            let path = trash.join(name);
            s.remove_dir_all(&path)
                .map_err(CoreError::metadata(&path))?;
        }
        let mut out = Vec::new();
        for name in s.list_dir(&topics).map_err(CoreError::metadata(&topics))? {
            let path = topics.join(&name).join(META_FILE);
            let bytes = match s.read_file(&path) {
                Ok(b) => b,
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                    // Created by a create-topic that crashed before its metadata was written.
                    warn!(dir = %topics.join(&name).display(), "removing topic directory without metadata");
                    let dir = topics.join(&name);
                    s.remove_dir_all(&dir).map_err(CoreError::metadata(&dir))?;
                    continue;
                }
                Err(e) => return Err(CoreError::metadata(&path)(e)),
            };
            let meta: TopicMeta = serde_json::from_slice(&bytes).map_err(|e| {
                CoreError::metadata(&path)(std::io::Error::new(std::io::ErrorKind::InvalidData, e))
            })?;
            if meta.name != name || meta.version != META_VERSION {
                return Err(CoreError::metadata(&path)(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    format!("names topic {:?} version {}", meta.name, meta.version),
                )));
            }
            out.push(meta);
        }
        out.sort_by(|a, b| a.name.cmp(&b.name));
        Ok(out)
    }

    fn save_topic(&self, meta: &TopicMeta) -> Result<()> {
        let dir = self.topic_dir(&meta.name);
        self.storage
            .create_dir_all(&dir)
            .map_err(CoreError::metadata(&dir))?;
        let path = dir.join(META_FILE);
        let json = serde_json::to_vec_pretty(meta).map_err(|e| {
            CoreError::metadata(&path)(std::io::Error::new(std::io::ErrorKind::InvalidData, e))
        })?;
        self.storage
            .write_file_atomic(&path, &json)
            .map_err(CoreError::metadata(&path))
    }

    fn delete_topic(&self, name: &str) -> Result<()> {
        let from = self.topic_dir(name);
        let to = self.trash_dir().join(format!(
            "{name}-{}",
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos())
        ));
        let s = &self.storage;
        s.rename(&from, &to).map_err(CoreError::metadata(&from))?;
        s.sync_dir(&self.topics_dir())
            .map_err(CoreError::metadata(self.topics_dir()))?;
        s.remove_dir_all(&to).map_err(CoreError::metadata(&to))
    }

    fn partition_dir(&self, topic: &str, partition: u32) -> PathBuf {
        self.topic_dir(topic).join(partition.to_string())
    }

    fn load_resources(&self, kind: &str) -> Result<Vec<Vec<u8>>> {
        let dir = self.resource_path(kind, "x")?.with_file_name("");
        let s = &self.storage;
        s.create_dir_all(&dir).map_err(CoreError::metadata(&dir))?;
        let mut names = s.list_dir(&dir).map_err(CoreError::metadata(&dir))?;
        names.sort();
        let mut out = Vec::new();
        for name in names.iter().filter(|n| n.ends_with(".json")) {
            let path = dir.join(name);
            match s.read_file(&path) {
                Ok(bytes) => out.push(bytes),
                // One unreadable resource must not keep the gateway from starting.
                Err(e) => {
                    warn!(path = %path.display(), error = %e, "skipping an unreadable resource")
                }
            }
        }
        Ok(out)
    }

    fn save_resource(&self, kind: &str, name: &str, json: &[u8]) -> Result<()> {
        let path = self.resource_path(kind, name)?;
        let dir = path.with_file_name("");
        self.storage
            .create_dir_all(&dir)
            .map_err(CoreError::metadata(&dir))?;
        self.storage
            .write_file_atomic(&path, json)
            .map_err(CoreError::metadata(&path))
    }

    fn delete_resource(&self, kind: &str, name: &str) -> Result<()> {
        let path = self.resource_path(kind, name)?;
        match self.storage.remove_file(&path) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                return Err(CoreError::metadata(&path)(e));
            }
            _ => {}
        }
        let dir = path.with_file_name("");
        self.storage
            .sync_dir(&dir)
            .map_err(CoreError::metadata(&dir))
    }
}
