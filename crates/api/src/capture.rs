//! Live captures of running links over HTTP: `GET /api/v1/links/{link}/capture` streams PCAPNG
//! (or PCAP) as packets pass, `GET /api/v1/captures` lists the captures running now and
//! `DELETE /api/v1/captures/{id}` ends one cleanly (the stream then closes with its interface
//! statistics). Each capture has a thread of its own that moves records from the taps to the
//! HTTP body; when the client goes away, the thread ends and the taps come off.

use crate::{Api, ApiError};
use axum::body::{Body, Bytes};
use axum::http::{header, HeaderValue, StatusCode};
use axum::response::Response;
use serde::Serialize;
use serde_json::{json, Value};
use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use stitch_io::capture_format::Format;
use stitch_io::link_capture::{select_links, CaptureOptions, EndReason, LinkCapture, TapStats};

/// The response header that carries a capture's id (for `DELETE /api/v1/captures/{id}`).
pub const CAPTURE_ID_HEADER: &str = "stitch-capture-id";

/// Bytes handed to the HTTP body at a time.
const CHUNK_BYTES: usize = 256 << 10;

/// The captures running now.
#[derive(Default)]
pub(crate) struct Captures {
    next_id: AtomicU64,
    active: Mutex<BTreeMap<u64, Active>>,
}

struct Active {
    selector: String,
    links: Vec<String>,
    filter: Option<String>,
    format: Format,
    started_unix_s: f64,
    stop: Arc<AtomicBool>,
    stats: Arc<Mutex<Vec<TapStats>>>,
}

#[derive(Serialize)]
struct ActiveView<'a> {
    id: u64,
    selector: &'a str,
    links: &'a [String],
    filter: &'a Option<String>,
    format: Format,
    started_unix_s: f64,
    taps: Vec<TapStats>,
}

const PARAMETERS: [&str; 5] = ["count", "duration", "snaplen", "filter", "format"];

/// Reads the query string of a capture request; an unknown parameter or a bad value is an error.
pub(crate) fn options_from_query(q: &HashMap<String, String>) -> Result<CaptureOptions, ApiError> {
    if let Some(k) = q.keys().find(|k| !PARAMETERS.contains(&k.as_str())) {
        return Err(ApiError::new(
            400,
            format!(
                "unknown parameter `{k}`: a capture takes {}",
                PARAMETERS.join(", ")
            ),
        ));
    }
    let number = |k: &str| -> Result<Option<f64>, ApiError> {
        q.get(k)
            .map(|v| {
                v.parse::<f64>()
                    .ok()
                    .filter(|x| x.is_finite() && *x >= 0.0)
                    .ok_or_else(|| {
                        ApiError::new(400, format!("`{k}` must be a number ≥ 0, not `{v}`"))
                    })
            })
            .transpose()
    };
    let mut o = CaptureOptions::default();
    if let Some(c) = number("count")? {
        o.count = Some(c as u64);
    }
    if let Some(d) = number("duration")? {
        o.duration = Some(Duration::from_secs_f64(d));
    }
    if let Some(s) = number("snaplen")? {
        if !(1.0..=262_144.0).contains(&s) {
            return Err(ApiError::new(400, "`snaplen` must be 1 to 262144"));
        }
        o.snaplen = s as u32;
    }
    o.filter = q.get("filter").filter(|f| !f.trim().is_empty()).cloned();
    if let Some(f) = q.get("format") {
        o.format = f.parse().map_err(|e: String| ApiError::new(400, e))?;
    }
    Ok(o)
}

impl Api {
    /// Taps the links `selector` names and starts the thread that streams them; returns the
    /// response (headers now, records as they come).
    pub(crate) fn start_capture(
        self: &Arc<Api>,
        selector: &str,
        options: CaptureOptions,
    ) -> Result<Response, ApiError> {
        let links =
            select_links(&self.engine.link_rings(), selector).map_err(|e| ApiError::new(404, e))?;
        let filter = options.filter.clone();
        let capture = LinkCapture::start(links, options).map_err(|e| ApiError::new(400, e))?;
        let format = capture.format();
        let id = self.captures.next_id.fetch_add(1, Ordering::Relaxed) + 1;
        let stop = Arc::new(AtomicBool::new(false));
        let stats = Arc::new(Mutex::new(capture.stats()));
        self.captures.active.lock().unwrap().insert(
            id,
            Active {
                selector: selector.to_string(),
                links: capture.link_names(),
                filter,
                format,
                started_unix_s: SystemTime::now()
                    .duration_since(UNIX_EPOCH)
                    .map_or(0.0, |d| d.as_secs_f64()),
                stop: stop.clone(),
                stats: stats.clone(),
            },
        );
        let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(16);
        let header = capture.header(&self.instance);
        let api = self.clone();
        let started = std::thread::Builder::new()
            .name(format!("stitch-capture-{id}"))
            .spawn(move || {
                let end = stream(capture, header, &tx, &stop, &stats);
                log::info!("capture {id} ended: {end}");
                api.captures.active.lock().unwrap().remove(&id);
            });
        if let Err(e) = started {
            self.captures.active.lock().unwrap().remove(&id);
            return Err(ApiError::new(
                503,
                format!("cannot start the capture thread: {e}"),
            ));
        }
        let extension = match format {
            Format::Pcap => "pcap",
            Format::Pcapng => "pcapng",
        };
        let file: String = selector
            .replace("->", "--")
            .chars()
            .filter(|c| !c.is_whitespace())
            .map(|c| {
                if c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_') {
                    c
                } else {
                    '_'
                }
            })
            .collect();
        let mut r = Response::new(Body::new(ChunkBody(rx)));
        *r.status_mut() = StatusCode::OK;
        let h = r.headers_mut();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static(format.media_type()),
        );
        h.insert(CAPTURE_ID_HEADER, HeaderValue::from(id));
        if let Ok(v) = HeaderValue::from_str(&format!(
            "attachment; filename=\"{}-{file}.{extension}\"",
            self.instance
        )) {
            h.insert(header::CONTENT_DISPOSITION, v);
        }
        Ok(r)
    }

    /// The captures running now, with their counters.
    pub(crate) fn captures_json(&self) -> Value {
        let active = self.captures.active.lock().unwrap();
        let list: Vec<Value> = active
            .iter()
            .map(|(&id, a)| {
                json!(ActiveView {
                    id,
                    selector: &a.selector,
                    links: &a.links,
                    filter: &a.filter,
                    format: a.format,
                    started_unix_s: a.started_unix_s,
                    taps: a.stats.lock().unwrap().clone(),
                })
            })
            .collect();
        Value::Array(list)
    }

    /// Ends capture `id`: its stream closes with the interface statistics.
    pub(crate) fn stop_capture(&self, id: &str) -> Result<Value, ApiError> {
        let n: u64 = id
            .parse()
            .map_err(|_| ApiError::new(400, format!("`{id}` is not a capture id (a number)")))?;
        let active = self.captures.active.lock().unwrap();
        let a = active.get(&n).ok_or_else(|| {
            ApiError::new(
                404,
                format!("no capture {n} is running (GET /api/v1/captures lists them)"),
            )
        })?;
        a.stop.store(true, Ordering::Release);
        Ok(json!({ "stopped": n }))
    }
}

/// Moves records from the taps to the body until the capture ends, the client goes away or
/// someone stops it; returns what ended it.
fn stream(
    mut capture: LinkCapture,
    header: Vec<u8>,
    tx: &tokio::sync::mpsc::Sender<Bytes>,
    stop: &AtomicBool,
    stats: &Mutex<Vec<TapStats>>,
) -> String {
    if tx.blocking_send(Bytes::from(header)).is_err() {
        return "the client went away".into();
    }
    let end = loop {
        let stopping = stop.load(Ordering::Acquire);
        let mut chunk = Vec::with_capacity(CHUNK_BYTES);
        let end = capture.poll(&mut chunk, CHUNK_BYTES);
        *stats.lock().unwrap() = capture.stats();
        let idle = chunk.is_empty();
        if !idle && tx.blocking_send(Bytes::from(chunk)).is_err() {
            return "the client went away".into();
        }
        if let Some(e) = end {
            break match e {
                EndReason::Count => "packet count reached",
                EndReason::Duration => "duration reached",
                EndReason::LinksGone => "the links left the graph",
            };
        }
        // A stop request ends after one more pass, so records already taken are written.
        if stopping && idle {
            break "stopped on request";
        }
        if tx.is_closed() {
            return "the client went away".into();
        }
        if idle {
            std::thread::sleep(Duration::from_millis(2));
        }
    };
    let _ = tx.blocking_send(Bytes::from(capture.finish()));
    end.into()
}

/// An HTTP body fed by the capture thread.
struct ChunkBody(tokio::sync::mpsc::Receiver<Bytes>);

impl http_body::Body for ChunkBody {
    type Data = Bytes;
    type Error = Infallible;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, Infallible>>> {
        self.0
            .poll_recv(cx)
            .map(|c| c.map(|b| Ok(http_body::Frame::data(b))))
    }
}
