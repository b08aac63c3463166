"""The corpus of bad inputs and faults, one verdict line per case.

Every test marked ``bad_input`` is a case: a mistyped flag, a bad data file, a crafted
checkpoint, a full disk, a launcher fault, a plan that cannot run, ... Each asserts what the user
must see (one ``error:`` line naming the value, the rule and the fix, exit 2, before step 1; or a
traceback and exit 1 for a bug) and that their files are intact afterwards. A case is *handled*
when its test passes, *mishandled* when it fails; a case that cannot run here (a full disk needs
root to mount a small tmpfs) is *not run*, with the reason.

    python benchmarks/bad_inputs.py            # the whole corpus, slow cases included
    python benchmarks/bad_inputs.py --fast     # without the slow tier
    python benchmarks/bad_inputs.py -k save_hf # a subset (pytest's -k)

Exit status: 0 when every case run was handled, 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


class Verdicts:
    """A pytest plugin collecting one verdict per test case."""

    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str]] = []

    def pytest_runtest_logreport(self, report) -> None:
        if report.when == "call" or (report.when == "setup" and not report.passed):
            if report.passed:
                verdict, why = "handled", ""
            elif report.skipped:
                verdict = "not run"
                why = report.longrepr[2] if isinstance(report.longrepr, tuple) else ""
            else:
                verdict = "MISHANDLED"
                why = str(report.longrepr).strip().splitlines()[-1][:160]
            self.rows.append((verdict, report.nodeid, why))
            print(f"{verdict:10} {report.nodeid}" + (f"  ({why})" if why else ""), flush=True)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--fast", action="store_true", help="leave out the slow tier")
    p.add_argument("-k", default=None, help="only the cases matching (pytest -k)")
    args = p.parse_args()
    marker = "bad_input and not slow" if args.fast else "bad_input"
    argv = [str(ROOT / "tests"), "-m", marker, "-p", "no:cacheprovider"]
    argv += ["-p", "no:terminal"]  # the verdict lines are the output
    if args.k:
        argv += ["-k", args.k]
    verdicts = Verdicts()
    start = time.perf_counter()
    pytest.main(argv, plugins=[verdicts])
    counts = Counter(verdict for verdict, _, _ in verdicts.rows)
    total = len(verdicts.rows)
    print(
        f"{total} cases: {counts['handled']} handled, {counts['MISHANDLED']} mishandled, "
        f"{counts['not run']} not run ({time.perf_counter() - start:.0f} s)"
    )
    return 0 if total and not counts["MISHANDLED"] else 1


if __name__ == "__main__":
    sys.exit(main())
