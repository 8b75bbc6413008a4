//! Sluice's listener runtime: the one place every protocol's listener (Kafka, MQTT over TCP,
//! HTTP with its WebSocket upgrades) binds, accepts and drains.
//!
//! It owns what is the same for every protocol: binding with a deep backlog (and
//! `SO_REUSEPORT` where relays share a port), accepting with backoff when the process runs out
//! of file descriptors, admission against connection caps in total and per source address
//! (shared by all listeners, since they share the process's file limit), an open-connections
//! gauge kept by a drop guard, a write deadline for sockets that stop draining, and a drain on
//! shutdown that waits, within a bound, for every connection to end.
//!
//! It knows nothing of protocols: when a connection's first packet or a frame in progress is
//! late is the protocol's to say (with [`within`]), as is what a refusal sends before closing.
//! It never reads or writes application bytes itself.

mod admission;
mod deadline;
mod listener;
mod metrics;
mod rate;
mod tls;

pub use admission::{Admission, ConnectionLimits, Refused, Slot};
pub use deadline::{WriteDeadline, within};
pub use listener::{
    Admitted, BindOptions, Deadlines, LISTEN_BACKLOG, ListenerStats, Listening, Tracked, bind,
    serve,
};
pub use metrics::ListenerMetrics;
pub use rate::{RateLimit, Rates};
pub use tls::{ClientCerts, ClientStream, Tls, TlsClient, TlsFiles, peer_common_name};
pub use tokio_rustls::server::TlsStream;
