"""Python's cycle collector in the service's long-lived processes: the start-up heap frozen out of its walks, every
pass timed.

Why it matters: a pass of generation g walks every tracked object of generations 0..g while holding the GIL, so it
is a pause of the whole process: of every stream an ingress replica, a router or a proxy carries, and of the engine
thread's step in a prefill or decode worker.
- A full pass walks everything the process holds. In a worker that is torch, Ray and the engine: ~210K objects,
  90-115 ms a pass on the 2-core box (`tests/engine/test_gc_pauses.py` says how it was read). It comes once ~25% of
  the heap's size was promoted since the last one, which request churn reaches over and over. What exists once
  the process is warm never becomes garbage: `freeze_startup_heap` moves it to the permanent generation, so a full
  pass walks only what was made since.
- A young pass walks what was allocated since the last one and is still alive: in an ingress replica, every
  in-flight request's objects (16-27 ms at 96 streams). It comes after every `threshold` net allocations, so
  request objects must not form reference cycles (service.body_writer, service.sse_chunks): cyclic garbage is freed
  only by these passes, and its allocations are what makes them frequent.
`watch_pauses` puts every pass into `dsv4_gc_pause_seconds{component, generation}`, the number to watch on a
dashboard when a token's latency tail grows.
"""

from __future__ import annotations

import gc
import time

_watched: set[str] = set()  # components whose callback this process installed (one each)


def freeze_startup_heap(component: str) -> int:
    """Collect once, then move every object this process holds now to the permanent generation (no pass walks them
    again); call once the process is warm (model loaded, compiled, listening). Returns the frozen object count, also
    set as `dsv4_gc_frozen_objects{component}`. Only for a process of its own (an actor, a replica): in a shared
    process (a test run, an in-process engine) frozen objects that became garbage in a cycle would never be freed."""
    from engine.telemetry.metrics import GC_FROZEN

    gc.collect()
    gc.freeze()
    frozen = gc.get_freeze_count()
    GC_FROZEN.labels(component).set(frozen)
    return frozen


def in_own_process() -> bool:
    """Whether this process is a Ray actor's (a worker, a router, a Serve replica): a process the service owns whole."""
    try:
        import ray
    except ImportError:
        return False
    return ray.is_initialized() and ray.get_runtime_context().get_actor_id() is not None


def watch_pauses(component: str) -> None:
    """Time every collector pass of this process into the pause histogram, labelled `component`; once a component."""
    if component in _watched:
        return
    from engine.telemetry.metrics import GC_PAUSE

    by_generation = {g: GC_PAUSE.labels(component, str(g)) for g in range(3)}
    started = [0.0]

    def on_pass(phase: str, info: dict) -> None:
        if phase == "start":
            started[0] = time.perf_counter()
        else:
            by_generation[info["generation"]].observe(time.perf_counter() - started[0])

    gc.callbacks.append(on_pass)
    _watched.add(component)
