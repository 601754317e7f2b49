//! The fast paths of a plain TCP data connection, for every runtime: an operation is
//! gathered from registered memory with `sendmsg` and a payload scattered into destination
//! pages with `recvmsg`, straight on the socket's descriptor while it has room or data. When
//! it has none, the runtime's own `write`/`read` of the next piece waits for it, so any
//! `futures-io` stream that exposes its descriptor gets them (tokio through [`crate::TokioIo`],
//! glommio's io_uring sockets as they are).

use crate::io_common::Checksum;
use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, IntoRawFd};
use std::pin::Pin;
use std::task::{Context, Poll};

use futures_io::{AsyncRead, AsyncWrite};
use futures_lite::io::{AsyncBufReadExt, BufReader};
use futures_lite::{AsyncReadExt, AsyncWriteExt};
use rustix::net::{
    recvmsg, sendmsg, RecvAncillaryBuffer, RecvFlags, SendAncillaryBuffer, SendFlags,
};

use crate::frame::CHECKSUM_LEN;
use crate::io_common::{gather_iovecs, hash_span, scatter_iovecs};
use crate::send::GatherWrite;
use crate::stream::ScatterRead;

/// Most bytes the runtime's own read or write moves when the socket has no data or room.
const PIECE: usize = 64 * 1024;

/// A plain TCP writing half that gathers each operation with non-blocking `sendmsg` calls.
#[derive(Debug)]
pub struct GatherConn<S>(pub S);

impl<S: AsyncWrite + AsRawFd + Unpin> GatherConn<S> {
    /// Writes what is left of `header` and `sources` after their first `done` bytes, and
    /// returns their length. With `hasher`, feeds it each piece of the sources right after
    /// the socket took it (the bytes are still in the cache).
    async fn gather(
        &mut self,
        header: &[u8],
        sources: &[(usize, usize)],
        mut done: usize,
        mut hasher: Option<&mut Checksum>,
    ) -> io::Result<usize> {
        let total = header.len() + sources.iter().map(|s| s.1).sum::<usize>();
        while done < total {
            let iov = gather_iovecs(header, sources, done);
            let sent = {
                // SAFETY: the descriptor stays open for as long as `self.0`, which outlives
                // the call.
                let fd = unsafe { BorrowedFd::borrow_raw(self.0.as_raw_fd()) };
                sendmsg(
                    fd,
                    &iov,
                    &mut SendAncillaryBuffer::default(),
                    SendFlags::DONTWAIT | SendFlags::NOSIGNAL,
                )
            };
            let n = match sent {
                Ok(0) => return Err(io::ErrorKind::WriteZero.into()),
                Ok(n) => n,
                Err(rustix::io::Errno::INTR) => continue,
                Err(rustix::io::Errno::AGAIN) => {
                    // The socket is full: the runtime's own write waits for room.
                    let piece = &iov[0][..iov[0].len().min(PIECE)];
                    self.0.write_all(piece).await?;
                    piece.len()
                }
                Err(e) => return Err(e.into()),
            };
            if let Some(h) = hasher.as_deref_mut() {
                // The payload part of what was just sent (the header is not hashed).
                let from = done.max(header.len());
                let to = done + n;
                if to > from {
                    // SAFETY: `sources` are registered host ranges of the operation being
                    // written, unchanged until it is reported.
                    unsafe { hash_span(h, sources, from - header.len(), to - from) };
                }
            }
            done += n;
        }
        Ok(done)
    }
}

/// The first `len` bytes of `ranges`, as ranges.
fn leading(ranges: &[(usize, usize)], mut len: usize) -> Vec<(usize, usize)> {
    let mut out = Vec::with_capacity(ranges.len());
    for &(ptr, n) in ranges {
        if len == 0 {
            break;
        }
        out.push((ptr, n.min(len)));
        len -= n.min(len);
    }
    out
}

/// Payload bytes a checked write hashes before sending them, so that its trailer leaves in
/// the same `sendmsg` as its last bytes (not as a packet and a wake-up of its own); the
/// bytes before them are hashed right after the socket took them.
const HASHED_AHEAD: usize = 256 * 1024;

impl<S: AsyncWrite + AsRawFd + Unpin> GatherWrite for GatherConn<S> {
    async fn write_gather(&mut self, header: &[u8], sources: &[(usize, usize)]) -> io::Result<()> {
        self.gather(header, sources, 0, None).await?;
        Ok(())
    }

    async fn write_gather_checked(
        &mut self,
        header: &[u8],
        sources: &[(usize, usize)],
    ) -> io::Result<()> {
        let payload = sources.iter().map(|s| s.1).sum::<usize>();
        let mut hasher = Checksum::new();
        // The bytes before the last HASHED_AHEAD go (with the header) as the socket takes
        // them and are hashed right after; nothing past them is sent yet.
        let before = payload.saturating_sub(HASHED_AHEAD);
        let mut done = 0;
        if before > 0 {
            let first = leading(sources, before);
            done = self.gather(header, &first, 0, Some(&mut hasher)).await?;
        }
        // SAFETY: as in `gather`: registered host ranges of the operation being written.
        unsafe { hash_span(&mut hasher, sources, before, payload - before) };
        let trailer: [u8; CHECKSUM_LEN] = hasher.digest().to_le_bytes();
        let mut with = sources.to_vec();
        with.push((trailer.as_ptr() as usize, CHECKSUM_LEN));
        self.gather(header, &with, done, None).await?;
        Ok(())
    }

    async fn finish(&mut self) {
        let _ = self.0.close().await;
    }
}

/// A plain TCP receiving connection: buffered for headers and tables, scattering payloads
/// with non-blocking `recvmsg` calls.
pub struct ScatterConn<S>(pub BufReader<S>);

impl<S: AsyncRead + Unpin> ScatterConn<S> {
    /// Wraps `stream` with a read buffer of `capacity` bytes (one receive usually brings a
    /// write's header, table and a small payload at once).
    pub fn new(stream: S, capacity: usize) -> Self {
        ScatterConn(BufReader::with_capacity(capacity, stream))
    }
}

impl<S: AsyncRead + Unpin> AsyncRead for ScatterConn<S> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl<S: AsyncWrite + Unpin> AsyncWrite for ScatterConn<S> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(self.0.get_mut()).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(self.0.get_mut()).poll_flush(cx)
    }

    fn poll_close(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(self.0.get_mut()).poll_close(cx)
    }
}

/// Copies `bytes` into `targets` from byte `skip` of them on; returns how many it placed.
fn place(targets: &[(usize, usize)], skip: usize, bytes: &[u8]) -> usize {
    let mut at = 0;
    for mut iov in scatter_iovecs(targets, skip) {
        if at == bytes.len() {
            break;
        }
        let n = iov.len().min(bytes.len() - at);
        iov[..n].copy_from_slice(&bytes[at..at + n]);
        at += n;
    }
    at
}

impl<S: AsyncRead + AsyncWrite + AsRawFd + Unpin> ScatterConn<S> {
    /// Reads exactly the bytes of `targets` into them; with `hasher`, feeds it each piece
    /// right after it landed (still in the cache).
    async fn scatter(
        &mut self,
        targets: &[(usize, usize)],
        mut hasher: Option<&mut Checksum>,
    ) -> io::Result<()> {
        let total: usize = targets.iter().map(|t| t.1).sum();
        // What the read buffer already holds belongs to this payload first.
        let buffered = self.0.buffer();
        let mut done = place(targets, 0, &buffered[..buffered.len().min(total)]);
        self.0.consume(done);
        if let Some(h) = hasher.as_deref_mut() {
            // SAFETY: `targets` are registered host ranges this write holds (its permit).
            unsafe { hash_span(h, targets, 0, done) };
        }
        while done < total {
            let mut iov = scatter_iovecs(targets, done);
            let got = {
                // SAFETY: the descriptor stays open for as long as the stream we borrow from.
                let fd = unsafe { BorrowedFd::borrow_raw(self.0.get_ref().as_raw_fd()) };
                recvmsg(
                    fd,
                    &mut iov,
                    &mut RecvAncillaryBuffer::default(),
                    RecvFlags::DONTWAIT,
                )
            };
            let n = match got {
                Ok(r) if r.bytes == 0 => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(r) => r.bytes,
                Err(rustix::io::Errno::INTR) => continue,
                Err(rustix::io::Errno::AGAIN) => {
                    // Nothing to read yet: the runtime's own read waits for data, straight
                    // into the next destination range (the read buffer is empty here).
                    let first = &mut iov[0];
                    let n = first.len().min(PIECE);
                    let got = self.0.get_mut().read(&mut first[..n]).await?;
                    if got == 0 {
                        return Err(io::ErrorKind::UnexpectedEof.into());
                    }
                    got
                }
                Err(e) => return Err(e.into()),
            };
            if let Some(h) = hasher.as_deref_mut() {
                // SAFETY: as above; these `n` bytes just landed.
                unsafe { hash_span(h, targets, done, n) };
            }
            done += n;
        }
        Ok(())
    }
}

impl<S: AsyncRead + AsyncWrite + AsRawFd + Unpin> ScatterRead for ScatterConn<S> {
    async fn read_into(
        &mut self,
        targets: &[(usize, usize)],
        _stage: &mut Vec<u8>,
    ) -> io::Result<()> {
        self.scatter(targets, None).await
    }

    async fn read_into_checked(
        &mut self,
        targets: &[(usize, usize)],
        _stage: &mut Vec<u8>,
    ) -> io::Result<u64> {
        let mut hasher = Checksum::new();
        self.scatter(targets, Some(&mut hasher)).await?;
        Ok(hasher.digest())
    }
}

/// A second handle on the socket of `stream`, so that one task reads while another writes
/// with no lock between them.
pub fn second_handle<S: AsRawFd + FromRawFd>(stream: &S) -> io::Result<S> {
    // SAFETY: the descriptor is open for as long as `stream` lives, which spans this call.
    let borrowed = unsafe { BorrowedFd::borrow_raw(stream.as_raw_fd()) };
    let dup = borrowed.try_clone_to_owned()?;
    // SAFETY: `dup` is a fresh descriptor this function owns, a duplicate of the socket `S`
    // was made from; ownership passes to the new `S`, which closes it.
    Ok(unsafe { S::from_raw_fd(dup.into_raw_fd()) })
}
