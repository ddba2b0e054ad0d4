//! Structured output at the API: reading the request's constraint (`response_format`, vLLM's
//! `structured_outputs` and its older `guided_*` fields, a forced `tool_choice`), compiling it with
//! llguidance off the async runtime (a constraint llguidance cannot compile is a 400 before any token),
//! and one grammar matcher per choice for the engine.
//!
//! The grammar compiler (the token trie over the vocabulary) is built once, in the background as soon
//! as the model is ready; the first constrained request waits for it if it is not done yet.

use std::sync::{Arc, OnceLock};

use sanmai_engine::api::OutputConstraint;
use sanmai_structured::{
    CompiledGrammar, Constraint, GrammarCompiler, StructuredError, ToolSyntax,
};
use sanmai_tokenizer::Tokenizer;
use serde::Deserialize;
use serde_json::{json, Value};

use crate::error::ApiError;
use crate::output::ToolFormat;
use crate::task::blocking;

/// The structured-output fields of a request body (chat and completions).
#[derive(Debug, Clone, Default, Deserialize)]
pub struct StructuredFields {
    pub response_format: Option<Value>,
    pub structured_outputs: Option<Value>,
    pub guided_json: Option<Value>,
    pub guided_regex: Option<String>,
    pub guided_choice: Option<Vec<String>>,
    pub guided_grammar: Option<String>,
}

/// A constraint and the request field it came from (named in errors).
#[derive(Debug, Clone, PartialEq)]
pub struct Requested {
    pub constraint: Constraint,
    pub param: &'static str,
}

/// `tool_choice`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    Auto,
    None,
    /// Some tool must be called.
    Required,
    /// This tool must be called.
    Named(String),
}

/// Reads `tool_choice`.
pub fn tool_choice(v: Option<&Value>) -> Result<ToolChoice, ApiError> {
    let bad = || {
        ApiError::invalid(
            "tool_choice",
            "tool_choice must be \"auto\", \"none\", \"required\" or {\"type\": \"function\", \"function\": {\"name\": ...}}",
        )
    };
    match v {
        None | Some(Value::Null) => Ok(ToolChoice::Auto),
        Some(Value::String(s)) => match s.as_str() {
            "auto" => Ok(ToolChoice::Auto),
            "none" => Ok(ToolChoice::None),
            "required" => Ok(ToolChoice::Required),
            _ => Err(bad()),
        },
        Some(Value::Object(o)) => {
            let name = o
                .get("function")
                .and_then(|f| f.get("name"))
                .or_else(|| o.get("name"))
                .and_then(Value::as_str)
                .filter(|n| !n.is_empty());
            match (
                o.get("type").and_then(Value::as_str).unwrap_or("function"),
                name,
            ) {
                ("function", Some(n)) => Ok(ToolChoice::Named(n.to_string())),
                _ => Err(bad()),
            }
        }
        Some(_) => Err(bad()),
    }
}

/// The forced tool call of a `tool_choice`, if it forces one.
pub fn tool_constraint(
    choice: &ToolChoice,
    tools: &[Value],
    format: ToolFormat,
) -> Result<Option<Requested>, ApiError> {
    let name = match choice {
        ToolChoice::Auto | ToolChoice::None => return Ok(None),
        ToolChoice::Required => None,
        ToolChoice::Named(n) => Some(n.clone()),
    };
    if tools.is_empty() {
        return Err(ApiError::invalid(
            "tool_choice",
            "tool_choice forces a tool call, but `tools` is empty",
        ));
    }
    if let Some(n) = &name {
        let known = tools.iter().any(|t| {
            t.get("function")
                .and_then(|f| f.get("name"))
                .and_then(Value::as_str)
                == Some(n)
        });
        if !known {
            return Err(ApiError::invalid(
                "tool_choice",
                format!("tool_choice names the function {n:?}, which is not in `tools`"),
            ));
        }
    }
    let syntax = match format {
        ToolFormat::Qwen3Xml => ToolSyntax::Xml,
        ToolFormat::Qwen3Json => ToolSyntax::Json,
    };
    Ok(Some(Requested {
        constraint: Constraint::ToolCall {
            tools: tools.to_vec(),
            syntax,
            name,
        },
        param: "tool_choice",
    }))
}

fn schema_value(v: &Value, param: &'static str) -> Result<Value, ApiError> {
    match v {
        // A schema may come as a JSON string.
        Value::String(s) => serde_json::from_str(s).map_err(|e| {
            ApiError::invalid(param, format!("`{param}` is not a valid JSON schema: {e}"))
        }),
        Value::Object(_) | Value::Bool(_) => Ok(v.clone()),
        _ => Err(ApiError::invalid(
            param,
            format!("`{param}` must be a JSON schema object"),
        )),
    }
}

fn response_format(v: &Value) -> Result<Option<Requested>, ApiError> {
    let param = "response_format";
    let Value::Object(o) = v else {
        return Err(ApiError::invalid(
            param,
            "response_format must be an object",
        ));
    };
    let constraint = match o.get("type").and_then(Value::as_str) {
        None | Some("text") => return Ok(None),
        Some("json_object") => Constraint::JsonObject,
        Some("json_schema") => {
            let spec = o.get("json_schema").ok_or_else(|| {
                ApiError::invalid(
                    "response_format.json_schema",
                    "response_format of type json_schema needs a `json_schema` object",
                )
            })?;
            let schema = match spec.get("schema") {
                Some(s) => schema_value(s, "response_format.json_schema.schema")?,
                // A schema without constraints: any JSON value.
                None => json!({}),
            };
            // `strict: true` asks for exact adherence: a keyword that cannot be enforced is a 400.
            if spec.get("strict").and_then(Value::as_bool) == Some(true) {
                Constraint::JsonSchema(schema)
            } else {
                Constraint::JsonSchemaBestEffort(schema)
            }
        }
        Some(other) => {
            return Err(ApiError::invalid(
                "response_format.type",
                format!("response_format type must be \"text\", \"json_object\" or \"json_schema\", got {other:?}"),
            ))
        }
    };
    Ok(Some(Requested { constraint, param }))
}

fn string_list(v: &Value, param: &'static str) -> Result<Vec<String>, ApiError> {
    v.as_array()
        .and_then(|a| a.iter().map(|c| c.as_str().map(str::to_string)).collect())
        .ok_or_else(|| ApiError::invalid(param, format!("`{param}` must be a list of strings")))
}

fn structured_outputs(v: &Value) -> Result<Option<Requested>, ApiError> {
    let param = "structured_outputs";
    let Value::Object(o) = v else {
        return Err(ApiError::invalid(
            param,
            "structured_outputs must be an object",
        ));
    };
    let mut found = Vec::new();
    for (k, val) in o {
        if val.is_null() || val == &Value::Bool(false) {
            continue;
        }
        let c = match k.as_str() {
            "json" => Constraint::JsonSchema(schema_value(val, "structured_outputs.json")?),
            "json_object" => Constraint::JsonObject,
            "regex" => Constraint::Regex(
                val.as_str()
                    .ok_or_else(|| ApiError::invalid("structured_outputs.regex", "`regex` must be a string"))?
                    .to_string(),
            ),
            "choice" => Constraint::Choice(string_list(val, "structured_outputs.choice")?),
            "grammar" => Constraint::Lark(
                val.as_str()
                    .ok_or_else(|| ApiError::invalid("structured_outputs.grammar", "`grammar` must be a string"))?
                    .to_string(),
            ),
            // Options that do not choose a constraint.
            "disable_fallback" | "disable_any_whitespace" | "disable_additional_properties"
            | "whitespace_pattern" | "backend" => continue,
            other => {
                return Err(ApiError::invalid(
                    param,
                    format!("structured_outputs.{other} is not supported (use json, json_object, regex, choice or grammar)"),
                ))
            }
        };
        found.push(c);
    }
    match found.len() {
        0 => Ok(None),
        1 => Ok(Some(Requested {
            constraint: found.remove(0),
            param,
        })),
        _ => Err(ApiError::invalid(
            param,
            "structured_outputs must choose exactly one of json, json_object, regex, choice and grammar",
        )),
    }
}

/// The output constraint a body asks for (besides a forced tool call); more than one is a 400.
pub fn requested(f: &StructuredFields) -> Result<Option<Requested>, ApiError> {
    let mut all = Vec::new();
    if let Some(v) = &f.response_format {
        all.extend(response_format(v)?);
    }
    if let Some(v) = &f.structured_outputs {
        all.extend(structured_outputs(v)?);
    }
    if let Some(v) = &f.guided_json {
        all.push(Requested {
            constraint: Constraint::JsonSchema(schema_value(v, "guided_json")?),
            param: "guided_json",
        });
    }
    if let Some(r) = &f.guided_regex {
        all.push(Requested {
            constraint: Constraint::Regex(r.clone()),
            param: "guided_regex",
        });
    }
    if let Some(c) = &f.guided_choice {
        all.push(Requested {
            constraint: Constraint::Choice(c.clone()),
            param: "guided_choice",
        });
    }
    if let Some(g) = &f.guided_grammar {
        all.push(Requested {
            constraint: Constraint::Lark(g.clone()),
            param: "guided_grammar",
        });
    }
    if all.len() > 1 {
        return Err(ApiError::invalid(
            all[1].param,
            format!(
                "only one output constraint may be given, but both `{}` and `{}` are set",
                all[0].param, all[1].param
            ),
        ));
    }
    Ok(all.pop())
}

/// The grammar compiler of the served tokenizer, built once.
#[derive(Clone, Default)]
pub struct Compilers {
    cell: Arc<OnceLock<Result<GrammarCompiler, String>>>,
}

impl Compilers {
    /// Builds the compiler (blocking: hundreds of milliseconds for a large vocabulary); later calls
    /// return the same one.
    pub fn get(&self, tok: &Tokenizer) -> Result<GrammarCompiler, String> {
        self.cell
            .get_or_init(|| {
                let started = std::time::Instant::now();
                let c = GrammarCompiler::new(tok).map_err(|e| e.to_string());
                match &c {
                    Ok(c) => tracing::info!(
                        vocab = c.vocab_size(),
                        seconds = started.elapsed().as_secs_f64(),
                        "structured output: token trie built"
                    ),
                    Err(e) => tracing::warn!(error = %e, "structured output is unavailable"),
                }
                c
            })
            .clone()
    }
}

/// A compiled constraint, ready to hand one matcher to each choice.
pub struct Prepared {
    pub grammar: CompiledGrammar,
    /// The constraint starts after these tokens (`</think>` when the prompt opens reasoning).
    pub activate_after: Vec<u32>,
}

impl Prepared {
    pub fn for_choice(&self) -> OutputConstraint {
        OutputConstraint {
            matcher: self.grammar.matcher(),
            activate_after: self.activate_after.clone(),
        }
    }
}

/// Compiles `req` on a blocking thread. `after_think` makes the constraint start after `</think>`.
pub async fn compile(
    compilers: &Compilers,
    tokenizer: Option<&Tokenizer>,
    req: Requested,
    after_think: bool,
) -> Result<Prepared, ApiError> {
    let tok = tokenizer
        .ok_or_else(|| {
            ApiError::invalid(req.param, "structured output needs the model's tokenizer")
        })?
        .clone();
    let compilers = compilers.clone();
    blocking(move || {
        let compiler = compilers.get(&tok).map_err(|e| {
            ApiError::invalid(req.param, format!("structured output is unavailable: {e}"))
        })?;
        let grammar = compiler.compile(&req.constraint).map_err(|e| match e {
            StructuredError::Invalid(m) => ApiError::invalid(req.param, m),
            other => ApiError::invalid(req.param, format!("invalid `{}`: {other}", req.param)),
        })?;
        let activate_after = if after_think {
            tok.encode("</think>", false)
                .map_err(|e| ApiError::internal(e.to_string()))?
        } else {
            Vec::new()
        };
        Ok(Prepared {
            grammar,
            activate_after,
        })
    })
    .await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_choose_one_constraint() {
        let f = StructuredFields {
            response_format: Some(
                json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}),
            ),
            ..Default::default()
        };
        assert_eq!(
            requested(&f).unwrap().unwrap().constraint,
            Constraint::JsonSchemaBestEffort(json!({"type": "object"}))
        );
        let f = StructuredFields {
            response_format: Some(
                json!({"type": "json_schema", "json_schema": {"name": "x", "strict": true, "schema": {"type": "object"}}}),
            ),
            ..Default::default()
        };
        assert_eq!(
            requested(&f).unwrap().unwrap().constraint,
            Constraint::JsonSchema(json!({"type": "object"}))
        );
        let f = StructuredFields {
            structured_outputs: Some(json!({"choice": ["a", "b"]})),
            ..Default::default()
        };
        assert_eq!(
            requested(&f).unwrap().unwrap().constraint,
            Constraint::Choice(vec!["a".into(), "b".into()])
        );
        let f = StructuredFields {
            response_format: Some(json!({"type": "json_object"})),
            guided_regex: Some("a+".into()),
            ..Default::default()
        };
        assert!(requested(&f).is_err());
        let f = StructuredFields {
            response_format: Some(json!({"type": "text"})),
            ..Default::default()
        };
        assert!(requested(&f).unwrap().is_none());
        let f = StructuredFields {
            response_format: Some(json!({"type": "yaml"})),
            ..Default::default()
        };
        assert!(requested(&f).is_err());
    }

    #[test]
    fn tool_choice_forms() {
        assert_eq!(tool_choice(None).unwrap(), ToolChoice::Auto);
        assert_eq!(
            tool_choice(Some(&json!("required"))).unwrap(),
            ToolChoice::Required
        );
        assert_eq!(
            tool_choice(Some(
                &json!({"type": "function", "function": {"name": "f"}})
            ))
            .unwrap(),
            ToolChoice::Named("f".into())
        );
        assert!(tool_choice(Some(&json!("maybe"))).is_err());
        assert!(tool_choice(Some(&json!(3))).is_err());
        let tools = [json!({"type": "function", "function": {"name": "f"}})];
        assert!(
            tool_constraint(&ToolChoice::Named("g".into()), &tools, ToolFormat::Qwen3Xml).is_err()
        );
        assert!(tool_constraint(&ToolChoice::Required, &[], ToolFormat::Qwen3Xml).is_err());
        assert!(
            tool_constraint(&ToolChoice::Auto, &tools, ToolFormat::Qwen3Xml)
                .unwrap()
                .is_none()
        );
    }
}
