//! The qwen4_exp `ple` block (spec §3): the hashed n-gram memory's shape, parsed with errors that
//! name the offending field.

use serde_json::Value;
use std::path::Path;

use crate::ConfigError;

/// A malformed `ple` block; `field` names the offending entry (`heads`, `table_sizes[1][0]`, ...).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("ple config: field `{field}`: {msg}")]
pub struct PleConfigError {
    pub field: String,
    pub msg: String,
}

impl PleConfigError {
    fn new(field: impl Into<String>, msg: impl Into<String>) -> Self {
        PleConfigError {
            field: field.into(),
            msg: msg.into(),
        }
    }
}

/// The `ple` block of a model config.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PleConfig {
    /// n-gram orders, e.g. `[2, 3]`.
    pub orders: Vec<usize>,
    /// Hash heads per order.
    pub heads: usize,
    /// bf16 values per row.
    pub row_dim: usize,
    /// SplitMix64 seed of the multipliers.
    pub seed: u64,
    pub layer_ids: Vec<usize>,
    /// `table_sizes[o][h]`: rows (a prime) of the sub-table of order `orders[o]`, head `h`.
    pub table_sizes: Vec<Vec<u64>>,
    pub conv_kernel: usize,
    pub conv_dilation: usize,
    pub eos_token_id: i64,
}

fn field<'a>(block: &'a Value, name: &str) -> Result<&'a Value, PleConfigError> {
    block
        .get(name)
        .ok_or_else(|| PleConfigError::new(name, "missing"))
}

fn uint(v: &Value, name: &str) -> Result<u64, PleConfigError> {
    v.as_u64().ok_or_else(|| {
        PleConfigError::new(name, format!("expected a non-negative integer, got {v}"))
    })
}

fn uint_list(v: &Value, name: &str) -> Result<Vec<u64>, PleConfigError> {
    let arr = v
        .as_array()
        .ok_or_else(|| PleConfigError::new(name, format!("expected a list, got {v}")))?;
    arr.iter()
        .enumerate()
        .map(|(i, x)| uint(x, &format!("{name}[{i}]")))
        .collect()
}

fn positive(x: u64, name: &str) -> Result<usize, PleConfigError> {
    if x == 0 {
        return Err(PleConfigError::new(name, "must be positive"));
    }
    usize::try_from(x).map_err(|_| PleConfigError::new(name, "too large"))
}

impl PleConfig {
    /// Reads a model config file and parses its `ple` block (top level or under `text_config`).
    pub fn from_model_config_file(path: &Path) -> Result<Self, ConfigError> {
        let name = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Io {
            path: name.clone(),
            source,
        })?;
        let v: Value = serde_json::from_str(&text).map_err(|source| ConfigError::Json {
            path: name.clone(),
            source,
        })?;
        Self::from_model_config(&v).map_err(|e| ConfigError::Invalid {
            file: name,
            field: e.field,
            message: e.msg,
        })
    }

    /// Finds the `ple` block of a parsed model config (top level or under `text_config`).
    pub fn from_model_config(config: &Value) -> Result<Self, PleConfigError> {
        let block = config
            .get("ple")
            .or_else(|| config.get("text_config").and_then(|t| t.get("ple")))
            .filter(|b| !b.is_null())
            .ok_or_else(|| PleConfigError::new("ple", "the model config has no `ple` block"))?;
        Self::from_block(block)
    }

    /// Parses the `ple` block itself.
    pub fn from_block(block: &Value) -> Result<Self, PleConfigError> {
        if !block.is_object() {
            return Err(PleConfigError::new("ple", "expected an object"));
        }
        let orders = uint_list(field(block, "orders")?, "orders")?
            .into_iter()
            .enumerate()
            .map(|(i, n)| {
                let name = format!("orders[{i}]");
                let n = positive(n, &name)?;
                if n > 64 {
                    return Err(PleConfigError::new(name, "order above 64"));
                }
                Ok(n)
            })
            .collect::<Result<Vec<_>, _>>()?;
        if orders.is_empty() {
            return Err(PleConfigError::new("orders", "must not be empty"));
        }
        let heads = positive(uint(field(block, "heads")?, "heads")?, "heads")?;
        let row_dim = positive(uint(field(block, "row_dim")?, "row_dim")?, "row_dim")?;
        let seed = uint(field(block, "seed")?, "seed")?;
        let layer_ids = uint_list(field(block, "layer_ids")?, "layer_ids")?
            .into_iter()
            .map(|x| x as usize)
            .collect();
        let sizes_v = field(block, "table_sizes")?;
        let rows = sizes_v.as_array().ok_or_else(|| {
            PleConfigError::new(
                "table_sizes",
                format!("expected a list of lists, got {sizes_v}"),
            )
        })?;
        if rows.len() != orders.len() {
            return Err(PleConfigError::new(
                "table_sizes",
                format!("has {} rows, orders has {}", rows.len(), orders.len()),
            ));
        }
        let mut table_sizes = Vec::with_capacity(rows.len());
        for (o, row) in rows.iter().enumerate() {
            let name = format!("table_sizes[{o}]");
            let sizes = uint_list(row, &name)?;
            if sizes.len() != heads {
                return Err(PleConfigError::new(
                    name,
                    format!("has {} sizes, heads = {heads}", sizes.len()),
                ));
            }
            for (h, &p) in sizes.iter().enumerate() {
                if p == 0 || p > i64::MAX as u64 {
                    return Err(PleConfigError::new(
                        format!("table_sizes[{o}][{h}]"),
                        format!("{p} is not a valid row count"),
                    ));
                }
            }
            table_sizes.push(sizes);
        }
        let conv_kernel = positive(
            uint(field(block, "conv_kernel")?, "conv_kernel")?,
            "conv_kernel",
        )?;
        let conv_dilation = positive(
            uint(field(block, "conv_dilation")?, "conv_dilation")?,
            "conv_dilation",
        )?;
        let eos = field(block, "eos_token_id")?;
        let eos_token_id = eos.as_i64().ok_or_else(|| {
            PleConfigError::new("eos_token_id", format!("expected an integer, got {eos}"))
        })?;
        Ok(PleConfig {
            orders,
            heads,
            row_dim,
            seed,
            layer_ids,
            table_sizes,
            conv_kernel,
            conv_dilation,
            eos_token_id,
        })
    }

    /// Number of sub-tables (= rows gathered per token): `len(orders) · heads`.
    pub fn num_tables(&self) -> usize {
        self.orders.len() * self.heads
    }

    /// The sub-table sizes flattened in (order, head) order.
    pub fn flat_sizes(&self) -> Vec<u64> {
        self.table_sizes.iter().flatten().copied().collect()
    }

    /// Bytes of one row (bf16).
    pub fn row_bytes(&self) -> usize {
        self.row_dim * 2
    }
}
