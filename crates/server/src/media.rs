//! The bytes behind an image content part's URL, under the operator's policy (vLLM's
//! `--allowed-local-media-path` and `--allowed-media-domains`): `data:` URLs are decoded, `file://`
//! URLs are read only inside the allowed folder, and `http(s)://` URLs are fetched with a deadline, a
//! size cap, a redirect limit and the host allow-list checked on every hop.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};
use std::time::Duration;

use base64::engine::general_purpose::{STANDARD, STANDARD_NO_PAD};
use base64::Engine as _;
use reqwest::header::CONTENT_TYPE;
use reqwest::Url;
use tokio::io::AsyncReadExt;

/// Default [`MediaPolicy::timeout`].
pub const DEFAULT_FETCH_TIMEOUT: Duration = Duration::from_secs(10);
/// Default [`MediaPolicy::max_bytes`].
pub const DEFAULT_MAX_MEDIA_BYTES: usize = 20 << 20;
/// Default [`MediaPolicy::max_redirects`].
pub const DEFAULT_MAX_REDIRECTS: usize = 3;

/// Where image URLs may point (vLLM's --allowed-local-media-path / --allowed-media-domains).
#[derive(Debug, Clone)]
pub struct MediaPolicy {
    /// The canonical folder `file://` URLs must resolve inside; `None` refuses every `file://` URL.
    pub allowed_local_path: Option<PathBuf>,
    /// When set, `http(s)://` hosts (and every redirect's) must be one of these, compared exactly
    /// and case-insensitively.
    pub allowed_domains: Option<Vec<String>>,
    /// The whole fetch (connection, headers and body).
    pub timeout: Duration,
    /// The most bytes an image may have.
    pub max_bytes: usize,
    /// The most redirects followed.
    pub max_redirects: usize,
}

impl Default for MediaPolicy {
    fn default() -> MediaPolicy {
        MediaPolicy {
            allowed_local_path: None,
            allowed_domains: None,
            timeout: DEFAULT_FETCH_TIMEOUT,
            max_bytes: DEFAULT_MAX_MEDIA_BYTES,
            max_redirects: DEFAULT_MAX_REDIRECTS,
        }
    }
}

impl MediaPolicy {
    /// Whether `url`'s scheme and host may be fetched.
    fn check_remote(&self, url: &Url) -> Result<(), String> {
        if !matches!(url.scheme(), "http" | "https") {
            return Err(format!(
                "the URL scheme `{}` is not supported for images",
                url.scheme()
            ));
        }
        let Some(host) = url.host_str() else {
            return Err("the image URL has no host".into());
        };
        if let Some(domains) = &self.allowed_domains {
            if !domains.iter().any(|d| d.eq_ignore_ascii_case(host)) {
                return Err(format!(
                    "the host `{host}` is not in --allowed-media-domains"
                ));
            }
        }
        Ok(())
    }

    fn too_large(&self) -> String {
        format!("the image is larger than {} bytes", self.max_bytes)
    }
}

/// The bytes behind `url`: a `data:` URL (base64; `data:image/...;base64,...`), a `file://` URL
/// (only under `allowed_local_path`, resolved with canonicalize so `..` and symlinks cannot escape),
/// or an `http(s)://` URL fetched under the policy. The error is a plain sentence, for a 400 that
/// names the content part.
pub async fn fetch(url: &str, policy: &MediaPolicy) -> Result<Vec<u8>, String> {
    let url = url.trim();
    let scheme = url
        .split_once(':')
        .map(|(s, _)| s.to_ascii_lowercase())
        .unwrap_or_default();
    match scheme.as_str() {
        "data" => decode_data_url(url, policy),
        "file" => read_local(url, policy).await,
        "http" | "https" => fetch_remote(url, policy).await,
        "" => Err("the image URL has no scheme (expected data:, http(s):// or file://)".into()),
        other => Err(format!(
            "the URL scheme `{other}` is not supported for images (expected data:, http(s):// or file://)"
        )),
    }
}

/// `data:image/...;base64,...`.
fn decode_data_url(url: &str, policy: &MediaPolicy) -> Result<Vec<u8>, String> {
    // The caller matched the scheme case-insensitively; "data:" is five ASCII bytes.
    let rest = &url[5..];
    let Some((header, payload)) = rest.split_once(',') else {
        return Err("the data URL has no `,` before its data".into());
    };
    let Some(media_type) = header
        .len()
        .checked_sub(";base64".len())
        .and_then(|at| Some((header.get(..at)?, header.get(at..)?)))
        .filter(|(_, suffix)| suffix.eq_ignore_ascii_case(";base64"))
        .map(|(media_type, _)| media_type)
    else {
        return Err("the data URL must be base64 (`data:image/...;base64,...`)".into());
    };
    let essence = media_type.split(';').next().unwrap_or("").trim();
    if !essence.to_ascii_lowercase().starts_with("image/") {
        return Err(format!(
            "the data URL's media type `{essence}` is not an image type"
        ));
    }
    // Four base64 characters make three bytes: refuse a payload far over the cap before decoding it.
    if payload.len() / 4 * 3 > policy.max_bytes.saturating_add(2) {
        return Err(policy.too_large());
    }
    let bytes = STANDARD
        .decode(payload)
        .or_else(|_| STANDARD_NO_PAD.decode(payload))
        .map_err(|e| format!("the data URL's base64 is invalid: {e}"))?;
    if bytes.len() > policy.max_bytes {
        return Err(policy.too_large());
    }
    Ok(bytes)
}

/// A `file://` URL inside the allowed folder.
async fn read_local(url: &str, policy: &MediaPolicy) -> Result<Vec<u8>, String> {
    let Some(allowed) = &policy.allowed_local_path else {
        return Err("local files need --allowed-local-media-path".into());
    };
    let parsed = Url::parse(url).map_err(|e| format!("the file URL is invalid: {e}"))?;
    let path = parsed
        .to_file_path()
        .map_err(|()| "the file URL must be `file:///absolute/path` (no host)".to_string())?;
    let root = tokio::fs::canonicalize(allowed)
        .await
        .map_err(|_| "--allowed-local-media-path cannot be read".to_string())?;
    // A missing file and one outside the folder read the same, so requests cannot probe the disk.
    let outside = || "no file at this URL inside --allowed-local-media-path".to_string();
    let real = tokio::fs::canonicalize(&path)
        .await
        .map_err(|_| outside())?;
    if !real.starts_with(&root) {
        return Err(outside());
    }
    read_capped(&real, policy.max_bytes).await
}

async fn read_capped(path: &Path, max_bytes: usize) -> Result<Vec<u8>, String> {
    let unreadable = |e: std::io::Error| format!("the file cannot be read: {}", e.kind());
    let file = tokio::fs::File::open(path).await.map_err(unreadable)?;
    let meta = file.metadata().await.map_err(unreadable)?;
    if !meta.is_file() {
        return Err("the file URL does not name a regular file".into());
    }
    if meta.len() > max_bytes as u64 {
        return Err(format!("the image is larger than {max_bytes} bytes"));
    }
    // The length read is capped too: a file may grow, or report no size.
    let mut bytes = Vec::with_capacity(meta.len() as usize);
    file.take(max_bytes as u64 + 1)
        .read_to_end(&mut bytes)
        .await
        .map_err(unreadable)?;
    if bytes.len() > max_bytes {
        return Err(format!("the image is larger than {max_bytes} bytes"));
    }
    Ok(bytes)
}

/// A redirect refused by the policy; its message is the error's.
#[derive(Debug)]
struct Refused(String);

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Refused {}

/// One client (and connection pool) per redirect policy.
fn client(policy: &MediaPolicy) -> Result<reqwest::Client, String> {
    type Key = (usize, Option<Vec<String>>);
    static CLIENTS: OnceLock<Mutex<HashMap<Key, reqwest::Client>>> = OnceLock::new();
    let key = (policy.max_redirects, policy.allowed_domains.clone());
    let mut clients = CLIENTS
        .get_or_init(Default::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(c) = clients.get(&key) {
        return Ok(c.clone());
    }
    let hops = policy.clone();
    let redirects = reqwest::redirect::Policy::custom(move |attempt| {
        // `previous` holds the URLs already requested: the first one and each redirect followed.
        if attempt.previous().len() > hops.max_redirects {
            let message = format!(
                "the image URL redirected more than {} times",
                hops.max_redirects
            );
            return attempt.error(Refused(message));
        }
        match hops.check_remote(attempt.url()) {
            Ok(()) => attempt.follow(),
            Err(m) => attempt.error(Refused(format!("a redirect was refused: {m}"))),
        }
    });
    let c = reqwest::Client::builder()
        .redirect(redirects)
        .user_agent(concat!("sanmai/", env!("CARGO_PKG_VERSION")))
        .build()
        .map_err(|e| format!("the HTTP client could not start: {e}"))?;
    clients.insert(key, c.clone());
    Ok(c)
}

/// A request error as a sentence: a refused redirect's own message, otherwise the causes joined.
fn describe(e: reqwest::Error) -> String {
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&e);
    while let Some(s) = source {
        if let Some(r) = s.downcast_ref::<Refused>() {
            return r.0.clone();
        }
        source = s.source();
    }
    let e = e.without_url();
    let mut text = format!("fetching the image failed: {e}");
    let mut source = std::error::Error::source(&e);
    while let Some(s) = source {
        text.push_str(": ");
        text.push_str(&s.to_string());
        source = s.source();
    }
    text
}

/// An `http(s)://` URL, under the policy's deadline, size cap, redirect limit and host list.
async fn fetch_remote(url: &str, policy: &MediaPolicy) -> Result<Vec<u8>, String> {
    let parsed = Url::parse(url).map_err(|e| format!("the image URL is invalid: {e}"))?;
    policy.check_remote(&parsed)?;
    let client = client(policy)?;
    let fetch = async {
        let mut response = client.get(parsed).send().await.map_err(describe)?;
        let status = response.status();
        if !status.is_success() {
            return Err(format!("the image URL answered with status {status}"));
        }
        let content_type = response
            .headers()
            .get(CONTENT_TYPE)
            .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
        let essence = content_type
            .as_deref()
            .and_then(|t| t.split(';').next())
            .map(|t| t.trim().to_ascii_lowercase());
        match essence.as_deref() {
            Some(t) if t.starts_with("image/") || t == "application/octet-stream" => {}
            Some(_) => {
                return Err(format!(
                    "the image URL's content type `{}` is not an image type",
                    content_type.unwrap_or_default()
                ))
            }
            None => return Err("the image URL's response has no content type".into()),
        }
        let announced = response.content_length();
        if announced.is_some_and(|n| n > policy.max_bytes as u64) {
            return Err(policy.too_large());
        }
        let mut body = Vec::with_capacity(announced.unwrap_or(0) as usize);
        while let Some(chunk) = response.chunk().await.map_err(describe)? {
            if body.len() + chunk.len() > policy.max_bytes {
                return Err(policy.too_large());
            }
            body.extend_from_slice(&chunk);
        }
        Ok(body)
    };
    tokio::time::timeout(policy.timeout, fetch)
        .await
        .map_err(|_| {
            format!(
                "fetching the image took longer than {} s",
                policy.timeout.as_secs_f64()
            )
        })?
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Arc;
    use std::time::Instant;
    use tokio::io::AsyncWriteExt;
    use tokio::net::{TcpListener, TcpStream};

    /// Reads one request's head (through the blank line); `None` if the peer closed first.
    async fn read_head(sock: &mut TcpStream) -> Option<String> {
        let mut head = Vec::new();
        let mut buf = [0u8; 1024];
        while !head.windows(4).any(|w| w == b"\r\n\r\n") {
            let n = sock.read(&mut buf).await.ok()?;
            if n == 0 {
                return None;
            }
            head.extend_from_slice(&buf[..n]);
        }
        Some(String::from_utf8_lossy(&head).into_owned())
    }

    /// A server on 127.0.0.1 that hands each connection to `handle` (with the connection's number);
    /// returns its base URL and the number of connections accepted.
    async fn serve<F, Fut>(handle: F) -> (String, Arc<AtomicUsize>)
    where
        F: Fn(TcpStream, usize) -> Fut + Send + 'static,
        Fut: std::future::Future<Output = ()> + Send + 'static,
    {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let count = Arc::new(AtomicUsize::new(0));
        let accepted = count.clone();
        tokio::spawn(async move {
            while let Ok((sock, _)) = listener.accept().await {
                let n = accepted.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(handle(sock, n));
            }
        });
        (format!("http://{addr}"), count)
    }

    /// A server answering every request with `response` and closing the connection.
    async fn serve_fixed(response: Vec<u8>) -> (String, Arc<AtomicUsize>) {
        let response = Arc::new(response);
        serve(move |mut sock, _| {
            let response = response.clone();
            async move {
                if read_head(&mut sock).await.is_some() {
                    let _ = sock.write_all(&response).await;
                    let _ = sock.shutdown().await;
                }
            }
        })
        .await
    }

    fn policy(timeout_ms: u64) -> MediaPolicy {
        MediaPolicy {
            timeout: Duration::from_millis(timeout_ms),
            ..MediaPolicy::default()
        }
    }

    const PNG_BYTES: &[u8] = b"\x89PNG\r\n\x1a\n-not-really-a-png";

    fn response(status: &str, content_type: &str, body: &[u8]) -> Vec<u8> {
        let mut r = format!(
            "HTTP/1.1 {status}\r\nContent-Type: {content_type}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
            body.len()
        )
        .into_bytes();
        r.extend_from_slice(body);
        r
    }

    #[tokio::test]
    async fn a_server_that_never_answers_is_cut_off() {
        let (base, count) = serve(|sock, _| async move {
            // Holds the connection open without a byte.
            tokio::time::sleep(Duration::from_secs(30)).await;
            drop(sock);
        })
        .await;
        let start = Instant::now();
        let err = fetch(&format!("{base}/a.png"), &policy(500))
            .await
            .unwrap_err();
        assert_eq!(err, "fetching the image took longer than 0.5 s");
        assert!(
            start.elapsed() < Duration::from_secs(3),
            "{:?}",
            start.elapsed()
        );
        assert_eq!(count.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn a_body_that_trickles_is_cut_off() {
        let (base, _) = serve(|mut sock, _| async move {
            read_head(&mut sock).await;
            let head = "HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nContent-Length: 1000\r\n\r\n";
            let _ = sock.write_all(head.as_bytes()).await;
            for _ in 0..1000 {
                if sock.write_all(b"x").await.is_err() {
                    return;
                }
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        })
        .await;
        let start = Instant::now();
        let err = fetch(&format!("{base}/slow.png"), &policy(500))
            .await
            .unwrap_err();
        assert_eq!(err, "fetching the image took longer than 0.5 s");
        assert!(
            start.elapsed() < Duration::from_secs(3),
            "{:?}",
            start.elapsed()
        );
    }

    /// A server streaming zeros after `head` until the client hangs up; the bytes it managed to
    /// send arrive on the returned channel.
    async fn serve_zeros(
        head: &'static str,
        chunked: bool,
    ) -> (String, tokio::sync::mpsc::UnboundedReceiver<usize>) {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let (base, _) = serve(move |mut sock, _| {
            let tx = tx.clone();
            async move {
                read_head(&mut sock).await;
                let mut sent = 0usize;
                if sock.write_all(head.as_bytes()).await.is_ok() {
                    let zeros = vec![0u8; 64 << 10];
                    while sent < 100 << 20 {
                        let written = if chunked {
                            let mut c = format!("{:x}\r\n", zeros.len()).into_bytes();
                            c.extend_from_slice(&zeros);
                            c.extend_from_slice(b"\r\n");
                            sock.write_all(&c).await
                        } else {
                            sock.write_all(&zeros).await
                        };
                        if written.is_err() {
                            break;
                        }
                        sent += zeros.len();
                    }
                }
                let _ = tx.send(sent);
            }
        })
        .await;
        (base, rx)
    }

    /// A server streaming zeros after `head` (`chunked` or not) is refused at a 1 MiB cap, and
    /// stops because the client hung up, long before it sent 100 MB.
    async fn refused_at_the_cap(head: &'static str, chunked: bool) {
        let (base, mut sent) = serve_zeros(head, chunked).await;
        let p = MediaPolicy {
            max_bytes: 1 << 20,
            ..policy(5000)
        };
        let err = fetch(&format!("{base}/big.png"), &p).await.unwrap_err();
        assert_eq!(err, "the image is larger than 1048576 bytes");
        let sent = tokio::time::timeout(Duration::from_secs(5), sent.recv())
            .await
            .unwrap()
            .unwrap();
        assert!(sent < 50 << 20, "the server sent {sent} bytes");
    }

    #[tokio::test]
    async fn an_announced_body_over_the_cap_is_refused_unread() {
        refused_at_the_cap(
            "HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nContent-Length: 104857600\r\n\r\n",
            false,
        )
        .await;
    }

    #[tokio::test]
    async fn a_chunked_body_is_cut_at_the_cap() {
        refused_at_the_cap(
            "HTTP/1.1 200 OK\r\nContent-Type: image/png\r\nTransfer-Encoding: chunked\r\n\r\n",
            true,
        )
        .await;
    }

    #[tokio::test]
    async fn a_redirect_loop_stops_at_the_limit() {
        let (base, count) = serve(|mut sock, _| async move {
            if read_head(&mut sock).await.is_some() {
                let r = "HTTP/1.1 302 Found\r\nLocation: /loop\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
                let _ = sock.write_all(r.as_bytes()).await;
                let _ = sock.shutdown().await;
            }
        })
        .await;
        let err = fetch(&format!("{base}/loop"), &policy(5000))
            .await
            .unwrap_err();
        assert_eq!(err, "the image URL redirected more than 3 times");
        // The first request and three redirects followed.
        assert_eq!(count.load(Ordering::SeqCst), 4);
    }

    #[tokio::test]
    async fn redirects_within_the_limit_are_followed() {
        let (base, count) = serve(|mut sock, _| async move {
            let Some(head) = read_head(&mut sock).await else {
                return;
            };
            let r = if head.starts_with("GET /final.png ") {
                response("200 OK", "image/png", PNG_BYTES)
            } else {
                b"HTTP/1.1 301 Moved\r\nLocation: /final.png\r\nContent-Length: 0\r\nConnection: close\r\n\r\n".to_vec()
            };
            let _ = sock.write_all(&r).await;
            let _ = sock.shutdown().await;
        })
        .await;
        let bytes = fetch(&format!("{base}/start"), &policy(5000))
            .await
            .unwrap();
        assert_eq!(bytes, PNG_BYTES);
        assert_eq!(count.load(Ordering::SeqCst), 2);
    }

    #[tokio::test]
    async fn a_redirect_to_a_host_off_the_list_is_refused() {
        let (base, count) = serve(|mut sock, _| async move {
            if read_head(&mut sock).await.is_some() {
                let r = "HTTP/1.1 302 Found\r\nLocation: http://localhost:9/a.png\r\nContent-Length: 0\r\nConnection: close\r\n\r\n";
                let _ = sock.write_all(r.as_bytes()).await;
                let _ = sock.shutdown().await;
            }
        })
        .await;
        let p = MediaPolicy {
            allowed_domains: Some(vec!["127.0.0.1".into()]),
            ..policy(5000)
        };
        let err = fetch(&format!("{base}/a.png"), &p).await.unwrap_err();
        assert_eq!(
            err,
            "a redirect was refused: the host `localhost` is not in --allowed-media-domains"
        );
        assert_eq!(count.load(Ordering::SeqCst), 1);
    }

    #[tokio::test]
    async fn a_non_image_content_type_is_refused() {
        let (base, _) = serve_fixed(response(
            "200 OK",
            "text/html; charset=utf-8",
            b"<html></html>",
        ))
        .await;
        let err = fetch(&format!("{base}/page"), &policy(5000))
            .await
            .unwrap_err();
        assert_eq!(
            err,
            "the image URL's content type `text/html; charset=utf-8` is not an image type"
        );
    }

    #[tokio::test]
    async fn a_closed_port_is_a_fetch_error() {
        let port = {
            let l = TcpListener::bind("127.0.0.1:0").await.unwrap();
            l.local_addr().unwrap().port()
        };
        let err = fetch(&format!("http://127.0.0.1:{port}/a.png"), &policy(5000))
            .await
            .unwrap_err();
        assert!(
            err.starts_with("fetching the image failed: error sending request")
                && !err.contains("127.0.0.1"),
            "{err}"
        );
    }

    #[tokio::test]
    async fn an_error_status_is_refused() {
        let (base, _) = serve_fixed(response("404 Not Found", "image/png", b"")).await;
        let err = fetch(&format!("{base}/missing.png"), &policy(5000))
            .await
            .unwrap_err();
        assert_eq!(err, "the image URL answered with status 404 Not Found");
    }

    #[tokio::test]
    async fn hosts_off_the_list_are_never_contacted() {
        let (base, count) = serve_fixed(response("200 OK", "image/png", PNG_BYTES)).await;
        let p = MediaPolicy {
            allowed_domains: Some(vec!["example.com".into()]),
            ..policy(5000)
        };
        let err = fetch(&format!("{base}/a.png"), &p).await.unwrap_err();
        assert_eq!(
            err,
            "the host `127.0.0.1` is not in --allowed-media-domains"
        );
        assert_eq!(count.load(Ordering::SeqCst), 0);
        // The match is exact and case-insensitive.
        let p = MediaPolicy {
            allowed_domains: Some(vec!["EXAMPLE.com".into()]),
            ..policy(5000)
        };
        let err = fetch("http://Example.COM.evil.test/a.png", &p)
            .await
            .unwrap_err();
        assert_eq!(
            err,
            "the host `example.com.evil.test` is not in --allowed-media-domains"
        );
    }

    #[tokio::test]
    async fn an_image_is_fetched() {
        let (base, _) = serve_fixed(response("200 OK", "image/png", PNG_BYTES)).await;
        let p = MediaPolicy {
            allowed_domains: Some(vec!["127.0.0.1".into()]),
            ..policy(5000)
        };
        assert_eq!(
            fetch(&format!("{base}/a.png"), &p).await.unwrap(),
            PNG_BYTES
        );
        let (base, _) =
            serve_fixed(response("200 OK", "application/octet-stream", PNG_BYTES)).await;
        assert_eq!(fetch(&format!("{base}/a"), &p).await.unwrap(), PNG_BYTES);
    }

    #[tokio::test]
    async fn data_urls() {
        let p = MediaPolicy::default();
        let encoded = STANDARD.encode(PNG_BYTES);
        let url = format!("data:image/png;base64,{encoded}");
        assert_eq!(fetch(&url, &p).await.unwrap(), PNG_BYTES);
        // Padding may be left off.
        let unpadded = STANDARD_NO_PAD.encode(PNG_BYTES);
        assert_ne!(unpadded, encoded);
        let url = format!("data:image/png;base64,{unpadded}");
        assert_eq!(fetch(&url, &p).await.unwrap(), PNG_BYTES);

        let err = fetch("data:image/png;base64,AAA*AAA=", &p)
            .await
            .unwrap_err();
        assert!(
            err.starts_with("the data URL's base64 is invalid: "),
            "{err}"
        );
        let err = fetch(&format!("data:text/plain;base64,{encoded}"), &p)
            .await
            .unwrap_err();
        assert_eq!(
            err,
            "the data URL's media type `text/plain` is not an image type"
        );
        let err = fetch("data:image/png,rawbytes", &p).await.unwrap_err();
        assert_eq!(
            err,
            "the data URL must be base64 (`data:image/...;base64,...`)"
        );
        let small = MediaPolicy {
            max_bytes: 8,
            ..MediaPolicy::default()
        };
        let err = fetch(&format!("data:image/png;base64,{encoded}"), &small)
            .await
            .unwrap_err();
        assert_eq!(err, "the image is larger than 8 bytes");
        // Exactly at the cap is fine.
        let eight = STANDARD.encode([7u8; 8]);
        let url = format!("data:image/png;base64,{eight}");
        assert_eq!(fetch(&url, &small).await.unwrap(), [7u8; 8]);
    }

    #[tokio::test]
    async fn other_schemes_are_refused() {
        let p = MediaPolicy::default();
        let err = fetch("ftp://example.com/a.png", &p).await.unwrap_err();
        assert_eq!(
            err,
            "the URL scheme `ftp` is not supported for images (expected data:, http(s):// or file://)"
        );
        let err = fetch("just-a-name.png", &p).await.unwrap_err();
        assert_eq!(
            err,
            "the image URL has no scheme (expected data:, http(s):// or file://)"
        );
    }

    /// A fresh folder holding `allowed/a.png`, `allowed/sub/`, a large `allowed/big.png`, a file
    /// beside `allowed` and a symlink inside `allowed` pointing to it.
    fn local_tree(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("sanmai-media-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("allowed/sub")).unwrap();
        std::fs::write(dir.join("allowed/a.png"), PNG_BYTES).unwrap();
        std::fs::write(dir.join("allowed/big.png"), vec![0u8; 4096]).unwrap();
        std::fs::write(dir.join("secret.png"), b"secret").unwrap();
        #[cfg(unix)]
        std::os::unix::fs::symlink(dir.join("secret.png"), dir.join("allowed/link.png")).unwrap();
        dir.canonicalize().unwrap()
    }

    #[tokio::test]
    async fn file_urls_stay_inside_the_allowed_folder() {
        let dir = local_tree("files");
        let allowed = dir.join("allowed");
        let p = MediaPolicy {
            allowed_local_path: Some(allowed.clone()),
            max_bytes: 1024,
            ..MediaPolicy::default()
        };
        let url = |p: &Path| format!("file://{}", p.display());
        assert_eq!(
            fetch(&url(&allowed.join("a.png")), &p).await.unwrap(),
            PNG_BYTES
        );

        let outside = "no file at this URL inside --allowed-local-media-path";
        // Beside the folder, through `..` (plain and percent-encoded), through a symlink, or missing.
        for target in [
            url(&dir.join("secret.png")),
            format!("file://{}/../secret.png", allowed.display()),
            format!("file://{}/%2e%2e/secret.png", allowed.display()),
            format!("file://{}/sub/../../secret.png", allowed.display()),
            url(&allowed.join("missing.png")),
        ] {
            assert_eq!(fetch(&target, &p).await.unwrap_err(), outside, "{target}");
        }
        #[cfg(unix)]
        assert_eq!(
            fetch(&url(&allowed.join("link.png")), &p)
                .await
                .unwrap_err(),
            outside
        );
        assert_eq!(
            fetch(&url(&allowed.join("sub")), &p).await.unwrap_err(),
            "the file URL does not name a regular file"
        );
        assert_eq!(
            fetch(&url(&allowed.join("big.png")), &p).await.unwrap_err(),
            "the image is larger than 1024 bytes"
        );
        assert_eq!(
            fetch("file://otherhost/etc/passwd", &p).await.unwrap_err(),
            "the file URL must be `file:///absolute/path` (no host)"
        );

        // Without a folder nothing local is read.
        let err = fetch(&url(&allowed.join("a.png")), &MediaPolicy::default())
            .await
            .unwrap_err();
        assert_eq!(err, "local files need --allowed-local-media-path");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
