//! The publisher of a broadcast run: over MQTT, or over the REST API as a camera gateway would.

use super::*;

/// Publishes `args.messages` payloads at `args.rate` per second (as fast as the broker takes
/// them when the rate is higher than that); answers the time from the first send until the last
/// PUBACK (QoS 1: durable in Sluice) or the last write (QoS 0).
pub(super) fn publish(addr: SocketAddr, qos: u8, args: &BroadcastArgs) -> anyhow::Result<Duration> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let mut s = TcpStream::connect(addr).await?;
        s.set_nodelay(true)?;
        s.write_all(&connect_packet("broadcast-publisher")).await?;
        let mut body = Vec::new();
        read_packet(&mut s, &mut body).await?;
        let (mut rd, mut wr) = s.into_split();
        // The publisher keeps its rate regardless of PUBACKs; it only counts them. A publisher
        // that subscribes to nothing receives only PUBACKs, four bytes each.
        let acked = Arc::new(AtomicU64::new(0));
        let counter = acked.clone();
        tokio::spawn(async move {
            let mut sink = vec![0u8; 4096];
            while let Ok(n) = rd.read(&mut sink).await {
                if n == 0 {
                    return;
                }
                counter.fetch_add(n as u64, Ordering::Relaxed);
            }
        });
        let interval = Duration::from_secs_f64(1.0 / args.rate.max(0.001));
        let mut tick = tokio::time::interval(interval);
        let mut payload = vec![0x5Au8; args.size.max(12)];
        let started = Instant::now();
        for seq in 0..args.messages {
            tick.tick().await;
            payload[..8].copy_from_slice(&now_ns().to_be_bytes());
            payload[8..12].copy_from_slice(&(seq as u32).to_be_bytes());
            let head = publish_head(&args.topic, qos, (seq % 60_000) as u16 + 1, payload.len());
            wr.write_all_buf(&mut Buf::chain(head.as_slice(), payload.as_slice()))
                .await?;
        }
        if qos > 0 {
            let deadline = Instant::now() + Duration::from_secs(60);
            while acked.load(Ordering::Relaxed) < 4 * args.messages as u64 {
                anyhow::ensure!(Instant::now() < deadline, "PUBACKs missing");
                tokio::time::sleep(Duration::from_millis(1)).await;
            }
        }
        anyhow::Ok(started.elapsed())
    })
}

/// Publishes `messages` payloads of `size` bytes at `rate` per second (as fast as the broker
/// answers when the rate is higher) through Sluice's REST API at `http`, as a camera gateway
/// would: `connections` keep-alive HTTP/1.1 connections, each sending its next request once the
/// last one is answered (Sluice answers once the record is durable). Each record's key is the
/// MQTT topic, so MQTT subscribers get it under that name. Answers the time from the first
/// request until the last answer. Written on a plain socket rather than reqwest (which
/// `sluice-bench http` uses): each body carries its own send time, and reqwest would take a
/// fresh buffer per request, a 2 MB copy per image on the cores being measured.
pub(super) fn publish_rest(
    http: SocketAddr,
    size: usize,
    rate: f64,
    messages: usize,
    connections: usize,
) -> anyhow::Result<Duration> {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let size = size.max(12);
        let head = format!(
            "POST /topics/{LEDGER_TOPIC}/records?key={TOPIC} HTTP/1.1\r\nHost: {http}\r\n\
             Content-Type: application/octet-stream\r\nContent-Length: {size}\r\n\r\n"
        );
        let head: Arc<[u8]> = head.into_bytes().into();
        let mut streams = Vec::new();
        for _ in 0..connections.max(1) {
            let s = TcpStream::connect(http).await?;
            s.set_nodelay(true)?;
            streams.push(s);
        }
        // One clock for all connections, so the rate is the publisher's, and the sequence number
        // is taken after the tick, so numbers follow send times.
        let interval = Duration::from_secs_f64(1.0 / rate.max(0.001));
        let tick = Arc::new(tokio::sync::Mutex::new(tokio::time::interval(interval)));
        let next = Arc::new(AtomicUsize::new(0));
        let started = Instant::now();
        let tasks: Vec<_> = streams
            .into_iter()
            .map(|mut s| {
                let (head, tick, next) = (head.clone(), tick.clone(), next.clone());
                tokio::spawn(async move {
                    let mut payload = vec![0x5Au8; size];
                    let mut answer = Vec::new();
                    // When this connection's last answer came: a connection that finds every
                    // message taken has waited for a tick that sent nothing.
                    let mut answered = None;
                    loop {
                        tick.lock().await.tick().await;
                        let seq = next.fetch_add(1, Ordering::Relaxed);
                        if seq >= messages {
                            return anyhow::Ok(answered);
                        }
                        payload[..8].copy_from_slice(&now_ns().to_be_bytes());
                        payload[8..12].copy_from_slice(&(seq as u32).to_be_bytes());
                        s.write_all_buf(&mut Buf::chain(&head[..], payload.as_slice()))
                            .await?;
                        let status = read_http_answer(&mut s, &mut answer).await?;
                        anyhow::ensure!(
                            status == 200,
                            "REST produce answered {status}: {}",
                            String::from_utf8_lossy(&answer)
                        );
                        answered = Some(Instant::now());
                    }
                })
            })
            .collect();
        let mut last = started;
        for t in tasks {
            last = last.max(t.await??.unwrap_or(started));
        }
        anyhow::Ok(last - started)
    })
}
