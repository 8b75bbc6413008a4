//! The broadcast harness checked without brokers: wire framing, publishers, the report's
//! arithmetic, source addresses and latency buckets.

use super::*;

#[test]
fn the_framer_counts_each_packet_once_when_its_last_byte_arrives() {
    let mut small = vec![7u8; 300];
    small[8..12].copy_from_slice(&1u32.to_be_bytes());
    let mut large = vec![9u8; 2 << 20];
    large[8..12].copy_from_slice(&2u32.to_be_bytes());
    let mut stream = publish_packet(1, 5, &small);
    stream.extend_from_slice(&[0xD0, 0]);
    stream.extend_from_slice(&publish_packet(0, 0, &large));
    for chunk in [1, 7, 300, 65_536, stream.len()] {
        let mut f = Framer::new(Framing::Mqtt);
        let mut got = Vec::new();
        for (i, piece) in stream.chunks(chunk).enumerate() {
            f.feed(piece, |first, head| {
                got.push((
                    i,
                    first,
                    head.len(),
                    head.get(2 + TOPIC.len()..).map(<[u8]>::to_vec),
                ))
            });
        }
        let kinds: Vec<u8> = got.iter().map(|g| g.1).collect();
        assert_eq!(kinds, [0x32, 0xD0, 0x30], "chunks of {chunk}");
        // The large one completes with the last chunk, not before.
        assert_eq!(
            got[2].0,
            stream.len().div_ceil(chunk) - 1,
            "chunks of {chunk}"
        );
        assert_eq!(got[0].3.as_deref().map(|h| &h[..2]), Some(&[0u8, 5][..]));
        assert!(got[2].2 <= HEAD_BYTES);
        assert_eq!(
            got[2].3.as_deref().map(|h| &h[8..12]),
            Some(&2u32.to_be_bytes()[..])
        );
    }
}

#[test]
fn websocket_frames_of_every_length_encoding_are_counted_when_complete() {
    let frame = |seq: u32, len: usize| {
        let mut payload = vec![1u8; len];
        payload[..8].copy_from_slice(&now_ns().to_be_bytes());
        payload[8..12].copy_from_slice(&seq.to_be_bytes());
        let mut f = vec![0x82];
        match len {
            0..=125 => f.push(len as u8),
            126..=65_535 => {
                f.push(126);
                f.extend_from_slice(&(len as u16).to_be_bytes());
            }
            _ => {
                f.push(127);
                f.extend_from_slice(&(len as u64).to_be_bytes());
            }
        }
        f.extend_from_slice(&payload);
        f
    };
    let mut stream = frame(0, 100);
    stream.extend_from_slice(&[0x89, 0]);
    stream.extend_from_slice(&frame(1, 300));
    stream.extend_from_slice(&frame(2, 2 << 20));
    for chunk in [1, 3, 4096, stream.len()] {
        let seen = Seen::new(3);
        let mut f = Framer::new(Framing::WebSocket);
        let mut kinds = Vec::new();
        for piece in stream.chunks(chunk) {
            f.feed(piece, |first, head| {
                kinds.push(first);
                if first & 0x0F == 2 {
                    assert_eq!(record_payload(&seen, head), 1);
                }
            });
        }
        assert_eq!(kinds, [0x82, 0x89, 0x82, 0x82], "chunks of {chunk}");
        let counts: Vec<u64> = seen
            .count
            .iter()
            .map(|c| c.load(Ordering::Relaxed))
            .collect();
        assert_eq!(counts, [1, 1, 1], "chunks of {chunk}");
    }
}

#[test]
fn a_publish_is_counted_with_its_latency_and_acknowledged() {
    let seen = Seen::new(4);
    let mut payload = vec![0u8; 64];
    payload[..8].copy_from_slice(&(now_ns() - 5_000_000).to_be_bytes());
    payload[8..12].copy_from_slice(&2u32.to_be_bytes());
    let p = publish_packet(1, 300, &payload);
    let (first, header, len) = fixed_header(&p).unwrap();
    assert_eq!(header + len, p.len());
    let mut acks = Vec::new();
    assert_eq!(record(&seen, first, &p[header..], false, &mut acks), 1);
    assert_eq!(acks, [0x40, 2, 1, 44]);
    assert_eq!(seen.count[2].load(Ordering::Relaxed), 1);
    let last = seen.last_us[2].load(Ordering::Relaxed);
    assert!((5_000..60_000_000).contains(&last), "{last}");
}

#[test]
fn an_mqtt5_publish_under_a_topic_alias_is_counted_past_its_properties() {
    let seen = Seen::new(4);
    let mut payload = vec![0u8; 64];
    payload[..8].copy_from_slice(&now_ns().to_be_bytes());
    payload[8..12].copy_from_slice(&3u32.to_be_bytes());
    // QoS 1, empty topic name, packet id 7, properties: Topic Alias 1.
    let mut body = vec![0, 0, 0, 7, 3, 0x23, 0, 1];
    body.extend_from_slice(&payload);
    let mut acks = Vec::new();
    assert_eq!(record(&seen, 0x32, &body, true, &mut acks), 1);
    assert_eq!(acks, [0x40, 2, 0, 7]);
    assert_eq!(seen.count[3].load(Ordering::Relaxed), 1);
    // Read as MQTT 3.1.1, the properties would be taken for the payload's time stamp.
    let other = Seen::new(4);
    record(&other, 0x32, &body, false, &mut Vec::new());
    assert_eq!(other.count[3].load(Ordering::Relaxed), 0);
}

#[test]
fn an_http_answer_is_complete_once_its_head_and_content_length_body_are_in() {
    let answer = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 12\r\n\r\n{\"offset\":7}";
    // The head ends where the 12-byte body starts.
    let head = answer.len() - 12;
    for cut in 0..head {
        assert_eq!(http_answer(&answer[..cut]).unwrap(), None, "cut at {cut}");
    }
    for cut in head..=answer.len() {
        assert_eq!(
            http_answer(&answer[..cut]).unwrap(),
            Some((200, answer.len())),
            "cut at {cut}"
        );
    }
    let no_body = b"HTTP/1.1 404 Not Found\r\nContent-Length: 0\r\n\r\n";
    assert_eq!(http_answer(no_body).unwrap(), Some((404, no_body.len())));
    assert!(http_answer(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n").is_err());
    assert!(http_answer(b"garbage\r\n\r\n").is_err());
}

#[test]
fn the_rest_publisher_posts_every_payload_stamped_under_the_mqtt_name() {
    let runtime = tokio::runtime::Runtime::new().unwrap();
    let dir = std::env::temp_dir().join(format!("sluice-bench-rest-{}", std::process::id()));
    let (engine, server) = runtime.block_on(crate::http::start_sluice(&dir)).unwrap();
    let http: SocketAddr = server.base.trim_start_matches("http://").parse().unwrap();
    // A refused request ends the publisher with the answer.
    let small = sluice_core::TopicPolicy {
        max_message_bytes: 128,
        ..sluice_core::TopicPolicy::default()
    };
    runtime
        .block_on(engine.create_topic(LEDGER_TOPIC, 1, Some(small)))
        .unwrap();
    let refused = publish_rest(http, 256, 1e6, 3, 2).unwrap_err();
    assert!(format!("{refused:#}").contains("413"), "{refused:#}");
    runtime
        .block_on(engine.set_policy(LEDGER_TOPIC, sluice_core::TopicPolicy::default()))
        .unwrap();
    let before = now_ns();
    publish_rest(http, 64, 1e6, 7, 3).unwrap();
    let fetched = runtime
        .block_on(engine.fetch(LEDGER_TOPIC, 0, 0, 1 << 20))
        .unwrap();
    let mut seqs = Vec::new();
    for batch in sluice_core::split_batches(fetched.data).unwrap() {
        for r in sluice_core::decode_records(&batch).unwrap() {
            assert_eq!(r.record.key.as_deref(), Some(TOPIC.as_bytes()));
            let value = r.record.value.unwrap();
            assert_eq!(value.len(), 64);
            let sent = u64::from_be_bytes(value[..8].try_into().unwrap());
            assert!((before..=now_ns()).contains(&sent), "send time {sent}");
            seqs.push(u32::from_be_bytes(value[8..12].try_into().unwrap()));
        }
    }
    seqs.sort_unstable();
    assert_eq!(seqs, (0..7).collect::<Vec<u32>>());
    let _ = server.stop.send(true);
    runtime.block_on(server.task).unwrap().unwrap();
    runtime.block_on(engine.shutdown());
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn pubacks_the_socket_cannot_take_wait_for_writability_and_only_then() {
    use std::io::Read;
    use std::os::fd::AsRawFd;
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let stream = std::net::TcpStream::connect(listener.local_addr().unwrap()).unwrap();
    let (mut broker, _) = listener.accept().unwrap();
    stream.set_nonblocking(true).unwrap();
    let epoll = crate::epoll::Epoll::new().unwrap();
    let fd = stream.as_raw_fd();
    epoll
        .ctl(libc::EPOLL_CTL_ADD, fd, libc::EPOLLIN as u32, 7)
        .unwrap();
    let mut sub = Receiving {
        stream,
        framer: Framer::new(Framing::Mqtt),
        have: 0,
        acks: vec![0x40, 2, 0, 1],
        wants_write: false,
    };
    // Taken at once: nothing waits.
    assert!(flush_acks(&epoll, &mut sub, 7));
    assert!(sub.acks.is_empty() && !sub.wants_write);
    // More than the socket takes while the broker reads nothing: the rest waits.
    const BACKLOG: usize = 64 << 20;
    sub.acks = vec![0x40; BACKLOG];
    assert!(flush_acks(&epoll, &mut sub, 7));
    assert!(!sub.acks.is_empty() && sub.wants_write);
    let reader = std::thread::spawn(move || {
        let (mut buf, mut total) = (vec![0u8; 1 << 20], 4);
        while total < BACKLOG + 4 {
            total += broker.read(&mut buf).unwrap();
        }
        // Kept open: its end of stream would make the subscriber readable.
        broker
    });
    // Writability is reported, and once everything is written it is no longer waited for.
    let mut events = crate::epoll::events(8);
    for _ in 0..600 {
        if sub.acks.is_empty() {
            break;
        }
        let n = epoll.wait(&mut events, 100).unwrap();
        let writable = events[..n]
            .iter()
            .any(|e| e.u64 == 7 && e.events & libc::EPOLLOUT as u32 != 0);
        if writable {
            assert!(flush_acks(&epoll, &mut sub, 7));
        }
    }
    assert!(sub.acks.is_empty(), "EPOLLOUT never came for the backlog");
    assert!(!sub.wants_write);
    let _broker = reader.join().unwrap();
    assert_eq!(
        epoll.wait(&mut events, 0).unwrap(),
        0,
        "no EPOLLOUT left armed"
    );
}

/// A case of `broker` that published one message and delivered nothing.
fn case(broker: &str, qos: u8, subscribers: usize) -> CaseResult {
    CaseResult {
        broker: broker.to_owned(),
        speaks: "3.1.1".to_owned(),
        qos,
        subscribers,
        connected: subscribers as u64,
        connect_s: 0.0,
        published: 1,
        received: 0,
        histogram: vec![0; BUCKETS],
        last_ms: Vec::new(),
        broker_cpu: Duration::ZERO,
        broker_rss: 0,
        broker_rss_idle: 0,
        worker_cpu_us: 0,
        wire_bytes: 0,
        size: 0,
        publish_s: 0.0,
        stalled: 0,
        broker_stats: Value::Null,
        disk_mb_s: None,
    }
}

#[test]
fn cpu_is_shared_out_per_delivery_and_per_message_taken() {
    let mut ingest = CaseResult {
        published: 4,
        broker_cpu: Duration::from_millis(2),
        ..case("sluice", 1, 0)
    };
    assert!(ingest.cpu_per_delivery_us().is_nan(), "no deliveries");
    assert_eq!(ingest.cpu_per_message_us(), 500.0);
    ingest.received = 8;
    assert_eq!(ingest.cpu_per_delivery_us(), 250.0);
    assert_eq!(ingest.cpu_per_message_us(), 500.0);
}

#[test]
fn each_sluice_case_is_compared_with_every_peer_at_its_qos_and_n() {
    let results = vec![
        case("floor", 0, 100),
        case("sluice", 0, 100),
        case("mosquitto", 0, 100),
        case("sluice + 2 relays", 0, 100),
        case("sluice", 1, 100),
        case("mosquitto", 1, 100),
        case("mosquitto", 0, 200),
    ];
    let pairs: Vec<(&str, &str, u8)> = against_peers(&results)
        .iter()
        .map(|(o, p)| (o.broker.as_str(), p.broker.as_str(), o.qos))
        .collect();
    assert_eq!(
        pairs,
        [
            ("sluice", "floor", 0),
            ("sluice", "mosquitto", 0),
            ("sluice + 2 relays", "floor", 0),
            ("sluice + 2 relays", "mosquitto", 0),
            ("sluice", "mosquitto", 1),
        ]
    );
}

#[test]
fn each_block_of_clients_connects_from_its_own_address() {
    let first = Ipv4Addr::new(127, 3, 0, 7);
    assert_eq!(source_for(first, 0), first);
    assert_eq!(source_for(first, CLIENTS_PER_ADDRESS - 1), first);
    assert_eq!(
        source_for(first, CLIENTS_PER_ADDRESS),
        Ipv4Addr::new(127, 3, 1, 7)
    );
    assert_eq!(source_for(first, 18_999), Ipv4Addr::new(127, 3, 4, 7));
}

#[test]
fn buckets_hold_latencies_within_one_percent() {
    for us in [2u64, 10, 999, 12_345, 1_000_000, 59_000_000] {
        let b = bucket_us(bucket(us));
        assert!(
            b <= us as f64 * 1.0001 && b > us as f64 / 1.02,
            "{us} -> {b}"
        );
    }
}
