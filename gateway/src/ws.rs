//! MQTT over WebSocket at `/mqtt` on the HTTP port, for browser clients: binary WebSocket
//! messages carry MQTT bytes (subprotocol `mqtt`). Each socket is bridged to an in-memory
//! stream that the MQTT server serves exactly like a TCP connection.

use std::net::SocketAddr;

use axum::extract::ws::{Message, WebSocket, WebSocketUpgrade};
use axum::extract::{ConnectInfo, State};
use axum::http::{HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use tokio::io::{AsyncReadExt, AsyncWriteExt};

use crate::http::AppState;

/// Bytes buffered between the WebSocket and the MQTT session in each direction.
const BRIDGE_BUFFER: usize = 256 * 1024;

pub(crate) async fn mqtt(
    State(state): State<AppState>,
    ConnectInfo(peer): ConnectInfo<SocketAddr>,
    headers: HeaderMap,
    upgrade: WebSocketUpgrade,
) -> Response {
    if let Some(refused) = state.rest.check_websocket_origin(&headers) {
        return refused.into_response();
    }
    let Some(server) = state.mqtt.get().cloned() else {
        return (StatusCode::SERVICE_UNAVAILABLE, "MQTT is not ready\n").into_response();
    };
    let stop = state.stop.clone();
    upgrade
        .protocols(["mqtt"])
        .max_message_size(server_max_message(&server))
        .on_upgrade(move |socket| async move {
            let (session_side, bridge_side) = tokio::io::duplex(BRIDGE_BUFFER);
            tokio::spawn(bridge(socket, bridge_side));
            server
                .serve_stream(session_side, format!("ws://{peer}"), None, stop)
                .await;
        })
}

/// A WebSocket message may hold a whole MQTT packet plus framing.
fn server_max_message(server: &sluice_mqtt::MqttServer) -> usize {
    server.max_packet_bytes() + 16
}

/// Copies binary messages into the session's stream and the session's output back out as
/// binary messages, until either side ends.
async fn bridge(mut socket: WebSocket, mut stream: tokio::io::DuplexStream) {
    let mut buf = vec![0u8; 64 * 1024];
    loop {
        tokio::select! {
            msg = socket.recv() => match msg {
                Some(Ok(Message::Binary(bytes))) => {
                    if stream.write_all(&bytes).await.is_err() {
                        break;
                    }
                }
                Some(Ok(Message::Ping(_) | Message::Pong(_))) => {}
                // Text frames are not MQTT; a close or an error ends the connection.
                _ => break,
            },
            n = stream.read(&mut buf) => match n {
                Ok(0) | Err(_) => break,
                Ok(n) => {
                    if socket.send(Message::Binary(buf[..n].to_vec().into())).await.is_err() {
                        break;
                    }
                }
            },
        }
    }
    let _ = socket.send(Message::Close(None)).await;
}
