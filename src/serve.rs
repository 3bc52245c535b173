//! Accept loops for HTTPS and plain HTTP with graceful shutdown.
//!
//! On shutdown the listener stops accepting at once, in-flight requests finish, idle keep-alive
//! connections are closed (HTTP/1) or sent GOAWAY (HTTP/2), and whatever is still open after the
//! drain deadline is dropped.

use std::sync::Arc;
use std::time::Duration;

use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use hyper_util::server::graceful::GracefulShutdown;
use hyper_util::service::TowerToHyperService;
use tokio::net::TcpListener;
use tokio_util::sync::CancellationToken;

/// Connection-level limits.
#[derive(Debug, Clone, Copy)]
pub struct ServeOptions {
    /// Longest TLS handshake.
    pub handshake_timeout: Duration,
    /// Longest wait for a complete request head (also bounds idle keep-alive on HTTP/1).
    pub header_read_timeout: Duration,
    /// How long in-flight requests may run after shutdown starts.
    pub drain_timeout: Duration,
}

impl Default for ServeOptions {
    fn default() -> Self {
        Self {
            handshake_timeout: Duration::from_secs(5),
            header_read_timeout: Duration::from_secs(30),
            drain_timeout: Duration::from_secs(20),
        }
    }
}

fn builder(opts: &ServeOptions) -> auto::Builder<TokioExecutor> {
    let mut b = auto::Builder::new(TokioExecutor::new());
    b.http1()
        .timer(TokioTimer::new())
        .header_read_timeout(opts.header_read_timeout)
        .keep_alive(true);
    b.http2()
        .timer(TokioTimer::new())
        .keep_alive_interval(Some(Duration::from_secs(30)));
    b
}

/// Serves `app` over TLS on `listener` until `shutdown` fires, then drains.
pub async fn serve_tls(
    listener: TcpListener,
    tls: Arc<rustls::ServerConfig>,
    app: axum::Router,
    shutdown: CancellationToken,
    opts: ServeOptions,
) {
    let acceptor = tokio_rustls::TlsAcceptor::from(tls);
    let graceful = GracefulShutdown::new();
    let builder = Arc::new(builder(&opts));
    loop {
        let (tcp, peer) = tokio::select! {
            () = shutdown.cancelled() => break,
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(error) => {
                    // EMFILE and friends: back off briefly instead of spinning.
                    tracing::warn!(%error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = tcp.set_nodelay(true);
        let acceptor = acceptor.clone();
        let service = TowerToHyperService::new(app.clone());
        let builder = Arc::clone(&builder);
        let watcher = graceful.watcher();
        let shutdown = shutdown.clone();
        tokio::spawn(async move {
            let tls = tokio::select! {
                () = shutdown.cancelled() => return,
                r = tokio::time::timeout(opts.handshake_timeout, acceptor.accept(tcp)) => match r {
                    Ok(Ok(s)) => s,
                    Ok(Err(error)) => {
                        tracing::debug!(%peer, %error, "TLS handshake failed");
                        return;
                    }
                    Err(_) => {
                        tracing::debug!(%peer, "TLS handshake timed out");
                        return;
                    }
                },
            };
            let conn = builder.serve_connection_with_upgrades(TokioIo::new(tls), service);
            if let Err(error) = watcher.watch(conn.into_owned()).await {
                tracing::debug!(%peer, error = %error, "connection ended with an error");
            }
        });
    }
    drop(listener);
    drain(graceful, opts.drain_timeout).await;
}

/// Serves `app` over plain HTTP on `listener` until `shutdown` fires, then drains.
pub async fn serve_plain(
    listener: TcpListener,
    app: axum::Router,
    shutdown: CancellationToken,
    opts: ServeOptions,
) {
    let graceful = GracefulShutdown::new();
    let builder = Arc::new(builder(&opts));
    loop {
        let (tcp, peer) = tokio::select! {
            () = shutdown.cancelled() => break,
            r = listener.accept() => match r {
                Ok(c) => c,
                Err(error) => {
                    tracing::warn!(%error, "accept failed");
                    tokio::time::sleep(Duration::from_millis(50)).await;
                    continue;
                }
            },
        };
        let _ = tcp.set_nodelay(true);
        let service = TowerToHyperService::new(app.clone());
        let conn = builder
            .serve_connection_with_upgrades(TokioIo::new(tcp), service)
            .into_owned();
        let fut = graceful.watch(conn);
        tokio::spawn(async move {
            if let Err(error) = fut.await {
                tracing::debug!(%peer, error = %error, "connection ended with an error");
            }
        });
    }
    drop(listener);
    drain(graceful, opts.drain_timeout).await;
}

async fn drain(graceful: GracefulShutdown, deadline: Duration) {
    if tokio::time::timeout(deadline, graceful.shutdown())
        .await
        .is_err()
    {
        tracing::warn!(
            ?deadline,
            "connections still open after the drain deadline; dropping them"
        );
    }
}
