//! RoPE (NeoX) against the direct rotation formula, and interleaved MRoPE against RoPE and a hand case.

mod ops_util;

use ops_util::{max_elem_rel, Rng};
use sanmai_cpu::ops::{mrope_axis, rope_mrope_interleaved, rope_neox, MropePositions};

fn inv_freq(rot_dim: usize, theta: f64) -> Vec<f32> {
    (0..rot_dim / 2)
        .map(|j| (1.0 / theta.powf(2.0 * j as f64 / rot_dim as f64)) as f32)
        .collect()
}

/// Direct formula: pair (j, j + rot/2) of each head rotated by angle `pos·inv_freq[j]` (the product taken
/// in f32, as transformers computes its `freqs`), cos and sin scaled by `mscale`.
fn rope_ref(
    x: &[f32],
    n_heads: usize,
    hd: usize,
    rot: usize,
    pos: impl Fn(usize, usize) -> u32,
    inv: &[f32],
    mscale: f64,
) -> Vec<f64> {
    let mut out: Vec<f64> = x.iter().map(|&v| v as f64).collect();
    let half = rot / 2;
    for (s, row) in out.chunks_mut(n_heads * hd).enumerate() {
        for head in row.chunks_mut(hd) {
            for j in 0..half {
                let angle = (pos(s, j) as f32 * inv[j]) as f64;
                let (c, sn) = (angle.cos() * mscale, angle.sin() * mscale);
                let (a, b) = (head[j], head[j + half]);
                head[j] = a * c - b * sn;
                head[j + half] = b * c + a * sn;
            }
        }
    }
    out
}

#[test]
fn rope_matches_rotation_formula() {
    let mut rng = Rng::new(1);
    // (t, heads, head_dim, rot_dim): full rotation, partial rotation (0.25 of 256), odd t.
    for (t, nh, hd, rot, ms) in [
        (1, 1, 8, 8, 1.0),
        (7, 3, 64, 64, 1.0),
        (5, 4, 256, 64, 1.0),
        (300, 8, 32, 16, 1.3),
    ] {
        let x = rng.vec(t * nh * hd, -2.0, 2.0);
        let pos: Vec<u32> = (0..t).map(|_| rng.below(300_000) as u32).collect();
        let inv = inv_freq(rot, 10_000_000.0);
        let mut y = x.clone();
        rope_neox(&mut y, nh, hd, rot, &pos, &inv, ms as f32);
        let r = rope_ref(&x, nh, hd, rot, |s, _| pos[s], &inv, ms);
        let e = max_elem_rel(&y, &r, 1.0);
        assert!(e < 1e-6, "t={t} heads={nh} hd={hd} rot={rot}: error {e:e}");
        // Dims past rot_dim pass through untouched.
        for (a, b) in y.chunks(hd).zip(x.chunks(hd)) {
            assert_eq!(&a[rot..], &b[rot..]);
        }
    }
}

#[test]
fn rope_at_position_zero_is_identity() {
    let mut rng = Rng::new(2);
    let x = rng.vec(2 * 16, -1.0, 1.0);
    let mut y = x.clone();
    rope_neox(&mut y, 2, 8, 8, &[0, 0], &inv_freq(8, 10_000.0), 1.0);
    assert_eq!(x, y);
}

#[test]
fn mrope_with_equal_positions_is_rope() {
    let mut rng = Rng::new(3);
    let (t, nh, hd, rot) = (40, 4, 256, 64);
    let x = rng.vec(t * nh * hd, -2.0, 2.0);
    let pos: Vec<u32> = (0..t).map(|_| rng.below(100_000) as u32).collect();
    let pos3: Vec<[u32; 3]> = pos.iter().map(|&p| [p, p, p]).collect();
    let inv = inv_freq(rot, 10_000_000.0);
    let mut a = x.clone();
    let mut b = x.clone();
    rope_neox(&mut a, nh, hd, rot, &pos, &inv, 1.0);
    let p = MropePositions {
        positions: &pos3,
        sections: &[11, 11, 10],
    };
    rope_mrope_interleaved(&mut b, nh, hd, rot, p, &inv, 1.0);
    assert_eq!(a, b);
}

#[test]
fn mrope_axis_follows_interleaved_recomposition() {
    // transformers: H takes slice(1, 3·s[1], 3), W takes slice(2, 3·s[2], 3), T keeps the rest.
    let s = [11, 11, 10];
    let axes: Vec<usize> = (0..32).map(|j| mrope_axis(j, &s)).collect();
    let mut expect = vec![0usize; 32];
    for j in (1..33).step_by(3) {
        expect[j] = 1;
    }
    for j in (2..30).step_by(3) {
        expect[j] = 2;
    }
    assert_eq!(axes, expect);
    assert_eq!(mrope_axis(29, &s), 2);
    assert_eq!(mrope_axis(30, &s), 0);
    assert_eq!(mrope_axis(31, &s), 1);
    // A short W section leaves its later slots to T.
    assert_eq!(
        (0..9)
            .map(|j| mrope_axis(j, &[2, 2, 1]))
            .collect::<Vec<_>>(),
        [0, 1, 2, 0, 1, 0, 0, 0, 0]
    );
}

#[test]
fn mrope_hand_checked_case() {
    // One head of 8, all rotated; inv_freq = [1, 1/2, 1/4, 1/8]; positions (t, h, w) = (3, 5, 7);
    // sections [2, 1, 1]: frequency 0 → t, 1 → h, 2 → w, 3 → t (3 % 3 == 0).
    // Angles: 3·1 = 3, 5·0.5 = 2.5, 7·0.25 = 1.75, 3·0.125 = 0.375.
    // With x = [1, 1, 1, 1, 0, 0, 0, 0], pair j becomes (cos a_j, sin a_j).
    let mut x = vec![1f32, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0];
    rope_mrope_interleaved(
        &mut x,
        1,
        8,
        8,
        MropePositions {
            positions: &[[3, 5, 7]],
            sections: &[2, 1, 1],
        },
        &[1.0, 0.5, 0.25, 0.125],
        1.0,
    );
    let angles = [3.0f64, 2.5, 1.75, 0.375];
    for (j, a) in angles.iter().enumerate() {
        assert!((x[j] as f64 - a.cos()).abs() < 1e-7, "cos at {j}: {}", x[j]);
        assert!(
            (x[j + 4] as f64 - a.sin()).abs() < 1e-7,
            "sin at {j}: {}",
            x[j + 4]
        );
    }
    // Same input through 1-D RoPE at position 3 differs exactly in the h and w slots.
    let mut y = vec![1f32, 1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0];
    rope_neox(&mut y, 1, 8, 8, &[3], &[1.0, 0.5, 0.25, 0.125], 1.0);
    assert_eq!((x[0], x[3]), (y[0], y[3]));
    assert_ne!(x[1], y[1]);
    assert_ne!(x[2], y[2]);
}
