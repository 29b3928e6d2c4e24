"""The pool planner's decisions (service/planner.py) on made-up observations: bounds, hysteresis, cooldowns, the
N/(N-1) consolidation check, holding while a change lands and on stale data; pool specs and their errors."""

from __future__ import annotations

import pytest

from service.planner import (
    DOWN_REASONS,
    UP_REASONS,
    Planner,
    PlannerConfig,
    PoolBounds,
    PoolObservation,
    WorkerSample,
    parse_pool_spec,
)

CFG = PlannerConfig(
    interval_s=1.0,
    prefill_queue_tokens=1000,
    ttft_target_s=1.0,
    decode_streams=4,
    kv_target=0.8,
    itl_target_s=0.1,
    up_after=2,
    down_after=3,
    up_cooldown_s=5.0,
    down_cooldown_s=10.0,
    stale_s=5.0,
    min_samples=2,
)


def decode_pool(n: int, streams: int, now: float, bounds=(1, 4), **kw) -> PoolObservation:
    ready = tuple(WorkerSample(worker_id=f"d{i}", running=streams, at=now) for i in range(n))
    return PoolObservation(pool="decode", bounds=PoolBounds(min=bounds[0], max=bounds[1]), ready=ready, **kw)


def prefill_pool(n: int, now: float, queue_tokens=0, ttft=None, samples=10, bounds=(1, 4)) -> PoolObservation:
    ready = tuple(
        WorkerSample(worker_id=f"p{i}", queue_tokens=queue_tokens, ttft_p90_s=ttft, samples=samples, at=now)
        for i in range(n)
    )
    return PoolObservation(pool="prefill", bounds=PoolBounds(min=bounds[0], max=bounds[1]), ready=ready)


@pytest.mark.parametrize("text, bounds", [("3", (3, 3)), (" 1:4 ", (1, 4)), ("2:2", (2, 2)), (5, (5, 5))], ids=str)
def test_pool_specs(text, bounds):
    b = parse_pool_spec(text, "--decode-workers")
    assert (b.min, b.max) == bounds
    assert b.elastic == (bounds[0] != bounds[1])


@pytest.mark.parametrize("text", ["0", "4:2", "a", "1:b", "1:2:3", "", ":3", "-1:2", "0:2"])
def test_bad_pool_specs_name_the_value(text):
    with pytest.raises(ValueError) as e:
        parse_pool_spec(text, "--prefill-workers")
    assert "--prefill-workers" in str(e.value) and repr(text.strip()) in str(e.value)


def test_bad_config_names_the_field():
    with pytest.raises(ValueError, match="down_threshold"):
        PlannerConfig(down_threshold=1.5)
    with pytest.raises(ValueError, match="decode_streams"):
        PlannerConfig(decode_streams=0)


def test_fixed_pool_never_changes():
    planner = Planner(CFG)
    for t in range(20):
        d = planner.decide(decode_pool(2, streams=100, now=t, bounds=(2, 2)), now=t)
        assert not d.changed and d.reason == "steady"


def test_bounds_win_at_once():
    planner = Planner(CFG)
    d = planner.decide(PoolObservation(pool="decode", bounds=PoolBounds(min=2, max=3)), now=0)
    assert (d.current, d.desired, d.reason) == (0, 2, "below_min")
    d = planner.decide(decode_pool(5, streams=0, now=1, bounds=(1, 3)), now=1)
    assert (d.desired, d.reason) == (3, "above_max")


def test_burst_scales_up_after_confirmation_in_one_step():
    planner = Planner(CFG)
    # 3x the streams target on one worker: the first tick over target only confirms
    d = planner.decide(decode_pool(1, streams=12, now=0), now=0)
    assert not d.changed and d.reason == "confirming"
    d = planner.decide(decode_pool(1, streams=12, now=1), now=1)
    assert d.changed and d.desired == 3 and d.reason == "streams" and d.pressure == pytest.approx(3.0)
    assert d.reason in UP_REASONS


def test_up_step_capped_by_max_and_reports_at_max():
    planner = Planner(CFG)
    for t in (0, 1):
        d = planner.decide(decode_pool(2, streams=40, now=t, bounds=(1, 3)), now=t)
    assert d.desired == 3
    d = planner.decide(decode_pool(3, streams=40, now=9, bounds=(1, 3)), now=9)
    assert not d.changed and d.reason == "at_max"


def test_holds_while_a_change_lands_and_on_stale_data():
    planner = Planner(CFG)
    d = planner.decide(decode_pool(1, streams=40, now=0, starting=1), now=0)
    assert (d.current, d.desired, d.reason) == (2, 2, "settling")  # a starting worker is capacity on its way
    d = planner.decide(decode_pool(2, streams=0, now=0, draining=1), now=0)
    assert not d.changed and d.reason == "settling"
    d = planner.decide(decode_pool(2, streams=40, now=0), now=100)  # read 100 s ago
    assert not d.changed and d.reason == "stale"
    d = planner.decide(PoolObservation(pool="decode", bounds=PoolBounds(min=1, max=4), starting=0), now=0)
    assert d.reason == "below_min"  # no worker at all: the bound, not staleness


def test_up_cooldown_after_a_change():
    planner = Planner(CFG)
    for t in (0, 1):
        d = planner.decide(decode_pool(1, streams=6, now=t), now=t)
    assert d.desired == 2  # ceil(1 x 1.5)
    for t in (2, 3, 4):  # over target again right away: held by the cooldown (5 s since t=1)
        d = planner.decide(decode_pool(2, streams=6, now=t), now=t)
        assert not d.changed
    assert d.reason == "cooldown"
    d = planner.decide(decode_pool(2, streams=6, now=6), now=6)
    assert d.desired == 3


def test_consolidation_check_prevents_two_one_oscillation():
    """Two workers each at 40% of target: one alone would be at 80% (over the 0.6 threshold): keep both,
    however long it stays so (Dynamo's 2 <-> 1 oscillation, ai-dynamo/dynamo#9294)."""
    planner = Planner(CFG)
    for t in range(30):
        d = planner.decide(prefill_pool(2, now=t, queue_tokens=400), now=t)
        assert not d.changed
    assert d.reason == "consolidation"


def test_scale_down_one_at_a_time_after_hysteresis_and_cooldown():
    planner = Planner(CFG)
    t, sizes = 0, []
    n = 4
    while t < 80:
        d = planner.decide(prefill_pool(n, now=t, queue_tokens=50), now=t)  # 5% of target each
        if d.changed:
            assert d.desired == n - 1 and d.reason in DOWN_REASONS
            sizes.append((t, d.desired))
            n = d.desired
        t += 1
    assert [s for _, s in sizes] == [3, 2, 1]
    times = [t for t, _ in sizes]
    assert times[0] == 2  # down_after=3 ticks (t = 0, 1, 2)
    assert all(b - a >= CFG.down_cooldown_s for a, b in zip(times, times[1:]))


def test_no_scale_down_right_after_scale_up():
    planner = Planner(CFG)
    for t in (0, 1):
        planner.decide(decode_pool(1, streams=8, now=t), now=t)  # -> 2 at t=1
    for t in range(2, 11):  # the burst is over at once: held for down_cooldown_s since t=1
        d = planner.decide(decode_pool(2, streams=0, now=t), now=t)
        assert not d.changed
    d = planner.decide(decode_pool(2, streams=0, now=11), now=11)
    assert d.desired == 1 and d.reason == "idle"


def test_latency_signals_need_samples():
    planner = Planner(CFG)
    # TTFT 3x the target but from one sample per worker (a cold start): not counted
    for t in range(4):
        d = planner.decide(prefill_pool(1, now=t, ttft=3.0, samples=1), now=t)
        assert not d.changed
    for t in range(4, 6):
        d = planner.decide(prefill_pool(1, now=t, ttft=3.0, samples=5, queue_tokens=10), now=t)
    assert d.changed and d.reason == "ttft" and d.desired == 3


def test_latency_of_an_idle_worker_is_not_pressure():
    """After a burst the workers' windows still hold its slow first tokens; idle, they must not grow the pool."""
    planner = Planner(CFG)
    for t in range(6):
        d = planner.decide(prefill_pool(1, now=t, ttft=3.0, samples=20, queue_tokens=0), now=t)
        assert not d.changed and d.pressure == 0


def test_decode_pressure_takes_the_largest_signal():
    planner = Planner(CFG)
    ready = (WorkerSample(worker_id="d0", running=1, kv_usage=0.2, itl_p90_s=0.3, samples=9, at=0.0),)
    obs = PoolObservation(pool="decode", bounds=PoolBounds(min=1, max=8), ready=ready)
    planner.decide(obs, now=0)
    d = planner.decide(obs, now=0.5)
    assert d.reason == "itl" and d.desired == 3 and "kv_usage 0.25" in d.detail


def test_serve_flags_give_the_pools_bounds_and_planner_targets(capsys):
    """`dsv4 serve --prefill-workers 1:3 --decode-workers 2`: the prefill pool is elastic, the decode pool fixed, the
    planner flags reach ServiceConfig.planner; a bad spec stops argparse with the flag and the value; an elastic
    multi-rank pool is refused with the reason."""
    import argparse

    from service.serve_args import add_serve_args, config_from_args
    from service.service_config import ServiceConfig

    parser = argparse.ArgumentParser(prog="dsv4 serve")
    add_serve_args(parser)
    cfg = config_from_args(
        parser.parse_args(["--prefill-workers", "1:3", "--decode-workers", "2", "--ttft-target-seconds", "0.5"])
    )
    assert (cfg.pool_bounds("prefill").min, cfg.pool_bounds("prefill").max) == (1, 3)
    assert not cfg.pool_bounds("decode").elastic and cfg.decode_workers == 2 and cfg.elastic
    assert cfg.planner.ttft_target_s == 0.5
    assert not config_from_args(parser.parse_args([])).elastic
    with pytest.raises(SystemExit):
        parser.parse_args(["--decode-workers", "4:2"])
    assert "--decode-workers '4:2'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="elastic decode pool .*single-rank"):
        ServiceConfig(model_dir="m", decode_workers=1, decode_max_workers=2, tensor_parallel_size=2)
