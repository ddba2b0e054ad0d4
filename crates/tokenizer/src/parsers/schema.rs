//! The request's `tools` (OpenAI format) as the parsers need them: which function names exist
//! and the JSON-schema type of each parameter, and the typing of XML parameter values.

use serde_json::{Map, Value};
use std::collections::HashMap;

/// Longest function or parameter name accepted.
pub(crate) const MAX_NAME_LEN: usize = 256;

/// Function names and parameter schemas from an OpenAI `tools` array.
#[derive(Debug, Clone, Default)]
pub(crate) struct ToolSet {
    /// Function name → its `parameters.properties` (empty when absent).
    functions: HashMap<String, Map<String, Value>>,
    /// True when no tools were given: every well-formed name is accepted.
    any_name: bool,
}

impl ToolSet {
    /// Reads `[{"type": "function", "function": {"name", "parameters"}}, …]`; entries without the
    /// `function` wrapper are read the same way, and entries without a name are skipped.
    pub(crate) fn new(tools: &[Value]) -> Self {
        let mut functions = HashMap::new();
        for tool in tools {
            let function = tool.get("function").unwrap_or(tool);
            let Some(name) = function.get("name").and_then(Value::as_str) else {
                continue;
            };
            let properties = function
                .get("parameters")
                .and_then(|p| p.get("properties"))
                .and_then(Value::as_object)
                .cloned()
                .unwrap_or_default();
            functions.insert(name.to_string(), properties);
        }
        ToolSet {
            functions,
            any_name: tools.is_empty(),
        }
    }

    /// Whether a call to `name` is acceptable: a well-formed name, and one of the tools when
    /// tools were given.
    pub(crate) fn accepts(&self, name: &str) -> bool {
        valid_name(name) && (self.any_name || self.functions.contains_key(name))
    }

    /// The schema of `param` of `function`, if declared.
    pub(crate) fn param_schema(&self, function: &str, param: &str) -> Option<&Value> {
        self.functions.get(function)?.get(param)
    }
}

/// Whether `c` may appear in a function or parameter name.
pub(crate) fn name_char(c: char) -> bool {
    !c.is_whitespace() && !matches!(c, '<' | '>' | '"' | '\'' | '{' | '}')
}

/// A non-empty name of at most [`MAX_NAME_LEN`] bytes made of [`name_char`]s.
pub(crate) fn valid_name(name: &str) -> bool {
    !name.is_empty() && name.len() <= MAX_NAME_LEN && name.chars().all(name_char)
}

/// The JSON value of an XML parameter whose raw text (one leading and one trailing newline
/// already removed) is `raw`, typed by its schema:
///
/// - each declared type is tried in order (`type` as a string or a list, or the `type`s of
///   `anyOf`/`oneOf` options) and the first that accepts the text wins: `string` takes the text
///   as it is; `integer` an integer; `number` a JSON number; `boolean` `true`/`false` (any case);
///   `null` `null`/`None`; `object`/`array` a JSON object or array; an unknown type name any JSON;
/// - a nullable schema maps the text `null`/`None` (any case) to null before that;
/// - with no schema or no declared type, the text is tried as JSON, except for a schema with an
///   all-string `enum`, which keeps it as a string;
/// - when nothing accepts it, the value is the text as a string.
pub(crate) fn convert_param(raw: &str, schema: Option<&Value>) -> Value {
    let Some(schema) = schema else {
        return json_or_string(raw);
    };
    let (types, nullable) = declared_types(schema);
    let trimmed = raw.trim();
    if nullable && is_null_word(trimmed) {
        return Value::Null;
    }
    if types.is_empty() {
        let string_enum = schema
            .get("enum")
            .and_then(Value::as_array)
            .is_some_and(|values| values.iter().all(Value::is_string));
        return if string_enum {
            Value::String(raw.to_string())
        } else {
            json_or_string(raw)
        };
    }
    for ty in &types {
        if let Some(value) = convert_as(raw, trimmed, ty) {
            return value;
        }
    }
    Value::String(raw.to_string())
}

/// The non-null type names a schema declares, and whether it admits null.
fn declared_types(schema: &Value) -> (Vec<String>, bool) {
    let mut names = Vec::new();
    collect_type_names(schema.get("type"), &mut names);
    for key in ["anyOf", "oneOf"] {
        if let Some(options) = schema.get(key).and_then(Value::as_array) {
            for option in options {
                collect_type_names(option.get("type"), &mut names);
            }
        }
    }
    let nullable = names.iter().any(|t| t == "null");
    names.retain(|t| t != "null");
    (names, nullable)
}

fn collect_type_names(ty: Option<&Value>, out: &mut Vec<String>) {
    match ty {
        Some(Value::String(name)) => out.push(name.trim().to_ascii_lowercase()),
        Some(Value::Array(list)) => {
            for name in list.iter().filter_map(Value::as_str) {
                out.push(name.trim().to_ascii_lowercase());
            }
        }
        _ => {}
    }
}

fn convert_as(raw: &str, trimmed: &str, ty: &str) -> Option<Value> {
    match ty {
        "string" | "str" | "text" | "varchar" | "char" | "enum" => {
            Some(Value::String(raw.to_string()))
        }
        "integer" | "int" | "long" | "short" => {
            if let Ok(n) = trimmed.parse::<i64>() {
                Some(Value::from(n))
            } else {
                trimmed.parse::<u64>().ok().map(Value::from)
            }
        }
        "number" | "float" | "double" => match serde_json::from_str::<Value>(trimmed) {
            Ok(v @ Value::Number(_)) => Some(v),
            _ => None,
        },
        "boolean" | "bool" => match trimmed.to_ascii_lowercase().as_str() {
            "true" => Some(Value::Bool(true)),
            "false" => Some(Value::Bool(false)),
            _ => None,
        },
        "null" => is_null_word(trimmed).then_some(Value::Null),
        "object" | "array" | "dict" | "list" => match serde_json::from_str::<Value>(raw) {
            Ok(v @ (Value::Object(_) | Value::Array(_))) => Some(v),
            _ => None,
        },
        _ => serde_json::from_str::<Value>(raw).ok(),
    }
}

fn is_null_word(s: &str) -> bool {
    s.eq_ignore_ascii_case("null") || s.eq_ignore_ascii_case("none")
}

fn json_or_string(raw: &str) -> Value {
    serde_json::from_str(raw).unwrap_or_else(|_| Value::String(raw.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn typed_conversion() {
        let s = |v: Value| Some(v);
        assert_eq!(
            convert_param(" 42 ", s(json!({"type": "integer"})).as_ref()),
            json!(42)
        );
        assert_eq!(
            convert_param("4x", s(json!({"type": "integer"})).as_ref()),
            json!("4x")
        );
        assert_eq!(
            convert_param("2.5", s(json!({"type": "number"})).as_ref()),
            json!(2.5)
        );
        assert_eq!(
            convert_param("True", s(json!({"type": "boolean"})).as_ref()),
            json!(true)
        );
        assert_eq!(
            convert_param("42", s(json!({"type": "string"})).as_ref()),
            json!("42")
        );
        assert_eq!(
            convert_param("None", s(json!({"type": ["string", "null"]})).as_ref()),
            Value::Null
        );
        assert_eq!(
            convert_param(
                "7",
                s(json!({"anyOf": [{"type": "integer"}, {"type": "string"}]})).as_ref()
            ),
            json!(7)
        );
        assert_eq!(
            convert_param("[1, 2]", s(json!({"type": "array"})).as_ref()),
            json!([1, 2])
        );
        assert_eq!(
            convert_param("[1, 2", s(json!({"type": "array"})).as_ref()),
            json!("[1, 2")
        );
        assert_eq!(
            convert_param("1", s(json!({"enum": ["1", "2"]})).as_ref()),
            json!("1")
        );
        assert_eq!(convert_param("{\"a\": 1}", None), json!({"a": 1}));
        assert_eq!(convert_param("hello", None), json!("hello"));
    }

    #[test]
    fn tool_set_reads_openai_tools() {
        let tools = [json!({"type": "function", "function": {"name": "f",
            "parameters": {"type": "object", "properties": {"x": {"type": "integer"}}}}})];
        let set = ToolSet::new(&tools);
        assert!(set.accepts("f"));
        assert!(!set.accepts("g"));
        assert_eq!(
            set.param_schema("f", "x"),
            Some(&json!({"type": "integer"}))
        );
        assert!(ToolSet::new(&[]).accepts("anything"));
        assert!(!ToolSet::new(&[]).accepts("two words"));
    }
}
