"""determinism.py (the GPU check of issue 38) runs on the CPU with tiny shapes: both modes, the
deterministic mode's identities hold (--check), and its table and JSON say so."""

import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import determinism  # noqa: E402


def test_determinism_script_small(tmp_path, capsys):
    rc = determinism.main(["--device", "cpu", "--small", "--check", "--out", str(tmp_path),
                           "--batch", "4", "--new", "4", "--check-new", "4", "--train-len", "32"])
    out = capsys.readouterr().out
    assert rc == 0, out
    got = json.loads((tmp_path / "determinism.json").read_text())
    default, det = got["modes"]
    assert det["mode"] == "deterministic" and det["batch_invariant"] and det["repeatable"]
    for k in ("base", "lora", "prefix"):
        assert det[k]["score"] == det[k]["train"] == 0.0
    assert det["prefix_hits"] >= 1
    # The default mode computes the same numbers to rounding only (fp32 on the CPU).
    assert default["base"]["score"] < 1e-4
    assert det["decode_tok_s"] > 0 and det["train_tok_s"] > 0
    row = next(line for line in out.splitlines() if line.startswith("| deterministic |"))
    assert row.startswith("| deterministic | 0 | 0 | 0 | 0 (") and "| yes | yes |" in row
    assert "deterministic / default: decode" in out
