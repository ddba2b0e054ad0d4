//! Image input flags (vLLM's `--limit-mm-per-prompt` and `--mm-processor-kwargs`) and the image
//! encoder of a model with a vision tower: its tower's weights from the checkpoint, its
//! `preprocessor_config.json` (Qwen3.5's values when the directory has none) under the
//! processor kwargs.

use std::path::Path;

use anyhow::{anyhow, bail, Context, Result};
use clap::Args;
use sanmai_config::ModelConfig;
use sanmai_engine::images::ImageEncoder;
use sanmai_model::builtin;
use sanmai_model::vision::{tower_device_bytes, PreprocessorConfig, TowerBytes, Vision};
use sanmai_weights::TensorSource;
use serde_json::Value;

/// Images per prompt when `--limit-mm-per-prompt` does not say.
pub const DEFAULT_IMAGES_PER_PROMPT: usize = 8;

#[derive(Args, Debug, Clone, Default)]
pub struct MmArgs {
    /// Images one prompt may hold, as JSON: '{"image": 4}' [default: 8]. '{"image": 0}' turns
    /// image input off (the vision tower is not loaded). Video is not supported.
    #[arg(long, value_name = "JSON")]
    pub limit_mm_per_prompt: Option<String>,
    /// Overrides of the image processor's settings, as JSON: '{"max_pixels": 2097152}' (also
    /// "min_pixels", or "size": {"shortest_edge": N, "longest_edge": N}).
    #[arg(long, value_name = "JSON")]
    pub mm_processor_kwargs: Option<String>,
    /// Keep the vision tower's blocks in pinned host memory on a GPU: two device slots hold block i
    /// and i + 1, the copy of i + 1 overlapping the compute of i (the same arithmetic as resident
    /// weights, for about 58 MiB of VRAM instead of 0.8 GiB on Qwen3.5's tower).
    #[arg(long)]
    pub vit_on_host: bool,
}

impl MmArgs {
    /// Images per prompt.
    pub fn images_per_prompt(&self) -> Result<usize> {
        let Some(text) = &self.limit_mm_per_prompt else {
            return Ok(DEFAULT_IMAGES_PER_PROMPT);
        };
        let flag = "--limit-mm-per-prompt";
        let v: Value = serde_json::from_str(text)
            .map_err(|e| anyhow!("{flag}: not valid JSON ({e}): {text}"))?;
        let Value::Object(map) = v else {
            bail!("{flag}: expected an object like {{\"image\": 4}}, got {text}");
        };
        let mut images = DEFAULT_IMAGES_PER_PROMPT;
        for (k, v) in &map {
            let n = v.as_u64().ok_or_else(|| {
                anyhow!("{flag}: \"{k}\" must be a non-negative integer, got {v}")
            })?;
            match k.as_str() {
                "image" => images = n as usize,
                "video" | "audio" if n == 0 => {}
                "video" | "audio" => bail!("{flag}: \"{k}\": only images are supported"),
                other => bail!("{flag}: unknown modality \"{other}\" (expected \"image\")"),
            }
        }
        Ok(images)
    }

    /// What the vision tower of `cfg` takes on a GPU: its weights (two blocks' slots of them with
    /// `--vit-on-host`) and the activations of the largest image the processor lets through
    /// ([`tower_device_bytes`]); `None` without a tower or with images turned off. `dir` and
    /// `builtin` as for [`MmArgs::encoder`].
    pub fn tower_bytes(
        &self,
        cfg: &ModelConfig,
        dir: Option<&Path>,
        builtin: bool,
    ) -> Result<Option<TowerBytes>> {
        if cfg.vision.is_none() || self.images_per_prompt()? == 0 {
            return Ok(None);
        }
        let max_pixels = self.processor_of(dir, builtin)?.max_pixels;
        Ok(tower_device_bytes(cfg, max_pixels, self.vit_on_host))
    }

    /// The processor's settings: `dir`'s `preprocessor_config.json` (the model directory's, when
    /// it has one), the built-in model's when `builtin`, else Qwen3.5's; under the kwargs.
    fn processor_of(&self, dir: Option<&Path>, builtin: bool) -> Result<PreprocessorConfig> {
        let file = dir
            .map(|d| d.join("preprocessor_config.json"))
            .filter(|f| f.exists());
        match file {
            Some(f) => {
                let text = std::fs::read_to_string(&f)
                    .with_context(|| format!("reading {}", f.display()))?;
                self.preprocessor(Some((&f.display().to_string(), &text)))
            }
            None if builtin => self.preprocessor(Some((
                "configs/models/builtin_preprocessor_config.json",
                builtin::PREPROCESSOR_JSON,
            ))),
            None => self.preprocessor(None),
        }
    }

    /// The image processor's settings: `file` (a `preprocessor_config.json`, by name and text;
    /// Qwen3.5's values without one) under `--mm-processor-kwargs`.
    fn preprocessor(&self, file: Option<(&str, &str)>) -> Result<PreprocessorConfig> {
        let flag = "--mm-processor-kwargs";
        let kwargs: Option<Value> = self
            .mm_processor_kwargs
            .as_deref()
            .map(|t| {
                serde_json::from_str(t).map_err(|e| anyhow!("{flag}: not valid JSON ({e}): {t}"))
            })
            .transpose()?;
        if kwargs.as_ref().is_some_and(|k| !k.is_object()) {
            bail!("{flag}: expected an object like {{\"max_pixels\": 2097152}}");
        }
        let mut base = match file {
            Some((name, text)) => serde_json::from_str::<Value>(text)
                .with_context(|| format!("{name}: not valid JSON"))?,
            None => Value::Object(Default::default()),
        };
        let name = file.map_or("preprocessor_config.json", |(n, _)| n);
        if let (Some(Value::Object(k)), Value::Object(b)) = (&kwargs, &mut base) {
            for (key, v) in k {
                match key.as_str() {
                    "max_pixels" | "min_pixels" | "size" => {
                        b.insert(key.clone(), v.clone());
                    }
                    other => bail!(
                        "{flag}: unknown key \"{other}\" (expected max_pixels, min_pixels or size)"
                    ),
                }
            }
        }
        PreprocessorConfig::from_value(&base, name).map_err(|e| match kwargs {
            Some(_) => anyhow!("{flag} over {name}: {e}"),
            None => anyhow!(e),
        })
    }

    /// The image encoder of a model whose config has a vision tower (`None` without one, or with
    /// images turned off), its weights read from `src`. The processor's settings are `dir`'s
    /// `preprocessor_config.json` (the model directory's, when it has one), the built-in model's
    /// when `builtin`, else Qwen3.5's.
    pub fn encoder(
        &self,
        cfg: &ModelConfig,
        src: &dyn TensorSource,
        dir: Option<&Path>,
        builtin: bool,
    ) -> Result<Option<ImageEncoder>> {
        let max_images = self.images_per_prompt()?;
        if cfg.vision.is_none() || max_images == 0 {
            return Ok(None);
        }
        let preprocessor = self.processor_of(dir, builtin)?;
        let Some(vision) = Vision::load(cfg, src).context("loading the vision tower")? else {
            tracing::warn!(
                "the config has a vision_config but the checkpoint holds no vision tower \
                 (model.visual.*): serving text only, requests with images get a 400"
            );
            return Ok(None);
        };
        Ok(Some(ImageEncoder::new(vision, preprocessor, max_images)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(limit: Option<&str>, kwargs: Option<&str>) -> MmArgs {
        MmArgs {
            limit_mm_per_prompt: limit.map(String::from),
            mm_processor_kwargs: kwargs.map(String::from),
            vit_on_host: false,
        }
    }

    #[test]
    fn limits_are_read_as_vllm_writes_them() {
        assert_eq!(args(None, None).images_per_prompt().unwrap(), 8);
        assert_eq!(
            args(Some(r#"{"image": 2, "video": 0}"#), None)
                .images_per_prompt()
                .unwrap(),
            2
        );
        for (bad, says) in [
            ("{", "not valid JSON"),
            ("[1]", "expected an object"),
            (r#"{"image": -1}"#, "non-negative"),
            (r#"{"video": 1}"#, "only images"),
            (r#"{"pictures": 1}"#, "unknown modality"),
        ] {
            let e = args(Some(bad), None).images_per_prompt().unwrap_err();
            assert!(e.to_string().contains(says), "{bad}: {e}");
            assert!(e.to_string().contains("--limit-mm-per-prompt"), "{e}");
        }
    }

    #[test]
    fn processor_kwargs_override_the_file() {
        let cfg = args(None, Some(r#"{"max_pixels": 2097152}"#))
            .preprocessor(None)
            .unwrap();
        assert_eq!(cfg.max_pixels, 2_097_152);
        assert_eq!(cfg.min_pixels, PreprocessorConfig::qwen3_5().min_pixels);
        let e = args(None, Some(r#"{"max_pixel": 1}"#))
            .preprocessor(None)
            .unwrap_err();
        assert!(e.to_string().contains("unknown key \"max_pixel\""), "{e}");
        let e = args(None, Some(r#"{"max_pixels": 10, "min_pixels": 100}"#))
            .preprocessor(None)
            .unwrap_err();
        assert!(e.to_string().contains("--mm-processor-kwargs"), "{e}");
        assert!(e.to_string().contains("is above"), "{e}");
    }
}
