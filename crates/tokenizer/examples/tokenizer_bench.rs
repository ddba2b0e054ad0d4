//! Measures building the built-in tokenizer, encoding, and incremental decoding.
//!
//! `cargo run --release -p sanmai-tokenizer --example tokenizer_bench`

use std::time::Instant;

use sanmai_tokenizer::{IncrementalDecoder, Tokenizer};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut builds = Vec::new();
    let mut tok = None;
    for _ in 0..5 {
        let t = Instant::now();
        tok = Some(Tokenizer::builtin()?);
        builds.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let tok = tok.expect("built");
    builds.sort_by(f64::total_cmp);
    println!(
        "Tokenizer::builtin(): min {:.1} ms, median {:.1} ms, max {:.1} ms",
        builds[0], builds[2], builds[4]
    );

    let text =
        "The quick brown fox 跳过了懒狗 🦊🐶 — fn main() { println!(\"{}\", 42); }\n".repeat(2000);
    let t = Instant::now();
    let ids = tok.encode(&text, false)?;
    let secs = t.elapsed().as_secs_f64();
    println!(
        "encode: {} bytes → {} ids in {:.1} ms ({:.1} MB/s)",
        text.len(),
        ids.len(),
        secs * 1e3,
        text.len() as f64 / secs / 1e6
    );

    let t = Instant::now();
    let mut dec = IncrementalDecoder::new(tok.clone(), false);
    let mut out = String::new();
    for &id in &ids {
        out.push_str(&dec.step(id)?);
    }
    out.push_str(&dec.flush()?);
    let secs = t.elapsed().as_secs_f64();
    assert_eq!(out, text);
    println!(
        "IncrementalDecoder::step: {:.2} µs per id over {} ids",
        secs * 1e6 / ids.len() as f64,
        ids.len()
    );

    let template = tok.chat_template().expect("built-in template");
    let mut request = tok.chat_request(serde_json::json!([
        {"role": "system", "content": "You are a helpful assistant."},
        {"role": "user", "content": "What's the weather in Paris?"},
        {"role": "assistant", "content": null, "tool_calls": [{"type": "function",
            "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}}]},
        {"role": "tool", "content": "{\"temp_c\": 18}"},
        {"role": "user", "content": "Thanks"}
    ]));
    request.tools = Some(serde_json::json!([{"type": "function", "function": {
        "name": "get_weather", "description": "Weather for a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}]));
    request.add_generation_prompt = true;
    let n = 200;
    let t = Instant::now();
    for _ in 0..n {
        template.render(&request)?;
    }
    println!(
        "ChatTemplate::render (tools, 5 messages): {:.1} µs",
        t.elapsed().as_secs_f64() * 1e6 / n as f64
    );
    Ok(())
}
