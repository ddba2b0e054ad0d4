//! `POST /v1/completions` on the built-in model: the four prompt forms, `n`, `echo` with prompt
//! log-probabilities in the legacy shape, streaming, and stop strings.

mod server_support;

use serde_json::{json, Value};
use server_support::{completion, ServerProc};

const PATH: &str = "/v1/completions";

fn greedy(max_tokens: u64) -> Value {
    json!({"max_tokens": max_tokens, "temperature": 0, "ignore_eos": true})
}

fn texts(v: &Value) -> Vec<String> {
    v["choices"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| c["text"].as_str().unwrap().to_string())
        .collect()
}

#[test]
fn prompts_in_every_form() {
    let s = ServerProc::start(&[]);
    let (status, one) = s.post(
        PATH,
        &completion(json!("The capital of France is"), greedy(5)),
    );
    assert_eq!(status, 200, "{one}");
    assert!(one["id"].as_str().unwrap().starts_with("cmpl-"));
    assert_eq!(one["object"], "text_completion");
    assert_eq!(one["model"], "sanmai-demo");
    assert_eq!(one["choices"][0]["finish_reason"], "length");
    assert!(one["choices"][0]["logprobs"].is_null());
    assert_eq!(one["usage"]["completion_tokens"], 5);

    let (_, tok) = s.post("/tokenize", &json!({"prompt": "The capital of France is"}));
    let ids = tok["tokens"].clone();
    assert_eq!(one["usage"]["prompt_tokens"], tok["count"]);

    // Token ids give the same completion as the text they encode.
    let (_, by_ids) = s.post(PATH, &completion(ids.clone(), greedy(5)));
    assert_eq!(texts(&by_ids), texts(&one));

    // A list of prompts: one choice each, in order; usage sums the prompts.
    let (_, many) = s.post(
        PATH,
        &completion(
            json!(["The capital of France is", "Once upon a time"]),
            greedy(5),
        ),
    );
    let t = texts(&many);
    assert_eq!(t.len(), 2);
    assert_eq!(t[0], texts(&one)[0]);
    let (_, other) = s.post(PATH, &completion(json!("Once upon a time"), greedy(5)));
    assert_eq!(t[1], texts(&other)[0]);
    assert_eq!(
        many["usage"]["prompt_tokens"].as_u64().unwrap(),
        one["usage"]["prompt_tokens"].as_u64().unwrap()
            + other["usage"]["prompt_tokens"].as_u64().unwrap()
    );
    assert_eq!(many["usage"]["completion_tokens"], 10);

    // A list of token-id lists with n = 2: prompt-major choice order.
    let (_, lists) = s.post(
        PATH,
        &completion(json!([ids, [9707, 1879]]), {
            let mut g = greedy(3);
            g["n"] = json!(2);
            g
        }),
    );
    let c = lists["choices"].as_array().unwrap();
    assert_eq!(c.len(), 4);
    for (i, ch) in c.iter().enumerate() {
        assert_eq!(ch["index"], i);
    }
    // Greedy: both choices of a prompt agree.
    assert_eq!(c[0]["text"], c[1]["text"]);
    assert_eq!(c[2]["text"], c[3]["text"]);
}

#[test]
fn echo_with_logprobs_reports_the_prompt() {
    let s = ServerProc::start(&[]);
    let prompt = "Hello world, this is";
    let (status, v) = s.post(
        PATH,
        &completion(json!(prompt), {
            let mut g = greedy(4);
            g["echo"] = json!(true);
            g["logprobs"] = json!(2);
            g
        }),
    );
    assert_eq!(status, 200, "{v}");
    let c = &v["choices"][0];
    let text = c["text"].as_str().unwrap();
    assert!(text.starts_with(prompt), "{text:?}");
    let lp = &c["logprobs"];
    let n_prompt = v["usage"]["prompt_tokens"].as_u64().unwrap() as usize;
    let tokens = lp["tokens"].as_array().unwrap();
    assert_eq!(tokens.len(), n_prompt + 4);
    let token_logprobs = lp["token_logprobs"].as_array().unwrap();
    let top = lp["top_logprobs"].as_array().unwrap();
    let offsets: Vec<u64> = lp["text_offset"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect();
    assert_eq!(token_logprobs.len(), tokens.len());
    assert_eq!(top.len(), tokens.len());
    assert!(token_logprobs[0].is_null() && top[0].is_null());
    for i in 1..tokens.len() {
        assert!(token_logprobs[i].as_f64().unwrap() <= 0.0);
        let alts = top[i].as_object().unwrap();
        assert!(!alts.is_empty() && alts.len() <= 2);
    }
    // Offsets walk the token texts from 0.
    assert_eq!(offsets[0], 0);
    for i in 1..tokens.len() {
        let prev = tokens[i - 1].as_str().unwrap().chars().count() as u64;
        assert_eq!(offsets[i], offsets[i - 1] + prev);
    }
    // The prompt's tokens spell the prompt.
    let spelled: String = tokens[..n_prompt]
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    assert_eq!(spelled, prompt);
    // Greedy: each generated token is its step's most likely one.
    for i in n_prompt..tokens.len() {
        let best = top[i]
            .as_object()
            .unwrap()
            .values()
            .map(|x| x.as_f64().unwrap())
            .fold(f64::MIN, f64::max);
        assert!((best - token_logprobs[i].as_f64().unwrap()).abs() < 1e-6);
    }

    // Echo without logprobs only repeats the text; logprobs without echo covers the new tokens.
    let (_, plain) = s.post(
        PATH,
        &completion(json!(prompt), {
            let mut g = greedy(4);
            g["echo"] = json!(true);
            g
        }),
    );
    assert_eq!(plain["choices"][0]["text"], c["text"]);
    assert!(plain["choices"][0]["logprobs"].is_null());
    let (_, new_only) = s.post(
        PATH,
        &completion(json!(prompt), {
            let mut g = greedy(4);
            g["logprobs"] = json!(0);
            g
        }),
    );
    assert_eq!(
        new_only["choices"][0]["logprobs"]["tokens"]
            .as_array()
            .unwrap()
            .len(),
        4
    );
    assert_eq!(new_only["choices"][0]["logprobs"]["text_offset"][0], 0);

    // Streamed with echo + logprobs: the prompt comes first, then the tokens; the whole matches.
    let mut body = completion(json!(prompt), {
        let mut g = greedy(4);
        g["echo"] = json!(true);
        g["logprobs"] = json!(2);
        g["stream"] = json!(true);
        g["stream_options"] = json!({"include_usage": true});
        g
    });
    let sse = s.stream(PATH, &body);
    assert!(sse.done);
    assert_eq!(sse.text_of(0, "text"), text);
    let streamed: Vec<Value> = sse
        .chunks()
        .filter_map(|e| e["choices"][0]["logprobs"]["tokens"].as_array().cloned())
        .flatten()
        .collect();
    assert_eq!(&streamed, tokens);
    let offsets_streamed: Vec<Value> = sse
        .chunks()
        .filter_map(|e| {
            e["choices"][0]["logprobs"]["text_offset"]
                .as_array()
                .cloned()
        })
        .flatten()
        .collect();
    assert_eq!(
        offsets_streamed,
        lp["text_offset"].as_array().unwrap().clone()
    );
    assert_eq!(sse.events.last().unwrap()["usage"]["completion_tokens"], 4);
    body["stream"] = json!(false);
}

#[test]
fn streamed_completion_matches_and_stops() {
    let s = ServerProc::start(&[]);
    let mut body = completion(json!("In the beginning"), {
        let mut g = greedy(16);
        g["logprobs"] = json!(0);
        g
    });
    let (_, whole) = s.post(PATH, &body);
    let text = texts(&whole)[0].clone();
    body["stream"] = json!(true);
    let sse = s.stream(PATH, &body);
    assert!(sse.done);
    assert_eq!(sse.text_of(0, "text"), text);
    assert_eq!(sse.finish_reason(0).as_deref(), Some("length"));
    assert!(sse.events.iter().all(|e| e["object"] == "text_completion"));

    // A stop string spanning two tokens, somewhere past the first token.
    let tokens: Vec<String> = whole["choices"][0]["logprobs"]["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap().to_string())
        .collect();
    let stop = tokens
        .windows(2)
        .skip(1)
        .find(|w| {
            !w[0].is_empty() && !w[1].is_empty() && !(w[0].clone() + &w[1]).contains('\u{fffd}')
        })
        .map(|w| {
            let a: String = w[0]
                .chars()
                .rev()
                .take(2)
                .collect::<Vec<_>>()
                .into_iter()
                .rev()
                .collect();
            let b: String = w[1].chars().take(1).collect();
            a + &b
        })
        .expect("two plain tokens");
    let at = text.find(&stop).unwrap();
    for stream in [false, true] {
        let mut b = completion(json!("In the beginning"), greedy(16));
        b["stop"] = json!(stop);
        let (got, reason) = if stream {
            b["stream"] = json!(true);
            let sse = s.stream(PATH, &b);
            (sse.text_of(0, "text"), sse.finish_reason(0))
        } else {
            let (_, v) = s.post(PATH, &b);
            (
                texts(&v)[0].clone(),
                v["choices"][0]["finish_reason"].as_str().map(String::from),
            )
        };
        assert_eq!(got, text[..at], "stream={stream} stop={stop:?}");
        assert_eq!(reason.as_deref(), Some("stop"));
    }
}
