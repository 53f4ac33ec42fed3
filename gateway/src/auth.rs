//! API keys: who may call, and which caller a request counts against.
//!
//! Keys come from the configuration (`--api-key`, `SWARMGATE_API_KEYS`, or `api_keys` in the
//! file) and are sent as `Authorization: Bearer KEY`. With no key configured the API is open and
//! every request is the [`Caller::Anonymous`] caller. With keys, every route needs one except
//! the probes (`/health`, `/ready`) and, with `--metrics-public true`, `/metrics`; a missing
//! key or a wrong one is a 401 before anything else runs.
//!
//! Admin keys (`--admin-key`, `SWARMGATE_ADMIN_KEYS`, `admin_keys`) are API keys that may also
//! edit the swarm ([`Auth::admin`]): adding or removing agents needs one, whether or not the
//! rest of the API is open. Without admin keys such edits are refused (403 `admin_disabled`);
//! with them, no key is a 401, and a key that is not an admin key a 403 `admin_key_required`.
//! Reading agents' definitions (system prompts, sampling, verifier policies) needs an admin key
//! too ([`Auth::reads_definitions`]), except on a server without any key, whose API is open to
//! all; other callers see agents' names and descriptions.
//!
//! Invariants:
//! - keys are kept only as SHA-256 digests, and a presented key is compared with every digest
//!   in constant time, so neither the time taken nor the order of the keys tells an attacker how
//!   much of a guess was right;
//! - a key never appears in logs, metrics or `Debug` output; a caller is named by its
//!   [`KeyId`], a fingerprint of the digest.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use axum::extract::{FromRequestParts, Request, State};
use axum::http::request::Parts;
use axum::http::{header, HeaderMap};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};
use subtle::ConstantTimeEq;

use crate::error::ApiError;

/// An API key as configured, with what its caller may do beyond the server's bounds. Its
/// `Debug` hides it.
///
/// Flags and environment variables give bare keys; the file may give a key as a table with its
/// own bounds: `api_keys = ["sk-a", { key = "sk-batch", max_tokens = 256, rpm = 10 }]`.
#[derive(Clone, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(try_from = "serde_json::Value", into = "KeyEntry")]
pub struct ApiKey {
    key: String,
    policy: KeyPolicy,
}

/// One key's own bounds; each unset one is the server's.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct KeyPolicy {
    /// Most tokens one answer may ask for, within the server's `--max-tokens-limit`; more is
    /// a 400 naming the field, and an answer that names none gets at most this many.
    pub max_tokens: Option<usize>,
    /// Requests per minute, in place of the server's `--rpm`; 0: no limit.
    pub rpm: Option<u64>,
    /// Tokens per minute, in place of the server's `--tpm`; 0: no limit.
    pub tpm: Option<u64>,
    /// The most urgent `priority` (lower runs first) its requests may ask for; more urgent is a
    /// 400. Unset: any.
    pub min_priority: Option<i64>,
    /// Longest `cache_ttl_secs` hint, within the server's `--cache-ttl-max-secs`.
    pub max_cache_ttl_secs: Option<u64>,
}

/// How the file writes a key: bare, or a table with its bounds.
#[derive(serde::Serialize)]
#[serde(untagged)]
enum KeyEntry {
    Bare(String),
    Table(KeyTable),
}

#[derive(serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
struct KeyTable {
    key: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    max_tokens: Option<usize>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    rpm: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    tpm: Option<u64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    min_priority: Option<i64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    max_cache_ttl_secs: Option<u64>,
}

impl ApiKey {
    /// This key's own bounds.
    pub fn policy(&self) -> KeyPolicy {
        self.policy
    }
}

impl FromStr for ApiKey {
    type Err = String;

    fn from_str(key: &str) -> Result<Self, String> {
        // A bearer token is one header token: no spaces, nothing a header cannot carry.
        if key.is_empty() || !key.bytes().all(|b| b.is_ascii_graphic()) {
            return Err("an API key must be non-empty printable ASCII without spaces".into());
        }
        Ok(Self {
            key: key.to_owned(),
            policy: KeyPolicy::default(),
        })
    }
}

impl TryFrom<serde_json::Value> for ApiKey {
    type Error = String;

    fn try_from(entry: serde_json::Value) -> Result<Self, String> {
        if let serde_json::Value::String(key) = entry {
            return key.parse();
        }
        let KeyTable {
            key,
            max_tokens,
            rpm,
            tpm,
            min_priority,
            max_cache_ttl_secs,
        } = serde_path_to_error::deserialize(entry).map_err(|e| {
            let at = match e.path().to_string() {
                path if path == "." => String::new(),
                path => format!(" ({path})"),
            };
            format!(
                "a key is a string or a table of key and bounds{at}: {}",
                e.into_inner()
            )
        })?;
        if max_tokens == Some(0) {
            return Err("a key's max_tokens must be positive".into());
        }
        let most = crate::validate::hints::MAX_PRIORITY;
        if min_priority.is_some_and(|p| !(-most..=most).contains(&p)) {
            return Err(format!(
                "a key's min_priority must be between -{most} and {most}"
            ));
        }
        Ok(Self {
            policy: KeyPolicy {
                max_tokens,
                rpm,
                tpm,
                min_priority,
                max_cache_ttl_secs,
            },
            ..key.parse()?
        })
    }
}

impl From<ApiKey> for KeyEntry {
    fn from(key: ApiKey) -> Self {
        if key.policy == KeyPolicy::default() {
            Self::Bare(key.key)
        } else {
            let KeyPolicy {
                max_tokens,
                rpm,
                tpm,
                min_priority,
                max_cache_ttl_secs,
            } = key.policy;
            Self::Table(KeyTable {
                key: key.key,
                max_tokens,
                rpm,
                tpm,
                min_priority,
                max_cache_ttl_secs,
            })
        }
    }
}

impl fmt::Debug for ApiKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ApiKey")
            .field("policy", &self.policy)
            .finish_non_exhaustive()
    }
}

/// Names a key without revealing it: the first 8 bytes of its SHA-256, shown in hex. Stable
/// across restarts, so a key keeps its rate-limit bucket in a shared store.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct KeyId([u8; 8]);

impl KeyId {
    fn of(digest: &[u8; 32]) -> Self {
        let mut id = [0; 8];
        id.copy_from_slice(&digest[..8]);
        Self(id)
    }
}

impl fmt::Display for KeyId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        self.0.iter().try_for_each(|b| write!(f, "{b:02x}"))
    }
}

/// Whom a request counts against.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub enum Caller {
    /// No keys are configured: all traffic is one caller.
    #[default]
    Anonymous,
    Key(KeyId),
}

impl Caller {
    /// The salt of this caller's prefix-cache blocks: a key's blocks are found only by its own
    /// requests (past any shared prefix); without keys everything is one tenant's.
    pub fn cache_salt(self, shared_prefix: usize) -> Option<engine::CacheSalt> {
        match self {
            Self::Anonymous => None,
            Self::Key(id) => {
                let mut h = std::hash::DefaultHasher::new();
                std::hash::Hash::hash(&id, &mut h);
                Some(engine::CacheSalt {
                    salt: std::hash::Hasher::finish(&h),
                    shared_prefix,
                })
            }
        }
    }
}

impl fmt::Display for Caller {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Anonymous => f.write_str("anonymous"),
            Self::Key(id) => write!(f, "key:{id}"),
        }
    }
}

/// The caller [`authenticate`] found; a request that did not pass through it is anonymous.
impl<S: Send + Sync> FromRequestParts<S> for Caller {
    type Rejection = std::convert::Infallible;

    async fn from_request_parts(parts: &mut Parts, _: &S) -> Result<Self, Self::Rejection> {
        Ok(parts
            .extensions
            .get::<Caller>()
            .copied()
            .unwrap_or_default())
    }
}

/// The configured keys and which routes are open without one.
pub struct Auth {
    /// API keys and admin keys: each authenticates its caller.
    digests: Vec<[u8; 32]>,
    /// Whether API keys are configured, closing the API to callers without one.
    closed: bool,
    admin: Vec<[u8; 32]>,
    metrics_public: bool,
    policies: KeyPolicies,
}

/// Each key's own bounds, by the caller it authenticates as.
#[derive(Clone, Debug, Default)]
pub struct KeyPolicies(std::collections::HashMap<KeyId, KeyPolicy>);

impl KeyPolicies {
    /// The bounds of `keys` that have any.
    pub fn new<'a>(keys: impl IntoIterator<Item = &'a ApiKey>) -> Self {
        Self(
            keys.into_iter()
                .filter(|k| k.policy != KeyPolicy::default())
                .map(|k| (KeyId::of(&digest(&k.key)), k.policy))
                .collect(),
        )
    }

    /// `caller`'s own bounds (none for the anonymous caller or a key without any).
    pub fn get(&self, caller: Caller) -> KeyPolicy {
        match caller {
            Caller::Anonymous => KeyPolicy::default(),
            Caller::Key(id) => self.0.get(&id).copied().unwrap_or_default(),
        }
    }
}

/// Routes that answer without a key: probes must work for orchestrators that hold none.
const PROBES: [&str; 2] = ["/health", "/ready"];

impl Auth {
    pub fn new(keys: &[ApiKey], admin_keys: &[ApiKey], metrics_public: bool) -> Self {
        let admin: Vec<_> = admin_keys.iter().map(|k| digest(&k.key)).collect();
        Self {
            digests: keys
                .iter()
                .map(|k| digest(&k.key))
                .chain(admin.clone())
                .collect(),
            policies: KeyPolicies::new(keys.iter().chain(admin_keys)),
            closed: !keys.is_empty(),
            admin,
            metrics_public,
        }
    }

    /// `caller`'s own bounds.
    pub fn policy(&self, caller: Caller) -> KeyPolicy {
        self.policies.get(caller)
    }

    fn is_open(&self, path: &str) -> bool {
        !self.closed || PROBES.contains(&path) || (self.metrics_public && path == "/metrics")
    }

    /// The caller of a request that always needs a key when keys are configured (every gRPC
    /// call): anonymous when none is.
    pub fn check(&self, headers: &HeaderMap) -> Result<Caller, ApiError> {
        if !self.closed {
            return Ok(Caller::Anonymous);
        }
        self.caller(headers)
    }

    /// Whether `headers` carry an admin key; the error says why not (see the module header).
    pub fn admin(&self, headers: &HeaderMap) -> Result<(), ApiError> {
        if self.admin.is_empty() {
            return Err(ApiError::Forbidden {
                message: "Editing agents is turned off on this server: it has no admin key \
                          (--admin-key, SWARMGATE_ADMIN_KEYS or admin_keys)."
                    .into(),
                code: "admin_disabled",
            });
        }
        let presented = presented(headers)?;
        if bool::from(matches(&self.admin, &presented)) {
            Ok(())
        } else if bool::from(matches(&self.digests, &presented)) {
            Err(ApiError::Forbidden {
                message: "Editing agents needs an admin key; this key is not one.".into(),
                code: "admin_key_required",
            })
        } else {
            Err(ApiError::InvalidApiKey)
        }
    }

    /// Whether the caller of `headers` may read agents' definitions: on a server without any
    /// key, everyone; else only an admin key.
    pub fn reads_definitions(&self, headers: &HeaderMap) -> bool {
        if !self.closed && self.admin.is_empty() {
            return true;
        }
        presented(headers).is_ok_and(|key| bool::from(matches(&self.admin, &key)))
    }

    /// The caller `headers` authenticate as.
    fn caller(&self, headers: &HeaderMap) -> Result<Caller, ApiError> {
        let presented = presented(headers)?;
        if bool::from(matches(&self.digests, &presented)) {
            Ok(Caller::Key(KeyId::of(&presented)))
        } else {
            Err(ApiError::InvalidApiKey)
        }
    }
}

/// The digest of the bearer key in `headers`.
fn presented(headers: &HeaderMap) -> Result<[u8; 32], ApiError> {
    let value = headers
        .get(header::AUTHORIZATION)
        .ok_or(ApiError::MissingApiKey)?;
    let key = value
        .to_str()
        .ok()
        .and_then(|v| v.split_once(' '))
        .filter(|(scheme, _)| scheme.eq_ignore_ascii_case("bearer"))
        .map(|(_, key)| key.trim())
        .ok_or(ApiError::InvalidApiKey)?;
    Ok(digest(key))
}

/// Whether `presented` is one of `digests`; every digest is compared, whatever matched first.
fn matches(digests: &[[u8; 32]], presented: &[u8; 32]) -> subtle::Choice {
    digests.iter().fold(subtle::Choice::from(0), |found, d| {
        found | d.ct_eq(presented)
    })
}

fn digest(key: &str) -> [u8; 32] {
    Sha256::digest(key.as_bytes()).into()
}

/// The layer: refuses requests without a valid key (where one is needed) and records the
/// [`Caller`] for the layers and handlers after it.
pub async fn authenticate(
    State(auth): State<Arc<Auth>>,
    mut request: Request,
    next: Next,
) -> Response {
    let caller = match auth.caller(request.headers()) {
        Ok(caller) => caller,
        Err(_) if auth.is_open(request.uri().path()) => Caller::Anonymous,
        Err(error) => return error.into_response(),
    };
    request.extensions_mut().insert(caller);
    next.run(request).await
}

#[cfg(test)]
mod tests {
    use axum::http::HeaderValue;

    use super::*;

    fn keys(keys: &[&str]) -> Auth {
        let keys: Vec<ApiKey> = keys.iter().map(|k| k.parse().unwrap()).collect();
        Auth::new(&keys, &[], true)
    }

    fn bearer(value: &str) -> HeaderMap {
        let mut headers = HeaderMap::new();
        headers.insert(header::AUTHORIZATION, HeaderValue::from_str(value).unwrap());
        headers
    }

    #[test]
    fn check_needs_a_key_only_when_keys_are_configured() {
        assert_eq!(
            keys(&[]).check(&HeaderMap::new()).unwrap(),
            Caller::Anonymous
        );
        let auth = keys(&["sk-alpha"]);
        assert!(matches!(
            auth.check(&HeaderMap::new()),
            Err(ApiError::MissingApiKey)
        ));
        assert!(matches!(
            auth.check(&bearer("Bearer nope")),
            Err(ApiError::InvalidApiKey)
        ));
        assert!(auth.check(&bearer("Bearer sk-alpha")).is_ok());
    }

    #[test]
    fn a_configured_key_authenticates_as_itself() {
        let auth = keys(&["sk-alpha", "sk-beta"]);
        let alpha = auth.caller(&bearer("Bearer sk-alpha")).unwrap();
        let beta = auth.caller(&bearer("bearer  sk-beta")).unwrap();
        assert!(matches!(alpha, Caller::Key(_)));
        assert_ne!(alpha, beta, "each key is its own caller");
        assert_eq!(auth.caller(&bearer("Bearer sk-alpha")).unwrap(), alpha);
    }

    fn code(result: Result<(), ApiError>) -> &'static str {
        match result {
            Err(ApiError::Forbidden { code, .. }) => code,
            Err(ApiError::MissingApiKey | ApiError::InvalidApiKey) => "401",
            other => panic!("expected a refusal, got {other:?}"),
        }
    }

    #[test]
    fn only_admin_keys_may_administer() {
        let parse = |k: &str| -> ApiKey { k.parse().unwrap() };
        let none = Auth::new(&[parse("sk-alpha")], &[], true);
        assert_eq!(
            code(none.admin(&bearer("Bearer sk-alpha"))),
            "admin_disabled"
        );

        let auth = Auth::new(&[parse("sk-alpha")], &[parse("sk-root")], true);
        assert!(auth.admin(&bearer("Bearer sk-root")).is_ok());
        assert_eq!(
            code(auth.admin(&bearer("Bearer sk-alpha"))),
            "admin_key_required"
        );
        assert_eq!(code(auth.admin(&HeaderMap::new())), "401");
        assert_eq!(code(auth.admin(&bearer("Bearer sk-nope"))), "401");
        // An admin key is an API key too, and a caller of its own.
        let root = auth.caller(&bearer("Bearer sk-root")).unwrap();
        assert_ne!(root, auth.caller(&bearer("Bearer sk-alpha")).unwrap());
    }

    #[test]
    fn definitions_are_for_admin_keys_unless_there_are_no_keys() {
        let parse = |k: &str| -> ApiKey { k.parse().unwrap() };
        assert!(Auth::new(&[], &[], true).reads_definitions(&HeaderMap::new()));
        for auth in [
            Auth::new(&[parse("sk-alpha")], &[parse("sk-root")], true),
            Auth::new(&[], &[parse("sk-root")], true),
        ] {
            assert!(auth.reads_definitions(&bearer("Bearer sk-root")));
            assert!(!auth.reads_definitions(&bearer("Bearer sk-alpha")));
            assert!(!auth.reads_definitions(&HeaderMap::new()));
        }
        let users_only = Auth::new(&[parse("sk-alpha")], &[], true);
        assert!(!users_only.reads_definitions(&bearer("Bearer sk-alpha")));
    }

    #[test]
    fn admin_keys_alone_leave_the_api_open() {
        let auth = Auth::new(&[], &["sk-root".parse().unwrap()], true);
        assert!(auth.is_open("/v1/chat/completions"));
        assert_eq!(auth.check(&HeaderMap::new()).unwrap(), Caller::Anonymous);
        assert!(auth.admin(&bearer("Bearer sk-root")).is_ok());
        assert_eq!(code(auth.admin(&HeaderMap::new())), "401");
    }

    #[test]
    fn missing_wrong_and_malformed_keys_are_refused() {
        let auth = keys(&["sk-alpha"]);
        assert!(matches!(
            auth.caller(&HeaderMap::new()),
            Err(ApiError::MissingApiKey)
        ));
        for value in [
            "Bearer sk-alph",
            "Bearer sk-alpha2",
            "Basic sk-alpha",
            "sk-alpha",
            "Bearer ",
        ] {
            assert!(
                matches!(auth.caller(&bearer(value)), Err(ApiError::InvalidApiKey)),
                "{value:?}"
            );
        }
    }

    #[test]
    fn probes_stay_open_and_metrics_follow_the_flag() {
        let auth = keys(&["sk-alpha"]);
        assert!(auth.is_open("/health") && auth.is_open("/ready") && auth.is_open("/metrics"));
        assert!(!auth.is_open("/v1/chat/completions"));
        let private = Auth::new(&["sk-alpha".parse().unwrap()], &[], false);
        assert!(!private.is_open("/metrics"));
        assert!(
            Auth::new(&[], &[], false).is_open("/v1/chat/completions"),
            "no keys: open"
        );
    }

    #[test]
    fn keys_never_show_and_are_validated() {
        let key: ApiKey = "sk-secret".parse().unwrap();
        assert!(!format!("{key:?}").contains("secret"));
        assert!("".parse::<ApiKey>().is_err());
        assert!("sk with space".parse::<ApiKey>().is_err());
        let Caller::Key(id) = keys(&["sk-secret"])
            .caller(&bearer("Bearer sk-secret"))
            .unwrap()
        else {
            panic!("a configured key");
        };
        assert_eq!(id.to_string().len(), 16);
        assert!(!id.to_string().contains("secret"));
    }
}
