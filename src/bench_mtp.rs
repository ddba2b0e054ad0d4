//! `sanmai bench --speculative-config ...`: what MTP drafting costs and gives on this machine.
//!
//! Per batch size, on the caches the plain decode left: the median time of a verify step (each
//! sequence's last token and K drafts, its GDN state kept first as the engine keeps it) beside the
//! plain decode step, the median time of the MTP head's draft (its catch-up over the K + 1 rows and
//! K − 1 chained rows), and the tokens/s these give where each draft is accepted with probability
//! 0.5, 0.7 and 0.9. Random weights accept almost nothing, so the engine then runs the same prompts
//! with drafts forced to the target's own greedy tokens ([`ForcedDrafts`]): the plain decode's
//! first, then, where a verify row's greedy token differs from the plain decode's at a near-tie,
//! the previous pass's output, until every draft is accepted: the all-accepted case end to end,
//! its tokens compared with the plain ones.

use std::collections::HashMap;
use std::time::Instant;

use anyhow::{anyhow, Result};
use sanmai_engine::api::{EngineEvent, EngineRequest, StopParams};
use sanmai_engine::forced_drafts::ForcedDrafts;
use sanmai_engine::sampler::SamplingParams;
use sanmai_engine::{start, EngineConfig, ModelExecutor};
use sanmai_model::{Backend, Model, OutRows, Probe, StepChunk, StepInput, StepStart};

/// Verify and draft steps timed per batch size.
const REPS: usize = 16;

/// The positions past a sequence's end a verify and its draft chain write.
pub fn extra_positions(k: usize) -> usize {
    2 * k + 2
}

/// One sequence of the benchmark: its tokens from position 0, state slot and blocks.
pub struct Seq<'a> {
    pub tokens: &'a [u32],
    pub state: usize,
    pub blocks: &'a [u32],
}

/// Times verify steps and drafts of `k` tokens at the end of `seqs` (whose caches hold every token
/// but the last) and prints them beside `plain_step` (seconds) of `batch` sequences.
pub fn verify_and_draft<B: Backend>(
    m: &Model<B>,
    seqs: &[Seq<'_>],
    k: usize,
    plain_step: f64,
) -> Result<()> {
    let batch = seqs.len();
    let snaps: Vec<usize> = seqs
        .iter()
        .map(|_| m.backend.alloc_state())
        .collect::<Result<_, _>>()?;
    // The verified tokens: the last token, then k drafts (the last token again: any ids do).
    let rows: Vec<Vec<u32>> = seqs
        .iter()
        .map(|s| vec![*s.tokens.last().unwrap(); k + 1])
        .collect();
    let (mut verify, mut draft) = (Vec::new(), Vec::new());
    let pos0 = seqs[0].tokens.len() - 1;
    // A decode step at the verify's first position, for its logits (the state put back after).
    for (s, &snap) in seqs.iter().zip(&snaps) {
        m.backend.copy_state(s.state, snap)?;
    }
    let chunks: Vec<StepChunk> = seqs
        .iter()
        .map(|s| StepChunk {
            tokens: &s.tokens[pos0..],
            history: &s.tokens[..pos0],
            pos0,
            state: s.state,
            blocks: s.blocks,
            out: OutRows::Last,
        })
        .collect();
    let out = m.step(StepInput {
        chunks: &chunks,
        start: StepStart::Tokens,
        hidden: false,
    })?;
    let (_, cols, decoded) = m
        .backend
        .to_host(out.logits.ok_or_else(|| anyhow!("no logits"))?)?;
    for (s, &snap) in seqs.iter().zip(&snaps) {
        m.backend.copy_state(snap, s.state)?;
    }
    let mut first_rows = Vec::new();
    for _ in 0..REPS {
        let t0 = Instant::now();
        for (s, &snap) in seqs.iter().zip(&snaps) {
            m.backend.copy_state(s.state, snap)?;
        }
        let chunks: Vec<StepChunk> = seqs
            .iter()
            .zip(&rows)
            .map(|(s, r)| StepChunk {
                tokens: r,
                history: &s.tokens[..pos0],
                pos0,
                state: s.state,
                blocks: s.blocks,
                out: OutRows::Tail(k + 1),
            })
            .collect();
        let out = m.step(StepInput {
            chunks: &chunks,
            start: StepStart::Tokens,
            hidden: true,
        })?;
        let logits = out.logits.ok_or_else(|| anyhow!("no logits"))?;
        let (_, _, got) = m.backend.to_host(logits)?;
        verify.push(t0.elapsed().as_secs_f64());
        first_rows = got;

        let t0 = Instant::now();
        let hidden = out.hidden.ok_or_else(|| anyhow!("no hidden states"))?;
        let mut h = hidden;
        let mut tok: Vec<Vec<u32>> = rows.clone();
        let mut pos = pos0;
        for round in 0..k {
            let chunks: Vec<StepChunk> = seqs
                .iter()
                .zip(&tok)
                .map(|(s, t)| StepChunk {
                    tokens: t,
                    history: &[],
                    pos0: pos,
                    state: s.state,
                    blocks: s.blocks,
                    out: OutRows::Last,
                })
                .collect();
            let out = m.step(StepInput {
                chunks: &chunks,
                start: StepStart::Draft(h),
                hidden: true,
            })?;
            let (_, cols, logits) = m
                .backend
                .to_host(out.logits.ok_or_else(|| anyhow!("no draft logits"))?)?;
            pos += if round == 0 { k + 1 } else { 1 };
            tok = (0..batch)
                .map(|i| vec![argmax(&logits[i * cols..(i + 1) * cols])])
                .collect();
            h = out
                .hidden
                .ok_or_else(|| anyhow!("no draft hidden states"))?;
        }
        draft.push(t0.elapsed().as_secs_f64());
        for (s, &snap) in seqs.iter().zip(&snaps) {
            m.backend.copy_state(snap, s.state)?;
        }
    }
    for s in snaps {
        m.backend.free_state(s);
    }
    // Each sequence's first verify row against the decode step's row.
    let (mut diff, mut scale, mut same) = (0f32, 0f32, 0);
    for i in 0..batch {
        let a = &decoded[i * cols..(i + 1) * cols];
        let b = &first_rows[i * (k + 1) * cols..(i * (k + 1) + 1) * cols];
        for (x, y) in a.iter().zip(b) {
            diff = diff.max((x - y).abs());
            scale = scale.max(x.abs());
        }
        same += usize::from(argmax(a) == argmax(b));
    }
    println!(
        "  MTP K={k}: a verify's first row against a decode step at the same position: max |logit \
         difference| {diff:.4} (max |logit| {scale:.2}); the same greedy token in {same} of {batch}"
    );
    let (v, d) = (median(&mut verify), median(&mut draft));
    println!(
        "  MTP K={k}: verify step ({} rows a sequence, its state kept first) median {:.2} ms vs plain decode \
         step {:.2} ms; draft (catch-up over {} rows, {} chained) median {:.2} ms",
        k + 1,
        v * 1e3,
        plain_step * 1e3,
        k + 1,
        k - 1,
        d * 1e3
    );
    let plain = batch as f64 / plain_step;
    let rates: Vec<String> = [0.5f64, 0.7, 0.9]
        .iter()
        .map(|&a| {
            // Tokens a verify step emits: the accepted run of drafts and one drawn token.
            let per_step = (0..=k).map(|i| a.powi(i as i32)).sum::<f64>();
            let tok_s = batch as f64 * per_step / (v + d);
            format!(
                "{a}: {per_step:.2} tokens a step, {tok_s:.1} tok/s ({:.2}x plain)",
                tok_s / plain
            )
        })
        .collect();
    println!("  MTP K={k} at acceptance {}", rates.join("; "));
    Ok(())
}

/// Runs `known` prompts (each the prompt of `prompt_len` tokens and its plain greedy output)
/// through the engine with `k` drafts forced to the known output, batch by batch, re-running a batch
/// with its previous output as the known tokens until every draft is accepted (at most
/// [`FORCED_PASSES`] runs); prints the last run's decode speed, the acceptance and whether the
/// tokens equal the plain ones.
pub fn forced_end_to_end<B: Probe + 'static>(
    model: Model<B>,
    valid_vocab: usize,
    batches: &[(usize, Vec<Vec<u32>>)],
    prompt_len: usize,
    gen_len: usize,
    k: usize,
) -> Result<()> {
    let max_batch = batches.iter().map(|(b, _)| *b).max().unwrap_or(1);
    let len = prompt_len + gen_len + extra_positions(k) + 16;
    let per_seq = len.div_ceil(16) + 1;
    let kv_bytes = max_batch * per_seq * 16 * model.kv_bytes_per_token(B::CACHE_ELEM_BYTES);
    let mut known = HashMap::new();
    let mut waves = Vec::new();
    for (batch, seqs) in batches {
        let mut wave = Vec::new();
        for (i, t) in seqs.iter().enumerate() {
            let req = EngineRequest {
                id: format!("mtp-{batch}-{i}"),
                prompt: t[..prompt_len].to_vec(),
                sampling: SamplingParams::greedy().validated(valid_vocab)?,
                stop: StopParams {
                    max_tokens: Some(gen_len),
                    ignore_eos: true,
                    ..Default::default()
                },
                prompt_logprobs: false,
                cache_salt: Vec::new(),
                checkpoint_at: Vec::new(),
                images: None,
            };
            known.insert(req.key(), t.clone());
            wave.push((req, t[prompt_len..prompt_len + gen_len].to_vec()));
        }
        waves.push((*batch, wave));
    }
    let exec = ForcedDrafts::new(ModelExecutor::new(model), known, None);
    let known = exec.known();
    let engine = start(
        exec,
        None,
        EngineConfig {
            model_name: "bench".into(),
            max_num_seqs: max_batch,
            max_num_batched_tokens: 2048,
            max_model_len: len,
            max_waiting: max_batch,
            default_max_tokens: None,
            valid_vocab,
            eos_ids: Vec::new(),
            block_size: 16,
            kv_cache_memory_bytes: kv_bytes.max(1 << 20),
            enable_prefix_caching: false,
            state_checkpoint_interval: None,
            num_speculative_tokens: k,
        },
    )
    .map_err(|e| anyhow!(e))?;
    for (batch, wave) in waves {
        // Pass 0 drafts the plain decode's tokens. Where a verify row's greedy token differs from
        // the plain decode's (bf16 rounding of other kernels, at near-ties), the next pass drafts
        // the previous pass's own output: each pass agrees with the last one at least one token
        // further, until every draft is the target's own greedy token and is accepted.
        for pass in 0.. {
            let r = run_wave(&engine, &wave)?;
            let converged = r.accepted == r.drafted || pass + 1 == FORCED_PASSES;
            if converged {
                let equal = r
                    .got
                    .iter()
                    .zip(&wave)
                    .filter(|(g, (_, want))| *g == want)
                    .count();
                println!(
                    "batch {batch}, MTP K={k}, drafts forced to the target's greedy tokens ({}): decode \
                     {:.1} tok/s after the last first token ({} tokens in {} steps, {} of {} drafts \
                     accepted); tokens equal to the plain decode's in {equal} of {batch} sequences",
                    match pass {
                        0 => "the plain decode's".to_string(),
                        p => format!("the output of pass {p}, after {p} passes"),
                    },
                    r.tok_s,
                    r.tokens,
                    r.steps,
                    r.accepted,
                    r.drafted,
                );
                break;
            }
            let mut known = known.lock().unwrap_or_else(|e| e.into_inner());
            for ((req, _), got) in wave.iter().zip(&r.got) {
                let mut t = req.prompt.clone();
                t.extend(got);
                known.insert(req.key(), t);
            }
        }
    }
    engine.shutdown();
    Ok(())
}

/// Passes of [`forced_end_to_end`] at most, each drafting the previous pass's output.
const FORCED_PASSES: usize = 64;

/// What one wave of requests gave.
struct WaveRun {
    /// Each request's output tokens.
    got: Vec<Vec<u32>>,
    tokens: usize,
    steps: u64,
    drafted: u64,
    accepted: u64,
    /// Decode tokens/s after the last first token.
    tok_s: f64,
}

/// Submits `wave` at once and reads every stream to its end.
fn run_wave(
    engine: &sanmai_engine::EngineHandle,
    wave: &[(EngineRequest, Vec<u32>)],
) -> Result<WaveRun> {
    let before = engine.metrics();
    let started = Instant::now();
    let streams: Vec<_> = wave
        .iter()
        .map(|(r, _)| engine.submit(r.clone()).map_err(|e| anyhow!("{e:?}")))
        .collect::<Result<_>>()?;
    // Each stream read on its own thread: when its first token came, and its tokens.
    let got: Vec<(f64, Vec<u32>)> = std::thread::scope(|scope| {
        let hs: Vec<_> = streams
            .into_iter()
            .map(|mut s| {
                scope.spawn(move || {
                    let (mut first, mut ids) = (0.0, Vec::new());
                    while let Some(ev) = s.blocking_recv() {
                        if let EngineEvent::Tokens { ids: new, .. } = ev {
                            if ids.is_empty() {
                                first = started.elapsed().as_secs_f64();
                            }
                            ids.extend(new);
                        }
                    }
                    (first, ids)
                })
            })
            .collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let first = got.iter().map(|g| g.0).fold(0.0, f64::max);
    let tokens: usize = got.iter().map(|g| g.1.len()).sum();
    let total = started.elapsed().as_secs_f64();
    let m = engine.metrics();
    Ok(WaveRun {
        tokens,
        steps: m.steps_total - before.steps_total,
        drafted: m.spec_decode_num_draft_tokens_total - before.spec_decode_num_draft_tokens_total,
        accepted: m.spec_decode_num_accepted_tokens_total
            - before.spec_decode_num_accepted_tokens_total,
        tok_s: (tokens - wave.len()) as f64 / (total - first).max(1e-9),
        got: got.into_iter().map(|g| g.1).collect(),
    })
}

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

fn argmax(row: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in row.iter().enumerate() {
        if x > row[best] {
            best = i;
        }
    }
    best as u32
}
