"""What the GPU measurement scripts' tables share (multi_gpu.sh, swarm_gpu.sh; engines/torch/lib.sh
writes what this reads): each part's outcome, a run's metrics and events, the placement
`slimen gpus --config` printed, and where nvidia-smi saw the run's workers while it ran."""

import json
import math
import pathlib
import re
import struct
import time

WORKER_TAIL_CHARS = 1200  # of the workers' last lines in a failed run's table cell

# The milestones of a killed rank's group on its way back into the run (Work.restart), in order:
# where the line is (the host's output, NAME.log, each line stamped with its epoch time by
# lib.sh's stamp; or a worker's own log line in the run's events.log, in its local time to the
# ms), what it says, and the milestone's name in the table.
RESTART_MILESTONES = [
    ("worker", r"slimen_torch (INFO rank [\d, ]+ gone: exiting at once|INFO the other ranks have "
               r"stopped; exiting|ERROR rank \d+: )",
     "rank 0 exits (group down)"),
    # torchrun restarts its group itself (its --max-restarts): these two only when it gave up, or
    # for a launcher without restarts of its own.
    ("host", r"the torch worker \(pid \d+\) exited", "torchrun exited"),
    ("host", r"the torch worker is started again", "the host starts torchrun again"),
    ("worker", r"slimen_torch INFO serve: process \d+ began",
     "a rank's process began (torchrun up)"),
    ("worker", r"slimen_torch INFO listening on ", "rank 0 listens (its imports done)"),
    ("worker", r"slimen_torch INFO rank \d+ of \d+ ", "the ranks met (process group)"),
    ("worker", r"slimen_torch INFO serving ", "worker ready (model, trainer built)"),
    ("host", r"restarted as a new process", "back in the run (checkpoint loaded)"),
]
_WORKER_TIME = re.compile(r"worker: (\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) ")


def mean(xs):
    xs = list(xs)
    return sum(xs) / len(xs) if xs else float("nan")


def params(model: pathlib.Path) -> int:
    """Every parameter in a model folder's safetensors (from the headers)."""
    n = 0
    for f in model.glob("*.safetensors"):
        with open(f, "rb") as fh:
            h = json.loads(fh.read(struct.unpack("<Q", fh.read(8))[0]))
        n += sum(math.prod(v["shape"]) for k, v in h.items() if k != "__metadata__")
    return n


def steady(lines: list, warmup: int) -> list:
    """The metrics lines of the steps after the first `warmup` (compilation, CUDA graphs, the
    allocator growing), or the last one when the run had no more."""
    return [m for m in lines if m["step"] > warmup] or lines[-1:]


def steps_label(lines: list) -> str:
    s = sorted({m["step"] for m in lines})
    if not s:
        return "no steps"
    return f"step {s[0]}" if len(s) == 1 else f"steps {s[0]}–{s[-1]} mean"


def table(rows) -> str:
    return "| measure | value |\n|---|---|\n" + "".join(f"| {k} | {v} |\n" for k, v in rows)


class Work:
    """A script's WORK folder."""

    def __init__(self, path):
        self.path = pathlib.Path(path)

    def log(self, name: str) -> str:
        p = self.path / f"{name}.log"
        return p.read_text(errors="replace") if p.exists() else ""

    def status(self, name: str) -> str:
        """"" when part NAME succeeded, else what happened to it, with its log's last lines and,
        for a run, its torch workers' (worker_tail)."""
        p = self.path / "status" / name
        if not p.exists():
            return "not run"
        rc, t, _took = p.read_text().split()
        if rc == "0":
            return ""
        if rc == "skipped":
            return "skipped: the budget was spent"
        tail = " / ".join(l.strip() for l in self.log(name).splitlines()[-3:])
        tail = tail.replace("|", "\\|")[:400]
        worker = " / ".join(self.worker_tail(name)).replace("|", "\\|")[-WORKER_TAIL_CHARS:]
        worker = f"; the torch workers' last lines (events.log): {worker}" if worker else ""
        if rc in ("124", "137"):
            return f"**timed out** after {t} s; last lines: {tail}{worker}"
        return f"**failed** (exit {rc}); last lines: {tail}{worker}"

    def worker_tail(self, run: str, n: int = 8) -> list:
        """The last n lines of run's torch workers' own output (their stderr and stdout, which
        slimen writes to events.log as 'policy "P": worker: …'), each as 'P: line' (the line
        without the time slimen stamps it with)."""
        out = []
        for l in self.events(run).splitlines():
            m = re.match(r'^\S+ policy "([^"]+)": worker: (.*)$', l)
            if m and m.group(2).strip():
                out.append(f"{m.group(1)}: {m.group(2).strip()}")
        return out[-n:]

    def took(self, name: str) -> float:
        p = self.path / "status" / name
        return float(p.read_text().split()[2]) if p.exists() else float("nan")

    def metrics(self, run: str, policy: str | None = None) -> list:
        p = self.path / run / "metrics.jsonl"
        if not p.exists():
            return []
        ms = [json.loads(l) for l in p.read_text().splitlines() if l.strip()]
        return [m for m in ms if policy is None or m.get("policy") == policy]

    def events(self, run: str) -> str:
        p = self.path / run / "events.log"
        return p.read_text(errors="replace") if p.exists() else ""

    def restart(self, run: str, killed: float) -> list:
        """The milestones (RESTART_MILESTONES) of run's return after a rank was killed at epoch
        time killed: (name, seconds after the kill) for the first line of each after it, in
        order; a milestone with no such line is left out."""
        host, worker = [], []
        for l in self.log(run).splitlines():
            t, _, msg = l.partition(" ")
            try:
                host.append((float(t), msg))
            except ValueError:
                continue
        for l in self.events(run).splitlines():
            m = _WORKER_TIME.search(l)
            if m:
                t = time.mktime(time.strptime(m.group(1), "%Y-%m-%d %H:%M:%S"))
                worker.append((t + int(m.group(2)) / 1000, l[m.end():]))
        out = []
        for where, pat, name in RESTART_MILESTONES:
            at = next((t for t, msg in (host if where == "host" else worker)
                       if t >= killed and re.search(pat, msg)), None)
            if at is not None:
                out.append((name, at - killed))
        return out

    def worker_pids(self, run: str) -> dict:
        """policy → the pids its torch worker had (the first start, then each restart), from
        events.log; a LoRA policy that rides another's worker gets that worker's pids."""
        ev = self.events(run)
        pids = {}
        for pol, pid in re.findall(r'policy "([^"]+)": torch worker ready in [0-9.]+s \(pid (\d+)\)', ev):
            pids.setdefault(pol, []).append(int(pid))
        for pol, pid in re.findall(r'policy "([^"]+)": the torch worker is started again on .*pid (\d+)\)', ev):
            pids.setdefault(pol, []).append(int(pid))
        starts = re.findall(r'policy "([^"]+)": starting a torch worker: .* --model (\S+), on', ev)
        model_of = {pol: m for pol, m in starts}
        for pol, model in re.findall(r'policy "([^"]+)": a LoRA adapter on the torch worker of (\S+) that another', ev):
            host = next((p for p, m in model_of.items() if m == model), None)
            if host in pids:
                pids[pol] = pids[host]
        return pids

    def planned(self, name: str) -> dict:
        """policy → the GPUs `slimen gpus --config` (its log NAME) placed its worker on; the LoRA
        adapters listed under a worker get that worker's GPUs."""
        plan, last = {}, None
        for l in self.log(name).splitlines():
            m = re.match(r"^  (\S+): GPU ([0-9,]+) ", l)
            if m:
                last = [int(x) for x in m.group(2).split(",")]
                plan[m.group(1)] = last
                continue
            m = re.match(r"^    LoRA adapters in it: (.*)$", l)
            if m and last is not None:
                for a in re.findall(r'"([^"]+)"', m.group(1)):
                    plan[a] = last
        return plan

    def observed(self, run: str):
        """Where nvidia-smi saw run's processes (sample NAME=run): ({pid: {GPU index}}, {pid: ppid},
        the GPUs whose memory in use rose by 1 GiB or more while it ran). None when there was no
        nvidia-smi."""
        uu = self.path / f"{run}.uuids"
        if not uu.exists():
            return None
        index = {}
        for l in uu.read_text().splitlines():
            i, u = [x.strip() for x in l.split(",")]
            index[u] = int(i)
        on = {}
        apps = self.path / f"{run}.apps"
        for l in (apps.read_text().splitlines() if apps.exists() else []):
            f = [x.strip() for x in l.split(",")]
            if len(f) >= 4 and f[1] in index and f[2].isdigit():
                on.setdefault(int(f[2]), set()).add(index[f[1]])
        parent = {}
        ps = self.path / f"{run}.ps"
        for l in (ps.read_text().splitlines() if ps.exists() else []):
            f = [x.strip() for x in l.split(",")]
            if len(f) == 3 and f[1].isdigit() and f[2].isdigit():
                parent[int(f[1])] = int(f[2])
        mem = {}
        p = self.path / f"{run}.mem"
        for l in (p.read_text().splitlines() if p.exists() else []):
            f = [x.strip() for x in l.split(",")]
            if len(f) == 3:
                mem.setdefault(int(f[1]), []).append(float(f[2]))
        rose = sorted(i for i, v in mem.items() if v and max(v) - v[0] >= 1024)
        return on, parent, rose

    def placement(self, plan_log: str, run: str) -> str:
        """Planned against observed, per policy where nvidia-smi lists processes (a worker's, its
        ranks' or children's pids), else the GPUs whose memory rose against the planned ones:
        "…; placement matches: yes/no"."""
        plan = self.planned(plan_log)
        if not plan:
            text = self.log(plan_log).strip().splitlines() or ["nothing"]
            return f"? (slimen gpus --config printed no plan: {text[-1][:160]})"
        obs = self.observed(run)
        if obs is None:
            return "planned " + compact(plan) + "; no nvidia-smi to check it against"
        on, parent, rose = obs
        pids = self.worker_pids(run)

        def under(pid, roots):
            seen = set()
            while pid and pid not in seen:
                if pid in roots:
                    return True
                seen.add(pid)
                pid = parent.get(pid)
            return False

        if on and pids:
            ran = {}
            for pol in plan:
                roots = set(pids.get(pol, []))
                ran[pol] = sorted({g for pid, gs in on.items() if under(pid, roots) for g in gs})
            ok = all(ran[p] == plan[p] for p in plan)
            return (f"planned {compact(plan)}; ran on {compact(ran)} (nvidia-smi's processes, by the workers' "
                    f"pids in events.log); placement matches: {'yes' if ok else 'no'}")
        want = sorted({g for gs in plan.values() for g in gs})
        if on:
            seen = sorted({g for gs in on.values() for g in gs})
            ev = self.events(run)
            why = ("no torch worker became ready" if "starting a torch worker" in ev and "torch worker ready in" not in ev
                   else "a slimen built before the ready line gave it")
            return (f"planned {compact(plan)}; GPUs with processes: {','.join(map(str, seen))} (events.log names no "
                    f"worker pid: {why}); placement matches: {'yes' if seen == want else 'no'}")
        return (f"planned {compact(plan)}; GPUs whose memory in use rose ≥ 1 GiB: {','.join(map(str, rose)) or 'none'} "
                f"(nvidia-smi listed no process of the run); placement matches: {'yes' if rose == want else 'no'}")


def compact(by_policy: dict) -> str:
    """{a: [0], b: [0], c: [1]} → "GPU 0: a, b; GPU 1: c" (policies in their order)."""
    groups = {}
    for pol, gs in by_policy.items():
        groups.setdefault(",".join(map(str, gs)) or "none", []).append(pol)
    return "; ".join(f"GPU {g}: {', '.join(ps)}" for g, ps in groups.items())
