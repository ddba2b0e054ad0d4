//! Page plans and the prefetch thread: the plan covers exactly the pages a gather touches,
//! cancellation drops pending windows, and the EPERM fallback requests the same pages.

use sanmai_config::PleConfig;
use sanmai_ple::{
    create_table, page_ranges, AdviseMode, CreateOptions, Fill, PageAdvisor, PleTable,
    PrefetchOptions, Prefetcher, WINDOW_TOKENS,
};
use serde_json::json;
use std::collections::BTreeSet;
use std::ops::Range;
use std::sync::Arc;

fn open_table(dir: &std::path::Path) -> Arc<PleTable> {
    let cfg = PleConfig::from_block(&json!({
        "orders": [2, 3], "heads": 8, "row_dim": 160, "seed": 1, "layer_ids": [1],
        "table_sizes": [[4001, 4003, 4007, 4013, 4019, 4021, 4027, 4049],
                        [4051, 4057, 4073, 4079, 4091, 4093, 4099, 4111]],
        "conv_kernel": 4, "conv_dilation": 3, "eos_token_id": 0
    }))
    .unwrap();
    let opts = CreateOptions {
        rows_scale: 1.0,
        fill: Fill::Zeros,
        progress: false,
    };
    create_table(&cfg, dir, opts).unwrap();
    Arc::new(PleTable::open(dir, &cfg).unwrap())
}

fn prompt(n: usize, salt: u64) -> Vec<u32> {
    (0..n as u64)
        .map(|i| ((i.wrapping_mul(0x9E37_79B9) ^ salt) % 248_000 + 1) as u32)
        .collect()
}

/// Pages the gather of `indices` reads, from the file offsets alone.
fn touched_pages(t: &PleTable, indices: &[u64]) -> BTreeSet<u64> {
    let ps = t.page_size();
    let mut set = BTreeSet::new();
    for (i, &r) in indices.iter().enumerate() {
        let off = t.row_offset(i % 16, r);
        for p in off / ps..=(off + 319) / ps {
            set.insert(p);
        }
    }
    set
}

fn plan_pages(t: &PleTable, plan: &[Range<u64>]) -> BTreeSet<u64> {
    let ps = t.page_size();
    for w in plan.windows(2) {
        assert!(
            w[0].end < w[1].start,
            "ranges sorted, disjoint, merged: {w:?}"
        );
    }
    plan.iter()
        .flat_map(|r| {
            assert_eq!(r.start % ps, 0);
            assert_eq!(r.end % ps, 0);
            r.start / ps..r.end / ps
        })
        .collect()
}

#[test]
fn page_ranges_by_hand() {
    // Two sub-tables of 100 rows of 320 B in 4 KiB pages: row 12 of table 0 spans bytes
    // 3840..4160 (pages 0 and 1); row 13 is 4160..4480 (page 1); row 0 of table 1 starts at 32000
    // (page 7); row 99 of table 1 ends at 63999 (page 15).
    let (mut pages, mut out) = (Vec::new(), Vec::new());
    let n = page_ranges(
        &[12, 0, 13, 99, 5000, 0],
        &[0, 100],
        &[100, 100],
        320,
        4096,
        &mut pages,
        &mut out,
    );
    assert_eq!(n, 4);
    assert_eq!(out, vec![0..8192, 7 * 4096..8 * 4096, 15 * 4096..16 * 4096]);
}

#[test]
fn the_plan_covers_exactly_the_pages_the_gather_touches() {
    let tmp = tempfile::tempdir().unwrap();
    let t = open_table(tmp.path());
    for n in [1usize, 7, 300, 1024] {
        let idx = t.hasher().indices(&prompt(n, n as u64));
        let plan = t.page_plan(&idx);
        let pages = plan_pages(&t, &plan);
        assert_eq!(pages, touched_pages(&t, &idx));
        // Merging actually happened somewhere for the larger prompts.
        if n >= 300 {
            assert!(plan.len() < pages.len());
        }
    }
}

fn window_pages(t: &PleTable, tokens: &[u32]) -> u64 {
    let idx = t.hasher().indices(tokens);
    idx.chunks(WINDOW_TOKENS * 16)
        .map(|w| touched_pages(t, w).len() as u64)
        .sum()
}

#[test]
fn cancellation_drops_pending_windows() {
    let tmp = tempfile::tempdir().unwrap();
    let t = open_table(tmp.path());
    let p = Prefetcher::spawn(
        t.clone(),
        PrefetchOptions {
            enabled: true,
            force_eperm: false,
            max_ahead_windows: 0,
        },
    );
    assert!(p.enabled());
    let a = prompt(5000, 1); // 5 windows
    let b = prompt(2500, 2); // 3 windows
    p.pause();
    p.submit(1, &a);
    p.submit(2, &b);
    p.cancel(1);
    p.resume();
    p.flush().unwrap();
    let m = t.metrics().snapshot();
    assert_eq!(m.windows_dropped, 5);
    assert_eq!(m.windows_done, 3);
    assert_eq!(m.pages_requested, window_pages(&t, &b));

    // A request cancelled after it finished drops nothing more.
    p.submit(3, &a);
    p.flush().unwrap();
    p.cancel(3);
    p.flush().unwrap();
    let m2 = t.metrics().snapshot();
    assert_eq!(m2.windows_dropped, 5);
    assert_eq!(m2.windows_done, 8);
    assert_eq!(m2.pages_requested, m.pages_requested + window_pages(&t, &a));
}

#[test]
fn prefetch_stays_a_set_number_of_windows_ahead_of_the_prefill() {
    let tmp = tempfile::tempdir().unwrap();
    let t = open_table(tmp.path());
    let p = Prefetcher::spawn(
        t.clone(),
        PrefetchOptions {
            max_ahead_windows: 2,
            ..PrefetchOptions::default()
        },
    );
    let a = prompt(6000, 5); // 6 windows
    let b = prompt(1500, 6); // 2 windows
    p.submit(1, &a);
    p.submit(2, &b);
    // Nothing gathered yet: two windows of each request.
    p.flush().unwrap();
    assert_eq!(t.metrics().snapshot().windows_done, 4);
    // The prefill of request 1 reached token 1100: windows starting below 1100 + 2048.
    p.progress(1, 1100);
    p.flush().unwrap();
    assert_eq!(t.metrics().snapshot().windows_done, 6);
    p.progress(1, 6000);
    p.flush().unwrap();
    let m = t.metrics().snapshot();
    assert_eq!(m.windows_done, 8);
    assert_eq!(
        m.pages_requested,
        window_pages(&t, &a) + window_pages(&t, &b)
    );
    // A paced request that is cancelled drops what it had not reached.
    p.submit(3, &a);
    p.flush().unwrap();
    p.cancel(3);
    p.flush().unwrap();
    let m = t.metrics().snapshot();
    assert_eq!((m.windows_done, m.windows_dropped), (10, 4));
}

#[test]
fn a_cached_prefix_is_not_prefetched() {
    let tmp = tempfile::tempdir().unwrap();
    let t = open_table(tmp.path());
    let p = Prefetcher::spawn(
        t.clone(),
        PrefetchOptions {
            max_ahead_windows: 0,
            ..PrefetchOptions::default()
        },
    );
    let a = prompt(3000, 8);
    p.submit_from(1, &a, 2000);
    p.submit_from(2, &a, 3000); // everything cached: nothing to do
    p.flush().unwrap();
    let m = t.metrics().snapshot();
    assert_eq!(m.windows_done, 1);
    let idx = t.hasher().indices(&a);
    assert_eq!(
        m.pages_requested,
        touched_pages(&t, &idx[2000 * 16..]).len() as u64
    );
}

#[test]
fn eperm_falls_back_to_per_range_madvise() {
    let tmp = tempfile::tempdir().unwrap();
    let t = open_table(tmp.path());
    let tokens = prompt(3000, 9);
    let p = Prefetcher::spawn(
        t.clone(),
        PrefetchOptions {
            enabled: true,
            force_eperm: true,
            max_ahead_windows: 0,
        },
    );
    p.submit(7, &tokens);
    assert_eq!(p.flush(), Some(AdviseMode::PerRange));
    assert!(PageAdvisor::fallback_logged());
    assert_eq!(
        t.metrics().snapshot().pages_requested,
        window_pages(&t, &tokens)
    );
    assert_eq!(t.metrics().snapshot().windows_done, 3);

    // The decode path on the same switch: one token's 16 rows.
    let mut adv = PageAdvisor::new(t.clone(), true);
    let idx = t.hasher().indices(&tokens[..1]);
    let n = adv.advise_rows(&idx).unwrap();
    assert_eq!(n, touched_pages(&t, &idx).len());
    assert_eq!(adv.mode(), AdviseMode::PerRange);
}

#[test]
fn the_real_advisor_requests_pages_in_either_mode() {
    let tmp = tempfile::tempdir().unwrap();
    let t = open_table(tmp.path());
    let mut adv = PageAdvisor::new(t.clone(), false);
    let idx = t.hasher().indices(&prompt(2048, 3));
    // Every other page of the file: more than 1024 ranges, several process_madvise batches; the
    // last range runs past the end of the file and is clipped.
    let ps = t.page_size();
    let pages = (t.bytes().len() as u64).div_ceil(ps);
    let plan: Vec<Range<u64>> = (0..pages + 2)
        .step_by(2)
        .map(|p| p * ps..(p + 1) * ps)
        .collect();
    assert!(plan.len() > 2 * 1024, "{} ranges", plan.len());
    adv.advise(&plan).unwrap();
    eprintln!("advise mode here: {:?}", adv.mode());
    let n = adv.advise_rows(&idx[..16]).unwrap();
    assert_eq!(n, touched_pages(&t, &idx[..16]).len());
}

#[test]
fn disabled_prefetch_does_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let t = open_table(tmp.path());
    let p = Prefetcher::spawn(
        t.clone(),
        PrefetchOptions {
            enabled: false,
            ..PrefetchOptions::default()
        },
    );
    assert!(!p.enabled());
    p.submit(1, &prompt(100, 0));
    assert_eq!(p.flush(), None);
    assert_eq!(t.metrics().snapshot().windows_done, 0);
}

#[test]
fn the_store_gathers_prefill_and_decode_rows_like_the_table() {
    let tmp = tempfile::tempdir().unwrap();
    let t = open_table(tmp.path());
    drop(t);
    let cfg = PleConfig::from_block(&json!({
        "orders": [2, 3], "heads": 8, "row_dim": 160, "seed": 1, "layer_ids": [1],
        "table_sizes": [[4001, 4003, 4007, 4013, 4019, 4021, 4027, 4049],
                        [4051, 4057, 4073, 4079, 4091, 4093, 4099, 4111]],
        "conv_kernel": 4, "conv_dilation": 3, "eos_token_id": 0
    }))
    .unwrap();
    let store = sanmai_ple::PleStore::open(tmp.path(), &cfg, PrefetchOptions::default()).unwrap();
    let tokens: Vec<u32> = prompt(1500, 4);
    store.submit(1, &tokens);
    let dim = store.table().token_dim();
    let mut out = vec![half::bf16::ZERO; 1500 * dim];
    store.gather(&tokens, 0..1500, &mut out).unwrap();
    store.prefetcher().flush();
    let before = store.table().metrics().snapshot();
    let mut one = vec![half::bf16::ZERO; dim];
    store.gather_decode(&tokens, &mut one).unwrap();
    assert_eq!(one, out[1499 * dim..]);
    // The decode step requested exactly its token's pages.
    let idx = store.table().hasher().indices(&tokens);
    let after = store.table().metrics().snapshot();
    if store.prefetcher().enabled() {
        assert_eq!(before.windows_done, 2);
        assert_eq!(
            after.pages_requested - before.pages_requested,
            touched_pages(store.table(), &idx[1499 * 16..]).len() as u64
        );
    }
    assert_eq!(after.gathered_tokens, before.gathered_tokens + 1);
    store.cancel(1);
    assert!(store.gather_decode(&tokens[..0], &mut one).is_err());
}
