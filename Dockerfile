# The gateway as a container image: built with the project's toolchain, run from a small
# Debian image as an unprivileged user with its data on a volume.
#
#   docker build -t sluice .
#   docker run -p 8080:8080 -p 9092:9092 -p 1883:1883 -v sluice-data:/var/lib/sluice sluice
#
# docker-compose.yml runs it with Prometheus and Grafana (README, "Deployment").

FROM rust:1.95-bookworm AS build
WORKDIR /src
COPY . .
# Only the gateway: the benchmarks and examples are not in the image.
RUN cargo build --release --locked -p sluice \
    && cp target/release/sluice /usr/local/bin/sluice \
    && strip /usr/local/bin/sluice

FROM debian:bookworm-slim
# ca-certificates: TLS to object stores and upstreams; nothing else is needed at run time.
RUN apt-get update \
    && apt-get install -y --no-install-recommends ca-certificates \
    && rm -rf /var/lib/apt/lists/* \
    && useradd --system --uid 10001 --home-dir /var/lib/sluice --create-home sluice
COPY --from=build /usr/local/bin/sluice /usr/local/bin/sluice
COPY deploy/healthcheck.sh /usr/local/bin/sluice-healthcheck
USER sluice
ENV SLUICE_DATA_DIR=/var/lib/sluice
VOLUME ["/var/lib/sluice"]
# HTTP (REST, /metrics, /readyz, MQTT over WebSocket), Kafka, MQTT.
EXPOSE 8080 9092 1883
# Ready once the ledger is recovered and every listener is bound; 503 while shutting down.
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
    CMD ["/usr/local/bin/sluice-healthcheck", "127.0.0.1", "8080"]
STOPSIGNAL SIGTERM
ENTRYPOINT ["/usr/local/bin/sluice"]
