//! A small blocking client for the API on the Unix socket, used by `stitch stats`, `apply`,
//! `show`, `top` and `capture --link`.

use anyhow::{anyhow, Context, Result};
use http_body_util::{BodyExt, Full};
use hyper::body::{Bytes, Incoming};
pub use hyper::header::HeaderMap;
pub use hyper::Method;
use hyper::{Request, Response};
use hyper_util::rt::TokioIo;
use serde_json::Value;
use std::path::Path;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

fn runtime() -> Result<tokio::runtime::Runtime> {
    Ok(tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?)
}

/// Sends one request and returns the response head with the body still to read.
async fn send(
    socket: &Path,
    method: Method,
    path: &str,
    body: Option<Vec<u8>>,
) -> Result<Response<Incoming>> {
    let stream = tokio::net::UnixStream::connect(socket)
        .await
        .with_context(|| {
            format!(
                "no stitch instance answers on {} (is `stitch run` running? --name?)",
                socket.display()
            )
        })?;
    let (mut sender, conn) = hyper::client::conn::http1::handshake(TokioIo::new(stream))
        .await
        .context("HTTP handshake with the instance")?;
    tokio::spawn(conn);
    let req = Request::builder()
        .method(method)
        .uri(path)
        .header("host", "stitch")
        .header("content-type", "application/json")
        .body(Full::new(Bytes::from(body.unwrap_or_default())))?;
    tokio::time::timeout(Duration::from_secs(60), sender.send_request(req))
        .await
        .map_err(|_| anyhow!("the instance did not answer within 60 s"))?
        .map_err(Into::into)
}

/// Sends one request to the instance on `socket`; returns the status and body.
pub fn call(
    socket: &Path,
    method: Method,
    path: &str,
    body: Option<Vec<u8>>,
) -> Result<(u16, Vec<u8>)> {
    runtime()?.block_on(async {
        let resp = send(socket, method, path, body).await?;
        let status = resp.status().as_u16();
        let bytes = resp.into_body().collect().await?.to_bytes();
        Ok((status, bytes.to_vec()))
    })
}

/// The instance's reason for refusing a request, from its JSON error body.
fn refusal(status: u16, bytes: &[u8]) -> anyhow::Error {
    let reason = serde_json::from_slice::<Value>(bytes)
        .ok()
        .and_then(|v| v["error"].as_str().map(str::to_string))
        .unwrap_or_else(|| {
            format!(
                "request failed with status {status}: {}",
                String::from_utf8_lossy(bytes)
            )
        });
    anyhow!("{reason}")
}

/// Sends a request and returns the JSON answer, or the instance's reason as the error.
pub fn json(socket: &Path, method: Method, path: &str, body: Option<Vec<u8>>) -> Result<Value> {
    let (status, bytes) = call(socket, method, path, body)?;
    if status >= 400 {
        return Err(refusal(status, &bytes));
    }
    serde_json::from_slice(&bytes).with_context(|| {
        format!(
            "the instance answered {status} with something that is not JSON: {}",
            String::from_utf8_lossy(&bytes)
        )
    })
}

/// Sends a GET whose answer is a stream (a capture) and hands each piece of the body to
/// `sink` as it arrives, until the body ends. When `stop` turns true, `stop_request` is asked
/// for a request that ends the stream cleanly (given the response headers) and that request is
/// sent; reading goes on until the instance closes the stream, at most `grace` later.
pub fn stream(
    socket: &Path,
    path: &str,
    stop: &AtomicBool,
    stop_request: impl Fn(&HeaderMap) -> Option<(Method, String)>,
    grace: Duration,
    mut sink: impl FnMut(&[u8]) -> Result<()>,
) -> Result<()> {
    runtime()?.block_on(async {
        let resp = send(socket, Method::GET, path, None).await?;
        let status = resp.status().as_u16();
        if status >= 400 {
            let bytes = resp.into_body().collect().await?.to_bytes();
            return Err(refusal(status, &bytes));
        }
        let headers = resp.headers().clone();
        let mut body = resp.into_body();
        let mut stopping_since: Option<tokio::time::Instant> = None;
        loop {
            if stopping_since.is_none() && stop.load(Ordering::Relaxed) {
                stopping_since = Some(tokio::time::Instant::now());
                if let Some((method, p)) = stop_request(&headers) {
                    let r = send(socket, method, &p, None).await?;
                    if r.status().as_u16() >= 400 {
                        break;
                    }
                }
            }
            if stopping_since.is_some_and(|t| t.elapsed() >= grace) {
                break;
            }
            match tokio::time::timeout(Duration::from_millis(100), body.frame()).await {
                Err(_) => continue,
                Ok(None) => break,
                Ok(Some(frame)) => {
                    if let Ok(data) = frame.context("reading the stream")?.into_data() {
                        sink(&data)?;
                    }
                }
            }
        }
        Ok(())
    })
}

/// What to ask of a live link capture (`GET /api/v1/links/{link}/capture`).
#[derive(Debug, Clone, Default)]
pub struct CaptureRequest {
    /// `pcapng` (default) or `pcap`.
    pub format: Option<String>,
    pub snaplen: Option<u32>,
    pub count: Option<u64>,
    pub duration: Option<f64>,
    /// libpcap filter expression.
    pub filter: Option<String>,
}

impl CaptureRequest {
    /// The request's path for the links `selector` names.
    pub fn path(&self, selector: &str) -> String {
        let enc = |s: &str| {
            percent_encoding::utf8_percent_encode(s, percent_encoding::NON_ALPHANUMERIC).to_string()
        };
        let mut q = Vec::new();
        if let Some(f) = &self.format {
            q.push(format!("format={}", enc(f)));
        }
        if let Some(s) = self.snaplen {
            q.push(format!("snaplen={s}"));
        }
        if let Some(c) = self.count {
            q.push(format!("count={c}"));
        }
        if let Some(d) = self.duration {
            q.push(format!("duration={d}"));
        }
        if let Some(f) = self.filter.as_deref().filter(|f| !f.trim().is_empty()) {
            q.push(format!("filter={}", enc(f)));
        }
        format!("/api/v1/links/{}/capture?{}", enc(selector), q.join("&"))
    }
}

/// Streams a live capture of the links `selector` names into `out` until it ends (count,
/// duration, `stop`, or `out` refusing more: a reader that went away). `on_start` runs once,
/// when the instance has accepted the capture. Returns the packets and drops seen in the
/// stream.
pub fn capture_link(
    socket: &Path,
    selector: &str,
    request: &CaptureRequest,
    stop: &AtomicBool,
    out: &mut dyn std::io::Write,
    flush_each_piece: bool,
    mut on_start: impl FnMut(),
) -> Result<stitch_io::capture_format::StreamTally> {
    let mut tally = stitch_io::capture_format::StreamTally::default();
    let mut started = false;
    let stop_request = |headers: &HeaderMap| {
        let id = headers.get(crate::CAPTURE_ID_HEADER)?.to_str().ok()?;
        Some((Method::DELETE, format!("/api/v1/captures/{id}")))
    };
    let result = stream(
        socket,
        &request.path(selector),
        stop,
        stop_request,
        Duration::from_secs(5),
        |bytes| {
            if !started {
                started = true;
                on_start();
            }
            tally.feed(bytes);
            out.write_all(bytes)?;
            if flush_each_piece {
                out.flush()?;
            }
            Ok(())
        },
    );
    let flushed = out.flush();
    let broken_pipe = |e: &std::io::Error| e.kind() == std::io::ErrorKind::BrokenPipe;
    match result {
        // The reader went away (`| head`, Wireshark closed): the capture ends with it.
        Err(e) if e.downcast_ref::<std::io::Error>().is_some_and(broken_pipe) => {}
        r => r?,
    }
    match flushed {
        Err(e) if !broken_pipe(&e) => Err(e.into()),
        _ => Ok(tally),
    }
}
