"""The prefix cache: finished samples' KV-cache rows kept for reuse by later prompts.

A conversation sends each turn as a new request whose prompt is the previous turn's prompt and
sampled tokens followed by the new messages. With prefix reuse (`rows` > 0, the worker's
--prefix-cache) a finished sample's row is kept (up to `rows` of them, least recently used first
out) instead of freed at once: its token ids (prompt + sampled tokens but the last, whose key and
value were never computed) are what positions [0, n) of the row hold. The generator's admission
(Generator._place) asks `match` for the longest kept prefix of a new prompt, takes the row over or
copies its prefix, and evicts a kept row only when a sample needs one and none is free.

An idle row still rides in decode steps, writing at position 0, so when a row goes idle its
position 0 is saved (`save_pos0`) and put back before its prefix is read (`restore_pos0`).

Every kept row is dropped when the weights change (`forget`); under LoRA adapters a row is
reused only by requests of the adapter that computed it.
"""

from __future__ import annotations

import collections

import torch

from .model import kv_bytes


class PrefixCache:
    """The kept rows, least recently used first, and an index of their token ids: a chain hash of
    blocks 1..k of `min` tokens → the rows whose first k blocks hash so (`match` compares only
    those rows)."""

    def __init__(self, rows: int, min_len: int, *, slots: int, max_len: int, device):
        self.rows = min(max(rows, 0), slots)  # rows kept at most; 0: reuse off
        self.min = max(min_len, 1)  # the shortest prefix reused, and the hash block
        self.S, self.L, self.device = slots, max_len, device
        self.kept: collections.OrderedDict[int, None] = collections.OrderedDict()
        self.adapter: list = [None] * slots  # the LoRA adapter that computed a row's keys
        self.by_hash: dict[int, set[int]] = {}
        self.row_hashes: list[list[int]] = [[] for _ in range(slots)]
        # The token ids each kept row holds (-1 past them, and everywhere in rows not kept).
        self.tokens = torch.full((slots, max_len), -1, dtype=torch.int32) if self.rows else None
        # Position 0 of each layer's keys and values of rows gone idle, on first use:
        # [slots, kv_heads, head_dim] a layer; saved0[row]: the row's position 0 is there.
        self.k0 = self.v0 = None
        self.saved0 = [False] * slots
        self.stats = dict(prompts=0, hits=0, prompt_tokens=0, reused_tokens=0, evicted=0)
        # Counts `forget` calls: a sample admitted before the weights changed finishes with keys
        # and values partly of the old weights, so its row is not kept.
        self.weights = 0

    # ---- keeping and dropping rows ----

    def keep(self, seqs) -> None:
        """Keeps the rows of finished samples (sequence.Sequence; their slots were just freed),
        evicting the least recently used rows past `rows`."""
        for s in seqs:
            ids = s.req.prompt + s.tokens[:-1]
            self.tokens[s.slot, :len(ids)] = torch.tensor(ids, dtype=torch.int32)
            self.adapter[s.slot] = s.req.adapter
            self.row_hashes[s.slot] = hs = list(self._block_hashes(ids, len(ids)))
            for h in hs:
                self.by_hash.setdefault(h, set()).add(s.slot)
            self.kept[s.slot] = None
            self.kept.move_to_end(s.slot)
        while len(self.kept) > self.rows:
            self.evict(next(iter(self.kept)))

    def evict(self, row: int) -> None:
        del self.kept[row]
        self.unindex(row)
        self.stats["evicted"] += 1

    def evict_lru(self, spare: set[int]) -> int:
        """Evicts the least recently used kept row not in spare and returns it; -1 if none."""
        old = next((r for r in self.kept if r not in spare), -1)
        if old >= 0:
            self.evict(old)
        return old

    def take(self, row: int, start: int) -> None:
        """A new sample takes kept row over from its prefix of start tokens on. The prefix stays
        valid (for copies) until the sample's prefill writes past it; call `unindex` then."""
        del self.kept[row]
        self.tokens[row, start:].fill_(-1)

    def touch(self, row: int) -> None:
        """Marks a kept row as just used (a prefix copied from it)."""
        if row in self.kept:
            self.kept.move_to_end(row)

    def unindex(self, row: int) -> None:
        self.tokens[row].fill_(-1)
        for h in self.row_hashes[row]:
            rows = self.by_hash[h]
            rows.discard(row)
            if not rows:
                del self.by_hash[h]
        self.row_hashes[row] = []

    def forget(self) -> int:
        """Drops every kept row (the weights changed: their keys and values are stale); returns
        how many there were."""
        n = len(self.kept)
        self.weights += 1
        self.kept.clear()
        self.adapter = [None] * self.S
        self.by_hash.clear()
        self.row_hashes = [[] for _ in range(self.S)]
        if self.tokens is not None:
            self.tokens.fill_(-1)
        return n

    # ---- finding prefixes ----

    def match(self, req, pinned: set[int]) -> tuple[int, int]:
        """(length, row) of the longest prefix of req's prompt a kept row of the same adapter
        holds (a row taken over in this admission holds its new sample's start), at most the
        prompt's length - 1 tokens and at least `min`; (0, -1) when none. Ties go to a row not
        pinned, then to the lowest."""
        prompt = req.prompt
        n = min(len(prompt), self.L) - 1
        rows: set[int] = set()
        for h in self._block_hashes(prompt, n):  # the rows sharing the most leading blocks
            deeper = self.by_hash.get(h)
            if not deeper:
                break
            rows = deeper
        rows = sorted(r for r in rows if self.adapter[r] is req.adapter)
        if not rows:
            return 0, -1
        # Exact from here (a hash may collide; a row taken over holds only its new start).
        p = torch.tensor(prompt[:n], dtype=torch.int32)
        differ = self.tokens[rows, :n] != p  # -1 past a row's tokens: never equal
        lcp = torch.where(differ.any(1), differ.int().argmax(1), n)
        score = lcp * 2 + torch.tensor([r not in pinned for r in rows])
        i = int(score.argmax())
        length = int(lcp[i])
        return (length, rows[i]) if length >= self.min else (0, -1)

    def wanted(self, queue) -> set[int]:
        """The kept rows the prompts of the first waiting requests (twice as many as there are
        rows) would reuse."""
        out, seen = set(), set()
        for s in queue:
            if len(seen) >= 2 * self.S:
                break
            if id(s.req) not in seen:
                seen.add(id(s.req))
                _, src = self.match(s.req, set())
                if src >= 0:
                    out.add(src)
        return out

    def _block_hashes(self, ids: list[int], n: int):
        """The chain hashes of the whole blocks of `min` tokens in ids[:n]."""
        B, h = self.min, 0
        for k in range(n // B):
            h = hash((h, tuple(ids[k * B:(k + 1) * B])))
            yield h

    # ---- counters ----

    def count(self, prompt_len: int, start: int) -> None:
        """Counts a prompt admitted with a prefix of start tokens found (0: none)."""
        st = self.stats
        st["prompts"] += 1
        st["prompt_tokens"] += prompt_len
        if start:
            st["hits"] += 1
            st["reused_tokens"] += start

    def take_stats(self) -> dict:
        """The counters since the last call, and zeroes them."""
        out = dict(self.stats, kept=len(self.kept))
        self.stats = dict.fromkeys(self.stats, 0)
        return out

    # ---- position 0 of idle rows ----

    def save_pos0(self, k: list[torch.Tensor], v: list[torch.Tensor], rows: list[int]) -> None:
        """Saves position 0 of the cache rows about to go idle (not already saved); k and v are
        the cache's per-layer keys and values."""
        rows = [r for r in rows if not self.saved0[r]]
        if not rows:
            return
        # (An fp8 cache's bytes: these are copies, and not every index kernel takes float8.)
        ks, vs = [kv_bytes(t) for t in k], [kv_bytes(t) for t in v]
        if self.k0 is None:
            self.k0 = [kc[:, :, 0].clone() for kc in ks]
            self.v0 = [vc[:, :, 0].clone() for vc in vs]
        idx = torch.tensor(rows, device=self.device)
        for kc, vc, k0, v0 in zip(ks, vs, self.k0, self.v0):
            k0[idx] = kc[idx, :, 0]
            v0[idx] = vc[idx, :, 0]
        for r in rows:
            self.saved0[r] = True

    def restore_pos0(self, k: list[torch.Tensor], v: list[torch.Tensor], rows: list[int]) -> None:
        """Puts position 0 of idle rows back (before their prefix is read)."""
        idx = torch.tensor(rows, device=self.device)
        for kc, vc, k0, v0 in zip(map(kv_bytes, k), map(kv_bytes, v), self.k0, self.v0):
            kc[idx, :, 0] = k0[idx]
            vc[idx, :, 0] = v0[idx]

    def occupied(self, row: int) -> None:
        """A sample writes the row from now on: a saved position 0 of it is stale."""
        self.saved0[row] = False
