//! The JSON both servers speak besides their APIs: errors in vLLM's shape, `/health`, and request
//! bodies read into typed structs with the field at fault named.

use serde::{Deserialize, Serialize};

/// An error response, in the shape vLLM's `ErrorResponse` has: `{"error": {"message", "type",
/// "param", "code"}}`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ErrorResponse {
    pub error: ErrorInfo,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ErrorInfo {
    pub message: String,
    /// vLLM's names: `BadRequestError`, `NotFoundError`, `InternalServerError`, …
    #[serde(rename = "type")]
    pub kind: String,
    pub param: Option<String>,
    pub code: u16,
}

impl ErrorResponse {
    /// The error for an HTTP `status`, its `type` the name vLLM gives that status.
    pub fn new(status: u16, message: impl Into<String>, param: Option<&str>) -> Self {
        let kind = match status {
            400 | 408 | 413 | 431 => "BadRequestError",
            401 => "AuthenticationError",
            404 => "NotFoundError",
            405 => "MethodNotAllowedError",
            503 => "ServiceUnavailableError",
            504 => "TimeoutError",
            _ if status >= 500 => "InternalServerError",
            _ => "BadRequestError",
        };
        Self {
            error: ErrorInfo {
                message: message.into(),
                kind: kind.into(),
                param: param.map(str::to_string),
                code: status,
            },
        }
    }

    pub fn to_json(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("an error response serialises")
    }
}

/// `GET /health`.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Health {
    pub status: String,
}

/// Reads a request body as `T`, naming the field that is malformed (`messages[0].role: unknown
/// variant …`): the path and the message, for a 400 whose `param` is the path's first field.
/// Fields `T` does not know are ignored, as vLLM ignores them.
pub fn parse_request<T: serde::de::DeserializeOwned>(body: &[u8]) -> Result<T, (String, String)> {
    parse_request_naming_unknown(body).map(|(value, _)| value)
}

/// [`parse_request`], and the paths of the fields `T` does not know (`presence_penalty`,
/// `messages.0.name`), in the order they came.
pub fn parse_request_naming_unknown<T: serde::de::DeserializeOwned>(
    body: &[u8],
) -> Result<(T, Vec<String>), (String, String)> {
    let de = &mut serde_json::Deserializer::from_slice(body);
    let mut unknown = Vec::new();
    let mut note = |path: serde_ignored::Path| unknown.push(path.to_string());
    let watched = serde_ignored::Deserializer::new(&mut *de, &mut note);
    let value: T = serde_path_to_error::deserialize(watched).map_err(|e| {
        let path = e.path().to_string();
        let inner = e.into_inner();
        let message = if inner.is_syntax() || inner.is_eof() {
            format!("invalid JSON: {inner}")
        } else if path == "." {
            inner.to_string()
        } else {
            format!("`{path}`: {inner}")
        };
        let field = match path.split(['.', '[']).find(|s| !s.is_empty()) {
            Some(f) if f != "?" => f.to_string(),
            _ => "body".to_string(),
        };
        (field, message)
    })?;
    // Nothing may follow the object (`{…}garbage` is not a request).
    de.end()
        .map_err(|e| ("body".to_string(), format!("invalid JSON: {e}")))?;
    Ok((value, unknown))
}
