//! The benchmark's parts on a small table: eviction, residency, the O_DIRECT rate and the report.

use sanmai_config::PleConfig;
use sanmai_ple::{
    create_table, evict, resident_fraction, run_bench, CreateOptions, Fill, PleTable,
};
use serde_json::json;

#[test]
fn bench_reports_a_scaled_table_opened_by_its_sidecar() {
    let cfg = PleConfig::from_block(&json!({
        "orders": [2, 3], "heads": 8, "row_dim": 160, "seed": 2, "layer_ids": [1],
        "table_sizes": [[40009, 40013, 40031, 40037, 40039, 40063, 40087, 40093],
                        [40099, 40111, 40123, 40127, 40129, 40151, 40153, 40163]],
        "conv_kernel": 4, "conv_dilation": 3, "eos_token_id": 7
    }))
    .unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let opts = CreateOptions {
        rows_scale: 0.5,
        fill: Fill::Random,
        progress: false,
    };
    let s = create_table(&cfg, tmp.path(), opts).unwrap();
    // Opened without the model config: the hash uses the sidecar's (scaled) sizes.
    let t = PleTable::open_sidecar(tmp.path(), 7).unwrap();
    let by_cfg = PleTable::open(tmp.path(), &cfg).unwrap();
    let tokens = [3u32, 9, 7, 11, 12];
    assert_eq!(
        t.hasher().indices(&tokens),
        by_cfg.hasher().indices(&tokens)
    );
    assert_eq!(t.sidecar(), &s);
    let frac = resident_fraction(&t);
    assert!((0.0..=1.0).contains(&frac));
    drop((t, by_cfg));
    evict(&tmp.path().join(sanmai_ple::TABLE_FILE)).unwrap();

    let r = run_bench(tmp.path(), 3000, 7).unwrap();
    assert_eq!(r.tokens, 3000);
    assert!(r.pages > 0 && r.pages <= s.file_len().div_ceil(4096));
    assert!(r.cold_no_prefetch_s > 0.0 && r.cold_prefetch_s > 0.0 && r.warm_s > 0.0);
    assert!((r.cold_prefetch_pages_per_s - r.pages as f64 / r.cold_prefetch_s).abs() < 1e-6);
    if let Some(rate) = r.random_read_4k_per_s {
        assert!(rate > 0.0);
    }
}
