//! Agent runs: which run (program) a request is a turn of, so that the engine serves runs first
//! come, first served and holds a turn's KV cache for the follow-up that brings its tools'
//! results.
//!
//! A request names its run with the `x-swarmgate-run-id` header; without it, a chat request in a
//! session is a turn of the session's run, and a Responses API request continuing from a stored
//! response (`previous_response_id`) a turn of that chain's run, which the chain's first
//! response started. Runs are their caller's: two API keys naming the same id name two runs.

use axum::http::HeaderMap;
use engine::RunTurn;

use crate::auth::Caller;
use crate::error::ApiError;
use crate::session::header_id;

/// The header that names a request's run.
pub const RUN_HEADER: &str = "x-swarmgate-run-id";

/// The run `headers` name, else the session's (`session`: its name in the store, which is its
/// caller's already).
pub fn run_key(
    caller: Caller,
    headers: &HeaderMap,
    session: Option<&str>,
) -> Result<Option<String>, ApiError> {
    Ok(match header_id(headers, RUN_HEADER)? {
        Some(id) => Some(format!("{caller}:run:{id}")),
        None => session.map(|name| format!("session:{name}")),
    })
}

/// The run of the Responses chain that `root` (a response's id) started.
pub fn chain_key(caller: Caller, root: &str) -> String {
    format!("{caller}:response:{root}")
}

/// The engine's view of a turn of `run`, served by `program` (the model or agent, whose pauses
/// between turns the engine learns).
pub fn turn(run: Option<&str>, program: &str) -> Option<RunTurn> {
    run.map(|id| RunTurn {
        id: id.to_owned(),
        program: program.to_owned(),
        warm_up: false,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_header_names_the_run_else_the_session_and_runs_are_the_callers_own() {
        let mut headers = HeaderMap::new();
        assert_eq!(run_key(Caller::Anonymous, &headers, None).unwrap(), None);
        let session = run_key(Caller::Anonymous, &headers, Some("anonymous:s1")).unwrap();
        assert_eq!(session.as_deref(), Some("session:anonymous:s1"));
        headers.insert(RUN_HEADER, "job-7".parse().unwrap());
        let named = run_key(Caller::Anonymous, &headers, Some("anonymous:s1")).unwrap();
        assert_eq!(named.as_deref(), Some("anonymous:run:job-7"));
        headers.insert(RUN_HEADER, "".parse().unwrap());
        assert!(run_key(Caller::Anonymous, &headers, None).is_err());
    }
}
