//! What a model (or one pipeline stage of it) will hold, counted from its config and quantization
//! alone, before any tensor is read: its weights (the loader's tensor list, with the same names,
//! shapes and packed/dense choices as `Model::load_stage`, at the bytes a backend stores each in),
//! its K/V bytes per token and GDN state bytes per sequence (what `Model::kv_bytes_per_token` and
//! `Model::state_bytes` say once loaded), and an estimate of a step's activations. `sanmai plan`
//! and the server's memory plan size a stage with it.

use std::ops::Range;

use sanmai_config::{FfnType, Fp8Config, LayerType, ModelConfig, QuantConfig, QuantScheme};
use sanmai_weights::fp8::device_fits;
use sanmai_weights::names::text_name;
use sanmai_weights::quant::{
    packed_fits, quant_module, scale_cols, words_per_row, PACKED_WORKSPACE_BYTES,
};

/// How a backend stores weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WeightStorage {
    /// The CUDA backend: dense weights bf16 (vectors also in f32), packed ones as packed words and
    /// f32 scales when the packed kernels take their shape ([`packed_fits`]), FP8 ones as their bytes
    /// and f32 scales when the FP8 kernels do ([`device_fits`]), else bf16.
    Cuda,
    /// The CPU backend: every weight f32 (packed ones dequantised).
    Cpu,
}

impl WeightStorage {
    /// Bytes of a K/V cache value (`Backend::CACHE_ELEM_BYTES`).
    pub fn cache_elem(self) -> usize {
        match self {
            WeightStorage::Cuda => 2,
            WeightStorage::Cpu => 4,
        }
    }
}

/// Whether the stage holds the MTP head (and its attention layer's cache).
fn has_mtp(cfg: &ModelConfig, stage: &Range<usize>) -> bool {
    cfg.mtp_layers > 0 && stage.end == cfg.num_layers
}

fn count(cfg: &ModelConfig, stage: &Range<usize>, t: LayerType) -> usize {
    stage.clone().filter(|&i| cfg.layer_types[i] == t).count()
}

/// K/V bytes one token takes on the stage's attention layers (the MTP layer's on the last stage),
/// at `elem` bytes a value, plus each one's QSA index-key entry.
pub fn stage_kv_bytes_per_token(cfg: &ModelConfig, stage: &Range<usize>, elem: usize) -> usize {
    let a = &cfg.attention;
    let index = cfg.qsa.as_ref().map_or(0, |q| q.index_entry_bytes());
    let layers = count(cfg, stage, LayerType::FullAttention) + usize::from(has_mtp(cfg, stage));
    layers * (2 * a.num_kv_heads * a.head_dim * elem + index)
}

/// The QSA layers of the stage (its full-attention layers and the MTP layer when the config has
/// `qsa`; 0 without).
pub fn stage_qsa_layers(cfg: &ModelConfig, stage: &Range<usize>) -> usize {
    match cfg.qsa {
        Some(_) => count(cfg, stage, LayerType::FullAttention) + usize::from(has_mtp(cfg, stage)),
        None => 0,
    }
}

/// Bytes of one token's QSA K and V rows on the stage (0 without QSA): what `--qsa-kv-offload` moves
/// to pinned host memory out of [`stage_kv_bytes_per_token`] (the index keys stay).
pub fn stage_qsa_kv_bytes_per_token(cfg: &ModelConfig, stage: &Range<usize>, elem: usize) -> usize {
    let a = &cfg.attention;
    stage_qsa_layers(cfg, stage) * 2 * a.num_kv_heads * a.head_dim * elem
}

/// Bytes of one sequence's state on the stage: GDN conv + recurrent state of its GDN layers and the
/// PLE conv state of its PLE layers, at `elem` bytes a value.
pub fn stage_state_bytes(cfg: &ModelConfig, stage: &Range<usize>, elem: usize) -> usize {
    let g = &cfg.gdn;
    let per_layer =
        (g.conv_kernel - 1) * g.conv_dim() + g.num_v_heads * g.k_head_dim * g.v_head_dim;
    let ple = cfg.ple.as_ref().map_or(0, |p| {
        let layers = stage.clone().filter(|i| p.layer_ids.contains(i)).count();
        let streams = cfg.hyper_connections.as_ref().map_or(1, |h| h.num_streams);
        layers * (p.conv_kernel - 1) * p.conv_dilation * streams * cfg.hidden_size
    });
    (count(cfg, stage, LayerType::LinearAttention) * per_layer + ple) * elem
}

/// An estimate of the device memory a step of `tokens` tokens takes beyond the weights and caches,
/// at its peak: the residual streams in and out (f32), three of the widest per-layer intermediates
/// (the routed experts' rows, attention's gated queries, the GDN projections, the MLPs), f32 and
/// activation-width logits of every row on the last stage, and the packed GEMM's workspace when
/// weights are packed. The server measures the real peak with a profiling step on a GPU.
pub fn stage_activation_bytes(
    cfg: &ModelConfig,
    stage: &Range<usize>,
    tokens: usize,
    form: WeightForm<'_>,
    storage: WeightStorage,
) -> usize {
    let e = storage.cache_elem();
    let h = cfg.hidden_size;
    let streams = cfg
        .hyper_connections
        .as_ref()
        .map_or(1, |hc| hc.num_streams);
    let a = &cfg.attention;
    let g = &cfg.gdn;
    let moe = cfg.moe.as_ref().map_or(0, |m| {
        (m.top_k * 2 * m.intermediate_size).max(2 * m.shared_intermediate_size)
    });
    let widest = [
        2 * a.num_heads * a.head_dim,
        g.conv_dim() + g.value_dim(),
        2 * cfg.intermediate_size,
        moe,
        streams * h,
    ]
    .into_iter()
    .max()
    .unwrap_or(h);
    let last = stage.end == cfg.num_layers;
    let logits = if last {
        tokens * cfg.vocab_size * (4 + e)
    } else {
        0
    };
    let packed = match storage {
        WeightStorage::Cuda if form.quant.is_some() || form.fp8.is_some() => PACKED_WORKSPACE_BYTES,
        _ => 0,
    };
    2 * tokens * streams * h * 4 + 3 * tokens * widest * e + logits + packed
}

/// A stage's weights by kind.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WeightBytes {
    /// Bytes in the backend's storage.
    pub stored: u64,
    /// Weights handed to the backend packed, and their packed size (words and f32 scales).
    pub packed_tensors: usize,
    pub packed_bytes: u64,
}

impl std::ops::Add for WeightBytes {
    type Output = WeightBytes;
    fn add(self, o: WeightBytes) -> WeightBytes {
        WeightBytes {
            stored: self.stored + o.stored,
            packed_tensors: self.packed_tensors + o.packed_tensors,
            packed_bytes: self.packed_bytes + o.packed_bytes,
        }
    }
}

/// Where the tensors come from, as far as their form goes.
#[derive(Debug, Clone, Copy)]
pub struct WeightForm<'a> {
    /// The quantization packed tensors follow (a dummy source's config, a checkpoint's packed
    /// tensors); `None`: every weight dense.
    pub quant: Option<&'a QuantConfig>,
    /// The block-scaled FP8 config whose converted Linears the loader hands over as FP8 bytes with
    /// their block scales repeated per row (a dummy source's config, a checkpoint's FP8 tensors).
    pub fp8: Option<&'a Fp8Config>,
    /// The routed experts come as per-expert tensors (a checkpoint without the fused 3-D ones).
    pub per_expert: bool,
    /// The MTP head's tensors come from a directory of their own (`--speculative-config`'s
    /// `"model"`, e.g. `sanmai quantize --mtp-int4`'s output) whose quantization this is, its
    /// experts one tensor per expert; `None`: the head is counted as the other weights are.
    pub mtp: Option<&'a QuantConfig>,
}

/// The weights of layers `stage` of a `cfg` model in `storage`, with the embedding, final norm,
/// lm_head, MTP head and hyper-connection head where `Model::load_stage` puts them.
pub fn stage_weight_bytes(
    cfg: &ModelConfig,
    stage: Range<usize>,
    form: WeightForm<'_>,
    storage: WeightStorage,
) -> WeightBytes {
    let mut c = Counter {
        cfg,
        form,
        storage,
        out: WeightBytes::default(),
    };
    let (h, v) = (cfg.hidden_size, cfg.vocab_size);
    let (first, last) = (stage.start == 0, stage.end == cfg.num_layers);
    // The MTP head's embedding on a last stage without one stays in host memory.
    if first || (last && cfg.tie_word_embeddings) {
        c.proj(&text_name(cfg, "embed_tokens.weight"), v, h);
    }
    if last && !cfg.tie_word_embeddings {
        c.proj("lm_head.weight", v, h);
    }
    if last {
        c.dense(&[h]);
    }
    for i in stage {
        let prefix = text_name(cfg, &format!("layers.{i}."));
        c.layer(&prefix, i, cfg.layer_types[i], cfg.ffn_types[i], true);
    }
    if cfg.mtp_layers > 0 && last {
        if let Some(q) = form.mtp {
            c.form = WeightForm {
                quant: Some(q),
                fp8: None,
                per_expert: true,
                mtp: None,
            };
        }
        c.proj("mtp.fc.weight", h, 2 * h);
        c.dense(&[h]);
        c.dense(&[h]);
        let ffn = if cfg.moe.is_some() {
            FfnType::Moe
        } else {
            FfnType::Dense
        };
        c.layer(
            "mtp.layers.0.",
            cfg.num_layers,
            LayerType::FullAttention,
            ffn,
            false,
        );
        c.dense(&[h]);
    }
    if let (Some(hc), true) = (&cfg.hyper_connections, last) {
        c.dense(&[hc.num_streams]);
    }
    c.out
}

/// How a Linear reaches the backend packed: compressed-tensors integers of scheme `s`, or FP8 (`s` then
/// 8 bits with the block's columns as its group).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct Packed {
    s: QuantScheme,
    fp8: bool,
}

struct Counter<'a> {
    cfg: &'a ModelConfig,
    form: WeightForm<'a>,
    storage: WeightStorage,
    out: WeightBytes,
}

impl Counter<'_> {
    /// How the Linear `name` of `shape` reaches the backend packed: its compressed-tensors scheme,
    /// or FP8 (8-bit codes, one scale per row and block of columns) when the FP8 config converts it.
    fn scheme(&self, name: &str, shape: &[usize]) -> Option<Packed> {
        let (module, linear) = quant_module(name, shape)?;
        if let Some(s) = self
            .form
            .quant
            .and_then(|q| q.scheme_for_module(module, linear))
        {
            return Some(Packed { s, fp8: false });
        }
        let f = self.form.fp8?;
        (linear && f.converts(module)).then_some(Packed {
            s: QuantScheme {
                bits: 8,
                group_size: f.block[1],
            },
            fp8: true,
        })
    }

    /// A dense weight of (stored) `shape`.
    fn dense(&mut self, shape: &[usize]) {
        let n = shape.iter().product::<usize>() as u64;
        self.out.stored += match self.storage {
            WeightStorage::Cpu => 4 * n,
            WeightStorage::Cuda if shape.len() == 1 && n > 0 => 6 * n,
            WeightStorage::Cuda => 2 * n,
        };
    }

    /// A weight handed to the backend packed: `[out, inp]` in `p`. FP8 bytes are the INT8 words' (the
    /// same layout, `inp % 4 == 0` where the device keeps them), its scales one per row and group.
    fn packed(&mut self, p: Packed, out: usize, inp: usize) {
        let s = p.s;
        let packed =
            4 * (out * (words_per_row(s.bits, inp) + scale_cols(s.group_size, inp))) as u64;
        let fits = if p.fp8 {
            device_fits(s.group_size, inp)
        } else {
            packed_fits(s.bits, s.group_size, inp)
        };
        self.out.packed_tensors += 1;
        self.out.packed_bytes += packed;
        self.out.stored += match self.storage {
            WeightStorage::Cuda if fits && out > 0 => packed,
            WeightStorage::Cuda => 2 * (out * inp) as u64,
            WeightStorage::Cpu => 4 * (out * inp) as u64,
        };
    }

    /// A Linear `[out, inp]`: packed when its scheme says so.
    fn proj(&mut self, name: &str, out: usize, inp: usize) {
        match self.scheme(name, &[out, inp]) {
            Some(s) => self.packed(s, out, inp),
            None => self.dense(&[out, inp]),
        }
    }

    /// Two Linears stacked into one `[n_a + n_b, inp]`: packed when both are, in one scheme.
    fn stacked(&mut self, (a, n_a): (&str, usize), (b, n_b): (&str, usize), inp: usize) {
        match (self.scheme(a, &[n_a, inp]), self.scheme(b, &[n_b, inp])) {
            (Some(x), Some(y)) if x == y => self.packed(x, n_a + n_b, inp),
            _ => self.dense(&[n_a + n_b, inp]),
        }
    }

    fn mlp(&mut self, prefix: &str, inter: usize) {
        let h = self.cfg.hidden_size;
        self.stacked(
            (&format!("{prefix}gate_proj.weight"), inter),
            (&format!("{prefix}up_proj.weight"), inter),
            h,
        );
        self.proj(&format!("{prefix}down_proj.weight"), h, inter);
    }

    fn experts(&mut self, s: &str, e: usize, inter: usize) {
        let h = self.cfg.hidden_size;
        if self.form.per_expert {
            for x in 0..e {
                self.mlp(&format!("{s}mlp.experts.{x}."), inter);
            }
            return;
        }
        let gu = self.scheme(&format!("{s}mlp.experts.gate_up_proj"), &[e, 2 * inter, h]);
        let dn = self.scheme(&format!("{s}mlp.experts.down_proj"), &[e, h, inter]);
        for _ in 0..e {
            match (gu, dn) {
                (Some(g), Some(d)) => {
                    self.packed(g, 2 * inter, h);
                    self.packed(d, h, inter);
                }
                _ => {
                    self.dense(&[2 * inter, h]);
                    self.dense(&[h, inter]);
                }
            }
        }
    }

    fn attention(&mut self, s: &str) {
        let cfg = self.cfg;
        let a = &cfg.attention;
        let (h, nh, nkv, hd) = (cfg.hidden_size, a.num_heads, a.num_kv_heads, a.head_dim);
        self.proj(&format!("{s}self_attn.q_proj.weight"), nh * hd * 2, h);
        self.proj(&format!("{s}self_attn.k_proj.weight"), nkv * hd, h);
        self.proj(&format!("{s}self_attn.v_proj.weight"), nkv * hd, h);
        self.proj(&format!("{s}self_attn.o_proj.weight"), h, nh * hd);
        self.dense(&[hd]);
        self.dense(&[hd]);
        if let Some(q) = &cfg.qsa {
            let (ni, di) = (q.index_n_heads, q.index_head_dim);
            self.proj(&format!("{s}self_attn.indexer.wq.weight"), ni * di, h);
            self.proj(&format!("{s}self_attn.indexer.wk.weight"), di, h);
            self.dense(&[di]);
            self.dense(&[di]);
            self.proj(&format!("{s}self_attn.indexer.weights_proj.weight"), ni, h);
        }
    }

    fn gdn(&mut self, s: &str) {
        let cfg = self.cfg;
        let g = &cfg.gdn;
        let h = cfg.hidden_size;
        let (conv_dim, value_dim, nv) = (g.conv_dim(), g.value_dim(), g.num_v_heads);
        if cfg.arch.grouped_gdn_projections() {
            let n_qkvz = 2 * g.key_dim() + 2 * g.value_dim();
            match self.scheme(&format!("{s}linear_attn.in_proj_qkvz.weight"), &[n_qkvz, h]) {
                Some(q) => {
                    self.packed(q, conv_dim, h);
                    self.packed(q, value_dim, h);
                    match self.scheme(&format!("{s}linear_attn.in_proj_ba.weight"), &[2 * nv, h]) {
                        Some(b) => {
                            self.packed(b, nv, h);
                            self.packed(b, nv, h);
                        }
                        None => {
                            self.dense(&[nv, h]);
                            self.dense(&[nv, h]);
                        }
                    }
                }
                None => {
                    self.dense(&[conv_dim, h]);
                    self.dense(&[value_dim, h]);
                    self.dense(&[nv, h]);
                    self.dense(&[nv, h]);
                }
            }
        } else {
            self.proj(&format!("{s}linear_attn.in_proj_qkv.weight"), conv_dim, h);
            self.proj(&format!("{s}linear_attn.in_proj_z.weight"), value_dim, h);
            self.proj(&format!("{s}linear_attn.in_proj_b.weight"), nv, h);
            self.proj(&format!("{s}linear_attn.in_proj_a.weight"), nv, h);
        }
        self.dense(&[conv_dim, g.conv_kernel]);
        self.dense(&[nv]);
        self.dense(&[nv]);
        self.dense(&[g.v_head_dim]);
        self.proj(&format!("{s}linear_attn.out_proj.weight"), h, value_dim);
    }

    fn ffn(&mut self, s: &str, kind: FfnType) {
        let cfg = self.cfg;
        let h = cfg.hidden_size;
        match (kind, &cfg.moe) {
            (FfnType::Moe, Some(m)) => {
                self.experts(s, m.num_experts, m.intermediate_size);
                if m.shared_intermediate_size > 0 {
                    self.mlp(
                        &format!("{s}mlp.shared_expert."),
                        m.shared_intermediate_size,
                    );
                    self.proj(&format!("{s}mlp.shared_expert_gate.weight"), 1, h);
                }
                self.proj(&format!("{s}mlp.gate.weight"), m.num_experts, h);
            }
            _ => self.mlp(&format!("{s}mlp."), cfg.intermediate_size),
        }
    }

    fn ple(&mut self, s: &str) {
        let cfg = self.cfg;
        let h = cfg.hidden_size;
        let p = cfg.ple.as_ref().expect("a PLE layer has a ple block");
        let e = p.num_tables() * p.row_dim;
        let streams = cfg
            .hyper_connections
            .as_ref()
            .map_or(1, |hc| hc.num_streams);
        self.proj(&format!("{s}ple.value.weight"), h, e);
        self.dense(&[h]);
        for _ in 0..streams {
            // The keys are read dense (`Loader::get`), the key bias and the three norms per stream.
            self.dense(&[h, e]);
            for _ in 0..4 {
                self.dense(&[h]);
            }
        }
        self.dense(&[streams * h, p.conv_kernel]);
    }

    fn hc(&mut self, s: &str, prefix: &str, streams: usize, rank: usize) {
        let h = self.cfg.hidden_size;
        self.dense(&[streams]);
        self.proj(&format!("{s}{prefix}down.weight"), rank, h);
        self.proj(&format!("{s}{prefix}inject.weight"), rank, h);
        self.proj(&format!("{s}{prefix}up.weight"), streams * h, rank);
    }

    fn layer(&mut self, s: &str, index: usize, mixer: LayerType, ffn: FfnType, main: bool) {
        let cfg = self.cfg;
        let h = cfg.hidden_size;
        self.dense(&[h]);
        self.dense(&[h]);
        match mixer {
            LayerType::FullAttention => self.attention(s),
            LayerType::LinearAttention => self.gdn(s),
        }
        self.ffn(s, ffn);
        let ple_here = main
            && cfg
                .ple
                .as_ref()
                .is_some_and(|p| p.layer_ids.contains(&index));
        if ple_here {
            self.ple(s);
        }
        if let (Some(hc), true) = (&cfg.hyper_connections, main) {
            let (n, r) = (hc.num_streams, hc.rank);
            self.hc(s, "hc_attn.", n, r);
            self.hc(s, "hc_ffn.", n, r);
        }
    }
}
