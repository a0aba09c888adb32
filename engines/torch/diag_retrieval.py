"""Can a model of this shape learn MemAgent's find turn at all?

MemAgent's find turn copies, from a chunk of facts "NAME's KEY is VALUE.", the value of the fact
whose name and key are the question's: a lookup by two tokens at once. builtin:tiny-chat (hidden
64, 2 layers, heads of 16) never learns it from the chat corpus (docs/agents.md). This script asks
the question without the corpus: a bare causal transformer of the given shape (RMSNorm, RoPE and
tied embeddings as tiny-chat, a plain SiLU MLP for its SwiGLU) trained from random weights on the lookup alone,
in a 31-token vocabulary:

    Q NAME 's KEY C  NAME 's KEY is D D .  (n facts)  A NAME 's KEY is -> D D

with 8 names, 6 keys, two-digit values as two digit tokens, and n of 2, 3, 5 or 10 facts, each
(name, key) at most once. Only the two answer digits are trained. Two options bring it closer to
the chat corpus's find turn: --answer-names writes the answer's NAME as a token of its own (the
note's bare `Hal` against the chunk's ` Hal`), --prefix N puts N tokens drawn from 16 others
before the question (the turn's instructions). Every --eval-every steps it
prints the loss and the share of 200 fresh problems whose two digits are both right, by n: a model
that copies one of the facts' values at random gets 1/n.

    python engines/torch/diag_retrieval.py --hidden 128 --heads 4 --layers 2 --steps 4000

On 1 CPU thread (2026-11-29, seed 0, batches of 64): hidden 64 with 4 heads of 16 (tiny-chat's
widths), with 2 heads of 32, and with 3 layers stayed at chance for 3,000-6,000 steps; hidden 128
with 4 heads of 32 was at 0.93 / 0.65 / 0.23 (n = 2, 5, 10) by step 2,000.
"""

import argparse
import random
import time

import torch
import torch.nn as nn
import torch.nn.functional as F

NAMES, KEYS = 8, 6
# The vocabulary: names 0-7, keys 8-13, digits 14-23, then these; the answer's own names
# (--answer-names) 31-38, the prefix's tokens (--prefix) 39-54.
S_, IS, DOT, Q, C, A, PAD = 24, 25, 26, 27, 28, 29, 30
ANSWER_NAME, PREFIX = 31, 39
VOCAB, VOCAB_WITH_OPTIONS = 31, 55


def problem(rng, n, answer_names=False, prefix=0):
    """One lookup among n facts: (prompt tokens, the two answer tokens)."""
    pairs = rng.sample([(a, b) for a in range(NAMES) for b in range(KEYS)], n)
    facts = [(a, b, rng.randrange(10), rng.randrange(10)) for a, b in pairs]
    qa, qb, d1, d2 = rng.choice(facts)
    seq = [PREFIX + rng.randrange(16) for _ in range(prefix)] + [Q, qa, S_, 8 + qb, C]
    for a, b, x, y in facts:
        seq += [a, S_, 8 + b, IS, 14 + x, 14 + y, DOT]
    seq += [A, ANSWER_NAME + qa if answer_names else qa, S_, 8 + qb, IS]
    return seq, [14 + d1, 14 + d2]


def batch(rng, size, sizes, answer_names=False, prefix=0):
    """Inputs and targets (-100 where nothing is trained) of size problems, padded."""
    xs, ys = [], []
    for _ in range(size):
        seq, ans = problem(rng, rng.choice(sizes), answer_names, prefix)
        full = seq + ans
        xs.append(full[:-1])
        ys.append([-100] * (len(seq) - 1) + ans)
    t = max(map(len, xs))
    x = torch.full((size, t), PAD)
    y = torch.full((size, t), -100)
    for i, (a, b) in enumerate(zip(xs, ys)):
        x[i, : len(a)] = torch.tensor(a)
        y[i, : len(b)] = torch.tensor(b)
    return x, y


class Block(nn.Module):
    def __init__(self, d, heads):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.n1, self.n2 = nn.RMSNorm(d), nn.RMSNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 3 * d), nn.SiLU(), nn.Linear(3 * d, d))

    def forward(self, x, rope):
        b, t, d = x.shape
        q, k, v = self.qkv(self.n1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        a = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.n2(x))


class Model(nn.Module):
    def __init__(self, d, heads, layers, vocab=VOCAB, theta=10000.0, positions=512):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList([Block(d, heads) for _ in range(layers)])
        self.norm = nn.RMSNorm(d)
        hd = d // heads
        ang = torch.arange(positions)[:, None] * (1.0 / theta ** (torch.arange(0, hd, 2) / hd))[None]
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)

    def rope(self, x):
        t = x.shape[-2]
        c, s = self.cos[:t], self.sin[:t]
        x1, x2 = x[..., ::2], x[..., 1::2]
        return torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], -1).flatten(-2)

    def forward(self, x):
        h = self.emb(x)
        for b in self.blocks:
            h = b(h, self.rope)
        return self.norm(h) @ self.emb.weight.T


def right_share(model, rng, n, size=200, answer_names=False, prefix=0):
    """The share of size fresh n-fact problems whose two answer digits are both right (greedy)."""
    with torch.no_grad():
        x, y = batch(rng, size, [n], answer_names, prefix)
        got = model(x).argmax(-1)
        trained = y != -100
        return ((got == y) | ~trained).all(1).float().mean().item()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--hidden", type=int, default=64)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--eval-every", type=int, default=500)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--answer-names", action="store_true", help="the answer's NAME a token of its own")
    p.add_argument("--prefix", type=int, default=0, help="tokens before the question")
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    torch.manual_seed(a.seed)
    rng = random.Random(a.seed)
    model = Model(a.hidden, a.heads, a.layers, VOCAB_WITH_OPTIONS if a.answer_names or a.prefix else VOCAB)
    opt = torch.optim.AdamW(model.parameters(), a.lr, weight_decay=0.01)
    params = sum(q.numel() for q in model.parameters())
    print(f"hidden {a.hidden}, {a.heads} heads of {a.hidden // a.heads}, {a.layers} layers: {params} parameters", flush=True)
    print("step  loss   right with 2 / 5 / 10 facts (chance 0.50 / 0.20 / 0.10)", flush=True)
    start = time.time()
    for step in range(1, a.steps + 1):
        x, y = batch(rng, a.batch, [2, 3, 5, 10], a.answer_names, a.prefix)
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=-100)
        opt.zero_grad()
        loss.backward()
        opt.step()
        if step % a.eval_every == 0 or step == a.steps:
            shares = " / ".join(f"{right_share(model, rng, n, 200, a.answer_names, a.prefix):.2f}" for n in (2, 5, 10))
            print(f"{step:5d} {loss.item():.3f}  {shares}  ({time.time() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
