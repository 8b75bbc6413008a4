//! A publisher flooding large payloads is held back: once 64 MiB of its publishes wait for the
//! ledger, the connection stops reading until they are stored, and nothing is lost.
#![allow(clippy::unwrap_used)]

use std::io::{self, IoSlice};
use std::path::Path;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Condvar, Mutex};
use std::time::{Duration, Instant};

use sluice_core::{Engine, EngineConfig, FsStorage, LogFile, Storage, SystemClock};
use sluice_mqtt::{MqttServer, MqttSettings};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

const PATIENCE: Duration = Duration::from_secs(30);
const IMAGE: usize = 2 * 1024 * 1024;
const IMAGES: u16 = 64;

/// Holds every append of a megabyte or more until opened: a disk that has stopped.
#[derive(Debug, Default)]
struct Gate {
    open: Mutex<bool>,
    changed: Condvar,
}

impl Gate {
    fn wait(&self) {
        let mut open = self.open.lock().unwrap();
        while !*open {
            open = self.changed.wait(open).unwrap();
        }
    }

    fn open(&self) {
        *self.open.lock().unwrap() = true;
        self.changed.notify_all();
    }
}

/// Opens the gate when dropped, so a failing test still lets the writer finish (the runtime
/// waits for blocking tasks when it shuts down).
struct OpenOnDrop(Arc<Gate>);

impl Drop for OpenOnDrop {
    fn drop(&mut self) {
        self.0.open();
    }
}

#[derive(Debug)]
struct GatedStorage {
    gate: Arc<Gate>,
}

#[derive(Debug)]
struct GatedFile {
    inner: Arc<dyn LogFile>,
    gate: Arc<Gate>,
}

impl LogFile for GatedFile {
    fn read_exact_at(&self, buf: &mut [u8], pos: u64) -> io::Result<()> {
        self.inner.read_exact_at(buf, pos)
    }

    fn append(&self, bufs: &[IoSlice<'_>]) -> io::Result<()> {
        if bufs.iter().map(|b| b.len()).sum::<usize>() >= 1 << 20 {
            self.gate.wait();
        }
        self.inner.append(bufs)
    }

    fn sync_data(&self) -> io::Result<()> {
        self.inner.sync_data()
    }

    fn len(&self) -> io::Result<u64> {
        self.inner.len()
    }

    fn truncate(&self, len: u64) -> io::Result<()> {
        self.inner.truncate(len)
    }
}

impl Storage for GatedStorage {
    fn open(&self, path: &Path, create: bool) -> io::Result<Arc<dyn LogFile>> {
        Ok(Arc::new(GatedFile {
            inner: FsStorage.open(path, create)?,
            gate: self.gate.clone(),
        }))
    }
    fn read_file(&self, path: &Path) -> io::Result<Vec<u8>> {
        FsStorage.read_file(path)
    }
    fn write_file_atomic(&self, path: &Path, contents: &[u8]) -> io::Result<()> {
        FsStorage.write_file_atomic(path, contents)
    }
    fn remove_file(&self, path: &Path) -> io::Result<()> {
        FsStorage.remove_file(path)
    }
    fn create_dir_all(&self, path: &Path) -> io::Result<()> {
        FsStorage.create_dir_all(path)
    }
    fn remove_dir_all(&self, path: &Path) -> io::Result<()> {
        FsStorage.remove_dir_all(path)
    }
    fn rename(&self, from: &Path, to: &Path) -> io::Result<()> {
        FsStorage.rename(from, to)
    }
    fn list_dir(&self, path: &Path) -> io::Result<Vec<String>> {
        FsStorage.list_dir(path)
    }
    fn sync_dir(&self, path: &Path) -> io::Result<()> {
        FsStorage.sync_dir(path)
    }
}

/// An MQTT remaining length.
fn varint(mut n: usize, out: &mut Vec<u8>) {
    loop {
        let byte = (n % 128) as u8;
        n /= 128;
        if n == 0 {
            out.push(byte);
            return;
        }
        out.push(byte | 0x80);
    }
}

fn connect() -> Vec<u8> {
    let mut body = vec![0, 4, b'M', b'Q', b'T', b'T', 4, 0x02, 0, 60, 0, 5];
    body.extend_from_slice(b"flood");
    let mut p = vec![0x10];
    varint(body.len(), &mut p);
    p.extend_from_slice(&body);
    p
}

fn publish_qos1(pkid: u16, payload: &[u8]) -> Vec<u8> {
    let topic = b"cameras/flood";
    let mut p = vec![0x32];
    varint(2 + topic.len() + 2 + payload.len(), &mut p);
    p.extend_from_slice(&(topic.len() as u16).to_be_bytes());
    p.extend_from_slice(topic);
    p.extend_from_slice(&pkid.to_be_bytes());
    p.extend_from_slice(payload);
    p
}

/// Waits until `ready` holds; fails the test after [`PATIENCE`].
async fn until(what: &str, ready: impl Fn() -> bool) {
    let deadline = Instant::now() + PATIENCE;
    while !ready() {
        assert!(Instant::now() < deadline, "timed out waiting: {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_flooding_publisher_is_held_at_the_pending_budget_and_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let gate = Arc::new(Gate::default());
    let _open_at_the_end = OpenOnDrop(gate.clone());
    let engine = Engine::open(
        EngineConfig::new(dir.path()),
        Arc::new(GatedStorage { gate: gate.clone() }),
        Arc::new(SystemClock),
    )
    .await
    .unwrap();
    let settings = MqttSettings {
        addr: "127.0.0.1:0".into(),
        max_packet_bytes: 8 * 1024 * 1024,
        default_topic: "mqtt".into(),
        connect_timeout_ms: 10_000,
        routes: vec![],
        users: Default::default(),
    };
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let server = MqttServer::new(engine.clone(), settings).await.unwrap();
    let (stop, stop_rx) = tokio::sync::watch::channel(false);
    tokio::spawn(server.clone().serve(listener, stop_rx));

    let stream = TcpStream::connect(("127.0.0.1", port)).await.unwrap();
    let (mut rd, mut wr) = stream.into_split();
    wr.write_all(&connect()).await.unwrap();
    let mut connack = [0u8; 4];
    rd.read_exact(&mut connack).await.unwrap();
    assert_eq!(connack, [0x20, 2, 0, 0]);
    // 128 MiB of images, written as fast as the socket takes them.
    let writer = tokio::spawn(async move {
        let image = vec![0xA5u8; IMAGE];
        for pkid in 1..=IMAGES {
            wr.write_all(&publish_qos1(pkid, &image)).await.unwrap();
        }
        wr
    });

    // The disk is stopped, so the connection must stop reading at its budget.
    let m = &server.metrics;
    until("the connection stops reading", || {
        m.reads_paused.load(Ordering::Relaxed) >= 1
    })
    .await;
    let pending = m.pending_publish_bytes.load(Ordering::Relaxed) as usize;
    // At least the budget; beyond it at most what one read of the socket had already brought.
    assert!(pending >= 64 << 20, "{pending}");
    assert!(pending <= (64 << 20) + 4 * IMAGE, "{pending}");
    assert!(!writer.is_finished(), "all images were taken in");

    // The disk resumes: every image is stored and acknowledged, in order.
    gate.open();
    let _wr = writer.await.unwrap();
    for pkid in 1..=IMAGES {
        let mut puback = [0u8; 4];
        tokio::time::timeout(PATIENCE, rd.read_exact(&mut puback))
            .await
            .unwrap()
            .unwrap();
        let [hi, lo] = pkid.to_be_bytes();
        assert_eq!(puback, [0x40, 2, hi, lo]);
    }
    assert_eq!(m.pending_publish_bytes.load(Ordering::Relaxed), 0);
    let stats = engine.metrics();
    let stored: u64 = stats
        .partitions
        .iter()
        .filter(|p| p.topic == "mqtt")
        .map(|p| p.high_watermark)
        .sum();
    assert_eq!(stored, u64::from(IMAGES));
    let _ = stop.send(true);
    engine.shutdown().await;
}
