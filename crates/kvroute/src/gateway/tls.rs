//! TLS for the two listeners and towards the engines: the PEM files of the configuration read
//! into rustls settings, and the settings a listener's next handshake uses.
//!
//! Owns: [`Listeners`] (one [`Slot`] per listener configured with TLS, each holding the
//! rustls `ServerConfig` the next accepted connection is handed: certificate chain, key and,
//! when `client_ca_file` is set, the verifier requiring a client certificate signed by that
//! bundle), re-reading the files on a reload ([`Listeners::prepare`], then
//! [`Prepared::commit`]), the CA bundle added to the engines' HTTP client
//! ([`engine_roots`]), and the client this replica posts to its peers with, presenting its
//! `[peers.tls]` certificate ([`peer_client`]).
//! Invariants: a slot's settings are swapped whole, after every file of the new settings has
//! been read and parsed: a reload that fails to read any of them changes no listener;
//! connections already open keep the settings they were accepted with; only the ring
//! provider is used (the one reqwest's rustls uses too). Every error names its configuration
//! field.
//! Must not: look at HTTP, or panic on anything a file or a client sends.

use super::config::file::GatewayConfig;
use super::config::tls::ListenerTls;
use parking_lot::RwLock;
use rustls::server::WebPkiClientVerifier;
use rustls::{RootCertStore, ServerConfig};
use rustls_pki_types::pem::PemObject;
use rustls_pki_types::{CertificateDer, PrivateKeyDer};
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;
use tokio_rustls::TlsAcceptor;

/// The ring provider, as reqwest 0.12's rustls uses it (one provider in the binary, and no
/// aws-lc-rs C build). rustls 0.23.48 deprecates it for lacking post-quantum key exchange;
/// moving both to aws-lc-rs is the follow-up.
#[allow(deprecated)]
fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// The certificates of a PEM file; `field` names it in errors.
fn read_certs(path: &Path, field: &str) -> Result<Vec<CertificateDer<'static>>, String> {
    let shown = path.display();
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| format!("{field}: {shown}: {e}"))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| format!("{field}: {shown}: {e}"))?;
    if certs.is_empty() {
        return Err(format!("{field}: {shown}: no PEM certificate in the file"));
    }
    Ok(certs)
}

/// The listener's rustls settings from its files; `section` (`tls`, `admin_tls`) prefixes the
/// field named in errors.
pub fn server_config(t: &ListenerTls, section: &str) -> Result<ServerConfig, String> {
    let certs = read_certs(&t.cert_file, &format!("{section}.cert_file"))?;
    let key = PrivateKeyDer::from_pem_file(&t.key_file)
        .map_err(|e| format!("{section}.key_file: {}: {e}", t.key_file.display()))?;
    let builder = ServerConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .map_err(|e| format!("{section}: {e}"))?;
    let builder = match &t.client_ca_file {
        None => builder.with_no_client_auth(),
        Some(ca) => {
            let field = format!("{section}.client_ca_file");
            let mut roots = RootCertStore::empty();
            for c in read_certs(ca, &field)? {
                roots
                    .add(c)
                    .map_err(|e| format!("{field}: {}: {e}", ca.display()))?;
            }
            let verifier = WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider())
                .build()
                .map_err(|e| format!("{field}: {}: {e}", ca.display()))?;
            builder.with_client_cert_verifier(verifier)
        }
    };
    let mut config = builder.with_single_cert(certs, key).map_err(|e| {
        format!(
            "{section}.key_file: {} does not fit {section}.cert_file: {e}",
            t.key_file.display()
        )
    })?;
    // The listeners speak HTTP/1.1 only.
    config.alpn_protocols = vec![b"http/1.1".to_vec()];
    Ok(config)
}

/// One listener's current TLS settings.
pub struct Slot {
    current: RwLock<Arc<ServerConfig>>,
}

impl Slot {
    fn new(config: ServerConfig) -> Slot {
        Slot {
            current: RwLock::new(Arc::new(config)),
        }
    }

    /// The acceptor for the next connection (the settings as they are now).
    pub fn acceptor(&self) -> TlsAcceptor {
        TlsAcceptor::from(self.current.read().clone())
    }
}

/// The listeners' TLS, as started (a listener without TLS at start has none until a restart).
#[derive(Default)]
pub struct Listeners {
    pub front: Option<Arc<Slot>>,
    pub admin: Option<Arc<Slot>>,
}

/// New settings read by [`Listeners::prepare`], not yet in use.
pub struct Prepared {
    swaps: Vec<(Arc<Slot>, ServerConfig, &'static str)>,
}

impl Prepared {
    /// Hands the new settings to the listeners; returns the listeners changed.
    pub fn commit(self) -> Vec<&'static str> {
        self.swaps
            .into_iter()
            .map(|(slot, config, name)| {
                *slot.current.write() = Arc::new(config);
                name
            })
            .collect()
    }
}

impl Listeners {
    /// Reads the files of `config`'s `tls` and `admin_tls`.
    pub fn load(config: &GatewayConfig) -> Result<Listeners, String> {
        let slot = |t: &Option<ListenerTls>, section| {
            t.as_ref()
                .map(|t| server_config(t, section).map(|c| Arc::new(Slot::new(c))))
                .transpose()
        };
        Ok(Listeners {
            front: slot(&config.tls, "tls")?,
            admin: slot(&config.admin_tls, "admin_tls")?,
        })
    }

    /// Reads the files `new` names for the listeners that run TLS (the certificate and key
    /// may have been replaced on disk, or the paths changed), without using them yet.
    pub fn prepare(&self, new: &GatewayConfig) -> Result<Prepared, String> {
        let mut swaps = Vec::new();
        for (slot, t, section) in [
            (&self.front, &new.tls, "tls"),
            (&self.admin, &new.admin_tls, "admin_tls"),
        ] {
            if let (Some(slot), Some(t)) = (slot, t) {
                swaps.push((slot.clone(), server_config(t, section)?, section));
            }
        }
        Ok(Prepared { swaps })
    }
}

/// The CA bundle `engine_ca_file` names, as certificates for the engines' HTTP client.
pub fn engine_roots(path: &Path) -> Result<Vec<reqwest::Certificate>, String> {
    pem_roots("engine_ca_file", path)
}

/// The certificates of the PEM bundle at `path`, to trust as roots; errors name `field`.
pub fn pem_roots(field: &str, path: &Path) -> Result<Vec<reqwest::Certificate>, String> {
    let shown = path.display();
    let pem = std::fs::read(path).map_err(|e| format!("{field}: {shown}: {e}"))?;
    let certs = reqwest::Certificate::from_pem_bundle(&pem)
        .map_err(|e| format!("{field}: {shown}: {e}"))?;
    if certs.is_empty() {
        return Err(format!("{field}: {shown}: no PEM certificate in the file"));
    }
    Ok(certs)
}

/// The client this replica posts to its peers with: the engines' own (`engines`), or, with
/// `[peers.tls]`, one that presents that client certificate and trusts `peers.tls.ca_file`,
/// `engine_ca_file` and the system's roots. Errors name the field.
pub fn peer_client(
    config: &GatewayConfig,
    engines: &reqwest::Client,
) -> Result<reqwest::Client, String> {
    let Some(t) = &config.peers.tls else {
        return Ok(engines.clone());
    };
    let read = |field: &str, path: &Path| {
        std::fs::read(path).map_err(|e| format!("peers.tls.{field}: {}: {e}", path.display()))
    };
    let mut pem = read("client_key_file", &t.client_key_file)?;
    pem.push(b'\n');
    pem.extend(read("client_cert_file", &t.client_cert_file)?);
    let identity = reqwest::Identity::from_pem(&pem)
        .map_err(|e| format!("peers.tls: the client certificate and key: {e}"))?;
    let mut client = reqwest::Client::builder()
        .use_rustls_tls()
        .identity(identity)
        .timeout(Duration::from_secs_f64(
            config.request_timeout_secs.max(0.1),
        ))
        .connect_timeout(Duration::from_secs(3));
    let roots = [
        ("peers.tls.ca_file", t.ca_file.as_deref()),
        ("engine_ca_file", config.engine_ca_file.as_deref()),
    ];
    for (field, path) in roots {
        if let Some(path) = path {
            for cert in pem_roots(field, path)? {
                client = client.add_root_certificate(cert);
            }
        }
    }
    client.build().map_err(|e| format!("peers.tls: {e}"))
}
