//! Speculative decoding with the built-in model's MTP head over HTTP: with `--speculative-config`
//! (K = 1 and 2) the server answers concurrent greedy and seeded requests, a forced tool call
//! streamed, and the same prompts again from the prefix cache, exactly as without it (text, token
//! log-probabilities, usage, the streamed deltas); prefill runs in small chunks; a tiny K/V budget
//! preempts and still gives the same text; the spec-decode counters move.

mod server_support;

use serde_json::{json, Value};
use server_support::{chat, ServerProc};

const PATH: &str = "/v1/chat/completions";

fn spec(k: usize) -> String {
    format!(r#"{{"method": "mtp", "num_speculative_tokens": {k}}}"#)
}

/// What a request's answer must keep: its text (or tool calls), token log-probabilities and usage.
fn answer(v: &Value) -> Value {
    let c = &v["choices"][0];
    json!({
        "content": c["message"]["content"],
        "tool_calls": c["message"]["tool_calls"],
        "finish_reason": c["finish_reason"],
        "logprobs": c["logprobs"]["content"].as_array().map(|a| a.iter().map(|t| json!([t["token"], t["logprob"]])).collect::<Vec<_>>()),
        "usage": [v["usage"]["prompt_tokens"], v["usage"]["completion_tokens"]],
    })
}

/// The requests: four greedy chats with log-probabilities and one seeded sampled chat, all at
/// once; each answer as [`answer`] gives it.
fn concurrent(s: &ServerProc) -> Vec<Value> {
    let bodies: Vec<Value> = (0..4)
        .map(|i| {
            chat(
                &format!("Request {i}: tell me a story about the number {}.", i * 17),
                json!({"max_tokens": 24, "temperature": 0, "ignore_eos": true, "logprobs": true}),
            )
        })
        .chain(std::iter::once(chat(
            "Sample something.",
            json!({"max_tokens": 24, "temperature": 1.0, "top_p": 0.9, "seed": 11,
                   "presence_penalty": 0.5, "ignore_eos": true}),
        )))
        .collect();
    std::thread::scope(|scope| {
        let hs: Vec<_> = bodies
            .iter()
            .map(|b| {
                scope.spawn(move || {
                    let (status, v) = s.post(PATH, b);
                    assert_eq!(status, 200, "{v}");
                    answer(&v)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    })
}

/// A forced tool call, streamed: the content of every chunk's delta.
fn tool_call_deltas(s: &ServerProc) -> Vec<Value> {
    let tools = json!([{"type": "function", "function": {"name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"},
        "days": {"type": "integer"}}, "required": ["city", "days"]}}}]);
    let body = chat(
        "What's the weather in Paris?",
        json!({"max_tokens": 64, "temperature": 0, "stream": true, "tools": tools,
               "tool_choice": "required"}),
    );
    deltas(s, &body)
}

/// A streamed chat completion: each chunk's delta (tool call ids removed: they are per response)
/// and finish reason.
fn deltas(s: &ServerProc, body: &Value) -> Vec<Value> {
    let sse = s.stream(PATH, body);
    assert!(sse.done);
    sse.chunks()
        .map(|c| {
            let mut d = c["choices"][0]["delta"].clone();
            if let Some(calls) = d["tool_calls"].as_array_mut() {
                for call in calls {
                    call.as_object_mut().unwrap().remove("id");
                }
            }
            json!([d, c["choices"][0]["finish_reason"]])
        })
        .collect()
}

/// Everything [`concurrent`] and [`tool_call_deltas`] give, twice (the second round hits the
/// prefix cache), with the server's spec-decode counters.
fn run(args: &[&str]) -> (Vec<Value>, f64, f64) {
    let s = ServerProc::start(args);
    let mut out = concurrent(&s);
    out.push(json!(tool_call_deltas(&s)));
    let hits = s.metric("sanmai:prefix_cache_hits_total");
    out.extend(concurrent(&s));
    assert!(
        s.metric("sanmai:prefix_cache_hits_total") > hits,
        "the second round hits"
    );
    out.push(json!(tool_call_deltas(&s)));
    let drafts = metric_or_zero(&s, "sanmai:spec_decode_num_draft_tokens_total");
    let accepted = metric_or_zero(&s, "sanmai:spec_decode_num_accepted_tokens_total");
    (out, drafts, accepted)
}

/// Equal answers: the same text, tokens, tool calls and usage, and log-probabilities within
/// 1e-4 (a verify step computes a row among several, in another order than a decode step alone).
fn assert_same(got: &Value, want: &Value, what: &str) {
    match (got, want) {
        (Value::Number(a), Value::Number(b)) => {
            let (a, b) = (a.as_f64().unwrap(), b.as_f64().unwrap());
            assert!((a - b).abs() <= 1e-4, "{what}: {a} vs {b}");
        }
        (Value::Array(a), Value::Array(b)) => {
            assert_eq!(a.len(), b.len(), "{what}: {got} vs {want}");
            for (x, y) in a.iter().zip(b) {
                assert_same(x, y, what);
            }
        }
        (Value::Object(a), Value::Object(b)) => {
            assert_eq!(a.len(), b.len(), "{what}: {got} vs {want}");
            for (k, x) in a {
                assert_same(x, &b[k], &format!("{what}.{k}"));
            }
        }
        _ => assert_eq!(got, want, "{what}"),
    }
}

fn metric_or_zero(s: &ServerProc, name: &str) -> f64 {
    let (_, text) = s.get("/metrics");
    server_support::metric_in(&text, name).unwrap_or(0.0)
}

#[test]
fn answers_with_mtp_drafts_equal_those_without() {
    let chunked = ["--max-num-batched-tokens", "32"];
    let (want, drafts, _) = run(&chunked);
    assert_eq!(drafts, 0.0, "no drafts without --speculative-config");
    for k in [1, 2] {
        let json = spec(k);
        let args = [&chunked[..], &["--speculative-config", &json]].concat();
        let (got, drafts, accepted) = run(&args);
        assert!(drafts > 0.0, "K = {k}: the head drafted");
        assert!(accepted <= drafts);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert_same(g, w, &format!("K = {k}: answer {i}"));
        }
    }
}

#[test]
fn preemption_with_drafts_keeps_outputs() {
    let json = spec(2);
    let s = ServerProc::start(&[
        "--max-model-len",
        "256",
        // 18 blocks of 16 tokens (the MTP layer's K/V included): one 224-token request fits, two
        // do not.
        "--kv-cache-memory-bytes",
        "300000",
        "--speculative-config",
        &json,
    ]);
    server_support::preempted_outputs_equal_solo_ones(&s);
}

#[test]
fn a_bad_speculative_config_names_the_key() {
    for (json, want) in [
        (r#"{"method": "eagle"}"#, "`method`"),
        (
            r#"{"method": "mtp", "num_speculative_tokens": 0}"#,
            "`num_speculative_tokens`",
        ),
        (r#"{"method": "mtp", "k": 2}"#, "unknown key `k`"),
        ("not json", "not JSON"),
    ] {
        let err = server_support::stderr(&server_support::sanmai(&[
            "generate",
            "--speculative-config",
            json,
            "--prompt",
            "hi",
        ]));
        assert!(
            err.contains("--speculative-config") && err.contains(want),
            "{json}: {err}"
        );
    }
}

/// Forced tool calls (`tool_choice: "required"`), two at a time, streamed, on two pipeline stages
/// with drafting on: every answer is a call of a given tool whose arguments parse, and the streamed
/// deltas are those of one stage without drafts.
#[test]
fn forced_tool_calls_on_two_stages_with_drafts_are_valid_and_unchanged() {
    let tools = json!([
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object",
            "properties": {"city": {"type": "string", "maxLength": 8},
                "days": {"type": "integer", "minimum": 1, "maximum": 9}},
            "required": ["city", "days"], "additionalProperties": false}}},
        {"type": "function", "function": {"name": "search", "parameters": {"type": "object",
            "properties": {"query": {"type": "string", "maxLength": 10}}, "required": ["query"],
            "additionalProperties": false}}}
    ]);
    let body = |i: usize| {
        chat(
            &format!("Question {i}: what should I look up?"),
            // Penalties keep the random model from repeating one character to the end.
            json!({"max_tokens": 200, "temperature": 1.0, "seed": 40 + i, "stream": true,
                   "frequency_penalty": 1.0, "presence_penalty": 1.0,
                   "tools": tools, "tool_choice": "required"}),
        )
    };
    let run = |s: &ServerProc| -> Vec<Vec<Value>> {
        let mut all = Vec::new();
        for pair in 0..4 {
            let got: Vec<Vec<Value>> = std::thread::scope(|scope| {
                let hs: Vec<_> = (0..2)
                    .map(|j| {
                        let b = body(pair * 2 + j);
                        scope.spawn(move || deltas(s, &b))
                    })
                    .collect();
                hs.into_iter().map(|h| h.join().unwrap()).collect()
            });
            all.extend(got);
        }
        all
    };
    let want = run(&ServerProc::start(&[]));
    let json = spec(2);
    let two = ServerProc::start(&[
        "--pipeline-parallel-size",
        "2",
        "--speculative-config",
        &json,
    ]);
    let got = run(&two);
    // The random head's drafts are rarely legal under the tool-call grammar, which cuts them before
    // they are verified (`crates/engine/tests/mtp.rs` verifies grammar-masked drafts with forced ones).
    for (i, (g, w)) in got.iter().zip(&want).enumerate() {
        assert_eq!(g, w, "request {i}'s streamed deltas");
        // The call: a name from the tools and arguments that parse as a JSON object.
        let (mut name, mut args) = (String::new(), String::new());
        for d in g {
            for call in d[0]["tool_calls"].as_array().into_iter().flatten() {
                name.push_str(call["function"]["name"].as_str().unwrap_or(""));
                args.push_str(call["function"]["arguments"].as_str().unwrap_or(""));
            }
        }
        assert!(
            ["get_weather", "search"].contains(&name.as_str()),
            "request {i}: {name}: {g:?}"
        );
        let v: Value = serde_json::from_str(&args).unwrap_or_else(|e| panic!("{args}: {e}"));
        assert!(v.is_object(), "request {i}: {args}");
        let last = g.last().unwrap();
        assert_eq!(last[1], "tool_calls", "request {i}");
    }
}
