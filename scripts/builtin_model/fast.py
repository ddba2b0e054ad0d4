"""Faster training steps for the built-in model, each the same function as transformers' original.

At the built-in model's size a GPU training step is bound by kernel launches and host syncs, not by
arithmetic. What is here removes the syncs and the data-dependent shapes, so that a whole step
(forward, backward, clipping, AdamW) can also be captured once per sequence-length bucket as a CUDA
graph and replayed (`train.py --cuda-graphs`):

- `dense_experts_forward`: every routed expert on every token, weighted by the router's top-k weights
  scattered into a dense [tokens, experts] matrix (zero for the experts a token was not routed to).
  The same sum as transformers' per-expert loop, with no `nonzero` / `.item()` and fixed shapes; the
  experts are tiny, so the extra arithmetic costs less than the launches it saves. Registered as the
  experts implementation "dense".
- `load_balancing_loss`: transformers' `load_balancing_loss_func` without `bincount` (which syncs on a
  GPU): the same counts from a comparison with each expert's index.
- `HeadLoss`: the tied LM head's cross-entropy on gathered positions, chunked, with the logits
  recomputed in the backward pass instead of kept (a 248,320-wide row per position would otherwise
  stay in memory), and a weight per position (0 for the padding of a fixed-size position list).

`check_fast.py` compares each with the original in float64.
"""

import torch
import torch.nn.functional as F
from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS


def dense_experts_forward(self, hidden_states, top_k_index, top_k_weights):
    """Qwen3_5MoeExperts.forward with every expert computed for every token."""
    n, h = hidden_states.shape
    route = torch.zeros(n, self.num_experts, dtype=top_k_weights.dtype, device=hidden_states.device)
    route = route.scatter(1, top_k_index, top_k_weights)  # [N, E]
    x = hidden_states.to(self.gate_up_proj.dtype) if not torch.is_autocast_enabled() else hidden_states
    gate_up = torch.einsum("nh,eoh->neo", x, self.gate_up_proj)  # [N, E, 2I]
    gate, up = gate_up.chunk(2, dim=-1)
    act = self.act_fn(gate) * up  # [N, E, I]
    act = act * route.unsqueeze(-1).to(act.dtype)
    out = torch.einsum("nei,ehi->nh", act, self.down_proj)  # sums over experts too
    return out.to(hidden_states.dtype)


ALL_EXPERTS_FUNCTIONS.register("dense", dense_experts_forward)


def load_balancing_loss(gate_logits, num_experts, top_k):
    """transformers' load_balancing_loss_func (no attention mask), without bincount or one_hot."""
    tokens = torch.zeros(num_experts, dtype=torch.float32, device=gate_logits[0].device)
    probs = torch.zeros_like(tokens)
    experts = torch.arange(num_experts, device=tokens.device)
    rows = 0
    for layer_gate in gate_logits:
        routing = torch.softmax(layer_gate.float(), dim=-1)
        _, selected = torch.topk(routing, top_k, dim=-1)
        tokens = tokens + (selected.unsqueeze(-1) == experts).sum(dim=(0, 1)).float()
        probs = probs + routing.sum(dim=0)
        rows += routing.shape[0]
    return torch.sum((tokens / rows) * (probs / rows)) * num_experts


def _logits(h, w, bias, acc):
    """One chunk's logits in `acc`, with the columns' correction when there is one."""
    logits = (h @ w.t()).to(acc)
    return logits if bias is None else logits + bias


class HeadLoss(torch.autograd.Function):
    """sum_i w_i * CE(h_i @ W^T + bias, t_i), the logits in `dtype` (bf16 on a GPU), softmax in float32,
    in chunks of `chunk` rows; the backward pass recomputes each chunk's logits. `bias` (a constant per
    column, or None) is the log-correction of sampled columns."""

    @staticmethod
    def forward(ctx, hidden, weight, targets, weights, chunk, dtype, bias):
        w = weight.to(dtype)
        acc = torch.promote_types(hidden.dtype, torch.float32)
        lses = []
        total = hidden.new_zeros((), dtype=acc)
        for s in range(0, hidden.shape[0], chunk):
            logits = _logits(hidden[s : s + chunk].to(dtype), w, bias, acc)
            lse = torch.logsumexp(logits, dim=-1)
            tgt = logits.gather(1, targets[s : s + chunk, None]).squeeze(1)
            total = total + ((lse - tgt) * weights[s : s + chunk]).sum()
            lses.append(lse)
        ctx.save_for_backward(hidden, weight, targets, weights, torch.cat(lses))
        ctx.chunk, ctx.dtype, ctx.bias = chunk, dtype, bias
        return total

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, targets, weights, lse = ctx.saved_tensors
        chunk, dtype, bias = ctx.chunk, ctx.dtype, ctx.bias
        w = weight.to(dtype)
        acc = lse.dtype
        grad_h = torch.empty_like(hidden)
        grad_w = torch.zeros(weight.shape, dtype=acc, device=weight.device)
        for s in range(0, hidden.shape[0], chunk):
            h = hidden[s : s + chunk].to(dtype)
            p = torch.exp(_logits(h, w, bias, acc) - lse[s : s + chunk, None])
            p.scatter_add_(1, targets[s : s + chunk, None], -torch.ones_like(p[:, :1]))
            p = (p * (weights[s : s + chunk] * grad)[:, None]).to(dtype)
            grad_h[s : s + chunk] = (p @ w).to(hidden.dtype)
            grad_w += (p.t() @ h).to(acc)
        return grad_h, grad_w.to(weight.dtype), None, None, None, None, None


def head_loss(hidden, weight, targets, weights, chunk=4096, dtype=None, bias=None):
    """Mean over the weighted positions of the tied head's cross-entropy (weights 0 or 1); `bias` is
    added to every row's logits (the sampled columns' log-correction)."""
    dtype = dtype or hidden.dtype
    weights = weights.to(torch.promote_types(hidden.dtype, torch.float32))
    total = HeadLoss.apply(hidden, weight, targets, weights, chunk, dtype, bias)
    return total / weights.sum().clamp_min(1.0)
