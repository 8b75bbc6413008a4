//! Worker processes of subscribers (`broadcast-worker`): connecting them, reading them with one
//! epoll per thread, counting each delivery's latency; and the coordinator's handle on one.

use super::*;

/// Latency histogram: bucket `i` holds samples of about 1.01^i microseconds.
pub(super) const BUCKETS: usize = 2400;

pub(super) fn bucket(us: u64) -> usize {
    if us <= 1 {
        return 0;
    }
    (((us as f64).ln() / 1.01f64.ln()) as usize).min(BUCKETS - 1)
}

pub(super) fn bucket_us(i: usize) -> f64 {
    1.01f64.powi(i as i32)
}

/// What the subscribers of one worker saw.
#[derive(Debug)]
pub(super) struct Seen {
    pub(super) histogram: Vec<AtomicU64>,
    /// Per sequence number: subscribers that had it, and the latest arrival (µs after send).
    pub(super) count: Vec<AtomicU64>,
    pub(super) last_us: Vec<AtomicU64>,
    pub(super) received: AtomicU64,
    /// Clients that have everything (all sequence numbers).
    pub(super) complete: AtomicUsize,
    pub(super) ready: AtomicUsize,
    pub(super) failed: AtomicUsize,
    /// Connection attempts that had to be repeated (refused, reset or timed out).
    pub(super) retries: AtomicUsize,
    /// Bytes read from the broker once subscribed: what the deliveries cost on the wire.
    pub(super) wire_bytes: AtomicU64,
}

impl Seen {
    pub(super) fn new(messages: usize) -> Self {
        let zeros = |n: usize| (0..n).map(|_| AtomicU64::new(0)).collect();
        Self {
            histogram: zeros(BUCKETS),
            count: zeros(messages),
            last_us: zeros(messages),
            received: AtomicU64::new(0),
            complete: AtomicUsize::new(0),
            ready: AtomicUsize::new(0),
            failed: AtomicUsize::new(0),
            retries: AtomicUsize::new(0),
            wire_bytes: AtomicU64::new(0),
        }
    }
}

pub(super) fn now_ns() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_nanos() as u64)
}

/// One subscriber as a receiver thread holds it.
pub(super) struct Receiving {
    pub(super) stream: std::net::TcpStream,
    pub(super) framer: Framer,
    /// Messages counted so far.
    pub(super) have: usize,
    /// PUBACKs the socket has not taken yet.
    pub(super) acks: Vec<u8>,
    /// Whether the epoll set also waits for this socket to be writable.
    pub(super) wants_write: bool,
}

/// Receives for `streams` on this thread until `stop` is set: one level-triggered epoll, one
/// `read` per readiness into one scratch buffer (an idle subscriber holds no read buffer of its
/// own; 20,000 × 10 KB would be 200 MB), PUBACKs written back at once. No tasks or wakers: the
/// load generator shares the machine's two cores with the broker, so every microsecond it
/// spends per delivery is taken from the broker under test.
pub(super) fn receive(
    streams: Vec<std::net::TcpStream>,
    seen: &Seen,
    messages: usize,
    framing: Framing,
    stop: &AtomicBool,
) -> std::io::Result<()> {
    use std::io::Read;
    use std::os::fd::AsRawFd;
    let epoll = crate::epoll::Epoll::new()?;
    let mut subs: Vec<Option<Receiving>> = Vec::with_capacity(streams.len());
    for (token, stream) in streams.into_iter().enumerate() {
        epoll.ctl(
            libc::EPOLL_CTL_ADD,
            stream.as_raw_fd(),
            libc::EPOLLIN as u32,
            token as u64,
        )?;
        subs.push(Some(Receiving {
            stream,
            framer: Framer::new(framing),
            have: 0,
            acks: Vec::new(),
            wants_write: false,
        }));
    }
    let mut events = crate::epoll::events(1024);
    let mut scratch = vec![0u8; 256 * 1024];
    while !stop.load(Ordering::Relaxed) {
        let n = epoll.wait(&mut events, 20)?;
        for ev in &events[..n] {
            let slot = &mut subs[ev.u64 as usize];
            let Some(sub) = slot.as_mut() else {
                continue;
            };
            let open = if ev.events & libc::EPOLLOUT as u32 != 0 {
                flush_acks(&epoll, sub, ev.u64)
            } else {
                match sub.stream.read(&mut scratch) {
                    Ok(0) => false,
                    Ok(n) => {
                        seen.wire_bytes.fetch_add(n as u64, Ordering::Relaxed);
                        let Receiving {
                            framer, have, acks, ..
                        } = sub;
                        framer.feed(&scratch[..n], |first, head| {
                            let counted = match framing {
                                Framing::Mqtt if first >> 4 == 3 => {
                                    record(seen, first, head, false, acks)
                                }
                                Framing::Mqtt5 if first >> 4 == 3 => {
                                    record(seen, first, head, true, acks)
                                }
                                // A binary frame: the record's value, as published.
                                Framing::WebSocket if first & 0x0F == 2 => {
                                    record_payload(seen, head)
                                }
                                _ => 0,
                            };
                            *have += counted;
                            if counted > 0 && *have == messages {
                                seen.complete.fetch_add(1, Ordering::Relaxed);
                            }
                        });
                        flush_acks(&epoll, sub, ev.u64)
                    }
                    Err(e) => matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::Interrupted
                    ),
                }
            };
            if !open {
                // Closing the socket removes it from the epoll set.
                *slot = None;
            }
        }
    }
    Ok(())
}

/// Writes a subscriber's pending PUBACKs; what the socket does not take waits for it to be
/// writable. The epoll set changes only when that wait starts or ends: a PUBACK written at
/// once costs its `write` and no `epoll_ctl`. False when the connection failed.
pub(super) fn flush_acks(epoll: &crate::epoll::Epoll, sub: &mut Receiving, token: u64) -> bool {
    use std::os::fd::AsRawFd;
    while !sub.acks.is_empty() {
        match sub.stream.write(&sub.acks) {
            Ok(n) => {
                sub.acks.drain(..n);
            }
            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => break,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => {}
            Err(_) => return false,
        }
    }
    let wants_write = !sub.acks.is_empty();
    if wants_write == sub.wants_write {
        return true;
    }
    sub.wants_write = wants_write;
    let events = if wants_write {
        libc::EPOLLIN | libc::EPOLLOUT
    } else {
        libc::EPOLLIN
    };
    epoll
        .ctl(
            libc::EPOLL_CTL_MOD,
            sub.stream.as_raw_fd(),
            events as u32,
            token,
        )
        .is_ok()
}

/// Counts one PUBLISH (and queues its PUBACK, the same four bytes in MQTT 5: no reason code is
/// success); 1 when it carried a payload header. `body` is the packet's body or at least its
/// first [`HEAD_BYTES`]; `v5`: properties come before the payload.
pub(super) fn record(seen: &Seen, first: u8, body: &[u8], v5: bool, acks: &mut Vec<u8>) -> usize {
    let Some(topic_len) = body
        .get(..2)
        .map(|b| u16::from_be_bytes([b[0], b[1]]) as usize)
    else {
        return 0;
    };
    let mut at = 2 + topic_len;
    if (first >> 1) & 3 > 0 {
        let Some(id) = body.get(at..at + 2) else {
            return 0;
        };
        acks.extend_from_slice(&[0x40, 2, id[0], id[1]]);
        at += 2;
    }
    if v5 {
        // The properties' length, a variable byte integer, then the properties.
        let mut len = 0usize;
        for i in 0..4 {
            let Some(&b) = body.get(at) else {
                return 0;
            };
            at += 1;
            len |= usize::from(b & 0x7F) << (7 * i);
            if b & 0x80 == 0 {
                break;
            }
        }
        at += len;
    }
    body.get(at..)
        .map_or(0, |payload| record_payload(seen, payload))
}

/// Counts one delivered payload by the send time and sequence number it starts with; 1 when
/// it has them.
pub(super) fn record_payload(seen: &Seen, payload: &[u8]) -> usize {
    let Some(head) = payload.get(..12) else {
        return 0;
    };
    let sent = u64::from_be_bytes(head[..8].try_into().unwrap_or_default());
    let seq = u32::from_be_bytes(head[8..12].try_into().unwrap_or_default()) as usize;
    let us = now_ns().saturating_sub(sent) / 1000;
    seen.histogram[bucket(us)].fetch_add(1, Ordering::Relaxed);
    seen.received.fetch_add(1, Ordering::Relaxed);
    if let (Some(c), Some(l)) = (seen.count.get(seq), seen.last_us.get(seq)) {
        c.fetch_add(1, Ordering::Relaxed);
        l.fetch_max(us, Ordering::Relaxed);
    }
    1
}

/// `broadcast-worker`: connects its subscribers, prints `ready <ms>` once all are subscribed,
/// then counts deliveries; prints its summary as one JSON line when every client has every
/// message or when a line arrives on stdin.
pub(crate) fn worker(args: WorkerArgs) -> anyhow::Result<()> {
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let seen = Arc::new(Seen::new(args.messages));
        let gate = Arc::new(tokio::sync::Semaphore::new(args.connect_concurrency.max(1)));
        let started = Instant::now();
        let mut streams = Vec::with_capacity(args.clients);
        let mut tasks = tokio::task::JoinSet::new();
        for i in 0..args.clients {
            let gate = gate.clone();
            let seen = seen.clone();
            let id = format!("b{}", args.first_id + i);
            let (broker, source, qos) = (args.broker, source_for(args.source, i), args.qos);
            let ws_path = args.ws_path.clone();
            let (topic, alias_max) = (args.topic.clone(), args.mqtt5_alias_max);
            tasks.spawn(async move {
                let _permit = gate.acquire().await;
                let mut attempt = 0;
                loop {
                    let connected = match &ws_path {
                        Some(path) => connect_ws(broker, source, path).await,
                        None => connect(broker, source, &id, &topic, qos, alias_max).await,
                    };
                    match connected {
                        Ok(s) => {
                            seen.ready.fetch_add(1, Ordering::Relaxed);
                            return Some(s);
                        }
                        Err(_) if attempt < 5 => {
                            attempt += 1;
                            seen.retries.fetch_add(1, Ordering::Relaxed);
                            tokio::time::sleep(Duration::from_millis(100 << attempt)).await;
                        }
                        Err(_) => {
                            seen.failed.fetch_add(1, Ordering::Relaxed);
                            return None;
                        }
                    }
                }
            });
        }
        while let Some(r) = tasks.join_next().await {
            if let Ok(Some(s)) = r {
                streams.push(s);
            }
        }
        let connect_ms = started.elapsed().as_millis();
        println!(
            "ready {connect_ms} {} {} {}",
            streams.len(),
            seen.failed.load(Ordering::Relaxed),
            seen.retries.load(Ordering::Relaxed)
        );
        std::io::stdout().flush()?;
        let cpu_before = cpu_time();
        let stalled = args.stalled.min(streams.len());
        // Held open and never read: the broker has to cope with them.
        let held: Vec<TcpStream> = streams.drain(..stalled).collect();
        let reading = streams.len();
        let framing = match (&args.ws_path, args.mqtt5_alias_max) {
            (Some(_), _) => Framing::WebSocket,
            (None, Some(_)) => Framing::Mqtt5,
            (None, None) => Framing::Mqtt,
        };
        // Two receiver threads, each with half of the subscribers.
        let stop = Arc::new(AtomicBool::new(false));
        let mut plain = Vec::with_capacity(streams.len());
        for s in streams {
            plain.push(s.into_std()?);
        }
        let half = plain.len().div_ceil(2);
        for part in [plain.split_off(half), plain] {
            let (seen, stop) = (seen.clone(), stop.clone());
            let messages = args.messages;
            std::thread::spawn(move || {
                if let Err(e) = receive(part, &seen, messages, framing, &stop) {
                    eprintln!("broadcast-worker: receiving stopped: {e}");
                }
            });
        }
        // Ends when every client has everything, or when the coordinator says so.
        let (stop_tx, mut stop_rx) = tokio::sync::mpsc::channel::<()>(1);
        std::thread::spawn(move || {
            let mut line = String::new();
            let _ = std::io::stdin().read_line(&mut line);
            let _ = stop_tx.blocking_send(());
        });
        loop {
            if seen.complete.load(Ordering::Relaxed) >= reading {
                break;
            }
            tokio::select! {
                _ = stop_rx.recv() => break,
                () = tokio::time::sleep(Duration::from_millis(20)) => {}
            }
        }
        stop.store(true, Ordering::Relaxed);
        let histogram: Vec<(usize, u64)> = seen
            .histogram
            .iter()
            .enumerate()
            .map(|(i, c)| (i, c.load(Ordering::Relaxed)))
            .filter(|(_, c)| *c > 0)
            .collect();
        drop(held);
        let summary = json!({
            "connected": reading + stalled,
            "stalled": stalled,
            "failed": seen.failed.load(Ordering::Relaxed),
            "received": seen.received.load(Ordering::Relaxed),
            "count": seen.count.iter().map(|c| c.load(Ordering::Relaxed)).collect::<Vec<_>>(),
            "last_us": seen.last_us.iter().map(|c| c.load(Ordering::Relaxed)).collect::<Vec<_>>(),
            "histogram": histogram,
            "wire_bytes": seen.wire_bytes.load(Ordering::Relaxed),
            "cpu_us": cpu_time().saturating_sub(cpu_before).as_micros() as u64,
        });
        println!("{summary}");
        std::io::stdout().flush()?;
        // Exits without closing every socket one by one: the kernel does it at once.
        std::process::exit(0);
    })
}

/// One worker process and its output.
pub(super) struct Worker {
    pub(super) child: Child,
    pub(super) stdin: ChildStdin,
    pub(super) lines: std::sync::mpsc::Receiver<String>,
}

impl Worker {
    pub(super) fn start(args: &WorkerArgs) -> anyhow::Result<Self> {
        let mut child = Command::new(std::env::current_exe()?)
            .args(["broadcast-worker", "--broker", &args.broker.to_string()])
            .args(["--source", &args.source.to_string()])
            .args(["--clients", &args.clients.to_string()])
            .args(["--first-id", &args.first_id.to_string()])
            .args(["--qos", &args.qos.to_string()])
            .args(["--messages", &args.messages.to_string()])
            .args([
                "--connect-concurrency",
                &args.connect_concurrency.to_string(),
            ])
            .args(["--stalled", &args.stalled.to_string()])
            .args(
                args.ws_path
                    .iter()
                    .flat_map(|p| ["--ws-path".to_owned(), p.clone()]),
            )
            .args(["--topic", &args.topic])
            .args(
                args.mqtt5_alias_max
                    .iter()
                    .flat_map(|m| ["--mqtt5-alias-max".to_owned(), m.to_string()]),
            )
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()?;
        let stdout = child.stdout.take().context("worker stdout")?;
        let stdin = child.stdin.take().context("worker stdin")?;
        let (tx, lines) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    return;
                }
            }
        });
        Ok(Self {
            child,
            stdin,
            lines,
        })
    }

    pub(super) fn line(&self, deadline: Instant) -> anyhow::Result<String> {
        let left = deadline.saturating_duration_since(Instant::now());
        self.lines
            .recv_timeout(left)
            .context("a worker said nothing in time")
    }
}
