//! The one-launch layers (`gdn_layer.cu`, `moe_layer.cu`) inside a whole model: the shrunken
//! Qwen3-Next-80B config (four layers at the 80B's widths: three GDN mixers and one attention layer,
//! eight INT4 experts top 2, an INT6 shared expert, INT8 projections) with dummy weights, on the GPU
//! with the one-launch layers on and off, against the CPU: prompt log-probs through a prefill chunk
//! and one-token decode steps (where the layers run).

use sanmai_cpu::CpuBackend;
use sanmai_cuda::CudaBackend;
use sanmai_model::{Backend, Ffn, Mixer, Model};
use sanmai_weights::Dummy;

use crate::e2e::{argmax, lcg_prompt, prompt_logprobs, BLOCK, BLOCKS, MAX_TOL, MEAN_TOL, PREFILL};
use crate::plan::shrunken_80b;

const DECODE: usize = 16;

fn load<B: Backend>(b: B) -> Model<B> {
    let cfg = shrunken_80b();
    let src = Dummy::new(7).with_quantization(cfg.quantization.clone());
    let m = Model::load(cfg, &src, b).unwrap();
    m.init_cache(BLOCKS, BLOCK).unwrap();
    m
}

#[test]
fn shrunken_80b_one_launch_layers_match_cpu() {
    let test = "shrunken_80b_one_launch_layers_match_cpu";
    let gpu = match CudaBackend::new(0, &crate::options::cuda_options()) {
        Ok(b) => b,
        Err(e) => {
            eprintln!("skipped: {test}: {e}");
            return;
        }
    };
    gpu.set_fused_decode(true);
    gpu.set_gdn_layer(true);
    gpu.set_moe_layer(true);
    let g = load(gpu);
    let c = load(CpuBackend::default());
    // Decode steps of this model take both one-launch layers.
    let Mixer::Gdn(w) = &g.layers[0].mixer else {
        panic!("layer 0 is a GDN layer");
    };
    assert!(
        g.backend.gdn_layer_takes(w, &g.gdn_shape, 1),
        "the GDN layer launch takes layer 0"
    );
    let Ffn::Moe(m) = &g.layers[0].ffn else {
        panic!("layer 0 is MoE");
    };
    assert!(
        g.backend.moe_layer_takes(m, 1),
        "the MoE layer launch takes layer 0"
    );

    let prompt = lcg_prompt(777, PREFILL + DECODE, g.cfg.vocab_size);
    let on = prompt_logprobs(&g, &prompt);
    g.backend.set_gdn_layer(false);
    g.backend.set_moe_layer(false);
    let off = prompt_logprobs(&g, &prompt);
    let cpu = prompt_logprobs(&c, &prompt);
    // |a − b| of the prompt tokens' log-probs at the decode positions.
    let decode = |a: &[Vec<f64>], b: &[Vec<f64>]| -> Vec<f64> {
        (PREFILL..prompt.len())
            .map(|t| (a[t - 1][prompt[t] as usize] - b[t - 1][prompt[t] as usize]).abs())
            .collect()
    };
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    let (e_on, e_off) = (decode(&on, &cpu), decode(&off, &cpu));
    let (m_on, m_off) = (mean(&e_on), mean(&e_off));
    let worst = e_on.iter().copied().fold(0.0, f64::max);
    let agree = |a: &[Vec<f64>]| {
        (PREFILL - 1..prompt.len())
            .filter(|&t| argmax(&a[t]) == argmax(&cpu[t]))
            .count()
    };
    let tol = MEAN_TOL.max(3.0 * m_off);
    println!(
        "PACKED check=one_launch_layers model=qwen3-next-80b-shrunken decode={DECODE} mean_abs_on={m_on:.4} mean_abs_off={m_off:.4} max_abs_on={worst:.4} argmax_agree_on={}/{} argmax_agree_off={}/{} tol_mean={tol:.4} tol_max={MAX_TOL}",
        agree(&on),
        DECODE + 1,
        agree(&off),
        DECODE + 1
    );
    assert!(
        m_on <= tol,
        "mean |GPU − CPU| decode log-prob {m_on} (bound {tol})"
    );
    assert!(worst <= MAX_TOL, "max |GPU − CPU| decode log-prob {worst}");
}
