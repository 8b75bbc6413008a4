//! TLS on the listener runtime, with certificates made here: handshakes against a trusted CA,
//! client certificates and their subject, refusals of untrusted peers, and a reload that new
//! connections see while open ones carry on.
#![allow(clippy::unwrap_used)]

use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
use sluice_net::{ClientCerts, Tls, TlsFiles, peer_common_name};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

struct Ca {
    params: CertificateParams,
    key: KeyPair,
    pem: String,
}

fn ca(name: &str) -> Ca {
    let mut params = CertificateParams::new(Vec::<String>::new()).unwrap();
    params.distinguished_name.push(DnType::CommonName, name);
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let key = KeyPair::generate().unwrap();
    let pem = params.self_signed(&key).unwrap().pem();
    Ca { params, key, pem }
}

/// A leaf for `cn` (and `localhost`) signed by `ca`: (certificate PEM, key PEM).
fn leaf(ca: &Ca, cn: &str) -> (String, String) {
    let mut params = CertificateParams::new(vec!["localhost".to_string()]).unwrap();
    params.distinguished_name.push(DnType::CommonName, cn);
    let key = KeyPair::generate().unwrap();
    let issuer = Issuer::from_params(&ca.params, &ca.key);
    let cert = params.signed_by(&key, &issuer).unwrap();
    (cert.pem(), key.serialize_pem())
}

fn write(dir: &Path, name: &str, text: &str) -> std::path::PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p
}

fn client_config(trust: &str, identity: Option<(&str, &str)>) -> Arc<rustls::ClientConfig> {
    let provider = Arc::new(rustls::crypto::aws_lc_rs::default_provider());
    let mut roots = rustls::RootCertStore::empty();
    for c in CertificateDer::pem_slice_iter(trust.as_bytes()) {
        roots.add(c.unwrap()).unwrap();
    }
    let builder = rustls::ClientConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots);
    let config = match identity {
        Some((cert, key)) => builder
            .with_client_auth_cert(
                CertificateDer::pem_slice_iter(cert.as_bytes())
                    .map(Result::unwrap)
                    .collect(),
                PrivateKeyDer::from_pem_slice(key.as_bytes()).unwrap(),
            )
            .unwrap(),
        None => builder.with_no_client_auth(),
    };
    Arc::new(config)
}

use rustls::pki_types::pem::PemObject;

/// An echo server over TLS that first writes the client's certificate CN (or "-") and a
/// newline.
async fn echo_server(tls: Arc<Tls>) -> std::net::SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let (tcp, _) = listener.accept().await.unwrap();
            let tls = tls.clone();
            tokio::spawn(async move {
                let Ok(mut s) = tls.accept(tcp, Duration::from_secs(10)).await else {
                    return;
                };
                let cn = peer_common_name(&s).unwrap_or_else(|| "-".into());
                let _ = s.write_all(format!("{cn}\n").as_bytes()).await;
                let mut buf = [0u8; 64];
                while let Ok(n) = s.read(&mut buf).await {
                    if n == 0 || s.write_all(&buf[..n]).await.is_err() {
                        return;
                    }
                }
            });
        }
    });
    addr
}

type Client = tokio_rustls::client::TlsStream<TcpStream>;

async fn connect(
    addr: std::net::SocketAddr,
    config: Arc<rustls::ClientConfig>,
) -> std::io::Result<(Client, String)> {
    let tcp = TcpStream::connect(addr).await?;
    let mut s = tokio_rustls::TlsConnector::from(config)
        .connect(ServerName::try_from("localhost").unwrap(), tcp)
        .await?;
    let mut line = Vec::new();
    let mut b = [0u8; 1];
    loop {
        // The server's first write is where a refused client certificate shows (TLS 1.3
        // sends the alert after the client's handshake is done).
        if s.read(&mut b).await? == 0 {
            return Err(std::io::ErrorKind::UnexpectedEof.into());
        }
        if b[0] == b'\n' {
            break;
        }
        line.push(b[0]);
    }
    Ok((s, String::from_utf8(line).unwrap()))
}

async fn round_trip(s: &mut Client) -> std::io::Result<()> {
    s.write_all(b"ping").await?;
    let mut got = [0u8; 4];
    s.read_exact(&mut got).await?;
    assert_eq!(&got, b"ping");
    Ok(())
}

#[tokio::test]
async fn handshakes_client_certificates_and_refusals() {
    let dir = tempfile::tempdir().unwrap();
    let server_ca = ca("server CA");
    let client_ca = ca("client CA");
    let (cert, key) = leaf(&server_ca, "localhost");
    let tls = Tls::load(TlsFiles {
        cert_file: write(dir.path(), "cert.pem", &cert),
        key_file: write(dir.path(), "key.pem", &key),
        client_ca_file: Some(write(dir.path(), "clients.pem", &client_ca.pem)),
        client_certs: ClientCerts::Optional,
    })
    .unwrap();
    let addr = echo_server(tls.clone()).await;

    // No client certificate: allowed (optional), no subject.
    let (mut s, cn) = connect(addr, client_config(&server_ca.pem, None))
        .await
        .unwrap();
    assert_eq!(cn, "-");
    round_trip(&mut s).await.unwrap();

    // A certificate from the client CA: its subject's common name comes through.
    let (ccert, ckey) = leaf(&client_ca, "alice");
    let (mut s, cn) = connect(addr, client_config(&server_ca.pem, Some((&ccert, &ckey))))
        .await
        .unwrap();
    assert_eq!(cn, "alice");
    round_trip(&mut s).await.unwrap();

    // A client certificate from another CA is refused.
    let rogue = ca("rogue CA");
    let (rcert, rkey) = leaf(&rogue, "mallory");
    assert!(
        connect(addr, client_config(&server_ca.pem, Some((&rcert, &rkey))))
            .await
            .is_err()
    );

    // A client that does not trust the server's CA refuses it.
    assert!(
        connect(addr, client_config(&rogue.pem, None))
            .await
            .is_err()
    );

    // Plain text on the TLS port fails its handshake and is counted.
    let failures = handshake_failures(&tls);
    let mut plain = TcpStream::connect(addr).await.unwrap();
    plain.write_all(b"GET / HTTP/1.1\r\n\r\n").await.unwrap();
    let mut buf = Vec::new();
    let _ = plain.read_to_end(&mut buf).await;
    assert!(handshake_failures(&tls) > failures);
}

#[tokio::test]
async fn required_client_certificates_refuse_clients_without_one() {
    let dir = tempfile::tempdir().unwrap();
    let server_ca = ca("server CA");
    let client_ca = ca("client CA");
    let (cert, key) = leaf(&server_ca, "localhost");
    let tls = Tls::load(TlsFiles {
        cert_file: write(dir.path(), "cert.pem", &cert),
        key_file: write(dir.path(), "key.pem", &key),
        client_ca_file: Some(write(dir.path(), "clients.pem", &client_ca.pem)),
        client_certs: ClientCerts::Required,
    })
    .unwrap();
    let addr = echo_server(tls).await;
    assert!(
        connect(addr, client_config(&server_ca.pem, None))
            .await
            .is_err()
    );
    let (ccert, ckey) = leaf(&client_ca, "bob");
    let (_, cn) = connect(addr, client_config(&server_ca.pem, Some((&ccert, &ckey))))
        .await
        .unwrap();
    assert_eq!(cn, "bob");
}

#[tokio::test]
async fn a_reload_serves_new_connections_and_keeps_open_ones() {
    let dir = tempfile::tempdir().unwrap();
    let old_ca = ca("old CA");
    let new_ca = ca("new CA");
    let (cert, key) = leaf(&old_ca, "localhost");
    let cert_file = write(dir.path(), "cert.pem", &cert);
    let key_file = write(dir.path(), "key.pem", &key);
    let tls = Tls::load(TlsFiles {
        cert_file: cert_file.clone(),
        key_file: key_file.clone(),
        client_ca_file: None,
        client_certs: ClientCerts::None,
    })
    .unwrap();
    let addr = echo_server(tls.clone()).await;
    let (mut open, _) = connect(addr, client_config(&old_ca.pem, None))
        .await
        .unwrap();

    // A broken file is refused and the old certificate stays in force.
    std::fs::write(&cert_file, "not a certificate").unwrap();
    assert!(tls.reload().unwrap_err().contains("tls.cert_file"));
    connect(addr, client_config(&old_ca.pem, None))
        .await
        .unwrap();

    let (cert, key) = leaf(&new_ca, "localhost");
    std::fs::write(&cert_file, cert).unwrap();
    std::fs::write(&key_file, key).unwrap();
    tls.reload().unwrap();
    assert!(
        connect(addr, client_config(&old_ca.pem, None))
            .await
            .is_err()
    );
    connect(addr, client_config(&new_ca.pem, None))
        .await
        .unwrap();
    // The connection made before the reload still works.
    round_trip(&mut open).await.unwrap();
}

#[test]
fn missing_and_mismatched_files_are_named() {
    let dir = tempfile::tempdir().unwrap();
    let a = ca("a");
    let (cert, _) = leaf(&a, "localhost");
    let (_, other_key) = leaf(&a, "localhost");
    let err = Tls::load(TlsFiles {
        cert_file: dir.path().join("missing.pem"),
        key_file: dir.path().join("key.pem"),
        client_ca_file: None,
        client_certs: ClientCerts::None,
    })
    .unwrap_err();
    assert!(err.contains("tls.cert_file"), "{err}");
    let err = Tls::load(TlsFiles {
        cert_file: write(dir.path(), "cert.pem", &cert),
        key_file: write(dir.path(), "key.pem", &other_key),
        client_ca_file: None,
        client_certs: ClientCerts::None,
    })
    .unwrap_err();
    assert!(err.contains("do not make a certificate"), "{err}");
}

/// The exported count of failed handshakes, read as a scrape of `/metrics` reads it.
fn handshake_failures(tls: &Tls) -> f64 {
    let mut registry = sluice_metrics::Registry::default();
    tls.register(&mut registry);
    let text = sluice_metrics::encode(&registry);
    sluice_metrics::sample(&text, "sluice_tls_handshake_failures_total").expect("exported")
}
