"""The README's integration example as runnable source, with its step count substituted.

`example_source(readme_text, decode_steps)` finds the first ```python block of the "Integrating with an
engine" section and rewrites its `DECODE_STEPS = <n>` line. The example writes its files to a temporary
directory of its own, so the source runs from any working directory (against a checkout or an installed
wheel). Kept free of the checkout's paths for that reason: callers pass the README's text.
"""

from __future__ import annotations

import re

SECTION = "## Integrating with an engine"
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_STEPS = re.compile(r"^DECODE_STEPS = \d+(?=\s|#|$)", re.M)


class ReadmeExampleError(LookupError):
    """The README no longer has the integration example in the form this helper reads."""


def example_source(readme_text: str, decode_steps: int) -> str:
    """The integration example's code with `DECODE_STEPS = decode_steps`."""
    if not isinstance(decode_steps, int) or isinstance(decode_steps, bool) or decode_steps < 0:
        raise ValueError(f"decode_steps must be a non-negative int, got {decode_steps!r}")
    _, found, section = readme_text.partition(SECTION)
    if not found:
        raise ReadmeExampleError(f"README has no {SECTION!r} section")
    section = section.split("\n## ", 1)[0]  # this section only
    block = _BLOCK.search(section)
    if block is None:
        raise ReadmeExampleError(f"README's {SECTION!r} section has no ```python block")
    code = block.group(1)
    hits = _STEPS.findall(code)
    if len(hits) != 1:
        raise ReadmeExampleError(f"README's integration example must set DECODE_STEPS = <int> on one line of its "
                                 f"own, found {len(hits)} such lines")
    return _STEPS.sub(f"DECODE_STEPS = {decode_steps}", code)
