"""Training batches of fixed shapes: exchanges bucketed by length, a bucket's batches all [rows, T],
and the positions the loss is taken on gathered into fixed-size lists.

A batch of bucket T holds up to `rows(T)` exchanges of at most T tokens (right-padded) and at most
`cap(T)` reply tokens; unused rows are padding. The loss positions are flat indices into the
[rows, T] hidden states (`pos1`: position t predicts token t+1, counted where t+1 is a reply token)
and into the MTP head's [rows, T-1] drafts (`pos2`: index t predicts token t+2), each with its target
and a weight (1, or 0 for the list's padding). So a bucket's steps all have one shape: on a GPU the
whole step can be captured once as a CUDA graph and replayed.

Every epoch visits every exchange once (those of at least `long_len` tokens only with `long_share`'s
chance), in a new order; batches of all buckets are interleaved.
"""

import queue
import threading

import numpy as np
import torch

BUCKETS = (64, 128, 192, 256, 320, 384, 512, 640, 768, 1024, 1536, 2048, 3072, 4096)


class Batches:
    def __init__(self, ids, offsets, reply_start, tokens_per_batch, max_rows, reply_cap, pad_id, seed,
                 max_len=4096, active=None, long_share=1.0, long_len=1024):
        lengths = np.diff(offsets).astype(np.int64)
        keep = lengths <= max_len
        self.flat = np.concatenate([ids.astype(np.int64), [pad_id]])
        self.pad_pos = len(ids)
        self.pad_id = pad_id
        self.starts = offsets[:-1].astype(np.int64)[keep]
        self.lengths = lengths[keep]
        self.reply = reply_start.astype(np.int64)[keep]
        self.replies = self.lengths - self.reply
        self.dropped = int((~keep).sum())
        self.active = None if active is None else np.asarray(active, np.int64)
        buckets = [b for b in BUCKETS if b < max_len] + [max_len]
        self.bucket_of = np.searchsorted(np.asarray(buckets), self.lengths)
        self.shapes = {}
        for i, t in enumerate(buckets):
            sel = self.bucket_of == i
            if not sel.any():
                continue
            rows = int(max(1, min(max_rows, tokens_per_batch // t)))
            mean = float(self.replies[sel].mean())
            cap = int(min(reply_cap, rows * mean * 1.2))
            cap = max(cap, int(self.replies[sel].max()))
            cap = -(-cap // 128) * 128
            self.shapes[i] = (t, rows, cap)
        self.rng = np.random.default_rng(seed)
        self.long_share, self.long_len = long_share, long_len

    def describe(self):
        return {self.shapes[i][0]: {"rows": self.shapes[i][1], "reply_cap": self.shapes[i][2],
                                    "exchanges": int((self.bucket_of == i).sum())} for i in sorted(self.shapes)}

    def epoch(self):
        """The batches of one pass over the data: (bucket, exchange indices), shuffled."""
        out = []
        for i, (t, rows, cap) in self.shapes.items():
            members = np.flatnonzero(self.bucket_of == i)
            self.rng.shuffle(members)
            cur, used = [], 0
            for e in members.tolist():
                r = int(self.replies[e])
                if cur and (len(cur) >= rows or used + r > cap):
                    out.append((i, cur))
                    cur, used = [], 0
                cur.append(e)
                used += r
            if cur:
                out.append((i, cur))
        # Long exchanges (agent contexts) carry few reply tokens for their length: only a share of their
        # batches is used in each epoch (a different share each time).
        out = [o for o in out if self.shapes[o[0]][0] < self.long_len or self.rng.random() < self.long_share]
        order = self.rng.permutation(len(out))
        return [out[k] for k in order]

    def assemble(self, bucket, members):
        t, rows, cap = self.shapes[bucket]
        m = np.asarray(members, np.int64)
        j = np.arange(t)
        valid = j[None, :] < self.lengths[m][:, None]
        idx = np.where(valid, self.starts[m][:, None] + j[None, :], self.pad_pos)
        ids = np.full((rows, t), self.pad_id, np.int64)
        ids[: len(m)] = self.flat[idx]
        reply = valid & (j[None, :] >= self.reply[m][:, None])
        out = {"ids": ids}
        for name, shift, width in (("1", 1, t), ("2", 2, t - 1)):
            b, p = np.nonzero(reply[:, shift:])
            tgt = ids[b, p + shift]
            if self.active is not None:
                tgt = np.searchsorted(self.active, tgt)
            n = len(b)
            pos = np.zeros(cap, np.int64)
            pos[:n] = b * width + p
            target = np.zeros(cap, np.int64)
            target[:n] = tgt
            weight = np.zeros(cap, np.float32)
            weight[:n] = 1.0
            out["pos" + name], out["tgt" + name], out["w" + name] = pos, target, weight
        return {k: torch.from_numpy(v) for k, v in out.items()}

    def stream(self, pin=False, prefetch=8):
        """Endless assembled batches, built on a background thread."""
        q = queue.Queue(maxsize=prefetch)

        def work():
            while True:
                for bucket, members in self.epoch():
                    b = self.assemble(bucket, members)
                    if pin:
                        b = {k: v.pin_memory() for k, v in b.items()}
                    q.put(b)

        threading.Thread(target=work, daemon=True).start()
        while True:
            yield q.get()
