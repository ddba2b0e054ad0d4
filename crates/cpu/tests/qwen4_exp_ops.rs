//! The qwen4_exp ops of the CPU backend on their own: the index-key number formats (bf16 scale,
//! fp8 e4m3), QSA's exact top-k with its tie rule, the PLE conv and mix across chunks and restored
//! checkpoints, and the hyper-connections' elementwise ops.

use sanmai_cpu::{ops, CpuBackend, CpuTensor};
use sanmai_model::backend::CacheSpec;
use sanmai_model::{Backend, GdnShape, PleCall, PleShape, PleWeights, SeqChunk};

/// A small deterministic generator (SplitMix64) for test data.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    fn uniform(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0
    }
    fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.uniform() * scale).collect()
    }
}

#[test]
fn fp8_e4m3_round_trips_every_finite_byte() {
    for b in 0u8..=255 {
        let v = ops::fp8_e4m3_decode(b);
        if v.is_nan() {
            assert!(b & 0x7f == 0x7f, "only 0x7f/0xff are NaN");
            continue;
        }
        let back = ops::fp8_e4m3_encode(v);
        // +0 and -0 keep their sign bit; every other value its byte.
        assert_eq!(back, b, "byte {b:#04x} = {v}");
    }
    assert_eq!(ops::fp8_e4m3_decode(0x7e), 448.0);
    assert_eq!(ops::fp8_e4m3_decode(0x01), 2f32.powi(-9));
    assert_eq!(ops::fp8_e4m3_decode(0x08), 2f32.powi(-6));
}

#[test]
fn fp8_e4m3_rounds_to_nearest_even_and_saturates() {
    // Every pair of neighbouring positive values: their midpoint goes to the even mantissa,
    // a hair either side to the nearer one.
    let values: Vec<f32> = (0u8..0x7f).map(ops::fp8_e4m3_decode).collect();
    for w in values.windows(2) {
        let (lo, hi) = (w[0], w[1]);
        let mid = (lo + hi) / 2.0;
        let (blo, bhi) = (ops::fp8_e4m3_encode(lo), ops::fp8_e4m3_encode(hi));
        let even = if blo % 2 == 0 { blo } else { bhi };
        assert_eq!(ops::fp8_e4m3_encode(mid), even, "midpoint of {lo} and {hi}");
        assert_eq!(ops::fp8_e4m3_encode(-mid), even | 0x80);
        let eps = (hi - lo) / 16.0;
        assert_eq!(ops::fp8_e4m3_encode(mid - eps), blo);
        assert_eq!(ops::fp8_e4m3_encode(mid + eps), bhi);
    }
    for big in [448.5f32, 464.0, 479.0, 1e6, f32::INFINITY] {
        assert_eq!(ops::fp8_e4m3_encode(big), 0x7e, "{big} saturates");
        assert_eq!(ops::fp8_e4m3_encode(-big), 0xfe);
    }
    assert_eq!(
        ops::fp8_e4m3_encode(2f32.powi(-11)),
        0,
        "below half the smallest subnormal"
    );
    assert_eq!(ops::fp8_e4m3_encode(f32::NAN) & 0x7f, 0x7f);
}

#[test]
fn bf16_scale_rounds_to_nearest_even() {
    let one = 1.0f32;
    let ulp = 2f32.powi(-7);
    assert_eq!(
        ops::bf16_value(ops::bf16_bits(one + ulp / 2.0)),
        one,
        "tie to even"
    );
    assert_eq!(
        ops::bf16_value(ops::bf16_bits(one + 1.5 * ulp)),
        one + 2.0 * ulp
    );
    assert_eq!(ops::bf16_value(ops::bf16_bits(one + ulp * 0.51)), one + ulp);
    assert_eq!(ops::bf16_bits(-2.0), 0xc000);
}

#[test]
fn index_key_entry_is_scaled_fp8_with_a_bf16_scale() {
    let mut rng = Rng(3);
    let k = rng.vec(64, 3.0);
    let mut entry = vec![0u8; 66];
    ops::quantize_index_key(&k, &mut entry);
    let amax = k.iter().fold(0f32, |m, x| m.max(x.abs()));
    let s = ops::bf16_value(ops::bf16_bits(amax / 448.0));
    assert_eq!(&entry[64..], &ops::bf16_bits(s).to_le_bytes());
    let mut kh = vec![0f32; 64];
    ops::dequantize_index_key(&entry, &mut kh);
    for (i, (&x, &y)) in k.iter().zip(&kh).enumerate() {
        assert_eq!(entry[i], ops::fp8_e4m3_encode(x / s));
        assert_eq!(y, ops::fp8_e4m3_decode(entry[i]) * s);
        assert!((x - y).abs() <= x.abs() / 16.0 + s * 2f32.powi(-9));
    }
    // An all-zero key gets scale 1.
    ops::quantize_index_key(&[0.0; 64], &mut entry);
    assert_eq!(
        ops::bf16_value(u16::from_le_bytes([entry[64], entry[65]])),
        1.0
    );
    assert!(entry[..64].iter().all(|&b| b == 0));
}

/// Brute force: sort every position by (score desc, position desc) and keep the first k.
fn brute_topk(scores: &[f32], k: usize) -> Vec<usize> {
    let mut idx: Vec<usize> = (0..scores.len()).collect();
    idx.sort_by(|&a, &b| scores[b].total_cmp(&scores[a]).then(b.cmp(&a)));
    idx.truncate(k);
    idx.sort_unstable();
    idx
}

#[test]
fn topk_is_exact_and_ties_prefer_the_larger_position() {
    assert_eq!(
        ops::topk_positions(&[1.0, 2.0, 2.0, 0.0, 2.0], 2),
        vec![2, 4]
    );
    assert_eq!(ops::topk_positions(&[0.0; 6], 3), vec![3, 4, 5]);
    assert_eq!(ops::topk_positions(&[5.0, 1.0], 8), vec![0, 1]);
    assert_eq!(
        ops::topk_positions(&[f32::NAN, 0.0, -1.0], 2),
        vec![1, 2],
        "NaN ranks last"
    );
    let mut rng = Rng(11);
    for trial in 0..300 {
        let n = 1 + (rng.next() % 200) as usize;
        let k = 1 + (rng.next() % n as u64) as usize;
        // Few distinct values, so ties are everywhere.
        let scores: Vec<f32> = (0..n).map(|_| (rng.next() % 5) as f32 - 2.0).collect();
        assert_eq!(
            ops::topk_positions(&scores, k),
            brute_topk(&scores, k),
            "trial {trial}"
        );
    }
}

#[test]
fn index_scores_follow_the_formula() {
    let mut rng = Rng(5);
    let (nh, d, n) = (3, 8, 10);
    let q = rng.vec(nh * d, 1.0);
    let w = rng.vec(nh, 1.0);
    let keys = rng.vec(n * d, 1.0);
    let mut out = vec![0f32; n];
    ops::index_scores(&q, &w, &keys, d, &mut out);
    for s in 0..n {
        let want: f64 = (0..nh)
            .map(|h| {
                let dot: f64 = (0..d)
                    .map(|i| q[h * d + i] as f64 * keys[s * d + i] as f64)
                    .sum();
                w[h] as f64 * dot.max(0.0)
            })
            .sum();
        assert!((out[s] as f64 - want).abs() < 1e-5, "position {s}");
    }
}

#[test]
fn dilated_conv_in_pieces_equals_one_pass() {
    let mut rng = Rng(7);
    let (c, k, dil, t) = (6, 4, 3, 40);
    let x = rng.vec(t * c, 1.0);
    let w = rng.vec(c * k, 0.5);
    let mut state = vec![0f32; (k - 1) * dil * c];
    let mut whole = vec![0f32; t * c];
    ops::dilated_conv_silu(&x, &w, &mut state, c, k, dil, &mut whole);
    // Reference by the formula with zero history.
    for s in 0..t {
        for ch in 0..c {
            let mut acc = 0f32;
            for j in 0..k {
                let back = (k - 1 - j) * dil;
                if s >= back {
                    acc += w[ch * k + j] * x[(s - back) * c + ch];
                }
            }
            assert!((whole[s * c + ch] - ops::silu(acc)).abs() < 1e-6);
        }
    }
    for split in [1, 5, 9, 10, 23] {
        let mut st = vec![0f32; (k - 1) * dil * c];
        let mut out = vec![0f32; t * c];
        let (a, b) = out.split_at_mut(split * c);
        ops::dilated_conv_silu(&x[..split * c], &w, &mut st, c, k, dil, a);
        let saved = st.clone();
        ops::dilated_conv_silu(&x[split * c..], &w, &mut st, c, k, dil, b);
        assert_eq!(out, whole, "split at {split}");
        assert_eq!(st, state, "final state after split at {split}");
        // Restoring the saved state and running the rest again gives the same rows.
        let mut st2 = saved;
        let mut again = vec![0f32; (t - split) * c];
        ops::dilated_conv_silu(&x[split * c..], &w, &mut st2, c, k, dil, &mut again);
        assert_eq!(again, whole[split * c..]);
    }
}

fn ple_backend(sh: &PleShape) -> CpuBackend {
    let b = CpuBackend::new();
    b.init_cache(&CacheSpec {
        num_blocks: 4,
        block_size: 16,
        attn_layers: vec![],
        num_kv_heads: 1,
        head_dim: 8,
        index_head_dim: 0,
        gdn_layers: vec![],
        gdn: GdnShape {
            num_k_heads: 1,
            num_v_heads: 1,
            k_head_dim: 8,
            v_head_dim: 8,
            conv_kernel: 4,
        },
        ple_layers: vec![2],
        ple: Some(*sh),
        kv_host: None,
    })
    .unwrap();
    b
}

fn ple_weights(b: &CpuBackend, sh: &PleShape, rng: &mut Rng) -> PleWeights<sanmai_cpu::CpuWeight> {
    let (h, e, s) = (sh.hidden, sh.row_width, sh.streams);
    let mut w = |n: usize, shape: &[usize], scale: f32, mean: f32| {
        let v = rng.vec(n, scale).into_iter().map(|x| x + mean).collect();
        b.weight(v, shape).unwrap()
    };
    PleWeights {
        value: w(h * e, &[h, e], 0.3, 0.0),
        value_bias: w(h, &[h], 0.1, 0.0),
        key: (0..s).map(|_| w(h * e, &[h, e], 0.3, 0.0)).collect(),
        key_bias: (0..s).map(|_| w(h, &[h], 0.1, 0.0)).collect(),
        key_norm: (0..s).map(|_| w(h, &[h], 0.1, 1.0)).collect(),
        query_norm: (0..s).map(|_| w(h, &[h], 0.1, 1.0)).collect(),
        conv_norm: (0..s).map(|_| w(h, &[h], 0.1, 1.0)).collect(),
        conv: w(s * h * sh.conv_kernel, &[s * h, sh.conv_kernel], 0.5, 0.0),
    }
}

fn seq(state: usize, start: usize, len: usize, pos0: usize) -> SeqChunk<'static> {
    SeqChunk {
        start,
        len,
        pos0,
        state,
        blocks: &[],
    }
}

/// Layer 2's PLE mix of `streams` with the table rows `e`.
fn mix(
    b: &CpuBackend,
    sh: &PleShape,
    w: &PleWeights<sanmai_cpu::CpuWeight>,
    streams: &mut CpuTensor,
    e: &CpuTensor,
    seqs: &[SeqChunk<'_>],
) {
    let call = PleCall {
        layer: 2,
        shape: sh,
        rows: e,
        w,
        seqs,
    };
    b.ple_mix(streams, &call).unwrap();
}

fn rows(t: &CpuTensor, a: usize, b: usize) -> CpuTensor {
    CpuTensor {
        rows: b - a,
        cols: t.cols,
        data: t.data[a * t.cols..b * t.cols].to_vec(),
    }
}

/// The PLE mix of one sequence in one step equals two chunks with the state carried, and equals a
/// continuation from a checkpoint restored with `copy_state`, bit for bit; two sequences batched
/// in one step do not disturb each other.
#[test]
fn ple_mix_across_chunks_and_restored_checkpoints_equals_one_pass() {
    let sh = PleShape {
        streams: 2,
        hidden: 8,
        row_width: 12,
        conv_kernel: 4,
        conv_dilation: 3,
    };
    let b = ple_backend(&sh);
    let mut rng = Rng(21);
    let w = ple_weights(&b, &sh, &mut rng);
    let t = 25;
    let e = CpuTensor {
        rows: t,
        cols: sh.row_width,
        data: rng.vec(t * sh.row_width, 1.0),
    };
    let r0 = CpuTensor {
        rows: t,
        cols: sh.channels(),
        data: rng.vec(t * sh.channels(), 1.0),
    };

    let one = b.alloc_state().unwrap();
    let mut whole = r0.clone();
    mix(&b, &sh, &w, &mut whole, &e, &[seq(one, 0, t, 0)]);
    assert_ne!(whole, r0);

    let split = 11;
    let two = b.alloc_state().unwrap();
    let mut first = rows(&r0, 0, split);
    mix(
        &b,
        &sh,
        &w,
        &mut first,
        &rows(&e, 0, split),
        &[seq(two, 0, split, 0)],
    );
    let checkpoint = b.alloc_state().unwrap();
    b.copy_state(two, checkpoint).unwrap();
    let mut second = rows(&r0, split, t);
    let e2 = rows(&e, split, t);
    mix(
        &b,
        &sh,
        &w,
        &mut second,
        &e2,
        &[seq(two, 0, t - split, split)],
    );
    assert_eq!(first.data, whole.data[..split * sh.channels()]);
    assert_eq!(second.data, whole.data[split * sh.channels()..]);

    let restored = b.alloc_state().unwrap();
    b.copy_state(checkpoint, restored).unwrap();
    let mut again = rows(&r0, split, t);
    mix(
        &b,
        &sh,
        &w,
        &mut again,
        &e2,
        &[seq(restored, 0, t - split, split)],
    );
    assert_eq!(again, second);

    // Batched with another sequence's decode row: same rows.
    let other = b.alloc_state().unwrap();
    let mut batch_r = rows(&r0, split, t);
    batch_r.rows += 1;
    batch_r.data.extend(rng.vec(sh.channels(), 1.0));
    let mut batch_e = e2.clone();
    batch_e.rows += 1;
    batch_e.data.extend(rng.vec(sh.row_width, 1.0));
    let fresh = b.alloc_state().unwrap();
    b.copy_state(checkpoint, fresh).unwrap();
    mix(
        &b,
        &sh,
        &w,
        &mut batch_r,
        &batch_e,
        &[seq(fresh, 0, t - split, split), seq(other, t - split, 1, 0)],
    );
    assert_eq!(rows(&batch_r, 0, t - split), second);
}

#[test]
fn ple_gate_follows_the_formula() {
    let mut rng = Rng(9);
    let h = 8;
    let key = rng.vec(h, 1.0);
    let r = rng.vec(h, 2.0);
    let qn = rng
        .vec(h, 0.1)
        .into_iter()
        .map(|x| x + 1.0)
        .collect::<Vec<_>>();
    let v = rng.vec(h, 1.0);
    let mut u = vec![0f32; h];
    ops::ple_gate(&key, &r, &qn, &v, &mut u);
    let ms: f64 = r.iter().map(|&x| (x as f64).powi(2)).sum::<f64>() / h as f64;
    let inv = 1.0 / (ms + 1e-6).sqrt();
    let dot: f64 = (0..h)
        .map(|i| key[i] as f64 * qn[i] as f64 * r[i] as f64 * inv)
        .sum::<f64>()
        / (h as f64).sqrt();
    let sig = dot.signum() * dot.abs().max(1e-6).sqrt();
    let g = 1.0 / (1.0 + (-sig).exp());
    for i in 0..h {
        assert!((u[i] as f64 - g * v[i] as f64).abs() < 1e-5);
    }
    assert_eq!(ops::signed_sqrt(0.0), 0.0);
    assert_eq!(ops::signed_sqrt(-4.0), -2.0);
    assert_eq!(ops::signed_sqrt(1e-9), 1e-3);
}

#[test]
fn hyper_connection_ops_follow_the_formulas() {
    let b = CpuBackend::new();
    let (s, h, t) = (3, 4, 2);
    let mut rng = Rng(13);
    let streams = CpuTensor {
        rows: t,
        cols: s * h,
        data: rng.vec(t * s * h, 1.0),
    };
    let pre = b.weight(vec![0.5, -1.0, 2.0], &[3]).unwrap();
    let x = b.hc_premix(&streams, &pre).unwrap();
    let z: f64 = [0.5f64, -1.0, 2.0].iter().map(|p| p.exp()).sum();
    let p: Vec<f64> = [0.5f64, -1.0, 2.0].iter().map(|v| v.exp() / z).collect();
    for r in 0..t {
        for i in 0..h {
            let want: f64 = (0..s)
                .map(|c| p[c] * streams.data[r * s * h + c * h + i] as f64)
                .sum();
            assert!((x.data[r * h + i] as f64 - want).abs() < 1e-6);
        }
    }
    let u = CpuTensor {
        rows: t,
        cols: s * h,
        data: rng.vec(t * s * h, 2.0),
    };
    let y = CpuTensor {
        rows: t,
        cols: h,
        data: rng.vec(t * h, 1.0),
    };
    let mut out = streams.clone();
    b.hc_gated_residual(&mut out, &u, &y).unwrap();
    for r in 0..t {
        for c in 0..s {
            for i in 0..h {
                let j = r * s * h + c * h + i;
                let want = streams.data[j] + ops::sigmoid(u.data[j]) * y.data[r * h + i];
                assert_eq!(out.data[j], want);
            }
        }
    }
    let act = b.silu(&y).unwrap();
    assert!(act
        .data
        .iter()
        .zip(&y.data)
        .all(|(a, x)| *a == ops::silu(*x)));
}
