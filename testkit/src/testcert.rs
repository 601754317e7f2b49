//! Throwaway TLS material for the bench, the demo and tests: a fresh CA and one certificate
//! it signed, written as PEM files. Never for production (the CA key is discarded, and every
//! node shares one certificate).

use std::path::{Path, PathBuf};

use kvferry_tcp::TlsFiles;

/// Writes `ca.pem`, `node.pem` and `node.key` into `dir` (a new CA, and a certificate for
/// `server_name` it signed) and returns them as a node's TLS files.
pub fn throwaway(dir: &Path, server_name: &str) -> std::io::Result<TlsFiles> {
    let fail = |e: rcgen::Error| std::io::Error::other(e.to_string());
    let mut ca_params = rcgen::CertificateParams::new(Vec::<String>::new()).map_err(fail)?;
    ca_params.is_ca = rcgen::IsCa::Ca(rcgen::BasicConstraints::Unconstrained);
    let ca_key = rcgen::KeyPair::generate().map_err(fail)?;
    let ca = ca_params.self_signed(&ca_key).map_err(fail)?;
    let params = rcgen::CertificateParams::new(vec![server_name.to_owned()]).map_err(fail)?;
    let key = rcgen::KeyPair::generate().map_err(fail)?;
    let cert = params.signed_by(&key, &ca, &ca_key).map_err(fail)?;
    std::fs::create_dir_all(dir)?;
    let files = TlsFiles {
        cert: dir.join("node.pem"),
        key: dir.join("node.key"),
        ca: dir.join("ca.pem"),
        server_name: server_name.to_owned(),
    };
    std::fs::write(&files.ca, ca.pem())?;
    std::fs::write(&files.cert, cert.pem())?;
    std::fs::write(&files.key, key.serialize_pem())?;
    Ok(files)
}

/// A directory for throwaway TLS material under the system's temporary one, named after
/// `label` and this process, and removed when dropped (a bench or test that fails included).
pub struct CertDir(PathBuf);

impl CertDir {
    /// The directory `kvferry-{label}-{pid}` (created by [`throwaway`]).
    pub fn new(label: &str) -> CertDir {
        CertDir(std::env::temp_dir().join(format!("kvferry-{label}-{}", std::process::id())))
    }
}

impl std::ops::Deref for CertDir {
    type Target = Path;
    fn deref(&self) -> &Path {
        &self.0
    }
}

impl Drop for CertDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}
