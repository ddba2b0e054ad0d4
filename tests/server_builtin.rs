//! The trained built-in model (served by default): short, on-topic replies that end by themselves.

mod server_support;

use serde_json::json;
use server_support::{chat, ServerProc};

#[test]
fn the_default_model_greets_back_and_stops_by_itself() {
    let s = ServerProc::start(&["--load-format", "auto"]);
    for thinking in [true, false] {
        let body = chat(
            "Hello!",
            json!({"temperature": 0, "chat_template_kwargs": {"enable_thinking": thinking}}),
        );
        let (status, v) = s.post("/v1/chat/completions", &body);
        assert_eq!(status, 200, "{v}");
        let choice = &v["choices"][0];
        assert_eq!(choice["finish_reason"], "stop", "{v}");
        let content = choice["message"]["content"].as_str().unwrap();
        assert!(content.starts_with("Hello"), "{v}");
        assert!(
            v["usage"]["completion_tokens"].as_u64().unwrap() < 64,
            "{v}"
        );
        // Thinking on: the reply opened with a short reasoning block.
        assert_eq!(
            choice["message"]["reasoning_content"].is_string(),
            thinking,
            "{v}"
        );
    }
}
