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

/// Why TLS could not be set up.
#[derive(Debug)]
pub enum TlsError {
    /// A PEM file could not be read or holds nothing usable.
    File {
        /// The file.
        path: PathBuf,
        /// What was wrong.
        what: String,
    },
    /// `server_name` is neither a DNS name nor an IP address.
    ServerName(String),
    /// rustls refused the material (a key that does not match, an invalid CA, ...).
    Config(String),
}

impl std::fmt::Display for TlsError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TlsError::File { path, what } => write!(f, "TLS file {}: {what}", path.display()),
            TlsError::ServerName(n) => {
                write!(f, "TLS server name {n:?} is not a DNS name or IP address")
            }
            TlsError::Config(e) => write!(f, "TLS configuration refused: {e}"),
        }
    }
}

impl std::error::Error for TlsError {}
