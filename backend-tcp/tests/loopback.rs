//! The data plane over real loopback sockets: bytes land where the descriptors say, refused
//! writes touch nothing, a broken connection fails in-flight operations transiently.
#![allow(clippy::unwrap_used, clippy::type_complexity)] // test helpers may panic

use std::sync::{Arc, Mutex};

use kvferry_core::sim::small_layout;
use kvferry_core::{
    Generation, OpKind, Region, RoomId, SessionId, Slice, TransferId, TransferOp, TransferOutcome,
    WritePermit, WriteRefused,
};
use kvferry_memory::{MemoryMap, WriteCheck};
use kvferry_tcp::{serve_writes, DataSender, Limits, Report};
use tokio::net::{TcpListener, TcpStream};

/// How long the tests' reads keep trying after the last bytes, as a tokio node's do.
const SPIN: std::time::Duration = std::time::Duration::from_micros(50);

/// Lets writes of its room land; one of the room 100 above it already succeeded.
struct AllowRoom(RoomId);

impl WriteCheck for AllowRoom {
    fn begin(
        &self,
        room: RoomId,
        generation: Generation,
        _s: &[Slice],
    ) -> Result<WritePermit, WriteRefused> {
        if room == self.0 {
            Ok(WritePermit {
                corrupt: false,
                session: SessionId(1),
                room: Some(room),
                generation,
                epoch: 0,
                seq: 0,
                applied: false,
            })
        } else if room.0 == self.0 .0 + 100 {
            Err(WriteRefused::AlreadyLanded)
        } else {
            Err(WriteRefused::UnknownRoom)
        }
    }

    fn end(&self, _permit: WritePermit, _slices: &[Slice]) {}
}

async fn pair() -> (TcpStream, TcpStream) {
    let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let a = TcpStream::connect(l.local_addr().unwrap()).await.unwrap();
    let (b, _) = l.accept().await.unwrap();
    (a, b)
}

/// A connection whose far end serves writes into `dst` for `room` (limits 4096 rows, 1 GiB):
/// the writing end and the server's task.
async fn serving(
    dst: &Arc<MemoryMap>,
    room: u64,
    checksum: bool,
) -> (
    TcpStream,
    tokio::task::JoinHandle<Result<kvferry_tcp::ServeStats, kvferry_tcp::ServeError>>,
) {
    let (a, b) = pair().await;
    let limits = Limits {
        checksum,
        max_slices: 4096,
        max_bytes: 1 << 30,
    };
    let server = tokio::spawn(serve_writes(
        b,
        dst.clone(),
        Arc::new(AllowRoom(RoomId(room))),
        limits,
        SPIN,
    ));
    (a, server)
}

fn op(id: u64, room: u64, slices: Vec<Slice>) -> TransferOp {
    let bytes = slices.iter().map(Slice::bytes).sum();
    TransferOp {
        checksum: false,
        id: TransferId(id),
        session: SessionId(1),
        room: Some(RoomId(room)),
        generation: 0,
        kind: OpKind::Kv,
        attempt: 1,
        slices: slices.into(),
        bytes,
    }
}

/// Waits until `n` operations were reported to `got`.
async fn reported(got: &Mutex<Vec<(TransferId, TransferOutcome)>>, n: usize) {
    while got.lock().unwrap().len() < n {
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
}

fn collector() -> (Report, Arc<Mutex<Vec<(TransferId, TransferOutcome)>>>) {
    let got = Arc::new(Mutex::new(Vec::new()));
    let g = got.clone();
    (Arc::new(move |id, o| g.lock().unwrap().push((id, o))), got)
}

#[tokio::test]
async fn a_batch_lands_exactly_where_its_descriptors_say() {
    let layout = small_layout(256);
    let src = Arc::new(MemoryMap::allocate(layout));
    let dst = Arc::new(MemoryMap::allocate(layout));
    let region = Region::Kv { layer: 1, plane: 1 };
    for p in 0..8u64 {
        src.write(region, p * 1024, &vec![p as u8 + 1; 1024])
            .unwrap();
    }
    let (a, server) = serving(&dst, 7, false).await;
    let (report, got) = collector();
    let sender = DataSender::spawn(a, src.clone(), report, SPIN);
    // pages 0..4 -> 100..104, pages 6..8 -> 10..12
    let slices = vec![
        Slice::run(region, 0, 100 * 1024, 4 * 1024),
        Slice::run(region, 6 * 1024, 10 * 1024, 2 * 1024),
    ];
    sender.send(op(1, 7, slices)).unwrap();
    sender
        .send(op(2, 8, vec![Slice::run(region, 0, 0, 1024)]))
        .unwrap();
    reported(&got, 2).await;
    assert_eq!(
        *got.lock().unwrap(),
        vec![
            (TransferId(1), TransferOutcome::Done),
            (TransferId(2), TransferOutcome::Refused)
        ]
    );
    let mut page = vec![0u8; 1024];
    for (dst_page, value) in [(100, 1), (101, 2), (102, 3), (103, 4), (10, 7), (11, 8)] {
        dst.read(region, dst_page * 1024, &mut page).unwrap();
        assert!(page.iter().all(|b| *b == value), "page {dst_page}");
    }
    dst.read(region, 0, &mut page).unwrap();
    assert!(
        page.iter().all(|b| *b == 0),
        "the refused write touched nothing"
    );
    sender.close().await;
    let stats = server.await.unwrap().unwrap();
    assert_eq!((stats.applied, stats.refused), (1, 1));
}

#[tokio::test]
async fn a_repeat_of_a_write_whose_room_already_succeeded_is_acknowledged_done_and_touches_nothing()
{
    let layout = small_layout(256);
    let src = Arc::new(MemoryMap::allocate(layout));
    let dst = Arc::new(MemoryMap::allocate(layout));
    let region = Region::Kv { layer: 0, plane: 0 };
    src.write(region, 0, &[9u8; 1024]).unwrap();
    let (a, server) = serving(&dst, 7, false).await;
    let (report, got) = collector();
    let sender = DataSender::spawn(a, src.clone(), report, SPIN);
    sender
        .send(op(1, 107, vec![Slice::run(region, 0, 0, 1024)]))
        .unwrap();
    reported(&got, 1).await;
    // The sender's room must not fail for a retry whose bytes are there already.
    assert_eq!(
        *got.lock().unwrap(),
        vec![(TransferId(1), TransferOutcome::Done)]
    );
    let mut page = vec![0u8; 1024];
    dst.read(region, 0, &mut page).unwrap();
    assert!(page.iter().all(|b| *b == 0), "nothing written");
    sender.close().await;
    let stats = server.await.unwrap().unwrap();
    assert_eq!((stats.applied, stats.refused), (0, 1));
}

#[tokio::test]
async fn a_strided_slice_moves_each_row_from_its_source_row_to_its_destination_row() {
    let layout = small_layout(256);
    let src = Arc::new(MemoryMap::allocate(layout));
    let dst = Arc::new(MemoryMap::allocate(layout));
    let region = Region::Kv { layer: 0, plane: 1 };
    // Source rows of 64 bytes, byte value = row + 1; the slice takes bytes 32..48 of each of
    // 16 rows into destination rows of 16 bytes (a decode holding a quarter of the heads).
    for r in 0..16u64 {
        src.write(region, r * 64, &[r as u8 + 1; 64]).unwrap();
    }
    let (a, server) = serving(&dst, 3, true).await;
    let (report, got) = collector();
    let sender = DataSender::spawn(a, src.clone(), report, SPIN);
    let slice = Slice {
        region,
        src_offset: 32,
        dst_offset: 2048,
        len: 16,
        rows: 16,
        src_stride: 64,
        dst_stride: 16,
    };
    sender
        .send(TransferOp {
            checksum: true,
            ..op(1, 3, vec![slice])
        })
        .unwrap();
    reported(&got, 1).await;
    assert_eq!(
        *got.lock().unwrap(),
        vec![(TransferId(1), TransferOutcome::Done)]
    );
    let mut landed = vec![0u8; 256 + 32];
    dst.read(region, 2048 - 16, &mut landed).unwrap();
    let mut want = vec![0u8; 16];
    for r in 0..16u8 {
        want.extend([r + 1; 16]);
    }
    want.extend([0u8; 16]);
    assert_eq!(landed, want, "each row in its place, nothing around them");
    sender.close().await;
    let stats = server.await.unwrap().unwrap();
    assert_eq!((stats.applied, stats.refused), (1, 0));
}

#[tokio::test]
async fn short_rows_apart_in_the_destination_land_each_in_its_place_across_many_receives() {
    short_rows_land(false).await;
}

#[tokio::test]
async fn checked_short_rows_apart_in_the_destination_land_and_verify() {
    short_rows_land(true).await;
}

async fn short_rows_land(checksum: bool) {
    // 600 rows of 1000 bytes (more than the receiver's stage and read buffer, rows that
    // start off any 16-byte boundary) into rows 2000 bytes apart: the head-split layout a
    // decode holding all heads receives from a prefill holding half of them.
    let (rows, len, stride) = (600u64, 1000u64, 2000u64);
    let layout = small_layout(2048);
    let src = Arc::new(MemoryMap::allocate(layout));
    let dst = Arc::new(MemoryMap::allocate(layout));
    let region = Region::Kv { layer: 2, plane: 0 };
    let sent: Vec<u8> = (0..rows * len).map(|i| (i % 251) as u8 + 1).collect();
    src.write(region, 0, &sent).unwrap();
    let (a, server) = serving(&dst, 5, checksum).await;
    let (report, got) = collector();
    let sender = DataSender::spawn(a, src.clone(), report, SPIN);
    let slice = Slice {
        region,
        src_offset: 0,
        dst_offset: 8,
        len,
        rows: rows as u32,
        src_stride: len,
        dst_stride: stride,
    };
    sender
        .send(TransferOp {
            checksum,
            ..op(1, 5, vec![slice])
        })
        .unwrap();
    reported(&got, 1).await;
    assert_eq!(
        *got.lock().unwrap(),
        vec![(TransferId(1), TransferOutcome::Done)]
    );
    let mut landed = vec![0u8; (rows * stride) as usize];
    dst.read(region, 8, &mut landed).unwrap();
    for r in 0..rows as usize {
        let row = &landed[r * stride as usize..][..stride as usize];
        assert_eq!(
            &row[..len as usize],
            &sent[r * len as usize..][..len as usize],
            "row {r}"
        );
        assert!(
            row[len as usize..].iter().all(|b| *b == 0),
            "the gap after row {r}"
        );
    }
    sender.close().await;
    let stats = server.await.unwrap().unwrap();
    assert_eq!((stats.applied, stats.refused), (1, 0));
}

#[tokio::test]
async fn a_closed_connection_fails_unacknowledged_operations_transiently() {
    let layout = small_layout(256);
    let src = Arc::new(MemoryMap::allocate(layout));
    let (a, b) = pair().await;
    drop(b);
    let (report, got) = collector();
    let sender = DataSender::spawn(a, src, report, SPIN);
    let region = Region::Kv { layer: 0, plane: 0 };
    let _ = sender.send(op(5, 1, vec![Slice::run(region, 0, 0, 1024)]));
    sender.close().await;
    assert_eq!(
        *got.lock().unwrap(),
        vec![(TransferId(5), TransferOutcome::Transient)]
    );
}

/// One 32-byte descriptor may not make a receiver place and account millions of rows: a
/// batch whose rows exceed the receiver's `max_op_slices` closes the connection before any
/// payload byte is read, and nothing lands.
#[tokio::test]
async fn a_batch_with_more_rows_than_the_receiver_allows_closes_the_connection() {
    use tokio::io::AsyncWriteExt;
    let layout = small_layout(256);
    let dst = Arc::new(MemoryMap::allocate(layout));
    let (mut a, server) = serving(&dst, 7, false).await;
    let rows = 64 * 1024u32;
    let hostile = Slice {
        region: Region::Kv { layer: 0, plane: 0 },
        src_offset: 0,
        dst_offset: 0,
        len: 1,
        rows,
        src_stride: 1,
        dst_stride: 1,
    };
    let mut frame = Vec::new();
    kvferry_tcp::WriteHeader {
        op: TransferId(1),
        room: RoomId(7),
        generation: 0,
        slices: 1,
        payload: u64::from(rows),
        checked: false,
    }
    .encode(&mut frame);
    kvferry_tcp::encode_slice(&hostile, &mut frame);
    frame.extend(vec![0xAB; rows as usize]);
    let _ = a.write_all(&frame).await;
    let served = tokio::time::timeout(std::time::Duration::from_secs(5), server)
        .await
        .expect("the receiver ends the connection")
        .unwrap();
    assert!(served.is_err(), "{served:?}");
    let mut page = vec![0u8; 1024];
    dst.read(Region::Kv { layer: 0, plane: 0 }, 0, &mut page)
        .unwrap();
    assert!(page.iter().all(|b| *b == 0), "nothing landed");
}

/// A peer that acknowledges an operation this connection never sent broke the protocol:
/// the connection closes at once in both directions (the peer reads its end, so it knows to
/// open another), the operation in flight is reported transient for a retry elsewhere, and
/// the connection takes nothing more.
#[tokio::test]
async fn an_acknowledgement_for_an_operation_never_sent_closes_the_connection_at_once() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let layout = small_layout(16);
    let src = Arc::new(MemoryMap::allocate(layout));
    let (a, mut peer) = pair().await;
    let (report, got) = collector();
    let sender = DataSender::spawn(a, src, report, SPIN);
    let region = Region::Kv { layer: 0, plane: 0 };
    let slice = Slice::run(region, 0, 0, 1024);
    sender.send(op(1, 7, vec![slice])).unwrap();
    // The operation's header and payload arrive; the peer answers for operation 999.
    let mut frame = vec![0u8; kvferry_tcp::WRITE_HEADER_LEN + kvferry_tcp::SLICE_DESC_LEN + 1024];
    peer.read_exact(&mut frame).await.unwrap();
    let ack = kvferry_tcp::encode_ack(TransferId(999), kvferry_tcp::AckStatus::Applied);
    peer.write_all(&ack).await.unwrap();
    let mut rest = [0u8; 64];
    let end = tokio::time::timeout(std::time::Duration::from_secs(3), peer.read(&mut rest)).await;
    assert!(
        matches!(end, Ok(Ok(0)) | Ok(Err(_))),
        "the connection must close at once, got {end:?}"
    );
    assert_eq!(
        *got.lock().unwrap(),
        vec![(TransferId(1), TransferOutcome::Transient)]
    );
    assert!(sender.is_closed());
    assert!(
        sender.send(op(2, 7, vec![slice])).is_err(),
        "a closed connection takes nothing"
    );
}

/// Records every permit handed back, to see how each write ended.
struct Recording(RoomId, Mutex<Vec<WritePermit>>);

impl WriteCheck for Recording {
    fn begin(
        &self,
        room: RoomId,
        generation: Generation,
        s: &[Slice],
    ) -> Result<WritePermit, WriteRefused> {
        AllowRoom(self.0).begin(room, generation, s)
    }

    fn end(&self, permit: WritePermit, _slices: &[Slice]) {
        self.1.lock().unwrap().push(permit);
    }
}

fn checked_limits() -> Limits {
    Limits {
        max_slices: 64,
        max_bytes: 1 << 20,
        checksum: true,
    }
}

/// A checked write batch for `room`: 1024 bytes of `byte` into page 3 of layer 0 plane 0,
/// its trailer the XXH3-64 of `sent` (the bytes the writer held).
fn checked_batch(room: u64, sent: &[u8], payload: &[u8]) -> Vec<u8> {
    let slice = Slice::run(
        Region::Kv { layer: 0, plane: 0 },
        0,
        3 * 1024,
        payload.len() as u64,
    );
    checked_batch_of(room, slice, sent, payload)
}

/// A checked write batch of `slice` for `room`, its trailer the XXH3-64 of `sent`.
fn checked_batch_of(room: u64, slice: Slice, sent: &[u8], payload: &[u8]) -> Vec<u8> {
    let mut out = Vec::new();
    kvferry_tcp::WriteHeader {
        op: TransferId(9),
        room: RoomId(room),
        generation: 0,
        slices: 1,
        payload: payload.len() as u64,
        checked: true,
    }
    .encode(&mut out);
    kvferry_tcp::encode_slice(&slice, &mut out);
    out.extend_from_slice(payload);
    out.extend_from_slice(
        &{
            let mut h = kvferry_memory::Checksum::new();
            h.update(sent);
            h.digest()
        }
        .to_le_bytes(),
    );
    out
}

#[tokio::test]
async fn a_checked_write_whose_bytes_changed_on_the_way_is_acknowledged_corrupt() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dst = Arc::new(MemoryMap::allocate(small_layout(16)));
    let (mut writer, b) = pair().await;
    let check = Arc::new(Recording(RoomId(7), Mutex::new(Vec::new())));
    let server = tokio::spawn(serve_writes(
        b,
        dst.clone(),
        check.clone(),
        checked_limits(),
        SPIN,
    ));
    let sent = vec![0x11u8; 1024];
    let mut landed = sent.clone();
    landed[500] ^= 0x04; // one bit flipped in flight
    writer
        .write_all(&checked_batch(7, &sent, &landed))
        .await
        .unwrap();
    let mut ack = [0u8; kvferry_tcp::ACK_LEN];
    writer.read_exact(&mut ack).await.unwrap();
    assert_eq!(
        kvferry_tcp::decode_ack(&ack).unwrap(),
        (TransferId(9), kvferry_tcp::AckStatus::Corrupt)
    );
    // The same bytes, unchanged, are applied.
    writer
        .write_all(&checked_batch(7, &sent, &sent))
        .await
        .unwrap();
    writer.read_exact(&mut ack).await.unwrap();
    assert_eq!(
        kvferry_tcp::decode_ack(&ack).unwrap(),
        (TransferId(9), kvferry_tcp::AckStatus::Applied)
    );
    let permits = check.1.lock().unwrap().clone();
    assert_eq!(
        permits
            .iter()
            .map(|p| (p.applied, p.corrupt))
            .collect::<Vec<_>>(),
        vec![(false, true), (true, false)]
    );
    drop(writer);
    let stats = server.await.unwrap().unwrap();
    assert_eq!((stats.applied, stats.corrupt), (1, 1));
}

#[tokio::test]
async fn a_checked_write_of_rows_apart_whose_bytes_changed_on_the_way_is_acknowledged_corrupt() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let region = Region::Kv { layer: 0, plane: 0 };
    let dst = Arc::new(MemoryMap::allocate(small_layout(16)));
    let (mut writer, b) = pair().await;
    let check = Arc::new(Recording(RoomId(7), Mutex::new(Vec::new())));
    let server = tokio::spawn(serve_writes(
        b,
        dst.clone(),
        check.clone(),
        checked_limits(),
        SPIN,
    ));
    // Ten rows of 100 bytes, 200 bytes apart: received through the stage.
    let slice = Slice {
        region,
        src_offset: 0,
        dst_offset: 1024,
        len: 100,
        rows: 10,
        src_stride: 100,
        dst_stride: 200,
    };
    let sent: Vec<u8> = (0..1000u32).map(|i| (i % 7) as u8 + 1).collect();
    let mut landed = sent.clone();
    landed[550] ^= 0x10; // one bit flipped in flight
    let mut ack = [0u8; kvferry_tcp::ACK_LEN];
    for (payload, want) in [
        (&landed, kvferry_tcp::AckStatus::Corrupt),
        (&sent, kvferry_tcp::AckStatus::Applied),
    ] {
        writer
            .write_all(&checked_batch_of(7, slice, &sent, payload))
            .await
            .unwrap();
        writer.read_exact(&mut ack).await.unwrap();
        assert_eq!(
            kvferry_tcp::decode_ack(&ack).unwrap(),
            (TransferId(9), want)
        );
    }
    let mut row = vec![0u8; 200];
    for r in 0..10usize {
        dst.read(region, 1024 + 200 * r as u64, &mut row).unwrap();
        assert_eq!(&row[..100], &sent[r * 100..][..100], "row {r}");
        assert!(row[100..].iter().all(|b| *b == 0), "the gap after row {r}");
    }
    drop(writer);
    let stats = server.await.unwrap().unwrap();
    assert_eq!((stats.applied, stats.corrupt), (1, 1));
}

#[tokio::test]
async fn an_unchecked_write_on_a_checksummed_connection_closes_it() {
    use tokio::io::AsyncWriteExt;
    let dst = Arc::new(MemoryMap::allocate(small_layout(16)));
    let (mut writer, b) = pair().await;
    let server = tokio::spawn(serve_writes(
        b,
        dst,
        Arc::new(AllowRoom(RoomId(7))),
        checked_limits(),
        SPIN,
    ));
    let mut unchecked = Vec::new();
    kvferry_tcp::WriteHeader {
        op: TransferId(1),
        room: RoomId(7),
        generation: 0,
        slices: 1,
        payload: 8,
        checked: false,
    }
    .encode(&mut unchecked);
    writer.write_all(&unchecked).await.unwrap();
    assert!(
        server.await.unwrap().is_err(),
        "the connection ends with an error"
    );
}

/// `docs/PROTOCOL.md`, "Write batch": a checksummed batch on a session without the
/// checksum flag is served as on a checksummed one (applied, verified, acknowledged), not
/// refused.
#[tokio::test]
async fn a_checked_write_on_an_unchecked_connection_is_served_and_verified() {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let dst = Arc::new(MemoryMap::allocate(small_layout(16)));
    let (mut writer, b) = pair().await;
    let unchecked = Limits {
        checksum: false,
        ..checked_limits()
    };
    let check = Arc::new(Recording(RoomId(7), Mutex::new(Vec::new())));
    let server = tokio::spawn(serve_writes(b, dst.clone(), check.clone(), unchecked, SPIN));
    let sent = vec![0x22u8; 1024];
    let mut flipped = sent.clone();
    flipped[3] ^= 0x80;
    let mut ack = [0u8; kvferry_tcp::ACK_LEN];
    for (landed, status) in [
        (&sent, kvferry_tcp::AckStatus::Applied),
        (&flipped, kvferry_tcp::AckStatus::Corrupt),
    ] {
        writer
            .write_all(&checked_batch(7, &sent, landed))
            .await
            .unwrap();
        writer.read_exact(&mut ack).await.unwrap();
        assert_eq!(
            kvferry_tcp::decode_ack(&ack).unwrap(),
            (TransferId(9), status)
        );
    }
    drop(writer);
    let stats = server.await.unwrap().unwrap();
    assert_eq!((stats.applied, stats.corrupt), (1, 1));
}

/// Sends `op` with its checksum from `src` to a checked receiver into `dst` (room 7 allowed)
/// and returns what the sender reported once it reported.
async fn send_checked(
    src: Arc<MemoryMap>,
    dst: Arc<MemoryMap>,
    mut op: TransferOp,
) -> Vec<(TransferId, TransferOutcome)> {
    let (a, b) = pair().await;
    let _server = tokio::spawn(serve_writes(
        b,
        dst,
        Arc::new(AllowRoom(RoomId(7))),
        checked_limits(),
        SPIN,
    ));
    let (report, got) = collector();
    let sender = DataSender::spawn(a, src, report, SPIN);
    op.checksum = true;
    sender.send(op).unwrap();
    reported(&got, 1).await;
    let reported = got.lock().unwrap().clone();
    reported
}

#[tokio::test]
async fn a_checksummed_operation_lands_and_is_acknowledged() {
    let layout = small_layout(16);
    let src = Arc::new(MemoryMap::allocate(layout));
    let dst = Arc::new(MemoryMap::allocate(layout));
    let region = Region::Kv { layer: 1, plane: 0 };
    src.write(region, 2 * 1024, &[0x5Au8; 2048]).unwrap();
    let slices = vec![Slice::run(region, 2 * 1024, 8 * 1024, 2048)];
    assert_eq!(
        send_checked(src, dst.clone(), op(4, 7, slices)).await,
        vec![(TransferId(4), TransferOutcome::Done)]
    );
    let mut page = vec![0u8; 2048];
    dst.read(region, 8 * 1024, &mut page).unwrap();
    assert!(page.iter().all(|b| *b == 0x5A));
}

#[tokio::test]
async fn a_checksummed_operation_larger_than_what_is_hashed_ahead_lands_and_is_acknowledged() {
    // Three slices of 300 KiB: the writer hashes the first bytes after sending them and the
    // last 256 KiB before, so its trailer leaves with them; both halves must make one hash.
    let layout = small_layout(2048);
    let src = Arc::new(MemoryMap::allocate(layout));
    let dst = Arc::new(MemoryMap::allocate(layout));
    let region = Region::Kv { layer: 2, plane: 1 };
    let bytes: Vec<u8> = (0..1024 * 1024u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 13) as u8)
        .collect();
    src.write(region, 0, &bytes).unwrap();
    let piece = 300 * 1024;
    let slices = (0..3)
        .map(|i| {
            Slice::run(
                region,
                (i * piece) as u64,
                (1024 * 1024 - (i + 1) * piece) as u64,
                piece as u64,
            )
        })
        .collect();
    assert_eq!(
        send_checked(src, dst.clone(), op(5, 7, slices)).await,
        vec![(TransferId(5), TransferOutcome::Done)]
    );
    for i in 0..3 {
        let mut landed = vec![0u8; piece];
        dst.read(region, (1024 * 1024 - (i + 1) * piece) as u64, &mut landed)
            .unwrap();
        assert!(
            landed == bytes[i * piece..(i + 1) * piece],
            "slice {i} landed whole"
        );
    }
}
