"""Fixtures of the access-control and TLS suite (tests/security): a real `sluice` gateway per
test, configured with a file of [[users]] (made by `sluice passwd`), [[acl]] rules, [auth] and
[tls] (certificates made by the `openssl` CLI at test time), and stock clients against it:
mosquitto_pub/mosquitto_sub, paho-mqtt (TLS and wss://), confluent-kafka, kcat, curl, openssl.

Run from the repository root, after ./scripts/install-test-deps.sh:

    target/pyenv/bin/python -m pytest -q tests/security

The gateway process, `gateway_factory` and the hooks live in tests/harness.py (its docstring
lists the environment variables read). Here:
    pki                 (session) the CAs and certificates, see seclib.Pki
    secure_gateway      make(users={name: password}, acl=[...], auth={...}, tls=True|False|dict,
                        tokens=(names,), env={...}) -> a started gateway (SecureGateway)
"""

from __future__ import annotations

import ssl
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))
sys.path.insert(0, str(HERE))

import harness  # noqa: E402
from harness import (  # noqa: E402,F401  (fixtures and hooks are found by name here)
    gateway_factory,
    pytest_collection_modifyitems,
    pytest_configure,
    pytest_runtest_makereport,
    uniq,
)
import seclib  # noqa: E402
from seclib import Mqtt, Pki  # noqa: E402

# Every TLS listener on a port the OS picks (their defaults are 0.0.0.0:8443/8883/9093).
TLS_ENV = {
    "SLUICE_HTTP__TLS_ADDR": "127.0.0.1:0",
    "SLUICE_MQTT__TLS_ADDR": "127.0.0.1:0",
    "SLUICE_KAFKA__TLS_ADDR": "127.0.0.1:0",
}


class SecureGateway(harness.Gateway):
    """The shared gateway process, plus its TLS listeners, its configuration file (rewritable,
    then `reload()` with SIGHUP) and paho clients closed at teardown."""

    config_path: Path
    pki: Pki
    tokens: dict[str, str]
    tls_files: "seclib.Cert | None"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self._mqtt_clients: list[Mqtt] = []

    # ---- addresses of the TLS listeners ----

    def tls_addr(self, proto: str, timeout: float = 5.0) -> tuple[str, int]:
        """The address of listener `proto` ("https", "mqtt-tls", "kafka-tls")."""
        if proto not in self.addrs:
            line = self.wait_for_log(rf'listening\s+protocol="?{proto}"?\s', timeout=timeout)
            m = harness._LISTENING.search(line)
            self.addrs[m.group("proto")] = harness._split_addr(m.group("addr"))
        return self.addrs[proto]

    @property
    def https(self) -> str:
        host, port = self.tls_addr("https")
        return f"https://{host}:{port}"

    @property
    def mqtts_addr(self) -> tuple[str, int]:
        return self.tls_addr("mqtt-tls")

    @property
    def kafka_tls(self) -> str:
        host, port = self.tls_addr("kafka-tls")
        return f"{host}:{port}"

    # ---- configuration ----

    def rewrite_config(self, **sections) -> None:
        """Writes the configuration file anew (config_text's arguments)."""
        self.config_path.write_text(seclib.config_text(**sections))

    def reload(self, what: str = r"reload", timeout: float = 10.0) -> str:
        """SIGHUP, then waits for the gateway's log line about the reload matching `what`."""
        import signal

        start = len(self.log_lines())
        assert self.proc is not None and self.alive
        self.proc.send_signal(signal.SIGHUP)
        return self.wait_for_log(what, timeout=timeout, start_index=start)

    # ---- clients ----

    def client_tls(self, ca: Path | None = None, cert=None) -> ssl.SSLContext:
        return seclib.client_context(ca or self.pki.ca.cert, cert)

    def mqtt_tls(self, version: int = 5, connect: bool = True, ca: Path | None = None, cert=None, **kwargs) -> Mqtt:
        """A paho client on the MQTT TLS listener (trusting the test CA unless `ca`)."""
        host, port = self.mqtts_addr
        # The server certificate names IP:127.0.0.1 too: the hostname check applies to the IP.
        c = Mqtt(host, port, version=version, tls=self.client_tls(ca, cert), **kwargs)
        self._mqtt_clients.append(c)
        if connect:
            c.connect()
        return c

    def mqtt_plain(self, version: int = 5, connect: bool = True, **kwargs) -> Mqtt:
        c = Mqtt(self.mqtt_host, self.mqtt_port, version=version, **kwargs)
        self._mqtt_clients.append(c)
        if connect:
            c.connect()
        return c

    def mqtt_wss(self, version: int = 5, connect: bool = True, **kwargs) -> Mqtt:
        """A paho client speaking MQTT over wss:// to /mqtt on the HTTPS listener."""
        host, port = self.tls_addr("https")
        c = Mqtt(host, port, version=version, tls=self.client_tls(), transport="websockets", path="/mqtt", **kwargs)
        self._mqtt_clients.append(c)
        if connect:
            c.connect()
        return c

    def kafka_conf(self, protocol: str = "SASL_SSL", mechanism: str | None = "SCRAM-SHA-512", user: str | None = None,
                   password: str | None = None, cert=None, ca: Path | None = None, **extra) -> dict:
        """confluent-kafka settings for one of the gateway's Kafka listeners: SSL/SASL_SSL on the
        TLS listener, PLAINTEXT/SASL_PLAINTEXT on the plain one."""
        conf = {"security.protocol": protocol}
        if protocol in ("SSL", "SASL_SSL"):
            conf["bootstrap.servers"] = self.kafka_tls
            conf["ssl.ca.location"] = str(ca or self.pki.ca.cert)
            conf["ssl.endpoint.identification.algorithm"] = "https"
            if cert is not None:
                conf["ssl.certificate.location"] = str(cert.cert)
                conf["ssl.key.location"] = str(cert.key)
        else:
            conf["bootstrap.servers"] = self.bootstrap
        if protocol.startswith("SASL"):
            conf.update({"sasl.mechanism": mechanism, "sasl.username": user, "sasl.password": password})
        conf.update(extra)
        return conf

    def close_clients(self) -> None:
        for c in self._mqtt_clients:
            c.close()
        self._mqtt_clients.clear()
        super().close_clients()


@pytest.fixture
def gateway_class():
    return SecureGateway


@pytest.fixture(scope="session")
def pki(tmp_path_factory) -> Pki:
    """CAs and certificates made with the openssl CLI once per session (seclib.Pki)."""
    return Pki(tmp_path_factory.mktemp("pki"))


@pytest.fixture(scope="session")
def user_entries():
    """entry(name, password) -> a [[users]] entry from `sluice passwd` (cached per session)."""
    cache: dict[tuple[str, str], str] = {}

    def entry(name: str, password: str) -> str:
        if (name, password) not in cache:
            cache[(name, password)] = seclib.passwd(name, password)
        return cache[(name, password)]

    return entry


@pytest.fixture
def secure_gateway(gateway_factory, pki, user_entries, tmp_path):
    """make(users={name: password}, acl=[rule dicts], auth={...}, tls=True, tokens=(), env={})
    -> a started SecureGateway configured by a file (gw.config_path):
        users   [[users]] entries made with `sluice passwd`
        tokens  user names that also get an HTTP Bearer token (gw.tokens[name])
        tls     True: [tls] with the test CA's server certificate (files copied into the test's
                dir, gw.tls_files, which a test may replace), the CA as client_ca_file and
                cert_principal on; a dict: those [tls] keys over that; False: no [tls]
    The TLS listeners are on 127.0.0.1 ports the OS picks."""
    count = [0]

    def make(users: dict | None = None, acl=(), auth: dict | None = None, tls=True, tokens=(), env: dict | None = None):
        n = count[0]
        count[0] += 1
        entries, toks = [], {}
        for name, password in (users or {}).items():
            if name in tokens:
                entry, toks[name] = seclib.user_entry(name, password, token=True)
            else:
                entry = user_entries(name, password)
            entries.append(entry)
        tls_files = None
        tls_section = None
        if tls:
            tls_files = pki.server_copy(tmp_path / f"tls-{n}")
            tls_section = {"cert_file": tls_files.cert, "key_file": tls_files.key,
                           "client_ca_file": pki.ca.cert, "cert_principal": True}
            if isinstance(tls, dict):
                tls_section.update(tls)
        sections = {"users": entries, "acl": list(acl), "auth": auth, "tls": tls_section}
        path = tmp_path / f"sluice-{n}.toml"
        path.write_text(seclib.config_text(**sections))
        gw = gateway_factory(env={**TLS_ENV, **(env or {})}, args=("--config", str(path)))
        gw.config_path, gw.pki, gw.tokens, gw.tls_files = path, pki, toks, tls_files
        gw.sections = sections
        return gw

    return make
