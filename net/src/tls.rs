//! TLS for every listener (rustls on aws-lc-rs): one server configuration from PEM files,
//! shared by the MQTT, Kafka and HTTPS listeners, replaced whole by [`Tls::reload`] (SIGHUP)
//! without touching connections already open (each keeps the session it negotiated).

use std::io;
use std::path::PathBuf;
use std::sync::Arc;

use std::time::Duration;

use arc_swap::ArcSwap;
use rustls::RootCertStore;
use rustls::server::{ServerConfig, WebPkiClientVerifier};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use sluice_metrics::{Counter, RegisterExt, Registry};
use tokio::io::{AsyncRead, AsyncWrite};
use tokio_rustls::server::TlsStream;

/// Whether clients must show a certificate signed by the client CA.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ClientCerts {
    /// No client CA: clients are not asked for certificates.
    None,
    /// A certificate is verified when given; clients without one still connect (and sign in
    /// with credentials instead).
    Optional,
    /// Every client must show a valid certificate.
    Required,
}

/// Where the certificate, key and client CA are read from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    pub cert_file: PathBuf,
    pub key_file: PathBuf,
    /// Client CA bundle; `None`: no mutual TLS.
    pub client_ca_file: Option<PathBuf>,
    /// Only with a client CA.
    pub client_certs: ClientCerts,
}

/// The server side of TLS: the configuration in force and its counts.
#[derive(Debug)]
pub struct Tls {
    files: TlsFiles,
    config: ArcSwap<ServerConfig>,
    /// Handshakes that failed (bad certificates, untrusted CAs, plain text on a TLS port).
    handshake_failures: Counter,
    /// Successful reloads since start.
    reloads: Counter,
}

impl Tls {
    /// Reads the files and builds the configuration; an error names the file and the problem.
    pub fn load(files: TlsFiles) -> Result<Arc<Self>, String> {
        let config = build(&files)?;
        Ok(Arc::new(Self {
            files,
            config: ArcSwap::from_pointee(config),
            handshake_failures: Counter::default(),
            reloads: Counter::default(),
        }))
    }

    /// Reads the files again and puts the new configuration in force for new connections;
    /// on any error the old one stays, and the error is returned.
    pub fn reload(&self) -> Result<(), String> {
        let config = build(&self.files)?;
        self.config.store(Arc::new(config));
        self.reloads.inc();
        Ok(())
    }

    /// Runs the server handshake on `stream` within `limit`.
    pub async fn accept<S>(&self, stream: S, limit: Duration) -> io::Result<TlsStream<S>>
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        let acceptor = tokio_rustls::TlsAcceptor::from(self.config.load_full());
        match crate::within(limit, "the TLS handshake", acceptor.accept(stream)).await {
            Ok(s) => Ok(s),
            Err(e) => {
                self.handshake_failures.inc();
                Err(e)
            }
        }
    }

    /// Registers the handshake failures and reloads of every TLS listener.
    pub fn register(&self, registry: &mut Registry) {
        registry.register_counter(
            "sluice_tls_handshake_failures_total",
            "TLS handshakes that failed or timed out, on every TLS listener (untrusted or expired certificates, plain text on a TLS port).",
            &self.handshake_failures,
        );
        registry.register_counter(
            "sluice_tls_reloads_total",
            "Certificate reloads (SIGHUP) that put new certificates in force.",
            &self.reloads,
        );
    }

    /// The configuration in force (for an HTTP server that runs its own handshakes).
    pub fn config(&self) -> Arc<ServerConfig> {
        self.config.load_full()
    }
}

/// The common name of the subject of the certificate a client showed, if it showed one.
pub fn peer_common_name<S>(stream: &TlsStream<S>) -> Option<String> {
    let (_, conn) = stream.get_ref();
    let der = conn.peer_certificates()?.first()?;
    let (_, cert) = x509_parser::parse_x509_certificate(der.as_ref()).ok()?;
    let cn = cert.subject().iter_common_name().next()?.as_str().ok()?;
    Some(cn.to_owned())
}

fn build(files: &TlsFiles) -> Result<ServerConfig, String> {
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(&files.cert_file)
        .and_then(|it| it.collect::<Result<_, _>>())
        .map_err(|e| format!("tls.cert_file {}: {e}", files.cert_file.display()))?;
    if certs.is_empty() {
        return Err(format!(
            "tls.cert_file {}: no certificate in it",
            files.cert_file.display()
        ));
    }
    let key = PrivateKeyDer::from_pem_file(&files.key_file)
        .map_err(|e| format!("tls.key_file {}: {e}", files.key_file.display()))?;
    let builder = ServerConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("tls: {e}"))?;
    let builder = match (&files.client_ca_file, files.client_certs) {
        (Some(ca), mode) if mode != ClientCerts::None => {
            let mut roots = RootCertStore::empty();
            let cas = CertificateDer::pem_file_iter(ca)
                .and_then(|it| it.collect::<Result<Vec<_>, _>>())
                .map_err(|e| format!("tls.client_ca_file {}: {e}", ca.display()))?;
            let (added, _) = roots.add_parsable_certificates(cas);
            if added == 0 {
                return Err(format!(
                    "tls.client_ca_file {}: no usable CA certificate in it",
                    ca.display()
                ));
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider);
            let verifier = if mode == ClientCerts::Optional {
                verifier.allow_unauthenticated()
            } else {
                verifier
            };
            builder.with_client_cert_verifier(
                verifier
                    .build()
                    .map_err(|e| format!("tls.client_ca_file {}: {e}", ca.display()))?,
            )
        }
        _ => builder.with_no_client_auth(),
    };
    builder
        .with_single_cert(certs, key)
        .map_err(|e| format!("tls.cert_file and tls.key_file do not make a certificate: {e}"))
}

/// The client side of TLS, for a relay's links to its upstream: the CAs it trusts and,
/// optionally, its own certificate (for an upstream that asks for one).
#[derive(Debug, Clone)]
pub struct TlsClient {
    config: Arc<rustls::ClientConfig>,
}

impl TlsClient {
    /// Trusts the CAs in `ca_file`; presents `identity` (certificate and key files) when given.
    pub fn load(
        ca_file: &std::path::Path,
        identity: Option<(&std::path::Path, &std::path::Path)>,
    ) -> Result<Self, String> {
        let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
        let mut roots = RootCertStore::empty();
        let cas = CertificateDer::pem_file_iter(ca_file)
            .and_then(|it| it.collect::<Result<Vec<_>, _>>())
            .map_err(|e| format!("{}: {e}", ca_file.display()))?;
        let (added, _) = roots.add_parsable_certificates(cas);
        if added == 0 {
            return Err(format!(
                "{}: no usable CA certificate in it",
                ca_file.display()
            ));
        }
        let builder = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(|e| format!("tls: {e}"))?
            .with_root_certificates(roots);
        let config = match identity {
            None => builder.with_no_client_auth(),
            Some((cert, key)) => {
                let certs = CertificateDer::pem_file_iter(cert)
                    .and_then(|it| it.collect::<Result<Vec<_>, _>>())
                    .map_err(|e| format!("{}: {e}", cert.display()))?;
                let key = PrivateKeyDer::from_pem_file(key)
                    .map_err(|e| format!("{}: {e}", key.display()))?;
                builder
                    .with_client_auth_cert(certs, key)
                    .map_err(|e| format!("the relay's certificate and key: {e}"))?
            }
        };
        Ok(Self {
            config: Arc::new(config),
        })
    }

    /// Runs the client handshake on `stream` to `addr` (HOST:PORT; the host is the name the
    /// server's certificate must carry).
    pub async fn connect<S>(
        &self,
        addr: &str,
        stream: S,
    ) -> io::Result<tokio_rustls::client::TlsStream<S>>
    where
        S: AsyncRead + AsyncWrite + Unpin,
    {
        let host = addr
            .rsplit_once(':')
            .map_or(addr, |(h, _)| h)
            .trim_start_matches('[')
            .trim_end_matches(']');
        let name = rustls_pki_types::ServerName::try_from(host.to_owned())
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidInput, format!("{host}: {e}")))?;
        tokio_rustls::TlsConnector::from(self.config.clone())
            .connect(name, stream)
            .await
    }
}

/// A client connection: plain TCP, or TLS over it.
#[derive(Debug)]
pub enum ClientStream {
    Plain(tokio::net::TcpStream),
    Tls(Box<tokio_rustls::client::TlsStream<tokio::net::TcpStream>>),
}

impl ClientStream {
    /// Connects to `addr` within `limit`, with TLS when `tls` is given.
    pub async fn connect(addr: &str, tls: Option<&TlsClient>, limit: Duration) -> io::Result<Self> {
        let tcp = crate::within(limit, "connecting", tokio::net::TcpStream::connect(addr)).await?;
        tcp.set_nodelay(true)?;
        match tls {
            None => Ok(Self::Plain(tcp)),
            Some(tls) => {
                let s = crate::within(limit, "the TLS handshake", tls.connect(addr, tcp)).await?;
                Ok(Self::Tls(Box::new(s)))
            }
        }
    }
}

impl AsyncRead for ClientStream {
    fn poll_read(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(s) => std::pin::Pin::new(s).poll_read(cx, buf),
            Self::Tls(s) => std::pin::Pin::new(s).poll_read(cx, buf),
        }
    }
}

impl AsyncWrite for ClientStream {
    fn poll_write(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
        buf: &[u8],
    ) -> std::task::Poll<io::Result<usize>> {
        match self.get_mut() {
            Self::Plain(s) => std::pin::Pin::new(s).poll_write(cx, buf),
            Self::Tls(s) => std::pin::Pin::new(s).poll_write(cx, buf),
        }
    }

    fn poll_flush(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(s) => std::pin::Pin::new(s).poll_flush(cx),
            Self::Tls(s) => std::pin::Pin::new(s).poll_flush(cx),
        }
    }

    fn poll_shutdown(
        self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<io::Result<()>> {
        match self.get_mut() {
            Self::Plain(s) => std::pin::Pin::new(s).poll_shutdown(cx),
            Self::Tls(s) => std::pin::Pin::new(s).poll_shutdown(cx),
        }
    }
}
