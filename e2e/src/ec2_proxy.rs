//! A fault-injecting HTTP proxy on loopback in front of moto, for what moto does not emulate:
//! throttling, capacity errors, server errors, slow answers, and a `pending` boot phase.
//!
//! It speaks the EC2 query protocol: requests are form-encoded `Action=...&...` POSTs. Each request
//! is recorded ([`Ec2Proxy::requests`]), so tests can check parameters moto does not keep (root
//! volume IOPS and throughput, `ClientToken`, market options). Faults ([`Fault`]) answer chosen
//! actions (optionally only when a parameter has a value) a given number of times, with the XML
//! error body EC2 uses. [`Ec2Proxy::report_pending_for`] makes instances launched through the proxy
//! show as `pending` in DescribeInstances for a while, rewriting the `instance-state-name` filter
//! of the request and the states in the answer consistently.
//!
//! The upstream must be a loopback address; nothing else is ever dialled.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::{Ipv4Addr, SocketAddr};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Request, Response, StatusCode};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;
use tokio::task::JoinHandle;

/// What a fault does.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum FaultKind {
    /// Answer with an EC2 XML error.
    Error {
        /// HTTP status.
        status: u16,
        /// EC2 error code.
        code: String,
        message: String,
    },
    /// Answer with a bare status and a non-XML body (a load balancer's 5xx).
    Status(u16),
    /// Wait, then forward as usual.
    Delay(Duration),
}

/// One injected fault.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Fault {
    /// The `Action` it applies to.
    pub action: String,
    /// Only when this form parameter has this value.
    pub when: Option<(String, String)>,
    /// How many more requests it applies to.
    pub times: u32,
    /// What it does.
    pub kind: FaultKind,
}

impl Fault {
    /// An EC2 error `code` with `status` for the next `times` requests of `action`.
    pub fn error(action: &str, status: u16, code: &str, times: u32) -> Self {
        Self {
            action: action.into(),
            when: None,
            times,
            kind: FaultKind::Error {
                status,
                code: code.into(),
                message: format!("injected {code}"),
            },
        }
    }

    /// `RequestLimitExceeded` (HTTP 503), as EC2 throttles.
    pub fn throttle(action: &str, times: u32) -> Self {
        Self::error(action, 503, "RequestLimitExceeded", times)
    }

    /// `InsufficientInstanceCapacity` (HTTP 500).
    pub fn capacity(action: &str, times: u32) -> Self {
        Self::error(action, 500, "InsufficientInstanceCapacity", times)
    }

    /// A bare HTTP `status` without an EC2 error body.
    pub fn status(action: &str, status: u16, times: u32) -> Self {
        Self {
            action: action.into(),
            when: None,
            times,
            kind: FaultKind::Status(status),
        }
    }

    /// Delays the next `times` requests of `action` by `delay`.
    pub fn delay(action: &str, delay: Duration, times: u32) -> Self {
        Self {
            action: action.into(),
            when: None,
            times,
            kind: FaultKind::Delay(delay),
        }
    }

    /// Applies only when form parameter `key` equals `value`.
    pub fn when_param(mut self, key: &str, value: &str) -> Self {
        self.when = Some((key.into(), value.into()));
        self
    }
}

/// One request seen by the proxy.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Recorded {
    /// The `Action`.
    pub action: String,
    /// Form parameters as sent by the client, in order.
    pub params: Vec<(String, String)>,
    /// The fault applied, if any (`RequestLimitExceeded`, `status 503`, `delay`).
    pub fault: Option<String>,
    /// The region the request was signed for (the SigV4 credential scope of its
    /// `Authorization` header), so tests can check which region every call went to.
    pub region: Option<String>,
}

/// The region of a SigV4 `Authorization` header:
/// `AWS4-HMAC-SHA256 Credential=<key>/<date>/<region>/<service>/aws4_request, ...`.
fn signed_region(headers: &hyper::HeaderMap) -> Option<String> {
    let auth = headers.get(hyper::header::AUTHORIZATION)?.to_str().ok()?;
    let credential = auth.split("Credential=").nth(1)?;
    let scope = credential.split(',').next()?;
    scope.split('/').nth(2).map(str::to_owned)
}

impl Recorded {
    /// The first value of a form parameter.
    pub fn param(&self, key: &str) -> Option<&str> {
        self.params
            .iter()
            .find(|(k, _)| k == key)
            .map(|(_, v)| v.as_str())
    }
}

#[derive(Debug, Default)]
struct State {
    faults: Vec<Fault>,
    pending_for: Option<Duration>,
    launched: HashMap<String, Instant>,
    log: Vec<Recorded>,
}

/// The running proxy; stops on drop.
#[derive(Debug)]
pub struct Ec2Proxy {
    addr: SocketAddr,
    state: Arc<Mutex<State>>,
    task: JoinHandle<()>,
}

impl Drop for Ec2Proxy {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl Ec2Proxy {
    /// Starts a proxy on 127.0.0.1 (random port) forwarding to `upstream`, which must be loopback.
    pub async fn start(upstream: SocketAddr) -> std::io::Result<Self> {
        if !upstream.ip().is_loopback() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                format!("upstream {upstream} is not a loopback address"),
            ));
        }
        let listener = TcpListener::bind((Ipv4Addr::LOCALHOST, 0)).await?;
        let addr = listener.local_addr()?;
        let state = Arc::new(Mutex::new(State::default()));
        let client: Client<HttpConnector, Full<Bytes>> =
            Client::builder(TokioExecutor::new()).build_http();
        let shared = state.clone();
        let task = tokio::spawn(async move {
            let mut conns = tokio::task::JoinSet::new();
            while let Ok((stream, _)) = listener.accept().await {
                let state = shared.clone();
                let client = client.clone();
                conns.spawn(async move {
                    let svc =
                        service_fn(move |req| handle(req, upstream, state.clone(), client.clone()));
                    let _ = hyper::server::conn::http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), svc)
                        .await;
                });
                while conns.try_join_next().is_some() {}
            }
        });
        Ok(Self { addr, state, task })
    }

    /// The endpoint URL to give the SDK.
    pub fn endpoint(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Adds a fault; faults apply in the order added.
    pub fn inject(&self, fault: Fault) {
        self.lock().faults.push(fault);
    }

    /// Removes every fault not yet used up.
    pub fn clear_faults(&self) {
        self.lock().faults.clear();
    }

    /// Instances launched through the proxy from now on show as `pending` for `d` after launch.
    pub fn report_pending_for(&self, d: Duration) {
        self.lock().pending_for = Some(d);
    }

    /// Every request so far.
    pub fn requests(&self) -> Vec<Recorded> {
        self.lock().log.clone()
    }

    /// Requests of one action so far.
    pub fn requests_of(&self, action: &str) -> Vec<Recorded> {
        self.lock()
            .log
            .iter()
            .filter(|r| r.action == action)
            .cloned()
            .collect()
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }
}

fn xml_response(status: u16, body: String) -> Response<Full<Bytes>> {
    Response::builder()
        .status(StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR))
        .header("content-type", "text/xml;charset=UTF-8")
        .body(Full::new(Bytes::from(body)))
        .expect("static response parts are valid")
}

fn ec2_error(status: u16, code: &str, message: &str) -> Response<Full<Bytes>> {
    xml_response(
        status,
        format!(
            "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Response><Errors><Error><Code>{code}</Code><Message>{message}</Message></Error></Errors><RequestID>00000000-0000-4000-8000-000000000000</RequestID></Response>"
        ),
    )
}

async fn handle(
    req: Request<Incoming>,
    upstream: SocketAddr,
    state: Arc<Mutex<State>>,
    client: Client<HttpConnector, Full<Bytes>>,
) -> Result<Response<Full<Bytes>>, Infallible> {
    let (parts, body) = req.into_parts();
    let body = match body.collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => return Ok(xml_response(400, format!("bad request body: {e}"))),
    };
    let mut params: Vec<(String, String)> = form_urlencoded::parse(&body).into_owned().collect();
    let action = params
        .iter()
        .find(|(k, _)| k == "Action")
        .map(|(_, v)| v.clone())
        .unwrap_or_default();

    // Pick a fault and record the request.
    let (fault, pending_for) = {
        let mut s = state.lock().unwrap_or_else(|e| e.into_inner());
        let fault = s.faults.iter_mut().find(|f| {
            f.times > 0
                && f.action == action
                && f.when
                    .as_ref()
                    .is_none_or(|(k, v)| params.iter().any(|(pk, pv)| pk == k && pv == v))
        });
        let kind = fault.map(|f| {
            f.times -= 1;
            f.kind.clone()
        });
        s.log.push(Recorded {
            region: signed_region(&parts.headers),
            action: action.clone(),
            params: params.clone(),
            fault: kind.as_ref().map(|k| match k {
                FaultKind::Error { code, .. } => code.clone(),
                FaultKind::Status(s) => format!("status {s}"),
                FaultKind::Delay(_) => "delay".into(),
            }),
        });
        (kind, s.pending_for)
    };
    match fault {
        Some(FaultKind::Error {
            status,
            code,
            message,
        }) => return Ok(ec2_error(status, &code, &message)),
        Some(FaultKind::Status(status)) => {
            return Ok(xml_response(
                status,
                "<html><body>Service Unavailable</body></html>".into(),
            ));
        }
        Some(FaultKind::Delay(d)) => tokio::time::sleep(d).await,
        None => {}
    }

    // While instances are reported pending, a filter on `pending` must also fetch `running` ones
    // from moto; the answer is then filtered back to what was asked.
    let mut wanted_states: Option<Vec<String>> = None;
    if action == "DescribeInstances" && pending_for.is_some() {
        wanted_states = widen_state_filter(&mut params);
    }
    let forwarded = if wanted_states.is_some() {
        Bytes::from(
            form_urlencoded::Serializer::new(String::new())
                .extend_pairs(params.iter())
                .finish(),
        )
    } else {
        body
    };

    let uri = format!(
        "http://{upstream}{}",
        parts
            .uri
            .path_and_query()
            .map(|p| p.as_str())
            .unwrap_or("/")
    );
    let mut up = Request::builder().method(parts.method).uri(uri);
    for (k, v) in parts.headers.iter() {
        if k != hyper::header::CONTENT_LENGTH && k != hyper::header::HOST {
            up = up.header(k, v);
        }
    }
    let up = match up.body(Full::new(forwarded)) {
        Ok(r) => r,
        Err(e) => return Ok(xml_response(500, format!("proxy: {e}"))),
    };
    let resp = match client.request(up).await {
        Ok(r) => r,
        Err(e) => return Ok(xml_response(502, format!("proxy: upstream: {e}"))),
    };
    let (rparts, rbody) = resp.into_parts();
    let rbody = match rbody.collect().await {
        Ok(b) => b.to_bytes(),
        Err(e) => return Ok(xml_response(502, format!("proxy: upstream body: {e}"))),
    };
    let mut text = String::from_utf8_lossy(&rbody).into_owned();
    if rparts.status.is_success() {
        let mut s = state.lock().unwrap_or_else(|e| e.into_inner());
        if action == "RunInstances" {
            let now = Instant::now();
            for id in instance_ids(&text) {
                s.launched.entry(id).or_insert(now);
            }
        }
        if action == "DescribeInstances"
            && let Some(window) = s.pending_for
        {
            text = rewrite_pending(&text, &s.launched, window, wanted_states.as_deref());
        }
    }
    let mut out = Response::builder().status(rparts.status);
    for (k, v) in rparts.headers.iter() {
        if k != hyper::header::CONTENT_LENGTH && k != hyper::header::TRANSFER_ENCODING {
            out = out.header(k, v);
        }
    }
    Ok(out
        .body(Full::new(Bytes::from(text)))
        .unwrap_or_else(|e| xml_response(500, format!("proxy: {e}"))))
}

/// If the request filters on `instance-state-name` including `pending` but not `running`, adds
/// `running` and returns the states originally asked for. `None` when nothing needs filtering back.
fn widen_state_filter(params: &mut Vec<(String, String)>) -> Option<Vec<String>> {
    let prefix = params
        .iter()
        .find(|(k, v)| {
            k.starts_with("Filter.") && k.ends_with(".Name") && v == "instance-state-name"
        })
        .map(|(k, _)| k.trim_end_matches("Name").to_owned())?;
    let value_prefix = format!("{prefix}Value.");
    let wanted: Vec<String> = params
        .iter()
        .filter(|(k, _)| k.starts_with(&value_prefix))
        .map(|(_, v)| v.clone())
        .collect();
    let has = |s: &str| wanted.iter().any(|w| w == s);
    if has("pending") && !has("running") {
        params.push((
            format!("{value_prefix}{}", wanted.len() + 1),
            "running".into(),
        ));
    }
    Some(wanted)
}

/// Instance ids in an EC2 XML answer, in order, without repeats.
fn instance_ids(xml: &str) -> Vec<String> {
    let mut out: Vec<String> = Vec::new();
    let mut rest = xml;
    while let Some(i) = rest.find("<instanceId>") {
        rest = &rest[i + "<instanceId>".len()..];
        if let Some(j) = rest.find("</instanceId>") {
            let id = rest[..j].to_owned();
            if !out.contains(&id) {
                out.push(id);
            }
            rest = &rest[j..];
        }
    }
    out
}

/// Byte ranges of the top-level `<item>` elements inside each `<instancesSet>`.
fn instance_items(xml: &str) -> Vec<(usize, usize)> {
    let mut spans = Vec::new();
    let mut pos = 0;
    while let Some(set) = xml[pos..].find("<instancesSet>") {
        let mut i = pos + set + "<instancesSet>".len();
        let mut depth = 0usize;
        let mut start = 0;
        loop {
            let open = xml[i..].find("<item>").map(|o| (i + o, true));
            let close = xml[i..].find("</item>").map(|c| (i + c, false));
            let end_set = xml[i..].find("</instancesSet>").map(|e| i + e);
            let next = match (open, close) {
                (Some(o), Some(c)) => Some(if o.0 < c.0 { o } else { c }),
                (o, c) => o.or(c),
            };
            match next {
                Some((at, _)) if depth == 0 && end_set.is_some_and(|e| e < at) => {
                    i = end_set.unwrap_or(at);
                    break;
                }
                Some((at, true)) => {
                    if depth == 0 {
                        start = at;
                    }
                    depth += 1;
                    i = at + "<item>".len();
                }
                Some((at, false)) => {
                    depth = depth.saturating_sub(1);
                    i = at + "</item>".len();
                    if depth == 0 {
                        spans.push((start, i));
                    }
                }
                None => {
                    i = xml.len();
                    break;
                }
            }
        }
        pos = i;
    }
    spans
}

/// Reports instances launched less than `window` ago as pending, and drops instances whose
/// reported state is not among `wanted` (when the request filtered on state).
fn rewrite_pending(
    xml: &str,
    launched: &HashMap<String, Instant>,
    window: Duration,
    wanted: Option<&[String]>,
) -> String {
    let now = Instant::now();
    let mut out = String::with_capacity(xml.len());
    let mut last = 0;
    for (start, end) in instance_items(xml) {
        out.push_str(&xml[last..start]);
        last = end;
        let item = &xml[start..end];
        let id = instance_ids(item).into_iter().next().unwrap_or_default();
        let young = launched
            .get(&id)
            .is_some_and(|t| now.duration_since(*t) < window);
        let running = "<instanceState><code>16</code><name>running</name></instanceState>";
        let item = if young && item.contains(running) {
            item.replace(
                running,
                "<instanceState><code>0</code><name>pending</name></instanceState>",
            )
        } else {
            item.to_owned()
        };
        let state = item
            .split_once("<instanceState>")
            .and_then(|(_, r)| r.split_once("<name>"))
            .and_then(|(_, r)| r.split_once("</name>"))
            .map(|(s, _)| s.to_owned())
            .unwrap_or_default();
        if wanted.is_none_or(|w| w.contains(&state)) {
            out.push_str(&item);
        }
    }
    out.push_str(&xml[last..]);
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    const XML: &str = "<r><reservationSet><item><reservationId>r-1</reservationId><instancesSet>\
        <item><tagSet><item><key>a</key></item></tagSet><instanceId>i-1</instanceId><instanceState><code>16</code><name>running</name></instanceState></item>\
        <item><instanceId>i-2</instanceId><instanceState><code>16</code><name>running</name></instanceState><groupSet><item>g</item></groupSet></item>\
        </instancesSet></item></reservationSet></r>";

    #[test]
    fn finds_top_level_instance_items() {
        let spans = instance_items(XML);
        assert_eq!(spans.len(), 2);
        assert!(XML[spans[0].0..spans[0].1].contains("i-1"));
        assert!(XML[spans[1].0..spans[1].1].ends_with("</groupSet></item>"));
        assert_eq!(instance_ids(XML), ["i-1", "i-2"]);
    }

    #[test]
    fn rewrites_young_instances_and_filters_back() {
        let mut launched = HashMap::new();
        launched.insert("i-1".to_owned(), Instant::now());
        let w = Duration::from_secs(60);
        let all = rewrite_pending(XML, &launched, w, None);
        assert!(all.contains(
            "<instanceId>i-1</instanceId><instanceState><code>0</code><name>pending</name>"
        ));
        assert!(all.contains(
            "<instanceId>i-2</instanceId><instanceState><code>16</code><name>running</name>"
        ));
        let pending_only = rewrite_pending(XML, &launched, w, Some(&["pending".to_owned()]));
        assert!(pending_only.contains("i-1") && !pending_only.contains("i-2"));
        let running_only = rewrite_pending(XML, &launched, w, Some(&["running".to_owned()]));
        assert!(!running_only.contains("i-1") && running_only.contains("i-2"));
        assert!(running_only.ends_with("</instancesSet></item></reservationSet></r>"));
    }

    #[test]
    fn widens_a_pending_only_filter() {
        let mut p = vec![
            ("Action".to_owned(), "DescribeInstances".to_owned()),
            ("Filter.2.Name".to_owned(), "instance-state-name".to_owned()),
            ("Filter.2.Value.1".to_owned(), "pending".to_owned()),
        ];
        let wanted = widen_state_filter(&mut p).unwrap();
        assert_eq!(wanted, ["pending"]);
        assert!(p.contains(&("Filter.2.Value.2".to_owned(), "running".to_owned())));
        let mut none = vec![("Action".to_owned(), "DescribeInstances".to_owned())];
        assert_eq!(widen_state_filter(&mut none), None);
    }
}
