//! Authentication without revealing the secret: each side of a session proves it knows the
//! cluster token with HMAC-SHA256 over fresh nonces from both sides and both hellos, and the
//! session's key (derived from the token and both nonces) binds its data connections. The
//! token itself never goes on the wire. `docs/PROTOCOL.md` ("Authentication") gives every
//! input byte by byte.

use hmac::{Hmac, Mac};
use sha2::Sha256;

/// Length of a challenge nonce.
pub const NONCE_LEN: usize = 32;
/// Length of a proof (an HMAC-SHA256 output).
pub const PROOF_LEN: usize = 32;
/// Length of the tag that names a session on its data connections.
pub const TAG_LEN: usize = 16;

/// A challenge: 32 bytes the other side must fold into its proof.
pub type Nonce = [u8; NONCE_LEN];
/// A proof of the cluster token (or of a session key).
pub type Proof = [u8; PROOF_LEN];
/// Names a session on a data connection without revealing its key.
pub type SessionTag = [u8; TAG_LEN];

const LABEL_NONCE_KEY: &[u8] = b"kvferry/2 nonce key";
const LABEL_CONNECTOR: &[u8] = b"kvferry/2 connector";
const LABEL_LISTENER: &[u8] = b"kvferry/2 listener";
const LABEL_SESSION_KEY: &[u8] = b"kvferry/2 session key";
const LABEL_SESSION_TAG: &[u8] = b"kvferry/2 session tag";
const LABEL_DATA: &[u8] = b"kvferry/2 data";

/// HMAC-SHA256 of the concatenation of `parts` under `key`.
fn mac(key: &[u8], parts: &[&[u8]]) -> [u8; 32] {
    // HMAC accepts keys of any length: this cannot fail.
    #[allow(clippy::expect_used)]
    let mut m = <Hmac<Sha256> as Mac>::new_from_slice(key).expect("HMAC takes any key length");
    for p in parts {
        m.update(p);
    }
    m.finalize().into_bytes().into()
}

/// Compares two byte strings in time independent of where they differ.
pub(crate) fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

/// Where this endpoint's nonces come from: a keyed counter, unpredictable to anyone who does
/// not know the cluster token and the endpoint's seed, and never repeated within one life of
/// the endpoint (the node id and incarnation are in the key).
#[derive(Clone)]
pub(crate) struct Nonces {
    key: [u8; 32],
    next: u64,
}

impl core::fmt::Debug for Nonces {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.write_str("Nonces { .. }")
    }
}

impl Nonces {
    pub(crate) fn new(token: &[u8], seed: u64, node: u64, incarnation: u64) -> Self {
        let mut who = [0u8; 24];
        who[..8].copy_from_slice(&seed.to_le_bytes());
        who[8..16].copy_from_slice(&node.to_le_bytes());
        who[16..].copy_from_slice(&incarnation.to_le_bytes());
        Nonces {
            key: mac(token, &[LABEL_NONCE_KEY, &who]),
            next: 0,
        }
    }

    pub(crate) fn fresh(&mut self) -> Nonce {
        self.next += 1;
        mac(&self.key, &[&self.next.to_le_bytes()])
    }
}

/// The connector's proof: its hello frame as sent, with the proof bytes zero.
pub(crate) fn connector_proof(
    token: &[u8],
    connector: &Nonce,
    listener: &Nonce,
    connector_hello: &[u8],
) -> Proof {
    mac(
        token,
        &[LABEL_CONNECTOR, connector, listener, connector_hello],
    )
}

/// The listener's proof: both hello frames (the connector's as received, its own with the
/// proof bytes zero), so it also vouches for what it was told.
pub(crate) fn listener_proof(
    token: &[u8],
    connector: &Nonce,
    listener: &Nonce,
    connector_hello: &[u8],
    listener_hello: &[u8],
) -> Proof {
    mac(
        token,
        &[
            LABEL_LISTENER,
            connector,
            listener,
            connector_hello,
            listener_hello,
        ],
    )
}

/// What binds data connections to one authenticated session: a tag that names the session
/// and a key only its two ends know. Neither reveals the cluster token.
#[derive(Clone, PartialEq, Eq)]
pub struct SessionKey {
    key: [u8; 32],
    tag: SessionTag,
}

impl core::fmt::Debug for SessionKey {
    fn fmt(&self, f: &mut core::fmt::Formatter<'_>) -> core::fmt::Result {
        f.debug_struct("SessionKey")
            .field("tag", &self.tag)
            .finish_non_exhaustive()
    }
}

impl SessionKey {
    pub(crate) fn derive(token: &[u8], connector: &Nonce, listener: &Nonce) -> Self {
        let key = mac(token, &[LABEL_SESSION_KEY, connector, listener]);
        let full = mac(&key, &[LABEL_SESSION_TAG]);
        let mut tag = [0u8; TAG_LEN];
        tag.copy_from_slice(&full[..TAG_LEN]);
        SessionKey { key, tag }
    }

    /// The tag a data connection names its session by.
    pub fn tag(&self) -> SessionTag {
        self.tag
    }

    /// The answer to a data listener's `challenge`: proves this connection belongs to the
    /// session without revealing its key.
    pub fn prove(&self, challenge: &Nonce) -> Proof {
        mac(&self.key, &[LABEL_DATA, challenge])
    }

    /// Whether `proof` answers `challenge` for this session (constant time).
    pub fn verify(&self, challenge: &Nonce, proof: &Proof) -> bool {
        constant_time_eq(&self.prove(challenge), proof)
    }
}

/// The CLI's default cluster token: everyone knows it, so it protects nothing beyond loopback.
pub const DEMO_TOKEN: &[u8] = b"kvferry-demo";

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_proof_depends_on_the_token_both_nonces_and_the_hello() {
        let (c, l) = ([1u8; 32], [2u8; 32]);
        let p = connector_proof(b"t", &c, &l, b"hello");
        assert_ne!(p, connector_proof(b"u", &c, &l, b"hello"));
        assert_ne!(p, connector_proof(b"t", &[3; 32], &l, b"hello"));
        assert_ne!(p, connector_proof(b"t", &c, &[3; 32], b"hello"));
        assert_ne!(p, connector_proof(b"t", &c, &l, b"hellp"));
        assert_ne!(p, listener_proof(b"t", &c, &l, b"hello", b""));
    }

    #[test]
    fn nonces_never_repeat_and_differ_between_lives() {
        let mut a = Nonces::new(b"t", 1, 7, 100);
        let mut b = Nonces::new(b"t", 1, 7, 101);
        let first = a.fresh();
        assert_ne!(first, a.fresh());
        assert_ne!(first, b.fresh());
    }

    #[test]
    fn a_session_key_proves_data_connections_and_names_its_session() {
        let k = SessionKey::derive(b"t", &[1; 32], &[2; 32]);
        let other = SessionKey::derive(b"t", &[1; 32], &[3; 32]);
        assert_ne!(k.tag(), other.tag());
        let proof = k.prove(&[9; 32]);
        assert!(k.verify(&[9; 32], &proof));
        assert!(
            !k.verify(&[8; 32], &proof),
            "a replay answers another challenge"
        );
        assert!(!other.verify(&[9; 32], &proof));
    }
}
