"""The decode step's LoRA table (lora.Table, lora.Slots), the path a CUDA graph captures: its
updates equal lora.Rows' for every row; a batch mixing adapters of different ranks and targets
generates (greedy, sampled, top-p) what each request generates alone and what the eager Rows
path generates; the step reads each row's slot (rows swapped change the result); an adapter
trained in place decodes with its new weights, as the adapter re-created from its saved folder;
the step runs through the graphs (a stand-in capture on the CPU), captured again only when the
table grows; a step with more adapters than the table's slots runs Rows; the compiled and
Triton-split layer functions take the updates; every form of the fused expand
(lora_kernels' switches) gives the default's results."""

import dataclasses
import json

import pytest
import torch

from conftest import REPO
from test_lora import _random_adapter
from slimen_torch import kernels, lora
from slimen_torch.engine import Engine, Options
from slimen_torch.generate import Generator
from slimen_torch.model import (apply_rope, block_forward, decode_layer, decode_post, decode_pre,
                                decode_step, decode_step_split, rms_norm)
from slimen_torch.types import Batch, GenerateRequest, LossConfig, Sample, Sampling

BUILTIN = REPO / "engines" / "tiny" / "builtin" / "tiny-arith"
IDS = json.loads((REPO / "testdata" / "lora_peft" / "expected.json").read_text())["ids"]

# Three adapters of different ranks and targets (b shares no target with a).
ADAPTERS = {"a": (("q_proj", "v_proj", "up_proj", "down_proj"), 2),
            "b": (("k_proj", "o_proj", "gate_proj"), 4),
            "c": (lora.TARGETS, 3)}
# The fused expand's other tiles (lora_kernels' module-level switches BM and WARPS, bench_lora's
# diff variants): each must give the default's results.
FORMS = {"bm64": dict(BM=64), "bm32": dict(BM=32), "w2": dict(WARPS=2),
         "bm128_w8": dict(BM=128, WARPS=8)}
# Those whose tiles have other sizes: the interpreter's fp32 products (NumPy's, of other shapes)
# may sum in another order there, so their fp32 results agree within rounding, not bit for bit.
# On the GPU (bf16) the test there asks them for the same bits.
RETILED = {"bm64", "bm32", "bm128_w8"}


def expand_form(monkeypatch, form):
    """lora_kernels switched to FORMS[form] (undone by monkeypatch)."""
    from slimen_torch import lora_kernels
    for k, v in FORMS[form].items():
        monkeypatch.setattr(lora_kernels, k, v)


# (adapter, prompt) of a mixed batch: every adapter twice, the base once.
ROWS = [("a", IDS[:20]), ("", IDS[:15]), ("c", IDS[3:12]), ("b", IDS[:30]), ("a", IDS[5:17]),
        ("c", IDS[:25]), ("b", IDS[8:14])]


def add(e, name, seed, targets, rank):
    """An adapter with B drawn too, alpha 2·rank, parameters of standard deviation 0.3."""
    return _random_adapter(e, name, seed, targets, rank, alpha=2.0 * rank, std=0.3)


def engine():
    e = Engine(str(BUILTIN), Options(device="cpu"))
    for i, (name, (targets, rank)) in enumerate(ADAPTERS.items()):
        add(e, name, i + 1, targets, rank)
    return e


@pytest.fixture(scope="module")
def eng():
    e = engine()
    yield e
    e.close()


def generate(e, rows, sampling, tag):
    reqs = [GenerateRequest(id=f"{tag}{i}", prompt_tokens=p, adapter=a,
                            sampling=dataclasses.replace(sampling, seed=100 + i))
            for i, (a, p) in enumerate(rows)]
    return [(c.tokens, c.logprobs) for c in e.generate(reqs)]


def same(x, y, tol=5e-5):
    """Equal tokens, log-probs within tol (fp32: the prefill of a batch and of one prompt, in
    other summation orders, differ by ~1e-5)."""
    return x[0] == y[0] and max((abs(a - b) for a, b in zip(x[1], y[1])), default=0.0) <= tol


class Counting(lora.Slots):
    made = 0

    def __init__(self, *a, **kw):
        Counting.made += 1
        super().__init__(*a, **kw)


def test_slots_give_each_row_the_update_rows_gives(eng):
    m, bank = eng.model, eng.bank
    a, b, c = (bank.adapters[n] for n in "abc")
    row_ads = [a, None, c, b, a, c]
    t = lora.Table(bank, 8)
    assert t.place([x for x in row_ads if x is not None])
    idx = torch.tensor([t.slot_of(x) for x in row_ads])
    assert sorted(set(idx.tolist())) == [0, 1, 2, 3]
    cfg = m.cfg
    g = torch.Generator().manual_seed(0)
    inputs = {1: torch.randn(6, cfg.hidden, generator=g), 5: torch.randn(6, cfg.q_dim, generator=g),
              8: torch.randn(6, cfg.hidden, generator=g), 9: torch.randn(6, cfg.intermediate, generator=g)}
    slots, rows = lora.Slots(t, idx), bank.rows(row_ads, "cpu")
    for i in range(cfg.layers):
        ws, wr = slots.weights(m, i, m.layers[i].weights()), rows.weights(m, i, m.layers[i].weights())
        for k, x in inputs.items():
            got, want = lora.linear(x, ws[k]), lora.linear(x, wr[k])
            assert torch.allclose(got, want, rtol=0, atol=1e-6), (i, k)
            # A row alone (its own slot, the others absent) gets the same.
            one = lora.Slots(t, idx[3:4]).weights(m, i, m.layers[i].weights())[k]
            assert torch.allclose(lora.linear(x[3:4], one), want[3:4], rtol=0, atol=1e-5), (lora.linear(x[3:4], one) - want[3:4]).abs().max()
        # A base row gets the base product.
        assert torch.equal(lora.linear(inputs[1][1:2], lora.Slots(t, idx[1:2]).weights(
            m, i, m.layers[i].weights())[1]), torch.nn.functional.linear(inputs[1][1:2], m.layers[i].wqkv))
    # The slot index is read: the rows' slots reversed give the reversed rows' updates.
    w0 = m.layers[0].weights()
    x = inputs[8]
    flipped = lora.linear(x, lora.Slots(t, idx.flip(0)).weights(m, 0, w0)[8])
    want = lora.linear(x, bank.rows(row_ads[::-1], "cpu").weights(m, 0, w0)[8])
    assert torch.allclose(flipped, want, rtol=0, atol=1e-6)
    assert not torch.allclose(flipped, lora.linear(x, slots.weights(m, 0, w0)[8]), atol=1e-3)


def test_a_slot_is_reused_in_place(eng):
    """An adapter that needs a slot takes the least recently used one, copied over in place (the
    table's shapes unchanged): what the evicted adapter left there (a larger rank, targets the new
    one lacks) is gone."""
    m, bank = eng.model, eng.bank
    a, b, c = (bank.adapters[n] for n in "abc")
    t = lora.Table(bank, 8)
    assert t.place([c, b]) and t.cap == 2
    version, c_slot = t.version, t.slot_of(c)
    assert t.place([b])
    assert t.place([a])
    assert t.version == version and t.slot_of(a) == c_slot and id(c) not in t.slot
    assert t.slot_of(b) != c_slot
    x = torch.randn(3, m.cfg.hidden, generator=torch.Generator().manual_seed(2))
    idx = torch.tensor([t.slot_of(a), t.slot_of(b), 0])
    for i in range(m.cfg.layers):
        w = m.layers[i].weights()
        for k in (1, 8):
            got = lora.linear(x, lora.Slots(t, idx).weights(m, i, w)[k])
            want = lora.linear(x, bank.rows([a, b, None], "cpu").weights(m, i, w)[k])
            assert torch.allclose(got, want, rtol=0, atol=1e-6), (i, k)
    # Three adapters in two slots: the table grows (a new version) and holds all three.
    assert t.place([a, b, c]) and t.version > version and t.cap == 4
    assert sorted(t.slot_of(x) for x in (a, b, c)) == [1, 2, 3]


@pytest.mark.parametrize("sampling", [Sampling(max_tokens=6, temperature=0.0),
                                      Sampling(max_tokens=6, temperature=1.0),
                                      Sampling(max_tokens=6, temperature=0.8, top_p=0.7)],
                         ids=["greedy", "sampled", "top_p"])
def test_a_mixed_batch_decodes_as_each_request_alone_and_as_rows(eng, sampling, monkeypatch):
    monkeypatch.setattr(lora, "Slots", Counting)
    Counting.made = 0
    mixed = generate(eng, ROWS, sampling, "m")
    assert Counting.made > 0, "the decode steps did not run through the table"
    for i, row in enumerate(ROWS):
        # generate() seeds request i with 100 + i: alone, the same seed.
        alone = [(c.tokens, c.logprobs) for c in eng.generate([GenerateRequest(
            id=f"y{i}", prompt_tokens=row[1], adapter=row[0],
            sampling=dataclasses.replace(sampling, seed=100 + i))])]
        assert same(mixed[i], alone[0]), f"row {i} ({row[0] or 'base'}) differs alone"
    # The eager Rows path (the one before the table) gives the same.
    made = Counting.made
    eng.gen.lora_table = False
    try:
        rows = generate(eng, ROWS, sampling, "r")
    finally:
        eng.gen.lora_table = True
    assert Counting.made == made
    for i, (x, y) in enumerate(zip(mixed, rows)):
        assert same(x, y), f"row {i}: the table and Rows differ"
    # The adapters matter: each row differs from the base's.
    base = generate(eng, [("", p) for _, p in ROWS], sampling, "b")
    assert all(not same(x, y, 1e-3) for x, y, (a, _) in zip(mixed, base, ROWS) if a)


def test_a_rows_result_does_not_depend_on_the_other_rows_adapters(eng):
    """The mixed batch against the same prompts all under one row's adapter (the same shapes, the
    same table, prefill and decode alike): each row's tokens and log-probs are equal, bit for
    bit."""
    greedy = Sampling(max_tokens=6, temperature=0.0)
    mixed = generate(eng, ROWS, greedy, "u")
    for name in ("", "a", "b", "c"):
        one = generate(eng, [(name, p) for _, p in ROWS], greedy, f"v{name}")
        for i, (a, _) in enumerate(ROWS):
            if a == name:
                assert mixed[i] == one[i], f"row {i} ({a or 'base'})"


def test_the_step_reads_each_rows_slot(eng):
    """_decode, what a CUDA graph captures, on a generator of its own: the rows' slots reversed
    give other log-probs; written back, the same as before."""
    from slimen_torch.sequence import Request
    g = Generator(eng.model, eng.tokenizer, eng.eos, slots=4, max_len=64, cuda_graphs=False,
                  compile_layers=False, prefill_tokens=512)
    g.bank = eng.bank
    for i, name in enumerate("abc"):
        r = Request(f"s{i}", IDS[:10], 1, Sampling(max_tokens=4, temperature=0.0), lambda c: None)
        r.adapter = eng.bank.adapters[name]
        g.add(r)
    g._admit()
    rows = [(r, s) for r, s in enumerate(g.slots) if s is not None]
    assert len(rows) == 3
    g._lora_step(rows)
    assert g.lora_mode == "table"
    t = g.bank.table
    assert g.lora_idx[:3].tolist() == [t.slot_of(eng.bank.adapters[n]) for n in "abc"]
    state = [g.tok, g.pos, g.step_idx] + g.k + g.v
    saved = [x.clone() for x in state]

    def step():
        for x, s in zip(state, saved):
            x.copy_(s)
        g._decode(4, 64, False)
        return g.out_lp[:3].clone(), g.out_tok[:3].clone()

    lp, tok = step()
    good = g.lora_idx.clone()
    g.lora_idx[:3] = good[:3].flip(0)
    lp2, _ = step()
    assert not torch.allclose(lp[[0, 2]], lp2[[0, 2]], atol=1e-4)
    assert torch.allclose(lp[1], lp2[1])  # row 1 kept its slot
    g.lora_idx.copy_(good)
    lp3, tok3 = step()
    assert torch.equal(lp, lp3) and torch.equal(tok, tok3)


def test_a_steady_decode_step_reads_no_row_and_no_weight(eng, monkeypatch):
    """_lora_step with the same rows and adapters as the step before (the table folded, as with
    the Triton kernels) dispatches no tensor operation, looks up no row's slot and copies no
    base weight; after base_changed the next step copies the bases once (the folded copy then
    the model's weight), after a row changed it reads the rows again, and after an adapter was
    replaced under running rows (Engine._load_adapter) it places the new one."""
    from slimen_torch.sequence import Request
    bank = lora.Bank(eng.model)  # (a table of its own: eng's stays as the other tests left it)
    bank.adapters = dict(eng.bank.adapters)
    g = Generator(eng.model, eng.tokenizer, eng.eos, slots=4, max_len=64, cuda_graphs=False,
                  compile_layers=False, prefill_tokens=512, triton=True)
    assert g.triton  # (under the interpreter: _lora_step folds the table, no kernel runs here)
    g.bank = bank
    for i, name in enumerate("abc"):
        r = Request(f"s{i}", IDS[:10], 1, Sampling(max_tokens=4, temperature=0.0), lambda c: None)
        r.adapter = bank.adapters[name]
        g.add(r)
    g._admit()
    rows = [(r, s) for r, s in enumerate(g.slots) if s is not None]
    g._lora_step(rows)
    t = bank.table
    assert g.lora_mode == "table" and t.folded and t.base
    assert g.lora_idx[:3].tolist() == [t.slot_of(bank.adapters[n]) for n in "abc"]
    n = {"_sync": 0, "slot_of": 0}

    def counted(name):
        fn = getattr(lora.Table, name)

        def f(self, *a):
            n[name] += 1
            return fn(self, *a)
        return f
    for name in n:
        monkeypatch.setattr(lora.Table, name, counted(name))
    assert _ops(lambda: [g._lora_step(rows) for _ in range(3)]) == {}
    assert n == {"_sync": 0, "slot_of": 0} and g.lora_mode == "table"
    W = eng.model.layers[0].wqkv
    try:
        with torch.no_grad():
            W.data.add_(0.5)  # (uncounted, as a push's broadcast writes)
        t.base_changed()
        g._lora_step(rows)
        assert n == {"_sync": 1, "slot_of": 0}
        assert torch.equal(t.wa[(0, "wqkv")][:W.shape[0]], W)
        g._lora_step(rows)
        assert n["_sync"] == 1
    finally:
        with torch.no_grad():
            W.data.sub_(0.5)
    # Row 1 (adapter b) freed: the rows read again, b no longer among the step's adapters.
    g._free([1])
    rows = [(r, s) for r, s in enumerate(g.slots) if s is not None]
    g._lora_step(rows)
    assert n["slot_of"] == 2 and g.lora_ads == [bank.adapters["a"], bank.adapters["c"]]
    # Adapter a replaced under row 0, as a load of a folder under its name does.
    old = bank.adapters["a"]
    new = lora.Adapter("a", old.cfg, eng.model.cfg, "cpu", torch.float32)
    g.slots[0].req.adapter = bank.adapters["a"] = new
    bank.changed()
    g._lora_step(rows)
    assert id(old) not in t.slot and g.lora_idx[0].item() == t.slot_of(new)
    assert g.lora_idx[2].item() == t.slot_of(bank.adapters["c"])


def _uncounted(model, f):
    """Writes f(weight) into every fused projection weight of model as a collective's broadcast
    does (through .data: no version counter moves)."""
    with torch.no_grad():
        for layer in model.layers:
            for name in lora.FUSED:
                w = getattr(layer, name)
                w.data.copy_(f(w.data))


def test_a_push_and_a_load_reach_the_folded_base(tmp_path, monkeypatch):
    """With the Triton kernels (the table folded: it decodes from its own copy of the base's
    projections), weights received by a push (Engine._push_receive) and a base loaded (with the
    adapters removed, then added again) decode as the eager Rows path, which reads the model's
    own weights, and differ from what the old base decoded."""
    from safetensors.torch import load_file, save_file
    e = Engine(str(BUILTIN), Options(device="cpu", kernels=True))
    try:
        for i, (name, (targets, rank)) in enumerate(ADAPTERS.items()):
            add(e, name, i + 1, targets, rank)
        # (Two tokens: the prefill's and one decode step, which reads the folded table; each
        # step costs seconds under the interpreter.)
        greedy = Sampling(max_tokens=2, temperature=0.0)

        def check(tag):
            e.gen.lora_table = True
            got = generate(e, ROWS, greedy, tag + "t")
            assert e.bank.table.folded
            e.gen.lora_table = False
            rows = generate(e, ROWS, greedy, tag + "r")
            e.gen.lora_table = True
            for i, (x, y) in enumerate(zip(got, rows)):
                assert same(x, y), f"{tag}: row {i}"
            return got

        before = check("a")

        class Pushed:
            """A push group's receiving end: the weights written as NCCL's broadcast does."""

            def receive(self, model):
                _uncounted(model, lambda w: w * -1.5)
                return dict(bytes=0, seconds=0.0, link="test")

        e._call(e._push_receive, Pushed())
        pushed = check("b")
        assert sum(x[0] != y[0] for x, y in zip(before, pushed)) >= 3
        # A base loaded from a folder: its weights, in place.
        folder = tmp_path / "base"
        folder.mkdir()
        for f in BUILTIN.iterdir():
            (folder / f.name).write_bytes(f.read_bytes())
        w = load_file(str(BUILTIN / "model.safetensors"))
        save_file({k: (v * 0.5 if "proj" in k else v).contiguous() for k, v in w.items()},
                  str(folder / "model.safetensors"))
        for name in ADAPTERS:
            e.remove_adapter(name)
        e.load(str(folder))
        for i, (name, (targets, rank)) in enumerate(ADAPTERS.items()):
            add(e, name, i + 1, targets, rank)
        loaded = check("c")
        assert sum(x[0] != y[0] for x, y in zip(pushed, loaded)) >= 3
    finally:
        e.close()


def test_a_trained_adapter_decodes_with_its_new_weights(tmp_path):
    e = engine()
    try:
        greedy = Sampling(max_tokens=6, temperature=0.0)
        rows = [("a", IDS[:20]), ("b", IDS[:12]), ("a", IDS[4:15])]
        before = generate(e, rows, greedy, "p")
        version = e.bank.table.version
        r = IDS[20:30]
        e.train(Batch(samples=[Sample(prompt=IDS[:20], response=r, loss_mask=[1.0] * len(r),
                                      old_logprobs=[-3.0] * len(r), advantages=[1.0] * len(r))],
                      loss=LossConfig(lr=2e-2), adapter="a"))
        after = generate(e, rows, greedy, "q")
        assert e.bank.table.version == version, "the table was rebuilt, not updated in place"
        assert not same(after[0], before[0], 1e-4) and not same(after[2], before[2], 1e-4)
        assert same(after[1], before[1])
        e.gen.lora_table = False
        rows_path = generate(e, rows, greedy, "r")
        e.gen.lora_table = True
        assert all(same(x, y) for x, y in zip(after, rows_path))
        # As the adapter re-created from its saved folder decodes.
        e.save(str(tmp_path / "a"), adapter="a")
        e.load_adapter(str(tmp_path / "a"), "a2")
        again = generate(e, [("a2", p) if n == "a" else (n, p) for n, p in rows], greedy, "s")
        assert all(same(x, y) for x, y in zip(after, again))
    finally:
        e.close()


class FakeGraph:
    """A stand-in for a captured CUDA graph on the CPU: replaying runs _decode with the
    arguments of its capture, as a graph replays the captured step."""

    def __init__(self, gen, *args):
        self.gen, self.args, self.version = gen, args, gen.graphs_lora
        self.replays = 0

    def replay(self):
        assert self.version == self.gen.graphs_lora, "a graph of another table replayed"
        self.replays += 1
        self.gen._decode(*self.args)


def test_adapters_decode_through_the_graphs(monkeypatch):
    e = engine()
    try:
        g = e.gen
        captured = []

        def capture(B, L, use_top_p, grouped):
            captured.append(FakeGraph(g, B, L, use_top_p, grouped))
            return captured[-1]

        greedy = Sampling(max_tokens=6, temperature=0.0)
        monkeypatch.setattr(g, "use_graphs", True)
        monkeypatch.setattr(g, "_capture", capture)
        # Base rows before any adapter was placed: the base's graphs.
        base = generate(e, [("", p) for _, p in ROWS[:3]], greedy, "z")
        assert captured and e.bank.table.cap == 0 and g.graphs_lora == 0
        g.lora_table = False
        assert base == generate(e, [("", p) for _, p in ROWS[:3]], greedy, "y")
        want = generate(e, ROWS, greedy, "w")  # (eager: Rows)
        g.lora_table = True
        captured.clear()
        got = generate(e, ROWS, greedy, "g")
        assert captured and sum(c.replays for c in captured) >= 5
        assert all(same(x, y) for x, y in zip(got, want))
        n = len(captured)
        again = generate(e, ROWS, greedy, "h")  # the same shapes: replayed, not captured again
        assert len(captured) == n and again == got
        # A larger rank grows the table: the graphs are captured again, over its new tensors.
        version = e.bank.table.version
        add(e, "d", 9, ("v_proj", "down_proj"), 8)
        rows = ROWS + [("d", IDS[:11])]
        got = generate(e, rows, greedy, "i")
        assert e.bank.table.version > version and e.bank.table.r == 8
        assert len(captured) > n and g.graphs_lora == e.bank.table.version
        assert all(c.version == g.graphs_lora for c in g.graphs.values())
        g.lora_table = False
        assert all(same(x, y) for x, y in zip(got, generate(e, rows, greedy, "j")))
    finally:
        e.close()


def test_more_adapters_than_slots_run_rows(eng, monkeypatch):
    monkeypatch.setattr(lora, "Slots", Counting)
    greedy = Sampling(max_tokens=4, temperature=0.0)
    want = generate(eng, ROWS, greedy, "k")
    Counting.made = 0
    monkeypatch.setattr(eng.bank.table, "max_slots", 2)
    got = generate(eng, ROWS, greedy, "l")
    assert Counting.made == 0 and eng.gen.lora_warned
    assert all(same(x, y) for x, y in zip(got, want))
    # Two adapters fit: the table again.
    got = generate(eng, [r for r in ROWS if r[0] != "c"], greedy, "n")
    assert Counting.made > 0


def _attention(q, k, v, kc, vc, pos, L, scale, rope):
    """kernels.decode_attention's contract in PyTorch (q/k norm and rope applied here)."""
    q_norm, k_norm, cos, sin, eps = rope
    if q_norm is not None:
        q, k = rms_norm(q, q_norm, eps), rms_norm(k, k_norm, eps)
    c, s = cos[pos].to(q.dtype), sin[pos].to(q.dtype)
    return kernels.decode_attention_reference(apply_rope(q, c, s), apply_rope(k, c, s), v, kc, vc,
                                              pos, L, scale)


def _four_rows_placed(eng):
    """The table with four rows' adapters (a, the base, c, b) placed, the rows' slots and the
    adapters placed."""
    bank = eng.bank
    row_ads = [bank.adapters["a"], None, bank.adapters["c"], bank.adapters["b"]]
    ads = [x for x in row_ads if x is not None]
    t = bank.table
    assert t.place(ads)
    return t, torch.tensor([t.slot_of(x) for x in row_ads]), ads


def test_the_compiled_and_split_layers_take_the_updates(eng):
    """decode_step_split (the Triton path's layer split, here around a PyTorch attention) with
    pre and post compiled whole (fullgraph: the table's tensors are plain arguments) gives the
    eager decode_step's hidden states under the same slots."""
    m, cfg = eng.model, eng.model.cfg
    t, idx, ads = _four_rows_placed(eng)
    B, L = 4, 16
    tokens = torch.tensor(IDS[:B])
    pos = torch.tensor([3, 7, 0, 5])

    def caches():
        g = torch.Generator().manual_seed(1)
        shape = (B, cfg.kv_heads, L, cfg.head_dim)
        return ([torch.randn(shape, generator=g) for _ in range(cfg.layers)],
                [torch.randn(shape, generator=g) for _ in range(cfg.layers)])

    pre = torch.compile(decode_pre, fullgraph=True, dynamic=True, backend="eager")
    post = torch.compile(decode_post, fullgraph=True, dynamic=True, backend="eager")
    with torch.no_grad(), m.using(lora.Slots(t, idx)):
        want = decode_step(m, decode_layer, tokens, pos, *caches(), L)
        got = decode_step_split(m, pre, post, _attention, tokens, pos, *caches(), L)
        base_rows = decode_step_split(m, decode_pre, decode_post, _attention, tokens, pos, *caches(), L)
    assert torch.allclose(got, want, rtol=0, atol=1e-5)
    assert torch.allclose(base_rows, want, rtol=0, atol=1e-5)
    with torch.no_grad():
        base = decode_step(m, decode_layer, tokens, pos, *caches(), L)
    assert torch.allclose(base[1], want[1], rtol=0, atol=1e-5)  # the base row
    assert not torch.allclose(base[0], want[0], atol=1e-3)


def _fused_and_packed(t, idx, m, i):
    """Layer i's weights under Slots over table t, fused (lora.Fused) and not (lora.Packed)."""
    w = m.layers[i].weights()
    fused = lora.Slots(t, idx, fused=True)
    assert fused.fused
    return fused.weights(m, i, w), lora.Slots(t, idx).weights(m, i, w)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_fused_expand_gives_packeds_updates(eng, dtype):
    """lora.Fused (lora_kernels.expand, under the interpreter) against lora.Packed (the mask and
    three products) for every fused projection of every layer: fp32 within summation order,
    bf16 within one rounding of the result; a row's result does not depend on the other rows'
    slots, and other slots' columns never reach it (NaN written into them changes nothing)."""
    m, bank = eng.model, eng.bank
    a, b, c = (bank.adapters[n] for n in "abc")
    row_ads = [a, None, c, b, a, c] * 3  # 18 rows: two row tiles of the kernel's
    t = lora.Table(bank, 8)
    assert t.place([x for x in row_ads if x is not None]) and t.bn == 32
    idx = torch.tensor([t.slot_of(x) for x in row_ads])
    cfg = m.cfg
    g = torch.Generator().manual_seed(4)
    dims = {1: cfg.hidden, 5: cfg.q_dim, 8: cfg.hidden, 9: cfg.intermediate}
    inputs = {k: torch.randn(len(row_ads), d, generator=g) for k, d in dims.items()}
    saved = {k: (v.clone(), t.b[k].clone()) for k, v in t.a.items()}
    try:
        if dtype != torch.float32:
            for k in t.a:
                t.a[k].data, t.b[k].data = t.a[k].data.to(dtype), t.b[k].data.to(dtype)
        for i in range(cfg.layers):
            wf, wp = _fused_and_packed(t, idx, m, i)
            for k, x in inputs.items():
                x = x.to(dtype)
                wk = [z.to(dtype) if isinstance(z, torch.Tensor) and z.is_floating_point()
                      and z is not wf[k].scale else z for z in wf[k]]
                pk = [z.to(dtype) for z in wp[k]]
                got = lora.linear(x, lora.Fused(*wk))
                want = lora.linear(x, lora.Packed(*pk))
                tol = 2e-6 if dtype == torch.float32 else 2 ** -7 * want.abs().max().item()
                assert (got.float() - want.float()).abs().max() <= tol, (i, k)
                assert not torch.equal(got, torch.nn.functional.linear(x, wk[0]))
                # Row 3 with every other row on the base, or on row 3's adapter: the same.
                for other in (0, idx[3].item()):
                    idx2 = torch.full_like(idx, other)
                    idx2[3] = idx[3]
                    one = lora.linear(x, lora.Fused(*wk[:3], idx2, *wk[4:]))
                    assert torch.equal(one[3], got[3]), (i, k)
        # Slot of c poisoned: the rows of a and b and the base rows keep their results.
        x = inputs[1].to(dtype)
        w0 = lora.Slots(t, idx, fused=True).weights(m, 0, m.layers[0].weights())[1]
        w0 = lora.Fused(w0.w.to(dtype), *w0[1:])
        before = lora.linear(x, w0)
        k = t.slot_of(c)
        A = t.a[(0, "wqkv")]
        for p in range(len(t.parts["wqkv"])):
            A[(p * t.cap + k - 1) * t.r:(p * t.cap + k) * t.r] = float("nan")
        after = lora.linear(x, w0)
        rows_c = torch.tensor([x is c for x in row_ads])
        assert torch.equal(after[~rows_c], before[~rows_c])
        assert after[rows_c].isnan().any()
    finally:
        for k, (A, B) in saved.items():
            t.a[k].data, t.b[k].data = A, B


def _expand_inputs(dtype, M, N=256, cap=4, r=2, seed=0):
    """A folded product y [M, N + 2·cap·r] (its shrink in the last columns), b, idx, scale and
    part of 32-column chunks in two parts and one chunk-run no adapter targets (-1); a row with
    slot 0 and a y of -0.0 in it."""
    g = torch.Generator().manual_seed(seed)
    cr = cap * r
    part = torch.tensor([0] * 4 + [-1] * 2 + [1] * 2, dtype=torch.int32)
    b = torch.zeros(N, 2 * cr)
    b[:128, :cr] = torch.randn(128, cr, generator=g) * 0.1
    b[192:, cr:] = torch.randn(64, cr, generator=g) * 0.1
    y = torch.randn(M, N + 2 * cr, generator=g)
    y[0, 5] = -0.0
    idx = torch.randint(0, cap + 1, (M,), generator=g)
    idx[1] = 0
    return y.to(dtype), b.to(dtype), idx, torch.rand(cap, generator=g) * 2, part, r


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("form", sorted(FORMS))
def test_the_expand_forms_give_the_defaults_results(monkeypatch, form, dtype):
    """Each form of lora_kernels.expand (under the interpreter) against the default's, rows of
    a partial tile included: the same results (bit for bit, but for the retiled forms in fp32;
    a chunk no adapter targets keeps y as it is)."""
    from slimen_torch import lora_kernels
    M = 37
    y, b, idx, scale, part, r = _expand_inputs(dtype, M)
    N = b.shape[0]
    want = lora_kernels.expand(y, y, b, idx, scale, part, r, N)
    assert torch.allclose(want.float(), lora_kernels.expand_reference(
        y, y, b, idx, scale, part, r, N).float(), rtol=0, atol=2e-6 if dtype == torch.float32
        else 2 ** -7 * want.abs().max().item())
    expand_form(monkeypatch, form)
    got = lora_kernels.expand(y, y, b, idx, scale, part, r, N)
    assert torch.equal(got[:, 128:192], y[:, 128:192])  # the chunks of part -1
    if form in RETILED and dtype == torch.float32:
        assert torch.allclose(got, want, rtol=1e-6, atol=1e-6)
    else:
        assert torch.equal(got.contiguous().view(torch.uint8), want.view(torch.uint8))  # bits


def test_a_folded_table_gives_packeds_updates_and_follows_the_base():
    """Table.fold: the shrink in the base's product (each fused weight below a copy of the
    model's) gives Packed's updates; a base weight written in place, replaced, or written
    uncounted, then announced by base_changed (the engine's _weights_change), reaches the folded
    product at the next place()."""
    e = engine()
    try:
        m, bank = e.model, e.bank
        a, b, c = (bank.adapters[n] for n in "abc")
        row_ads = [a, None, c, b, a, c]
        t = lora.Table(bank, 8)
        t.fold = True
        assert t.place([a, b, c]) and t.folded and len(t.wa) == 4 * m.cfg.layers
        idx = torch.tensor([t.slot_of(x) for x in row_ads])
        g = torch.Generator().manual_seed(5)
        dims = {1: m.cfg.hidden, 5: m.cfg.q_dim, 8: m.cfg.hidden, 9: m.cfg.intermediate}
        inputs = {k: torch.randn(len(row_ads), d, generator=g) for k, d in dims.items()}

        def check():
            for i in range(m.cfg.layers):
                wf, wp = _fused_and_packed(t, idx, m, i)
                for k, x in inputs.items():
                    assert wf[k].a is None  # folded
                    got, want = lora.linear(x, wf[k]), lora.linear(x, wp[k])
                    assert torch.allclose(got, want, rtol=0, atol=2e-6), (i, k)

        check()
        with torch.no_grad():
            m.layers[0].w13.mul_(1.5)
            m.layers[1].wqkv.add_(0.25)
            old = m.layers[1].w2
            m.layers[1].w2 = torch.nn.Parameter(old.detach() * -1)
        t.base_changed()
        assert t.place([a])
        check()
        # Written where no version counter moves (as NCCL's broadcast of a push writes): the
        # engine's _weights_change has the table copy every base again.
        with torch.no_grad():
            m.layers[0].wqkv.data.mul_(-2)
        bank.table = t
        e._weights_change("test")
        assert t.place([a])
        check()
        # The table's own A_f rows (a view of the folded tensor) still take adapters in place.
        assert t.place([a, b, c]) and t.wa[(0, "wqkv")].data_ptr() == t.a[(0, "wqkv")].data_ptr() - \
            t.b[(0, "wqkv")].shape[0] * m.cfg.hidden * t.a[(0, "wqkv")].element_size()
        # Fold off: the next place() reallocates without the copies.
        version = t.version
        t.fold = False
        assert t.place([a]) and not t.folded and not t.wa and t.version > version
        assert sorted(t.slot_of(x) for x in (a, b, c)) == [1, 2, 3]
    finally:
        e.close()


def _ops(fn) -> dict:
    """The operations fn dispatches (aten and custom; views and metadata not counted)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class Count(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = {}

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if not (torch.Tag.view_copy in func.tags or func.is_view
                    or func.__name__.split(".")[0] in ("detach", "_to_copy", "lift_fresh")):
                name = func.__name__.split(".")[0]
                self.n[name] = self.n.get(name, 0) + 1
            return func(*args, **(kwargs or {}))

    with Count() as c:
        fn()
    return c.n


def test_the_fused_step_runs_fewer_operations(eng):
    """A decode step's operations (what a CUDA graph launches, less the Triton attention):
    fused, each adapted projection adds two to the base's (the shrink and the expand); Packed
    adds the mask's product, the expand's product and the add besides, and the mask's making;
    folded (Table.fold), one (the expand)."""
    m, cfg = eng.model, eng.model.cfg
    t, idx, ads = _four_rows_placed(eng)
    B, L = 4, 16
    tokens, pos = torch.tensor(IDS[:B]), torch.tensor([3, 7, 0, 5])
    g = torch.Generator().manual_seed(1)
    shape = (B, cfg.kv_heads, L, cfg.head_dim)
    kc = [torch.randn(shape, generator=g) for _ in range(cfg.layers)]
    vc = [torch.randn(shape, generator=g) for _ in range(cfg.layers)]

    def step(sel):
        def run():
            with torch.no_grad(), m.using(sel):
                decode_step_split(m, decode_pre, decode_post, _attention, tokens, pos, kc, vc, L)
        return run

    base = _ops(step(None))
    fused = _ops(step(lora.Slots(t, idx, fused=True)))
    packed = _ops(step(lora.Slots(t, idx)))
    adapted = cfg.layers * sum(1 for ps in t.parts.values() if ps)
    assert adapted == 2 * 4
    total = lambda n: sum(n.values())  # noqa: E731
    assert total(fused) == total(base) + 2 * adapted, (fused, base)
    assert fused.get("lora_expand") == adapted
    assert total(packed) >= total(base) + 4 * adapted, (packed, base)
    assert total(fused) < total(packed)
    # Folded: the expand alone (the shrink is in the base's product).
    t.fold = True
    try:
        assert t.place(ads) and t.folded
        folded = _ops(step(lora.Slots(t, idx, fused=True)))
    finally:
        t.fold = False
        t.place(ads)
    assert total(folded) == total(base) + adapted, (folded, base)
    assert folded.get("lora_expand") == adapted


def test_a_mixed_batch_decodes_fused_as_each_request_alone(monkeypatch):
    """An engine with the Triton kernels (under the interpreter: the split decode layers, the
    table's updates fused, folded): the mixed batch's greedy tokens are each request's alone,
    those unfolded, Packed's and the eager Rows path's; each row's result does not depend on the
    other rows' adapters."""
    e = Engine(str(BUILTIN), Options(device="cpu", kernels=True))
    try:
        for i, (name, (targets, rank)) in enumerate(ADAPTERS.items()):
            add(e, name, i + 1, targets, rank)
        made = []

        class Seen(lora.Slots):
            def __init__(self, *a, **kw):
                super().__init__(*a, **kw)
                made.append(self.fused)

        monkeypatch.setattr(lora, "Slots", Seen)
        assert e.gen.triton and e.gen.lora_fused and e.gen.lora_fold
        # Three tokens: the prefill's, a first decode step (the table placed and folded) and a
        # steady one; each decode step of 7 rows costs seconds under the interpreter, and this
        # test makes 13 calls.
        greedy = Sampling(max_tokens=3, temperature=0.0)
        mixed = generate(e, ROWS, greedy, "m")
        assert any(made), "no decode step ran fused"
        assert e.bank.table.folded
        for i, row in enumerate(ROWS):
            alone = generate(e, [row], greedy, f"y{i}")
            assert same(mixed[i], alone[0]), f"row {i} ({row[0] or 'base'}) differs alone"
        for name in ("a", "c"):
            one = generate(e, [(name, p) for _, p in ROWS], greedy, f"v{name}")
            for i, (a, _) in enumerate(ROWS):
                if a == name:
                    assert mixed[i] == one[i], f"row {i} ({a})"
        e.gen.lora_fold = False
        unfolded = generate(e, ROWS, greedy, "f")
        assert not e.bank.table.folded
        e.gen.lora_fused = False
        made.clear()
        packed = generate(e, ROWS, greedy, "p")
        assert made and not any(made)
        e.gen.lora_fused, e.gen.lora_table = True, False
        rows = generate(e, ROWS, greedy, "r")
        for i, (x, y, z, u) in enumerate(zip(mixed, packed, rows, unfolded)):
            assert same(x, y) and same(x, z) and same(x, u), f"row {i}"
    finally:
        e.close()


def test_a_mixed_batch_decodes_the_same_in_every_expand_form(monkeypatch):
    """The engine with the Triton kernels (under the interpreter; the table folded and fused):
    the mixed batch's sampled tokens and log-probs in every form of the expand
    (FORMS) are the default form's (bit for bit but for the retiled forms, whose fp32 products
    the interpreter may sum in another order)."""
    from slimen_torch import lora_kernels
    e = Engine(str(BUILTIN), Options(device="cpu", kernels=True))
    try:
        for i, (name, (targets, rank)) in enumerate(ADAPTERS.items()):
            add(e, name, i + 1, targets, rank)
        assert e.gen.triton and e.gen.lora_fused and e.gen.lora_fold
        sampled = Sampling(max_tokens=2, temperature=1.0)
        want = generate(e, ROWS, sampled, "d")
        assert e.bank.table.folded
        tiles = []
        launch = lora_kernels._launch
        monkeypatch.setattr(lora_kernels, "_launch", lambda *a, **kw: tiles.append(
            (lora_kernels.BM, lora_kernels.WARPS)) or launch(*a, **kw))
        for form in sorted(FORMS):
            with monkeypatch.context() as mp:
                expand_form(mp, form)
                want_tile = (lora_kernels.BM, lora_kernels.WARPS)
                tiles.clear()
                got = generate(e, ROWS, sampled, form)
            # (The kernel ran, in the form's tile.)
            assert tiles and set(tiles) == {want_tile}, form
            for i, (u, v) in enumerate(zip(got, want)):
                assert same(u, v) if form in RETILED else u == v, (form, i)
    finally:
        e.close()


@pytest.mark.parametrize("fold", [False, True], ids=["unfolded", "folded"])
def test_the_compiled_layers_take_the_fused_updates(fold):
    """decode_pre and decode_post compiled whole (dynamic shapes; aot_eager: the custom op's fake
    implementation traced, as inductor traces it) under fused Slots give the eager step's hidden
    states, at two batch sizes."""
    e = engine()
    try:
        m, bank = e.model, e.bank
        cfg = m.cfg
        ads = [bank.adapters["a"], None, bank.adapters["c"], bank.adapters["b"]] * 5
        t = bank.table
        t.fold = fold
        assert t.place([x for x in ads if x is not None]) and t.folded == fold
        pre = torch.compile(decode_pre, fullgraph=True, dynamic=True, backend="aot_eager")
        post = torch.compile(decode_post, fullgraph=True, dynamic=True, backend="aot_eager")
        for B in (4, 20):
            idx = torch.tensor([t.slot_of(x) for x in ads[:B]])
            L = 16
            tokens = torch.tensor(IDS[:B])
            pos = torch.arange(B) % L
            g = torch.Generator().manual_seed(1)
            shape = (B, cfg.kv_heads, L, cfg.head_dim)
            kv = [[torch.randn(shape, generator=g) for _ in range(cfg.layers)] for _ in range(2)]
            with torch.no_grad(), m.using(lora.Slots(t, idx, fused=True)):
                got = decode_step_split(m, pre, post, _attention, tokens, pos,
                                        *[[x.clone() for x in c] for c in kv], L)
            with torch.no_grad(), m.using(lora.Slots(t, idx)):
                want = decode_step(m, decode_layer, tokens, pos, *kv, L)
            assert torch.allclose(got, want, rtol=0, atol=1e-5), B
    finally:
        e.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_the_gpu_adapters_decode_in_captured_graphs():
    """The engine's GPU defaults (CUDA graphs, compiled layers, Triton kernels, bf16; the prefill
    under the table in the compiled prefill layer, lora.PREFILL_COMPILED): a mixed batch's steps
    replay graphs captured over the table, nothing degrades (the prefill layer still the
    compiled one), and each row's tokens and log-probs equal, bit for bit, those of the same
    prompts all under its adapter."""
    e = Engine(str(BUILTIN), Options(device="cuda:0"))
    try:
        for i, (name, (targets, rank)) in enumerate(ADAPTERS.items()):
            add(e, name, i + 1, targets, rank)
        g = e.gen
        greedy = Sampling(max_tokens=8, temperature=0.0)
        rows = ROWS * 3  # 21 rows: the batch's step is not the batch-1 path
        mixed = generate(e, rows, greedy, "m")
        assert g.use_graphs and g.graphs and g.graphs_lora == e.bank.table.version > 0
        assert not g.compile_error and not g.kernel_error
        assert lora.PREFILL_COMPILED and g.prefill_fn is not block_forward
        assert e.bank.table.folded and e.bank.table.bn > 0  # the step ran Fused, folded
        for name in ("", "a", "b", "c"):
            one = generate(e, [(name, p) for _, p in rows], greedy, f"o{name}")
            for i, (a, _) in enumerate(rows):
                if a == name:
                    assert mixed[i] == one[i], f"row {i} ({a or 'base'})"
        base = generate(e, [("", p) for _, p in rows], greedy, "b")
        assert sum(x != y for x, y, (a, _) in zip(mixed, base, rows) if a) > 0
    finally:
        e.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_on_the_gpu_the_expand_kernel_gives_the_reference():
    """lora_kernels.expand compiled for the GPU (bf16 products on the tensor cores) against its
    PyTorch reference at Qwen3-0.6B's q/k/v shape: 8 slots of rank 8, rows 1 to 256."""
    from slimen_torch import lora_kernels
    g = torch.Generator(device="cuda").manual_seed(0)
    N, cap, r = 4096, 8, 8
    part = torch.tensor([0] * 16 + [1] * 8 + [2] * 8, dtype=torch.int32, device="cuda")
    b = torch.zeros(N, 3 * cap * r, dtype=torch.bfloat16, device="cuda")
    for p, (lo, hi) in enumerate(((0, 2048), (2048, 3072), (3072, 4096))):
        b[lo:hi, p * cap * r:(p + 1) * cap * r] = torch.randn(
            hi - lo, cap * r, generator=g, device="cuda").bfloat16() * 0.05
    scale = torch.rand(cap, generator=g, device="cuda") * 2
    for M in (1, 7, 64, 256):
        y = torch.randn(M, N, generator=g, device="cuda").bfloat16()
        s = torch.randn(M, 3 * cap * r, generator=g, device="cuda").bfloat16()
        idx = torch.randint(0, cap + 1, (M,), generator=g, device="cuda")
        got = lora_kernels.expand(y, s, b, idx, scale, part, r)
        want = lora_kernels.expand_reference(y, s, b, idx, scale, part, r)
        tol = 2 ** -7 * want.abs().max().item()
        assert (got.float() - want.float()).abs().max().item() <= tol, M
        assert torch.equal(got[idx == 0], y[idx == 0])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
@pytest.mark.parametrize("form", sorted(FORMS))
def test_on_the_gpu_the_expand_forms_give_the_defaults_bits(monkeypatch, form):
    """Each form of lora_kernels.expand compiled for the GPU (bf16, Qwen3-0.6B's q/k/v and
    gate/up shapes, 8 slots of rank 8, the shrink folded into the product) gives the default
    form's results bit for bit, rows 1 to 256: what keeps a step's tokens the same."""
    from slimen_torch import lora_kernels
    g = torch.Generator(device="cuda").manual_seed(0)
    cap, r = 8, 8
    cr = cap * r
    for sizes in ((2048, 1024, 1024), (3072, 3072)):
        N = sum(sizes)
        part = torch.tensor([p for p, n in enumerate(sizes) for _ in range(n // 128)],
                            dtype=torch.int32, device="cuda")
        b = torch.zeros(N, len(sizes) * cr, dtype=torch.bfloat16, device="cuda")
        lo = 0
        for p, n in enumerate(sizes):
            b[lo:lo + n, p * cr:(p + 1) * cr] = torch.randn(
                n, cr, generator=g, device="cuda").bfloat16() * 0.05
            lo += n
        scale = torch.rand(cap, generator=g, device="cuda") * 2
        for M in (1, 7, 64, 256):
            y = torch.randn(M, N + len(sizes) * cr, generator=g, device="cuda").bfloat16()
            idx = torch.randint(0, cap + 1, (M,), generator=g, device="cuda")
            want = lora_kernels.expand(y, y, b, idx, scale, part, r, N)
            with monkeypatch.context() as mp:
                expand_form(mp, form)
                got = lora_kernels.expand(y, y, b, idx, scale, part, r, N)
            assert torch.equal(got.view(torch.int16), want.view(torch.int16)), (N, M)


def test_a_prefill_under_the_table_runs_the_compiled_layer(monkeypatch):
    """By default (lora.PREFILL_COMPILED) a prefill of rows under the adapters' table (Slots:
    Packed weights) runs the generator's prefill layer, as a prefill without adapters does
    (prefill_fn: compiled on a GPU; on the CPU the eager layer itself, so the other tests cannot
    tell the two apart: here a recorder of whole_block, the function a GPU compiles). The mixed
    batch's greedy tokens through it are each row's alone and, bit for bit, those of the same
    prompts all under the row's adapter; it samples what the eager layer samples. Off, the eager
    layer runs and prefill_fn never sees adapters. (That Dynamo traces the layer under Packed
    weights: test_on_the_gpu_adapters_decode_in_captured_graphs, whose engine compiles it.)"""
    from slimen_torch.model import whole_block
    e = engine()
    try:
        assert lora.PREFILL_COMPILED
        compiled = whole_block(e.model.cfg)
        seen = []

        def layer(cfg, x, w, *a, **kw):
            seen.append(any(isinstance(p, lora.Packed) for p in w))
            return compiled(cfg, x, w, *a, **kw)
        e.gen.prefill_fn = layer
        greedy = Sampling(max_tokens=3, temperature=0.0)
        mixed = generate(e, ROWS, greedy, "g")
        assert seen and all(seen)  # every layer of the prefill, under the table's weights
        for i, row in enumerate(ROWS):
            alone = generate(e, [row], greedy, f"y{i}")
            assert same(mixed[i], alone[0]), f"row {i} ({row[0] or 'base'}) differs alone"
        for name in ("", "a", "b", "c"):
            one = generate(e, [(name, p) for _, p in ROWS], greedy, f"v{name}")
            for i, (a, _) in enumerate(ROWS):
                if a == name:
                    assert mixed[i] == one[i], f"row {i} ({a or 'base'})"
        sampled = Sampling(max_tokens=3, temperature=1.0)
        on = generate(e, ROWS, sampled, "on")
        seen.clear()
        monkeypatch.setattr(lora, "PREFILL_COMPILED", False)
        off = generate(e, ROWS, sampled, "off")
        assert not seen  # off: a prefill under adapters runs the eager layer
        for i, (u, v) in enumerate(zip(on, off)):
            assert same(u, v), i
    finally:
        e.close()
