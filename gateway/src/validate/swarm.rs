//! `POST /v1/swarm/route`: a wire request to the text to route and the strategy to use.
//!
//! The messages pass the same checks as chat's; the text routed on is the last user turn, which
//! must exist and not be blank.

use router::RoutingStrategy;

use crate::api::swarm::RouteRequest;
use crate::error::ApiError;

/// A route request that passed validation.
#[derive(Clone, Debug, PartialEq)]
pub struct ValidRouteRequest {
    /// The last user turn.
    pub text: String,
    /// The request's override, if any.
    pub strategy: Option<RoutingStrategy>,
}

pub fn validate_route(request: RouteRequest) -> Result<ValidRouteRequest, ApiError> {
    let strategy = match request.strategy.as_deref() {
        None => None,
        Some("embedding") => Some(RoutingStrategy::Embedding),
        Some("llm") => Some(RoutingStrategy::Llm),
        Some(other) => {
            return Err(ApiError::invalid(
                "strategy",
                format!("strategy '{other}' is not one of 'embedding', 'llm'"),
            ))
        }
    };
    let messages = super::messages(request.messages)?;
    let text = router::route::last_user_turn(&messages)
        .filter(|t| !t.trim().is_empty())
        .ok_or_else(|| {
            ApiError::invalid(
                "messages",
                "messages must contain a user message with text to route",
            )
        })?
        .to_owned();
    Ok(ValidRouteRequest { text, strategy })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::api::{ChatMessage, MessageContent};

    fn message(role: &str, text: &str) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: Some(MessageContent::Text(text.into())),
            ..ChatMessage::default()
        }
    }

    fn param(e: ApiError) -> Option<String> {
        match e {
            ApiError::InvalidRequest { param, .. } => param,
            other => panic!("expected a 400, got {other:?}"),
        }
    }

    #[test]
    fn the_last_user_turn_is_routed() {
        let request = RouteRequest {
            messages: vec![
                message("system", "s"),
                message("user", "first"),
                message("assistant", "a"),
                message("user", "second"),
            ],
            strategy: Some("llm".into()),
        };
        let valid = validate_route(request).unwrap();
        assert_eq!(valid.text, "second");
        assert_eq!(valid.strategy, Some(RoutingStrategy::Llm));
    }

    #[test]
    fn bad_requests_name_their_field() {
        let no_user = RouteRequest {
            messages: vec![message("system", "s")],
            strategy: None,
        };
        assert_eq!(
            param(validate_route(no_user).unwrap_err()).as_deref(),
            Some("messages")
        );
        let blank = RouteRequest {
            messages: vec![message("user", "  ")],
            strategy: None,
        };
        assert_eq!(
            param(validate_route(blank).unwrap_err()).as_deref(),
            Some("messages")
        );
        let unknown = RouteRequest {
            messages: vec![message("user", "hi")],
            strategy: Some("dice".into()),
        };
        assert_eq!(
            param(validate_route(unknown).unwrap_err()).as_deref(),
            Some("strategy")
        );
        let bad_role = RouteRequest {
            messages: vec![message("robot", "hi")],
            strategy: None,
        };
        assert_eq!(
            param(validate_route(bad_role).unwrap_err()).as_deref(),
            Some("messages[0].role")
        );
    }
}
