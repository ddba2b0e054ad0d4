//! Loading the qwen4_exp extension weights: QSA's indexer (`self_attn.indexer.`), the PLE mix
//! (`ple.`) and the hyper-connections (`hc_attn.`, `hc_ffn.`). Names are documented in
//! `docs/qwen4_exp.md`.

use sanmai_config::QsaConfig;
use sanmai_weights::names::Scope;
use sanmai_weights::{Init, Result};

use super::Loader;
use crate::backend::{Backend, HcWeights, IndexerWeights, PleWeights};

impl<B: Backend> Loader<'_, B> {
    pub(crate) fn indexer(&self, s: &Scope, q: &QsaConfig) -> Result<IndexerWeights<B::Weight>> {
        let h = self.cfg.hidden_size;
        let (ni, di) = (q.index_n_heads, q.index_head_dim);
        Ok(IndexerWeights {
            wq: self.proj(s, "self_attn.indexer.wq.weight", ni * di, h)?,
            wk: self.proj(s, "self_attn.indexer.wk.weight", di, h)?,
            k_norm: self.get(s, "self_attn.indexer.k_norm.weight", &[di], Init::ONES)?,
            k_norm_bias: self.get(s, "self_attn.indexer.k_norm.bias", &[di], Init::ZEROS)?,
            weights_proj: self.proj(s, "self_attn.indexer.weights_proj.weight", ni, h)?,
        })
    }

    pub(crate) fn ple(&self, s: &Scope) -> Result<PleWeights<B::Weight>> {
        let h = self.cfg.hidden_size;
        let p = self.cfg.ple.as_ref().expect("ple weights need a ple block");
        let e = p.num_tables() * p.row_dim;
        let streams = self
            .cfg
            .hyper_connections
            .as_ref()
            .map_or(1, |hc| hc.num_streams);
        let per_stream = |name: &str, shape: &[usize], init: Init| {
            (0..streams)
                .map(|c| self.get(s, &format!("ple.{name}.{c}.weight"), shape, init))
                .collect::<Result<Vec<_>>>()
        };
        let key_bias = (0..streams)
            .map(|c| self.get(s, &format!("ple.key.{c}.bias"), &[h], Init::ZEROS))
            .collect::<Result<Vec<_>>>()?;
        let kernel = p.conv_kernel;
        let conv = s.get(
            "ple.conv.weight",
            &[streams * h, 1, kernel],
            Init::std((kernel as f32).powf(-0.5)),
        )?;
        Ok(PleWeights {
            value: self.proj(s, "ple.value.weight", h, e)?,
            value_bias: self.get(s, "ple.value.bias", &[h], Init::ZEROS)?,
            key: per_stream("key", &[h, e], Init::std((e as f32).powf(-0.5)))?,
            key_bias,
            key_norm: per_stream("key_norm", &[h], Init::ONES)?,
            query_norm: per_stream("query_norm", &[h], Init::ONES)?,
            conv_norm: per_stream("conv_norm", &[h], Init::ONES)?,
            conv: self.w(conv, &[streams * h, kernel])?,
        })
    }

    pub(crate) fn hc(
        &self,
        s: &Scope,
        prefix: &str,
        streams: usize,
        rank: usize,
    ) -> Result<HcWeights<B::Weight>> {
        let h = self.cfg.hidden_size;
        Ok(HcWeights {
            pre: self.get(s, &format!("{prefix}pre"), &[streams], Init::ZEROS)?,
            down: self.proj(s, &format!("{prefix}down.weight"), rank, h)?,
            inject: self.proj(s, &format!("{prefix}inject.weight"), rank, h)?,
            up: self.proj(s, &format!("{prefix}up.weight"), streams * h, rank)?,
        })
    }
}
