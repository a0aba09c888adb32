"""The engine: one model, its tokenizer, the generator and the trainer, driven by one thread.

Every use of the model happens on the worker thread, so generation, scoring, training, saving
and loading never race on the weights or the CUDA graphs. Generate requests join the running
decode batch at the next scheduler iteration; the other calls run between decode steps.
The methods mirror engines.Engine in Go (engines/engine.go); server.py serves them over gRPC.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import json
import logging
import os
import pathlib
import threading
import time

import torch

from . import batch_invariant, compile_cache, kernels, lora, profiling
from .config import ModelConfig, eos_ids, read_config
from .generate import Generator, Request
from .model import Transformer, bind_thread, fused_rms_norm
from . import constrain
from .tokenizer import Tokenizer
from .train import (Trainer, deterministic_micro_batch_tokens, free_memory, micro_batches,
                    response_hidden, response_logits)
from .types import (Batch, Completion, GenerateRequest, LossConfig, RequestError, Sampling,
                    ScoreRequest, TrainStats)
from .versions import Versions
from .weights import load_weights, save_weights

log = logging.getLogger("slimen_torch")

OPTIMIZER_FILE = "optimizer.pt"


@dataclasses.dataclass
class Options:
    device: str = "cpu"
    dtype: str = ""  # "" → bfloat16 on a GPU, float32 on the CPU
    slots: int = 0  # cache rows (concurrent samples); 0 → 16 on the CPU, 256 on a GPU (fitted)
    max_seq_len: int = 0  # cache positions; 0 → min(model's, 2048 CPU / 4096 GPU)
    cuda_graphs: bool = True  # capture decode steps (GPU only)
    compile: bool = True  # torch.compile the decode layer before capturing it (GPU only)
    # Triton decode attention and sampler (kernels.py); None: on a GPU when Triton is there.
    # On the CPU only under TRITON_INTERPRET=1 (tests).
    kernels: bool | None = None
    # Batch-1 decode steps entirely in Triton kernels (model.decode_step_b1); None: as kernels.
    fused_b1: bool | None = None
    # Training: log-probs and entropy computed in chunks from the hidden states, never the whole
    # fp32 logits (kernels.linear_logprobs; Triton element-wise passes on a GPU).
    fused_head: bool = True
    # Training RMSNorm in PyTorch's fused kernel (model.fused_rms_norm); None: on a GPU.
    fused_norm: bool | None = None
    # torch.compile of training (GPU only): "block" the whole layer (forward and backward,
    # dynamic shapes), "block-static", "regional" (the q/k/v and MLP parts around an eager
    # attention), "off" (or ""). A failure falls back block → regional → eager.
    compile_train: str | bool = "block"
    prefill_tokens: int = 0  # prompt tokens admitted per iteration; 0 → 2048 CPU / 16384 GPU
    # A prompt admitted alone (batch 1) and at most this long is prefilled by a CUDA graph per
    # length bucket (multiples of 64); 0: always eagerly. None: 512 on a GPU with cuda_graphs,
    # else 0 (on the CPU a positive value runs the same bucketed code without graphs: tests).
    prefill_graph_max: int | None = None
    # The prefill's layer compiled as well (GPU, with compile; traced whole, model.whole_block):
    # faster admissions, of a batch and of a lone prompt (docs/performance.md); each worker
    # compiles it on first use, once for a batch and once for a lone prompt (hits of the compile
    # cache after the first run).
    compile_prefill: bool = True
    # The samples of one request admitted together read their shared prompt's keys and values
    # once as a group in the batched Triton decode attention (GRPO's n samples of a prompt;
    # kernels.decode_attention's shared), instead of once per sample. Off: each row reads its own.
    shared_prompts: bool = True
    # Padded tokens per training micro-batch; 0 → 4096 (CPU) / 16384 (GPU), in the deterministic
    # mode on a GPU what free memory allows (train.deterministic_micro_batch_tokens).
    micro_batch_tokens: int = 0
    grad_checkpointing: bool = False  # recompute layer activations in the backward pass
    ref_model: str = ""  # the frozen KL reference; "" → the folder the engine started with
    kv_memory_fraction: float = 0.4  # share of free GPU memory the default cache may take
    # The KV cache's storage dtype: "auto" the model's; "fp8" float8_e4m3fn with a per-tensor
    # scale of 1.0 (vLLM's and SGLang's --kv-cache-dtype fp8 without calibration): half the
    # bytes a decode step reads at bf16, keys and values rounded to 3 mantissa bits and
    # saturated at ±448 (docs/torch.md). Every generation path supports it; scoring and
    # training never read the cache.
    kv_cache_dtype: str = "auto"
    # Prefix reuse across a conversation's turns (generate.py's module comment): up to this many
    # finished samples' cache rows are kept and a new prompt that starts with one's tokens (at
    # least prefix_min of them) is prefilled from there. 0: off (the default: with it on, a
    # completion's floating-point values can depend on what was cached; docs/torch.md).
    prefix_cache: int = 0
    prefix_min: int = 16
    # Keep weights versions in the worker (versions.py, "versions" in the capabilities): a
    # rollout model and a device copy per kept version. False: the host uses rollout replicas.
    versions: bool = True
    # Join push groups (push.py, "push" in the capabilities): a trainer and its rollout replicas
    # take the weights through a process group. False: the host pushes them through a folder.
    push: bool = True
    # Batch-invariant arithmetic (batch_invariant.py, docs/torch.md): a row's numbers do not
    # depend on its batch or its cache row's layout, and the trainer's log-probs equal the
    # rollout's bit for bit. It runs the paths that have invariant forms: no Triton decode
    # kernels, no torch.compile, PyTorch's RMSNorm, the log-prob head on whole logits; CUDA
    # graphs stay. The KV cache must be in the model's dtype.
    deterministic: bool = False


def _dtype(name: str, device: torch.device) -> torch.dtype:
    if not name:
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    try:
        return {"bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float32": torch.float32,
                "fp32": torch.float32, "float16": torch.float16}[name]
    except KeyError:
        raise ValueError(f"dtype {name!r}: use bfloat16 or float32") from None


KV_CACHE_DTYPES = ("auto", "fp8")


def _kv_dtype(name: str, dtype: torch.dtype) -> torch.dtype:
    """Options.kv_cache_dtype → the cache's dtype (dtype: the model's)."""
    if name in ("", "auto"):
        return dtype
    if name == "fp8":
        return torch.float8_e4m3fn
    raise ValueError(f"kv_cache_dtype {name!r} (--kv-cache-dtype): use auto (the model's dtype) "
                     f"or fp8 (float8_e4m3fn)")


def _eos(raw: dict, tok: Tokenizer) -> list[int]:
    ids = eos_ids(raw)
    gen = tok.files.get("generation_config.json")
    if gen is not None:
        ids += eos_ids(json.loads(gen))
    t = tok.token_id(tok.special.get("eos_token"))
    if t is not None:
        ids.append(t)
    return list(dict.fromkeys(ids))


def _one_prompt(messages, prompt_tokens, what: str) -> None:
    """A request's prompt is exactly one of messages and prompt_tokens."""
    if bool(messages) == bool(prompt_tokens):
        raise RequestError("INVALID_ARGUMENT", f"{what}: set exactly one of messages and "
                           "prompt_tokens")


def device_fault(e: BaseException) -> bool:
    """Whether e is the device's own failure (a CUDA error: a kernel's failed assertion, an
    illegal address), after which the process's CUDA context runs nothing more: every later
    operation raises the same error, so only a new process serves again."""
    if isinstance(e, torch.AcceleratorError):
        return True
    return isinstance(e, RuntimeError) and "CUDA error" in str(e)


class Engine:
    # Whether the engine keeps weights versions (versions.py; "versions" in its capabilities).
    # A sharded trainer's engine (dist.py) does not.
    keeps_versions = True
    # Whether the engine can join a push group (push.py). A worker group (dist.py) cannot: its
    # processes' default group is its own.
    pushes_weights = True

    def __init__(self, model_dir: str, options: Options | None = None):
        self.opts = options or Options()
        if self.opts.deterministic:
            if self.opts.kv_cache_dtype not in ("", "auto"):
                raise ValueError(f"deterministic: kv_cache_dtype {self.opts.kv_cache_dtype!r} "
                                 "rounds the keys and values generation reads and training does "
                                 "not; use kv_cache_dtype auto")
            # The gradients' products run in cuBLAS, repeatable on one stream; with other
            # streams active it may pick other kernels unless its workspace is fixed, as
            # PyTorch's deterministic mode asks (the attention's backward pass no longer enters
            # that mode, which set it on the first step): fixed before the first product.
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
            # Micro-batches by default as large as the free memory allows the whole logits
            # (train.deterministic_micro_batch_tokens, in _build once the cache is made; a
            # row's numbers do not depend on how rows are cut into micro-batches).
            self.opts = dataclasses.replace(
                self.opts, kernels=False, fused_b1=False, compile=False, compile_prefill=False,
                compile_train="off", fused_norm=False, fused_head=False, shared_prompts=False)
        self.device = torch.device(self.opts.device)
        if self.device.type == "cuda" and self.device.index is None:
            # "cuda" is the current device of the thread that builds the engine; its own threads
            # bind that device by index (bind_thread).
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.dtype = _dtype(self.opts.dtype, self.device)
        self.kv_dtype = _kv_dtype(self.opts.kv_cache_dtype, self.dtype)
        self._reference = None
        self._ref_dir = self.opts.ref_model or str(model_dir)
        # What info() reports as the model: the folder the engine started from, even after a
        # load (a host resets a server it trains to it by loading it).
        self._started = str(pathlib.Path(model_dir).absolute())
        self.compile_cache: compile_cache.Status | None = None
        self._first_train = True
        self.profiler = profiling.StepProfiler()  # SLIMEN_TORCH_PROFILE
        self.keeps_versions = self.keeps_versions and self.opts.versions
        self.versions = Versions(self)
        self.pushes_weights = self.pushes_weights and self.opts.push
        self._push_group = None  # push.Group; made by join_push
        self._push_lock = threading.Lock()
        self._build(pathlib.Path(model_dir))
        if self.kv_dtype != self.dtype:
            log.info("KV cache in %s (kv_cache_dtype %s)", str(self.kv_dtype).removeprefix(
                "torch."), self.opts.kv_cache_dtype)
        log.info("engine ready: %s on %s; %s", model_dir, self.device,
                 self.compile_cache.line() if self.compile_cache else "nothing compiled")
        self._cv = threading.Condition()
        self._tasks: list = []
        self._new: list[Request] = []
        self._cancels: list[str] = []
        self._closed = False
        self._dead = ""  # why the engine's thread stopped, if it did: every call then says so
        # Called (on the engine's thread) with the reason when the device faults (device_fault):
        # `serve` sets it to end the process, so that the host starts a new worker, puts its
        # policy's state back and resends the calls in flight, as after a killed worker. Unset
        # (an engine in a test, or embedded), the engine's thread stops: every call fails.
        self.on_fault = None
        self._unanswered: list[concurrent.futures.Future] = []  # the calls a device fault stopped
        self._thread = threading.Thread(target=self._run_loop, name="slimen-torch-worker",
                                        daemon=True)
        self._thread.start()

    # ---- building the model ----

    def _build(self, model_dir: pathlib.Path) -> None:
        if self.device.type == "cuda" and self.compile_cache is None:
            # Before anything compiles (torch.compile, the Triton kernels): the compilers read
            # these folders when they first use them.
            self.compile_cache = compile_cache.setup(self.device)
            # A recompile mid-run (a new shape's guard failed) costs seconds of a step: the
            # worker's log says which function and why (torch's "__recompiles" lines).
            torch._logging.set_logs(recompiles=True)
        cfg, raw = read_config(model_dir)
        self.model_dir, self.cfg, self.raw = model_dir, cfg, raw
        self.tokenizer = Tokenizer(model_dir)
        self.eos = _eos(raw, self.tokenizer)
        model = Transformer(cfg, device=self.device, dtype=self.dtype)
        load_weights(model, model_dir)
        self.model = model.eval().requires_grad_(True)
        o, cuda = self.opts, self.device.type == "cuda"
        self.gen = None  # (a rebuild: the old generator's cache is no reservation of the new one)
        self.gen = self.new_generator(model)
        model.grad_checkpointing = o.grad_checkpointing
        if o.fused_norm if o.fused_norm is not None else cuda:
            model.train_norm = fused_rms_norm
        mode = o.compile_train
        mode = "block" if mode is True else ("" if mode in (False, None, "off") else mode)
        mode = mode if cuda else ""
        mbt = o.micro_batch_tokens or (16384 if cuda else 4096)
        if o.deterministic and not o.micro_batch_tokens:
            mbt = deterministic_micro_batch_tokens(cfg, self.dtype.itemsize,
                                                   free_memory(self.device))
            log.info("deterministic mode: training micro-batches of %d tokens", mbt)
        self.trainer = self._new_trainer(model, micro_batch_tokens=mbt,
                                         reference=self._reference_model, compile=mode,
                                         fused_head=o.fused_head)
        self._load_optimizer(model_dir)
        # LoRA adapters over this model as a frozen base (one per policy of the host).
        self.bank = self.gen.bank = lora.Bank(model)

    def new_generator(self, model: Transformer) -> Generator:
        """A generator of model with the engine's options (its own KV cache and graphs)."""
        o, cuda = self.opts, self.device.type == "cuda"
        max_len = min(self.cfg.max_seq_len, o.max_seq_len or (4096 if cuda else 2048))
        use_kernels = o.kernels if o.kernels is not None else (cuda and kernels.HAVE_TRITON)
        return Generator(
            model, self.tokenizer, self.eos, slots=o.slots or self._default_slots(max_len),
            max_len=max_len, cuda_graphs=o.cuda_graphs, compile_layers=o.compile and cuda,
            compile_prefill=o.compile_prefill and o.compile and cuda,
            prefill_tokens=o.prefill_tokens or (16384 if cuda else 2048),
            triton=use_kernels, fused_b1=use_kernels if o.fused_b1 is None else o.fused_b1,
            prefill_graph_max=(512 if cuda and o.cuda_graphs else 0) if o.prefill_graph_max is None
            else o.prefill_graph_max, prefix_rows=o.prefix_cache, prefix_min=o.prefix_min,
            kv_dtype=self.kv_dtype, shared_prompts=o.shared_prompts)

    def _new_trainer(self, model: Transformer, **kw) -> Trainer:
        """The trainer of the model (dist.py's engine makes a sharded one)."""
        return Trainer(model, **kw)

    def _default_slots(self, max_len: int) -> int:
        if self.device.type != "cuda":
            return 16
        c = self.cfg
        per_row = 2 * c.layers * c.kv_heads * max_len * c.head_dim * self.kv_dtype.itemsize
        free, _ = torch.cuda.mem_get_info(self.device)
        gen = getattr(self, "gen", None)
        if gen is not None and gen.k is None:
            # A second generator (the rollout model's, versions.py) while the first has not
            # allocated its cache yet (it does on first use): leave room for it.
            free = max(0, free - gen.S * gen.L * per_row // max_len)
        slots = 256
        while slots > 1 and slots * per_row > self.opts.kv_memory_fraction * free:
            slots //= 2
        return slots

    def _reference_model(self) -> Transformer:
        if self._reference is None:
            cfg, _ = read_config(self._ref_dir)
            ref = Transformer(cfg, device=self.device, dtype=self.dtype)
            load_weights(ref, self._ref_dir)
            self._reference = ref.eval().requires_grad_(False)
        return self._reference

    def _load_optimizer(self, model_dir: pathlib.Path) -> None:
        path = model_dir / OPTIMIZER_FILE
        if path.exists():
            self.trainer.load_state_dict(torch.load(path, map_location=self.device))

    # ---- the worker thread ----

    def _run_loop(self) -> None:
        """The engine's thread: _loop, and should it raise (a bug, not a failed call: those go
        to their callers), every waiting and later call fails with the reason instead of
        waiting for a thread that is gone."""
        try:
            self._loop()
        except BaseException as e:
            log.exception("the engine's thread stopped")
            if device_fault(e) and self.on_fault is not None:
                self.on_fault(f"{type(e).__name__}: {e}")
            with self._cv:
                self._dead = f"the engine's thread stopped: {type(e).__name__}: {e}"
                self._closed = True
                tasks, self._tasks = self._tasks, []
                new, self._new = self._new, []
            for fut in self._unanswered:
                fut.set_exception(e)
            for _, fut in tasks:
                if fut.set_running_or_notify_cancel():
                    fut.set_exception(RuntimeError(self._dead))
            for r in new:
                if r.on_error is not None:
                    r.on_error("INTERNAL", self._dead)
            try:
                self.gen.fail_all(self._dead)
            except Exception:  # the generator may be what broke
                log.exception("failing the generator's requests")

    def _loop(self) -> None:
        bind_thread(self.device)
        # All of the engine's model work runs on this thread: its arithmetic mode is the thread's.
        batch_invariant.set_enabled(self.opts.deterministic)
        while True:
            with self._cv:
                while not (self._closed or self._tasks or self._new or self._cancels
                           or self.gen.busy()):
                    self._cv.wait()
                if self._closed:
                    return
                tasks, self._tasks = self._tasks, []
                new, self._new = self._new, []
                cancels, self._cancels = self._cancels, []
            for r in new:
                self.gen.add(r)
            for rid in cancels:
                self.gen.cancel(rid)
            if tasks:
                self.gen.flush()
            for i, (fn, fut) in enumerate(tasks):
                if fut.set_running_or_notify_cancel():
                    try:
                        fut.set_result(fn())
                    except BaseException as e:  # handed to the caller
                        if not device_fault(e):
                            fut.set_exception(e)
                            continue
                        # The device failed: no later task can run. They are answered only
                        # after on_fault (_run_loop), which ends a served process first, so that
                        # the host resends them instead of hearing that they failed.
                        self._unanswered = [fut] + [f for _, f in tasks[i + 1:]
                                                    if f.set_running_or_notify_cancel()]
                        raise
            if self.gen.busy():
                try:
                    self.gen.step()
                except Exception as e:
                    if device_fault(e):
                        raise  # _run_loop: the device can run nothing more in this process
                    log.exception("generation failed")
                    self.gen.fail_all(f"generation failed: {e}")

    def _call(self, fn, *args):
        fut: concurrent.futures.Future = concurrent.futures.Future()
        with self._cv:
            if self._closed:
                raise RuntimeError(self._dead or "engine closed")
            self._tasks.append((lambda: fn(*args), fut))
            self._cv.notify()
        return fut.result()

    # ---- the engine methods ----

    def info(self) -> dict:
        return dict(model=self._started, architecture=self.cfg.architecture,
                    vocab_size=self.cfg.vocab_size, max_seq_len=self.gen.L,
                    chat_template=self.tokenizer.chat_template, eos_tokens=list(self.eos),
                    params=self.cfg.params(), devices=[str(self.device)],
                    capabilities=["generate", "score", "train", "values", "reference", "tis",
                                  "lora", "constrain"] + (["versions"] if self._keeps_versions() else [])
                    + (["push"] if self.pushes_weights else []))

    # ---- LoRA adapters ----

    def add_adapter(self, name: str, cfg: lora.LoRAConfig, seed: int) -> int:
        """A new adapter over the model as a frozen base: A drawn from seed, B zero (it computes
        what the base computes until it trains). Returns its parameter count."""
        cfg.validate()
        if not name:
            raise RequestError("INVALID_ARGUMENT", "an adapter needs a name")
        return self._call(self._add_adapter, name, cfg, seed)

    def _add_adapter(self, name, cfg, seed) -> int:
        if name in self.bank.adapters:
            raise RequestError("ALREADY_EXISTS", f"adapter {name!r} exists already")
        if self.trainer.steps:
            raise RequestError("FAILED_PRECONDITION", f"adapter {name!r}: this worker trained its "
                               "full weights; adapters need a frozen base")
        ad = lora.Adapter(name, cfg, self.cfg, self.device, self.dtype)
        ad.init_random(seed)
        self.model.requires_grad_(False)  # the base is frozen: no gradients, no AdamW state
        self.bank.adapters[name] = ad
        self._adapters_changed()
        return ad.numel()

    def remove_adapter(self, name: str) -> None:
        """Drops an adapter; its requests in flight end with an error. Unknown names are ignored."""
        self._call(self._remove_adapter, name)

    def _remove_adapter(self, name) -> None:
        ad = self.bank.adapters.pop(name, None)
        if ad is not None:
            self.gen.fail_adapter(ad, f"adapter {name!r} was removed")
            self._adapters_changed()

    def adapter_names(self) -> list[str]:
        return list(self.bank.adapters)

    def _adapter(self, name: str, what: str):
        """The adapter of a request (None for "": the base)."""
        if not name:
            return None
        ad = self.bank.adapters.get(name)
        if ad is None:
            raise RequestError("NOT_FOUND", f"{what}: no adapter {name!r} (have "
                               f"{sorted(self.bank.adapters)})")
        return ad

    def _adapter_trainer(self, ad) -> Trainer:
        if ad.trainer is None:
            # Eager layers (compiled ones were traced without adapters); the same loss code.
            ad.trainer = Trainer(lora.View(self.model, lora.One(ad)),
                                 micro_batch_tokens=self.trainer.micro_batch_tokens,
                                 reference=lambda: self.model, compile="",
                                 fused_head=self.trainer.fused_head, params=ad.params())
        return ad.trainer

    def tokenize(self, texts: list[str]) -> list[list[int]]:
        return [self.tokenizer.encode(t) for t in texts]

    def render(self, reqs) -> list[list[int]]:
        """The chat template applied to each request's messages, as token ids (a conversation's
        turns: engines.Renderer). Each request is (messages, tools, add_generation_prompt); tools
        are JSON schemas, given to the template's `tools` variable."""
        out = []
        for i, (messages, tools, add_generation_prompt) in enumerate(reqs):
            try:
                schemas = [json.loads(t) for t in tools] or None
                out.append(self.tokenizer.encode_chat([dict(m) for m in messages],
                                                      add_generation_prompt, schemas))
            except Exception as e:
                raise RequestError("INVALID_ARGUMENT", f"render request {i}: chat template: {e}") from None
        return out

    def prompt_of(self, messages, prompt_tokens, what: str) -> list[int]:
        """The prompt ids of a request with exactly one of messages and prompt_tokens."""
        _one_prompt(messages, prompt_tokens, what)
        if messages:
            try:
                ids = self.tokenizer.encode_chat([dict(m) for m in messages])
            except Exception as e:
                raise RequestError("INVALID_ARGUMENT", f"{what}: chat template: {e}") from None
        else:
            ids = list(prompt_tokens)
        V = self.cfg.vocab_size
        bad = next((t for t in ids if not 0 <= t < V), None)
        if bad is not None:
            raise RequestError("INVALID_ARGUMENT", f"{what}: token {bad} outside the vocabulary "
                               f"[0, {V})")
        if not ids:
            raise RequestError("INVALID_ARGUMENT", f"{what}: empty prompt")
        return ids

    def submit(self, req: GenerateRequest, on_completion, on_error=None) -> None:
        """Queues req; on_completion(Completion) is called (on the worker thread) for each sample
        as it finishes, on_error(code, message) once if the request fails after submission.
        Raises RequestError for a request that cannot be served at all."""
        r = self.request(req, on_completion, on_error)
        with self._cv:
            if self._closed:
                raise RuntimeError(self._dead or "engine closed")
            self._new.append(r)
            self._cv.notify()

    def request(self, req: GenerateRequest, on_completion=None, on_error=None) -> Request:
        """The generator's request of req, checked (RequestError for one that cannot be served)."""
        prompt = self.prompt_of(req.messages, req.prompt_tokens, f"request {req.id!r}")
        if len(prompt) >= self.gen.L:
            raise RequestError("INVALID_ARGUMENT", f"request {req.id!r}: prompt of {len(prompt)} "
                               f"tokens leaves no room in the engine's {self.gen.L} positions")
        r = Request(req.id, prompt, req.n or 1, self.check(req), on_completion, on_error)
        r.adapter = self._adapter(req.adapter, f"request {req.id!r}")
        s = req.sampling
        if s.constraint:
            try:
                r.matcher = self._matchers().get(s.constraint)
            except (constrain.ConstraintError, ValueError) as e:
                raise RequestError("INVALID_ARGUMENT", f"request {req.id!r}: constraint: {e}") from None
        return r

    def check(self, req: GenerateRequest) -> Sampling:
        """The checks of req that need neither its prompt's tokens nor the chat template (request
        makes them too, after the prompt's); returns its sampling settings as the generator takes
        them. A worker over several ranks (dist.Group) makes these at once and the rest on the
        rank the request is dealt to."""
        what = f"request {req.id!r}"
        _one_prompt(req.messages, req.prompt_tokens, what)
        s = req.sampling
        if not 0 <= s.temperature < float("inf"):
            raise RequestError("INVALID_ARGUMENT", f"{what}: temperature {s.temperature}; "
                               "want a finite value ≥ 0")
        if req.n < 0:
            raise RequestError("INVALID_ARGUMENT", f"{what}: negative n")
        if s.max_tokens < 1:  # the host sets it from the run's config: no second default here
            raise RequestError("INVALID_ARGUMENT", f"{what}: max_tokens = {s.max_tokens}; "
                               "want at least 1")
        if not 0 <= s.top_p <= 1:
            raise RequestError("INVALID_ARGUMENT", f"{what}: top_p {s.top_p}; want a value in (0, 1]")
        self._adapter(req.adapter, what)
        return Sampling(max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p or 1.0,
                        stop=[x for x in s.stop if x], seed=s.seed, constraint=s.constraint)

    def _matchers(self) -> "constrain.Matchers":
        """The constraints' matchers of the current tokenizer (constrain.py)."""
        m, tok = getattr(self, "_constraint_matchers", None), self.tokenizer
        if m is None or m.owner is not tok:  # none yet, or a Load brought another tokenizer
            m = self._constraint_matchers = constrain.Matchers(
                lambda i: tok.decode([i]), self.cfg.vocab_size, self.eos)
            m.owner = tok
        return m

    def cancel(self, request_id: str) -> None:
        with self._cv:
            self._cancels.append(request_id)
            self._cv.notify()
        if self.versions.rollout is not None:
            self.versions.rollout.cancel(request_id)

    # ---- weights versions (engines.Versions; versions.py) ----

    def _keeps_versions(self) -> bool:
        """Versions are of the full weights: a worker serving LoRA adapters (over a frozen base)
        keeps none (the host then uses rollout replicas for its policies)."""
        return self.keeps_versions and not self.bank.adapters

    def _versioned(self) -> Versions:
        if not self.keeps_versions:
            raise RequestError("UNIMPLEMENTED", "this engine keeps no weights versions")
        if self.bank.adapters:
            raise RequestError("FAILED_PRECONDITION", "a worker serving LoRA adapters keeps no "
                               "weights versions (they would be of its frozen base)")
        return self.versions

    def keep_version(self, v: int) -> dict:
        """Copies the current weights into kept version v (on the worker thread, between
        training steps); returns the GB copied and the seconds the copy took."""
        vs = self._versioned()
        return self._call(vs.keep, v)

    def drop_versions(self, below: int) -> None:
        self._versioned().drop(below)

    def submit_version(self, v: int, req: GenerateRequest, on_completion, on_error=None) -> None:
        """As submit, sampled from kept version v by the rollout model, while training goes on."""
        vs = self._versioned()
        if req.adapter:
            raise RequestError("INVALID_ARGUMENT", f"request {req.id!r}: a weights version is of the "
                               "full weights, not of an adapter")
        vs.submit(v, self.request(req, on_completion, on_error))

    def score_version(self, v: int, reqs: list[ScoreRequest]) -> list[list[float]]:
        """As score, with kept version v; requests with reference set are scored by the frozen
        reference, as in score (on the worker thread)."""
        pairs = self._pairs(reqs, "score request")
        mine = [i for i, r in enumerate(reqs) if not r.reference]
        out = self._versioned().call(v, lambda m: self._score([pairs[i] for i in mine], m))
        got: list[list[float]] = [[] for _ in reqs]
        for i, lp in zip(mine, out):
            got[i] = lp
        ref = [i for i, r in enumerate(reqs) if r.reference]
        if ref:
            for i, lp in zip(ref, self.score([reqs[i] for i in ref])):
                got[i] = lp
        return got

    def save_version(self, v: int, out_dir: str) -> None:
        """Writes kept version v as a Hugging Face folder (no optimizer state)."""
        self._versioned().call(v, lambda m: self._write(pathlib.Path(out_dir), None, m))

    def generate(self, reqs: list[GenerateRequest], timeout: float | None = None) -> list[Completion]:
        """Blocking: all completions, request by request in order, by sample index within one."""
        done = threading.Condition()
        got: dict[tuple[int, int], Completion] = {}
        errors: list[str] = []
        want = sum(r.n or 1 for r in reqs)

        for i, r in enumerate(reqs):
            def on_completion(c, i=i):
                with done:
                    got[(i, c.index)] = c
                    done.notify()

            def on_error(code, message):
                with done:
                    errors.append(message)
                    done.notify()

            self.submit(r, on_completion, on_error)
        with done:
            if not done.wait_for(lambda: errors or len(got) == want, timeout):
                raise TimeoutError("generate timed out")
        if errors:
            raise RuntimeError(errors[0])
        return [got[k] for k in sorted(got)]

    def score(self, reqs: list[ScoreRequest]) -> list[list[float]]:
        """Log-probs of each request's tokens; a request with reference set is scored by the
        frozen KL reference model instead of the current weights."""
        pairs = self._pairs(reqs, "score request")
        return self._call(self._score_split, pairs, [bool(r.reference) for r in reqs],
                          [r.adapter for r in reqs])

    def _score_split(self, pairs, reference: list[bool], names: list[str]) -> list[list[float]]:
        ads = [self._adapter(n, f"score request {i}") for i, n in enumerate(names)]
        # The reference of an adapter's request is the base without it: the model, adapter 0.
        ads = [None if r else a for r, a in zip(reference, ads)]
        full_ref = [r and not n for r, n in zip(reference, names)]
        out: list[list[float]] = [[] for _ in pairs]
        for ref in (False, True):
            idx = [i for i, r in enumerate(full_ref) if r == ref]
            if not idx:
                continue
            model = self._reference_model() if ref else self.model
            for i, lp in zip(idx, self._score([pairs[i] for i in idx], model,
                                              None if ref else [ads[i] for i in idx])):
                out[i] = lp
        return out

    def _pairs(self, reqs: list[ScoreRequest], what: str) -> list[tuple[list[int], list[int]]]:
        pairs = [(self.prompt_of(r.messages, r.prompt_tokens, f"{what} {i}"), list(r.tokens))
                 for i, r in enumerate(reqs)]
        for i, (p, t) in enumerate(pairs):
            bad = next((x for x in t if not 0 <= x < self.cfg.vocab_size), None)
            if bad is not None:
                raise RequestError("INVALID_ARGUMENT", f"{what} {i}: token {bad} outside "
                                   "the vocabulary")
            if len(p) + len(t) > self.cfg.max_seq_len:
                raise RequestError("INVALID_ARGUMENT", f"{what} {i}: {len(p) + len(t)} "
                                   f"tokens, longer than the model's {self.cfg.max_seq_len}")
        return pairs

    @torch.no_grad()
    def _score(self, pairs, model=None, adapters=None) -> list[list[float]]:
        """adapters: each pair's lora.Adapter (None: the base), all in one pass per micro-batch."""
        model = self.model if model is None else model
        out: list[list[float]] = [[] for _ in pairs]
        todo = [i for i, (_, t) in enumerate(pairs) if t]
        budget = self.trainer.micro_batch_tokens
        for mb in micro_batches([len(pairs[i][0]) + len(pairs[i][1]) for i in todo], budget):
            idx = [todo[j] for j in mb]
            sel = None
            if adapters is not None and any(adapters[i] is not None for i in idx):
                sel = self.gen._rows([adapters[i] for i in idx])
            with model.using(sel):
                lp = self._score_mb(model, [pairs[i] for i in idx])
            k = 0
            for i in idx:
                n = len(pairs[i][1])
                out[i] = lp[k:k + n]
                k += n
        return out

    def _score_mb(self, model, pairs) -> list[float]:
        """The log-probs of one micro-batch's response tokens, flattened in order."""
        if self.trainer.fused_head:
            hidden, targets = response_hidden(model, pairs)
            try:
                lp = kernels.linear_logprobs(hidden, model.head_weight, targets,
                                             use_triton=self.trainer.head_triton)[0]
            except Exception as e:
                if not self.trainer.head_triton:
                    raise
                log.warning("the Triton log-prob kernels failed, using PyTorch: %s", e)
                self.trainer.head_triton = False
                lp = kernels.linear_logprobs(hidden, model.head_weight, targets,
                                             use_triton=False)[0]
            return lp.tolist()
        logits, targets = response_logits(model, pairs)
        if batch_invariant.enabled():
            return batch_invariant.token_logprobs(logits, targets).tolist()
        logits = logits.float()
        return (logits.gather(1, targets[:, None]).squeeze(1)
                - torch.logsumexp(logits, dim=-1)).tolist()

    def values(self, reqs: list[ScoreRequest]) -> list[list[float]]:
        """A PPO critic's value of each response token: the value head on the hidden state at
        the position whose logits predict the token. The head is created (zeros) on first use
        unless the checkpoint had one (score.weight)."""
        pairs = self._pairs(reqs, "values request")
        return self._call(self._values, pairs)

    @torch.no_grad()
    def _values(self, pairs) -> list[list[float]]:
        self._ensure_value_head()
        out: list[list[float]] = [[] for _ in pairs]
        todo = [i for i, (_, t) in enumerate(pairs) if t]
        for mb in micro_batches([len(pairs[i][0]) + len(pairs[i][1]) for i in todo],
                                self.trainer.micro_batch_tokens):
            idx = [todo[j] for j in mb]
            hidden, _ = response_hidden(self.model, [pairs[i] for i in idx])
            vals = self.model.values(hidden).tolist()
            k = 0
            for i in idx:
                n = len(pairs[i][1])
                out[i] = vals[k:k + n]
                k += n
        return out

    def _ensure_value_head(self) -> None:
        if self.model.score is None:
            self.trainer.add_params(self.model.add_value_head())

    def train(self, batch: Batch) -> TrainStats:
        with self.profiler.train():
            return self._call(self._train, batch)

    def _train(self, batch: Batch) -> TrainStats:
        if batch.adapter:
            ad = self._adapter(batch.adapter, "train")
            if any(s.returns for s in batch.samples):
                raise RequestError("INVALID_ARGUMENT", f"adapter {batch.adapter!r}: a LoRA adapter "
                                   "has no value head (a PPO critic trains full weights)")
            stats = self._adapter_trainer(ad).step(batch)
            self._adapters_changed()
            return stats
        if self.bank.adapters:
            raise RequestError("FAILED_PRECONDITION", "this worker's base is frozen under its "
                               f"LoRA adapters {sorted(self.bank.adapters)}: name the adapter to train")
        if any(s.returns for s in batch.samples):
            self._ensure_value_head()
        return self._first_logged(self.trainer.step, batch)

    def _first_logged(self, step, *args) -> TrainStats:
        """step(*args); the first training step of a worker that compiles logs its time and the
        compiler caches' hits (how much of it was compiling)."""
        self._weights_change("training step")
        t = time.perf_counter()
        stats = step(*args)
        if self._first_train and self.compile_cache is not None:
            self._first_train = False
            log.info("first training step %.1f s (%s); %s", time.perf_counter() - t,
                     self.trainer.mode or "eager", compile_cache.counts_line())
        return stats

    def _adapters_changed(self) -> None:
        """After an adapter was added, removed, loaded or trained."""
        self.bank.changed()
        self._weights_change("adapters changed")

    def _weights_change(self, why: str) -> None:
        """Before the weights change: the kept prefix rows are dropped (their keys and values
        would be stale), after a log line of the prefix-reuse counters since the last change;
        the adapter table's copies of the base weights (lora.Table.fold) are copied again before
        their next use."""
        self.bank.table.base_changed()
        if not self.gen.prefix_rows:
            return
        st = self.gen.take_prefix_stats()
        dropped = self.gen.forget_prefixes()
        p, r = st["prompt_tokens"], st["reused_tokens"]
        log.info("prefix cache: %d prompts, %d with a cached prefix; %d of %d prompt tokens reused "
                 "(%.1f%%), %d prefilled; %d rows evicted; %d kept rows dropped (%s)",
                 st["prompts"], st["hits"], r, p, 100 * r / p if p else 0.0, p - r,
                 st["evicted"], dropped, why)

    def sft_step(self, pairs: list[tuple[list[int], list[int]]], loss: LossConfig) -> TrainStats:
        """A supervised step on (prompt ids, response ids) pairs (sft.py)."""
        return self._call(self._first_logged, self.trainer.sft_step, pairs, loss)

    def save(self, out_dir: str, adapter: str = "") -> None:
        """The model as a Hugging Face folder; with adapter, only that adapter as a PEFT folder
        (adapter_config.json naming the base, adapter_model.safetensors, and its AdamW state)."""
        if adapter:
            self._call(self._save_adapter, pathlib.Path(out_dir), adapter)
            return
        self._call(self._save, pathlib.Path(out_dir))

    def _save_adapter(self, out: pathlib.Path, name: str) -> None:
        self._adapter(name, "save").save(out, self._started)

    def load_adapter(self, folder: str, name: str) -> None:
        """Replaces adapter name (made if new) with the PEFT folder, which must be a LoRA of this
        base's shape; its rank, alpha and targets become the adapter's, and its AdamW state (reset
        when the folder has none) resumes."""
        self._call(self._load_adapter, pathlib.Path(folder), name)

    def _load_adapter(self, folder: pathlib.Path, name: str) -> None:
        try:
            cfg = lora.read_config(folder)
            ad = lora.Adapter(name, cfg, self.cfg, self.device, self.dtype)
            opt = lora.load_tensors(folder, ad)
        except (OSError, ValueError, KeyError) as e:
            raise RequestError("INVALID_ARGUMENT", f"load adapter {name!r} from {folder}: {e}") from None
        if opt is not None:
            tr = self._adapter_trainer(ad)
            o = tr._optimizer()
            step = int(opt.pop("__step__"))
            for (n, _), m in zip(ad.named(), tr.masters):
                if tr.mixed:  # the master copy as saved (fp32), not from the rounded weights
                    with torch.no_grad():
                        m.copy_(opt["weight." + n])
                st = torch.tensor(float(step), dtype=torch.float32,
                                  device=m.device if tr.cuda else "cpu")
                o.state[m] = {"step": st, "exp_avg": opt["exp_avg." + n].to(m.device, m.dtype),
                              "exp_avg_sq": opt["exp_avg_sq." + n].to(m.device, m.dtype)}
            tr.steps = step
        if self.trainer.steps and not self.bank.adapters:
            raise RequestError("FAILED_PRECONDITION", f"adapter {name!r}: this worker trained its "
                               "full weights; adapters need a frozen base")
        self.model.requires_grad_(False)
        old = self.bank.adapters.get(name)
        self.gen.flush()
        if old is not None:
            for s in list(self.gen.waiting) + self.gen.slots:
                if s is not None and s.req.adapter is old:
                    s.req.adapter = ad
        self.bank.adapters[name] = ad
        self._adapters_changed()

    def _save(self, out: pathlib.Path) -> None:
        self._write(out, self.trainer.state_dict())

    def _write(self, out: pathlib.Path, state: dict | None, model: Transformer | None = None) -> None:
        """Writes the model folder: config, weights, tokenizer and the optimizer state."""
        out.mkdir(parents=True, exist_ok=True)
        raw = dict(self.raw)
        raw["dtype"] = str(self.dtype).removeprefix("torch.")
        raw.pop("torch_dtype", None)
        (out / "config.json").write_text(json.dumps(raw, indent=2) + "\n")
        save_weights(self.model if model is None else model, out)
        # From memory, not from model_dir: that folder may be gone by now (a checkpoint the
        # host pruned after the engine was started or loaded from it).
        self.tokenizer.save(out)
        if state is not None:
            torch.save(state, out / OPTIMIZER_FILE)

    def load(self, model_dir: str, adapter: str = "") -> None:
        if adapter:
            self.load_adapter(model_dir, adapter)
            return
        if self.bank.adapters:
            raise RequestError("FAILED_PRECONDITION", "this worker's base is frozen under its LoRA "
                               f"adapters {sorted(self.bank.adapters)}: load an adapter by name")
        self._call(self._load, pathlib.Path(model_dir))

    def _load(self, model_dir: pathlib.Path) -> None:
        cfg, _ = read_config(model_dir)
        if cfg != self.cfg:
            # Another architecture: a new model, cache and graphs.
            self.gen.fail_all("the engine loaded another model")
            self.versions.reset("the engine loaded another model")
            self._build(model_dir)
            return
        # The same shapes: copy in place, so the captured decode graphs stay valid.
        self.gen.flush()
        self._weights_change("load")
        _, raw = read_config(model_dir)
        with torch.no_grad():
            load_weights(self.model, model_dir)
        self.model_dir, self.raw = model_dir, raw
        self.tokenizer = self.gen.tokenizer = Tokenizer(model_dir)
        self.eos = _eos(raw, self.tokenizer)
        self.gen.eos = set(self.eos)
        if self.versions.rollout is not None:
            self.versions.rollout.gen.tokenizer = self.tokenizer
            self.versions.rollout.gen.eos = set(self.eos)
        # The same trainer, started over from the loaded weights (a sharded one's build, FSDP's
        # wrapping of a second fp32 copy, took seconds of a restarted worker group's return).
        self.trainer.reset()
        self._load_optimizer(model_dir)

    # ---- pushing weights through a process group (push.py) ----

    def join_push(self, name: str, init_method: str, rank: int, world: int,
                  timeout_s: float) -> list[str]:
        """Joins push group name as rank of world (every member is called at once); returns how
        this member reaches each rank. The same name again is the same group (a resent call); a
        new name leaves the old group first."""
        if not self.pushes_weights:
            raise RequestError("FAILED_PRECONDITION", "this worker cannot join a push group (a "
                               "worker group of several ranks, or started with --no-push): "
                               "push its weights through a folder (Save, Load)")
        with self._push_lock:
            g = self._push_group
            if g is not None and g.name == name:
                return g.links
            if g is not None:
                g.close()
                self._push_group = None
            from .push import Group
            try:
                self._push_group = Group(name, init_method, rank, world, timeout_s, self.device)
            except Exception as e:
                raise RequestError("UNKNOWN",
                                   f"joining push group {name!r} at {init_method} as rank {rank} "
                                   f"of {world}: {e}") from None
            return self._push_group.links

    def push_weights(self, name: str, peer: int, version: int) -> dict:
        """Rank 0 sends its weights to rank peer of push group name; rank peer takes them into its
        parameters in place (between decode steps: the host pushes only into a replica that
        holds no version still needed, so none of its requests runs)."""
        g = self._push_group
        if g is None or g.name != name:
            raise RequestError("FAILED_PRECONDITION", f"push group {name!r}: this worker is not in "
                               f"it (it is in {g.name if g else 'none'}; a worker that restarted "
                               "has left its group)")
        if g.rank == 0:
            out = self._call(self._push_send, g, peer)
        elif g.rank != peer:
            raise RequestError("INVALID_ARGUMENT", f"push group {name!r}: a push to rank {peer} "
                               f"reached rank {g.rank}")
        else:
            out = self._call(self._push_receive, g)
        out["received"] = g.rank != 0
        gb = out["bytes"] / 1e9
        log.info("weights version %d %s rank %d of push group %s by broadcast (%s): %.6g GB in "
                 "%.6f s (%.6f s/GB)", version, "sent to" if g.rank == 0 else "received as",
                 peer, name, out["link"], gb, out["seconds"], out["seconds"] / max(gb, 1e-12))
        return out

    def _push_send(self, g, peer: int) -> dict:
        refuse = ""
        if self.bank.adapters:
            refuse = (f"this worker's base is frozen under its LoRA adapters "
                      f"{sorted(self.bank.adapters)}: push them through a folder")
        try:
            return g.send(self.model, peer, refuse)
        except ValueError as e:
            raise RequestError("FAILED_PRECONDITION", str(e)) from None

    def _push_receive(self, g) -> dict:
        self.gen.flush()
        self._weights_change("push")
        try:
            return g.receive(self.model)
        except ValueError as e:
            raise RequestError("FAILED_PRECONDITION", str(e)) from None

    def close(self) -> None:
        with self._push_lock:
            if self._push_group is not None:
                self._push_group.close()
                self._push_group = None
        self.versions.close()
        with self._cv:
            self._closed = True
            self._cv.notify()
        self._thread.join(timeout=30)


__all__ = ["Engine", "Options", "ModelConfig"]
