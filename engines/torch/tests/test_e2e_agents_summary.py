"""e2e_agents_summary.py, the table of e2e_agents.sh: steps, held-out first → last (and the best
eval between), tokens trained over the trained policies, the masked share from the script's
chat_masked_share or else from the saved rollouts' loss masks, and the run's outcome."""

import json

import e2e_agents_summary as summary


def write(path, lines):
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))


def run_dir(tmp_path, name, metrics, rollouts=()):
    d = tmp_path / name
    d.mkdir()
    write(d / "metrics.jsonl", metrics)
    write(d / "rollouts.jsonl", rollouts)
    return d


def test_row_from_saved_rollouts(tmp_path):
    metrics = [
        {"step": 0, "policy": "_eval", "accuracy": 0.05, "dataset": "calc"},
        {"step": 1, "policy": "planner", "trained_tokens": 100},
        {"step": 1, "policy": "_run", "accuracy": 0.1},
        {"step": 2, "policy": "planner", "trained_tokens": 50},
        {"step": 2, "policy": "_run", "accuracy": 0.2},
        {"step": 2, "policy": "_eval", "accuracy": 0.30, "dataset": "calc"},
        {"step": 3, "policy": "planner", "trained_tokens": 25},
        {"step": 3, "policy": "_run", "accuracy": 0.2, "tokens": 999},
        {"step": 4, "policy": "_run", "accuracy": 0.2},
        {"step": 4, "policy": "_eval", "accuracy": 0.25, "dataset": "calc"},
    ]
    rollouts = [
        # Trained: from the first sampled token on, 2 of 6 masked out (a tool result).
        {"step": 1, "eval": False, "calls": [
            {"trained": True, "mask": [0, 0, 1, 1, 0, 0, 1, 1]},
            {"trained": False, "mask": [0, 0, 0, 1]},  # not trained: not counted
        ]},
        {"step": 0, "eval": True, "calls": [{"trained": False, "mask": [1, 0, 0, 0]}]},
    ]
    d = run_dir(tmp_path, "agentflow", metrics, rollouts)
    (tmp_path / "status").mkdir()
    (tmp_path / "status" / "agentflow").write_text("124 300 310.4\n")
    st = summary.read_status(str(tmp_path / "status" / "agentflow"))
    assert summary.row("agentflow", str(d), st) == [
        "agentflow", "4", "310", "0.05 → 0.25 (+0.20; step 0 → 4; best 0.30 at step 2)", "175",
        "33% (saved rollouts)", "stopped at its 300 s limit"]


def test_row_logged_share_and_datasets_averaged(tmp_path):
    metrics = [
        {"step": 0, "policy": "_eval", "accuracy": 0.0, "dataset": "a"},
        {"step": 0, "policy": "_eval", "accuracy": 0.2, "dataset": "b"},
        {"step": 1, "policy": "orchestrator", "trained_tokens": 10},
        {"step": 1, "policy": "_run", "chat_masked_share": 0.4},
        {"step": 2, "policy": "orchestrator", "trained_tokens": 10},
        {"step": 2, "policy": "_run", "chat_masked_share": 0.6},
        {"step": 2, "policy": "_eval", "accuracy": 0.5, "dataset": "a"},
        {"step": 2, "policy": "_eval", "accuracy": 0.3, "dataset": "b"},
    ]
    d = run_dir(tmp_path, "toolorchestra", metrics, [{"step": 1, "eval": False, "calls": [
        {"trained": True, "mask": [1, 0, 0, 0]}]}])
    assert summary.row("toolorchestra", str(d), ("0", 300.0, 200.0)) == [
        "toolorchestra", "2", "200", "0.10 → 0.40 (+0.30; step 0 → 2)", "20", "50%", "done"]


def test_row_of_a_run_that_never_started(tmp_path):
    d = tmp_path / "memagent"
    d.mkdir()
    assert summary.row("memagent", str(d), ("skipped", 0.0, 0.0)) == [
        "memagent", "0", "0", "no eval", "0", "–", "skipped: no budget left"]
    assert summary.row("memagent", str(d), None)[2:] == ["–", "no eval", "0", "–", "not run"]
    table = summary.table([summary.row("memagent", str(d), None)])
    assert table.splitlines()[0].startswith("| example | steps | wall s |")


def test_sft_table(tmp_path):
    log = tmp_path / "sft.log"
    log.write_text(
        "2026-11-28 11:17:09,001 slimen_torch INFO step 5: held-out h.jsonl, greedy answers equal "
        "to the right ones: 37.5% of 48 (calc 66.7%, orchestra 0.0%)\n"
        "step 5: held-out h.jsonl, greedy answers equal to the right ones: 37.5% of 48 "
        "(calc 66.7%, orchestra 0.0%)\n"
        "step 9: held-out h.jsonl, greedy answers equal to the right ones: 40.0% of 48 "
        "(calc 70.0%, orchestra 1.0%, arith 20.0%)\n")
    assert summary.sft_table(str(log)).splitlines() == [
        "| sft step | held-out exact match | calc | orchestra | arith |",
        "|---:|---:|---:|---:|---:|",
        "| 5 | 37.5% of 48 | 66.7% | 0.0% | – |",
        "| 9 | 40.0% of 48 | 70.0% | 1.0% | 20.0% |",
    ]
    empty = tmp_path / "empty.log"
    empty.write_text("sft stopped\n")
    assert summary.sft_table(str(empty)).startswith("no held-out lines")
