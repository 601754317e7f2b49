//! What a node's TLS configuration names (always compiled: drivers without the tokio data
//! plane still carry it in their configuration).

use std::path::PathBuf;

/// Where a node's TLS material lives (PEM files).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TlsFiles {
    /// This node's certificate chain, leaf first.
    pub cert: PathBuf,
    /// Its private key (PKCS#8, PKCS#1 or SEC1).
    pub key: PathBuf,
    /// The CA certificates a peer's certificate must chain to.
    pub ca: PathBuf,
    /// The name a listener's certificate must carry (a DNS name or an IP address).
    pub server_name: String,
}
