//! A simulated worker with a real ZMQ subscriber on its event stream, and the `BlockStored`
//! events read from it.

use kvroute_index::{Event, Stored};
use kvroute_sim::{fleet, PublisherConfig, SimHandle, WorkerConfig};
use std::time::Duration;
use zeromq::{Socket, SocketRecv, SubSocket};

/// Starts worker `w0` from `cfg` (engine time ×10⁶, a bound PUB socket) and subscribes to it.
pub async fn subscribed_worker(mut cfg: WorkerConfig) -> (SimHandle, SubSocket) {
    cfg.speedup = 1e6;
    cfg.zmq = Some(PublisherConfig::new("tcp://127.0.0.1:0"));
    let h = fleet::start_worker("w0", cfg, ([127, 0, 0, 1], 0).into())
        .await
        .unwrap();
    let mut sub = SubSocket::new();
    sub.connect(&h.zmq[0]).await.unwrap();
    sub.subscribe("").await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    (h, sub)
}

/// The stores of every batch received until the stream is quiet for 300 ms.
pub async fn stores(sub: &mut SubSocket) -> Vec<Stored> {
    let mut out = Vec::new();
    while let Ok(Ok(m)) = tokio::time::timeout(Duration::from_millis(300), sub.recv()).await {
        let frames: Vec<Vec<u8>> = m.into_vec().iter().map(|f| f.to_vec()).collect();
        let refs: Vec<&[u8]> = frames.iter().map(Vec::as_slice).collect();
        let (_, _, batch) = kvroute_wire::decode_message(&"w0".into(), &refs).unwrap();
        out.extend(batch.events.into_iter().filter_map(|e| match e {
            Event::Stored(s) => Some(s),
            _ => None,
        }));
    }
    out
}
