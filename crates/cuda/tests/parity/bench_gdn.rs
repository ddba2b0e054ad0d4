//! Timing (ignored by default; `--ignored` runs it) of the GDN prefill of one layer at Qwen3-Next-80B's
//! shape: the multi-sequence causal conv and the chunked delta rule over 1 × 512 and 8 × 512 prompt
//! tokens. Prints `BENCH` lines.

use half::bf16;
use sanmai_cuda::GdnDims;

use crate::bench::{pattern, time};
use crate::common::gpu;

/// Qwen3-Next's gated-delta-net layer and its conv kernel.
const GDN: GdnDims = GdnDims {
    hk: 16,
    hv: 32,
    dk: 128,
    dv: 128,
};
const CONV_KERNEL: usize = 4;

#[test]
#[ignore = "timing; run with --ignored on a GPU host"]
fn bench_gdn_prefill() {
    let Some(g) = gpu("bench_gdn_prefill") else {
        return;
    };
    let dims = GDN;
    let (cd, kk, t) = (dims.conv_dim(), CONV_KERNEL, 512usize);
    for n in [1usize, 8] {
        let rows = n * t;
        let x = g.upload(&pattern(rows * cd, 12)).unwrap();
        let w = g.upload(&pattern(cd * kk, 13)).unwrap();
        let a = g.upload(&pattern(rows * dims.hv, 14)).unwrap();
        let b = g.upload(&pattern(rows * dims.hv, 15)).unwrap();
        let a_log = g.upload(&vec![-1.0f32; dims.hv]).unwrap();
        let dt_bias = g.upload(&vec![0.5f32; dims.hv]).unwrap();
        let starts = g
            .upload(&(0..n as u32).map(|i| i * t as u32).collect::<Vec<_>>())
            .unwrap();
        let lens = g.upload(&vec![t as u32; n]).unwrap();
        let slots = g.upload(&(0..n as u32).collect::<Vec<_>>()).unwrap();
        let mut conv_pool = g.zeros::<bf16>(n * (kk - 1) * cd).unwrap();
        let mut ssm_pool = g.zeros::<f32>(n * dims.state_len()).unwrap();
        let mut mixed = g.zeros::<bf16>(rows * cd).unwrap();
        let mut out = g.zeros::<bf16>(rows * dims.hv * dims.dv).unwrap();
        let conv_s = time(g, 2, 20, || {
            g.conv1d_prefill(
                &x,
                &w,
                &mut conv_pool,
                &starts,
                &lens,
                &slots,
                &mut mixed,
                rows,
                n,
                t,
                cd,
                kk,
            )
            .unwrap()
        });
        let gdn_s = time(g, 2, 20, || {
            g.gdn_chunk_prefill(
                dims,
                &mixed,
                &a,
                &b,
                &a_log,
                &dt_bias,
                &mut ssm_pool,
                &starts,
                &lens,
                &slots,
                &mut out,
                rows,
                n,
            )
            .unwrap()
        });
        let layer = conv_s + gdn_s;
        println!(
            "BENCH gdn_prefill seqs={n} tokens={rows} hk={} hv={} dk={} dv={} conv_us={:.1} chunk_us={:.1} us_per_layer={:.1} tokens_per_s={:.0}",
            dims.hk,
            dims.hv,
            dims.dk,
            dims.dv,
            conv_s * 1e6,
            gdn_s * 1e6,
            layer * 1e6,
            rows as f64 / layer
        );
    }
}
