"""Prints what an offline W&B run wrote, as one JSON object, for host/wandb's tests.

    python read_wandb.py WANDB_DIR

It finds the one offline-run-* folder under WANDB_DIR/wandb, reads its run-*.wandb file (a
LevelDB-style log of the SDK's protobuf Records: a 7-byte header, then 32 KiB blocks of records
that each carry a checksum, a length and whether it is a whole record or a piece of one) and
prints {"run": {project, name, id}, "config": {...}, "history": [{key: value}, …],
"tables": {path: table json}, "exit_code": N}.
"""

import glob
import json
import math
import os
import struct
import sys

from wandb.proto import wandb_internal_pb2 as pb

BLOCK = 32 * 1024
HEADER = 7  # checksum u32, length u16, type u8
FULL, FIRST, MIDDLE, LAST = 1, 2, 3, 4


def records(path):
    data = open(path, "rb").read()
    ident, magic, version = struct.unpack("<4sHB", data[:7])
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), (ident, magic, version)
    pos, parts = 7, []
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:  # a block's tail too short for a header is padding
            pos += left
            continue
        _, n, kind = struct.unpack("<IHB", data[pos:pos + HEADER])
        if kind == 0 and n == 0:
            pos += left
            continue
        chunk = data[pos + HEADER:pos + HEADER + n]
        pos += HEADER + n
        if kind == FULL:
            parts = [chunk]
        elif kind == FIRST:
            parts = [chunk]
            continue
        elif kind == MIDDLE:
            parts.append(chunk)
            continue
        else:
            parts.append(chunk)
        r = pb.Record()
        r.ParseFromString(b"".join(parts))
        yield r


def main(root):
    runs = glob.glob(os.path.join(root, "wandb", "offline-run-*"))
    assert len(runs) == 1, runs
    (log,) = glob.glob(os.path.join(runs[0], "run-*.wandb"))
    out = {"run": {}, "config": {}, "history": [], "tables": {}, "exit_code": None}
    for r in records(log):
        kind = r.WhichOneof("record_type")
        if kind == "run":
            out["run"] = {"project": r.run.project, "name": r.run.display_name, "id": r.run.run_id}
            for item in r.run.config.update:
                out["config"][item.key] = json.loads(item.value_json)
        elif kind == "config":
            for item in r.config.update:
                out["config"][item.key] = json.loads(item.value_json)
        elif kind == "history":
            row = {}
            for item in r.history.item:
                key = item.key or "/".join(item.nested_key)
                row[key] = json.loads(item.value_json)
            out["history"].append(row)
        elif kind == "exit":
            out["exit_code"] = r.exit.exit_code
    for path in glob.glob(os.path.join(runs[0], "files", "media", "table", "**", "*.table.json"),
                          recursive=True):
        out["tables"][os.path.relpath(path, os.path.join(runs[0], "files"))] = json.load(open(path))
    json.dump(finite(out), sys.stdout, allow_nan=False)


def finite(v):
    """v with its non-finite floats as the strings "NaN", "Infinity", "-Infinity" (not JSON)."""
    if isinstance(v, float) and not math.isfinite(v):
        return "NaN" if math.isnan(v) else ("Infinity" if v > 0 else "-Infinity")
    if isinstance(v, dict):
        return {k: finite(x) for k, x in v.items()}
    if isinstance(v, list):
        return [finite(x) for x in v]
    return v


if __name__ == "__main__":
    main(sys.argv[1])
