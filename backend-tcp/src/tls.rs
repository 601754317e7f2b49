//! TLS on control and data connections (optional): confidentiality for the KV cache, which
//! holds users' prompts. Both ends present a certificate signed by the cluster's CA and
//! verify the other's (mutual TLS), so a relay in the middle cannot read what it forwards.
//! The cluster-token proofs of the handshake run inside TLS, unchanged.

use std::io;
use std::path::Path;

use crate::tls_files::TlsError;
pub use crate::tls_files::TlsFiles;
#[cfg(feature = "tokio")]
use std::pin::Pin;
use std::sync::Arc;
#[cfg(feature = "tokio")]
use std::task::{Context, Poll};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};
#[cfg(feature = "tokio")]
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
#[cfg(feature = "tokio")]
use tokio::net::TcpStream;
#[cfg(feature = "tokio")]
use tokio_rustls::{TlsAcceptor, TlsConnector};

/// A node's TLS client and server configuration, loaded once (for either runtime).
#[derive(Clone)]
pub struct TlsSetup {
    client: Arc<rustls::ClientConfig>,
    server: Arc<rustls::ServerConfig>,
    server_name: ServerName<'static>,
}

impl std::fmt::Debug for TlsSetup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TlsSetup")
            .field("server_name", &self.server_name)
            .finish_non_exhaustive()
    }
}

fn certs(path: &Path) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let bad = |what: String| TlsError::File {
        path: path.to_owned(),
        what,
    };
    let certs = CertificateDer::pem_file_iter(path)
        .map_err(|e| bad(e.to_string()))?
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| bad(e.to_string()))?;
    if certs.is_empty() {
        return Err(bad("no certificate in it".into()));
    }
    Ok(certs)
}

impl TlsSetup {
    /// Loads the PEM files and builds both configurations (ring provider, TLS 1.2 and 1.3).
    pub fn load(files: &TlsFiles) -> Result<Self, TlsError> {
        let chain = certs(&files.cert)?;
        let key = PrivateKeyDer::from_pem_file(&files.key).map_err(|e| TlsError::File {
            path: files.key.clone(),
            what: e.to_string(),
        })?;
        let mut roots = rustls::RootCertStore::empty();
        for ca in certs(&files.ca)? {
            roots.add(ca).map_err(|e| TlsError::Config(e.to_string()))?;
        }
        let roots = Arc::new(roots);
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let config = |e: rustls::Error| TlsError::Config(e.to_string());
        let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
            roots.clone(),
            provider.clone(),
        )
        .build()
        .map_err(|e| TlsError::Config(e.to_string()))?;
        let server = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .map_err(config)?
            .with_client_cert_verifier(verifier)
            .with_single_cert(chain.clone(), key.clone_key())
            .map_err(config)?;
        let client = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .map_err(config)?
            .with_root_certificates(roots)
            .with_client_auth_cert(chain, key)
            .map_err(config)?;
        let server_name = ServerName::try_from(files.server_name.clone())
            .map_err(|_| TlsError::ServerName(files.server_name.clone()))?;
        Ok(TlsSetup {
            client: Arc::new(client),
            server: Arc::new(server),
            server_name,
        })
    }

    /// Runs the client side of the TLS handshake on a connection this node opened.
    #[cfg(feature = "tokio")]
    pub async fn connect(&self, tcp: TcpStream) -> io::Result<Conn> {
        let tls = TlsConnector::from(self.client.clone())
            .connect(self.server_name.clone(), tcp)
            .await?;
        Ok(Conn::Tls(Box::new(tokio_rustls::TlsStream::Client(tls))))
    }

    /// Runs the server side of the TLS handshake on a connection this node accepted.
    #[cfg(feature = "tokio")]
    pub async fn accept(&self, tcp: TcpStream) -> io::Result<Conn> {
        let tls = TlsAcceptor::from(self.server.clone()).accept(tcp).await?;
        Ok(Conn::Tls(Box::new(tokio_rustls::TlsStream::Server(tls))))
    }

    /// The client side of the TLS handshake over a `futures-io` stream (glommio's sockets).
    #[cfg(feature = "glommio")]
    pub async fn connect_on<S>(&self, stream: S) -> io::Result<futures_rustls::TlsStream<S>>
    where
        S: futures_io::AsyncRead + futures_io::AsyncWrite + Unpin,
    {
        let tls = futures_rustls::TlsConnector::from(self.client.clone())
            .connect(self.server_name.clone(), stream)
            .await?;
        Ok(futures_rustls::TlsStream::Client(tls))
    }

    /// The server side of the TLS handshake over a `futures-io` stream (glommio's sockets).
    #[cfg(feature = "glommio")]
    pub async fn accept_on<S>(&self, stream: S) -> io::Result<futures_rustls::TlsStream<S>>
    where
        S: futures_io::AsyncRead + futures_io::AsyncWrite + Unpin,
    {
        let tls = futures_rustls::TlsAcceptor::from(self.server.clone())
            .accept(stream)
            .await?;
        Ok(futures_rustls::TlsStream::Server(tls))
    }
}

/// A control or data connection: plain TCP, or TLS over TCP.
#[cfg(feature = "tokio")]
#[derive(Debug)]
pub enum Conn {
    /// Plain TCP: the data plane reads and writes registered memory with vectored syscalls.
    Plain(TcpStream),
    /// TLS: bytes are encrypted and decrypted through rustls's buffers.
    Tls(Box<tokio_rustls::TlsStream<TcpStream>>),
}

#[cfg(feature = "tokio")]
impl From<TcpStream> for Conn {
    fn from(s: TcpStream) -> Self {
        Conn::Plain(s)
    }
}

#[cfg(feature = "tokio")]
impl Conn {
    /// The TCP socket underneath.
    pub fn tcp(&self) -> &TcpStream {
        match self {
            Conn::Plain(s) => s,
            Conn::Tls(t) => t.get_ref().0,
        }
    }
}

#[cfg(feature = "tokio")]
impl AsyncRead for Conn {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_read(cx, buf),
            Conn::Tls(t) => Pin::new(t.as_mut()).poll_read(cx, buf),
        }
    }
}

#[cfg(feature = "tokio")]
impl AsyncWrite for Conn {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_write(cx, buf),
            Conn::Tls(t) => Pin::new(t.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_flush(cx),
            Conn::Tls(t) => Pin::new(t.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match self.get_mut() {
            Conn::Plain(s) => Pin::new(s).poll_shutdown(cx),
            Conn::Tls(t) => Pin::new(t.as_mut()).poll_shutdown(cx),
        }
    }
}
