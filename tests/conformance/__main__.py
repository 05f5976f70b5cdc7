"""Run the conformance matrix and print a summary table.

    python -m tests.conformance            # the fast tier (the draws of the CI test run)
    python -m tests.conformance --full     # 16x the Monte Carlo draws
    python -m tests.conformance -k chain   # only cases whose name contains "chain"

One row per case, one column per estimator (``+r``: with the ``block_grad`` route); each entry
reads ``passed/cells`` of that (case, estimator), ``R`` when the cells are expected raises (or an
allowed raise happened), and the failed checks' names. The failures' messages follow the table.
The exit status is 1 when a cell failed.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import warnings


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tests.conformance", description=__doc__.split("\n\n")[0]
    )
    parser.add_argument("--full", action="store_true", help="16x the Monte Carlo draws")
    parser.add_argument("-k", default="", help="only cases whose name contains this")
    parser.add_argument("-q", action="store_true", help="no failure messages, only the table")
    args = parser.parse_args(argv)
    if args.full:
        os.environ["GRADROUTE_CONFORMANCE_FULL"] = "1"
    # import after the environment is set: checks.py reads the tier at import
    import pyro
    import torch

    from .cases import CASES
    from .checks import ESTIMATORS, cells, run_cell
    from .test_structured import STRUCTURED_CASES

    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    cases = [c for c in CASES + STRUCTURED_CASES if args.k in c.name]
    results: dict = {}
    failures = []
    t0 = time.perf_counter()
    for case, est, routed, check in cells(cases):
        pyro.set_rng_seed(0)
        torch.set_default_dtype(torch.float32)
        key = (case.name, est + ("+r" if routed else ""))
        entry = results.setdefault(key, {"cells": 0, "passed": 0, "raised": 0, "failed": []})
        entry["cells"] += 1
        try:
            out = run_cell(case, est, routed, check)
        except Exception as e:  # a failed cell (AssertionError) or an unexpected error
            entry["failed"].append(check)
            failures.append((f"{case.name}-{key[1]}-{check}", f"{type(e).__name__}: {e}"))
            continue
        entry["passed"] += 1
        if out in ("raised", "expected-raise"):
            entry["raised"] += 1
    elapsed = time.perf_counter() - t0
    cols = [e + s for s in ("", "+r") for e in ESTIMATORS]
    print(f"| case | {' | '.join(cols)} |")
    print("|---" * (len(cols) + 1) + "|")
    tot = {"cells": 0, "passed": 0, "raised": 0, "failed": 0}
    for case in cases:
        row = []
        for col in cols:
            e = results.get((case.name, col))
            if e is None:
                row.append("")
                continue
            tot["cells"] += e["cells"]
            tot["passed"] += e["passed"]
            tot["raised"] += e["raised"]
            tot["failed"] += len(e["failed"])
            if e["failed"]:
                row.append(f"**FAIL** {','.join(e['failed'])}")
            elif e["raised"] == e["cells"]:
                row.append("R")
            else:
                row.append(f"{e['passed']}/{e['cells']}" + (" R" if e["raised"] else ""))
        print(f"| {case.name} | {' | '.join(row)} |")
    tier = "full" if args.full else "fast"
    print(
        f"\n{tier} tier: {tot['cells']} cells, {tot['passed']} passed "
        f"({tot['raised']} of them expected or allowed raises), {tot['failed']} failed, {elapsed:.0f} s"
    )
    if failures and not args.q:
        print("\nFailures:")
        for name, msg in failures:
            print(f"\n--- {name}\n{msg[:2000]}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
