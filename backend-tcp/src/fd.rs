//! The fast paths of a plain TCP data connection, for every runtime: an operation is
//! gathered from registered memory with `sendmsg` and a payload scattered into destination
//! pages with `recvmsg`, straight on the socket's descriptor while it has room or data. When
//! it has none, the runtime's own `write`/`read` of the next piece waits for it, so any
//! `futures-io` stream that exposes its descriptor gets them (tokio through [`crate::TokioIo`],
//! glommio's io_uring sockets as they are). A payload of short rows apart in the destination
//! (a head split's) is received into a stage that stays in the cache and placed from there
//! with streaming stores: writing such rows in place makes the CPU read every line it fills.

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

/// Destination rows shorter than this on average are received through the connection's
/// stage and placed with streaming stores ([`ScatterConn::scatter_staged`]).
const STAGED_ROW: usize = 8 * 1024;

/// The stage a payload of short rows is received into, one socket call at a time (it stays
/// in the cache between the receive and the placement).
const STAGE: usize = 256 * 1024;

/// Where the next byte of a payload goes: a target's index and how far into it.
#[derive(Default)]
struct Place {
    target: usize,
    offset: usize,
}

impl Place {
    /// Copies `bytes` into `targets` from this place on with streaming stores, and moves on.
    fn stream(&mut self, targets: &[(usize, usize)], mut bytes: &[u8]) {
        while !bytes.is_empty() {
            let (ptr, len) = targets[self.target];
            let n = (len - self.offset).min(bytes.len());
            // SAFETY: the range lies inside one (ptr, len) from MemoryMap::range (registered
            // memory the caller's Arc keeps alive), and the core accepted the write for this
            // room's pages (the permit), so nobody else touches them until it ends; `bytes`
            // is the connection's own buffer, apart from registered memory.
            unsafe { stream_copy((ptr + self.offset) as *mut u8, bytes.as_ptr(), n) };
            bytes = &bytes[n..];
            self.offset += n;
            if self.offset == len {
                self.target += 1;
                self.offset = 0;
            }
        }
    }
}

/// Copies `n` bytes from `src` to `dst` with non-temporal stores where the CPU has them: a
/// row written apart from its neighbours costs the cache no read of the line it fills. The
/// caller ends the payload with [`stream_fence`] before reporting it landed.
///
/// # Safety
///
/// `dst` is valid for `n` bytes of writes, `src` for `n` bytes of reads, and they do not
/// overlap.
unsafe fn stream_copy(dst: *mut u8, src: *const u8, n: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm_stream_si128};
        let head = dst.align_offset(16).min(n);
        // SAFETY: within the `n` bytes the caller vouches for.
        unsafe { std::ptr::copy_nonoverlapping(src, dst, head) };
        let mut at = head;
        while at + 16 <= n {
            // SAFETY: `dst + at` is 16-byte aligned and both 16-byte ranges lie within the
            // caller's `n` bytes; SSE2 is part of every x86_64 CPU.
            unsafe {
                let v = _mm_loadu_si128(src.add(at) as *const __m128i);
                _mm_stream_si128(dst.add(at) as *mut __m128i, v);
            }
            at += 16;
        }
        // SAFETY: the tail, within the caller's `n` bytes.
        unsafe { std::ptr::copy_nonoverlapping(src.add(at), dst.add(at), n - at) };
    }
    #[cfg(not(target_arch = "x86_64"))]
    // SAFETY: as the caller vouches.
    unsafe {
        std::ptr::copy_nonoverlapping(src, dst, n)
    };
}

/// Orders every streaming store before what follows (the write's report that it landed).
fn stream_fence() {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: SSE is part of every x86_64 CPU; a fence touches no memory.
    unsafe {
        std::arch::x86_64::_mm_sfence()
    };
}

/// Fences this thread's streaming stores when dropped.
struct Fenced;

impl Drop for Fenced {
    fn drop(&mut self) {
        stream_fence();
    }
}

/// Whether a payload of `targets` is rows short enough, and apart, that placing them from a
/// stage beats the kernel's scatter (each short row it writes in place reads its cache
/// lines first).
fn staged_rows(targets: &[(usize, usize)], total: usize) -> bool {
    targets.len() > 1 && total / targets.len() < STAGED_ROW
}

impl<S: AsyncRead + AsyncWrite + AsRawFd + Unpin> ScatterConn<S> {
    /// Reads exactly the bytes of `targets` into them: short rows apart through `stage`
    /// ([`ScatterConn::scatter_staged`]), anything else straight ([`ScatterConn::scatter`]);
    /// with `hasher`, feeds it the bytes as they arrive.
    async fn payload(
        &mut self,
        targets: &[(usize, usize)],
        stage: &mut Vec<u8>,
        hasher: Option<&mut Checksum>,
    ) -> io::Result<()> {
        let total: usize = targets.iter().map(|t| t.1).sum();
        if staged_rows(targets, total) {
            self.scatter_staged(targets, total, stage, hasher).await
        } else {
            self.scatter(targets, total, hasher).await
        }
    }

    /// Reads exactly the bytes of `targets` into them through `stage`, one socket call at a
    /// time, each piece placed with streaming stores; with `hasher`, feeds it each piece from
    /// the stage (the bytes as they arrived, still in the cache).
    async fn scatter_staged(
        &mut self,
        targets: &[(usize, usize)],
        total: usize,
        stage: &mut Vec<u8>,
        mut hasher: Option<&mut Checksum>,
    ) -> io::Result<()> {
        let mut place = Place::default();
        // Every way out of here (the end, an error, the future dropped) fences the stores
        // this thread made since the last wait.
        let _fence = Fenced;
        // What the read buffer already holds belongs to this payload first.
        let buffered = self.0.buffer();
        let mut done = buffered.len().min(total);
        if let Some(h) = hasher.as_deref_mut() {
            h.update(&buffered[..done]);
        }
        place.stream(targets, &buffered[..done]);
        self.0.consume(done);
        if stage.len() < STAGE {
            stage.resize(STAGE, 0);
        }
        while done < total {
            let want = (total - done).min(STAGE);
            let got = {
                // SAFETY: the descriptor stays open for as long as the stream we borrow from.
                let fd = unsafe { BorrowedFd::borrow_raw(self.0.get_ref().as_raw_fd()) };
                rustix::net::recv(fd, &mut stage[..want], RecvFlags::DONTWAIT)
            };
            let n = match got {
                Ok(0) => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(n) => n,
                Err(rustix::io::Errno::INTR) => continue,
                Err(rustix::io::Errno::AGAIN) => {
                    // Nothing to read yet: the runtime's own read waits for data (the read
                    // buffer is empty here). The task may resume on another thread, and a
                    // streaming store is ordered only by a fence on the thread that made it.
                    stream_fence();
                    match self.0.get_mut().read(&mut stage[..want]).await? {
                        0 => return Err(io::ErrorKind::UnexpectedEof.into()),
                        n => n,
                    }
                }
                Err(e) => return Err(e.into()),
            };
            if let Some(h) = hasher.as_deref_mut() {
                h.update(&stage[..n]);
            }
            place.stream(targets, &stage[..n]);
            done += n;
        }
        Ok(())
    }

    /// Reads exactly the bytes of `targets` into them; with `hasher`, feeds it each piece
    /// right after it landed (still in the cache).
    async fn scatter(
        &mut self,
        targets: &[(usize, usize)],
        total: usize,
        mut hasher: Option<&mut Checksum>,
    ) -> io::Result<()> {
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
        stage: &mut Vec<u8>,
    ) -> io::Result<()> {
        self.payload(targets, stage, None).await
    }

    async fn read_into_checked(
        &mut self,
        targets: &[(usize, usize)],
        stage: &mut Vec<u8>,
    ) -> io::Result<u64> {
        let mut hasher = Checksum::new();
        self.payload(targets, stage, Some(&mut hasher)).await?;
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
