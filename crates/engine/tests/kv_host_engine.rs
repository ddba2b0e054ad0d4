//! The QSA K/V host pool's counters through the engine: a QSA model with its K/V rows pinned in host
//! memory publishes the row cache's hits and misses per QSA layer and the bytes read from host
//! memory in its metrics snapshot, one stage or two (the stages' counters merged); the tokens are
//! those of the model with its rows on the heap, whose snapshot has no counters.

use std::path::{Path, PathBuf};

use sanmai_config::ModelConfig;
use sanmai_cpu::CpuBackend;
use sanmai_engine::api::{EngineEvent, EngineRequest, KvHostStats, StopParams};
use sanmai_engine::sampler::SamplingParams;
use sanmai_engine::{start, EngineConfig, Executor, ModelExecutor, PipelineExecutor};
use sanmai_model::{KvHost, Model};
use sanmai_ple::PrefetchOptions;
use sanmai_weights::Checkpoint;

/// Rows of each stage's row cache (what `sanmai serve` passes by default).
const CACHE_ROWS: usize = 48_576;
/// The K/V budget with the rows on the heap.
const HEAP_BUDGET: usize = 1 << 22;
/// The budget with the rows pinned (a block costs the device its index keys only): about 130
/// blocks, 2 MiB of pinned rows, well under a default memlock limit.
const OFFLOAD_BUDGET: usize = 150_000;

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen4_exp_qsa_tiny")
}

/// The fixture's layers `stage` (the whole model: `0..4`), with its QSA K/V rows pinned when
/// `offload`.
fn load(stage: std::ops::Range<usize>, offload: bool) -> Model<CpuBackend> {
    let cfg = ModelConfig::from_file(&dir().join("config.json")).unwrap();
    let ckpt = Checkpoint::open(&dir()).unwrap();
    let mut m = Model::load_stage(cfg, &ckpt, CpuBackend::new(), None, stage).unwrap();
    m.kv_host = offload.then(|| KvHost {
        what: "the test's QSA K/V pool".into(),
        reserve: 0,
        lock_path: std::env::temp_dir().join("sanmai-engine-test-pin.lock"),
        row_cache_rows: CACHE_ROWS,
        row_cache: true,
    });
    m
}

/// Runs two greedy requests of 12 tokens each on `exec` under a K/V budget of `budget` bytes;
/// returns their tokens and the counters of the metrics snapshot.
fn run(exec: impl Executor + 'static, budget: usize) -> (Vec<Vec<u32>>, Option<KvHostStats>) {
    let engine = start(
        exec,
        None,
        EngineConfig {
            model_name: "qsa".into(),
            max_num_seqs: 4,
            max_num_batched_tokens: 16,
            max_model_len: 128,
            max_waiting: 16,
            default_max_tokens: Some(12),
            valid_vocab: 1024,
            eos_ids: Vec::new(),
            block_size: 16,
            kv_cache_memory_bytes: budget,
            enable_prefix_caching: true,
            state_checkpoint_interval: Some(64),
            num_speculative_tokens: 0,
        },
    )
    .unwrap();
    let prompts: Vec<Vec<u32>> = [20usize, 45]
        .iter()
        .map(|&n| (0..n as u32).map(|i| (i * 37 + n as u32) % 1000).collect())
        .collect();
    let streams: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            engine
                .submit(EngineRequest {
                    id: format!("qsa-{i}"),
                    prompt: p.clone(),
                    sampling: SamplingParams {
                        temperature: 0.0,
                        ..SamplingParams::default()
                    }
                    .validated(1024)
                    .unwrap(),
                    stop: StopParams {
                        ignore_eos: true,
                        ..Default::default()
                    },
                    prompt_logprobs: false,
                    cache_salt: Vec::new(),
                    checkpoint_at: Vec::new(),
                    images: None,
                })
                .unwrap()
        })
        .collect();
    let tokens = streams
        .into_iter()
        .map(|mut s| {
            let mut ids = Vec::new();
            while let Some(ev) = s.blocking_recv() {
                if let EngineEvent::Tokens { ids: new, .. } = ev {
                    ids.extend(new);
                }
            }
            ids
        })
        .collect();
    let stats = engine.metrics().kv_host;
    engine.shutdown();
    (tokens, stats)
}

#[test]
fn offloaded_qsa_rows_report_row_cache_counters_one_stage_or_two() {
    let (want, none) = run(ModelExecutor::new(load(0..4, false)), HEAP_BUDGET);
    assert_eq!(none, None, "rows on the heap have no host counters");
    assert!(want.iter().all(|t| t.len() == 12));

    let (got, one) = run(ModelExecutor::new(load(0..4, true)), OFFLOAD_BUDGET);
    assert_eq!(got, want, "offloaded rows give the same tokens");
    let one = one.expect("offloaded rows report their counters");
    // The attention layer 3 and the MTP layer (which these steps do not run).
    let layers: Vec<usize> = one.layers.iter().map(|l| l.layer).collect();
    assert_eq!(layers, [3, 4]);
    let l3 = one.layers[0];
    assert!(l3.hits > 0 && l3.misses > 0, "{one:?}");
    assert_eq!((one.layers[1].hits, one.layers[1].misses), (0, 0));
    assert!(one.host_bytes_read >= l3.misses * 2 * 64 * 4, "{one:?}");

    // Two stages: the first has no attention layer; the counters are the second's. (With a step
    // in flight per stage, the requests decode in separate steps: other counts than one stage's.)
    let stages = vec![load(0..2, true), load(2..4, true)];
    let pipe = PipelineExecutor::new(stages, PrefetchOptions::default(), Default::default());
    let (got, two) = run(pipe.unwrap(), OFFLOAD_BUDGET);
    assert_eq!(got, want, "two stages give the same tokens");
    let two = two.expect("offloaded stages report their counters");
    let layers: Vec<usize> = two.layers.iter().map(|l| l.layer).collect();
    assert_eq!(layers, [3, 4]);
    assert!(two.layers[0].hits > 0 && two.host_bytes_read > 0, "{two:?}");
}
