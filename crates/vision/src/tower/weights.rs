//! The tower's parameters in f32, gathered by name from wherever the caller keeps them. Names are
//! relative to the tower (the multimodal checkpoint's `model.visual.` stripped), as transformers'
//! `Qwen3_5MoeVisionModel` names its parameters:
//!
//! - `patch_embed.proj.{weight,bias}`: the Conv3d, `[hidden, channels, temporal, patch, patch]`
//!   (a `[hidden, channels · temporal · patch²]` matrix is taken too);
//! - `pos_embed.weight`: the learned position table, `[num_position_embeddings, hidden]`;
//! - `blocks.{i}.norm{1,2}.{weight,bias}`, `blocks.{i}.attn.{qkv,proj}.{weight,bias}`,
//!   `blocks.{i}.mlp.linear_fc{1,2}.{weight,bias}`;
//! - `merger.norm.{weight,bias}` (`[hidden]`), `merger.linear_fc1` (`[hidden · merge², hidden ·
//!   merge²]`), `merger.linear_fc2` (`[out_hidden, hidden · merge²]`).
//!
//! Matrices are row-major `[out, in]`, as PyTorch stores a Linear's weight.

use super::VisionConfig;
use crate::{Result, VisionError};

/// A fully connected layer: `y = W x + b`, `W` row-major `[out, in]`.
#[derive(Debug, Clone)]
pub struct Linear {
    pub weight: Vec<f32>,
    pub bias: Vec<f32>,
    pub inputs: usize,
    pub outputs: usize,
}

/// A LayerNorm's scale and shift.
#[derive(Debug, Clone)]
pub struct LayerNorm {
    pub weight: Vec<f32>,
    pub bias: Vec<f32>,
}

/// One transformer block.
#[derive(Debug, Clone)]
pub struct Block {
    pub norm1: LayerNorm,
    pub qkv: Linear,
    pub proj: Linear,
    pub norm2: LayerNorm,
    pub fc1: Linear,
    pub fc2: Linear,
}

/// The patch merger: norm, then two layers over `merge²` concatenated patches.
#[derive(Debug, Clone)]
pub struct Merger {
    pub norm: LayerNorm,
    pub fc1: Linear,
    pub fc2: Linear,
}

/// Every parameter of the tower.
#[derive(Debug, Clone)]
pub struct VisionWeights {
    /// The Conv3d as a matrix over a flattened patch row.
    pub patch_embed: Linear,
    /// `[num_position_embeddings, hidden]`, row-major.
    pub pos_embed: Vec<f32>,
    pub blocks: Vec<Block>,
    pub merger: Merger,
}

/// A tensor as the caller hands it over: shape and row-major values.
pub type Tensor = (Vec<usize>, Vec<f32>);

struct Loader<F> {
    get: F,
}

impl<F: FnMut(&str) -> Option<Tensor>> Loader<F> {
    /// The tensor `name`, which must have one of `shapes`.
    fn tensor(&mut self, name: &str, shapes: &[&[usize]]) -> Result<Vec<f32>> {
        let err = |message: String| VisionError::Weight {
            name: name.to_string(),
            message,
        };
        let (shape, data) = (self.get)(name).ok_or_else(|| err("missing".into()))?;
        if !shapes.contains(&shape.as_slice()) {
            return Err(err(format!("shape {shape:?}, expected {:?}", shapes[0])));
        }
        if data.len() != shape.iter().product::<usize>() {
            return Err(err(format!("{} values for shape {shape:?}", data.len())));
        }
        Ok(data)
    }

    fn linear(&mut self, prefix: &str, inputs: usize, outputs: usize) -> Result<Linear> {
        Ok(Linear {
            weight: self.tensor(&format!("{prefix}.weight"), &[&[outputs, inputs]])?,
            bias: self.tensor(&format!("{prefix}.bias"), &[&[outputs]])?,
            inputs,
            outputs,
        })
    }

    fn norm(&mut self, prefix: &str, width: usize) -> Result<LayerNorm> {
        Ok(LayerNorm {
            weight: self.tensor(&format!("{prefix}.weight"), &[&[width]])?,
            bias: self.tensor(&format!("{prefix}.bias"), &[&[width]])?,
        })
    }
}

impl VisionWeights {
    /// Gathers the tower's tensors through `get(name)`, which returns a tensor's shape and
    /// row-major f32 values, or `None` when there is no such tensor. A missing or mis-shaped
    /// tensor is a [`VisionError::Weight`] naming it.
    pub fn load(cfg: &VisionConfig, get: impl FnMut(&str) -> Option<Tensor>) -> Result<Self> {
        let mut l = Loader { get };
        let (h, c) = (cfg.hidden_size, cfg.in_channels);
        let (t, p) = (cfg.temporal_patch_size, cfg.patch_size);
        let patch_embed = Linear {
            weight: l.tensor(
                "patch_embed.proj.weight",
                &[&[h, c, t, p, p], &[h, cfg.patch_len()]],
            )?,
            bias: l.tensor("patch_embed.proj.bias", &[&[h]])?,
            inputs: cfg.patch_len(),
            outputs: h,
        };
        let pos_embed = l.tensor("pos_embed.weight", &[&[cfg.num_position_embeddings, h]])?;
        let blocks = (0..cfg.depth)
            .map(|i| {
                let b = format!("blocks.{i}");
                Ok(Block {
                    norm1: l.norm(&format!("{b}.norm1"), h)?,
                    qkv: l.linear(&format!("{b}.attn.qkv"), h, 3 * h)?,
                    proj: l.linear(&format!("{b}.attn.proj"), h, h)?,
                    norm2: l.norm(&format!("{b}.norm2"), h)?,
                    fc1: l.linear(&format!("{b}.mlp.linear_fc1"), h, cfg.intermediate_size)?,
                    fc2: l.linear(&format!("{b}.mlp.linear_fc2"), cfg.intermediate_size, h)?,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let merged = h * cfg.merge_unit();
        let merger = Merger {
            norm: l.norm("merger.norm", h)?,
            fc1: l.linear("merger.linear_fc1", merged, merged)?,
            fc2: l.linear("merger.linear_fc2", merged, cfg.out_hidden_size)?,
        };
        Ok(VisionWeights {
            patch_embed,
            pos_embed,
            blocks,
            merger,
        })
    }
}
