//! Typed access to the fields of one JSON object, with errors that name the file and the field.

use serde_json::{Map, Value};

use crate::{ConfigError, Result};

#[derive(Clone)]
pub(crate) struct Fields<'a> {
    map: &'a Map<String, Value>,
    file: &'a str,
    /// Dotted path of this object inside the file (`""` at the root, `"text_config."` below it).
    prefix: String,
}

impl<'a> Fields<'a> {
    pub fn new(value: &'a Value, file: &'a str, prefix: &str) -> Result<Self> {
        let map = value.as_object().ok_or_else(|| ConfigError::Invalid {
            file: file.to_string(),
            field: prefix.trim_end_matches('.').to_string(),
            message: "expected a JSON object".into(),
        })?;
        Ok(Fields {
            map,
            file,
            prefix: prefix.to_string(),
        })
    }

    pub fn child(&self, name: &str) -> Result<Fields<'a>> {
        let v = self.map.get(name).ok_or_else(|| self.missing(name))?;
        Fields::new(v, self.file, &format!("{}{name}.", self.prefix))
    }

    pub fn get(&self, name: &str) -> Option<&'a Value> {
        self.map.get(name)
    }

    /// Present and not null.
    pub fn has(&self, name: &str) -> bool {
        matches!(self.map.get(name), Some(v) if !v.is_null())
    }

    pub fn missing(&self, name: &str) -> ConfigError {
        ConfigError::Missing {
            file: self.file.to_string(),
            field: format!("{}{name}", self.prefix),
        }
    }

    pub fn invalid(&self, name: &str, message: String) -> ConfigError {
        ConfigError::Invalid {
            file: self.file.to_string(),
            field: format!("{}{name}", self.prefix),
            message,
        }
    }

    fn opt<T>(&self, name: &str, what: &str, f: impl Fn(&Value) -> Option<T>) -> Result<Option<T>> {
        match self.map.get(name) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => f(v)
                .map(Some)
                .ok_or_else(|| self.invalid(name, format!("expected {what}, found {v}"))),
        }
    }

    pub fn opt_usize(&self, name: &str) -> Result<Option<usize>> {
        self.opt(name, "a non-negative integer", |v| {
            v.as_u64().map(|x| x as usize)
        })
    }

    pub fn opt_f64(&self, name: &str) -> Result<Option<f64>> {
        self.opt(name, "a number", Value::as_f64)
    }

    pub fn opt_bool(&self, name: &str) -> Result<Option<bool>> {
        self.opt(name, "a boolean", Value::as_bool)
    }

    pub fn opt_str(&self, name: &str) -> Result<Option<String>> {
        self.opt(name, "a string", |v| v.as_str().map(str::to_string))
    }

    pub fn req_usize(&self, name: &str) -> Result<usize> {
        self.opt_usize(name)?.ok_or_else(|| self.missing(name))
    }

    pub fn req_str(&self, name: &str) -> Result<String> {
        self.opt_str(name)?.ok_or_else(|| self.missing(name))
    }
}
