"""Where kvfsm's host time in transformers' offloading goes: one warm `kvfsm_fenced` run of
bench/transformers_offload.py's workload (smaller: --requests, --new-tokens), profiled with cProfile.

Prints, per swap-out and per restore call, the cumulative host time of the manager's entry points and of
the functions under them (kvfsm's and the engine's), so a design change can be aimed at the largest.
cProfile inflates Python-heavy calls; the ratios between them are what this probe is for.

  python bench/probes/transformers_swap_profile.py [--requests 32 --new-tokens 128] [--out FILE]
"""

from __future__ import annotations

import argparse
import cProfile
import io
import json
import pstats
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import transformers_offload as tob  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=128)
    ap.add_argument("--mode", default="kvfsm_fenced")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    args = argparse.Namespace(
        quick=False,
        model="small",
        cuda_graphs=False,
        device="cuda",
        requests=a.requests,
        new_tokens=a.new_tokens,
        prompt_min=32,
        prompt_max=256,
        page_size=32,
        num_blocks=192,
        max_batch_tokens=1024,
        host_gib=4.0,
        repeats=1,
        soft_reset=False,
        sync_timing=False,
        checked=False,
        async_batching=None,
        out=None,
    )
    model = tob.build_model(args, "cuda")
    inputs = tob.workload(args, model.config.vocab_size)
    tob.run(model, inputs, args, a.mode, False)  # warm: kernels compiled, caches filled
    prof = cProfile.Profile()
    prof.enable()
    row = tob.run(model, inputs, args, a.mode, False)
    prof.disable()
    buf = io.StringIO()
    st = pstats.Stats(prof, stream=buf).sort_stats("cumulative")
    st.print_stats(r"kvfsm|offload|restore|cache|copy", 45)
    text = buf.getvalue()
    print(
        {
            k: row[k]
            for k in (
                "offload_calls",
                "restore_calls",
                "time_offload_requests_s",
                "time_restore_s",
                "swapped_out",
                "restores",
            )
        }
    )
    print(text[-9000:])
    if a.out:
        Path(a.out).write_text(
            json.dumps({"row": {k: v for k, v in row.items() if k != "_outputs"}, "profile": text}, indent=1)
        )


if __name__ == "__main__":
    main()
