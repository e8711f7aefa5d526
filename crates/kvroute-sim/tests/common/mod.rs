//! A minimal HTTP/1.1 client over a real TCP socket (Connection: close), for the API tests, and
//! what every integration suite shares: waits on a condition with a deadline (`wait`), and
//! whether python3 has the modules a test drives (`python`).

#![allow(dead_code)]

pub mod corpus;
#[path = "../../../kvroute/tests/common/python.rs"]
pub mod python;
pub mod subscriber;
#[path = "../../../kvroute/tests/common/wait.rs"]
pub mod wait;

#[allow(unused_imports)]
pub use wait::{wait_for, wait_until, WAIT};

use serde_json::Value;
use std::net::SocketAddr;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

pub struct Reply {
    pub status: u16,
    pub headers: String,
    pub body: String,
}

impl Reply {
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.body).unwrap_or_else(|e| panic!("{e}: {}", self.body))
    }

    /// The `data:` payloads of an SSE body.
    pub fn sse(&self) -> Vec<String> {
        self.body
            .lines()
            .filter_map(|l| l.strip_prefix("data: ").or_else(|| l.strip_prefix("data:")))
            .map(str::to_string)
            .collect()
    }
}

fn dechunk(mut s: &str) -> String {
    let mut out = String::new();
    while let Some((size, rest)) = s.split_once("\r\n") {
        let Ok(n) = usize::from_str_radix(size.trim(), 16) else {
            break;
        };
        if n == 0 || rest.len() < n {
            break;
        }
        out.push_str(&rest[..n]);
        s = rest[n..].trim_start_matches("\r\n");
    }
    out
}

pub async fn request(addr: SocketAddr, method: &str, path: &str, body: Option<&str>) -> Reply {
    let mut sock = TcpStream::connect(addr).await.expect("connect");
    let body = body.unwrap_or("");
    let req = format!(
        "{method} {path} HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\n\
         Content-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    sock.write_all(req.as_bytes()).await.expect("write");
    let mut raw = Vec::new();
    sock.read_to_end(&mut raw).await.expect("read");
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, rest) = text.split_once("\r\n\r\n").unwrap_or((&text, ""));
    let status = head
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    let chunked = head
        .to_ascii_lowercase()
        .contains("transfer-encoding: chunked");
    Reply {
        status,
        headers: head.to_string(),
        body: if chunked {
            dechunk(rest)
        } else {
            rest.to_string()
        },
    }
}

pub async fn post(addr: SocketAddr, path: &str, body: &Value) -> Reply {
    request(addr, "POST", path, Some(&body.to_string())).await
}

pub async fn get(addr: SocketAddr, path: &str) -> Reply {
    request(addr, "GET", path, None).await
}
