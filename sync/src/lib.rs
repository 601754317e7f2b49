//! State that kvferry's drivers and backends share between threads or tasks, kept apart from
//! any runtime so that every structure can be model-checked with `loom`
//! (`RUSTFLAGS="--cfg loom" cargo test -p kvferry-sync --release --test loom`).
//!
//! Owns: the completion hand-off of a data connection ([`OpLedger`]), the set of data
//! connections of a session with its closing rule ([`ConnSet`]), and the receive path's hold
//! on a room's pages while a write lands ([`Landing`]). Must never: make a
//! retry, timeout or state decision (the core does), do IO, or depend on a runtime.
#![forbid(unsafe_code)]
#![deny(missing_docs)]

pub mod loom;

mod conns;
mod landing;
mod ledger;

pub use conns::ConnSet;
pub use landing::{EndWrite, Landing};
pub use ledger::{Acked, LedgerState, OpLedger, Start};
