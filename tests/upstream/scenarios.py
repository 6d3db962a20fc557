"""The scripted decode workloads of the differential test, as plain data.

A scenario is run by `harness.run_scenario` step by step as SGLang's scheduler would; nothing here knows
which manager runs it, so the same list drives upstream's manager and kvfsm's adapter.
"""

from __future__ import annotations

from dataclasses import dataclass, field

WIDE = 2**32  # token ids from here on take upstream's u64 page encoding


@dataclass(frozen=True)
class ReqSpec:
    """One request. It arrives at step `start` with its prompt's KV already transferred and its first
    output token sampled (as a PD decode instance receives it), then decodes `decode` more tokens and ends
    at step `start + decode` by `end` ("finish": length; "abort")."""

    rid: str
    prompt: tuple[int, ...]
    decode: int
    start: int = 0
    end: str = "finish"
    extra_key: str | None = None
    cache_salt: str | None = None
    lora_id: str | None = None
    # Tokens of the prompt the decode-side radix tree already holds (page-aligned): matched and locked at
    # admission, owned by the tree (`cache_protected_len`).
    prefix: int = 0
    # Speculative decoding: slots allocated past what is needed, at admission and whenever the row grows.
    spec_extra: int = 0
    out_base: int = 50_000  # output token i is out_base + i

    def outputs(self) -> tuple[int, ...]:
        return tuple(self.out_base + i for i in range(self.decode + 1))


@dataclass(frozen=True)
class Scenario:
    name: str
    page_size: int
    requests: tuple[ReqSpec, ...]
    stride: int | None = None  # SGLANG_HICACHE_DECODE_OFFLOAD_STRIDE; None: one page
    tp: int = 1
    pool: str = "mha"  # or "mla"
    layers: int = 2
    heads: int = 2  # per rank (MHA)
    head_dim: int = 4
    device_tokens: int = 1024
    host_ratio: float = 2.0
    rank_host_ratio: tuple[float, ...] | None = None  # per TP rank, overriding host_ratio
    # Steps at which the scheduler's progress check is not reached (a copy stays unacknowledged).
    skip_progress: frozenset[int] = frozenset()
    # Steps at which the scheduler asks to retract (`drain_before_retraction`, before the decode).
    retract_at: frozenset[int] = frozenset()
    # Ordinals (0-based, over the whole run, per rank) of storage page writes that fail.
    fail_backup_pages: frozenset[int] = frozenset()
    # Steps run after the last request ended, so every copy and backup is acknowledged.
    drain_steps: int = 3
    tags: frozenset[str] = field(default_factory=frozenset)

    @property
    def steps(self) -> int:
        return max(r.start + r.decode for r in self.requests) + 1 + self.drain_steps


def _prompt(n: int, base: int = 1) -> tuple[int, ...]:
    return tuple(base + i for i in range(n))


def _plain(ps: int, stride: int | None) -> Scenario:
    tag = f"s{stride}" if stride else "s-"
    chunk = max(ps, stride or 0)
    return Scenario(
        name=f"plain-p{ps}-{tag}",
        page_size=ps,
        stride=stride,
        device_tokens=max(1024, 16 * chunk),
        requests=(
            ReqSpec("a", _prompt(3 * ps + 1), decode=4 * chunk + 2),
            ReqSpec("b", _prompt(2 * ps, base=900), decode=3 * chunk, start=1),
            ReqSpec("c", _prompt(max(ps - 1, 1), base=7000), decode=2 * chunk + 1, start=2),
        ),
        tags=frozenset({"plain"}),
    )


def _scenarios() -> list[Scenario]:
    out: list[Scenario] = []
    for ps, strides in ((1, (None, 3, 8)), (4, (None, 8, 10)), (16, (None, 32)), (64, (None, 128))):
        out += [_plain(ps, s) for s in strides]
    ps = 4
    out.append(
        Scenario(
            name="namespaced",
            page_size=ps,
            requests=(
                ReqSpec("plain", _prompt(9), decode=10),
                ReqSpec("key", _prompt(9), decode=10, extra_key="tenant-a"),
                ReqSpec("salt", _prompt(9), decode=10, cache_salt="s3cret"),
                ReqSpec("both", _prompt(9), decode=10, extra_key="tenant-a", cache_salt="s3cret"),
                ReqSpec("empty-key", _prompt(9), decode=10, extra_key=""),
                ReqSpec("empty-salt", _prompt(9), decode=10, cache_salt=""),
                ReqSpec("lora", _prompt(9), decode=10, extra_key="tenant-a", lora_id="lora7"),
                ReqSpec("utf8", _prompt(9), decode=10, extra_key="tenant-ü", cache_salt="ß"),
            ),
            tags=frozenset({"namespaced"}),
        )
    )
    out.append(
        Scenario(
            name="wide-tokens",
            page_size=ps,
            requests=(
                ReqSpec("wide-prompt", (1, 2, 3, 4, 5, 2**40, 7, 8, 9, 10), decode=9),
                ReqSpec("wide-out", _prompt(6), decode=9, out_base=2**33),
                ReqSpec("max", _prompt(5), decode=5, out_base=2**63 - 6),
            ),
            tags=frozenset({"wide"}),
        )
    )
    out.append(
        Scenario(
            name="prefix-matched",
            page_size=ps,
            requests=(
                ReqSpec("p8", _prompt(13), decode=9, prefix=8),
                ReqSpec("p4", _prompt(13, base=300), decode=9, prefix=4, start=1),
                ReqSpec("p-all", _prompt(12, base=600), decode=6, prefix=12, start=1),
            ),
            tags=frozenset({"prefix"}),
        )
    )
    out.append(
        Scenario(
            name="prefix-matched-p1",
            page_size=1,
            requests=(ReqSpec("p5", _prompt(9), decode=7, prefix=5),),
            tags=frozenset({"prefix"}),
        )
    )
    out.append(
        Scenario(
            name="finish-on-and-off-boundary",
            page_size=ps,
            stride=8,
            requests=(
                # all_tokens - aligned prompt at the end: 8 (on a chunk boundary) and 11 (off it).
                ReqSpec("on", _prompt(8), decode=8),
                ReqSpec("off", _prompt(8, base=400), decode=11),
                ReqSpec("on-unaligned-prompt", _prompt(10, base=800), decode=6),
            ),
            tags=frozenset({"finish"}),
        )
    )
    out.append(
        Scenario(
            name="abort-mid-offload",
            page_size=ps,
            # a's chunk is submitted at step 4; the progress check of step 5 is skipped; a aborts at step 5.
            requests=(
                ReqSpec("a", _prompt(8), decode=5, end="abort"),
                ReqSpec("b", _prompt(8, base=100), decode=9),
            ),
            skip_progress=frozenset({5}),
            tags=frozenset({"abort"}),
        )
    )
    out.append(
        Scenario(
            # Requests that end at the same step, most with a chunk due at their last call: a flush finishes them
            # together and one progress check acknowledges their last copies, so their releases come as one batch
            name="finish-together",
            page_size=ps,
            requests=tuple(
                ReqSpec(f"t{i}", _prompt(4 + i, base=100 * i + 1), decode=9, prefix=4 * (i % 2)) for i in range(8)
            ),
            tags=frozenset({"plain"}),
        )
    )
    out.append(
        Scenario(
            name="abort-while-copies-pile-up",
            page_size=ps,
            requests=(ReqSpec("a", _prompt(5), decode=13, end="abort"),),
            skip_progress=frozenset({6, 7, 8, 9, 10, 11, 12, 13}),
            retract_at=frozenset({9}),
            tags=frozenset({"abort"}),
        )
    )
    out.append(
        Scenario(
            name="host-pool-full",
            page_size=ps,
            device_tokens=80,
            host_ratio=0.2,
            # 16 host slots + padding page; three requests with 8-token chunks outrun it while backups lag. The
            # device pool holds all three at their last step (3 x 24 tokens): in SGLang's order the finished
            # requests' pages return only at the end of that step's free group, after the step's new slots.
            requests=tuple(ReqSpec(f"r{i}", _prompt(4, base=100 * i + 1), decode=17) for i in range(3)),
            stride=8,
            skip_progress=frozenset({9, 10}),
            tags=frozenset({"host-full"}),
        )
    )
    out.append(
        Scenario(
            name="backup-failure",
            page_size=ps,
            stride=8,
            requests=(
                ReqSpec("a", _prompt(4), decode=17),
                ReqSpec("b", _prompt(4, base=500), decode=17),
            ),
            fail_backup_pages=frozenset({1, 6}),
            tags=frozenset({"backup-failure"}),
        )
    )
    out.append(
        Scenario(
            name="spec-decode-overalloc",
            page_size=ps,
            requests=(
                ReqSpec("s", _prompt(7), decode=10, spec_extra=5),
                ReqSpec("s-prefix", _prompt(9, base=40), decode=6, spec_extra=3, prefix=4),
            ),
            tags=frozenset({"spec"}),
        )
    )
    out.append(
        Scenario(
            name="spec-decode-overalloc-p1",
            page_size=1,
            stride=2,
            requests=(ReqSpec("s", _prompt(3), decode=7, spec_extra=4),),
            tags=frozenset({"spec"}),
        )
    )
    out.append(
        Scenario(
            name="mla",
            page_size=ps,
            pool="mla",
            requests=(ReqSpec("m", _prompt(6), decode=9), ReqSpec("n", _prompt(9, base=77), decode=5, start=1)),
            tags=frozenset({"mla"}),
        )
    )
    out.append(
        Scenario(
            name="tp2",
            page_size=ps,
            tp=2,
            requests=(
                ReqSpec("a", _prompt(6), decode=9),
                ReqSpec("b", _prompt(8, base=70), decode=6, start=1, extra_key="t"),
            ),
            skip_progress=frozenset({4}),
            tags=frozenset({"tp"}),
        )
    )
    out.append(
        Scenario(
            name="tp2-host-full-on-one-rank",
            page_size=ps,
            tp=2,
            stride=8,
            device_tokens=64,
            # Rank 1's host pool (one page) never fits an 8-token chunk; rank 0's always does.
            rank_host_ratio=(2.0, 0.01),
            requests=(ReqSpec("a", _prompt(4), decode=12),),
            retract_at=frozenset({11}),
            tags=frozenset({"tp", "host-full"}),
        )
    )
    return out


SCENARIOS: list[Scenario] = _scenarios()
BY_NAME: dict[str, Scenario] = {s.name: s for s in SCENARIOS}
