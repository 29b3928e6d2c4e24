"""The disaggregated service on one machine (tools/gpu/service_run.sh): the kill stage, and the BENCHMARKS section.

`tools/gpu/service_run.sh` runs the stages (on one GPU: `dsv4 bench serve` colocated vs 1P1D sharing the GPU with
NIXL moving VRAM, `dsv4 bench kernels nixl-raw`, then `fault` here) and `report` here; each stage leaves JSON in
$OUT. `report --out FILE` writes the section's markdown; `merge FILE` puts it into BENCHMARKS.md (section
`gpu_service`) where the tree is (the GPU machine works on a copy).

    python3 tools/gpu/service_run.py fault --device cuda --worker-num-gpus 0.5 --transfer nixl --json-out fault.json
    python3 tools/gpu/service_run.py report --dir $OUT --out $OUT/gpu_service.md
    python3 tools/gpu/service_run.py merge gpu_service.md
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import signal
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


# ---- fault: kill the decode worker's process mid-stream --------------------------------------------------------
def _stats(handles: dict, timeout: float = 10.0) -> list:
    import ray

    return ray.get([h.stats.remote() for h in (*handles["prefill"].values(), *handles["decode"].values())],
                   timeout=timeout)


def _wait(cond, timeout: float, what: str) -> float:
    """Poll cond() (exceptions count as not yet) until true; -> seconds waited; TimeoutError naming `what`."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        try:
            if cond():
                return time.monotonic() - t0
        except Exception:  # noqa: BLE001 - a restarting actor: not yet
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{what} not reached after {timeout:.0f} s")


def _stream_all(addr: str, token: str, prompts: list, params, kill_after: int | None = None) -> dict:
    """Stream every prompt concurrently; with kill_after, `ready` is set once each has that many tokens.
    -> {"tokens": [...], "errors": [...], "ready": Event, "threads": [...]} (threads started, not joined)."""
    from router.client import RouterClient, RouterError

    out = {"tokens": [[] for _ in prompts], "errors": [None] * len(prompts), "ready": threading.Event()}
    lock, counted = threading.Lock(), set()

    def run(i: int) -> None:
        try:
            with RouterClient(addr, timeout_s=600, token=token) as c:
                for ev in c.generate(prompts[i], params):
                    if ev.token_id is None:
                        continue
                    out["tokens"][i].append(ev.token_id)
                    if kill_after and len(out["tokens"][i]) == kill_after:
                        with lock:
                            counted.add(i)
                            if len(counted) == len(prompts):
                                out["ready"].set()
        except RouterError as e:
            out["errors"][i] = f"{e.code.name}: {str(e)[:300]}"
        except Exception as e:  # noqa: BLE001 - anything else is not a clean failure: reported as such
            out["errors"][i] = f"UNCLEAN {type(e).__name__}: {str(e)[:300]}"
        finally:
            if kill_after:
                with lock:
                    counted.add(i)
                    if len(counted) == len(prompts):
                        out["ready"].set()

    out["threads"] = [threading.Thread(target=run, args=(i,), daemon=True) for i in range(len(prompts))]
    for t in out["threads"]:
        t.start()
    return out


def kill_mid_stream(handles: dict, streams: int, prompt_len: int, max_new: int, kill_after: int, vocab: int) -> dict:
    import ray

    from engine.execution.sampling_params import SamplingParams
    from router.client import RouterClient

    addr, token = handles["router_addr"], handles["token"]
    decode = next(iter(handles["decode"].values()))
    rng = random.Random(1)
    prompts = [[rng.randrange(2, vocab) for _ in range(prompt_len)] for _ in range(streams)]
    params = SamplingParams(max_new_tokens=max_new, ignore_eos=True)
    victim = ray.get(decode.stats.remote(), timeout=30).incarnation
    run = _stream_all(addr, token, prompts, params, kill_after)
    if not run["ready"].wait(300):
        raise TimeoutError(f"streams did not reach {kill_after} tokens in 300 s")
    streamed = [list(t) for t in run["tokens"]]  # what each client had at the kill (must survive the migration)
    at_kill = [len(t) for t in streamed]
    t_kill = time.monotonic()
    os.kill(int(victim.split("-")[0]), signal.SIGKILL)  # the decode worker's OS process, as a crash would
    for t in run["threads"]:
        t.join(600)
    streams_done_s = time.monotonic() - t_kill
    restarted_s = _wait(lambda: ray.get(decode.stats.remote(), timeout=5).incarnation != victim, 300,
                        "decode worker restarted") + streams_done_s
    idle_s = _wait(lambda: all(s.running == 0 and s.waiting == 0 and s.kv_usage == 0.0 for s in _stats(handles)),
                   120, "both pools idle with every page free")
    probe = [5, 6, 7, 8]
    with RouterClient(addr, timeout_s=300, token=token) as c:
        again = c.generate_full(probe, SamplingParams(max_new_tokens=16, ignore_eos=True))
        stats = c.stats()
    serve_again_s = time.monotonic() - t_kill
    reference = _stream_all(addr, token, prompts, params)  # the same streams, undisturbed
    for t in reference["threads"]:
        t.join(600)
    _wait(lambda: all(s.running == 0 and s.kv_usage == 0.0 for s in _stats(handles)), 120, "idle after reference")
    completed = [i for i, (e, t) in enumerate(zip(run["errors"], run["tokens"])) if e is None and len(t) == max_new]
    return {"streams": streams, "prompt_tokens": prompt_len, "max_new_tokens": max_new, "kill_after": kill_after,
            "tokens_at_kill": at_kill, "tokens_got": [len(t) for t in run["tokens"]], "errors": run["errors"],
            "completed": len(completed), "clean_failures": sum(e is not None and not e.startswith("UNCLEAN")
                                                               for e in run["errors"]),
            "unclean": [e for e in run["errors"] if e and e.startswith("UNCLEAN")],
            "kept_streamed": sum(run["tokens"][i][:len(streamed[i])] == streamed[i] for i in completed),
            "identical_to_undisturbed": sum(run["tokens"][i] == reference["tokens"][i] for i in completed),
            "first_divergence": [_first_difference(run["tokens"][i], reference["tokens"][i]) for i in completed],
            "reference_errors": [e for e in reference["errors"] if e],
            "streams_ended_s": streams_done_s, "restarted_s": restarted_s, "idle_after_s": idle_s,
            "served_again_s": serve_again_s, "served_again_tokens": len(again.token_ids),
            "router_retries_total": stats.retries_total, "router_worker_deaths_total": stats.worker_deaths_total,
            "router_errors_total": dict(stats.errors_total), "killed_pid": int(victim.split("-")[0])}


def _first_difference(a: list, b: list) -> int | None:
    """Index of the first token where two streams differ (None when equal)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))


def fault_main(args) -> int:
    from engine.model.config import ModelConfig
    from engine.loading.make_model import default_model_dir
    from service.launcher import ServiceConfig, init_ray, prepare_metrics_dir, ray_logs_tail, start_service, \
        stop_service

    model = args.model or default_model_dir()
    opts = {k: v for k, v in (("device", args.device), ("dtype", args.dtype), ("max_batch_tokens", args.max_batch_tokens),
                              ("max_cached_tokens", args.max_cached_tokens)) if v is not None}
    init_ray(prepare_metrics_dir())
    cfg = ServiceConfig(model_dir=model, prefill_workers=1, decode_workers=1, transfer=args.transfer,
                        engine_options=tuple(opts.items()), worker_num_cpus=0.1, worker_num_gpus=args.worker_num_gpus,
                        ready_timeout_s=300.0)
    handles = None
    try:
        handles = start_service(cfg, http=False)
        result = kill_mid_stream(handles, args.streams, args.prompt_tokens, args.max_new_tokens, args.kill_after,
                                 ModelConfig.from_model_dir(model).vocab_size)
    except Exception:
        print(ray_logs_tail(), file=sys.stderr)
        raise
    finally:
        stop_service(handles, drain_s=0)
    result.update(device=args.device or "cpu", transfer=args.transfer, worker_num_gpus=args.worker_num_gpus,
                  model=os.path.basename(model.rstrip("/")))
    print(json.dumps(result, indent=1))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=1))
    ok = not result["unclean"] and result["completed"] + result["clean_failures"] == result["streams"]
    return 0 if ok and result["served_again_tokens"] == 16 else 1


# ---- report: the BENCHMARKS.md section from the stages' JSON -------------------------------------------------
def _load(path: Path):
    return json.loads(path.read_text()) if path.is_file() else None


def _serve_table(serve: dict) -> list[str]:
    lines = ["| topology | requests | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | req/s | tok/s | KV GB/s "
             "(per pull) | KV MB moved | pulls |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in serve["rows"]:
        gbps = "-" if r["kv_gb_per_s"] != r["kv_gb_per_s"] else f"{r['kv_gb_per_s']:.2f}"
        lines.append(f"| {r['topology']} | {r['requests']} | {r['ttft_p50_ms']:.1f} | {r['ttft_p99_ms']:.1f} | "
                     f"{r['itl_p50_ms']:.2f} | {r['itl_p99_ms']:.2f} | {r['req_per_s']:.2f} | {r['tok_per_s']:.0f} | "
                     f"{gbps} | {r['kv_mb']:.1f} | {r.get('kv_transfers', '-')} |")
    return lines


def _gap_lines(serve: dict, raw: dict | None) -> list[str]:
    rows = {r["topology"].split(" ")[0]: r for r in serve["rows"]}
    out = []
    if "1P1D" in rows and "colocated" in rows:
        d, c = rows["1P1D"], rows["colocated"]
        out.append(f"- 1P1D vs colocated: TTFT p50 {d['ttft_p50_ms'] / c['ttft_p50_ms']:.2f}x, ITL p50 "
                   f"{d['itl_p50_ms'] / c['itl_p50_ms']:.2f}x, output tok/s {d['tok_per_s'] / c['tok_per_s']:.2f}x.")
        if raw and raw.get("rows") and d.get("kv_transfers"):
            per = d["kv_mb"] * 1e6 / d["kv_transfers"]
            # A staged NIXL pull (kv_transfer.staging) is one READ descriptor: compare with the fewest-descriptor
            # raw row of the nearest size. The serve stats do not say whether each pull was staged.
            near = min(raw["rows"], key=lambda r: (abs(r["bytes"] - per), r["descriptors"]))
            best = max(r["gb_per_s_median"] for r in raw["rows"])
            out.append(f"- KV transfer: {d['kv_gb_per_s']:.2f} GB/s per pull (mean {per / 1e6:.2f} MB a request, the "
                       f"pull's whole time on the decode worker) vs NIXL's raw READ {near['gb_per_s_median']:.2f} GB/s "
                       f"at {near['bytes'] / (1 << 20):.0f} MiB in {near['descriptors']} descriptor(s) "
                       f"({d['kv_gb_per_s'] / near['gb_per_s_median']:.1%} of it; a staged pull is one descriptor, "
                       f"the stats here do not record which pulls were staged) and {best:.1f} GB/s at its best "
                       f"size here.")
            if not math.isnan(d.get("kv_wire_gb_per_s", math.nan)):  # where a pull's time goes (older runs: none)
                out.append(f"- The pull's time split: {d['kv_pull_gb_per_s']:.2f} GB/s over the backend's pull "
                           f"(the rest of the whole time is the hand-off to the pulling thread), "
                           f"{d['kv_wire_gb_per_s']:.2f} GB/s over its READs alone (the rest of the pull is the "
                           f"plan, the scatter into the pages and the confirmation).")
            ms = d.get("kv_ms_per_pull")
            if ms and "join_seconds" not in ms:  # (runs before 2026-12-02 17:00 UTC)
                out.append(f"- A pull's mean milliseconds: {ms['seconds']:.2f} on the decode worker, "
                           f"{ms['pull_seconds']:.2f} in the backend's pull, {ms['wire_seconds']:.2f} in its READs, "
                           f"{ms['scatter_seconds']:.2f} in the staged scatter into the pages (on the pulling "
                           "thread).")
            elif ms:
                out.append(f"- A pull's mean milliseconds: {ms['seconds']:.2f} on the decode worker, of which "
                           f"{ms['pull_seconds']:.2f} in the backend's pull: {ms['plan_seconds']:.2f} plan, "
                           f"{ms['staging_wait_seconds']:.2f} waiting for a staging range, {ms['wire_seconds']:.2f} "
                           f"READs; the pulling thread's CPU time {ms['pull_cpu_seconds']:.2f} (the rest of the pull "
                           "it spent off the CPU: the GIL or the READ's waits). The staged scatter runs on the engine "
                           f"thread as the request joins: {ms['scatter_seconds']:.2f} (page ids "
                           f"{ms['scatter_index_seconds']:.2f}, views {ms['scatter_views_seconds']:.2f}, copies "
                           f"{ms['scatter_copies_seconds']:.2f}, event {ms['scatter_record_seconds']:.2f}; CPU "
                           f"{ms['scatter_cpu_seconds']:.2f}); the join, the wait for the engine's step in flight "
                           f"included: {ms['join_seconds']:.2f}.")
    for t in serve.get("tokens", []):
        out.append(f"- Tokens: {t['topology']} gave the colocated engine's greedy tokens for {t['identical']} of "
                   f"{t['requests']} prompts sent one at a time ({serve['max_new_tokens']} tokens each)"
                   + (f"; first difference at (prompt, position) {tuple(t['first_difference'])}."
                      if t["first_difference"] else "."))
    return out


def report(d: Path) -> str:
    env, serve, raw, fault = (_load(d / n) for n in ("env.json", "serve.json", "nixl_raw.json", "fault.json"))
    on_gpu = bool(env and env.get("device") == "cuda")
    lines = [f"## Disaggregated service on one {'GPU' if on_gpu else 'machine (CPU run)'}", "",
             "Run: `tools/gpu/service_run.sh` (stages env, model, serve, raw, fault, report; "
             "`tools/device_wheels/stage.sh` installs the service's packages on the GPU machine first).", ""]
    if env:
        lines += [f"Machine: {env.get('gpu', '?')}, torch {env.get('torch', '?')}, Ray {env.get('ray', '?')}, NIXL "
                  f"{env.get('nixl', '?')}, Python {env.get('python', '?')}; date {env.get('date', '?')}. "
                  f"Model: {env.get('model', '?')}.", ""]
    if serve:
        opts = serve.get("engine_options", {})
        lines += [f"`dsv4 bench serve`: {serve['header'].split('; ', 1)[-1]} Engines: "
                  + ", ".join(f"{k} {v}" for k, v in opts.items())
                  + (f"; each Ray worker reserves {serve['worker_num_gpus']:g} GPU: the prefill and the decode worker "
                     f"share GPU 0 in separate processes" if serve.get("worker_num_gpus") else "; workers on CPUs")
                  + f"; transfer {serve['transfer']}.", ""] + _serve_table(serve) + [""] + _gap_lines(serve, raw) + [""]
        lines += [f"- {f['topology']} FAILED: {f['error'][:600]}" for f in serve.get("failures", [])]
    else:
        lines += ["`dsv4 bench serve` did not complete (the run's stages.log says why).", ""]
    if raw and raw.get("rows"):
        lines += [f"NIXL raw READ between two processes (`dsv4 bench kernels nixl-raw`, {raw['rows'][0]['device']}, "
                  f"UCX_TLS {raw.get('ucx_tls')}; transports seen: {raw.get('transports', 'not recorded')}):", "",
                  "| MiB | descriptors | GB/s median | GB/s best | bytes match |", "|---|---|---|---|---|"]
        lines += [f"| {r['bytes'] / (1 << 20):.0f} | {r['descriptors']} | {r['gb_per_s_median']:.1f} | "
                  f"{r['gb_per_s_best']:.1f} | {r['bytes_match']} |" for r in raw["rows"]] + [""]
    else:
        lines += ["NIXL raw READ stage did not complete (the run's stages.log says why).", ""]
    if fault:
        # What the README claims of a migration: every stream ends (completed, or a clean error), a completed one
        # has its whole budget and begins with every token streamed before the kill (none lost, none repeated).
        # Equality with an undisturbed run is reported, not claimed (another batch: bf16 numerics differ).
        ok = (not fault["unclean"] and fault["completed"] + fault["clean_failures"] == fault["streams"]
              and fault.get("kept_streamed") == fault["completed"])
        lines += [f"Decode worker killed mid-stream (SIGKILL to its process, pid {fault['killed_pid']}, after "
                  f"{fault['kill_after']} tokens of each of {fault['streams']} streams of {fault['max_new_tokens']}): "
                  f"{fault['completed']} streams completed (continued on the restarted worker: router retries "
                  f"{fault['router_retries_total']}), {fault['clean_failures']} ended with a clean gRPC error"
                  + (f", {len(fault['unclean'])} did not end cleanly" if fault["unclean"] else "")
                  + f"; {fault.get('kept_streamed', 'unrecorded')} of them kept every token streamed before the kill"
                  f" and got {fault['max_new_tokens']} in all"
                  + f"; {fault['identical_to_undisturbed']} of the completed streams gave the tokens of the same "
                  f"streams run undisturbed afterwards{_divergence_note(fault)}. Streams ended "
                  f"{fault['streams_ended_s']:.1f} s after the kill; "
                  f"the worker was back {fault['restarted_s']:.1f} s after it; both pools then idle with every page "
                  f"free (after {fault['idle_after_s']:.1f} s more); a new request served {fault['served_again_s']:.1f} "
                  f"s after the kill. Verdict: {'pass' if ok else 'FAIL'}.", ""]
    else:
        lines += ["Decode-worker kill stage did not complete (the run's stages.log says why).", ""]
    return "\n".join(lines).rstrip() + "\n"


def _divergence_note(fault: dict) -> str:
    """Where the completed streams first differ from the undisturbed ones: after the kill point, a retry's
    re-prefill rounding differently; before it, a real fault."""
    firsts = [f for f in fault.get("first_divergence", []) if f is not None]
    if not firsts:
        return ""
    kill = min(fault["tokens_at_kill"])
    where = "all after it" if min(firsts) >= kill else "SOME BEFORE IT"
    return f" (first differing token at {', '.join(map(str, firsts))}; the kill came after token {kill}: {where})"


def report_main(args) -> int:
    text = report(Path(args.dir))
    print(text)
    if args.out:
        Path(args.out).write_text(text)
    return 0


def merge_main(args) -> int:
    from service.benchmarks_md import write_section

    text = Path(args.file).read_text()
    if not text.startswith("## "):
        raise SystemExit(f"{args.file} is not a gpu_service section (it should start with a '## ' heading)")
    write_section("gpu_service", text)
    print(f"BENCHMARKS.md: section gpu_service from {args.file}")
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fault", help="kill the decode worker's process mid-stream; JSON of what followed")
    f.add_argument("--model", default=None)
    f.add_argument("--device", default=None)
    f.add_argument("--dtype", default=None)
    f.add_argument("--transfer", default="nixl")
    f.add_argument("--worker-num-gpus", type=float, default=None)
    f.add_argument("--max-cached-tokens", type=int, default=None)
    f.add_argument("--max-batch-tokens", type=int, default=None)
    f.add_argument("--streams", type=int, default=4)
    f.add_argument("--prompt-tokens", type=int, default=64)
    f.add_argument("--max-new-tokens", type=int, default=200)
    f.add_argument("--kill-after", type=int, default=8, help="kill once every stream has this many tokens")
    f.add_argument("--json-out", default=None)
    r = sub.add_parser("report", help="the section's markdown from a stage directory's JSON files")
    r.add_argument("--dir", required=True)
    r.add_argument("--out", default=None)
    m = sub.add_parser("merge", help="write a section file made by `report` into BENCHMARKS.md")
    m.add_argument("file")
    args = ap.parse_args()
    return {"fault": fault_main, "report": report_main, "merge": merge_main}[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
