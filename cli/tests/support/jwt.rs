//! NATS's decentralized authentication for a test's own server, made as `nsc` makes it: an
//! operator's nkey signs account JWTs, an account's nkey signs its users' JWTs, and a user
//! connects with a `.creds` file (its JWT and its seed). The server trusts the operator and
//! knows the accounts from its configuration ([`server_config`]).

use base64::Engine as _;
use nkeys::KeyPair;
use serde_json::{json, Value};

/// A JWT of `claims` about `subject` (a public key), issued and signed by `issuer`.
fn jwt(issuer: &KeyPair, subject: &str, name: &str, nats: Value) -> String {
    let b64 = base64::engine::general_purpose::URL_SAFE_NO_PAD;
    let iat = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_secs();
    let claims = json!({
        "jti": uuid::Uuid::new_v4().simple().to_string().to_uppercase(),
        "iat": iat,
        "iss": issuer.public_key(),
        "name": name,
        "sub": subject,
        "nats": nats,
    });
    let header = b64.encode(r#"{"typ":"JWT","alg":"ed25519-nkey"}"#);
    let signed = format!("{header}.{}", b64.encode(claims.to_string()));
    let signature = issuer.sign(signed.as_bytes()).unwrap();
    format!("{signed}.{}", b64.encode(signature))
}

pub struct Operator {
    key: KeyPair,
    pub jwt: String,
    /// The server's own account (JetStream needs one).
    system: Account,
}

pub struct Account {
    key: KeyPair,
    pub jwt: String,
}

impl Operator {
    pub fn new(name: &str) -> Self {
        let key = KeyPair::new_operator();
        let system = account(&key, "SYS", false);
        let jwt = jwt(
            &key,
            &key.public_key(),
            name,
            json!({"type": "operator", "version": 2, "system_account": system.public_key()}),
        );
        Self { key, jwt, system }
    }

    /// An account this operator signs, with no limits and JetStream on.
    pub fn account(&self, name: &str) -> Account {
        account(&self.key, name, true)
    }
}

/// An account `operator` signs, without limits; with JetStream when `jetstream`.
fn account(operator: &KeyPair, name: &str, jetstream: bool) -> Account {
    let key = KeyPair::new_account();
    let storage = if jetstream { -1 } else { 0 };
    let limits = json!({
        "subs": -1, "data": -1, "payload": -1, "imports": -1, "exports": -1,
        "wildcards": true, "conn": -1, "leaf": -1,
        "mem_storage": storage, "disk_storage": storage, "streams": storage, "consumer": storage,
    });
    let jwt = jwt(
        operator,
        &key.public_key(),
        name,
        json!({"type": "account", "version": 2, "limits": limits}),
    );
    Account { key, jwt }
}

impl Account {
    pub fn public_key(&self) -> String {
        self.key.public_key()
    }

    /// A new user of this account, as the text of its `.creds` file.
    pub fn user_creds(&self, name: &str) -> String {
        let user = KeyPair::new_user();
        let jwt = jwt(
            &self.key,
            &user.public_key(),
            name,
            json!({
                "type": "user", "version": 2, "pub": {}, "sub": {},
                "subs": -1, "data": -1, "payload": -1,
            }),
        );
        let seed = user.seed().unwrap();
        format!(
            "-----BEGIN NATS USER JWT-----\n{jwt}\n------END NATS USER JWT------\n\n\
             -----BEGIN USER NKEY SEED-----\n{seed}\n------END USER NKEY SEED------\n"
        )
    }
}

/// A server configuration trusting `operator` and knowing `accounts` (and its system account).
pub fn server_config(operator: &Operator, accounts: &[&Account]) -> String {
    let preload: String = accounts
        .iter()
        .chain([&&operator.system])
        .map(|a| format!("  {}: \"{}\"\n", a.public_key(), a.jwt))
        .collect();
    format!(
        "operator: \"{}\"\nsystem_account: {}\nresolver: MEMORY\nresolver_preload: {{\n{preload}}}\n",
        operator.jwt,
        operator.system.public_key()
    )
}
