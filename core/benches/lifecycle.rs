//! Full room lifecycles (open, request, chunk, plan, transfer, status, release) through the
//! core, with no data movement. Reports rooms per second.

use std::time::{Duration, Instant};

use criterion::{criterion_group, criterion_main, BatchSize, Criterion, Throughput};
use kvferry_core::sim::{fast_config, small_layout, Faults, Sim, Workload};
use kvferry_core::{
    Chunk, Endpoint, EndpointInfo, Grant, Incarnation, NodeId, Role, RoomId, SessionId,
    TransferOutcome,
};

const ROOMS: usize = 1000;

fn sim_with_workload() -> Sim {
    let mut sim = Sim::new(7, Faults::default());
    let layout = small_layout(1 << 16);
    let config = fast_config();
    let p = sim.add_prefill(config.clone(), layout, 0, 0..layout.layers);
    let d = sim.add_decode(config, layout, 0);
    sim.connect(d, p);
    sim.run_for(Duration::from_millis(5), 10_000)
        .expect("handshake");
    let mut w = Workload::new(vec![d], vec![vec![p]], ROOMS);
    w.interarrival = Duration::from_micros(20);
    w.chunks = (1, 1);
    w.layerwise = 0.0;
    w.pages = (4, 4);
    sim.start_workload(w);
    sim
}

/// Two endpoints wired back to back: every output goes straight to the peer's input.
struct Pair {
    now: Instant,
    prefill: Endpoint,
    decode: Endpoint,
    sp: SessionId,
    sd: SessionId,
    buf: Vec<u8>,
    next_room: u64,
}

impl Pair {
    fn new() -> Self {
        let now = Instant::now();
        let layout = small_layout(1 << 16);
        let mut pi = EndpointInfo::new(Role::Prefill, NodeId(1), Incarnation(1), layout);
        pi.token = b"t".to_vec();
        let mut di = EndpointInfo::new(Role::Decode, NodeId(2), Incarnation(2), layout);
        di.token = b"t".to_vec();
        let mut prefill = Endpoint::new(fast_config(), pi, 1, now).expect("config");
        let mut decode = Endpoint::new(fast_config(), di, 2, now).expect("config");
        let sp = prefill.open_session(now);
        let sd = decode.accept_session(now);
        let mut pair = Pair {
            now,
            prefill,
            decode,
            sp,
            sd,
            buf: Vec::new(),
            next_room: 1,
        };
        pair.pump();
        pair
    }

    fn pump(&mut self) {
        loop {
            let mut moved = false;
            self.buf.clear();
            while self.prefill.poll_transmit(&mut self.buf).is_some() {
                moved = true;
            }
            if !self.buf.is_empty() {
                let n = self.decode.handle_input(self.now, self.sd, &self.buf);
                debug_assert_eq!(n, self.buf.len());
            }
            self.buf.clear();
            while self.decode.poll_transmit(&mut self.buf).is_some() {
                moved = true;
            }
            if !self.buf.is_empty() {
                self.prefill.handle_input(self.now, self.sp, &self.buf);
            }
            while let Some(op) = self.prefill.poll_transfer(self.now) {
                moved = true;
                self.prefill
                    .handle_transfer_result(self.now, op.id, TransferOutcome::Done);
            }
            while self.prefill.poll_event().is_some() {}
            while self.decode.poll_event().is_some() {}
            if !moved {
                break;
            }
        }
    }

    fn room(&mut self) {
        let room = RoomId(self.next_room);
        self.next_room += 1;
        let base = (self.next_room as u32 % 1000) * 4;
        let pages: Vec<u32> = (base..base + 4).collect();
        let grant = Grant {
            extras: Vec::new(),
            pages: pages.clone(),
            aux_slot: Some(1),
            state_slot: None,
            receivers: 1,
            skip_pages: 0,
            idle_sources: 0,
            prompt: None,
        };
        self.decode
            .open_receiver(self.now, room, 0, &[self.sd], Some(grant))
            .expect("open receiver");
        self.prefill
            .open_sender(self.now, room, 0, None)
            .expect("open sender");
        self.pump();
        let chunk = Chunk {
            extras: Vec::new(),
            pages,
            last: true,
            aux_slot: Some(1),
            state_slot: None,
            layerwise: false,
        };
        self.prefill
            .send_chunk(self.now, room, chunk)
            .expect("chunk");
        self.pump();
    }
}

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("room_lifecycle");
    g.throughput(Throughput::Elements(ROOMS as u64));
    g.sample_size(20);
    g.bench_function("endpoint_pair_1000_rooms", |b| {
        b.iter_batched(
            Pair::new,
            |mut pair| {
                for _ in 0..ROOMS {
                    pair.room();
                }
                pair
            },
            BatchSize::LargeInput,
        )
    });
    g.bench_function("simulation_1000_rooms", |b| {
        b.iter_batched(
            sim_with_workload,
            |mut sim| {
                sim.run_until(10_000_000, |s| s.workload_done())
                    .expect("workload completes");
                sim
            },
            BatchSize::LargeInput,
        )
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
