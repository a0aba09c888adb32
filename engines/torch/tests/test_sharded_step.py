"""The host's work of a sharded step (dist.ShardedTrainer) in the parts that grow with the
parameter count: the gradient norm and the clip are a few multi-tensor operations on the local
shards, not a loop over every parameter's DTensor; FSDP does not cast the layers' inputs. One
gloo rank in a process of its own (the test's process keeps no process group), against the
one-rank Trainer's step on the same batch."""

import os
import pickle
import socket

import pytest
import torch

import ranks
from slimen_torch.profiling import OpCount
from slimen_torch.types import Batch, LossConfig, Sample

LAYERS = 4


def model(dtype=torch.float32):
    from slimen_torch.config import parse_config
    from slimen_torch.make_model import config_dict
    from slimen_torch.model import Transformer

    raw = config_dict("tiny-qwen3", 64, 2, 0, "float32")
    raw["num_hidden_layers"] = LAYERS
    m = Transformer(parse_config(raw), dtype=torch.float32)
    m.init_weights(torch.Generator().manual_seed(1))
    return m.to(dtype).eval()


def batch(max_grad_norm: float) -> Batch:
    g = torch.Generator().manual_seed(2)
    samples = []
    for i in range(4):
        p = torch.randint(0, 64, (4 + i,), generator=g).tolist()
        r = torch.randint(0, 64, (6 + i,), generator=g).tolist()
        samples.append(Sample(p, r, [1.0] * len(r), [-4.0] * len(r),
                              [1.0 if i % 2 else -1.0] * len(r)))
    return Batch(samples=samples, loss=LossConfig(lr=1e-3, max_grad_norm=max_grad_norm))


def _rank(rank, port, local_opt, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0",
                      WORLD_SIZE="1")
    if local_opt:
        os.environ["SLIMEN_TORCH_FSDP_LOCAL_OPT"] = "1"
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo")
    from slimen_torch import dist
    from slimen_torch.train import Trainer

    tr = dist.ShardedTrainer(model(), micro_batch_tokens=64)
    ops = {}

    def counted(name):
        fn = getattr(tr, name)

        def run(*a):
            with OpCount() as c:
                r = fn(*a)
            ops[name] = c.n
            return r
        setattr(tr, name, run)

    counted("_grad_norm")
    counted("_clip")
    b = batch(1e-3)  # far below the norm: the clip scales every gradient
    got = tr.step(b)
    one = Trainer(model(), micro_batch_tokens=64)
    want = one.step(b)
    weights = [(p.full_tensor(), q) for p, q in zip(tr.model.parameters(), one.model.parameters())]
    torch.distributed.destroy_process_group()
    with open(out, "wb") as f:
        pickle.dump({"ops": ops, "got": got, "want": want, "params": len(tr.params),
                     "diff": max((a - b).abs().max().item() for a, b in weights)}, f)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("local_opt", [False, True])
def test_norm_and_clip_are_multi_tensor_on_the_shards(tmp_path, local_opt):
    out = str(tmp_path / "r.pkl")
    ranks.start_processes(_rank, (free_port(), local_opt, out), 1)
    with open(out, "rb") as f:
        r = pickle.load(f)
    got, want = r["got"], r["want"]
    assert not got.skipped and not want.skipped
    assert got.grad_norm == pytest.approx(want.grad_norm, rel=1e-5)
    assert got.loss == pytest.approx(want.loss, rel=1e-6)
    assert r["diff"] < 1e-6  # the clipped step moved the weights as one rank's did
    # A fixed handful of operations (the norms, their squares' sum, the all-reduce; the
    # product), whatever the parameter count (a loop did four or more a parameter).
    assert r["params"] > 8 * LAYERS, r
    if local_opt:  # the clip is the fused AdamW's, scaled on the device before it (Trainer)
        assert r["ops"] == {"_grad_norm": pytest.approx(8, abs=4)}
    else:
        assert r["ops"]["_grad_norm"] <= 12 and r["ops"]["_clip"] <= 4, r["ops"]


def _rank_bf16(rank, port, out):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK="0", LOCAL_RANK="0",
                      WORLD_SIZE="1")
    torch.set_num_threads(1)
    torch.distributed.init_process_group("gloo")
    from slimen_torch import dist, model as M
    from slimen_torch.train import Trainer

    seen = []
    real = M.Block.forward

    def forward(self, x, cos, sin, **kw):
        seen.append((x.dtype, cos.dtype, sin.dtype))
        return real(self, x, cos, sin, **kw)
    M.Block.forward = forward
    got = dist.ShardedTrainer(model(torch.bfloat16), micro_batch_tokens=64).step(batch(0.0))
    torch.distributed.destroy_process_group()
    want = Trainer(model(torch.bfloat16), micro_batch_tokens=64).step(batch(0.0))
    with open(out, "wb") as f:
        pickle.dump({"seen": seen, "got": got, "want": want}, f)


def test_layers_take_their_inputs_uncast(tmp_path):
    """bf16 passes: each layer gets the bf16 hidden states and the fp32 rope tables, as on one
    rank (which casts the tables where it applies them): FSDP's cast of the inputs, a walk of
    each layer call's arguments and two casts, is off; the step's numbers are one rank's."""
    out = str(tmp_path / "r.pkl")
    ranks.start_processes(_rank_bf16, (free_port(), out), 1)
    with open(out, "rb") as f:
        r = pickle.load(f)
    assert len(r["seen"]) >= LAYERS
    assert set(r["seen"]) == {(torch.bfloat16, torch.float32, torch.float32)}
    assert r["got"].loss == pytest.approx(r["want"].loss, rel=1e-6)
    assert r["got"].grad_norm == pytest.approx(r["want"].grad_norm, rel=1e-3)
