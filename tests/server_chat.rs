//! `POST /v1/chat/completions` on the built-in model: whole and streamed answers in OpenAI's shapes,
//! usage, logprobs, `n`, stop strings, reasoning, and requests with tools.

mod server_support;

use serde_json::{json, Value};
use server_support::{chat, ServerProc};

const PATH: &str = "/v1/chat/completions";

fn greedy(extra: Value) -> Value {
    let mut body = json!({"temperature": 0, "ignore_eos": true});
    server_support::merge(&mut body, extra);
    body
}

#[test]
fn whole_answer_has_the_openai_shape() {
    let s = ServerProc::start(&[]);
    let (status, v) = s.post(
        PATH,
        &chat(
            "Tell me a story.",
            greedy(json!({"max_tokens": 6, "user": "u-1", "some_future_field": {"x": 1}})),
        ),
    );
    assert_eq!(status, 200, "{v}");
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(v["object"], "chat.completion");
    assert!(v["created"].as_u64().unwrap() > 1_600_000_000);
    assert_eq!(v["model"], "sanmai-demo");
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 1);
    let c = &choices[0];
    assert_eq!(c["index"], 0);
    assert_eq!(c["message"]["role"], "assistant");
    assert!(c["message"]["content"].is_string());
    assert!(c["message"].get("reasoning_content").is_some());
    assert!(c["logprobs"].is_null());
    assert_eq!(c["finish_reason"], "length");
    let u = &v["usage"];
    assert_eq!(u["completion_tokens"], 6);
    assert!(u["prompt_tokens"].as_u64().unwrap() > 5);
    assert_eq!(
        u["total_tokens"].as_u64().unwrap(),
        u["prompt_tokens"].as_u64().unwrap() + 6
    );
    assert!(u["prompt_tokens_details"]["cached_tokens"].is_u64());

    // max_completion_tokens is the newer spelling of max_tokens.
    let (_, v) = s.post(
        PATH,
        &chat(
            "Tell me a story.",
            greedy(json!({"max_completion_tokens": 3})),
        ),
    );
    assert_eq!(v["usage"]["completion_tokens"], 3);

    // Without max_tokens the built-in model's default (512) applies; min_tokens + a stop token id
    // end it earlier.
    let (_, v) = s.post(
        PATH,
        &chat(
            "hi",
            json!({"temperature": 0, "min_tokens": 2, "max_tokens": 40}),
        ),
    );
    let n = v["usage"]["completion_tokens"].as_u64().unwrap();
    assert!((2..=40).contains(&n), "{v}");
}

#[test]
fn streamed_answer_matches_the_whole_one() {
    let s = ServerProc::start(&[]);
    let body = chat("Count to ten.", greedy(json!({"max_tokens": 12})));
    let (_, whole) = s.post(PATH, &body);
    let whole_text = whole["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();

    let mut sb = body.clone();
    sb["stream"] = json!(true);
    sb["stream_options"] = json!({"include_usage": true});
    let sse = s.stream(PATH, &sb);
    assert!(sse.done, "no [DONE]");
    let first = &sse.events[0];
    assert_eq!(first["object"], "chat.completion.chunk");
    assert_eq!(first["choices"][0]["delta"]["role"], "assistant");
    let id = first["id"].as_str().unwrap();
    assert!(id.starts_with("chatcmpl-"));
    assert!(sse
        .events
        .iter()
        .all(|e| e["id"] == id && e["model"] == "sanmai-demo"));
    assert_eq!(sse.text_of(0, "content"), whole_text);
    assert_eq!(sse.finish_reason(0).as_deref(), Some("length"));
    // Only the final chunk has a finish_reason.
    let with_reason = sse
        .chunks()
        .filter(|e| !e["choices"][0]["finish_reason"].is_null())
        .count();
    assert_eq!(with_reason, 1);
    // The usage chunk comes last, with no choices; other chunks carry usage: null.
    let last = sse.events.last().unwrap();
    assert_eq!(last["choices"], json!([]));
    assert_eq!(last["usage"]["completion_tokens"], 12);
    assert_eq!(
        last["usage"]["prompt_tokens"],
        whole["usage"]["prompt_tokens"]
    );
    assert!(sse.chunks().all(|e| e["usage"].is_null()));

    // Without include_usage there is no usage chunk.
    sb["stream_options"] = json!(null);
    let sse = s.stream(PATH, &sb);
    assert!(sse.done);
    assert!(sse
        .events
        .iter()
        .all(|e| !e["choices"].as_array().unwrap().is_empty()));
    assert!(sse.events.iter().all(|e| e.get("usage").is_none()));
}

#[test]
fn logprobs_report_the_chosen_tokens() {
    let s = ServerProc::start(&[]);
    let body = chat(
        "Hello!",
        greedy(json!({"max_tokens": 5, "logprobs": true, "top_logprobs": 3})),
    );
    let (status, v) = s.post(PATH, &body);
    assert_eq!(status, 200, "{v}");
    let entries = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(entries.len(), 5);
    let mut bytes = Vec::new();
    for e in entries {
        let lp = e["logprob"].as_f64().unwrap();
        assert!(lp <= 0.0);
        let top = e["top_logprobs"].as_array().unwrap();
        assert_eq!(top.len(), 3);
        // Greedy: the chosen token is the most likely one.
        assert_eq!(top[0]["token"], e["token"]);
        assert!((top[0]["logprob"].as_f64().unwrap() - lp).abs() < 1e-6);
        assert!(top
            .windows(2)
            .all(|w| w[0]["logprob"].as_f64() >= w[1]["logprob"].as_f64()));
        bytes.extend(
            e["bytes"]
                .as_array()
                .unwrap()
                .iter()
                .map(|b| b.as_u64().unwrap() as u8),
        );
    }
    // The tokens' bytes spell the answer (special tokens aside, which ignore_eos keeps out of text
    // only when they are not generated; the built-in model rarely emits them in five tokens).
    let content = v["choices"][0]["message"]["content"].as_str().unwrap();
    assert!(
        String::from_utf8_lossy(&bytes).contains(content.trim()),
        "{bytes:?} vs {content:?}"
    );

    // Streamed: one entry per token across the chunks.
    let mut sb = body.clone();
    sb["stream"] = json!(true);
    let sse = s.stream(PATH, &sb);
    let streamed: Vec<&Value> = sse
        .chunks()
        .filter_map(|e| e["choices"][0]["logprobs"]["content"].as_array())
        .flatten()
        .collect();
    assert_eq!(streamed.len(), 5);
    for (a, b) in streamed.iter().zip(entries) {
        assert_eq!(a["token"], b["token"]);
    }

    // logprobs without top_logprobs: the chosen token only.
    let (_, v) = s.post(
        PATH,
        &chat("Hello!", greedy(json!({"max_tokens": 2, "logprobs": true}))),
    );
    let entries = v["choices"][0]["logprobs"]["content"].as_array().unwrap();
    assert_eq!(entries.len(), 2);
    assert!(entries.iter().all(|e| e["top_logprobs"] == json!([])));
}

#[test]
fn n_choices_and_seeds() {
    let s = ServerProc::start(&[]);
    let body = chat(
        "Pick a word.",
        json!({"max_tokens": 8, "n": 3, "temperature": 1.0, "seed": 11, "ignore_eos": true}),
    );
    let (status, v) = s.post(PATH, &body);
    assert_eq!(status, 200, "{v}");
    let choices = v["choices"].as_array().unwrap();
    assert_eq!(choices.len(), 3);
    for (i, c) in choices.iter().enumerate() {
        assert_eq!(c["index"], i);
    }
    assert_eq!(v["usage"]["completion_tokens"], 24);
    // Seeds are offset per choice, so the same request gives the same choices again...
    let (_, again) = s.post(PATH, &body);
    let texts = |v: &Value| -> Vec<String> {
        v["choices"]
            .as_array()
            .unwrap()
            .iter()
            .map(|c| c["message"]["content"].as_str().unwrap().to_string())
            .collect()
    };
    assert_eq!(texts(&v), texts(&again));
    // ...and choice 0 of seed 12 equals choice 1 of seed 11.
    let mut shifted = body.clone();
    shifted["seed"] = json!(12);
    shifted["n"] = json!(1);
    let (_, one) = s.post(PATH, &shifted);
    assert_eq!(texts(&one)[0], texts(&v)[1]);

    // Streamed: every choice gets its role, its deltas and its final chunk.
    let mut sb = body.clone();
    sb["stream"] = json!(true);
    sb["n"] = json!(2);
    let sse = s.stream(PATH, &sb);
    assert!(sse.done);
    for i in 0..2u64 {
        assert_eq!(sse.finish_reason(i).as_deref(), Some("length"));
        let role = sse.chunks().any(|e| {
            e["choices"][0]["index"] == i && e["choices"][0]["delta"]["role"] == "assistant"
        });
        assert!(role);
        assert_eq!(sse.text_of(i, "content"), texts(&v)[i as usize]);
    }
}

#[test]
fn stop_strings_end_the_answer_and_are_not_emitted() {
    let s = ServerProc::start(&[]);
    let base = chat(
        "Write something long.",
        greedy(json!({"max_tokens": 24, "logprobs": true})),
    );
    let (_, v) = s.post(PATH, &base);
    let text = v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .to_string();
    let tokens: Vec<String> = v["choices"][0]["logprobs"]["content"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e["token"].as_str().unwrap().to_string())
        .collect();
    // A stop string across a token boundary: the last char of one token and the first of the next,
    // at the first boundary past the leading whitespace where both sides are plain text.
    let mut stop = None;
    let mut offset = 0;
    for w in tokens.windows(2) {
        offset += w[0].len();
        let (a, b) = (&w[0], &w[1]);
        if offset > 0
            && !a.trim().is_empty()
            && !b.trim().is_empty()
            && !a.contains('\u{fffd}')
            && !b.contains('\u{fffd}')
        {
            let s: String = a
                .chars()
                .last()
                .into_iter()
                .chain(b.chars().next())
                .collect();
            stop = Some(s);
            break;
        }
    }
    let Some(stop) = stop else {
        panic!("no usable token boundary in {tokens:?}");
    };
    let at = text
        .find(&stop)
        .expect("the stop string occurs in the greedy text");
    for stream in [false, true] {
        let mut body = base.clone();
        body["stop"] = json!([stop.clone(), "never-occurs-here"]);
        body["logprobs"] = json!(false);
        let (got, reason, stop_reason) = if stream {
            body["stream"] = json!(true);
            let sse = s.stream(PATH, &body);
            let last = sse.chunks().last().unwrap()["choices"][0].clone();
            (
                sse.text_of(0, "content"),
                sse.finish_reason(0),
                last["stop_reason"].clone(),
            )
        } else {
            let (_, v) = s.post(PATH, &body);
            let c = &v["choices"][0];
            (
                c["message"]["content"].as_str().unwrap().to_string(),
                c["finish_reason"].as_str().map(String::from),
                c["stop_reason"].clone(),
            )
        };
        assert_eq!(got, text[..at], "stream={stream} stop={stop:?}");
        assert_eq!(reason.as_deref(), Some("stop"));
        assert_eq!(stop_reason, json!(stop));
    }
    // A stop string given as a single string works the same.
    let mut body = base.clone();
    body["stop"] = json!(stop.clone());
    let (_, v) = s.post(PATH, &body);
    assert_eq!(
        v["choices"][0]["message"]["content"].as_str().unwrap(),
        &text[..at]
    );
}

#[test]
fn thinking_on_streams_reasoning_content() {
    let s = ServerProc::start(&[]);
    // The built-in model defaults to thinking off: replies are content.
    let (_, off) = s.post(
        PATH,
        &chat("Why is the sky blue?", greedy(json!({"max_tokens": 8}))),
    );
    assert!(
        off["choices"][0]["message"]["reasoning_content"].is_null(),
        "{off}"
    );
    // With thinking on, the prompt opens <think>, so the output starts as reasoning.
    let body = chat(
        "Why is the sky blue?",
        greedy(json!({"max_tokens": 8, "chat_template_kwargs": {"enable_thinking": true}})),
    );
    let (status, v) = s.post(PATH, &body);
    assert_eq!(status, 200, "{v}");
    let m = &v["choices"][0]["message"];
    let reasoning = m["reasoning_content"].as_str().unwrap_or("");
    assert!(!reasoning.is_empty(), "{v}");
    assert!(!m["content"].as_str().unwrap_or("").contains("<think>"));
    let mut sb = body.clone();
    sb["stream"] = json!(true);
    let sse = s.stream(PATH, &sb);
    assert_eq!(sse.text_of(0, "reasoning_content"), reasoning);
    assert_eq!(
        sse.text_of(0, "content"),
        m["content"].as_str().unwrap_or("")
    );

    // History with reasoning_content (as a client sends it back) is accepted.
    let history = json!({
        "messages": [
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello", "reasoning_content": "greet back"},
            {"role": "user", "content": "again"}
        ],
        "max_tokens": 2,
        "temperature": 0
    });
    let (status, v) = s.post(PATH, &history);
    assert_eq!(status, 200, "{v}");
}

#[test]
fn requests_with_tools_render_and_answer() {
    let s = ServerProc::start(&[]);
    let tools = json!([{"type": "function", "function": {"name": "get_weather", "description": "Weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]);
    let with_tools = |choice: Value| {
        chat(
            "What's the weather in Paris?",
            greedy(json!({"max_tokens": 4, "tools": tools, "tool_choice": choice})),
        )
    };
    // Tools are rendered into the prompt: the prompt is longer than without them.
    let (_, plain) = s.post(
        PATH,
        &chat(
            "What's the weather in Paris?",
            greedy(json!({"max_tokens": 4})),
        ),
    );
    for choice in [json!("auto"), json!("none"), Value::Null] {
        let (status, v) = s.post(PATH, &with_tools(choice.clone()));
        assert_eq!(status, 200, "{choice}: {v}");
        assert!(v["usage"]["prompt_tokens"].as_u64() > plain["usage"]["prompt_tokens"].as_u64());
        let reason = v["choices"][0]["finish_reason"].as_str().unwrap();
        assert!(["length", "stop", "tool_calls"].contains(&reason));
    }
    // A conversation that already holds a tool call and its result.
    let convo = json!({
        "messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": null, "tool_calls": [{"id": "call_1", "type": "function",
                "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
            {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"}
        ],
        "tools": tools, "max_tokens": 3, "temperature": 0, "stream": true
    });
    let sse = s.stream(PATH, &convo);
    assert!(sse.done);
}
