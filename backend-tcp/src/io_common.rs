//! What both data-plane implementations (tokio, and any `futures-io` stream) share: the
//! receiver's admission trait, bounds, outcomes, and how an operation is prepared for the wire.

use std::io::{self, IoSlice, IoSliceMut};

use kvferry_core::{Slice, TransferOp, WritePermit, WriteRefused};
use kvferry_sync::{EndWrite, Landing};
use tracing::warn;

#[cfg(test)]
use crate::frame::DataHello;
use crate::frame::{encode_slice, FrameError, WriteHeader, KIND_CONTROL, KIND_DATA, MAGIC};
use kvferry_memory::{MemoryMap, SliceSide, WriteCheck};

/// Hands a write's permit back, with the write's slices, through a [`WriteCheck`] behind
/// any pointer (`Arc` on tokio, `Rc` on a thread-per-core runtime).
pub(crate) struct EndThrough<P> {
    check: P,
    slices: Vec<Slice>,
}

impl<P> EndWrite for EndThrough<P>
where
    P: std::ops::Deref,
    P::Target: WriteCheck,
{
    fn end_write(&self, permit: WritePermit) {
        self.check.end(permit, &self.slices);
    }
}

/// Bounds a receiver enforces on every write header.
#[derive(Clone, Copy, Debug)]
pub struct Limits {
    /// Most slices per operation.
    pub max_slices: u32,
    /// Most payload bytes per operation.
    pub max_bytes: u64,
    /// Every write must carry its checksum (the session agreed on it at the handshake): an
    /// unchecked write batch breaks the protocol and closes the connection.
    pub checksum: bool,
}

/// What a receiver saw on a data connection before it ended.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ServeStats {
    /// Operations applied.
    pub applied: u64,
    /// Operations refused (payload discarded).
    pub refused: u64,
    /// Payload bytes applied.
    pub bytes: u64,
    /// Operations whose bytes landed but did not match their checksum.
    pub corrupt: u64,
}

/// An error that ends a data connection on the receiving side.
#[derive(Debug)]
pub enum ServeError {
    /// The socket failed.
    Io(io::Error),
    /// The peer sent a frame that cannot be accepted.
    Frame(FrameError),
}

impl std::fmt::Display for ServeError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            ServeError::Io(e) => write!(f, "data connection failed: {e}"),
            ServeError::Frame(e) => write!(f, "data connection refused a frame: {e}"),
        }
    }
}

impl std::error::Error for ServeError {}

impl From<io::Error> for ServeError {
    fn from(e: io::Error) -> Self {
        ServeError::Io(e)
    }
}

/// What an accepted connection says it is.
#[derive(Debug)]
pub enum Preamble {
    /// The core's control frames follow.
    Control,
    /// A data connection: the listener sends its challenge, reads the [`DataHello`]
    /// answering it, and accepts or refuses; then write batches follow.
    ///
    /// [`DataHello`]: crate::DataHello
    Data,
}

/// Encodes `op`'s header and slice table into `header` and resolves every source range in
/// registered memory before anything goes on the wire. `true` in the second place: a range is
/// not registered (the operation fails fatally; nothing is sent).
pub fn prepare_op(
    op: &TransferOp,
    memory: &MemoryMap,
    header: &mut Vec<u8>,
) -> (Vec<(usize, usize)>, bool) {
    header.clear();
    WriteHeader {
        op: op.id,
        room: op.room.unwrap_or_default(),
        generation: op.generation,
        slices: op.slices.len() as u32,
        payload: op.bytes,
        checked: op.checksum,
    }
    .encode(header);
    for s in op.slices.iter() {
        encode_slice(s, header);
    }
    let mut sources: Vec<(usize, usize)> = Vec::with_capacity(op.slices.len());
    for s in op.slices.iter() {
        if let Err(e) = push_rows(memory, s, SliceSide::Source, &mut sources) {
            warn!(op = %op.id, error = %e, "source range cannot be read");
            return (sources, true);
        }
    }
    (sources, false)
}

/// Appends the (address, length) of every row of `s` on `side`, in order (rows that touch
/// as one range), if this process can move their bytes ([`reachable`] over the span from
/// the first row to the last).
pub(crate) fn push_rows(
    memory: &MemoryMap,
    s: &Slice,
    side: SliceSide,
    out: &mut Vec<(usize, usize)>,
) -> Result<(), kvferry_memory::AccessError> {
    let (offset, stride) = match side {
        SliceSide::Source => (s.src_offset, s.src_stride),
        SliceSide::Destination => (s.dst_offset, s.dst_stride),
    };
    let span = kvferry_core::rows_end(offset, s.len, s.rows, stride)
        .map(|end| end - offset)
        .ok_or(kvferry_memory::AccessError::OutOfBounds(
            kvferry_memory::OutOfBounds {
                region: s.region,
                offset,
                len: s.len,
            },
        ))?;
    let first = reachable(memory, s.region, offset, span)? as usize;
    if stride == s.len {
        // Rows that touch are one range: one iovec (the kernel's cost is per iovec).
        out.push((first, span as usize));
    } else {
        out.extend((0..s.rows as usize).map(|i| (first + i * stride as usize, s.len as usize)));
    }
    Ok(())
}

/// A range's address if this process can move its bytes: host memory, or device memory the
/// map reaches through a copy engine (the staged paths). Device memory without one is an
/// error, so no CPU path ever dereferences a device address.
fn reachable(
    memory: &MemoryMap,
    region: kvferry_core::Region,
    offset: u64,
    len: u64,
) -> Result<*mut u8, kvferry_memory::AccessError> {
    if memory.staging().is_some() {
        Ok(memory.range(region, offset, len)?)
    } else {
        memory.host_range(region, offset, len)
    }
}

/// Linux accepts at most this many iovecs per call.
pub const MAX_IOV: usize = 1024;

/// The (address, length) of what is left of `ranges` after `skip` bytes, at most `max` of
/// them: the shared bookkeeping of partial vectored writes and reads.
fn remaining(
    ranges: &[(usize, usize)],
    mut skip: usize,
    max: usize,
) -> impl Iterator<Item = (usize, usize)> + '_ {
    ranges
        .iter()
        .filter_map(move |&(ptr, len)| {
            if skip >= len {
                skip -= len;
                None
            } else {
                let part = (ptr + skip, len - skip);
                skip = 0;
                Some(part)
            }
        })
        .take(max)
}

/// The iovecs of what is left to send after `skip` bytes, at most [`MAX_IOV`] of them.
pub fn gather_iovecs<'a>(
    header: &'a [u8],
    sources: &[(usize, usize)],
    skip: usize,
) -> Vec<IoSlice<'a>> {
    let mut iov = Vec::with_capacity((sources.len() + 1).min(MAX_IOV));
    if skip < header.len() {
        iov.push(IoSlice::new(&header[skip..]));
    }
    let skip = skip.saturating_sub(header.len());
    for (ptr, len) in remaining(sources, skip, MAX_IOV - iov.len()) {
        // SAFETY: the range lies inside one (ptr, len) from MemoryMap::range, in registered
        // memory that outlives the map (held by the caller's Arc); the core keeps these source
        // pages pinned (no release, no reuse) until this operation is reported.
        iov.push(IoSlice::new(unsafe {
            std::slice::from_raw_parts(ptr as *const u8, len)
        }));
    }
    iov
}

/// The iovecs of what is left to receive into `targets` after `skip` bytes, at most
/// [`MAX_IOV`] of them.
pub fn scatter_iovecs<'a>(targets: &[(usize, usize)], skip: usize) -> Vec<IoSliceMut<'a>> {
    remaining(targets, skip, MAX_IOV)
        .map(|(ptr, len)| {
            // SAFETY: the range lies inside one (ptr, len) from MemoryMap::range (registered
            // memory the caller's Arc keeps alive) and the core accepted the write for this
            // room's pages, so nobody else touches them until the room is released.
            IoSliceMut::new(unsafe { std::slice::from_raw_parts_mut(ptr as *mut u8, len) })
        })
        .collect()
}

pub(crate) use kvferry_memory::Checksum;

/// Feeds `hasher` the `len` bytes of `ranges` that start `skip` bytes into them: the bytes a
/// socket call just moved, hashed while they are still in the cache.
///
/// # Safety
///
/// As [`checksum_of`].
pub(crate) unsafe fn hash_span(
    hasher: &mut Checksum,
    ranges: &[(usize, usize)],
    mut skip: usize,
    mut len: usize,
) {
    for &(ptr, n) in ranges {
        if len == 0 {
            break;
        }
        if skip >= n {
            skip -= n;
            continue;
        }
        let take = (n - skip).min(len);
        // SAFETY: the caller's contract; the piece lies inside this range.
        hasher.update(unsafe { std::slice::from_raw_parts((ptr + skip) as *const u8, take) });
        len -= take;
        skip = 0;
    }
}

/// The XXH3-64 (seed 0) of the bytes of `ranges`, in order: the checksum of a write batch.
///
/// # Safety
///
/// Every range must be host memory valid for reads for its length, that nobody writes
/// meanwhile (registered memory whose room's pages the core holds for this operation).
pub(crate) unsafe fn checksum_of(ranges: &[(usize, usize)]) -> u64 {
    let mut hasher = Checksum::new();
    for &(ptr, len) in ranges {
        // SAFETY: the caller's contract, for each range.
        hasher.update(unsafe { std::slice::from_raw_parts(ptr as *const u8, len) });
    }
    hasher.digest()
}

/// What a receiver does with one write whose header and table it read.
pub(crate) enum Admission<P>
where
    P: std::ops::Deref,
    P::Target: WriteCheck,
{
    /// Apply the payload into `targets`; `landing` holds the room's pages until dropped.
    Apply {
        /// The core's permit, handed back on drop.
        landing: Landing<EndThrough<P>>,
        /// Destination ranges in registered memory.
        targets: Vec<(usize, usize)>,
    },
    /// Read the payload into a discard buffer (the core's reason, if it refused).
    Refuse(Option<WriteRefused>),
}

/// Asks the core (through `check`) whether the write of `h` may land, and resolves its
/// destinations against this process's registrations whatever the core said: the one
/// admission step of every receive path. An injected reset is an error.
pub(crate) fn admit<P>(
    check: &P,
    memory: &MemoryMap,
    h: &WriteHeader,
    slices: &[Slice],
) -> Result<Admission<P>, ServeError>
where
    P: std::ops::Deref + Clone,
    P::Target: WriteCheck,
{
    if check.inject_reset(h.room, h.op) {
        return Err(ServeError::Io(io::Error::new(
            io::ErrorKind::ConnectionReset,
            "injected reset",
        )));
    }
    let permit = match check.begin(h.room, h.generation, slices) {
        Ok(p) => p,
        Err(refused) => return Ok(Admission::Refuse(Some(refused))),
    };
    // Held until the payload is applied or abandoned (a cancelled task drops it): the core
    // keeps the room's pages while it is out.
    let landing = Landing::new(
        permit,
        EndThrough {
            check: check.clone(),
            slices: slices.to_vec(),
        },
    );
    let mut targets = Vec::with_capacity(slices.len());
    let targets = slices
        .iter()
        .try_for_each(|s| push_rows(memory, s, SliceSide::Destination, &mut targets))
        .ok()
        .map(|()| targets);
    Ok(match targets {
        Some(targets) => Admission::Apply { landing, targets },
        None => Admission::Refuse(None),
    })
}

/// Length of a connection's preamble: the magic and the kind. A data connection's hello
/// follows only after the listener sent its challenge.
pub const PREAMBLE_LEN: usize = 5;

/// Parses a connection's preamble without doing IO, the one place every stream type does:
/// exactly [`PREAMBLE_LEN`] bytes, total (bad input is an error).
pub fn parse_preamble(bytes: &[u8]) -> Result<Preamble, ServeError> {
    if bytes.len() != PREAMBLE_LEN {
        return Err(ServeError::Frame(FrameError::Malformed("preamble length")));
    }
    if bytes[..4] != MAGIC {
        return Err(ServeError::Frame(FrameError::BadMagic));
    }
    match bytes[4] {
        KIND_CONTROL => Ok(Preamble::Control),
        KIND_DATA => Ok(Preamble::Data),
        other => Err(ServeError::Frame(FrameError::UnknownType(other))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_that_touch_are_one_range_and_rows_apart_one_range_each() {
        let map = MemoryMap::allocate(kvferry_core::sim::small_layout(16));
        let region = kvferry_core::Region::Kv { layer: 1, plane: 0 };
        // A rank's four rows of 256 bytes: side by side in its own page, every 512 bytes
        // in a page of twice its heads.
        let rows = Slice {
            region,
            src_offset: 1024,
            dst_offset: 4096,
            len: 256,
            rows: 4,
            src_stride: 256,
            dst_stride: 512,
        };
        let (mut src, mut dst) = (Vec::new(), Vec::new());
        push_rows(&map, &rows, SliceSide::Source, &mut src).unwrap();
        push_rows(&map, &rows, SliceSide::Destination, &mut dst).unwrap();
        let at = |offset| map.host_range(region, offset, 1).unwrap() as usize;
        assert_eq!(src, vec![(at(1024), 1024)]);
        assert_eq!(
            dst,
            (0..4)
                .map(|i| (at(4096) + i * 512, 256))
                .collect::<Vec<_>>()
        );
    }

    fn parse(bytes: &[u8]) -> Result<Option<Preamble>, ServeError> {
        parse_preamble(bytes).map(Some)
    }

    #[test]
    fn a_control_preamble_is_the_magic_and_the_control_kind() {
        let mut bytes = MAGIC.to_vec();
        bytes.push(KIND_CONTROL);
        assert!(matches!(parse(&bytes), Ok(Some(Preamble::Control))));
    }

    #[test]
    fn a_data_preamble_is_the_magic_and_the_data_kind() {
        let mut bytes = MAGIC.to_vec();
        bytes.push(KIND_DATA);
        assert!(matches!(parse(&bytes), Ok(Some(Preamble::Data))));
    }

    #[test]
    fn a_data_hello_round_trips() {
        let hello = DataHello {
            tag: [1; 16],
            proof: [2; 32],
        };
        assert_eq!(DataHello::decode(&hello.encode()), hello);
    }

    #[test]
    fn wrong_magic_and_unknown_kind_are_refused() {
        assert!(matches!(
            parse(b"HTTP/"),
            Err(ServeError::Frame(FrameError::BadMagic))
        ));
        let mut bytes = MAGIC.to_vec();
        bytes.push(0xee);
        assert!(matches!(
            parse(&bytes),
            Err(ServeError::Frame(FrameError::UnknownType(0xee)))
        ));
    }

    #[test]
    fn a_preamble_of_the_wrong_length_is_refused() {
        assert!(parse_preamble(&MAGIC).is_err());
    }
}
