//! A small blocking client for the API on the Unix socket, used by `stitch stats`, `apply`,
//! `show` and `top`.

use anyhow::{anyhow, bail, Context, Result};
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
pub use hyper::Method;
use hyper::Request;
use hyper_util::rt::TokioIo;
use serde_json::Value;
use std::path::Path;
use std::time::Duration;

/// Sends one request to the instance on `socket`; returns the status and body.
pub fn call(
    socket: &Path,
    method: Method,
    path: &str,
    body: Option<Vec<u8>>,
) -> Result<(u16, Vec<u8>)> {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    rt.block_on(async {
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
        let resp = tokio::time::timeout(Duration::from_secs(60), sender.send_request(req))
            .await
            .map_err(|_| anyhow!("the instance did not answer within 60 s"))??;
        let status = resp.status().as_u16();
        let bytes = resp.into_body().collect().await?.to_bytes();
        Ok((status, bytes.to_vec()))
    })
}

/// Sends a request and returns the JSON answer, or the instance's reason as the error.
pub fn json(socket: &Path, method: Method, path: &str, body: Option<Vec<u8>>) -> Result<Value> {
    let (status, bytes) = call(socket, method, path, body)?;
    let v: Value = serde_json::from_slice(&bytes).with_context(|| {
        format!(
            "the instance answered {status} with something that is not JSON: {}",
            String::from_utf8_lossy(&bytes)
        )
    })?;
    if status >= 400 {
        bail!(
            "{}",
            v["error"]
                .as_str()
                .map(str::to_string)
                .unwrap_or_else(|| format!("request failed with status {status}"))
        );
    }
    Ok(v)
}
