//! What a request constrains its output to, and the llguidance grammar each kind compiles to.
//!
//! JSON is generated compactly unless the schema says otherwise (an `x-guidance` block of its own): no free
//! whitespace between tokens, so a weak model cannot wander through the vocabulary's many whitespace
//! tokens. Choices and forced tool calls are written as Lark grammars.

use llguidance::api::TopLevelGrammar;
use serde_json::{json, Value};

use crate::error::{Result, StructuredError};
use crate::grammar::{compact_schema, lark_str};
use crate::toolcall::{tool_call_lark, ToolSyntax};

/// One request's output constraint.
#[derive(Debug, Clone, PartialEq)]
pub enum Constraint {
    /// Any JSON object (`response_format: {"type": "json_object"}`).
    JsonObject,
    /// JSON valid against `schema` (`response_format` `json_schema` with `strict: true`,
    /// `structured_outputs.json`); a keyword llguidance does not implement is an error.
    JsonSchema(Value),
    /// JSON following `schema` as far as llguidance implements it: unimplemented keywords and unknown
    /// formats are ignored and `oneOf` is read as `anyOf` (`response_format` `json_schema` without
    /// `strict`). Schemas that are wrong or unsatisfiable are still errors.
    JsonSchemaBestEffort(Value),
    /// Text matching a regular expression (Rust `regex` syntax, matched as a whole).
    Regex(String),
    /// Exactly one of these strings.
    Choice(Vec<String>),
    /// A Lark grammar in llguidance's dialect.
    Lark(String),
    /// One call of one of `tools` (OpenAI `{"type": "function", "function": {...}}` entries, or bare
    /// function objects) in the model's syntax, its arguments valid against the tool's `parameters`;
    /// `name` picks the tool (`tool_choice` naming a function), `None` allows any (`"required"`).
    ToolCall {
        tools: Vec<Value>,
        syntax: ToolSyntax,
        name: Option<String>,
    },
}

impl Constraint {
    /// The llguidance grammar of this constraint (not compiled yet).
    pub fn to_grammar(&self) -> Result<TopLevelGrammar> {
        Ok(match self {
            Constraint::JsonObject => {
                TopLevelGrammar::from_json_schema(compact_schema(&json!({"type": "object"}), false))
            }
            Constraint::JsonSchema(schema) | Constraint::JsonSchemaBestEffort(schema) => {
                if !(schema.is_object() || schema.is_boolean()) {
                    return Err(StructuredError::Invalid(
                        "a JSON schema must be an object".into(),
                    ));
                }
                let lenient = matches!(self, Constraint::JsonSchemaBestEffort(_));
                TopLevelGrammar::from_json_schema(compact_schema(schema, lenient))
            }
            Constraint::Regex(rx) => TopLevelGrammar::from_regex(rx),
            Constraint::Choice(options) => {
                if options.is_empty() {
                    return Err(StructuredError::Invalid(
                        "a choice needs at least one option".into(),
                    ));
                }
                if options.iter().any(String::is_empty) {
                    return Err(StructuredError::Invalid(
                        "choice options must not be empty strings".into(),
                    ));
                }
                let alts: Vec<String> = options.iter().map(|o| lark_str(o)).collect();
                TopLevelGrammar::from_lark(format!("start: {}\n", alts.join(" | ")))
            }
            Constraint::Lark(g) => {
                if g.trim().is_empty() {
                    return Err(StructuredError::Invalid("the grammar is empty".into()));
                }
                TopLevelGrammar::from_lark(g.clone())
            }
            Constraint::ToolCall {
                tools,
                syntax,
                name,
            } => TopLevelGrammar::from_lark(tool_call_lark(tools, *syntax, name.as_deref())?),
        })
    }
}
