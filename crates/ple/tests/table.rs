//! Table files: create writes the layout the sidecar describes, check catches every disagreement,
//! and the mmap gather returns exactly the bytes at the hashed offsets.

use half::bf16;
use sanmai_config::PleConfig;
use sanmai_ple::{
    check_table, create_table, scaled_sizes, CreateOptions, Fill, PleError, PleHasher, PleTable,
    Sidecar, SIDECAR_FILE, TABLE_FILE,
};
use serde_json::json;
use std::io::{Read, Seek, SeekFrom};
use std::path::Path;

fn small_cfg() -> PleConfig {
    PleConfig::from_block(&json!({
        "orders": [2, 3], "heads": 8, "row_dim": 160, "seed": 5, "layer_ids": [1],
        "table_sizes": [[1009, 1013, 1019, 1021, 1031, 1033, 1039, 1049],
                        [1051, 1061, 1063, 1069, 1087, 1091, 1093, 1097]],
        "conv_kernel": 4, "conv_dilation": 3, "eos_token_id": 248046
    }))
    .unwrap()
}

fn table_error(r: Result<Sidecar, PleError>) -> String {
    match r {
        Err(PleError::Table { what, .. }) => what,
        other => panic!("expected a table error, got {other:?}"),
    }
}

fn rewrite_sidecar(dir: &Path, edit: impl Fn(&mut Sidecar), fix_checksum: bool) {
    let mut s = Sidecar::read(dir).unwrap();
    edit(&mut s);
    if fix_checksum {
        s.checksum = s.compute_checksum();
    }
    std::fs::write(dir.join(SIDECAR_FILE), serde_json::to_string(&s).unwrap()).unwrap();
}

#[test]
fn create_then_check_and_catch_disagreements() {
    let cfg = small_cfg();
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("t");
    let s = create_table(&cfg, &dir, CreateOptions::default()).unwrap();
    let total: u64 = cfg.flat_sizes().iter().sum();
    assert_eq!(
        std::fs::metadata(dir.join(TABLE_FILE)).unwrap().len(),
        total * 320
    );
    assert!(!dir.join(format!("{TABLE_FILE}.partial")).exists());
    assert_eq!(check_table(&dir, &cfg).unwrap(), s);
    assert_eq!(s.checksum, s.compute_checksum());

    // A config that disagrees: each error names the field.
    let mut other = cfg.clone();
    other.table_sizes[1][3] = 1103;
    assert!(table_error(check_table(&dir, &other)).starts_with("table_sizes"));
    let mut other = cfg.clone();
    other.row_dim = 128;
    assert!(table_error(check_table(&dir, &other)).starts_with("row_dim"));
    let mut other = cfg.clone();
    other.seed = 6;
    assert!(table_error(check_table(&dir, &other)).starts_with("seed"));

    // An edited sidecar without a fresh checksum.
    rewrite_sidecar(&dir, |s| s.heads = 4, false);
    assert!(table_error(check_table(&dir, &cfg)).contains("checksum"));
    rewrite_sidecar(&dir, |s| s.heads = 8, true);
    check_table(&dir, &cfg).unwrap();

    // A truncated file.
    let f = std::fs::OpenOptions::new()
        .write(true)
        .open(dir.join(TABLE_FILE))
        .unwrap();
    f.set_len(total * 320 - 2).unwrap();
    assert!(table_error(check_table(&dir, &cfg)).contains("bytes"));
}

#[test]
fn rows_scale_writes_smaller_primes() {
    let cfg = small_cfg();
    let scaled = scaled_sizes(&cfg.table_sizes, 0.1).unwrap();
    assert_eq!(scaled[0][0], 97); // largest prime <= 100
    assert_eq!(scaled[1][7], 109); // floor(109.7) = 109 is prime
    for (row, orig) in scaled.iter().flatten().zip(cfg.flat_sizes()) {
        assert!(*row <= orig / 10 && *row >= 2);
        assert!((2..*row)
            .take_while(|d| d * d <= *row)
            .all(|d| row % d != 0));
    }
    assert!(scaled_sizes(&cfg.table_sizes, 0.0).is_err());
    assert!(scaled_sizes(&cfg.table_sizes, 1.5).is_err());

    let tmp = tempfile::tempdir().unwrap();
    let opts = CreateOptions {
        rows_scale: 0.1,
        fill: Fill::Zeros,
        progress: true,
    };
    let s = create_table(&cfg, tmp.path(), opts).unwrap();
    assert_eq!(s.sizes, scaled);
    assert_eq!(check_table(tmp.path(), &cfg).unwrap(), s);
    let bytes = std::fs::read(tmp.path().join(TABLE_FILE)).unwrap();
    assert_eq!(bytes.len() as u64, s.file_len());
    assert!(bytes.iter().all(|&b| b == 0));
}

#[test]
fn random_fill_is_deterministic_and_small() {
    let cfg = small_cfg();
    let a = tempfile::tempdir().unwrap();
    let b = tempfile::tempdir().unwrap();
    let opts = CreateOptions {
        rows_scale: 0.05,
        ..CreateOptions::default()
    };
    create_table(&cfg, a.path(), opts).unwrap();
    create_table(&cfg, b.path(), opts).unwrap();
    let x = std::fs::read(a.path().join(TABLE_FILE)).unwrap();
    assert_eq!(x, std::fs::read(b.path().join(TABLE_FILE)).unwrap());
    let vals: Vec<f32> = x
        .chunks_exact(2)
        .map(|p| bf16::from_le_bytes([p[0], p[1]]).to_f32())
        .collect();
    assert!(vals.iter().all(|v| v.abs() <= 0.0502));
    let nonzero = vals.iter().filter(|v| **v != 0.0).count();
    assert!(nonzero > vals.len() * 9 / 10);
}

#[test]
fn gather_equals_reading_the_file_at_the_hashed_offsets() {
    let cfg = small_cfg();
    let tmp = tempfile::tempdir().unwrap();
    create_table(&cfg, tmp.path(), CreateOptions::default()).unwrap();
    let table = PleTable::open(tmp.path(), &cfg).unwrap();
    assert_eq!(table.num_tables(), 16);
    assert_eq!(table.token_dim(), 16 * 160);

    let tokens: Vec<u32> = (0..300u32)
        .map(|i| {
            if i == 137 {
                248046
            } else {
                (i * 2654435761u32) % 248320
            }
        })
        .collect();
    let positions = 20..300;
    let mut out = vec![bf16::ZERO; positions.len() * table.token_dim()];
    table.gather(&tokens, positions.clone(), &mut out).unwrap();

    // The reference: the standalone hasher and plain file reads at (base of sub-table + row)·320.
    let hasher = PleHasher::new(&cfg);
    let idx = hasher.indices(&tokens);
    let sizes = cfg.flat_sizes();
    let mut f = std::fs::File::open(tmp.path().join(TABLE_FILE)).unwrap();
    let mut row = [0u8; 320];
    for (i, t) in positions.enumerate() {
        for k in 0..16 {
            let base: u64 = sizes[..k].iter().sum();
            let r = idx[t * 16 + k];
            assert!(r < sizes[k]);
            f.seek(SeekFrom::Start((base + r) * 320)).unwrap();
            f.read_exact(&mut row).unwrap();
            let got = &out[(i * 16 + k) * 160..(i * 16 + k + 1) * 160];
            for (g, p) in got.iter().zip(row.chunks_exact(2)) {
                assert_eq!(g.to_bits(), u16::from_le_bytes([p[0], p[1]]));
            }
        }
    }

    // A wrongly sized buffer or range is an error, not a panic.
    assert!(table.gather(&tokens, 0..2, &mut out).is_err());
    assert!(table
        .gather(&tokens, 299..301, &mut out[..2 * 2560])
        .is_err());
    assert!(table.gather_indices(&[5000; 16], &mut out[..2560]).is_err());
}

#[test]
fn open_refuses_a_table_for_another_config() {
    let cfg = small_cfg();
    let tmp = tempfile::tempdir().unwrap();
    create_table(
        &cfg,
        tmp.path(),
        CreateOptions {
            rows_scale: 0.1,
            fill: Fill::Zeros,
            progress: false,
        },
    )
    .unwrap();
    let mut other = cfg.clone();
    other.orders = vec![2, 4];
    assert!(matches!(
        PleTable::open(tmp.path(), &other),
        Err(PleError::Table { what, .. }) if what.starts_with("orders")
    ));
    // A scaled table opens, with the hash using the table's own sizes.
    let t = PleTable::open(tmp.path(), &cfg).unwrap();
    let idx = t.hasher().indices(&[1u32, 2, 3]);
    let sizes: Vec<u64> = t.sidecar().sizes.iter().flatten().copied().collect();
    for row in idx.chunks(16) {
        assert!(row.iter().zip(&sizes).all(|(r, p)| r < p));
    }
}
