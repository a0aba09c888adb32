#!/usr/bin/env python3
"""Writes rewards.jsonl: slime's rm_hub verdicts on inputs built here, the oracle for slimen's
graders (starlib/slime_vectors_test.go).

Usage: make_reward_vectors.py SLIME_CHECKOUT [OUT]

SLIME_CHECKOUT is a checkout of THUDM/slime; the rm_hub files are imported directly by path, so
only sympy and pylatexenc are needed (pip install sympy pylatexenc). Each line of OUT is
{"mode", "response", "label", "want"} (plus "choices" or "metadata" for gpqa, "strict_box" for
dapo's strict_box_verify); a case where slime raises or runs
past the time limit has "crash" (the error) instead of "want", and the Go test skips it.

Modes, with the slime function that gives the verdict:
  math        1 if grade_answer_verl(response, label) else 0      (rm_type "math")
  deepscaler  get_deepscaler_rule_based_reward(response, label)   (rm_type "deepscaler")
  dapo        compute_score(response, label)["score"]             (rm_type "dapo"; strict_box_verify
                                                                   where the case says strict_box)
  f1          f1_score(response, label)[0]                        (rm_type "f1")
  gpqa        compute_gpqa_reward(response, label, metadata)      (rm_type "gpqa"; metadata from
                                                                   the case's metadata and choices)
  equal       grade_answer_mathd(a, b) or grade_answer_sympy(a, b): math's comparison of two answers
  boxed       math_utils.extract_answer(text): the answer math grades, or None
  extract     the last match of is_correct_minerva's answer pattern: the answer dapo grades, or None
  latex       math_utils._parse_latex(text), or None where it raises: LaTeX as the sympy step reads it
"""
import importlib
import json
import os
import random
import re
import signal
import sys
import types

TIME_LIMIT_S = 10


def load(slime, name):
    """Imports rm_hub/<name>.py as a module of a bare package, so its relative imports work
    without running rm_hub/__init__.py (which needs slime's server dependencies)."""
    if "slime_rm_hub" not in sys.modules:
        pkg = types.ModuleType("slime_rm_hub")
        pkg.__path__ = [os.path.join(slime, "slime", "rollout", "rm_hub")]
        sys.modules["slime_rm_hub"] = pkg
    return importlib.import_module("slime_rm_hub." + name)


class TimedOut(BaseException):
    """Raised by the alarm; a BaseException so slime's `except Exception` cannot swallow it."""


def on_alarm(signum, frame):
    raise TimedOut()


# Answers that should be equivalent to each other (each group), in the forms models write.
GROUPS = [
    ["1/2", r"\frac{1}{2}", r"\dfrac{1}{2}", r"\tfrac12", r"\frac12", "0.5", ".5", "0.50", "2/4", r"\frac{2}{4}", r"\left(\frac{1}{2}\right)", r"$\frac{1}{2}$", r"\frac 1 2"],
    ["2", "2.0", "2.00", "4/2", r"\frac{4}{2}", "02", "+2", r"\text{2}", "x=2", "x = 2", r"2\%", "2%", r"2^\circ", r"2^{\circ}", "2 degrees", r"2\text{ cm}", "2 cm", "2 meters", "two", r"\boxed{2}", "{2}", r"\sqrt{4}", "2.0000001", "1.9999999", "2e0"],
    ["1000", "1,000", r"1{,}000", r"1\,000", r"1\!000", "1 000", "1000.0", "1e3", r"10^3", r"10^{3}", "1000.", "1,000.00", "999.9999999"],
    ["-3", "- 3", "-3.0", r"-\frac{6}{2}", "(-3)", r"\left(-3\right)", "-3/1", "−3", "m=-3"],
    [r"\frac{3}{4}", "3/4", "0.75", r"\dfrac34", "6/8", r"\frac{6}{8}", r"\frac{3}{4}\%", "75\\%", r"\frac{-3}{-4}"],
    [r"-\frac{1}{3}", r"\frac{-1}{3}", "-1/3", r"-0.\overline{3}", "-0.3333333333", "-0.333", r"-\dfrac13"],
    [r"2\sqrt{2}", r"\sqrt{8}", r"2 \sqrt 2", r"2\sqrt2", "2*sqrt(2)", r"\sqrt{2}\cdot 2", r"\sqrt{2}+\sqrt{2}", "2.828427", r"2^{3/2}", r"\frac{4}{\sqrt{2}}", r"\frac{4\sqrt{2}}{2}"],
    [r"\frac{\sqrt{3}}{2}", r"\sqrt{3}/2", r"\frac{1}{2}\sqrt{3}", r"\frac{3}{2\sqrt{3}}", r"\sqrt{\frac{3}{4}}", "0.866", r"\frac{\sqrt3}2"],
    [r"\pi", "pi", r"\pi/1", "3.14", "3.14159", r"\frac{2\pi}{2}", r"180^\circ", r"\frac{\pi}{1}"],
    [r"\frac{\pi}{2}", r"\pi/2", r"\frac{1}{2}\pi", r"0.5\pi", r"\frac12\pi", r"90^\circ", "1.5708", r"\dfrac{\pi}{2}"],
    [r"3\pi", r"3 \pi", r"\pi \cdot 3", r"\pi\times3", r"\frac{6\pi}{2}", r"3\pi^1", "9.42"],
    ["x+1", "1+x", "x + 1", r"(x+1)", r"\left(x+1\right)", "x+2-1", "x+1.0", "y+1", r"\frac{2x+2}{2}", "x-1"],
    ["x^2+2x+1", "(x+1)^2", "(x+1)(x+1)", "x^2+1+2x", r"x^{2}+2x+1", "x*x+2*x+1", "x^2+2x"],
    [r"\frac{x+1}{2}", "(x+1)/2", r"\frac{x}{2}+\frac{1}{2}", "x/2+1/2", "0.5x+0.5", r"\frac{1+x}{2}"],
    ["2x", "x2", "2*x", r"2 \cdot x", "x+x", r"2\times x", "2 x", "x*2"],
    ["ab", "ba", "a*b", r"a \cdot b", "b a", "a+b"],
    ["(1,2)", "(1, 2)", r"\left(1,2\right)", "(2,1)", "[1,2]", "(1,2,3)", "1,2", r"(1,\frac{4}{2})", r"(\frac{2}{2},2)", "(1.0,2)"],
    ["[1,3)", "[1, 3)", r"\left[1,3\right)", "(1,3)", "[1,3]", r"[1,\frac{6}{2})"],
    [r"(-\infty, 3]", r"(-\infty,3]", "(-inf,3]", r"\left(-\infty, 3\right]", r"(-\infty, 3)", r"x \le 3"],
    [r"(0,\infty)", r"(0, \infty)", "(0,inf)", r"(0,+\infty)"],
    [r"\{1,2\}", "{1,2}", "1,2", "1, 2", "1 and 2", "1 or 2", "2,1", r"\{2,1\}"],
    ["A", "(A)", r"\text{A}", r"\textbf{A}", "a", "B", r"\text{(A)}", "A.", r"\mathrm{A}", "(a)"],
    ["C", "(C)", r"\text{(C)}", "c", "D", r"\textbf{(C)}"],
    [r"\text{Monday}", "Monday", "monday", "MONDAY", "Tuesday", r"\text{monday}"],
    ["yes", "Yes", "YES", r"\text{yes}", "no", "Yes."],
    ["10\\%", "10%", "10", "0.1", "10 percent", r"10\text{ percent}"],
    ["45^\\circ", "45", "45 degrees", r"45^{\circ}", r"\frac{\pi}{4}", "45°", r"45\text{ degrees}"],
    ["5 cm", "5", r"5\text{ cm}", r"5\mbox{ cm}", "5cm", r"5 \text{cm}", r"5\ \text{cm}", "5 centimeters", "5 meters", "50 mm"],
    ["12 hours", "12", r"12\text{ hours}", "12 hrs", "720 minutes"],
    [r"\$5", "5", r"\$5.00", "5 dollars", "$5$", r"5\$"],
    ["1000000", "1,000,000", "1 million", r"10^6", "1e6", r"1000000.0"],
    ["2.5", r"\frac{5}{2}", "5/2", r"2\frac{1}{2}", r"2 \frac{1}{2}", "2 1/2", "2.50", r"\frac{10}{4}"],
    [r"\sqrt{2}", r"\sqrt2", "sqrt(2)", "1.414", "1.41421356", r"2^{1/2}", r"\frac{2}{\sqrt{2}}", r"\sqrt{2}/1"],
    [r"\sqrt[3]{2}", r"2^{1/3}", r"\sqrt{2}", "1.26"],
    [r"1+\sqrt{2}", r"\sqrt{2}+1", r"\frac{1}{\sqrt{2}-1}", r"1 + \sqrt 2", "2.414"],
    [r"\infty", "inf", "oo", r"+\infty", r"-\infty"],
    [r"\emptyset", r"\varnothing", r"\{\}", "none"],
    [r"\begin{pmatrix}1\\2\end{pmatrix}", r"\begin{pmatrix} 1 \\ 2 \end{pmatrix}", "(1,2)", r"\begin{bmatrix}1\\2\end{bmatrix}"],
    [r"\begin{pmatrix}1&2\\3&4\end{pmatrix}", r"\begin{pmatrix} 1 & 2 \\ 3 & 4 \end{pmatrix}", r"\begin{bmatrix}1&2\\3&4\end{bmatrix}"],
    ["k=5", "5", "k = 5", "x=5", r"k=\frac{10}{2}", "abc=5", "y=x+5"],
    ["y=2x+3", "2x+3", "y = 3 + 2x", "y=2x+3.0"],
    ["0", "0.0", "-0", "+0", "0.000", "00", "zero"],
    ["-1", "-1.0", r"-\frac{2}{2}", "(-1)", "−1", "1"],
    ["100", "100.0", "1e2", "10^2", "99.99999999", "100.00000001", "1.0e2"],
    ["123456789", "123,456,789", "123456789.0", "123456788"],
    ["3.14159", "3.1416", r"\pi", "3.14159000"],
    [r"\frac{1}{6}", "1/6", "0.1667", r"\frac{2}{12}", "0.16666666666666666"],
    [r"e", r"e^1", "2.718", r"\exp(1)"],
    [r"\ln 2", r"\log 2", "ln(2)", r"\ln(2)", "0.693"],
    [r"2^{10}", "1024", r"2^10", "2**10"],
    ["7", "7.", "7.0", r"\text{7}", "seven", "7!", "VII", r"7\text{.}"],
    ["3!", "6", "3*2*1"],
    [r"a^2+b^2", r"b^2+a^2", r"a^{2}+b^{2}", "c^2"],
    [r"\frac{a}{b}", "a/b", r"a \div b", r"\frac{b}{a}", "a*b^{-1}"],
    [r"x \in [1,2]", "[1,2]", r"1 \le x \le 2"],
    [r"x>3", r"x > 3", r"(3,\infty)", r"x\geq3"],
    [r"\{-1, 1\}", r"\pm 1", "-1,1", "1,-1", r"x=\pm1"],
    [r"0.\overline{3}", r"\frac{1}{3}", "1/3", "0.333...", "0.3333333333"],
    ["1.5", "3/2", r"1\frac{1}{2}", r"\frac{3}{2}", "1.50", r"1\tfrac12"],
    ["12.5\\%", "12.5", "0.125", r"\frac{1}{8}"],
    [r"\text{(B)}\ 2", "B", "2", "(B)"],
    ["", " ", r"\boxed{}"],
]

# Labels and responses for F1 (SQuAD-style short answers).
F1_PAIRS = [
    ("Paris", "Paris"), ("paris", "Paris"), ("The Paris", "Paris"), ("Paris, France", "Paris"),
    ("the city of Paris", "Paris"), ("London", "Paris"), ("", ""), ("the", "a"), ("a", ""), ("", "Paris"),
    ("Yes", "yes"), ("yes", "no"), ("yes.", "Yes"), ("no", "no answer"), ("noanswer", "no answer"),
    ("yes it is", "yes"), ("no way", "no"), ("No.", "no"), ("yes", "yes yes"),
    ("don't stop", "dont stop"), ("rock'n'roll", "rock n roll"), ("U.S.A.", "USA"), ("U.S.A.", "u s a"),
    ("“quoted” text", "quoted text"), ("naïve café", "naive cafe"), ("naïve café", "Naïve Café"),
    ("Straße", "STRASSE"), ("ÉCOLE", "école"), ("a–b", "a b"), ("x — y", "x y"), ("it’s", "its"),
    ("the cat sat on the mat", "a cat sat on a mat"), ("cat cat cat", "cat"), ("cat", "cat cat cat"),
    ("the quick brown fox", "quick brown dog"), ("1,000", "1000"), ("$5", "5"), ("50%", "50"),
    ("George Washington", "Washington"), ("Washington, George", "George Washington"),
    ("an apple a day", "apple day"), ("An", "an"), ("The The", "the"), ("theatre", "the atre"),
    ("\tmany   spaces\n", "many spaces"), ("under_score", "underscore"), ("under_score", "under score"),
    ("中文 答案", "中文 答案"), ("中文答案", "中文 答案"), ("αβγ", "αβγ δ"), ("a. b. c.", "b c"),
    ("Mr. Smith", "mr smith"), ("Smith (born 1950)", "Smith"), ("[1] reference", "reference"),
    ("3.14", "314"), ("3 . 14", "3 14"), ("e-mail", "email"), ("e - mail", "e mail"),
    ("The answer is 42", "42"), ("42", "The answer is 42"), ("forty two", "42"),
    ("New York City", "new york"), ("new york", "New York City"), ("NYC", "New York City"),
    ("¿Qué?", "que"), ("¿Qué?", "qué"), ("l'été", "lete"), ("a/b", "ab"), ("a\\b", "ab"),
    ("c++", "c"), ("#1", "1"), ("@user", "user"), ("x^2", "x2"), ("50°", "50"), ("§ 3", "3"),
    ("yes\u00a0sir", "yes sir"), ("ＡＢＣ", "abc"), ("İstanbul", "istanbul"), ("noanswer", "noanswer"),
    ("No Answer", "noanswer"), ("NO", "No"), ("yes no", "yes"), ("the yes", "yes"),
]

GPQA = [
    ("The answer is B", "B", None), ("The answer is (B)", "B", None), ("answer: c", "C", None),
    ("Answer: D", "B", None), ("I think B is correct", "B", None), ("B is the correct one", "B", None),
    ("Final answer: A", "A", None), ("<think>answer is A</think> The answer is C", "C", None),
    ("<think>answer is A</think> so C", "C", None), ("so it must be C.", "C", None),
    ("Option D", "D", None), ("choice: e", "E", None), ("The choice is K", "K", None),
    ("I pick A and then B", "B", None), ("A B C D", "D", None), ("none of them", "A", None),
    ("", "A", None), ("the answer is 42", "42", None), ("it equals 42 meters", "42 meters", None),
    ("answer is x", "X", None), ("analysis shows answer is J", "J", None),
    ("my answer isn't clear", "A", None), ("The correct answer is (b)", "B", None),
    ("This is a tricky one. B", "B", None), ("I think the answer is Paris", "Paris", None),
    ("The capital is Paris", "A", ["Paris", "London", "Rome", "Berlin"]),
    ("The capital is Rome", "A", ["Paris", "London", "Rome", "Berlin"]),
    ("The answer is C", "Rome", ["Paris", "London", "Rome", "Berlin"]),
    ("The answer is C", 2, ["Paris", "London", "Rome", "Berlin"]),
    ("The answer is E", "E", ["Paris", "London", "Rome", "Berlin"]),
    ("Answer: B", 1, None), ("Answer: B", 1.0, None), ("Answer: A", 0, None),
    ("the option (A) is wrong; B is correct", "B", None), ("É B", "B", None), ("aB", "B", None),
    ("x = 5, so answer:5", "A", None), ("Answer is: a", "A", None), ("answeris b", "B", None),
]


# The end-to-end inputs of slime's own rm_hub tests (tests/test_rm_*.py), as (mode, response,
# label[, extra]) rows.
SLIME_TEST_INPUTS = [
    ("math", r"answer: \boxed{42}", r"\boxed{42}"), ("math", "just 42", "42"), ("math", r"\boxed{42}", ""),
    ("equal", "x+1", "1+x"), ("equal", r"\frac{2}{4}", r"\frac{1}{2}"), ("equal", r"\frac{1}{2}", "0.5"),
    ("equal", r"\frac12", r"\frac{1}{2}"), ("equal", r"45^\circ", "45"), ("equal", "3/4", r"\frac{3}{4}"),
    ("equal", "42", "43"), ("equal", r"\text{42}", "42"), ("equal", r"\left(1\right)", "(1)"), ("equal", ".7", "0.7"),
    ("equal", "1 + 1", "1+1"), ("equal", r"\tfrac{1}{2}", r"\frac{1}{2}"),
    ("boxed", r"first attempt \boxed{wrong}, final \boxed{42}", ""), ("boxed", r"answer: \fbox{7}", ""),
    ("boxed", r"start \boxed{never closes", ""), ("boxed", "plain text, no box", ""),
    ("deepscaler", r"Let me reconsider. \boxed{99}</think>Final: \boxed{42}", "42"),
    ("deepscaler", r"Scratch work \boxed{wrong}###Response\boxed{42}", "42"), ("deepscaler", r"\boxed{42}", "42"),
    ("deepscaler", "plain</think>no box here", "42"), ("deepscaler", r"</think>\boxed{42}", ""),
    ("deepscaler", r"</think>\boxed{42}", 42), ("deepscaler", r"</think>\boxed{42}", 42.0),
    ("deepscaler", r"</think>\boxed{42}", r"\boxed{42}"), ("deepscaler", r"</think>\boxed{43}", "42"),
    ("deepscaler", r"</think>\boxed{\frac{1}{2}}", "0.5"),
    ("dapo", "Long solution. Answer: 42", "42"), ("dapo", "just a number 42", "42"), ("dapo", "Answer: 42", "42"),
    ("dapo", "Answer: x = 42", "42"), ("dapo", "Answer: an answer", "42"), ("dapo", "Answer: 42 square", "42"),
    ("dapo", "Answer: 100 dollars", "100"), ("dapo", r"Answer: \text{hello}", "42"), ("dapo", r"Answer: \boxed{42}", "42"),
    ("dapo", "Answer: 1,234,567", "1234567"), ("dapo", "Answer: 42<|endoftext|>", "42"), ("dapo", "Answer: 42<|im_end|>", "42"),
    ("dapo", r"long preamble … \boxed{42}", "42", {"strict_box": True}), ("dapo", r"\boxed{43}", "42", {"strict_box": True}),
    ("dapo", "plain 42", "42", {"strict_box": True}), ("dapo", r"\boxed{42}" + " filler" * 60, "42", {"strict_box": True}),
    ("dapo", r"\boxed{42}", "42", {"strict_box": True}), ("dapo", r"\boxed{ 42}", "42", {"strict_box": True}),
    ("dapo", r"x" * 250 + r"\boxed{42}", "42", {"strict_box": True}), ("dapo", r"\boxed{4{2}}", "4{2}", {"strict_box": True}),
    ("dapo", r"\boxed{42} \boxed{7", "42", {"strict_box": True}), ("dapo", r"\boxed 42", "42", {"strict_box": True}),
    ("f1", "The Quick Brown Fox.", "quick brown fox"), ("f1", "An apple, a day", "apple day"), ("f1", "HELLO   WORLD", "hello world"),
    ("f1", "a.b,c!", "abc"), ("f1", "the", ""), ("f1", "Paris is the capital", "Paris is the capital"),
    ("f1", "the brown fox", "a quick brown fox"), ("f1", "apple banana", "carrot date"),
    ("f1", "yes", "some other phrase"), ("f1", "no", "some other phrase"), ("f1", "noanswer", "some other phrase"),
    ("f1", "some other phrase", "yes"), ("f1", "some other phrase", "no"), ("f1", "some other phrase", "noanswer"), ("f1", "yes", "yes"),
    ("gpqa", "The answer is B.", "B"), ("gpqa", "My choice is D", "D"), ("gpqa", "A is correct here", "A"),
    ("gpqa", "E is the correct option", "E"), ("gpqa", "the final option is C", "C"),
    ("gpqa", "we ruled out A, then B, settled on C", "C"), ("gpqa", "Let me think… Answer: A is wrong.</think>The answer is B.", "B"),
    ("gpqa", "no idea, sorry", "A"), ("gpqa", "Answer: C, but actually A was right, no wait B.", "B", {"metadata": {"valid_letters": ["A", "B"]}}),
    ("gpqa", "The answer is C.", "C"), ("gpqa", "The answer is C.", "D"),
    ("gpqa", "Answer: C", 2, {"metadata": {"choices": ["alpha", "beta", "gamma", "delta"]}}),
    ("gpqa", "Answer: B", 1, {"metadata": {"choices": {"a": "first", "b": "second", "c": "third"}}}),
    ("gpqa", "I think the answer is B.", "capital of france", {"metadata": {"choices": ["London", "Capital of France", "Berlin"]}}),
    ("gpqa", "Definitely paris.", "Paris", {"metadata": {"choices": ["London", "Paris", "Berlin"]}}),
    ("gpqa", "Answer: A", "anything", {"metadata": {"correct_letter": "a"}}),
    ("gpqa", "random text", "some answer"),
]

# More gpqa metadata shapes.
GPQA_META = [
    ("The answer is B", "A", {"correct_letter": "B"}), ("The answer is B", "A", {"correct_letter": " b "}),
    ("The answer is B", 0, {"correct_letter": "B"}), ("It is Paris", "x", {"correct_answer": "Paris"}),
    ("It is Paris", "x", {"answer_text": "paris"}), ("It is Paris", "x", {"correct_answer": "London", "answer_text": "Paris"}),
    ("I'd say F", "F", {"valid_letters": ["a", "b", "c", "d", "e", "f"]}), ("I'd say F", "F", {"choices": ["1", "2", "3", "4"]}),
    ("I'd say F", 5, {"valid_letters": ["A", "B", "C", "D", "E", "F"]}), ("option: z", "Z", {"valid_letters": ["X", "Y", "Z"]}),
    ("Answer: D", "D", {"choices": []}), ("the answer is gamma", 2, {"choices": ["alpha", "beta", "gamma"]}),
    ("no letter, but gamma", 2, {"choices": ["alpha", "beta", "gamma"]}), ("no letter, but gamma", "C", {"choices": ["alpha", "beta", "gamma"]}),
    ("no letter, but gamma", "Z", {"correct_letter": "Z", "choices": ["alpha", "beta", "gamma"]}),
    ("Answer: A", "alpha!", {"choices": ["Alpha", "beta"]}), ("answer: b", "beta", {"choices": ["alpha", "Beta"]}),
    ("</think>none", "B", {"choices": ["alpha", "beta"]}), ("none", 7, {"choices": ["alpha", "beta"]}),
    ("choice is 3", 3, {"choices": [1, 2, 3, 4]}), ("has 3 in it", 2, {"choices": [1, 2, 3, 4]}),
]

# Answers as MATH, GSM8K and AIME labels write them; each is paired with forms a model might
# write (see variants()).
REAL_ANSWERS = [
    r"\frac{\sqrt{3}}{3}", r"\left( -\frac{1}{2}, \frac{3}{2} \right)", "x^2 - 4x + 4", r"\$32.50", r"6\sqrt{2}", "p - q",
    r"\text{(E)}", "-2, 1", "1,2,3", r"\frac{1}{4}(x-1)^2", r"48\pi", "9.2", r"\frac{\pi}{3}", r"\sqrt{5}", "14", "-7",
    r"\frac{7}{2}", "0.25", r"2\sqrt{3}+1", r"\frac{3\sqrt{2}}{4}", "(3,-1)", r"[-2,\infty)", r"(-\infty,-1)\cup(1,\infty)",
    r"\{1,3\}", r"\text{Tuesday}", "2017", "588", "35\%", r"120^\circ", "8 cm", r"12\text{ inches}", "1.5 hours",
    "x=3", "y = -2x + 5", r"\dfrac{5}{9}", r"3\frac{1}{3}", "a+b", "2a", r"\sqrt[3]{4}", r"\frac{1}{\sqrt{2}}",
    r"5\pi/4", "3.1416", "100,000", "2^5", "-0.5", r"\frac{-5}{3}", "x(x+1)", "(x-2)(x+3)", r"\infty", "0", "1/3",
    r"\begin{pmatrix} 2 \\ -1 \end{pmatrix}", r"\begin{pmatrix} 1 & 0 \\ 0 & 1 \end{pmatrix}", r"\mathbf{(A)}", "B",
    r"\frac{a}{2b}", "4!", r"\binom{5}{2}", "10", r"\pm 2", r"x \ge 2", r"\text{no solution}", "even", r"\ln 2", "e^2",
    r"\frac{1}{e}", r"\log_2 3", r"\sin 30^\circ", "2i", "1+i", r"3-2\sqrt{2}", r"\sqrt{2}-1", r"\frac{2}{3}\pi",
]


def variants(a):
    """Ways a model may write answer a: the same value in other notation, and near misses."""
    out = {a, "$" + a + "$", " " + a + " ", r"\left(" + a + r"\right)", "(" + a + ")", a + ".", r"\text{" + a + "}",
           a.replace(r"\frac", r"\dfrac"), a.replace(" ", ""), a.replace(",", ", "), a.replace(r"\sqrt{", r"\sqrt {"),
           a.upper(), a.lower(), a + r"\%", a + " units", "x = " + a, a.replace("x", "y"), a.replace("2", "3"),
           a.replace("-", "+"), "-" + a, "2" + a, a + "+0", "1*" + a, a + "*1", "(" + a + ")/1", a.replace(r"\pi", "pi"),
           a.replace(r"\sqrt", "sqrt"), a.replace("^", "**"), a.replace(r"\left", "").replace(r"\right", "")}
    return sorted(out)


# Fragments that random answers are made of, to reach the corners of slime's string handling.
FRAGMENTS = [
    "1", "2", "3", "12", "0", "-", "+", " ", ".", ",", "5", "1,000", "0.5", ".5", "x", "y", "a", "(", ")", "[", "]",
    r"\frac", r"\dfrac", r"\tfrac", "{", "}", r"\sqrt", r"\pi", r"\infty", r"\text{", r"\text{ ", r"\mbox{", r"\left",
    r"\right", r"\%", "%", r"\$", "$", "^", r"^\circ", r"^{\circ}", "=", "x=", "/", "*", r"\cdot", r"\times", r"\!", r"\,",
    r"\;", " cm", " degrees", " meters", "hours", "inches", " and ", " or ", "million", r"\boxed{", r"\fbox{", "\n", "\\\\",
    r"\{", r"\}", r"\cup", r"\le", "e", "i", r"\sqrt{2}", r"\frac{1}{2}", r"\frac12", "3/4", "2/4", "10^3", "1e3",
    "Answer: ", "The", " the ", "yes", "No", "A", "(B)", r"\mathrm{", r"\textbf{", "_", "'", '"', "!", "?", "~",
    "<|im_end|>", "é", "½", "²", "−",
]


# LaTeX commands, rendered by themselves, before, with and around arguments.
LATEX_COMMANDS = """
alpha beta gamma delta epsilon varepsilon zeta eta theta vartheta iota kappa varkappa lambda mu nu xi omicron pi varpi
rho varrho sigma varsigma tau upsilon phi varphi chi psi omega Gamma Delta Theta Lambda Xi Pi Sigma Upsilon Phi Psi Omega
infty partial nabla forall exists nexists neg lnot emptyset varnothing angle measuredangle triangle square blacksquare
diamond Box checkmark cdot times div pm mp ast star circ bullet oplus ominus otimes oslash odot cap cup sqcap sqcup vee
wedge setminus wr amalg le leq ge geq neq ne approx sim simeq cong equiv propto ll gg prec succ subset supset subseteq
supseteq in ni notin mid nmid parallel perp models vdash dashv asymp doteq lt gt leqslant geqslant lesssim gtrsim nless
ngtr nleq ngeq to rightarrow leftarrow Rightarrow Leftarrow leftrightarrow Leftrightarrow mapsto implies iff impliedby
longrightarrow Longrightarrow uparrow downarrow nearrow searrow hookrightarrow ldots cdots vdots ddots dots dotsc dotsb
langle rangle lfloor rfloor lceil rceil lvert rvert lVert rVert vert Vert backslash sin cos tan cot sec csc arcsin arccos
arctan sinh cosh tanh coth ln log lg exp lim liminf limsup max min sup inf det gcd deg dim ker hom arg Pr mod bmod pmod
aleph beth hbar ell wp Re Im imath jmath prime degree textdegree S P dag ddag copyright pounds quad qquad enspace
thinspace negthinspace hfill displaystyle textstyle scriptstyle limits nolimits text textbf textit textrm textsf texttt
textsc textsl textup textnormal emph mathrm mathbf mathit mathsf mathtt mathcal mathfrak mathscr mathbb mathnormal
boldsymbol bm operatorname mbox hbox fbox boxed ensuremath overline underline widehat widetilde hat bar vec tilde dot
ddot check breve acute grave mathring overrightarrow overleftarrow underbrace overbrace phantom hphantom vphantom hspace
vspace color textcolor label tag ref cite frac dfrac tfrac cfrac sfrac binom dbinom tbinom choose over sqrt root left
right big Big bigg Bigg bigl bigr Bigl Bigr middle
""".split()


def latex_cases():
    cases = []
    for name in LATEX_COMMANDS:
        for template in ["\\%s{ab}c", "\\%s ab", "x\\%s", "\\%s{a}{b}c", "\\%s[3]{ab}", "2\\%s 3"]:
            cases.append({"mode": "latex", "response": template % name, "label": ""})
    return cases


def random_cases(rng, rounds):
    """Random strings of FRAGMENTS through every grader."""
    def answer():
        return "".join(rng.choice(FRAGMENTS) for _ in range(rng.randint(1, 6)))
    cases = []
    for _ in range(rounds):
        a, b = answer(), answer()
        cases.append({"mode": "equal", "response": a, "label": b})
        cases.append({"mode": "equal", "response": a, "label": a.replace(" ", "")})
        cases.append({"mode": "math", "response": "so " + box(a), "label": b})
        cases.append({"mode": "deepscaler", "label": a, "response": rng.choice(["</think>", "<think>", "###Response", ""]) + answer() + box(a)})
        cases.append({"mode": "dapo", "response": answer() + "Answer: " + a, "label": rng.choice(["1", "12", "5", "0", "-1", "1000", "2"])})
        cases.append({"mode": "f1", "response": a, "label": b})
        cases.append({"mode": "gpqa", "response": a + answer(), "label": rng.choice(["A", "B", "x", "1", "12"])})
        cases.append({"mode": "boxed", "response": answer() + answer(), "label": ""})
        cases.append({"mode": "extract", "response": answer() + answer(), "label": ""})
    return cases


# Labels, answer-line fragments and words for random dapo, f1, gpqa and math cases.
NUMBERS = ["0", "1", "5", "12", "-3", "007", "1e2", "2.5", "-0.5", "1_000", "+4", ".5", "5.", "1,000", "10^3",
           "\\frac{1}{2}", "1e400", "nan", "-inf", "١٢", "²"]
ANSWER_FRAGMENTS = ["Answer", "answer", "ANSWER", ":", " ", "\n", "=", "$", "\\boxed{", "}", "\\text{", "dollars", "cm",
                    " units", ",", ".", "a ", "an ", "\\$", "\\%", "^\\circ", "<|endoftext|>", "\\sqrt", "frac", "\\frac",
                    "\\overline{", "\\textbf{", "mbox{", "\\text{and}", "\\text{m}", "\\;", ",\\!", "{,}", '"', "\\ldots",
                    "Final", "x"]
WORDS = ["Paris", "the", "a", "an", "yes", "no", "noanswer", "No Answer", "é", "É", "ß", "İ", "’", "—", "_", "-", ".", ",",
         "!", " ", "\t", "\n", "\u00a0", "\u3000", "B", "(C)", "1", "2", "A", "is", "correct", "answer", "option", "choice",
         "final", "</think>", "<think>", "ſ", "K", "ı"]


def label_cases(rng, rounds):
    """Random labels and answers for dapo and math, words for f1 and gpqa (with metadata)."""
    def join(pool, lo, hi):
        return "".join(rng.choice(pool) for _ in range(rng.randint(lo, hi)))
    metas = [{"choices": ["Paris", "yes", "B"]}, {"valid_letters": ["A", "b"]}, {"correct_letter": "c"},
             {"correct_answer": "Paris"}, {"choices": {"x": "a", "y": "correct"}}]
    cases = []
    for _ in range(rounds):
        cases.append({"mode": "dapo", "response": join(ANSWER_FRAGMENTS + NUMBERS, 1, 8), "label": rng.choice(NUMBERS)})
        cases.append({"mode": "dapo", "response": "Answer: " + join(ANSWER_FRAGMENTS + NUMBERS, 1, 4), "label": rng.choice(NUMBERS)})
        cases.append({"mode": "f1", "response": join(WORDS, 0, 6), "label": join(WORDS, 0, 6)})
        g = {"mode": "gpqa", "response": join(WORDS, 1, 8), "label": rng.choice(["A", "b", "C ", "x", 0, 2, 1.0, -1, "Paris", "yes", ""])}
        if rng.random() < 0.5:
            g["metadata"] = rng.choice(metas)
        cases.append(g)
        cases.append({"mode": "math", "response": join(ANSWER_FRAGMENTS + NUMBERS, 1, 6), "label": rng.choice(NUMBERS)})
    return cases


def expression_cases(rng, count, radicals=False):
    """Random expressions in numbers, x, y, pi, square roots and decimals (with radicals, also
    square roots of sums, logarithms and 1/(x+n)), each compared with the forms sympy writes it in
    (LaTeX, plain, expanded, factored, rationalised, 6 digits) and with another expression."""
    import sympy

    x, y = sympy.symbols("x y")

    def atom():
        r = rng.random()
        if r < 0.3:
            return sympy.Integer(rng.randint(-9, 12))
        if r < 0.45:
            return sympy.Rational(rng.randint(1, 9), rng.randint(2, 9))
        if r < 0.6:
            return x
        if r < 0.7:
            return y
        if r < 0.8:
            if radicals:
                return sympy.sqrt(rng.choice([2, 3, 5, 8, 12, 18]) + rng.choice([0, 1, sympy.sqrt(2), x]))
            return sympy.sqrt(rng.choice([2, 3, 5, 8, 12, 18]))
        if r < 0.87:
            if radicals:
                return rng.choice([sympy.pi, sympy.log(rng.randint(2, 9)), 1 / (x + rng.randint(1, 3))])
            return sympy.pi
        if r < 0.93:
            return sympy.Float(rng.choice(["0.5", "1.25", "2.0", "0.1", "3.75"]))
        return sympy.Integer(rng.randint(10, 999))

    def expr(depth=0):
        if depth > 2 or rng.random() < 0.35:
            return atom()
        op = rng.choice("+-*/^")
        a, b = expr(depth + 1), expr(depth + 1)
        if op == "+":
            return a + b
        if op == "-":
            return a - b
        if op == "*":
            return a * b
        if op == "/":
            return a / b if b != 0 else a
        return a ** rng.randint(2, 3)

    def forms(e):
        out = []
        for f in (sympy.latex, lambda e: str(e).replace("**", "^"), lambda e: sympy.latex(sympy.expand(e)),
                  lambda e: sympy.latex(sympy.factor(e)), lambda e: str(sympy.nsimplify(e)).replace("**", "^"),
                  lambda e: sympy.latex(sympy.N(e, 6))):
            try:
                s = f(e)
            except Exception:
                continue
            if len(s) < 120 and s not in out:
                out.append(s)
        return out

    cases = []
    for _ in range(count):
        fs, other = forms(expr()), forms(expr())
        for a in fs:
            for b in fs + other[:1]:
                cases.append({"mode": "equal", "response": a, "label": b})
    return cases


def box(s):
    return r"\boxed{" + s + "}"


def build_cases():
    equal_pairs = []
    for group in GROUPS:
        for i, a in enumerate(group):
            for j, b in enumerate(group):
                if i != j or len(group) < 3:
                    equal_pairs.append((a, b))
    # A few cross-group pairs, so the wrong answers are not all near misses.
    heads = [g[0] for g in GROUPS]
    for i in range(len(heads)):
        equal_pairs.append((heads[i], heads[(i + 7) % len(heads)]))

    cases = []
    for a, b in equal_pairs:
        cases.append({"mode": "equal", "response": a, "label": b})
    # math: the boxed answer against the label, in the wrappings models write.
    for k, (a, b) in enumerate(equal_pairs):
        wrap = [
            "So the answer is " + box(a) + ".",
            "$" + box(a) + "$",
            r"\[ " + box(a) + r" \]",
            "Step 1... " + box("0") + " wait, no. Final: " + box(a),
        ][k % 4]
        cases.append({"mode": "math", "response": wrap, "label": b})
    labels_math = [("5", 1), (r"\boxed{5}", 1), (r"\frac{1}{2}", 1), ("", 0), ("x+1", 1), (r"\boxed{", 1)]
    responses_math = [
        r"\boxed{5}", r"\boxed 5", r"\boxed {5}", r"\fbox{5}", r"\boxed{5} and \fbox{6}", r"\fbox{6} \boxed{5}",
        r"\boxed{5} then \boxed{6", r"\boxed{6} then \boxed{5", r"\boxed{\frac{1}{2}}", r"\boxed{{5}}",
        r"\boxed{ 5 }", r"\boxed{5}\boxed{6}", r"\boxedx{5}", r"\boxed{x+1}", r"\boxed{1+x}", "5", "Answer: 5",
        r"\boxed{\text{5}}", r"\boxed{5.}", r"\boxed{\{5\}}", r"\boxed{5}}", r"\boxed{\boxed{5}}",
        r"<think>\boxed{6}</think>\boxed{5}", r"\(\boxed{5}\)", r"\boxed{5^{\circ}}", r"\boxed{\$5}",
        r"\boxed{5\text{ cm}}", r"\boxed{5 \text{cm}}", r"\boxed{5\ \text{cm}}", r"\boxed{\frac12}", r"\boxed{0.5}",
        r"\boxed{1/2}", r"\boxed{2/4}", r"\boxed{\dfrac{1}{2}}", r"\boxed{\left(\frac{1}{2}\right)}",
        "\\boxed{5\n}", r"\boxed{\fbox{5}}", r"\fbox{\boxed{5}}", r"\boxed{}",
    ]
    for label, _ in labels_math:
        for r in responses_math:
            cases.append({"mode": "math", "response": r, "label": label})
            cases.append({"mode": "boxed", "response": r, "label": ""})
    # deepscaler: the same answers after the thinking, and the think rules.
    for k, (a, b) in enumerate(equal_pairs[::3]):
        wrap = [
            "<think>hmm " + box("0") + "</think>The answer is " + box(a),
            "</think>" + box(a),
            box(a),
            "<think>" + box(a) + "</think> no box",
            "###Response " + box(a),
            "<think>" + box(a),
        ][k % 6]
        cases.append({"mode": "deepscaler", "response": wrap, "label": b})
    ds_responses = [
        "<think>x</think>" + box("5"), box("5"), "<think>" + box("5"), "<think>a</think><think>b</think>" + box("5"),
        "</think>" + box("5") + "</think>", "</think>" + box("5") + "</think>" + box("6"),
        "###Response" + box("5"), "###Response" + box("5") + "###Response" + box("6"),
        "prefix ###Response x ###Response " + box("5"), "</think>###Response" + box("6"),
        "<think>" + box("5") + "</think>", "</THINK>" + box("5"), "</think>\n\n" + box("5"),
        "</think>" + r"\boxed 5", "</think>" + r"\fbox{5}", "</think>" + box("5") + r" then \boxed{6",
    ]
    for label in ["5", r"\boxed{5}", "", "6", r"\boxed{5"]:
        for r in ds_responses:
            cases.append({"mode": "deepscaler", "response": r, "label": label})
    # dapo: the answer line in the last 300 characters; integer labels.
    dapo_answers = [
        "5", "5.", "5.0", "$5$", r"\boxed{5}", "x = 5", "5 degrees", "5 dollars", r"5\%", "5 cm", "05",
        r"\frac{10}{2}", "five", "5 apples", "1,000", r"1{,}000", "1000", "-5", "- 5", " 5 ", "5\t", r"\text{5}",
        r"5^\circ", "5^{\\circ}", r"\textbf{5}", "5 points", "5 units", "5 ways", "5<|im_end|>", r"\$5",
        "a 5", "an 5", "5 mph", "5 km", "5 inches", "5 hours", r"\mbox{5}", r"\overline{5}", "5.5", "6",
        "y=2=5", r"\dfrac{10}{2}", "5 students", "12", "12.0", "-12",
    ]
    dapo_labels = ["5", "5.0", "1000", "-5", "12", "1e3", " 5 ", "5.7", "-5.7", "1_000", "inf", "12.5", "abc", r"\boxed{5}", "0"]
    prefixes = ["Answer: ", "answer:", "ANSWER : ", "Final Answer: ", "FinalAnswer: ", "MyAnswer: ", "The answer: ", "Answer:\n"]
    k = 0
    for label in dapo_labels:
        for a in dapo_answers:
            k += 1
            resp = prefixes[k % len(prefixes)] + a
            if k % 5 == 0:
                resp = "Work.\nAnswer: 3\n" + resp
            cases.append({"mode": "dapo", "response": resp, "label": label})
    long_tail = "x" * 295
    for resp in [
        "Answer: 5\n" + long_tail, "Answer: 5\n" + "x" * 285, "Answer: 5\n" + "é" * 289, "Answer: 5\n" + "é" * 291,
        "Answer: 5 " + "y" * 400, "no answer line", "", "Answer: 5\nAnswer: 6", "Answer: 6\nAnswer: 5",
        "Answer:5\n\nthe end", "answer: 5 and more", "Answer: 5 Answer: 6", "\\boxed{5}", "Answer: \\boxed{5}",
        "Answer: $5$.", "Answer: 5$.", "Answer: $5.$", "Answer: 5=", "Answer: =5",
    ]:
        for label in ["5", "6"]:
            cases.append({"mode": "dapo", "response": resp, "label": label})
    for text in ["Answer: 42", "work\nAnswer: 1\nmore\nFinal answer:  7 \n", "ANSWER : -3", "Answer:\n12",
                 "The answer is 5", "FinalAnswer: 5", "MyAnswer: 9", "answer:x\nanswer: y", "Answer: ", "Answer:  \n5"]:
        cases.append({"mode": "extract", "response": text, "label": ""})
    # f1
    for p, g in F1_PAIRS:
        cases.append({"mode": "f1", "response": p, "label": g})
        cases.append({"mode": "f1", "response": g, "label": p})
    # slime's own test inputs
    for row in SLIME_TEST_INPUTS:
        c = {"mode": row[0], "response": row[1], "label": row[2]}
        if len(row) > 3:
            c.update(row[3])
        cases.append(c)
    # realistic answers and their variants
    for k, a in enumerate(REAL_ANSWERS):
        for v in variants(a):
            cases.append({"mode": "equal", "response": v, "label": a})
            cases.append({"mode": "math", "response": "Thus " + box(v) + ".", "label": a})
        b = REAL_ANSWERS[(k + 1) % len(REAL_ANSWERS)]
        cases.append({"mode": "equal", "response": b, "label": a})
        cases.append({"mode": "deepscaler", "response": "<think>t</think>" + box(a), "label": a})
    for resp, label, meta in GPQA_META:
        cases.append({"mode": "gpqa", "response": resp, "label": label, "metadata": meta})
    cases += random_cases(random.Random(1), 700)
    cases += expression_cases(random.Random(2), 120)
    cases += expression_cases(random.Random(5), 60, radicals=True)
    cases += label_cases(random.Random(3), 500)
    cases += latex_cases()
    for c in random_cases(random.Random(4), 400):
        if c["mode"] == "equal":
            cases.append({"mode": "latex", "response": c["response"], "label": ""})
    # gpqa
    for resp, label, choices in GPQA:
        c = {"mode": "gpqa", "response": resp, "label": label}
        if choices is not None:
            c["choices"] = choices
        cases.append(c)
    return cases


def main():
    if len(sys.argv) not in (2, 3):
        sys.exit(__doc__)
    slime = sys.argv[1]
    out = sys.argv[2] if len(sys.argv) == 3 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "rewards.jsonl")
    mu = load(slime, "math_utils")
    ds = load(slime, "deepscaler")
    dapo = load(slime, "math_dapo_utils")
    f1 = load(slime, "f1")
    gpqa = load(slime, "gpqa")
    answer_pattern = dapo.is_correct_minerva.__defaults__[1]

    def extract(text):
        found = re.findall(answer_pattern, text)
        return found[-1] if found else None

    verdict = {
        "math": lambda c: 1 if mu.grade_answer_verl(c["response"], c["label"]) else 0,
        "deepscaler": lambda c: ds.get_deepscaler_rule_based_reward(c["response"], c["label"]),
        "dapo": lambda c: dapo.compute_score(c["response"], c["label"], strict_box_verify=c.get("strict_box", False))["score"],
        "f1": lambda c: f1.f1_score(c["response"], c["label"])[0],
        "gpqa": lambda c: gpqa.compute_gpqa_reward(c["response"], c["label"], metadata=gpqa_metadata(c)),
        "equal": lambda c: bool(mu.grade_answer_mathd(c["response"], c["label"]) or mu.grade_answer_sympy(c["response"], c["label"])),
        "boxed": lambda c: mu.extract_answer(c["response"]),
        "extract": lambda c: extract(c["response"]),
        "latex": lambda c: parse_latex(c["response"]),
    }
    def parse_latex(text):
        try:
            return mu._parse_latex(text)
        except Exception:  # _normalize catches this and keeps the text as it was
            return None

    def gpqa_metadata(c):
        meta = json.loads(json.dumps(c.get("metadata", {})))  # a copy: slime writes into it
        if "choices" in c:
            meta["choices"] = c["choices"]
        return meta

    signal.signal(signal.SIGALRM, on_alarm)
    seen = set()
    counts = {}
    with open(out, "w", encoding="utf-8") as f:
        for c in build_cases():
            key = json.dumps(c, sort_keys=True)
            if key in seen:
                continue
            seen.add(key)
            signal.alarm(TIME_LIMIT_S)
            try:
                c["want"] = verdict[c["mode"]](c)
            except TimedOut:
                c["crash"] = "timed out after %ds" % TIME_LIMIT_S
            except Exception as e:  # slime raises: the case says so and the Go test skips it
                c["crash"] = "%s: %s" % (type(e).__name__, e)
            finally:
                signal.alarm(0)
            counts[c["mode"]] = counts.get(c["mode"], 0) + 1
            f.write(json.dumps(c, ensure_ascii=False) + "\n")
    print(out, counts, file=sys.stderr)


if __name__ == "__main__":
    main()
