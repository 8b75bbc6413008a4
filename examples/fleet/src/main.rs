//! A device fleet for trying Sluice: `--devices` MQTT clients (rumqttc) publish a JSON sensor
//! reading every `--interval-ms` to `sensors/<device>/reading`, and every `--image-every`
//! readings a camera-sized image (`--image-bytes`, 2 MB by default) to `cameras/<device>/jpeg`.
//! Runs for `--seconds` and prints what was acknowledged.
//!
//!     cargo run --release                       # the gateway, in one terminal
//!     cargo run --release -p sluice-example-fleet -- --devices 50 --seconds 30
//!     kcat -b 127.0.0.1:9092 -C -t mqtt -e -f '%k %s\n' | head   # readings over Kafka

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use clap::Parser;
use rumqttc::{AsyncClient, Event, MqttOptions, Packet, QoS};

#[derive(Debug, Parser)]
#[command(name = "fleet", about = "Simulated MQTT device fleet for Sluice")]
struct Args {
    /// MQTT host of the gateway.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    #[arg(long, default_value_t = 1883)]
    port: u16,
    /// Number of simulated devices (one MQTT connection each).
    #[arg(long, default_value_t = 20)]
    devices: usize,
    /// Time between two readings of one device.
    #[arg(long, default_value_t = 1000)]
    interval_ms: u64,
    /// Every this many readings a device also sends an image (0: never).
    #[arg(long, default_value_t = 30)]
    image_every: u64,
    #[arg(long, default_value_t = 2 * 1024 * 1024)]
    image_bytes: usize,
    /// How long the fleet runs.
    #[arg(long, default_value_t = 30)]
    seconds: u64,
}

#[derive(Default)]
struct Totals {
    readings: AtomicU64,
    images: AtomicU64,
    acks: AtomicU64,
}

#[tokio::main]
async fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    let totals = Arc::new(Totals::default());
    let end = Instant::now() + Duration::from_secs(args.seconds);
    let mut devices = Vec::new();
    for d in 0..args.devices {
        let mut opts = MqttOptions::new(format!("device-{d}"), &args.host, args.port);
        opts.set_keep_alive(Duration::from_secs(30));
        opts.set_max_packet_size(16 * 1024 * 1024, 16 * 1024 * 1024);
        let (client, mut events) = AsyncClient::new(opts, 64);
        let totals_ev = totals.clone();
        tokio::spawn(async move {
            loop {
                match events.poll().await {
                    Ok(Event::Incoming(Packet::PubAck(_))) => {
                        totals_ev.acks.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(_) => {}
                    // After the run the device disconnects, which ends its event loop.
                    Err(_) if Instant::now() >= end => break,
                    Err(e) => {
                        eprintln!("device {d}: {e}");
                        tokio::time::sleep(Duration::from_secs(1)).await;
                    }
                }
            }
        });
        let totals = totals.clone();
        let image = vec![0xFFu8; args.image_bytes];
        let (interval, every) = (args.interval_ms, args.image_every);
        devices.push(tokio::spawn(async move {
            // Spread the devices over the interval instead of all publishing at once.
            tokio::time::sleep(Duration::from_millis(
                interval * d as u64 / args.devices.max(1) as u64,
            ))
            .await;
            let mut tick = tokio::time::interval(Duration::from_millis(interval));
            let mut n = 0u64;
            while Instant::now() < end {
                tick.tick().await;
                n += 1;
                let now_ms = SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map_or(0, |t| t.as_millis());
                let temperature = 20.0 + (d as f64 * 0.7 + n as f64 * 0.1).sin() * 5.0;
                let reading = format!(
                    r#"{{"device":{d},"seq":{n},"ts":{now_ms},"temperature":{temperature:.2}}}"#
                );
                if client
                    .publish(
                        format!("sensors/{d}/reading"),
                        QoS::AtLeastOnce,
                        false,
                        reading,
                    )
                    .await
                    .is_ok()
                {
                    totals.readings.fetch_add(1, Ordering::Relaxed);
                }
                if every > 0 && n.is_multiple_of(every) {
                    let sent = client
                        .publish(
                            format!("cameras/{d}/jpeg"),
                            QoS::AtLeastOnce,
                            false,
                            image.clone(),
                        )
                        .await;
                    if sent.is_ok() {
                        totals.images.fetch_add(1, Ordering::Relaxed);
                    }
                }
            }
            let _ = client.disconnect().await;
        }));
    }
    let started = Instant::now();
    let mut report = tokio::time::interval(Duration::from_secs(5));
    while Instant::now() < end {
        report.tick().await;
        println!(
            "{:>4.0}s  readings {:>8}  images {:>6}  acknowledged {:>8}",
            started.elapsed().as_secs_f64(),
            totals.readings.load(Ordering::Relaxed),
            totals.images.load(Ordering::Relaxed),
            totals.acks.load(Ordering::Relaxed),
        );
    }
    for d in devices {
        let _ = d.await;
    }
    println!(
        "done: {} readings and {} images from {} devices; {} acknowledged by the gateway",
        totals.readings.load(Ordering::Relaxed),
        totals.images.load(Ordering::Relaxed),
        args.devices,
        totals.acks.load(Ordering::Relaxed),
    );
    Ok(())
}
