//! The TLS sections of the configuration: `[tls]` (the front listener), `[admin_tls]` (the
//! admin listener, optionally requiring client certificates) and `engine_ca_file` (the CA
//! bundle trusted for `https://` engine URLs).
//!
//! Owns: [`ListenerTls`], the file paths a listener's TLS reads, and their validation as plain
//! data (each error names its field).
//! Invariants: plain data; reading and parsing the PEM files is `gateway::tls`'s (the front
//! door's), at start and at every reload.
//! Must not: read files or start anything.

use serde::{Deserialize, Serialize};
use std::path::PathBuf;

/// TLS on one listener: its certificate chain and private key (PEM files), and optionally a
/// CA bundle that clients must present a certificate signed by (mutual TLS).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListenerTls {
    /// PEM file: the server's certificate first, then its intermediates.
    pub cert_file: PathBuf,
    /// PEM file: the certificate's private key (PKCS#8, PKCS#1 or SEC1).
    pub key_file: PathBuf,
    /// PEM file of CA certificates: when set, a client must present a certificate signed by
    /// one of them, or the handshake fails.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub client_ca_file: Option<PathBuf>,
}

impl ListenerTls {
    /// Checks the paths are given; `section` names the TOML section in errors.
    pub fn validate(&self, section: &str) -> Result<(), String> {
        if self.cert_file.as_os_str().is_empty() {
            return Err(format!("{section}.cert_file is empty"));
        }
        if self.key_file.as_os_str().is_empty() {
            return Err(format!("{section}.key_file is empty"));
        }
        if self
            .client_ca_file
            .as_ref()
            .is_some_and(|p| p.as_os_str().is_empty())
        {
            return Err(format!("{section}.client_ca_file is empty"));
        }
        Ok(())
    }
}
