//! `sluice topics|groups|subscriptions|cameras|tail|produce`: the admin CLI, a client of a
//! running gateway's REST API (docs/CLI.md). Human tables by default, the API's JSON with
//! `--output json`; errors are one line on stderr and an exit code:
//!
//! | code | meaning |
//! |---|---|
//! | 0 | done |
//! | 1 | the gateway refused or failed the request (4xx other than 401/403, 5xx other than 503) |
//! | 2 | bad usage (arguments) |
//! | 69 | the gateway cannot be reached, or answered 503 (EX_UNAVAILABLE) |
//! | 77 | credentials missing or refused, or not allowed (401, 403: EX_NOPERM) |

mod client;
mod commands;
mod table;

use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Args, Subcommand, ValueEnum};

/// How to reach the gateway and how to print; shared by every CLI command.
#[derive(Debug, Args, Clone)]
pub(crate) struct Conn {
    /// The gateway's HTTP listener (plain HTTP: run the CLI where it reaches http.addr, as
    /// kafka-topics.sh reaches a broker). Env: SLUICE_SERVER.
    #[arg(
        long,
        env = "SLUICE_SERVER",
        default_value = "http://127.0.0.1:8080",
        global = true
    )]
    pub(crate) server: String,
    /// Output format.
    #[arg(long, short = 'o', value_enum, default_value_t = Output::Table, global = true)]
    pub(crate) output: Output,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, ValueEnum)]
pub(crate) enum Output {
    Table,
    Json,
}

#[derive(Debug, Subcommand)]
pub(crate) enum TopicsCmd {
    /// Every topic with its partitions, records, bytes and retention.
    List,
    /// Create a topic.
    Create {
        name: String,
        #[arg(long, default_value_t = 1)]
        partitions: u32,
        /// A policy key (see `sluice default-config`, [topics.defaults]), repeatable:
        /// `--config retention_ms=86400000`.
        #[arg(long = "config", short = 'c', value_name = "KEY=VALUE")]
        config: Vec<String>,
    },
    /// Partitions, offsets, sizes and policy of one topic.
    Describe { name: String },
    /// Delete a topic and its records.
    Delete { name: String },
    /// Change a topic's policy (`KEY=VALUE ...`) and/or grow it (`--partitions N`).
    Set {
        name: String,
        #[arg(value_name = "KEY=VALUE")]
        settings: Vec<String>,
        #[arg(long)]
        partitions: Option<u32>,
    },
}

#[derive(Debug, Subcommand)]
pub(crate) enum GroupsCmd {
    /// Every consumer group with committed offsets, and its lag.
    List,
    /// A group's committed offset and lag per partition.
    Describe { group: String },
    /// Commit new offsets for a group on every partition of a topic (or one). Consumers of
    /// the group should be stopped first: a running member commits over it.
    ResetOffsets(ResetArgs),
}

#[derive(Debug, Args)]
#[command(group(clap::ArgGroup::new("to").required(true).args(["to_earliest", "to_latest", "to_offset"])))]
pub(crate) struct ResetArgs {
    pub(crate) group: String,
    #[arg(long)]
    pub(crate) topic: String,
    /// Only this partition (default: all).
    #[arg(long)]
    pub(crate) partition: Option<u32>,
    #[arg(long)]
    pub(crate) to_earliest: bool,
    #[arg(long)]
    pub(crate) to_latest: bool,
    /// Clamped to each partition's log start and high watermark.
    #[arg(long, value_name = "OFFSET")]
    pub(crate) to_offset: Option<u64>,
    /// Print the new offsets without committing them.
    #[arg(long)]
    pub(crate) dry_run: bool,
}

#[derive(Debug, Subcommand)]
pub(crate) enum SubscriptionsCmd {
    /// Named subscriptions with their type, consumers and backlog (of one topic, or all).
    List { topic: Option<String> },
}

#[derive(Debug, Subcommand)]
pub(crate) enum CamerasCmd {
    /// Every camera with its state, frame rate and bit rate.
    List,
    /// Add a camera (kept across restarts).
    Add {
        name: String,
        /// rtsp://[user:password@]host[:port]/path
        url: String,
        #[arg(long)]
        topic: Option<String>,
        #[arg(long)]
        username: Option<String>,
        /// The camera's password. Env: SLUICE_CAMERA_PASSWORD.
        #[arg(long, env = "SLUICE_CAMERA_PASSWORD", hide_env_values = true)]
        password: Option<String>,
        /// tcp or udp.
        #[arg(long)]
        transport: Option<String>,
        /// frames, keyframes or jpeg.
        #[arg(long)]
        mode: Option<String>,
    },
    /// Remove a camera added over the API.
    Remove { name: String },
}

#[derive(Debug, Args)]
pub(crate) struct TailArgs {
    pub(crate) topic: String,
    /// Start at each partition's first record instead of the next one written.
    #[arg(long)]
    pub(crate) from_beginning: bool,
    /// Only this partition (default: all, interleaved as they are written).
    #[arg(long)]
    pub(crate) partition: Option<u32>,
    /// Exit after this many records.
    #[arg(long, short = 'n', value_name = "N")]
    pub(crate) max_records: Option<u64>,
}

#[derive(Debug, Args)]
pub(crate) struct ProduceArgs {
    pub(crate) topic: String,
    /// Read from this file instead of stdin.
    #[arg(long, short = 'f', value_name = "FILE")]
    pub(crate) file: Option<PathBuf>,
    /// Send the whole input as one record (an image, say) instead of one record per line.
    #[arg(long)]
    pub(crate) whole: bool,
    /// The content type of a --whole record (kept as its `content-type` header).
    #[arg(long, requires = "whole")]
    pub(crate) content_type: Option<String>,
    /// Every record's key (the partition then follows the key's hash).
    #[arg(long, short = 'k')]
    pub(crate) key: Option<String>,
    #[arg(long, short = 'p')]
    pub(crate) partition: Option<u32>,
}

/// The admin commands, each with the connection flags.
#[derive(Debug, Subcommand)]
pub(crate) enum Admin {
    /// List, create, describe, delete or change topics of a running gateway.
    Topics {
        #[command(subcommand)]
        cmd: TopicsCmd,
        #[command(flatten)]
        conn: Conn,
    },
    /// List or describe consumer groups, or reset their offsets.
    Groups {
        #[command(subcommand)]
        cmd: GroupsCmd,
        #[command(flatten)]
        conn: Conn,
    },
    /// List named subscriptions and their backlogs.
    Subscriptions {
        #[command(subcommand)]
        cmd: SubscriptionsCmd,
        #[command(flatten)]
        conn: Conn,
    },
    /// List, add or remove RTSP cameras.
    Cameras {
        #[command(subcommand)]
        cmd: CamerasCmd,
        #[command(flatten)]
        conn: Conn,
    },
    /// Print a topic's records as they are written (text values as they are, others in
    /// base64).
    Tail {
        #[command(flatten)]
        args: TailArgs,
        #[command(flatten)]
        conn: Conn,
    },
    /// Produce records: one per line of stdin or --file, or the whole input as one (--whole).
    Produce {
        #[command(flatten)]
        args: ProduceArgs,
        #[command(flatten)]
        conn: Conn,
    },
}

/// Runs an admin command against the gateway at `--server` and exits as the module's table
/// says.
pub(crate) fn run(admin: Admin) -> ExitCode {
    let runtime = match tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
    {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("sluice: cannot start the async runtime: {e}");
            return ExitCode::FAILURE;
        }
    };
    let conn = match &admin {
        Admin::Topics { conn, .. }
        | Admin::Groups { conn, .. }
        | Admin::Subscriptions { conn, .. }
        | Admin::Cameras { conn, .. }
        | Admin::Tail { conn, .. }
        | Admin::Produce { conn, .. } => conn.clone(),
    };
    let result = runtime.block_on(async {
        let client = client::Client::new(&conn)?;
        commands::run(&client, conn.output, admin).await
    });
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(f) => {
            eprintln!("sluice: {}", f.message);
            ExitCode::from(f.code)
        }
    }
}
