//! Causal conv1d + SiLU over prefill chunks against `sanmai_cpu::ops::causal_conv1d_silu`, and the
//! conversion between the CPU's conv state (`[kernel − 1, c]`, the inputs before the chunk) and the
//! GPU's ring (`[kernel, c]`, input `x_q` at entry `q mod kernel`) that the GDN tests share.

use half::bf16;
use sanmai_cpu::ops;
use sanmai_cuda::{ConvWeight, SeqRows};

use crate::common::{check_elementwise, from_bf16, gpu, to_bf16, Rng};

/// The ring entry of input position `q` (which may lie before position 0) in a ring of `k` entries.
fn entry(q: i64, k: usize) -> usize {
    q.rem_euclid(k as i64) as usize
}

/// Writes the CPU conv state `state` (`[k − 1, c]`: the inputs of positions `pos − k + 1 .. pos`) into
/// the ring `ring` (`[k, c]`) of a sequence whose next input is at position `pos`; the remaining entry
/// keeps what it holds.
pub fn state_into_ring(state: &[f32], pos: u32, k: usize, c: usize, ring: &mut [f32]) {
    for (r, row) in state.chunks_exact(c).enumerate() {
        let e = entry(pos as i64 - (k as i64 - 1) + r as i64, k);
        ring[e * c..(e + 1) * c].copy_from_slice(row);
    }
}

/// The CPU conv state (`[k − 1, c]`) a ring (`[k, c]`) holds for a sequence whose next input is at
/// position `pos`.
pub fn state_from_ring(ring: &[f32], pos: u32, k: usize, c: usize) -> Vec<f32> {
    let mut state = Vec::with_capacity((k - 1) * c);
    for r in 0..k - 1 {
        let e = entry(pos as i64 - (k as i64 - 1) + r as i64, k);
        state.extend_from_slice(&ring[e * c..(e + 1) * c]);
    }
    state
}

#[test]
fn conv1d_prefill_matches_cpu() {
    let Some(g) = gpu("conv1d_prefill_matches_cpu") else {
        return;
    };
    let mut rng = Rng::new(30);
    // Qwen3-Next's conv_dim 8192 with kernel 4, small widths, kernel 2; chunks shorter than kernel − 1
    // exercise rings partly kept, an empty chunk and an out-of-range slot (7: zero output) are
    // skipped. Chunks start at positions that put the ring's entries in every order.
    let lens = [9usize, 2, 1, 0, 17, 3];
    let pos0 = [0u32, 5, 2, 7, 1_000_003, 1];
    let slots = [3u32, 0, 5, 1, 7, 2];
    let slots_n = 6;
    for &(c, kk) in &[(8192usize, 4usize), (300, 4), (64, 2), (100, 3)] {
        // Sequences in order, one row of no sequence between neighbours (its position is junk).
        let mut starts = Vec::new();
        let mut positions = Vec::new();
        for (&l, &p) in lens.iter().zip(&pos0) {
            starts.push(positions.len());
            positions.extend((0..l as u32).map(|r| p + r));
            positions.push(u32::MAX / 3);
        }
        let rows = positions.len();
        let sl = kk * c;
        let (xb, xf) = to_bf16(&rng.normals(rows * c, 0.0, 1.0));
        let (wb, wf) = to_bf16(&rng.normals(c * kk, 0.0, 0.5));
        let (pb, pf) = to_bf16(&rng.normals(slots_n * sl, 0.0, 1.0));
        let mut want = vec![0f32; rows * c];
        let mut want_pool = pf.clone();
        for (((&s0, &t), &slot), &p) in starts.iter().zip(&lens).zip(&slots).zip(&pos0) {
            let slot = slot as usize;
            if slot >= slots_n || t == 0 {
                continue;
            }
            let ring = &mut want_pool[slot * sl..(slot + 1) * sl];
            let mut state = state_from_ring(ring, p, kk, c);
            ops::causal_conv1d_silu(
                &xf[s0 * c..(s0 + t) * c],
                &wf,
                &mut state,
                t,
                c,
                kk,
                &mut want[s0 * c..(s0 + t) * c],
            );
            state_into_ring(&state, p + t as u32, kk, c, ring);
        }
        let as_u32 = |x: &[usize]| x.iter().map(|&v| v as u32).collect::<Vec<_>>();
        let (x, w) = (g.upload(&xb).unwrap(), g.upload(&wb).unwrap());
        let (pos, st, ln, sd) = (
            g.upload(&positions).unwrap(),
            g.upload(&as_u32(&starts)).unwrap(),
            g.upload(&as_u32(&lens)).unwrap(),
            g.upload(&slots).unwrap(),
        );
        let mut pool = g.upload(&pb).unwrap();
        let mut out = g.zeros::<bf16>(rows * c).unwrap();
        let max_len = lens.iter().copied().max().unwrap();
        let seqs = SeqRows {
            starts: &st,
            lens: &ln,
            slots: &sd,
            rows,
            n_seq: lens.len(),
            max_len,
        };
        let conv = ConvWeight {
            w: &w,
            channels: c,
            kernel: kk,
        };
        g.conv1d_prefill(&x, &conv, &mut pool, &pos, &seqs, &mut out)
            .unwrap();
        let got = from_bf16(&g.download(&out).unwrap());
        // Rows of no sequence and of the bad slot stay zero: `want` holds zeros there.
        check_elementwise(
            "conv1d_prefill",
            &format!("t9+2+1+0+17+3_c{c}_k{kk}"),
            &got,
            &want,
        );
        // The rings hold inputs, so they are exact: each sequence's entries of its last kernel − 1
        // positions as the CPU's state, its other entry, the slot of the empty chunk and slot 4 (not
        // in the step) untouched.
        assert_eq!(
            from_bf16(&g.download(&pool).unwrap()),
            want_pool,
            "c{c} k{kk}: rings"
        );
    }
}

#[test]
fn conv1d_prefill_short_chunks_match_one_pass() {
    let Some(g) = gpu("conv1d_prefill_short_chunks_match_one_pass") else {
        return;
    };
    let mut rng = Rng::new(32);
    // One sequence from a fresh (zero) ring in chunks mostly shorter than kernel − 1, one launch pair
    // per chunk, against the CPU's single pass over all its tokens.
    let chunks = [1usize, 2, 1, 1, 5, 2, 3, 1];
    let t: usize = chunks.iter().sum();
    for &(c, kk) in &[(8192usize, 4usize), (96, 3), (64, 2)] {
        let (xb, xf) = to_bf16(&rng.normals(t * c, 0.0, 1.0));
        let (wb, wf) = to_bf16(&rng.normals(c * kk, 0.0, 0.5));
        let mut want = vec![0f32; t * c];
        let mut state = vec![0f32; (kk - 1) * c];
        ops::causal_conv1d_silu(&xf, &wf, &mut state, t, c, kk, &mut want);

        let w = g.upload(&wb).unwrap();
        // Slot 1 of three; the other two must stay zero.
        let mut pool = g.zeros::<bf16>(3 * kk * c).unwrap();
        let (st, sd) = (g.upload(&[0u32]).unwrap(), g.upload(&[1u32]).unwrap());
        let mut got = Vec::with_capacity(t * c);
        let mut p0 = 0usize;
        for &len in &chunks {
            let x = g.upload(&xb[p0 * c..(p0 + len) * c]).unwrap();
            let positions: Vec<u32> = (p0..p0 + len).map(|p| p as u32).collect();
            let pos = g.upload(&positions).unwrap();
            let ln = g.upload(&[len as u32]).unwrap();
            let mut out = g.zeros::<bf16>(len * c).unwrap();
            let seqs = SeqRows {
                starts: &st,
                lens: &ln,
                slots: &sd,
                rows: len,
                n_seq: 1,
                max_len: len,
            };
            let conv = ConvWeight {
                w: &w,
                channels: c,
                kernel: kk,
            };
            g.conv1d_prefill(&x, &conv, &mut pool, &pos, &seqs, &mut out)
                .unwrap();
            got.extend(from_bf16(&g.download(&out).unwrap()));
            p0 += len;
        }
        check_elementwise(
            "conv1d_prefill_chunked",
            &format!("t1+2+1+1+5+2+3+1_c{c}_k{kk}"),
            &got,
            &want,
        );
        let ring = from_bf16(&g.download(&pool).unwrap());
        let sl = kk * c;
        assert_eq!(
            state_from_ring(&ring[sl..2 * sl], t as u32, kk, c),
            state,
            "c{c} k{kk}: the ring holds the last kernel − 1 inputs"
        );
        assert!(
            ring[..sl].iter().chain(&ring[2 * sl..]).all(|&v| v == 0.0),
            "c{c} k{kk}: other slots untouched"
        );
    }
}
