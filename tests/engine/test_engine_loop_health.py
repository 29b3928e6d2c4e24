"""EngineLoop health on the real tiny engine: a failed step ends the loop and says so; a step that never returns
is reported once it outlasts the stall bound (an idle loop never is); the watchdog ends the process (here: a
recorded exit) for a dead loop at once and for a stalled one after its grace, never after a deliberate stop;
a worker exposes the fault hook only when built with test hooks."""

from __future__ import annotations

import queue
import time

import pytest

from engine.execution.sampling_params import SamplingParams
from engine.loading.load import load_engine
from engine.runtime.engine_loop import EngineLoop
from engine.runtime.health import EXIT_CODE, HealthOptions, LoopWatchdog
from engine.runtime.loop_errors import LoopStopped, StepFailed

pytestmark = pytest.mark.filterwarnings(
    "ignore::pytest.PytestUnhandledThreadExceptionWarning"
)  # the failed loop re-raises

PARAMS = SamplingParams(max_new_tokens=200, ignore_eos=True)


class Sink:
    def __init__(self):
        self.queue: queue.Queue = queue.Queue()

    def put(self, item):
        self.queue.put(item)


@pytest.fixture
def loop():
    lp = EngineLoop(load_engine(warmup=False), name="test-health")
    yield lp
    lp.stop()


def start(loop: EngineLoop, rid: str) -> Sink:
    sink = Sink()
    loop.call(lambda e: (e.add_request([5, 6, 7, 8], PARAMS, rid), loop.subscribe(rid, sink))).result(30)
    return sink


def wait_for(cond, timeout=20.0):
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, "condition not met"
        time.sleep(0.02)


def test_idle_and_serving_loop_is_healthy(loop):
    time.sleep(0.4)  # idle longer than the bound: an idle loop is not stalled
    assert loop.problem(0.2) is None and loop.busy_since is None
    sink = start(loop, "a")
    first = sink.queue.get(timeout=30)
    assert first.token_id is not None and loop.problem(30.0) is None


def test_failed_step_ends_the_loop_and_fails_its_requests(loop):
    sink = start(loop, "a")
    sink.queue.get(timeout=30)
    loop.inject_fault("raise")
    item = sink.queue.get(timeout=30)
    while not isinstance(item, BaseException):
        item = sink.queue.get(timeout=30)
    assert isinstance(item, StepFailed) and "injected step failure" in str(item)
    wait_for(lambda: not loop.alive)
    assert loop.problem(300.0) == "engine loop ended: RuntimeError: injected step failure (test hook)"
    with pytest.raises(LoopStopped):
        loop.call(lambda e: None).result(5)


def test_a_calls_failed_collective_ends_the_loop_but_other_call_errors_do_not(loop):
    """A call whose collective failed (a peer rank died: gloo's transport error) leaves the ranks out of step: the
    loop ends and its streams get LoopStopped (the worker's death, retryable); an ordinary error stays the call's."""
    with pytest.raises(ValueError, match="bad input"):
        loop.call(lambda e: (_ for _ in ()).throw(ValueError("bad input"))).result(10)
    assert loop.alive
    sink = start(loop, "a")
    sink.queue.get(timeout=30)
    gloo = RuntimeError("[gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:1: Connection reset by peer")
    with pytest.raises(StepFailed, match="Connection reset by peer"):
        loop.call(lambda e: (_ for _ in ()).throw(gloo)).result(10)
    wait_for(lambda: not loop.alive)
    item = sink.queue.get(timeout=30)
    while not isinstance(item, BaseException):
        item = sink.queue.get(timeout=30)
    assert isinstance(item, LoopStopped)


def test_hung_step_is_reported_after_the_bound_and_stop_ends_it(loop):
    sink = start(loop, "a")
    sink.queue.get(timeout=30)
    loop.inject_fault("hang")
    wait_for(lambda: loop.busy_since is not None and time.monotonic() - loop.busy_since > 0.6)
    assert loop.alive and loop.problem(60.0) is None  # a long step within its bound is fine
    problem = loop.problem(0.5)
    assert problem.startswith("engine thread stuck for") and "stall bound 0.5 s" in problem
    loop.stop(timeout=10)
    assert not loop.alive and "injected hang ended by stop" in loop.problem(0.5)


def test_inject_fault_rejects_unknown_kinds(loop):
    with pytest.raises(ValueError, match="fault must be one of"):
        loop.inject_fault("explode")


def test_watchdog_exits_for_a_dead_loop(loop):
    exits = []
    dog = LoopWatchdog(loop, 300.0, "w", exit_process=exits.append, interval_s=0.05)
    start(loop, "a").queue.get(timeout=30)
    loop.inject_fault("raise")
    wait_for(lambda: exits, timeout=20)
    assert exits == [EXIT_CODE]
    dog.stop()


def test_watchdog_exits_for_a_stall_only_after_its_grace(loop):
    exits = []
    dog = LoopWatchdog(loop, 0.3, "w", exit_process=exits.append, interval_s=0.05, stall_exit_grace_s=1.0)
    start(loop, "a").queue.get(timeout=30)
    loop.inject_fault("hang")
    wait_for(lambda: loop.problem(0.3) is not None)
    assert not exits  # unhealthy (the router moves its streams) but not ended yet
    wait_for(lambda: exits, timeout=20)
    assert exits == [EXIT_CODE] and time.monotonic() - loop.busy_since >= 1.3
    dog.stop()


def test_watchdog_ignores_a_deliberate_stop(loop):
    exits = []
    dog = LoopWatchdog(loop, 300.0, "w", exit_process=exits.append, interval_s=0.05)
    dog.stop()
    loop.stop()
    time.sleep(0.3)
    assert not exits


def test_health_options_and_the_workers_fault_hook():
    from prefill_worker.worker import PrefillWorker

    with pytest.raises(ValueError, match="stall_timeout_s must be > 0"):
        HealthOptions(stall_timeout_s=0)
    off = PrefillWorker("p-off", None)
    on = PrefillWorker("p-on", None, health=HealthOptions(stall_timeout_s=0.5, test_hooks=True))
    try:
        with pytest.raises(PermissionError, match="test hooks are off"):
            off.inject_fault("raise")
        assert on.stats().healthy and on.ping() == on.incarnation
        on.inject_fault("raise")
        on.loop.call(lambda e: e.add_request([5, 6, 7], SamplingParams(max_new_tokens=2), "x"))
        wait_for(lambda: not on.loop.alive)
        assert not on.stats().healthy and "injected step failure" in on.stats().problem
        with pytest.raises(RuntimeError, match="engine loop ended"):
            on.ping()
    finally:
        off.shutdown()
        on.shutdown()
