"""How the `kvfsm` command line ends on an error: every command exits with a documented code and a message,
never a traceback, whatever its input.

Exit codes: 0 success; 1 the check a command runs failed (`gen --check` and `schema --check` stale, an
illegal step in `replay`, a violation in `check`); 2 input the command cannot use (an invalid spec or config,
a file past a bound of kvfsm.input_limits, not UTF-8, unreadable or unwritable, bad options); 3 `check
--require-all` with a transition unreached; INTERNAL (70, sysexits' EX_SOFTWARE) an error inside kvfsm
itself, reported on one line with a hint (KVFSM_TRACEBACK=1 shows the traceback).
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

import typer
from rich.console import Console
from typer.core import TyperGroup

from kvfsm.errors import ConfigError, InputRejected

if TYPE_CHECKING:
    from typer._click import Context  # the context class TyperGroup.invoke declares (typer vendors click)

INVALID = 2
INTERNAL = 70
TRACEBACK_VAR = "KVFSM_TRACEBACK"

_err = Console(stderr=True, highlight=False, soft_wrap=True)


def _one_line(text: str, limit: int = 300) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


class GuardedGroup(TyperGroup):
    """The command group: a typed input error that a command lets through exits INVALID with its message
    (each spec error on its own `file:line` line); anything else exits INTERNAL with one line."""

    def invoke(self, ctx: Context) -> Any:
        try:
            return super().invoke(ctx)
        except Exception as exc:
            if type(exc).__module__.split(".")[0] in ("click", "typer"):
                raise  # the command line's own exits and usage errors: click prints them (exit 0, 1 or 2)
            if os.environ.get(TRACEBACK_VAR) == "1" and not _is_input_error(exc):
                raise
            raise typer.Exit(_report(exc, ctx.invoked_subcommand or "")) from None


def _is_input_error(exc: Exception) -> bool:
    from kvfsm.spec import SpecInvalid  # here, not at the top: `kvfsm --help` builds no spec model

    return isinstance(exc, (SpecInvalid, InputRejected, ConfigError, OSError))


def _report(exc: Exception, command: str) -> int:
    """Print what `exc` says on stderr; return the exit code it gets."""
    from kvfsm.spec import SpecInvalid

    if isinstance(exc, SpecInvalid):
        for e in exc.errors:
            _err.print(str(e), markup=False)
        return INVALID
    if isinstance(exc, (InputRejected, ConfigError)):
        _err.print(_one_line(str(exc), 2000), markup=False)
        return INVALID
    if isinstance(exc, OSError):
        where = exc.filename if exc.filename is not None else f"kvfsm {command}".rstrip()
        _err.print(_one_line(f"{where}: {exc.strerror or exc}"), markup=False)
        return INVALID
    _err.print(
        _one_line(f"kvfsm {command}: internal error: {type(exc).__name__}: {exc}")
        + f" (a bug in kvfsm: rerun with {TRACEBACK_VAR}=1 for the traceback, and report it)",
        markup=False,
    )
    return INTERNAL


__all__ = ["INTERNAL", "INVALID", "TRACEBACK_VAR", "GuardedGroup"]
