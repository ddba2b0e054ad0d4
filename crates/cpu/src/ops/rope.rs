//! Rotary position embedding, NeoX style (`rotate_half`), on the first `rot_dim` dims of every head, and
//! the interleaved multimodal variant (MRoPE) of Qwen3-VL / Qwen3.5.
//!
//! As in transformers, the angle of frequency `j` is the f32 product `position · inv_freq[j]`; cos and sin
//! are then taken of that f32 angle (through f64, so correctly rounded whatever the platform's libm) and
//! multiplied by the attention scaling `mscale` in f32. Pair `(j, j + rot_dim/2)` of each head becomes
//! `(x1·cos − x2·sin, x2·cos + x1·sin)`; dims from `rot_dim` on pass through.

use rayon::prelude::*;

use super::PAR_MIN_WORK;

/// Which position axis (0 = temporal, 1 = height, 2 = width) frequency `j` uses under interleaved MRoPE:
/// transformers' `apply_interleaved_mrope` takes frequency `j` from axis 1 when `j % 3 == 1` and
/// `j < 3·sections[1]`, from axis 2 when `j % 3 == 2` and `j < 3·sections[2]`, and from axis 0 otherwise.
pub fn mrope_axis(j: usize, sections: &[usize; 3]) -> usize {
    match j % 3 {
        1 if j < 3 * sections[1] => 1,
        2 if j < 3 * sections[2] => 2,
        _ => 0,
    }
}

/// Fills `cos`/`sin` (`rot_dim/2` each) for one token; `pos(j)` is the position frequency `j` uses.
#[inline]
fn angles(
    inv_freq: &[f32],
    mscale: f32,
    pos: impl Fn(usize) -> u32,
    cos: &mut [f32],
    sin: &mut [f32],
) {
    for (j, ((c, s), f)) in cos.iter_mut().zip(sin.iter_mut()).zip(inv_freq).enumerate() {
        let angle = (pos(j) as f32 * f) as f64;
        *c = angle.cos() as f32 * mscale;
        *s = angle.sin() as f32 * mscale;
    }
}

/// Rotates the first `2·cos.len()` dims of every head of one token row.
#[inline]
fn rotate_row(row: &mut [f32], head_dim: usize, cos: &[f32], sin: &[f32]) {
    let half = cos.len();
    for head in row.chunks_exact_mut(head_dim) {
        let (x1, rest) = head.split_at_mut(half);
        let x2 = &mut rest[..half];
        for (((a, b), c), s) in x1.iter_mut().zip(x2.iter_mut()).zip(cos).zip(sin) {
            let (u, v) = (*a, *b);
            *a = u * c + (-v) * s;
            *b = v * c + u * s;
        }
    }
}

/// Applies the rotation to every token row of `x`, computing the angles of token `s` with `pos(s, j)`.
fn apply(
    x: &mut [f32],
    n_heads: usize,
    head_dim: usize,
    rot_dim: usize,
    inv_freq: &[f32],
    mscale: f32,
    pos: impl Fn(usize, usize) -> u32 + Sync,
) {
    let half = rot_dim / 2;
    let width = n_heads * head_dim;
    if half == 0 || width == 0 {
        return;
    }
    let token = |s: usize, row: &mut [f32], buf: &mut Vec<f32>| {
        buf.resize(2 * half, 0.0);
        let (cos, sin) = buf.split_at_mut(half);
        angles(inv_freq, mscale, |j| pos(s, j), cos, sin);
        rotate_row(row, head_dim, cos, sin);
    };
    if x.len() * 4 < PAR_MIN_WORK || x.len() == width {
        let mut buf = Vec::with_capacity(2 * half);
        x.chunks_exact_mut(width)
            .enumerate()
            .for_each(|(s, row)| token(s, row, &mut buf));
    } else {
        x.par_chunks_mut(width)
            .enumerate()
            .for_each_init(Vec::new, |buf, (s, row)| token(s, row, buf));
    }
}

fn check(
    name: &str,
    x: &[f32],
    n_heads: usize,
    head_dim: usize,
    rot_dim: usize,
    t: usize,
    inv_freq: &[f32],
) {
    assert!(
        rot_dim.is_multiple_of(2) && rot_dim <= head_dim,
        "{name}: rot_dim must be even and at most head_dim"
    );
    assert_eq!(
        inv_freq.len(),
        rot_dim / 2,
        "{name}: inv_freq must have rot_dim/2 entries"
    );
    assert_eq!(
        x.len(),
        t * n_heads * head_dim,
        "{name}: x must be [t, n_heads*head_dim]"
    );
}

/// NeoX-style RoPE in place on the first `rot_dim` dims of each head.
///
/// `x`: `[t, n_heads·head_dim]`; `positions`: `[t]`; `inv_freq`: `[rot_dim/2]` (`theta^(-2j/rot_dim)`,
/// possibly YaRN-scaled by the caller); `mscale` multiplies cos and sin (1.0 unless YaRN).
pub fn rope_neox(
    x: &mut [f32],
    n_heads: usize,
    head_dim: usize,
    rot_dim: usize,
    positions: &[u32],
    inv_freq: &[f32],
    mscale: f32,
) {
    check(
        "rope_neox",
        x,
        n_heads,
        head_dim,
        rot_dim,
        positions.len(),
        inv_freq,
    );
    apply(x, n_heads, head_dim, rot_dim, inv_freq, mscale, |s, _| {
        positions[s]
    });
}

/// The token positions of interleaved MRoPE: `positions[s]` is token `s`'s
/// `[temporal, height, width]`; `sections` is the config's `mrope_section`.
#[derive(Debug, Clone, Copy)]
pub struct MropePositions<'a> {
    pub positions: &'a [[u32; 3]],
    pub sections: &'a [usize; 3],
}

/// Interleaved MRoPE in place: like [`rope_neox`], but frequency `j` of token `s` uses
/// `p.positions[s][mrope_axis(j, p.sections)]`. With equal positions on the three axes it is
/// `rope_neox`.
pub fn rope_mrope_interleaved(
    x: &mut [f32],
    n_heads: usize,
    head_dim: usize,
    rot_dim: usize,
    p: MropePositions<'_>,
    inv_freq: &[f32],
    mscale: f32,
) {
    check(
        "rope_mrope_interleaved",
        x,
        n_heads,
        head_dim,
        rot_dim,
        p.positions.len(),
        inv_freq,
    );
    let axis: Vec<usize> = (0..rot_dim / 2)
        .map(|j| mrope_axis(j, p.sections))
        .collect();
    apply(x, n_heads, head_dim, rot_dim, inv_freq, mscale, |s, j| {
        p.positions[s][axis[j]]
    });
}
