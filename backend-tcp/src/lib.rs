//! `kvferry-tcp`: kvferry's data plane over TCP.
//!
//! It owns the data-plane frames (a write batch: header, slice table, payload; one ack per
//! batch), the sending side that gathers
//! source pages with vectored writes straight from registered memory, and the receiving side
//! that validates every header and table and scatters payload straight into destination
//! pages. It moves bytes; it never decides a retry, a timeout or a room's fate: those come
//! from `kvferry-core` through the driver.
//!
//! The tokio implementation lives behind the default `tokio` feature; the `futures-io`
//! feature adds the same data plane over any `futures-io` stream ([`stream`], used by the
//! glommio driver).

mod frame;
mod io_common;

#[cfg(feature = "tokio")]
mod io;
#[cfg(feature = "futures-io")]
pub mod stream;
#[cfg(feature = "tokio")]
pub mod tls;
mod tls_files;

pub use frame::{
    decode_ack, decode_slices, encode_ack, encode_slice, AckStatus, DataHello, FrameError,
    WriteHeader, ACK_LEN, DATA_CHALLENGE_LEN, DATA_HELLO_LEN, FRAME_WRITE, KIND_CONTROL, KIND_DATA,
    MAGIC, SLICE_DESC_LEN, WRITE_HEADER_LEN,
};
pub use io_common::{
    gather_iovecs, parse_preamble, prepare_op, scatter_iovecs, Limits, Preamble, ServeError,
    ServeStats, MAX_IOV, PREAMBLE_LEN,
};
#[cfg(feature = "tokio")]
pub use tls::{Conn, TlsError, TlsSetup};
pub use tls_files::TlsFiles;

#[cfg(feature = "tokio")]
pub use io::{
    accept_conn, answer_data, challenge_data, connect_control, connect_data, read_preamble,
    serve_writes, DataSender, Report,
};
