//! Speculative decoding with the MTP head, through the engine on the CPU: the tokens are those of
//! the same requests without drafts (greedy, and seeded sampling with penalties), with concurrent
//! requests, chunked prefill, prefix-cache hits, preemption, two pipeline stages and a QSA model;
//! with the
//! head's own drafts (random weights: almost all rejected) and with drafts forced to the known
//! output (all accepted, or spoiled at chosen positions so that verify steps reject in the middle).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use sanmai_config::ModelConfig;
use sanmai_cpu::CpuBackend;
use sanmai_engine::api::{
    EngineEvent, EngineRequest, FinishReason, MetricsSnapshot, OutputConstraint, StopParams, Usage,
};
use sanmai_engine::forced_drafts::{ForcedDrafts, Spoil};
use sanmai_engine::sampler::SamplingParams;
use sanmai_engine::{start, EngineConfig, Executor, ModelExecutor, PipelineExecutor};
use sanmai_model::{builtin, Backend, Model};
use sanmai_ple::PrefetchOptions;
use sanmai_structured::{Constraint, GrammarCompiler};
use sanmai_tokenizer::Tokenizer;
use sanmai_weights::{Checkpoint, Dummy};
use serde_json::json;

const VOCAB: usize = 1024;

fn dir(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures")
        .join(name)
}

fn load(name: &str, stage: std::ops::Range<usize>) -> Model<CpuBackend> {
    let cfg = ModelConfig::from_file(&dir(name).join("config.json")).unwrap();
    let ckpt = Checkpoint::open(&dir(name)).unwrap();
    Model::load_stage(cfg, &ckpt, CpuBackend::new(), None, stage).unwrap()
}

fn one_stage(name: &str) -> ModelExecutor<CpuBackend> {
    ModelExecutor::new(load(name, 0..4))
}

fn config(k: usize) -> EngineConfig {
    EngineConfig {
        model_name: "mtp".into(),
        max_num_seqs: 4,
        // Prompts of up to 70 tokens are prefilled in chunks.
        max_num_batched_tokens: 24,
        max_model_len: 256,
        max_waiting: 64,
        default_max_tokens: Some(40),
        valid_vocab: VOCAB,
        eos_ids: Vec::new(),
        block_size: 16,
        kv_cache_memory_bytes: 1 << 24,
        enable_prefix_caching: true,
        state_checkpoint_interval: Some(32),
        num_speculative_tokens: k,
    }
}

fn prompt(n: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i * 131 + salt * 17 + 5) % VOCAB as u32)
        .collect()
}

fn request(
    id: &str,
    prompt: Vec<u32>,
    sampling: SamplingParams,
    stop: StopParams,
) -> EngineRequest {
    EngineRequest {
        id: id.into(),
        prompt,
        sampling: sampling.validated(VOCAB).unwrap(),
        stop,
        prompt_logprobs: false,
        cache_salt: Vec::new(),
        checkpoint_at: Vec::new(),
        images: None,
    }
}

fn greedy() -> SamplingParams {
    SamplingParams::greedy()
}

fn tokens(max: usize) -> StopParams {
    StopParams {
        max_tokens: Some(max),
        ignore_eos: true,
        ..Default::default()
    }
}

/// One request's output: its tokens, their log-probabilities and its usage.
#[derive(Debug, Clone, PartialEq)]
struct Output {
    ids: Vec<u32>,
    logprobs: Vec<f32>,
    usage: Option<Usage>,
}

/// Runs `reqs` in waves (each wave's requests at once, the next wave after it finished) on `exec`
/// under `cfg`; returns every request's output and the final metrics.
fn run(
    exec: impl Executor + 'static,
    cfg: EngineConfig,
    waves: &[Vec<EngineRequest>],
) -> (Vec<Output>, MetricsSnapshot) {
    let engine = start(exec, None, cfg).unwrap();
    let mut outs = Vec::new();
    for wave in waves {
        let streams: Vec<_> = wave
            .iter()
            .map(|r| engine.submit(r.clone()).unwrap())
            .collect();
        for mut s in streams {
            let mut o = Output {
                ids: Vec::new(),
                logprobs: Vec::new(),
                usage: None,
            };
            while let Some(ev) = s.blocking_recv() {
                match ev {
                    EngineEvent::Tokens { ids, logprobs, .. } => {
                        o.ids.extend(ids);
                        o.logprobs.extend(logprobs.iter().map(|l| l.logprob));
                    }
                    EngineEvent::Finished { usage, .. } => o.usage = Some(usage),
                    EngineEvent::PromptLogprobs(_) => {}
                }
            }
            outs.push(o);
        }
    }
    let m = engine.metrics();
    engine.shutdown();
    (outs, m)
}

/// Four requests at once (prompts of 9 to 70 tokens, chunked), then the same four again (their
/// prompts now cached), with `sampling`.
fn workload(sampling: &SamplingParams, stop: &StopParams) -> Vec<Vec<EngineRequest>> {
    let wave = |w: usize| {
        [9usize, 33, 70, 16]
            .iter()
            .enumerate()
            .map(|(i, &n)| {
                let mut s = sampling.clone();
                s.seed = s.seed.map(|x| x + i as u64);
                request(&format!("r{w}-{i}"), prompt(n, i as u32), s, stop.clone())
            })
            .collect::<Vec<_>>()
    };
    vec![wave(0), wave(1)]
}

/// Each request's prompt and expected output, by request key, for [`ForcedDrafts`].
fn known(waves: &[Vec<EngineRequest>], outs: &[Output]) -> HashMap<u64, Vec<u32>> {
    waves
        .iter()
        .flatten()
        .zip(outs)
        .map(|(r, o)| {
            let mut t = r.prompt.clone();
            t.extend(&o.ids);
            (r.key(), t)
        })
        .collect()
}

/// The same tokens, log-probabilities and token counts (cached tokens may differ where requests
/// were preempted).
fn assert_same(got: &[Output], want: &[Output], what: &str) {
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert_eq!(g.ids, w.ids, "{what}: request {i}'s tokens");
        let counts = |o: &Output| o.usage.map(|u| (u.prompt_tokens, u.completion_tokens));
        assert_eq!(counts(g), counts(w), "{what}: request {i}'s usage");
        for (a, b) in g.logprobs.iter().zip(&w.logprobs) {
            assert!(
                (a - b).abs() < 1e-4,
                "{what}: request {i}'s logprobs {a} vs {b}"
            );
        }
    }
}

#[test]
fn greedy_tokens_equal_those_without_drafts() {
    let waves = workload(&greedy(), &tokens(40));
    let (want, base) = run(one_stage("qwen3_next_tiny"), config(0), &waves);
    assert!(want.iter().all(|o| o.ids.len() == 40));
    assert_eq!(base.spec_decode_num_drafts_total, 0);
    assert!(
        want[5..7]
            .iter()
            .all(|o| o.usage.unwrap().cached_tokens > 0),
        "the second wave's longer prompts hit the prefix cache"
    );
    for k in [1, 2, 3] {
        // The head's own drafts (random weights: rarely right).
        let (got, m) = run(one_stage("qwen3_next_tiny"), config(k), &waves);
        assert_same(&got, &want, &format!("K = {k}, the head's drafts"));
        assert!(m.spec_decode_num_drafts_total > 0, "K = {k}: {m:?}");
        assert_eq!(
            m.spec_decode_num_accepted_tokens_per_pos_total
                .iter()
                .sum::<u64>(),
            m.spec_decode_num_accepted_tokens_total
        );

        // Drafts forced to the known tokens: every one accepted, fewer steps.
        let all = ForcedDrafts::new(one_stage("qwen3_next_tiny"), known(&waves, &want), None);
        let (got, m) = run(all, config(k), &waves);
        assert_same(&got, &want, &format!("K = {k}, all accepted"));
        assert!(m.spec_decode_num_draft_tokens_total > 0);
        assert_eq!(
            m.spec_decode_num_accepted_tokens_total, m.spec_decode_num_draft_tokens_total,
            "K = {k}: {m:?}"
        );
        assert!(
            m.steps_total < base.steps_total,
            "K = {k}: {} vs {}",
            m.steps_total,
            base.steps_total
        );

        // Drafts spoiled at positions that vary with the step: rejections in the middle.
        let spoil: Spoil =
            Box::new(|key, step, j| (key as usize + step as usize + j).is_multiple_of(3));
        let some = ForcedDrafts::new(
            one_stage("qwen3_next_tiny"),
            known(&waves, &want),
            Some(spoil),
        );
        let (got, m) = run(some, config(k), &waves);
        assert_same(&got, &want, &format!("K = {k}, some spoiled"));
        let (acc, drafted) = (
            m.spec_decode_num_accepted_tokens_total,
            m.spec_decode_num_draft_tokens_total,
        );
        assert!(acc > 0 && acc < drafted, "K = {k}: {acc} of {drafted}");
    }
}

#[test]
fn known_tokens_given_through_the_handle_are_drafted() {
    // What `sanmai bench` does between its passes: the known tokens replaced through the shared
    // handle, here from nothing, before the requests come.
    let waves = workload(&greedy(), &tokens(40));
    let (want, _) = run(one_stage("qwen3_next_tiny"), config(0), &waves);
    let forced = ForcedDrafts::new(one_stage("qwen3_next_tiny"), HashMap::new(), None);
    forced.known().lock().unwrap().extend(known(&waves, &want));
    let (got, m) = run(forced, config(2), &waves);
    assert_same(&got, &want, "known through the handle");
    assert!(m.spec_decode_num_draft_tokens_total > 0);
    assert_eq!(
        m.spec_decode_num_accepted_tokens_total,
        m.spec_decode_num_draft_tokens_total
    );
}

#[test]
fn seeded_sampling_with_penalties_is_the_same_with_drafts() {
    let sampling = SamplingParams {
        temperature: 1.0,
        top_p: 0.9,
        top_k: 50,
        repetition_penalty: 1.1,
        presence_penalty: 0.3,
        seed: Some(7),
        logprobs: Some(0),
        ..SamplingParams::default()
    };
    let stop = StopParams {
        max_tokens: Some(30),
        min_tokens: 5,
        stop_token_ids: vec![3, 77],
        ..Default::default()
    };
    let waves = workload(&sampling, &stop);
    let (want, _) = run(one_stage("qwen3_next_tiny"), config(0), &waves);
    for k in [1, 3] {
        let (got, _) = run(one_stage("qwen3_next_tiny"), config(k), &waves);
        assert_same(&got, &want, &format!("K = {k}, the head's drafts"));
        let spoil: Spoil =
            Box::new(|key, step, j| (key as usize + 2 * step as usize + j).is_multiple_of(4));
        let forced = ForcedDrafts::new(
            one_stage("qwen3_next_tiny"),
            known(&waves, &want),
            Some(spoil),
        );
        let (got, m) = run(forced, config(k), &waves);
        assert_same(&got, &want, &format!("K = {k}, forced"));
        assert!(m.spec_decode_num_accepted_tokens_total > 0, "{m:?}");
    }
}

#[test]
fn preempted_and_pipelined_requests_keep_their_tokens() {
    let waves = workload(&greedy(), &tokens(40));
    let (want, _) = run(one_stage("qwen3_next_tiny"), config(0), &waves);
    // A K/V budget of about 20 blocks for four requests of up to 110 tokens: preemptions.
    let small = EngineConfig {
        kv_cache_memory_bytes: 20 * 16 * 2 * 2 * 2 * 32 * 4,
        ..config(2)
    };
    let forced = ForcedDrafts::new(one_stage("qwen3_next_tiny"), known(&waves, &want), None);
    let (got, m) = run(forced, small, &waves);
    assert!(m.preemptions_total > 0, "{m:?}");
    assert_same(&got, &want, "preempted");

    // Two stages, the MTP head on the second.
    let stages = vec![load("qwen3_next_tiny", 0..2), load("qwen3_next_tiny", 2..4)];
    let pipe =
        PipelineExecutor::new(stages, PrefetchOptions::default(), Default::default()).unwrap();
    let spoil: Spoil =
        Box::new(|key, step, j| (key as usize + step as usize + j).is_multiple_of(3));
    let forced = ForcedDrafts::new(pipe, known(&waves, &want), Some(spoil));
    let (got, m) = run(forced, config(2), &waves);
    assert_same(&got, &want, "two stages");
    assert!(m.spec_decode_num_accepted_tokens_total > 0, "{m:?}");
}

#[test]
fn a_qsa_model_drafts_too() {
    // The head's layer is a QSA layer with its own index keys.
    let name = "qwen4_exp_qsa_tiny";
    let waves = workload(&greedy(), &tokens(24));
    let (want, _) = run(one_stage(name), config(0), &waves);
    let (got, m) = run(one_stage(name), config(2), &waves);
    assert_same(&got, &want, name);
    assert!(m.spec_decode_num_drafts_total > 0, "{name}: {m:?}");
    let forced = ForcedDrafts::new(one_stage(name), known(&waves, &want), None);
    let (got, _) = run(forced, config(2), &waves);
    assert_same(&got, &want, &format!("{name}, forced"));
}

/// Layers `r` of the built-in model (real vocabulary, an MTP head).
fn builtin_stage(r: std::ops::Range<usize>) -> Model<CpuBackend> {
    Model::load_stage(
        builtin::config(),
        &Dummy::new(builtin::SEED),
        CpuBackend::new(),
        None,
        r,
    )
    .unwrap()
}

fn builtin_one() -> ModelExecutor<CpuBackend> {
    ModelExecutor::new(builtin_stage(0..4))
}

fn builtin_two() -> PipelineExecutor<CpuBackend> {
    let stages = vec![builtin_stage(0..2), builtin_stage(2..4)];
    PipelineExecutor::new(stages, PrefetchOptions::default(), Default::default()).unwrap()
}

/// Sixteen seeded JSON-schema requests, two at a time, on `exec` with `k` drafts: each answer's
/// text and tokens, and the metrics.
fn json_answers(
    exec: impl Executor + 'static,
    k: usize,
) -> (Vec<(String, Vec<u32>)>, MetricsSnapshot) {
    let tok = Tokenizer::builtin().unwrap();
    let compiler = GrammarCompiler::new(&tok).unwrap();
    let schema = json!({"type": "object", "properties": {
        "id": {"type": "integer", "minimum": 1, "maximum": 999},
        "name": {"type": "string", "minLength": 1, "maxLength": 6},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3}
    }, "required": ["id", "name", "tags"], "additionalProperties": false});
    let grammar = compiler.compile(&Constraint::JsonSchema(schema)).unwrap();
    let cfg = EngineConfig {
        valid_vocab: tok.vocab_size(),
        eos_ids: tok.eos_token_ids().to_vec(),
        max_model_len: 512,
        max_num_batched_tokens: 64,
        ..config(k)
    };
    let engine = start(exec, Some(tok.clone()), cfg).unwrap();
    let mut answers = Vec::new();
    for pair in 0..8 {
        let streams: Vec<_> = (0..2)
            .map(|j| {
                let i = pair * 2 + j;
                let sampling = SamplingParams {
                    temperature: 1.0,
                    seed: Some(100 + i),
                    frequency_penalty: 1.0,
                    presence_penalty: 1.0,
                    ..SamplingParams::default()
                };
                let req = EngineRequest {
                    id: format!("json-{i}"),
                    prompt: tok.encode("Answer in JSON:", false).unwrap(),
                    sampling: sampling.validated(tok.vocab_size()).unwrap(),
                    stop: StopParams {
                        max_tokens: Some(96),
                        ..Default::default()
                    },
                    prompt_logprobs: false,
                    cache_salt: Vec::new(),
                    checkpoint_at: Vec::new(),
                    images: None,
                };
                let c = OutputConstraint {
                    matcher: grammar.matcher(),
                    activate_after: Vec::new(),
                };
                engine.submit_constrained(req, Some(c)).unwrap()
            })
            .collect();
        for mut s in streams {
            let (mut text, mut ids) = (String::new(), Vec::new());
            while let Some(ev) = s.blocking_recv() {
                match ev {
                    EngineEvent::Tokens {
                        ids: i, text: t, ..
                    } => {
                        ids.extend(i);
                        text.push_str(&t);
                    }
                    EngineEvent::Finished { reason, .. } => {
                        assert_eq!(reason, FinishReason::Stop, "{text}")
                    }
                    EngineEvent::PromptLogprobs(_) => {}
                }
            }
            answers.push((text, ids));
        }
    }
    let m = engine.metrics();
    engine.shutdown();
    (answers, m)
}

#[test]
fn json_schema_answers_under_drafts_and_two_stages_are_valid_and_unchanged() {
    let (want, _) = json_answers(builtin_one(), 0);
    for (text, _) in &want {
        let v: serde_json::Value = serde_json::from_str(text).expect(text);
        assert!(
            v["id"].is_u64() && v["name"].is_string() && v["tags"].is_array(),
            "{text}"
        );
    }
    let prompt = Tokenizer::builtin()
        .unwrap()
        .encode("Answer in JSON:", false)
        .unwrap();
    let known: HashMap<u64, Vec<u32>> = want
        .iter()
        .enumerate()
        .map(|(i, (_, ids))| {
            let mut t = prompt.clone();
            t.extend(ids);
            let key = EngineRequest {
                id: format!("json-{i}"),
                prompt: Vec::new(),
                sampling: greedy().validated(VOCAB).unwrap(),
                stop: StopParams::default(),
                prompt_logprobs: false,
                cache_salt: Vec::new(),
                checkpoint_at: Vec::new(),
                images: None,
            }
            .key();
            (key, t)
        })
        .collect();
    let spoil = || -> Spoil {
        Box::new(|key, step, j| (key as usize + step as usize + j).is_multiple_of(4))
    };
    let runs = [
        (
            "one stage, the head's drafts",
            json_answers(builtin_one(), 2),
        ),
        (
            "two stages, the head's drafts",
            json_answers(builtin_two(), 2),
        ),
        (
            "one stage, forced drafts",
            json_answers(
                ForcedDrafts::new(builtin_one(), known.clone(), Some(spoil())),
                2,
            ),
        ),
        (
            "two stages, forced drafts",
            json_answers(
                ForcedDrafts::new(builtin_two(), known.clone(), Some(spoil())),
                2,
            ),
        ),
    ];
    for (what, (got, m)) in runs {
        assert_eq!(got, want, "{what}");
        // The head's drafts are picked under the grammar's masks, so they are verified (and where
        // the grammar allows one token, accepted); a spoiled forced draft the grammar forbids is
        // cut before verifying.
        assert!(m.spec_decode_num_drafts_total > 0, "{what}: {m:?}");
        if what.contains("forced") {
            let (acc, drafted) = (
                m.spec_decode_num_accepted_tokens_total,
                m.spec_decode_num_draft_tokens_total,
            );
            assert!(acc > 0 && acc <= drafted, "{what}: {acc} of {drafted}");
        }
    }
}

#[test]
fn the_last_stage_drafts_from_its_host_copy_of_the_embedding_as_one_stage_does() {
    // qwen3_next_tiny's lm_head is not its embedding: its last stage keeps the MTP head's copy of
    // the embedding in host memory, the whole model the device table.
    let whole = load("qwen3_next_tiny", 0..4);
    let last = load("qwen3_next_tiny", 2..4);
    assert!(whole.mtp_embed.is_none() && whole.embed.is_some());
    assert!(last.mtp_embed.is_some() && last.embed.is_none());
    let ids = [0u32, 5, 517, VOCAB as u32 - 1];
    let rows = |m: &Model<CpuBackend>| m.backend.to_host(m.draft_embed(&ids).unwrap()).unwrap();
    assert_eq!(rows(&whole), rows(&last), "bit for bit");
    assert!(last.draft_embed(&[VOCAB as u32]).is_err());

    // The head's own drafts (random weights: mostly rejected) on one stage and on two: the same
    // drafts, so the same acceptance, and the same tokens.
    let waves = workload(&greedy(), &tokens(24));
    let (one, m1) = run(one_stage("qwen3_next_tiny"), config(2), &waves);
    let stages = vec![load("qwen3_next_tiny", 0..2), load("qwen3_next_tiny", 2..4)];
    let pipe =
        PipelineExecutor::new(stages, PrefetchOptions::default(), Default::default()).unwrap();
    let (two, m2) = run(pipe, config(2), &waves);
    assert_same(&two, &one, "two stages, the head's own drafts");
    assert!(m1.spec_decode_num_draft_tokens_total > 0, "{m1:?}");
    assert_eq!(
        (
            m1.spec_decode_num_draft_tokens_total,
            m1.spec_decode_num_accepted_tokens_total
        ),
        (
            m2.spec_decode_num_draft_tokens_total,
            m2.spec_decode_num_accepted_tokens_total
        )
    );
}
