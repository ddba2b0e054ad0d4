//! Starting the real `sanmai serve` binary on a free port and speaking HTTP to it, for the
//! `server_*` integration tests.
#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read};
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use reqwest::blocking::{Client, Response};
use serde_json::{json, Value};

/// A running server; killed when dropped.
pub struct ServerProc {
    child: Child,
    pub base: String,
    log: Arc<Mutex<String>>,
    client: Client,
}

/// How long the built-in model may take to load.
const READY_TIMEOUT: Duration = Duration::from_secs(120);

impl ServerProc {
    /// Starts `sanmai serve --port 0 ARGS` and waits for it to listen (not for the model). Without a
    /// model flag (`--model`, `--config`, `--load-format`) it serves the random built-in model
    /// (`--load-format dummy`): these tests check shapes, not answers; `--load-format auto` serves the
    /// trained one.
    pub fn spawn(args: &[&str]) -> ServerProc {
        let random = if args
            .iter()
            .any(|a| matches!(*a, "--model" | "--config" | "--load-format"))
        {
            &[][..]
        } else {
            &["--load-format", "dummy"][..]
        };
        let mut child = Command::new(env!("CARGO_BIN_EXE_sanmai"))
            .arg("serve")
            .args(["--port", "0"])
            .args(random)
            .args(args)
            .env("RUST_LOG", "info")
            .env("NO_COLOR", "1")
            .env("RUST_BACKTRACE", "1")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .expect("the binary starts");
        let stderr = child.stderr.take().unwrap();
        let log = Arc::new(Mutex::new(String::new()));
        let (tx, rx) = std::sync::mpsc::channel();
        {
            let log = log.clone();
            std::thread::spawn(move || {
                let mut reader = BufReader::new(stderr);
                let mut line = String::new();
                let mut sent = false;
                while reader.read_line(&mut line).unwrap_or(0) > 0 {
                    if !sent {
                        if let Some(at) = line.find("listening on http://") {
                            let rest = &line[at + "listening on http://".len()..];
                            let addr: String =
                                rest.chars().take_while(|c| !c.is_whitespace()).collect();
                            let _ = tx.send(addr);
                            sent = true;
                        }
                    }
                    log.lock().unwrap().push_str(&line);
                    line.clear();
                }
            });
        }
        let addr = match rx.recv_timeout(Duration::from_secs(60)) {
            Ok(a) => a,
            Err(_) => {
                let _ = child.kill();
                panic!(
                    "the server did not start listening:\n{}",
                    log.lock().unwrap()
                );
            }
        };
        ServerProc {
            child,
            base: format!("http://{addr}"),
            log,
            client: Client::builder()
                .timeout(Duration::from_secs(300))
                .build()
                .unwrap(),
        }
    }

    /// Starts a server and waits until its model is loaded.
    pub fn start(args: &[&str]) -> ServerProc {
        let s = ServerProc::spawn(args);
        s.wait_ready();
        s
    }

    pub fn wait_ready(&self) {
        let t = Instant::now();
        while t.elapsed() < READY_TIMEOUT {
            if let Ok(r) = self.client.get(self.url("/health")).send() {
                if r.status() == 200 {
                    return;
                }
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        panic!("the model did not load in time:\n{}", self.log());
    }

    pub fn log(&self) -> String {
        self.log.lock().unwrap().clone()
    }

    pub fn url(&self, path: &str) -> String {
        format!("{}{path}", self.base)
    }

    pub fn client(&self) -> &Client {
        &self.client
    }

    pub fn pid(&self) -> u32 {
        self.child.id()
    }

    /// Sends SIGTERM and waits (at most `limit`) for the process to exit; returns its exit code.
    pub fn terminate(&mut self, limit: Duration) -> Option<i32> {
        let status = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status()
            .expect("kill runs");
        assert!(status.success());
        let t = Instant::now();
        while t.elapsed() < limit {
            if let Some(s) = self.child.try_wait().unwrap() {
                return s.code();
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        None
    }

    /// POSTs JSON; returns the status and the JSON body.
    pub fn post(&self, path: &str, body: &Value) -> (u16, Value) {
        let r = self
            .client
            .post(self.url(path))
            .json(body)
            .send()
            .unwrap_or_else(|e| panic!("POST {path}: {e}\nserver log:\n{}", self.log()));
        let status = r.status().as_u16();
        let text = r.text().unwrap();
        let v = serde_json::from_str(&text)
            .unwrap_or_else(|e| panic!("{path} answered non-JSON ({e}): {text:?}"));
        (status, v)
    }

    /// POSTs raw bytes as JSON content.
    pub fn post_raw(&self, path: &str, body: Vec<u8>, key: Option<&str>) -> (u16, String) {
        let mut req = self
            .client
            .post(self.url(path))
            .header("content-type", "application/json")
            .body(body);
        if let Some(k) = key {
            req = req.bearer_auth(k);
        }
        let r = req.send().unwrap();
        (r.status().as_u16(), r.text().unwrap())
    }

    pub fn get(&self, path: &str) -> (u16, String) {
        let r = self.client.get(self.url(path)).send().unwrap();
        (r.status().as_u16(), r.text().unwrap())
    }

    pub fn get_json(&self, path: &str) -> (u16, Value) {
        let (s, text) = self.get(path);
        (s, serde_json::from_str(&text).unwrap())
    }

    /// POSTs a streaming request and reads the whole event stream.
    pub fn stream(&self, path: &str, body: &Value) -> Sse {
        let r = self.client.post(self.url(path)).json(body).send().unwrap();
        assert_eq!(r.status(), 200, "streaming request failed");
        let ct = r.headers()["content-type"].to_str().unwrap().to_string();
        assert!(ct.starts_with("text/event-stream"), "{ct}");
        let mut events = SseReader::new(r);
        let mut out = Sse::default();
        while let Some(data) = events.next_data() {
            if data == "[DONE]" {
                out.done = true;
                assert!(events.next_data().is_none(), "events after [DONE]");
                break;
            }
            out.events.push(serde_json::from_str(&data).unwrap());
        }
        out
    }

    /// Opens a streaming request and returns the reader without consuming it.
    pub fn open_stream(&self, path: &str, body: &Value) -> SseReader {
        let r = self.client.post(self.url(path)).json(body).send().unwrap();
        assert_eq!(r.status(), 200);
        SseReader::new(r)
    }

    /// A Prometheus sample (the first whose name, labels stripped, is `name`).
    pub fn metric(&self, name: &str) -> f64 {
        let (status, text) = self.get("/metrics");
        assert_eq!(status, 200);
        metric_in(&text, name).unwrap_or_else(|| panic!("no metric {name} in\n{text}"))
    }
}

pub fn metric_in(text: &str, name: &str) -> Option<f64> {
    text.lines().filter(|l| !l.starts_with('#')).find_map(|l| {
        let (key, value) = l.rsplit_once(' ')?;
        let bare = key.split('{').next()?;
        (bare == name).then(|| value.parse().ok())?
    })
}

impl Drop for ServerProc {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// A finished event stream.
#[derive(Debug, Default)]
pub struct Sse {
    pub events: Vec<Value>,
    pub done: bool,
}

impl Sse {
    /// The events that carry choices (not the usage chunk).
    pub fn chunks(&self) -> impl Iterator<Item = &Value> {
        self.events
            .iter()
            .filter(|e| e["choices"].as_array().is_some_and(|c| !c.is_empty()))
    }

    /// Concatenates `choices[].delta[field]` (chat) or `choices[].text` of one choice.
    pub fn text_of(&self, index: u64, field: &str) -> String {
        let mut s = String::new();
        for e in self.chunks() {
            for c in e["choices"].as_array().unwrap() {
                if c["index"] == index {
                    let v = if field == "text" {
                        &c["text"]
                    } else {
                        &c["delta"][field]
                    };
                    if let Some(t) = v.as_str() {
                        s.push_str(t);
                    }
                }
            }
        }
        s
    }

    /// The `finish_reason` of one choice (from its final chunk).
    pub fn finish_reason(&self, index: u64) -> Option<String> {
        self.chunks()
            .flat_map(|e| e["choices"].as_array().unwrap().iter())
            .filter(|c| c["index"] == index)
            .find_map(|c| c["finish_reason"].as_str().map(String::from))
    }
}

/// Reads `data:` payloads off an event stream.
pub struct SseReader {
    reader: BufReader<Response>,
}

impl SseReader {
    fn new(r: Response) -> SseReader {
        SseReader {
            reader: BufReader::new(r),
        }
    }

    /// The next event's data, `None` at the end of the stream.
    pub fn next_data(&mut self) -> Option<String> {
        let mut data = String::new();
        let mut line = String::new();
        loop {
            line.clear();
            match self.reader.read_line(&mut line) {
                Ok(0) | Err(_) => return (!data.is_empty()).then_some(data),
                Ok(_) => {}
            }
            let l = line.trim_end_matches(['\r', '\n']);
            if l.is_empty() {
                if !data.is_empty() {
                    return Some(data);
                }
                continue;
            }
            if let Some(d) = l.strip_prefix("data:") {
                data.push_str(d.strip_prefix(' ').unwrap_or(d));
            }
        }
    }

    /// Reads whatever is left (to the end of the stream).
    pub fn rest(mut self) -> String {
        let mut s = String::new();
        let _ = self.reader.read_to_string(&mut s);
        s
    }
}

/// A chat request body for the built-in model.
pub fn chat(content: &str, extra: Value) -> Value {
    let mut body = serde_json::json!({
        "model": "sanmai-demo",
        "messages": [{"role": "user", "content": content}],
    });
    merge(&mut body, extra);
    body
}

/// A completions request body for the built-in model.
pub fn completion(prompt: Value, extra: Value) -> Value {
    let mut body = serde_json::json!({"model": "sanmai-demo", "prompt": prompt});
    merge(&mut body, extra);
    body
}

pub fn merge(body: &mut Value, extra: Value) {
    if let Value::Object(m) = extra {
        for (k, v) in m {
            body[k] = v;
        }
    }
}

/// Asserts the OpenAI error shape and returns the error object.
pub fn error_of(v: &Value) -> &Value {
    let e = &v["error"];
    assert!(e["message"].as_str().is_some_and(|m| !m.is_empty()), "{v}");
    assert!(e["type"].is_string(), "{v}");
    assert!(e.get("param").is_some() && e.get("code").is_some(), "{v}");
    e
}

/// Polls until `f` holds or `limit` passes.
pub fn eventually(limit: Duration, mut f: impl FnMut() -> bool) -> bool {
    let t = Instant::now();
    while t.elapsed() < limit {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(25));
    }
    false
}

/// Two 200-token greedy completions at once on `s` (whose K/V budget holds one of them): at least
/// one preemption, and each text equals the same request run alone afterwards; nothing left running.
pub fn preempted_outputs_equal_solo_ones(s: &ServerProc) {
    let body = |i: usize| {
        completion(
            json!(format!("Story number {i} begins here and goes on")),
            json!({"max_tokens": 200, "temperature": 0, "ignore_eos": true}),
        )
    };
    let together: Vec<String> = std::thread::scope(|scope| {
        let hs: Vec<_> = (0..2)
            .map(|i| {
                let s = &s;
                let b = body(i);
                scope.spawn(move || {
                    let (status, v) = s.post("/v1/completions", &b);
                    assert_eq!(status, 200, "{v}");
                    v["choices"][0]["text"].as_str().unwrap().to_string()
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    assert!(s.metric("sanmai:num_preemptions_total") >= 1.0);
    for (i, text) in together.iter().enumerate() {
        let (_, alone) = s.post("/v1/completions", &body(i));
        assert_eq!(
            alone["choices"][0]["text"].as_str().unwrap(),
            text,
            "request {i}"
        );
    }
    assert_eq!(s.metric("sanmai:num_requests_running"), 0.0);
}

/// Runs the `sanmai` binary with `args` (warnings only in its log) and returns what it did.
pub fn sanmai(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_sanmai"))
        .args(args)
        .env("RUST_LOG", "warn")
        .env("RUST_BACKTRACE", "0")
        .output()
        .expect("the binary runs")
}

/// The error output of a run that must fail.
pub fn stderr(out: &std::process::Output) -> String {
    assert!(
        !out.status.success(),
        "expected a failure; stdout: {}",
        String::from_utf8_lossy(&out.stdout)
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
}
