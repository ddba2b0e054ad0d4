//! `sanmai bench`: prefill and decode speed of a model on this machine, printed (never asserted).

use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use sanmai_model::{Backend, Model, OutRows, Probe, StepChunk, StepInput, StepStart};

use crate::bench_kernels;
use crate::bench_mtp;
use crate::load::{LoadFormat, Loaded, ModelArgs, OnModel};
use crate::speculative::Speculative;

#[derive(Args, Debug)]
pub struct BenchArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Decode batch sizes to measure.
    #[arg(long, value_delimiter = ',', default_value = "1")]
    pub batch: Vec<usize>,
    /// Prompt lengths of each sequence to measure (each with every batch size).
    #[arg(long, value_delimiter = ',', default_value = "512")]
    pub prompt_len: Vec<usize>,
    /// Tokens decoded per sequence.
    #[arg(long, default_value_t = 128)]
    pub gen_len: usize,
    /// Also measure MTP drafting ('{"method": "mtp", "num_speculative_tokens": K}', as `serve`
    /// takes it): verify and draft step times per batch size, and the engine's decode with drafts
    /// forced to the plain decode's tokens.
    #[arg(long, value_name = "JSON")]
    pub speculative_config: Option<String>,
    /// After each batch size's decode, time each kernel of a decode step replayed from a CUDA graph
    /// (timed events between its kernels, in a recording of their own: the figures above stay
    /// untimed) and print the step by kernel. CUDA only.
    #[arg(long)]
    pub kernel_times: bool,
}

/// Block size of the benchmark's caches.
const BLOCK: usize = 16;
/// Prefill runs in chunks of this many tokens, as the engine's default step budget.
const PREFILL_CHUNK: usize = 2048;
/// Decode steps of each batch size run untimed before the timed ones: a GPU backend runs its first
/// step of a batch size eagerly (its warm-up) and records the second as a graph, one time each, as a
/// running server does on its first steps; the timed steps replay the graph.
const UNTIMED_STEPS: usize = 2;

fn median(v: &mut [f64]) -> f64 {
    v.sort_by(|a, b| a.total_cmp(b));
    v[v.len() / 2]
}

pub fn run(args: BenchArgs) -> Result<()> {
    // Refused before the weights load: pipeline stages run under the server's engine only.
    if let Some(n) = args.model.pipeline_parallel_size.filter(|&n| n > 1) {
        bail!(
            "sanmai bench runs the model on one stage, not --pipeline-parallel-size {n}: serve the \
             stages (`sanmai serve --pipeline-parallel-size {n}`) and measure them with `sanmai bench \
             serve`, whose stage table shows how much they overlap at --concurrency 1 and above"
        );
    }
    args.model.clone().load_then(Bench(args))
}

struct Bench(BenchArgs);

impl OnModel for Bench {
    type Output = ();

    fn run<B: Probe + 'static>(self, loaded: Loaded<B>) -> Result<()> {
        bench(self.0, loaded)
    }
}

/// One step of `chunks` from their tokens (each asking for its last row's logits): the logits on the
/// host, `[chunks, cols]`, and `cols`.
fn step_logits<B: Backend>(m: &Model<B>, chunks: &[StepChunk<'_>]) -> Result<(usize, Vec<f32>)> {
    let out = m.step(StepInput {
        chunks,
        start: StepStart::Tokens,
        hidden: false,
    })?;
    let logits = out
        .logits
        .ok_or_else(|| anyhow::anyhow!("the step returned no logits"))?;
    let (_, cols, values) = m.backend.to_host(logits)?;
    Ok((cols, values))
}

/// A chunk of `tokens` at `pos0` of the sequence `seq` (its tokens from position 0) that asks for its
/// last row.
fn chunk<'a>(
    seq: &'a [u32],
    pos0: usize,
    len: usize,
    state: usize,
    blocks: &'a [u32],
) -> StepChunk<'a> {
    StepChunk {
        tokens: &seq[pos0..pos0 + len],
        history: &seq[..pos0],
        pos0,
        state,
        blocks,
        out: OutRows::Last,
    }
}

fn bench<B: Probe + 'static>(args: BenchArgs, mut loaded: Loaded<B>) -> Result<()> {
    let m = loaded.single("sanmai bench")?;
    if args.prompt_len.contains(&0) || args.gen_len == 0 || args.batch.contains(&0) {
        bail!("--prompt-len, --gen-len and --batch must be positive");
    }
    let k = match &args.speculative_config {
        Some(json) => {
            let k = Speculative::parse(json)?.num_speculative_tokens;
            if m.mtp.is_none() {
                bail!("--speculative-config: the model has no MTP head");
            }
            if args.prompt_len.len() > 1 {
                bail!("--speculative-config measures one --prompt-len at a time");
            }
            k
        }
        None => 0,
    };
    if args.kernel_times {
        if k > 0 {
            bail!("--kernel-times and --speculative-config measure apart: run one, then the other");
        }
        if !m.backend.time_kernels(false)? {
            bail!(
                "--kernel-times: the {} backend launches no kernels to time (use --device cuda)",
                loaded.device
            );
        }
    }
    // Each batch size's sequences (prompt, plain greedy output and the token after it).
    let mut plain = Vec::new();
    let vocab = loaded.valid_vocab as u64;
    println!("model: {} on {}", loaded.name, loaded.device);
    println!("{}", load_line(&args.model, loaded.load_seconds)?);
    let bandwidth = m.backend.copy_bandwidth()?;
    warm_up(&args, &loaded)?;
    let runs = args
        .prompt_len
        .iter()
        .flat_map(|&p| args.batch.iter().map(move |&b| (p, b)));
    for (prompt_len, batch) in runs {
        // Deterministic pseudo-random prompts, distinct per sequence.
        let prompts: Vec<Vec<u32>> = (0..batch as u64)
            .map(|s| {
                (0..prompt_len as u64)
                    .map(|i| ((i * 7919 + s * 104_729 + 13) % vocab) as u32)
                    .collect()
            })
            .collect();
        // Each sequence gets a contiguous run of blocks for its whole length (and the untimed step
        // that records the routing).
        let extra = if k > 0 {
            bench_mtp::extra_positions(k)
        } else if args.kernel_times {
            bench_kernels::STEPS
        } else {
            0
        };
        let per_seq =
            (prompt_len + UNTIMED_STEPS + args.gen_len + 1 + extra).div_ceil(BLOCK) as u32;
        m.init_cache(per_seq as usize * batch, BLOCK)?;
        let seqs_cache: Vec<(usize, Vec<u32>)> = (0..batch as u32)
            .map(|i| {
                Ok((
                    m.backend.alloc_state()?,
                    (i * per_seq..(i + 1) * per_seq).collect(),
                ))
            })
            .collect::<Result<_>>()?;
        let started = Instant::now();
        let mut ttft = Vec::new();
        let mut next = Vec::new();
        for ((state, blocks), p) in seqs_cache.iter().zip(&prompts) {
            let t0 = Instant::now();
            let mut pos = 0;
            let mut last = Vec::new();
            for part in p.chunks(PREFILL_CHUNK) {
                last = step_logits(m, &[chunk(p, pos, part.len(), *state, blocks)])?.1;
                pos += part.len();
            }
            next.push(argmax(&last[..loaded.valid_vocab]));
            ttft.push(t0.elapsed().as_secs_f64());
        }
        let prefill_s = started.elapsed().as_secs_f64();
        let mut steps = Vec::with_capacity(args.gen_len);
        // Each sequence's tokens from position 0 (what a PLE model hashes).
        let mut hist: Vec<Vec<u32>> = prompts.clone();
        let mut decode = Decode {
            seqs: &seqs_cache,
            hist: &mut hist,
            next: &mut next,
            vocab: loaded.valid_vocab,
        };
        for _ in 0..UNTIMED_STEPS {
            decode.step(m)?;
        }
        for _ in 0..args.gen_len {
            let t0 = Instant::now();
            decode.step(m)?;
            steps.push(t0.elapsed().as_secs_f64());
        }
        // One more step, untimed, recording how many distinct experts each MoE layer routed to.
        m.backend.record_routing(true);
        decode.step(m)?;
        let routed = m.backend.take_routing();
        m.backend.record_routing(false);
        let total: f64 = steps.iter().sum();
        let itl = median(&mut steps);
        let decode_tok_s = (batch * args.gen_len) as f64 / total;
        println!(
            "batch {batch}: prefill {:.1} tok/s (TTFT median {:.1} ms, prompt {} tokens) | decode {:.1} tok/s, \
             inter-token latency median {:.2} ms, mean {:.2} ms ({} steps after {UNTIMED_STEPS} untimed)",
            (batch * prompt_len) as f64 / prefill_s,
            median(&mut ttft) * 1e3,
            prompt_len,
            decode_tok_s,
            itl * 1e3,
            total / args.gen_len as f64 * 1e3,
            args.gen_len
        );
        if args.kernel_times {
            bench_kernels::run(m, || decode.step(m), itl)?;
        }
        let context = prompt_len + UNTIMED_STEPS + args.gen_len / 2;
        let bytes = m.decode_step_bytes(batch, context, &routed);
        let ceiling = batch as f64 * bandwidth / bytes.total() as f64;
        let experts = if routed.is_empty() {
            String::new()
        } else {
            format!(
                " for {:.1} distinct experts per MoE layer",
                routed.iter().sum::<usize>() as f64 / routed.len() as f64
            )
        };
        println!(
            "  roofline: {:.3} GB read per decode step (dense weights {:.3} GB, routed experts {:.3} GB{experts}, \
             embedding rows {:.1} KB, state and K/V at context {context} {:.3} GB); copy bandwidth {:.1} GB/s \
             -> ceiling {:.1} tok/s; achieved {:.1}%",
            bytes.total() as f64 / 1e9,
            bytes.dense_weights as f64 / 1e9,
            bytes.routed_experts as f64 / 1e9,
            bytes.embedding_rows as f64 / 1e3,
            bytes.state as f64 / 1e9,
            bandwidth / 1e9,
            ceiling,
            100.0 * decode_tok_s / ceiling
        );
        if k > 0 {
            for (h, &n) in hist.iter_mut().zip(&next) {
                h.push(n);
            }
            let seqs: Vec<bench_mtp::Seq> = seqs_cache
                .iter()
                .zip(&hist)
                .map(|((state, blocks), h)| bench_mtp::Seq {
                    tokens: h,
                    state: *state,
                    blocks,
                })
                .collect();
            bench_mtp::verify_and_draft(m, &seqs, k, itl)?;
            plain.push((batch, hist));
        }
        for (state, _) in seqs_cache {
            m.backend.free_state(state);
        }
    }
    if k > 0 {
        let model = loaded.stages.pop().expect("one stage");
        bench_mtp::forced_end_to_end(
            model,
            loaded.valid_vocab,
            &plain,
            args.prompt_len[0],
            args.gen_len,
            k,
        )?;
    }
    Ok(())
}

/// One untimed prefill of a prompt of the benchmark's longest length and one decode step, so that what a
/// backend does once (lazy uploads, expert address tables, library heuristics) stays out of the
/// first batch size's figures.
fn warm_up<B: Backend>(args: &BenchArgs, loaded: &Loaded<B>) -> Result<()> {
    let m = loaded.single("sanmai bench")?;
    let vocab = loaded.valid_vocab as u64;
    let prompt_len = args.prompt_len.iter().copied().max().unwrap_or(1);
    let prompt: Vec<u32> = (0..prompt_len as u64 + 1)
        .map(|i| ((i * 7919 + 13) % vocab) as u32)
        .collect();
    let per_seq = (prompt.len()).div_ceil(BLOCK);
    m.init_cache(per_seq, BLOCK)?;
    let state = m.backend.alloc_state()?;
    let blocks: Vec<u32> = (0..per_seq as u32).collect();
    let mut pos = 0;
    for part in [&prompt[..prompt_len], &prompt[prompt_len..]] {
        for piece in part.chunks(PREFILL_CHUNK) {
            step_logits(m, &[chunk(&prompt, pos, piece.len(), state, &blocks)])?;
            pos += piece.len();
        }
    }
    m.backend.free_state(state);
    Ok(())
}

/// The benchmark's sequences mid-decode: each one's cache (state slot, blocks), tokens from
/// position 0 and greedy next token.
struct Decode<'a> {
    seqs: &'a [(usize, Vec<u32>)],
    hist: &'a mut Vec<Vec<u32>>,
    next: &'a mut Vec<u32>,
    vocab: usize,
}

impl Decode<'_> {
    /// One decode step of every sequence: its next token appended and run, the greedy token after
    /// it taken.
    fn step<B: Backend>(&mut self, m: &Model<B>) -> Result<()> {
        for (h, &n) in self.hist.iter_mut().zip(self.next.iter()) {
            h.push(n);
        }
        let chunks: Vec<StepChunk> = self
            .seqs
            .iter()
            .zip(self.hist.iter())
            .map(|((state, blocks), h)| chunk(h, h.len() - 1, 1, *state, blocks))
            .collect();
        let (c, logits) = step_logits(m, &chunks)?;
        for (i, n) in self.next.iter_mut().enumerate() {
            *n = argmax(&logits[i * c..i * c + self.vocab]);
        }
        Ok(())
    }
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

/// How long the weights took to load and, for a checkpoint, how long its safetensors files take to
/// read again (from the page cache, where the load left them): what of the load is the conversion
/// (dequantizing, packing, uploading) rather than the reading.
fn load_line(model: &ModelArgs, load_seconds: f64) -> Result<String> {
    let Some(dir) = model
        .model
        .as_ref()
        .filter(|_| model.load_format != LoadFormat::Dummy)
    else {
        return Ok(format!("load: {load_seconds:.2} s"));
    };
    let mut files: Vec<_> = std::fs::read_dir(dir)
        .with_context(|| format!("--model {}", dir.display()))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "safetensors"))
        .collect();
    files.sort();
    let started = Instant::now();
    let mut bytes = 0u64;
    let mut buf = vec![0u8; 16 << 20];
    for f in &files {
        let mut file =
            std::fs::File::open(f).with_context(|| format!("reading {}", f.display()))?;
        loop {
            let n = std::io::Read::read(&mut file, &mut buf)
                .with_context(|| format!("reading {}", f.display()))?;
            if n == 0 {
                break;
            }
            bytes += n as u64;
        }
    }
    let read = started.elapsed().as_secs_f64();
    let size = match bytes {
        b if b >= 1 << 30 => format!("{:.2} GiB", b as f64 / (1u64 << 30) as f64),
        b => format!("{:.2} MiB", b as f64 / (1u64 << 20) as f64),
    };
    Ok(format!(
        "load: {load_seconds:.2} s; reading the checkpoint's {size} again from the page cache: \
         {read:.3} s ({:.1} GB/s)",
        bytes as f64 / read.max(1e-9) / 1e9
    ))
}
