//! Keeping a partition's manifest in step with the store: syncing with its newest version,
//! writing new versions with a conditional put, installing them locally, deleting objects.

use std::collections::HashSet;
use std::sync::atomic::Ordering;

use bytes::Bytes;
use object_store::{PutMode, PutOptions};
use sluice_storage::{FsStorage, Storage};
use tracing::info;

use super::*;

impl PartitionTier {
    /// Compares the manifest with the store's newest and takes whichever is newer, then
    /// deletes objects no manifest names (uploads cut short, deletes that failed).
    pub(super) async fn sync(&self, reader: &LogReader) -> Result<(), String> {
        let dir = ObjPath::from(format!("{}/manifest", self.root));
        let listed: Vec<_> = self
            .store()
            .list(Some(&dir))
            .try_collect()
            .await
            .map_err(|e| {
                self.counters().fail_list.inc();
                format!("list {dir}: {e}")
            })?;
        let versions: Vec<(u64, ObjPath)> = listed
            .iter()
            .filter_map(|o| {
                let name = o.location.filename()?;
                let v = name.strip_suffix(".json")?.parse().ok()?;
                Some((v, o.location.clone()))
            })
            .collect();
        let local = self.manifest();
        let newest = versions.iter().max_by_key(|(v, _)| *v).cloned();
        match newest {
            Some((v, path)) if v > local.version => {
                let bytes = self.get_all(&path).await?;
                let m: Manifest =
                    serde_json::from_slice(&bytes).map_err(|e| format!("manifest {path}: {e}"))?;
                m.check(&self.topic, self.partition, self.incarnation)?;
                info!(
                    topic = self.topic,
                    partition = self.partition,
                    version = v,
                    "took the store's newer offload manifest"
                );
                self.install(m, reader).await?;
            }
            Some((v, _)) if v == local.version => {}
            _ if local.version == 0 => {}
            _ => {
                warn!(
                    topic = self.topic,
                    partition = self.partition,
                    version = local.version,
                    "the store has no copy of the offload manifest; writing it again"
                );
                self.put_manifest(&local).await?;
            }
        }
        let current = self.manifest();
        for (v, path) in &versions {
            if *v + 1 < current.version {
                self.delete_quietly(path).await;
            }
        }
        let named: HashSet<u64> = current.segments.iter().map(|s| s.base_offset).collect();
        let seg_dir = ObjPath::from(format!("{}/segments", self.root));
        let objects: Vec<_> = self
            .store()
            .list(Some(&seg_dir))
            .try_collect()
            .await
            .map_err(|e| {
                self.counters().fail_list.inc();
                format!("list {seg_dir}: {e}")
            })?;
        for o in objects {
            let base = o
                .location
                .filename()
                .and_then(|n| n.split('.').next())
                .and_then(|b| b.parse::<u64>().ok());
            if base.is_none_or(|b| !named.contains(&b)) {
                self.delete_quietly(&o.location).await;
            }
        }
        self.synced.store(true, Ordering::Release);
        Ok(())
    }

    pub(super) async fn get_all(&self, path: &ObjPath) -> Result<Bytes, String> {
        let got = match self.store().get(path).await {
            Ok(r) => r.bytes().await,
            Err(e) => Err(e),
        };
        got.map_err(|e| {
            self.counters().fail_get.inc();
            format!("GET {path}: {e}")
        })
    }

    async fn delete_quietly(&self, path: &ObjPath) {
        if let Err(e) = self.store().delete(path).await {
            self.counters().fail_delete.inc();
            warn!(object = %path, error = %e, "could not delete an object; retried at the next sync");
        }
    }

    pub(super) async fn delete_segment_objects(&self, base: u64) {
        // The log object goes last: index objects without it are swept as orphans.
        for ext in ["index", "timeindex", "seal", "log"] {
            self.delete_quietly(&self.segment_key(base, ext)).await;
        }
        self.indexes.lock().remove(&base);
    }

    /// Writes version `m.version` of the manifest; fails if that version exists already.
    async fn put_manifest(&self, m: &Manifest) -> Result<(), String> {
        let body = serde_json::to_vec_pretty(m).map_err(|e| e.to_string())?;
        let key = self.manifest_key(m.version);
        let opts = PutOptions {
            mode: PutMode::Create,
            ..Default::default()
        };
        match self.store().put_opts(&key, body.into(), opts).await {
            Ok(_) => Ok(()),
            Err(object_store::Error::AlreadyExists { .. }) => {
                self.counters().fail_manifest.inc();
                // Another writer won this version: read theirs before going on.
                self.synced.store(false, Ordering::Release);
                Err(format!(
                    "manifest version {} of {}/{} was written by another writer",
                    m.version, self.topic, self.partition
                ))
            }
            Err(e) => {
                self.counters().fail_manifest.inc();
                Err(format!("PUT {key}: {e}"))
            }
        }
    }

    /// Puts the next manifest version, then makes it the local one.
    pub(super) async fn commit(&self, next: Manifest, reader: &LogReader) -> Result<(), String> {
        self.put_manifest(&next).await?;
        let version = next.version;
        self.install(next, reader).await?;
        if version >= 2 {
            self.delete_quietly(&self.manifest_key(version - 2)).await;
        }
        Ok(())
    }

    /// Writes the local copy, then serves `m`.
    async fn install(&self, m: Manifest, reader: &LogReader) -> Result<(), String> {
        let body = serde_json::to_vec_pretty(&m).map_err(|e| e.to_string())?;
        let path = self.local_copy.clone();
        let written =
            tokio::task::spawn_blocking(move || FsStorage.write_file_atomic(&path, &body)).await;
        if !matches!(written, Ok(Ok(()))) {
            self.counters().fail_local.inc();
            return Err(format!(
                "could not write {}: {written:?}",
                self.local_copy.display()
            ));
        }
        let (start, end) = m.range();
        let kept: HashSet<u64> = m.segments.iter().map(|s| s.base_offset).collect();
        *self.manifest.write() = Arc::new(m);
        reader.set_remote_range(start, end);
        self.indexes.lock().retain(|base, _| kept.contains(base));
        Ok(())
    }
}
