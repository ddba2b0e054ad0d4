//! A qwen4_exp model with a PLE table through the engine: two requests with chunked prefill give the
//! reference's greedy tokens, the prefetch thread requested their prompts' windows, and the table's
//! read counters reach the metrics snapshot.

use std::path::Path;

use sanmai_config::ModelConfig;
use sanmai_cpu::CpuBackend;
use sanmai_engine::api::{EngineEvent, EngineRequest, StopParams};
use sanmai_engine::sampler::SamplingParams;
use sanmai_engine::{start, EngineConfig, ModelExecutor};
use sanmai_model::{Model, PleSource};
use sanmai_ple::PrefetchOptions;
use sanmai_weights::Checkpoint;
use serde_json::Value;

#[test]
fn a_ple_model_generates_the_reference_and_reports_its_table_reads() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen4_exp_all_tiny");
    let cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let ple = PleSource::open(&dir, cfg.ple.as_ref().unwrap(), false).unwrap();
    let ckpt = Checkpoint::open(&dir).unwrap();
    let vocab = cfg.vocab_size;
    let model = Model::load_with_ple(cfg, &ckpt, CpuBackend::new(), Some(ple)).unwrap();
    let exec = ModelExecutor::with_prefetch(
        model,
        PrefetchOptions {
            enabled: true,
            ..PrefetchOptions::default()
        },
    );
    let engine = start(
        exec,
        None,
        EngineConfig {
            model_name: "ple".into(),
            max_num_seqs: 4,
            max_num_batched_tokens: 24,
            max_model_len: 512,
            max_waiting: 16,
            default_max_tokens: Some(8),
            valid_vocab: vocab,
            eos_ids: Vec::new(),
            block_size: 16,
            kv_cache_memory_bytes: 1 << 24,
            enable_prefix_caching: true,
            state_checkpoint_interval: Some(64),
            num_speculative_tokens: 0,
        },
    )
    .unwrap();
    let reference: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("reference.json")).unwrap())
            .unwrap();
    let cases: Vec<(Vec<u32>, Vec<u32>)> = [1, 2]
        .iter()
        .map(|&i| {
            let c = &reference["prompts"][i];
            let ids = |k: &str| -> Vec<u32> {
                c[k].as_array()
                    .unwrap()
                    .iter()
                    .map(|v| v.as_u64().unwrap() as u32)
                    .collect()
            };
            (ids("ids"), ids("greedy_ids"))
        })
        .collect();
    let streams: Vec<_> = cases
        .iter()
        .enumerate()
        .map(|(i, (prompt, greedy))| {
            engine
                .submit(EngineRequest {
                    id: format!("ple-{i}"),
                    prompt: prompt.clone(),
                    sampling: SamplingParams {
                        temperature: 0.0,
                        ..SamplingParams::default()
                    }
                    .validated(engine.info().valid_vocab)
                    .unwrap(),
                    stop: StopParams {
                        max_tokens: Some(greedy.len()),
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
    for (mut s, (prompt, greedy)) in streams.into_iter().zip(&cases) {
        let mut ids = Vec::new();
        while let Some(ev) = s.blocking_recv() {
            if let EngineEvent::Tokens { ids: new, .. } = ev {
                ids.extend(new);
            }
        }
        assert_eq!(&ids, greedy, "prompt of {} tokens", prompt.len());
    }
    let m = engine
        .metrics()
        .ple
        .expect("a PLE model reports its table reads");
    // Every prompt position's rows were gathered (the snapshot is published between steps, so the
    // last decode step's rows may not be counted yet).
    let prompts: usize = cases.iter().map(|(p, _)| p.len()).sum();
    assert!(
        m.gathered_tokens as usize > prompts,
        "{} tokens gathered for {prompts} prompt tokens and the decodes",
        m.gathered_tokens
    );
    assert!(m.windows_done >= 2, "each prompt's window was prefetched");
    assert!(m.pages_requested > 0);
    engine.shutdown();
}
