//! What a loaded [`Model`] holds, by name: its embedding and final norm, its layers of each kind, and
//! the sizes of the caches its layers need (K/V per token, recurrent state), and their allocation.

use sanmai_config::LayerType;

use super::Model;
use crate::backend::{Backend, CacheSpec, OpResult};

impl<B: Backend> Model<B> {
    /// The token embedding (the first stage's, or the last's when it holds one).
    ///
    /// # Panics
    /// On a stage that holds none (see [`Model::load_stage`]).
    pub fn embedding(&self) -> &B::Weight {
        self.embed.as_ref().unwrap_or_else(|| {
            panic!(
                "the stage of layers {:?} holds no embedding table",
                self.stage
            )
        })
    }

    /// The final norm.
    ///
    /// # Panics
    /// On a stage other than the last.
    pub fn final_norm(&self) -> &B::Weight {
        self.norm.as_ref().unwrap_or_else(|| {
            panic!(
                "the stage of layers {:?} is not the last: it holds no final norm",
                self.stage
            )
        })
    }

    /// Whether this model holds the first layer (it embeds tokens).
    pub fn is_first_stage(&self) -> bool {
        self.stage.start == 0
    }

    /// Whether this model holds the last layer (final norm, lm_head, MTP head).
    pub fn is_last_stage(&self) -> bool {
        self.stage.end == self.cfg.num_layers
    }

    /// Layer indices with attention K/V caches in this model (the MTP layer is `num_layers`).
    pub fn attention_layers(&self) -> Vec<usize> {
        let mut v: Vec<usize> = self
            .stage
            .clone()
            .filter(|&i| self.cfg.layer_types[i] == LayerType::FullAttention)
            .collect();
        if self.mtp.is_some() {
            v.push(self.cfg.num_layers);
        }
        v
    }

    /// Layer indices with GDN state in this model.
    pub fn gdn_layers(&self) -> Vec<usize> {
        self.stage
            .clone()
            .filter(|&i| self.cfg.layer_types[i] == LayerType::LinearAttention)
            .collect()
    }

    /// Bytes of K/V one token takes across all attention layers, at `elem` bytes per value, plus the
    /// QSA index-key entry (`dI + 2` bytes) of each attention layer.
    pub fn kv_bytes_per_token(&self, elem: usize) -> usize {
        crate::weight_plan::stage_kv_bytes_per_token(&self.cfg, &self.stage, elem)
            - self.kv_host_bytes_per_token(elem)
    }

    /// Bytes of one token's K/V kept in pinned host memory ([`Model::kv_host`]; 0 without it).
    pub fn kv_host_bytes_per_token(&self, elem: usize) -> usize {
        match self.kv_host {
            Some(_) => {
                crate::weight_plan::stage_qsa_kv_bytes_per_token(&self.cfg, &self.stage, elem)
            }
            None => 0,
        }
    }

    /// Bytes of one sequence's state: GDN conv + recurrent state across all GDN layers and the PLE
    /// conv state of each PLE layer, at `elem` bytes per value.
    pub fn state_bytes(&self, elem: usize) -> usize {
        let g = &self.cfg.gdn;
        let per_layer =
            (g.conv_kernel - 1) * g.conv_dim() + g.num_v_heads * g.k_head_dim * g.v_head_dim;
        let ple = self.ple.as_ref().map_or(0, |(sh, _)| {
            self.ple_layers().len() * sh.state_rows() * sh.channels()
        });
        (self.gdn_layers().len() * per_layer + ple) * elem
    }

    /// Layers with a PLE mix (and a PLE conv state per state slot).
    pub fn ple_layers(&self) -> Vec<usize> {
        self.stage
            .clone()
            .zip(&self.layers)
            .filter(|(_, l)| l.ple.is_some())
            .map(|(i, _)| i)
            .collect()
    }

    /// Allocates the backend's caches for `num_blocks` blocks of `block_size` positions.
    pub fn init_cache(&self, num_blocks: usize, block_size: usize) -> OpResult<()> {
        self.backend.init_cache(&CacheSpec {
            num_blocks,
            block_size,
            attn_layers: self.attention_layers(),
            num_kv_heads: self.cfg.attention.num_kv_heads,
            head_dim: self.cfg.attention.head_dim,
            index_head_dim: self.qsa.as_ref().map_or(0, |q| q.head_dim),
            gdn_layers: self.gdn_layers(),
            gdn: self.gdn_shape,
            ple_layers: self.ple_layers(),
            ple: self.ple.as_ref().map(|(sh, _)| *sh),
            kv_host: self.kv_host.clone().filter(|_| self.qsa.is_some()),
        })
    }
}
