//! Python's arguments turned into the core's types: the role, the layout and its extra
//! pools, idle ranks, addresses and the transport asked for, each refusal an `InvalidArgument`.

use kvferry_core::layout::{ItemPart, MAX_EXTRA_POOLS, MAX_EXTRA_TENSORS, MAX_ITEM_PARTS};
use kvferry_core::{ExtraPool, Layout, Role};
use kvferry_memory::{ExternalRegion, MemoryKind};
use kvferry_tokio::{DataBackend, SameHost};
use pyo3::prelude::*;
use pyo3::types::PyDict;

use crate::errors::InvalidArgument;

/// The data plane a node asks for: `transport` ("auto", "rdma", "tcp"; else
/// `KVFERRY_TRANSPORT`, else "auto") on `rdma_device` (else `KVFERRY_RDMA_DEVICE`, else the
/// device nearest the node's memory), and whether peers on this host take the same-host
/// path ("auto": where they can; "same-host": always, else the session is refused).
pub(crate) fn parse_transport(
    transport: Option<String>,
    rdma_device: Option<String>,
    port: u8,
) -> PyResult<(DataBackend, SameHost)> {
    let env = |k: &str| std::env::var(k).ok().filter(|v| !v.is_empty());
    let device = rdma_device.or_else(|| env("KVFERRY_RDMA_DEVICE"));
    let transport = transport.or_else(|| env("KVFERRY_TRANSPORT"));
    match transport.as_deref().unwrap_or("auto") {
        "auto" => Ok((DataBackend::Auto { device, port }, SameHost::Auto)),
        "rdma" => Ok((DataBackend::Rdma { device, port }, SameHost::Off)),
        "tcp" => Ok((DataBackend::Tcp, SameHost::Off)),
        "same-host" => Ok((DataBackend::Tcp, SameHost::Required)),
        other => Err(InvalidArgument::new_err(format!(
            "transport {other:?}: one of \"auto\" (same-host memory copies with a peer on this host, else RDMA where both sides can, else TCP), \"same-host\" (only the same-host path: refuse to start without it, refuse sessions that cannot take it), \"rdma\" (refuse to start without it) or \"tcp\""
        ))),
    }
}

pub(crate) fn parse_role(role: &str) -> PyResult<Role> {
    match role {
        "prefill" => Ok(Role::Prefill),
        "decode" => Ok(Role::Decode),
        other => Err(InvalidArgument::new_err(format!(
            "role must be \"prefill\" or \"decode\", not {other:?}"
        ))),
    }
}

pub(crate) fn parse_layout(d: &Bound<'_, PyDict>) -> PyResult<Layout> {
    fn get<'py, T: FromPyObject<'py>>(
        d: &Bound<'py, PyDict>,
        key: &str,
        default: Option<T>,
    ) -> PyResult<T> {
        match d.get_item(key)? {
            Some(v) => v
                .extract()
                .map_err(|e| InvalidArgument::new_err(format!("layout[{key:?}]: {e}"))),
            None => {
                default.ok_or_else(|| InvalidArgument::new_err(format!("layout needs {key:?}")))
            }
        }
    }
    Ok(Layout {
        layers: get(d, "layers", None)?,
        planes: get(d, "planes", Some(2))?,
        page_bytes: get(d, "page_bytes", None)?,
        pages: get(d, "pages", None)?,
        aux_bytes: get(d, "aux_bytes", Some(0))?,
        state_bytes: get(d, "state_bytes", Some(0))?,
        slots: get(d, "slots", Some(0))?,
    })
}

/// The grant's bitmask of idle sources, from positions in a room's peers.
pub(crate) fn idle_mask(positions: &[usize], peers: usize) -> PyResult<u64> {
    let mut mask = 0u64;
    for &i in positions {
        if i >= peers.min(64) {
            return Err(InvalidArgument::new_err(format!(
                "idle_sources: position {i} is not one of the room's {peers} peers (at most 64)"
            )));
        }
        mask |= 1 << i;
    }
    Ok(mask)
}

/// Extra pools from Python: per pool, its tensors as `(address, bytes, item_bytes)`; every
/// tensor of a pool must hold the same number of items.
pub(crate) fn parse_extras(
    extras: &[Vec<(usize, usize, u32)>],
    kind: MemoryKind,
) -> PyResult<(Vec<ExtraPool>, Vec<Vec<ExternalRegion>>)> {
    if extras.len() > MAX_EXTRA_POOLS {
        return Err(InvalidArgument::new_err(format!(
            "extras: {} pools, at most {MAX_EXTRA_POOLS}",
            extras.len()
        )));
    }
    let mut pools = Vec::with_capacity(extras.len());
    let mut regions = Vec::with_capacity(extras.len());
    for (p, tensors) in extras.iter().enumerate() {
        if tensors.is_empty() || tensors.len() > MAX_EXTRA_TENSORS {
            return Err(InvalidArgument::new_err(format!(
                "extras pool {p}: {} tensors, need 1 to {MAX_EXTRA_TENSORS}",
                tensors.len()
            )));
        }
        let mut items = None;
        for (t, &(_, len, item)) in tensors.iter().enumerate() {
            let n = (item > 0).then(|| len / item as usize);
            if n.is_none() || items.is_some_and(|i| Some(i) != n) {
                return Err(InvalidArgument::new_err(format!(
                    "extras pool {p} tensor {t}: {len} bytes of {item}-byte items; every tensor \
                     of a pool holds the same number of items (item_bytes > 0)"
                )));
            }
            items = n;
        }
        let items = items.unwrap_or(0).min(u32::MAX as usize) as u32;
        pools.push(ExtraPool {
            items,
            item_bytes: tensors.iter().map(|t| t.2).collect(),
            parts: Vec::new(),
        });
        regions.push(
            tensors
                .iter()
                .map(|&(ptr, len, _)| ExternalRegion {
                    ptr: ptr as *mut u8,
                    len,
                    kind,
                })
                .collect(),
        );
    }
    Ok((pools, regions))
}

/// One `ItemPart` as Python gives it: `(offset, rows, stride, units, first, count,
/// unit_bytes)`.
pub(crate) type PartTuple = (u32, u32, u32, u16, u16, u16, u32);

/// Splits the tensors of `pools` into the parts `parts` names (per pool, per tensor, a list
/// of parts; an empty list leaves a tensor whole), each checked to lie inside its item.
pub(crate) fn parse_extra_parts(
    pools: &mut [ExtraPool],
    parts: Vec<Vec<Vec<PartTuple>>>,
) -> PyResult<()> {
    if parts.len() > pools.len() {
        return Err(InvalidArgument::new_err(format!(
            "extra_parts: {} pools, extras has {}",
            parts.len(),
            pools.len()
        )));
    }
    for (p, (pool, tensors)) in pools.iter_mut().zip(parts).enumerate() {
        if tensors.is_empty() {
            continue;
        }
        if tensors.len() != pool.item_bytes.len() {
            return Err(InvalidArgument::new_err(format!(
                "extra_parts pool {p}: {} tensors, the pool has {}",
                tensors.len(),
                pool.item_bytes.len()
            )));
        }
        let mut split = Vec::with_capacity(tensors.len());
        for (t, list) in tensors.into_iter().enumerate() {
            if list.len() > MAX_ITEM_PARTS {
                return Err(InvalidArgument::new_err(format!(
                    "extra_parts pool {p} tensor {t}: {} parts, at most {MAX_ITEM_PARTS}",
                    list.len()
                )));
            }
            let item = u64::from(pool.item_bytes[t]);
            let mut parts = Vec::with_capacity(list.len());
            for (offset, rows, stride, units, first, count, unit_bytes) in list {
                let part = ItemPart {
                    offset,
                    rows,
                    stride,
                    units,
                    first,
                    count,
                    unit_bytes,
                };
                if part.end().is_none_or(|end| end > item) {
                    return Err(InvalidArgument::new_err(format!(
                        "extra_parts pool {p} tensor {t}: {part:?} is not inside a {item}-byte \
                         item (rows >= 1, count >= 1, first + count <= units, rows apart by at \
                         least count x unit_bytes)"
                    )));
                }
                parts.push(part);
            }
            split.push(parts);
        }
        pool.parts = split;
    }
    Ok(())
}

pub(crate) fn parse_addr(a: &str) -> PyResult<std::net::SocketAddr> {
    a.parse()
        .map_err(|e| InvalidArgument::new_err(format!("address {a:?}: {e}")))
}
