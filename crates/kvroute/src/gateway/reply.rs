//! The gateway's OpenAI-style error answers, shared by the front door's handlers (the proxy,
//! disaggregated serving, the tenants' rejections, the admin API).
//!
//! Owns: the error body (`message`, `type` named after the status as OpenAI's clients expect,
//! `param`, `code`) and the `Retry-After: 1` a 503 carries.
//! Must not: import the gateway's handlers or state (every front-door module may use it).

use super::request;
use axum::http::{HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde_json::json;

/// An OpenAI error body for `status` (see [`error_on`]).
pub fn error(status: StatusCode, message: impl Into<String>) -> Response {
    error_on(status, message, None)
}

/// A refused request's OpenAI error, naming its field.
pub fn invalid(e: request::Invalid) -> Response {
    error_on(e.status, e.message, e.param)
}

/// An OpenAI error body (`message`, `type`, `param`, `code`) with `status`.
pub fn error_on(status: StatusCode, message: impl Into<String>, param: Option<&str>) -> Response {
    let kind = match status.as_u16() {
        400 => "BadRequestError",
        401 => "AuthenticationError",
        404 => "NotFoundError",
        408 => "RequestTimeoutError",
        413 => "RequestTooLargeError",
        429 => "RateLimitError",
        502 => "BadGatewayError",
        503 => "ServiceUnavailableError",
        _ => "InternalServerError",
    };
    let mut r = (status, Json(json!({"error": {"message": message.into(), "type": kind, "param": param, "code": status.as_u16()}}))).into_response();
    if status == StatusCode::SERVICE_UNAVAILABLE {
        r.headers_mut()
            .insert("retry-after", HeaderValue::from_static("1"));
    }
    r
}
