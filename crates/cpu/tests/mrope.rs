//! Interleaved MRoPE on the CPU backend against transformers' formula: the axis each frequency
//! takes (`recomposition_frequencies`), the rope op, and the backend's attention turning rows at
//! explicit (t, h, w) positions (`rotate_half` over the partial rotary dims), two sequences in one call.

use sanmai_cpu::ops::{rope_mrope_interleaved, MropePositions};
use sanmai_cpu::{CpuBackend, CpuTensor};
use sanmai_model::backend::{mrope_axis, CacheSpec};
use sanmai_model::{AttnCall, AttnShape, AttnWeights, Backend, GdnShape, Mrope, Rope, SeqChunk};

/// transformers' `Qwen3_5MoeTextRotaryEmbedding` for one token at `(t, h, w)`: per axis the f32
/// angles `pos · inv_freq`, then `recomposition_frequencies` (T's table with H's entries at
/// `1, 4, ..` below `3·section[1]` and W's at `2, 5, ..` below `3·section[2]`), doubled; cos/sin.
fn transformers_cos_sin(
    pos: [u32; 3],
    inv_freq: &[f32],
    section: [usize; 3],
) -> (Vec<f64>, Vec<f64>) {
    let freqs: Vec<Vec<f32>> = pos
        .iter()
        .map(|&p| inv_freq.iter().map(|&f| p as f32 * f).collect())
        .collect();
    let mut thw = freqs[0].clone();
    for (dim, offset) in [(1usize, 1usize), (2, 2)] {
        let length = section[dim] * 3;
        for j in (offset..length.min(thw.len())).step_by(3) {
            thw[j] = freqs[dim][j];
        }
    }
    let emb: Vec<f32> = thw.iter().chain(&thw).copied().collect();
    (
        emb.iter().map(|&a| (a as f64).cos()).collect(),
        emb.iter().map(|&a| (a as f64).sin()).collect(),
    )
}

/// transformers' `apply_rotary_pos_emb` with a partial rotary: `x_rot · cos + rotate_half(x_rot) ·
/// sin` on the first `cos.len()` dims of each head, the rest passed through.
fn transformers_rotate(x: &[f64], head_dim: usize, cos: &[f64], sin: &[f64]) -> Vec<f64> {
    let rot = cos.len();
    let half = rot / 2;
    let mut out = x.to_vec();
    for (head, o) in x.chunks_exact(head_dim).zip(out.chunks_exact_mut(head_dim)) {
        for j in 0..rot {
            let rotated = if j < half {
                -head[j + half]
            } else {
                head[j - half]
            };
            o[j] = head[j] * cos[j] + rotated * sin[j];
        }
    }
    out
}

#[test]
fn mrope_axes_are_transformers_recomposition() {
    // Qwen3.5's sections: 64 rotary dims, 32 frequencies.
    let s = [11, 11, 10];
    let inv: Vec<f32> = (0..32)
        .map(|j| 1.0 / 10_000_000f32.powf(j as f32 / 32.0))
        .collect();
    let pos = [7u32, 3, 12];
    let (cos, _) = transformers_cos_sin(pos, &inv, s);
    for j in 0..32 {
        let want = (pos[mrope_axis(j, &s)] as f32 * inv[j]) as f64;
        assert_eq!(cos[j], want.cos(), "frequency {j}");
    }
    // Hand-checked: H takes 1, 4, .., 31 (below 3·11), W takes 2, 5, .., 29 (below 3·10), T the
    // rest (0, 3, .., 30).
    let axes: Vec<usize> = (0..32).map(|j| mrope_axis(j, &s)).collect();
    assert_eq!(&axes[..7], &[0, 1, 2, 0, 1, 2, 0]);
    assert_eq!(&axes[27..], &[0, 1, 2, 0, 1]);
    // The tiny fixture's [2, 1, 1]: t, h, w, t.
    assert_eq!(
        (0..4)
            .map(|j| mrope_axis(j, &[2, 1, 1]))
            .collect::<Vec<_>>(),
        [0, 1, 2, 0]
    );
}

#[test]
fn mrope_op_is_transformers_formula() {
    let (nh, hd, rot) = (3, 16, 8);
    let inv: Vec<f32> = (0..rot / 2)
        .map(|j| 1.0 / 10_000f32.powf((2 * j) as f32 / rot as f32))
        .collect();
    let positions = [[5u32, 2, 9], [0, 0, 0], [40, 41, 44]];
    let x: Vec<f32> = (0..positions.len() * nh * hd)
        .map(|i| ((i * 37 % 101) as f32 / 50.0) - 1.0)
        .collect();
    let mut got = x.clone();
    let sections = [2, 1, 1];
    rope_mrope_interleaved(
        &mut got,
        nh,
        hd,
        rot,
        MropePositions {
            positions: &positions,
            sections: &sections,
        },
        &inv,
        1.0,
    );
    for (r, &p) in positions.iter().enumerate() {
        let (cos, sin) = transformers_cos_sin(p, &inv, sections);
        let row: Vec<f64> = x[r * nh * hd..(r + 1) * nh * hd]
            .iter()
            .map(|&v| v as f64)
            .collect();
        let want = transformers_rotate(&row, hd, &cos, &sin);
        for (g, w) in got[r * nh * hd..(r + 1) * nh * hd].iter().zip(&want) {
            assert!((*g as f64 - w).abs() < 1e-6, "row {r}: {g} vs {w}");
        }
    }
}

/// The backend's attention with explicit positions: two sequences in one call (the second's rows
/// start after the first's), against the gated attention computed here with transformers' MRoPE.
#[test]
fn attention_turns_rows_at_their_mrope_positions() {
    let b = CpuBackend::new();
    let (nh, nkv, d, rot) = (2, 1, 16, 8);
    b.init_cache(&CacheSpec {
        num_blocks: 4,
        block_size: 4,
        attn_layers: vec![0],
        num_kv_heads: nkv,
        head_dim: d,
        index_head_dim: 0,
        gdn_layers: vec![],
        gdn: GdnShape {
            num_k_heads: 1,
            num_v_heads: 1,
            k_head_dim: 8,
            v_head_dim: 8,
            conv_kernel: 4,
        },
        ple_layers: vec![],
        ple: None,
        kv_host: None,
    })
    .unwrap();
    let w = |n: usize| b.weight(vec![0.0; n], &[n]).unwrap();
    let weights = AttnWeights {
        q_proj: w(1),
        k_proj: w(1),
        v_proj: w(1),
        o_proj: w(1),
        q_norm: b
            .weight((0..d).map(|i| 0.05 * i as f32).collect(), &[d])
            .unwrap(),
        k_norm: b
            .weight((0..d).map(|i| -0.03 * i as f32).collect(), &[d])
            .unwrap(),
    };
    let shape = AttnShape {
        num_heads: nh,
        num_kv_heads: nkv,
        head_dim: d,
        eps: 1e-6,
    };
    let rope = Rope {
        rot_dim: rot,
        inv_freq: (0..rot / 2)
            .map(|j| 1.0 / 10_000f32.powf((2 * j) as f32 / rot as f32))
            .collect(),
        mscale: 1.0,
    };
    let sections = [2, 1, 1];
    // Sequence 0: 3 rows (text, then two image tokens); sequence 1: 2 rows.
    let positions = [[0u32, 0, 0], [1, 1, 1], [1, 1, 2], [0, 0, 0], [3, 5, 4]];
    let rows = positions.len();
    let data = |cols: usize, seed: usize| {
        let v = (0..rows * cols)
            .map(|i| (((i + seed) * 53 % 97) as f32 / 48.0) - 1.0)
            .collect();
        CpuTensor {
            rows,
            cols,
            data: v,
        }
    };
    let (q_gate, k, v) = (data(2 * nh * d, 1), data(nkv * d, 2), data(nkv * d, 3));
    let blocks = [vec![0u32, 1], vec![2u32, 3]];
    let seqs = [
        SeqChunk {
            start: 0,
            len: 3,
            pos0: 0,
            state: 0,
            blocks: &blocks[0],
        },
        SeqChunk {
            start: 3,
            len: 2,
            pos0: 0,
            state: 1,
            blocks: &blocks[1],
        },
    ];
    let out = b
        .attention(&AttnCall {
            layer: 0,
            shape: &shape,
            rope: &rope,
            q_gate: &q_gate,
            k: &k,
            v: &v,
            w: &weights,
            seqs: &seqs,
            mrope: Some(Mrope {
                positions: &positions,
                sections,
            }),
        })
        .unwrap();

    // The reference: zero-centred RMSNorm of each head, MRoPE, causal softmax, sigmoid gate.
    let norm = |x: &[f32], w: &[f32]| -> Vec<f64> {
        let ms = x.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / x.len() as f64;
        let inv = 1.0 / (ms + 1e-6).sqrt();
        x.iter()
            .zip(w)
            .map(|(&v, &g)| v as f64 * inv * (1.0 + g as f64))
            .collect()
    };
    let qn = weights.q_norm.data.clone();
    let kn = weights.k_norm.data.clone();
    for s in &seqs {
        let roped = |r: usize, x: Vec<f64>| {
            let (cos, sin) = transformers_cos_sin(positions[r], &rope.inv_freq, sections);
            transformers_rotate(&x, d, &cos, &sin)
        };
        let keys: Vec<Vec<f64>> = (s.start..s.start + s.len)
            .map(|r| roped(r, norm(&k.data[r * d..(r + 1) * d], &kn)))
            .collect();
        for i in 0..s.len {
            let r = s.start + i;
            for h in 0..nh {
                let qg = &q_gate.data[r * 2 * nh * d + h * 2 * d..][..2 * d];
                let q = roped(r, norm(&qg[..d], &qn));
                let scores: Vec<f64> = (0..=i)
                    .map(|j| {
                        q.iter().zip(&keys[j]).map(|(a, b)| a * b).sum::<f64>() / (d as f64).sqrt()
                    })
                    .collect();
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let total: f64 = e.iter().sum();
                for c in 0..d {
                    let o: f64 = (0..=i)
                        .map(|j| e[j] / total * v.data[(s.start + j) * d + c] as f64)
                        .sum();
                    let g = qg[d + c] as f64;
                    let want = o / (1.0 + (-g).exp());
                    let got = out.data[r * nh * d + h * d + c] as f64;
                    assert!(
                        (got - want).abs() < 2e-5,
                        "row {r} head {h} dim {c}: {got} vs {want}"
                    );
                }
            }
        }
    }
}
