//! The embedder's room calls, written once for every runtime over [`ShardCalls`]: how a call
//! reaches the driver of one shard is all a runtime supplies (a lock on tokio, a closure sent
//! to the shard's thread on glommio). Room `r` lives on shard `r mod shards`
//! ([`shard_of`]); a peer is the list of its addresses on every shard.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Mutex;

use kvferry_core::{
    ApiError, Capacity, Chunk, Counters, FailureReason, Generation, Grant, Link, PromptDigest,
    RoomId, SessionId, TargetId,
};
use tokio::sync::oneshot;

use crate::{shard_of, NodeError, PeerId, RoomHandle};
use crate::{Driver, Host};

/// How an embedder's call reaches the driver of one of a node's shards.
pub trait ShardCalls: Send + Sync + 'static {
    /// The runtime side of the driver loop.
    type Host: Host;

    /// How many shards (drivers) the node runs; a tokio node is one.
    fn shards(&self) -> usize;

    /// Runs `f` on the driver of `shard` and gives back its result (`ShutDown` when the
    /// shard is gone).
    fn call<T, F>(&self, shard: usize, f: F) -> impl Future<Output = Result<T, NodeError>> + Send
    where
        T: Send + 'static,
        F: FnOnce(&mut Driver<Self::Host>) -> T + Send + 'static;
}

/// A node's room calls and its peer table over any runtime's shards.
#[derive(Debug)]
pub struct Embedder<C> {
    calls: C,
    peers: Mutex<PeerTable>,
}

/// Per peer, per shard of this node: the links to each of the peer's addresses. A peer
/// disconnected or let go leaves no entry; ids are not reused.
#[derive(Debug, Default)]
struct PeerTable {
    next: u32,
    links: std::collections::HashMap<u32, Vec<Vec<Link>>>,
}

impl PeerTable {
    fn add(&mut self, per_shard: Vec<Vec<Link>>) -> PeerId {
        let id = self.next;
        self.next = self.next.wrapping_add(1);
        self.links.insert(id, per_shard);
        PeerId(id)
    }

    /// Forgets every peer with a link among `targets` of `shard` (the core let them go as
    /// idle). Its other links stay with their cores until those let them go too: a room may
    /// still be on one, and no new room can reach them.
    fn forget(&mut self, shard: usize, targets: &[TargetId]) {
        if targets.is_empty() {
            return;
        }
        self.links.retain(|_, per_shard| {
            !per_shard.get(shard).is_some_and(|links| {
                links
                    .iter()
                    .any(|l| matches!(l, Link::Target(t) if targets.contains(t)))
            })
        });
    }
}

fn api<T>(result: Result<Result<T, ApiError>, NodeError>) -> Result<T, NodeError> {
    result?.map_err(NodeError::from)
}

impl<C: ShardCalls> Embedder<C> {
    /// Room calls over `calls`, with no peer yet.
    pub fn new(calls: C) -> Self {
        Embedder {
            calls,
            peers: Mutex::new(PeerTable::default()),
        }
    }

    /// The runtime's way into its shards.
    pub fn calls(&self) -> &C {
        &self.calls
    }

    /// Opens sessions from every shard to each of a peer's `addrs` (one per shard of the
    /// peer) and waits for their handshakes; names the peer. If one fails, the sessions
    /// opened so far are closed again: a failed call leaves nothing behind. Each connection
    /// gets one attempt of at most 8 x `connect_timeout` (a link slower than
    /// `connect_timeout` is still reached; one that never answers fails after it).
    pub async fn connect(&self, addrs: Vec<SocketAddr>) -> Result<PeerId, NodeError> {
        let mut per_shard = Vec::with_capacity(self.calls.shards());
        for shard in 0..self.calls.shards() {
            per_shard.push(Vec::with_capacity(addrs.len()));
            for &addr in &addrs {
                let (tx, rx) = oneshot::channel();
                // The dial is bounded by the core's connect timeout, the handshake by its
                // handshake timeout.
                let opened = match self.calls.call(shard, move |d| d.dial(addr, tx)).await {
                    Ok(()) => rx.await.map_err(|_| NodeError::ShutDown).and_then(|r| r),
                    Err(e) => Err(e),
                };
                match opened {
                    Ok(session) => per_shard[shard].push(Link::Session(session)),
                    Err(e) => {
                        self.let_go(per_shard).await;
                        return Err(e);
                    }
                }
            }
        }
        Ok(self.add_peer(per_shard))
    }

    /// Lets a peer go: its kept links are dialed no more, its sessions close (rooms still
    /// on them fail `AbortedLocally`; the peer hears an orderly goodbye), waits for it end
    /// with [`NodeError::Disconnected`], and its id is unknown from now on.
    pub async fn disconnect(&self, peer: PeerId) -> Result<(), NodeError> {
        let per_shard = {
            let mut table = self.table();
            table
                .links
                .remove(&peer.0)
                .ok_or(NodeError::UnknownPeer(peer))?
        };
        self.let_go(per_shard).await;
        Ok(())
    }

    /// Disconnects `per_shard`'s links on their shards (a shard gone has let them go).
    async fn let_go(&self, per_shard: Vec<Vec<Link>>) {
        for (shard, links) in per_shard.into_iter().enumerate() {
            if !links.is_empty() {
                let _ = self.calls.call(shard, move |d| d.disconnect(&links)).await;
            }
        }
    }

    /// Replaces the injected data-path faults on every shard (demos and tests).
    pub async fn set_faults(&self, faults: Option<crate::FaultPlan>) {
        for shard in 0..self.calls.shards() {
            let _ = self.calls.call(shard, move |d| d.set_faults(faults)).await;
        }
    }

    /// Names a peer by its links, per shard of this node.
    pub fn add_peer(&self, per_shard: Vec<Vec<Link>>) -> PeerId {
        self.table().add(per_shard)
    }

    fn table(&self) -> std::sync::MutexGuard<'_, PeerTable> {
        self.peers.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn peer(&self, peer: PeerId) -> Result<Vec<Vec<Link>>, NodeError> {
        self.table()
            .links
            .get(&peer.0)
            .cloned()
            .ok_or(NodeError::UnknownPeer(peer))
    }

    /// Forgets the peers whose kept links any shard's core let go as idle.
    async fn forget_let_go(&self) {
        for shard in 0..self.calls.shards() {
            if let Ok(targets) = self.calls.call(shard, |d| d.take_let_go()).await {
                self.table().forget(shard, &targets);
            }
        }
    }

    /// Whether `peer` names a peer of this node: `false` once it was disconnected, or let
    /// go after the core's `peer_idle_timeout` unused (connect again to use it).
    pub async fn knows_peer(&self, peer: PeerId) -> bool {
        self.forget_let_go().await;
        self.table().links.contains_key(&peer.0)
    }

    /// The link to each of `peers` on the shard owning `room` (address `room mod n`).
    fn links_for(&self, room: RoomId, peers: &[PeerId]) -> Result<Vec<Link>, NodeError> {
        let shard = shard_of(room, self.calls.shards());
        let table = self.table();
        peers
            .iter()
            .map(|p| {
                let per_shard = table.links.get(&p.0).ok_or(NodeError::UnknownPeer(*p))?;
                let links = per_shard.get(shard).ok_or(NodeError::UnknownPeer(*p))?;
                if links.is_empty() {
                    return Err(NodeError::UnknownPeer(*p));
                }
                Ok(links[shard_of(room, links.len())])
            })
            .collect()
    }

    fn on_room<T, F>(
        &self,
        room: RoomId,
        f: F,
    ) -> impl Future<Output = Result<T, NodeError>> + Send + '_
    where
        T: Send + 'static,
        F: FnOnce(&mut Driver<C::Host>) -> T + Send + 'static,
    {
        self.calls.call(shard_of(room, self.calls.shards()), f)
    }

    /// A peer this node keeps connected to on every shard (dialed again whenever lost). If a
    /// shard refuses (its shutdown began), the shards that took it let it go again.
    pub async fn connect_persistent(&self, addrs: Vec<SocketAddr>) -> Result<PeerId, NodeError> {
        self.forget_let_go().await;
        let mut per_shard = Vec::with_capacity(self.calls.shards());
        for shard in 0..self.calls.shards() {
            let addrs = addrs.clone();
            let added = self
                .calls
                .call(shard, move |d| {
                    let mut links = Vec::with_capacity(addrs.len());
                    for a in addrs {
                        match d.add_target(a) {
                            Ok(t) => links.push(Link::Target(t)),
                            Err(e) => {
                                d.disconnect(&links);
                                return Err(NodeError::from(e));
                            }
                        }
                    }
                    Ok(links)
                })
                .await
                .and_then(|r| r);
            match added {
                Ok(links) => per_shard.push(links),
                Err(e) => {
                    self.let_go(per_shard).await;
                    return Err(e);
                }
            }
        }
        Ok(self.add_peer(per_shard))
    }

    /// Waits until every persistent link to `peer` reached its first verdict.
    pub async fn reach(&self, peer: PeerId) -> Result<(), NodeError> {
        self.forget_let_go().await;
        for (shard, links) in self.peer(peer)?.into_iter().enumerate() {
            for link in links {
                // A session the embedder opened was reached when it was opened.
                let Link::Target(target) = link else { continue };
                let (tx, rx) = oneshot::channel();
                self.calls
                    .call(shard, move |d| d.on_target(target, tx))
                    .await?;
                rx.await.map_err(|_| NodeError::ShutDown)??;
            }
        }
        Ok(())
    }

    /// Why a persistent peer is unreachable now (down for its whole `unreachable_timeout`),
    /// or `None` while it has a session or may still come back; answers at once
    /// (`ShutDown` once this node's shutdown began: it keeps no peer any more).
    pub async fn unreachable(&self, peer: PeerId) -> Result<Option<FailureReason>, NodeError> {
        self.forget_let_go().await;
        for (shard, links) in self.peer(peer)?.into_iter().enumerate() {
            for link in links {
                let Link::Target(target) = link else { continue };
                let found = self
                    .calls
                    .call(shard, move |d| {
                        let e = d.endpoint();
                        e.may_connect().map(|()| e.target_unreachable(target))
                    })
                    .await?
                    .map_err(NodeError::from)?;
                if found.is_some() {
                    return Ok(found);
                }
            }
        }
        Ok(None)
    }

    /// Decode: opens a receiver room fed by `peers`.
    pub async fn open_receiver(
        &self,
        room: RoomId,
        generation: Generation,
        peers: Vec<PeerId>,
        grant: Option<Grant>,
    ) -> Result<RoomHandle, NodeError> {
        let links = self.links_for(room, &peers)?;
        let via = links.clone();
        let (opened, let_go) = self
            .on_room(room, move |d| {
                let opened = d.open_room(room, |e, now| {
                    e.open_receiver_via(now, room, generation, &via, grant)
                });
                (opened, d.take_let_go())
            })
            .await?;
        self.table()
            .forget(shard_of(room, self.calls.shards()), &let_go);
        opened.map_err(|e| match e {
            // Let go as idle between the lookup and the open: the peer is unknown now.
            ApiError::UnknownTarget(t) => links
                .iter()
                .position(|l| *l == Link::Target(t))
                .map_or(NodeError::from(e), |i| NodeError::UnknownPeer(peers[i])),
            e => NodeError::from(e),
        })
    }

    /// Decode: grants a room its pages.
    pub async fn grant_pages(&self, room: RoomId, grant: Grant) -> Result<(), NodeError> {
        api(self
            .on_room(room, move |d| {
                d.with(|e, now| e.grant_pages(now, room, grant))
            })
            .await)
    }

    /// Whether this node may listen on `addr` (the core's rule: beyond loopback only with a
    /// cluster token of its own).
    pub async fn check_listen(&self, addr: SocketAddr) -> Result<(), NodeError> {
        let loopback = addr.ip().is_loopback();
        api(self
            .calls
            .call(0, move |d| d.endpoint().check_listen(loopback))
            .await)
    }

    /// Prefill: opens a sender room for the KV of `prompt`'s tokens (`None`: unchecked).
    pub async fn open_sender(
        &self,
        room: RoomId,
        generation: Generation,
        prompt: Option<PromptDigest>,
    ) -> Result<RoomHandle, NodeError> {
        api(self
            .on_room(room, move |d| {
                d.open_room(room, |e, now| e.open_sender(now, room, generation, prompt))
            })
            .await)
    }

    /// Prefill: sends the next chunk of a room.
    pub async fn send_chunk(&self, room: RoomId, chunk: Chunk) -> Result<(), NodeError> {
        api(self
            .on_room(room, move |d| {
                d.with(|e, now| e.send_chunk(now, room, chunk))
            })
            .await)
    }

    /// Prefill: layer `layer` of `rooms` finished its forward pass.
    pub async fn mark_layer_ready(&self, rooms: Vec<RoomId>, layer: u16) -> Result<(), NodeError> {
        let n = self.calls.shards();
        let mut by_shard: Vec<Vec<RoomId>> = vec![Vec::new(); n];
        for r in rooms {
            by_shard[shard_of(r, n)].push(r);
        }
        for (shard, rooms) in by_shard.into_iter().enumerate() {
            if rooms.is_empty() {
                continue;
            }
            api(self
                .calls
                .call(shard, move |d| {
                    d.with(|e, now| e.mark_layer_ready(now, &rooms, layer))
                })
                .await)?;
        }
        Ok(())
    }

    /// Decode: free capacity advertised in heartbeats; each shard advertises its share, so
    /// the sum over a peer's sessions is the truth.
    pub async fn set_capacity(&self, capacity: Capacity) {
        let n = self.calls.shards() as u32;
        for shard in 0..n {
            let extra = u32::from(shard < capacity.free_pages % n);
            let share = Capacity {
                free_pages: capacity.free_pages / n + extra,
                queued_rooms: capacity.queued_rooms,
            };
            let _ = self
                .calls
                .call(shard as usize, move |d| {
                    d.with(|e, _| e.set_capacity(share))
                })
                .await;
        }
    }

    /// Decode: the room waits for capacity behind `position` others.
    pub async fn set_queue_position(&self, room: RoomId, position: u32) -> Result<(), NodeError> {
        api(self
            .on_room(room, move |d| {
                d.with(|e, now| e.set_queue_position(now, room, position))
            })
            .await)
    }

    /// Aborts a room locally.
    pub async fn abort(&self, room: RoomId) -> Result<(), NodeError> {
        api(self
            .on_room(room, move |d| d.with(|e, now| e.abort(now, room)))
            .await)
    }

    /// The core's counters of one shard.
    pub async fn shard_counters(&self, shard: usize) -> Result<Counters, NodeError> {
        self.calls
            .call(shard, |d| d.endpoint().counters().clone())
            .await
    }

    /// The path each live session of every shard moves its operations on (sessions whose
    /// path is not chosen yet are left out).
    pub async fn data_paths(&self) -> Vec<(usize, SessionId, crate::DataPath)> {
        let mut all = Vec::new();
        for shard in 0..self.calls.shards() {
            if let Ok(paths) = self.calls.call(shard, |d| d.session_paths()).await {
                all.extend(paths.into_iter().map(|(sid, path)| (shard, sid, path)));
            }
        }
        all
    }

    /// The data connections each session of every shard holds.
    pub async fn data_connections(&self) -> Vec<(usize, SessionId, usize)> {
        let mut all = Vec::new();
        for shard in 0..self.calls.shards() {
            if let Ok(counts) = self
                .calls
                .call(shard, |d| d.session_data_connections())
                .await
            {
                all.extend(counts.into_iter().map(|(sid, n)| (shard, sid, n)));
            }
        }
        all
    }

    /// The core's counters summed over every shard.
    pub async fn counters(&self) -> Counters {
        let mut total = Counters::default();
        for shard in 0..self.calls.shards() {
            if let Ok(c) = self.shard_counters(shard).await {
                total.add(&c);
            }
        }
        total
    }
}
