//! Prefill: turning a room's released layers and the receivers' grants into operations, and
//! knowing when every one of them is done.

use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use tracing::warn;

use crate::api::OpKind;
use crate::codec::{ProgressStage, SKIP_ALL};
use crate::ids::{Generation, RoomId, SessionId};
use crate::layout::Slice;
use crate::plan::{plan_aux, plan_extras, plan_kv, plan_kv_heads, HeadSide, OpLimits};
use crate::state::{FailureReason, KvPoll};

use super::{Endpoint, Op, SenderRoom, Side};

/// An operation planned for a session: its kind, the layers it carries, its slices.
type PlannedOp = (SessionId, OpKind, Range<usize>, Vec<Slice>);

impl Endpoint {
    /// Plans every released, not yet planned layer of a bootstrapped sender room.
    pub(super) fn plan_room(&mut self, now: Instant, room: RoomId) {
        let limits = OpLimits {
            max_bytes: self.config.max_op_bytes,
            max_slices: self.config.max_op_slices,
        };
        let layout = self.local.layout;
        let extras = &self.local.extras;
        let first_layer = self.local.layer_start;
        let owned = self.owned_layers();
        let writes_aux = self.local.writes_aux;
        let from = HeadSide {
            page_bytes: layout.page_bytes,
            heads: self.local.heads,
        };
        let sessions = &self.sessions;
        let Some((generation, s)) = self.rooms.live_sender(room) else {
            return;
        };
        // Once the room's length is known, a grant its chunks leave partly unwritten fails
        // the room now: a `RoomStatus(0)` must never stand for pages nobody wrote.
        if s.last_seen && !s.grant_checked {
            s.grant_checked = true;
            if let Some(why) = s.grant_shortfall(&layout, writes_aux) {
                warn!(%room, %why, "the room's chunks do not cover the decode's grant");
                self.conclude(now, room, KvPoll::Failed(FailureReason::GrantMismatch));
                return;
            }
        }
        let mut new_ops: Vec<PlannedOp> = Vec::new();
        let mut overflow = false;
        for c in s.chunks.iter_mut() {
            let end = c.dst_start as usize + c.src.len();
            // A receiver's grant covers the room's pages after the ones it skips.
            if s.receivers
                .iter()
                .any(|x| x.skip != SKIP_ALL && x.dst.len().saturating_add(x.skip as usize) < end)
            {
                overflow = true;
                break;
            }
            // Layers ready now and not yet planned, grouped into consecutive ranges so that
            // whole-batch chunks become as few operations as the limits allow.
            let mut l = 0;
            while l < owned {
                if !c.released.get(l) || c.planned.get(l) {
                    l += 1;
                    continue;
                }
                let start = l;
                while l < owned
                    && c.released.get(l)
                    && !c.planned.get(l)
                    && (!c.layerwise || l == start)
                {
                    c.planned.set(l);
                    l += 1;
                }
                let layers = first_layer + start as u16..first_layer + l as u16;
                for x in &s.receivers {
                    // Room pages `first..end` of this chunk go; the ones before are skipped.
                    let first = (c.dst_start as usize).max(x.skip as usize);
                    if x.skip == SKIP_ALL || first >= end {
                        continue;
                    }
                    let src = &c.src[first - c.dst_start as usize..];
                    let dst = &x.dst[first - x.skip as usize..end - x.skip as usize];
                    let to = sessions
                        .get(&x.session)
                        .and_then(|s| s.peer)
                        .map(|p| HeadSide {
                            page_bytes: p.layout.page_bytes,
                            heads: p.heads,
                        });
                    let ops = match to {
                        // A peer that holds other heads gets, for every token, the ones it shares.
                        Some(to) if to != from => {
                            plan_kv_heads(layout.planes, from, to, layers.clone(), src, dst, limits)
                        }
                        _ => plan_kv(&layout, layers.clone(), src, dst, limits),
                    };
                    for slices in ops {
                        new_ops.push((x.session, OpKind::Kv, start..l, slices));
                    }
                }
            }
        }
        if overflow {
            warn!(%room, "chunk exceeds the pages decode granted");
            self.conclude(now, room, KvPoll::Failed(FailureReason::GrantMismatch));
            return;
        }
        while s
            .chunks
            .front()
            .is_some_and(|c| c.planned.count() as usize == owned)
        {
            s.chunks.pop_front();
        }
        if s.last_seen && s.chunks.is_empty() && writes_aux {
            for x in s.receivers.iter().filter(|x| x.skip != SKIP_ALL) {
                let slices = plan_aux(&layout, s.aux_src, x.aux_slot, s.state_src, x.state_slot);
                if !slices.is_empty() {
                    new_ops.push((x.session, OpKind::Aux, 0..0, slices));
                }
                let asked = |p: usize| x.extras.get(p).map_or(&[][..], |v| &v[..]);
                let copies = sessions
                    .get(&x.session)
                    .map_or(&[][..], |s| &s.extra_copies[..]);
                for (p, src) in s.extras_src.iter().enumerate() {
                    for slices in plan_extras(extras, copies, p, src, asked(p), limits) {
                        new_ops.push((x.session, OpKind::Aux, 0..0, slices));
                    }
                }
            }
            s.aux_src = None;
            s.state_src = None;
            s.extras_src = Vec::new();
        }
        s.ops_live += new_ops.len() as u32;
        if s.layer_live.len() < owned {
            s.layer_live.resize(owned, 0);
        }
        for (_, _, layers, _) in &new_ops {
            for n in &mut s.layer_live[layers.clone()] {
                *n += 1;
            }
        }
        let any = !new_ops.is_empty();
        self.queue_planned(now, room, generation, new_ops);
        if any {
            self.set_state(room, KvPoll::Transferring);
            self.send_progress(now, room, ProgressStage::Transferring);
        }
        self.report_delivered_layers(room);
        self.check_sender_complete(now, room);
    }

    /// Puts a room's planned operations at the back of their sessions' queues.
    fn queue_planned(
        &mut self,
        now: Instant,
        room: RoomId,
        generation: Generation,
        new_ops: Vec<PlannedOp>,
    ) {
        for (sid, kind, layers, slices) in new_ops {
            let op = Op::queued(sid, Some(room), generation, kind, Arc::from(slices), layers);
            self.counters.ops_planned += 1;
            self.counters.bytes_planned += op.bytes;
            let id = self.ops.add(op);
            if let Some(x) = self.sessions.get_mut(&sid) {
                x.ops.push_back(id);
                x.last_targeted = now;
            }
            self.mark_ready(sid);
        }
    }

    pub(super) fn check_sender_complete(&mut self, now: Instant, room: RoomId) {
        let Some(r) = self.rooms.get(&room) else {
            return;
        };
        let Side::Sender(s) = &r.side else { return };
        let complete = !r.state.is_terminal()
            && r.state != KvPoll::Bootstrapping
            && s.last_seen
            && s.chunks.is_empty()
            && s.ops_live == 0;
        if complete {
            self.conclude(now, room, KvPoll::Success);
        }
    }
}

impl SenderRoom {
    /// What of a receiver's grant the room's chunks, all sent, leave unwritten (or write
    /// past), if anything: the grant and the chunks must describe the same room.
    fn grant_shortfall(&self, layout: &crate::layout::Layout, writes_aux: bool) -> Option<String> {
        let room_pages = self.next_dst;
        for x in self.receivers.iter().filter(|x| x.skip != SKIP_ALL) {
            let wanted = u64::from(x.skip) + x.dst.len() as u64;
            if wanted != u64::from(room_pages) {
                return Some(format!(
                    "the chunks hold {room_pages} room pages, the grant skips {} and asks for {}",
                    x.skip,
                    x.dst.len()
                ));
            }
            if !writes_aux {
                continue;
            }
            if x.aux_slot.is_some() && layout.aux_bytes > 0 && self.aux_src.is_none() {
                return Some("an aux row was granted, the last chunk names none".into());
            }
            if x.state_slot.is_some() && layout.state_bytes > 0 && self.state_src.is_none() {
                return Some("a state slot was granted, the last chunk names none".into());
            }
            // Extra items pair one to one: a list the decode asked for that differs in
            // length from ours would leave its items unwritten or ours unsent.
            for (pool, wanted) in x.extras.iter().enumerate() {
                let ours = self.extras_src.get(pool).map_or(0, Vec::len);
                if !wanted.is_empty() && ours != wanted.len() {
                    return Some(format!(
                        "extra pool {pool}: the last chunk names {ours} items, the grant {}",
                        wanted.len()
                    ));
                }
            }
        }
        None
    }
}
