//! Images into the text model, as transformers 5.17's `Qwen3_5MoeModel` takes them:
//!
//! - [`Vision`]: the vision tower of a multimodal checkpoint (`vision_config`, the `model.visual.*`
//!   tensors as f32 host weights) and its CPU forward over preprocessed patches
//!   ([`sanmai_vision::tower`]); [`Model::image_embeds`] puts its merged tokens on the model's
//!   backend, ready to replace the embeddings of the image placeholder tokens
//!   ([`crate::StepEmbeds`]);
//! - [`PromptPositions`]: where each token of a prompt with images sits under interleaved MRoPE
//!   (`get_rope_index`), the rows of its placeholder tokens, and the offset of the positions of
//!   the tokens after it ([`crate::StepMultimodal::positions`]).
//!
//! A prompt shows an image as `<|vision_start|>`, `t·h·w / merge²` image placeholder tokens
//! (`image_token_id`) and `<|vision_end|>`: the processor expands one placeholder per merged token.
//! The placeholders' rows take the image's merged tokens in order, images in prompt order.

use sanmai_config::ModelConfig;
use sanmai_vision::positions::rope_index;
use sanmai_vision::tower::{self, Tensor, VisionConfig, VisionWeights};
use sanmai_weights::{Init, TensorSource, WeightError};

use crate::backend::{Backend, BackendError};
use crate::load::Model;

pub use sanmai_vision::positions::Grid;
pub use sanmai_vision::{preprocess, Patches, PreprocessorConfig, VisionError};

/// Why an image could not be prepared or its tokens placed.
#[derive(Debug, thiserror::Error)]
pub enum ImageError {
    #[error(transparent)]
    Vision(#[from] VisionError),
    #[error("vision tower weights: {0}")]
    Weights(#[from] WeightError),
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error("{0}")]
    Input(String),
}

/// A multimodal checkpoint's vision tower with its weights, and the token that stands for an
/// image's merged tokens.
pub struct Vision {
    pub config: VisionConfig,
    pub weights: VisionWeights,
    /// The image placeholder token (`image_token_id`).
    pub image_token_id: u32,
    pub vision_start_token_id: u32,
    pub vision_end_token_id: u32,
}

/// Where a checkpoint keeps the tower's tensors (transformers' `model.visual`).
pub const VISION_PREFIX: &str = "model.visual.";

impl Vision {
    /// The tower of `cfg` (its `vision_config`) with its weights from `src` (`model.visual.*`,
    /// widened to f32); `None` when the config has no vision tower or the checkpoint holds none of
    /// its tensors (no `patch_embed`). A missing or mis-shaped tensor of a tower that is there is
    /// an error naming it.
    pub fn load(cfg: &ModelConfig, src: &dyn TensorSource) -> Result<Option<Self>, ImageError> {
        let Some(spec) = &cfg.vision else {
            return Ok(None);
        };
        let config = VisionConfig::from_value(&spec.config, "config.json: vision_config")?;
        if config.out_hidden_size != cfg.hidden_size {
            return Err(ImageError::Input(format!(
                "the vision tower's out_hidden_size {} is not the text model's hidden_size {}",
                config.out_hidden_size, cfg.hidden_size
            )));
        }
        // A checkpoint of the multimodal layout may come without its tower (a text-only export).
        if !src.contains(&format!("{VISION_PREFIX}patch_embed.proj.weight")) {
            return Ok(None);
        }
        let mut failed: Option<WeightError> = None;
        let weights = VisionWeights::load(&config, |name| {
            match read(src, &config, name) {
                Ok(t) => Some(t),
                // The tower's loader names a missing tensor; other failures are kept.
                Err(WeightError::Missing { .. }) => None,
                Err(e) => {
                    failed.get_or_insert(e);
                    None
                }
            }
        });
        if let Some(e) = failed {
            return Err(e.into());
        }
        Ok(Some(Vision {
            config,
            weights: weights?,
            image_token_id: spec.image_token_id,
            vision_start_token_id: spec.vision_start_token_id,
            vision_end_token_id: spec.vision_end_token_id,
        }))
    }

    /// Merged tokens of an image of grid `[t, h, w]` (patches): its placeholder count.
    pub fn tokens(&self, grid: Grid) -> usize {
        grid.iter().product::<usize>() / self.config.merge_unit()
    }

    /// The tower's merged tokens `[Σ tokens, out_hidden_size]` (row-major) of the images whose
    /// patch rows are `pixels` (one image after another, as [`Patches::pixel_values`]) and whose
    /// grids are `grids`.
    pub fn forward(&self, pixels: &[f32], grids: &[Grid]) -> Result<Vec<f32>, ImageError> {
        Ok(tower::forward(&self.config, &self.weights, pixels, grids)?)
    }

    /// The positions of the prompt `ids`, whose runs of the image placeholder are the images of
    /// `grids` in order.
    pub fn positions(&self, ids: &[u32], grids: &[Grid]) -> Result<PromptPositions, ImageError> {
        PromptPositions::new(
            ids,
            self.image_token_id,
            grids,
            self.config.spatial_merge_size,
        )
    }
}

/// Rows per piece of the device tower's row-wise work (its qkv and MLP GEMMs and their epilogues),
/// whose buffers hold this many rows rather than every patch of the image.
pub const TOWER_CHUNK_ROWS: usize = 1024;

/// What the tower of a config takes on a GPU (`crates/cuda`'s tower), in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TowerBytes {
    /// Weights on the device: every matrix in bf16; biases, norms and the position table in f32.
    /// With the blocks on the host, only two blocks' slots of them.
    pub weights: usize,
    /// The activations of one forward over the largest image the processor lets through.
    pub activations: usize,
    /// The blocks' weights in pinned host memory (`0` unless they stay on the host).
    pub host: usize,
}

/// What the tower of `cfg` takes on a GPU ([`TowerBytes`]) for images of up to `max_pixels` pixels,
/// its blocks resident on the device or, with `blocks_on_host`, in pinned host memory streamed
/// through two device slots. `None` for a config without a vision tower.
pub fn tower_device_bytes(
    cfg: &ModelConfig,
    max_pixels: usize,
    blocks_on_host: bool,
) -> Option<TowerBytes> {
    let spec = cfg.vision.as_ref()?;
    let v = VisionConfig::from_value(&spec.config, "config.json: vision_config").ok()?;
    let (h, i, m2) = (v.hidden_size, v.intermediate_size, v.merge_unit());
    let wide = h * m2;
    let block = 2 * (4 * h * h + 2 * h * i) + 4 * (3 * h + h + i + h + 4 * h);
    let matrices = h * v.patch_len() + wide * wide + v.out_hidden_size * wide;
    let vectors = v.num_position_embeddings * h + h + 2 * h + wide + v.out_hidden_size;
    let rest = 2 * matrices + 4 * vectors;
    let patches = max_pixels / (v.patch_size * v.patch_size);
    // The head dimension padded to a multiple of 16 (the attention kernel's tiles).
    let padded = v.head_dim().div_ceil(16) * 16;
    let per_patch = 2 * v.patch_len()       // pixels, bf16
        + 32                                // position taps and weights
        + 8 * v.head_dim()                  // rotary cos and sin, f32
        + (4 + 2 + 2) * h                   // residual, normed, attention out
        + 6 * v.num_heads * padded          // q, k, v in bf16
        + 6 * h                             // merger rows, f32 and bf16
        + 4 * v.out_hidden_size / m2; // merged tokens
                                      // The row-wise work in pieces of TOWER_CHUNK_ROWS rows: qkv, projection, MLP hidden.
    let per_chunk_row = (12 + 4) * h + 6 * i;
    let activations = patches * per_patch + patches.min(TOWER_CHUNK_ROWS) * per_chunk_row;
    let (on_device, host) = if blocks_on_host {
        (v.depth.min(2), v.depth)
    } else {
        (v.depth, 0)
    };
    Some(TowerBytes {
        weights: rest + on_device * block,
        activations,
        host: host * block,
    })
}

/// A vision tower's forward over prepared patches: [`Vision`]'s CPU reference, or a device's copy
/// of the same weights. Returns the merged tokens `[Σ tokens, out_hidden_size]`, row-major, of the
/// images whose patch rows are `pixels` and whose grids are `grids` (see [`Vision::forward`]).
pub trait Tower: Send + Sync {
    fn forward(&self, pixels: &[f32], grids: &[Grid]) -> Result<Vec<f32>, ImageError>;

    /// Whether the tower's blocks stay in pinned host memory, streamed to the device per forward
    /// (see [`tower_device_bytes`]).
    fn blocks_on_host(&self) -> bool {
        false
    }
}

impl Tower for Vision {
    fn forward(&self, pixels: &[f32], grids: &[Grid]) -> Result<Vec<f32>, ImageError> {
        Vision::forward(self, pixels, grids)
    }
}

/// The tensor `name` of the tower (relative to [`VISION_PREFIX`]) in f32, with its shape.
fn read(src: &dyn TensorSource, cfg: &VisionConfig, name: &str) -> Result<Tensor, WeightError> {
    let full = format!("{VISION_PREFIX}{name}");
    let Some(shape) = shape(cfg, name) else {
        return Err(WeightError::Missing { name: full });
    };
    let init = if name.ends_with("norm1.weight")
        || name.ends_with("norm2.weight")
        || name.ends_with("norm.weight")
    {
        Init::ONES
    } else if name.ends_with(".bias") {
        Init::ZEROS
    } else {
        Init::std((*shape.last().unwrap_or(&1) as f32).powf(-0.5))
    };
    let t = match src.tensor(&full, &shape, init) {
        // The patch embedding's Conv3d may be stored flattened to a matrix.
        Err(WeightError::Shape { found, .. })
            if name == "patch_embed.proj.weight" && found == [cfg.hidden_size, cfg.patch_len()] =>
        {
            src.tensor(&full, &found, init)?
        }
        t => t?,
    };
    let shape = t.shape.clone();
    Ok((shape, t.into_f32()))
}

/// The shape transformers gives the tower's parameter `name`.
fn shape(cfg: &VisionConfig, name: &str) -> Option<Vec<usize>> {
    let (h, i) = (cfg.hidden_size, cfg.intermediate_size);
    let m = h * cfg.merge_unit();
    let (c, t, p) = (cfg.in_channels, cfg.temporal_patch_size, cfg.patch_size);
    let (base, kind) = name.rsplit_once('.')?;
    let block = base.strip_prefix("blocks.").and_then(|rest| {
        let (n, part) = rest.split_once('.')?;
        n.parse::<usize>()
            .ok()
            .filter(|&n| n < cfg.depth)
            .map(|_| part)
    });
    let (out, inp) = match (block, base) {
        (Some("norm1" | "norm2"), _) => (h, 0),
        (Some("attn.qkv"), _) => (3 * h, h),
        (Some("attn.proj"), _) => (h, h),
        (Some("mlp.linear_fc1"), _) => (i, h),
        (Some("mlp.linear_fc2"), _) => (h, i),
        (Some(_), _) => return None,
        (None, "merger.norm") => (h, 0),
        (None, "merger.linear_fc1") => (m, m),
        (None, "merger.linear_fc2") => (cfg.out_hidden_size, m),
        (None, "pos_embed") if kind == "weight" => {
            return Some(vec![cfg.num_position_embeddings, h])
        }
        (None, "patch_embed.proj") if kind == "weight" => return Some(vec![h, c, t, p, p]),
        (None, "patch_embed.proj") => (h, 0),
        _ => return None,
    };
    Some(match kind {
        "weight" if inp > 0 => vec![out, inp],
        "weight" | "bias" => vec![out],
        _ => return None,
    })
}

/// Where the tokens of a prompt with images sit: transformers' `get_rope_index` over the prompt.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PromptPositions {
    /// `(t, h, w)` of every token: text advances all three by one a token; an image's tokens sit at
    /// its start (t) plus their merged row (h) and column (w); the text after an image starts at
    /// the image's start plus `max(h, w) / merge`.
    pub positions: Vec<[u32; 3]>,
    /// `max position + 1 − prompt length` (transformers' `rope_deltas`): a token at sequence
    /// position `p` after the prompt sits at `p + delta` on every axis.
    pub delta: i64,
    /// The rows of the image placeholder tokens, in order: the rows the images' merged tokens
    /// replace ([`crate::StepEmbeds::rows`]).
    pub image_rows: Vec<usize>,
}

impl PromptPositions {
    /// The positions of `ids`, whose runs of `image_token` are the images of `grids` in order
    /// (`merge`: the tower's `spatial_merge_size`).
    pub fn new(
        ids: &[u32],
        image_token: u32,
        grids: &[Grid],
        merge: usize,
    ) -> Result<Self, ImageError> {
        let (pos, delta) = rope_index(ids, image_token, grids, merge)?;
        let axis = |a: usize, i: usize| -> Result<u32, ImageError> {
            u32::try_from(pos[a][i])
                .map_err(|_| ImageError::Input(format!("position {} of token {i}", pos[a][i])))
        };
        let positions = (0..ids.len())
            .map(|i| Ok([axis(0, i)?, axis(1, i)?, axis(2, i)?]))
            .collect::<Result<Vec<_>, ImageError>>()?;
        let image_rows = (0..ids.len()).filter(|&i| ids[i] == image_token).collect();
        Ok(PromptPositions {
            positions,
            delta,
            image_rows,
        })
    }

    /// The positions of the `len` tokens at sequence positions `pos0 ..` after the prompt (the
    /// prompt's own positions for those within it): `p + delta` on every axis.
    pub fn at(&self, pos0: usize, len: usize) -> Vec<[u32; 3]> {
        (pos0..pos0 + len)
            .map(|p| match self.positions.get(p) {
                Some(&x) => x,
                None => [(p as i64 + self.delta).max(0) as u32; 3],
            })
            .collect()
    }

    /// The image rows among the sequence positions `pos0 .. pos0 + len`, as rows of a chunk
    /// starting at step row `start`, and the index of the first one among all image rows (where
    /// its merged tokens start).
    pub fn image_rows_in(&self, pos0: usize, len: usize, start: usize) -> (Vec<usize>, usize) {
        let first = self.image_rows.partition_point(|&r| r < pos0);
        let rows = self.image_rows[first..]
            .iter()
            .take_while(|&&r| r < pos0 + len)
            .map(|&r| start + r - pos0)
            .collect();
        (rows, first)
    }
}

impl<B: Backend> Model<B> {
    /// The merged tokens of the images of `grids` (patch rows `pixels`, see [`Vision::forward`]),
    /// computed by `vision`'s CPU tower and uploaded to this model's backend as a
    /// `[Σ tokens, hidden]` tensor: the input embeddings of their placeholder rows
    /// ([`crate::StepEmbeds::values`]).
    pub fn image_embeds(
        &self,
        vision: &Vision,
        pixels: &[f32],
        grids: &[Grid],
    ) -> Result<B::Tensor, ImageError> {
        let h = self.cfg.hidden_size;
        if vision.config.out_hidden_size != h {
            return Err(ImageError::Input(format!(
                "the vision tower's out_hidden_size {} is not the text model's hidden_size {h}",
                vision.config.out_hidden_size
            )));
        }
        let merged = vision.forward(pixels, grids)?;
        Ok(self.backend.upload(merged.len() / h, h, merged)?)
    }
}

#[cfg(test)]
mod device_bytes_tests {
    use super::*;

    #[test]
    fn the_tower_of_qwen3_5_takes_its_weights_and_grows_with_the_image() {
        let path = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../configs/models/qwen3.5-35b-a3b.json"
        );
        let cfg = ModelConfig::from_file(std::path::Path::new(path)).unwrap();
        let one = tower_device_bytes(&cfg, 1 << 20, false).unwrap();
        let four = tower_device_bytes(&cfg, 4 << 20, false).unwrap();
        // 27 blocks of width 1152 (MLP 4304) and the merger to 2048: 443.6 M bf16 matrix entries
        // and 2.9 M f32 vectors, 857.6 MiB (what the device tower reports, rounded: 858 MiB).
        assert_eq!(one.weights, four.weights);
        assert_eq!(one.weights, 899_263_424);
        assert_eq!(one.host, 0);
        // Activations: whole-image buffers scale with the patches (4096 of them at 1 MP), the
        // row-wise work's pieces do not.
        let piece = TOWER_CHUNK_ROWS * ((12 + 4) * 1152 + 6 * 4304);
        assert_eq!(four.activations - piece, 4 * (one.activations - piece));
        let a1 = one.activations;
        assert!((150 << 20..200 << 20).contains(&a1), "{a1} bytes at 1 MP");
        // With the blocks on the host, two blocks' slots stay on the device (a block: 29.1 MiB).
        let streamed = tower_device_bytes(&cfg, 1 << 20, true).unwrap();
        let block = streamed.host / 27;
        assert_eq!(block, 30_508_352);
        assert_eq!(streamed.weights, one.weights - 25 * block);
        assert_eq!(streamed.activations, one.activations);
        let text = ModelConfig::from_file(std::path::Path::new(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../configs/models/qwen3-next-80b-a3b.json"
        )))
        .unwrap();
        assert!(tower_device_bytes(&text, 1 << 20, false).is_none());
    }
}
