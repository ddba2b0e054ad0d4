//! `sanmai serve` over HTTP: the small routes, every error case in OpenAI's error shape, the API key and
//! the body-size limit.

mod server_support;

use serde_json::{json, Value};
use server_support::{chat, completion, error_of, ServerProc};

#[test]
fn small_routes_answer() {
    let s = ServerProc::start(&[]);
    let (status, body) = s.get("/health");
    assert_eq!((status, body.as_str()), (200, ""));
    let (status, v) = s.get_json("/version");
    assert_eq!(status, 200);
    assert_eq!(v["version"], env!("CARGO_PKG_VERSION"));

    let (status, v) = s.get_json("/v1/models");
    assert_eq!(status, 200);
    assert_eq!(v["object"], "list");
    let m = &v["data"][0];
    assert_eq!(m["id"], "sanmai-demo");
    assert_eq!(m["object"], "model");
    assert!(m["max_model_len"].as_u64().unwrap() >= 65_536, "{v}");
    let (status, one) = s.get_json("/v1/models/sanmai-demo");
    assert_eq!(status, 200);
    assert_eq!(one["id"], "sanmai-demo");
    assert_eq!(one["max_model_len"], m["max_model_len"]);

    let (status, text) = s.get("/metrics");
    assert_eq!(status, 200);
    for family in [
        "num_requests_running",
        "num_requests_waiting",
        "kv_cache_usage_perc",
        "prompt_tokens_total",
        "generation_tokens_total",
        "prefix_cache_queries_total",
        "prefix_cache_hits_total",
        "num_preemptions_total",
        "time_to_first_token_seconds",
        "inter_token_latency_seconds",
        "e2e_request_latency_seconds",
    ] {
        assert!(
            text.contains(&format!("# TYPE sanmai:{family} ")),
            "{family}"
        );
    }
}

#[test]
fn tokenize_and_detokenize_round_trip() {
    let s = ServerProc::start(&[]);
    let (status, v) = s.post("/tokenize", &json!({"prompt": "Hello, world! 你好"}));
    assert_eq!(status, 200, "{v}");
    let tokens = v["tokens"].as_array().unwrap().clone();
    assert_eq!(v["count"].as_u64().unwrap() as usize, tokens.len());
    assert!(v["max_model_len"].as_u64().unwrap() >= 65_536);
    let (status, v) = s.post("/detokenize", &json!({"tokens": tokens}));
    assert_eq!(status, 200);
    assert_eq!(v["prompt"], "Hello, world! 你好");

    // Chat messages tokenize to exactly the prompt a chat request counts.
    let messages = json!([{"role": "user", "content": "What is 2+2?"}]);
    let (_, t) = s.post("/tokenize", &json!({"messages": messages}));
    let (status, c) = s.post(
        "/v1/chat/completions",
        &json!({"messages": messages, "max_tokens": 1}),
    );
    assert_eq!(status, 200, "{c}");
    assert_eq!(t["count"], c["usage"]["prompt_tokens"]);
    let (status, v) = s.post(
        "/tokenize",
        &json!({"prompt": "hi there", "return_token_strs": true}),
    );
    assert_eq!(status, 200);
    let strs: Vec<&str> = v["token_strs"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_str().unwrap())
        .collect();
    assert_eq!(strs.concat(), "hi there");

    let (status, v) = s.post("/detokenize", &json!({"tokens": [999_999_999]}));
    assert_eq!(status, 400);
    assert_eq!(error_of(&v)["param"], "tokens");
}

/// Sends `body` to `path` and checks a 400 naming `param` whose message contains `needle`.
fn expect_400(s: &ServerProc, path: &str, body: Value, param: Option<&str>, needle: &str) {
    let (status, v) = s.post(path, &body);
    assert_eq!(status, 400, "{body} → {v}");
    let e = error_of(&v);
    assert_eq!(e["type"], "invalid_request_error");
    if let Some(p) = param {
        assert_eq!(e["param"], p, "{body} → {v}");
    }
    let msg = e["message"].as_str().unwrap();
    assert!(msg.contains(needle), "{body}: {msg:?} lacks {needle:?}");
}

#[test]
fn bad_requests_get_400s_naming_the_field() {
    let s = ServerProc::start(&["--max-model-len", "256"]);
    let c = "/v1/chat/completions";
    let p = "/v1/completions";

    let (status, text) = s.post_raw(c, b"{\"messages\": [".to_vec(), None);
    assert_eq!(status, 400);
    let v: Value = serde_json::from_str(&text).unwrap();
    assert!(error_of(&v)["message"].as_str().unwrap().contains("JSON"));
    let (status, _) = s.post_raw(c, b"[1, 2]".to_vec(), None);
    assert_eq!(status, 400);

    expect_400(
        &s,
        c,
        json!({"model": "sanmai-demo"}),
        Some("messages"),
        "required",
    );
    // Fields of a chat request for "hi", the param the 400 names, and what its message says.
    let chat_cases = [
        (json!({"temperature": -1}), "temperature", "temperature"),
        (json!({"temperature": "warm"}), "temperature", "temperature"),
        (json!({"top_p": 1.5}), "top_p", "top_p"),
        (json!({"top_k": -2}), "top_k", "top_k"),
        (json!({"min_p": 2}), "min_p", "min_p"),
        (
            json!({"presence_penalty": 5}),
            "presence_penalty",
            "presence_penalty",
        ),
        (
            json!({"frequency_penalty": -5}),
            "frequency_penalty",
            "frequency_penalty",
        ),
        (
            json!({"repetition_penalty": 0}),
            "repetition_penalty",
            "repetition_penalty",
        ),
        (json!({"n": 0}), "n", "n must be"),
        (json!({"max_tokens": 0}), "max_tokens", "at least 1"),
        (json!({"logit_bias": {"abc": 3}}), "logit_bias", "token ids"),
        (
            json!({"logit_bias": {"999999999": 3}}),
            "logit_bias",
            "vocabulary",
        ),
        (
            json!({"logprobs": true, "top_logprobs": 21}),
            "top_logprobs",
            "20",
        ),
        (json!({"stop": [""]}), "stop", "empty"),
        (json!({"stop": 5}), "stop", "stop"),
        (
            json!({"tool_choice": {"type": "function", "function": {"name": "g"}}, "tools": [{"type": "function", "function": {"name": "f"}}]}),
            "tool_choice",
            "not in `tools`",
        ),
        (
            json!({"tool_choice": "required"}),
            "tool_choice",
            "`tools` is empty",
        ),
        (
            json!({"tools": [{"type": "function", "function": {}}]}),
            "tools[0]",
            "function",
        ),
    ];
    for (fields, param, needle) in chat_cases {
        expect_400(&s, c, chat("hi", fields), Some(param), needle);
    }
    expect_400(
        &s,
        c,
        json!({"messages": [{"role": "user", "content": [{"type": "text", "text": "what is this?"}, {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}),
        Some("messages[0].content[1]"),
        "could not be decoded",
    );
    expect_400(
        &s,
        c,
        json!({"messages": [{"role": "bot", "content": "x"}]}),
        Some("messages[0].role"),
        "role",
    );
    expect_400(&s, c, json!({"messages": []}), Some("messages"), "empty");

    // Context length: the prompt alone, and prompt + max_tokens; both lengths are named.
    let long = "word ".repeat(400);
    let (_, t) = s.post(
        "/tokenize",
        &json!({"messages": [{"role": "user", "content": long}]}),
    );
    let n = t["count"].as_u64().unwrap();
    expect_400(
        &s,
        c,
        chat(&long, json!({})),
        Some("messages"),
        &n.to_string(),
    );
    expect_400(&s, c, chat(&long, json!({})), Some("messages"), "256");
    expect_400(
        &s,
        c,
        chat("hi", json!({"max_tokens": 1000})),
        Some("max_tokens"),
        "256",
    );
    expect_400(
        &s,
        p,
        completion(json!("word ".repeat(400)), json!({})),
        Some("prompt"),
        "256",
    );

    // The prompt and further fields of a completion request, the param the 400 names, and what its
    // message says.
    let completion_cases = [
        (json!([]), json!({}), "prompt", "empty"),
        (json!([1, "a"]), json!({}), "prompt", ""),
        (json!([[1], [-1]]), json!({}), "prompt", ""),
        (json!("hi"), json!({"logprobs": 50}), "logprobs", "20"),
        (json!("hi"), json!({"suffix": "x"}), "suffix", "suffix"),
    ];
    for (prompt, fields, param, needle) in completion_cases {
        expect_400(&s, p, completion(prompt, fields), Some(param), needle);
    }
    let (status, v) = s.post(
        p,
        &completion(json!([999_999_999]), json!({"max_tokens": 1})),
    );
    assert_eq!(status, 400, "{v}");
    assert!(error_of(&v)["message"]
        .as_str()
        .unwrap()
        .contains("vocabulary"));
}

#[test]
fn unknown_models_routes_and_methods() {
    let s = ServerProc::start(&["--served-model-name", "my-model"]);
    let (status, v) = s.post(
        "/v1/chat/completions",
        &chat("hi", json!({"max_tokens": 1})),
    );
    assert_eq!(
        status, 404,
        "sanmai-demo is not served under that name here: {v}"
    );
    let e = error_of(&v);
    assert_eq!(e["param"], "model");
    assert_eq!(e["code"], "model_not_found");
    let (status, v) = s.post(
        "/v1/completions",
        &json!({"model": "gpt-4", "prompt": "x", "max_tokens": 1}),
    );
    assert_eq!(status, 404);
    error_of(&v);
    let (status, v) = s.post(
        "/v1/chat/completions",
        &json!({"model": "my-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 1}),
    );
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["model"], "my-model");
    // Without `model` the served one is meant.
    let (status, _) = s.post("/v1/completions", &json!({"prompt": "x", "max_tokens": 1}));
    assert_eq!(status, 200);

    let (status, v) = s.get_json("/v1/models/gpt-4");
    assert_eq!(status, 404);
    assert_eq!(error_of(&v)["param"], "model");

    let (status, text) = s.get("/v1/nothing-here");
    assert_eq!(status, 404);
    error_of(&serde_json::from_str(&text).unwrap());
    let (status, text) = s.get("/v1/chat/completions");
    assert_eq!(status, 405);
    error_of(&serde_json::from_str(&text).unwrap());
}

#[test]
fn api_key_guards_the_api() {
    let s = ServerProc::start(&["--api-key", "sekrit"]);
    let body = serde_json::to_vec(&completion(json!("hi"), json!({"max_tokens": 1}))).unwrap();
    for key in [None, Some("wrong")] {
        let (status, text) = s.post_raw("/v1/completions", body.clone(), key);
        assert_eq!(status, 401, "{key:?}");
        let v: Value = serde_json::from_str(&text).unwrap();
        assert_eq!(error_of(&v)["type"], "authentication_error");
    }
    let (status, text) = s.post_raw("/v1/completions", body, Some("sekrit"));
    assert_eq!(status, 200, "{text}");
    let r = s.client().get(s.url("/v1/models")).send().unwrap();
    assert_eq!(r.status(), 401);
    let r = s
        .client()
        .get(s.url("/v1/models"))
        .bearer_auth("sekrit")
        .send()
        .unwrap();
    assert_eq!(r.status(), 200);
    let r = s
        .client()
        .post(s.url("/tokenize"))
        .json(&json!({"prompt": "x"}))
        .send()
        .unwrap();
    assert_eq!(r.status(), 401);
    // Health, version and metrics stay open for probes.
    for path in ["/health", "/version", "/metrics"] {
        assert_eq!(s.get(path).0, 200, "{path}");
    }
}

#[test]
fn oversized_bodies_get_413() {
    let s = ServerProc::start(&["--max-request-bytes", "2000"]);
    let big = chat(&"a".repeat(3000), json!({"max_tokens": 1}));
    let (status, v) = s.post("/v1/chat/completions", &big);
    assert_eq!(status, 413, "{v}");
    assert_eq!(error_of(&v)["code"], "request_too_large");
    let small = chat("hello", json!({"max_tokens": 1}));
    let (status, v) = s.post("/v1/chat/completions", &small);
    assert_eq!(status, 200, "{v}");
}

#[test]
fn overloaded_and_loading_servers_answer_503() {
    // No room in the queue: every request is refused as overloaded.
    let s = ServerProc::start(&["--max-waiting-requests", "0"]);
    let (status, v) = s.post(
        "/v1/chat/completions",
        &chat("hi", json!({"max_tokens": 1})),
    );
    assert_eq!(status, 503, "{v}");
    assert!(error_of(&v)["message"]
        .as_str()
        .unwrap()
        .contains("overloaded"));
    let (status, v) = s.post(
        "/v1/completions",
        &completion(json!("hi"), json!({"max_tokens": 1})),
    );
    assert_eq!(status, 503, "{v}");
    drop(s);

    // Right after it listens the model may still be loading: then /health and the API say 503.
    let s = ServerProc::spawn(&[]);
    let (status, body) = s.get("/health");
    if status == 503 {
        let v: Value = serde_json::from_str(&body).unwrap();
        assert!(error_of(&v)["message"]
            .as_str()
            .unwrap()
            .contains("loading"));
        let (status, v) = s.post(
            "/v1/chat/completions",
            &chat("hi", json!({"max_tokens": 1})),
        );
        assert!(status == 503 || status == 200, "{status} {v}");
    } else {
        assert_eq!(status, 200);
    }
    s.wait_ready();
}
