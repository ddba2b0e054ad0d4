//! qwen4_exp with random ("dummy") weights: the tiny config with every block on runs prefill and
//! decode with zero PLE rows or with a table made at scaled sizes (`--rows-scale`), whose sidecar
//! sizes the hash then uses; real weights refuse such a table, and a PLE model refuses to load
//! without a row source.

use std::path::{Path, PathBuf};

use sanmai_config::ModelConfig;
use sanmai_cpu::CpuBackend;
use sanmai_model::{Backend, Model, OutRows, PleSource};
use sanmai_ple::{create_table, CreateOptions, Fill, PleTable};
use sanmai_weights::Dummy;

mod step_util;
use step_util::{logits, Seq};

fn tiny() -> ModelConfig {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../../configs/models/qwen4-exp-tiny.json");
    ModelConfig::from_file(&path).unwrap()
}

struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        let p = std::env::temp_dir().join(format!("sanmai-qwen4-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        TempDir(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Prefill of `prompt` then 4 greedy decode steps; returns the tokens and the last logits.
fn run(m: &Model<CpuBackend>, prompt: &[u32]) -> (Vec<u32>, Vec<f32>) {
    m.init_cache(16, 16).unwrap();
    let seq = Seq::new(m, (0..16).collect());
    let mut tokens = prompt.to_vec();
    let mut pos0 = 0;
    let mut len = prompt.len();
    let mut last = Vec::new();
    for _ in 0..5 {
        let logits = logits(m, &[seq.chunk(&tokens, pos0, len, OutRows::Last)]);
        assert!(logits.iter().all(|x| x.is_finite()));
        let next = (0..logits.len())
            .max_by(|&a, &b| logits[a].total_cmp(&logits[b]))
            .unwrap() as u32;
        pos0 += len;
        len = 1;
        tokens.push(next);
        last = logits;
    }
    m.backend.free_state(seq.state);
    (tokens, last)
}

#[test]
fn a_ple_model_needs_a_row_source() {
    let err = Model::load(tiny(), &Dummy::new(1), CpuBackend::new())
        .err()
        .expect("refused")
        .to_string();
    assert!(err.contains("ple"), "{err}");
}

#[test]
fn dummy_weights_run_with_zero_rows_and_with_a_scaled_table() {
    let cfg = tiny();
    let ple = cfg.ple.clone().unwrap();
    let prompt: Vec<u32> = (0..40).map(|i| (i * 37 % 1000) as u32).collect();

    let zeros = Model::load_with_ple(
        cfg.clone(),
        &Dummy::new(1),
        CpuBackend::new(),
        Some(PleSource::Zeros),
    )
    .unwrap();
    assert_eq!(zeros.ple_layers(), ple.layer_ids);
    let (_, zero_logits) = run(&zeros, &prompt);

    let dir = TempDir::new("scaled");
    let opts = CreateOptions {
        rows_scale: 0.5,
        fill: Fill::Random,
        progress: false,
    };
    let side = create_table(&ple, &dir.0, opts).unwrap();
    assert_ne!(side.sizes, ple.table_sizes);
    // Real weights refuse a table whose sizes are not the config's.
    let err = PleSource::open(&dir.0, &ple, false)
        .err()
        .expect("refused")
        .to_string();
    assert!(err.contains("table"), "{err}");
    // Dummy weights take the sidecar's sizes: the rows are those the table's own hash finds.
    let source = PleSource::open(&dir.0, &ple, true).unwrap();
    let table = PleTable::open_sidecar(&dir.0, ple.eos_token_id).unwrap();
    let width = table.token_dim();
    let mut got = vec![0f32; prompt.len() * width];
    source
        .gather(&prompt, 0..prompt.len(), width, &mut got)
        .unwrap();
    let mut want = vec![half::bf16::ZERO; prompt.len() * width];
    table.gather(&prompt, 0..prompt.len(), &mut want).unwrap();
    assert!(got.iter().zip(&want).all(|(a, b)| *a == b.to_f32()));
    assert!(got.iter().any(|&x| x != 0.0));

    let with_table =
        Model::load_with_ple(cfg.clone(), &Dummy::new(1), CpuBackend::new(), Some(source)).unwrap();
    let (_, table_logits) = run(&with_table, &prompt);
    assert_ne!(
        zero_logits, table_logits,
        "the table's rows reach the logits"
    );

    // A table of another shape is refused even for dummy weights.
    let mut other = ple.clone();
    other.row_dim += 1;
    let dir2 = TempDir::new("shape");
    create_table(
        &other,
        &dir2.0,
        CreateOptions {
            rows_scale: 0.5,
            ..opts
        },
    )
    .unwrap();
    let err = PleSource::open(&dir2.0, &ple, true)
        .err()
        .expect("refused")
        .to_string();
    assert!(err.contains("row_dim"), "{err}");
}

#[test]
fn state_and_kv_sizes_count_the_extensions() {
    let cfg = tiny();
    let m = Model::load_with_ple(
        cfg.clone(),
        &Dummy::new(2),
        CpuBackend::new(),
        Some(PleSource::Zeros),
    )
    .unwrap();
    let a = &cfg.attention;
    let q = cfg.qsa.as_ref().unwrap();
    // Attention layers: 1 main + the MTP layer; each keeps K, V and one index-key entry per token.
    assert_eq!(
        m.kv_bytes_per_token(2),
        2 * (2 * a.num_kv_heads * a.head_dim * 2 + q.index_head_dim + 2)
    );
    let g = &cfg.gdn;
    let p = cfg.ple.as_ref().unwrap();
    let hc = cfg.hyper_connections.as_ref().unwrap();
    let gdn =
        3 * ((g.conv_kernel - 1) * g.conv_dim() + g.num_v_heads * g.k_head_dim * g.v_head_dim);
    let ple = p.layer_ids.len()
        * (p.conv_kernel - 1)
        * p.conv_dilation
        * hc.num_streams
        * cfg.hidden_size;
    assert_eq!(m.state_bytes(4), (gdn + ple) * 4);
}
