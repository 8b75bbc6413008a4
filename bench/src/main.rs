//! `sluice-bench`: Sluice's benchmark and load-generator programs. Each subcommand measures one
//! thing, compares it with a baseline or peer run on the same machine in the same run, and
//! prints a Markdown table (and JSON on request) for `docs/BENCHMARKS.md`.

mod broadcast;
mod compaction;
mod epoll;
mod fanout;
mod floor;
mod http;
mod ledger;
mod mqtt;
mod stats;
mod tls;
mod validate;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(name = "sluice-bench", about = "Sluice benchmarks and load generators")]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Ledger append throughput and latency (1 KB and 2 MB records) against raw fdatasync'd
    /// writes to the same disk.
    Ledger(ledger::LedgerArgs),
    /// Log compaction in process: a pass over a large compacted partition (time, bytes read and
    /// written, memory, CPU) against reading and writing its files once, and produce to the
    /// same disk while it runs against produce alone.
    Compaction(compaction::CompactionArgs),
    /// The core's live broadcast in process: N subscribers on one partition, 10 KB records at a
    /// steady rate and 2 MB bursts; attach time, memory per subscriber, latency, copies.
    FanoutCore(fanout::FanoutArgs),
    /// MQTT one publisher → one subscriber through Sluice, Mosquitto and rumqttd (QoS 0/1,
    /// 1 KB and 2 MB), and Sluice's memory per idle connection.
    Mqtt(mqtt::MqttArgs),
    /// The REST API over HTTP/1.1 with concurrent keep-alive clients: produce, single-record
    /// fetch and range fetch (1 KB and 2 MB) against an HTTP floor with no storage.
    Http(http::HttpArgs),
    /// The connected-car case: one publisher, one MQTT topic, N subscribers (QoS 0/1) in worker
    /// processes, through Sluice, Mosquitto and rumqttd each in its own process; connect time,
    /// latency, time until the last subscriber has each message, loss, CPU per delivery, memory.
    Broadcast(Box<broadcast::BroadcastArgs>),
    /// What TLS costs beside plain TCP on the gateway binary, in the same run: MQTT QoS 1
    /// (1 KB, 2 MB), Kafka produce, and the fan-out's CPU per delivery to N subscribers.
    Tls(tls::TlsArgs),
    /// What whole-batch validation (every record walked, compressed batches decompressed) adds
    /// to a produce, per record, beside the header and CRC check alone.
    Validate(validate::ValidateArgs),
    /// A worker process of `broadcast` (started by it).
    #[command(hide = true)]
    BroadcastWorker(broadcast::WorkerArgs),
    /// A broker process of `broadcast` (started by it).
    #[command(hide = true)]
    BroadcastPeer(broadcast::PeerArgs),
}

fn main() -> anyhow::Result<()> {
    let cli = Cli::parse();
    // These run their own runtimes (sized for the processes they are).
    let cli = match cli.command {
        Command::Broadcast(args) => return broadcast::run(*args),
        Command::Validate(args) => return validate::run(args),
        Command::BroadcastWorker(args) => return broadcast::worker(args),
        Command::BroadcastPeer(args) => return broadcast::peer(args),
        command => command,
    };
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    match cli {
        Command::Ledger(args) => runtime.block_on(ledger::run(args)),
        Command::Compaction(args) => runtime.block_on(compaction::run(args)),
        Command::FanoutCore(args) => runtime.block_on(fanout::run(args)),
        Command::Mqtt(args) => runtime.block_on(mqtt::run(args)),
        Command::Http(args) => runtime.block_on(http::run(args)),
        Command::Tls(args) => runtime.block_on(tls::run(args)),
        Command::Broadcast(_)
        | Command::BroadcastWorker(_)
        | Command::BroadcastPeer(_)
        | Command::Validate(_) => {
            unreachable!("handled above")
        }
    }
}
