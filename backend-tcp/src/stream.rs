//! The receiving side of a data connection and the connection hellos, written once against
//! `futures-io` streams for every runtime. The default scatter coalesces small slices through
//! one staging buffer and moves large slices straight into registered memory; a plain socket
//! scatters from its descriptor instead ([`crate::fd::ScatterConn`] overrides [`ScatterRead`]).

use crate::io_common::Checksum;
use std::io;

use futures_io::{AsyncRead, AsyncWrite};
use futures_lite::{AsyncReadExt, AsyncWriteExt};
use kvferry_core::{TransferId, WriteRefused};
use tracing::{debug, warn};

use crate::frame::{
    decode_ack, decode_slices, encode_ack, AckStatus, DataHello, FrameError, WriteHeader, ACK_LEN,
    CHECKSUM_LEN, DATA_CHALLENGE_LEN, DATA_HELLO_LEN, KIND_CONTROL, KIND_DATA, MAGIC,
    SLICE_DESC_LEN, WRITE_HEADER_LEN,
};
use crate::io_common::{
    admit, checksum_of, parse_preamble, Admission, Limits, Preamble, ServeError, ServeStats,
    PREAMBLE_LEN,
};
use crate::staged;
use kvferry_memory::{MemoryMap, WriteCheck};

/// Slices at least this long move straight between the socket and registered memory; shorter
/// ones are coalesced through the staging buffer (one receive for many of them).
pub const DIRECT_MIN: usize = 64 * 1024;
/// Most bytes staged per read of small slices.
const STAGE_MAX: usize = 256 * 1024;

/// Reads one acknowledgement.
pub async fn read_ack<R: AsyncRead + Unpin>(r: &mut R) -> io::Result<(TransferId, AckStatus)> {
    let mut buf = [0u8; ACK_LEN];
    r.read_exact(&mut buf).await?;
    decode_ack(&buf).map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e.to_string()))
}

/// Serves write batches on a data connection (decode): validates each header and table with
/// `check`, applies the payload into registered memory, then acknowledges. Refused writes are
/// read into a discard buffer (never into registered memory) and acknowledged as refused. A
/// malformed header ends the connection. Returns on end of stream.
pub async fn serve_writes_on<S, P>(
    stream: &mut S,
    memory: &MemoryMap,
    check: P,
    limits: Limits,
) -> Result<ServeStats, ServeError>
where
    S: ScatterRead,
    P: std::ops::Deref + Clone,
    P::Target: WriteCheck,
{
    let mut stats = ServeStats::default();
    let mut header = [0u8; WRITE_HEADER_LEN];
    let mut table = Vec::new();
    let mut stage = Vec::new();
    // This connection's own staging buffer, made at its first staged write.
    let mut lane = None;
    loop {
        match stream.read_exact(&mut header).await {
            Ok(()) => {}
            Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => return Ok(stats),
            Err(e) => return Err(e.into()),
        }
        let h = WriteHeader::decode(&header, limits.max_slices, limits.max_bytes)
            .map_err(ServeError::Frame)?;
        if limits.checksum && !h.checked {
            // The session agreed on checksums: an unchecked batch is not one of its writers'.
            return Err(ServeError::Frame(FrameError::Malformed(
                "a write without its checksum on a checksummed session",
            )));
        }
        table.resize(h.slices as usize * SLICE_DESC_LEN, 0);
        stream.read_exact(&mut table).await?;
        let slices =
            decode_slices(&table, h.payload, limits.max_slices).map_err(ServeError::Frame)?;
        let status = match admit(&check, memory, &h, &slices)? {
            Admission::Apply { landing, targets } => {
                let device = memory.staging().is_some() && staged::on_device(memory, &slices);
                // The XXH3-64 of the bytes that landed (checked batches).
                let mut landed = None;
                match memory.staging() {
                    Some(staging) if device => {
                        let pieces = staged::pieces(memory, &slices, &targets);
                        let own = staged::lane_of(&mut lane, staging)?;
                        // A checked batch hashes the bytes as they arrive in the staging
                        // buffers, before the engine copies them into place.
                        let mut hasher = h.checked.then(Checksum::new);
                        staged::read_staged(stream, &pieces, &own, staging, hasher.as_mut())
                            .await?;
                        landed = hasher.map(|h| h.digest());
                    }
                    _ if h.checked => {
                        landed = Some(stream.read_into_checked(&targets, &mut stage).await?)
                    }
                    _ => stream.read_into(&targets, &mut stage).await?,
                }
                if h.checked && Some(read_checksum(stream).await?) != landed {
                    landing.corrupt();
                    stats.corrupt += 1;
                    warn!(room = %h.room, op = %h.op, "write checksum mismatch");
                    AckStatus::Corrupt
                } else {
                    landing.applied();
                    stats.applied += 1;
                    stats.bytes += h.payload;
                    AckStatus::Applied
                }
            }
            Admission::Refuse(refused) => {
                let trailer = if h.checked { CHECKSUM_LEN as u64 } else { 0 };
                discard(stream, h.payload + trailer, &mut stage).await?;
                stats.refused += 1;
                debug!(room = %h.room, op = %h.op, ?refused, "write refused");
                if refused == Some(WriteRefused::AlreadyLanded) {
                    // A retry of bytes that landed before the room succeeded: they are here.
                    AckStatus::Applied
                } else {
                    AckStatus::Refused
                }
            }
        };
        stream.write_all(&encode_ack(h.op, status)).await?;
        stream.flush().await?;
    }
}

/// How a receiving connection reads a write's payload into its destination ranges. The
/// default reads through the stream (large ranges straight, runs of small ones through a
/// staging buffer); a transport that can scatter straight from its socket overrides it.
pub trait ScatterRead: AsyncRead + AsyncWrite + Unpin + Sized {
    /// Reads exactly the bytes of `targets` (address, length) into them.
    fn read_into<'a>(
        &'a mut self,
        targets: &'a [(usize, usize)],
        stage: &'a mut Vec<u8>,
    ) -> impl std::future::Future<Output = io::Result<()>> + 'a {
        read_scatter(self, targets, stage)
    }

    /// As [`ScatterRead::read_into`], returning the XXH3-64 of the bytes read (a checked
    /// batch's checksum, to compare with its trailer). A transport that can hash each piece
    /// as it lands (while it is in the cache) overrides this.
    fn read_into_checked<'a>(
        &'a mut self,
        targets: &'a [(usize, usize)],
        stage: &'a mut Vec<u8>,
    ) -> impl std::future::Future<Output = io::Result<u64>> + 'a {
        async move {
            self.read_into(targets, stage).await?;
            // SAFETY: `targets` are the host ranges this write just filled; the permit holds
            // their room's pages, so nobody else writes them meanwhile.
            Ok(unsafe { checksum_of(targets) })
        }
    }
}

impl<R: AsyncRead + AsyncWrite + Unpin> ScatterRead for futures_lite::io::BufReader<R> {}

/// Reads exactly the bytes of `targets` into them: large ones straight, runs of small ones
/// through `stage`.
pub async fn read_scatter<R: AsyncRead + Unpin>(
    r: &mut R,
    targets: &[(usize, usize)],
    stage: &mut Vec<u8>,
) -> io::Result<()> {
    let mut i = 0;
    while i < targets.len() {
        let (ptr, len) = targets[i];
        if len >= DIRECT_MIN {
            // SAFETY: inside one range from MemoryMap::range (registered memory the caller
            // keeps alive); the core accepted this write for the room's pages and holds them
            // (the permit) until it ends, so nobody else touches them meanwhile.
            let dst = unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, len) };
            r.read_exact(dst).await?;
            i += 1;
            continue;
        }
        // A run of small slices, at most STAGE_MAX bytes (at least one slice).
        let mut end = i;
        let mut total = 0;
        while end < targets.len() && targets[end].1 < DIRECT_MIN {
            if total > 0 && total + targets[end].1 > STAGE_MAX {
                break;
            }
            total += targets[end].1;
            end += 1;
        }
        stage.resize(total, 0);
        r.read_exact(&mut stage[..total]).await?;
        let mut at = 0;
        for &(ptr, len) in &targets[i..end] {
            // SAFETY: as above.
            let dst = unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, len) };
            dst.copy_from_slice(&stage[at..at + len]);
            at += len;
        }
        i = end;
    }
    Ok(())
}

/// Reads a checked batch's trailer: the sender's XXH3-64 of the payload.
async fn read_checksum<R: AsyncRead + Unpin>(r: &mut R) -> io::Result<u64> {
    let mut b = [0u8; CHECKSUM_LEN];
    r.read_exact(&mut b).await?;
    Ok(u64::from_le_bytes(b))
}

async fn discard<R: AsyncRead + Unpin>(
    r: &mut R,
    mut n: u64,
    sink: &mut Vec<u8>,
) -> io::Result<()> {
    sink.resize(64 * 1024, 0);
    while n > 0 {
        let k = (n as usize).min(sink.len());
        r.read_exact(&mut sink[..k]).await?;
        n -= k as u64;
    }
    Ok(())
}

/// Introduces a freshly opened data connection: reads the listener's challenge, answers it
/// for the session of `key`, and waits for the verdict.
pub async fn hello_data<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    key: &kvferry_core::SessionKey,
) -> io::Result<()> {
    stream.write_all(&MAGIC).await?;
    stream.write_all(&[KIND_DATA]).await?;
    stream.flush().await?;
    let mut challenge = [0u8; DATA_CHALLENGE_LEN];
    stream.read_exact(&mut challenge).await?;
    stream
        .write_all(&DataHello::answer(key, &challenge).encode())
        .await?;
    stream.flush().await?;
    let mut answer = [0u8; 1];
    stream.read_exact(&mut answer).await?;
    if answer[0] != 0 {
        return Err(io::Error::new(
            io::ErrorKind::PermissionDenied,
            "data connection refused by the peer",
        ));
    }
    Ok(())
}

/// Listener side of a data connection, after its preamble: sends `challenge` and reads the
/// hello that answers it (the caller checks it, then [`answer_data_on`]).
pub async fn challenge_data_on<S: AsyncRead + AsyncWrite + Unpin>(
    stream: &mut S,
    challenge: &kvferry_core::auth::Nonce,
) -> io::Result<DataHello> {
    stream.write_all(challenge).await?;
    stream.flush().await?;
    let mut hello = [0u8; DATA_HELLO_LEN];
    stream.read_exact(&mut hello).await?;
    Ok(DataHello::decode(&hello))
}

/// Introduces a freshly opened control connection.
pub async fn hello_control<S: AsyncWrite + Unpin>(stream: &mut S) -> io::Result<()> {
    stream.write_all(&MAGIC).await?;
    stream.write_all(&[KIND_CONTROL]).await?;
    stream.flush().await
}

/// Reads the preamble of an accepted connection (bounded, total).
pub async fn read_preamble_on<S: AsyncRead + Unpin>(
    stream: &mut S,
) -> Result<Preamble, ServeError> {
    let mut head = [0u8; PREAMBLE_LEN];
    stream.read_exact(&mut head).await?;
    parse_preamble(&head)
}

/// Accepts (0) or refuses (1) a data connection after its preamble.
pub async fn answer_data_on<S: AsyncWrite + Unpin>(stream: &mut S, accept: bool) -> io::Result<()> {
    stream.write_all(&[u8::from(!accept)]).await?;
    stream.flush().await
}
