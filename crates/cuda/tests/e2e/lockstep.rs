//! Lockstep: the forward pass op by op on the CPU and CUDA backends at once. Every op gets the same
//! inputs on both (the CPU's result rounded to bf16, handed to both backends), its outputs are
//! compared, and both continue from there, so bf16 rounding never compounds through the network and
//! the comparison stays sharp: a wrong layout, a misplaced cache row or a lost state shows as an O(1)
//! error in the op that caused it. Caches (K/V blocks, GDN state slots) evolve on each backend on its
//! own, so cache writes, slot handling, copy_block and copy_state are covered.
//!
//! Bounds: stateless ops [`MAX_REL`] / [`RMS_REL`]; the stateful cores (attention, GDN) [`STATE_MAX_REL`]
//! / [`STATE_RMS_REL`], because they round inside (q/k after RoPE and the cache are bf16 on the GPU, and
//! so are the conv and delta-rule outputs of prefill, which decode keeps in f32 inside its one fused
//! kernel; all f32 on the CPU) and the gated RMSNorm after the delta rule
//! rescales rows whose output nearly cancels, so their relative error is that of the cancelled sum.

use std::collections::BTreeMap;

use sanmai_cpu::{CpuBackend, CpuTensor};
use sanmai_cuda::{CudaBackend, CudaTensor};
use sanmai_model::{
    AttnCall, AttnWeights, Backend, Ffn, GdnCall, GdnGates, GdnWeights, Layer, Mixer, Model,
    MoeCall, MoeWeights, OpResult, SeqChunk, SharedExpert,
};

/// Per-op bounds: `max|gpu − cpu| / max|cpu|` and `‖gpu − cpu‖ / ‖cpu‖`.
pub const MAX_REL: f32 = 5e-2;
pub const RMS_REL: f32 = 2e-2;
pub const STATE_MAX_REL: f32 = 1.5e-1;
pub const STATE_RMS_REL: f32 = 4e-2;

/// The bounds of op `op`.
pub fn bounds(op: &str) -> (f32, f32) {
    if op.starts_with("gdn") || op.starts_with("attention") {
        (STATE_MAX_REL, STATE_RMS_REL)
    } else {
        (MAX_REL, RMS_REL)
    }
}

pub type Pair = (CpuTensor, CudaTensor);

pub struct Lockstep<'a> {
    pub cpu: &'a Model<CpuBackend>,
    pub gpu: &'a Model<CudaBackend>,
    /// Worst (max_rel, rms_rel, calls) per op, and per `op@tag`.
    pub worst: BTreeMap<String, (f32, f32, usize)>,
    /// The kind of step being run (`prefill`, `mixed`, `mtp`, `decode`).
    pub tag: &'static str,
}

fn layer<B: Backend>(m: &Model<B>, i: usize) -> &Layer<B::Weight> {
    if i == m.cfg.num_layers {
        &m.mtp.as_ref().expect("an MTP head").layer
    } else {
        &m.layers[i]
    }
}

fn attn<B: Backend>(m: &Model<B>, i: usize) -> &AttnWeights<B::Weight> {
    match &layer(m, i).mixer {
        Mixer::Attention(w) => w,
        #[allow(unreachable_patterns)]
        _ => panic!("layer {i} is not gated attention"),
    }
}

fn gdn<B: Backend>(m: &Model<B>, i: usize) -> &GdnWeights<B::Weight> {
    match &layer(m, i).mixer {
        Mixer::Gdn(w) => w,
        #[allow(unreachable_patterns)]
        _ => panic!("layer {i} is not GDN"),
    }
}

fn moe<B: Backend>(m: &Model<B>, i: usize) -> &MoeWeights<B::Weight> {
    match &layer(m, i).ffn {
        Ffn::Moe(w) => w,
        Ffn::Dense(_) => panic!("layer {i} is dense"),
    }
}

/// Runs `$body` (an op's result) on both models (`$m` bound to each, the listed pairs to that
/// backend's tensor) and compares the results under `$name`.
macro_rules! both {
    ($ls:expr, $name:expr, [$($v:ident),*], $m:ident => $body:expr) => {{
        let c = {
            let $m = $ls.cpu;
            $(let $v = &$v.0;)*
            $body
        };
        let g = {
            let $m = $ls.gpu;
            $(let $v = &$v.1;)*
            $body
        };
        $ls.sync($name, ok($name, "cpu", c), ok($name, "cuda", g))
    }};
}

/// Runs `linear_many` of the listed weights (each an expression of `$m`, the model) on `$x` on both
/// models and compares each result under its name, as forward.rs groups its projections.
macro_rules! both_many {
    ($ls:expr, [$($name:expr),*], $x:ident, $m:ident => [$($w:expr),*]) => {{
        let c = {
            let $m = $ls.cpu;
            $m.backend.linear_many(&$x.0, &[$(&$w),*])
        };
        let g = {
            let $m = $ls.gpu;
            $m.backend.linear_many(&$x.1, &[$(&$w),*])
        };
        $ls.sync_many(
            [$($name),*],
            ok("linear_many", "cpu", c),
            ok("linear_many", "cuda", g),
        )
    }};
}

/// An op's result, or a panic naming the op and the backend.
fn ok<T>(op: &str, backend: &str, r: OpResult<T>) -> T {
    r.unwrap_or_else(|e| panic!("{op} on the {backend} backend: {e}"))
}

impl<'a> Lockstep<'a> {
    pub fn new(cpu: &'a Model<CpuBackend>, gpu: &'a Model<CudaBackend>) -> Self {
        Self {
            cpu,
            gpu,
            worst: BTreeMap::new(),
            tag: "",
        }
    }

    fn upload(&self, c: &CpuTensor) -> CudaTensor {
        self.gpu
            .backend
            .tensor_from_host(c.rows, c.cols, &c.data)
            .unwrap()
    }

    /// Compares the GPU result with the CPU's and returns the CPU result on both backends.
    pub fn sync(&mut self, op: &str, mut c: CpuTensor, g: CudaTensor) -> Pair {
        let (r, cols, gv) = ok("to_host", "cuda", self.gpu.backend.to_host(g));
        assert_eq!((r, cols), (c.rows, c.cols), "{op}: shapes differ");
        let scale = c.data.iter().fold(0f32, |m, v| m.max(v.abs()));
        let (mut max_abs, mut se, mut sw) = (0f32, 0f64, 0f64);
        for (a, b) in gv.iter().zip(&c.data) {
            let d = (a - b).abs();
            assert!(d.is_finite(), "{op}: non-finite GPU value {a} (cpu {b})");
            max_abs = max_abs.max(d);
            se += (d as f64).powi(2);
            sw += (*b as f64).powi(2);
        }
        let max_rel = if scale > 0.0 {
            max_abs / scale
        } else {
            max_abs
        };
        let rms_rel = if sw > 0.0 {
            (se / sw).sqrt() as f32
        } else {
            se.sqrt() as f32
        };
        for key in [op.to_string(), format!("{op}@{}", self.tag)] {
            let e = self.worst.entry(key).or_insert((0.0, 0.0, 0));
            *e = (e.0.max(max_rel), e.1.max(rms_rel), e.2 + 1);
        }
        // Both continue from the same values: the CPU's, rounded as the GPU stores them.
        c.data
            .iter_mut()
            .for_each(|v| *v = half::bf16::from_f32(*v).to_f32());
        let g = self.upload(&c);
        (c, g)
    }

    /// [`Lockstep::sync`] of each of the `N` results of one `linear_many`, under its name.
    pub fn sync_many<const N: usize>(
        &mut self,
        ops: [&str; N],
        c: Vec<CpuTensor>,
        g: Vec<CudaTensor>,
    ) -> [Pair; N] {
        assert_eq!((c.len(), g.len()), (N, N), "{ops:?}: one result per weight");
        let mut pairs = ops.into_iter().zip(c.into_iter().zip(g));
        std::array::from_fn(|_| {
            let (op, (c, g)) = pairs.next().expect("N results");
            self.sync(op, c, g)
        })
    }

    /// `acc + y` on both (in place on copies of `acc`).
    fn add(&mut self, op: &str, acc: &Pair, y: &Pair) -> Pair {
        let mut c = acc.0.clone();
        ok(op, "cpu", self.cpu.backend.add(&mut c, &y.0));
        let mut g = self.upload(&acc.0);
        ok(op, "cuda", self.gpu.backend.add(&mut g, &y.1));
        self.sync(op, c, g)
    }

    fn mlp_shared(&mut self, i: usize, x: &Pair) -> Pair {
        let gu = both!(self, "shared_gate_up", [x], m =>
            m.backend.linear(x, &moe(m, i).shared.as_ref().unwrap().gate_up));
        let a = both!(self, "swiglu", [gu], m => m.backend.swiglu(gu));
        both!(self, "shared_down", [a], m =>
            m.backend.linear(a, &moe(m, i).shared.as_ref().unwrap().down))
    }

    /// One decoder layer (cache layer index `i`; `num_layers` is the MTP layer).
    pub fn layer(&mut self, i: usize, x: Pair, seqs: &[SeqChunk<'_>]) -> Pair {
        let eps = self.cpu.cfg.rms_norm_eps;
        let hn = both!(self, "input_norm", [x], m =>
            m.backend.rms_norm(x, &layer(m, i).input_norm, eps, 1.0));
        let is_attn = matches!(layer(self.cpu, i).mixer, Mixer::Attention(_));
        let mixed = if is_attn {
            let [q, k, v] = both_many!(self, ["q_proj", "k_proj", "v_proj"], hn, m =>
                [attn(m, i).q_proj, attn(m, i).k_proj, attn(m, i).v_proj]);
            let o = both!(self, "attention", [q, k, v], m => m.backend.attention(&AttnCall {
                layer: i,
                shape: &m.attn_shape,
                rope: &m.rope,
                q_gate: q,
                k,
                v,
                w: attn(m, i),
                seqs,
                mrope: None,
            }));
            both!(self, "o_proj", [o], m => m.backend.linear(o, &attn(m, i).o_proj))
        } else {
            let [qkv, z, b, a] = both_many!(
                self, ["in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a"], hn, m =>
                [gdn(m, i).in_proj_qkv, gdn(m, i).in_proj_z, gdn(m, i).in_proj_b, gdn(m, i).in_proj_a]);
            let o = both!(self, "gdn", [qkv, z, b, a], m => m.backend.gdn(&GdnCall {
                layer: i,
                shape: &m.gdn_shape,
                qkv,
                z,
                gates: GdnGates::Given { b, a },
                w: gdn(m, i),
                eps,
                seqs,
            }));
            both!(self, "out_proj", [o], m => m.backend.linear(o, &gdn(m, i).out_proj))
        };
        let x = self.add("residual_add", &x, &mixed);
        let hn = both!(self, "post_norm", [x], m =>
            m.backend.rms_norm(x, &layer(m, i).post_attention_norm, eps, 1.0));
        let out = match &layer(self.cpu, i).ffn {
            Ffn::Dense(_) => {
                let gu = both!(self, "mlp_gate_up", [hn], m => match &layer(m, i).ffn {
                    Ffn::Dense(w) => m.backend.linear(hn, &w.gate_up),
                    Ffn::Moe(_) => unreachable!(),
                });
                let a = both!(self, "swiglu", [gu], m => m.backend.swiglu(gu));
                both!(self, "mlp_down", [a], m => match &layer(m, i).ffn {
                    Ffn::Dense(w) => m.backend.linear(a, &w.down),
                    Ffn::Moe(_) => unreachable!(),
                })
            }
            Ffn::Moe(w) => {
                if w.shared.is_some() {
                    let y = self.mlp_shared(i, &hn);
                    let g = both!(self, "shared_gate", [hn], m =>
                        m.backend.linear(hn, moe(m, i).shared_gate.as_ref().unwrap()));
                    both!(self, "moe_experts_shared", [hn, y, g], m =>
                    m.backend.moe_experts(&MoeCall {
                        x: hn,
                        w: moe(m, i),
                        shared: Some(SharedExpert { y: Some(y), gate: Some(g) }),
                    }))
                } else {
                    both!(self, "moe_experts", [hn], m =>
                        m.backend.moe_experts(&MoeCall { x: hn, w: moe(m, i), shared: None }))
                }
            }
        };
        self.add("residual_add", &x, &out)
    }

    /// The forward pass: final-normed hidden states of `out_rows`.
    pub fn forward(&mut self, ids: &[u32], seqs: &[SeqChunk<'_>], out_rows: &[usize]) -> Pair {
        let mut x = both!(self, "embed", [], m => m.backend.embed(m.embedding(), ids));
        for i in 0..self.cpu.cfg.num_layers {
            x = self.layer(i, x, seqs);
        }
        let r = both!(self, "rows", [x], m => m.backend.rows(x, out_rows));
        let eps = self.cpu.cfg.rms_norm_eps;
        both!(self, "final_norm", [r], m => m.backend.rms_norm(r, m.final_norm(), eps, 1.0))
    }

    pub fn logits(&mut self, h: &Pair) -> Pair {
        both!(self, "lm_head", [h], m => m.logits(h))
    }

    /// The MTP head over `h_prev` (final-normed hidden states) and the next tokens.
    pub fn mtp(&mut self, next: &[u32], h: &Pair, seqs: &[SeqChunk<'_>]) -> Pair {
        let eps = self.cpu.cfg.rms_norm_eps;
        let e = both!(self, "embed", [], m => m.backend.embed(m.embedding(), next));
        let e = both!(self, "mtp_norm_e", [e], m => m.backend.rms_norm(
            e, &m.mtp.as_ref().unwrap().pre_fc_norm_embedding, eps, 1.0));
        let hn = both!(self, "mtp_norm_h", [h], m => m.backend.rms_norm(
            h, &m.mtp.as_ref().unwrap().pre_fc_norm_hidden, eps, 1.0));
        let cat = both!(self, "concat_cols", [e, hn], m => m.backend.concat_cols(e, hn));
        let x =
            both!(self, "mtp_fc", [cat], m => m.backend.linear(cat, &m.mtp.as_ref().unwrap().fc));
        let x = self.layer(self.cpu.cfg.num_layers, x, seqs);
        both!(self, "mtp_norm", [x], m => m.backend.rms_norm(x, &m.mtp.as_ref().unwrap().norm, eps, 1.0))
    }
}
