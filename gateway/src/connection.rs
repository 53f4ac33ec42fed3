//! Serving the HTTP API's connections, each with time limits that a slow or silent client
//! cannot stretch.
//!
//! - **Headers**: HTTP/1 request headers must arrive within `header_read_timeout` of the
//!   connection's being ready for a request (hyper's timer starts as soon as it waits for one),
//!   else hyper closes the connection. A client trickling its headers byte by byte holds a
//!   socket for that long and no more.
//! - **Idle**: a connection on which no byte moved either way for `idle_timeout` is shut down
//!   gracefully: at once when no request is in flight, after the one in flight otherwise. A
//!   stream always moves bytes (tokens, or keep-alive comments), so only silence ends it.
//! - **Body**: the request body's own deadline is [`crate::http::json::ApiJson`]'s, since only
//!   the handler knows when it wants the body.
//!
//! Shutdown: no new connections; every open one finishes its requests in flight and closes;
//! [`serve`] returns when the last one has.

use std::future::Future;
use std::io;
use std::pin::{pin, Pin};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use axum::Router;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto::Builder;
use hyper_util::service::TowerToHyperService;
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::watch;
use tokio::task::JoinSet;

/// The time limits of every connection.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ConnectionTimeouts {
    pub header_read: Duration,
    pub idle: Duration,
}

/// Serves `app` on `listener` until `shutdown` completes, then waits for the open connections
/// to finish their requests.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    timeouts: ConnectionTimeouts,
    shutdown: impl Future<Output = ()>,
) -> io::Result<()> {
    let mut builder = Builder::new(TokioExecutor::new());
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(timeouts.header_read);
    let (stop, stopping) = watch::channel(false);
    let mut connections = JoinSet::new();
    let mut shutdown = pin!(shutdown);
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            () = &mut shutdown => break,
        };
        // Finished connections leave the set as new ones come.
        while connections.try_join_next().is_some() {}
        let stream = match accepted {
            Ok((stream, _)) => stream,
            // Out of descriptors, or a connection reset before it was accepted: the listener
            // itself is fine. A short pause keeps a full descriptor table from spinning.
            Err(e) => {
                tracing::warn!(error = %e, "accept failed");
                tokio::time::sleep(Duration::from_millis(50)).await;
                continue;
            }
        };
        connections.spawn(connection(
            stream,
            builder.clone(),
            app.clone(),
            timeouts.idle,
            stopping.clone(),
        ));
    }
    let _ = stop.send(true);
    while connections.join_next().await.is_some() {}
    Ok(())
}

/// Serves one connection until it closes, shutting it down gracefully when it has been idle
/// for `idle` or the server stops.
async fn connection(
    stream: TcpStream,
    builder: Builder<TokioExecutor>,
    app: Router,
    idle: Duration,
    mut stopping: watch::Receiver<bool>,
) {
    // Each chunk of a stream is a small write; Nagle's algorithm would hold it back.
    let _ = stream.set_nodelay(true);
    let started = Instant::now();
    let activity = Arc::new(AtomicU64::new(0));
    let io = TokioIo::new(Active {
        io: stream,
        started,
        last: activity.clone(),
    });
    let mut conn = pin!(builder.serve_connection(io, TowerToHyperService::new(app)));
    let mut closing = false;
    loop {
        let last = started + Duration::from_millis(activity.load(Ordering::Relaxed));
        tokio::select! {
            served = conn.as_mut() => {
                if let Err(e) = served {
                    tracing::debug!(error = %e, "connection ended with an error");
                }
                return;
            }
            () = tokio::time::sleep_until((last + idle).into()), if !closing => {
                if last.elapsed() >= idle {
                    closing = true;
                    conn.as_mut().graceful_shutdown();
                }
            }
            changed = stopping.changed(), if !closing => {
                if changed.is_err() || *stopping.borrow() {
                    closing = true;
                    conn.as_mut().graceful_shutdown();
                }
            }
        }
    }
}

/// A socket that records when a byte last moved, in milliseconds since `started`.
struct Active<IO> {
    io: IO,
    started: Instant,
    last: Arc<AtomicU64>,
}

impl<IO> Active<IO> {
    fn touch(&self) {
        let now = self.started.elapsed().as_millis() as u64;
        self.last.store(now, Ordering::Relaxed);
    }
}

impl<IO: AsyncRead + Unpin> AsyncRead for Active<IO> {
    fn poll_read(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &mut ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let before = buf.filled().len();
        let polled = Pin::new(&mut self.io).poll_read(cx, buf);
        if buf.filled().len() > before {
            self.touch();
        }
        polled
    }
}

impl<IO: AsyncWrite + Unpin> AsyncWrite for Active<IO> {
    fn poll_write(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.io).poll_write(cx, buf);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.touch();
        }
        polled
    }

    fn poll_write_vectored(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        let polled = Pin::new(&mut self.io).poll_write_vectored(cx, bufs);
        if matches!(polled, Poll::Ready(Ok(n)) if n > 0) {
            self.touch();
        }
        polled
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut self.io).poll_shutdown(cx)
    }
}

#[cfg(test)]
mod tests {
    use std::net::SocketAddr;

    use axum::routing::get;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    use super::*;

    async fn server(timeouts: ConnectionTimeouts) -> SocketAddr {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let app = Router::new().route("/", get(|| async { "ok" }));
        tokio::spawn(serve(listener, app, timeouts, std::future::pending()));
        addr
    }

    /// Reads until the server closes the connection; what it sent.
    async fn until_closed(stream: &mut TcpStream) -> String {
        let mut out = Vec::new();
        let _ = stream.read_to_end(&mut out).await;
        String::from_utf8_lossy(&out).into_owned()
    }

    #[tokio::test]
    async fn trickled_headers_are_cut_off_at_the_header_timeout() {
        let addr = server(ConnectionTimeouts {
            header_read: Duration::from_millis(300),
            idle: Duration::from_secs(60),
        })
        .await;
        let mut slow = TcpStream::connect(addr).await.unwrap();
        let started = Instant::now();
        slow.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n")
            .await
            .unwrap();
        let trickle = async {
            for _ in 0..50 {
                tokio::time::sleep(Duration::from_millis(100)).await;
                if slow.write_all(b"X-Slow: 1\r\n").await.is_err() {
                    break;
                }
            }
        };
        let _ = tokio::time::timeout(Duration::from_secs(5), trickle).await;
        let answer = until_closed(&mut slow).await;
        assert!(!answer.contains("200 OK"), "{answer}");
        assert!(
            started.elapsed() < Duration::from_secs(3),
            "closed at the timeout, not after the trickle: {:?}",
            started.elapsed()
        );
        // The server itself is fine.
        let mut quick = TcpStream::connect(addr).await.unwrap();
        quick
            .write_all(b"GET / HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
            .await
            .unwrap();
        assert!(until_closed(&mut quick).await.contains("200 OK"));
    }

    #[tokio::test]
    async fn an_idle_keep_alive_connection_is_closed() {
        let addr = server(ConnectionTimeouts {
            header_read: Duration::from_secs(60),
            idle: Duration::from_millis(300),
        })
        .await;
        let mut client = TcpStream::connect(addr).await.unwrap();
        client
            .write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
            .await
            .unwrap();
        let started = Instant::now();
        let answer = tokio::time::timeout(Duration::from_secs(5), until_closed(&mut client))
            .await
            .expect("the idle connection is closed");
        assert!(answer.contains("200 OK"), "the request was answered first");
        assert!(started.elapsed() >= Duration::from_millis(250));
    }
}
