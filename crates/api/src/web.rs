//! The live graph view: one page and its scripts, built into the binary. The page lays the
//! graph out with dagre (vendored, MIT, in `web/vendor/`) and polls the API every second.

use axum::extract::Path;
use axum::http::header;
use axum::response::{IntoResponse, Response};

use crate::ApiError;

const INDEX: &str = include_str!("../web/index.html");
const ASSETS: &[(&str, &str, &str)] = &[
    (
        "app.js",
        "text/javascript; charset=utf-8",
        include_str!("../web/app.js"),
    ),
    (
        "style.css",
        "text/css; charset=utf-8",
        include_str!("../web/style.css"),
    ),
    (
        "dagre.min.js",
        "text/javascript; charset=utf-8",
        include_str!("../web/vendor/dagre-3.1.3.min.js"),
    ),
];

pub async fn index() -> Response {
    ([(header::CONTENT_TYPE, "text/html; charset=utf-8")], INDEX).into_response()
}

pub async fn asset(Path(file): Path<String>) -> Result<Response, ApiError> {
    let (_, kind, body) = ASSETS
        .iter()
        .find(|(name, _, _)| *name == file)
        .ok_or_else(|| ApiError::new(404, format!("no file `{file}` in the graph view")))?;
    Ok(([(header::CONTENT_TYPE, *kind)], *body).into_response())
}
