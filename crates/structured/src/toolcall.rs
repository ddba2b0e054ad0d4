//! Forced tool calls as Lark grammars, in the model's own syntax.
//!
//! XML (Qwen3.5 / Qwen3-Coder): `<tool_call>\n<function=NAME>\n`, then one
//! `<parameter=P>\nVALUE\n</parameter>\n` block per property of the tool's `parameters` in schema order
//! (required ones mandatory, the others optional), then `</function>\n</tool_call>`. A property whose
//! schema is a plain string (`"type": "string"`, a string `enum` or `const`) is written raw, as the chat
//! template writes it: any text without `</parameter>` that fits the schema's `minLength`, `maxLength`,
//! `pattern` or enum; every other value is compact JSON valid against the property's schema.
//!
//! JSON (Hermes): `<tool_call>\n{"name":"NAME","arguments":ARGS}\n</tool_call>` with `ARGS` valid
//! against `parameters`.
//!
//! Tool schemas are written for the agent, not for us: what llguidance does not implement is ignored
//! (`oneOf` is read as `anyOf`) rather than refused.
//!
//! With thinking the model may open its answer with a newline or two; the grammar allows them before
//! the call (no more: a weak model would repeat newlines forever).

use serde_json::{json, Map, Value};

use crate::error::{Result, StructuredError};
use crate::grammar::{compact_schema, lark_str};

/// The tool-call syntax of a model.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ToolSyntax {
    /// Qwen3.5 / Qwen3-Coder: `<tool_call>\n<function=NAME>\n<parameter=P>\nVALUE\n</parameter>\n</function>\n</tool_call>`.
    Xml,
    /// Hermes / Qwen2.5: `<tool_call>\n{"name": NAME, "arguments": {...}}\n</tool_call>`.
    Json,
}

const PARAM_CLOSE: &str = "\n</parameter>";

/// One tool: its name and parameters schema.
struct Tool<'a> {
    name: &'a str,
    parameters: Option<&'a Value>,
}

fn read_tool(t: &Value, i: usize) -> Result<Tool<'_>> {
    let f = t.get("function").unwrap_or(t);
    let name = f
        .get("name")
        .and_then(Value::as_str)
        .filter(|n| !n.is_empty())
        .ok_or_else(|| StructuredError::Invalid(format!("tools[{i}] has no function name")))?;
    if name.contains(['>', '<', '\n']) {
        return Err(StructuredError::Invalid(format!(
            "tools[{i}]: the function name {name:?} cannot be written in a tool call"
        )));
    }
    let parameters = f.get("parameters").filter(|p| !p.is_null());
    if let Some(p) = parameters {
        if !p.is_object() {
            return Err(StructuredError::Invalid(format!(
                "tools[{i}].function.parameters must be a JSON schema object"
            )));
        }
    }
    Ok(Tool { name, parameters })
}

/// The Lark grammar of one call of one of `tools` (of the one called `name`, if given).
pub fn tool_call_lark(tools: &[Value], syntax: ToolSyntax, name: Option<&str>) -> Result<String> {
    let mut all = Vec::with_capacity(tools.len());
    for (i, t) in tools.iter().enumerate() {
        all.push(read_tool(t, i)?);
    }
    let chosen: Vec<&Tool> = match name {
        Some(n) => {
            let t = all.iter().find(|t| t.name == n).ok_or_else(|| {
                StructuredError::Invalid(format!(
                    "tool_choice names {n:?}, which is not in `tools`"
                ))
            })?;
            vec![t]
        }
        None => all.iter().collect(),
    };
    if chosen.is_empty() {
        return Err(StructuredError::Invalid(
            "a tool call is required but `tools` is empty".into(),
        ));
    }
    let mut rules = String::new();
    let mut calls = Vec::new();
    for (i, t) in chosen.iter().enumerate() {
        let rule = format!("call_{i}");
        let body = match syntax {
            ToolSyntax::Xml => xml_call(t, i, &mut rules)?,
            ToolSyntax::Json => json_call(t)?,
        };
        rules.push_str(&format!("{rule}: {body}\n"));
        calls.push(rule);
    }
    Ok(format!(
        "start: LEAD? call\nLEAD: /\\n{{1,2}}/\ncall: {}\n{rules}",
        calls.join(" | ")
    ))
}

fn json_call(t: &Tool) -> Result<String> {
    let params = t
        .parameters
        .cloned()
        .unwrap_or_else(|| json!({"type": "object"}));
    let head = format!(
        "<tool_call>\n{{\"name\":{},\"arguments\":",
        Value::String(t.name.into())
    );
    Ok(format!(
        "{} %json {} {}",
        lark_str(&head),
        compact_schema(&params, true),
        lark_str("}\n</tool_call>")
    ))
}

fn xml_call(t: &Tool, i: usize, rules: &mut String) -> Result<String> {
    let mut parts = vec![lark_str(&format!("<tool_call>\n<function={}>\n", t.name))];
    if let Some(params) = t.parameters {
        let required: Vec<&str> = params
            .get("required")
            .and_then(Value::as_array)
            .map(|r| r.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        let defs = shared_definitions(params);
        if let Some(props) = params.get("properties").and_then(Value::as_object) {
            for (j, (p, schema)) in props.iter().enumerate() {
                if p.contains(['>', '<', '\n']) {
                    return Err(StructuredError::Invalid(format!(
                        "the parameter name {p:?} of {} cannot be written in a tool call",
                        t.name
                    )));
                }
                if schema == &Value::Bool(false) {
                    continue;
                }
                let rule = format!("param_{i}_{j}");
                let open = lark_str(&format!("<parameter={p}>\n"));
                let value = match raw_string_regex(schema)? {
                    Some(rx) => {
                        let term = format!("VALUE_{i}_{j}");
                        rules.push_str(&format!("{term}: {rx}\n"));
                        term
                    }
                    None => {
                        let mut s = compact_schema(schema, true);
                        if let (Value::Object(m), Some(d)) = (&mut s, &defs) {
                            for (k, v) in d {
                                m.entry(k.clone()).or_insert_with(|| v.clone());
                            }
                        }
                        format!("%json {s} {}", lark_str(PARAM_CLOSE))
                    }
                };
                rules.push_str(&format!("{rule}: {open} {value} {}\n", lark_str("\n")));
                let optional = if required.contains(&p.as_str()) {
                    ""
                } else {
                    "?"
                };
                parts.push(format!("{rule}{optional}"));
            }
        }
    }
    parts.push(lark_str("</function>\n</tool_call>"));
    Ok(parts.join(" "))
}

/// `$defs` / `definitions` of the parameters schema, for property schemas that refer to them.
fn shared_definitions(params: &Value) -> Option<Map<String, Value>> {
    let mut out = Map::new();
    for key in ["$defs", "definitions"] {
        if let Some(d) = params.get(key) {
            out.insert(key.to_string(), d.clone());
        }
    }
    (!out.is_empty()).then_some(out)
}

/// Escapes a literal for a regex inside a Lark `/.../` literal.
fn rx_escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '\\' | '.' | '+' | '*' | '?' | '(' | ')' | '|' | '[' | ']' | '{' | '}' | '^' | '$'
            | '#' | '&' | '-' | '~' | '/' => {
                out.push('\\');
                out.push(c);
            }
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            c => out.push(c),
        }
    }
    out
}

/// Text without `</parameter>` (lowered to a plain regex: split at each `<`, no piece after a `<` starts
/// with `/parameter>`).
fn no_close_tag() -> String {
    let w: Vec<char> = "/parameter>".chars().collect();
    let mut prefixes = String::new();
    for c in w.iter().take(w.len() - 1).rev() {
        prefixes = format!("(?:{}{prefixes})?", rx_escape(&c.to_string()));
    }
    let mut diverge = Vec::new();
    for i in 0..w.len() {
        let head: String = w[..i].iter().collect();
        diverge.push(format!(
            "{}[^{}<][^<]*",
            rx_escape(&head),
            rx_escape(&w[i].to_string())
        ));
    }
    format!("[^<]*(?:<(?:{}|{prefixes}))*", diverge.join("|"))
}

/// The terminal (value plus closing tag) of a property written raw, or `None` for a JSON value.
fn raw_string_regex(schema: &Value) -> Result<Option<String>> {
    let close = rx_escape(PARAM_CLOSE);
    let lit_alts = |vals: &[Value]| -> Option<String> {
        let lits: Option<Vec<String>> = vals.iter().map(|v| v.as_str().map(rx_escape)).collect();
        lits.filter(|l| !l.is_empty())
            .map(|l| format!("/(?:{}){close}/", l.join("|")))
    };
    if let Some(c) = schema.get("const") {
        return Ok(lit_alts(std::slice::from_ref(c)));
    }
    let is_string = match schema.get("type") {
        Some(Value::String(t)) => t == "string",
        Some(Value::Array(ts)) => ts.len() == 1 && ts[0] == "string",
        Some(_) => false,
        None => schema.get("enum").is_some(),
    };
    if !is_string {
        return Ok(None);
    }
    if let Some(Value::Array(vals)) = schema.get("enum") {
        return Ok(lit_alts(vals));
    }
    let mut terms = vec![format!("/{}{close}/", no_close_tag())];
    let min = schema.get("minLength").and_then(Value::as_u64);
    let max = schema.get("maxLength").and_then(Value::as_u64);
    if min.is_some() || max.is_some() {
        let (lo, hi) = (
            min.unwrap_or(0),
            max.map_or(String::new(), |m| m.to_string()),
        );
        if max.is_some_and(|m| m < lo) {
            return Err(StructuredError::Compile(format!(
                "minLength {lo} is above maxLength {hi}"
            )));
        }
        terms.push(format!("/(?s:.{{{lo},{hi}}}){close}/"));
    }
    if let Some(p) = schema.get("pattern").and_then(Value::as_str) {
        let mut p = p;
        let start = p.starts_with('^');
        if start {
            p = &p[1..];
        }
        let end = p.ends_with('$') && !p.ends_with("\\$");
        if end {
            p = &p[..p.len() - 1];
        }
        let p = p.replace('/', "\\/");
        let (pre, post) = (
            if start { "" } else { "(?s:.*)" },
            if end { "" } else { "(?s:.*)" },
        );
        terms.push(format!("/{pre}(?:{p}){post}{close}/"));
    }
    Ok(Some(terms.join(" & ")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xml_grammar_lists_parameters_in_order() {
        let tools = vec![
            json!({"type": "function", "function": {"name": "get", "parameters": {
            "type": "object", "properties": {"city": {"type": "string", "maxLength": 8}, "days": {"type": "integer"}},
            "required": ["city"]}}}),
        ];
        let g = tool_call_lark(&tools, ToolSyntax::Xml, None).unwrap();
        assert!(g.contains("<function=get>"), "{g}");
        assert!(g.contains("param_0_0 param_0_1?"), "{g}");
        assert!(g.contains("%json"), "{g}");
    }

    #[test]
    fn unknown_tool_names_are_refused() {
        let tools = vec![json!({"type": "function", "function": {"name": "a"}})];
        assert!(tool_call_lark(&tools, ToolSyntax::Xml, Some("b")).is_err());
        assert!(tool_call_lark(&[], ToolSyntax::Json, None).is_err());
    }
}
