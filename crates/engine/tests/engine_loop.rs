//! The engine loop on the built-in model: continuous batching with chunked prefill gives what one sequence
//! alone gives, stop conditions, prompt log-probabilities, and aborts that free the sequence.

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use sanmai_cpu::CpuBackend;
use sanmai_engine::api::{EngineEvent, EngineRequest, FinishReason, StopParams, StopReason};
use sanmai_engine::sampler::SamplingParams;
use sanmai_engine::{start, EngineConfig, EngineHandle, ModelExecutor};
use sanmai_model::{builtin, Model};
use sanmai_tokenizer::Tokenizer;
use sanmai_weights::Dummy;

fn tokenizer() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| Tokenizer::builtin().unwrap())
}

fn engine(max_num_seqs: usize, max_num_batched_tokens: usize) -> EngineHandle {
    let model = Model::load(
        builtin::config(),
        &Dummy::new(builtin::SEED),
        CpuBackend::new(),
    )
    .unwrap();
    let tok = tokenizer().clone();
    start(
        ModelExecutor::new(model),
        Some(tok.clone()),
        EngineConfig {
            model_name: "test".into(),
            max_num_seqs,
            max_num_batched_tokens,
            max_model_len: 4096,
            max_waiting: 100,
            default_max_tokens: Some(64),
            valid_vocab: tok.backend().get_vocab_size(true),
            eos_ids: vec![248046, 248044],
        },
    )
}

fn request(id: &str, prompt: &str, max_tokens: usize) -> EngineRequest {
    EngineRequest {
        id: id.into(),
        prompt: tokenizer().encode(prompt, false).unwrap(),
        sampling: SamplingParams::greedy(),
        stop: StopParams {
            max_tokens: Some(max_tokens),
            ignore_eos: true,
            ..Default::default()
        },
        prompt_logprobs: false,
        cache_salt: Vec::new(),
    }
}

struct Outcome {
    ids: Vec<u32>,
    text: String,
    reason: FinishReason,
    stop: Option<StopReason>,
    prompt_logprobs: Option<Vec<Option<f32>>>,
}

fn collect(h: &EngineHandle, req: EngineRequest) -> Outcome {
    let mut s = h.submit(req).unwrap();
    let mut out = Outcome {
        ids: Vec::new(),
        text: String::new(),
        reason: FinishReason::Abort,
        stop: None,
        prompt_logprobs: None,
    };
    while let Some(ev) = s.blocking_recv() {
        match ev {
            EngineEvent::PromptLogprobs(p) => {
                out.prompt_logprobs =
                    Some(p.iter().map(|x| x.as_ref().map(|t| t.logprob)).collect())
            }
            EngineEvent::Tokens { ids, text, .. } => {
                out.ids.extend(ids);
                out.text.push_str(&text);
            }
            EngineEvent::Finished {
                reason,
                stop_reason,
                ..
            } => {
                out.reason = reason;
                out.stop = stop_reason;
            }
        }
    }
    out
}

#[test]
fn concurrent_chunked_requests_equal_solo_runs() {
    let prompts = [
        "The quick brown fox",
        "日本語のテキストと emoji 🎉 mixed together in a longer prompt that spans chunks",
        "a",
    ];
    let solo = engine(1, 2048);
    let alone: Vec<Outcome> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| collect(&solo, request(&i.to_string(), p, 20)))
        .collect();
    // Tight budgets: prefill is chunked in 7-token pieces while other sequences decode.
    let busy = engine(3, 7);
    let handles: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let h = busy.clone();
            let req = request(&format!("b{i}"), p, 20);
            std::thread::spawn(move || collect(&h, req))
        })
        .collect();
    for (i, h) in handles.into_iter().enumerate() {
        let got = h.join().unwrap();
        assert_eq!(got.ids, alone[i].ids, "prompt {i}");
        assert_eq!(got.text, alone[i].text);
        assert_eq!(got.reason, FinishReason::Length);
        assert_eq!(got.ids.len(), 20);
    }
}

#[test]
fn stop_string_ends_generation_and_is_not_emitted() {
    let h = engine(4, 64);
    let free = collect(&h, request("free", "Hello", 30));
    // Pick a stop string from the middle of the free-running text.
    let chars: Vec<char> = free.text.chars().collect();
    assert!(
        chars.len() > 6,
        "the built-in model produced too little text: {:?}",
        free.text
    );
    let stop: String = chars[3..5].iter().collect();
    let mut req = request("stopped", "Hello", 30);
    req.stop.stop = vec![stop.clone()];
    let got = collect(&h, req);
    assert_eq!(got.reason, FinishReason::Stop);
    assert_eq!(got.stop, Some(StopReason::Text(stop.clone())));
    let expected = &free.text[..free.text.find(&stop).unwrap()];
    assert_eq!(got.text, expected);
}

#[test]
fn stop_token_ids_min_tokens_and_prompt_logprobs() {
    let h = engine(4, 64);
    let free = collect(&h, request("free", "Count with me", 12));
    let mut req = request("tok", "Count with me", 12);
    req.stop.stop_token_ids = vec![free.ids[3]];
    let got = collect(&h, req);
    let first = free.ids.iter().position(|&t| t == free.ids[3]).unwrap();
    assert_eq!(got.ids, free.ids[..=first]);
    assert_eq!(got.stop, Some(StopReason::Token(free.ids[3])));

    let mut req = request("min", "Count with me", 12);
    req.stop.stop_token_ids = vec![free.ids[0]];
    req.stop.min_tokens = 5;
    let got = collect(&h, req);
    assert!(got.ids.len() >= 5, "min_tokens holds off the stop token");

    let mut req = request("lp", "Count with me", 2);
    req.prompt_logprobs = true;
    let n = req.prompt.len();
    let got = collect(&h, req);
    let lp = got.prompt_logprobs.expect("prompt logprobs were asked for");
    assert_eq!(lp.len(), n);
    assert!(lp[0].is_none() && lp[1..].iter().all(|x| x.unwrap() <= 0.0));
}

#[test]
fn dropping_the_stream_aborts_and_frees() {
    let h = engine(4, 64);
    let mut s = h
        .submit(request("long", "Tell me a long story", 4000))
        .unwrap();
    // Wait for a token, then disconnect.
    loop {
        if let Some(EngineEvent::Tokens { .. }) = s.blocking_recv() {
            break;
        }
    }
    drop(s);
    let t0 = Instant::now();
    while h.metrics().requests_finished_total != 1 || h.metrics().requests_running != 0 {
        assert!(
            t0.elapsed() < Duration::from_secs(10),
            "the aborted request is still running"
        );
        std::thread::sleep(Duration::from_millis(5));
    }
    assert!(h.metrics().generation_tokens_total < 4000);
}
