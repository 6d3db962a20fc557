"""Spec errors: every one names the file, the line and the element, so an author can jump straight to it."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class SpecError:
    file: str
    line: int
    element: str
    message: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.element}: {self.message}"


class SpecInvalid(Exception):
    """Raised with every error found; `str()` is one line per error."""

    def __init__(self, errors: list[SpecError]) -> None:
        self.errors = sorted(errors, key=lambda e: (e.file, e.line, e.element, e.message))
        super().__init__("\n".join(map(str, self.errors)))
