"""The verdict of e2e_determinism.sh: its three runs' metrics.jsonl, timings aside, compared.

    python engines/torch/e2e_determinism.py OUT STEPS

OUT holds a/, b/ (two uninterrupted runs with the same seed) and killed/ (the run whose worker
was SIGKILLed), each with metrics.jsonl, events.log, rc and (killed/) the kill's line. Prints a
markdown table: each pair, its metric lines, how many differ and the first difference; then
whether the kill happened and the host restarted the worker, and how many policy-steps after step
1 had a gradient (equal metrics of weights that never moved would show nothing). Exits 1 unless
every run finished, the three agree byte for byte and the kill and restart happened.
"""

from __future__ import annotations

import json
import pathlib
import sys

# host.TimingFields (host/metrics.go): wall time and the machine's state, which differ between
# equal runs; everything else on a line must be equal.
TIMING_FIELDS = ("rollout_s", "train_s", "step_s", "tokens_per_s", "gpu_mem_gib", "gpu_used_gib",
                 "gpu_util", "engine_busy", "rollout_wall_s")


def untimed(path: pathlib.Path) -> list[str]:
    """The lines of metrics.jsonl without TIMING_FIELDS, each as canonical JSON text (the values
    as the host wrote them: a float that differs in its last digit differs here)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        if not line.strip():
            continue
        m = json.loads(line)
        for k in TIMING_FIELDS:
            m.pop(k, None)
        out.append(json.dumps(m, sort_keys=True))
    return out


def first_diff(a: list[str], b: list[str]) -> str:
    if len(a) != len(b):
        return f"{len(a)} lines vs {len(b)}"
    for la, lb in zip(a, b):
        if la == lb:
            continue
        ma, mb = json.loads(la), json.loads(lb)
        for k in sorted(set(ma) | set(mb)):
            if ma.get(k) != mb.get(k):
                return f"step {ma.get('step')} {ma.get('policy')}: {k} {ma.get(k)!r} vs {mb.get(k)!r}"
    return ""


def verdict(out: pathlib.Path, steps: int) -> tuple[str, bool]:
    runs = {n: untimed(out / n / "metrics.jsonl") for n in ("a", "b", "killed")}
    rcs = {n: (out / n / "rc").read_text().strip() if (out / n / "rc").exists() else "?"
           for n in runs}
    lines = ["| runs | metric lines | lines that differ | first difference | identical |",
             "|---|---|---|---|---|"]
    same_all = True
    for x, y in (("a", "b"), ("a", "killed")):
        a, b = runs[x], runs[y]
        # A run cut short (EXEC_TIMEOUT) is compared over the lines both have; the verdict then
        # says it did not finish.
        n = min(len(a), len(b))
        nd = sum(la != lb for la, lb in zip(a, b))
        same = n > 0 and a[:n] == b[:n]
        same_all = same_all and same
        lines.append(f"| {x} vs {y} | {len(a)} / {len(b)} | {nd} | "
                     f"{first_diff(a[:n], b[:n]) or '-'} | {'yes' if same else 'NO'} |")
    done = {n: max([json.loads(l).get("step", 0) for l in r] or [0]) for n, r in runs.items()}
    lines.append("")
    lines.append("exit codes: " + ", ".join(f"{n} {rcs[n]}" for n in runs) +
                 "; last step: " + ", ".join(f"{n} {done[n]}" for n in runs) +
                 f" (of {steps})")
    finished = all(rcs[n] == "0" and done[n] == steps for n in runs)
    killed = (out / "killed" / "killed")
    events = (out / "killed" / "events.log")
    ev = events.read_text() if events.exists() else ""
    restarted = "restarted as a new process" in ev
    lines.append(f"kill: {killed.read_text().strip() if killed.exists() else 'none'}; "
                 f"the host restarted the worker: {'yes' if restarted else 'no'}")
    kill_ok = killed.exists() and restarted
    moved = sum(1 for l in runs["a"]
                if (m := json.loads(l)).get("step", 0) > 1 and (m.get("grad_norm") or 0) > 0)
    lines.append(f"policy-steps after step 1 with a gradient: {moved}"
                 + ("" if moved >= 3 else " (too few: equal metrics say little about the weights)"))
    ok = same_all and finished and kill_ok and moved >= 3
    if ok:
        v = "IDENTICAL (timings aside)"
    elif not same_all:
        v = "NOT identical"
    else:
        v = "INCONCLUSIVE: equal, but " + "; ".join(
            w for c, w in ((finished, "a run did not finish (compared over the lines all have)"),
                           (kill_ok, "no kill or no restart"),
                           (moved >= 3, "the weights hardly moved")) if not c)
    lines.append("")
    lines.append("verdict: " + v)
    return "\n".join(lines), ok


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 2:
        print(__doc__.split("\n\n")[1].strip(), file=sys.stderr)
        return 2
    text, ok = verdict(pathlib.Path(argv[0]), int(argv[1]))
    print(text)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
