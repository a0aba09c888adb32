"""LoRA adapters over one frozen base (many policies in one worker).

A target projection y = x·Wᵀ becomes y = x·Wᵀ + s·(x·Aᵀ)·Bᵀ with A rank×in, B out×rank and
s = alpha/rank (PEFT's scaling, and the Go tiny engine's: engines/tiny/lora.go). The base W is
shared and frozen; each adapter's A and B are its own parameters with their own AdamW state.

The model's fused matrices (q/k/v in one, gate/up in another) get the update of each targeted
part in its slice of the output; parts the adapter does not target get nothing.

Three ways to apply adapters (model.Transformer.lora, set with `model.using(sel)`):

* `One(adapter)`: every row uses one adapter, with its parameters (training: gradients reach A
  and B only; scoring with one policy).
* `Rows` (Bank.rows): each row of the batch uses its own adapter (or none) — one forward pass
  for a batch mixing policies. The base product is computed once for all rows; the low-rank part
  is two dense products with the batch's adapters side by side (one wide A and B, zero-padded to
  their largest rank) and a per-row mask that keeps the row's own block, scaled (so a row's
  result does not depend on the other rows: batch invariance). The stacks hold only the adapters
  of the batch, so a worker with a thousand adapters pays for the eight a batch uses. Scoring
  runs this, and so do the generator's passes that the table cannot serve.
* `Slots` (over Bank.table, a `Table`): the decode step's and the prefill's. The same arithmetic
  as Rows over tensors whose shapes do not depend on which adapters a batch holds: the adapters
  the running rows use sit in the slots of a preallocated table, updated in place when one
  changes, and each row reads its slot from an index tensor of the step state. So the step can
  be captured as a CUDA graph once and replayed whatever the batch mixes, and the compiled and
  Triton-split decode layers take the updates as plain tensors (`Packed`). With the Triton
  kernels the decode step applies them as `Fused`: the shrink of every slot in one product, then
  lora_kernels.expand adds each row's own slot's expand to the base product in one kernel.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
from typing import NamedTuple

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file

from . import lora_kernels
from .triton_env import pow2 as _pow2

TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")

# Our fused parameter → the targets it holds, in output order.
FUSED = {"wqkv": ("q_proj", "k_proj", "v_proj"), "wo": ("o_proj",),
         "w13": ("gate_proj", "up_proj"), "w2": ("down_proj",)}
# The index of each fused parameter in Block.weights().
WEIGHT_INDEX = {"wqkv": 1, "wo": 5, "w13": 8, "w2": 9}

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
OPT_FILE = "adapter_optimizer.safetensors"  # the Go tiny engine's names: a resume works either way
OPT_STATE_FILE = "adapter_optimizer.json"


def module_of(target: str) -> str:
    return ("self_attn." if target in TARGETS[:4] else "mlp.") + target


def proj_shape(cfg, target: str) -> tuple[int, int]:
    """(out, in) of a target projection."""
    d, q, kv, im = cfg.hidden, cfg.q_dim, cfg.kv_dim, cfg.intermediate
    return {"q_proj": (q, d), "k_proj": (kv, d), "v_proj": (kv, d), "o_proj": (d, q),
            "gate_proj": (im, d), "up_proj": (im, d), "down_proj": (d, im)}[target]


@dataclasses.dataclass
class LoRAConfig:
    rank: int
    alpha: float
    dropout: float = 0.0
    targets: tuple = ()

    def validate(self) -> None:
        if self.rank < 1:
            raise ValueError(f"lora rank {self.rank}; want at least 1")
        if not (self.alpha > 0 and math.isfinite(self.alpha)):
            raise ValueError(f"lora alpha {self.alpha}; want a finite value > 0")
        if self.dropout != 0:
            # As the tiny engine: an adapter trains without dropout (the loss of a step must
            # be the loss its log-probs were scored with).
            raise ValueError(f"lora dropout {self.dropout}: adapters train without dropout; set it to 0")
        if not self.targets:
            raise ValueError(f"lora targets are empty; name at least one of {list(TARGETS)}")
        for t in self.targets:
            if t not in TARGETS:
                raise ValueError(f"lora target {t!r} is not a projection of the model (want one of {list(TARGETS)})")

    @property
    def scale(self) -> float:
        return self.alpha / self.rank


class Adapter:
    """One adapter: A and B per layer and target (PEFT's shapes), in the model's dtype."""

    def __init__(self, name: str, cfg: LoRAConfig, model_cfg, device, dtype):
        cfg.validate()
        self.name, self.cfg = name, cfg
        self.a: list[dict[str, torch.nn.Parameter]] = []
        self.b: list[dict[str, torch.nn.Parameter]] = []
        for _ in range(model_cfg.layers):
            la, lb = {}, {}
            for t in cfg.targets:
                out, inp = proj_shape(model_cfg, t)
                la[t] = torch.nn.Parameter(torch.zeros(cfg.rank, inp, device=device, dtype=dtype))
                lb[t] = torch.nn.Parameter(torch.zeros(out, cfg.rank, device=device, dtype=dtype))
            self.a.append(la)
            self.b.append(lb)
        self.trainer = None  # a Trainer over params(), made on the first train step

    def init_random(self, seed: int) -> None:
        """PEFT's initialisation: A uniform in ±1/√in (kaiming_uniform, a = √5), B = 0."""
        g = torch.Generator().manual_seed(seed & 0x7FFF_FFFF_FFFF_FFFF)
        with torch.no_grad():
            for la, lb in zip(self.a, self.b):
                for t in self.cfg.targets:
                    bound = 1 / math.sqrt(la[t].shape[1])
                    la[t].copy_((torch.rand(la[t].shape, generator=g, dtype=torch.float64) * 2 - 1) * bound)
                    lb[t].zero_()

    def named(self):
        """(PEFT tensor name, parameter), layer by layer, A before B: the order of the optimizer
        state and of the Go engine's files."""
        for i, (la, lb) in enumerate(zip(self.a, self.b)):
            for t in TARGETS:
                if t in la:
                    p = f"base_model.model.model.layers.{i}.{module_of(t)}."
                    yield p + "lora_A.weight", la[t]
                    yield p + "lora_B.weight", lb[t]

    def params(self) -> list[torch.nn.Parameter]:
        return [p for _, p in self.named()]

    def numel(self) -> int:
        return sum(p.numel() for p in self.params())

    # ---- PEFT folders ----

    def save(self, out: pathlib.Path, base: str) -> None:
        out.mkdir(parents=True, exist_ok=True)
        c = self.cfg
        pc = dict(peft_type="LORA", task_type="CAUSAL_LM", base_model_name_or_path=base, r=c.rank,
                  lora_alpha=c.alpha, lora_dropout=c.dropout, target_modules=list(c.targets),
                  bias="none", fan_in_fan_out=False, inference_mode=True, use_rslora=False,
                  use_dora=False, init_lora_weights=True)
        (out / CONFIG_FILE).write_text(json.dumps(pc, indent=2) + "\n")
        tr = self.trainer
        masters = tr.masters if tr is not None and tr.masters is not None else self.params()
        save_file({n: m.detach().float().contiguous().cpu() for (n, _), m in zip(self.named(), masters)},
                  str(out / WEIGHTS_FILE), metadata={"format": "pt"})
        for f in (OPT_FILE, OPT_STATE_FILE):
            (out / f).unlink(missing_ok=True)
        if tr is not None and tr.opt is not None and tr.steps > 0:
            st, ts = tr.opt.state, {}
            for (n, _), m in zip(self.named(), masters):
                s = st.get(m, {})
                ts["exp_avg." + n] = s.get("exp_avg", torch.zeros_like(m)).float().contiguous().cpu()
                ts["exp_avg_sq." + n] = s.get("exp_avg_sq", torch.zeros_like(m)).float().contiguous().cpu()
            save_file(ts, str(out / OPT_FILE))
            (out / OPT_STATE_FILE).write_text(json.dumps({"optimizer": "adamw", "step": tr.steps}) + "\n")


def read_config(folder: pathlib.Path) -> LoRAConfig:
    try:
        pc = json.loads((folder / CONFIG_FILE).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{folder / CONFIG_FILE}: {e}") from None
    if (pc.get("peft_type") != "LORA" or pc.get("use_rslora") or pc.get("use_dora")
            or pc.get("bias", "none") not in ("none", None) or pc.get("fan_in_fan_out")):
        raise ValueError(f"{folder / CONFIG_FILE}: only a plain LoRA without bias, rsLoRA or DoRA loads")
    targets = pc.get("target_modules") or []
    if isinstance(targets, str):
        targets = [targets]
    c = LoRAConfig(rank=int(pc.get("r", 0)), alpha=float(pc.get("lora_alpha", 0)), dropout=0.0,
                   targets=tuple(sorted(targets, key=lambda t: TARGETS.index(t) if t in TARGETS else -1)))
    c.validate()
    c.dropout = float(pc.get("lora_dropout") or 0.0)
    return c


def load_tensors(folder: pathlib.Path, adapter: Adapter) -> dict[str, torch.Tensor] | None:
    """Fills the adapter's A and B from folder/adapter_model.safetensors (every tensor must be
    there, with its shape); returns the optimizer moments saved beside them with the saved
    weights as they are (fp32: a bf16 adapter's master copy) under "weight." + name, or None
    when the folder has no optimizer state."""
    want = dict(adapter.named())
    saved = {}
    with safe_open(str(folder / WEIGHTS_FILE), framework="pt") as f:
        keys = set(f.keys())
        extra = keys - want.keys()
        if extra:
            raise ValueError(f"{WEIGHTS_FILE}: tensor {sorted(extra)[0]} is not one of this adapter's")
        with torch.no_grad():
            for n, p in want.items():
                if n not in keys:
                    raise ValueError(f"{WEIGHTS_FILE}: no tensor {n}")
                t = f.get_tensor(n)
                if tuple(t.shape) != tuple(p.shape):
                    raise ValueError(f"{WEIGHTS_FILE}: {n} has shape {list(t.shape)}, want {list(p.shape)}")
                p.copy_(t)
                saved["weight." + n] = t
    if not (folder / OPT_FILE).exists():
        return None
    meta = json.loads((folder / OPT_STATE_FILE).read_text())
    with safe_open(str(folder / OPT_FILE), framework="pt") as f:
        out = {k: f.get_tensor(k) for k in f.keys()}
    out["__step__"] = torch.tensor(int(meta["step"]))
    return out | saved


class Bank:
    """The adapters of a worker, by name, with the stacked copies the mixed-batch path gathers
    from (rebuilt lazily after an adapter changes)."""

    def __init__(self, model, max_slots: int = 64):
        self.model = model
        self.adapters: dict[str, Adapter] = {}
        self._stack = None  # (key, stacks, scale) of the last batch's adapters
        self.changes = 0  # counts changed() (the generator's cache of its rows' adapters follows)
        # The decode step's adapters in static tensors (Slots), at most max_slots at once.
        self.table = Table(self, max_slots)

    def changed(self) -> None:
        """After an adapter was added, removed, replaced or trained: the stacks are rebuilt and
        the table's slots copied again (in place) before their next use."""
        self._stack = None
        self.changes += 1
        self.table.changed()

    def rows(self, adapters, device) -> "Rows":
        """The selection for a batch whose row i uses adapters[i] (None: the base)."""
        uniq: dict[int, Adapter] = {}
        for a in adapters:
            if a is not None:
                uniq.setdefault(id(a), a)
        pos = {k: i for i, k in enumerate(uniq, 1)}
        idx = torch.tensor([0 if a is None else pos[id(a)] for a in adapters], device=device)
        return Rows(self, tuple(uniq.values()), idx)

    def stacks(self, ads: tuple):
        """For the n adapters ads, side by side: {(layer, target): (A [n·r, in], B [out, n·r])},
        adapter k (from 0) in rows / columns k·r … k·r + rank, the rest zeros (r their largest
        rank), and r."""
        key = tuple(id(a) for a in ads)
        if self._stack is None or self._stack[0] != key:
            m = self.model
            r = max((a.cfg.rank for a in ads), default=1)
            dev, dt = m.embed.device, m.embed.dtype
            st = {}
            with torch.no_grad():
                for i in range(m.cfg.layers):
                    for t in TARGETS:
                        if not any(t in a.a[i] for a in ads):
                            continue
                        out, inp = proj_shape(m.cfg, t)
                        A = torch.zeros(len(ads) * r, inp, device=dev, dtype=dt)
                        B = torch.zeros(out, len(ads) * r, device=dev, dtype=dt)
                        for k, a in enumerate(ads):
                            if t in a.a[i]:
                                A[k * r:k * r + a.cfg.rank] = a.a[i][t]
                                B[:, k * r:k * r + a.cfg.rank] = a.b[i][t]
                        st[(i, t)] = (A, B)
            self._stack = (key, st, r)
        return self._stack[1:]


# The bias of a fused projection, where the model has one (Qwen2's): a folded product has none.
BIAS = {"wqkv": "bqkv", "wo": "bo"}


def _plain(w) -> bool:
    """Whether w is a plain tensor (not a sharded one's wrapper), which the table can copy."""
    return type(w) in (torch.Tensor, torch.nn.Parameter)


class Table:
    """The adapters the generator's passes use, in device tensors whose shapes do not depend on
    which adapters a batch holds (Slots applies them; a CUDA graph captured over them stays
    valid). Each resident adapter is a copy of its A and B (and memory: at most max_slots).

    For each layer and fused projection f (FUSED) whose parts P are targeted by some adapter the
    table held (P in f's order): A_f [|P|·cap·r, in] and B_f [out_f, |P|·cap·r], where part p of
    the adapter in slot k (1 … cap) takes rows (p·cap + k - 1)·r … + its rank of A_f and the same
    columns of B_f, in part p's rows of the output; every other entry is zero (past the adapter's
    rank, where it does not target p, and B_f off the part's own block), so one product gives f's
    whole update, each part in its slice of the output. scale[k - 1] is slot k's alpha/rank.
    Slot 0 is the base: it has no columns. r is the largest rank the table held, cap its slots.

    `place` makes the adapters of a step resident, copying an adapter into a free slot or into
    the least recently used one that the step does not need (in place). Only when the step needs
    more slots than the table has, a larger rank or a new target does the table grow (new
    tensors, up to max_slots slots): then `version` counts up, and graphs captured over the old
    tensors must be dropped. After `changed` (an adapter added, removed, replaced or trained) the
    next `place` drops the slots of adapters the bank no longer holds and copies the others again,
    in place. `moves` counts the changes of which adapter holds which slot: the generator writes
    its rows' slots again only when it moved.

    A place() of adapters all resident, with nothing changed, does no tensor work and looks at no
    weight: it runs before every decode step, whose graph replay on a GPU must not wait for it."""

    def __init__(self, bank: Bank, max_slots: int):
        self.bank = bank
        self.max_slots = max_slots
        self.cap = self.r = 0
        self.parts: dict[str, tuple] = {f: () for f in FUSED}
        self.version = 0
        self.held: list[Adapter | None] = []  # the adapter of slot k at k - 1
        self.slot: dict[int, int] = {}  # id(adapter) → its slot (held keeps the adapter alive)
        self.used: dict[int, int] = {}  # id(adapter) → the place() call that last needed it
        self.calls = 0
        self.moves = 0
        self.stale = False
        self.a: dict[tuple[int, str], torch.Tensor] = {}
        self.b: dict[tuple[int, str], torch.Tensor] = {}
        self.scale = self.ids = None
        self.dtype = bank.model.embed.dtype
        # fold: each fused weight's A_f in a tensor below a copy of the base weight (wa), so that
        # the decode step's base product gives the shrink too (Fused); the copies cost the
        # projections' memory again and follow the model's weights (_sync). The generator sets
        # it; a change takes effect at the next place(), as a grown table (a new version).
        self.fold = self.folded = False
        self.wa: dict[tuple[int, str], torch.Tensor] = {}
        self.base: list[tuple[int, str]] = []  # (layer, fused name) of each weight copied
        # The copies are taken again at the next place() after base_changed (every path that
        # writes the model's weights calls it), not by comparing each weight every step.
        self.base_stale = False
        self.bn = 0
        self.part: dict[str, torch.Tensor] = {}

    def changed(self) -> None:
        self.stale = True

    def slot_of(self, adapter: Adapter | None) -> int:
        """The slot of a resident adapter; 0 for None (the base)."""
        return 0 if adapter is None else self.slot[id(adapter)]

    def place(self, ads) -> bool:
        """Makes the distinct adapters ads resident; False (nothing changed) when they are more
        than max_slots (the step then runs Rows)."""
        ads = list({id(a): a for a in ads}.values())
        if len(ads) > self.max_slots:
            return False
        self.calls += 1
        if self.stale:
            self._refresh()
        missing = [a for a in ads if id(a) not in self.slot]
        if missing or (self.cap and self.fold != self.folded):
            self._admit(ads, missing)  # (else the table's shapes fit the resident ones already)
        for a in ads:
            self.used[id(a)] = self.calls
        if self.base_stale:
            self._sync()
        return True

    def _admit(self, ads: list, missing: list) -> None:
        """Gives the adapters missing (of ads, the step's) slots: free ones or the least recently
        used of adapters the step does not need, in place; or a grown table for all of ads."""
        want = {id(a) for a in ads}
        r = max([self.r] + [a.cfg.rank for a in ads])
        parts = {f: tuple(t for t in ts if t in self.parts[f] or any(t in a.cfg.targets for a in ads))
                 for f, ts in FUSED.items()}
        if r != self.r or parts != self.parts or len(ads) > self.cap or self.fold != self.folded:
            # Grow: the step's adapters first, then the others held, most recently used first.
            others = sorted((a for a in self.held if a is not None and id(a) not in want),
                            key=lambda a: -self.used[id(a)])
            used = self.used
            cap = min(self.max_slots, max(self.cap, _pow2(len(ads))))
            self._alloc(cap, r, parts)
            for a in (ads + others)[:cap]:
                self._put(a, len(self.slot) + 1)
                self.used[id(a)] = used.get(id(a), 0)
        else:
            free = [k for k in range(1, self.cap + 1) if self.held[k - 1] is None]
            spare = sorted((self.used[id(a)], self.slot[id(a)]) for a in self.held
                           if a is not None and id(a) not in want)
            free += [k for _, k in spare]  # the free slots, then the least recently used
            for a, k in zip(missing, free):
                old = self.held[k - 1]
                if old is not None:
                    del self.slot[id(old)], self.used[id(old)]
                self._put(a, k)

    def base_changed(self) -> None:
        """The model's weights were or are about to be written (a load, a push, a training step:
        Engine._weights_change; written in place, replaced, or by a collective's broadcast that
        moves no version counter): the next place() copies every folded weight's base again."""
        self.base_stale = True

    @torch.no_grad()
    def _sync(self) -> None:
        """fold: the base rows of each folded weight copied again from the model's (after
        base_changed), in one operation."""
        self.base_stale = False
        if not self.base:
            return
        layers = self.bank.model.layers
        ws = [getattr(layers[i], f) for i, f in self.base]
        torch._foreach_copy_([self.wa[k][:W.shape[0]] for k, W in zip(self.base, ws)],
                             [W.detach() for W in ws])

    def _refresh(self) -> None:
        """After changed(): the adapters the bank dropped leave; the others are copied again."""
        self.stale = False
        live = {id(a) for a in self.bank.adapters.values()}
        for k, a in enumerate(self.held, 1):
            if a is None:
                continue
            if id(a) in live:
                self._put(a, k)
            else:
                self.held[k - 1] = None
                del self.slot[id(a)], self.used[id(a)]
                self.moves += 1

    def _alloc(self, cap: int, r: int, parts: dict) -> None:
        m = self.bank.model
        dev, dt = m.embed.device, m.embed.dtype
        self.cap, self.r, self.parts = cap, r, parts
        self.version += 1
        self.moves += 1
        self.held, self.slot = [None] * cap, {}
        self.used = {}
        self.a, self.b = {}, {}
        # For lora_kernels.expand: each chunk of bn output columns of a fused projection lies in
        # one part (bn divides every projection's size); 0: no chunk fits tl.dot's smallest tile,
        # and the decode step runs Packed (nothing folded).
        g = math.gcd(*(proj_shape(m.cfg, t)[0] for t in TARGETS))
        self.bn = min(lora_kernels.BN_MAX, g & -g)
        self.bn = self.bn if self.bn >= 16 else 0
        self.wa, self.base, self.folded = {}, [], self.fold  # (made under this fold setting)
        self.base_stale = False  # (the copies below are taken now)
        for i in range(m.cfg.layers):
            layer = m.layers[i]
            for f, ps in parts.items():
                if not ps:
                    continue
                n = len(ps) * cap * r
                out = sum(proj_shape(m.cfg, t)[0] for t in FUSED[f])
                inp = proj_shape(m.cfg, FUSED[f][0])[1]
                self.b[(i, f)] = torch.zeros(out, n, device=dev, dtype=dt)
                W = getattr(layer, f)
                if (self.fold and self.bn and getattr(layer, BIAS.get(f, ""), None) is None
                        and _plain(W)):
                    # A_f below a copy of the base weight: one product gives both (Fused).
                    wa = torch.empty(out + n, inp, device=dev, dtype=dt)
                    wa[:out].copy_(W)
                    wa[out:].zero_()
                    self.wa[(i, f)], self.a[(i, f)] = wa, wa[out:]
                    self.base.append((i, f))
                else:
                    self.a[(i, f)] = torch.zeros(n, inp, device=dev, dtype=dt)
        self.scale = torch.zeros(cap, device=dev, dtype=torch.float32)
        self.ids = torch.arange(1, cap + 1, device=dev)
        # Each chunk's part: its index in parts, or -1.
        self.part = {}
        for f, ps in parts.items():
            if ps and self.bn:
                chunks = []
                for t in FUSED[f]:
                    n = proj_shape(m.cfg, t)[0] // self.bn
                    chunks += [ps.index(t) if t in ps else -1] * n
                self.part[f] = torch.tensor(chunks, device=dev, dtype=torch.int32)

    @torch.no_grad()
    def _put(self, ad: Adapter, k: int) -> None:
        """Copies ad into slot k (in place)."""
        cfg = self.bank.model.cfg
        zero, dst, src = [], [], []
        for i in range(cfg.layers):
            for f, ps in self.parts.items():
                if not ps:
                    continue
                A, B = self.a[(i, f)], self.b[(i, f)]
                offs, o = {}, 0
                for t in FUSED[f]:
                    offs[t] = o
                    o += proj_shape(cfg, t)[0]
                for p, t in enumerate(ps):
                    c = (p * self.cap + k - 1) * self.r
                    out = proj_shape(cfg, t)[0]
                    a_blk, b_blk = A[c:c + self.r], B[offs[t]:offs[t] + out, c:c + self.r]
                    zero += [a_blk, b_blk]
                    if t in ad.a[i]:
                        dst += [a_blk[:ad.cfg.rank], b_blk[:, :ad.cfg.rank]]
                        src += [ad.a[i][t], ad.b[i][t]]
        if zero:
            torch._foreach_zero_(zero)
        if dst:
            torch._foreach_copy_(dst, src)
        self.scale[k - 1] = ad.cfg.scale
        if self.held[k - 1] is not ad:
            self.moves += 1
        self.held[k - 1] = ad
        self.slot[id(ad)] = k


class Packed(NamedTuple):
    """A fused projection weight w with the table's updates of the batch's rows: `linear`
    computes x·wᵀ + ((x·aᵀ) ∘ m)·bᵀ, a and b a layer's A_f and B_f (Table), m the rows' mask
    (Slots.mask). A tuple of tensors, which torch.compile takes as an argument as it is."""

    w: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    m: torch.Tensor


class Fused(NamedTuple):
    """A fused projection weight w with the table's updates of the batch's rows, applied by
    `linear` in two kernels after the base product: the shrink x·aᵀ of every slot and
    lora_kernels.expand (each row's own slot's columns, scaled, times b, added). a, b: a layer's
    A_f and B_f; idx: the rows' slots; scale, part, r: the table's (Table.part). The decode
    step's (x of [rows, in]), on the devices the kernel runs on. Folded (Table.fold): a is None
    and w is the table's [w; A_f], whose one product gives the base's output and the shrink."""

    w: torch.Tensor
    a: torch.Tensor
    b: torch.Tensor
    idx: torch.Tensor
    scale: torch.Tensor
    part: torch.Tensor
    r: int


class LoRAWeight:
    """A fused projection weight with low-rank updates: `linear` applies it."""

    __slots__ = ("w", "delta")

    def __init__(self, w, delta):
        self.w, self.delta = w, delta


def linear(x: torch.Tensor, w, b=None) -> torch.Tensor:
    """F.linear that also applies a LoRAWeight's update."""
    if isinstance(w, LoRAWeight):
        return F.linear(x, w.w, b) + w.delta(x)
    if isinstance(w, Fused):
        if w.a is None:  # folded (Table.fold): w is [base; A_f], one product gives both
            y = F.linear(x, w.w)
            return lora_kernels.expand(y, y, w.b, w.idx, w.scale, w.part, w.r, w.b.shape[0])
        return lora_kernels.expand(F.linear(x, w.w, b), F.linear(x, w.a), w.b, w.idx, w.scale,
                                   w.part, w.r)
    if isinstance(w, Packed):
        m = w.m if x.dim() == 2 else w.m[:, None, :]
        return F.linear(x, w.w, b) + F.linear(F.linear(x, w.a) * m, w.b)
    return F.linear(x, w, b)


def _fused_delta(parts, x, sizes):
    """Concatenates each part's update (None: zeros of its size) along the last dimension."""
    outs = []
    for fn, n in zip(parts, sizes):
        outs.append(fn(x) if fn is not None else x.new_zeros(*x.shape[:-1], n))
    return outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)


def _with_updates(model, w: tuple, update) -> tuple:
    """w (Block.weights) with each fused projection that has targeted parts wrapped in a
    LoRAWeight; update(target) is that part's update function of x, or None."""
    w = list(w)
    for attr, targets in FUSED.items():
        fns = [update(t) for t in targets]
        if any(f is not None for f in fns):
            sizes = [proj_shape(model.cfg, t)[0] for t in targets]
            w[WEIGHT_INDEX[attr]] = LoRAWeight(w[WEIGHT_INDEX[attr]],
                                               lambda x, fns=fns, sizes=sizes: _fused_delta(fns, x, sizes))
    return tuple(w)


class One:
    """Every row uses one adapter (its own parameters: gradients reach them)."""

    def __init__(self, adapter: Adapter):
        self.ad = adapter

    def weights(self, model, i: int, w: tuple) -> tuple:
        ad, s = self.ad, self.ad.cfg.scale

        def update(t):
            if t not in ad.a[i]:
                return None
            A, B = ad.a[i][t], ad.b[i][t]
            return lambda x: F.linear(F.linear(x, A) * s, B)
        return _with_updates(model, w, update)


class Rows:
    """Row i of the batch uses adapter ads[idx[i] - 1] (idx 0: none); made by Bank.rows.

    The batch's adapters sit side by side in one wide A (n·r × in) and B (out × n·r): the update
    is ((x·Aᵀ) ∘ M)·Bᵀ, two dense products for all rows, where the mask M keeps each row's own
    block of n·r columns, scaled by its adapter's alpha/rank, and zeroes the others (a row's
    result is its own adapter's: the zeros add nothing)."""

    def __init__(self, bank: Bank, ads: tuple, idx: torch.Tensor):
        self.bank, self.ads, self.idx = bank, ads, idx
        self._mask = None

    def mask(self, r: int, dtype) -> torch.Tensor:
        """[R, n·r]: the scale of row i's adapter over its block, 0 elsewhere."""
        if self._mask is None:
            n = len(self.ads)
            scale = torch.tensor([a.cfg.scale for a in self.ads], device=self.idx.device, dtype=torch.float32)
            onehot = F.one_hot(self.idx, n + 1)[:, 1:].to(torch.float32) * scale
            self._mask = onehot.repeat_interleave(r, dim=1).to(dtype)
        return self._mask

    def weights(self, model, i: int, w: tuple) -> tuple:
        st, r = self.bank.stacks(self.ads)

        def update(t):
            if (i, t) not in st:
                return None
            A, B = st[(i, t)]
            M = self.mask(r, A.dtype)
            return lambda x: F.linear(F.linear(x, A) * (M if x.dim() == 2 else M[:, None, :]), B)
        return _with_updates(model, w, update)


# Whether a prefill under the adapters' table (Slots, its Packed weights: tuples of tensors) runs
# the generator's compiled prefill layer, as a prefill without adapters does, instead of the
# eager one. On one H200 (bench_lora.py --sections steps and gen: 256 rows over 8 adapters,
# Qwen3-0.6B's shape) a prefill of 128 rows took 109 ms in the eager layer against the one
# model's 33 ms in the compiled one, and the whole generation went from 0.660x the one model's
# tok/s to 0.803x with this on (docs/performance.md). Off: the eager layer, which the gen
# section times too.
PREFILL_COMPILED = True


class Slots:
    """Row i of the batch uses the adapter in slot idx[i] of table (0: none); what the decode
    step runs under, its shapes fixed by the table's, so it can be captured as a CUDA graph
    (idx is a slice of the step state, written before the step), and the prefill (x of
    [rows, T, in]: each row's mask over its positions).

    Rows' arithmetic over the whole table: ((x·A_fᵀ) ∘ M)·B_fᵀ, where the mask M keeps the
    columns of row i's slot, scaled by its alpha/rank, and zeroes the others (a row's result is
    its own adapter's whatever the other rows hold: batch invariance).

    fused (the decode step's, where lora_kernels runs): the same through Fused, which reads only
    each row's own slot's columns and needs no mask; not where the table has no chunk size
    (Table.bn 0)."""

    def __init__(self, table: Table, idx: torch.Tensor, fused: bool = False):
        self.table, self.idx = table, idx
        self.fused = fused and table.bn > 0 and lora_kernels.available(idx.device)
        # (Transformer.forward: an inference pass may run a compiled layer under it)
        self.compiled_ok = PREFILL_COMPILED and not self.fused
        if self.fused:
            return
        on = (idx[:, None] == table.ids[None, :]).to(torch.float32) * table.scale
        self.m1 = on[:, :, None].expand(-1, -1, table.r).reshape(
            idx.shape[0], table.cap * table.r).to(table.dtype)
        self._masks = {1: self.m1}

    def mask(self, parts: int) -> torch.Tensor:
        """[rows, parts·cap·r]: the mask of a fused projection of that many parts."""
        if parts not in self._masks:
            self._masks[parts] = self.m1.repeat(1, parts)
        return self._masks[parts]

    def weights(self, model, i: int, w: tuple) -> tuple:
        t = self.table
        w = list(w)
        for f, ps in t.parts.items():
            if ps:
                k = WEIGHT_INDEX[f]
                if self.fused:
                    wa = t.wa.get((i, f))
                    # (folded where the weight is the model's, which the table's copy follows)
                    if wa is not None and w[k] is getattr(model.layers[i], f):
                        w[k] = Fused(wa, None, t.b[(i, f)], self.idx, t.scale, t.part[f], t.r)
                    else:
                        w[k] = Fused(w[k], t.a[(i, f)], t.b[(i, f)], self.idx, t.scale,
                                     t.part[f], t.r)
                    continue
                w[k] = Packed(w[k], t.a[(i, f)], t.b[(i, f)], self.mask(len(ps)))
        return tuple(w)


class View:
    """The model as one adapter sees it, for the Trainer: calls run under One(adapter); every
    other attribute is the model's."""

    def __init__(self, model, sel):
        object.__setattr__(self, "_m", model)
        object.__setattr__(self, "_sel", sel)

    def __call__(self, *args, **kw):
        with self._m.using(self._sel):
            return self._m(*args, **kw)

    def __getattr__(self, name):
        return getattr(self._m, name)

    def __setattr__(self, name, value):
        if name == "train_block_fn":  # the trainer's compile mode: adapters run the eager layer
            return
        setattr(self._m, name, value)


def merge_into(model, adapter: Adapter) -> None:
    """Folds the adapter into the model's weights: W += s·B·A (slimen export --merge)."""
    s = adapter.cfg.scale
    with torch.no_grad():
        for i, layer in enumerate(model.layers):
            for attr, targets in FUSED.items():
                W = getattr(layer, attr)
                off = 0
                for t in targets:
                    out, _ = proj_shape(model.cfg, t)
                    if t in adapter.a[i]:
                        d = (adapter.b[i][t].double() @ adapter.a[i][t].double()) * s
                        W[off:off + out] += d.to(W.dtype)
                    off += out
