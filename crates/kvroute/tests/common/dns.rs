//! A real DNS server for the discovery tests: authoritative for one zone, on an ephemeral
//! loopback UDP port, answering in hickory's wire format from records the test sets and
//! changes. An SRV answer can carry its targets' A and AAAA records as additional records
//! (glue), as the cluster DNS of Kubernetes sends them for a headless Service.
//! Invariants: a name or type without records answers NOERROR with the zone's SOA (RFC 2308);
//! while `fail` is set everything answers SERVFAIL.
//! Must not: recurse or forward anywhere.

use hickory_resolver::proto::op::{Message, ResponseCode};
use hickory_resolver::proto::rr::rdata::SOA;
use hickory_resolver::proto::rr::{Name, RData, Record, RecordType};
use parking_lot::Mutex;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

pub struct Dns {
    pub addr: SocketAddr,
    records: Arc<Mutex<Vec<Record>>>,
    /// SERVFAIL for every query while set.
    pub fail: Arc<AtomicBool>,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for Dns {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Dns {
    /// Authoritative for `zone` (e.g. `disc.test.`); SRV answers carry no glue.
    pub async fn start(zone: &str) -> Dns {
        Dns::serve(zone, false).await
    }

    /// Authoritative for `zone`; every SRV answer carries its targets' addresses as additional
    /// records.
    pub async fn with_glue(zone: &str) -> Dns {
        Dns::serve(zone, true).await
    }

    async fn serve(zone: &str, glue: bool) -> Dns {
        let zone = Name::from_ascii(zone).expect("zone name");
        let sock = tokio::net::UdpSocket::bind("127.0.0.1:0").await.unwrap();
        let addr = sock.local_addr().unwrap();
        let records: Arc<Mutex<Vec<Record>>> = Arc::default();
        let fail = Arc::new(AtomicBool::new(false));
        let (r, f) = (records.clone(), fail.clone());
        let task = tokio::spawn(async move {
            let mut buf = vec![0u8; 4096];
            loop {
                let Ok((n, peer)) = sock.recv_from(&mut buf).await else {
                    return;
                };
                let Ok(q) = Message::from_vec(&buf[..n]) else {
                    continue;
                };
                let answer = answer(&q, &zone, &r.lock(), f.load(Ordering::Relaxed), glue);
                if let Ok(bytes) = answer.to_vec() {
                    let _ = sock.send_to(&bytes, peer).await;
                }
            }
        });
        Dns {
            addr,
            records,
            fail,
            task,
        }
    }

    /// Replaces every record the server answers from.
    pub fn set(&self, records: Vec<Record>) {
        *self.records.lock() = records;
    }
}

fn answer(q: &Message, zone: &Name, records: &[Record], fail: bool, glue: bool) -> Message {
    let mut m = Message::response(q.metadata.id, q.metadata.op_code);
    m.metadata.authoritative = true;
    m.metadata.recursion_desired = q.metadata.recursion_desired;
    m.add_queries(q.queries.clone());
    if fail {
        m.metadata.response_code = ResponseCode::ServFail;
        return m;
    }
    for query in &q.queries {
        let found: Vec<Record> = records
            .iter()
            .filter(|r| r.name == *query.name() && r.record_type() == query.query_type())
            .cloned()
            .collect();
        if glue {
            let targets: Vec<&Name> = found
                .iter()
                .filter_map(|r| match &r.data {
                    RData::SRV(s) => Some(&s.target),
                    _ => None,
                })
                .collect();
            m.add_additionals(
                records
                    .iter()
                    .filter(|r| matches!(r.record_type(), RecordType::A | RecordType::AAAA))
                    .filter(|r| targets.contains(&&r.name))
                    .cloned(),
            );
        }
        m.add_answers(found);
    }
    if m.answers.is_empty() {
        // No data: the zone's SOA in the authority section, as RFC 2308 asks.
        let soa = SOA::new(
            Name::from_ascii("ns").unwrap().append_domain(zone).unwrap(),
            Name::from_ascii("admin")
                .unwrap()
                .append_domain(zone)
                .unwrap(),
            1,
            60,
            60,
            60,
            1,
        );
        m.add_authority(Record::from_rdata(zone.clone(), 1, RData::SOA(soa)));
    }
    m
}
