"""tests/mutation/rekey.py's rewrite of the GPU pass's verdicts (the mutant generation around it is mutmut's)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import rekey  # noqa: E402


def test_a_verdict_moves_to_its_mutants_new_text_and_a_shared_old_text_is_left() -> None:
    verdicts = [
        {"function": "m.x_f", "change": "- a = 1, b\n+ a = 2, b", "status": "killed"},
        {"function": "m.x_f", "change": "- c = d\n+ c = None", "status": "survived"},
        {"function": "m.x_g", "change": "- t=r,\n+ t=None,", "status": "killed"},
        {"function": "m.x_h", "change": "- kept\n+ as it was", "status": "killed"},
    ]
    moves = {
        ("m.x_f", "- a = 1, b\n+ a = 2, b"): {"- a = 1,\n+ a = 2,"},
        ("m.x_f", "- c = d\n+ c = None"): {"- c = d\n+ c = None"},
        ("m.x_g", "- t=r,\n+ t=None,"): {"- t=r,\n+ t=None,", "- t=r,\n- )\n+ )"},  # two mutants, one old text
    }
    rekeyed, ambiguous = rekey.rekey_verdicts(verdicts, moves)
    assert rekeyed == 2 and ambiguous == [verdicts[2]]
    assert [v["change"] for v in verdicts] == [
        "- a = 1,\n+ a = 2,",
        "- c = d\n+ c = None",
        "- t=r,\n+ t=None,",
        "- kept\n+ as it was",
    ]
    assert [v["status"] for v in verdicts] == ["killed", "survived", "killed", "killed"]
