//! The one-launch GDN mixer (`gdn_layer.cu`, `CudaBackend::gdn_layer_takes`): a one-row GDN mixer
//! (packed q|k|v, z and out projections, bf16 gates, conv, delta rule, gated norm) in one persistent
//! launch, step after step of one sequence, against the CPU backend running the same mixer and
//! against the GPU's separate launches (the one launch off, a second state slot), with and without
//! the residual add and the next norm, at small shapes and at the 80B's and the 125B's.

use sanmai_cpu::CpuBackend;
use sanmai_cuda::CudaBackend;
use sanmai_model::backend::{CacheSpec, GdnMixerCall, GdnShape, GdnWeights, SeqChunk};
use sanmai_model::Backend;
use sanmai_weights::quant::quantize;

use crate::common::{check_composite, to_bf16, Rng};
use crate::moe_fused::fused_backend;
use sanmai_config::QuantScheme;

/// A GDN layer of hidden size `h` and shape `sh`, projections packed as `(bits, group)`, built from
/// `seed` (the same values on every backend).
fn layer<B: Backend>(
    b: &B,
    seed: u64,
    (bits, group_size): (u32, usize),
    h: usize,
    sh: &GdnShape,
) -> GdnWeights<B::Weight> {
    let mut rng = Rng::new(seed);
    let (hk, hv, dk, dv) = (sh.num_k_heads, sh.num_v_heads, sh.k_head_dim, sh.v_head_dim);
    let cd = 2 * hk * dk + hv * dv;
    let mut packed = |n: usize, k: usize| {
        let v = rng.normals(n * k, 0.0, (k as f32).powf(-0.5));
        let p = quantize("w", &v, n, k, QuantScheme { bits, group_size }).unwrap();
        b.packed_weight(&p).unwrap()
    };
    let in_proj_qkv = packed(cd, h);
    let in_proj_z = packed(hv * dv, h);
    let out_proj = packed(h, hv * dv);
    let mut dense = |n: usize, k: usize, sd: f32| {
        let v = to_bf16(&rng.normals(n * k, 0.0, sd)).1;
        b.weight(v, &[n, k]).unwrap()
    };
    let scale = (h as f32).powf(-0.5);
    let in_proj_b = dense(hv, h, scale);
    let in_proj_a = dense(hv, h, scale);
    let conv = dense(cd, sh.conv_kernel, 0.4);
    let a_log = b
        .weight(
            (0..hv).map(|i| (1.0 + (i % 15) as f32).ln()).collect(),
            &[hv],
        )
        .unwrap();
    let dt_bias = b
        .weight((0..hv).map(|i| 0.5 + 0.05 * i as f32).collect(), &[hv])
        .unwrap();
    let mut rng2 = Rng::new(seed ^ 0x5a5a);
    let norm = b
        .weight(to_bf16(&rng2.normals(dv, 1.0, 0.1)).1, &[dv])
        .unwrap();
    GdnWeights {
        in_proj_qkv,
        in_proj_z,
        in_proj_b,
        in_proj_a,
        conv,
        a_log,
        dt_bias,
        norm,
        out_proj,
    }
}

fn spec(sh: &GdnShape) -> CacheSpec {
    CacheSpec {
        num_blocks: 4,
        block_size: 16,
        attn_layers: vec![],
        num_kv_heads: 1,
        head_dim: 32,
        index_head_dim: 0,
        gdn_layers: vec![0],
        gdn: *sh,
        ple_layers: vec![],
        ple: None,
        kv_host: None,
    }
}

/// One mixer step of the sequence in `slot` at position `pos` on input `x`: with `acc0` and `nw`, the
/// residual after and the normed row ([`Backend::gdn_mixer_add_rms_norm`]); else the mixer's row
/// ([`Backend::gdn_mixer`]) twice over (the second vector empty).
fn step<B: Backend>(
    b: &B,
    w: &GdnWeights<B::Weight>,
    sh: &GdnShape,
    (slot, pos): (usize, usize),
    x: &[f32],
    add_norm: Option<(&[f32], &[f32])>,
) -> (Vec<f32>, Vec<f32>) {
    let h = x.len();
    let xt = b.upload(1, h, x.to_vec()).unwrap();
    let seqs = [SeqChunk {
        start: 0,
        len: 1,
        pos0: pos,
        state: slot,
        blocks: &[0],
    }];
    let call = GdnMixerCall {
        layer: 0,
        shape: sh,
        x: &xt,
        w,
        eps: 1e-6,
        seqs: &seqs,
    };
    match add_norm {
        Some((acc0, nw)) => {
            let mut acc = b.upload(1, h, acc0.to_vec()).unwrap();
            let nw = b.weight(nw.to_vec(), &[h]).unwrap();
            let normed = b
                .gdn_mixer_add_rms_norm(&call, &mut acc, &nw, 1e-6, 1.0)
                .unwrap();
            (b.to_host(acc).unwrap().2, b.to_host(normed).unwrap().2)
        }
        None => (
            b.to_host(b.gdn_mixer(&call).unwrap()).unwrap().2,
            Vec::new(),
        ),
    }
}

/// Runs `steps` steps of one sequence on the one launch (GPU slot `one`), the separate launches (GPU
/// slot `apart`) and the CPU, comparing every step's outputs.
fn case(
    b: &CudaBackend,
    cpu: &CpuBackend,
    seed: u64,
    q: (u32, usize),
    h: usize,
    sh: &GdnShape,
    add_norm: bool,
) {
    b.init_cache(&spec(sh)).unwrap();
    cpu.init_cache(&spec(sh)).unwrap();
    let wg = layer(b, seed, q, h, sh);
    let wc = layer(cpu, seed, q, h, sh);
    let name = format!(
        "q{}g{}_h{h}_hk{}_hv{}_dk{}_dv{}_k{}{}",
        q.0,
        q.1,
        sh.num_k_heads,
        sh.num_v_heads,
        sh.k_head_dim,
        sh.v_head_dim,
        sh.conv_kernel,
        if add_norm { "_addnorm" } else { "" }
    );
    b.set_gdn_layer(true);
    assert!(b.gdn_mixer_whole(&wg, sh, 1), "{name}: taken at one row");
    assert!(!b.gdn_mixer_whole(&wg, sh, 2), "{name}: not at two rows");
    let (one, apart, c) = (
        b.alloc_state().unwrap(),
        b.alloc_state().unwrap(),
        cpu.alloc_state().unwrap(),
    );
    let mut rng = Rng::new(seed + 1);
    for pos in 0..6 {
        let x = to_bf16(&rng.normals(h, 0.0, 1.0)).1;
        let acc0 = to_bf16(&rng.normals(h, 0.0, 1.0)).1;
        let nw = to_bf16(&rng.normals(h, 1.0, 0.2)).1;
        let an = add_norm.then_some((acc0.as_slice(), nw.as_slice()));
        b.set_gdn_layer(true);
        let got = step(b, &wg, sh, (one, pos), &x, an);
        b.set_gdn_layer(false);
        assert!(!b.gdn_mixer_whole(&wg, sh, 1), "{name}: off");
        let launches = step(b, &wg, sh, (apart, pos), &x, an);
        let want = step(cpu, &wc, sh, (c, pos), &x, an);
        let at = format!("{name}_pos{pos}");
        check_composite("gdn_layer", &at, &got.0, &want.0);
        check_composite("gdn_layer_vs_launches", &at, &got.0, &launches.0);
        if add_norm {
            check_composite("gdn_layer_normed", &at, &got.1, &want.1);
            check_composite("gdn_layer_normed_vs_launches", &at, &got.1, &launches.1);
        }
    }
    b.set_gdn_layer(true);
}

#[test]
fn backend_gdn_layer_launch_matches_cpu() {
    let test = "backend_gdn_layer_launch_matches_cpu";
    let Some(b) = fused_backend(test) else {
        return;
    };
    let cpu = CpuBackend::default();
    let shape = |hk, hv, dk, dv, k| GdnShape {
        num_k_heads: hk,
        num_v_heads: hv,
        k_head_dim: dk,
        v_head_dim: dv,
        conv_kernel: k,
    };
    // Small shapes (INT4 g128, INT6 and INT8 per row; two value heads a key head; a conv of 2 and
    // of 4 taps; key heads of 64), then the 80B's (INT8, h 2048, 16 key and 32 value heads of 128)
    // and the 125B's (h 2560, 48 value heads: the wider instance).
    case(&b, &cpu, 700, (4, 128), 256, &shape(2, 4, 64, 32, 4), true);
    case(&b, &cpu, 701, (6, 0), 256, &shape(2, 4, 64, 64, 2), false);
    case(&b, &cpu, 702, (8, 0), 512, &shape(4, 4, 128, 16, 4), true);
    case(
        &b,
        &cpu,
        703,
        (8, 0),
        2048,
        &shape(16, 32, 128, 128, 4),
        true,
    );
    case(
        &b,
        &cpu,
        704,
        (8, 0),
        2560,
        &shape(16, 48, 128, 128, 4),
        true,
    );
    case(
        &b,
        &cpu,
        705,
        (8, 0),
        2560,
        &shape(16, 48, 128, 128, 4),
        false,
    );
}
