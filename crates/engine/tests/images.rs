//! Prompts with images through the engine on the CPU, against transformers: the two-image prompt
//! of `tests/fixtures/qwen3_5_mm_tiny` (made by `tests/reference/make_mm_fixtures.py`) gives
//! transformers' greedy continuation when its images come from their PNG files through
//! [`ImageEncoder`] (placeholders expanded, tower run, MRoPE positions placed) and its prefill is cut
//! into chunks smaller than an image; the same prompt again hits the prefix cache through its
//! images and gives the same tokens; a different image behind the same placeholders does not hit
//! past the text before it; on one stage and on two pipeline stages.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use sanmai_config::ModelConfig;
use sanmai_cpu::CpuBackend;
use sanmai_engine::api::{EngineEvent, EngineRequest, StopParams, Usage};
use sanmai_engine::images::{ImageEncoder, PreparedImage, PromptImages};
use sanmai_engine::sampler::SamplingParams;
use sanmai_engine::{start, EngineConfig, Executor, ModelExecutor, PipelineExecutor};
use sanmai_model::vision::{PreprocessorConfig, Vision};
use sanmai_model::Model;
use sanmai_ple::PrefetchOptions;
use sanmai_weights::Checkpoint;
use serde_json::Value;

const VOCAB: usize = 1024;

fn dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/qwen3_5_mm_tiny")
}

fn reference() -> Value {
    serde_json::from_str(&std::fs::read_to_string(dir().join("reference.json")).unwrap()).unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

fn model_config() -> ModelConfig {
    let mut cfg = ModelConfig::from_file(&dir().join("config.json")).unwrap();
    cfg.mtp_layers = 0;
    cfg
}

/// The encoder of the fixture's images.
fn encoder() -> ImageEncoder {
    let ckpt = Checkpoint::open(&dir()).unwrap();
    let vision = Vision::load(&model_config(), &ckpt)
        .unwrap()
        .expect("a vision tower");
    let pre = PreprocessorConfig::from_file(&dir().join("preprocessor_config.json")).unwrap();
    ImageEncoder::new(vision, pre, 4)
}

/// The model's layers `range` on the CPU.
fn stage(range: std::ops::Range<usize>) -> Model<CpuBackend> {
    let ckpt = Checkpoint::open(&dir()).unwrap();
    Model::load_stage(model_config(), &ckpt, CpuBackend::new(), None, range).unwrap()
}

fn image(enc: &ImageEncoder, path: &Path) -> PreparedImage {
    enc.prepare(&std::fs::read(path).unwrap()).unwrap()
}

/// The reference prompt with each image's run of placeholders cut to one (what a chat template
/// renders).
fn rendered(full: &[u32], image_token: u32) -> Vec<u32> {
    let mut out: Vec<u32> = Vec::new();
    for &t in full {
        if !(t == image_token && out.last() == Some(&image_token)) {
            out.push(t);
        }
    }
    out
}

fn config() -> EngineConfig {
    EngineConfig {
        model_name: "mm".into(),
        max_num_seqs: 4,
        // The 33-token prompt is prefilled in chunks of 5: each image's tokens span two or more.
        max_num_batched_tokens: 5,
        max_model_len: 128,
        max_waiting: 16,
        default_max_tokens: None,
        valid_vocab: VOCAB,
        eos_ids: Vec::new(),
        block_size: 4,
        kv_cache_memory_bytes: 1 << 22,
        enable_prefix_caching: true,
        state_checkpoint_interval: Some(4),
        num_speculative_tokens: 0,
    }
}

fn request(id: &str, prompt: Vec<u32>, images: PromptImages, n: usize) -> EngineRequest {
    EngineRequest {
        id: id.into(),
        prompt,
        sampling: SamplingParams::greedy().validated(VOCAB).unwrap(),
        stop: StopParams {
            max_tokens: Some(n),
            ignore_eos: true,
            ..Default::default()
        },
        prompt_logprobs: false,
        cache_salt: Vec::new(),
        checkpoint_at: Vec::new(),
        images: Some(Arc::new(images)),
    }
}

#[test]
fn greedy_with_images_equals_transformers_and_images_key_the_prefix_cache() {
    images_through(ModelExecutor::new(stage(0..4)));
}

#[test]
fn two_pipeline_stages_give_the_same_tokens() {
    let stages = vec![stage(0..2), stage(2..4)];
    images_through(
        PipelineExecutor::new(stages, PrefetchOptions::default(), Default::default()).unwrap(),
    );
}

/// The fixture's two-image prompt through an engine on `exec`: transformers' greedy tokens, the
/// same again from the prefix cache, and no hit past the text for another image.
fn images_through(exec: impl Executor + 'static) {
    let r = reference();
    let enc = encoder();
    let full = ids(&r["input_ids"]);
    let want = ids(&r["greedy_ids"]);
    let image_token = r["image_token_id"].as_u64().unwrap() as u32;
    assert_eq!(enc.image_token(), image_token);
    let images = [
        image(&enc, &dir().join("image0.png")),
        image(&enc, &dir().join("image1.png")),
    ];
    let short = rendered(&full, image_token);
    let (prompt, prompt_images, moved) = enc.encode(&short, &images).unwrap();
    assert_eq!(prompt, full, "placeholders expanded as the processor does");
    assert_eq!(moved.len(), short.len());
    assert_eq!(
        prompt_images.positions.delta,
        r["rope_deltas"].as_i64().unwrap()
    );
    let first_image_row = prompt_images.positions.image_rows[0];

    // The first image replaced by its negative (same grid, same placeholders, other pixels).
    let mut other = images[0].clone();
    other.patches.pixel_values.iter_mut().for_each(|x| *x = -*x);
    other.hash = !other.hash;
    let (other_prompt, other_images, _) = enc.encode(&short, &[other, images[1].clone()]).unwrap();
    assert_eq!(
        other_prompt, full,
        "the same tokens behind a different image"
    );

    let engine = start(exec, None, config()).unwrap();
    let run = |req: EngineRequest| -> (Vec<u32>, Usage) {
        let mut s = engine.submit(req).unwrap();
        let (mut out, mut usage) = (Vec::new(), None);
        while let Some(ev) = s.blocking_recv() {
            match ev {
                EngineEvent::Tokens { ids, .. } => out.extend(ids),
                EngineEvent::Finished { usage: u, .. } => usage = Some(u),
                EngineEvent::PromptLogprobs(_) => {}
            }
        }
        (out, usage.expect("a finished event"))
    };
    let n = want.len();
    let (got, usage) = run(request("a", prompt.clone(), prompt_images.clone(), n));
    assert_eq!(got, want, "transformers' greedy continuation");
    assert_eq!(
        usage.prompt_tokens,
        full.len(),
        "image tokens count as prompt tokens"
    );
    assert_eq!(usage.cached_tokens, 0);

    let (again, usage) = run(request("b", prompt, prompt_images, n));
    assert_eq!(again, want, "the same prompt from the prefix cache");
    assert!(
        usage.cached_tokens > first_image_row,
        "the same images hit the cache past the first image: {} cached, the image starts at {first_image_row}",
        usage.cached_tokens
    );

    let (_, usage) = run(request("c", other_prompt, other_images, n));
    assert!(
        usage.cached_tokens <= first_image_row,
        "another image behind the same placeholders must not hit: {} cached, the image starts at {first_image_row}",
        usage.cached_tokens
    );
    assert!(
        usage.cached_tokens > 0,
        "the text before the image is shared"
    );
    engine.shutdown();
}

#[test]
fn a_prompt_must_hold_one_placeholder_per_image() {
    let enc = encoder();
    let img = image(&enc, &dir().join("image0.png"));
    let t = enc.image_token();
    let e = enc
        .encode(&[1, 2, 3], std::slice::from_ref(&img))
        .unwrap_err();
    assert!(
        e.to_string()
            .contains("0 image placeholder tokens for 1 images"),
        "{e}"
    );
    let e = enc.encode(&[1, t, 2, t], &[img]).unwrap_err();
    assert!(
        e.to_string()
            .contains("2 image placeholder tokens for 1 images"),
        "{e}"
    );
}
