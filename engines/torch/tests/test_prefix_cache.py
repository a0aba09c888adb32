"""Prefix reuse across a conversation's turns (Options.prefix_cache; generate.py's module
comment): a later turn whose prompt starts with an earlier turn's prompt and sampled tokens is
prefilled from there, and gets the same tokens and log-probs (fp32 on the CPU: within 1e-5) as
with reuse off; kept rows are evicted under slot pressure, dropped when the weights change, and
n > 1 samples follow their lead's row."""

import logging
import threading

import pytest
import torch

from slimen_torch.engine import Engine, Options
from slimen_torch.types import Batch, GenerateRequest, LossConfig, Sample, Sampling


def make(model_dir, rows, slots=6, **kw):
    return Engine(str(model_dir), Options(device="cpu", slots=slots, max_seq_len=256,
                                          prefix_cache=rows, prefix_min=4, **kw))


@pytest.fixture(scope="module")
def pair(noeos_dir):
    on, off = make(noeos_dir, 6), make(noeos_dir, 0)
    yield on, off
    on.close()
    off.close()


def prompt(seed, n):
    return torch.randint(3, 200, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def turn(e, rid, ids, n=1, seed=1, max_tokens=6):
    return e.generate([GenerateRequest(id=rid, prompt_tokens=ids, n=n,
                                       sampling=Sampling(seed=seed, max_tokens=max_tokens))])


def together(e, reqs):
    """e.generate(reqs), the requests queued at once (the worker sees them in one admission)."""
    got, done = {}, threading.Event()

    def on_completion(c):
        got[(c.request_id, c.index)] = c
        if len(got) == sum(r.n or 1 for r in reqs):
            done.set()

    with e._cv:  # the worker thread waits for it to take the new requests
        for r in reqs:
            e.submit(r, on_completion)
    assert done.wait(60)
    return [got[(r.id, i)] for r in reqs for i in range(r.n or 1)]


def assert_same(a, b):
    assert [c.tokens for c in a] == [c.tokens for c in b]
    for x, y in zip(a, b):
        assert max(abs(p - q) for p, q in zip(x.logprobs, y.logprobs)) <= 1e-5


def conversation(e, seed, turns=3, n=1):
    """A chat: each turn's prompt is the previous prompt + its first sample's tokens + new ids."""
    ids, out = prompt(seed, 20), []
    for t in range(turns):
        cs = turn(e, f"c{seed}-{t}", ids, n=n, seed=seed + t)
        out.append(cs)
        ids = ids + cs[0].tokens + prompt(seed * 10 + t, 7)
    return out


def test_later_turns_match_reuse_off(pair):
    on, off = pair
    on.gen.take_prefix_stats()
    got, want = conversation(on, 1), conversation(off, 1)
    for a, b in zip(got, want):
        assert_same(a, b)
    st = on.gen.take_prefix_stats()
    # Turns 2 and 3 reuse all of the previous turn but its last sampled token (never fed back).
    assert st["prompts"] == 3 and st["hits"] == 2
    assert st["reused_tokens"] == (20 + 6 - 1) + (20 + 6 + 7 + 6 - 1)
    assert off.gen.take_prefix_stats()["hits"] == 0


def test_n_samples_follow_their_lead(pair):
    on, off = pair
    got, want = conversation(on, 2, n=3), conversation(off, 2, n=3)
    for a, b in zip(got, want):
        assert len(a) == 3
        assert_same(a, b)


def test_suffix_prefill_equals_the_full_prefill(pair):
    """The logits and the row's keys and values of a prompt prefilled from a cached prefix, with
    another prompt of another start in the same batch, equal a whole prefill."""
    on, _ = pair
    gen = on.gen
    from slimen_torch.generate import Placed, Request, Sequence

    def run():
        gen._ensure_cache()
        a, b = prompt(5, 40), prompt(6, 23)
        full = gen._prefill_eager([a, b], torch.tensor([0, 1]), torch.tensor([0, 1]))
        seqs = []
        for p, row in ((a, 2), (b, 3)):
            s = Sequence(Request("x", p, 1, Sampling(), None), 0, 1)
            s.slot = row
            seqs.append(s)
        gen._copy_rows(torch.tensor([0]), torch.tensor([2]), 31)
        gen._copy_rows(torch.tensor([1]), torch.tensor([3]), 5)
        part = gen._prefill_offsets([Placed(seqs[0], 31, 2, seqs[0]),
                                     Placed(seqs[1], 5, 3, seqs[1])])
        kv = [(kc[0, :, :40], kc[2, :, :40], vc[1, :, :23], vc[3, :, :23])
              for kc, vc in zip(gen.k, gen.v)]
        return full.clone(), part.clone(), [tuple(t.clone() for t in x) for x in kv]

    full, part, kv = on._call(run)
    assert (full - part).abs().max() <= 1e-5
    for k0, k2, v1, v3 in kv:
        assert (k0 - k2).abs().max() <= 1e-5 and (v1 - v3).abs().max() <= 1e-5


def test_eviction_under_slot_pressure(noeos_dir):
    on, off = make(noeos_dir, 2, slots=2), make(noeos_dir, 0, slots=2)
    try:
        firsts = {}
        for seed in (11, 12, 13):  # the third conversation needs a row: evicts the oldest (11)
            ids = prompt(seed, 20)
            firsts[seed] = (ids, turn(on, f"a{seed}", ids, seed=seed))
        st = on.gen.take_prefix_stats()
        assert st["evicted"] == 1 and st["kept"] == 2 and st["hits"] == 0
        # Three later turns at once, two rows: 12 and 13 hit, 11 was evicted.
        reqs = [GenerateRequest(id=f"b{s}", prompt_tokens=ids + cs[0].tokens + [5, 6, 7],
                                sampling=Sampling(seed=s, max_tokens=6))
                for s, (ids, cs) in firsts.items()]
        got, want = together(on, reqs), off.generate(reqs)
        assert_same(got, want)
        st = on.gen.take_prefix_stats()
        assert st["hits"] == 2 and st["prompts"] == 3
        assert st["reused_tokens"] == 2 * (20 + 6 - 1)
    finally:
        on.close()
        off.close()


def test_train_drops_kept_rows(noeos_dir, caplog):
    e = make(noeos_dir, 4)
    try:
        ids = prompt(21, 20)
        cs = turn(e, "t1", ids)
        assert len(e.gen.kept) == 1
        batch = Batch(samples=[Sample(ids, cs[0].tokens, [1.0] * 6, cs[0].logprobs, [1.0] * 6)],
                      loss=LossConfig(lr=1e-2))
        with caplog.at_level(logging.INFO, logger="slimen_torch"):
            e.train(batch)
        assert len(e.gen.kept) == 0
        line = next(r.getMessage() for r in caplog.records if "prefix cache:" in r.getMessage())
        assert "1 prompts, 0 with a cached prefix; 0 of 20 prompt tokens reused" in line
        assert "1 kept rows dropped (training step)" in line
        # The next turn is prefilled whole, with the new weights.
        turn(e, "t2", ids + cs[0].tokens + [9, 9, 9])
        st = e.gen.take_prefix_stats()
        assert st["prompts"] == 1 and st["hits"] == 0
    finally:
        e.close()


def test_with_the_triton_decode_kernels(noeos_dir):
    """The Triton decode attention (CPU: Triton's interpreter), two conversations of a shared
    opening running at once. (Three tokens a turn: two interpreted decode steps, the second
    reading the step before's token from the cache.)"""
    on = make(noeos_dir, 6, kernels=True, fused_b1=True, prefill_graph_max=128)
    off = make(noeos_dir, 0, kernels=True, fused_b1=True, prefill_graph_max=128)
    try:
        assert on.gen.triton
        shared = prompt(31, 24)
        convs = [shared + prompt(32 + i, 3) for i in range(2)]
        for t in range(2):
            reqs = [GenerateRequest(id=f"k{i}-{t}", prompt_tokens=ids, n=1 + i,
                                    sampling=Sampling(seed=i + t, max_tokens=3))
                    for i, ids in enumerate(convs)]
            got, want = together(on, reqs), together(off, reqs)
            assert len(got) == 3
            assert_same(got, want)
            convs = [convs[0] + got[0].tokens + [7, 8], convs[1] + got[1].tokens + [7, 8]]
        st = on.gen.take_prefix_stats()
        assert st["hits"] == 2 and st["reused_tokens"] == 2 * (27 + 3 - 1)
    finally:
        on.close()
        off.close()


def test_two_prompts_reuse_one_kept_row(pair):
    """Two forks of one turn admitted together: the first takes the kept row over, the second
    gets a copy of its prefix before the first's prefill overwrites the row."""
    on, off = pair
    ids = prompt(41, 20)
    first = turn(on, "f0", ids)
    assert_same(first, turn(off, "f0", ids))
    on.gen.take_prefix_stats()
    base = ids + first[0].tokens
    reqs = [GenerateRequest(id=f"fork{i}", prompt_tokens=base + prompt(42 + i, 5),
                            sampling=Sampling(seed=i, max_tokens=6)) for i in range(2)]
    on.gen.offset_scores = 1  # one prompt a chunk
    try:
        assert_same(together(on, reqs), together(off, reqs))
    finally:
        on.gen.offset_scores = 1 << 28
    st = on.gen.take_prefix_stats()
    assert st["hits"] == 2 and st["reused_tokens"] == 2 * (20 + 6 - 1)


def test_a_sample_running_across_a_weight_change_is_not_kept(noeos_dir):
    e = make(noeos_dir, 4)
    try:
        from slimen_torch.generate import Request

        def run():
            gen, got = e.gen, []
            gen.add(Request("w", prompt(51, 20), 1, Sampling(seed=1, max_tokens=6), got.append))
            gen.step()  # admitted and a decode step launched
            e._weights_change("training step")
            while gen.busy():
                gen.step()
            return got, len(gen.kept)

        got, kept = e._call(run)
        assert len(got) == 1 and len(got[0].tokens) == 6 and kept == 0
    finally:
        e.close()


def test_lora_adapters_reuse_only_their_own_rows(noeos_dir):
    """Under LoRA adapters a kept row is reused only by a request of the adapter that computed
    it; the turns equal those with reuse off, and adding an adapter drops the kept rows."""
    from slimen_torch import lora
    on, off = make(noeos_dir, 6), make(noeos_dir, 0)
    try:
        for e in (on, off):
            for name, seed in (("a", 1), ("b", 2)):
                e.add_adapter(name, lora.LoRAConfig(rank=2, alpha=4.0,
                                                    targets=("q_proj", "v_proj", "up_proj")), seed)
                g = torch.Generator().manual_seed(seed)  # B drawn too: not the base's outputs
                with torch.no_grad():
                    for p in e.bank.adapters[name].params():
                        p.copy_(torch.randn(p.shape, generator=g) * 0.2)
        on.gen.take_prefix_stats()
        ids = prompt(61, 20)
        first = [GenerateRequest(id="a1", prompt_tokens=ids, adapter="a",
                                 sampling=Sampling(seed=1, max_tokens=6))]
        got = together(on, first)
        assert_same(got, together(off, first))
        later = ids + got[0].tokens + [4, 5, 6]
        # The same tokens under adapter b and the base: no reuse; under a: reuse.
        reqs = [GenerateRequest(id=f"x{a or 'base'}", prompt_tokens=later, adapter=a,
                                sampling=Sampling(seed=2, max_tokens=6)) for a in ("b", "", "a")]
        assert_same(together(on, reqs), together(off, reqs))
        st = on.gen.take_prefix_stats()
        assert st["prompts"] == 4 and st["hits"] == 1 and st["reused_tokens"] == 20 + 6 - 1
        assert len(on.gen.kept) == 3  # the request under a took its row over
        on.add_adapter("c", lora.LoRAConfig(rank=2, alpha=4.0, targets=("q_proj",)), 3)
        assert len(on.gen.kept) == 0
    finally:
        on.close()
        off.close()


def test_a_kept_row_idle_while_others_decode(pair):
    """A kept row rides idle in the decode steps of longer samples (writing its position 0);
    its next turn still gets the tokens of reuse off (position 0 saved and put back)."""
    on, off = pair
    a, b = prompt(71, 20), prompt(72, 20)
    reqs = [GenerateRequest(id="short", prompt_tokens=a, sampling=Sampling(seed=1, max_tokens=2)),
            GenerateRequest(id="long", prompt_tokens=b, sampling=Sampling(seed=2, max_tokens=14))]
    on.gen.forget_prefixes()
    first = together(on, reqs)
    assert_same(first, together(off, reqs))
    on.gen.take_prefix_stats()
    nxt = [GenerateRequest(id="short2", prompt_tokens=a + first[0].tokens + [3, 4],
                           sampling=Sampling(seed=3, max_tokens=6))]
    assert_same(together(on, nxt), together(off, nxt))
    assert on.gen.take_prefix_stats()["reused_tokens"] == 20 + 2 - 1


def test_shared_prompt_groups_with_reused_prefixes(noeos_dir, monkeypatch):
    """A request's samples admitted from a kept row (the lead's prefix copied from it, the
    followers copying the lead's prompt) read that prompt once as a group in the Triton decode
    attention: the tokens and log-probs of reuse and grouping off. (Rows are never split here, as
    a GPU batch of 16 rows or more is not, or the attention would read each row's own copy.
    Three tokens a turn: two interpreted decode steps of the group.)"""
    from slimen_torch import kernels as K
    monkeypatch.setattr(K, "attention_splits", lambda *a, **k: 1)
    on = make(noeos_dir, 6, slots=8, kernels=True)
    off = make(noeos_dir, 0, slots=8, kernels=True, shared_prompts=False)
    grouped = []  # rows in groups after each admission
    group = on.gen._group

    def counting(seqs):
        group(seqs)
        grouped.append(on.gen.n_grouped)

    on.gen._group = counting
    try:
        assert on.gen.share and not off.gen.share
        shared = prompt(41, 24)
        convs = [shared + prompt(42 + i, 3) for i in range(2)]
        for t in range(2):
            reqs = [GenerateRequest(id=f"g{i}-{t}", prompt_tokens=ids, n=1 + 2 * i,
                                    sampling=Sampling(seed=i + t, max_tokens=3))
                    for i, ids in enumerate(convs)]
            got, want = together(on, reqs), together(off, reqs)
            assert len(got) == 4
            assert_same(got, want)
            convs = [convs[0] + got[0].tokens + [7, 8], convs[1] + got[1].tokens + [7, 8]]
        assert on.gen.take_prefix_stats()["hits"] == 2
        assert grouped == [3, 3]  # the 3 samples of each turn's second request, one group
        assert on.gen.n_grouped == 0 and all(x < 0 for x in on.gen.lead)  # all finished
    finally:
        on.close()
        off.close()
