"""diag_retrieval.py's lookup problems are what it says: the answer is the value of the one fact
whose name and key are the question's; and a short run trains and prints its table."""

import pathlib
import random
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
import diag_retrieval as dr  # noqa: E402


def facts_of(seq):
    """The (name, key) -> (digit, digit) of a prompt's facts, in its order."""
    body = seq[seq.index(dr.C) + 1 : seq.index(dr.A)]
    facts = [tuple(body[i : i + 7]) for i in range(0, len(body), 7)]
    assert all(f[1] == dr.S_ and f[3] == dr.IS and f[6] == dr.DOT for f in facts)
    return [((f[0], f[2]), (f[4], f[5])) for f in facts]


def test_the_answer_is_the_value_of_the_fact_the_question_names():
    rng = random.Random(3)
    for n in (1, 2, 5, 10, 48):
        for _ in range(50):
            seq, ans = dr.problem(rng, n)
            facts = facts_of(seq)
            assert len(facts) == n
            assert len({k for k, _ in facts}) == n  # each name and key at most once
            q = (seq[1], seq[3])
            assert seq[-5:] == [dr.A, q[0], dr.S_, q[1], dr.IS]  # the answer's prefix repeats it
            assert dict(facts)[q] == tuple(ans)


def test_the_options_rename_the_answer_and_add_a_prefix():
    rng = random.Random(4)
    for _ in range(50):
        seq, ans = dr.problem(rng, 5, answer_names=True, prefix=7)
        assert all(dr.PREFIX <= t < dr.VOCAB_WITH_OPTIONS for t in seq[:7]) and seq[7] == dr.Q
        facts = facts_of(seq[7:])
        q = (seq[8], seq[10])
        assert seq[-4] == dr.ANSWER_NAME + q[0]  # the answer names the question's person, its own token
        assert dict(facts)[q] == tuple(ans)


def test_only_the_answer_digits_are_trained():
    x, y = dr.batch(random.Random(0), 8, [2, 5])
    for row_x, row_y in zip(x.tolist(), y.tolist()):
        trained = [i for i, t in enumerate(row_y) if t != -100]
        assert len(trained) == 2 and trained[1] == trained[0] + 1
        assert all(14 <= row_y[i] < 24 for i in trained)  # digits
        assert row_x[trained[0]] == dr.IS  # the first digit is predicted after "is"


def test_a_short_run_prints_its_table(capsys):
    dr.main(["--steps", "20", "--eval-every", "10", "--batch", "8"])
    out = capsys.readouterr().out.splitlines()
    assert out[0] == "hidden 64, 4 heads of 16, 2 layers: 84736 parameters"
    rows = [line.split() for line in out[2:]]
    assert [r[0] for r in rows] == ["10", "20"]
    for r in rows:
        shares = [float(v) for v in r[2:7:2]]
        assert all(0.0 <= v <= 1.0 for v in shares)
