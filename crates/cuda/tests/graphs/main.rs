//! CUDA graphs for decode steps: a backend that records and replays decode steps
//! ([`CudaBackend::set_graph_batch_sizes`]) against one that runs every step eagerly, on the committed
//! tiny fixtures, through `Model::step`: decode steps that return every sequence's row (embedding
//! to logits in one recording) and decode steps that return no rows (a recording of their own).
//!
//! Both run the same kernels on the same inputs, so their outputs must agree bit for bit. A second
//! eager backend is the control: if eager runs are not bitwise reproducible the graph run may differ
//! from the eager one by no more than the control does. Each batch size runs two rounds of fresh
//! sequences (other prompt lengths, other block ids): the second round replays the graphs the first
//! captured, at context lengths and block tables the capture never saw. Batch 3 is not a recorded
//! size and must run eagerly. A long-context case crosses [`MIN_GRAPH_SPAN`] and checks the larger span.
//!
//! The qwen4_exp fixtures (QSA, PLE and both with hyper-connections; PLE tables included) run the same
//! way, each step's PLE rows hashed from the sequences' tokens: the first round's sequences
//! cross from contexts within the indexer's topk (every position selected) to contexts past it during
//! the replayed steps, the second round replays at other contexts. The eager control traces its QSA
//! selections (a traced backend runs eagerly): every decode row selects `min(topk, context)` distinct
//! positions of its context, all of them while the context fits topk.
//!
//! With kernel timing on, the timed recordings equal eager too and read back a time per kernel.
//!
//! The ignored tests print decode step times eager against graph (`GRAPH_BENCH` lines) on the fixtures
//! and on `configs/models/qwen3.5-35b-a3b.json` with dummy weights and fewer layers
//! (`SANMAI_GRAPH_BENCH_LAYERS`, default 4). Without a GPU every test prints `skipped:` and passes.

#[path = "../support/options.rs"]
mod options;

use std::path::{Path, PathBuf};
use std::time::Instant;

use sanmai_config::ModelConfig;
use sanmai_cuda::{CudaBackend, CudaTensor, GraphStats, MIN_GRAPH_SPAN};
use sanmai_model::{
    Backend, Model, OutRows, PleSource, StepChunk, StepInput, StepOutput, StepStart,
};
use sanmai_weights::{Checkpoint, Dummy};

const BLOCK: usize = 16;
const NUM_BLOCKS: usize = 1536;
const STEPS: usize = 5;
const FIXTURES: [&str; 3] = [
    "qwen3_next_tiny",
    "qwen3_5_moe_text_tiny",
    "qwen3_5_moe_tiny",
];
/// The qwen4_exp fixtures: QSA, PLE, and both with hyper-connections.
const QWEN4_EXP: [&str; 3] = [
    "qwen4_exp_qsa_tiny",
    "qwen4_exp_ple_tiny",
    "qwen4_exp_all_tiny",
];
/// Decode steps per qwen4_exp case: a warm-up, a capture and six replays.
const QWEN4_STEPS: usize = 8;

/// A directory of the repository: under the working directory (a prebuilt binary run from the
/// repository root), else next to this crate.
fn repo_path(rel: &str) -> PathBuf {
    let here = PathBuf::from(rel);
    if here.exists() {
        return here;
    }
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../..")
        .join(rel)
}

fn fixture(name: &str) -> PathBuf {
    std::env::var_os("SANMAI_FIXTURES")
        .map(PathBuf::from)
        .filter(|d| d.join(name).is_dir())
        .unwrap_or_else(|| repo_path("tests/fixtures"))
        .join(name)
}

/// A fixture with its PLE table when its config has a `ple` block.
fn load_fixture(name: &str, b: CudaBackend) -> Model<CudaBackend> {
    let dir = fixture(name);
    let cfg = ModelConfig::from_file(&dir.join("config.json")).unwrap();
    let ckpt = Checkpoint::open(&dir).unwrap();
    let ple = cfg
        .ple
        .as_ref()
        .map(|p| PleSource::open(&dir, p, false).unwrap());
    let m = Model::load_with_ple(cfg, &ckpt, b, ple).unwrap();
    m.init_cache(NUM_BLOCKS, BLOCK).unwrap();
    m
}

/// A sequence's caches, length and tokens (the PLE rows hash them).
struct Seq {
    state: usize,
    blocks: Vec<u32>,
    len: usize,
    tokens: Vec<u32>,
}

/// Hands out block ids in a scattered order (so block tables are not ranges) and state slots from
/// a list allocated up front (the slot pools never grow during the test).
struct Alloc {
    blocks: Vec<u32>,
    states: Vec<usize>,
}

impl Alloc {
    fn new(m: &Model<CudaBackend>, states: usize) -> Self {
        let n = NUM_BLOCKS as u32;
        let mut blocks: Vec<u32> = (0..n).map(|i| (i * 7 + 3) % n).collect();
        blocks.reverse();
        Alloc {
            blocks,
            states: (0..states)
                .map(|_| m.backend.alloc_state().unwrap())
                .collect(),
        }
    }

    fn seq(&mut self, positions: usize) -> Seq {
        let nb = positions.div_ceil(BLOCK);
        let at = self.blocks.len() - nb;
        Seq {
            state: self.states.pop().expect("enough state slots"),
            blocks: self.blocks.split_off(at),
            len: 0,
            tokens: Vec::new(),
        }
    }
}

fn prompt(len: usize, salt: usize, vocab: usize) -> Vec<u32> {
    (0..len)
        .map(|i| ((i * 131 + salt * 977 + 17) % vocab) as u32)
        .collect()
}

/// Runs one step of `seqs`, chunk `i` taking `tokens[i]` and returning `out[i]` (each sequence's
/// tokens so far are the PLE hash's history); advances the sequences.
fn run_step(
    m: &Model<CudaBackend>,
    seqs: &mut [Seq],
    tokens: &[&[u32]],
    out: OutRows,
) -> StepOutput<CudaTensor> {
    let chunks: Vec<StepChunk<'_>> = seqs
        .iter()
        .zip(tokens)
        .map(|(s, t)| StepChunk {
            tokens: t,
            history: &s.tokens,
            pos0: s.len,
            state: s.state,
            blocks: &s.blocks,
            out,
        })
        .collect();
    let o = m
        .step(StepInput {
            chunks: &chunks,
            start: StepStart::Tokens,
            hidden: true,
        })
        .unwrap();
    for (s, t) in seqs.iter_mut().zip(tokens) {
        s.tokens.extend_from_slice(t);
        s.len += t.len();
    }
    o
}

/// Prefills every sequence with its prompt in one step.
fn prefill(m: &Model<CudaBackend>, seqs: &mut [Seq], prompts: &[Vec<u32>]) {
    let tokens: Vec<&[u32]> = prompts.iter().map(|p| p.as_slice()).collect();
    let out = run_step(m, seqs, &tokens, OutRows::Last);
    m.backend.to_host(out.hidden.unwrap()).unwrap();
}

/// One decode step (one token per sequence, with its PLE rows when the model has PLE): hidden
/// states and logits of every sequence on the host (`with_logits`: one recording from the
/// embedding to the logits), or a step that returns no rows (its own recording; both empty).
fn decode(
    m: &Model<CudaBackend>,
    seqs: &mut [Seq],
    ids: &[u32],
    with_logits: bool,
) -> (Vec<f32>, Vec<f32>) {
    let tokens: Vec<&[u32]> = ids.iter().map(std::slice::from_ref).collect();
    let out = if with_logits {
        OutRows::Last
    } else {
        OutRows::None
    };
    let o = run_step(m, seqs, &tokens, out);
    let host = |t: Option<CudaTensor>| t.map_or_else(Vec::new, |t| m.backend.to_host(t).unwrap().2);
    (host(o.hidden), host(o.logits))
}

fn argmax_rows(logits: &[f32], rows: usize) -> Vec<u32> {
    let w = logits.len() / rows.max(1);
    (0..rows)
        .map(|r| {
            let row = &logits[r * w..(r + 1) * w];
            (0..w).fold(0, |b, i| if row[i] > row[b] { i } else { b }) as u32
        })
        .collect()
}

fn max_abs(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "output sizes differ");
    a.iter()
        .zip(b)
        .map(|(x, y)| if x == y { 0.0 } else { (x - y).abs() })
        .fold(0.0, f32::max)
}

fn delta(after: GraphStats, before: GraphStats) -> GraphStats {
    GraphStats {
        eager: after.eager - before.eager,
        warmups: after.warmups - before.warmups,
        captures: after.captures - before.captures,
        replays: after.replays - before.replays,
        failures: after.failures - before.failures,
    }
}

/// Three copies of a fixture: graphs on, eager, eager (the control).
fn trio(name: &str, test: &str) -> Option<[Model<CudaBackend>; 3]> {
    let bs = [
        options::backend(test)?,
        options::backend(test)?,
        options::backend(test)?,
    ];
    let [g, e, c] = bs.map(|b| load_fixture(name, b));
    e.backend.set_graph_batch_sizes(&[]);
    c.backend.set_graph_batch_sizes(&[]);
    Some([g, e, c])
}

/// Runs the same decode steps on the three models; returns the largest difference graph − eager
/// and control − eager over hidden states and logits.
fn lockstep(
    ms: &[Model<CudaBackend>; 3],
    seqs: &mut [Vec<Seq>; 3],
    steps: usize,
    with_logits: bool,
    first: &[u32],
) -> (f32, f32) {
    let (mut dg, mut dc) = (0f32, 0f32);
    let mut ids = first.to_vec();
    for _ in 0..steps {
        let [g, e, c] = ms;
        let [sg, se, sc] = seqs;
        let og = decode(g, sg, &ids, with_logits);
        let oe = decode(e, se, &ids, with_logits);
        let oc = decode(c, sc, &ids, with_logits);
        dg = dg.max(max_abs(&og.0, &oe.0)).max(max_abs(&og.1, &oe.1));
        dc = dc.max(max_abs(&oc.0, &oe.0)).max(max_abs(&oc.1, &oe.1));
        ids = if with_logits {
            argmax_rows(&oe.1, ids.len())
        } else {
            ids.iter().map(|&t| (t * 3 + 1) % 64).collect()
        };
    }
    (dg, dc)
}

fn check_equal(what: &str, dg: f32, dc: f32) {
    if dc == 0.0 {
        assert_eq!(dg, 0.0, "{what}: graph replay differs from eager by {dg}");
    } else {
        assert!(
            dg <= dc,
            "{what}: graph replay differs from eager by {dg}, more than eager from eager ({dc})"
        );
    }
}

#[test]
fn graph_replay_equals_eager() {
    for name in FIXTURES {
        let Some(ms) = trio(name, "graph_replay_equals_eager") else {
            return;
        };
        let vocab = ms[0].cfg.vocab_size;
        let mut allocs = [0, 1, 2].map(|i| Alloc::new(&ms[i], 48));
        for round in 0..2 {
            for batch in [1, 2, 3, 4, 8] {
                let prompts: Vec<Vec<u32>> = (0..batch)
                    .map(|i| prompt(5 + 3 * i + 11 * round, 10 * round + i, vocab))
                    .collect();
                let mut seqs = [0, 1, 2].map(|k| {
                    prompts
                        .iter()
                        .map(|p| allocs[k].seq(p.len() + STEPS + 5))
                        .collect::<Vec<_>>()
                });
                for (m, s) in ms.iter().zip(seqs.iter_mut()) {
                    prefill(m, s, &prompts);
                }
                let before = ms[0].backend.graph_stats();
                let first: Vec<u32> = (0..batch as u32).map(|i| i + 1).collect();
                let (dg, dc) = lockstep(&ms, &mut seqs, STEPS, true, &first);
                let d = delta(ms[0].backend.graph_stats(), before);
                println!(
                    "GRAPH fixture={name} round={round} batch={batch} steps={STEPS} \
                     max_abs_graph_vs_eager={dg:e} max_abs_eager_vs_eager={dc:e} warmups={} \
                     captures={} replays={} eager={} failures={}",
                    d.warmups, d.captures, d.replays, d.eager, d.failures
                );
                let what = format!("{name} round {round} batch {batch}");
                check_equal(&what, dg, dc);
                assert_eq!(
                    d.failures,
                    0,
                    "{what}: a capture failed: {:?}",
                    ms[0].backend.graph_failure()
                );
                let expect = match (batch, round) {
                    (3, _) => (0, 0, 0, STEPS as u64),
                    (_, 0) => (1, 1, STEPS as u64 - 1, 0),
                    // Fresh sequences, other lengths and block tables: the first round's graph.
                    _ => (0, 0, STEPS as u64, 0),
                };
                assert_eq!(
                    (d.warmups, d.captures, d.replays, d.eager),
                    expect,
                    "{what}: (warm-ups, captures, replays, eager steps)"
                );
                if batch == 4 && round == 1 {
                    // The region of decode steps that return no rows: warm-up, capture, replays;
                    // then a step with logits reads the caches those steps wrote.
                    let before = ms[0].backend.graph_stats();
                    let (dg, dc) = lockstep(&ms, &mut seqs, 4, false, &first);
                    let d = delta(ms[0].backend.graph_stats(), before);
                    let (dg1, dc1) = lockstep(&ms, &mut seqs, 1, true, &first);
                    let (dg, dc) = (dg.max(dg1), dc.max(dc1));
                    println!(
                        "GRAPH fixture={name} no_rows batch=4 steps=4+1 \
                         max_abs_graph_vs_eager={dg:e} max_abs_eager_vs_eager={dc:e} \
                         captures={} replays={}",
                        d.captures, d.replays
                    );
                    check_equal(&format!("{name} no-row steps"), dg, dc);
                    assert_eq!((d.warmups, d.captures, d.replays), (1, 1, 3));
                }
            }
        }
    }
}

/// Kernel timing on ([`CudaBackend::time_kernels`]): the timed recordings (an event node after each
/// kernel) compute what eager steps do, and the last replay reads back one positive time per kernel
/// launch, each named after a loaded kernel.
#[test]
fn timed_graph_replay_equals_eager() {
    let name = "qwen3_5_moe_text_tiny";
    let Some(ms) = trio(name, "timed_graph_replay_equals_eager") else {
        return;
    };
    ms[0].backend.time_kernels(true).unwrap();
    let vocab = ms[0].cfg.vocab_size;
    let mut allocs = [0, 1, 2].map(|i| Alloc::new(&ms[i], 4));
    let prompts: Vec<Vec<u32>> = (0..2).map(|i| prompt(7 + 5 * i, i, vocab)).collect();
    let mut seqs = [0, 1, 2].map(|k| {
        prompts
            .iter()
            .map(|p| allocs[k].seq(p.len() + STEPS + 1))
            .collect::<Vec<_>>()
    });
    for (m, s) in ms.iter().zip(seqs.iter_mut()) {
        prefill(m, s, &prompts);
    }
    let before = ms[0].backend.graph_stats();
    let (dg, dc) = lockstep(&ms, &mut seqs, STEPS, true, &[1, 2]);
    let d = delta(ms[0].backend.graph_stats(), before);
    check_equal(&format!("{name} timed"), dg, dc);
    assert_eq!(
        (d.captures, d.replays, d.failures),
        (1, STEPS as u64 - 1, 0)
    );
    let times = ms[0].backend.kernel_times().unwrap();
    let known = ms[0].backend.gpu().kernels().names();
    let sum: f64 = times.iter().map(|t| t.1).sum();
    println!(
        "GRAPH_KERNELS fixture={name} batch=2 launches={} sum_us={sum:.1} max_abs_graph_vs_eager={dg:e}",
        times.len()
    );
    assert!(times.len() > 10, "{} kernels timed", times.len());
    for (k, us) in &times {
        assert!(known.contains(&k.as_str()), "{k} is not a loaded kernel");
        assert!(us.is_finite() && *us >= 0.0, "{k}: {us} us");
    }
    assert!(sum > 0.0);
    // The persistent layer launches' traces in the same replay (this fixture's batch of 2 runs none):
    // each a layer kernel's, its marks from its start to its last block's exit in time order.
    for (k, t) in ms[0].backend.layer_traces().unwrap() {
        assert!(sanmai_cuda::layer_phases(&k).is_some(), "{k} has no phases");
        assert!(t[0] > 0 && t[0] <= t[1] && t[1] <= t[9], "{k}: {t:?}");
    }
    // Off again: the recordings are dropped and nothing is timed.
    ms[0].backend.time_kernels(false).unwrap();
    assert!(ms[0].backend.kernel_times().unwrap().is_empty());
}

/// A sequence past [`MIN_GRAPH_SPAN`] next to a short one: a recording of the larger span (more
/// attention splits than either context needs eagerly) equals eager.
#[test]
fn graph_long_context_equals_eager() {
    long_context_equals_eager("qwen3_5_moe_text_tiny", "graph_long_context_equals_eager");
}

/// QSA past [`MIN_GRAPH_SPAN`]: a long selecting sequence next to a short dense one, recorded at the
/// larger span (score rows of the span, blocks past each context idle), equals eager.
#[test]
fn graph_qsa_long_context_equals_eager() {
    long_context_equals_eager("qwen4_exp_qsa_tiny", "graph_qsa_long_context_equals_eager");
}

/// Fixture `name`: a prompt of [`MIN_GRAPH_SPAN`] + 300 tokens next to one of 9, four decode steps
/// recorded at the larger span, against eager.
fn long_context_equals_eager(name: &str, test: &str) {
    let Some(ms) = trio(name, test) else {
        return;
    };
    let vocab = ms[0].cfg.vocab_size;
    let long = MIN_GRAPH_SPAN + 300;
    let prompts = vec![prompt(long, 1, vocab), prompt(9, 2, vocab)];
    let mut allocs = [0, 1, 2].map(|i| Alloc::new(&ms[i], 4));
    let mut seqs = [0, 1, 2].map(|k| {
        prompts
            .iter()
            .map(|p| allocs[k].seq(p.len() + 8))
            .collect::<Vec<_>>()
    });
    for (m, s) in ms.iter().zip(seqs.iter_mut()) {
        prefill(m, s, &prompts);
    }
    let before = ms[0].backend.graph_stats();
    let (dg, dc) = lockstep(&ms, &mut seqs, 4, true, &[5, 6]);
    let d = delta(ms[0].backend.graph_stats(), before);
    println!(
        "GRAPH fixture={name} long_context={long} batch=2 steps=4 max_abs_graph_vs_eager={dg:e} \
         max_abs_eager_vs_eager={dc:e} captures={} replays={}",
        d.captures, d.replays
    );
    assert_eq!(d.failures, 0, "{:?}", ms[0].backend.graph_failure());
    check_equal(&format!("{name} long context"), dg, dc);
    assert_eq!((d.warmups, d.captures, d.replays), (1, 1, 3));
}

/// Checks the eager control's QSA selections of `steps` decode steps of `batch` sequences: each row
/// selects `min(topk, context)` distinct positions of its context, ascending, every position while
/// the context fits topk. Returns the rows within topk and the rows past it.
fn check_trace(m: &Model<CudaBackend>, batch: usize, steps: usize) -> (usize, usize) {
    let t = m.backend.take_qsa_trace();
    let Some(topk) = m.cfg.qsa.as_ref().map(|q| q.index_topk) else {
        assert!(t.is_empty(), "selections traced without QSA");
        return (0, 0);
    };
    assert!(
        !t.is_empty() && t.len().is_multiple_of(batch * steps),
        "{} traced rows for {steps} steps of {batch} sequences",
        t.len()
    );
    let (mut dense, mut selecting) = (0, 0);
    for (layer, slot, pos, set) in &t {
        let ctx = pos + 1;
        let what = format!("layer {layer} slot {slot} position {pos}");
        assert_eq!(set.len(), ctx.min(topk), "{what}: set size");
        assert!(set.windows(2).all(|w| w[0] < w[1]), "{what}: not ascending");
        assert!(
            set.last().is_some_and(|&p| p < ctx),
            "{what}: beyond the context"
        );
        if ctx <= topk {
            dense += 1;
        } else {
            selecting += 1;
        }
    }
    (dense, selecting)
}

/// The prompt lengths of a qwen4_exp case: round 0 ends its prompts just within topk (the replayed
/// steps cross it), round 1 starts past it with one short sequence (other contexts than captured).
fn qwen4_prompt_len(topk: usize, round: usize, i: usize) -> usize {
    match (round, i) {
        (0, _) => topk - 4 - i % 4,
        (_, 1) => 9,
        _ => topk + 5 + 3 * i,
    }
}

#[test]
fn graph_qwen4_exp_equals_eager() {
    for name in QWEN4_EXP {
        let Some(ms) = trio(name, "graph_qwen4_exp_equals_eager") else {
            return;
        };
        let vocab = ms[0].cfg.vocab_size;
        let topk = ms[0].cfg.qsa.as_ref().map_or(32, |q| q.index_topk);
        // The control records selections (and so runs eagerly, as it does anyway).
        ms[2].backend.trace_qsa(true);
        let mut allocs = [0, 1, 2].map(|i| Alloc::new(&ms[i], 32));
        let (mut dense, mut selecting) = (0, 0);
        for round in 0..2 {
            for batch in [1, 2, 3, 4] {
                let prompts: Vec<Vec<u32>> = (0..batch)
                    .map(|i| prompt(qwen4_prompt_len(topk, round, i), 10 * round + i, vocab))
                    .collect();
                let mut seqs = [0, 1, 2].map(|k| {
                    prompts
                        .iter()
                        .map(|p| allocs[k].seq(p.len() + QWEN4_STEPS + 4))
                        .collect::<Vec<_>>()
                });
                for (m, s) in ms.iter().zip(seqs.iter_mut()) {
                    prefill(m, s, &prompts);
                }
                ms[2].backend.take_qsa_trace();
                let before = ms[0].backend.graph_stats();
                let first: Vec<u32> = (0..batch as u32).map(|i| i + 1).collect();
                let (dg, dc) = lockstep(&ms, &mut seqs, QWEN4_STEPS, true, &first);
                let d = delta(ms[0].backend.graph_stats(), before);
                let (nd, ns) = check_trace(&ms[2], batch, QWEN4_STEPS);
                dense += nd;
                selecting += ns;
                println!(
                    "GRAPH fixture={name} round={round} batch={batch} steps={QWEN4_STEPS} topk={topk} \
                     max_abs_graph_vs_eager={dg:e} max_abs_eager_vs_eager={dc:e} warmups={} \
                     captures={} replays={} eager={} failures={} traced_rows_within_topk={nd} \
                     traced_rows_past_topk={ns}",
                    d.warmups, d.captures, d.replays, d.eager, d.failures
                );
                let what = format!("{name} round {round} batch {batch}");
                check_equal(&what, dg, dc);
                assert_eq!(
                    d.failures,
                    0,
                    "{what}: a capture failed: {:?}",
                    ms[0].backend.graph_failure()
                );
                let steps = QWEN4_STEPS as u64;
                let expect = match (batch, round) {
                    (3, _) => (0, 0, 0, steps),
                    (_, 0) => (1, 1, steps - 1, 0),
                    _ => (0, 0, steps, 0),
                };
                assert_eq!(
                    (d.warmups, d.captures, d.replays, d.eager),
                    expect,
                    "{what}: (warm-ups, captures, replays, eager steps)"
                );
            }
        }
        if ms[0].cfg.qsa.is_some() {
            assert!(
                dense > 0 && selecting > 0,
                "{name}: the decode rows cover both sides of topk ({dense} within, {selecting} past)"
            );
        }
    }
}

/// Mean decode step time (a step to the logits, hidden states and logits to the host) over `steps`
/// steps at `batch`.
fn time_steps(m: &Model<CudaBackend>, alloc: &mut Alloc, batch: usize, steps: usize) -> f64 {
    let vocab = m.cfg.vocab_size;
    let prompts: Vec<Vec<u32>> = (0..batch).map(|i| prompt(32, i, vocab)).collect();
    let mut seqs: Vec<Seq> = prompts
        .iter()
        .map(|p| alloc.seq(p.len() + steps + 8))
        .collect();
    prefill(m, &mut seqs, &prompts);
    let mut ids: Vec<u32> = (0..batch as u32).collect();
    let mut t0 = Instant::now();
    for i in 0..steps + 3 {
        if i == 3 {
            // Warm-up and capture done.
            t0 = Instant::now();
        }
        let (_, l) = decode(m, &mut seqs, &ids, true);
        ids = argmax_rows(&l, batch);
    }
    t0.elapsed().as_secs_f64() / steps as f64
}

fn bench(label: &str, m: &Model<CudaBackend>, steps: usize) {
    let mut alloc = Alloc::new(m, 40);
    for batch in [1, 8] {
        m.backend.set_graph_batch_sizes(&[]);
        let eager = time_steps(m, &mut alloc, batch, steps);
        m.backend.set_graph_batch_sizes(&[batch]);
        let graph = time_steps(m, &mut alloc, batch, steps);
        let st = m.backend.graph_stats();
        println!(
            "GRAPH_BENCH model={label} batch={batch} steps={steps} eager_us={:.1} graph_us={:.1} \
             speedup={:.2} replays={} failures={}",
            eager * 1e6,
            graph * 1e6,
            eager / graph,
            st.replays,
            st.failures
        );
    }
}

#[test]
#[ignore = "timing: run explicitly (scripts/gpu_check.sh does)"]
fn graph_decode_timing_fixtures() {
    for name in FIXTURES {
        let Some(b) = options::backend("graph_decode_timing_fixtures") else {
            return;
        };
        bench(name, &load_fixture(name, b), 50);
    }
}

#[test]
#[ignore = "timing: run explicitly (scripts/gpu_check.sh does)"]
fn graph_decode_timing_dummy() {
    let Some(b) = options::backend("graph_decode_timing_dummy") else {
        return;
    };
    let layers: usize = std::env::var("SANMAI_GRAPH_BENCH_LAYERS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(4);
    let path = repo_path("configs/models/qwen3.5-35b-a3b.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let tc = v.get_mut("text_config").expect("a text_config block");
    tc["num_hidden_layers"] = layers.into();
    tc["mtp_num_hidden_layers"] = 0.into();
    let cfg = ModelConfig::from_value(&v, "qwen3.5-35b-a3b.json").unwrap();
    let t = Instant::now();
    let m = Model::load(cfg, &Dummy::new(7), b).unwrap();
    m.init_cache(NUM_BLOCKS, BLOCK).unwrap();
    println!(
        "GRAPH_BENCH model=qwen3.5-35b-a3b layers={layers} dummy bf16 weights={:.2} GiB loaded in {:.1} s",
        m.backend.memory().weights as f64 / (1u64 << 30) as f64,
        t.elapsed().as_secs_f64()
    );
    bench(&format!("qwen3.5-35b-a3b-{layers}layers"), &m, 30);
}

/// The 125B qwen4_exp config (dummy weights in its quantization mix; 4 layers, the last a QSA layer,
/// 64 experts, no MTP, PLE or vision, topk 24): one sequence decoding from within topk, where its
/// QSA layer runs in one launch, to past it, where it selects. The recordings equal eager bit for
/// bit on both sides, and the step within topk and the one past it are recorded apart (the one
/// launch in the first's timed kernels only).
#[test]
fn graph_qsa_one_launch_equals_eager() {
    let test = "graph_qsa_one_launch_equals_eager";
    let (Some(bg), Some(be)) = (options::backend(test), options::backend(test)) else {
        return;
    };
    let path = repo_path("configs/models/qwen4-exp-125b-a6b.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let topk = 24;
    v["num_hidden_layers"] = 4.into();
    v["mtp_num_hidden_layers"] = 0.into();
    v["num_experts"] = 64.into();
    v["qsa"]["index_topk"] = topk.into();
    for k in ["ple", "vision_config"] {
        v.as_object_mut().unwrap().remove(k);
    }
    let [g, e] = [bg, be].map(|b| {
        let cfg = ModelConfig::from_value(&v, "qwen4-exp-125b-a6b.json").unwrap();
        let m = Model::load(cfg, &Dummy::new(11), b).unwrap();
        m.init_cache(NUM_BLOCKS, BLOCK).unwrap();
        m
    });
    e.backend.set_graph_batch_sizes(&[]);
    g.backend.time_kernels(true).unwrap();
    let vocab = g.cfg.vocab_size;
    let p = prompt(topk - 4, 3, vocab);
    let mut seqs = [&g, &e].map(|m| {
        let mut s = vec![Alloc::new(m, 1).seq(topk + 8)];
        prefill(m, &mut s, std::slice::from_ref(&p));
        s
    });
    let before = g.backend.graph_stats();
    let one_launch = "attn_layer_m1_p8_u3_o6";
    let mut ids = vec![7u32];
    for pos in topk - 4..topk + 4 {
        let og = decode(&g, &mut seqs[0], &ids, true);
        let oe = decode(&e, &mut seqs[1], &ids, true);
        let d = max_abs(&og.0, &oe.0).max(max_abs(&og.1, &oe.1));
        println!("GRAPH {test} pos={pos} max_abs_graph_vs_eager={d:e}");
        assert_eq!(
            d, 0.0,
            "{test}: position {pos}: graph replay differs from eager"
        );
        let timed = g.backend.kernel_times().unwrap();
        let took = timed.iter().any(|(k, _)| k == one_launch);
        if pos == topk - 1 {
            assert!(
                took,
                "{test}: position {pos}: the one launch recorded within topk"
            );
        }
        if pos >= topk + 1 {
            assert!(!took, "{test}: position {pos}: no one launch past topk");
        }
        ids = argmax_rows(&oe.1, 1);
    }
    // Within topk: the first step's key (before any one launch ran) and the within-topk key warm up,
    // the second is captured; past topk the first key is captured and replayed.
    let d = delta(g.backend.graph_stats(), before);
    assert_eq!(
        (d.warmups, d.captures, d.replays, d.eager, d.failures),
        (2, 2, 6, 0, 0),
        "{test}: (warm-ups, captures, replays, eager steps, failures)"
    );
}
