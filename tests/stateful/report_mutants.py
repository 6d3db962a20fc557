"""Run the catalog mutants with shrinking on and write docs/mutants.md.

    .venv/bin/python tests/stateful/report_mutants.py [--shrink-seconds 20] [--out docs/mutants.md]

CI runs tests/stateful/test_mutants.py without shrinking (it only needs each mutant caught); this script
adds hypothesis's shrink phase, bounded per mutant, so the report can give the length of a minimal failing
example next to the steps the fuzzer took to find the first failure.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shrink-seconds", type=float, default=20.0, help="shrinking budget per mutant (0: off)")
    ap.add_argument("--out", default=str(ROOT / "docs" / "mutants.md"))
    args = ap.parse_args()
    os.environ["KVFSM_MUTANT_REPORT"] = str(Path(args.out).resolve())
    os.environ["KVFSM_MUTANT_SHRINK"] = str(args.shrink_seconds)
    os.chdir(ROOT)
    rc = pytest.main(["-q", "-p", "no:cacheprovider", str(ROOT / "tests" / "stateful" / "test_mutants.py")])
    print(f"report: {args.out}")
    return int(rc)


if __name__ == "__main__":
    sys.exit(main())
