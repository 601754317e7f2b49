//! `kvferry-tcp`: kvferry's data plane over TCP.
//!
//! It owns the data-plane frames (a write batch: header, slice table, payload; one ack per
//! batch), the sending side that gathers
//! source pages with vectored writes straight from registered memory, and the receiving side
//! that validates every header and table and scatters payload straight into destination
//! pages. It moves bytes; it never decides a retry, a timeout or a room's fate: those come
//! from `kvferry-core` through the driver.
//!
//! The data plane is written once, against `futures-io` streams ([`send`], [`stream`], and
//! the descriptor fast paths in [`fd`]); the `tokio` (default) and `glommio` features plug
//! each runtime's sockets into it. `unsafe` here is limited to the syscalls on a socket's
//! descriptor, the views of registered memory they read and write, and the streaming copy
//! that places short destination rows from a receive stage.

mod frame;
mod io_common;

pub mod fd;
#[cfg(feature = "glommio")]
pub mod glommio;
#[cfg(feature = "tokio")]
mod io;
pub mod polled;
pub mod send;
mod staged;
pub mod stream;
#[cfg(any(feature = "tokio", feature = "glommio"))]
pub mod tls;
mod tls_files;

pub use frame::{
    decode_ack, decode_slices, encode_ack, encode_slice, AckStatus, DataHello, FrameError,
    WriteHeader, ACK_LEN, CHECKSUM_LEN, DATA_CHALLENGE_LEN, DATA_HELLO_LEN, FRAME_WRITE,
    FRAME_WRITE_CHECKED, KIND_CONTROL, KIND_DATA, MAGIC, SLICE_DESC_LEN, WRITE_HEADER_LEN,
};
pub use io_common::{
    gather_iovecs, parse_preamble, prepare_op, scatter_iovecs, Limits, Preamble, ServeError,
    ServeStats, MAX_IOV, PREAMBLE_LEN,
};
pub use staged::DEPTH as STAGING_DEPTH;
#[cfg(feature = "tokio")]
pub use tls::Conn;
#[cfg(any(feature = "tokio", feature = "glommio"))]
pub use tls::TlsSetup;
pub use tls_files::{TlsError, TlsFiles};

#[cfg(feature = "tokio")]
pub use io::{
    accept_conn, answer_data, challenge_data, connect_control, connect_data, read_preamble,
    serve_writes, DataSender, Report, TokioIo,
};

/// Receive buffer of a data connection (larger reads go straight to registered memory).
pub const RECV_BUF: usize = 256 * 1024;
