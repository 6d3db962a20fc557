"""Run kvfsm under an address-space limit: `python tests/hostile/limited.py MIB cli ARGS...` runs the
`kvfsm` command line, `... MIB call MODULE:FUNCTION ARG` calls one reader on a path (`calls` on each of
several paths, printing a JSON list of outcomes), and `... MIB batch
FILE.json` runs every argv listed in the JSON file through the command line (typer's CliRunner) in this one
process and prints a JSON list of their exit codes, stderr and whether an exception escaped. The limit is set with
resource.setrlimit(RLIMIT_AS) in this process before kvfsm is imported, MIB above the address space the
interpreter has once torch is loaded (what torch maps depends on its build: a CUDA build maps gigabytes it
never touches on a CPU), so a reader that tries to expand its input into memory dies here with MemoryError
instead of taking the machine's memory.

A `call` prints the result's type and exits 0, or prints `error TYPE: message` and exits 3 for an
exception (any type: the test decides which are typed), so the test sees which error came out.
"""

from __future__ import annotations

import importlib
import resource
import sys


def cap_address_space(headroom_mib: int) -> tuple[int, int]:
    """Lower RLIMIT_AS to the address space this process maps now plus `headroom_mib` (never above the hard
    limit), and return the limits it replaced. Relative, not absolute: what an interpreter maps before any
    input depends on its torch build and, under a fuzzer, on its coverage tables."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    with open("/proc/self/statm") as f:
        mapped = int(f.read().split()[0]) * resource.getpagesize()
    limit = mapped + (headroom_mib << 20)
    if hard != resource.RLIM_INFINITY:
        limit = min(limit, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    return soft, hard


def main(argv: list[str]) -> int:
    mib, mode, *rest = argv
    import torch  # noqa: F401  (mapped before the limit: see the module doc)

    cap_address_space(int(mib))
    if mode == "cli":
        from kvfsm.cli import app

        sys.argv = ["kvfsm", *rest]
        app()
        return 0
    if mode == "batch":
        return _batch(rest[0])
    target, *args = rest
    module, func = target.split(":")
    fn = importlib.import_module(module)
    for part in func.split("."):
        fn = getattr(fn, part)
    if mode == "calls":  # one call per argument, one JSON line of outcomes
        import json

        print(json.dumps([_outcome(fn, arg) for arg in args]))
        return 0
    outcome = _outcome(fn, *args)
    print(outcome)
    return 3 if outcome.startswith("error") else 0


def _outcome(fn, *args) -> str:
    try:
        result = fn(*args)
    except BaseException as exc:  # noqa: BLE001 - reported to the test, which judges the type
        return f"error {type(exc).__module__}.{type(exc).__qualname__}: {str(exc)[:2000]}"
    return f"ok {type(result).__name__}"


def _batch(listing: str) -> int:
    import json

    from typer.testing import CliRunner

    from kvfsm.cli import app

    runner = CliRunner()
    results = []
    for argv in json.load(open(listing)):
        res = runner.invoke(app, argv)
        escaped = res.exception is not None and not isinstance(res.exception, SystemExit)
        err = res.stderr if len(res.stderr) <= 8000 else res.stderr[:4000] + " ... " + res.stderr[-4000:]
        results.append(
            {
                "argv": argv,
                "code": res.exit_code,
                "stderr": err,
                "escaped": f"{type(res.exception).__name__}: {res.exception}" if escaped else None,
            }
        )
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
