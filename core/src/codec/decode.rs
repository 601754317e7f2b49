//! Reading frames: the body of each frame type, field by field, refusing what has no
//! meaning (see `DecodeError`).

use super::*;

/// Bounds-checked little-endian reader over one frame body.
struct Reader<'a> {
    buf: &'a [u8],
    ty: u8,
}

impl<'a> Reader<'a> {
    fn take(&mut self, n: usize) -> Result<&'a [u8], DecodeError> {
        if self.buf.len() < n {
            return Err(DecodeError::Truncated { ty: self.ty });
        }
        let (head, tail) = self.buf.split_at(n);
        self.buf = tail;
        Ok(head)
    }

    fn u8(&mut self) -> Result<u8, DecodeError> {
        Ok(self.take(1)?[0])
    }

    fn u16(&mut self) -> Result<u16, DecodeError> {
        let b = self.take(2)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }

    fn u32(&mut self) -> Result<u32, DecodeError> {
        let b = self.take(4)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }

    fn u64(&mut self) -> Result<u64, DecodeError> {
        let b = self.take(8)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], DecodeError> {
        let mut a = [0u8; N];
        a.copy_from_slice(self.take(N)?);
        Ok(a)
    }

    fn opt_u32(&mut self) -> Result<Option<u32>, DecodeError> {
        Ok(Some(self.u32()?).filter(|v| *v != u32::MAX))
    }

    /// A `u32` count and that many (start, len) runs, none empty or past `u32::MAX`.
    fn runs(&mut self) -> Result<SmallVec<[PageRun; 4]>, DecodeError> {
        let count = self.u32()? as usize;
        // Each run is 8 bytes: bound the count by what is left before allocating.
        if count > self.buf.len() / 8 {
            return Err(DecodeError::Truncated { ty: self.ty });
        }
        let mut runs = SmallVec::with_capacity(count);
        for _ in 0..count {
            let run = PageRun {
                start: self.u32()?,
                len: self.u32()?,
            };
            if run.len == 0 || run.start.checked_add(run.len).is_none() {
                return Err(self.invalid("page run"));
            }
            runs.push(run);
        }
        Ok(runs)
    }

    /// A hello's extra pools: a `u8` count, then per pool its items, a `u16` tensor count
    /// and each tensor's item bytes (none zero).
    fn extra_pools(&mut self) -> Result<Vec<ExtraPool>, DecodeError> {
        let pools = usize::from(self.u8()?);
        if pools > MAX_EXTRA_POOLS {
            return Err(self.invalid("extra pools"));
        }
        let mut out = Vec::with_capacity(pools);
        for _ in 0..pools {
            let items = self.u32()?;
            let tensors = usize::from(self.u16()?);
            if tensors == 0 || tensors > MAX_EXTRA_TENSORS || tensors > self.buf.len() / 4 {
                return Err(self.invalid("extra tensors"));
            }
            let item_bytes = (0..tensors)
                .map(|_| self.u32())
                .collect::<Result<Vec<_>, _>>()?;
            if item_bytes.contains(&0) {
                return Err(self.invalid("extra item bytes"));
            }
            let parts = match self.u8()? {
                0 => Vec::new(),
                1 => item_bytes
                    .iter()
                    .map(|b| self.item_parts(*b))
                    .collect::<Result<Vec<_>, _>>()?,
                _ => return Err(self.invalid("extra parts")),
            };
            out.push(ExtraPool {
                items,
                item_bytes,
                parts,
            });
        }
        Ok(out)
    }

    /// One split tensor's parts: a `u8` count, then each part's offset, rows, stride (u32),
    /// units, first, count (u16) and unit bytes (u32), every one inside an item of `item`.
    fn item_parts(&mut self, item: u32) -> Result<Vec<ItemPart>, DecodeError> {
        let n = usize::from(self.u8()?);
        if n > MAX_ITEM_PARTS {
            return Err(self.invalid("extra parts"));
        }
        let mut parts = Vec::with_capacity(n);
        for _ in 0..n {
            let part = ItemPart {
                offset: self.u32()?,
                rows: self.u32()?,
                stride: self.u32()?,
                units: self.u16()?,
                first: self.u16()?,
                count: self.u16()?,
                unit_bytes: self.u32()?,
            };
            if part.end().map_or(true, |end| end > u64::from(item)) {
                return Err(self.invalid("extra parts"));
            }
            parts.push(part);
        }
        Ok(parts)
    }

    fn room(&mut self) -> Result<(RoomId, Generation), DecodeError> {
        Ok((RoomId(self.u64()?), self.u32()?))
    }

    fn invalid(&self, field: &'static str) -> DecodeError {
        DecodeError::InvalidField { ty: self.ty, field }
    }

    fn reason(&mut self) -> Result<FailureReason, DecodeError> {
        let code = self.u8()?;
        FailureReason::from_code(code).ok_or(self.invalid("reason"))
    }

    fn finish(self) -> Result<(), DecodeError> {
        if self.buf.is_empty() {
            Ok(())
        } else {
            Err(DecodeError::TrailingBytes { ty: self.ty })
        }
    }
}

/// The fields of a `RoomRequest` after its room and generation, through the body's end.
fn room_request(
    mut r: Reader<'_>,
    room: RoomId,
    generation: Generation,
) -> Result<Message, DecodeError> {
    let receivers = r.u8()?;
    if receivers == 0 {
        return Err(r.invalid("receivers"));
    }
    let skip_pages = r.u32()?;
    let aux_slot = r.opt_u32()?;
    let state_slot = r.opt_u32()?;
    let prompt = match (r.u8()?, r.u64()?) {
        (0, 0) => None,
        (1, digest) => Some(PromptDigest(digest)),
        _ => return Err(r.invalid("prompt")),
    };
    let pages = r.runs()?;
    let pools = usize::from(r.u8()?);
    if pools > MAX_EXTRA_POOLS {
        return Err(r.invalid("extra pools"));
    }
    let extras = (0..pools)
        .map(|_| r.runs())
        .collect::<Result<Vec<_>, _>>()?;
    let asks_extras = extras.iter().any(|x| !x.is_empty());
    if skip_pages == SKIP_ALL
        && (!pages.is_empty() || aux_slot.or(state_slot).is_some() || asks_extras)
    {
        return Err(r.invalid("skip_pages"));
    }
    r.finish()?;
    Ok(Message::RoomRequest(RoomRequest {
        room,
        generation,
        receivers,
        skip_pages,
        pages,
        aux_slot,
        state_slot,
        prompt,
        extras,
    }))
}

// One arm per message type, in type order: the wire format reads as one table beside
// docs/PROTOCOL.md, which splitting it would scatter.
pub(super) fn decode_body(ty: u8, body: &[u8]) -> Result<Message, DecodeError> {
    let mut r = Reader { buf: body, ty };
    let msg = match ty {
        ty::CHALLENGE => Message::Challenge {
            nonce: r.array::<NONCE_LEN>()?,
        },
        ty::HELLO => {
            let role = Role::from_code(r.u8()?).ok_or(r.invalid("role"))?;
            let rank = r.u16()?;
            let node = NodeId(r.u64()?);
            let incarnation = Incarnation(r.u64()?);
            let layout = Layout {
                layers: r.u16()?,
                planes: r.u8()?,
                page_bytes: r.u32()?,
                pages: r.u32()?,
                aux_bytes: r.u32()?,
                state_bytes: r.u32()?,
                slots: r.u32()?,
            };
            if layout.planes == 0 || layout.planes > 2 {
                return Err(r.invalid("planes"));
            }
            if layout.page_bytes == 0 {
                return Err(r.invalid("page_bytes"));
            }
            if layout.layers == 0 {
                return Err(r.invalid("layers"));
            }
            let layer_start = r.u16()?;
            let layer_end = r.u16()?;
            if layer_start >= layer_end || layer_end > layout.layers {
                return Err(r.invalid("layer range"));
            }
            let writes_aux = match r.u8()? {
                0 => false,
                1 => true,
                _ => return Err(r.invalid("writes_aux")),
            };
            let heads = Heads {
                total: r.u16()?,
                start: r.u16()?,
                count: r.u16()?,
                head_bytes: r.u32()?,
            };
            if heads.page_tokens(layout.page_bytes).is_none() {
                return Err(r.invalid("heads"));
            }
            let heartbeat_interval_ms = r.u32()?;
            if !(1..=MAX_HEARTBEAT_INTERVAL_MS).contains(&heartbeat_interval_ms) {
                return Err(r.invalid("heartbeat_interval_ms"));
            }
            let heartbeat_misses = r.u32()?;
            if !(1..=MAX_HEARTBEAT_MISSES).contains(&heartbeat_misses) {
                return Err(r.invalid("heartbeat_misses"));
            }
            Message::Hello(Hello {
                role,
                rank,
                node,
                incarnation,
                layout,
                layer_start,
                layer_end,
                writes_aux,
                heads,
                heartbeat_interval_ms,
                heartbeat_misses,
                proof: r.array::<PROOF_LEN>()?,
                checksum: match r.u8()? {
                    0 => false,
                    1 => true,
                    _ => return Err(r.invalid("flags")),
                },
                extras: r.extra_pools()?,
            })
        }
        ty::ROOM_PENDING => {
            let (room, generation) = r.room()?;
            Message::RoomPending {
                room,
                generation,
                queue_position: r.u32()?,
            }
        }
        ty::ROOM_REQUEST => {
            let (room, generation) = r.room()?;
            // Whatever else is wrong, the requester is told about this room: a request that
            // cannot be served is answered, never left to its deadline.
            return room_request(r, room, generation).map_err(|e| {
                DecodeError::InvalidRoomRequest {
                    room,
                    generation,
                    field: match e {
                        DecodeError::InvalidField { field, .. } => field,
                        _ => "length",
                    },
                }
            });
        }
        ty::ROOM_STATUS => {
            let (room, generation) = r.room()?;
            let failure = match r.u8()? {
                0 => None,
                c => Some(FailureReason::from_code(c).ok_or(r.invalid("reason"))?),
            };
            Message::RoomStatus {
                room,
                generation,
                failure,
            }
        }
        ty::PROGRESS => {
            let (room, generation) = r.room()?;
            let stage = match r.u8()? {
                1 => ProgressStage::Queued,
                2 => ProgressStage::Computing,
                3 => ProgressStage::Transferring,
                _ => return Err(r.invalid("stage")),
            };
            Message::Progress {
                room,
                generation,
                stage,
            }
        }
        ty::ABORT => {
            let (room, generation) = r.room()?;
            Message::Abort {
                room,
                generation,
                reason: r.reason()?,
            }
        }
        ty::ABORT_ACK => {
            let (room, generation) = r.room()?;
            Message::AbortAck { room, generation }
        }
        ty::HEARTBEAT => Message::Heartbeat {
            free_pages: r.u32()?,
            queued_rooms: r.u32()?,
            frames_received: r.u64()?,
        },
        ty::PROBE => Message::Probe { nonce: r.u64()? },
        ty::PROBE_ACK => Message::ProbeAck { nonce: r.u64()? },
        ty::ERROR => {
            let code = ErrorCode::from_code(r.u16()?).ok_or(r.invalid("code"))?;
            let len = r.u16()? as usize;
            if len > MAX_DETAIL_LEN {
                return Err(r.invalid("detail length"));
            }
            let detail =
                String::from_utf8(r.take(len)?.to_vec()).map_err(|_| r.invalid("detail"))?;
            Message::Error { code, detail }
        }
        ty::OP_CHECKSUM => {
            let (room, generation) = r.room()?;
            let checksum = r.u64()?;
            let n = usize::from(r.u16()?);
            if n == 0 || n > MAX_CHECKED_RANGES || n > r.buf.len() / DESCRIPTOR_LEN {
                return Err(r.invalid("ranges"));
            }
            let ranges = (0..n)
                .map(|_| {
                    let region = Region::from_code(r.u32()?).ok_or(r.invalid("region"))?;
                    let offset = r.u64()?;
                    let len = r.u64()?;
                    let rows = r.u32()?;
                    let stride = r.u64()?;
                    if rows_end(offset, len, rows, stride).is_none() {
                        return Err(r.invalid("range"));
                    }
                    Ok(LandedRange {
                        region,
                        offset,
                        len,
                        rows,
                        stride,
                    })
                })
                .collect::<Result<Vec<_>, _>>()?;
            let rows: u64 = ranges.iter().map(|r| u64::from(r.rows)).sum();
            if rows > MAX_CHECKED_RANGES as u64 {
                return Err(r.invalid("ranges"));
            }
            Message::OpChecksum {
                room,
                generation,
                checksum,
                ranges,
            }
        }
        ty::TRANSPORT => {
            let len = r.u16()? as usize;
            if len > MAX_TRANSPORT_LEN {
                return Err(r.invalid("transport length"));
            }
            Message::Transport {
                payload: r.take(len)?.to_vec(),
            }
        }
        other => return Err(DecodeError::UnknownType(other)),
    };
    r.finish()?;
    Ok(msg)
}
