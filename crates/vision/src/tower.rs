//! The vision tower's forward pass on the CPU in f32: the reference the accelerated tower is held
//! to. It computes what transformers 5.17's `Qwen3_5MoeVisionModel` does (the tower Qwen3.5 and
//! Qwen3.6 inherit from Qwen3-VL, without its deepstack mergers):
//!
//! 1. patch embedding: the Conv3d whose kernel equals its stride, i.e. a linear layer with bias
//!    over each patch row of `channels · temporal · patch²` pixels;
//! 2. plus the learned position table resampled bilinearly (aligned corners) to the image's grid,
//!    repeated over its frames, in the patches' merge order ([`positions::interpolation`]);
//! 3. `depth` blocks, `x += attn(norm1(x)); x += mlp(norm2(x))`, LayerNorm with eps 1e-6. The
//!    attention is bidirectional within one frame of one image (a frame's `h · w` patches), its
//!    q and k turned by a 2-D rotary embedding: per head, frequencies `θ^(−2i / (head_dim / 2))`
//!    for `i < head_dim / 4`, the row's angles then the column's, that half repeated, applied with
//!    `rotate_half` over the whole head ([`positions::rotary_positions`]);
//! 4. the merger: LayerNorm per patch, `merge²` consecutive patches concatenated into one row,
//!    `linear_fc1` (square), exact-erf GELU, `linear_fc2` to the text model's width.
//!
//! Only the merged tokens come out: Qwen3.5's tower returns no extra feature levels (its config
//! has no `deepstack_visual_indexes`; transformers ignores the key if a config carries one).
//! Matrix products, norms, softmax and activations accumulate in f64; values are stored in f32.

mod config;
mod weights;

pub use config::{Activation, VisionConfig};
pub use weights::{Block, LayerNorm, Linear, Merger, Tensor, VisionWeights};

use crate::positions::{self, Grid};
use crate::{Result, VisionError};
use rayon::prelude::*;

/// A point of the forward pass that [`forward_observed`] shows, each `[patches, hidden]` row-major
/// with patches in the model's (merge) order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// The patch embedding's output, before positions.
    PatchEmbed,
    /// The interpolated position embedding added to each patch.
    PositionEmbed,
    /// The output of block `i`.
    Block(usize),
}

/// The merged image tokens, `[Σ t·h·w / merge², out_hidden_size]` row-major, of `pixels`
/// (`[Σ t·h·w, channels · temporal · patch²]`, the images' patch rows one after another, as
/// [`crate::Patches`] holds them) for the images of `grids` (`[t, h, w]` in patches, each).
pub fn forward(
    cfg: &VisionConfig,
    w: &VisionWeights,
    pixels: &[f32],
    grids: &[Grid],
) -> Result<Vec<f32>> {
    forward_observed(cfg, w, pixels, grids, |_, _| {})
}

/// [`forward`], showing `observe` each [`Stage`] as it is computed.
pub fn forward_observed(
    cfg: &VisionConfig,
    w: &VisionWeights,
    pixels: &[f32],
    grids: &[Grid],
    mut observe: impl FnMut(Stage, &[f32]),
) -> Result<Vec<f32>> {
    let frames = check_inputs(cfg, w, pixels, grids)?;
    let hidden = cfg.hidden_size;
    let merge = cfg.spatial_merge_size;

    let mut x = linear(&w.patch_embed, pixels);
    observe(Stage::PatchEmbed, &x);

    let side = cfg.position_side();
    let mut pos = Vec::with_capacity(x.len());
    for taps in positions::interpolation(grids, side, merge) {
        for d in 0..hidden {
            let v: f64 = (0..4)
                .map(|k| w.pos_embed[taps.index[k] * hidden + d] as f64 * taps.weight[k] as f64)
                .sum();
            pos.push(v as f32);
        }
    }
    observe(Stage::PositionEmbed, &pos);
    add(&mut x, &pos);

    let rope = Rope::new(cfg, &positions::rotary_positions(grids, merge));
    for (i, block) in w.blocks.iter().enumerate() {
        let a = attention(cfg, block, &layer_norm(&block.norm1, &x), &rope, &frames);
        add(&mut x, &a);
        let m = mlp(cfg.hidden_act, block, &layer_norm(&block.norm2, &x));
        add(&mut x, &m);
        observe(Stage::Block(i), &x);
    }

    // The merger: norm each patch, then `merge²` consecutive patches as one row.
    let normed = layer_norm(&w.merger.norm, &x);
    let mut y = linear(&w.merger.fc1, &normed);
    y.iter_mut().for_each(|v| *v = gelu_erf(*v));
    Ok(linear(&w.merger.fc2, &y))
}

/// The attention segments, `(start, len)` in patches (one per frame of each image), after
/// checking the inputs agree with each other.
fn check_inputs(
    cfg: &VisionConfig,
    w: &VisionWeights,
    pixels: &[f32],
    grids: &[Grid],
) -> Result<Vec<(usize, usize)>> {
    if w.patch_embed.inputs != cfg.patch_len()
        || w.patch_embed.outputs != cfg.hidden_size
        || w.blocks.len() != cfg.depth
        || w.merger.fc2.outputs != cfg.out_hidden_size
    {
        return Err(VisionError::Input(
            "the weights were loaded for another vision config".into(),
        ));
    }
    frames(cfg, pixels, grids)
}

/// The attention segments, `(start, len)` in patches (one per frame of each image), of patch rows
/// `pixels` whose grids are `grids`: an error when a grid is empty, a side is not a multiple of the
/// merge size, or the pixels are not the grids' patches.
pub fn frames(cfg: &VisionConfig, pixels: &[f32], grids: &[Grid]) -> Result<Vec<(usize, usize)>> {
    let merge = cfg.spatial_merge_size;
    let mut frames = Vec::new();
    let mut start = 0;
    for (i, &[t, h, w]) in grids.iter().enumerate() {
        if t == 0 || h == 0 || w == 0 || h % merge != 0 || w % merge != 0 {
            return Err(VisionError::Input(format!(
                "image {i}: grid {t}x{h}x{w} is empty or its sides are not multiples of the merge size {merge}"
            )));
        }
        for _ in 0..t {
            frames.push((start, h * w));
            start += h * w;
        }
    }
    if pixels.len() != start * cfg.patch_len() {
        return Err(VisionError::Input(format!(
            "{} pixel values, the grids' {start} patches of {} need {}",
            pixels.len(),
            cfg.patch_len(),
            start * cfg.patch_len()
        )));
    }
    Ok(frames)
}

/// Each patch's rotary `cos` and `sin` over the head dimension, computed in f32 as transformers
/// does whatever the model's dtype.
struct Rope {
    cos: Vec<f32>,
    sin: Vec<f32>,
    dim: usize,
}

impl Rope {
    fn new(cfg: &VisionConfig, rows_cols: &[[usize; 2]]) -> Self {
        let dim = cfg.head_dim();
        let half = dim / 2;
        let inv_freq: Vec<f32> = (0..half / 2)
            .map(|i| 1.0 / (cfg.rope_theta as f32).powf((2 * i) as f32 / half as f32))
            .collect();
        let (mut cos, mut sin) = (Vec::new(), Vec::new());
        for &[row, col] in rows_cols {
            let angles: Vec<f32> = [row, col]
                .iter()
                .flat_map(|&p| inv_freq.iter().map(move |f| p as f32 * f))
                .collect();
            for _ in 0..2 {
                cos.extend(angles.iter().map(|&a| (a as f64).cos() as f32));
                sin.extend(angles.iter().map(|&a| (a as f64).sin() as f32));
            }
        }
        Rope { cos, sin, dim }
    }

    /// Turns one head's vector `x` of patch `p`: `x · cos + rotate_half(x) · sin`.
    fn apply(&self, p: usize, x: &mut [f32]) {
        let (cos, sin) = (
            &self.cos[p * self.dim..][..self.dim],
            &self.sin[p * self.dim..][..self.dim],
        );
        let half = self.dim / 2;
        let rotated: Vec<f32> = (0..self.dim)
            .map(|j| if j < half { -x[j + half] } else { x[j - half] })
            .collect();
        for j in 0..self.dim {
            x[j] = x[j] * cos[j] + rotated[j] * sin[j];
        }
    }
}

/// The block's self-attention over the normed `x`, each frame attending to itself only.
fn attention(
    cfg: &VisionConfig,
    b: &Block,
    x: &[f32],
    rope: &Rope,
    frames: &[(usize, usize)],
) -> Vec<f32> {
    let (hidden, heads, dim) = (cfg.hidden_size, cfg.num_heads, cfg.head_dim());
    let mut qkv = linear(&b.qkv, x);
    // Each row is [q | k | v], each of those [head, dim].
    for (p, row) in qkv.chunks_exact_mut(3 * hidden).enumerate() {
        for head in row[..2 * hidden].chunks_exact_mut(dim) {
            rope.apply(p, head);
        }
    }
    let scale = 1.0 / (dim as f64).sqrt();
    let at =
        |p: usize, part: usize, h: usize| &qkv[p * 3 * hidden + part * hidden + h * dim..][..dim];
    let mut out = vec![0f32; x.len()];
    for &(start, len) in frames {
        // Each query row on its own thread; per row and head the same sums in the same order.
        let rows = &mut out[start * hidden..(start + len) * hidden];
        rows.par_chunks_mut(hidden)
            .enumerate()
            .for_each(|(r, orow)| {
                let i = start + r;
                let mut scores = Vec::with_capacity(len);
                let mut acc = vec![0f64; dim];
                for h in 0..heads {
                    let q = at(i, 0, h);
                    scores.clear();
                    scores.extend((start..start + len).map(|j| dot(q, at(j, 1, h)) * scale));
                    let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                    scores.iter_mut().for_each(|s| *s = (*s - max).exp());
                    let total: f64 = scores.iter().sum();
                    // `Sum` of f64 starts from -0.0.
                    acc.iter_mut().for_each(|a| *a = -0.0);
                    for (j, s) in (start..start + len).zip(&scores) {
                        for (a, &v) in acc.iter_mut().zip(at(j, 2, h)) {
                            *a += s * v as f64;
                        }
                    }
                    for (od, a) in orow[h * dim..][..dim].iter_mut().zip(&acc) {
                        *od = (a / total) as f32;
                    }
                }
            });
    }
    linear(&b.proj, &out)
}

/// The block's MLP: `linear_fc2(act(linear_fc1(x)))`.
fn mlp(act: Activation, b: &Block, x: &[f32]) -> Vec<f32> {
    let mut y = linear(&b.fc1, x);
    y.iter_mut().for_each(|v| *v = activate(act, *v));
    linear(&b.fc2, &y)
}

/// `x · Wᵀ + b` over rows of `l.inputs` values.
fn linear(l: &Linear, x: &[f32]) -> Vec<f32> {
    let mut y = vec![0f32; x.len() / l.inputs * l.outputs];
    y.par_chunks_mut(l.outputs)
        .zip(x.par_chunks_exact(l.inputs))
        .for_each(|(out, row)| {
            for ((o, w), b) in out
                .iter_mut()
                .zip(l.weight.chunks_exact(l.inputs))
                .zip(&l.bias)
            {
                *o = (*b as f64 + dot(w, row)) as f32;
            }
        });
    y
}

/// LayerNorm (eps 1e-6, biased variance) over rows of the norm's width.
fn layer_norm(n: &LayerNorm, x: &[f32]) -> Vec<f32> {
    let width = n.weight.len();
    let mut y = Vec::with_capacity(x.len());
    for row in x.chunks_exact(width) {
        let mean = row.iter().map(|&v| v as f64).sum::<f64>() / width as f64;
        let var = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / width as f64;
        let inv = 1.0 / (var + 1e-6).sqrt();
        for ((&v, &g), &b) in row.iter().zip(&n.weight).zip(&n.bias) {
            y.push(((v as f64 - mean) * inv * g as f64 + b as f64) as f32);
        }
    }
    y
}

fn activate(act: Activation, x: f32) -> f32 {
    let v = x as f64;
    match act {
        Activation::GeluTanh => gelu_tanh(x),
        Activation::Gelu => gelu_erf(x),
        Activation::Silu => (v / (1.0 + (-v).exp())) as f32,
        Activation::QuickGelu => (v / (1.0 + (-1.702 * v).exp())) as f32,
    }
}

/// GELU's tanh approximation (`gelu_pytorch_tanh`):
/// `x/2 · (1 + tanh(√(2/π) · (x + 0.044715 x³)))`.
pub fn gelu_tanh(x: f32) -> f32 {
    let v = x as f64;
    let k = (2.0 / std::f64::consts::PI).sqrt();
    (0.5 * v * (1.0 + (k * (v + 0.044715 * v * v * v)).tanh())) as f32
}

/// The exact GELU (`nn.GELU()`): `x/2 · (1 + erf(x / √2))`.
pub fn gelu_erf(x: f32) -> f32 {
    let v = x as f64;
    (0.5 * v * (1.0 + erf(v / std::f64::consts::SQRT_2))) as f32
}

/// The error function to a few 1e-15: `2/√π · e^(−x²) · Σₙ 2ⁿ x^(2n+1) / (1·3···(2n+1))`, a
/// series of positive terms (no cancellation); beyond |x| = 6, erf is ±1 in f64.
pub fn erf(x: f64) -> f64 {
    if x.is_nan() {
        return x;
    }
    let a = x.abs();
    if a >= 6.0 {
        return x.signum();
    }
    let (mut term, mut sum, mut n) = (a, a, 0.0);
    while term > sum * 1e-17 {
        n += 1.0;
        term *= 2.0 * a * a / (2.0 * n + 1.0);
        sum += term;
    }
    let r = 2.0 / std::f64::consts::PI.sqrt() * (-a * a).exp() * sum;
    r.min(1.0).copysign(x)
}

fn dot(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum()
}

fn add(x: &mut [f32], y: &[f32]) {
    x.iter_mut().zip(y).for_each(|(a, b)| *a += b);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn erf_and_gelu_known_values() {
        // erf from tables (Abramowitz & Stegun 7.1), to a few 1e-15.
        for (x, want) in [
            (0.0, 0.0),
            (0.5, 0.520_499_877_813_046_5),
            (1.0, 0.842_700_792_949_714_9),
            (2.0, 0.995_322_265_018_952_7),
            (3.5, 0.999_999_256_901_627_7),
            (-1.0, -0.842_700_792_949_714_9),
        ] {
            assert!((erf(x) - want).abs() < 4e-15, "erf({x}) = {}", erf(x));
        }
        assert_eq!(erf(7.0), 1.0);
        assert!((gelu_erf(1.0) - 0.841_344_7).abs() < 1e-7);
        assert!((gelu_tanh(1.0) - 0.841_192).abs() < 1e-7);
        assert_eq!(gelu_erf(-20.0), 0.0);
    }
}
