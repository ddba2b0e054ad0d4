//! Where each image patch and token sits, as transformers computes it for the Qwen3.5 vision tower
//! and its text model (`vision_utils.py` and `get_rope_index`, transformers 5.17):
//!
//! - [`rotary_positions`]: each patch's (row, column) for the tower's 2-D rotary embedding, patches in
//!   merge order (the `merge × merge` patches a merged token takes are consecutive);
//! - [`interpolation`]: the four taps and weights that resample the square learned position table
//!   (`side × side`) to a patch's grid bilinearly with aligned corners, in f32 as transformers does;
//! - [`rope_index`]: the text model's 3-D (t, h, w) positions of a token sequence whose images are
//!   runs of the image token, and the offset of the positions after it.

use crate::{Result, VisionError};

/// One image's grid in patches: `[t, h, w]`.
pub type Grid = [usize; 3];

/// The row and column of every patch of every image, in merge order, each frame of an image again.
pub fn rotary_positions(grids: &[Grid], merge: usize) -> Vec<[usize; 2]> {
    let mut out = Vec::new();
    for &[t, h, w] in grids {
        for _ in 0..t {
            for bh in 0..h / merge {
                for bw in 0..w / merge {
                    for mh in 0..merge {
                        for mw in 0..merge {
                            out.push([bh * merge + mh, bw * merge + mw]);
                        }
                    }
                }
            }
        }
    }
    out
}

/// A patch's position embedding: `Σ weight[i] · table[index[i]]`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Taps {
    pub index: [usize; 4],
    pub weight: [f32; 4],
}

/// One axis: the two taps and weights of position `i` of `n` over a table side of `side`.
fn axis(i: usize, n: usize, side: usize) -> ([usize; 2], [f32; 2]) {
    let src = i as f32 * (side - 1) as f32 / (n.max(2) - 1) as f32;
    let floor = src.floor();
    let f = floor as usize;
    let taps = [f.min(side - 1), (f + 1).min(side - 1)];
    let w = [0.0f32, 1.0].map(|o| (1.0 - (src - floor - o).abs()).max(0.0));
    (taps, w)
}

/// The bilinear taps of every patch (merge order, as [`rotary_positions`]).
pub fn interpolation(grids: &[Grid], side: usize, merge: usize) -> Vec<Taps> {
    let mut out = Vec::new();
    for (&[_, h, w], [row, col]) in grids
        .iter()
        .flat_map(|g| std::iter::repeat_n(g, g[0] * g[1] * g[2]))
        .zip(rotary_positions(grids, merge))
    {
        let (ht, hw) = axis(row, h, side);
        let (wt, ww) = axis(col, w, side);
        out.push(Taps {
            index: [
                ht[0] * side + wt[0],
                ht[0] * side + wt[1],
                ht[1] * side + wt[0],
                ht[1] * side + wt[1],
            ],
            weight: [hw[0] * ww[0], hw[0] * ww[1], hw[1] * ww[0], hw[1] * ww[1]],
        });
    }
    out
}

/// The text model's positions of `ids`: `[t, h, w]` rows, and the offset (`max + 1 − len`) that
/// positions after the sequence add. Text advances all three by one a token; an image (a run of
/// `image_token` of `t · h · w / merge²` tokens, the next grid of `grids`) takes `t` at its start, and
/// `h` and `w` from its start plus the merged row and column; the text after it starts at the
/// image's start plus `max(h, w) / merge`.
pub fn rope_index(
    ids: &[u32],
    image_token: u32,
    grids: &[Grid],
    merge: usize,
) -> Result<([Vec<i64>; 3], i64)> {
    let mut pos: [Vec<i64>; 3] = Default::default();
    let mut grids = grids.iter();
    let mut current = 0i64;
    let mut i = 0;
    while i < ids.len() {
        if ids[i] != image_token {
            for p in pos.iter_mut() {
                p.push(current);
            }
            current += 1;
            i += 1;
            continue;
        }
        let run = ids[i..].iter().take_while(|&&t| t == image_token).count();
        let &[t, h, w] = grids.next().ok_or_else(|| {
            VisionError::Tokens(format!("image token run at {i} has no image grid left"))
        })?;
        let (lh, lw) = (h / merge, w / merge);
        if run != t * lh * lw {
            return Err(VisionError::Tokens(format!(
                "image token run at {i} has {run} tokens, its grid {t}x{h}x{w} merges to {}",
                t * lh * lw
            )));
        }
        for ti in 0..t {
            for r in 0..lh {
                for c in 0..lw {
                    pos[0].push(current + ti as i64);
                    pos[1].push(current + r as i64);
                    pos[2].push(current + c as i64);
                }
            }
        }
        current += lh.max(lw) as i64;
        i += run;
    }
    if grids.next().is_some() {
        return Err(VisionError::Tokens(
            "more image grids than image token runs".into(),
        ));
    }
    let max = pos
        .iter()
        .flat_map(|p| p.iter())
        .copied()
        .max()
        .unwrap_or(-1);
    Ok((pos, max + 1 - ids.len() as i64))
}
