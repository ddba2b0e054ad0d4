//! Structured output over HTTP on the built-in model (random weights: every well-formed answer is the
//! constraint's doing): `response_format` JSON schema and JSON mode, forced tool calls (`required` and a
//! named function, whole and streamed, in qwen-code's side-query shape), vLLM's `structured_outputs`
//! regex / choice / grammar, and 400s for constraints that cannot compile.

mod server_support;

use serde_json::{json, Value};
use server_support::{chat, completion, error_of, ServerProc};

const CHAT: &str = "/v1/chat/completions";

/// Sampled, seeded, with penalties that keep the random model from repeating one digit forever.
fn sampled(extra: Value) -> Value {
    let mut body = json!({"temperature": 1.0, "seed": 7, "frequency_penalty": 1.0, "presence_penalty": 1.0, "max_tokens": 200});
    server_support::merge(&mut body, extra);
    body
}

fn respond_in_schema() -> Value {
    json!([{"type": "function", "function": {
        "name": "respond_in_schema",
        "description": "Provide the response in the requested schema",
        "parameters": {"type": "object", "properties": {
            "reasoning": {"type": "string", "maxLength": 30},
            "next_speaker": {"type": "string", "enum": ["user", "model"]},
            "confidence": {"type": "integer", "minimum": 0, "maximum": 10}
        }, "required": ["reasoning", "next_speaker"]}
    }}])
}

fn check_side_query_args(args: &Value) {
    assert!(
        args["reasoning"]
            .as_str()
            .is_some_and(|r| r.chars().count() <= 30),
        "{args}"
    );
    assert!(
        ["user", "model"].contains(&args["next_speaker"].as_str().unwrap()),
        "{args}"
    );
    if let Some(c) = args.get("confidence") {
        assert!(c.as_i64().is_some_and(|c| (0..=10).contains(&c)), "{args}");
    }
    let keys: Vec<&String> = args.as_object().unwrap().keys().collect();
    assert!(
        keys.iter()
            .all(|k| ["reasoning", "next_speaker", "confidence"].contains(&k.as_str())),
        "{args}"
    );
}

#[test]
fn json_schema_and_json_mode() {
    let s = ServerProc::start(&[]);
    let schema = json!({"type": "object", "properties": {
        "city": {"type": "string", "minLength": 1, "maxLength": 12},
        "days": {"type": "integer", "minimum": 1, "maximum": 7},
        "units": {"enum": ["metric", "imperial"]}
    }, "required": ["city", "days", "units"], "additionalProperties": false});
    let (status, v) = s.post(
        CHAT,
        &chat(
            "Weather plan as JSON",
            sampled(json!({"n": 20, "response_format": {"type": "json_schema",
                "json_schema": {"name": "plan", "schema": schema, "strict": true}}})),
        ),
    );
    assert_eq!(status, 200, "{v}");
    for c in v["choices"].as_array().unwrap() {
        assert_eq!(c["finish_reason"], "stop", "{c}");
        let text = c["message"]["content"].as_str().unwrap();
        let obj: Value = serde_json::from_str(text).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        assert_eq!(obj.as_object().unwrap().len(), 3, "{text}");
        assert!(
            (1..=12).contains(&obj["city"].as_str().unwrap().chars().count()),
            "{text}"
        );
        assert!((1..=7).contains(&obj["days"].as_i64().unwrap()), "{text}");
        assert!(
            ["metric", "imperial"].contains(&obj["units"].as_str().unwrap()),
            "{text}"
        );
    }
    // JSON mode: what finishes is an object.
    let (status, v) = s.post(
        CHAT,
        &chat(
            "Any JSON",
            sampled(json!({"n": 4, "max_tokens": 400, "response_format": {"type": "json_object"}})),
        ),
    );
    assert_eq!(status, 200, "{v}");
    for c in v["choices"].as_array().unwrap() {
        let text = c["message"]["content"].as_str().unwrap();
        assert!(text.starts_with('{'), "{text}");
        if c["finish_reason"] == "stop" {
            assert!(
                serde_json::from_str::<Value>(text).unwrap().is_object(),
                "{text}"
            );
        }
    }
}

#[test]
fn forced_tool_calls_parse_and_validate() {
    let s = ServerProc::start(&[]);
    let tools = respond_in_schema();
    let (status, v) = s.post(
        CHAT,
        &chat(
            "Who speaks next?",
            sampled(json!({"n": 10, "tools": tools, "tool_choice": "required"})),
        ),
    );
    assert_eq!(status, 200, "{v}");
    for c in v["choices"].as_array().unwrap() {
        assert_eq!(c["finish_reason"], "tool_calls", "{c}");
        let calls = c["message"]["tool_calls"].as_array().unwrap();
        assert_eq!(calls.len(), 1, "{c}");
        assert_eq!(calls[0]["function"]["name"], "respond_in_schema");
        let args: Value =
            serde_json::from_str(calls[0]["function"]["arguments"].as_str().unwrap()).unwrap();
        check_side_query_args(&args);
    }
    // A named function among several.
    let two = json!([
        {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}},
        {"type": "function", "function": {"name": "set_level", "parameters": {"type": "object",
            "properties": {"level": {"type": "integer", "minimum": 1, "maximum": 3}}, "required": ["level"]}}}
    ]);
    let (status, v) = s.post(
        CHAT,
        &chat("Set it", sampled(json!({"n": 5, "tools": two, "tool_choice": {"type": "function", "function": {"name": "set_level"}}}))),
    );
    assert_eq!(status, 200, "{v}");
    for c in v["choices"].as_array().unwrap() {
        let call = &c["message"]["tool_calls"][0]["function"];
        assert_eq!(call["name"], "set_level", "{c}");
        let args: Value = serde_json::from_str(call["arguments"].as_str().unwrap()).unwrap();
        assert!((1..=3).contains(&args["level"].as_i64().unwrap()), "{args}");
    }
}

#[test]
fn qwen_code_side_query_streams_a_valid_tool_call() {
    let s = ServerProc::start(&[]);
    for seed in 0..5 {
        let body = chat(
            "Decide who speaks next.",
            sampled(json!({
                "seed": seed, "stream": true, "stream_options": {"include_usage": true},
                "tools": respond_in_schema(), "tool_choice": "required",
            })),
        );
        let sse = s.stream(CHAT, &body);
        assert!(sse.done);
        assert_eq!(sse.finish_reason(0).as_deref(), Some("tool_calls"));
        let (mut name, mut args) = (String::new(), String::new());
        for e in sse.chunks() {
            for call in e["choices"][0]["delta"]["tool_calls"]
                .as_array()
                .into_iter()
                .flatten()
            {
                assert_eq!(call["index"], 0);
                if let Some(n) = call["function"]["name"].as_str() {
                    name.push_str(n);
                }
                if let Some(a) = call["function"]["arguments"].as_str() {
                    args.push_str(a);
                }
            }
        }
        assert_eq!(name, "respond_in_schema");
        check_side_query_args(
            &serde_json::from_str(&args).unwrap_or_else(|e| panic!("{args:?}: {e}")),
        );
    }
}

#[test]
fn regex_choice_and_grammar_outputs_match() {
    let s = ServerProc::start(&[]);
    let (status, v) = s.post(
        "/v1/completions",
        &completion(
            json!("Code:"),
            sampled(json!({"n": 10, "structured_outputs": {"regex": "[A-F]{2}[0-9]{3}"}})),
        ),
    );
    assert_eq!(status, 200, "{v}");
    for c in v["choices"].as_array().unwrap() {
        let t = c["text"].as_str().unwrap();
        assert_eq!(c["finish_reason"], "stop");
        assert!(
            t.len() == 5
                && t[..2].bytes().all(|b| (b'A'..=b'F').contains(&b))
                && t[2..].bytes().all(|b| b.is_ascii_digit()),
            "{t}"
        );
    }
    let options = ["positive", "negative", "neutral"];
    let (status, v) = s.post(
        CHAT,
        &chat(
            "Sentiment?",
            sampled(json!({"n": 10, "structured_outputs": {"choice": options}})),
        ),
    );
    assert_eq!(status, 200, "{v}");
    for c in v["choices"].as_array().unwrap() {
        assert!(
            options.contains(&c["message"]["content"].as_str().unwrap()),
            "{c}"
        );
    }
    let grammar = "start: \"(\" num (\"+\" num)* \")\"\nnum: /[1-9]/\n";
    let (status, v) = s.post(
        "/v1/completions",
        &completion(
            json!("Sum:"),
            sampled(json!({"n": 10, "max_tokens": 60, "structured_outputs": {"grammar": grammar}})),
        ),
    );
    assert_eq!(status, 200, "{v}");
    for c in v["choices"].as_array().unwrap() {
        let t = c["text"].as_str().unwrap();
        if c["finish_reason"] == "stop" {
            let inner = t
                .strip_prefix('(')
                .and_then(|t| t.strip_suffix(')'))
                .unwrap_or_else(|| panic!("{t}"));
            assert!(
                inner
                    .split('+')
                    .all(|n| n.len() == 1 && n != "0" && n.bytes().all(|b| b.is_ascii_digit())),
                "{t}"
            );
        }
    }
}

#[test]
fn thinking_leaves_reasoning_free_and_constrains_the_answer() {
    let s = ServerProc::start(&[]);
    // `</think>` is one text token of the built-in vocabulary; a bias makes the model close its
    // (empty) reasoning at once, after which the answer follows the schema.
    let (_, tok) = s.post("/tokenize", &json!({"prompt": "</think>"}));
    let think_end = tok["tokens"][0].as_u64().unwrap();
    let schema = json!({"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": false});
    let (status, v) = s.post(
        CHAT,
        &chat("Think, then answer", sampled(json!({
            "n": 5,
            "chat_template_kwargs": {"enable_thinking": true},
            "logit_bias": {think_end.to_string(): 100},
            "response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": schema}},
        }))),
    );
    assert_eq!(status, 200, "{v}");
    for c in v["choices"].as_array().unwrap() {
        assert_eq!(c["finish_reason"], "stop", "{c}");
        let text = c["message"]["content"].as_str().unwrap();
        let obj: Value =
            serde_json::from_str(text.trim()).unwrap_or_else(|e| panic!("{text:?}: {e}"));
        assert!(obj["ok"].is_boolean(), "{text}");
    }
}

#[test]
fn constraints_that_cannot_compile_are_400s() {
    let s = ServerProc::start(&[]);
    for (extra, param, words) in [
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"a": {"type": "frobnicate"}}}}}}),
            "response_format",
            "frobnicate",
        ),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "minLength": 5, "maxLength": 2}}}}),
            "response_format",
            "schema",
        ),
        (
            json!({"response_format": {"type": "xml"}}),
            "response_format.type",
            "json_schema",
        ),
        (
            json!({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": true,
                "schema": {"type": "array", "uniqueItems": true}}}}),
            "response_format",
            "uniqueItems",
        ),
        (
            json!({"structured_outputs": {"regex": "(unclosed"}}),
            "structured_outputs",
            "regex",
        ),
        (
            json!({"structured_outputs": {"grammar": "start: nowhere"}}),
            "structured_outputs",
            "nowhere",
        ),
        (
            json!({"structured_outputs": {"regex": "a", "choice": ["b"]}}),
            "structured_outputs",
            "exactly one",
        ),
        (
            json!({"tools": respond_in_schema(), "tool_choice": {"type": "function", "function": {"name": "other"}}}),
            "tool_choice",
            "not in `tools`",
        ),
    ] {
        let (status, v) = s.post(CHAT, &chat("hi", sampled(extra.clone())));
        assert_eq!(status, 400, "{extra}: {v}");
        let e = error_of(&v);
        assert_eq!(e["param"], param, "{extra}: {v}");
        let msg = e["message"].as_str().unwrap().to_lowercase();
        assert!(msg.contains(&words.to_lowercase()), "{extra}: {msg}");
    }
    // The server still answers afterwards.
    let (status, _) = s.post(CHAT, &chat("hi", sampled(json!({"max_tokens": 2}))));
    assert_eq!(status, 200);
}
