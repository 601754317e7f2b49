//! A receiving data connection that scatters a write's payload straight from the socket into
//! its destination pages with `recvmsg`, instead of copying it out of a read buffer (and, for
//! small slices, out of a staging buffer too). glommio's sockets have no vectored read, so this
//! reads the descriptor directly while the socket has data and lets glommio wait when it has
//! none, as `write_gather` does for sends.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd};
use std::pin::Pin;
use std::task::{Context, Poll};

use futures_lite::io::{AsyncBufReadExt, BufReader};
use futures_lite::{AsyncRead, AsyncReadExt, AsyncWrite};
use glommio::net::TcpStream;
use kvferry_tcp::scatter_iovecs;
use kvferry_tcp::stream::ScatterRead;
use rustix::net::{recvmsg, RecvAncillaryBuffer, RecvFlags};

/// A data connection's receiving side: buffered for headers and tables, scattering payloads.
pub struct ScatterConn(pub BufReader<TcpStream>);

impl AsyncRead for ScatterConn {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut [u8],
    ) -> Poll<io::Result<usize>> {
        Pin::new(&mut self.0).poll_read(cx, buf)
    }
}

impl AsyncWrite for ScatterConn {
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

impl ScatterRead for ScatterConn {
    async fn read_into(
        &mut self,
        targets: &[(usize, usize)],
        _stage: &mut Vec<u8>,
    ) -> io::Result<()> {
        let total: usize = targets.iter().map(|t| t.1).sum();
        // What the read buffer already holds belongs to this payload first.
        let buffered = self.0.buffer();
        let mut done = place(targets, 0, &buffered[..buffered.len().min(total)]);
        self.0.consume(done);
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
            match got {
                Ok(r) if r.bytes == 0 => return Err(io::ErrorKind::UnexpectedEof.into()),
                Ok(r) => done += r.bytes,
                Err(rustix::io::Errno::INTR) => {}
                Err(rustix::io::Errno::AGAIN) => {
                    // Nothing to read yet: let glommio wait for data, reading straight into
                    // the next destination range (the read buffer is empty here).
                    let first = &mut iov[0];
                    let n = first.len().min(64 * 1024);
                    let got = self.0.get_mut().read(&mut first[..n]).await?;
                    if got == 0 {
                        return Err(io::ErrorKind::UnexpectedEof.into());
                    }
                    done += got;
                }
                Err(e) => return Err(e.into()),
            }
        }
        Ok(())
    }
}
