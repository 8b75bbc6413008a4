//! A child process appending hard is killed with SIGKILL; every record it acknowledged must be
//! there, byte for byte, after recovery. The child is this same test binary re-executed with
//! an environment variable, so no extra program is needed.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};

use bytes::Bytes;
use common::*;
use sluice_core::{PartitionChoice, Record};

const CHILD_DIR: &str = "SLUICETEST_CRASH_CHILD_DIR";
const PRODUCERS: u64 = 16;
const KILL_AFTER_ACKS: usize = 3000;

fn payload(producer: u64, seq: u64) -> Vec<u8> {
    let len = 64 + ((producer * 7919 + seq * 104_729) % 4000) as usize;
    format!("{producer}:{seq};")
        .bytes()
        .cycle()
        .take(len)
        .collect()
}

#[test]
fn sigkill_during_heavy_appends_loses_no_acknowledged_record() {
    if let Some(dir) = std::env::var_os(CHILD_DIR) {
        run_child(dir.into());
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "sigkill_during_heavy_appends_loses_no_acknowledged_record",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(CHILD_DIR, dir.path())
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut acked: HashMap<(u32, u64), (u64, u64)> = HashMap::new();
    let mut killed = false;
    // Acks printed before the kill are still in the pipe: read them all, to EOF.
    for line in lines.by_ref() {
        let line = line.unwrap();
        let Some(rest) = line.strip_prefix("ACK ") else {
            continue;
        };
        let f: Vec<u64> = rest.split(' ').map(|x| x.parse().unwrap()).collect();
        acked.insert((f[0] as u32, f[1]), (f[2], f[3]));
        if !killed && acked.len() >= KILL_AFTER_ACKS {
            child.kill().unwrap();
            killed = true;
        }
    }
    let status = child.wait().unwrap();
    assert!(
        killed,
        "child stopped by itself after {} acks: {status}",
        acked.len()
    );

    let rt = tokio::runtime::Runtime::new().unwrap();
    rt.block_on(async {
        let engine = open(dir.path()).await;
        let mut stored = HashMap::new();
        for partition in 0..2 {
            for r in read_all(&engine, "crash", partition).await {
                stored.insert((partition, r.offset as u64), r.record.value.unwrap());
            }
        }
        for ((partition, offset), (producer, seq)) in &acked {
            let value = stored
                .get(&(*partition, *offset))
                .unwrap_or_else(|| panic!("acknowledged record {partition}/{offset} lost"));
            assert_eq!(
                &value[..],
                &payload(*producer, *seq)[..],
                "record {partition}/{offset} damaged"
            );
        }
        assert!(stored.len() >= acked.len());
    });
}

/// Appends from many producers until killed, printing one line per acknowledgement.
fn run_child(dir: std::path::PathBuf) {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    rt.block_on(async move {
        let engine = open(&dir).await;
        engine.create_topic("crash", 2, None).await.unwrap();
        let stdout = std::sync::Arc::new(std::sync::Mutex::new(std::io::stdout()));
        let mut tasks = Vec::new();
        for producer in 0..PRODUCERS {
            let engine = engine.clone();
            let stdout = stdout.clone();
            tasks.push(tokio::spawn(async move {
                for seq in 0.. {
                    let record = Record {
                        timestamp: now(),
                        key: Some(Bytes::from(producer.to_string())),
                        value: Some(Bytes::from(payload(producer, seq))),
                        headers: vec![],
                    };
                    let ack = engine
                        .produce(
                            "crash",
                            PartitionChoice::Id((producer % 2) as u32),
                            &[record],
                        )
                        .await
                        .unwrap();
                    let mut out = stdout.lock().unwrap();
                    writeln!(
                        out,
                        "ACK {} {} {producer} {seq}",
                        ack.partition, ack.base_offset
                    )
                    .unwrap();
                    out.flush().unwrap();
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
    });
}
