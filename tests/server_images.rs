//! Images over HTTP on the built-in model (its vision tower has random weights): `image_url` parts
//! as `data:` URLs, local files under `--allowed-local-media-path` and `http://` URLs; image tokens
//! counted as prompt tokens; the same image again served from the prefix cache; and hostile inputs
//! answered with 400s naming the part while the server stays healthy.

mod server_support;

use std::io::{Read, Write};
use std::net::TcpListener;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use base64::Engine as _;
use serde_json::{json, Value};
use server_support::ServerProc;

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures")
        .join(name)
}

fn data_url(bytes: &[u8]) -> String {
    format!(
        "data:image/png;base64,{}",
        base64::engine::general_purpose::STANDARD.encode(bytes)
    )
}

fn chat(parts: Value) -> Value {
    json!({
        "messages": [{"role": "user", "content": parts}],
        "max_tokens": 6,
        "temperature": 0,
    })
}

fn image(url: &str) -> Value {
    json!({"type": "image_url", "image_url": {"url": url}})
}

/// A PNG whose header says `w`×`h` pixels, with a short (invalid) image stream: decoding it must
/// stop at the header.
fn png_header(w: u32, h: u32) -> Vec<u8> {
    fn crc(bytes: &[u8]) -> u32 {
        let mut c = !0u32;
        for &b in bytes {
            c ^= b as u32;
            for _ in 0..8 {
                c = if c & 1 == 1 {
                    0xEDB8_8320 ^ (c >> 1)
                } else {
                    c >> 1
                };
            }
        }
        !c
    }
    let chunk = |kind: &[u8], data: &[u8]| {
        let mut out = (data.len() as u32).to_be_bytes().to_vec();
        let body: Vec<u8> = kind.iter().chain(data).copied().collect();
        out.extend(&body);
        out.extend(crc(&body).to_be_bytes());
        out
    };
    let mut ihdr = w.to_be_bytes().to_vec();
    ihdr.extend(h.to_be_bytes());
    ihdr.extend([8, 2, 0, 0, 0]);
    let mut png = b"\x89PNG\r\n\x1a\n".to_vec();
    png.extend(chunk(b"IHDR", &ihdr));
    png.extend(chunk(b"IDAT", &[0x78, 0x9c, 0x03, 0x00]));
    png.extend(chunk(b"IEND", &[]));
    png
}

/// A local HTTP server answering each connection with `reply` (then holding it open for `hold`).
fn serve_once(reply: Vec<u8>, hold: Duration) -> String {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = listener.local_addr().unwrap();
    std::thread::spawn(move || {
        for conn in listener.incoming() {
            let Ok(mut conn) = conn else { break };
            let reply = reply.clone();
            std::thread::spawn(move || {
                let mut buf = [0u8; 4096];
                let _ = conn.read(&mut buf);
                let _ = conn.write_all(&reply);
                std::thread::sleep(hold);
            });
        }
    });
    format!("http://{addr}/image.png")
}

fn prompt_tokens(v: &Value) -> u64 {
    v["usage"]["prompt_tokens"].as_u64().unwrap()
}

#[test]
fn images_are_prompt_tokens_and_hit_the_prefix_cache() {
    let png = std::fs::read(fixture("qwen3_5_mm_tiny/image0.png")).unwrap();
    let dir = fixture("qwen3_5_mm_tiny");
    let s = ServerProc::start(&[
        "--allowed-local-media-path",
        dir.to_str().unwrap(),
        "--max-model-len",
        "4096",
    ]);
    let text = json!({"type": "text", "text": "What is in the picture?"});
    let (status, plain) = s.post("/v1/chat/completions", &chat(json!([text])));
    assert_eq!(status, 200, "{plain}");
    let with_image = chat(json!([text, image(&data_url(&png))]));
    let (status, first) = s.post("/v1/chat/completions", &with_image);
    assert_eq!(status, 200, "{first}");
    // 64×96 pixels, below the built-in processor's 65,536-pixel minimum: smart_resize scales it
    // to 224×320, 14×20 patches, 70 merged tokens, between <|vision_start|> and <|vision_end|>.
    assert_eq!(prompt_tokens(&first), prompt_tokens(&plain) + 72);
    assert_eq!(first["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    // `/tokenize` expands the image as the chat does.
    let (status, t) = s.post("/tokenize", &json!({"messages": with_image["messages"]}));
    assert_eq!(status, 200, "{t}");
    assert_eq!(t["count"].as_u64(), Some(prompt_tokens(&first)));

    let (status, again) = s.post("/v1/chat/completions", &with_image);
    assert_eq!(status, 200, "{again}");
    assert_eq!(
        again["choices"][0]["message"]["content"],
        first["choices"][0]["message"]["content"]
    );
    let cached = again["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        cached > prompt_tokens(&plain),
        "the image's tokens come from the cache: {cached} cached"
    );

    // The next turn of the conversation (the answer, then a new question) shares the image: its
    // prompt comes from the cache past the image.
    let mut next = with_image.clone();
    next["messages"]
        .as_array_mut()
        .unwrap()
        .push(json!({"role": "assistant", "content": first["choices"][0]["message"]["content"]}));
    next["messages"]
        .as_array_mut()
        .unwrap()
        .push(json!({"role": "user", "content": "And the colours?"}));
    let (status, turn) = s.post("/v1/chat/completions", &next);
    assert_eq!(status, 200, "{turn}");
    let cached = turn["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    assert!(
        cached >= prompt_tokens(&plain) + 72 - 16,
        "the next turn reuses the image's tokens: {cached} cached of {}",
        prompt_tokens(&turn)
    );

    // The same file through file:// and http:// gives the same answer.
    let file_url = format!("file://{}", dir.join("image0.png").display());
    let mut reply = format!(
        "HTTP/1.1 200 OK\r\ncontent-type: image/png\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
        png.len()
    )
    .into_bytes();
    reply.extend(&png);
    let http_url = serve_once(reply, Duration::ZERO);
    for url in [file_url, http_url] {
        let (status, v) = s.post("/v1/chat/completions", &chat(json!([text, image(&url)])));
        assert_eq!(status, 200, "{url}: {v}");
        assert_eq!(
            v["choices"][0]["message"]["content"], first["choices"][0]["message"]["content"],
            "{url}"
        );
    }
}

#[test]
fn hostile_images_get_400s_naming_the_part_and_the_server_stays_healthy() {
    let png = std::fs::read(fixture("qwen3_5_mm_tiny/image0.png")).unwrap();
    let dir = fixture("qwen3_5_mm_tiny");
    let s = ServerProc::start(&[
        "--allowed-local-media-path",
        dir.to_str().unwrap(),
        "--limit-mm-per-prompt",
        r#"{"image": 2}"#,
        "--media-fetch-timeout",
        "1",
    ]);
    let text = json!({"type": "text", "text": "Look:"});
    let huge = png_header(20_000, 20_000);
    let stall = serve_once(Vec::new(), Duration::from_secs(30));
    let mut big =
        b"HTTP/1.1 200 OK\r\ncontent-type: image/png\r\ncontent-length: 104857600\r\n\r\n".to_vec();
    big.resize(big.len() + (1 << 20), 0);
    let flood = serve_once(big, Duration::from_secs(5));
    let html = serve_once(
        b"HTTP/1.1 200 OK\r\ncontent-type: text/html\r\ncontent-length: 2\r\n\r\nhi".to_vec(),
        Duration::ZERO,
    );
    let outside = fixture("images/rgb_png.png");
    let cases: Vec<(&str, Value, &str)> = vec![
        (
            "broken base64",
            image("data:image/png;base64,@@@not-base64@@@"),
            "base64",
        ),
        (
            "a truncated PNG",
            image(&data_url(&png[..png.len() / 2])),
            "decoded",
        ),
        ("a 20000×20000 header", image(&data_url(&huge)), "20000"),
        (
            "a file outside the allowed folder",
            image(&format!("file://{}", outside.display())),
            "allowed",
        ),
        (
            "a path escaping with ..",
            image(&format!("file://{}/../images/rgb_png.png", dir.display())),
            "allowed",
        ),
        ("a server that stalls", image(&stall), "longer than 1 s"),
        ("a server that sends 100 MB", image(&flood), "bytes"),
        ("a page that is not an image", image(&html), "text/html"),
        (
            "a video part",
            json!({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}}),
            "video_url",
        ),
    ];
    for (what, part, says) in cases {
        let t = Instant::now();
        let (status, v) = s.post("/v1/chat/completions", &chat(json!([text, part])));
        assert_eq!(status, 400, "{what}: {v}");
        assert_eq!(v["error"]["param"], "messages[0].content[1]", "{what}: {v}");
        let msg = v["error"]["message"].as_str().unwrap();
        assert!(msg.contains(says), "{what}: {msg}");
        assert!(
            t.elapsed() < Duration::from_secs(10),
            "{what} took {:?}",
            t.elapsed()
        );
    }
    let three = json!([
        text,
        image(&data_url(&png)),
        image(&data_url(&png)),
        image(&data_url(&png))
    ]);
    let (status, v) = s.post("/v1/chat/completions", &chat(three));
    assert_eq!(status, 400, "{v}");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("limit of 2"),
        "{v}"
    );

    assert_eq!(s.get("/health").0, 200);
    let (status, v) = s.post(
        "/v1/chat/completions",
        &chat(json!([text, image(&data_url(&png))])),
    );
    assert_eq!(status, 200, "a good image after the bad ones: {v}");
}

#[test]
fn a_model_without_a_vision_tower_refuses_images() {
    let s = ServerProc::start(&["--limit-mm-per-prompt", r#"{"image": 0}"#]);
    let png = std::fs::read(fixture("qwen3_5_mm_tiny/image0.png")).unwrap();
    let (status, v) = s.post(
        "/v1/chat/completions",
        &chat(json!([{"type": "text", "text": "hi"}, image(&data_url(&png))])),
    );
    assert_eq!(status, 400, "{v}");
    assert_eq!(v["error"]["param"], "messages[0].content[1]");
    assert!(
        v["error"]["message"]
            .as_str()
            .unwrap()
            .contains("takes no images"),
        "{v}"
    );
}
