"""MQTT over WebSocket: paho with transport="websockets" on the HTTP listener's /mqtt path
(subprotocol "mqtt"), exchanging messages with a plain-TCP client in both directions."""

from __future__ import annotations

import queue
import threading

import paho.mqtt.client as paho
import pytest
from paho.mqtt.enums import CallbackAPIVersion

from harness import WAIT_S


class WsClient:
    """A paho client over WebSocket, with blocking helpers bounded by WAIT_S."""

    def __init__(self, gateway, version: int, path: str = "/mqtt"):
        self.messages: queue.Queue = queue.Queue()
        self.connack: queue.Queue = queue.Queue()
        self.subacks: queue.Queue = queue.Queue()
        self.published: dict[int, threading.Event] = {}
        self.client = paho.Client(
            CallbackAPIVersion.VERSION2,
            client_id=f"ws-{version}-{id(self)}",
            protocol=paho.MQTTv5 if version == 5 else paho.MQTTv311,
            transport="websockets",
            reconnect_on_failure=False,
        )
        self.client.ws_set_options(path=path)
        self.client.on_connect = lambda c, u, f, rc, p: self.connack.put(rc)
        self.client.on_message = lambda c, u, m: self.messages.put(m)
        self.client.on_subscribe = lambda c, u, mid, rcs, p: self.subacks.put(rcs)
        host, port = gateway._addr("http")
        self.client.connect(host, port, keepalive=30)
        self.client.loop_start()

    def close(self):
        self.client.disconnect()
        self.client.loop_stop()


@pytest.mark.parametrize("version", [pytest.param(4, id="v311"), pytest.param(5, id="v5")])
def test_websocket_round_trip(gateway, uniq, version):
    ws = WsClient(gateway, version)
    try:
        rc = ws.connack.get(timeout=WAIT_S)
        assert not rc.is_failure, f"CONNACK over WebSocket refused: {rc}"
        up = uniq("ws-up")
        down = uniq("ws-down")
        _, mid = ws.client.subscribe(down, qos=1)
        granted = ws.subacks.get(timeout=WAIT_S)
        assert [int(g.value) for g in granted] == [1], granted

        tcp = gateway.mqtt(version)
        tcp.subscribe(up, qos=1)
        # WebSocket -> TCP, acknowledged (QoS 1) over the WebSocket.
        info = ws.client.publish(up, b"from-ws", qos=1)
        info.wait_for_publish(timeout=WAIT_S)
        assert info.is_published(), "no PUBACK over WebSocket"
        got = tcp.wait_messages(1, what="TCP subscriber of a WebSocket publish: ")
        assert got[0].payload == b"from-ws"

        # TCP -> WebSocket.
        tcp.publish(down, b"to-ws", qos=1)
        m = ws.messages.get(timeout=WAIT_S)
        assert (m.topic, m.payload, m.qos) == (down, b"to-ws", 1)
    finally:
        ws.close()


def test_websocket_wrong_path_is_refused(gateway):
    # The handshake happens inside connect(): a path other than /mqtt gets no upgrade.
    with pytest.raises(paho.WebsocketConnectionError):
        WsClient(gateway, 5, path="/not-mqtt")
