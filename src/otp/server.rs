//! The HTTP side of the OTP server: `POST /store-key`, `POST /otp`, `POST /revoke`, `/healthz` on
//! the TLS port; `/healthz` and `/metrics` on a separate plain-HTTP admin port, so the port build
//! pods can reach exposes nothing but the endpoints the controller and they need.
//!
//! `/store-key` speaks the Go controller's protocol (body: key, answer: token) and, with
//! `?owner=<TaskRun UID>&request=<id>`, the controller's idempotent one: retries of one request
//! get the same token and entry. `&rearm=<token>` makes a used token of the same owner redeem once
//! more with the new key (a TaskRun retry attempt mounts the token its failed attempt used);
//! `&rearm=latest` names the owner's latest token without the caller knowing it. `&rearms=<n>`
//! says how many more re-arms may follow (the TaskRun's retries not yet started): a redeem of a
//! used token with one to come waits up to `--rearm-wait` for it, any other is refused at once.
//! `/revoke?owner=<uid>` deletes an owner's entries when its TaskRun ends.

use std::sync::Arc;
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Body;
use axum::extract::{Query, State};
use axum::http::{HeaderMap, HeaderValue, StatusCode, Uri, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use tokio_util::sync::CancellationToken;
use zeroize::Zeroizing;

use super::hold::{Holds, NoHold, Wake};
use super::metrics::OtpMetrics;
use super::seal::Sealer;
use super::secret_file::SecretFile;
use super::store::{
    Claim, MAX_ARMS, MAX_ID_LEN, Redeemed, Refusal, Store, StoreError, StoreOutcome, StoreRefusal,
    StoreRequest, Stored, request_digest,
};
use super::token::{Token, TokenHash};
use crate::serve::{BodyDeadline, Reserve};

/// Header carrying a client-chosen idempotency key on `/store-key`.
pub const IDEMPOTENCY_KEY: &str = "idempotency-key";
/// Longest idempotency key accepted.
pub const MAX_IDEMPOTENCY_KEY: usize = MAX_ID_LEN;
/// Largest `/otp` body (a token plus whitespace).
const MAX_TOKEN_BODY: usize = 1024;

/// Shared state of the handlers.
pub struct AppState {
    /// Durable entries.
    pub store: Store,
    /// Seals keys and derives idempotent tokens.
    pub sealer: Arc<Sealer>,
    /// Bearer token required on `/store-key` and `/revoke`.
    pub store_token: SecretFile,
    /// Entry lifetime (also how long a revoked owner is remembered).
    pub ttl: Duration,
    /// Largest private key accepted.
    pub max_key_bytes: usize,
    /// Longest a request may take (a redeem's wait for a re-arm excepted).
    pub request_timeout: Duration,
    /// How long a request body may take to arrive (within `request_timeout`).
    pub body_deadline: BodyDeadline,
    /// Longest a redeem of a used, re-armable token waits for the re-arm.
    pub rearm_wait: Duration,
    /// Redeems waiting for a re-arm.
    pub holds: Holds,
    /// Ends waiting redeems at shutdown.
    pub shutdown: CancellationToken,
    pub metrics: OtpMetrics,
}

impl std::fmt::Debug for AppState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AppState")
            .field("ttl", &self.ttl)
            .field("rearm_wait", &self.rearm_wait)
            .finish_non_exhaustive()
    }
}

/// The controller's calls, which may take the listener's reserved in-flight places: `/store-key`
/// and `/revoke` carrying the valid bearer token (the handler checks it again).
#[derive(Debug)]
pub struct ControllerCalls(pub Arc<AppState>);

impl Reserve for ControllerCalls {
    fn admits(&self, uri: &Uri, headers: &HeaderMap) -> bool {
        matches!(uri.path(), "/store-key" | "/revoke") && authorized(&self.0, headers)
    }
}

/// The TLS port's routes.
pub fn router(state: Arc<AppState>) -> Router {
    let timeout =
        |d| tower_http::timeout::TimeoutLayer::with_status_code(StatusCode::REQUEST_TIMEOUT, d);
    let bounded = Router::new()
        .route("/store-key", post(store_key))
        .route("/revoke", post(revoke))
        .route("/healthz", get(|| async { "ok" }))
        .layer(timeout(state.request_timeout));
    // A redeem may wait for a re-arm; the handler bounds its body read and its wait, this is the
    // backstop.
    let redeem = Router::new()
        .route("/otp", post(redeem))
        .layer(timeout(state.request_timeout * 2 + state.rearm_wait));
    bounded.merge(redeem).with_state(state)
}

/// The admin port's routes.
pub fn admin_router(metrics: OtpMetrics) -> Router {
    Router::new()
        .route("/healthz", get(|| async { "ok" }))
        .route("/readyz", get(|| async { "ok" }))
        .route(
            "/metrics",
            get(move || {
                let body = crate::metrics::encode(&metrics.registry);
                async move { ([(header::CONTENT_TYPE, crate::metrics::CONTENT_TYPE)], body) }
            }),
        )
}

/// What a `/store-key` request asks for.
#[derive(Debug, PartialEq, Eq)]
pub enum StoreParams {
    /// The Go controller's protocol: a random token, or the one an `Idempotency-Key` derives.
    Anonymous {
        /// The `Idempotency-Key` header.
        idempotency: Option<Vec<u8>>,
    },
    /// An owner's request, optionally re-arming a token the owner holds.
    Owned {
        /// The TaskRun UID.
        owner: String,
        /// The controller's id for this provisioning.
        request: String,
        /// What to re-arm, if anything.
        rearm: Option<RearmParam>,
        /// `rearms`: how many more re-arms may follow (at most [`MAX_ARMS`]).
        rearms_left: Option<u8>,
    },
}

/// The `rearm` parameter.
#[derive(Debug, PartialEq, Eq)]
pub enum RearmParam {
    /// A token the owner holds.
    Token(Token),
    /// `latest`: the owner's latest token (of its latest first store).
    Latest,
}

/// Why a `/store-key` or `/revoke` request's parameters are refused (HTTP 400; the message is
/// the answer's body).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParamError {
    /// An owner, request id or idempotency key that is not 1 to [`MAX_ID_LEN`] visible ASCII
    /// characters; `shown` is its first 40 characters, `more` says whether it went on.
    #[error("{name} must be 1-{MAX_ID_LEN} visible ASCII characters, got {shown:?}{}", if *.more { "..." } else { "" })]
    NotVisibleId {
        name: &'static str,
        shown: String,
        more: bool,
    },
    #[error("malformed query: {0}")]
    MalformedQuery(String),
    /// A parameter the endpoint does not take (its first 40 characters), and those it does.
    #[error("unknown parameter {shown:?} (expected {expected})")]
    UnknownParameter { shown: String, expected: String },
    #[error("parameter {0} given more than once")]
    Repeated(&'static str),
    /// A parameter that only makes sense with an owner.
    #[error("{0} needs an owner parameter")]
    NeedsOwner(&'static str),
    #[error(
        "{IDEMPOTENCY_KEY} cannot be combined with owner (the request id makes the store idempotent)"
    )]
    IdempotencyWithOwner,
    #[error("owner needs a request parameter")]
    NoRequest,
    #[error("rearm is not a token nor \"latest\"")]
    BadRearm,
    /// `rearms` that is not a count (its first 12 characters).
    #[error("rearms must be a count, got {0:?}")]
    BadRearms(String),
    #[error("owner parameter missing")]
    NoOwner,
}

/// Checks an owner, request id or idempotency key: 1 to [`MAX_ID_LEN`] visible ASCII characters.
fn visible_id(name: &'static str, value: &[u8]) -> Result<String, ParamError> {
    if value.is_empty() || value.len() > MAX_ID_LEN || !value.iter().all(u8::is_ascii_graphic) {
        return Err(ParamError::NotVisibleId {
            name,
            shown: String::from_utf8_lossy(value).chars().take(40).collect(),
            more: value.len() > 40,
        });
    }
    Ok(String::from_utf8_lossy(value).into_owned())
}

/// The query's parameters, each at most once and each one of `allowed`.
fn query_params(
    uri: &Uri,
    allowed: &[&'static str],
) -> Result<Vec<(&'static str, String)>, ParamError> {
    let Query(pairs) = Query::<Vec<(String, String)>>::try_from_uri(uri)
        .map_err(|e| ParamError::MalformedQuery(e.body_text()))?;
    let mut out: Vec<(&'static str, String)> = Vec::new();
    for (k, v) in pairs {
        let Some(name) = allowed.iter().copied().find(|a| *a == k) else {
            return Err(ParamError::UnknownParameter {
                shown: k.chars().take(40).collect(),
                expected: allowed.join(", "),
            });
        };
        if out.iter().any(|(n, _)| *n == name) {
            return Err(ParamError::Repeated(name));
        }
        out.push((name, v));
    }
    Ok(out)
}

fn param(params: &[(&'static str, String)], name: &str) -> Option<String> {
    params
        .iter()
        .find(|(n, _)| *n == name)
        .map(|(_, v)| v.clone())
}

/// Parses `/store-key`'s query (`owner`, `request`, `rearm`, `rearms`) and `Idempotency-Key`
/// header.
pub fn store_params(uri: &Uri, idempotency: Option<&[u8]>) -> Result<StoreParams, ParamError> {
    let params = query_params(uri, &["owner", "request", "rearm", "rearms"])?;
    let idempotency = idempotency
        .map(|v| visible_id(IDEMPOTENCY_KEY, v).map(String::into_bytes))
        .transpose()?;
    let Some(owner) = param(&params, "owner") else {
        if let Some((name, _)) = params.first() {
            return Err(ParamError::NeedsOwner(name));
        }
        return Ok(StoreParams::Anonymous { idempotency });
    };
    if idempotency.is_some() {
        return Err(ParamError::IdempotencyWithOwner);
    }
    let owner = visible_id("owner", owner.as_bytes())?;
    let request = param(&params, "request").ok_or(ParamError::NoRequest)?;
    let request = visible_id("request", request.as_bytes())?;
    // Never echo a token, even a malformed one.
    let rearm = param(&params, "rearm")
        .map(|t| match t.as_str() {
            "latest" => Ok(RearmParam::Latest),
            t => Token::parse(t.as_bytes())
                .map(RearmParam::Token)
                .map_err(|_| ParamError::BadRearm),
        })
        .transpose()?;
    let rearms_left = param(&params, "rearms")
        .map(|n| match n.parse::<u32>() {
            // More than an entry can be armed is as good as unbounded.
            Ok(n) => Ok(n.min(MAX_ARMS as u32) as u8),
            Err(_) => Err(ParamError::BadRearms(n.chars().take(12).collect())),
        })
        .transpose()?;
    Ok(StoreParams::Owned {
        owner,
        request,
        rearm,
        rearms_left,
    })
}

/// Parses `/revoke`'s query: the owner.
pub fn revoke_params(uri: &Uri) -> Result<String, ParamError> {
    let params = query_params(uri, &["owner"])?;
    let owner = param(&params, "owner").ok_or(ParamError::NoOwner)?;
    visible_id("owner", owner.as_bytes())
}

fn text(status: StatusCode, body: impl Into<Body>) -> Response {
    let mut r = (status, body.into()).into_response();
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-store"));
    r
}

fn refuse(state: &AppState, reason: &'static str, status: StatusCode, msg: &str) -> Response {
    state.metrics.reject(reason);
    tracing::info!(reason, status = status.as_u16(), "OTP request refused");
    text(status, format!("{msg}\n"))
}

fn unavailable(state: &AppState, e: &StoreError) -> Response {
    tracing::error!(error = %e, "OTP store failed");
    refuse(
        state,
        "unavailable",
        StatusCode::SERVICE_UNAVAILABLE,
        "storage unavailable, retry later",
    )
}

/// Why a body was not read.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum NoBody {
    /// Larger than the limit, or the client broke off.
    TooLarge,
    /// Not all there within the body deadline.
    Slow,
}

/// Reads at most `limit` bytes of body within the state's body deadline for it.
async fn read_body(
    state: &AppState,
    headers: &HeaderMap,
    body: Body,
    limit: usize,
) -> Result<Zeroizing<Vec<u8>>, NoBody> {
    // A larger declared length is read up to the limit all the same: HTTP/2 clients such as curl
    // report a refusal of an unread body as a stream error instead of the status.
    let deadline = state.body_deadline.for_body(headers, limit);
    match tokio::time::timeout(deadline, axum::body::to_bytes(body, limit)).await {
        Ok(Ok(b)) => Ok(Zeroizing::new(b.to_vec())),
        Ok(Err(_)) => Err(NoBody::TooLarge),
        Err(_) => Err(NoBody::Slow),
    }
}

/// The answer to a body that was not read.
fn no_body(state: &AppState, why: NoBody, what: &str) -> Response {
    match why {
        NoBody::TooLarge => refuse(
            state,
            "too_large",
            StatusCode::PAYLOAD_TOO_LARGE,
            &format!("{what} too large"),
        ),
        NoBody::Slow => refuse(
            state,
            "slow_body",
            StatusCode::REQUEST_TIMEOUT,
            "request body not received in time",
        ),
    }
}

fn authorized(state: &AppState, headers: &HeaderMap) -> bool {
    let Some(expected) = state.store_token.current() else {
        return false;
    };
    let Some(presented) = headers
        .get(header::AUTHORIZATION)
        .and_then(|v| v.as_bytes().strip_prefix(b"Bearer "))
    else {
        return false;
    };
    aws_lc_rs::constant_time::verify_slices_are_equal(presented.trim_ascii(), &expected).is_ok()
}

fn unauthorized(state: &AppState) -> Response {
    let mut r = refuse(
        state,
        "unauthorized",
        StatusCode::UNAUTHORIZED,
        "unauthorized",
    );
    r.headers_mut()
        .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
    r
}

fn observe(state: &AppState, endpoint: &'static str, started: Instant) {
    state
        .metrics
        .duration
        .with_label_values(&[endpoint])
        .observe(started.elapsed().as_secs_f64());
}

/// Longest an unauthorised request's body is read (and dropped) before the refusal is sent.
const REFUSED_BODY_DRAIN: Duration = Duration::from_millis(250);

/// Reads and drops up to `limit` bytes of body for at most [`REFUSED_BODY_DRAIN`]: HTTP/2
/// clients such as curl report an unread request body as a stream error instead of showing the
/// status, but nothing of it is kept.
async fn drain_body(body: Body, limit: usize) {
    use http_body_util::BodyExt;
    let mut body = body;
    let mut seen = 0usize;
    let drain = async {
        while seen <= limit {
            match body.frame().await {
                Some(Ok(frame)) => seen += frame.data_ref().map_or(0, |d| d.len()),
                _ => break,
            }
        }
    };
    let _ = tokio::time::timeout(REFUSED_BODY_DRAIN, drain).await;
}

/// A controller request (`/store-key`, `/revoke`): checks the bearer token before reading the
/// body, so an unauthenticated client cannot make the server buffer anything; then reads the body
/// (at most `limit` bytes, within its deadline), runs `f` on it and times it as `endpoint`.
async fn controller_request<Fut: Future<Output = Response>>(
    state: &AppState,
    endpoint: &'static str,
    headers: &HeaderMap,
    body: Body,
    limit: usize,
    f: impl FnOnce(Zeroizing<Vec<u8>>) -> Fut,
) -> Response {
    let started = Instant::now();
    let response = if authorized(state, headers) {
        match read_body(state, headers, body, limit).await {
            Ok(body) => f(body).await,
            Err(why) => no_body(state, why, if endpoint == "store" { "key" } else { "body" }),
        }
    } else {
        drain_body(body, limit).await;
        unauthorized(state)
    };
    observe(state, endpoint, started);
    response
}

async fn store_key(
    State(state): State<Arc<AppState>>,
    uri: Uri,
    headers: HeaderMap,
    body: Body,
) -> Response {
    let limit = state.max_key_bytes;
    controller_request(&state, "store", &headers, body, limit, |key| {
        store_key_inner(&state, &uri, &headers, key)
    })
    .await
}

async fn store_key_inner(
    state: &AppState,
    uri: &Uri,
    headers: &HeaderMap,
    key: Zeroizing<Vec<u8>>,
) -> Response {
    let idempotency = headers.get(IDEMPOTENCY_KEY).map(HeaderValue::as_bytes);
    let params = match store_params(uri, idempotency) {
        Ok(p) => p,
        Err(e) => {
            return refuse(state, "malformed", StatusCode::BAD_REQUEST, &e.to_string());
        }
    };
    if key.trim_ascii().is_empty() {
        return refuse(state, "malformed", StatusCode::BAD_REQUEST, "empty key");
    }
    let (token, claim) = match params {
        StoreParams::Anonymous { idempotency } => (
            idempotency
                .as_deref()
                .map_or_else(Token::random, |k| state.sealer.token_for(k)),
            Claim::Anonymous,
        ),
        StoreParams::Owned {
            owner,
            request,
            rearm,
            rearms_left,
        } => {
            let claim = Claim::Owned {
                owner: owner.as_bytes().to_vec(),
                request: request_digest(&request),
                request_id: request.as_bytes().to_vec(),
                rearm: rearm.is_some(),
                rearms_left,
            };
            let token = match rearm {
                Some(RearmParam::Token(t)) => t,
                Some(RearmParam::Latest) => {
                    match state.store.latest(owner.as_bytes().to_vec()).await {
                        Ok(Some(first)) => state
                            .sealer
                            .token_for_owner(&owner, &String::from_utf8_lossy(&first)),
                        Ok(None) => {
                            let (reason, status, msg) = store_refusal(StoreRefusal::Unknown);
                            return refuse(state, reason, status, msg);
                        }
                        Err(e) => return unavailable(state, &e),
                    }
                }
                None => state.sealer.token_for_owner(&owner, &request),
            };
            (token, claim)
        }
    };
    let owned = matches!(claim, Claim::Owned { .. });
    let hash = token.hash();
    let req = StoreRequest {
        hash,
        claim,
        sealed: state.sealer.seal(&hash.0, &key),
        key_digest: state.sealer.digest(&hash.0, &key),
        plaintext: key,
        ttl: state.ttl,
    };
    match state.store.store(req).await {
        Ok(StoreOutcome::Stored(stored)) => {
            let m = &state.metrics;
            let (status, outcome) = match stored {
                Stored::Created => {
                    m.stored.inc();
                    m.pending.inc();
                    m.entries.inc();
                    (StatusCode::CREATED, "created")
                }
                Stored::Replayed => {
                    m.store_replayed.inc();
                    (StatusCode::OK, "replayed")
                }
                Stored::Rearmed { was_redeemed } => {
                    m.rearmed.inc();
                    if was_redeemed {
                        m.pending.inc();
                    }
                    state.holds.wake(&hash, Wake::Rearmed);
                    (StatusCode::CREATED, "rearmed")
                }
            };
            tracing::info!(entry = %hash.log_id(), owned, outcome, "key stored");
            text(status, token.as_str().to_owned())
        }
        Ok(StoreOutcome::Refused(r)) => {
            let (reason, status, msg) = store_refusal(r);
            refuse(state, reason, status, msg)
        }
        Err(e) => unavailable(state, &e),
    }
}

/// The metrics reason, status and message for a refused store.
fn store_refusal(r: StoreRefusal) -> (&'static str, StatusCode, &'static str) {
    use StatusCode as S;
    match r {
        StoreRefusal::DifferentKey => (
            "conflict",
            S::CONFLICT,
            "this idempotency key or request id already stored a different key",
        ),
        StoreRefusal::AlreadyRedeemed => (
            "conflict",
            S::CONFLICT,
            "this request's key was already redeemed",
        ),
        StoreRefusal::TooManyRearms => (
            "conflict",
            S::CONFLICT,
            "the token was re-armed too many times; store a new one",
        ),
        StoreRefusal::Unknown => ("unknown", S::NOT_FOUND, "the token to re-arm is unknown"),
        StoreRefusal::Expired => (
            "expired",
            S::GONE,
            "the token to re-arm expired; store a new one",
        ),
        StoreRefusal::OtherOwner => (
            "forbidden",
            S::FORBIDDEN,
            "the token to re-arm does not belong to this owner",
        ),
        StoreRefusal::OwnerRevoked => (
            "revoked",
            S::GONE,
            "this owner was revoked (its TaskRun ended)",
        ),
    }
}

async fn revoke(
    State(state): State<Arc<AppState>>,
    uri: Uri,
    headers: HeaderMap,
    body: Body,
) -> Response {
    // The body carries nothing.
    controller_request(&state, "revoke", &headers, body, MAX_TOKEN_BODY, |_| {
        revoke_inner(&state, &uri)
    })
    .await
}

async fn revoke_inner(state: &AppState, uri: &Uri) -> Response {
    let owner = match revoke_params(uri) {
        Ok(o) => o,
        Err(e) => {
            return refuse(state, "malformed", StatusCode::BAD_REQUEST, &e.to_string());
        }
    };
    match state
        .store
        .revoke(owner.clone().into_bytes(), state.ttl)
        .await
    {
        Ok(r) => {
            let m = &state.metrics;
            m.revoked.inc_by(r.hashes.len() as u64);
            m.pending.sub(r.pending as i64);
            m.entries.sub(r.hashes.len() as i64);
            for h in &r.hashes {
                state.holds.wake(h, Wake::Revoked);
            }
            tracing::info!(%owner, entries = r.hashes.len(), "owner revoked");
            text(StatusCode::OK, format!("{}\n", r.hashes.len()))
        }
        Err(e) => unavailable(state, &e),
    }
}

async fn redeem(State(state): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    let started = Instant::now();
    let (response, held) = redeem_inner(&state, &headers, body).await;
    if !held {
        observe(&state, "redeem", started);
    }
    response
}

/// The answer, and whether the redeem waited for a re-arm.
async fn redeem_inner(state: &AppState, headers: &HeaderMap, body: Body) -> (Response, bool) {
    let body = match read_body(state, headers, body, MAX_TOKEN_BODY).await {
        Ok(b) => b,
        Err(why) => return (no_body(state, why, "body"), false),
    };
    let Ok(token) = Token::parse(&body) else {
        let r = refuse(
            state,
            "malformed",
            StatusCode::BAD_REQUEST,
            "malformed token",
        );
        return (r, false);
    };
    let hash = token.hash();
    match state.store.redeem(hash).await {
        Ok(Redeemed::Key(key)) => (served(state, &hash, &key), false),
        Ok(Redeemed::Refused(Refusal::Used {
            rearmable: true,
            arms,
        })) => (hold_for_rearm(state, hash, arms).await, true),
        Ok(Redeemed::Refused(r)) => (refusal(state, r), false),
        Err(e) => (unavailable(state, &e), false),
    }
}

fn served(state: &AppState, hash: &TokenHash, key: &[u8]) -> Response {
    state.metrics.redeemed.inc();
    state.metrics.pending.dec();
    tracing::info!(entry = %hash.log_id(), "key redeemed");
    text(StatusCode::OK, key.to_vec())
}

fn refusal(state: &AppState, r: Refusal) -> Response {
    match r {
        Refusal::Unknown => refuse(state, "unknown", StatusCode::NOT_FOUND, "unknown token"),
        Refusal::Used { .. } => refuse(state, "used", StatusCode::GONE, "token already used"),
        Refusal::Expired => refuse(state, "expired", StatusCode::GONE, "token expired"),
    }
}

fn revoked_token(state: &AppState) -> Response {
    refuse(state, "revoked", StatusCode::GONE, "token revoked")
}

/// A redeem of a used token its owner may re-arm: waits for the re-arm (then answers with the new
/// key, if no other redeem took it first), a revoke, a newer redeem of the token, shutdown, or the
/// close of this arm's window (see [`super::hold`]).
async fn hold_for_rearm(state: &AppState, hash: TokenHash, arms: usize) -> Response {
    let mut hold = match state.holds.hold(hash, arms, tokio::time::Instant::now()) {
        Ok(h) => h,
        Err(NoHold::Full) => {
            return refuse(
                state,
                "busy",
                StatusCode::SERVICE_UNAVAILABLE,
                "too many redeems are waiting for a re-arm; retry later",
            );
        }
        // Already waited for this arm in vain: no re-arm is coming.
        Err(NoHold::WindowClosed) => {
            return refusal(
                state,
                Refusal::Used {
                    rearmable: true,
                    arms,
                },
            );
        }
    };
    let started = Instant::now();
    let deadline = hold.closes();
    tracing::info!(entry = %hash.log_id(), "token already used; waiting for a re-arm");
    let (outcome, response) = loop {
        // Look again now that we are subscribed: a re-arm committed since the first look woke
        // nobody.
        match state.store.redeem(hash).await {
            Ok(Redeemed::Key(key)) => break ("served", served(state, &hash, &key)),
            // Still used (another redeem may have taken a re-arm's key): wait on for this arm.
            Ok(Redeemed::Refused(Refusal::Used { .. })) => {}
            Ok(Redeemed::Refused(Refusal::Expired)) => {
                break ("expired", refusal(state, Refusal::Expired));
            }
            // The entry is gone: only a revoke deletes a current entry.
            Ok(Redeemed::Refused(_)) => break ("revoked", revoked_token(state)),
            Err(e) => break ("unavailable", unavailable(state, &e)),
        }
        tokio::select! {
            () = state.shutdown.cancelled() => break (
                "shutdown",
                refuse(
                    state,
                    "unavailable",
                    StatusCode::SERVICE_UNAVAILABLE,
                    "the OTP server is shutting down; retry",
                ),
            ),
            () = tokio::time::sleep_until(deadline) => {
                break ("timed_out", refusal(state, Refusal::Used { rearmable: true, arms }));
            }
            wake = hold.woken() => match wake {
                Wake::Revoked => break ("revoked", revoked_token(state)),
                Wake::Superseded => break (
                    "superseded",
                    refuse(
                        state,
                        "conflict",
                        StatusCode::CONFLICT,
                        "a newer redeem of this token waits for its re-arm instead",
                    ),
                ),
                Wake::Rearmed | Wake::Waiting => {}
            },
        }
    };
    drop(hold);
    let waited = started.elapsed();
    state.metrics.hold_ended(outcome, waited);
    tracing::info!(
        entry = %hash.log_id(),
        outcome,
        waited_ms = waited.as_millis() as u64,
        "wait for a re-arm ended"
    );
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn store_parameters() {
        let t = Token::random();
        fn store_params(q: &str, h: Option<&[u8]>) -> Result<StoreParams, ParamError> {
            super::store_params(&format!("/store-key?{q}").parse().unwrap(), h)
        }
        assert_eq!(
            super::store_params(&"/store-key".parse().unwrap(), None),
            Ok(StoreParams::Anonymous { idempotency: None })
        );
        assert_eq!(
            store_params("", Some(&b"req-1"[..])),
            Ok(StoreParams::Anonymous {
                idempotency: Some(b"req-1".to_vec())
            })
        );
        let q = format!("owner=uid-1&request=r%2F1&rearm={}", t.as_str());
        assert_eq!(
            store_params(&q, None),
            Ok(StoreParams::Owned {
                owner: "uid-1".into(),
                request: "r/1".into(),
                rearm: Some(RearmParam::Token(t.clone())),
                rearms_left: None,
            })
        );
        assert_eq!(
            store_params("owner=u&request=r&rearm=latest&rearms=2", None),
            Ok(StoreParams::Owned {
                owner: "u".into(),
                request: "r".into(),
                rearm: Some(RearmParam::Latest),
                rearms_left: Some(2),
            })
        );
        assert_eq!(
            store_params("owner=u&request=r&rearms=100000", None),
            Ok(StoreParams::Owned {
                owner: "u".into(),
                request: "r".into(),
                rearm: None,
                rearms_left: Some(MAX_ARMS as u8),
            })
        );
        assert_eq!(
            store_params("request=r&owner=u", None),
            Ok(StoreParams::Owned {
                owner: "u".into(),
                request: "r".into(),
                rearm: None,
                rearms_left: None,
            })
        );
        let err = |q: &str, h: Option<&[u8]>| store_params(q, h).unwrap_err().to_string();
        assert!(err("owner=u", None).contains("request"));
        assert!(err("request=r", None).contains("owner"));
        assert!(err(&format!("rearm={}", t.as_str()), None).contains("owner"));
        assert!(err("owner=u&request=r&x=1", None).contains("unknown parameter \"x\""));
        assert!(err("owner=u&owner=v&request=r", None).contains("owner given more than once"));
        assert!(err("owner=a+b&request=r", None).contains("owner must be"));
        assert!(err("owner=&request=r", None).contains("owner must be"));
        assert!(err(&format!("owner=u&request={}", "r".repeat(129)), None).contains("request"));
        let bad_token = err("owner=u&request=r&rearm=secret-ish", None);
        assert!(
            bad_token.contains("rearm is not a token") && !bad_token.contains("secret-ish"),
            "{bad_token}"
        );
        assert!(err("owner=u&request=r&rearms=-1", None).contains("rearms must be a count"));
        assert!(err("owner=u&request=r", Some(b"k")).contains(IDEMPOTENCY_KEY));
        assert!(
            store_params("", Some(b"has space"))
                .unwrap_err()
                .to_string()
                .contains(IDEMPOTENCY_KEY)
        );
    }

    #[test]
    fn revoke_parameters() {
        let revoke = |q: &str| revoke_params(&format!("/revoke?{q}").parse().unwrap());
        let err = |q: &str| revoke(q).unwrap_err().to_string();
        assert_eq!(revoke("owner=uid-1"), Ok("uid-1".into()));
        assert!(err("").contains("owner"));
        assert!(err("owner=u&request=r").contains("request"));
        assert!(err("owner=%00").contains("owner must be"));
        assert!(err("owner=%FF").contains("owner must be"));
    }

    /// Callers read these answers (HTTP 400 bodies): the text is kept as it is.
    #[test]
    fn parameter_messages_read_exactly_as_documented() {
        let store = |q: &str, h: Option<&[u8]>| {
            store_params(&format!("/store-key?{q}").parse().unwrap(), h)
                .unwrap_err()
                .to_string()
        };
        let revoke = |q: &str| {
            revoke_params(&format!("/revoke?{q}").parse().unwrap())
                .unwrap_err()
                .to_string()
        };
        assert_eq!(
            store("owner=a+b&request=r", None),
            "owner must be 1-128 visible ASCII characters, got \"a b\""
        );
        assert_eq!(
            store(&format!("owner=u&request={}", "r".repeat(129)), None),
            format!(
                "request must be 1-128 visible ASCII characters, got {:?}...",
                "r".repeat(40)
            )
        );
        assert_eq!(
            store("x=1", None),
            "unknown parameter \"x\" (expected owner, request, rearm, rearms)"
        );
        assert_eq!(
            store("owner=u&owner=v", None),
            "parameter owner given more than once"
        );
        assert_eq!(store("request=r", None), "request needs an owner parameter");
        assert_eq!(
            store("owner=u&request=r", Some(b"k")),
            "idempotency-key cannot be combined with owner (the request id makes the store idempotent)"
        );
        assert_eq!(store("owner=u", None), "owner needs a request parameter");
        assert_eq!(
            store("owner=u&request=r&rearm=x", None),
            "rearm is not a token nor \"latest\""
        );
        assert_eq!(
            store("owner=u&request=r&rearms=-1234567890123", None),
            "rearms must be a count, got \"-12345678901\""
        );
        assert_eq!(revoke(""), "owner parameter missing");
        assert_eq!(
            revoke("request=r"),
            "unknown parameter \"request\" (expected owner)"
        );
    }
}
