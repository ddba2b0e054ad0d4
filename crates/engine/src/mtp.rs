//! The MTP drafter: after a step, the model's MTP head runs over the rows of the chunks that draft
//! ([`SpecChunk`]) and proposes the next step's drafts.
//!
//! The head at position `p` reads the main model's final-normed hidden state at `p` and the token
//! at `p + 1`, and writes its own K/V at `p` (cache layer `num_layers`): its output predicts the
//! token at `p + 2`. So after a step it can run over each row whose next token is known: the prompt
//! tokens that follow, the accepted drafts, and the token the executor drew after the last accepted
//! row. The last such row's output gives the first draft (the greedy pick of the head's logits);
//! each further draft feeds the head its own previous output and draft, one row a pass, as vLLM
//! chains them. Those chained rows' K/V are provisional: the next step's catch-up writes the same
//! positions again from the main model's hidden states.
//!
//! A sequence with a grammar gets the head's logits row of each draft besides: the engine picks
//! its drafts from them under the grammar's masks (the first draft exactly the masked greedy pick),
//! since the masks depend on the token drawn after the step.
//!
//! A draft that is wrong costs only time: the verify step draws every row from the target model
//! (`crate::sampler::speculative`), whatever the drafts were.

use sanmai_model::sample::{RowSampling, SamplingParams};
use sanmai_model::{
    Backend, Model, OpResult, OutRows, SampleCall, StepChunk, StepInput, StepStart,
};

use crate::step::{PlannedChunk, SpecChunk, StepLogits, StepPlan};

/// One chunk's share of the head's catch-up pass.
struct Rows {
    chunk: usize,
    /// The chunk's first row in the step.
    start: usize,
    /// The token after each row (the head embeds it).
    next: Vec<u32>,
    /// Drafts to propose from the last row (0 when its next token was not drawn here).
    propose: usize,
    valid_vocab: usize,
}

/// The rows of `spec`'s chunk `c` (the chunk's first logit row in the step is `first_row`) whose
/// next token is known after the step.
fn known_rows(
    c: &PlannedChunk,
    spec: SpecChunk,
    first_row: usize,
    out: &StepLogits,
) -> (Vec<u32>, usize) {
    let t = &c.tokens;
    let certain = t.len() - spec.drafts;
    let rows = c.logits.count(t.len());
    let drawn: Option<Vec<u32>> = (0..rows)
        .map(|j| match out.sampled.get(first_row + j) {
            Some(Some(Ok(s))) => Some(s.id),
            _ => None,
        })
        .collect();
    match drawn {
        Some(d) if rows > 0 && c.sampling.len() == rows => {
            let accepted = d
                .iter()
                .zip(&t[certain..])
                .take_while(|(x, y)| x == y)
                .count();
            let mut next = t[1..certain + accepted].to_vec();
            next.push(d[accepted]);
            (next, spec.propose)
        }
        _ if spec.drafts == 0 && spec.next.is_some() => {
            let mut next = t[1..].to_vec();
            next.extend(spec.next);
            (next, 0)
        }
        _ => (t[1..certain.max(1)].to_vec(), 0),
    }
}

/// Each chunk's drafts and, for a chunk whose grammar picks its drafts ([`SpecChunk::masked`]),
/// the head's logits row of each draft.
type Proposal = (Vec<Vec<u32>>, Vec<Vec<Vec<f32>>>);

/// Runs the MTP head after a step whose rows' final-normed hidden states are `hidden` (every row of
/// the step, in order): catches its K/V up over the known rows of each drafting chunk and returns
/// the drafts proposed for each chunk (see the module doc).
pub(crate) fn propose<B: Backend>(
    m: &Model<B>,
    plan: &StepPlan,
    hidden: &B::Tensor,
    out: &StepLogits,
) -> OpResult<Proposal> {
    let mut parts = Vec::new();
    let (mut row, mut logit_row) = (0, 0);
    for (i, c) in plan.chunks.iter().enumerate() {
        let first_row = logit_row;
        logit_row += c.logits.count(c.tokens.len());
        let start = row;
        row += c.tokens.len();
        let Some(spec) = c.spec else { continue };
        let (next, propose) = known_rows(c, spec, first_row, out);
        if next.is_empty() {
            continue;
        }
        parts.push(Rows {
            chunk: i,
            start,
            next,
            propose,
            valid_vocab: c.sampling.first().map_or(0, |s| s.valid_vocab),
        });
    }
    let mut drafts = vec![Vec::new(); plan.chunks.len()];
    let mut logit_rows = vec![Vec::new(); plan.chunks.len()];
    if parts.is_empty() {
        return Ok((drafts, logit_rows));
    }
    let b = &m.backend;
    let idx: Vec<usize> = parts
        .iter()
        .flat_map(|p| p.start..p.start + p.next.len())
        .collect();
    let mut h = b.rows(hidden, &idx)?;
    // Round 0 catches up over every known row (the chunks that propose return their last row);
    // each later round is one draft row per chunk that wants more.
    let mut tokens: Vec<Vec<u32>> = parts.iter().map(|p| p.next.clone()).collect();
    let mut pos: Vec<usize> = parts.iter().map(|p| plan.chunks[p.chunk].pos0).collect();
    let mut round = 0;
    let mut current: Vec<usize> = (0..parts.len()).collect();
    loop {
        let chunks: Vec<StepChunk<'_>> = current
            .iter()
            .map(|&k| {
                let c = &plan.chunks[parts[k].chunk];
                StepChunk {
                    tokens: &tokens[k],
                    history: &[],
                    pos0: pos[k],
                    state: c.state,
                    blocks: &c.blocks,
                    out: match parts[k].propose > round {
                        true => OutRows::Last,
                        false => OutRows::None,
                    },
                }
            })
            .collect();
        let step = m
            .step(StepInput {
                chunks: &chunks,
                start: StepStart::Draft(h),
                hidden: true,
            })
            .map_err(|e| sanmai_model::BackendError::invalid("mtp draft", e.to_string()))?;
        let asked: Vec<usize> = current
            .iter()
            .copied()
            .filter(|&k| parts[k].propose > round)
            .collect();
        let (Some(logits), Some(hs)) = (step.logits, step.hidden) else {
            break;
        };
        // The draft rows of the chunks whose grammar picks among the head's logits.
        let masked: Vec<usize> = (0..asked.len())
            .filter(|&j| {
                plan.chunks[parts[asked[j]].chunk]
                    .spec
                    .is_some_and(|s| s.masked)
            })
            .collect();
        if !masked.is_empty() {
            let (_, cols, host) = b.to_host(b.rows(&logits, &masked)?)?;
            for (row, &j) in host.chunks(cols.max(1)).zip(&masked) {
                let p = &parts[asked[j]];
                logit_rows[p.chunk].push(row[..p.valid_vocab.min(cols)].to_vec());
            }
        }
        let picks = greedy(b, logits, parts[asked[0]].valid_vocab, asked.len())?;
        for (&k, id) in asked.iter().zip(picks) {
            drafts[parts[k].chunk].push(id);
            // The draft sits one position after the row it was read from.
            pos[k] += tokens[k].len();
            tokens[k] = vec![id];
        }
        round += 1;
        // The next round: the chunks that want more drafts, from the head's own output rows.
        let more: Vec<usize> = (0..asked.len())
            .filter(|&j| parts[asked[j]].propose > round)
            .collect();
        if more.is_empty() {
            break;
        }
        h = b.rows(&hs, &more)?;
        current = more.iter().map(|&j| asked[j]).collect();
    }
    Ok((drafts, logit_rows))
}

/// The greedy pick of each of the `n` rows of `logits`.
fn greedy<B: Backend>(
    b: &B,
    logits: B::Tensor,
    valid_vocab: usize,
    n: usize,
) -> OpResult<Vec<u32>> {
    let params = SamplingParams::greedy()
        .validated(valid_vocab)
        .map_err(|e| sanmai_model::BackendError::invalid("mtp draft", e.to_string()))?;
    let row = RowSampling {
        params: &params,
        seen: &[],
        allowed: None,
        uniform: 0.0,
    };
    let rows = vec![row; n];
    b.sample(
        logits,
        &SampleCall {
            valid_vocab,
            rows: &rows,
        },
    )?
    .into_iter()
    .map(|r| {
        r.map(|s| s.id)
            .map_err(|e| sanmai_model::BackendError::invalid("mtp draft", e.to_string()))
    })
    .collect()
}
