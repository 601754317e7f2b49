//! What every runtime does with a connection its listener accepted, written once: read the
//! preamble, and for a data connection run the core's challenge and ask the core which
//! session the answer proves. The caller bounds all of it by the core's deadline for the
//! connection ([`crate::runtime::take_accepted`]).

use std::net::SocketAddr;

use futures_io::{AsyncRead, AsyncWrite};
use kvferry_core::SessionId;
use kvferry_tcp::stream::{answer_data_on, challenge_data_on, read_preamble_on};
use kvferry_tcp::Preamble;
use tracing::{debug, warn};

use crate::EndpointAccess;

/// What an accepted connection turned out to be.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Accepted {
    /// A control connection: its handshake runs on it next.
    Control,
    /// A data connection the core admitted to this session (the peer was told so).
    Data(SessionId),
}

/// Reads an accepted connection's preamble and, for a data connection, its hello; `None`
/// when the connection is to be dropped (garbage, refused, closed, node gone).
pub async fn accept<S, A>(stream: &mut S, access: &A, peer: Option<SocketAddr>) -> Option<Accepted>
where
    S: AsyncRead + AsyncWrite + Unpin,
    A: EndpointAccess,
{
    match read_preamble_on(stream).await {
        Err(e) => {
            warn!(?peer, error = %e, "refused a connection");
            None
        }
        Ok(Preamble::Control) => Some(Accepted::Control),
        Ok(Preamble::Data) => {
            // The core's challenge; the answer names the session and proves its key.
            let challenge = access.run(|e, _| e.data_challenge(), |_| false)?;
            let hello = match challenge_data_on(stream, &challenge).await {
                Ok(hello) => hello,
                Err(e) => {
                    debug!(?peer, error = %e, "data connection ended before its hello");
                    return None;
                }
            };
            let admitted = access.run(
                |e, _| e.admit_data(&challenge, &hello.tag, &hello.proof),
                |_| false,
            )?;
            match admitted {
                Ok(sid) => {
                    let told = answer_data_on(stream, true).await;
                    told.is_ok().then_some(Accepted::Data(sid))
                }
                Err(refusal) => {
                    warn!(?peer, %refusal, "data connection refused");
                    let _ = answer_data_on(stream, false).await;
                    None
                }
            }
        }
    }
}
