"""Issue 36: the compiled cost of a hybrid step before and after, in callgrind instructions.

    git archive <sha> | tar -x -C /tmp/before       # then build it there: python setup_mypyc.py build_ext --inplace
    .venv/bin/python benchmarks/hybrid_step_cost.py --tree before=/tmp/before --tree now=.

Runs ``benchmarks/serving.py``'s hybrid variant (its quick sizes, eviction on every admission)
once per package tree under callgrind, the same benchmark code for each (``PYTHONPATH`` selects
the tree, which must hold its compiled modules), and reports the instructions per prompt block
(admission, prefill chunks cut at snapshot positions, free) and per decode step per request."""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

import serving  # noqa: E402
from run import write_results  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tree", action="append", required=True, help="NAME=PATH of a package tree (repeat)")
    ap.add_argument("--out", default=os.path.join(HERE, "hybrid_step_cost_results.json"))
    a = ap.parse_args()
    params = dict(serving.QUICK, variant="hybrid", roomy=0)
    results = []
    for spec in a.tree:
        name, _, tree = spec.partition("=")
        out_file = f"/tmp/callgrind.hybrid_step.{name}.out"
        cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out_file}", sys.executable]
        cmd += [os.path.join(HERE, "serving.py"), "--worker", "serving", "--params", json.dumps(params)]
        env = {**os.environ, "PYTHONPATH": os.path.abspath(tree)}
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd="/tmp", check=True)
        r = json.loads(res.stdout.strip().splitlines()[-1])
        if not r["compiled"]:
            raise SystemExit(f"{name}: {tree} has no compiled modules in place")
        counts = serving._phase_instructions(out_file)
        per_unit = serving._per_unit(r, counts)
        results.append({"tree": name, "path": tree, "result": r, "instructions": counts, "per_unit": per_unit})
        print(
            f"{name}: {per_unit['per_prompt_block']:,.0f} per prompt block, "
            f"{per_unit['per_decode_step_per_request']:,.0f} per decode step per request",
            flush=True,
        )
    write_results(a.out, params, results)


if __name__ == "__main__":
    main()
