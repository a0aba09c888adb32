"""SLIMEN_TORCH_PROFILE: the window of training call K (rollouts since call K-1 and the call)
profiled into a table and a trace, on the CPU."""

import gzip
import json

import pytest

from slimen_torch import profiling
from slimen_torch.engine import Engine
from slimen_torch.types import GenerateRequest, LossConfig, Sampling

from test_train import fixed_batch


def test_parse():
    assert profiling.parse("") is None
    assert profiling.parse("/tmp/p") == (profiling.pathlib.Path("/tmp/p"), 3)
    assert profiling.parse("/tmp/p:5") == (profiling.pathlib.Path("/tmp/p"), 5)
    assert profiling.parse("C:/p") == (profiling.pathlib.Path("C:/p"), 3)
    with pytest.raises(ValueError, match="at least 2"):
        profiling.parse("/tmp/p:1")


def test_the_window_of_step_k(model_dirs, tmp_path, monkeypatch):
    monkeypatch.setenv(profiling.ENV, f"{tmp_path}:2")
    monkeypatch.setenv("RANK", "1")
    e = Engine(str(model_dirs["tiny-qwen3"]))
    try:
        batch = fixed_batch(e, LossConfig(lr=1e-3))
        e.train(batch)
        assert not list(tmp_path.iterdir())  # call 1 only opens the window
        e.generate([GenerateRequest(id="r", prompt_tokens=[1, 2, 3],
                                    sampling=Sampling(max_tokens=4, seed=1))])
        e.train(batch)
        text = (tmp_path / "rank1-step2.txt").read_text()
        assert text.startswith("rank 1, step 2: window ")
        assert "slimen.train" in text
        with gzip.open(tmp_path / "rank1-step2.json.gz") as f:
            names = {ev.get("name") for ev in json.load(f)["traceEvents"]}
        assert "slimen.train" in names
        assert not (tmp_path / "rank1-step2.json").exists()
        e.train(batch)  # past K: nothing more
        assert sorted(p.name for p in tmp_path.iterdir()) == ["rank1-step2.json.gz",
                                                             "rank1-step2.txt"]
    finally:
        e.close()
