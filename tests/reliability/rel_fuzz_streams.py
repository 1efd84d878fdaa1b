"""Stream fuzzer, run as a subprocess so that a crash of the reader (a segfault in Arrow) fails
the test with the case that caused it instead of killing pytest.

argv: WORKDIR SEED N. Mutates one stream file of a small two-rank run per case (bit flips,
truncation, inserted random bytes, zeroed ranges, duplicated ranges) and opens it with
load_run().tensors()/.scalars()/.info() and the CLI's main(). Prints a JSON summary: every outcome must be
"ok" (a readable subset) or "runerror" (fp8scope.errors.RunError, one line).
"""

import contextlib
import io
import json
import os
import random
import shutil
import sys
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import pyarrow as pa  # noqa: E402

import fp8scope  # noqa: E402
from fp8scope.cli.main import main  # noqa: E402
from fp8scope.errors import RunError  # noqa: E402
from fp8scope.schema import TENSOR_SCHEMA  # noqa: E402
from fp8scope.step_records import scalar_batch  # noqa: E402
from fp8scope.store import RunWriter, new_manifest, write_manifest  # noqa: E402


def tensor_rows(step: int, rank: int, n: int = 6) -> pa.RecordBatch:
    cols = []
    for f in TENSOR_SCHEMA:
        if f.name == "step":
            v = [step] * n
        elif f.name == "rank":
            v = [rank] * n
        elif f.name == "layer":
            v = [f"blocks.{i // 3}.mlp" for i in range(n)]
        elif f.name == "tensor":
            v = ["activation", "weight", "gradient"] * (n // 3)
        elif f.name in ("source", "fp8_format"):
            v = ["emulated" if f.name == "source" else "e4m3"] * n
        elif f.name == "recipe":
            v = ["delayed"] * n
        elif f.name == "full":
            v = [True] * n
        elif pa.types.is_integer(f.type):
            v = list(range(n))
        else:
            v = [1.5 + step] * n
        cols.append(pa.array(v, f.type))
    return pa.record_batch(cols, schema=TENSOR_SCHEMA)


def make_run(path: Path) -> None:
    write_manifest(path, new_manifest(world_size=2))
    for rank in (0, 1):
        w = RunWriter(path, rank)
        for s in range(8):
            w.write("tensors", tensor_rows(s, rank))
            w.write("scalars", scalar_batch(s, rank, ["loss", "lr"], [1.0 / (s + 1), 0.1], time.time()))
        if rank == 0:
            w.close()  # rank 0 ended cleanly (EOS marker), rank 1 "crashed"


def mutate(b: bytearray, rng: random.Random) -> str:
    kind = rng.choice(["flip", "flip", "trunc", "insert", "zero", "dup"])
    if kind == "flip":
        for _ in range(rng.randint(1, 4)):
            b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    elif kind == "trunc":
        del b[rng.randrange(len(b)):]
    elif kind == "insert":
        p = rng.randrange(len(b))
        b[p:p] = rng.randbytes(rng.randint(1, 16))
    elif kind == "zero":
        p = rng.randrange(len(b))
        n = min(rng.randint(1, 64), len(b) - p)
        b[p:p + n] = bytes(n)
    else:
        p, q = sorted(rng.randrange(len(b)) for _ in range(2))
        b[q:q] = b[p:q]
    return kind


def main_():
    work, seed, n = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    good = work / "good"
    make_run(good)
    rng = random.Random(seed)
    outcomes: dict[str, int] = {}
    bad = []
    for i in range(n):
        d = work / "case"
        shutil.rmtree(d, ignore_errors=True)
        shutil.copytree(good, d)
        streams = sorted((d / "streams").iterdir())
        f = rng.choice(streams)
        b = bytearray(f.read_bytes())
        kind = mutate(b, rng)
        f.write_bytes(bytes(b))
        (work / "current_case").write_text(f"seed {seed} case {i} {kind} {f.name}")  # if we crash, this says where
        try:
            r = fp8scope.load_run(d)
            r.tensors()
            r.scalars()
            r.info()
            res = "ok"
        except RunError as e:
            res = "runerror"
            if "\n" in str(e):
                bad.append((i, kind, "multi-line RunError"))
        except Exception as e:  # noqa: BLE001
            res = "other"
            bad.append((i, kind, f"{type(e).__name__}: {str(e)[:200]}"))
        for argv in (["info", str(d)], ["tensors", str(d), "--csv"]):
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                rc = main(argv)
            if rc != (0 if res == "ok" else 2) or len(err.getvalue().strip().splitlines()) > 1:
                bad.append((i, kind, f"cli {argv[0]} rc={rc}: {err.getvalue().strip()[:200]}"))
        outcomes[f"{kind}:{res}"] = outcomes.get(f"{kind}:{res}", 0) + 1
    print(json.dumps({"cases": n, "outcomes": outcomes, "bad": bad}))


if __name__ == "__main__":
    main_()
