//! `sanmai serve` under load and at its edges: `/metrics` counters that move, concurrent requests,
//! a client that disconnects mid-stream (its request is freed), graceful shutdown on SIGTERM, prefix-cache
//! hits that give the same log-probabilities as computing, and preemption that leaves outputs unchanged.

mod server_support;

use std::time::Duration;

use serde_json::json;
use server_support::{chat, completion, eventually, ServerProc};

#[test]
fn metrics_count_tokens_and_requests() {
    let s = ServerProc::start(&[]);
    let prompt0 = s.metric("sanmai:prompt_tokens_total");
    let gen0 = s.metric("sanmai:generation_tokens_total");
    let done0 = s.metric("sanmai:request_success_total");
    let ttft0 = s.metric("sanmai:time_to_first_token_seconds_count");
    let e2e0 = s.metric("sanmai:e2e_request_latency_seconds_count");
    let (status, v) = s.post(
        "/v1/chat/completions",
        &chat(
            "Tell me about metrics.",
            json!({"max_tokens": 7, "ignore_eos": true}),
        ),
    );
    assert_eq!(status, 200, "{v}");
    let prompt_tokens = v["usage"]["prompt_tokens"].as_f64().unwrap();
    assert_eq!(
        s.metric("sanmai:prompt_tokens_total") - prompt0,
        prompt_tokens
    );
    assert_eq!(s.metric("sanmai:generation_tokens_total") - gen0, 7.0);
    assert_eq!(s.metric("sanmai:request_success_total") - done0, 1.0);
    assert_eq!(
        s.metric("sanmai:time_to_first_token_seconds_count") - ttft0,
        1.0
    );
    assert_eq!(
        s.metric("sanmai:e2e_request_latency_seconds_count") - e2e0,
        1.0
    );
    assert_eq!(s.metric("sanmai:num_requests_running"), 0.0);
    assert_eq!(s.metric("sanmai:num_requests_waiting"), 0.0);
    // The same prompt again queries the prefix cache.
    let q0 = s.metric("sanmai:prefix_cache_queries_total");
    let (status, _) = s.post(
        "/v1/chat/completions",
        &chat("Tell me about metrics.", json!({"max_tokens": 1})),
    );
    assert_eq!(status, 200);
    assert!(s.metric("sanmai:prefix_cache_queries_total") > q0);
}

#[test]
fn concurrent_requests_all_complete() {
    let s = ServerProc::start(&[]);
    let s = &s;
    std::thread::scope(|scope| {
        let handles: Vec<_> = (0..8)
            .map(|i| {
                scope.spawn(move || {
                    let max = 4 + i as u64;
                    if i % 2 == 0 {
                        let body = chat(
                            &format!("Request number {i}"),
                            json!({"max_tokens": max, "ignore_eos": true, "stream": true, "stream_options": {"include_usage": true}}),
                        );
                        let sse = s.stream("/v1/chat/completions", &body);
                        assert!(sse.done);
                        assert_eq!(sse.events.last().unwrap()["usage"]["completion_tokens"], max);
                    } else {
                        let (status, v) = s.post(
                            "/v1/completions",
                            &completion(json!(format!("Prompt {i}")), json!({"max_tokens": max, "ignore_eos": true})),
                        );
                        assert_eq!(status, 200, "{v}");
                        assert_eq!(v["usage"]["completion_tokens"], max);
                    }
                })
            })
            .collect();
        for h in handles {
            h.join().unwrap();
        }
    });
    assert_eq!(s.metric("sanmai:num_requests_running"), 0.0);
}

#[test]
fn a_client_that_disconnects_frees_its_request() {
    let s = ServerProc::start(&[]);
    let body = chat(
        "Go on forever.",
        json!({"max_tokens": 100000, "ignore_eos": true, "stream": true}),
    );
    let mut reader = s.open_stream("/v1/chat/completions", &body);
    // The role chunk, then generated text.
    for _ in 0..3 {
        assert!(reader.next_data().is_some());
    }
    assert_eq!(s.metric("sanmai:num_requests_running"), 1.0);
    let gen_before = s.metric("sanmai:generation_tokens_total");
    drop(reader);
    assert!(
        eventually(Duration::from_secs(20), || s
            .metric("sanmai:num_requests_running")
            == 0.0),
        "the request kept running after its client left"
    );
    // And generation has stopped.
    let gen_after = s.metric("sanmai:generation_tokens_total");
    std::thread::sleep(Duration::from_millis(300));
    assert_eq!(s.metric("sanmai:generation_tokens_total"), gen_after);
    assert!(gen_after >= gen_before);
    // A client of a whole (non-streamed) answer that gives up frees its request too.
    let long = completion(
        json!("Go on forever."),
        json!({"max_tokens": 100000, "ignore_eos": true}),
    );
    let sent = s
        .client()
        .post(s.url("/v1/completions"))
        .json(&long)
        .timeout(Duration::from_millis(800))
        .send();
    assert!(sent.is_err(), "the answer cannot be done in time");
    assert!(
        eventually(Duration::from_secs(20), || s
            .metric("sanmai:num_requests_running")
            == 0.0),
        "the whole-answer request kept running after its client left"
    );
    // The server still serves.
    let (status, _) = s.post(
        "/v1/completions",
        &completion(json!("still there?"), json!({"max_tokens": 2})),
    );
    assert_eq!(status, 200);
}

#[test]
fn sigterm_ends_streams_cleanly_and_exits() {
    let mut s = ServerProc::start(&[]);
    let body = chat(
        "Keep talking.",
        json!({"max_tokens": 100000, "ignore_eos": true, "stream": true}),
    );
    let mut reader = s.open_stream("/v1/chat/completions", &body);
    for _ in 0..3 {
        assert!(reader.next_data().is_some());
    }
    let code = s.terminate(Duration::from_secs(20));
    assert_eq!(code, Some(0), "exit code after SIGTERM\n{}", s.log());
    // The stream got a final chunk (finish_reason "abort") and [DONE].
    let rest = reader.rest();
    assert!(rest.contains("\"finish_reason\":\"abort\""), "{rest}");
    assert!(rest.trim_end().ends_with("data: [DONE]"), "{rest}");
}

/// The top log-probabilities of the one token a completion generates.
fn first_token_logprobs(s: &ServerProc, prompt: &str) -> (serde_json::Value, u64) {
    let (status, v) = s.post(
        "/v1/completions",
        &completion(
            json!(prompt),
            json!({"max_tokens": 1, "temperature": 0, "logprobs": 5}),
        ),
    );
    assert_eq!(status, 200, "{v}");
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    (
        v["choices"][0]["logprobs"]["top_logprobs"][0].clone(),
        cached,
    )
}

#[test]
fn prefix_cache_hits_are_counted_and_change_nothing() {
    // An agent-shaped conversation: each turn's prompt extends the previous one.
    let first = "word ".repeat(60);
    let second = format!("{first} and then more words follow");
    let cached = ServerProc::start(&[]);
    let hits0 = cached.metric("sanmai:prefix_cache_hits_total");
    let (_, c0) = first_token_logprobs(&cached, &first);
    assert_eq!(c0, 0);
    let (with_cache, c1) = first_token_logprobs(&cached, &second);
    assert!(
        c1 >= 48,
        "the first turn's prompt was not reused: {c1} cached tokens"
    );
    assert!(cached.metric("sanmai:prefix_cache_hits_total") - hits0 >= c1 as f64);
    drop(cached);

    let fresh = ServerProc::start(&["--no-enable-prefix-caching"]);
    first_token_logprobs(&fresh, &first);
    let (without, c2) = first_token_logprobs(&fresh, &second);
    assert_eq!(c2, 0);
    let a = with_cache.as_object().unwrap();
    let b = without.as_object().unwrap();
    assert_eq!(a.keys().collect::<Vec<_>>(), b.keys().collect::<Vec<_>>());
    for (k, v) in a {
        let d = (v.as_f64().unwrap() - b[k].as_f64().unwrap()).abs();
        assert!(d < 1e-4, "{k:?}: cached {v} vs computed {}", b[k]);
    }
}

#[test]
fn preemption_under_a_tiny_block_budget_keeps_outputs() {
    // 22 blocks of 16 tokens: one 256-token request fits, two long ones do not.
    let s = ServerProc::start(&[
        "--max-model-len",
        "256",
        "--kv-cache-memory-bytes",
        "200000",
    ]);
    server_support::preempted_outputs_equal_solo_ones(&s);
}

/// A short chat's second turn reuses the first turn's conversation history from the prefix cache, although
/// the template renders the first reply differently in the history than in the generation prompt.
#[test]
fn a_short_second_turn_resumes_from_the_history() {
    let s = ServerProc::start(&[]);
    let first = json!([
        {"role": "system", "content": "Be terse."},
        {"role": "user", "content": "Name three primes."}
    ]);
    let (status, v) = s.post(
        "/v1/chat/completions",
        &json!({"messages": first, "max_tokens": 8, "temperature": 0}),
    );
    assert_eq!(status, 200, "{v}");
    let reply = v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    let mut second = first.as_array().unwrap().clone();
    second.push(json!({"role": "assistant", "content": reply}));
    second.push(json!({"role": "user", "content": "Two more."}));
    let (status, v) = s.post(
        "/v1/chat/completions",
        &json!({"messages": second, "max_tokens": 8, "temperature": 0}),
    );
    assert_eq!(status, 200, "{v}");
    let cached = v["usage"]["prompt_tokens_details"]["cached_tokens"]
        .as_u64()
        .unwrap();
    let prompt = v["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(
        cached > 10 && cached < prompt,
        "cached {cached} of {prompt}"
    );
}
