//! The seam between the model and the hardware: every op the forward pass needs, implemented once per
//! backend (the CPU reference here; CUDA later). Activations are `[rows, cols]` tensors whose rows are
//! the tokens of a step, sequence after sequence; per-sequence state (attention K/V in a block pool, GDN
//! conv and recurrent state in state slots) lives inside the backend.
//!
//! Every op returns an [`OpResult`]: a device failure or a call outside the op's contract is a
//! [`BackendError`], never a panic. Ops with many inputs take one call struct ([`AttnCall`],
//! [`QsaCall`], [`GdnCall`], [`MoeCall`], [`PleCall`], [`SampleCall`]); a whole mixer sublayer from
//! its normed input is a [`GdnMixerCall`] or an [`AttnMixerCall`] (`mixer.rs`), which a backend may
//! run its own way (one launch on a GPU).
//!
//! qwen4_exp adds (shapes and weights in `qsa.rs`, `ple.rs`, `hc.rs`): QSA's fp8 index-key cache next to the
//! K/V of every attention layer (one entry of `dI` fp8 e4m3 values and a bf16 scale per position, in
//! the same blocks, so prefix caching and `copy_block` cover it), the PLE short conv's state in the
//! state slots next to the GDN state (so `copy_state` checkpoints cover it), and hyper-connections'
//! S residual streams carried as one `[rows, S·H]` tensor (stream `c` in columns `c·H .. (c+1)·H`).

/// A sequence's share of one step: rows `start..start + len` of the step's activations are its tokens at
/// positions `pos0..pos0 + len`. Its attention K/V live in the pool blocks of `blocks` (block `i` holds
/// positions `i·block_size ..`), which must cover `pos0 + len` positions; its GDN conv and recurrent state is
/// state slot `state`, which holds the sequence's state after `pos0` tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeqChunk<'a> {
    pub start: usize,
    pub len: usize,
    pub pos0: usize,
    pub state: usize,
    pub blocks: &'a [u32],
}

/// The caches a backend allocates at startup: a pool of `num_blocks` K/V blocks of `block_size` positions
/// for each attention layer in `attn_layers` (layer indices; the MTP layer is index `num_layers`), and GDN
/// state slots for the layers in `gdn_layers`, allocated on demand.
#[derive(Debug, Clone, PartialEq)]
pub struct CacheSpec {
    pub num_blocks: usize,
    pub block_size: usize,
    pub attn_layers: Vec<usize>,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// QSA: `dI` of the index keys kept per position next to the K/V of every attention layer
    /// (`dI + 2` bytes per entry); 0 = no index keys.
    pub index_head_dim: usize,
    pub gdn_layers: Vec<usize>,
    pub gdn: GdnShape,
    /// PLE: layers whose short-conv state lives in each state slot (empty = none).
    pub ple_layers: Vec<usize>,
    /// PLE: the conv's shape (`None` when `ple_layers` is empty).
    pub ple: Option<PleShape>,
    /// QSA: keep the K and V rows of the attention layers in pinned host memory (the device reads
    /// them through unified addressing); the index keys stay on the device. `None`: all on the device.
    pub kv_host: Option<KvHost>,
}

/// Counters of the QSA K/V host pool ([`Backend::kv_host_stats`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct KvHostStats {
    /// Per QSA layer (absolute index, ascending): row reads of decode-shaped steps that the VRAM row
    /// cache served (`hits`) and that went to host memory (`misses`).
    pub layers: Vec<RowCacheCounts>,
    /// Bytes of K/V rows read from host memory (row-cache misses and every row of uncached steps).
    pub host_bytes_read: u64,
}

/// One QSA layer's row-cache counters.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct RowCacheCounts {
    pub layer: usize,
    pub hits: u64,
    pub misses: u64,
}

/// How a backend pins the host pool of QSA K/V rows (`--qsa-kv-offload`): one pool of exactly the
/// needed size, pinned under a lock file after a check of the available RAM (`sanmai_pinned`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KvHost {
    /// Names the pool in messages, e.g. "the QSA K/V pool of stage 1".
    pub what: String,
    /// RAM that must stay available after pinning (`--host-memory-reserve`).
    pub reserve: usize,
    /// The lock file that serialises pinning across stages and processes.
    pub lock_path: std::path::PathBuf,
    /// Rows of the stage's VRAM arena: a prefill stages a sequence's rows there (when they fit), and
    /// decode-shaped steps ([`MAX_CACHED_ROWS`] query rows at most) read through the row cache it
    /// holds between prefills, split over the stage's QSA layers (0: neither).
    pub row_cache_rows: usize,
    /// Whether decode-shaped steps read through the row cache (off: every row from host memory).
    pub row_cache: bool,
}

/// Decode-shaped steps (at most this many query rows: fixed launch shapes, recorded in CUDA graphs)
/// read QSA K/V rows through the row cache; larger steps read every row from host memory.
pub const MAX_CACHED_ROWS: usize = 12;

/// Static shapes of an attention layer call.
#[derive(Debug, Clone, Copy)]
pub struct AttnShape {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub eps: f32,
}

/// Rotary embedding tables: `rot_dim / 2` inverse frequencies and the cos/sin scale (YaRN's factor, else 1).
#[derive(Debug, Clone)]
pub struct Rope {
    pub rot_dim: usize,
    pub inv_freq: Vec<f32>,
    pub mscale: f32,
}

/// Explicit interleaved-MRoPE positions of a step's rows (Qwen3-VL / Qwen3.5 with images in the
/// prompt): row `r` turns rotary frequency `j` by `positions[r][mrope_axis(j, sections)] ·
/// inv_freq[j]` instead of `(pos0 + i) · inv_freq[j]`, as transformers' text rotary embedding
/// recomposes its (t, h, w) frequency tables. Only the angle changes: the K/V cache slot and the
/// causal mask of a row stay its sequence index `pos0 + i`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mrope<'a> {
    /// `(t, h, w)` of every row of the step, in row order.
    pub positions: &'a [[u32; 3]],
    /// The config's `mrope_section`: how many frequencies each axis owns (they sum to
    /// `rot_dim / 2`).
    pub sections: [usize; 3],
}

/// Which position axis (0 = t, 1 = h, 2 = w) rotary frequency `j` takes under interleaved MRoPE
/// (transformers' `recomposition_frequencies`: the h frequencies are `1, 4, 7, ...` below
/// `3·sections[1]`, the w frequencies `2, 5, 8, ...` below `3·sections[2]`, t keeps the rest).
pub fn mrope_axis(j: usize, sections: &[usize; 3]) -> usize {
    match j % 3 {
        1 if j < 3 * sections[1] => 1,
        2 if j < 3 * sections[2] => 2,
        _ => 0,
    }
}

/// Static shapes of a GDN layer call.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GdnShape {
    pub num_k_heads: usize,
    pub num_v_heads: usize,
    pub k_head_dim: usize,
    pub v_head_dim: usize,
    pub conv_kernel: usize,
}

/// Weights of a gated attention layer, in backend form.
pub struct AttnWeights<W> {
    /// `[num_heads · 2·head_dim, hidden]`, per head `[q | gate]`.
    pub q_proj: W,
    pub k_proj: W,
    pub v_proj: W,
    pub o_proj: W,
    pub q_norm: W,
    pub k_norm: W,
}

/// Weights of a GDN layer, in backend form (canonical contiguous projections).
pub struct GdnWeights<W> {
    pub in_proj_qkv: W,
    pub in_proj_z: W,
    pub in_proj_b: W,
    pub in_proj_a: W,
    /// `[conv_dim, kernel]`.
    pub conv: W,
    pub a_log: W,
    pub dt_bias: W,
    /// Plain-weight gated RMSNorm over `v_head_dim`.
    pub norm: W,
    pub out_proj: W,
}

/// A SwiGLU MLP with fused `[2I, H]` gate|up rows.
pub struct MlpWeights<W> {
    pub gate_up: W,
    pub down: W,
    pub inter: usize,
}

/// Routed experts plus the optional shared expert.
pub struct MoeWeights<W> {
    /// `[num_experts, hidden]`.
    pub router: W,
    pub experts: Vec<MlpWeights<W>>,
    pub top_k: usize,
    pub renormalize: bool,
    pub shared: Option<MlpWeights<W>>,
    /// `[1, hidden]`.
    pub shared_gate: Option<W>,
}

/// A decode step handed to [`Backend::decode_step`]: the ids the step embeds, its chunks (one token
/// each, chunk `i` at row `i`) and the rows it returns. `region` names the computation (the closure):
/// steps of one region and shape run the same ops on the same weights, so a backend may replay one
/// recording for all of them.
#[derive(Debug, Clone, Copy)]
pub struct DecodeStep<'a> {
    pub region: u32,
    pub ids: &'a [u32],
    pub seqs: &'a [SeqChunk<'a>],
    pub out_rows: &'a [usize],
}

mod error;
mod hc;
mod mixer;
mod ple;
mod probe;
mod qsa;

pub use error::{BackendError, OpResult};
pub use hc::{hc_residual_ops, hc_residual_premix_norm_ops, HcNext, HcWeights};
pub use mixer::{AttnMixerCall, GdnMixerCall};
pub use ple::{PleCall, PleShape, PleWeights};
pub use probe::{PhaseTable, Probe};
pub use qsa::{IndexerWeights, QsaCall, QsaMixerCall, QsaShape};
pub use sanmai_weights::quant::{PackedTensor, PackedWords};

use crate::sample::{RowError, RowSampling, Sampled};

/// One gated attention layer call (layer index `layer`; the MTP layer is `num_layers`): the q|gate,
/// k and v projections of the step's rows, the layer's weights and the step's chunks.
pub struct AttnCall<'a, T, W> {
    pub layer: usize,
    pub shape: &'a AttnShape,
    pub rope: &'a Rope,
    pub q_gate: &'a T,
    pub k: &'a T,
    pub v: &'a T,
    pub w: &'a AttnWeights<W>,
    pub seqs: &'a [SeqChunk<'a>],
    /// Explicit MRoPE positions of the step's rows; `None`: row `i` of a chunk at `pos0 + i` on
    /// every axis (plain RoPE).
    pub mrope: Option<Mrope<'a>>,
}

/// One GDN layer call over GDN layer `layer`'s state in each chunk's state slot: the `qkv` and `z`
/// projections of the step's rows and its gates.
pub struct GdnCall<'a, T, W> {
    pub layer: usize,
    pub shape: &'a GdnShape,
    pub qkv: &'a T,
    pub z: &'a T,
    pub gates: GdnGates<'a, T>,
    pub w: &'a GdnWeights<W>,
    /// The gated RMSNorm's epsilon.
    pub eps: f32,
    pub seqs: &'a [SeqChunk<'a>],
}

/// A GDN call's gate projections `b`, `a` (`[rows, Hv]`, before the sigmoid and softplus).
pub enum GdnGates<'a, T> {
    /// Projected by the model.
    Given { b: &'a T, a: &'a T },
    /// Projected by the backend from the layer's normed input `[rows, H]` with `in_proj_b` and
    /// `in_proj_a` ([`Backend::gdn_projects_gates`]).
    FromInput(&'a T),
}

impl<T> Clone for GdnGates<'_, T> {
    fn clone(&self) -> Self {
        *self
    }
}

impl<T> Copy for GdnGates<'_, T> {}

/// The shared expert's part of a MoE call: its output `[rows, H]` and gate logit `[rows, 1]`, each
/// `None` when the backend computes it itself ([`Backend::moe_fuses_shared`]: the output from
/// `MoeWeights::shared` with the routed experts, the gate logits from `MoeWeights::shared_gate`
/// with the router's).
pub struct SharedExpert<'a, T> {
    pub y: Option<&'a T>,
    pub gate: Option<&'a T>,
}

/// How a backend's [`Backend::moe_experts`] takes a layer's shared expert.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SharedFusion {
    /// The model computes the shared expert's output and gate logits.
    Apart,
    /// The backend runs the shared expert with the routed experts; the model computes its gate
    /// logits.
    Expert,
    /// The backend also computes the gate logits, with the router's.
    ExpertAndGate,
    /// The model computes the shared expert's output; the backend computes its gate logits with
    /// the router's (a shared expert the routed experts' launches do not take).
    Gate,
}

/// One MoE call: the normed input `x` `[rows, H]`, the layer's experts and router, and the shared
/// expert's output when the layer has one.
pub struct MoeCall<'a, T, W> {
    pub x: &'a T,
    pub w: &'a MoeWeights<W>,
    pub shared: Option<SharedExpert<'a, T>>,
}

/// What [`Backend::sample`] draws: one row of sampling per logits row, over the first `valid_vocab`
/// columns (the real tokens).
pub struct SampleCall<'a> {
    pub valid_vocab: usize,
    pub rows: &'a [RowSampling<'a>],
}

/// A weight the loader handed to the backend in packed form ([`Backend::packed_weight`]): its name
/// (for fused weights, the name of the fused tensor the model uses), scheme, shape and packed size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PackedInfo {
    pub name: String,
    pub bits: u32,
    /// Inputs per scale; 0 = one scale per output row.
    pub group_size: usize,
    pub out_features: usize,
    pub in_features: usize,
    /// Packed words plus f32 scales.
    pub bytes: usize,
}

/// The operations a backend provides. Ops on sequences take the step's [`SeqChunk`]s.
/// A pipeline stage's output on its way to the next stage ([`Backend::hand_over`]).
pub enum Handover<T> {
    /// A tensor the next stage takes as it is or copies to its own memory.
    Tensor(T),
    /// Values on the host, `[rows, cols]` row-major.
    Host {
        rows: usize,
        cols: usize,
        data: Vec<f32>,
    },
}

/// The sending half of a link between two pipeline stages' backends (NCCL between two GPUs): used on
/// the sending stage's thread, queued with that backend's work. Returns `x`'s `[rows, cols]`, which
/// the receiving stage passes to [`StageRecv::recv`].
pub trait StageSend<T>: Send {
    fn send(&self, x: &T) -> OpResult<(usize, usize)>;
}

/// The receiving half of a stage link: a `[rows, cols]` tensor of the receiving backend, ordered
/// before its next op.
pub trait StageRecv<T>: Send {
    fn recv(&self, rows: usize, cols: usize) -> OpResult<T>;
}

/// The two halves of a stage link ([`Backend::link_to`]).
pub type StageLink<T> = (Box<dyn StageSend<T>>, Box<dyn StageRecv<T>>);

pub trait Backend: Send + Sync {
    /// Activations, `[rows, cols]`.
    type Tensor: Send;
    /// A weight in the backend's storage (matrix `[out, in]` or vector).
    type Weight: Send + Sync;
    /// Bytes per value of the K/V cache and GDN state (for memory planning).
    const CACHE_ELEM_BYTES: usize;

    /// Uploads a weight given as f32 values with its shape.
    fn weight(&self, data: Vec<f32>, shape: &[usize]) -> OpResult<Self::Weight>;

    /// Uploads a quantized Linear weight `[p.out_features, p.in_features]` given in its packed form
    /// (compressed-tensors INT4/INT8 or INT6 gapless, see [`PackedTensor`]). A backend that consumes
    /// packed integers keeps them; the default dequantises (exactly `p.dequantize()`) into
    /// [`Backend::weight`].
    fn packed_weight(&self, p: &PackedTensor<'_>) -> OpResult<Self::Weight> {
        self.weight(p.dequantize(), &[p.out_features, p.in_features])
    }

    /// Allocates the K/V block pools (replacing any earlier ones).
    fn init_cache(&self, spec: &CacheSpec) -> OpResult<()>;
    /// A new GDN state slot, zeroed (the state of an empty sequence).
    fn alloc_state(&self) -> OpResult<usize>;
    /// Sizes the state slot pool for `slots` live slots at once, allocated now, and fixes it there:
    /// [`Backend::alloc_state`] fails while `slots` are live instead of growing the pool. Fails when
    /// more than `slots` are live now.
    fn reserve_states(&self, slots: usize) -> OpResult<()>;
    /// Returns a slot to the pool (a slot not allocated is ignored).
    fn free_state(&self, slot: usize);
    /// Copies every GDN layer's state of slot `src` into slot `dst` (checkpoint save and restore).
    fn copy_state(&self, src: usize, dst: usize) -> OpResult<()>;
    /// Copies K/V block `src` into block `dst` in every attention layer (copy-on-write of a shared partial
    /// block).
    fn copy_block(&self, src: u32, dst: u32) -> OpResult<()>;

    /// Rows of `table` `[vocab, hidden]` for the given ids.
    fn embed(&self, table: &Self::Weight, ids: &[u32]) -> OpResult<Self::Tensor>;
    /// Row-wise RMSNorm: `offset` 1.0 = zero-centred weight `(1 + w)`, 0.0 = plain weight.
    fn rms_norm(
        &self,
        x: &Self::Tensor,
        w: &Self::Weight,
        eps: f32,
        offset: f32,
    ) -> OpResult<Self::Tensor>;
    /// `x · wᵀ`.
    fn linear(&self, x: &Self::Tensor, w: &Self::Weight) -> OpResult<Self::Tensor>;
    /// `x · wᵀ` for each of `ws`, in order: the projections that read one input. A backend may run
    /// several in one launch (decode GEMVs are short, so their launches dominate); each result equals
    /// [`Backend::linear`]'s.
    fn linear_many(&self, x: &Self::Tensor, ws: &[&Self::Weight]) -> OpResult<Vec<Self::Tensor>> {
        ws.iter().map(|w| self.linear(x, w)).collect()
    }
    /// Selected rows of `x`.
    fn rows(&self, x: &Self::Tensor, rows: &[usize]) -> OpResult<Self::Tensor>;
    /// Overwrites rows of `x`: row `rows[i]` becomes row `i` of `values` (`[rows.len(), x.cols]`).
    /// The rows are distinct. What puts an image's embeddings in place of its placeholder tokens'.
    fn set_rows(&self, x: &mut Self::Tensor, rows: &[usize], values: &Self::Tensor)
        -> OpResult<()>;
    /// Concatenation along columns: `[a | b]`.
    fn concat_cols(&self, a: &Self::Tensor, b: &Self::Tensor) -> OpResult<Self::Tensor>;
    /// `acc += y`.
    fn add(&self, acc: &mut Self::Tensor, y: &Self::Tensor) -> OpResult<()>;
    /// `acc += y`, then [`Backend::rms_norm`] of the new `acc` (the residual add and the next
    /// sublayer's norm; a backend may fuse them into one pass).
    fn add_rms_norm(
        &self,
        acc: &mut Self::Tensor,
        y: &Self::Tensor,
        w: &Self::Weight,
        eps: f32,
        offset: f32,
    ) -> OpResult<Self::Tensor> {
        self.add(acc, y)?;
        self.rms_norm(acc, w, eps, offset)
    }
    /// [`Backend::linear`] whose output is added to the residual `acc` and normed
    /// ([`Backend::add_rms_norm`]): a mixer's output projection and the next sublayer's norm, the
    /// same values (a backend may run them in one pass).
    fn linear_add_rms_norm(
        &self,
        x: &Self::Tensor,
        w: &Self::Weight,
        acc: &mut Self::Tensor,
        norm: &Self::Weight,
        eps: f32,
        offset: f32,
    ) -> OpResult<Self::Tensor> {
        let y = self.linear(x, w)?;
        self.add_rms_norm(acc, &y, norm, eps, offset)
    }
    /// `silu(gate) · up` on a fused `[rows, 2I]` gate|up tensor.
    fn swiglu(&self, gate_up: &Self::Tensor) -> OpResult<Self::Tensor>;
    /// An MLP's down projection: [`Backend::linear`] of [`Backend::swiglu`]`(gate_up)` (a backend
    /// may stage the activation inside the projection's launch, with the same values).
    fn swiglu_linear(&self, gate_up: &Self::Tensor, w: &Self::Weight) -> OpResult<Self::Tensor> {
        self.linear(&self.swiglu(gate_up)?, w)
    }
    /// `silu(x)` elementwise.
    fn silu(&self, x: &Self::Tensor) -> OpResult<Self::Tensor>;

    /// Gated attention core: splits `q_gate` per head into query and gate, applies q/k norms and RoPE
    /// (at `pos0 + i`, or at the explicit positions of `c.mrope`), writes k/v into the sequence's
    /// blocks for layer index `c.layer`, attends causally over positions `0..pos0 + len` and returns
    /// `attn · sigmoid(gate)` as `[rows, num_heads·head_dim]`. A backend that cannot turn rows by
    /// explicit MRoPE positions refuses a call with `c.mrope` set.
    fn attention(&self, c: &AttnCall<'_, Self::Tensor, Self::Weight>) -> OpResult<Self::Tensor>;

    /// Gated delta net core over GDN layer `c.layer`'s state in each sequence's state slot: causal
    /// conv + SiLU on `qkv`, decay and beta from `a`/`b`, the delta rule (chunked for prefill,
    /// recurrent for decode), then the gated RMSNorm with `z`. Returns `[rows, Hv·dv]` (before
    /// `out_proj`).
    fn gdn(&self, c: &GdnCall<'_, Self::Tensor, Self::Weight>) -> OpResult<Self::Tensor>;

    /// Whether [`Backend::gdn`] projects layer `w`'s gates itself for a call of `rows` rows (the model
    /// then passes [`GdnGates::FromInput`]). Default: no.
    fn gdn_projects_gates(
        &self,
        _w: &GdnWeights<Self::Weight>,
        _shape: &GdnShape,
        _rows: usize,
    ) -> bool {
        false
    }

    /// The GDN mixer's core for the normed input `c.x`: the input projections (`in_proj_qkv`,
    /// `in_proj_z`, and the gates `in_proj_b`, `in_proj_a` unless [`Backend::gdn_projects_gates`])
    /// and [`Backend::gdn`], before `out_proj`.
    fn gdn_from_input(
        &self,
        c: &GdnMixerCall<'_, Self::Tensor, Self::Weight>,
    ) -> OpResult<Self::Tensor> {
        mixer::gdn_from_input(self, c)
    }

    /// Whether [`Backend::gdn_mixer`] and [`Backend::gdn_mixer_add_rms_norm`] run a call of `rows`
    /// rows on `w` their own way (one launch on a GPU); the model then calls them in place of the
    /// mixer's ops. Default: no.
    fn gdn_mixer_whole(
        &self,
        _w: &GdnWeights<Self::Weight>,
        _shape: &GdnShape,
        _rows: usize,
    ) -> bool {
        false
    }

    /// The whole GDN mixer: [`Backend::gdn_from_input`], then `out_proj`.
    fn gdn_mixer(
        &self,
        c: &GdnMixerCall<'_, Self::Tensor, Self::Weight>,
    ) -> OpResult<Self::Tensor> {
        self.linear(&self.gdn_from_input(c)?, &c.w.out_proj)
    }

    /// [`Backend::gdn_mixer`] added to `acc`, then [`Backend::rms_norm`] of the new `acc`.
    fn gdn_mixer_add_rms_norm(
        &self,
        c: &GdnMixerCall<'_, Self::Tensor, Self::Weight>,
        acc: &mut Self::Tensor,
        norm: &Self::Weight,
        eps: f32,
        offset: f32,
    ) -> OpResult<Self::Tensor> {
        let o = self.gdn_from_input(c)?;
        self.linear_add_rms_norm(&o, &c.w.out_proj, acc, norm, eps, offset)
    }

    /// The attention mixer's core for the normed input `c.x`: the q|gate, k and v projections and
    /// [`Backend::attention`], before `o_proj`.
    fn attn_from_input(
        &self,
        c: &AttnMixerCall<'_, Self::Tensor, Self::Weight>,
    ) -> OpResult<Self::Tensor> {
        mixer::attn_from_input(self, c)
    }

    /// Whether [`Backend::attn_mixer_add_rms_norm`] runs a call of `rows` rows on `w` its own way
    /// (one launch on a GPU); the model then calls it in place of the mixer's ops. Default: no.
    fn attn_mixer_whole(
        &self,
        _w: &AttnWeights<Self::Weight>,
        _shape: &AttnShape,
        _rows: usize,
    ) -> bool {
        false
    }

    /// The attention mixer ([`Backend::attn_from_input`], then `o_proj`) added to `acc`, then
    /// [`Backend::rms_norm`] of the new `acc`.
    fn attn_mixer_add_rms_norm(
        &self,
        c: &AttnMixerCall<'_, Self::Tensor, Self::Weight>,
        acc: &mut Self::Tensor,
        norm: &Self::Weight,
        eps: f32,
        offset: f32,
    ) -> OpResult<Self::Tensor> {
        let o = self.attn_from_input(c)?;
        self.linear_add_rms_norm(&o, &c.w.o_proj, acc, norm, eps, offset)
    }

    /// Routed experts: softmax router, top-k, optional renormalisation, weighted SwiGLU experts; plus
    /// `sigmoid(gate) · y` when the shared expert is given (a backend may add it in its combine).
    fn moe_experts(&self, c: &MoeCall<'_, Self::Tensor, Self::Weight>) -> OpResult<Self::Tensor>;

    /// [`Backend::moe_experts`] whose output is added to the residual `acc` and normed
    /// ([`Backend::add_rms_norm`]): the next sublayer's normed input, the same values (a backend may
    /// combine the experts, add and norm in one pass).
    fn moe_experts_add_rms_norm(
        &self,
        c: &MoeCall<'_, Self::Tensor, Self::Weight>,
        acc: &mut Self::Tensor,
        w: &Self::Weight,
        eps: f32,
        offset: f32,
    ) -> OpResult<Self::Tensor> {
        let y = self.moe_experts(c)?;
        self.add_rms_norm(acc, &y, w, eps, offset)
    }

    /// How [`Backend::moe_experts`] takes layer `w`'s shared expert for a call of `rows` rows: what it
    /// computes itself, in the same launches as the routed experts (the model then passes `None` for
    /// it in [`SharedExpert`]). Default: [`SharedFusion::Apart`].
    fn moe_fuses_shared(&self, _w: &MoeWeights<Self::Weight>, _rows: usize) -> SharedFusion {
        SharedFusion::Apart
    }

    /// Runs one decode step its own way: `step` says what the step is (every chunk one token) and `run`
    /// computes its outputs with this backend's ops. Each call of `run` that executes writes the
    /// step's K/V and advances its GDN state, so the step must execute exactly once; a backend may call
    /// `run` under a recording that does not execute (a CUDA stream capture) and replay the recording,
    /// for this step and later steps of the same region and shape. The outputs are what an executed
    /// `run` returns; an error of `run` is the step's error. The CPU backend calls `run` once.
    fn decode_step(
        &self,
        step: &DecodeStep<'_>,
        run: &dyn Fn() -> OpResult<Vec<Self::Tensor>>,
    ) -> OpResult<Vec<Self::Tensor>>;

    /// Keeps a decode step's input streams (from the previous pipeline stage) where a recorded
    /// [`Backend::decode_step`] reads them ([`Backend::kept_streams`]): a buffer per shape that stays
    /// in place from step to step. Gives them back where the backend records nothing (the default):
    /// the step then runs on them as they are.
    fn keep_streams(&self, x: Self::Tensor) -> OpResult<Option<Self::Tensor>> {
        Ok(Some(x))
    }

    /// A copy of the streams [`Backend::keep_streams`] kept last, for the step's ops (a recording
    /// reads the kept buffer at every replay).
    fn kept_streams(&self) -> OpResult<Self::Tensor> {
        Err(BackendError::Invalid {
            op: "kept_streams",
            message: "this backend keeps no streams".into(),
        })
    }

    /// Hands over the PLE rows `[rows, E]` of the [`Backend::decode_step`] that follows, before it
    /// starts: the step's [`Backend::ple_mix`] calls get the same tensor. A backend that replays
    /// recorded steps copies them where its recording reads them (a replay does not see the tensor
    /// the closure holds). The default does nothing: the ops read the tensor they are given.
    fn ple_step_rows(&self, rows: &Self::Tensor) -> OpResult<()> {
        let _ = rows;
        Ok(())
    }

    /// Stages a step's metadata (its token ids, chunks and returned rows) before its first op, so
    /// the ops find it in place; a pipeline stage calls it before it waits for its input. The
    /// default does nothing: the ops take what they need from their calls.
    fn prepare_step(&self, ids: &[u32], seqs: &[SeqChunk<'_>], out_rows: &[usize]) -> OpResult<()> {
        let _ = (ids, seqs, out_rows);
        Ok(())
    }

    /// Hands a pipeline stage's output (the residual streams) over to the next stage's thread: what
    /// comes back is complete and stays valid after this returns, whatever this backend does next.
    /// The default moves the tensor as it is (host memory: the next stage reads it in place).
    fn hand_over(&self, x: Self::Tensor) -> OpResult<Handover<Self::Tensor>> {
        Ok(Handover::Tensor(x))
    }

    /// A link to the next pipeline stage's backend that is not a hand-over (the streams cross between
    /// devices through a communication library), or `None` where [`Backend::hand_over`] serves.
    fn link_to(&self, next: &Self) -> OpResult<Option<StageLink<Self::Tensor>>>
    where
        Self: Sized,
    {
        let _ = next;
        Ok(None)
    }

    /// Takes over another stage's [`Backend::hand_over`] (a backend of this type, on this device or
    /// another) as a tensor of this backend, ordered before this backend's next op.
    fn take_over(&self, h: Handover<Self::Tensor>) -> OpResult<Self::Tensor> {
        match h {
            Handover::Tensor(x) => Ok(x),
            Handover::Host { rows, cols, data } => self.upload(rows, cols, data),
        }
    }

    /// Moves a tensor to the host as `(rows, cols, values)`.
    fn to_host(&self, x: Self::Tensor) -> OpResult<(usize, usize, Vec<f32>)>;

    /// An activation tensor `[rows, cols]` from host values (row-major); used for the PLE rows
    /// gathered on the host (bf16 values given as f32, so a bf16 device copy is exact).
    fn upload(&self, rows: usize, cols: usize, data: Vec<f32>) -> OpResult<Self::Tensor>;

    /// Samples one token from each row of `logits` `[c.rows.len(), cols]` as
    /// [`crate::sample::sample_row`] defines it, row `i` with `c.rows[i]`; returns each chosen id
    /// with its raw log-probability, or why that row could not be drawn. The default moves the logits
    /// to the host and runs that function; a backend that samples where the logits are sends back only
    /// the ids and log-probabilities (the same tokens up to float near-ties in cumulative sums).
    fn sample(
        &self,
        logits: Self::Tensor,
        c: &SampleCall<'_>,
    ) -> OpResult<Vec<Result<Sampled, RowError>>> {
        let (_, cols, mut values) = self.to_host(logits)?;
        Ok(crate::sample::sample_rows(
            &mut values,
            cols,
            c.valid_vocab,
            c.rows,
        ))
    }

    /// Whether [`Backend::sample`] runs next to the logits (saving their copy to the host), so that an
    /// engine should sample through it; `false` for a backend whose logits live on the host anyway.
    fn device_sampling(&self) -> bool {
        false
    }

    /// What the QSA K/V host pool has served since the caches were initialised, when the K/V rows
    /// live in host memory ([`CacheSpec::kv_host`]); `None` otherwise.
    fn kv_host_stats(&self) -> OpResult<Option<KvHostStats>> {
        Ok(None)
    }

    /// Bytes a weight occupies in this backend's storage: what one pass over it reads.
    fn weight_bytes(&self, w: &Self::Weight) -> usize;

    /// Hyper-connections pre-mix (and head collapse): `streams` is `[rows, S·H]` with S = `pre.len()`;
    /// returns `[rows, H]` with `x = Σ_c softmax(pre)_c · R_c` (softmax over the S values of `pre` in
    /// f32, max subtracted; the sum taken in order c = 0..S−1).
    fn hc_premix(&self, streams: &Self::Tensor, pre: &Self::Weight) -> OpResult<Self::Tensor>;

    /// Hyper-connections gated residual: `streams` `[rows, S·H]`, `u` `[rows, S·H]`, `y` `[rows, H]`;
    /// `R_c += sigmoid(u_c) ⊙ y` for every stream c (u_c = columns `c·H .. (c+1)·H` of `u`).
    fn hc_gated_residual(
        &self,
        streams: &mut Self::Tensor,
        u: &Self::Tensor,
        y: &Self::Tensor,
    ) -> OpResult<()>;

    /// The hyper-connections' gated residual of one sublayer (spec §4), in place on `streams`
    /// `[rows, S·H]`: with `y` `[rows, H]` the sublayer's output and `x` `[rows, H]` its pre-mixed
    /// input, `s = silu(down·y + inject·x)`, `u = up·s`, `R_c += sigmoid(u_c) ⊙ y`. The default is
    /// [`hc_residual_ops`] (the oracle); a backend may fuse the ops.
    fn hc_residual(
        &self,
        streams: &mut Self::Tensor,
        x: &Self::Tensor,
        y: &Self::Tensor,
        w: &HcWeights<Self::Weight>,
    ) -> OpResult<()> {
        hc_residual_ops(self, streams, x, y, w)
    }

    /// [`Backend::hc_residual`] of one sublayer, then the next sublayer's pre-mix
    /// ([`Backend::hc_premix`] with `next.pre`) and its norm ([`Backend::rms_norm`] with
    /// `next.norm`, `next.eps`, `next.offset`): returns the pre-mixed input and its norm. The default
    /// runs the three ops ([`hc_residual_premix_norm_ops`]); a backend may fuse them, with the same
    /// values.
    fn hc_residual_premix_norm(
        &self,
        streams: &mut Self::Tensor,
        (x, y): (&Self::Tensor, &Self::Tensor),
        w: &HcWeights<Self::Weight>,
        next: HcNext<'_, Self::Weight>,
    ) -> OpResult<(Self::Tensor, Self::Tensor)> {
        hc_residual_premix_norm_ops(self, streams, (x, y), w, next)
    }

    /// QSA attention of attention layer `c.attn.layer` (spec §2). Inputs per row (token) of the step:
    /// `c.attn` as for [`Backend::attention`] and the indexer projections of [`QsaCall`].
    ///
    /// Exactly: `kI = LayerNorm(ik; indexer.k_norm, indexer.k_norm_bias, eps 1e-6)` (mean and biased
    /// variance over dI); NeoX RoPE on the first `qsa.rope.rot_dim` dims of every `iq` head and of
    /// `kI` at the token's position with `qsa.rope.inv_freq`; the index key entry
    /// `s = bf16(max|kI| / 448)` (1 when that is 0), `k8 = fp8_e4m3(kI / s)` (f32 division by the
    /// bf16-rounded s, round to nearest even, saturating at ±448) is written with the token's K/V into
    /// the sequence's blocks. Then for each query row at position t: `w_h = iw_h · nI^-0.5 · dI^-0.5`,
    /// score `I[t,s] = Σ_h w_h · ReLU(qI_h · k̂_s)` with `k̂ = k8·s` for every s ≤ t; the selected set
    /// S_t is the `min(qsa.topk, t+1)` positions of largest score, ties going to the larger position;
    /// the output is the gated attention of [`Backend::attention`] with keys/values restricted to S_t
    /// (softmax over S_t only), `[rows, num_heads·head_dim]`. Only the selected K/V rows are read.
    /// Explicit MRoPE positions (`c.attn.mrope`) are refused: the indexer's keys have no
    /// multimodal positions.
    fn qsa_attention(&self, c: &QsaCall<'_, Self::Tensor, Self::Weight>) -> OpResult<Self::Tensor>;

    /// A QSA mixer whose every sequence's context (the new positions included) is within
    /// `c.qsa.topk`, run whole where the backend has its own way (one launch on a GPU): every
    /// position is selected, so QSA is the dense gated attention (spec §2); the index keys of the
    /// new positions are written as [`Backend::qsa_attention`] writes them, and the result is the
    /// mixer's output after `o_proj`, `[rows, hidden]`. `None`: the backend does not take the call
    /// (nothing was run; the caller runs the mixer's ops). Default: `None`.
    fn qsa_mixer_within_topk(
        &self,
        _c: &QsaMixerCall<'_, Self::Tensor, Self::Weight>,
    ) -> OpResult<Option<Self::Tensor>> {
        Ok(None)
    }

    /// The PLE mix of layer `c.layer` (spec §3.7), in place on the residual streams `[rows, S·H]`
    /// (S = `shape.streams`; S = 1 is the plain residual). `c.rows` `[rows, E]` are the tokens' table
    /// rows. Exactly, per token: `v = value·e + value_bias`; for each stream c:
    /// `key_c = rmsnorm(key[c]·e + key_bias[c]; key_norm[c])`, `q_c = rmsnorm(R_c; query_norm[c])`,
    /// `σ = ⟨key_c, q_c⟩ / sqrt(H)`, `σ = sign(σ)·sqrt(max(|σ|, 1e-6))`, `u_c = sigmoid(σ)·v`,
    /// `z_c = rmsnorm(u_c; conv_norm[c])` (every rmsnorm plain-weight, eps 1e-6, over H);
    /// `y = silu(conv(z))` with the depthwise causal dilated conv over the S·H channels
    /// (`y[t,ch] = Σ_j conv[ch, j] · z[t − (kernel−1−j)·dilation, ch]`, in order of j), whose past
    /// inputs come from the sequence's state slot (`(kernel−1)·dilation` rows of z, zeros for a new
    /// sequence) and are updated; then `R_c += u_c + y_c`.
    fn ple_mix(
        &self,
        streams: &mut Self::Tensor,
        c: &PleCall<'_, Self::Tensor, Self::Weight>,
    ) -> OpResult<()>;
}
