//! What each CLI command asks the gateway and how it prints the answer.

use std::io::{BufRead, Read, Write};

use reqwest::Method;
use reqwest::header::HeaderValue;
use serde_json::{Value, json};

use super::client::{Client, Failure};
use super::table::{Table, bytes, duration_ms};
use super::{
    Admin, CamerasCmd, GroupsCmd, Output, ProduceArgs, ResetArgs, SubscriptionsCmd, TailArgs,
    TopicsCmd,
};

/// Records per `POST /topics/{t}/batches` (the API takes up to 10,000)...
const BATCH_RECORDS: usize = 1000;
/// ...and bytes of values per request, below the API's 2 MiB body limit with room for JSON.
const BATCH_BYTES: usize = 1 << 20;
/// Offsets per `POST /groups/{g}/offsets` of a reset.
const RESET_CHUNK: usize = 100;

pub(super) async fn run(client: &Client, output: Output, cmd: Admin) -> Result<(), Failure> {
    let print = |value: &Value, table: &dyn Fn(&Value) -> String| match output {
        Output::Json => println!(
            "{}",
            serde_json::to_string_pretty(value).unwrap_or_default()
        ),
        Output::Table => print!("{}", table(value)),
    };
    match cmd {
        Admin::Topics {
            cmd: TopicsCmd::List,
            ..
        } => {
            let names = client.get(&["topics"]).await?;
            let mut topics = Vec::new();
            for name in strings(&names["topics"]) {
                match client.get(&["topics", &name]).await {
                    Ok(t) => topics.push(t),
                    // Deleted between the two calls.
                    Err(f) if f.code == 1 => {}
                    Err(f) => return Err(f),
                }
            }
            print(&json!({ "topics": topics }), &topics_table);
        }
        Admin::Topics {
            cmd:
                TopicsCmd::Create {
                    name,
                    partitions,
                    config,
                },
            ..
        } => {
            let policy = settings(&config)?;
            let body = json!({ "name": name, "partitions": partitions, "policy": policy });
            let created = client.json(Method::POST, &["topics"], Some(&body)).await?;
            print(&created, &describe_table);
        }
        Admin::Topics {
            cmd: TopicsCmd::Describe { name },
            ..
        } => {
            let topic = client.get(&["topics", &name]).await?;
            print(&topic, &describe_table);
        }
        Admin::Topics {
            cmd: TopicsCmd::Delete { name },
            ..
        } => {
            client
                .json(Method::DELETE, &["topics", &name], None)
                .await?;
            if output == Output::Json {
                println!("{}", json!({ "deleted": name }));
            } else {
                println!("deleted topic {name}");
            }
        }
        Admin::Topics {
            cmd:
                TopicsCmd::Set {
                    name,
                    settings: pairs,
                    partitions,
                },
            ..
        } => {
            if pairs.is_empty() && partitions.is_none() {
                return Err(Failure::usage(
                    "nothing to set: give KEY=VALUE settings and/or --partitions N",
                ));
            }
            let mut topic = Value::Null;
            if !pairs.is_empty() {
                let body = Value::Object(settings(&pairs)?);
                topic = client
                    .json(Method::PUT, &["topics", &name, "policy"], Some(&body))
                    .await?;
            }
            if let Some(count) = partitions {
                let body = json!({ "count": count });
                topic = client
                    .json(Method::PUT, &["topics", &name, "partitions"], Some(&body))
                    .await?;
            }
            print(&topic, &describe_table);
        }
        Admin::Groups {
            cmd: GroupsCmd::List,
            ..
        } => {
            let groups = client.get(&["groups"]).await?;
            print(&groups, &|v| {
                let mut t = Table::new(&["GROUP", "PARTITIONS", "LAG"]);
                for g in array(&v["groups"]) {
                    t.row(vec![
                        text(&g["group"]),
                        array(&g["partitions"]).len().to_string(),
                        text(&g["lag"]),
                    ]);
                }
                t.render()
            });
        }
        Admin::Groups {
            cmd: GroupsCmd::Describe { group },
            ..
        } => {
            let g = client.get(&["groups", &group]).await?;
            print(&g, &group_table);
        }
        Admin::Groups {
            cmd: GroupsCmd::ResetOffsets(args),
            ..
        } => reset_offsets(client, output, &args).await?,
        Admin::Subscriptions {
            cmd: SubscriptionsCmd::List { topic },
            ..
        } => {
            let topics = match topic {
                Some(t) => vec![t],
                None => strings(&client.get(&["topics"]).await?["topics"]),
            };
            let mut all = Vec::new();
            for t in topics {
                let subs = client.get(&["topics", &t, "subscriptions"]).await?;
                for mut s in array(&subs["subscriptions"]).iter().cloned() {
                    s["topic"] = json!(t);
                    all.push(s);
                }
            }
            print(&json!({ "subscriptions": all }), &|v| {
                let mut t = Table::new(&["TOPIC", "SUBSCRIPTION", "TYPE", "CONSUMERS", "BACKLOG"]);
                for s in array(&v["subscriptions"]) {
                    let consumers = match &s["consumers"] {
                        Value::Array(a) => a.len().to_string(),
                        other => text(other),
                    };
                    t.row(vec![
                        text(&s["topic"]),
                        text(&s["name"]),
                        text(&s["type"]),
                        consumers,
                        text(&s["backlog"]),
                    ]);
                }
                t.render()
            });
        }
        Admin::Cameras {
            cmd: CamerasCmd::List,
            ..
        } => {
            let cams = client.get(&["cameras"]).await?;
            print(&cams, &|v| {
                let mut t = Table::new(&["NAME", "STATE", "TOPIC", "CODEC", "FPS", "BITRATE"]);
                for c in array(&v["cameras"]) {
                    t.row(vec![
                        text(&c["name"]),
                        text(&c["state"]),
                        text(&c["topic"]),
                        text(&c["codec"]),
                        format!("{:.1}", c["fps"].as_f64().unwrap_or(0.0)),
                        format!(
                            "{} kbit/s",
                            (c["bitrate_bps"].as_f64().unwrap_or(0.0) / 1000.0).round()
                        ),
                    ]);
                }
                t.render()
            });
        }
        Admin::Cameras {
            cmd:
                CamerasCmd::Add {
                    name,
                    url,
                    topic,
                    username,
                    password,
                    transport,
                    mode,
                },
            ..
        } => {
            let mut body = json!({ "name": name, "url": url });
            for (k, v) in [
                ("topic", topic),
                ("username", username),
                ("password", password),
                ("transport", transport),
                ("mode", mode),
            ] {
                if let Some(v) = v {
                    body[k] = json!(v);
                }
            }
            let cam = client.json(Method::POST, &["cameras"], Some(&body)).await?;
            print(&json!({ "cameras": [cam] }), &|v| {
                let mut t = Table::new(&["NAME", "STATE", "TOPIC", "URL"]);
                for c in array(&v["cameras"]) {
                    t.row(vec![
                        text(&c["name"]),
                        text(&c["state"]),
                        text(&c["topic"]),
                        text(&c["url"]),
                    ]);
                }
                t.render()
            });
        }
        Admin::Cameras {
            cmd: CamerasCmd::Remove { name },
            ..
        } => {
            client
                .json(Method::DELETE, &["cameras", &name], None)
                .await?;
            if output == Output::Json {
                println!("{}", json!({ "removed": name }));
            } else {
                println!("removed camera {name}");
            }
        }
        Admin::Tail { args, .. } => tail(client, output, &args).await?,
        Admin::Produce { args, .. } => produce(client, output, &args).await?,
    }
    Ok(())
}

fn array(v: &Value) -> &[Value] {
    v.as_array().map_or(&[], Vec::as_slice)
}

fn strings(v: &Value) -> Vec<String> {
    array(v)
        .iter()
        .filter_map(|s| s.as_str().map(str::to_owned))
        .collect()
}

/// A cell: strings as they are, numbers and booleans as JSON writes them, null as "-".
fn text(v: &Value) -> String {
    match v {
        Value::Null => "-".to_owned(),
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

fn u64_of(v: &Value) -> u64 {
    v.as_u64().unwrap_or(0)
}

/// `KEY=VALUE` pairs as a JSON object; a value is read as JSON (numbers, booleans) when it
/// parses as such, else as a string.
fn settings(pairs: &[String]) -> Result<serde_json::Map<String, Value>, Failure> {
    let mut out = serde_json::Map::new();
    for pair in pairs {
        let (k, v) = pair
            .split_once('=')
            .filter(|(k, _)| !k.is_empty())
            .ok_or_else(|| Failure::usage(format!("{pair:?} is not KEY=VALUE")))?;
        let value = serde_json::from_str(v).unwrap_or_else(|_| Value::String(v.to_owned()));
        out.insert(k.to_owned(), value);
    }
    Ok(out)
}

fn records_and_bytes(topic: &Value) -> (u64, u64) {
    array(&topic["partitions"])
        .iter()
        .fold((0, 0), |(r, b), p| {
            let records = u64_of(&p["high_watermark"]).saturating_sub(u64_of(&p["log_start"]));
            (
                r + records,
                b + u64_of(&p["bytes"]) + u64_of(&p["remote_bytes"]),
            )
        })
}

fn retention(policy: &Value) -> String {
    let time = policy["retention_ms"]
        .as_i64()
        .map_or_else(|| "-".to_owned(), duration_ms);
    match policy["retention_bytes"].as_i64() {
        Some(b) if b >= 0 => format!("{time} / {}", bytes(b as u64)),
        _ => time,
    }
}

fn topics_table(v: &Value) -> String {
    let mut t = Table::new(&[
        "TOPIC",
        "PARTITIONS",
        "RECORDS",
        "SIZE",
        "RETENTION",
        "CLEANUP",
        "OFFLOAD",
    ]);
    for topic in array(&v["topics"]) {
        let (records, size) = records_and_bytes(topic);
        let policy = &topic["policy"];
        t.row(vec![
            text(&topic["name"]),
            array(&topic["partitions"]).len().to_string(),
            records.to_string(),
            bytes(size),
            retention(policy),
            text(&policy["cleanup_policy"]),
            if policy["remote_storage_enable"].as_bool() == Some(true) {
                "on".to_owned()
            } else {
                "off".to_owned()
            },
        ]);
    }
    t.render()
}

fn describe_table(topic: &Value) -> String {
    let mut t = Table::new(&[
        "PARTITION",
        "LOG_START",
        "HIGH_WATERMARK",
        "RECORDS",
        "SEGMENTS",
        "SIZE",
    ]);
    for p in array(&topic["partitions"]) {
        let records = u64_of(&p["high_watermark"]).saturating_sub(u64_of(&p["log_start"]));
        t.row(vec![
            text(&p["partition"]),
            text(&p["log_start"]),
            text(&p["high_watermark"]),
            records.to_string(),
            text(&p["segments"]),
            bytes(u64_of(&p["bytes"]) + u64_of(&p["remote_bytes"])),
        ]);
    }
    // The policy follows as KEY VALUE lines under the partitions.
    let mut policy = Table::new(&["POLICY", "VALUE"]);
    if let Value::Object(map) = &topic["policy"] {
        for (k, v) in map {
            policy.row(vec![k.clone(), text(v)]);
        }
    }
    format!(
        "topic {}\n\n{}\n{}",
        text(&topic["name"]),
        t.render(),
        policy.render()
    )
}

fn group_table(g: &Value) -> String {
    let mut t = Table::new(&["TOPIC", "PARTITION", "COMMITTED", "LAG"]);
    for p in array(&g["partitions"]) {
        t.row(vec![
            text(&p["topic"]),
            text(&p["partition"]),
            text(&p["committed"]),
            text(&p["lag"]),
        ]);
    }
    t.render()
}

/// A progress bar on stderr for `len` units, drawn only on a terminal.
fn progress(len: u64, unit_bytes: bool) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::with_draw_target(
        Some(len),
        indicatif::ProgressDrawTarget::stderr(),
    );
    let template = if unit_bytes {
        "{bar:40} {bytes}/{total_bytes} {bytes_per_sec} {eta}"
    } else {
        "{bar:40} {pos}/{len} {per_sec} {eta}"
    };
    if let Ok(style) = indicatif::ProgressStyle::with_template(template) {
        bar.set_style(style);
    }
    bar
}

async fn reset_offsets(client: &Client, output: Output, args: &ResetArgs) -> Result<(), Failure> {
    let topic = client.get(&["topics", &args.topic]).await?;
    let mut offsets = Vec::new();
    for p in array(&topic["partitions"]) {
        let partition = u64_of(&p["partition"]);
        if args
            .partition
            .is_some_and(|only| u64::from(only) != partition)
        {
            continue;
        }
        let (start, end) = (u64_of(&p["log_start"]), u64_of(&p["high_watermark"]));
        let offset = if args.to_earliest {
            start
        } else if args.to_latest {
            end
        } else {
            args.to_offset.unwrap_or(start).clamp(start, end)
        };
        offsets.push(json!({ "topic": args.topic, "partition": partition, "offset": offset, "metadata": "" }));
    }
    if offsets.is_empty() {
        return Err(Failure::failed(format!(
            "topic {} has no partition {}",
            args.topic,
            args.partition.unwrap_or_default()
        )));
    }
    if !args.dry_run {
        let bar = progress(offsets.len() as u64, false);
        for chunk in offsets.chunks(RESET_CHUNK) {
            let body = json!({ "offsets": chunk });
            client
                .json(
                    Method::POST,
                    &["groups", &args.group, "offsets"],
                    Some(&body),
                )
                .await?;
            bar.inc(chunk.len() as u64);
        }
        bar.finish_and_clear();
    }
    let result = json!({ "group": args.group, "dry_run": args.dry_run, "offsets": offsets });
    match output {
        Output::Json => println!(
            "{}",
            serde_json::to_string_pretty(&result).unwrap_or_default()
        ),
        Output::Table => {
            let mut t = Table::new(&["TOPIC", "PARTITION", "NEW_OFFSET"]);
            for o in &offsets {
                t.row(vec![
                    text(&o["topic"]),
                    text(&o["partition"]),
                    text(&o["offset"]),
                ]);
            }
            print!("{}", t.render());
        }
    }
    Ok(())
}

/// Follows the topic's Server-Sent Events: each record's value on a line (text as it is,
/// binary in base64), or one JSON object per line.
async fn tail(client: &Client, output: Output, args: &TailArgs) -> Result<(), Failure> {
    let mut query = vec![(
        "start",
        if args.from_beginning { "0" } else { "latest" }.to_owned(),
    )];
    if let Some(p) = args.partition {
        query.push(("partition", p.to_string()));
    }
    let url = client.url(&["topics", &args.topic, "events"], &query);
    let mut resp = client.send(Method::GET, url, None).await?;
    let mut parser = SseParser::default();
    let mut seen = 0u64;
    let mut stdout = std::io::stdout().lock();
    while args.max_records.is_none_or(|max| seen < max) {
        let chunk = resp
            .chunk()
            .await
            .map_err(|e| Failure::failed(format!("the stream broke: {e}")))?;
        let Some(chunk) = chunk else { break };
        for event in parser.feed(&chunk) {
            match event.kind.as_str() {
                "record" | "record-base64" => {
                    let (partition, offset) = event.id.split_once(':').unwrap_or(("", ""));
                    let line = match output {
                        Output::Json => json!({
                            "partition": partition.parse::<u64>().ok(),
                            "offset": offset.parse::<u64>().ok(),
                            if event.kind == "record" { "value" } else { "value_base64" }: event.data,
                        })
                        .to_string(),
                        Output::Table => event.data,
                    };
                    if writeln!(stdout, "{line}")
                        .and_then(|()| stdout.flush())
                        .is_err()
                    {
                        // The reader went away (`| head`): a normal end.
                        return Ok(());
                    }
                    seen += 1;
                    if args.max_records.is_some_and(|max| seen >= max) {
                        return Ok(());
                    }
                }
                "end" => return Err(Failure::failed(format!("the stream ended: {}", event.data))),
                _ => {}
            }
        }
    }
    Ok(())
}

/// One Server-Sent Event.
#[derive(Debug, Default, PartialEq, Eq)]
struct Event {
    kind: String,
    id: String,
    data: String,
}

/// Server-Sent Events from chunks as they come (lines may be split across chunks).
#[derive(Debug, Default)]
struct SseParser {
    buf: Vec<u8>,
    event: Event,
    data: Vec<String>,
}

impl SseParser {
    fn feed(&mut self, chunk: &[u8]) -> Vec<Event> {
        self.buf.extend_from_slice(chunk);
        let mut out = Vec::new();
        while let Some(end) = self.buf.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = self.buf.drain(..=end).collect();
            let line = String::from_utf8_lossy(&line);
            let line = line.trim_end_matches(['\n', '\r']);
            if line.is_empty() {
                if !self.data.is_empty() || !self.event.kind.is_empty() {
                    let mut e = std::mem::take(&mut self.event);
                    e.data = std::mem::take(&mut self.data).join("\n");
                    if e.kind.is_empty() {
                        e.kind = "message".to_owned();
                    }
                    out.push(e);
                }
                continue;
            }
            let (field, value) = line.split_once(':').unwrap_or((line, ""));
            let value = value.strip_prefix(' ').unwrap_or(value);
            match field {
                "event" => value.clone_into(&mut self.event.kind),
                "id" => value.clone_into(&mut self.event.id),
                "data" => self.data.push(value.to_owned()),
                _ => {}
            }
        }
        out
    }
}

/// Produces stdin or a file: one record per line in batches (with progress for a file), or
/// the whole input as one record.
async fn produce(client: &Client, output: Output, args: &ProduceArgs) -> Result<(), Failure> {
    let (reader, len): (Box<dyn Read>, Option<u64>) = match &args.file {
        Some(path) => {
            let file = std::fs::File::open(path)
                .map_err(|e| Failure::usage(format!("{}: {e}", path.display())))?;
            let len = file.metadata().ok().map(|m| m.len());
            (Box::new(file), len)
        }
        None => (Box::new(std::io::stdin()), None),
    };
    if args.whole {
        let mut value = Vec::new();
        let mut reader = reader;
        reader
            .read_to_end(&mut value)
            .map_err(|e| Failure::usage(format!("reading the input: {e}")))?;
        let mut query = Vec::new();
        if let Some(k) = &args.key {
            query.push(("key", k.clone()));
        }
        if let Some(p) = args.partition {
            query.push(("partition", p.to_string()));
        }
        let content_type = args
            .content_type
            .as_deref()
            .unwrap_or("application/octet-stream");
        let content_type = HeaderValue::from_str(content_type).map_err(|_| {
            Failure::usage(format!(
                "--content-type {content_type:?} is not a header value"
            ))
        })?;
        let url = client.url(&["topics", &args.topic, "records"], &query);
        let resp = client
            .send(Method::POST, url, Some((content_type, value)))
            .await?;
        let placed: Value = resp
            .bytes()
            .await
            .ok()
            .and_then(|b| serde_json::from_slice(&b).ok())
            .unwrap_or(Value::Null);
        match output {
            Output::Json => println!("{placed}"),
            Output::Table => println!(
                "produced 1 record to {} partition {} offset {}",
                args.topic,
                text(&placed["partition"]),
                text(&placed["offset"])
            ),
        }
        return Ok(());
    }
    let bar = progress(len.unwrap_or(0), true);
    if len.is_none() {
        bar.set_draw_target(indicatif::ProgressDrawTarget::hidden());
    }
    let mut lines = std::io::BufReader::new(reader);
    let (mut batch, mut batch_bytes, mut read_bytes) = (Vec::new(), 0usize, 0u64);
    let (mut produced, mut first, mut last): (u64, Option<Value>, Option<Value>) = (0, None, None);
    loop {
        let mut line = String::new();
        let n = lines
            .read_line(&mut line)
            .map_err(|e| Failure::usage(format!("reading the input: {e}")))?;
        if n > 0 {
            read_bytes += n as u64;
            let value = line.trim_end_matches(['\n', '\r']);
            let mut record = json!({ "value": value });
            if let Some(k) = &args.key {
                record["key"] = json!(k);
            }
            if let Some(p) = args.partition {
                record["partition"] = json!(p);
            }
            batch_bytes += value.len();
            batch.push(record);
        }
        if !batch.is_empty()
            && (n == 0 || batch.len() >= BATCH_RECORDS || batch_bytes >= BATCH_BYTES)
        {
            let body = json!({ "records": std::mem::take(&mut batch) });
            let placed = client
                .json(
                    Method::POST,
                    &["topics", &args.topic, "batches"],
                    Some(&body),
                )
                .await?;
            let offsets = array(&placed["offsets"]);
            produced += offsets.len() as u64;
            if first.is_none() {
                first = offsets.first().cloned();
            }
            last = offsets.last().cloned().or(last);
            batch_bytes = 0;
            bar.set_position(read_bytes);
        }
        if n == 0 {
            break;
        }
    }
    bar.finish_and_clear();
    let summary = json!({ "topic": args.topic, "records": produced, "first": first, "last": last });
    match output {
        Output::Json => println!("{summary}"),
        Output::Table => println!("produced {produced} records to {}", args.topic),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Events split anywhere across chunks come out whole; multi-line data is joined.
    #[test]
    fn sse_events_survive_any_chunking() {
        let stream = b"event: record\nid: 0:5\ndata: a\ndata: b\n\nevent: record-base64\nid: 1:2\ndata: AAE=\n\n";
        for split in 0..stream.len() {
            let mut p = SseParser::default();
            let mut events = p.feed(&stream[..split]);
            events.extend(p.feed(&stream[split..]));
            assert_eq!(
                events,
                vec![
                    Event {
                        kind: "record".into(),
                        id: "0:5".into(),
                        data: "a\nb".into()
                    },
                    Event {
                        kind: "record-base64".into(),
                        id: "1:2".into(),
                        data: "AAE=".into()
                    },
                ],
                "split at {split}"
            );
        }
    }

    #[test]
    fn settings_read_json_values_and_fall_back_to_strings() {
        let s = settings(&[
            "retention_ms=86400000".into(),
            "cleanup_policy=compact".into(),
            "remote_storage_enable=true".into(),
        ])
        .unwrap();
        assert_eq!(s["retention_ms"], json!(86_400_000));
        assert_eq!(s["cleanup_policy"], json!("compact"));
        assert_eq!(s["remote_storage_enable"], json!(true));
        assert_eq!(settings(&["nokey".into()]).unwrap_err().code, 2);
        assert_eq!(settings(&["=v".into()]).unwrap_err().code, 2);
    }
}
