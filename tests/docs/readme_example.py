"""The integration example of docs/integrations.md as runnable source, with its step count substituted.

`example_source(page_text, decode_steps)` finds the first ```python block of the page's "Integrating with an
engine" section and rewrites its `DECODE_STEPS = <n>` line. The example writes its files to a temporary
directory of its own, so the source runs from any working directory (against a checkout or an installed
wheel). Kept free of the checkout's paths for that reason: callers pass the page's text (PAGE names it).
"""

from __future__ import annotations

import re

PAGE = "docs/integrations.md"  # the page that holds the example, relative to the checkout
SECTION = "## Integrating with an engine"
_BLOCK = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
_STEPS = re.compile(r"^DECODE_STEPS = \d+(?=\s|#|$)", re.M)


class ReadmeExampleError(LookupError):
    """The page no longer has the integration example in the form this helper reads."""


def example_source(page_text: str, decode_steps: int) -> str:
    """The integration example's code with `DECODE_STEPS = decode_steps`."""
    if not isinstance(decode_steps, int) or isinstance(decode_steps, bool) or decode_steps < 0:
        raise ValueError(f"decode_steps must be a non-negative int, got {decode_steps!r}")
    _, found, section = page_text.partition(SECTION)
    if not found:
        raise ReadmeExampleError(f"{PAGE} has no {SECTION!r} section")
    section = section.split("\n## ", 1)[0]  # this section only
    block = _BLOCK.search(section)
    if block is None:
        raise ReadmeExampleError(f"{PAGE}'s {SECTION!r} section has no ```python block")
    code = block.group(1)
    hits = _STEPS.findall(code)
    if len(hits) != 1:
        raise ReadmeExampleError(
            f"{PAGE}'s integration example must set DECODE_STEPS = <int> on one line of its "
            f"own, found {len(hits)} such lines"
        )
    return _STEPS.sub(f"DECODE_STEPS = {decode_steps}", code)
