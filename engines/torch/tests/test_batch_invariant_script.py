"""determinism.py (the GPU check of issue 38) runs on the CPU with tiny shapes: both modes, the
deterministic mode's identities hold (--check), and its table and JSON say so."""

import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import bench_det_train  # noqa: E402
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


def test_the_training_pieces_bench_small(capsys):
    # bench_det_train.py's dry run (tiny shapes under Triton's interpreter): both tables, a row
    # for each setting of the attention's switches and each layer form and micro-batch.
    # The second form's rows (ATTN_BWD "triton2") after the first's, one more block each; every
    # row's gradients repeat bit for bit and are the first row's to fp16's rounding.
    assert bench_det_train.main(["--small", "--device", "cpu", "--dq", "16,16,4,1",
                                 "--dkdv2", "32,16,4,1"]) == 0
    out = capsys.readouterr().out
    att = [line for line in out.splitlines() if line.startswith("| lse ")]
    assert len(att) == 5 and any("recomputed, full blocks off" in line for line in att)
    att2 = [line for line in out.splitlines() if line.startswith("| triton2: lse ")]
    assert len(att2) == 3 and any("dK/dV2 32,16,4,1" in line for line in att2)
    for line in att + att2:
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[4] == "yes" and float(cells[5]) < 1e-2, line
    lay = [line for line in out.splitlines() if line.startswith("| one node") or
           line.startswith("| a node")]
    assert len(lay) == 4
    from slimen_torch import batch_invariant as bi
    assert bi.LAYER_FN and bi.ATTN_LSE and bi.ATTN_BWD_FULL_BLOCKS  # the switches as they were
    assert not bi.FORCE_TRITON and bi.ATTN_BWD_DQ == (128, 32, 8, 3)
    assert bi.ATTN_BWD == "triton2" and bi.ATTN_BWD2_DKDV == (32, 128, 8, 3)
