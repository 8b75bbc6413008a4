//! The offload pass: uploading sealed segments and naming them in the manifest, then
//! applying retention.

use std::sync::atomic::Ordering;

use object_store::WriteMultipart;
use sluice_storage::SealedSegmentFiles;
use tokio::io::AsyncReadExt;

use super::retention::plan;
use super::*;

/// Segments one manifest version adds at most: the versions (a PUT and two local fsyncs each)
/// stay few when a pass finds many segments, and an interrupted pass redoes at most these.
const SEGMENTS_PER_MANIFEST: usize = 8;

impl PartitionTier {
    /// One pass: sync with the store once, upload sealed segments in order, then apply
    /// retention. Failures stop the pass where they happen and are reported; the local disk
    /// keeps everything not yet offloaded.
    pub(crate) async fn pass(
        &self,
        reader: &LogReader,
        policy: PassPolicy,
        now_ms: i64,
    ) -> PassOutcome {
        let _pass = self.pass_lock.lock().await;
        let mut out = PassOutcome {
            partition: self.partition,
            ..Default::default()
        };
        let has_remote = !self.manifest().segments.is_empty();
        if (policy.upload || has_remote)
            && !self.synced.load(Ordering::Acquire)
            && let Err(e) = self.sync(reader).await
        {
            out.fail(e);
        }
        let synced = self.synced.load(Ordering::Acquire);
        if synced && policy.upload {
            let mut staged: Vec<ManifestSegment> = Vec::new();
            for seg in reader.sealed_segment_files() {
                let end = staged.last().map(|s| s.last_offset + 1).or_else(|| {
                    let m = self.manifest();
                    (!m.segments.is_empty()).then(|| m.range().1)
                });
                if end.is_some_and(|end| seg.meta.base_offset < end) {
                    continue;
                }
                if let Err(e) = self.upload(&seg).await {
                    warn!(topic = self.topic, partition = self.partition, segment = seg.meta.base_offset,
                        error = %e, "segment upload failed; retried at the next pass");
                    out.fail(e);
                    break;
                }
                staged.push(ManifestSegment::from(&seg.meta));
                if staged.len() >= SEGMENTS_PER_MANIFEST
                    && let Err(e) = self.commit_staged(&mut staged, &mut out, reader).await
                {
                    out.fail(e);
                    break;
                }
            }
            if let Err(e) = self.commit_staged(&mut staged, &mut out, reader).await {
                out.fail(e);
            }
        }
        let m = self.manifest();
        let plan = plan(
            &m,
            &reader.sealed_segments(),
            reader.stats(),
            policy,
            now_ms,
        );
        let (remote_start, _) = m.range();
        if synced && !m.segments.is_empty() && plan.remote_below > remote_start {
            let gone: Vec<u64> = m
                .segments
                .iter()
                .filter(|s| s.last_offset < plan.remote_below)
                .map(|s| s.base_offset)
                .collect();
            match self
                .commit(m.trimmed_below(plan.remote_below), reader)
                .await
            {
                Ok(()) => {
                    for base in &gone {
                        self.delete_segment_objects(*base).await;
                    }
                    out.remote_deleted_segments = gone.len() as u64;
                    self.remote_deleted_segments
                        .fetch_add(gone.len() as u64, Ordering::Relaxed);
                }
                Err(e) => out.fail(e),
            }
        }
        if plan.local_below > reader.local_start() {
            out.delete_local_before = Some(plan.local_below);
        }
        out
    }

    /// Names the uploaded segments in the next manifest version (one version for all of them).
    async fn commit_staged(
        &self,
        staged: &mut Vec<ManifestSegment>,
        out: &mut PassOutcome,
        reader: &LogReader,
    ) -> Result<(), String> {
        if staged.is_empty() {
            return Ok(());
        }
        let current = self.manifest();
        let mut next = (*current).clone();
        for s in staged.iter() {
            next = next.appended(s.clone());
        }
        next.version = current.version + 1;
        let (segments, bytes) = (
            staged.len() as u64,
            staged.iter().map(|s| s.size_bytes).sum::<u64>(),
        );
        staged.clear();
        self.commit(next, reader).await?;
        out.uploaded_segments += segments;
        out.uploaded_bytes += bytes;
        self.uploaded_segments
            .fetch_add(segments, Ordering::Relaxed);
        self.uploaded_bytes.fetch_add(bytes, Ordering::Relaxed);
        Ok(())
    }

    async fn put_file(&self, file: &std::path::Path, key: &ObjPath) -> Result<(), String> {
        let bytes = tokio::fs::read(file).await.map_err(|e| {
            self.counters().fail_local.inc();
            format!("read {}: {e}", file.display())
        })?;
        self.store()
            .put(key, bytes.into())
            .await
            .map(drop)
            .map_err(|e| {
                self.counters().fail_put.inc();
                format!("PUT {key}: {e}")
            })
    }

    /// Uploads a sealed segment: its indexes and seal record, then the log (in parts when
    /// large), checked for its full size before any manifest may name it.
    async fn upload(&self, seg: &SealedSegmentFiles) -> Result<(), String> {
        let base = seg.meta.base_offset;
        for (file, ext) in [
            (&seg.index, "index"),
            (&seg.time_index, "timeindex"),
            (&seg.seal, "seal"),
        ] {
            self.put_file(file, &self.segment_key(base, ext)).await?;
        }
        let key = self.segment_key(base, "log");
        let size = seg.meta.size_bytes;
        let part = self.tier.settings.part_bytes;
        if size <= part as u64 {
            self.put_file(&seg.log, &key).await?;
        } else {
            self.put_multipart(&seg.log, &key, size, part).await?;
        }
        let head = self.store().head(&key).await.map_err(|e| {
            self.counters().fail_get.inc();
            format!("HEAD {key}: {e}")
        })?;
        if head.size != size {
            self.counters().fail_put.inc();
            return Err(format!(
                "{key} holds {} bytes after upload, not {size}",
                head.size
            ));
        }
        Ok(())
    }

    async fn put_multipart(
        &self,
        file: &std::path::Path,
        key: &ObjPath,
        size: u64,
        part: usize,
    ) -> Result<(), String> {
        let fail = |what: String| {
            self.counters().fail_put.inc();
            what
        };
        let upload = self
            .store()
            .put_multipart(key)
            .await
            .map_err(|e| fail(format!("multipart PUT {key}: {e}")))?;
        let mut writer = WriteMultipart::new_with_chunk_size(upload, part);
        let mut f = match tokio::fs::File::open(file).await {
            Ok(f) => f,
            Err(e) => {
                let _ = writer.abort().await;
                self.counters().fail_local.inc();
                return Err(format!("open {}: {e}", file.display()));
            }
        };
        let mut buf = vec![0u8; part];
        let mut left = size;
        while left > 0 {
            let n = (left as usize).min(part);
            if let Err(e) = f.read_exact(&mut buf[..n]).await {
                let _ = writer.abort().await;
                self.counters().fail_local.inc();
                return Err(format!("read {}: {e}", file.display()));
            }
            if let Err(e) = writer
                .wait_for_capacity(self.tier.settings.upload_concurrency)
                .await
            {
                let _ = writer.abort().await;
                return Err(fail(format!("multipart PUT {key}: {e}")));
            }
            writer.write(&buf[..n]);
            left -= n as u64;
        }
        writer
            .finish()
            .await
            .map(drop)
            .map_err(|e| fail(format!("multipart PUT {key}: {e}")))
    }
}
