//! Zero-copy sends through the `io-uring` crate (`IORING_OP_SENDMSG_ZC`), a path glommio's
//! sockets do not expose. The kernel pins the source pages and sends from them instead of
//! copying them into socket buffers; it posts one completion with the bytes sent and, later, a
//! notification once it no longer reads the pages.
//!
//! Each sender owns a small ring of its own. Its completions are signalled on an eventfd that
//! the shard reads through glommio, so a shard waiting for a send parks in glommio's ring like
//! any other wait: no second poller, no spinning.
//!
//! Experiment knobs (A/B only): `ZC_NOWAIT=1` returns after the send's result without waiting
//! for the notification; `ZC_PLAIN=1` submits plain `SENDMSG` on the same ring, to tell the
//! cost of the ring and eventfd wake from the cost of zero-copy itself.
//!
//! Measured against [`crate::write_gather`] (plain non-blocking `sendmsg` from the same
//! pages) by `kvferry bench --runtime glommio` with `KVFERRY_GLOMMIO_ZC=1`; the driver does
//! not use it.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;

use glommio::io::BufferedFile;
use glommio::net::TcpStream;
use io_uring::{cqueue, opcode, types, IoUring};
use kvferry_tcp::{gather_iovecs, MemoryMap};

/// Sends one operation at a time on one connection with `SENDMSG_ZC`.
pub struct ZeroCopySender {
    ring: IoUring,
    /// The eventfd the ring signals, read through glommio to park until a completion.
    signal: BufferedFile,
    /// The operation's header, owned here: the kernel may read it until the notification.
    header: Vec<u8>,
    /// Source pages stay mapped for as long as the kernel may read them.
    _memory: Arc<MemoryMap>,
    /// A send whose completion or notification has not been reaped (see `Drop`).
    in_flight: bool,
}

/// What the ring said about one send.
#[derive(Default)]
struct Reaped {
    sent: Option<i32>,
    released: bool,
}

impl ZeroCopySender {
    /// A sender for operations whose sources lie in `memory`.
    pub fn new(memory: Arc<MemoryMap>) -> io::Result<Self> {
        let ring = IoUring::new(8)?;
        let fd = rustix::event::eventfd(0, rustix::event::EventfdFlags::CLOEXEC)?;
        ring.submitter().register_eventfd(fd.as_raw_fd())?;
        let fd: OwnedFd = fd;
        // SAFETY: `fd` is an open eventfd we own; the file takes it over and closes it.
        let signal = unsafe { BufferedFile::from_raw_fd(std::os::fd::IntoRawFd::into_raw_fd(fd)) };
        Ok(ZeroCopySender {
            ring,
            signal,
            header: Vec::with_capacity(4096),
            _memory: memory,
            in_flight: false,
        })
    }

    /// Writes `header` then every source range of `memory` on `stream`, zero-copy; returns
    /// once the kernel has sent every byte and released the pages.
    pub async fn send(
        &mut self,
        stream: &TcpStream,
        header: &[u8],
        sources: &[(usize, usize)],
    ) -> io::Result<()> {
        self.header.clear();
        self.header.extend_from_slice(header);
        let total = header.len() + sources.iter().map(|s| s.1).sum::<usize>();
        let mut done = 0usize;
        while done < total {
            let iov = gather_iovecs(&self.header, sources, done);
            // SAFETY: an all-zero msghdr is valid (no name, no control).
            let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
            msg.msg_iov = iov.as_ptr() as *mut _;
            msg.msg_iovlen = iov.len() as _;
            let entry = if std::env::var_os("ZC_PLAIN").is_some() {
                opcode::SendMsg::new(types::Fd(stream.as_raw_fd()), &msg)
                    .flags((libc::MSG_NOSIGNAL | libc::MSG_WAITALL) as u32)
                    .build()
                    .user_data(1)
            } else {
                opcode::SendMsgZc::new(types::Fd(stream.as_raw_fd()), &msg)
                    .flags((libc::MSG_NOSIGNAL | libc::MSG_WAITALL) as u32)
                    .build()
                    .user_data(1)
            };
            // SAFETY: the kernel copies `msg` and `iov` when `submit` issues the entry; what
            // they point at (this sender's header and the registered memory it keeps mapped)
            // stays alive until the notification is reaped below, or is leaked by `Drop` if
            // this future is dropped first.
            unsafe { self.ring.submission().push(&entry) }
                .map_err(|_| io::Error::other("zero-copy ring full"))?;
            self.in_flight = true;
            self.ring.submit()?;
            let reaped = self.wait().await?;
            self.in_flight = false;
            match reaped.sent {
                Some(n) if n > 0 => done += n as usize,
                Some(0) => return Err(io::ErrorKind::WriteZero.into()),
                Some(e) => return Err(io::Error::from_raw_os_error(-e)),
                None => return Err(io::Error::other("zero-copy send without a result")),
            }
        }
        Ok(())
    }

    /// Parks until the send's result and (when one is due) its notification were reaped.
    async fn wait(&mut self) -> io::Result<Reaped> {
        let mut reaped = Reaped::default();
        let mut notification_due = false;
        loop {
            for cqe in self.ring.completion() {
                if cqueue::notif(cqe.flags()) {
                    reaped.released = true;
                } else {
                    reaped.sent = Some(cqe.result());
                    notification_due = cqueue::more(cqe.flags());
                }
            }
            let _ = notification_due;
            if reaped.sent.is_some()
                && (std::env::var_os("ZC_NOWAIT").is_some() || !notification_due || reaped.released)
            {
                return Ok(reaped);
            }
            // The eventfd counts completions posted since the last read: a completion posted
            // after the drain above makes this read return at once.
            self.signal
                .read_at(0, 8)
                .await
                .map_err(|e| io::Error::other(e.to_string()))?;
        }
    }
}

impl Drop for ZeroCopySender {
    fn drop(&mut self) {
        if self.in_flight {
            // The kernel may still read the header: never hand its memory back.
            std::mem::forget(std::mem::take(&mut self.header));
        }
    }
}
