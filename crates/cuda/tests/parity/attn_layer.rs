//! The one-launch attention mixer (`attn_layer.cu`, `CudaBackend::attn_layer_takes`): a one-row
//! gated-attention mixer (packed q|gate, k, v and o projections, head norms, partial RoPE, the K/V
//! write, split-K attention over the paged cache, the output gate, o_proj with the residual add and
//! the next norm) in one persistent launch, decode step after decode step of one sequence after a
//! prefill, against the CPU backend running the same mixer and against the GPU's separate launches
//! (the one launch off, a second sequence with the same prefill), at small shapes, at a context that
//! spreads several tiles over each split, and at the 80B's shape.

use sanmai_cpu::CpuBackend;
use sanmai_cuda::CudaBackend;
use sanmai_model::backend::{
    AttnMixerCall, AttnShape, AttnWeights, CacheSpec, GdnShape, Rope, SeqChunk,
};
use sanmai_model::Backend;
use sanmai_weights::quant::quantize;

use crate::common::{check_composite, to_bf16, Rng};
use crate::moe_fused::fused_backend;
use sanmai_config::QuantScheme;

pub(crate) const BS: usize = 16;
const D: usize = 256;

/// An attention layer of hidden size `h` and shape `sh`, projections packed as `(bits, group)`,
/// built from `seed` (the same values on every backend).
pub(crate) fn layer<B: Backend>(
    b: &B,
    seed: u64,
    (bits, group_size): (u32, usize),
    h: usize,
    sh: &AttnShape,
) -> AttnWeights<B::Weight> {
    let mut rng = Rng::new(seed);
    let (hq, hkv) = (sh.num_heads, sh.num_kv_heads);
    let mut packed = |n: usize, k: usize| {
        let v = rng.normals(n * k, 0.0, (k as f32).powf(-0.5));
        let p = quantize("w", &v, n, k, QuantScheme { bits, group_size }).unwrap();
        b.packed_weight(&p).unwrap()
    };
    let q_proj = packed(2 * hq * D, h);
    let k_proj = packed(hkv * D, h);
    let v_proj = packed(hkv * D, h);
    let o_proj = packed(h, hq * D);
    let mut rng2 = Rng::new(seed ^ 0x5a5a);
    let mut norm = || {
        b.weight(to_bf16(&rng2.normals(D, 0.0, 0.1)).1, &[D])
            .unwrap()
    };
    let (q_norm, k_norm) = (norm(), norm());
    AttnWeights {
        q_proj,
        k_proj,
        v_proj,
        o_proj,
        q_norm,
        k_norm,
    }
}

/// Qwen3-Next's RoPE over `rot_dim` of the head's values (theta 1e7).
pub(crate) fn rope(rot_dim: usize) -> Rope {
    Rope {
        rot_dim,
        inv_freq: (0..rot_dim / 2)
            .map(|j| 1e7f32.powf(-(2.0 * j as f32) / rot_dim as f32))
            .collect(),
        mscale: 1.0,
    }
}

pub(crate) fn spec(sh: &AttnShape, num_blocks: usize) -> CacheSpec {
    CacheSpec {
        num_blocks,
        block_size: BS,
        attn_layers: vec![0],
        num_kv_heads: sh.num_kv_heads,
        head_dim: D,
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
    }
}

/// One mixer call of `x.len() / h` rows of the sequence on `blocks` at positions `pos0 ..`, its
/// residual `acc0` and norm weight `nw`: the residual after and the normed rows
/// ([`Backend::attn_mixer_add_rms_norm`]).
#[allow(clippy::too_many_arguments)]
fn call<B: Backend>(
    b: &B,
    w: &AttnWeights<B::Weight>,
    sh: &AttnShape,
    rope: &Rope,
    (blocks, pos0): (&[u32], usize),
    x: &[f32],
    acc0: &[f32],
    nw: &[f32],
) -> (Vec<f32>, Vec<f32>) {
    let h = nw.len();
    let rows = x.len() / h;
    let xt = b.upload(rows, h, x.to_vec()).unwrap();
    let seqs = [SeqChunk {
        start: 0,
        len: rows,
        pos0,
        state: 0,
        blocks,
    }];
    let c = AttnMixerCall {
        layer: 0,
        shape: sh,
        rope,
        x: &xt,
        w,
        seqs: &seqs,
        mrope: None,
    };
    let mut acc = b.upload(rows, h, acc0.to_vec()).unwrap();
    let nw = b.weight(nw.to_vec(), &[h]).unwrap();
    let normed = b
        .attn_mixer_add_rms_norm(&c, &mut acc, &nw, 1e-6, 1.0)
        .unwrap();
    (b.to_host(acc).unwrap().2, b.to_host(normed).unwrap().2)
}

/// A prefill of `prompt` positions, then `steps` decode steps of one sequence: on the one launch
/// (GPU, blocks from 0), the separate launches (GPU, the next blocks) and the CPU, comparing every
/// decode step's outputs.
#[allow(clippy::too_many_arguments)]
fn case(
    b: &CudaBackend,
    cpu: &CpuBackend,
    seed: u64,
    q: (u32, usize),
    h: usize,
    (hq, hkv, rot): (usize, usize, usize),
    prompt: usize,
    steps: usize,
) {
    let sh = AttnShape {
        num_heads: hq,
        num_kv_heads: hkv,
        head_dim: D,
        eps: 1e-6,
    };
    let rope = rope(rot);
    let nb = (prompt + steps).div_ceil(BS);
    b.init_cache(&spec(&sh, 2 * nb)).unwrap();
    cpu.init_cache(&spec(&sh, nb)).unwrap();
    let wg = layer(b, seed, q, h, &sh);
    let wc = layer(cpu, seed, q, h, &sh);
    let name = format!("q{}g{}_h{h}_hq{hq}_hkv{hkv}_rot{rot}_ctx{prompt}", q.0, q.1);
    b.set_attn_layer(true);
    assert!(b.attn_mixer_whole(&wg, &sh, 1), "{name}: taken at one row");
    assert!(!b.attn_mixer_whole(&wg, &sh, 2), "{name}: not at two rows");
    let one: Vec<u32> = (0..nb as u32).collect();
    let apart: Vec<u32> = (nb as u32..2 * nb as u32).collect();
    let mut rng = Rng::new(seed + 1);
    let mut rows = |n: usize, mean: f32, sd: f32| to_bf16(&rng.normals(n * h, mean, sd)).1;
    // The prefill (the separate launches on both GPU sequences: more than one row).
    let (x, acc0) = (rows(prompt, 0.0, 1.0), rows(prompt, 0.0, 1.0));
    let nw = to_bf16(&Rng::new(seed + 2).normals(h, 1.0, 0.2)).1;
    for blocks in [&one, &apart] {
        call(b, &wg, &sh, &rope, (blocks, 0), &x, &acc0, &nw);
    }
    call(cpu, &wc, &sh, &rope, (&one, 0), &x, &acc0, &nw);
    for pos in prompt..prompt + steps {
        let (x, acc0) = (rows(1, 0.0, 1.0), rows(1, 0.0, 1.0));
        b.set_attn_layer(true);
        let got = call(b, &wg, &sh, &rope, (&one, pos), &x, &acc0, &nw);
        b.set_attn_layer(false);
        assert!(!b.attn_mixer_whole(&wg, &sh, 1), "{name}: off");
        let launches = call(b, &wg, &sh, &rope, (&apart, pos), &x, &acc0, &nw);
        let want = call(cpu, &wc, &sh, &rope, (&one, pos), &x, &acc0, &nw);
        let at = format!("{name}_pos{pos}");
        check_composite("attn_layer", &at, &got.0, &want.0);
        check_composite("attn_layer_vs_launches", &at, &got.0, &launches.0);
        check_composite("attn_layer_normed", &at, &got.1, &want.1);
        check_composite("attn_layer_normed_vs_launches", &at, &got.1, &launches.1);
    }
    b.set_attn_layer(true);
}

#[test]
fn backend_attn_layer_launch_matches_cpu() {
    let test = "backend_attn_layer_launch_matches_cpu";
    let Some(b) = fused_backend(test) else {
        return;
    };
    let cpu = CpuBackend::default();
    // Small shapes (INT4 g128, INT6 and INT8 per row; groups of 1, 4 and 8 query heads a KV head;
    // RoPE over 64, 32 and all 256 values; contexts inside one tile, across a block boundary), a
    // context of more tiles than the grid has items a KV head (each item then walks several tiles
    // through its ring), then the 80B's shape (INT8, h 2048, 16 query heads, 2 KV heads, RoPE 64).
    case(&b, &cpu, 800, (4, 128), 256, (2, 2, 64), 5, 4);
    case(&b, &cpu, 801, (6, 0), 256, (4, 1, 32), 30, 4);
    case(&b, &cpu, 802, (8, 0), 512, (8, 1, 256), 47, 4);
    case(&b, &cpu, 803, (8, 0), 128, (4, 2, 64), 2300, 3);
    case(&b, &cpu, 804, (8, 0), 2048, (16, 2, 64), 40, 6);
}
