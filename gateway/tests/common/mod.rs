//! Runs the `sluice` binary as a child process and reads its log, for the end-to-end tests.
#![allow(clippy::unwrap_used, dead_code)]

pub(crate) mod relay;

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::sync::mpsc;
use std::time::Duration;

pub(crate) const BIN: &str = env!("CARGO_BIN_EXE_sluice");
/// Upper bound for any single wait on the child; a healthy run takes a fraction of it.
pub(crate) const PATIENCE: Duration = Duration::from_secs(60);

pub(crate) struct Gateway {
    pub(crate) child: Child,
    lines: mpsc::Receiver<String>,
    pub(crate) seen: Vec<String>,
    /// `http://HOST:PORT` of the HTTP listener.
    pub(crate) http: String,
    /// HOST:PORT of the MQTT listener.
    pub(crate) mqtt: String,
    /// HOST:PORT of the Kafka listener (on a relay, its read-only one for relays below it;
    /// empty when it has none).
    pub(crate) kafka: String,
    /// HOST:PORT of the MQTT and Kafka TLS listeners (empty without `[tls]`).
    pub(crate) mqtt_tls: String,
    pub(crate) kafka_tls: String,
}

impl Gateway {
    /// A main node on `data_dir`, every listener on a free loopback port.
    pub(crate) fn start(data_dir: &std::path::Path, extra: &[&str]) -> Self {
        Self::start_on(data_dir, "127.0.0.1:0", "127.0.0.1:0", extra)
    }

    /// Stops this main node (SIGTERM, which must succeed) and starts it again on `data_dir`
    /// with the same Kafka and MQTT addresses and `extra` arguments, as an operator's restart.
    pub(crate) fn restart(self, data_dir: &std::path::Path, extra: &[&str]) -> Self {
        let (kafka, mqtt) = (self.kafka.clone(), self.mqtt.clone());
        let (status, log) = self.stop_with(libc::SIGTERM);
        assert!(status.success(), "{log:#?}");
        Self::start_on(data_dir, &kafka, &mqtt, extra)
    }

    /// A main node on `data_dir` with the given Kafka and MQTT listeners.
    pub(crate) fn start_on(
        data_dir: &std::path::Path,
        kafka: &str,
        mqtt: &str,
        extra: &[&str],
    ) -> Self {
        Self::start_with_env(data_dir, kafka, mqtt, extra, &[])
    }

    /// A main node on `data_dir` with the given Kafka and MQTT listeners, `extra` arguments
    /// and the environment variables `env`.
    pub(crate) fn start_with_env(
        data_dir: &std::path::Path,
        kafka: &str,
        mqtt: &str,
        extra: &[&str],
        env: &[(&str, &str)],
    ) -> Self {
        let mut args = vec![
            "--data-dir",
            data_dir.to_str().unwrap(),
            "--http-addr",
            "127.0.0.1:0",
            "--kafka-addr",
            kafka,
            "--mqtt-addr",
            mqtt,
        ];
        args.extend_from_slice(extra);
        Self::spawn_with_env(&args, env)
    }

    /// A relay of `upstream` whose MQTT listener is `mqtt_addr` (port 0: a free one).
    pub(crate) fn relay(upstream: &Gateway, mqtt_addr: &str) -> Self {
        Self::relay_with(upstream, mqtt_addr, &[])
    }

    /// A relay of `upstream` (a main node or a relay serving relays below it) with `extra`
    /// arguments.
    pub(crate) fn relay_with(upstream: &Gateway, mqtt_addr: &str, extra: &[&str]) -> Self {
        let mut args = vec![
            "relay",
            "--upstream",
            &upstream.kafka,
            "--upstream-mqtt",
            &upstream.mqtt,
            "--http-addr",
            "127.0.0.1:0",
            "--mqtt-addr",
            mqtt_addr,
        ];
        args.extend_from_slice(extra);
        Self::spawn(&args)
    }

    /// Starts `sluice ARGS` and waits until it logs "ready".
    pub(crate) fn spawn(args: &[&str]) -> Self {
        Self::spawn_with_env(args, &[])
    }

    /// Starts `sluice ARGS` with the environment variables `env` set and waits until it logs
    /// "ready".
    pub(crate) fn spawn_with_env(args: &[&str], env: &[(&str, &str)]) -> Self {
        let mut g = Self::launch(args, env);
        g.read_until(|l| l.ends_with(" ready") || l.contains(r#""message":"ready""#));
        g
    }

    /// Starts `sluice ARGS` with `env` set, without waiting for anything.
    pub(crate) fn launch(args: &[&str], env: &[(&str, &str)]) -> Self {
        Self::launch_with(args, env, None)
    }

    /// Like [`Self::launch`], with the process's open-file limit (soft and hard) set to
    /// `max_files` when given: the gateway may raise only its soft limit, up to the hard one.
    pub(crate) fn launch_with(args: &[&str], env: &[(&str, &str)], max_files: Option<u64>) -> Self {
        let mut command = Command::new(BIN);
        command
            .args(args)
            .envs(env.iter().copied())
            .env_remove("RUST_LOG")
            // The worker-count test reads tokio's own default, which this would change.
            .env_remove("TOKIO_WORKER_THREADS")
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit());
        if let Some(n) = max_files {
            use std::os::unix::process::CommandExt;
            let limit = libc::rlimit {
                rlim_cur: n,
                rlim_max: n,
            };
            // SAFETY: setrlimit is async-signal-safe and touches only the child being started.
            unsafe {
                command.pre_exec(move || {
                    if libc::setrlimit(libc::RLIMIT_NOFILE, &limit) == 0 {
                        Ok(())
                    } else {
                        Err(std::io::Error::last_os_error())
                    }
                });
            }
        }
        let mut child = command.spawn().unwrap();
        let (tx, lines) = mpsc::channel();
        let stdout = child.stdout.take().unwrap();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        Self {
            child,
            lines,
            seen: Vec::new(),
            http: String::new(),
            mqtt: String::new(),
            kafka: String::new(),
            mqtt_tls: String::new(),
            kafka_tls: String::new(),
        }
    }

    /// Reads the log up to the first line `stop` accepts, and returns it, taking each
    /// listener's address from the lines on the way.
    pub(crate) fn read_until(&mut self, stop: impl Fn(&str) -> bool) -> String {
        loop {
            let line = self.wait_for_line(|l| l.contains("listening") || stop(l));
            if line.contains("listening") {
                let addr = listen_addr(&line);
                let is = |p: &str| {
                    line.contains(&format!("protocol=\"{p}\""))
                        || line.contains(&format!(r#""protocol":"{p}""#))
                };
                if is("http") {
                    self.http = format!("http://{addr}");
                } else if is("mqtt") {
                    self.mqtt = addr;
                } else if is("kafka") {
                    self.kafka = addr;
                } else if is("mqtt-tls") {
                    self.mqtt_tls = addr;
                } else if is("kafka-tls") {
                    self.kafka_tls = addr;
                }
            }
            if stop(&line) {
                return line;
            }
        }
    }

    pub(crate) fn wait_for_line(&mut self, f: impl Fn(&str) -> bool) -> String {
        loop {
            let line = self
                .lines
                .recv_timeout(PATIENCE)
                .unwrap_or_else(|e| panic!("no matching log line ({e}); saw {:#?}", self.seen));
            self.seen.push(line.clone());
            if f(&line) {
                return line;
            }
        }
    }

    pub(crate) fn signal(&self, sig: i32) {
        // SAFETY: kill with a valid pid and signal number has no memory effects.
        assert_eq!(unsafe { libc::kill(self.child.id() as i32, sig) }, 0);
    }

    /// Sends `sig` and returns the exit status and every remaining log line.
    pub(crate) fn stop_with(mut self, sig: i32) -> (std::process::ExitStatus, Vec<String>) {
        self.signal(sig);
        let status = self.child.wait().unwrap();
        let mut all = std::mem::take(&mut self.seen);
        // The reader thread may still be passing on the last lines after the exit: read until
        // it drops its end at the end of the output (taking only what had arrived lost them).
        loop {
            match self.lines.recv_timeout(PATIENCE) {
                Ok(line) => all.push(line),
                Err(mpsc::RecvTimeoutError::Disconnected) => break,
                Err(mpsc::RecvTimeoutError::Timeout) => panic!("the log did not end: {all:#?}"),
            }
        }
        (status, all)
    }
}

impl Drop for Gateway {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The HOST:PORT after `addr` in a "listening" log line (text or JSON).
fn listen_addr(line: &str) -> String {
    let addr = line.split("addr").nth(1).unwrap();
    addr.trim_start_matches(['=', '"', ':'])
        .chars()
        .take_while(|c| c.is_ascii_digit() || *c == '.' || *c == ':')
        .collect()
}

pub(crate) async fn get(url: &str) -> (u16, String) {
    let resp = reqwest::get(url).await.unwrap();
    (resp.status().as_u16(), resp.text().await.unwrap())
}
