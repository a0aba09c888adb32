"""bench_lora.py's diff section (the decode step, variant against variant) runs on the CPU: the
Fused path under Triton's interpreter, every variant measured without error, the one model's
variants run without the adapters and the others with them, and its table has a row for each."""

import json
import pathlib
import sys
import types

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import bench_lora  # noqa: E402


def test_the_diff_section_runs_every_variant(model_dirs, tmp_path):
    # Two rows: two adapters in one step (each interpreted step's kernels cost by rows).
    a = types.SimpleNamespace(device="cpu", shape="tiny", rank=8, rows=2, slots=2, max_len=64,
                              pos=20, steps=1, out=str(tmp_path), variants="")
    res = bench_lora.sec_diff(a, model_dirs["tiny"])
    # (written as each variant ends: what a run cut short measured)
    partial = json.loads((tmp_path / "bench_lora_diff.json").read_text())
    assert partial["variants"] == res["variants"]
    vs = res["variants"]
    assert list(vs) == [v[0] for v in bench_lora._diff_variants(None, None)]
    for name, v in vs.items():
        assert "error" not in v, (name, v.get("traceback"))
        assert v["us"] > 0 and v["ops"] > 0 and not v["compile_error"], name
        assert v["mode"] == (None if name.startswith("one_model") else "table"), name
    assert res["rows"] == 2 and res["pos"] == 20 and res["table"]["folded"]
    # The adapters' step runs more operations than the one model's (the fused expand, under
    # Triton's interpreter); the table selected over the layers' own weights adds nothing but
    # the selection.
    assert vs["lora"]["ops"] > vs["one_model"]["ops"]
    assert vs["lora_expand_only"]["ops"] > vs["lora_base_copy"]["ops"]
    assert vs["lora_own_weights"]["ops"] - vs["one_model"]["ops"] < 4
    md = bench_lora.table({"diff": res}, a)
    rows = [line for line in md.splitlines() if line.startswith("| lora") or
            line.startswith("| one_model")]
    assert len(rows) == len(vs)


def test_the_diff_section_runs_the_variants_asked_for(model_dirs):
    a = types.SimpleNamespace(device="cpu", shape="tiny", rank=8, rows=2, slots=2, max_len=64,
                              pos=8, steps=1, variants="lora,one_model")
    res = bench_lora.sec_diff(a, model_dirs["tiny"])
    assert list(res["variants"]) == ["one_model", "lora"]


def test_the_steps_section_times_each_step_and_prefill(model_dirs):
    # The generation as gen runs it, each decode step and prefill timed (the host's clock on the
    # CPU): every row's tokens are steps of one (rows, length) shape here, and the engine's
    # methods are its own again after the run.
    a = types.SimpleNamespace(device="cpu", shape="tiny", rank=8, rows=4, slots=4, max_len=256,
                              new=3, seed=0)
    res = bench_lora.sec_steps(a, model_dirs["tiny"])
    for k in ("one_model", "eight_adapters"):
        r = res[k]
        assert r["wall_s"] > 0 and r["first_to_last_ms"] > 0
        # 3 new tokens a row: the first from the prefill, then 2 decode steps of all 4 rows
        assert sum(len(v) for v in r["steps"].values()) == 2, r["steps"]
        assert list(r["steps"]) == ["4x192"]
        assert sum(n for n, _ in r["prefills"]) == 4
    md = bench_lora.table({"steps": res}, a)
    assert "| one_model |" in md and "| eight_adapters |" in md
