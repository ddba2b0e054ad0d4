//! The hash against vectors computed independently (arbitrary-precision integers reduced mod 2^64,
//! Python's `%` which takes the divisor's sign), plus document-boundary properties.

use sanmai_config::PleConfig;
use sanmai_ple::{splitmix64_outputs, PleError, PleHasher};
use serde_json::json;

fn cfg(seed: u64, sizes: serde_json::Value, eos: i64) -> PleConfig {
    PleConfig::from_block(&json!({
        "orders": [2, 3], "heads": 2, "row_dim": 4, "seed": seed, "layer_ids": [1],
        "table_sizes": sizes, "conv_kernel": 4, "conv_dilation": 3, "eos_token_id": eos
    }))
    .unwrap()
}

#[test]
fn splitmix64_matches_the_reference_generator() {
    assert_eq!(
        splitmix64_outputs(0, 3),
        vec![0xe220a8397b1dcdaf, 0x6e789e6aa1b965f4, 0x06c45d188009454f]
    );
    assert_eq!(
        splitmix64_outputs(7, 3),
        vec![0x63cbe1e459320dd7, 0x044c3cd7f43c661c, 0xe6984080bab12a02]
    );
}

#[test]
fn multipliers_are_odd_signed_splitmix_outputs() {
    let h = PleHasher::new(&cfg(7, json!([[1000003, 999983], [13, 1u64 << 62]]), 2));
    assert_eq!(
        h.multipliers(),
        &[
            7191089600892374487,
            309689372594955805,
            -1830642326893942269
        ]
    );
}

#[test]
fn indices_match_hand_computed_vectors_with_wrapping_and_eos() {
    // Token 4e9 times the multipliers wraps i64 many times over; position 3 holds EOS (= 2), so
    // positions 3.. see only EOS before it; the 2^62 size keeps the high bits of the mix visible.
    let h = PleHasher::new(&cfg(7, json!([[1000003, 999983], [13, 1u64 << 62]]), 2));
    let tokens: [i64; 6] = [5, 17, 99, 2, 4_000_000_000, 7];
    let expected: [[u64; 4]; 6] = [
        [715086, 231805, 11, 3986690465488493839],
        [253423, 949326, 6, 4091433534736908752],
        [448601, 577014, 6, 2175541650953883591],
        [781433, 770357, 1, 161913421678150546],
        [892044, 151828, 1, 1513638386875498556],
        [800503, 730967, 2, 3132067070824398055],
    ];
    let got = h.indices(&tokens);
    assert_eq!(got, expected.concat());
    // Any sub-range computed against the full sequence gives the same rows.
    let mut part = vec![0u64; 3 * 4];
    h.fill_indices(&tokens, 2..5, &mut part).unwrap();
    assert_eq!(part, expected[2..5].concat());
}

#[test]
fn ngrams_never_cross_a_document_boundary() {
    let h = PleHasher::new(&cfg(3, json!([[101, 103], [107, 109]]), 9));
    let doc = [40, 41, 42, 43];
    let mut a = vec![1, 2, 3, 9];
    a.extend_from_slice(&doc);
    let mut b = vec![77, 9];
    b.extend_from_slice(&doc);
    let mut c = vec![9];
    c.extend_from_slice(&doc);
    let ia = h.indices(&a);
    let ib = h.indices(&b);
    let ic = h.indices(&c);
    let nt = h.num_tables();
    assert_eq!(&ia[3 * nt..], &ib[nt..]);
    assert_eq!(&ib[nt..], &ic[..]);
    // At the very start, positions < 0 read as EOS: the document alone equals it after an EOS.
    assert_eq!(&h.indices(&doc)[..], &ic[nt..]);
    // Without the boundary the context differs.
    let mut d = vec![1, 2, 3, 8];
    d.extend_from_slice(&doc);
    assert_ne!(&h.indices(&d)[4 * nt..], &ic[nt..]);
}

#[test]
fn indices_stay_below_each_size_for_negative_mixes() {
    let h = PleHasher::new(&cfg(11, json!([[7, 5], [3, 2]]), 0));
    let tokens: Vec<i64> = (0..500).map(|i| i * 7919 + 1).collect();
    let idx = h.indices(&tokens);
    let sizes = [7u64, 5, 3, 2];
    for row in idx.chunks(4) {
        for (x, p) in row.iter().zip(sizes) {
            assert!(*x < p);
        }
    }
}

#[test]
fn bad_ranges_are_errors() {
    let h = PleHasher::new(&cfg(0, json!([[7, 5], [3, 2]]), 0));
    let mut out = vec![0u64; 4];
    assert!(matches!(
        h.fill_indices(&[1, 2], 1..3, &mut out),
        Err(PleError::Input(_))
    ));
    assert!(h.fill_indices(&[1, 2], 0..2, &mut out).is_err());
}

#[test]
fn every_sub_range_matches_the_whole_sequence() {
    // EOS ids sprinkled at various distances before each range start.
    let h = PleHasher::new(&cfg(5, json!([[101, 103], [107, 109]]), 9));
    let tokens: Vec<i64> = (0..64)
        .map(|i| {
            if i % 7 == 3 || i == 40 || i == 41 {
                9
            } else {
                i * 31 + 1
            }
        })
        .collect();
    let all = h.indices(&tokens);
    for start in 0..tokens.len() {
        for end in start..=tokens.len().min(start + 5) {
            let mut part = vec![0u64; (end - start) * 4];
            h.fill_indices(&tokens, start..end, &mut part).unwrap();
            assert_eq!(part, all[start * 4..end * 4], "{start}..{end}");
        }
    }
}
