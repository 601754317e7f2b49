//! The data plane on glommio: its io_uring sockets plugged into the one data plane of this
//! crate, with the `sendmsg`/`recvmsg` fast paths, on the shard's own thread.

use std::io;
use std::rc::Rc;
use std::sync::Arc;

use glommio::net::TcpStream;
use kvferry_core::{TransferId, TransferOutcome};
use kvferry_memory::{MemoryMap, WriteCheck};

use crate::fd::{second_handle, GatherConn, ScatterConn};
use crate::io_common::{Limits, ServeError, ServeStats};
use crate::send::Task;
use crate::stream::serve_writes_on;

/// Where a [`LocalDataSender`] reports each operation's outcome (on the shard's own thread).
pub type LocalReport = Rc<dyn Fn(TransferId, TransferOutcome)>;

/// The sending side of one data connection on a glommio shard.
pub type LocalDataSender = crate::send::DataSender<glommio::Task<()>, LocalReport>;

impl Task for glommio::Task<()> {
    async fn stop(self) {
        let _ = self.cancel().await;
    }

    fn abort(self) {
        // Dropping a glommio task cancels it.
    }
}

impl LocalDataSender {
    /// Starts the writer and ack reader of `stream` on the current glommio executor, over two
    /// handles of its socket; sources are read from `memory`.
    pub fn spawn(
        stream: TcpStream,
        memory: Arc<MemoryMap>,
        report: LocalReport,
    ) -> io::Result<Self> {
        let _ = stream.set_nodelay(true);
        let read = second_handle(&stream)?;
        Ok(Self::start(
            GatherConn(stream),
            read,
            memory,
            report,
            |w, a| [glommio::spawn_local(w.run()), glommio::spawn_local(a.run())],
        ))
    }
}

/// Serves write batches on a data connection (decode) on the current glommio executor:
/// validates each write with `check`, scatters it into registered memory, acknowledges.
pub async fn serve_local(
    stream: TcpStream,
    memory: &MemoryMap,
    check: Rc<dyn WriteCheck>,
    limits: Limits,
) -> Result<ServeStats, ServeError> {
    let _ = stream.set_nodelay(true);
    let mut conn = ScatterConn::new(stream, crate::RECV_BUF);
    serve_writes_on(&mut conn, memory, check, limits).await
}
