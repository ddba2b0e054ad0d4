//! QSA K/V rows in pinned host memory (`--qsa-kv-offload`) on the CPU backend: decode-shaped steps
//! read the selected rows through each layer's row cache (the twin of the GPU's), and every step
//! gives bit for bit the logits of the same model with its rows on the heap, whatever the cache's
//! size: no cache, a cache of a few lines (constant evictions) or one larger than the pool. The
//! workload stores into rows the cache holds (block reuse by a prefill, a copy-on-write block copy
//! into a block read before), shares prefix blocks between sequences, and mixes decode steps of up to
//! 12 rows (cached) with 13-row decode steps and prefill chunks (read from host memory). The
//! counters add up: every row a step reads is a hit, a miss or a direct read, and the bytes read
//! from host memory are the misses and direct reads.

use std::path::Path;

use sanmai_config::{LayerType, ModelConfig};
use sanmai_cpu::CpuBackend;
use sanmai_model::{Backend, KvHost, KvHostStats, Model, OutRows};
use sanmai_weights::Dummy;

mod step_util;
use step_util::{logits, Seq};

const BLOCK: usize = 4;
const BLOCKS: usize = 96;
const TOPK: usize = 8;
/// Bytes one row read moves from host memory: the K and V rows of 2 heads of 32 f32 values.
const ROW_BYTES: u64 = 2 * 2 * 32 * 4;
/// The QSA layers: three of the four decoder layers and the MTP layer.
const QSA_LAYERS: [usize; 4] = [0, 2, 3, 4];

/// The QSA fixture's config with three attention layers and a top-k of 8, so that the short
/// contexts here select densely and sparsely.
fn config() -> ModelConfig {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../tests/fixtures/qwen4_exp_qsa_tiny/config.json");
    let mut cfg = ModelConfig::from_file(&path).unwrap();
    cfg.layer_types = vec![
        LayerType::FullAttention,
        LayerType::LinearAttention,
        LayerType::FullAttention,
        LayerType::FullAttention,
    ];
    cfg.qsa.as_mut().unwrap().index_topk = TOPK;
    cfg
}

/// The model with random weights, its K/V rows pinned with a row cache of `rows` rows when given
/// (turned off when `on` is false), on the heap otherwise.
fn model(cache: Option<(usize, bool)>) -> Model<CpuBackend> {
    let mut m = Model::load(config(), &Dummy::new(7), CpuBackend::new()).unwrap();
    m.kv_host = cache.map(|(rows, on)| KvHost {
        what: format!("the test's QSA K/V pool ({rows} cache rows)"),
        reserve: 0,
        lock_path: std::env::temp_dir()
            .join(format!("sanmai-cpu-test-{}.lock", std::process::id())),
        row_cache_rows: rows,
        row_cache: on,
    });
    m.init_cache(BLOCKS, BLOCK).unwrap();
    m
}

/// `n` token ids below the vocabulary, from a seed.
fn toks(seed: u32, n: usize) -> Vec<u32> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) ^ seed.wrapping_mul(40_503)) % 1000)
        .collect()
}

/// A sequence with all its tokens fixed in advance and the positions computed so far.
struct S {
    seq: Seq,
    tokens: Vec<u32>,
    done: usize,
}

impl S {
    fn new(m: &Model<CpuBackend>, blocks: Vec<u32>, tokens: Vec<u32>) -> Self {
        S {
            seq: Seq::new(m, blocks),
            tokens,
            done: 0,
        }
    }
}

/// One step of the chunks `(sequence, tokens)`; its last-token logits go to `out`.
fn step(m: &Model<CpuBackend>, seqs: &mut [S], parts: &[(usize, usize)], out: &mut Vec<u32>) {
    let chunks: Vec<_> = parts
        .iter()
        .map(|&(i, len)| {
            let s = &seqs[i];
            s.seq.chunk(&s.tokens, s.done, len, OutRows::Last)
        })
        .collect();
    out.extend(logits(m, &chunks).iter().map(|x| x.to_bits()));
    for &(i, len) in parts {
        seqs[i].done += len;
    }
}

/// Decode steps of the sequences `which` together.
fn decode(
    m: &Model<CpuBackend>,
    seqs: &mut [S],
    which: &[usize],
    steps: usize,
    out: &mut Vec<u32>,
) {
    let parts: Vec<(usize, usize)> = which.iter().map(|&i| (i, 1)).collect();
    for _ in 0..steps {
        step(m, seqs, &parts, out);
    }
}

/// The workload; returns the bits of every logit it produced.
fn workload(m: &Model<CpuBackend>) -> Vec<u32> {
    let mut out = Vec::new();
    let (e, a, b, c) = (0, 1, 2, 3);
    let a_tokens = toks(1, 24);
    let mut c_tokens = a_tokens[..10].to_vec();
    c_tokens.extend(toks(3, 14));
    let mut seqs = vec![
        S::new(m, vec![40, 41, 42], toks(0, 12)),
        S::new(m, vec![0, 1, 2, 3, 8, 9], a_tokens),
        S::new(m, vec![4, 5, 6, 7, 10, 11], toks(2, 24)),
    ];
    // E decodes alone, through the cache: its rows in blocks 40..42 are cached.
    step(m, &mut seqs, &[(e, 6)], &mut out);
    decode(m, &mut seqs, &[e], 4, &mut out);
    // A and B prefill (the second step mixes a chunk of 4 and one of 13: read from the host).
    step(m, &mut seqs, &[(a, 6)], &mut out);
    step(m, &mut seqs, &[(a, 4), (b, 13)], &mut out);
    // E ends; C forks from A at position 10: blocks 0 and 1 shared, A's partial block 2 copied into
    // block 41, which E's cached rows held.
    m.backend.free_state(seqs[e].seq.state);
    let fork = S::new(m, vec![0, 1, 41, 44, 45, 46], c_tokens);
    m.backend
        .copy_state(seqs[a].seq.state, fork.seq.state)
        .unwrap();
    m.backend.copy_block(2, 41).unwrap();
    seqs.push(S { done: 10, ..fork });
    decode(m, &mut seqs, &[a, b, c], 7, &mut out);
    // Thirteen short sequences: a 13-row decode step reads from the host, a 12-row one through the
    // cache. One of them reuses block 40 of E, whose rows the cache may still hold.
    let first = seqs.len();
    for i in 0..13u32 {
        let blocks = if i == 0 {
            vec![40, 50]
        } else {
            vec![50 + 2 * i, 51 + 2 * i]
        };
        seqs.push(S::new(m, blocks, toks(10 + i, 7)));
    }
    let group: Vec<usize> = (first..first + 13).collect();
    let prefill: Vec<(usize, usize)> = group.iter().map(|&i| (i, 3)).collect();
    step(m, &mut seqs, &prefill, &mut out);
    decode(m, &mut seqs, &group, 1, &mut out);
    decode(m, &mut seqs, &group[..12], 2, &mut out);
    // A decode row beside a prefill chunk (read from the host), then decodes again.
    seqs.push(S::new(m, vec![80, 81], toks(30, 8)));
    let h = seqs.len() - 1;
    step(m, &mut seqs, &[(a, 1), (h, 5)], &mut out);
    decode(m, &mut seqs, &[a, c, h], 3, &mut out);
    out
}

fn stats(m: &Model<CpuBackend>) -> KvHostStats {
    m.backend
        .kv_host_stats()
        .unwrap()
        .expect("pinned rows have stats")
}

/// Rows read in all: hits, and the rows the bytes from host memory stand for.
fn rows_read(s: &KvHostStats) -> u64 {
    assert_eq!(s.host_bytes_read % ROW_BYTES, 0, "{s:?}");
    s.layers.iter().map(|l| l.hits).sum::<u64>() + s.host_bytes_read / ROW_BYTES
}

#[test]
fn row_cache_reads_are_the_host_rows_and_the_counters_add_up() {
    let heap = model(None);
    let want = workload(&heap);
    assert_eq!(heap.backend.kv_host_stats().unwrap(), None);
    // No cache, 3 lines a layer (12 rows over 4 layers), more lines than the pool's slots, and
    // a cache turned off.
    let runs: Vec<((usize, bool), KvHostStats)> =
        [(0, true), (12, true), (100_000, true), (100_000, false)]
            .into_iter()
            .map(|cache| {
                let m = model(Some(cache));
                let got = workload(&m);
                assert!(got == want, "{cache:?}: logits differ from the heap's");
                (cache, stats(&m))
            })
            .collect();
    let total = rows_read(&runs[0].1);
    assert!(total > 0);
    for (rows, s) in &runs {
        let layers: Vec<usize> = s.layers.iter().map(|l| l.layer).collect();
        assert_eq!(layers, QSA_LAYERS, "{rows:?}");
        assert_eq!(rows_read(s), total, "{rows:?}: {s:?}");
        // The MTP layer does not run in these steps.
        assert_eq!((s.layers[3].hits, s.layers[3].misses), (0, 0));
    }
    let (none, tiny, large) = (&runs[0].1, &runs[1].1, &runs[2].1);
    assert!(
        none.layers.iter().all(|l| l.hits == 0 && l.misses == 0),
        "{none:?}"
    );
    for (t, l) in tiny.layers.iter().zip(&large.layers).take(3) {
        assert!(l.hits > 0 && l.misses > 0, "{large:?}");
        assert!(t.misses > l.misses, "{tiny:?} vs {large:?}");
        // Every cached step reads the same rows whatever the cache's size.
        assert_eq!(t.hits + t.misses, l.hits + l.misses);
    }
    assert!(large.host_bytes_read < tiny.host_bytes_read);
    assert!(tiny.host_bytes_read < none.host_bytes_read);
    assert_eq!(&runs[3].1, none, "a cache turned off reads as no cache");
}

/// A decode step of one sequence at context `ctx ≤ topk` reads its `ctx` rows in every QSA layer
/// it runs: its last position (just stored) misses, the rows the previous step read hit; and
/// `init_cache` starts the counters again.
#[test]
fn a_decode_step_hits_what_the_previous_one_read() {
    let m = model(Some((4096, true)));
    let mut seqs = vec![S::new(&m, vec![3, 4], toks(5, 8))];
    let mut out = Vec::new();
    step(&m, &mut seqs, &[(0, 4)], &mut out);
    let before = stats(&m);
    assert!(before.layers.iter().all(|l| l.hits + l.misses == 0));
    // Prefill reads its 4 rows once per layer from the host.
    assert_eq!(before.host_bytes_read, 3 * 4 * ROW_BYTES);
    decode(&m, &mut seqs, &[0], 1, &mut out);
    let one = stats(&m);
    for l in &one.layers[..3] {
        // Nothing was cached: 5 misses.
        assert_eq!((l.hits, l.misses), (0, 5), "{one:?}");
    }
    decode(&m, &mut seqs, &[0], 1, &mut out);
    let two = stats(&m);
    for (l, p) in two.layers[..3].iter().zip(&one.layers) {
        // Positions 0..5 hit, the new position 5 misses.
        assert_eq!((l.hits - p.hits, l.misses - p.misses), (5, 1), "{two:?}");
    }
    assert_eq!(
        two.host_bytes_read - one.host_bytes_read,
        3 * ROW_BYTES,
        "one miss per layer"
    );
    m.init_cache(BLOCKS, BLOCK).unwrap();
    let fresh = stats(&m);
    assert!(fresh.layers.iter().all(|l| l.hits + l.misses == 0) && fresh.host_bytes_read == 0);
}
