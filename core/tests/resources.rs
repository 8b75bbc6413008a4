//! Gateway resources in the metadata store (cameras added over the API): saved atomically,
//! listed at start, deleted for good, and never a way out of their directory.

use std::sync::Arc;

use sluice_core::{FileMetadataStore, FsStorage, MetadataStore};

#[test]
fn resources_are_saved_listed_and_deleted() {
    let dir = tempfile::tempdir().unwrap();
    let store = FileMetadataStore::new(dir.path(), Arc::new(FsStorage));
    assert!(store.load_resources("cameras").unwrap().is_empty());
    store.save_resource("cameras", "b", b"{\"n\":2}").unwrap();
    store.save_resource("cameras", "a", b"{\"n\":1}").unwrap();
    store.save_resource("cameras", "a", b"{\"n\":3}").unwrap();
    // A second store on the same directory (a restart) sees them, by name.
    let again = FileMetadataStore::new(dir.path(), Arc::new(FsStorage));
    assert_eq!(
        again.load_resources("cameras").unwrap(),
        vec![b"{\"n\":3}".to_vec(), b"{\"n\":2}".to_vec()]
    );
    again.delete_resource("cameras", "a").unwrap();
    again.delete_resource("cameras", "never-there").unwrap();
    assert_eq!(
        store.load_resources("cameras").unwrap(),
        vec![b"{\"n\":2}".to_vec()]
    );
    // Other kinds are apart.
    assert!(store.load_resources("other").unwrap().is_empty());
}

#[test]
fn resource_names_cannot_leave_their_directory() {
    let dir = tempfile::tempdir().unwrap();
    let store = FileMetadataStore::new(dir.path(), Arc::new(FsStorage));
    for name in ["../x", "a/b", ".hidden", "", "x\0"] {
        assert!(
            store.save_resource("cameras", name, b"{}").is_err(),
            "{name:?}"
        );
    }
    assert!(store.save_resource("../up", "x", b"{}").is_err());
    assert!(!dir.path().join("x.json").exists());
}

#[test]
fn an_unreadable_resource_is_skipped_not_fatal() {
    let dir = tempfile::tempdir().unwrap();
    let store = FileMetadataStore::new(dir.path(), Arc::new(FsStorage));
    store.save_resource("cameras", "ok", b"{}").unwrap();
    // A directory where a document should be cannot be read as one.
    std::fs::create_dir(dir.path().join("resources/cameras/broken.json")).unwrap();
    assert_eq!(
        store.load_resources("cameras").unwrap(),
        vec![b"{}".to_vec()]
    );
}
