"""`dsv4 bench frontdoor`'s reading of a load level: what the clients received (service.frontdoor_load records)
against when the synthetic workers emitted it (their emit logs, same host clock).

Order and loss are read from the text alone (token k of every stream is one letter: service.frontdoor_workers); the
added latency of a decode token (k >= 1) emitted in the level's window is its receive time minus its emit time.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator

from service.bench_serve import pct
from service.frontdoor_workers import token_for

LETTER = "a"  # the tiny tokenizer's letter that token id letter_id decodes to (the bench finds that id)


def _decode_latencies(recv, sent: list[float], t0: float, t_end: float) -> Iterator[tuple[float, float]]:
    """(emit time, added ms) of each decode token (k >= 1) emitted in [t0, t_end]; recv[k]: its receive time."""
    for k, got in enumerate(recv):
        if 1 <= k < len(sent) and t0 <= sent[k] <= t_end:
            yield sent[k], (got - sent[k]) * 1e3


def score(records, emits: dict, t0: float, t_end: float, max_tokens: int, letter_id: int) -> dict:
    """Order, loss, delivered tokens in [t0, t_end] and added latency of the decode tokens (k >= 1) emitted in it."""
    expected = "".join(chr(ord(LETTER) + token_for(k, letter_id) - letter_id) for k in range(max_tokens))
    lost = disorder = errors = in_window = 0
    added: list[float] = []
    seen: list[float] = []  # the same tokens as the client's loop read them (the lean client only)
    for r in records:
        errors += r.error is not None
        lost += max(0, max_tokens - len(r.text)) if r.error is None else 0
        disorder += not expected.startswith(r.text)
        in_window += sum(t0 <= t <= t_end for t in r.recv)
        sent = emits.get(r.tag, [])
        added.extend(ms for _, ms in _decode_latencies(r.recv, sent, t0, t_end))
        seen.extend(ms for _, ms in _decode_latencies(r.recv_seen, sent, t0, t_end))
    kinds = Counter(r.error.split(":", 1)[0][:80] for r in records if r.error)
    return {
        "lost": lost,
        "disorder": disorder,
        "errors": errors,
        "error_kinds": dict(kinds.most_common(3)),
        "in_window": in_window,
        "tokens": sum(len(r.text) for r in records),
        "p50": pct(added, 0.5),
        "p99": pct(added, 0.99),
        "p99_seen": pct(seen, 0.99) if seen else 0.0,
    }


def dump_level(path: str, replicas: int, streams: int, records, emits: dict, t0: float, t_end: float) -> None:
    """--dump: one JSON line a level, every decode token emitted in the window as [emit time, added ms] (time.time()),
    for reading the tail's shape: pauses that hit every stream at once (a collector pass, a process off its core)
    show as runs of late tokens with nearby emit times, steady queueing as a wide spread."""
    tokens = [
        (t, round(ms, 3)) for r in records for t, ms in _decode_latencies(r.recv, emits.get(r.tag, []), t0, t_end)
    ]
    with open(path, "a") as f:
        f.write(json.dumps({"replicas": replicas, "streams": streams, "tokens": sorted(tokens)}) + "\n")
