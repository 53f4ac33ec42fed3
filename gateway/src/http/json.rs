//! [`ApiJson`], the JSON body extractor of every endpoint.
//!
//! axum's own `Json` answers malformed bodies with plain text and statuses OpenAI does not use
//! (415, 422). This one keeps the envelope: a missing or wrong content type, invalid JSON and a
//! body of the wrong shape are all 400 `invalid_request_error`, with `param` naming the field
//! when serde can tell which; a body over the limit (axum's `DefaultBodyLimit`, set in
//! [`mod@crate::app`]) is 413, and one that does not arrive within the [`BodyReadTimeout`]
//! (also set there) is 408: a client trickling its body cannot hold a handler for longer.

use std::time::Duration;

use axum::body::Bytes;
use axum::extract::rejection::{BytesRejection, FailedToBufferBody};
use axum::extract::{FromRequest, Request};
use axum::http::{header, HeaderMap};
use serde::de::DeserializeOwned;

use crate::api::GenerationOptions;
use crate::error::ApiError;

/// How long a request's body may take to arrive, as a request extension.
#[derive(Clone, Copy, Debug)]
pub struct BodyReadTimeout(pub Duration);

/// A request body parsed as JSON into `T`.
#[derive(Debug)]
pub struct ApiJson<T>(pub T);

impl<S, T> FromRequest<S> for ApiJson<T>
where
    S: Send + Sync,
    T: DeserializeOwned,
{
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        if !is_json(req.headers()) {
            return Err(ApiError::invalid_request(
                "Expected a request with `Content-Type: application/json`.",
            ));
        }
        let timeout = req.extensions().get::<BodyReadTimeout>().copied();
        let read = Bytes::from_request(req, state);
        let body = match timeout {
            Some(BodyReadTimeout(limit)) => tokio::time::timeout(limit, read)
                .await
                .map_err(|_| ApiError::BodyTimeout(limit.as_secs_f64()))?,
            None => read.await,
        }
        .map_err(body_error)?;
        parse(&body).map(Self)
    }
}

/// Parses `body`, naming the field at fault when the JSON is well-formed but of the wrong shape.
pub fn parse<T: DeserializeOwned>(body: &[u8]) -> Result<T, ApiError> {
    let mut deserializer = serde_json::Deserializer::from_slice(body);
    let value = serde_path_to_error::deserialize(&mut deserializer).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        match inner.classify() {
            serde_json::error::Category::Data if path != "." => invalid_value(path, &inner),
            // The fields chat and completions share are `#[serde(flatten)]`ed, which loses
            // their path; parsed alone, they name the one at fault.
            serde_json::error::Category::Data => match shared_field_error(body) {
                Some((path, inner)) => invalid_value(path, &inner),
                None => ApiError::invalid_request(format!("Invalid request body: {inner}")),
            },
            _ => syntax_error(&inner),
        }
    })?;
    // Trailing bytes after the value make the body invalid JSON, as for any strict parser.
    deserializer.end().map_err(|e| syntax_error(&e))?;
    Ok(value)
}

fn invalid_value(path: String, inner: &serde_json::Error) -> ApiError {
    ApiError::invalid(path.clone(), format!("Invalid value for '{path}': {inner}"))
}

/// The path and error of a wrong [`GenerationOptions`] field in `body`, if there is one.
fn shared_field_error(body: &[u8]) -> Option<(String, serde_json::Error)> {
    let mut deserializer = serde_json::Deserializer::from_slice(body);
    let error =
        serde_path_to_error::deserialize::<_, GenerationOptions>(&mut deserializer).err()?;
    let path = error.path().to_string();
    (path != ".").then(|| (path, error.into_inner()))
}

fn syntax_error(e: &serde_json::Error) -> ApiError {
    ApiError::invalid_request(format!(
        "We could not parse the JSON body of your request ({e})."
    ))
}

fn body_error(rejection: BytesRejection) -> ApiError {
    match rejection {
        BytesRejection::FailedToBufferBody(FailedToBufferBody::LengthLimitError(_)) => {
            ApiError::PayloadTooLarge
        }
        other => ApiError::invalid_request(format!("Could not read the request body: {other}")),
    }
}

/// `application/json` and `application/*+json`, with any parameters (`charset=utf-8`).
fn is_json(headers: &HeaderMap) -> bool {
    let Some(mime) = headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<mime::Mime>().ok())
    else {
        return false;
    };
    mime.type_() == mime::APPLICATION
        && (mime.subtype() == mime::JSON || mime.suffix().is_some_and(|s| s == mime::JSON))
}

#[cfg(test)]
mod tests {
    use axum::http::HeaderValue;
    use serde::Deserialize;

    use super::*;

    #[derive(Debug, Deserialize)]
    struct Body {
        #[allow(dead_code)]
        items: Vec<Item>,
    }

    #[derive(Debug, Deserialize)]
    struct Item {
        #[allow(dead_code)]
        x: f64,
    }

    fn param(body: &str) -> Option<String> {
        match parse::<Body>(body.as_bytes()) {
            Err(e @ ApiError::InvalidRequest { .. }) => e.body().param,
            other => panic!("expected a 400, got {other:?}"),
        }
    }

    #[test]
    fn shape_errors_name_the_field() {
        assert_eq!(
            param(r#"{"items": [{"x": 1}, {"x": "one"}]}"#).as_deref(),
            Some("items[1].x")
        );
        assert_eq!(
            param(r#"{"other": 1}"#),
            None,
            "a missing field has no path"
        );
    }

    #[test]
    fn syntax_errors_are_400_without_param() {
        for body in ["{", r#"{"items": []} trailing"#, "", "nul"] {
            assert_eq!(param(body), None, "{body:?}");
        }
        assert!(parse::<Body>(br#"{"items": [], "extra": true}"#).is_ok());
    }

    #[test]
    fn json_content_types() {
        let check = |ct: Option<&'static str>| {
            let mut headers = HeaderMap::new();
            if let Some(ct) = ct {
                headers.insert(header::CONTENT_TYPE, HeaderValue::from_static(ct));
            }
            is_json(&headers)
        };
        assert!(check(Some("application/json")));
        assert!(check(Some("application/json; charset=utf-8")));
        assert!(check(Some("application/merge-patch+json")));
        assert!(!check(Some("text/plain")));
        assert!(!check(Some("application/x-www-form-urlencoded")));
        assert!(!check(None));
    }
}
