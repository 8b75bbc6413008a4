//! Opening the object store named by `[offload] store`.

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use object_store::aws::AmazonS3Builder;
use object_store::local::LocalFileSystem;
use object_store::prefix::PrefixStore;
use object_store::{BackoffConfig, ObjectStore, RetryConfig};

/// Where offloaded segments go and how to reach it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct StoreSpec {
    /// `file:///absolute/dir` or `s3://bucket/optional/prefix`; empty: `file://<default_dir>`.
    pub url: String,
    /// S3 endpoint (MinIO and other S3-compatible servers); empty: `AWS_ENDPOINT_URL` or AWS.
    pub endpoint: String,
    /// Empty: `AWS_REGION` / `AWS_DEFAULT_REGION`, else `us-east-1`.
    pub region: String,
    /// Empty: `AWS_ACCESS_KEY_ID` (and the rest of the standard credential chain).
    pub access_key_id: String,
    /// Empty: `AWS_SECRET_ACCESS_KEY`.
    pub secret_access_key: String,
    /// Allows `http://` endpoints.
    pub allow_http: bool,
    /// `bucket.host/key` requests instead of path-style `host/bucket/key`.
    pub virtual_hosted_style: bool,
}

impl StoreSpec {
    /// The URL with any credentials left out, for logs.
    pub fn describe(&self, default_dir: &Path) -> String {
        if self.url.is_empty() {
            format!("file://{}", default_dir.display())
        } else {
            self.url.clone()
        }
    }
}

/// Opens the store; nothing is sent over the network (a store that is down does not stop the
/// gateway from starting).
pub fn open_store(spec: &StoreSpec, default_dir: &Path) -> Result<Arc<dyn ObjectStore>, String> {
    if spec.url.is_empty() {
        return open_dir(default_dir);
    }
    let url =
        url::Url::parse(&spec.url).map_err(|e| format!("offload.store {:?}: {e}", spec.url))?;
    match url.scheme() {
        "file" => {
            let path = url
                .to_file_path()
                .map_err(|()| format!("offload.store {:?}: not an absolute path", spec.url))?;
            open_dir(&path)
        }
        "s3" => {
            let bucket = url
                .host_str()
                .filter(|b| !b.is_empty())
                .ok_or_else(|| format!("offload.store {:?}: no bucket", spec.url))?;
            // object_store retries a failed request for up to 3 minutes by default; a reader
            // waits for its GETs, and a Kafka client gives up on a request after 30 s, so
            // fail sooner (the next pass, or the client's retry, tries again).
            let retry = RetryConfig {
                backoff: BackoffConfig::default(),
                max_retries: 3,
                retry_timeout: Duration::from_secs(10),
            };
            let mut b = AmazonS3Builder::from_env()
                .with_retry(retry)
                .with_bucket_name(bucket)
                .with_allow_http(spec.allow_http)
                .with_virtual_hosted_style_request(spec.virtual_hosted_style);
            if !spec.endpoint.is_empty() {
                b = b.with_endpoint(&spec.endpoint);
            }
            let region = if !spec.region.is_empty() {
                spec.region.clone()
            } else {
                std::env::var("AWS_REGION")
                    .or_else(|_| std::env::var("AWS_DEFAULT_REGION"))
                    .unwrap_or_else(|_| "us-east-1".into())
            };
            b = b.with_region(region);
            if !spec.access_key_id.is_empty() {
                b = b.with_access_key_id(&spec.access_key_id);
            }
            if !spec.secret_access_key.is_empty() {
                b = b.with_secret_access_key(&spec.secret_access_key);
            }
            let s3 = b
                .build()
                .map_err(|e| format!("offload.store {:?}: {e}", spec.url))?;
            let prefix = url.path().trim_matches('/');
            Ok(if prefix.is_empty() {
                Arc::new(s3)
            } else {
                Arc::new(PrefixStore::new(s3, prefix))
            })
        }
        other => Err(format!(
            "offload.store {:?}: scheme {other:?} is not file or s3",
            spec.url
        )),
    }
}

fn open_dir(dir: &Path) -> Result<Arc<dyn ObjectStore>, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("offload store {}: {e}", dir.display()))?;
    let store = LocalFileSystem::new_with_prefix(dir)
        .map_err(|e| format!("offload store {}: {e}", dir.display()))?
        .with_automatic_cleanup(true);
    Ok(Arc::new(store))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn urls_pick_the_store() {
        let dir = tempfile::tempdir().unwrap();
        let spec = |url: &str| StoreSpec {
            url: url.into(),
            ..Default::default()
        };
        assert!(open_store(&spec(""), dir.path()).is_ok());
        let file = format!("file://{}/x", dir.path().display());
        assert!(open_store(&spec(&file), dir.path()).is_ok());
        assert!(dir.path().join("x").is_dir());
        assert!(open_store(&spec("s3://bucket/prefix"), dir.path()).is_ok());
        assert!(open_store(&spec("s3:///nobucket"), dir.path()).is_err());
        assert!(open_store(&spec("ftp://host/x"), dir.path()).is_err());
        assert!(open_store(&spec("not a url"), dir.path()).is_err());
    }
}
