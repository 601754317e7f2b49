//! Room workloads through two nodes of one driver on two links side by side (TCP against
//! RDMA, plain against TLS).

/// One workload moved between two nodes on loopback over two kinds of link (plain TCP
/// against RDMA, or against TLS), in one run.
#[derive(Clone, Debug)]
pub struct LinkPoint {
    /// What moved.
    pub workload: &'static str,
    /// The driver both nodes ran on (`tokio`, `glommio`): [`LinkRun::runtime`]'s name.
    pub runtime: &'static str,
    /// GB/s over the first link, then over the second.
    pub gbps: [f64; 2],
    /// Every page of every run verified, none corrupted or unfinished.
    pub clean: bool,
}

/// How much of the link workloads a run moves.
#[derive(Clone, Copy, Debug)]
pub struct LinkRun {
    /// Rounds per workload (the best of them counts).
    pub iterations: usize,
    /// Each workload moves its rooms divided by this (1: all of them).
    pub room_divisor: u64,
    /// The driver both nodes run on.
    pub runtime: crate::Runtime,
}

/// The same room workloads through a prefill and a decode node over each of `links`,
/// alternating which goes first so drifting load hits both alike, best of `iterations` each
/// (every byte verified every time). Each workload's point goes to `done` as soon as it is
/// measured: on a slow link the whole run takes minutes.
async fn side_by_side(
    run: LinkRun,
    links: [crate::DemoLink; 2],
    done: &mut dyn FnMut(&LinkPoint),
) -> Result<Vec<LinkPoint>, kvferry_tokio::NodeError> {
    let workloads: [(&'static str, crate::Shape, u64); 3] = [
        (
            "64 MiB rooms",
            crate::Shape {
                page_bytes: 256 * 1024,
                pages_per_room: 16,
                concurrency: 4,
                ..crate::Shape::default()
            },
            16,
        ),
        ("8 MiB rooms of 16 KiB pages", crate::Shape::default(), 128),
        (
            "1 MiB rooms of 4 KiB pages",
            crate::Shape {
                page_bytes: 4096,
                ..crate::Shape::default()
            },
            256,
        ),
    ];
    let mut out = Vec::new();
    for (workload, shape, rooms) in workloads {
        let rooms = (rooms / run.room_divisor.max(1)).max(1);
        let mut gbps = [0.0f64; 2];
        let mut clean = true;
        for i in 0..run.iterations.max(1) {
            for k in [i % 2, 1 - i % 2] {
                let report = crate::run_demo(
                    shape.clone(),
                    kvferry_core::Config::default(),
                    rooms,
                    crate::DemoFaults::default(),
                    None,
                    run.runtime,
                    links[k].clone(),
                )
                .await?;
                clean &= report.pages_corrupted == 0
                    && report.rooms_unfinished == 0
                    && report.rooms_succeeded == rooms;
                gbps[k] = gbps[k].max(report.throughput_gbps);
            }
        }
        let point = LinkPoint {
            workload,
            runtime: run.runtime.name(),
            gbps,
            clean,
        };
        done(&point);
        out.push(point);
    }
    Ok(out)
}

/// `bench --backend rdma`: the room workloads over TCP data connections and over RDMA.
pub async fn backends(
    run: LinkRun,
    device: Option<String>,
    done: &mut dyn FnMut(&LinkPoint),
) -> Result<Vec<LinkPoint>, kvferry_tokio::NodeError> {
    let rdma = kvferry_tokio::DataBackend::Rdma { device, port: 1 };
    side_by_side(
        run,
        [kvferry_tokio::DataBackend::Tcp.into(), rdma.into()],
        done,
    )
    .await
}

/// `bench --tls`: the room workloads over plain TCP and with TLS on every connection. The
/// certificates are a throwaway CA's, written under the system's temporary directory.
pub async fn tls(
    run: LinkRun,
    done: &mut dyn FnMut(&LinkPoint),
) -> Result<Vec<LinkPoint>, kvferry_tokio::NodeError> {
    let dir = crate::testcert::CertDir::new("bench-tls");
    let files =
        crate::testcert::throwaway(&dir, "kvferry").map_err(kvferry_tokio::NodeError::Io)?;
    let tls = crate::DemoLink {
        tls: Some(files),
        ..crate::DemoLink::default()
    };
    side_by_side(run, [crate::DemoLink::default(), tls], done).await
}
