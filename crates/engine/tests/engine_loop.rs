//! The engine loop on the built-in model: continuous batching with chunked prefill gives what one sequence
//! alone gives, stop conditions, prompt log-probabilities, and aborts that free the sequence.

#[macro_use]
mod wrap;

use std::sync::OnceLock;
use std::time::{Duration, Instant};

use sanmai_cpu::CpuBackend;
use sanmai_engine::api::{EngineEvent, EngineRequest, FinishReason, StopParams, StopReason};
use sanmai_engine::sampler::{SamplingParams, ValidatedParams};
use sanmai_engine::{start, EngineConfig, EngineHandle, ModelExecutor};
use sanmai_model::{builtin, Model};
use sanmai_tokenizer::Tokenizer;
use sanmai_weights::Dummy;

fn tokenizer() -> &'static Tokenizer {
    static T: OnceLock<Tokenizer> = OnceLock::new();
    T.get_or_init(|| Tokenizer::builtin().unwrap())
}

/// Engine settings for the built-in model; tests adjust the fields they exercise.
fn config(max_num_seqs: usize, max_num_batched_tokens: usize) -> EngineConfig {
    EngineConfig {
        model_name: "test".into(),
        max_num_seqs,
        max_num_batched_tokens,
        max_model_len: 4096,
        max_waiting: 100,
        default_max_tokens: Some(64),
        valid_vocab: tokenizer().backend().get_vocab_size(true),
        eos_ids: vec![248046, 248044],
        block_size: 16,
        kv_cache_memory_bytes: 1 << 30,
        enable_prefix_caching: true,
        state_checkpoint_interval: Some(64),
        num_speculative_tokens: 0,
    }
}

fn executor() -> ModelExecutor<CpuBackend> {
    ModelExecutor::new(
        Model::load(
            builtin::config(),
            &Dummy::new(builtin::SEED),
            CpuBackend::new(),
        )
        .unwrap(),
    )
}

fn engine_from(cfg: EngineConfig) -> EngineHandle {
    start(executor(), Some(tokenizer().clone()), cfg).unwrap()
}

fn engine(max_num_seqs: usize, max_num_batched_tokens: usize) -> EngineHandle {
    engine_from(config(max_num_seqs, max_num_batched_tokens))
}

fn engine_uncached(max_num_seqs: usize, max_num_batched_tokens: usize) -> EngineHandle {
    engine_from(EngineConfig {
        enable_prefix_caching: false,
        ..config(max_num_seqs, max_num_batched_tokens)
    })
}

fn greedy() -> ValidatedParams {
    SamplingParams::greedy()
        .validated(tokenizer().backend().get_vocab_size(true))
        .unwrap()
}

fn request(id: &str, prompt: &str, max_tokens: usize) -> EngineRequest {
    EngineRequest {
        id: id.into(),
        prompt: tokenizer().encode(prompt, false).unwrap(),
        sampling: greedy(),
        stop: StopParams {
            max_tokens: Some(max_tokens),
            ignore_eos: true,
            ..Default::default()
        },
        prompt_logprobs: false,
        cache_salt: Vec::new(),
        checkpoint_at: Vec::new(),
        images: None,
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

fn with_logprobs(mut req: EngineRequest) -> EngineRequest {
    req.sampling = SamplingParams {
        logprobs: Some(5),
        ..(*req.sampling).clone()
    }
    .validated(tokenizer().backend().get_vocab_size(true))
    .unwrap();
    req
}

/// Generated ids and every generated token's top-5 log-probabilities.
/// Top alternatives of each generated token.
type Tops = Vec<Vec<(u32, f32)>>;

fn run_logprobs(h: &EngineHandle, req: EngineRequest) -> (Vec<u32>, Tops, usize) {
    let mut s = h.submit(with_logprobs(req)).unwrap();
    let (mut ids, mut lps, mut cached) = (Vec::new(), Vec::new(), 0);
    while let Some(ev) = s.blocking_recv() {
        match ev {
            EngineEvent::Tokens {
                ids: i, logprobs, ..
            } => {
                ids.extend(i);
                lps.extend(logprobs.into_iter().map(|l| l.top));
            }
            EngineEvent::Finished { usage, .. } => cached = usage.cached_tokens,
            EngineEvent::PromptLogprobs(_) => {}
        }
    }
    (ids, lps, cached)
}

fn assert_close(a: &[Vec<(u32, f32)>], b: &[Vec<(u32, f32)>]) {
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(b) {
        for ((ia, la), (ib, lb)) in x.iter().zip(y) {
            assert_eq!(ia, ib);
            assert!((la - lb).abs() < 1e-4, "logprob {la} vs {lb}");
        }
    }
}

/// An agent-shaped second turn: the first turn's prompt and reply, then a new message.
#[test]
fn prefix_cache_resumes_agent_turns_with_equal_logits() {
    let cached = engine(4, 48);
    let plain = engine_uncached(4, 48);
    let turn1 = request("t1", "<|im_start|>system\nYou are a coding agent. Use tools.<|im_end|>\n<|im_start|>user\nList the files in the repository and explain them.<|im_end|>\n<|im_start|>assistant\n", 40);
    let (ids1, _, hit1) = run_logprobs(&cached, turn1.clone());
    assert_eq!(hit1, 0);
    let mut prompt2 = turn1.prompt.clone();
    prompt2.extend(&ids1);
    prompt2.extend(
        tokenizer()
            .encode(
                "<|im_end|>\n<|im_start|>user\nNow fix the bug.<|im_end|>\n<|im_start|>assistant\n",
                false,
            )
            .unwrap(),
    );
    let mut turn2 = request("t2", "", 30);
    turn2.prompt = prompt2.clone();
    let (ids2, lp2, hit2) = run_logprobs(&cached, turn2.clone());
    // The first turn's prompt comes back from its checkpoint at the last block boundary before its end
    // (its reply's blocks too, if an interval checkpoint landed there).
    assert!(
        hit2 >= (turn1.prompt.len() - 1) / 16 * 16,
        "cached {hit2} of the {}-token first prompt",
        turn1.prompt.len()
    );
    let (ids2b, lp2b, hit2b) = run_logprobs(&plain, turn2);
    assert_eq!(hit2b, 0);
    assert_eq!(ids2, ids2b);
    assert_close(&lp2, &lp2b);
    let m = cached.metrics();
    assert!(m.prefix_cache_hits_total >= turn1.prompt.len() as u64);
    assert!(m.prefix_cache_queries_total >= (turn1.prompt.len() + prompt2.len()) as u64);
}

/// The same prompt asked again resumes from the last block boundary before its end, whatever its
/// length, and answers as an engine without a prefix cache does.
#[test]
fn a_repeated_prompt_resumes_from_its_last_block() {
    let cached = engine(2, 48);
    let plain = engine_uncached(2, 48);
    for (i, text) in [
        "Count the sheep: one, two, three.",
        "A longer prompt that runs past several blocks of sixteen tokens, so that its checkpoint lands well inside it and the second request reuses most of what the first one computed.",
    ]
    .into_iter()
    .enumerate()
    {
        let req = request(&format!("r{i}"), text, 6);
        let n = req.prompt.len();
        let (ids1, lp1, hit1) = run_logprobs(&cached, req.clone());
        assert_eq!(hit1, 0);
        let (ids2, lp2, hit2) = run_logprobs(&cached, req.clone());
        assert_eq!(hit2, (n - 1) / 16 * 16, "{n}-token prompt");
        let (ids3, lp3, _) = run_logprobs(&plain, req);
        assert_eq!(ids1, ids3);
        assert_eq!(ids2, ids3);
        assert_close(&lp1, &lp3);
        assert_close(&lp2, &lp3);
    }
}

#[test]
fn interval_checkpoints_serve_a_diverging_prompt() {
    let cached = engine(2, 40);
    let plain = engine_uncached(2, 40);
    let long = "The history of the printing press begins with movable type in East Asia and continues through Gutenberg's workshop in Mainz, where metal type, oil-based ink and a screw press came together around 1450.";
    let long = format!("{long} {long}");
    // Its own checkpoint (the last block boundary before its end) lies past where `b` diverges.
    let a = request(
        "a",
        &format!("{long} Summarise it in three sentences, then list every name, place and date it gives, in order."),
        5,
    );
    assert!(
        a.prompt.len() > 70,
        "the prompt must cross the 64-token checkpoint interval"
    );
    run_logprobs(&cached, a);
    let b = request(
        "b",
        &format!("{long} Now translate it into French, please, carefully."),
        12,
    );
    let (ids, lps, hit) = run_logprobs(&cached, b.clone());
    assert_eq!(hit, 64, "resumes from the interval checkpoint at 64 tokens");
    let (ids_plain, lps_plain, _) = run_logprobs(&plain, b);
    assert_eq!(ids, ids_plain);
    assert_close(&lps, &lps_plain);
}

#[test]
fn preemption_under_a_tiny_block_budget_keeps_outputs() {
    // 16 blocks of 16 tokens (1 KiB per token): three ~106-token sequences (7 blocks each) cannot all fit.
    let tight = engine_from(EngineConfig {
        max_model_len: 128,
        kv_cache_memory_bytes: 16 * 16 * 1024,
        ..config(3, 64)
    });
    let roomy = engine_from(EngineConfig {
        max_model_len: 128,
        ..config(3, 64)
    });
    let prompts = [
        "one two three four five six",
        "alpha beta gamma delta epsilon",
        "red green blue yellow",
    ];
    let run = |h: &EngineHandle| -> Vec<Vec<u32>> {
        let hs: Vec<_> = prompts
            .iter()
            .enumerate()
            .map(|(i, p)| {
                let h = h.clone();
                let req = request(&format!("p{i}"), p, 100);
                std::thread::spawn(move || run_logprobs(&h, req).0)
            })
            .collect();
        hs.into_iter().map(|t| t.join().unwrap()).collect()
    };
    let a = run(&tight);
    let b = run(&roomy);
    assert_eq!(a, b);
    assert!(
        tight.metrics().preemptions_total > 0,
        "the budget was meant to force preemption"
    );
    assert_eq!(roomy.metrics().preemptions_total, 0);
}

/// An executor that keeps two steps in flight: `submit` queues, `wait` runs the oldest step. The engine must
/// never put a sequence in a step while its previous step is still queued.
struct TwoInFlight {
    inner: ModelExecutor<CpuBackend>,
    queue: std::collections::VecDeque<sanmai_engine::executor::StepPlan>,
}

impl sanmai_engine::Executor for TwoInFlight {
    hand_on_cache_ops!();
    fn alloc_state(&mut self) -> Result<usize, String> {
        self.inner.alloc_state()
    }
    fn free_state(&mut self, slot: usize) {
        self.inner.free_state(slot)
    }
    fn max_in_flight(&self) -> usize {
        2
    }
    fn submit(&mut self, plan: sanmai_engine::executor::StepPlan) {
        let queued: Vec<usize> = self
            .queue
            .iter()
            .flat_map(|p| p.chunks.iter().map(|c| c.state))
            .collect();
        assert!(
            plan.chunks.iter().all(|c| !queued.contains(&c.state)),
            "a sequence was scheduled while its previous step was in flight"
        );
        self.queue.push_back(plan);
    }
    fn wait(
        &mut self,
    ) -> (
        sanmai_engine::executor::StepPlan,
        Result<sanmai_engine::executor::StepLogits, String>,
    ) {
        let plan = self.queue.pop_front().expect("a step is in flight");
        self.inner.submit(plan);
        self.inner.wait()
    }
}

#[test]
fn two_steps_in_flight_give_the_same_outputs() {
    let prompts = [
        "first prompt here",
        "a second, somewhat longer prompt for the other microbatch",
        "third",
    ];
    let solo = engine(1, 2048);
    let alone: Vec<Vec<u32>> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| collect(&solo, request(&i.to_string(), p, 16)).ids)
        .collect();
    let two = TwoInFlight {
        inner: executor(),
        queue: Default::default(),
    };
    let h = start(two, Some(tokenizer().clone()), config(3, 8)).unwrap();
    let hs: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let h = h.clone();
            let req = request(&format!("pp{i}"), p, 16);
            std::thread::spawn(move || collect(&h, req).ids)
        })
        .collect();
    for (i, t) in hs.into_iter().enumerate() {
        assert_eq!(t.join().unwrap(), alone[i], "prompt {i}");
    }
}

/// The Qwen3.5 template renders the generation prompt with an empty think block that the next turn's
/// history leaves out: the turns share the prompt only up to the end of the history, where the request
/// asked for a checkpoint.
#[test]
fn history_end_checkpoint_serves_the_next_turn() {
    let h = engine(2, 64);
    let history = "<|im_start|>system\nYou are terse.<|im_end|>\n<|im_start|>user\nName three primes.<|im_end|>\n";
    let history_ids = tokenizer().encode(history, false).unwrap();
    let mut turn1 = request(
        "h1",
        &format!("{history}<|im_start|>assistant\n<think>\n\n</think>\n\n"),
        8,
    );
    turn1.checkpoint_at = vec![history_ids.len()];
    let (reply, _, _) = run_logprobs(&h, turn1);
    let mut turn2 = request("h2", "", 8);
    turn2.prompt = history_ids.clone();
    turn2.prompt.extend(
        tokenizer()
            .encode("<|im_start|>assistant\n", false)
            .unwrap(),
    );
    turn2.prompt.extend(reply);
    turn2.prompt.extend(
        tokenizer()
            .encode(
                "<|im_end|>\n<|im_start|>user\nAnd two more.<|im_end|>\n",
                false,
            )
            .unwrap(),
    );
    let (ids, lps, cached) = run_logprobs(&h, turn2.clone());
    assert_eq!(
        cached,
        history_ids.len(),
        "resumes exactly where the history ended"
    );
    let (ids_plain, lps_plain, _) = run_logprobs(&engine_uncached(2, 64), turn2);
    assert_eq!(ids, ids_plain);
    assert_close(&lps, &lps_plain);
}

/// An executor with room for `slots` GDN state slots at once (a device running out of memory): one
/// more allocation fails.
struct FewSlots {
    inner: ModelExecutor<CpuBackend>,
    slots: usize,
    live: usize,
}

impl sanmai_engine::Executor for FewSlots {
    hand_on_cache_ops!();
    fn alloc_state(&mut self) -> Result<usize, String> {
        if self.live == self.slots {
            return Err("alloc_state: out of device memory".into());
        }
        self.live += 1;
        self.inner.alloc_state()
    }
    fn free_state(&mut self, slot: usize) {
        self.live -= 1;
        self.inner.free_state(slot)
    }
    fn submit(&mut self, plan: sanmai_engine::executor::StepPlan) {
        self.inner.submit(plan)
    }
    fn wait(
        &mut self,
    ) -> (
        sanmai_engine::executor::StepPlan,
        Result<sanmai_engine::executor::StepLogits, String>,
    ) {
        self.inner.wait()
    }
}

#[test]
fn a_request_without_a_state_slot_waits_for_one_or_fails_alone() {
    let prompts = ["first prompt here", "a second prompt", "third"];
    let solo = engine(1, 2048);
    let alone: Vec<Vec<u32>> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| collect(&solo, request(&i.to_string(), p, 8)).ids)
        .collect();
    // One slot: the requests take turns (checkpoints find no slot and are skipped).
    let one = FewSlots {
        inner: executor(),
        slots: 1,
        live: 0,
    };
    let h = start(one, Some(tokenizer().clone()), config(3, 2048)).unwrap();
    let hs: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let h = h.clone();
            let req = request(&format!("s{i}"), p, 8);
            std::thread::spawn(move || collect(&h, req))
        })
        .collect();
    for (i, t) in hs.into_iter().enumerate() {
        let out = t.join().unwrap();
        assert_eq!(out.reason, FinishReason::Length, "prompt {i}");
        assert_eq!(out.ids, alone[i], "prompt {i}");
    }
    // No slot at all: the request fails with the executor's reason and the engine goes on.
    let none = FewSlots {
        inner: executor(),
        slots: 0,
        live: 0,
    };
    let h = start(none, Some(tokenizer().clone()), config(3, 2048)).unwrap();
    for i in 0..2 {
        let out = collect(&h, request(&format!("n{i}"), prompts[0], 8));
        assert_eq!(
            out.reason,
            FinishReason::Error("alloc_state: out of device memory".into())
        );
        assert!(out.ids.is_empty());
    }
}
