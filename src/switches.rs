//! The run-time switches and the CUDA kernel compiler's folders. The libraries read no environment
//! variable: this module reads each one, once, and hands the result down as options. A switch is a
//! pair of flags whose default is its environment variable, so A/B runs of one build need no
//! rebuild: the flag wins, then the variable (`0`, `off` or `false` turn the switch off, `1`, `on` or
//! `true` on), and without either the switch takes its default: on, except the FP8 tensor cores.

use clap::Args;
use sanmai_ple::PrefetchOptions;

/// PLE page prefetch (a model with a PLE table).
const PLE_PREFETCH_ENV: &str = "SANMAI_PLE_PREFETCH";
/// A pipeline stage prepares its next step before it waits for the previous stage.
const PP_DEFERRED_RECEIVE_ENV: &str = "SANMAI_PP_DEFERRED_RECEIVE";
/// CUDA graphs for decode steps.
#[cfg(feature = "cuda")]
const CUDA_GRAPHS_ENV: &str = "SANMAI_CUDA_GRAPHS";
/// Programmatic dependent launch (sm_90 and later).
#[cfg(feature = "cuda")]
const PDL_ENV: &str = "SANMAI_PDL";
/// The CUDA backend's fused decode launches (the shared expert with the routed experts).
#[cfg(feature = "cuda")]
const FUSED_DECODE_ENV: &str = "SANMAI_FUSED_DECODE";
/// A MoE layer's one-token CUDA decode step in one persistent launch.
#[cfg(feature = "cuda")]
const MOE_LAYER_ENV: &str = "SANMAI_MOE_LAYER";
/// A GDN mixer's one-token CUDA decode step in one persistent launch.
#[cfg(feature = "cuda")]
const GDN_LAYER_ENV: &str = "SANMAI_GDN_LAYER";
/// An attention mixer's one-token CUDA decode step in one persistent launch.
#[cfg(feature = "cuda")]
const ATTN_LAYER_ENV: &str = "SANMAI_ATTN_LAYER";
/// One-row packed GEMVs a warp a row, as the layer launches' row phases.
#[cfg(feature = "cuda")]
const ROW_GEMV_ENV: &str = "SANMAI_ROW_GEMV";
/// FP8 prefill GEMMs on the FP8 tensor cores.
#[cfg(feature = "cuda")]
const FP8_TENSOR_CORES_ENV: &str = "SANMAI_FP8_TENSOR_CORES";

#[derive(Args, Debug, Clone, Default)]
pub struct SwitchArgs {
    /// Prefetch an admitted prompt's PLE table pages ahead of its prefill (the default; overrides
    /// SANMAI_PLE_PREFETCH=0).
    #[arg(long, overrides_with = "no_ple_prefetch")]
    pub ple_prefetch: bool,
    /// Do not prefetch PLE table pages [default: prefetch, unless SANMAI_PLE_PREFETCH=0].
    #[arg(long, overrides_with = "ple_prefetch")]
    pub no_ple_prefetch: bool,
    /// Record CUDA decode steps of batch 1, 2, 4 and 8 as CUDA graphs (the default; overrides
    /// SANMAI_CUDA_GRAPHS=0).
    #[arg(long, overrides_with = "no_cuda_graphs")]
    pub cuda_graphs: bool,
    /// Run every CUDA decode step eagerly [default: graphs, unless SANMAI_CUDA_GRAPHS=0].
    #[arg(long, overrides_with = "cuda_graphs")]
    pub no_cuda_graphs: bool,
    /// Programmatic dependent launch of the CUDA kernels on sm_90 and later (the default; overrides
    /// SANMAI_PDL=0).
    #[arg(long, overrides_with = "no_pdl")]
    pub pdl: bool,
    /// Launch every CUDA kernel the ordinary way [default: PDL, unless SANMAI_PDL=0].
    #[arg(long, overrides_with = "pdl")]
    pub no_pdl: bool,
    /// Fused CUDA decode launches: a MoE layer's shared expert runs in its routed experts' grouped
    /// GEMVs when the two share a format (the default; overrides SANMAI_FUSED_DECODE=0).
    #[arg(long, overrides_with = "no_fused_decode")]
    pub fused_decode: bool,
    /// One launch per op in CUDA decode steps, for A/B runs [default: fused, unless
    /// SANMAI_FUSED_DECODE=0].
    #[arg(long, overrides_with = "fused_decode")]
    pub no_fused_decode: bool,
    /// A MoE layer's one-token CUDA decode step in one persistent launch, with the fused launches
    /// (the default; overrides SANMAI_MOE_LAYER=0).
    #[arg(long, overrides_with = "no_moe_layer")]
    pub moe_layer: bool,
    /// The one-token MoE step in its separate launches, for A/B runs [default: one launch, unless
    /// SANMAI_MOE_LAYER=0].
    #[arg(long, overrides_with = "moe_layer")]
    pub no_moe_layer: bool,
    /// A GDN mixer's one-token CUDA decode step (input projections, GDN step, output projection)
    /// in one persistent launch, with the fused launches (the default; overrides
    /// SANMAI_GDN_LAYER=0).
    #[arg(long, overrides_with = "no_gdn_layer")]
    pub gdn_layer: bool,
    /// The one-token GDN mixer in its separate launches, for A/B runs [default: one launch, unless
    /// SANMAI_GDN_LAYER=0].
    #[arg(long, overrides_with = "gdn_layer")]
    pub no_gdn_layer: bool,
    /// An attention mixer's one-token CUDA decode step (projections, head norms and RoPE, K/V
    /// write, attention, o_proj) in one persistent launch, with the fused launches (the default;
    /// overrides SANMAI_ATTN_LAYER=0).
    #[arg(long, overrides_with = "no_attn_layer")]
    pub attn_layer: bool,
    /// The one-token attention mixer in its separate launches, for A/B runs [default: one launch,
    /// unless SANMAI_ATTN_LAYER=0].
    #[arg(long, overrides_with = "attn_layer")]
    pub no_attn_layer: bool,
    /// One-row INT8 CUDA GEMVs (1024 to 6144 inputs) a warp a row with several rows' loads in
    /// flight, as the layer launches' row phases (the default; overrides SANMAI_ROW_GEMV=0).
    #[arg(long, overrides_with = "no_row_gemv")]
    pub row_gemv: bool,
    /// One-row packed GEMVs on the 32-value unit kernel, for A/B runs [default: a warp a row,
    /// unless SANMAI_ROW_GEMV=0].
    #[arg(long, overrides_with = "row_gemv")]
    pub no_row_gemv: bool,
    /// FP8 prefill GEMMs on the FP8 tensor cores where the GPU has them, the activations quantised
    /// per token and 128 columns, for A/B runs (overrides SANMAI_FP8_TENSOR_CORES=0).
    #[arg(long, overrides_with = "no_fp8_tensor_cores")]
    pub fp8_tensor_cores: bool,
    /// FP8 prefill GEMMs on weights decoded to bf16 tiles, faster on an H100 and without the
    /// activations' e4m3 rounding [default: bf16 tiles, unless SANMAI_FP8_TENSOR_CORES=1].
    #[arg(long, overrides_with = "fp8_tensor_cores")]
    pub no_fp8_tensor_cores: bool,
    /// A pipeline stage prepares its next step (layout, PLE rows, device metadata) before it waits
    /// for the previous stage's streams (the default; overrides SANMAI_PP_DEFERRED_RECEIVE=0).
    #[arg(long, overrides_with = "no_pp_deferred_receive")]
    pub pp_deferred_receive: bool,
    /// A pipeline stage waits for the previous stage's streams, then prepares its step [default:
    /// deferred receive, unless SANMAI_PP_DEFERRED_RECEIVE=0].
    #[arg(long, overrides_with = "pp_deferred_receive")]
    pub no_pp_deferred_receive: bool,
}

/// What an environment variable says about a switch: `Some(false)` for `0`, `off` or `false`,
/// `Some(true)` for `1`, `on` or `true` (any case), `None` when unset or anything else.
fn env_switch(var: &str) -> Option<bool> {
    parse_switch(&std::env::var(var).ok()?)
}

fn parse_switch(value: &str) -> Option<bool> {
    match value.trim().to_ascii_lowercase().as_str() {
        "0" | "off" | "false" => Some(false),
        "1" | "on" | "true" => Some(true),
        _ => None,
    }
}

/// A switch: the flag given last wins, else the variable, else on.
fn switch(on: bool, off: bool, var: &str) -> bool {
    resolve(on, off, || env_switch(var), true)
}

/// A switch that is off unless a flag or the variable turns it on.
#[cfg(feature = "cuda")]
fn switch_default_off(on: bool, off: bool, var: &str) -> bool {
    resolve(on, off, || env_switch(var), false)
}

fn resolve(on: bool, off: bool, env: impl FnOnce() -> Option<bool>, default: bool) -> bool {
    match (on, off) {
        (true, _) => true,
        (_, true) => false,
        _ => env().unwrap_or(default),
    }
}

impl SwitchArgs {
    /// How the PLE table's pages are prefetched.
    pub fn ple_prefetch(&self) -> PrefetchOptions {
        PrefetchOptions {
            enabled: switch(self.ple_prefetch, self.no_ple_prefetch, PLE_PREFETCH_ENV),
            ..PrefetchOptions::default()
        }
    }

    /// Whether pipeline stages prepare a step before receiving its input.
    pub fn pp_deferred_receive(&self) -> bool {
        switch(
            self.pp_deferred_receive,
            self.no_pp_deferred_receive,
            PP_DEFERRED_RECEIVE_ENV,
        )
    }

    /// The CUDA flags given on the command line, for a warning when the model runs on the CPU.
    pub fn cuda_flags(&self) -> Vec<&'static str> {
        [
            (self.cuda_graphs, "--cuda-graphs"),
            (self.no_cuda_graphs, "--no-cuda-graphs"),
            (self.pdl, "--pdl"),
            (self.no_pdl, "--no-pdl"),
            (self.fused_decode, "--fused-decode"),
            (self.no_fused_decode, "--no-fused-decode"),
            (self.moe_layer, "--moe-layer"),
            (self.no_moe_layer, "--no-moe-layer"),
            (self.gdn_layer, "--gdn-layer"),
            (self.no_gdn_layer, "--no-gdn-layer"),
            (self.attn_layer, "--attn-layer"),
            (self.no_attn_layer, "--no-attn-layer"),
            (self.row_gemv, "--row-gemv"),
            (self.no_row_gemv, "--no-row-gemv"),
            (self.fp8_tensor_cores, "--fp8-tensor-cores"),
            (self.no_fp8_tensor_cores, "--no-fp8-tensor-cores"),
        ]
        .into_iter()
        .filter_map(|(given, name)| given.then_some(name))
        .collect()
    }

    /// How the CUDA backend opens: the switches, the kernel cache and the CUDA header folders.
    #[cfg(feature = "cuda")]
    pub fn cuda_options(&self) -> sanmai_cuda::CudaOptions {
        sanmai_cuda::CudaOptions {
            gpu: sanmai_cuda::GpuOptions {
                pdl: switch(self.pdl, self.no_pdl, PDL_ENV),
                fp8_tensor_cores: switch_default_off(
                    self.fp8_tensor_cores,
                    self.no_fp8_tensor_cores,
                    FP8_TENSOR_CORES_ENV,
                ),
                row_gemv: switch(self.row_gemv, self.no_row_gemv, ROW_GEMV_ENV),
                compile: cuda::compile_options(),
            },
            cuda_graphs: switch(self.cuda_graphs, self.no_cuda_graphs, CUDA_GRAPHS_ENV),
            fused_decode: switch(self.fused_decode, self.no_fused_decode, FUSED_DECODE_ENV),
            moe_layer: switch(self.moe_layer, self.no_moe_layer, MOE_LAYER_ENV),
            gdn_layer: switch(self.gdn_layer, self.no_gdn_layer, GDN_LAYER_ENV),
            attn_layer: switch(self.attn_layer, self.no_attn_layer, ATTN_LAYER_ENV),
        }
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use sanmai_cuda::registry::CompileOptions;

    /// The kernel cache and the CUDA header folders the environment names
    /// ([`CompileOptions::from_vars`]).
    pub fn compile_options() -> CompileOptions {
        CompileOptions::from_vars(|v| std::env::var_os(v))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_flag_wins_then_the_variable_then_the_default() {
        for default in [true, false] {
            assert_eq!(resolve(false, false, || None, default), default);
            assert!(!resolve(false, false, || Some(false), default));
            assert!(resolve(false, false, || Some(true), default));
            assert!(resolve(true, false, || Some(false), default));
            assert!(!resolve(false, true, || Some(true), default));
        }
    }

    /// The only test of this binary that touches `SANMAI_PLE_PREFETCH`.
    #[test]
    fn the_ple_prefetch_variable_is_the_flags_default() {
        let none = SwitchArgs::default();
        let on = SwitchArgs {
            ple_prefetch: true,
            ..SwitchArgs::default()
        };
        let off = SwitchArgs {
            no_ple_prefetch: true,
            ..SwitchArgs::default()
        };
        std::env::remove_var(PLE_PREFETCH_ENV);
        assert!(none.ple_prefetch().enabled);
        assert!(!off.ple_prefetch().enabled);
        std::env::set_var(PLE_PREFETCH_ENV, "0");
        assert!(!none.ple_prefetch().enabled);
        assert!(on.ple_prefetch().enabled);
        std::env::set_var(PLE_PREFETCH_ENV, "1");
        assert!(none.ple_prefetch().enabled);
        assert!(!off.ple_prefetch().enabled);
        std::env::remove_var(PLE_PREFETCH_ENV);
    }

    #[test]
    fn variable_values() {
        for off in ["0", "off", "OFF", " false "] {
            assert_eq!(parse_switch(off), Some(false), "{off:?}");
        }
        for on in ["1", "on", "True"] {
            assert_eq!(parse_switch(on), Some(true), "{on:?}");
        }
        assert_eq!(parse_switch(""), None);
        assert_eq!(parse_switch("maybe"), None);
    }
}
