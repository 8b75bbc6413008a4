//! Live connections per protocol: what the gateway's Kafka and MQTT servers report, plus this
//! API's own open streams and attached consumers.

use std::sync::Arc;

use axum::Json;
use axum::extract::State;
use serde::Serialize;
use utoipa::ToSchema;

use crate::RestApi;

/// One protocol's live connections.
#[derive(Debug, Clone, Serialize, ToSchema)]
pub struct ProtocolConnections {
    /// `kafka`, `mqtt`, `rest-websocket`, `rest-sse`, `rest-consumer`.
    pub protocol: String,
    /// Connections (or streams, or attached consumers) open now.
    pub open: u64,
    /// Who they are, where the protocol names its clients (MQTT client ids), sorted.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub clients: Vec<String>,
}

/// Reports the other servers' connections; the gateway supplies it.
pub type ConnectionLister = Arc<dyn Fn() -> Vec<ProtocolConnections> + Send + Sync>;

#[derive(Debug, Serialize, ToSchema)]
pub(crate) struct Connections {
    protocols: Vec<ProtocolConnections>,
}

/// Live connections per protocol.
#[utoipa::path(get, path = "/connections", tag = "admin",
    responses((status = 200, description = "Per protocol", body = Connections)))]
pub(crate) async fn connections(State(api): State<Arc<RestApi>>) -> Json<Connections> {
    let mut protocols = api.connections.as_ref().map(|f| f()).unwrap_or_default();
    let m = &api.metrics;
    for (protocol, gauge) in [
        ("rest-websocket", &m.websocket_streams),
        ("rest-sse", &m.sse_streams),
        ("rest-consumer", &m.subscription_consumers),
    ] {
        protocols.push(ProtocolConnections {
            protocol: protocol.to_owned(),
            open: gauge.get(),
            clients: Vec::new(),
        });
    }
    Json(Connections { protocols })
}
