//! Bearer credentials: the front door's API keys and the router's admin token, checked the
//! same way (`Authorization: Bearer <key>`), refused with OpenAI's 401 body.
//!
//! Keys are kept only as BLAKE3 digests, compared in constant time, and never logged or
//! echoed (OpenAI echoes a masked key; a 401 here names none).
//!
//! A keys file holds one key per line, optionally followed by what the key may ask of flow
//! control: `sk-team-a-0123456789 priority=0 max-priority=10` (its default priority, and the
//! highest a request with it may name: a higher one is lowered to it).
//!
//! A key's id, its tenant in flow control, metrics and logs, is a keyed hash of the key
//! (`t-` and 16 hex digits): keyed by the deployment's salt ([`Credentials::with_salt`]), or
//! by default by the digests of all its keys, so that nobody can tell from an id which key it
//! is without the deployment's secret or every key.

use std::path::Path;
use std::sync::Arc;

use axum::Router;
use axum::extract::{Request, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};

use crate::ApiError;

/// Which key a request carried: its id (a keyed hash, the same for every request with that
/// key) and what it may ask. Handlers behind [`require`] find it in the request's extensions.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeyId {
    pub id: String,
    pub grant: Grant,
}

impl KeyId {
    /// A key's id with no grant of its own (tests).
    pub fn named(id: impl Into<String>) -> Self {
        Self { id: id.into(), grant: Grant::default() }
    }
}

/// What a key may ask of flow control, from its line of the keys file.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Grant {
    /// The priority of its requests that name none (`priority=N`).
    pub priority: Option<i32>,
    /// The highest priority its requests may name (`max-priority=N`); a higher one is lowered
    /// to it.
    pub max_priority: Option<i32>,
}

/// A set of accepted bearer keys; empty accepts everyone. Cheap to clone.
#[derive(Clone, Default)]
pub struct Credentials {
    digests: Arc<[(blake3::Hash, Grant)]>,
    /// The key of the ids' hash; `None`: derived from the digests.
    salt: Option<[u8; 32]>,
}

impl std::fmt::Debug for Credentials {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Credentials({} keys)", self.digests.len())
    }
}

/// Why keys could not be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum CredentialsError {
    #[error("reading {path}")]
    Read { path: String, source: std::io::Error },
    #[error("{0}: a key must be 8 to 256 visible ASCII characters")]
    Invalid(String),
    #[error(
        "{origin}: {option:?} is no key option (priority=N, max-priority=N, N from {} to {})",
        kvroute_core::schedule::flow::MIN_PRIORITY,
        kvroute_core::schedule::flow::MAX_PRIORITY
    )]
    Option { origin: String, option: String },
}

/// A key's options (`priority=N`, `max-priority=N`).
fn grant(options: &[&str], origin: &str) -> Result<Grant, CredentialsError> {
    use kvroute_core::schedule::flow::{MAX_PRIORITY, MIN_PRIORITY};
    let mut grant = Grant::default();
    for option in options {
        let bad =
            || CredentialsError::Option { origin: origin.to_owned(), option: (*option).to_owned() };
        let (name, value) = option.split_once('=').ok_or_else(bad)?;
        let value: i32 = value.parse().map_err(|_| bad())?;
        if !(MIN_PRIORITY..=MAX_PRIORITY).contains(&value) {
            return Err(bad());
        }
        match name {
            "priority" => grant.priority = Some(value),
            "max-priority" | "max_priority" => grant.max_priority = Some(value),
            _ => return Err(bad()),
        }
    }
    Ok(grant)
}

impl Credentials {
    /// Accepts each of `keys` (surrounding whitespace trimmed; empty entries skipped), each
    /// optionally followed by its options (`KEY priority=0 max-priority=10`). `origin` names
    /// where they came from, in errors (never the key).
    pub fn new<I, S>(keys: I, origin: &str) -> Result<Self, CredentialsError>
    where
        I: IntoIterator<Item = S>,
        S: AsRef<str>,
    {
        let mut digests = Vec::new();
        for entry in keys {
            let mut words = entry.as_ref().split_whitespace();
            let Some(key) = words.next() else { continue };
            let options: Vec<&str> = words.collect();
            let visible = key.bytes().all(|b| b.is_ascii_graphic());
            if !(8..=256).contains(&key.len()) || !visible {
                return Err(CredentialsError::Invalid(origin.to_owned()));
            }
            digests.push((blake3::hash(key.as_bytes()), grant(&options, origin)?));
        }
        Ok(Self { digests: digests.into(), salt: None })
    }

    /// Ids keyed by `secret` (the deployment's: the same on every replica), not by the keys.
    #[must_use]
    pub fn with_salt(mut self, secret: &[u8]) -> Self {
        let mut h = blake3::Hasher::new_derive_key("kvroute 2026-12 tenant ids");
        self.salt = Some(*h.update(secret).finalize().as_bytes());
        self
    }

    /// The key of the ids' hash.
    fn salt(&self) -> [u8; 32] {
        if let Some(salt) = self.salt {
            return salt;
        }
        let mut digests: Vec<&[u8; 32]> = self.digests.iter().map(|(d, _)| d.as_bytes()).collect();
        digests.sort_unstable();
        let mut h = blake3::Hasher::new_derive_key("kvroute 2026-12 tenant ids of a key set");
        for d in digests {
            h.update(d);
        }
        *h.finalize().as_bytes()
    }

    /// Keys from a file, one per line; blank lines and lines starting with `#` are skipped.
    pub fn from_file(path: &Path) -> Result<Self, CredentialsError> {
        let origin = path.display().to_string();
        let text = std::fs::read_to_string(path)
            .map_err(|source| CredentialsError::Read { path: origin.clone(), source })?;
        Self::new(text.lines().filter(|l| !l.trim_start().starts_with('#')), &origin)
    }

    /// These keys and `other`'s (with this set's salt, if it has one, else `other`'s).
    #[must_use]
    pub fn and(&self, other: &Self) -> Self {
        Self {
            digests: self.digests.iter().chain(other.digests.iter()).copied().collect(),
            salt: self.salt.or(other.salt),
        }
    }

    pub fn is_empty(&self) -> bool {
        self.digests.is_empty()
    }

    pub fn len(&self) -> usize {
        self.digests.len()
    }

    /// Whether `key` is one of the keys.
    pub fn accepts(&self, key: &str) -> bool {
        self.find(key).is_some()
    }

    /// The id of `key` if it is one of the keys.
    fn find(&self, key: &str) -> Option<KeyId> {
        let digest = blake3::hash(key.as_bytes());
        // `Hash` compares in constant time; every key is compared.
        let mut found = None;
        for (d, grant) in self.digests.iter() {
            if *d == digest {
                found = Some(*grant);
            }
        }
        let grant = found?;
        let id = blake3::keyed_hash(&self.salt(), key.as_bytes());
        Some(KeyId { id: format!("t-{}", &id.to_hex()[..16]), grant })
    }

    /// Checks a request's `Authorization: Bearer` header: the key's id, or `None` when no key
    /// is set.
    pub fn check(&self, headers: &HeaderMap) -> Result<Option<KeyId>, ApiError> {
        if self.is_empty() {
            return Ok(None);
        }
        let Some(value) = headers.get(header::AUTHORIZATION) else {
            return Err(unauthorized(
                "You didn't provide an API key. You need to provide your API key in an Authorization header using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).",
                None,
            ));
        };
        match bearer_token(value.as_bytes()).and_then(|k| self.find(k)) {
            Some(id) => Ok(Some(id)),
            None => Err(unauthorized("Incorrect API key provided.", Some("invalid_api_key"))),
        }
    }
}

/// The token of `Bearer <token>` as RFC 9110 (section 11) and RFC 6750 parse it: the scheme
/// matched without regard to case, then one or more spaces, then the token, which ends at the
/// field's end (trailing whitespace is not part of a field value) and holds no space.
/// Anything else, another scheme or a token with a space inside, is no token.
pub fn bearer_token(value: &[u8]) -> Option<&str> {
    let value = std::str::from_utf8(value).ok()?.trim_matches([' ', '\t']);
    let (scheme, rest) = value.split_once(' ')?;
    if !scheme.eq_ignore_ascii_case("bearer") {
        return None;
    }
    let token = rest.trim_start_matches(' ');
    (!token.is_empty() && !token.contains([' ', '\t'])).then_some(token)
}

fn unauthorized(message: &str, code: Option<&'static str>) -> ApiError {
    let e = ApiError::new(StatusCode::UNAUTHORIZED, message).kind("invalid_request_error");
    match code {
        Some(code) => e.code(code),
        None => e.no_code(),
    }
}

/// `router`'s routes (those added so far) answer only requests that carry one of `keys`;
/// nothing changes when `keys` is empty.
pub fn require<S: Clone + Send + Sync + 'static>(
    router: Router<S>,
    keys: Credentials,
) -> Router<S> {
    if keys.is_empty() {
        return router;
    }
    router.route_layer(middleware::from_fn_with_state(keys, check_request))
}

/// `router`'s routes (those added so far) answer nobody: a 403 saying `why` (an admin route
/// while API keys guard the others but no admin token is set).
pub fn closed<S: Clone + Send + Sync + 'static>(router: Router<S>, why: &'static str) -> Router<S> {
    router.route_layer(middleware::from_fn(move |_request: Request, _next: Next| async move {
        ApiError::new(StatusCode::FORBIDDEN, why).into_response()
    }))
}

/// The admin routes' guard beside API keys: the admin token when one is set; closed when
/// API keys are set without one (what the keys keep from clients must not be open beside
/// them); open when neither is (loopback, or `--insecure` behind a proxy).
pub fn admin<S: Clone + Send + Sync + 'static>(
    router: Router<S>,
    admin: Credentials,
    api_keys: &Credentials,
) -> Router<S> {
    match (admin.is_empty(), api_keys.is_empty()) {
        (true, false) => closed(
            router,
            "this route needs the admin token, and none is set (--admin-token-file or \
             KVROUTE_ADMIN_TOKEN)",
        ),
        _ => require_admin(router, admin),
    }
}

/// Routes that change where prompts go (a worker added, drained or removed): the admin token,
/// always, whatever the address; closed (403) when none is set.
pub fn mutations<S: Clone + Send + Sync + 'static>(
    router: Router<S>,
    admin: Credentials,
) -> Router<S> {
    match admin.is_empty() {
        true => closed(
            router,
            "adding, draining or removing a worker needs the admin token, and none is set: \
             start with --admin-token-file or KVROUTE_ADMIN_TOKEN",
        ),
        false => require_admin(router, admin),
    }
}

/// [`require`] for the admin token: its answers name the admin token, not an API key.
pub fn require_admin<S: Clone + Send + Sync + 'static>(
    router: Router<S>,
    admin: Credentials,
) -> Router<S> {
    if admin.is_empty() {
        return router;
    }
    router.route_layer(middleware::from_fn_with_state(admin, check_admin_request))
}

async fn check_admin_request(
    State(keys): State<Credentials>,
    request: Request,
    next: Next,
) -> Response {
    let error = match request.headers().get(header::AUTHORIZATION) {
        None => unauthorized(
            "This route needs the admin token, in an Authorization header using Bearer auth \
             (Authorization: Bearer ADMIN_TOKEN); it is the one in --admin-token-file or \
             KVROUTE_ADMIN_TOKEN.",
            None,
        ),
        Some(value) if bearer_token(value.as_bytes()).is_some_and(|k| keys.accepts(k)) => {
            return next.run(request).await;
        }
        Some(_) => unauthorized("Incorrect admin token provided.", Some("invalid_admin_token")),
    };
    let mut response = error.into_response();
    response
        .headers_mut()
        .insert(header::WWW_AUTHENTICATE, header::HeaderValue::from_static("Bearer"));
    response
}

async fn check_request(
    State(keys): State<Credentials>,
    mut request: Request,
    next: Next,
) -> Response {
    match keys.check(request.headers()) {
        Ok(id) => {
            if let Some(id) = id {
                request.extensions_mut().insert(id);
            }
            next.run(request).await
        }
        Err(e) => {
            let mut response = e.into_response();
            response
                .headers_mut()
                .insert(header::WWW_AUTHENTICATE, header::HeaderValue::from_static("Bearer"));
            response
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use super::*;
    use axum::routing::get;

    fn bearer(key: &str) -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(header::AUTHORIZATION, format!("Bearer {key}").parse().unwrap());
        h
    }

    #[test]
    fn several_keys_each_accepted_others_refused() {
        let keys = Credentials::new(["sk-first-key", " sk-second-key ", ""], "test").unwrap();
        assert_eq!(keys.len(), 2);
        let first = keys.check(&bearer("sk-first-key")).unwrap().unwrap();
        let second = keys.check(&bearer("sk-second-key")).unwrap().unwrap();
        assert_ne!(first, second, "each key its id");
        assert_eq!(keys.check(&bearer("sk-first-key")).unwrap(), Some(first.clone()));
        assert_eq!(first.id.len(), 18);
        assert!(first.id.starts_with("t-"));
        assert!(!first.id.contains("first"), "the id is no part of the key");
        let unkeyed = blake3::hash(b"sk-first-key").to_hex();
        assert!(!unkeyed.starts_with(&first.id[2..]), "a keyed hash, not the key's digest");
        let wrong = keys.check(&bearer("sk-first-kez")).unwrap_err();
        assert_eq!(wrong.status(), StatusCode::UNAUTHORIZED);
        let body = serde_json::to_value(wrong.body()).unwrap();
        assert_eq!(body["error"]["code"], "invalid_api_key");
        assert_eq!(body["error"]["type"], "invalid_request_error");
        assert!(!body.to_string().contains("sk-first"), "no key in the body: {body}");
        let missing = keys.check(&HeaderMap::new()).unwrap_err();
        assert!(missing.message().starts_with("You didn't provide an API key"));
        assert_eq!(Credentials::default().check(&HeaderMap::new()).unwrap(), None, "open");
        assert!(format!("{keys:?}").ends_with("(2 keys)"), "Debug shows no key");
    }

    #[test]
    fn the_scheme_is_case_insensitive_and_spaces_are_not_part_of_the_key() {
        for ok in ["Bearer k", "bearer k", "BEARER k", "bEaReR   k", "Bearer k  ", "\tBearer k"] {
            assert_eq!(bearer_token(ok.as_bytes()), Some("k"), "{ok:?}");
        }
        for bad in
            ["Bearer", "Bearer ", "Bearer  ", "Bearer k k", "Basic k", "Bearerk", "Bearer\tk", ""]
        {
            assert_eq!(bearer_token(bad.as_bytes()), None, "{bad:?}");
        }
        let keys = Credentials::new(["sk-test-0123456789"], "test").unwrap();
        assert!(keys.check(&bearer("sk-test-0123456789")).is_ok());
        let mut headers = HeaderMap::new();
        headers.insert(header::AUTHORIZATION, "BEARER sk-test-0123456789".parse().unwrap());
        assert!(keys.check(&headers).is_ok());
        headers.insert(header::AUTHORIZATION, "Bearer sk-test-0123456789 x".parse().unwrap());
        assert!(keys.check(&headers).is_err(), "a space inside is no key");
    }

    #[test]
    fn a_key_carries_its_grant_and_ids_depend_on_the_salt() {
        let keys = Credentials::new(
            ["sk-low-0123456789 priority=-1 max-priority=0", "sk-plain-0123456789"],
            "t",
        )
        .unwrap();
        let low = keys.check(&bearer("sk-low-0123456789")).unwrap().unwrap();
        assert_eq!(low.grant, Grant { priority: Some(-1), max_priority: Some(0) });
        let plain = keys.check(&bearer("sk-plain-0123456789")).unwrap().unwrap();
        assert_eq!(plain.grant, Grant::default());
        assert!(keys.check(&bearer("sk-low-0123456789 priority=-1")).is_err());
        // Another key set, another id for the same key; a salt fixes ids across key sets.
        let more = Credentials::new(["sk-plain-0123456789", "sk-other-0123456789"], "t").unwrap();
        let again = more.check(&bearer("sk-plain-0123456789")).unwrap().unwrap();
        assert_ne!(again.id, plain.id);
        let salted = |k: &Credentials| {
            let k = k.clone().with_salt(b"deployment");
            k.check(&bearer("sk-plain-0123456789")).unwrap().unwrap().id
        };
        assert_eq!(salted(&keys), salted(&more));
        assert_ne!(salted(&keys), plain.id);
        for bad in [
            "sk-low-0123456789 priority=x",
            "sk-low-0123456789 max-priority=1000",
            "sk-low-0123456789 weight=3",
        ] {
            let e = Credentials::new([bad], "keys").unwrap_err();
            assert!(e.to_string().starts_with("keys: "), "{e}");
            assert!(!e.to_string().contains("sk-low"), "no key in the error: {e}");
        }
    }

    #[test]
    fn short_or_invisible_keys_are_refused() {
        assert!(Credentials::new(["short"], "t").is_err());
        assert!(Credentials::new(["has a space in it"], "t").is_err());
        let err = Credentials::new(["sk-\u{e9}t\u{e9}-key"], "KVROUTE_API_KEYS").unwrap_err();
        assert_eq!(
            err.to_string(),
            "KVROUTE_API_KEYS: a key must be 8 to 256 visible ASCII characters"
        );
    }

    #[tokio::test]
    async fn routes_added_before_require_need_a_key_later_ones_do_not() {
        let keys = Credentials::new(["sk-test-0001"], "t").unwrap();
        let app = require(Router::new().route("/secret", get(|| async { "yes" })), keys)
            .route("/health", get(|| async { "ok" }));
        let call = |uri: &'static str, key: Option<&'static str>| {
            let app = app.clone();
            async move {
                let mut r = axum::http::Request::get(uri);
                if let Some(k) = key {
                    r = r.header(header::AUTHORIZATION, format!("Bearer {k}"));
                }
                crate::testing::call_raw(&app, r.body(axum::body::Body::empty()).unwrap()).await
            }
        };
        assert_eq!(call("/secret", None).await.0, StatusCode::UNAUTHORIZED);
        assert_eq!(call("/secret", Some("sk-test-0002")).await.0, StatusCode::UNAUTHORIZED);
        assert_eq!(call("/secret", Some("sk-test-0001")).await.0, StatusCode::OK);
        assert_eq!(call("/health", None).await.0, StatusCode::OK);
    }

    /// #64 finding 5: with API keys and no admin token the admin routes are closed, not open.
    #[tokio::test]
    async fn admin_routes_are_closed_when_keys_are_on_without_an_admin_token() {
        let keys = Credentials::new(["sk-client-0001"], "t").unwrap();
        let token = Credentials::new(["admin-token-01"], "t").unwrap();
        let routes = || Router::new().route("/metrics", get(|| async { "counters" }));
        let get_with = |app: Router, key: Option<&'static str>| async move {
            let mut r = axum::http::Request::get("/metrics");
            if let Some(k) = key {
                r = r.header(header::AUTHORIZATION, format!("Bearer {k}"));
            }
            crate::testing::call_raw(&app, r.body(axum::body::Body::empty()).unwrap()).await.0
        };
        let closed = admin(routes(), Credentials::default(), &keys);
        assert_eq!(get_with(closed.clone(), None).await, StatusCode::FORBIDDEN);
        assert_eq!(get_with(closed, Some("sk-client-0001")).await, StatusCode::FORBIDDEN);
        let guarded = admin(routes(), token, &keys);
        assert_eq!(get_with(guarded.clone(), None).await, StatusCode::UNAUTHORIZED);
        assert_eq!(get_with(guarded, Some("admin-token-01")).await, StatusCode::OK);
        let open = admin(routes(), Credentials::default(), &Credentials::default());
        assert_eq!(get_with(open, None).await, StatusCode::OK, "neither set: loopback's default");
    }
}
