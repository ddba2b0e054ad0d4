//! Preparing OpenAI chat messages for a template: content-part arrays, tool-call arguments, and
//! the conversion of JSON into template values.

use minijinja::value::Value;
use serde_json::Value as Json;

use crate::error::{Result, TokenizerError};

/// How a template expects `message.content`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ContentFormat {
    /// A plain string: content-part arrays are flattened to their text parts joined by `"\n"`
    /// (other parts, such as images, are dropped) and a null content becomes `""`.
    String,
    /// The template iterates over content parts itself: arrays are passed through unchanged.
    OpenAi,
}

impl ContentFormat {
    /// Guesses the format from the template source: a `for` loop over something named
    /// `content` (`for x in content`, `message.content`, `message['content']`) means the template
    /// handles content-part arrays.
    pub fn detect(source: &str) -> ContentFormat {
        let mut rest = source;
        while let Some(start) = rest.find("{%") {
            let after = &rest[start + 2..];
            let end = after.find("%}").unwrap_or(after.len());
            let tag =
                after[..end].trim_matches(|c: char| c == '-' || c == '+' || c.is_whitespace());
            if let Some(body) = tag.strip_prefix("for") {
                if body.starts_with(char::is_whitespace) && iterates_content(body) {
                    return ContentFormat::OpenAi;
                }
            }
            rest = &after[end..];
        }
        ContentFormat::String
    }
}

/// `body` is what follows `for` in a tag: `item in message['content'] if ...`.
fn iterates_content(body: &str) -> bool {
    let Some((_, iterable)) = body.split_once(" in ") else {
        return false;
    };
    let expr = iterable
        .split(" if ")
        .next()
        .unwrap_or("")
        .trim()
        .trim_end_matches("recursive")
        .trim();
    let expr =
        expr.trim_end_matches(|c: char| c == ']' || c == '\'' || c == '"' || c.is_whitespace());
    expr == "content"
        || expr.ends_with(".content")
        || expr.ends_with("[content")
        || expr.ends_with("['content")
        || expr.ends_with("[\"content")
}

/// Returns `messages` ready for rendering: tool-call `function.arguments` JSON strings decoded
/// into objects, and content shaped for `format`.
pub fn normalize_messages(messages: &Json, format: ContentFormat) -> Result<Json> {
    let Json::Array(list) = messages else {
        return Err(TokenizerError::InvalidRequest(
            "`messages` must be an array".into(),
        ));
    };
    let mut out = Vec::with_capacity(list.len());
    for (i, message) in list.iter().enumerate() {
        let Json::Object(map) = message else {
            return Err(TokenizerError::InvalidRequest(format!(
                "messages[{i}] must be an object"
            )));
        };
        let mut map = map.clone();
        if format == ContentFormat::String {
            if let Some(content) = map.get_mut("content") {
                flatten_content(content);
            }
        }
        if let Some(Json::Array(calls)) = map.get_mut("tool_calls") {
            for call in calls.iter_mut() {
                decode_arguments(call);
            }
        }
        out.push(Json::Object(map));
    }
    Ok(Json::Array(out))
}

/// Content parts → their text joined by newlines; null → "".
fn flatten_content(content: &mut Json) {
    match content {
        Json::Null => *content = Json::String(String::new()),
        Json::Array(parts) => {
            let texts: Vec<&str> = parts.iter().filter_map(part_text).collect();
            *content = Json::String(texts.join("\n"));
        }
        _ => {}
    }
}

/// The text of a content part: a string, or an object with a string `text` whose `type` is
/// absent or one of `text`, `input_text`, `output_text`.
fn part_text(part: &Json) -> Option<&str> {
    match part {
        Json::String(s) => Some(s),
        Json::Object(map) => {
            let kind = map.get("type").and_then(Json::as_str);
            match kind {
                None | Some("text") | Some("input_text") | Some("output_text") => {
                    map.get("text").and_then(Json::as_str)
                }
                _ => None,
            }
        }
        _ => None,
    }
}

/// `arguments` given as a JSON string holding an object becomes that object (in
/// `call.function.arguments` and in a flat `call.arguments`).
fn decode_arguments(call: &mut Json) {
    let decode = |args: &mut Json| {
        if let Json::String(text) = args {
            if let Ok(parsed @ Json::Object(_)) = serde_json::from_str::<Json>(text) {
                *args = parsed;
            }
        }
    };
    if let Some(args) = call
        .get_mut("function")
        .and_then(|f| f.get_mut("arguments"))
    {
        decode(args);
    }
    if let Some(args) = call.get_mut("arguments") {
        decode(args);
    }
}

/// Converts JSON into a template value, keeping key order and the integer/float distinction.
pub fn json_to_value(json: &Json) -> Value {
    match json {
        Json::Null => Value::from(()),
        Json::Bool(b) => Value::from(*b),
        Json::Number(n) => {
            if let Some(i) = n.as_i64() {
                Value::from(i)
            } else if let Some(u) = n.as_u64() {
                Value::from(u)
            } else {
                Value::from(n.as_f64().unwrap_or(f64::NAN))
            }
        }
        Json::String(s) => Value::from(s.as_str()),
        Json::Array(items) => items.iter().map(json_to_value).collect(),
        Json::Object(map) => Value::from_pairs(
            map.iter()
                .map(|(k, v)| (Value::from(k.as_str()), json_to_value(v))),
        ),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn detects_templates_that_iterate_content() {
        assert_eq!(
            ContentFormat::detect("{%- for item in content %}{{ item.text }}{% endfor %}"),
            ContentFormat::OpenAi
        );
        assert_eq!(
            ContentFormat::detect(
                "{% for part in message['content'] if part.type == 'text' %}{% endfor %}"
            ),
            ContentFormat::OpenAi
        );
        assert_eq!(
            ContentFormat::detect("{% for m in messages %}{{ m.content }}{% endfor %}"),
            ContentFormat::String
        );
    }

    #[test]
    fn flattens_parts_and_decodes_arguments() {
        let messages = json!([
            {"role": "user", "content": [
                {"type": "text", "text": "a"},
                {"type": "image_url", "image_url": {"url": "x"}},
                {"type": "text", "text": "b"}
            ]},
            {"role": "assistant", "content": null, "tool_calls": [
                {"type": "function", "function": {"name": "f", "arguments": "{\"x\": 1, \"y\": [2]}"}},
                {"type": "function", "function": {"name": "g", "arguments": "not json"}}
            ]}
        ]);
        let out = normalize_messages(&messages, ContentFormat::String).unwrap();
        assert_eq!(out[0]["content"], json!("a\nb"));
        assert_eq!(out[1]["content"], json!(""));
        assert_eq!(
            out[1]["tool_calls"][0]["function"]["arguments"],
            json!({"x": 1, "y": [2]})
        );
        assert_eq!(
            out[1]["tool_calls"][1]["function"]["arguments"],
            json!("not json")
        );

        let out = normalize_messages(&messages, ContentFormat::OpenAi).unwrap();
        assert_eq!(out[0]["content"], messages[0]["content"]);
        assert_eq!(out[1]["content"], Json::Null);
        assert!(normalize_messages(&json!({"role": "user"}), ContentFormat::String).is_err());
    }
}
