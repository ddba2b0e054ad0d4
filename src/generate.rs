//! `sanmai generate`: one prompt through prefill and decode, printed as text or as a JSON record.

use std::io::Write;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use sanmai_engine::api::{EngineEvent, EngineRequest, FinishReason, StopParams};
use sanmai_engine::sampler::SamplingParams;
use serde_json::{json, Value};

use crate::engine_args::EngineArgs;
use crate::load::{Loaded, ModelArgs, OnModel};
use sanmai_model::Backend;

#[derive(Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
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

pub fn run(args: GenerateArgs) -> Result<()> {
    args.model.clone().load_then(Generate(args))
}

struct Generate(GenerateArgs);

impl OnModel for Generate {
    type Output = ();

    fn run<B: sanmai_model::Probe + 'static>(self, loaded: Loaded<B>) -> Result<()> {
        generate(self.0, loaded)
    }
}

fn generate<B: Backend + 'static>(args: GenerateArgs, loaded: Loaded<B>) -> Result<()> {
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
        // Always ask: the chosen token's log-probability is reported; alternatives only with --logprobs.
        logprobs: Some(args.logprobs.unwrap_or(0)),
    };
    let params = params.validated(loaded.valid_vocab)?;
    let tokenizer = loaded.tokenizer.clone();
    let engine = args
        .engine
        .start(loaded, args.model.default_served_name())?;
    let request = EngineRequest {
        id: "generate-0".into(),
        prompt: prompt.clone(),
        sampling: params,
        stop: StopParams {
            max_tokens: Some(args.max_tokens),
            ignore_eos: args.ignore_eos,
            ..Default::default()
        },
        prompt_logprobs: args.echo,
        cache_salt: Vec::new(),
        checkpoint_at: Vec::new(),
        images: None,
    };
    let started = Instant::now();
    let mut stream = engine.submit(request)?;
    let mut stdout = std::io::stdout().lock();
    if !args.json && args.echo {
        if let Some(t) = &tokenizer {
            write!(stdout, "{}", t.decode(&prompt, true)?)?;
        }
    }
    let (mut ids, mut lps, mut tops, mut text) =
        (Vec::new(), Vec::new(), Vec::new(), String::new());
    let mut prompt_logprobs = Vec::new();
    let mut first_token = None;
    let mut failure = None;
    while let Some(ev) = stream.blocking_recv() {
        match ev {
            EngineEvent::PromptLogprobs(p) => {
                prompt_logprobs = p
                    .into_iter()
                    .map(|x| x.map_or(Value::Null, |t| json!(t.logprob)))
                    .collect()
            }
            EngineEvent::Tokens {
                ids: new,
                text: piece,
                logprobs,
            } => {
                first_token.get_or_insert_with(Instant::now);
                ids.extend(new);
                for lp in logprobs {
                    lps.push(lp.logprob);
                    tops.push(lp.top);
                }
                if !args.json && !piece.is_empty() {
                    write!(stdout, "{piece}")?;
                    stdout.flush()?;
                }
                text.push_str(&piece);
            }
            EngineEvent::Finished { reason, .. } => {
                if let FinishReason::Error(e) = reason {
                    failure = Some(e);
                }
            }
        }
    }
    if let Some(e) = failure {
        bail!("generation failed: {e}");
    }
    let ttft = first_token.map_or(0.0, |t| (t - started).as_secs_f64());
    let decode_s = first_token.map_or(0.0, |t| t.elapsed().as_secs_f64());
    tracing::info!(
        prompt_tokens = prompt.len(),
        generated = ids.len(),
        ttft_ms = format!("{:.1}", ttft * 1e3),
        decode_tok_s = format!(
            "{:.1}",
            ids.len().saturating_sub(1) as f64 / decode_s.max(1e-9)
        ),
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
    engine.shutdown();
    Ok(())
}
