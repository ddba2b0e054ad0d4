//! `sanmai bench serve`: a load generator for a running OpenAI-compatible server, as `vllm bench serve`.
//!
//! It sends `--num-prompts` streamed requests of random-word prompts of `--prompt-len` tokens, each asking
//! for exactly `--gen-len` tokens (`ignore_eos`), with at most `--concurrency` in flight (and, with
//! `--request-rate`, Poisson arrivals at that rate), then prints request and token throughput and the
//! percentiles of time to first token, time per output token, inter-token latency and end-to-end latency.
//! It prints numbers and never judges them.
//!
//! Prompts have exact lengths where the server has vLLM's `/tokenize`: random words are tokenized there and
//! the ids cut to length, then sent as token-id prompts to `/v1/completions` (or, with `--endpoint chat`,
//! the words as one user message, whose chat template adds a few tokens); a model served without a
//! tokenizer gets random token ids of exact length. Without `/tokenize`, prompts are
//! text of about one token per word. The lengths the server counted are printed either way.
//!
//! Where the server answers `GET /metrics` in the Prometheus format, it is scraped just before and just
//! after the timed run, and what the server counted in between is printed ([`server_metrics`]): prompt
//! and generation tokens, the prefix-cache hit rate, preemptions, and with pipeline stages a table of
//! each stage's busy and idle seconds and the pipeline overlap (1 when the stages compute in turn, N
//! when N stages are busy at once).
//!
//! [`server_metrics`]: crate::server_metrics

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Context, Result};
use clap::{Args, Subcommand};
use serde_json::{json, Value};
use tokio::sync::Semaphore;

use crate::bench::BenchArgs;
pub use crate::bench_prompts::Endpoint;
use crate::bench_prompts::{
    make_prompt, prompt_words, request_body, Prompt, PromptSpec, Rng, Tokenized,
};
use crate::prometheus;
use crate::server_metrics::{RunCounters, Scrape};

/// `sanmai bench`: the local model benchmark, or `sanmai bench serve` against a server.
#[derive(Args, Debug)]
#[command(args_conflicts_with_subcommands = true, subcommand_negates_reqs = true)]
pub struct BenchCommand {
    #[command(subcommand)]
    pub command: Option<BenchSub>,
    #[command(flatten)]
    pub local: BenchArgs,
}

#[derive(Subcommand, Debug)]
pub enum BenchSub {
    /// Load a running OpenAI-compatible server and print throughput and latency percentiles.
    Serve(BenchServeArgs),
}

#[derive(Args, Debug, Clone)]
pub struct BenchServeArgs {
    /// The server's base URL, e.g. http://127.0.0.1:8000 (a trailing /v1 is accepted).
    #[arg(long)]
    pub url: String,
    /// The model name to send [default: the first one the server lists].
    #[arg(long)]
    pub model: Option<String>,
    /// Requests in flight at most.
    #[arg(long, default_value_t = 1)]
    pub concurrency: usize,
    /// Requests to send.
    #[arg(long, default_value_t = 32)]
    pub num_prompts: usize,
    /// Prompt length in tokens.
    #[arg(long, default_value_t = 256)]
    pub prompt_len: usize,
    /// Tokens generated per request (sent as `max_tokens` with `ignore_eos`).
    #[arg(long, default_value_t = 64)]
    pub gen_len: usize,
    /// Which API to load.
    #[arg(long, value_enum, default_value_t = Endpoint::Completions)]
    pub endpoint: Endpoint,
    /// Requests per second, arriving as a Poisson process [default: all at once, bounded by
    /// --concurrency].
    #[arg(long)]
    pub request_rate: Option<f64>,
    /// Sampling temperature of the requests.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f64,
    /// Seed of the random prompts and arrival times.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Sent as `Authorization: Bearer KEY`.
    #[arg(long)]
    pub api_key: Option<String>,
    /// Seconds one request may take before it counts as failed.
    #[arg(long, default_value_t = 600)]
    pub request_timeout: u64,
    /// Also write the results as JSON to this file.
    #[arg(long)]
    pub result_json: Option<std::path::PathBuf>,
}

/// What one request measured.
#[derive(Debug, Clone, Default)]
struct Outcome {
    error: Option<String>,
    prompt_tokens: usize,
    output_tokens: usize,
    /// Seconds from sending to the first generated text.
    ttft: f64,
    /// Seconds between consecutive chunks carrying text.
    itl: Vec<f64>,
    /// Seconds from sending to the end of the stream.
    e2e: f64,
}

/// Splits server-sent events out of a byte stream that may cut them anywhere.
#[derive(Default)]
struct SseBuffer {
    buf: Vec<u8>,
}

impl SseBuffer {
    /// Appends bytes and returns the `data:` payloads of the events now complete.
    fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        self.buf.extend_from_slice(bytes);
        let mut out = Vec::new();
        loop {
            let lf = find(&self.buf, b"\n\n").map(|i| (i, 2));
            let crlf = find(&self.buf, b"\r\n\r\n").map(|i| (i, 4));
            let Some((end, sep)) = [lf, crlf].into_iter().flatten().min() else {
                break;
            };
            let event: Vec<u8> = self.buf.drain(..end + sep).collect();
            let text = String::from_utf8_lossy(&event[..end]);
            let data: Vec<&str> = text
                .lines()
                .filter_map(|l| l.strip_prefix("data:"))
                .map(|d| d.strip_prefix(' ').unwrap_or(d))
                .collect();
            if !data.is_empty() {
                out.push(data.join("\n"));
            }
        }
        out
    }
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

/// The text a streamed chunk carries (content, reasoning or tool-call fragments), for either endpoint,
/// or the tokens of a completion chunk without text (a model served without a tokenizer).
fn chunk_has_text(v: &Value) -> bool {
    let Some(choice) = v.get("choices").and_then(|c| c.get(0)) else {
        return false;
    };
    let nonempty = |x: Option<&Value>| x.and_then(Value::as_str).is_some_and(|s| !s.is_empty());
    if nonempty(choice.get("text")) {
        return true;
    }
    let tokens = choice.pointer("/logprobs/tokens").and_then(Value::as_array);
    if tokens.is_some_and(|t| !t.is_empty()) {
        return true;
    }
    let Some(delta) = choice.get("delta") else {
        return false;
    };
    nonempty(delta.get("content"))
        || nonempty(delta.get("reasoning_content"))
        || delta
            .get("tool_calls")
            .and_then(Value::as_array)
            .is_some_and(|a| !a.is_empty())
}

/// The `p`-th percentile (0..=100) of sorted values, interpolated linearly as numpy does.
fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let rank = p / 100.0 * (sorted.len() - 1) as f64;
    let lo = rank.floor() as usize;
    let hi = rank.ceil() as usize;
    sorted[lo] + (sorted[hi] - sorted[lo]) * (rank - lo as f64)
}

/// Mean, median, p90 and p99 of `values`, in milliseconds.
#[derive(Debug, Clone, Copy)]
struct Summary {
    mean: f64,
    p50: f64,
    p90: f64,
    p99: f64,
}

impl Summary {
    fn of_seconds(values: &[f64]) -> Summary {
        let mut v: Vec<f64> = values.iter().map(|s| s * 1e3).collect();
        v.sort_by(|a, b| a.total_cmp(b));
        let mean = if v.is_empty() {
            f64::NAN
        } else {
            v.iter().sum::<f64>() / v.len() as f64
        };
        Summary {
            mean,
            p50: percentile(&v, 50.0),
            p90: percentile(&v, 90.0),
            p99: percentile(&v, 99.0),
        }
    }

    fn json(&self) -> Value {
        json!({"mean_ms": self.mean, "p50_ms": self.p50, "p90_ms": self.p90, "p99_ms": self.p99})
    }
}

/// The server's base URL without a trailing `/` or `/v1`.
fn base_url(url: &str) -> String {
    let u = url.trim_end_matches('/');
    u.strip_suffix("/v1").unwrap_or(u).to_string()
}

/// The run's prompts (one more than `--num-prompts`: the last warms the server) and whether their
/// lengths are exact.
async fn make_prompts(
    t: &Target,
    spec: &PromptSpec,
    args: &BenchServeArgs,
    model: &str,
) -> Result<(Vec<Prompt>, bool)> {
    let mut rng = Rng(args.seed);
    let mut prompts = Vec::with_capacity(args.num_prompts + 1);
    let mut exact = true;
    for _ in 0..args.num_prompts + 1 {
        let text = prompt_words(spec, &mut rng);
        let tokenized = t.tokenize(model, &text).await?;
        prompts.push(make_prompt(spec, &mut rng, text, tokenized, &mut exact)?);
    }
    Ok((prompts, exact))
}

pub(crate) struct Target {
    client: reqwest::Client,
    base: String,
    api_key: Option<String>,
}

impl Target {
    fn post(&self, path: &str, body: &Value) -> reqwest::RequestBuilder {
        let mut req = self
            .client
            .post(format!("{}{path}", self.base))
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(body.to_string());
        if let Some(k) = &self.api_key {
            req = req.bearer_auth(k);
        }
        req
    }

    async fn get_json(&self, path: &str) -> Result<Value> {
        let mut req = self.client.get(format!("{}{path}", self.base));
        if let Some(k) = &self.api_key {
            req = req.bearer_auth(k);
        }
        let resp = req.send().await.with_context(|| format!("GET {path}"))?;
        let status = resp.status();
        let text = resp.text().await?;
        if !status.is_success() {
            bail!("GET {path}: {status}: {text}");
        }
        Ok(serde_json::from_str(&text)?)
    }

    /// The samples of `GET /metrics`, or `None` when the server has no such route (a note says why
    /// when it answers something that is not Prometheus text).
    async fn scrape(&self) -> Option<Scrape> {
        let mut req = self
            .client
            .get(format!("{}/metrics", self.base))
            .timeout(Duration::from_secs(30));
        if let Some(k) = &self.api_key {
            req = req.bearer_auth(k);
        }
        let sent = Instant::now();
        let resp = req.send().await.ok()?;
        if !resp.status().is_success() {
            return None;
        }
        let text = resp.text().await.ok()?;
        let at = sent + sent.elapsed() / 2;
        match prometheus::parse(&text) {
            Ok(samples) => Some(Scrape { at, samples }),
            Err(e) => {
                eprintln!("bench serve: the server's /metrics is left out: {e:#}");
                None
            }
        }
    }

    /// Token ids of `text` from `/tokenize`.
    pub(crate) async fn tokenize(&self, model: &str, text: &str) -> Result<Tokenized> {
        let body = json!({"model": model, "prompt": text, "add_special_tokens": false});
        let resp = self.post("/tokenize", &body).send().await?;
        if resp.status() == reqwest::StatusCode::NOT_FOUND {
            return Ok(Tokenized::NoRoute);
        }
        let status = resp.status();
        let text = resp.text().await?;
        if status == reqwest::StatusCode::BAD_REQUEST && text.contains("without a tokenizer") {
            return Ok(Tokenized::NoTokenizer);
        }
        if !status.is_success() {
            bail!("POST /tokenize: {status}: {text}");
        }
        let v: Value = serde_json::from_str(&text)?;
        let ids = v["tokens"]
            .as_array()
            .ok_or_else(|| anyhow!("/tokenize answered without `tokens`: {text}"))?
            .iter()
            .map(|t| t.as_u64().map(|t| t as u32))
            .collect::<Option<Vec<u32>>>()
            .ok_or_else(|| anyhow!("/tokenize answered non-integer tokens"))?;
        Ok(Tokenized::Ids(ids))
    }
}

/// Sends one streamed request and times its chunks.
async fn one_request(t: &Target, path: &str, body: Value) -> Outcome {
    let started = Instant::now();
    let mut out = Outcome::default();
    if let Err(e) = stream_request(t, path, body, started, &mut out).await {
        out.error = Some(format!("{e:#}"));
    }
    out.e2e = started.elapsed().as_secs_f64();
    out
}

async fn stream_request(
    t: &Target,
    path: &str,
    body: Value,
    started: Instant,
    out: &mut Outcome,
) -> Result<()> {
    let mut resp = t.post(path, &body).send().await?;
    let status = resp.status();
    if !status.is_success() {
        let text = resp.text().await.unwrap_or_default();
        bail!("{status}: {text}");
    }
    let mut sse = SseBuffer::default();
    let mut last: Option<Instant> = None;
    let mut chunks_with_text = 0;
    let mut done = false;
    while let Some(bytes) = resp.chunk().await? {
        let now = Instant::now();
        for data in sse.push(&bytes) {
            if data.trim() == "[DONE]" {
                done = true;
                continue;
            }
            let v: Value = serde_json::from_str(&data)
                .with_context(|| format!("an unreadable event: {data}"))?;
            if let Some(err) = v.get("error") {
                bail!("error in the stream: {err}");
            }
            if let Some(u) = v.get("usage").filter(|u| !u.is_null()) {
                out.prompt_tokens = u["prompt_tokens"].as_u64().unwrap_or(0) as usize;
                out.output_tokens = u["completion_tokens"].as_u64().unwrap_or(0) as usize;
            }
            if chunk_has_text(&v) {
                chunks_with_text += 1;
                match last {
                    None => out.ttft = (now - started).as_secs_f64(),
                    Some(prev) => out.itl.push((now - prev).as_secs_f64()),
                }
                last = Some(now);
            }
        }
    }
    if !done {
        bail!("the stream ended without `data: [DONE]`");
    }
    if last.is_none() {
        out.ttft = started.elapsed().as_secs_f64();
    }
    if out.output_tokens == 0 {
        out.output_tokens = chunks_with_text;
    }
    Ok(())
}

pub fn run(args: BenchServeArgs) -> Result<()> {
    if args.concurrency == 0 || args.num_prompts == 0 || args.prompt_len == 0 || args.gen_len == 0 {
        bail!("--concurrency, --num-prompts, --prompt-len and --gen-len must be positive");
    }
    if let Some(r) = args.request_rate {
        if !(r > 0.0 && r.is_finite()) {
            bail!("--request-rate must be a positive number of requests per second, got {r}");
        }
    }
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?
        .block_on(run_async(args))
}

async fn run_async(args: BenchServeArgs) -> Result<()> {
    let client = reqwest::Client::builder()
        .timeout(Duration::from_secs(args.request_timeout))
        .pool_max_idle_per_host(args.concurrency)
        .build()?;
    let t = Arc::new(Target {
        client,
        base: base_url(&args.url),
        api_key: args.api_key.clone(),
    });
    let listed = t.get_json("/v1/models").await?;
    let ids: Vec<&str> = listed["data"]
        .as_array()
        .map(|a| a.iter().filter_map(|m| m["id"].as_str()).collect())
        .unwrap_or_default();
    let model = match &args.model {
        Some(m) if ids.contains(&m.as_str()) => m.clone(),
        Some(m) => bail!("the server does not list the model {m:?}; it lists {ids:?}"),
        None => ids
            .first()
            .ok_or_else(|| anyhow!("/v1/models lists no model: {listed}"))?
            .to_string(),
    };
    let path = args.endpoint.path();
    let spec = PromptSpec {
        endpoint: args.endpoint,
        prompt_len: args.prompt_len,
        gen_len: args.gen_len,
        temperature: args.temperature,
    };
    let (mut prompts, exact) = make_prompts(&t, &spec, &args, &model).await?;
    println!(
        "bench serve: {} {path}, model {model}, {} prompts of {} tokens{}, {} generated tokens each, \
         concurrency {}, request rate {}",
        t.base,
        args.num_prompts,
        args.prompt_len,
        if exact { "" } else { " (about: the server has no /tokenize)" },
        args.gen_len,
        args.concurrency,
        args.request_rate
            .map_or("unbounded".to_string(), |r| format!("{r}/s")),
    );

    // One request first, outside the measurement: it checks the setup and warms the server.
    let warm = prompts.pop().ok_or_else(|| anyhow!("no prompt was made"))?;
    let w = one_request(&t, path, request_body(&spec, &model, &warm)).await;
    if let Some(e) = w.error {
        bail!("the first test request failed: {e}");
    }

    let before = t.scrape().await;
    let sem = Arc::new(Semaphore::new(args.concurrency));
    let mut rng = Rng(args.seed ^ 0x5eed);
    let started = Instant::now();
    let mut tasks = Vec::with_capacity(prompts.len());
    let mut next_arrival = 0.0f64;
    for prompt in &prompts {
        if let Some(rate) = args.request_rate {
            // Exponential gaps: a Poisson process of `rate` requests per second.
            next_arrival += -(1.0 - rng.unit()).ln() / rate;
            let at = started + Duration::from_secs_f64(next_arrival);
            tokio::time::sleep_until(at.into()).await;
        }
        let permit = sem.clone().acquire_owned().await?;
        let t = t.clone();
        let body = request_body(&spec, &model, prompt);
        tasks.push(tokio::spawn(async move {
            let o = one_request(&t, path, body).await;
            drop(permit);
            o
        }));
    }
    let mut outcomes = Vec::with_capacity(tasks.len());
    for task in tasks {
        outcomes.push(task.await?);
    }
    let duration = started.elapsed().as_secs_f64();
    let counted = match before {
        Some(before) => t.scrape().await.map(|after| {
            let window = after.at.duration_since(before.at).as_secs_f64();
            RunCounters::between(&before.samples, &after.samples, window)
        }),
        None => None,
    };
    report(&args, &outcomes, duration, counted.as_ref())
}

fn report(
    args: &BenchServeArgs,
    outcomes: &[Outcome],
    duration: f64,
    counted: Option<&RunCounters>,
) -> Result<()> {
    let ok: Vec<&Outcome> = outcomes.iter().filter(|o| o.error.is_none()).collect();
    let failed: Vec<&Outcome> = outcomes.iter().filter(|o| o.error.is_some()).collect();
    let input: usize = ok.iter().map(|o| o.prompt_tokens).sum();
    let output: usize = ok.iter().map(|o| o.output_tokens).sum();
    let ttft = Summary::of_seconds(&ok.iter().map(|o| o.ttft).collect::<Vec<_>>());
    let tpot = Summary::of_seconds(
        &ok.iter()
            .filter(|o| o.output_tokens > 1)
            .map(|o| (o.e2e - o.ttft) / (o.output_tokens - 1) as f64)
            .collect::<Vec<_>>(),
    );
    let itl = Summary::of_seconds(
        &ok.iter()
            .flat_map(|o| o.itl.iter().copied())
            .collect::<Vec<_>>(),
    );
    let e2e = Summary::of_seconds(&ok.iter().map(|o| o.e2e).collect::<Vec<_>>());
    let line = |name: &str, value: String| println!("{name:<40}{value:>12}");
    println!("{:=^52}", " Serving Benchmark Result ");
    line("Successful requests:", ok.len().to_string());
    line("Failed requests:", failed.len().to_string());
    line("Maximum request concurrency:", args.concurrency.to_string());
    line("Benchmark duration (s):", format!("{duration:.2}"));
    line("Total input tokens:", input.to_string());
    line("Total generated tokens:", output.to_string());
    line(
        "Request throughput (req/s):",
        format!("{:.2}", ok.len() as f64 / duration),
    );
    line(
        "Output token throughput (tok/s):",
        format!("{:.2}", output as f64 / duration),
    );
    line(
        "Total token throughput (tok/s):",
        format!("{:.2}", (input + output) as f64 / duration),
    );
    for (title, short, s) in [
        ("Time to First Token", "TTFT", ttft),
        ("Time per Output Token (excl. 1st token)", "TPOT", tpot),
        ("Inter-token Latency", "ITL", itl),
        ("End-to-end Latency", "E2EL", e2e),
    ] {
        println!("{:-^52}", title);
        line(&format!("Mean {short} (ms):"), format!("{:.2}", s.mean));
        line(&format!("Median {short} (ms):"), format!("{:.2}", s.p50));
        line(&format!("P90 {short} (ms):"), format!("{:.2}", s.p90));
        line(&format!("P99 {short} (ms):"), format!("{:.2}", s.p99));
    }
    if let Some(c) = counted {
        c.print(&line);
    }
    println!("{:=^52}", "");
    if let Some(first) = failed.first() {
        println!(
            "first failure: {}",
            first.error.as_deref().unwrap_or_default()
        );
    }
    if let Some(path) = &args.result_json {
        let mut v = json!({
            "url": args.url, "endpoint": format!("{:?}", args.endpoint).to_lowercase(),
            "concurrency": args.concurrency, "request_rate": args.request_rate,
            "num_prompts": args.num_prompts, "prompt_len": args.prompt_len, "gen_len": args.gen_len,
            "completed": ok.len(), "failed": failed.len(), "duration_s": duration,
            "total_input_tokens": input, "total_output_tokens": output,
            "request_throughput": ok.len() as f64 / duration,
            "output_throughput": output as f64 / duration,
            "total_token_throughput": (input + output) as f64 / duration,
            "ttft": ttft.json(), "tpot": tpot.json(), "itl": itl.json(), "e2el": e2e.json(),
            "server_counters": null, "pp_stages": [], "pp_overlap": null,
        });
        if let (Some(c), Some(obj)) = (counted, v.as_object_mut()) {
            if let Value::Object(fields) = c.json() {
                obj.extend(fields);
            }
        }
        std::fs::write(path, serde_json::to_string_pretty(&v)? + "\n")
            .with_context(|| format!("writing {}", path.display()))?;
    }
    if ok.is_empty() {
        bail!("every request failed");
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_events_split_anywhere() {
        let stream = b"data: {\"a\":1}\n\ndata: {\"b\":2}\r\n\r\n: comment\n\ndata: [DONE]\n\n";
        // Every cut point gives the same events.
        for cut in 0..stream.len() {
            let mut sse = SseBuffer::default();
            let mut got = sse.push(&stream[..cut]);
            got.extend(sse.push(&stream[cut..]));
            assert_eq!(
                got,
                vec!["{\"a\":1}", "{\"b\":2}", "[DONE]"],
                "cut at {cut}"
            );
        }
        // Byte by byte, and an unfinished event stays buffered.
        let mut sse = SseBuffer::default();
        let got: Vec<String> = stream[..stream.len() - 1]
            .iter()
            .flat_map(|b| sse.push(std::slice::from_ref(b)))
            .collect();
        assert_eq!(got, vec!["{\"a\":1}", "{\"b\":2}"]);
        assert_eq!(sse.push(b"\n"), vec!["[DONE]"]);
    }

    #[test]
    fn percentiles_interpolate_as_numpy() {
        let v = [1.0, 2.0, 3.0, 4.0, 5.0];
        assert_eq!(percentile(&v, 50.0), 3.0);
        assert_eq!(percentile(&v, 0.0), 1.0);
        assert_eq!(percentile(&v, 100.0), 5.0);
        assert!((percentile(&v, 90.0) - 4.6).abs() < 1e-12);
        assert!((percentile(&[10.0, 20.0], 99.0) - 19.9).abs() < 1e-12);
        assert!(percentile(&[], 50.0).is_nan());
        let s = Summary::of_seconds(&[0.003, 0.001, 0.002]);
        assert!((s.mean - 2.0).abs() < 1e-9 && (s.p50 - 2.0).abs() < 1e-9);
    }

    #[test]
    fn chunks_with_text_of_both_endpoints() {
        assert!(chunk_has_text(&json!({"choices": [{"text": "a"}]})));
        assert!(!chunk_has_text(
            &json!({"choices": [{"text": "", "finish_reason": "length"}]})
        ));
        assert!(chunk_has_text(
            &json!({"choices": [{"delta": {"content": "x"}}]})
        ));
        assert!(chunk_has_text(
            &json!({"choices": [{"delta": {"reasoning_content": "x"}}]})
        ));
        assert!(chunk_has_text(
            &json!({"choices": [{"delta": {"tool_calls": [{"index": 0}]}}]})
        ));
        assert!(!chunk_has_text(
            &json!({"choices": [{"delta": {"role": "assistant"}}]})
        ));
        assert!(!chunk_has_text(
            &json!({"choices": [], "usage": {"prompt_tokens": 1}})
        ));
    }

    #[test]
    fn urls() {
        assert_eq!(base_url("http://h:1/v1/"), "http://h:1");
        assert_eq!(base_url("http://h:1"), "http://h:1");
    }
}
