//! `sanmai generate`: one prompt through prefill and decode, printed as text or as a JSON record.

use std::io::Write;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use sanmai_cpu::CpuBackend;
use sanmai_engine::sampler::{token_logprob, SampleRequest, Sampler, SamplerState, SamplingParams};
use sanmai_model::{Backend, Model, SeqChunk};
use sanmai_tokenizer::IncrementalDecoder;
use serde_json::{json, Value};

use crate::load::ModelArgs;

/// Prefill runs in chunks of this many tokens.
pub const PREFILL_CHUNK: usize = 2048;

#[derive(Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The prompt text.
    #[arg(long, conflicts_with = "prompt_ids")]
    pub prompt: Option<String>,
    /// The prompt as comma-separated token ids.
    #[arg(long, value_delimiter = ',')]
    pub prompt_ids: Option<Vec<u32>>,
    /// Wrap the prompt as a user message in the model's chat template.
    #[arg(long)]
    pub chat: bool,
    #[arg(long, default_value_t = 32)]
    pub max_tokens: usize,
    /// 0 is greedy.
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    #[arg(long, default_value_t = 0)]
    pub top_k: i32,
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    #[arg(long)]
    pub seed: Option<u64>,
    #[arg(long, default_value_t = 0.0)]
    pub presence_penalty: f32,
    #[arg(long, default_value_t = 0.0)]
    pub frequency_penalty: f32,
    #[arg(long, default_value_t = 1.0)]
    pub repetition_penalty: f32,
    /// Keep generating past end-of-sequence tokens.
    #[arg(long)]
    pub ignore_eos: bool,
    /// Also report the prompt's log-probabilities.
    #[arg(long)]
    pub echo: bool,
    /// Report this many most likely alternatives per generated token.
    #[arg(long)]
    pub logprobs: Option<usize>,
    /// Print one JSON object instead of streaming text.
    #[arg(long)]
    pub json: bool,
}

/// One sequence's prefill and decode on a model.
pub struct SeqRun<'a> {
    pub model: &'a Model<CpuBackend>,
    pub slot: usize,
    pub pos: usize,
}

impl<'a> SeqRun<'a> {
    pub fn new(model: &'a Model<CpuBackend>) -> Self {
        SeqRun {
            model,
            slot: model.backend.alloc_seq(),
            pos: 0,
        }
    }

    /// Feeds `ids` in prefill chunks; returns the lm_head width and the logits of every fed token when
    /// `all_rows`, else of the last one.
    pub fn feed(&mut self, ids: &[u32], all_rows: bool) -> (usize, Vec<f32>) {
        let m = self.model;
        let (mut width, mut out) = (0, Vec::new());
        for chunk in ids.chunks(PREFILL_CHUNK) {
            let len = chunk.len();
            let seq = SeqChunk {
                slot: self.slot,
                start: 0,
                len,
                pos0: self.pos,
            };
            let rows: Vec<usize> = if all_rows {
                (0..len).collect()
            } else {
                vec![len - 1]
            };
            let step = m.forward(chunk, &[seq], &rows);
            let (_, c, data) = m.backend.to_host(&m.logits(&step.hidden));
            if !all_rows {
                out.clear();
            }
            out.extend(data);
            width = c;
            self.pos += len;
        }
        (width, out)
    }
}

impl Drop for SeqRun<'_> {
    fn drop(&mut self) {
        self.model.backend.free_seq(self.slot);
    }
}

pub fn run(args: GenerateArgs) -> Result<()> {
    let loaded = args.model.load()?;
    let m = &loaded.model;
    let prompt: Vec<u32> = match (&args.prompt, &args.prompt_ids) {
        (_, Some(ids)) => ids.clone(),
        (Some(text), None) => {
            let tok = loaded
                .tokenizer
                .as_ref()
                .context("this model has no tokenizer.json: give the prompt as --prompt-ids")?;
            let text = if args.chat {
                let template = tok
                    .chat_template()
                    .context("the tokenizer has no chat template")?;
                let req = tok.chat_request(json!([{"role": "user", "content": text}]));
                template.render(&req)?
            } else {
                text.clone()
            };
            tok.encode(&text, false)?
        }
        (None, None) => bail!("give a prompt: --prompt TEXT or --prompt-ids 1,2,3"),
    };
    if prompt.is_empty() {
        bail!("the prompt is empty");
    }
    if let Some(&bad) = prompt.iter().find(|&&id| id as usize >= loaded.valid_vocab) {
        bail!(
            "--prompt-ids: token id {bad} is outside the vocabulary ({} tokens)",
            loaded.valid_vocab
        );
    }
    let max_len = m.cfg.max_position_embeddings;
    if prompt.len() >= max_len {
        bail!(
            "the prompt has {} tokens; the model's context is {max_len}",
            prompt.len()
        );
    }
    let params = SamplingParams {
        temperature: args.temperature,
        top_p: args.top_p,
        top_k: args.top_k,
        min_p: args.min_p,
        seed: args.seed,
        presence_penalty: args.presence_penalty,
        frequency_penalty: args.frequency_penalty,
        repetition_penalty: args.repetition_penalty,
        logit_bias: Vec::new(),
        logprobs: args.logprobs,
    };
    params.validate(loaded.valid_vocab)?;
    let sampler = Sampler::new(loaded.valid_vocab);
    let mut state = SamplerState::new(&params, &prompt);

    let mut seq = SeqRun::new(m);
    let started = Instant::now();
    let (width, logits) = seq.feed(&prompt, args.echo);
    let prefill_s = started.elapsed().as_secs_f64();
    let mut prompt_logprobs: Vec<Value> = vec![Value::Null];
    if args.echo {
        for t in 1..prompt.len() {
            let row = &logits[(t - 1) * width..t * width];
            prompt_logprobs.push(json!(token_logprob(row, loaded.valid_vocab, prompt[t])?));
        }
    }
    let mut row = logits[logits.len() - width..].to_vec();

    let mut decoder = loaded
        .tokenizer
        .as_ref()
        .map(|t| IncrementalDecoder::new(t.clone(), true));
    let mut stdout = std::io::stdout().lock();
    let (mut ids, mut lps, mut tops, mut text) =
        (Vec::new(), Vec::new(), Vec::new(), String::new());
    if !args.json && args.echo {
        if let Some(t) = &loaded.tokenizer {
            write!(stdout, "{}", t.decode(&prompt, true)?)?;
        }
    }
    let decode_started = Instant::now();
    while ids.len() < args.max_tokens && prompt.len() + ids.len() < max_len {
        let s = sampler.sample(
            &mut row,
            &mut SampleRequest {
                params: &params,
                state: &mut state,
                allowed: None,
            },
        )?;
        state.accept(s.id);
        ids.push(s.id);
        lps.push(s.logprob);
        tops.push(s.top_logprobs);
        if let Some(d) = decoder.as_mut() {
            let piece = d.step(s.id)?;
            if !args.json && !piece.is_empty() {
                write!(stdout, "{piece}")?;
                stdout.flush()?;
            }
            text.push_str(&piece);
        }
        if !args.ignore_eos && loaded.eos_ids.contains(&s.id) {
            break;
        }
        if ids.len() < args.max_tokens {
            row = seq.feed(&[s.id], false).1;
        }
    }
    if let Some(d) = decoder.as_mut() {
        let rest = d.flush()?;
        if !args.json {
            write!(stdout, "{rest}")?;
        }
        text.push_str(&rest);
    }
    let decode_s = decode_started.elapsed().as_secs_f64();
    tracing::info!(
        prompt_tokens = prompt.len(),
        generated = ids.len(),
        prefill_tok_s = format!("{:.1}", prompt.len() as f64 / prefill_s),
        decode_tok_s = format!("{:.1}", ids.len() as f64 / decode_s.max(1e-9)),
        "done"
    );
    if args.json {
        let mut out = json!({"prompt_ids": prompt, "ids": ids, "logprobs": lps, "text": text});
        if args.echo {
            out["prompt_logprobs"] = json!(prompt_logprobs);
        }
        if args.logprobs.is_some() {
            out["top_logprobs"] = tops
                .iter()
                .map(|t| {
                    t.iter()
                        .map(|(id, lp)| json!({"id": id, "logprob": lp}))
                        .collect::<Value>()
                })
                .collect();
        }
        writeln!(stdout, "{}", serde_json::to_string(&out)?)?;
    } else {
        writeln!(stdout)?;
    }
    Ok(())
}
