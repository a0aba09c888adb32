"""The W&B sidecar (slimen_torch/wandb_sidecar.py): its protocol against a stand-in for the SDK,
and one real offline run read back from the .wandb file it wrote."""

import io
import json
import math
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

from slimen_torch import wandb_sidecar

REPO = pathlib.Path(__file__).resolve().parents[3]
SIDECAR = pathlib.Path(wandb_sidecar.__file__)
READER = REPO / "host" / "wandb" / "testdata" / "read_wandb.py"


class FakeRun:
    def __init__(self, kwargs):
        self.kwargs = kwargs
        self.id, self.name, self.dir, self.url, self.step = "abc123", kwargs.get("name"), "/d", "", 0
        self.settings = type("S", (), {"mode": kwargs.get("mode", "online")})()
        self.logged = []
        self.exit_code = None

    def log(self, data, step):
        self.logged.append((step, data))

    def finish(self, exit_code):
        self.exit_code = exit_code


class FakeWandb:
    """The parts of the wandb module the sidecar calls, recording what it was given."""

    def __init__(self):
        self.run = None

    def init(self, config, settings, **kwargs):
        self.run = FakeRun(dict(kwargs, config=config))
        return self.run

    def Settings(self, **kw):  # noqa: N802 - the SDK's name
        return kw

    def Histogram(self, values, num_bins):  # noqa: N802
        return ("hist", list(values), num_bins)

    def Table(self, columns, data):  # noqa: N802
        return ("table", columns, data)


def drive(*msgs):
    fake, out = FakeWandb(), io.StringIO()
    lines = [m if isinstance(m, str) else json.dumps(m) for m in msgs]
    status = wandb_sidecar.serve(iter(lines), fake, out)
    replies = [json.loads(x) for x in out.getvalue().splitlines()]
    return fake, replies, status


def test_protocol():
    fake, replies, status = drive(
        {"type": "init", "project": "p", "name": "n", "mode": "offline", "entity": "",
         "config": {"run": {"steps": 3}}},
        {"type": "log", "step": 1, "scalars": {"a/x": 1.5, "a/y": "NaN", "a/z": "-Infinity"},
         "histograms": {"a/reward": [0.5, "NaN", 1]}},
        "not json",
        {"type": "log", "step": 2, "tables": {"rollouts": {"columns": ["step", "policy"],
                                                          "rows": [[2, "a"]]}}},
        {"type": "log", "step": 1, "scalars": {"a/x": 2}},  # behind the last step: dropped
        {"type": "log", "step": 2, "scalars": {"a/x": 2}},  # the same step: the same row
        {"type": "log", "step": 3},  # nothing to log
        {"type": "finish", "exit_code": 0},
        {"type": "log", "step": 4, "scalars": {"a/x": 3}},  # after finish: never read
    )
    run = fake.run
    assert status == 0
    assert replies == [{"type": "ready", "id": "abc123", "name": "n", "url": "", "dir": "/d",
                        "mode": "offline"}, {"type": "finished"}]
    # Empty fields are the SDK's to fill from the environment (WANDB_ENTITY …).
    assert run.kwargs == {"project": "p", "name": "n", "mode": "offline",
                          "config": {"run": {"steps": 3}}}
    (s1, d1), (s2, d2), (s3, d3) = run.logged
    assert s1 == 1 and d1["a/x"] == 1.5 and math.isnan(d1["a/y"]) and d1["a/z"] == -math.inf
    assert d1["a/reward"] == ("hist", [0.5, 1.0], wandb_sidecar.HISTOGRAM_BINS)
    assert (s2, d2) == (2, {"rollouts": ("table", ["step", "policy"], [[2, "a"]])})
    assert (s3, d3) == (2, {"a/x": 2.0})
    assert run.exit_code == 0


def test_resumed_run_drops_the_steps_it_holds(capsys):
    fake = FakeWandb()
    init = fake.init

    def resumed(**kw):
        run = init(**kw)
        run.step = 5  # the W&B run logged steps up to 4 before the resume
        return run

    fake.init = resumed
    lines = [json.dumps(m) for m in (
        {"type": "init", "project": "p", "id": "r1"},
        {"type": "log", "step": 3, "scalars": {"a/x": 3}},
        {"type": "log", "step": 4, "scalars": {"a/x": 4}},
        {"type": "log", "step": 5, "scalars": {"a/x": 5}},
        {"type": "log", "step": 6, "scalars": {"a/x": 6}},
        {"type": "finish"})]
    assert wandb_sidecar.serve(iter(lines), fake, io.StringIO()) == 0
    assert [s for s, _ in fake.run.logged] == [5, 6]
    err = capsys.readouterr().err
    assert err.count("is not logged") == 1 and "at step 5" in err


def test_resume_id_and_end_of_input():
    fake, replies, status = drive({"type": "init", "project": "p", "id": "r1"},
                                  {"type": "log", "step": 1, "scalars": {"a/x": 1}})
    assert fake.run.kwargs["id"] == "r1" and fake.run.kwargs["resume"] == "allow"
    # stdin ended with no finish: the host went away, and the run is marked failed.
    assert status == 1 and fake.run.exit_code == 1
    assert [r["type"] for r in replies] == ["ready"]


def test_bad_scalar_loses_the_message_only(capsys):
    fake, _, _ = drive({"type": "init", "project": "p"},
                       {"type": "log", "step": 1, "scalars": {"a/x": "many"}},
                       {"type": "log", "step": 2, "scalars": {"a/x": 2}},
                       {"type": "finish"})
    assert fake.run.logged == [(2, {"a/x": 2.0})]
    assert "'many' is not a number" in capsys.readouterr().err


def sidecar(tmp_path, *msgs, python_args=()):
    """Runs the sidecar as host/wandb does: the file alone in a folder (next to slimen_torch's
    other modules, its types.py would stand in for the standard library's)."""
    script = tmp_path / "bin" / "slimen_wandb_sidecar.py"
    script.parent.mkdir()
    shutil.copy(SIDECAR, script)
    env = dict(os.environ, WANDB_DIR=str(tmp_path), WANDB_SILENT="true")
    env.pop("WANDB_MODE", None)
    p = subprocess.run([sys.executable, *python_args, str(script)],
                       input="".join(json.dumps(m) + "\n" for m in msgs),
                       capture_output=True, text=True, env=env, timeout=120)
    return p, [json.loads(x) for x in p.stdout.splitlines()]


def test_offline_run_read_back(tmp_path):
    pytest.importorskip("wandb")
    p, replies = sidecar(
        tmp_path,
        {"type": "init", "project": "t", "name": "side", "mode": "offline",
         "config": {"run": {"steps": 2}}},
        {"type": "log", "step": 1, "scalars": {"a/reward_mean": 0.25},
         "histograms": {"a/reward": [0, 0.5, 1]},
         "tables": {"rollouts": {"columns": ["step", "policy", "response", "reward"],
                                 "rows": [[1, "a", "42", 1.0]]}}},
        {"type": "log", "step": 2, "scalars": {"a/reward_mean": 0.75}},
        {"type": "finish", "exit_code": 0})
    assert p.returncode == 0, p.stderr
    assert [r["type"] for r in replies] == ["ready", "finished"], p.stdout
    assert replies[0]["mode"] == "offline" and replies[0]["name"] == "side"
    got = json.loads(subprocess.run([sys.executable, str(READER), str(tmp_path)], check=True,
                                    capture_output=True, text=True).stdout)
    assert got["run"]["project"] == "t" and got["run"]["id"] == replies[0]["id"]
    assert got["config"]["run"] == {"steps": 2}
    rows = {r["_step"]: r for r in got["history"]}
    assert rows[1]["a/reward_mean"] == 0.25 and rows[2]["a/reward_mean"] == 0.75
    assert rows[1]["a/reward/_type"] == "histogram"
    table = got["tables"][rows[1]["rollouts/path"]]
    assert table == {"columns": ["step", "policy", "response", "reward"],
                     "data": [[1, "a", "42", 1.0]]}
    assert got["exit_code"] == 0


def test_missing_wandb(tmp_path):
    # -S leaves site-packages out, as an environment without the SDK would be.
    p, replies = sidecar(tmp_path, {"type": "init", "project": "t"}, python_args=("-S",))
    assert p.returncode == 3
    assert replies[0]["type"] == "error" and replies[0]["missing"] == "wandb"
