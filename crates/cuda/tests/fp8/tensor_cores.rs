//! The FP8 tensor-core prefill GEMM against its CPU twin: the activations quantised per token and
//! 128-column group as `quant_f8_tokens` does (`s = max|x| / 448` in f32, `q = e4m3(x / s)` rounded to
//! the nearest even code), dequantised (`fp8(q) · s`) and multiplied in f32 by the oracle's weight.

use half::bf16;
use sanmai_cpu::ops;
use sanmai_cuda::{lt_block_scales, Fp8Mat, LT_BLOCK};
use sanmai_weights::fp8::{self, f32_to_fp8_e4m3, fp8_e4m3_to_f32};

use crate::kernels::{cfg, gpu, to_bf16, Weight};
use crate::{bf16_round, rel_errors, Rng};

/// `x` (`[m, k]`, bf16 values) quantised as the kernel does: the codes' values `[m, k]` and the
/// scales `[k / 128][m]`.
fn quantise(x: &[f32], m: usize, k: usize) -> (Vec<f32>, Vec<f32>) {
    let groups = k / LT_BLOCK;
    let mut q = vec![0f32; m * k];
    let mut s = vec![0f32; groups * m];
    for r in 0..m {
        for g in 0..groups {
            let at = r * k + g * LT_BLOCK;
            let amax = x[at..at + LT_BLOCK]
                .iter()
                .fold(0f32, |a, v| a.max(v.abs()));
            let sc = if amax > 0.0 { amax / 448.0 } else { 1.0 };
            s[g * m + r] = sc;
            for (o, v) in q[at..at + LT_BLOCK].iter_mut().zip(&x[at..at + LT_BLOCK]) {
                *o = fp8_e4m3_to_f32(f32_to_fp8_e4m3(v / sc));
            }
        }
    }
    (q, s)
}

/// Activations with rows of very different sizes and one all-zero group.
fn activations(rng: &mut Rng, m: usize, k: usize) -> Vec<f32> {
    let mut x = rng.normals(m * k);
    for (r, row) in x.chunks_mut(k).enumerate() {
        let f = [1.0, 30.0, 0.01, 3.0][r % 4];
        row.iter_mut().for_each(|v| *v *= f);
    }
    x[..LT_BLOCK.min(k)].iter_mut().for_each(|v| *v = 0.0);
    bf16_round(&x)
}

#[test]
fn fp8_token_quantisation_matches_cpu() {
    let Some(g) = gpu("fp8_token_quantisation_matches_cpu") else {
        return;
    };
    let mut rng = Rng::new(907);
    for (m, k) in [(1, 128), (37, 2048), (300, 512)] {
        let x = activations(&mut rng, m, k);
        let dx = g.upload(&to_bf16(&x)).unwrap();
        let mut dq = g.zeros::<u8>(m * k).unwrap();
        let mut ds = g.zeros::<f32>(m * k / LT_BLOCK).unwrap();
        g.quant_f8_tokens(&dx, &mut dq, &mut ds, m, k).unwrap();
        let (want_q, want_s) = quantise(&x, m, k);
        let got_s = g.download(&ds).unwrap();
        let got_q: Vec<f32> = g
            .download(&dq)
            .unwrap()
            .into_iter()
            .map(fp8_e4m3_to_f32)
            .collect();
        let scales_equal = got_s
            .iter()
            .zip(&want_s)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        let codes_equal = got_q == want_q;
        println!("FP8 check=quant_tokens m={m} k={k} scales_exact={scales_equal} codes_exact={codes_equal}");
        assert!(scales_equal, "m {m} k {k}: scales");
        assert!(codes_equal, "m {m} k {k}: codes");
    }
    // k not a multiple of 128 is refused.
    let dx = g.zeros::<bf16>(64).unwrap();
    let (mut dq, mut ds) = (g.zeros::<u8>(64).unwrap(), g.zeros::<f32>(1).unwrap());
    assert!(g.quant_f8_tokens(&dx, &mut dq, &mut ds, 1, 64).is_err());
}

#[test]
fn fp8_tensor_core_gemm_matches_cpu_twin() {
    let Some(g) = gpu("fp8_tensor_core_gemm_matches_cpu_twin") else {
        return;
    };
    let Some(lt) = g.fp8_lt() else {
        eprintln!(
            "skipped: fp8_tensor_core_gemm_matches_cpu_twin: no FP8 tensor-core GEMM on this device \
             (sm_90 and cuBLASLt 12.9 or later)"
        );
        return;
    };
    let mut rng = Rng::new(911);
    // n past whole row blocks (1000, 200), k of the 80B's projections, m from a short prefill up.
    for (n, k, m) in [
        (1000, 2048, 300),
        (2048, 4096, 64),
        (200, 256, 17),
        (512, 512, 1024),
    ] {
        let w = Weight::new(&mut rng, n, k, [128, 128]);
        let (db, ds) = w.upload(&g);
        let rows = fp8::packed("w", &w.bytes, &w.block_scales, &[n, k], &cfg([128, 128])).unwrap();
        let blk = lt_block_scales(&rows.scales, n, k, 128).expect("128×128 blocks");
        let dblk = g.upload(&blk).unwrap();
        let mat = Fp8Mat {
            bytes: &db,
            scales: &ds,
            group: 128,
            n,
            k,
        };
        let x = activations(&mut rng, m, k);
        let dx = g.upload(&to_bf16(&x)).unwrap();
        let mut dq = g.zeros::<u8>(m * k).unwrap();
        let mut dxs = g.zeros::<f32>(m * k / LT_BLOCK).unwrap();
        g.quant_f8_tokens(&dx, &mut dq, &mut dxs, m, k).unwrap();
        let mut y = g.zeros::<bf16>(m * n).unwrap();
        g.gemm_fp8_lt(lt, &dq, &dxs, &mat, &dblk, &mut y, m)
            .unwrap();
        let got: Vec<f32> = g.download(&y).unwrap().iter().map(|v| v.to_f32()).collect();
        // The twin: the quantised activations' values times their scales, then the oracle's product.
        let (q, s) = quantise(&x, m, k);
        let xd: Vec<f32> = (0..m * k)
            .map(|i| q[i] * s[(i % k) / LT_BLOCK * m + i / k])
            .collect();
        let mut want = vec![0f32; m * n];
        ops::matmul_t(&xd, &w.dense, m, k, n, &mut want);
        let (max, rms) = rel_errors(&got, &want);
        // And how far the scheme is from the unquantised activations (what the first-use check sees).
        let mut exact = vec![0f32; m * n];
        ops::matmul_t(&x, &w.dense, m, k, n, &mut exact);
        let (_, scheme) = rel_errors(&want, &exact);
        println!(
            "FP8 check=gemm_tensor_cores n={n} k={k} m={m} max_rel={max:.3e} rms_rel={rms:.3e} \
             activation_quantisation_rms={scheme:.3e} tol=1e-2/4e-3"
        );
        assert!(max <= 1e-2 && rms <= 4e-3, "n {n} k {k} m {m}: {max} {rms}");
    }
}
