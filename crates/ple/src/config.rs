//! The model config's `ple` block (spec §3), parsed with errors that name the offending field.

use crate::error::PleError;
use serde_json::Value;
use std::path::Path;

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

fn field<'a>(block: &'a Value, name: &str) -> Result<&'a Value, PleError> {
    block
        .get(name)
        .ok_or_else(|| PleError::config(name, "missing"))
}

fn uint(v: &Value, name: &str) -> Result<u64, PleError> {
    v.as_u64()
        .ok_or_else(|| PleError::config(name, format!("expected a non-negative integer, got {v}")))
}

fn uint_list(v: &Value, name: &str) -> Result<Vec<u64>, PleError> {
    let arr = v
        .as_array()
        .ok_or_else(|| PleError::config(name, format!("expected a list, got {v}")))?;
    arr.iter()
        .enumerate()
        .map(|(i, x)| uint(x, &format!("{name}[{i}]")))
        .collect()
}

fn positive(x: u64, name: &str) -> Result<usize, PleError> {
    if x == 0 {
        return Err(PleError::config(name, "must be positive"));
    }
    usize::try_from(x).map_err(|_| PleError::config(name, "too large"))
}

impl PleConfig {
    /// Reads a model config file and parses its `ple` block (top level or under `text_config`).
    pub fn from_model_config_file(path: &Path) -> Result<Self, PleError> {
        let text = std::fs::read_to_string(path).map_err(|e| PleError::io(path, e))?;
        let v: Value = serde_json::from_str(&text)
            .map_err(|e| PleError::config("<file>", format!("{}: {e}", path.display())))?;
        Self::from_model_config(&v)
    }

    /// Finds the `ple` block of a parsed model config (top level or under `text_config`).
    pub fn from_model_config(config: &Value) -> Result<Self, PleError> {
        let block = config
            .get("ple")
            .or_else(|| config.get("text_config").and_then(|t| t.get("ple")))
            .filter(|b| !b.is_null())
            .ok_or_else(|| PleError::config("ple", "the model config has no `ple` block"))?;
        Self::from_block(block)
    }

    /// Parses the `ple` block itself.
    pub fn from_block(block: &Value) -> Result<Self, PleError> {
        if !block.is_object() {
            return Err(PleError::config("ple", "expected an object"));
        }
        let orders = uint_list(field(block, "orders")?, "orders")?
            .into_iter()
            .enumerate()
            .map(|(i, n)| {
                let name = format!("orders[{i}]");
                let n = positive(n, &name)?;
                if n > 64 {
                    return Err(PleError::config(name, "order above 64"));
                }
                Ok(n)
            })
            .collect::<Result<Vec<_>, _>>()?;
        if orders.is_empty() {
            return Err(PleError::config("orders", "must not be empty"));
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
            PleError::config(
                "table_sizes",
                format!("expected a list of lists, got {sizes_v}"),
            )
        })?;
        if rows.len() != orders.len() {
            return Err(PleError::config(
                "table_sizes",
                format!("has {} rows, orders has {}", rows.len(), orders.len()),
            ));
        }
        let mut table_sizes = Vec::with_capacity(rows.len());
        for (o, row) in rows.iter().enumerate() {
            let name = format!("table_sizes[{o}]");
            let sizes = uint_list(row, &name)?;
            if sizes.len() != heads {
                return Err(PleError::config(
                    name,
                    format!("has {} sizes, heads = {heads}", sizes.len()),
                ));
            }
            for (h, &p) in sizes.iter().enumerate() {
                if p == 0 || p > i64::MAX as u64 {
                    return Err(PleError::config(
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
            PleError::config("eos_token_id", format!("expected an integer, got {eos}"))
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

    /// The config a table's sidecar implies (its sizes as written, `rows_scale` folded in), for
    /// tools that open a table without the model config; `eos_token_id` is not in the sidecar.
    pub fn from_sidecar(s: &crate::table::Sidecar, eos_token_id: i64) -> Result<Self, PleError> {
        Self::from_block(&serde_json::json!({
            "orders": s.orders, "heads": s.heads, "row_dim": s.row_dim, "seed": s.seed,
            "layer_ids": [], "table_sizes": s.sizes, "conv_kernel": 1, "conv_dilation": 1,
            "eos_token_id": eos_token_id,
        }))
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
