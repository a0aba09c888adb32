"""e2e_determinism.py, the verdict of e2e_determinism.sh (its three runs take minutes; the
command is in docs/torch.md): equal runs pass with their timings differing; a difference in any
other field, a missing step, no kill, no restart or weights that never moved fail."""

import json
import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

import e2e_determinism  # noqa: E402


def write_runs(out: pathlib.Path, steps: int = 3, grad: float = 0.5):
    for n, slow in (("a", 1.0), ("b", 2.0), ("killed", 3.0)):
        d = out / n
        d.mkdir(parents=True)
        lines = []
        for s in range(1, steps + 1):
            for p in ("critic", "generator"):
                lines.append(json.dumps({"step": s, "policy": p, "loss": 0.125 * s,
                                         "grad_norm": grad, "train_s": slow * s,
                                         "engine_busy": slow / 7}))
            lines.append(json.dumps({"step": s, "policy": "_run", "step_s": slow, "tokens": 48}))
        (d / "metrics.jsonl").write_text("\n".join(lines) + "\n")
        (d / "rc").write_text("0\n")
        (d / "events.log").write_text("")
    (out / "killed" / "killed").write_text("step 1: SIGKILLed worker pid 7\n")
    (out / "killed" / "events.log").write_text(
        'policy "generator": its torch worker restarted as a new process; the run goes on\n')


def test_equal_runs_pass_timings_aside(tmp_path):
    write_runs(tmp_path)
    text, ok = e2e_determinism.verdict(tmp_path, 3)
    assert ok, text
    assert "| a vs b | 9 / 9 | 0 | - | yes |" in text and "IDENTICAL" in text


def test_a_last_digit_fails(tmp_path):
    write_runs(tmp_path)
    p = tmp_path / "killed" / "metrics.jsonl"
    p.write_text(p.read_text().replace('"loss": 0.375', '"loss": 0.37500000000000006', 1))
    text, ok = e2e_determinism.verdict(tmp_path, 3)
    assert not ok and "verdict: NOT identical" in text
    assert "| a vs killed | 9 / 9 | 1 | step 3 critic: loss 0.375 vs 0.37500000000000006 | NO |" in text


def test_missing_step_kill_restart_or_gradient_fail(tmp_path):
    write_runs(tmp_path / "short")
    p = tmp_path / "short" / "b" / "metrics.jsonl"
    p.write_text("\n".join(p.read_text().splitlines()[:6]) + "\n")
    assert not e2e_determinism.verdict(tmp_path / "short", 3)[1]
    write_runs(tmp_path / "nokill")
    (tmp_path / "nokill" / "killed" / "killed").unlink()
    assert not e2e_determinism.verdict(tmp_path / "nokill", 3)[1]
    write_runs(tmp_path / "norestart")
    (tmp_path / "norestart" / "killed" / "events.log").write_text("")
    assert not e2e_determinism.verdict(tmp_path / "norestart", 3)[1]
    write_runs(tmp_path / "still", grad=0.0)
    text, ok = e2e_determinism.verdict(tmp_path / "still", 3)
    assert not ok and "too few" in text
    assert "verdict: INCONCLUSIVE: equal, but the weights hardly moved" in text
