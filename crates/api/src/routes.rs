//! The HTTP routes: thin handlers over [`Api`], each answering JSON (or an error object with a
//! reason) and running engine calls off the async threads.

use crate::access::Guard;
use crate::{metrics, web, Api, ApiError};
use axum::body::Bytes;
use axum::extract::rejection::{PathRejection, QueryRejection};
use axum::extract::{DefaultBodyLimit, Path, Query, Request, State};
use axum::http::{header, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{delete, get, post};
use axum::{Json, Router};
use serde_json::{json, Value};
use std::collections::HashMap;
use std::sync::{Arc, OnceLock};

/// The OpenAPI description, the single source for clients and for the conformance test.
pub const OPENAPI_YAML: &str = include_str!("../openapi.yaml");

fn openapi_document() -> &'static Value {
    static DOC: OnceLock<Value> = OnceLock::new();
    DOC.get_or_init(|| serde_saphyr::from_str(OPENAPI_YAML).expect("openapi.yaml is valid YAML"))
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let status = StatusCode::from_u16(self.status).unwrap_or(StatusCode::BAD_REQUEST);
        let mut body = json!({ "error": self.message });
        if let Some(Value::Object(d)) = self.details {
            body.as_object_mut().unwrap().extend(d);
        }
        let mut r = (status, Json(body)).into_response();
        if status == StatusCode::UNAUTHORIZED {
            r.headers_mut()
                .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
        }
        r
    }
}

type Answer = Result<Response, ApiError>;

/// Runs a blocking call (the engine parks workers, takes locks) off the async threads.
async fn blocking<T: Send + 'static>(
    f: impl FnOnce() -> Result<T, ApiError> + Send + 'static,
) -> Result<T, ApiError> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::new(500, format!("the request failed inside the server: {e}")))?
}

fn path(p: Result<Path<String>, PathRejection>) -> Result<String, ApiError> {
    p.map(|Path(name)| name)
        .map_err(|e| ApiError::new(400, format!("path: {}", e.body_text())))
}

fn query(
    q: Result<Query<HashMap<String, String>>, QueryRejection>,
) -> Result<HashMap<String, String>, ApiError> {
    q.map(|Query(q)| q)
        .map_err(|e| ApiError::new(400, format!("query string: {}", e.body_text())))
}

fn json_body(body: &Bytes, empty: Value) -> Result<Value, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Ok(empty);
    }
    serde_json::from_slice(body)
        .map_err(|e| ApiError::new(400, format!("the body is not valid JSON: {e}")))
}

/// All routes; with `guard` (TCP), each request is checked by it first: its host, origin, body
/// type and the role of its bearer token (`access`). Without (the Unix socket, whose mode and
/// group decide who connects), every request is the admin's.
pub fn router(api: Arc<Api>, guard: Option<Arc<Guard>>) -> Router {
    let router = Router::new()
        .route("/", get(web::index))
        .route("/ui/{file}", get(web::asset))
        .route("/metrics", get(get_metrics))
        .route("/api/v1/openapi.json", get(get_openapi))
        .route("/api/v1/graph", get(get_graph).put(put_graph))
        .route("/api/v1/graph/reload", post(reload))
        .route("/api/v1/stats", get(get_stats))
        .route("/api/v1/status", get(get_status))
        .route("/api/v1/apps", get(list_apps))
        .route(
            "/api/v1/apps/{name}",
            get(get_app).put(put_app).delete(delete_app),
        )
        .route("/api/v1/apps/{name}/query", post(query_app))
        .route(
            "/api/v1/links",
            get(list_links).post(add_link).delete(delete_link),
        )
        .route("/api/v1/links/{link}/capture", get(capture_link))
        .route("/api/v1/captures", get(list_captures))
        .route("/api/v1/captures/{id}", delete(stop_capture))
        .route("/api/v1/types", get(list_types))
        .with_state(api)
        .fallback(|| async { ApiError::new(404, "no such route: see /api/v1/openapi.json") })
        .method_not_allowed_fallback(|| async {
            ApiError::new(
                405,
                "method not allowed on this route: see /api/v1/openapi.json",
            )
        })
        .layer(DefaultBodyLimit::max(BODY_LIMIT))
        .layer(middleware::from_fn(refuse_declared_oversize));
    match guard {
        None => router,
        // Outermost: a request that may not come in is refused before anything reads it.
        Some(guard) => router.layer(middleware::from_fn(move |req: Request, next: Next| {
            guard.clone().check(req, next)
        })),
    }
}

/// The largest request body the API reads.
const BODY_LIMIT: usize = 64 << 20;

/// A body whose declared length is over the limit is refused before a byte of it is read: the
/// limit alone refuses it only once `BODY_LIMIT` bytes sit in memory, which the allocator then
/// keeps for the process's life (`stitch bench soak` saw 66 MiB more RssAnon per such request).
async fn refuse_declared_oversize(req: Request, next: Next) -> Response {
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    match declared {
        Some(n) if n > BODY_LIMIT as u64 => ApiError::new(
            413,
            format!(
                "the body is {n} bytes; the API reads at most {BODY_LIMIT} (64 MiB): send a smaller graph, or change it in parts (PUT /api/v1/apps/NAME)"
            ),
        )
        .into_response(),
        _ => next.run(req).await,
    }
}

async fn get_openapi() -> Response {
    Json(openapi_document()).into_response()
}

async fn get_metrics(State(api): State<Arc<Api>>) -> Answer {
    let text = blocking(move || Ok(metrics::render(api.metrics_snapshot()))).await?;
    Ok((
        [(
            header::CONTENT_TYPE,
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
        )],
        text,
    )
        .into_response())
}

async fn get_graph(
    State(api): State<Arc<Api>>,
    q: Result<Query<HashMap<String, String>>, QueryRejection>,
) -> Answer {
    let q = query(q)?;
    match q.get("format").map(String::as_str).unwrap_or("json") {
        "json" => Ok(Json(blocking(move || api.graph_document()).await?).into_response()),
        "dot" => {
            let dot = blocking(move || api.graph_dot()).await?;
            Ok(([(header::CONTENT_TYPE, "text/vnd.graphviz")], dot).into_response())
        }
        other => Err(ApiError::new(
            400,
            format!("query parameter `format`: `{other}` is neither `json` nor `dot`"),
        )),
    }
}

async fn put_graph(
    State(api): State<Arc<Api>>,
    q: Result<Query<HashMap<String, String>>, QueryRejection>,
    body: Bytes,
) -> Answer {
    let q = query(q)?;
    let text = String::from_utf8(body.to_vec())
        .map_err(|_| ApiError::new(400, "the body must be the graph file's text (UTF-8)"))?;
    let file = q.get("file").cloned().unwrap_or_else(|| "<request>".into());
    let dir = q.get("dir").map(std::path::PathBuf::from);
    let report = blocking(move || api.apply_text(&text, &file, dir.as_deref())).await?;
    Ok(Json(report).into_response())
}

async fn reload(State(api): State<Arc<Api>>) -> Answer {
    Ok(Json(blocking(move || api.reload()).await?).into_response())
}

async fn get_stats(State(api): State<Arc<Api>>) -> Answer {
    let v = blocking(move || Ok(api.stats_json(&api.engine().stats()))).await?;
    Ok(Json(v).into_response())
}

async fn get_status(State(api): State<Arc<Api>>) -> Answer {
    let v = blocking(move || Ok(api.status())).await?;
    Ok(Json(v).into_response())
}

async fn list_apps(State(api): State<Arc<Api>>) -> Answer {
    let v = blocking(move || Ok(api.stats_json(&api.engine().stats()))).await?;
    Ok(Json(&v["apps"]).into_response())
}

async fn list_links(State(api): State<Arc<Api>>) -> Answer {
    let v = blocking(move || Ok(api.stats_json(&api.engine().stats()))).await?;
    Ok(Json(&v["links"]).into_response())
}

async fn get_app(State(api): State<Arc<Api>>, name: Result<Path<String>, PathRejection>) -> Answer {
    let name = path(name)?;
    Ok(Json(blocking(move || api.app(&name)).await?).into_response())
}

async fn put_app(
    State(api): State<Arc<Api>>,
    name: Result<Path<String>, PathRejection>,
    body: Bytes,
) -> Answer {
    let name = path(name)?;
    let entry = json_body(&body, Value::Null)?;
    let (created, report) = blocking(move || api.put_app(&name, entry)).await?;
    let status = if created {
        StatusCode::CREATED
    } else {
        StatusCode::OK
    };
    Ok((status, Json(report)).into_response())
}

async fn delete_app(
    State(api): State<Arc<Api>>,
    name: Result<Path<String>, PathRejection>,
) -> Answer {
    let name = path(name)?;
    Ok(Json(blocking(move || api.delete_app(&name)).await?).into_response())
}

async fn query_app(
    State(api): State<Arc<Api>>,
    name: Result<Path<String>, PathRejection>,
    body: Bytes,
) -> Answer {
    let name = path(name)?;
    let request = json_body(&body, json!({}))?;
    Ok(Json(blocking(move || api.query(&name, request)).await?).into_response())
}

async fn add_link(State(api): State<Arc<Api>>, body: Bytes) -> Answer {
    let link = json_body(&body, Value::Null)?;
    let report = blocking(move || api.add_link(link)).await?;
    Ok((StatusCode::CREATED, Json(report)).into_response())
}

async fn delete_link(
    State(api): State<Arc<Api>>,
    q: Result<Query<HashMap<String, String>>, QueryRejection>,
) -> Answer {
    let q = query(q)?;
    let Some(spec) = q.get("link").cloned() else {
        return Err(ApiError::new(
            400,
            "query parameter `link` (\"APP.PORT -> APP.PORT\") is missing",
        ));
    };
    Ok(Json(blocking(move || api.delete_link(&spec)).await?).into_response())
}

async fn capture_link(
    State(api): State<Arc<Api>>,
    link: Result<Path<String>, PathRejection>,
    q: Result<Query<HashMap<String, String>>, QueryRejection>,
) -> Answer {
    let selector = path(link)?;
    let options = crate::capture::options_from_query(&query(q)?)?;
    blocking(move || api.start_capture(&selector, options)).await
}

async fn list_captures(State(api): State<Arc<Api>>) -> Answer {
    Ok(Json(api.captures_json()).into_response())
}

async fn stop_capture(
    State(api): State<Arc<Api>>,
    id: Result<Path<String>, PathRejection>,
) -> Answer {
    let id = path(id)?;
    Ok(Json(api.stop_capture(&id)?).into_response())
}

async fn list_types(State(api): State<Arc<Api>>) -> Answer {
    Ok(Json(api.types()).into_response())
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::body::Body;
    use stitch_core::{Engine, Graph, Registry};
    use tower::ServiceExt;

    /// `(path, methods)` of every `.route(` call in this file, read from the source so that a
    /// new route cannot be added without this test seeing it.
    fn declared_routes() -> Vec<(String, Vec<String>)> {
        let source = include_str!("routes.rs");
        let source = &source[..source.find("#[cfg(test)]").unwrap()];
        let mut out = Vec::new();
        for (i, _) in source.match_indices(".route(") {
            let rest = &source[i + ".route(".len()..];
            let (mut depth, mut end) = (1, 0);
            for (j, c) in rest.char_indices() {
                match c {
                    '(' => depth += 1,
                    ')' => depth -= 1,
                    _ => {}
                }
                if depth == 0 {
                    end = j;
                    break;
                }
            }
            let call = &rest[..end];
            let path = call.split('"').nth(1).unwrap().to_string();
            let methods = ["get", "put", "post", "delete"]
                .into_iter()
                .filter(|m| {
                    call.split(|c: char| !c.is_alphanumeric() && c != '_')
                        .any(|w| w == *m)
                })
                .map(String::from)
                .collect();
            out.push((path, methods));
        }
        out
    }

    #[tokio::test]
    async fn a_body_declared_over_the_limit_is_refused_unread() {
        let engine = Arc::new(Engine::new(Arc::new(Registry::new())));
        let router = router(Arc::new(Api::new(engine.clone(), None)), None);
        // A body that never yields a byte: reading it would hang the request.
        struct Silent;
        impl http_body::Body for Silent {
            type Data = Bytes;
            type Error = std::io::Error;
            fn poll_frame(
                self: std::pin::Pin<&mut Self>,
                _: &mut std::task::Context<'_>,
            ) -> std::task::Poll<Option<Result<http_body::Frame<Bytes>, std::io::Error>>>
            {
                std::task::Poll::Pending
            }
        }
        let endless = Body::new(Silent);
        let req = axum::http::Request::builder()
            .method("PUT")
            .uri("/api/v1/graph")
            .header(header::CONTENT_LENGTH, (BODY_LIMIT + 1).to_string())
            .body(endless)
            .unwrap();
        let resp = tokio::time::timeout(std::time::Duration::from_secs(10), router.oneshot(req))
            .await
            .expect("answered without reading the body")
            .unwrap();
        assert_eq!(resp.status().as_u16(), 413);
        let body = axum::body::to_bytes(resp.into_body(), 1 << 20)
            .await
            .unwrap();
        assert!(
            String::from_utf8_lossy(&body).contains("at most"),
            "{body:?}"
        );
        engine.stop();
    }

    #[test]
    fn openapi_document_and_router_agree() {
        let doc = openapi_document();
        let paths = doc["paths"].as_object().unwrap();
        let declared = declared_routes();
        assert!(declared.len() >= 10, "{declared:?}");
        for (path, methods) in &declared {
            let ops = paths
                .get(path)
                .unwrap_or_else(|| panic!("route {path} is missing from openapi.yaml"));
            for m in methods {
                assert!(
                    ops.get(m).is_some(),
                    "{m} {path} is missing from openapi.yaml"
                );
            }
        }
        for (path, ops) in paths {
            for m in ops
                .as_object()
                .unwrap()
                .keys()
                .filter(|k| *k != "parameters")
            {
                assert!(
                    declared.iter().any(|(p, ms)| p == path && ms.contains(m)),
                    "openapi.yaml documents {m} {path}, which the router does not serve"
                );
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn every_documented_operation_reaches_a_handler() {
        let engine = Arc::new(Engine::new(Arc::new(Registry::new())));
        let g = Graph::parse(
            "apps: {}\n",
            "empty.yaml",
            std::path::Path::new("."),
            engine.registry(),
        )
        .unwrap();
        engine.apply(g).unwrap();
        let router = router(Arc::new(Api::new(engine.clone(), None)), None);
        for (path, ops) in openapi_document()["paths"].as_object().unwrap() {
            let path = path.replace("{name}", "x").replace("{file}", "app.js");
            for m in ops
                .as_object()
                .unwrap()
                .keys()
                .filter(|k| *k != "parameters")
            {
                let req = axum::http::Request::builder()
                    .method(m.to_uppercase().as_str())
                    .uri(&path)
                    .body(Body::from("{}"))
                    .unwrap();
                let resp = router.clone().oneshot(req).await.unwrap();
                let status = resp.status().as_u16();
                let body = axum::body::to_bytes(resp.into_body(), 1 << 20)
                    .await
                    .unwrap();
                let text = String::from_utf8_lossy(&body);
                assert!(
                    status != 405 && !text.contains("no such route"),
                    "{m} {path} fell through to the router's fallback: {status} {text}"
                );
            }
        }
        engine.stop();
    }
}
