//! Chat templates: Jinja templates rendered with minijinja, set up to behave like
//! transformers' `apply_chat_template` (Jinja2 with `trim_blocks`, `lstrip_blocks`, loop
//! controls, `raise_exception`, `strftime_now`, a `tojson` that is Python's `json.dumps`, Python
//! string methods, and Python's way of printing values).
//!
//! Known differences from Jinja2: the `~` operator prints booleans and none the minijinja way
//! (`true`, `none`; `{{ x }}` and `x | string` print `True`, `None` like Python);
//! `strftime_now` formats UTC time; transformers' `{% generation %}` markers are accepted and
//! ignored. Templates receive `messages`, `tools`, `documents` (none), `add_generation_prompt`,
//! `bos_token`/`eos_token` when known, and the request's extra kwargs.

pub mod messages;
pub mod python;

use std::sync::Arc;

use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Kwargs, Rest, Value, ValueKind};
use minijinja::{Environment, Error as JinjaError, ErrorKind};
use serde_json::{Map, Value as Json};

use crate::error::{Result, TokenizerError};
pub use messages::ContentFormat;
use messages::{json_to_value, normalize_messages};
use python::{json_dumps, py_str, strftime, CivilTime, JsonOptions};

const TEMPLATE_NAME: &str = "chat_template";
/// Prefix marking the detail of an error made by `raise_exception`.
const RAISED: &str = "\u{1}raise_exception:";
/// Context names that `kwargs` may not replace.
const RESERVED: [&str; 4] = ["messages", "tools", "documents", "add_generation_prompt"];

/// What to render: the OpenAI request's messages and tools plus template variables.
#[derive(Debug, Clone, Default)]
pub struct RenderRequest {
    /// The `messages` array of an OpenAI chat request.
    pub messages: Json,
    /// The `tools` array, if any.
    pub tools: Option<Json>,
    /// End with the opening of an assistant turn.
    pub add_generation_prompt: bool,
    /// Extra top-level template variables (`chat_template_kwargs`: `enable_thinking`, ...).
    pub kwargs: Map<String, Json>,
    pub bos_token: Option<String>,
    pub eos_token: Option<String>,
}

/// A compiled chat template. Cloning is cheap (shared).
#[derive(Clone)]
pub struct ChatTemplate {
    inner: Arc<Inner>,
}

struct Inner {
    env: Environment<'static>,
    source: String,
    content_format: ContentFormat,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("content_format", &self.inner.content_format)
            .field("source_len", &self.inner.source.len())
            .finish()
    }
}

impl ChatTemplate {
    /// Compiles a template. The content format is detected from the source (see
    /// [`ContentFormat::detect`]).
    pub fn new(source: &str) -> Result<ChatTemplate> {
        Self::with_content_format(source, ContentFormat::detect(source))
    }

    /// Compiles a template with a given content format.
    pub fn with_content_format(
        source: &str,
        content_format: ContentFormat,
    ) -> Result<ChatTemplate> {
        let mut env = Environment::new();
        let mut syntax = SyntaxConfig::builder();
        syntax
            .trim_blocks(true)
            .lstrip_blocks(true)
            .keep_trailing_newline(false);
        env.set_syntax(
            syntax
                .build()
                .map_err(|e| TokenizerError::TemplateSyntax(e.to_string()))?,
        );
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_formatter(|out, _state, value| {
            if value.kind() == ValueKind::Invalid {
                return Err(JinjaError::new(
                    ErrorKind::InvalidOperation,
                    value.to_string(),
                ));
            }
            out.write_str(&py_str(value)).map_err(JinjaError::from)
        });
        env.add_filter("tojson", tojson);
        env.add_filter("string", |v: &Value| Value::from(py_str(v)));
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned(TEMPLATE_NAME, strip_generation_tags(source))
            .map_err(|e| TokenizerError::TemplateSyntax(describe(&e)))?;
        Ok(ChatTemplate {
            inner: Arc::new(Inner {
                env,
                source: source.to_string(),
                content_format,
            }),
        })
    }

    /// The template text as given.
    pub fn source(&self) -> &str {
        &self.inner.source
    }

    /// How `message.content` is prepared for this template.
    pub fn content_format(&self) -> ContentFormat {
        self.inner.content_format
    }

    /// Renders a conversation. Content-part arrays are flattened (for templates that do not
    /// iterate content) and tool-call argument strings decoded before rendering; a
    /// `raise_exception(msg)` in the template becomes [`TokenizerError::TemplateRaised`].
    pub fn render(&self, request: &RenderRequest) -> Result<String> {
        let messages = normalize_messages(&request.messages, self.inner.content_format)?;
        let mut ctx: Vec<(String, Value)> = Vec::with_capacity(8 + request.kwargs.len());
        let token = |t: &Option<String>| t.as_deref().map(Value::from);
        if let Some(bos) = token(&request.bos_token) {
            ctx.push(("bos_token".into(), bos));
        }
        if let Some(eos) = token(&request.eos_token) {
            ctx.push(("eos_token".into(), eos));
        }
        for (key, value) in &request.kwargs {
            if !RESERVED.contains(&key.as_str()) {
                ctx.retain(|(k, _)| k != key);
                ctx.push((key.clone(), json_to_value(value)));
            }
        }
        ctx.push(("messages".into(), json_to_value(&messages)));
        ctx.push((
            "tools".into(),
            request
                .tools
                .as_ref()
                .map_or(Value::from(()), json_to_value),
        ));
        ctx.push(("documents".into(), Value::from(())));
        ctx.push((
            "add_generation_prompt".into(),
            Value::from(request.add_generation_prompt),
        ));
        let template = self
            .inner
            .env
            .get_template(TEMPLATE_NAME)
            .map_err(|e| TokenizerError::TemplateSyntax(describe(&e)))?;
        template
            .render(Value::from_pairs(ctx))
            .map_err(|e| match raised_message(&e) {
                Some(msg) => TokenizerError::TemplateRaised(msg),
                None => TokenizerError::TemplateRender(describe(&e)),
            })
    }
}

/// Replaces transformers' `{% generation %}` / `{% endgeneration %}` markers (assistant-mask
/// tracking) by equivalent no-op blocks, keeping their whitespace control.
fn strip_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(start) = rest.find("{%") {
        out.push_str(&rest[..start]);
        let after = &rest[start + 2..];
        let Some(end) = after.find("%}") else {
            out.push_str(&rest[start..]);
            return out;
        };
        let inner = &after[..end];
        let lead = inner.chars().next().filter(|c| *c == '-' || *c == '+');
        let trail = inner.chars().last().filter(|c| *c == '-' || *c == '+');
        let word = inner.trim_matches(|c: char| c == '-' || c == '+' || c.is_whitespace());
        let replacement = match word {
            "generation" => Some("if true"),
            "endgeneration" => Some("endif"),
            _ => None,
        };
        match replacement {
            Some(r) => {
                out.push_str("{%");
                out.extend(lead);
                out.push(' ');
                out.push_str(r);
                out.push(' ');
                out.extend(trail);
                out.push_str("%}");
            }
            None => {
                out.push_str("{%");
                out.push_str(inner);
                out.push_str("%}");
            }
        }
        rest = &after[end + 2..];
    }
    out.push_str(rest);
    out
}

/// `tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False)`, the
/// filter transformers installs (Python's `json.dumps`, no HTML escaping).
fn tojson(
    value: &Value,
    args: Rest<Value>,
    kwargs: Kwargs,
) -> std::result::Result<Value, JinjaError> {
    let names = ["ensure_ascii", "indent", "separators", "sort_keys"];
    if args.len() > names.len() {
        return Err(JinjaError::new(
            ErrorKind::TooManyArguments,
            "tojson takes at most 4 arguments",
        ));
    }
    let arg = |i: usize| -> std::result::Result<Option<Value>, JinjaError> {
        if let Some(v) = args.get(i) {
            return Ok(Some(v.clone()));
        }
        let v: Option<Value> = kwargs.get(names[i])?;
        Ok(v)
    };
    let mut opts = JsonOptions::default();
    if let Some(v) = arg(0)? {
        opts.ensure_ascii = v.is_true();
    }
    if let Some(v) = arg(1)? {
        opts.indent = match v.kind() {
            ValueKind::None | ValueKind::Undefined => None,
            ValueKind::String => Some(v.as_str().unwrap_or_default().to_string()),
            ValueKind::Number => {
                let n = v
                    .as_i64()
                    .ok_or_else(|| bad_arg("indent must be an integer"))?;
                Some(" ".repeat(n.max(0) as usize))
            }
            _ => return Err(bad_arg("indent must be an integer or a string")),
        };
        if opts.indent.is_some() {
            opts.item_separator = ",".to_string();
        }
    }
    if let Some(v) = arg(2)? {
        if !v.is_none() && !v.is_undefined() {
            let parts: Vec<Value> = v.try_iter()?.collect();
            match parts.as_slice() {
                [item, key] if item.as_str().is_some() && key.as_str().is_some() => {
                    opts.item_separator = item.as_str().unwrap_or_default().to_string();
                    opts.key_separator = key.as_str().unwrap_or_default().to_string();
                }
                _ => return Err(bad_arg("separators must be a pair of strings")),
            }
        }
    }
    if let Some(v) = arg(3)? {
        opts.sort_keys = v.is_true();
    }
    kwargs.assert_all_used()?;
    json_dumps(value, &opts)
        .map(Value::from_safe_string)
        .map_err(|e| JinjaError::new(ErrorKind::InvalidOperation, e))
}

fn bad_arg(msg: &str) -> JinjaError {
    JinjaError::new(ErrorKind::InvalidOperation, msg.to_string())
}

fn raise_exception(message: Value) -> std::result::Result<Value, JinjaError> {
    Err(JinjaError::new(
        ErrorKind::InvalidOperation,
        format!("{RAISED}{}", py_str(&message)),
    ))
}

fn strftime_now(format: &str) -> String {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64);
    strftime(&CivilTime::from_unix(secs), format)
}

/// The message of a `raise_exception` anywhere in the error chain.
fn raised_message(err: &JinjaError) -> Option<String> {
    let mut current: Option<&(dyn std::error::Error + 'static)> = Some(err);
    while let Some(e) = current {
        if let Some(j) = e.downcast_ref::<JinjaError>() {
            if let Some(msg) = j.detail().and_then(|d| d.strip_prefix(RAISED)) {
                return Some(msg.to_string());
            }
        }
        current = e.source();
    }
    None
}

/// The error with its location and causes, on one line.
fn describe(err: &JinjaError) -> String {
    let mut text = match (err.detail(), err.line()) {
        (Some(detail), Some(line)) => format!("{} (line {line}): {detail}", err.kind()),
        (Some(detail), None) => format!("{}: {detail}", err.kind()),
        (None, Some(line)) => format!("{} (line {line})", err.kind()),
        (None, None) => err.kind().to_string(),
    };
    let mut source = std::error::Error::source(err);
    while let Some(e) = source {
        text.push_str(": ");
        text.push_str(&e.to_string());
        source = e.source();
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    fn render(source: &str, messages: Json) -> Result<String> {
        ChatTemplate::new(source)?.render(&RenderRequest {
            messages,
            ..Default::default()
        })
    }

    #[test]
    fn raise_exception_carries_the_message() {
        let err = render("{{ raise_exception('No messages provided.') }}", json!([])).unwrap_err();
        match err {
            TokenizerError::TemplateRaised(msg) => assert_eq!(msg, "No messages provided."),
            other => panic!("unexpected {other:?}"),
        }
        // Raised from inside a macro as well.
        let src = "{% macro m() %}{{ raise_exception('deep') }}{% endmacro %}{{ m() }}";
        assert!(
            matches!(render(src, json!([])), Err(TokenizerError::TemplateRaised(m)) if m == "deep")
        );
    }

    #[test]
    fn tojson_is_python_json_dumps() {
        let src = "{{ messages[0] | tojson }}|{{ messages[0] | tojson(indent=2) }}|{{ messages[0] | tojson(separators=(',', ':'), sort_keys=true) }}";
        let out = render(src, json!([{"z": "<é>", "a": [1, 2.0]}])).unwrap();
        assert_eq!(
            out,
            "{\"z\": \"<é>\", \"a\": [1, 2.0]}|{\n  \"z\": \"<é>\",\n  \"a\": [\n    1,\n    2.0\n  ]\n}|{\"a\":[1,2.0],\"z\":\"<é>\"}"
        );
    }

    #[test]
    fn values_print_like_python() {
        let out = render(
            "{{ true }} {{ none }} {{ 1.0 }} {{ messages }} {{ false | string }}",
            json!([{"a": null}]),
        )
        .unwrap();
        assert_eq!(out, "True None 1.0 [{'a': None}] False");
    }

    #[test]
    fn whitespace_follows_trim_and_lstrip_blocks() {
        let src =
            "{% for m in messages %}\n    {% if m %}\n{{ m.c }}\n    {% endif %}\n{% endfor %}\n";
        assert_eq!(
            render(src, json!([{"c": "a"}, {"c": "b"}])).unwrap(),
            "a\nb\n"
        );
    }

    #[test]
    fn generation_markers_are_ignored() {
        let src =
            "{% for m in messages %}{%- generation -%} {{ m.c }} {%- endgeneration %}{% endfor %}";
        assert_eq!(render(src, json!([{"c": "a"}, {"c": "b"}])).unwrap(), "ab");
    }

    #[test]
    fn kwargs_become_variables_but_cannot_replace_messages() {
        let t = ChatTemplate::new("{{ enable_thinking }} {{ messages | length }} {{ eos_token }}")
            .unwrap();
        let mut kwargs = Map::new();
        kwargs.insert("enable_thinking".into(), json!(false));
        kwargs.insert("messages".into(), json!("x"));
        let out = t
            .render(&RenderRequest {
                messages: json!([{}, {}]),
                kwargs,
                eos_token: Some("</s>".into()),
                ..Default::default()
            })
            .unwrap();
        assert_eq!(out, "False 2 </s>");
    }

    #[test]
    fn syntax_errors_are_reported() {
        assert!(matches!(
            ChatTemplate::new("{% for %}"),
            Err(TokenizerError::TemplateSyntax(_))
        ));
    }
}
