"""Times the Python constraint matcher (slimen_torch/constrain.py) per sampled token along a
57-byte answer of a three-property schema, cold (no state seen before) and warm (the states
kept), on synthetic subword vocabularies of 4,096 and 32,768 pieces, as the Go benchmark
(`go test ./engines/constrain -run '^$' -bench Mask`) times the Go one. Run:
`$(scripts/pyenv.sh)/bin/python engines/torch/tests/bench_constrain.py`."""

import pathlib
import random
import sys
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from slimen_torch import constrain  # noqa: E402

SPEC = {"json_schema": {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"},
                                                         "tags": {"type": "array", "items": {"type": "string"}}},
                        "required": ["name", "age", "tags"], "additionalProperties": False}}
RESPONSE = '{"name": "Ann Lee", "age": 31, "tags": ["a", "bc", "def"]}'


def vocab(size):
    """The characters, then pieces of JSON and words of several characters (as the Go benchmark's)."""
    texts = ["<|end|>", "\n"] + [chr(c) for c in range(32, 127)]
    seen, rng = set(texts), random.Random(7)
    frag = ['"', '": ', '", "', '{"', '"}', "}", "{", "[", "]", ", ", ": ", "\n", "  ", "true", "null", "false",
            "name", "age", "_", "<tool_call>", "</tool_call>", "arguments"]
    letters = "abcdefghijklmnopqrstuvwxyz0123456789 "
    while len(texts) < size:
        s = "".join(rng.choice(frag) if rng.randrange(3) == 0 else
                    "".join(rng.choice(letters) for _ in range(1 + rng.randrange(5))) for _ in range(1 + rng.randrange(3)))
        if s not in seen:
            seen.add(s)
            texts.append(s)
    return texts


def main():
    g = constrain.Grammar.compile(SPEC)
    for size in (4096, 32768):
        texts = vocab(size)
        t = time.perf_counter()
        v = constrain.Vocab(texts, [True] + [False] * (len(texts) - 1))
        index = time.perf_counter() - t
        for warm in (False, True):
            m = constrain.Matcher(g, v, [0])
            runs = 2 if warm else 1
            for _ in range(runs):
                s, t = g.start(), time.perf_counter()
                for ch in RESPONSE:
                    m.allowed(s)
                    s = s.feed(ch)
            per = (time.perf_counter() - t) / len(RESPONSE)
            print(f"{size} pieces (indexed in {index:.2f} s): {'warm' if warm else 'cold'} {per * 1e3:.3f} ms/token")


if __name__ == "__main__":
    main()
