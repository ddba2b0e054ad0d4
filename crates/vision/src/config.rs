//! The checkpoint's `preprocessor_config.json`, as transformers' Qwen2-VL image processor reads it:
//! patch, merge and temporal sizes, the pixel bounds (`size.shortest_edge` / `size.longest_edge`, or
//! the older `min_pixels` / `max_pixels`, which win when present), mean, std and rescale factor.

use serde_json::Value;

use crate::{Result, VisionError};

/// How images are prepared for the vision tower.
#[derive(Debug, Clone, PartialEq)]
pub struct PreprocessorConfig {
    pub patch_size: usize,
    pub temporal_patch_size: usize,
    pub merge_size: usize,
    /// Fewest and most pixels after resizing.
    pub min_pixels: usize,
    pub max_pixels: usize,
    pub image_mean: [f32; 3],
    pub image_std: [f32; 3],
    pub rescale_factor: f64,
}

impl PreprocessorConfig {
    /// Qwen3.5's values (`preprocessor_config.json` of its checkpoints).
    pub fn qwen3_5() -> Self {
        PreprocessorConfig {
            patch_size: 16,
            temporal_patch_size: 2,
            merge_size: 2,
            min_pixels: 65_536,
            max_pixels: 16_777_216,
            image_mean: [0.5; 3],
            image_std: [0.5; 3],
            rescale_factor: 1.0 / 255.0,
        }
    }

    /// Reads `preprocessor_config.json`; a missing field takes Qwen3.5's value.
    pub fn from_file(path: &std::path::Path) -> Result<Self> {
        let file = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| VisionError::Config {
            file: file.clone(),
            field: String::new(),
            message: e.to_string(),
        })?;
        let v: Value = serde_json::from_str(&text).map_err(|e| VisionError::Config {
            file: file.clone(),
            field: String::new(),
            message: format!("not valid JSON: {e}"),
        })?;
        Self::from_value(&v, &file)
    }

    /// Parses the config object; `file` names it in errors.
    pub fn from_value(v: &Value, file: &str) -> Result<Self> {
        let err = |field: &str, message: String| VisionError::Config {
            file: file.to_string(),
            field: field.to_string(),
            message,
        };
        let get = |path: &[&str]| -> Option<&Value> {
            path.iter()
                .try_fold(v, |v, k| v.get(k))
                .filter(|x| !x.is_null())
        };
        let count = |path: &[&str], default: usize| -> Result<usize> {
            match get(path) {
                None => Ok(default),
                Some(x) => x
                    .as_u64()
                    .filter(|&n| n > 0)
                    .map(|n| n as usize)
                    .ok_or_else(|| {
                        err(
                            &path.join("."),
                            format!("expected a positive integer, found {x}"),
                        )
                    }),
            }
        };
        let triple = |name: &str, default: [f32; 3]| -> Result<[f32; 3]> {
            match get(&[name]) {
                None => Ok(default),
                Some(Value::Number(n)) => Ok([n.as_f64().unwrap_or(0.0) as f32; 3]),
                Some(Value::Array(a)) if a.len() == 3 && a.iter().all(Value::is_number) => {
                    Ok([0, 1, 2].map(|i| a[i].as_f64().unwrap_or(0.0) as f32))
                }
                Some(x) => Err(err(name, format!("expected three numbers, found {x}"))),
            }
        };
        let d = Self::qwen3_5();
        let min_pixels = count(
            &["min_pixels"],
            count(&["size", "shortest_edge"], d.min_pixels)?,
        )?;
        let max_pixels = count(
            &["max_pixels"],
            count(&["size", "longest_edge"], d.max_pixels)?,
        )?;
        if min_pixels > max_pixels {
            return Err(err(
                "size",
                format!("shortest_edge (min pixels) {min_pixels} is above longest_edge (max pixels) {max_pixels}"),
            ));
        }
        let image_std = triple("image_std", d.image_std)?;
        if image_std.contains(&0.0) {
            return Err(err("image_std", "a standard deviation of 0".into()));
        }
        let rescale_factor = match get(&["rescale_factor"]) {
            None => d.rescale_factor,
            Some(x) => x.as_f64().filter(|f| *f > 0.0).ok_or_else(|| {
                err(
                    "rescale_factor",
                    format!("expected a positive number, found {x}"),
                )
            })?,
        };
        Ok(PreprocessorConfig {
            patch_size: count(&["patch_size"], d.patch_size)?,
            temporal_patch_size: count(&["temporal_patch_size"], d.temporal_patch_size)?,
            merge_size: count(&["merge_size"], d.merge_size)?,
            min_pixels,
            max_pixels,
            image_mean: triple("image_mean", d.image_mean)?,
            image_std,
            rescale_factor,
        })
    }

    /// The side every resized dimension is a multiple of: patch × merge.
    pub fn factor(&self) -> usize {
        self.patch_size * self.merge_size
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn size_bounds_and_defaults() {
        let c = PreprocessorConfig::from_value(
            &json!({"size": {"shortest_edge": 1024, "longest_edge": 4096}, "patch_size": 14,
                    "image_mean": [0.1, 0.2, 0.3], "image_std": 0.25}),
            "p.json",
        )
        .unwrap();
        assert_eq!(
            (c.min_pixels, c.max_pixels, c.patch_size, c.merge_size),
            (1024, 4096, 14, 2)
        );
        assert_eq!(c.image_mean, [0.1, 0.2, 0.3]);
        assert_eq!(c.image_std, [0.25; 3]);
        assert_eq!(c.factor(), 28);
        // The older keys win.
        let c = PreprocessorConfig::from_value(
            &json!({"size": {"shortest_edge": 1024, "longest_edge": 4096}, "max_pixels": 8192}),
            "p.json",
        )
        .unwrap();
        assert_eq!(c.max_pixels, 8192);
        assert_eq!(
            PreprocessorConfig::from_value(&json!({}), "p.json").unwrap(),
            PreprocessorConfig::qwen3_5()
        );
    }

    #[test]
    fn bad_fields_are_named() {
        for (v, field) in [
            (json!({"patch_size": 0}), "patch_size"),
            (
                json!({"size": {"shortest_edge": "big"}}),
                "size.shortest_edge",
            ),
            (json!({"image_std": [0.5, 0.0, 0.5]}), "image_std"),
            (json!({"image_mean": [0.5, 0.5]}), "image_mean"),
            (json!({"min_pixels": 9000, "max_pixels": 100}), "size"),
            (json!({"rescale_factor": -1}), "rescale_factor"),
        ] {
            let e = PreprocessorConfig::from_value(&v, "p.json")
                .unwrap_err()
                .to_string();
            assert!(
                e.contains("p.json") && e.contains(&format!("`{field}`")),
                "{v}: {e}"
            );
        }
    }
}
