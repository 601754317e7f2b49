//! The smallest complete embedding of kvferry: a prefill and a decode node in one process,
//! one room of two pages moved from prefill's KV pages 3, 4 to decode's pages 10, 11, and
//! checked. In a real server the two nodes live on different hosts, the router hands both the
//! room id, and the pages come from the engine's KV pool.
//!
//!     cargo run -p kvferry-tokio --example embed

use std::sync::Arc;

use kvferry_core::{
    Chunk, Config, EndpointInfo, Grant, Incarnation, KvPoll, Layout, NodeId, PromptDigest, Region,
    Role, RoomId,
};
use kvferry_memory::MemoryMap;
use kvferry_tokio::{Node, NodeConfig};

/// A node of `role` over freshly allocated (registered) memory of `layout`.
fn start(role: Role, node: u64, layout: Layout) -> Result<Node, kvferry_tokio::NodeError> {
    let started = std::time::UNIX_EPOCH
        .elapsed()
        .map_or(1, |d| d.as_nanos() as u64);
    let mut info = EndpointInfo::new(role, NodeId(node), Incarnation(started), layout);
    info.token = b"cluster-secret".to_vec(); // never sent: each side proves it
    let config = NodeConfig {
        core: Config::default(), // or Config::from_env() for KVFERRY_* knobs
        info,
        data_connections: 2,
        seed: started ^ node,
        faults: None,
        backend: Default::default(), // TCP data connections
        same_host: Default::default(),
        tls: None,
        read_spin: kvferry_tokio::DEFAULT_READ_SPIN,
    };
    kvferry_tokio::start(config, Arc::new(MemoryMap::allocate(layout)))
}

#[tokio::main]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let layout = Layout {
        layers: 4,
        planes: 2, // K and V
        page_bytes: 4096,
        pages: 64,
        aux_bytes: 64,
        state_bytes: 0,
        slots: 8,
    };
    // [README] the lines from here to [/README] are the README's embedding example.
    let prefill = start(Role::Prefill, 1, layout)?; // kvferry_tokio::start(NodeConfig, memory)
    let addrs = prefill.listen("127.0.0.1:0".parse()?).await?;
    let decode = start(Role::Decode, 2, layout)?;
    let peer = decode.connect(addrs).await?; // challenges, token proofs, hellos

    // Prefill computed the prompt's KV into its pages 3 and 4 (here: one layer and plane).
    let k0 = Region::Kv { layer: 0, plane: 0 };
    prefill.memory().write(k0, 3 * 4096, &[7; 2 * 4096])?;

    // Decode grants two free pages and an aux row; prefill sends its two pages, last chunk.
    // Both name the prompt's tokens: a room handed to another prompt fails prompt_mismatch.
    let room = RoomId(42);
    let prompt = Some(PromptDigest::of_tokens(&[101, 2023, 2003, 1037]));
    let grant = Grant {
        prompt,
        ..Grant::new(vec![10, 11], Some(0), None)
    };
    let mut arriving = decode
        .open_receiver(room, 0, vec![peer], Some(grant))
        .await?;
    let mut leaving = prefill.open_sender(room, 0, prompt).await?;
    let chunk = Chunk {
        extras: Vec::new(),
        pages: vec![3, 4],
        last: true,
        aux_slot: Some(0),
        state_slot: None,
        layerwise: false,
    };
    prefill.send_chunk(room, chunk).await?;

    // Success means every granted byte landed, in this room's lifetime.
    assert_eq!(arriving.terminal().await, KvPoll::Success);
    assert_eq!(leaving.terminal().await, KvPoll::Success);
    // [/README]
    let mut page = vec![0; 2 * 4096];
    decode.memory().read(k0, 10 * 4096, &mut page)?;
    assert!(page.iter().all(|&b| b == 7));
    println!(
        "{room}: {} bytes of layer 0 K verified on decode",
        page.len()
    );

    decode.shutdown().await;
    prefill.shutdown().await;
    Ok(())
}
