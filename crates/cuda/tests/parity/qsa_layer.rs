//! A QSA mixer within its topk in one launch (`CudaBackend`'s `qsa_mixer_within_topk`: the index
//! key's projection and write, then the one-launch attention mixer, dense since every position is
//! selected), decode step after decode step of one sequence after a prefill, against the CPU
//! backend's QSA ops and the GPU's (the one launch off, a second sequence with the same prefill). The
//! steps go on past topk, where the one launch declines and the GPU's QSA selects through the index
//! keys the one launch wrote: the selection and attention then match the CPU's only if those keys
//! were written as the separate launches write them. Small shapes, then the 125B's (h 2560, 24
//! query heads on 2 KV heads, RoPE over 64, INT8).

use sanmai_cpu::CpuBackend;
use sanmai_cuda::CudaBackend;
use sanmai_model::backend::{
    AttnCall, AttnMixerCall, AttnShape, AttnWeights, CacheSpec, IndexerWeights, QsaCall,
    QsaMixerCall, QsaShape, Rope, SeqChunk,
};
use sanmai_model::Backend;

use crate::attn_layer::{layer, rope, spec, BS};
use crate::common::{check_composite, to_bf16, Rng};
use crate::moe_fused::fused_backend;

const NI: usize = 4;
const DI: usize = 64;

/// The indexer's weights of hidden size `h` from `seed` (bf16; the same values on every backend).
fn indexer<B: Backend>(b: &B, seed: u64, h: usize) -> IndexerWeights<B::Weight> {
    let mut rng = Rng::new(seed);
    let mut w = |n: usize, k: usize, mean: f32, sd: f32| {
        let shape: &[usize] = if k == 1 { &[n] } else { &[n, k] };
        b.weight(to_bf16(&rng.normals(n * k, mean, sd)).1, shape)
            .unwrap()
    };
    let sd = (h as f32).powf(-0.5);
    IndexerWeights {
        wq: w(NI * DI, h, 0.0, sd),
        wk: w(DI, h, 0.0, sd),
        k_norm: w(DI, 1, 1.0, 0.1),
        k_norm_bias: w(DI, 1, 0.0, 0.1),
        weights_proj: w(NI, h, 0.0, sd),
    }
}

fn qsa_shape(topk: usize) -> QsaShape {
    QsaShape {
        n_heads: NI,
        head_dim: DI,
        topk,
        rope: rope(DI / 2),
    }
}

/// One QSA mixer call of `x.len() / h` rows of the sequence on `blocks` at positions `pos0 ..`: the
/// one launch where the backend takes it (`whole`), else the ops (projections, `qsa_attention`,
/// o_proj). Returns the output rows and whether the one launch ran.
#[allow(clippy::too_many_arguments)]
fn call<B: Backend>(
    b: &B,
    (w, iw): (&AttnWeights<B::Weight>, &IndexerWeights<B::Weight>),
    (sh, rope, qsa): (&AttnShape, &Rope, &QsaShape),
    (blocks, pos0): (&[u32], usize),
    x: &[f32],
    h: usize,
    whole: bool,
) -> (Vec<f32>, bool) {
    let rows = x.len() / h;
    let xt = b.upload(rows, h, x.to_vec()).unwrap();
    let seqs = [SeqChunk {
        start: 0,
        len: rows,
        pos0,
        state: 0,
        blocks,
    }];
    let mixer = AttnMixerCall {
        layer: 0,
        shape: sh,
        rope,
        x: &xt,
        w,
        seqs: &seqs,
        mrope: None,
    };
    if whole {
        let c = QsaMixerCall {
            mixer,
            qsa,
            indexer: iw,
        };
        if let Some(o) = b.qsa_mixer_within_topk(&c).unwrap() {
            return (b.to_host(o).unwrap().2, true);
        }
    }
    let ws = [
        &w.q_proj,
        &w.k_proj,
        &w.v_proj,
        &iw.wq,
        &iw.wk,
        &iw.weights_proj,
    ];
    let p = b.linear_many(&xt, &ws).unwrap();
    let c = QsaCall {
        attn: AttnCall {
            layer: 0,
            shape: sh,
            rope,
            q_gate: &p[0],
            k: &p[1],
            v: &p[2],
            w,
            seqs: &seqs,
            mrope: None,
        },
        qsa,
        iq: &p[3],
        ik: &p[4],
        iw: &p[5],
        indexer: iw,
    };
    let o = b.qsa_attention(&c).unwrap();
    let y = b.linear(&o, &w.o_proj).unwrap();
    (b.to_host(y).unwrap().2, false)
}

/// A prefill of `prompt` positions, then `steps` decode steps: the one launch where it takes them
/// (GPU, blocks from 0), the separate launches (GPU, the next blocks) and the CPU.
#[allow(clippy::too_many_arguments)]
fn case(
    b: &CudaBackend,
    cpu: &CpuBackend,
    seed: u64,
    q: (u32, usize),
    h: usize,
    (hq, hkv, rot): (usize, usize, usize),
    (prompt, steps, topk): (usize, usize, usize),
) {
    let sh = AttnShape {
        num_heads: hq,
        num_kv_heads: hkv,
        head_dim: 256,
        eps: 1e-6,
    };
    let (rope, qsa) = (rope(rot), qsa_shape(topk));
    let nb = (prompt + steps).div_ceil(BS);
    let qspec = |n: usize| CacheSpec {
        index_head_dim: DI,
        ..spec(&sh, n)
    };
    b.init_cache(&qspec(2 * nb)).unwrap();
    cpu.init_cache(&qspec(nb)).unwrap();
    let (wg, wc) = (layer(b, seed, q, h, &sh), layer(cpu, seed, q, h, &sh));
    let (ig, ic) = (indexer(b, seed ^ 7, h), indexer(cpu, seed ^ 7, h));
    let name = format!(
        "q{}g{}_h{h}_hq{hq}_hkv{hkv}_rot{rot}_ctx{prompt}_topk{topk}",
        q.0, q.1
    );
    let one: Vec<u32> = (0..nb as u32).collect();
    let apart: Vec<u32> = (nb as u32..2 * nb as u32).collect();
    let mut rng = Rng::new(seed + 1);
    let mut rows = |n: usize| to_bf16(&rng.normals(n * h, 0.0, 1.0)).1;
    let x = rows(prompt);
    b.set_attn_layer(true);
    for blocks in [&one, &apart] {
        let (_, took) = call(b, (&wg, &ig), (&sh, &rope, &qsa), (blocks, 0), &x, h, true);
        assert!(!took, "{name}: a prefill is not taken");
    }
    call(cpu, (&wc, &ic), (&sh, &rope, &qsa), (&one, 0), &x, h, true);
    let mut taken = 0;
    for pos in prompt..prompt + steps {
        let x = rows(1);
        let at = format!("{name}_pos{pos}");
        b.set_attn_layer(true);
        let (got, took) = call(b, (&wg, &ig), (&sh, &rope, &qsa), (&one, pos), &x, h, true);
        assert_eq!(took, pos < topk, "{at}: taken exactly within topk");
        taken += took as usize;
        b.set_attn_layer(false);
        let (apart_y, off) = call(
            b,
            (&wg, &ig),
            (&sh, &rope, &qsa),
            (&apart, pos),
            &x,
            h,
            true,
        );
        assert!(!off, "{at}: not taken with the one launch off");
        let (want, _) = call(
            cpu,
            (&wc, &ic),
            (&sh, &rope, &qsa),
            (&one, pos),
            &x,
            h,
            true,
        );
        check_composite("qsa_layer", &at, &got, &want);
        check_composite("qsa_layer_vs_launches", &at, &got, &apart_y);
    }
    assert!(taken > 0, "{name}: the one launch ran");
    b.set_attn_layer(true);
}

#[test]
fn backend_qsa_layer_launch_matches_cpu() {
    let test = "backend_qsa_layer_launch_matches_cpu";
    let Some(b) = fused_backend(test) else {
        return;
    };
    let cpu = CpuBackend::default();
    // Two query heads a KV head on INT4 g128 (the narrow instance), then twelve on INT8 (the wide
    // one: two heads a warp), each going past its topk; then the 125B's shape within topk.
    case(&b, &cpu, 900, (4, 128), 256, (4, 2, 64), (20, 8, 24));
    case(&b, &cpu, 901, (8, 0), 256, (12, 1, 64), (30, 8, 34));
    case(&b, &cpu, 902, (8, 0), 2560, (24, 2, 64), (40, 4, 2048));
}
