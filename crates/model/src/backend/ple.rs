//! The PLE mix (spec §3.7): its shapes and weights, and the arguments of
//! [`Backend::ple_mix`](super::Backend::ple_mix).

use super::SeqChunk;

/// Static shapes of a PLE mix.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PleShape {
    /// Residual streams S (1 without hyper-connections).
    pub streams: usize,
    /// Hidden size H.
    pub hidden: usize,
    /// Width E of a token's gathered rows (`len(orders)·heads·row_dim`).
    pub row_width: usize,
    pub conv_kernel: usize,
    pub conv_dilation: usize,
}

impl PleShape {
    /// Past positions of the conv's normed input kept per sequence.
    pub fn state_rows(&self) -> usize {
        (self.conv_kernel - 1) * self.conv_dilation
    }
    /// Conv channels `S·H`.
    pub fn channels(&self) -> usize {
        self.streams * self.hidden
    }
}

/// The PLE weights of one layer (`model.layers.{i}.ple.`), in backend form; the per-stream lists have
/// S entries.
pub struct PleWeights<W> {
    /// `[H, E]`.
    pub value: W,
    /// `[H]`.
    pub value_bias: W,
    /// `[H, E]` each.
    pub key: Vec<W>,
    /// `[H]` each.
    pub key_bias: Vec<W>,
    pub key_norm: Vec<W>,
    pub query_norm: Vec<W>,
    pub conv_norm: Vec<W>,
    /// `[S·H, kernel]` (`conv.weight [S·H, 1, kernel]` squeezed).
    pub conv: W,
}

/// One PLE mix call of layer `layer`: the tokens' table rows `rows` `[rows, E]`, the layer's weights
/// and the step's chunks (the conv's past inputs live in their state slots).
pub struct PleCall<'a, T, W> {
    pub layer: usize,
    pub shape: &'a PleShape,
    pub rows: &'a T,
    pub w: &'a PleWeights<W>,
    pub seqs: &'a [SeqChunk<'a>],
}
