//! The Responses API's stored responses: each kept in the [`StateStore`] with the input it
//! answered, under its caller and id, so another API key never sees it, and in Redis with
//! `--redis`, so every replica does. A response is kept `--session-ttl-secs` after its last use
//! (0: nothing is stored) and its input within `--session-max-bytes`, dropping the oldest turns
//! first ([`trim`]), as a session's history.

use std::sync::Arc;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::api::responses::{InputItem, Response};
use crate::auth::Caller;
use crate::config::ServeConfig;
use crate::error::ApiError;
use crate::state::{HistoryLimit, StateStore};

/// The stored responses: where they live and for how long.
#[derive(Clone)]
pub struct StoredResponses {
    store: Arc<dyn StateStore>,
    /// `None`: nothing is stored.
    limit: Option<HistoryLimit>,
}

/// A stored response as written.
#[derive(Serialize)]
struct RecordRef<'a> {
    response: &'a Response,
    input: &'a [InputItem],
    run: &'a str,
}

/// A stored response as read back: the response as it was sent, the input it answered, and the
/// agent run it was a turn of ([`crate::runs`]; absent in records older than runs).
#[derive(Deserialize)]
pub struct Stored {
    pub response: Value,
    pub input: Vec<InputItem>,
    #[serde(default)]
    pub run: Option<String>,
}

impl Stored {
    /// What a request continuing from this response goes after: its input, then its output
    /// (output items read as the input items they are).
    pub fn context(self) -> Result<Vec<InputItem>, ApiError> {
        let output: Vec<InputItem> = serde_json::from_value(self.response["output"].clone())
            .map_err(|e| ApiError::Internal(format!("a stored response's output: {e}")))?;
        let mut items = self.input;
        items.extend(output);
        Ok(items)
    }
}

impl StoredResponses {
    /// The stored responses `config` sets (the sessions' TTL and size), kept in `store`.
    pub fn new(config: &ServeConfig, store: Arc<dyn StateStore>) -> Self {
        let limit = (config.session_ttl_secs > 0).then(|| HistoryLimit {
            ttl: Duration::from_secs(config.session_ttl_secs),
            max_bytes: config.session_max_bytes,
        });
        Self { store, limit }
    }

    /// Whether responses are stored at all.
    pub fn enabled(&self) -> bool {
        self.limit.is_some()
    }

    /// Stores `response` of `caller`, a turn of `run` which answered `input`, trimmed to the
    /// size bound.
    pub async fn put(
        &self,
        caller: Caller,
        response: &Response,
        mut input: Vec<InputItem>,
        run: &str,
    ) -> Result<(), ApiError> {
        let Some(limit) = self.limit else {
            return Ok(());
        };
        trim(&mut input, limit.max_bytes);
        let record = RecordRef {
            response,
            input: &input,
            run,
        };
        let record = serde_json::to_string(&record).expect("a response serializes to JSON");
        let name = name(caller, &response.id);
        Ok(self.store.put_response(&name, &record, limit.ttl).await?)
    }

    /// `caller`'s response `id`; a 404 (naming `param`, the field that named it) when there is
    /// none.
    pub async fn get(
        &self,
        caller: Caller,
        id: &str,
        param: Option<&'static str>,
    ) -> Result<Stored, ApiError> {
        let not_found = || ApiError::ResponseNotFound {
            id: id.to_owned(),
            param,
        };
        let Some(limit) = self.limit else {
            return Err(match param {
                Some(param) => ApiError::invalid(
                    param,
                    "responses are not stored on this server (--session-ttl-secs 0)",
                ),
                None => not_found(),
            });
        };
        let record = self.store.response(&name(caller, id), limit.ttl).await?;
        let record = record.ok_or_else(not_found)?;
        serde_json::from_str(&record)
            .map_err(|e| ApiError::Internal(format!("a stored response is not valid: {e}")))
    }

    /// Deletes `caller`'s response `id`; a 404 when there is none.
    pub async fn delete(&self, caller: Caller, id: &str) -> Result<(), ApiError> {
        if self.limit.is_some() && self.store.delete_response(&name(caller, id)).await? {
            return Ok(());
        }
        Err(ApiError::ResponseNotFound {
            id: id.to_owned(),
            param: None,
        })
    }
}

/// The store's name of `caller`'s response `id`.
fn name(caller: Caller, id: &str) -> String {
    format!("{caller}:{id}")
}

/// Drops `items`' oldest turns while they hold more than `max_bytes` as JSON. A turn starts at a
/// user message, so a call is never kept without the message before it nor an output without
/// its call; the system and developer messages the items begin with stay, and so does the last
/// turn, whatever their size.
pub fn trim(items: &mut Vec<InputItem>, max_bytes: usize) {
    let sizes: Vec<usize> = items
        .iter()
        .map(|item| serde_json::to_string(item).map_or(0, |json| json.len()))
        .collect();
    let mut bytes: usize = sizes.iter().sum();
    let opening = items
        .iter()
        .take_while(|item| is_role(item, "system"))
        .count();
    let mut cut = opening;
    for start in opening + 1..items.len() {
        if bytes <= max_bytes {
            break;
        }
        if is_role(&items[start], "user") {
            bytes -= sizes[cut..start].iter().sum::<usize>();
            cut = start;
        }
    }
    items.drain(opening..cut);
}

/// Whether `item` is a message of `role` (`system` counting `developer`).
fn is_role(item: &InputItem, role: &str) -> bool {
    let message = matches!(item.kind.as_deref(), None | Some("message"));
    let of = item.role.as_deref();
    message && (of == Some(role) || (role == "system" && of == Some("developer")))
}
