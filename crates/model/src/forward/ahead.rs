//! What the call after each sublayer call reads first, named to [`Backend::read_ahead`] before the
//! call: the next mixer's input projections after a MoE call, the layer's router and shared expert
//! (or dense MLP) after a mixer call.

use crate::backend::Backend;
use crate::load::{Ffn, Layer, Mixer};

/// The input projections a layer's mixer reads first.
fn mixer_first<W>(l: &Layer<W>) -> Vec<&W> {
    match &l.mixer {
        Mixer::Gdn(w) => vec![&w.in_proj_b, &w.in_proj_a, &w.in_proj_qkv],
        Mixer::Attention(w) | Mixer::Qsa(w, _) => vec![&w.k_proj, &w.v_proj, &w.q_proj],
    }
}

/// What a layer's FFN reads first: a MoE layer's router and shared expert, a dense MLP's gate|up.
fn ffn_first<W>(l: &Layer<W>) -> Vec<&W> {
    match &l.ffn {
        Ffn::Dense(m) => vec![&m.gate_up],
        Ffn::Moe(m) => {
            let mut ws = vec![&m.router];
            if let Some(s) = &m.shared {
                ws.extend([&s.gate_up, &s.down]);
            }
            ws
        }
    }
}

/// Before a call whose successor is layer `next`'s mixer (none: nothing follows in this pass).
pub(super) fn before_mixer_of<B: Backend>(b: &B, next: Option<&Layer<B::Weight>>) {
    b.read_ahead(&next.map(mixer_first).unwrap_or_default());
}

/// Before layer `l`'s mixer call (its successor: the layer's FFN).
pub(super) fn before_ffn_of<B: Backend>(b: &B, l: &Layer<B::Weight>) {
    b.read_ahead(&ffn_first(l));
}
