"""`dsv4 serve` as a user runs it (a subprocess with its own Ray cluster, loopback only): what really listens,
and SIGTERM under load.

Checks: the banner's router and metrics addresses are what the kernel's socket table says is listening, on
loopback only; with streams in flight SIGTERM runs the service's own shutdown: every stream ends with [DONE]
(its tokens, or an in-band error), the process exits 0, no process it started is left (found by an
environment marker every child inherits, whatever session it moved to), and no dsv4-metrics-* directory is
left in its temp directory.
"""

from __future__ import annotations

import json
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import pytest

ray = pytest.importorskip("ray")
requests = pytest.importorskip("requests")

from tests.support.ports import free_port  # noqa: E402
from tests.support.proc import listening, pids_with_env  # noqa: E402

pytestmark = pytest.mark.ray
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _lines(proc, out: queue.Queue, log: list):
    for line in proc.stdout:
        log.append(line)
        out.put(line)


@pytest.mark.parametrize("target", ["driver", "process_group"])
def test_banner_addresses_and_sigterm_under_load(target):
    """target process_group: `kill -TERM -- -PGID` as systemd and container runtimes do; Ray's daemons are in
    their own session, so the drain still runs and ends within the drain time plus a few seconds."""
    tmp = tempfile.mkdtemp(prefix="dsv4-shutdown-test-")
    mark = uuid.uuid4().hex
    port, metrics_port = free_port(), free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "PROMETHEUS_MULTIPROC_DIR")}
    env.update(TMPDIR=tmp, DSV4_TEST_MARK=mark, RAY_ADDRESS="local", HOME=tmp)  # Ray's token file lands in tmp
    dsv4 = os.path.join(os.path.dirname(sys.executable), "dsv4")
    cmd = [dsv4] if os.path.exists(dsv4) else [sys.executable, "-m", "service.cli"]
    cmd += [
        "serve",
        "--port",
        str(port),
        "--metrics-port",
        str(metrics_port),
        "--transfer",
        "tcp",
        "--drain-seconds",
        "2",
        "--max-num-seqs",
        "8",
    ]
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        stdin=subprocess.DEVNULL,
        start_new_session=True,
    )
    lines, log = queue.Queue(), []
    threading.Thread(target=_lines, args=(proc, lines, log), daemon=True).start()
    session = requests.Session()
    session.trust_env = False
    try:
        banner = {}
        deadline = time.monotonic() + 300
        while "metrics" not in banner:
            assert proc.poll() is None and time.monotonic() < deadline, "".join(log)[-4000:]
            try:
                line = lines.get(timeout=1)
            except queue.Empty:
                continue
            m = re.match(r"\s+(router|metrics|OpenAI API):\s+(\S+)", line)
            if m:
                banner[m[1]] = m[2]
        router_port = int(banner["router"].rsplit(":", 1)[1])
        assert banner["router"].startswith("grpc://127.0.0.1:") and listening(router_port) == ["127.0.0.1"]
        assert banner["metrics"] == f"http://127.0.0.1:{metrics_port}/metrics"
        assert listening(metrics_port) == ["127.0.0.1"] and listening(port) == ["127.0.0.1"]
        token_file = os.path.join(tmp, ".ray", "auth_token")  # Ray writes it world-readable; dsv4 serve fixes that
        assert os.stat(token_file).st_mode & 0o777 == 0o600, oct(os.stat(token_file).st_mode)

        streams = []
        for i in range(6):
            r = session.post(
                f"http://127.0.0.1:{port}/v1/completions",
                stream=True,
                timeout=120,
                json={
                    "model": "dsv4",
                    "prompt": [5, 6, 7, i + 2],
                    "max_tokens": 3000,
                    "ignore_eos": True,
                    "stream": True,
                },
            )
            assert r.status_code == 200, r.text
            r.lines = r.iter_lines(decode_unicode=True)
            assert next(x for x in r.lines if x.startswith("data:"))  # in flight: a token has arrived
            streams.append(r)
        t0 = time.monotonic()
        if target == "driver":
            proc.send_signal(signal.SIGTERM)
        else:
            os.killpg(proc.pid, signal.SIGTERM)
        for r in streams:
            payloads = [x[5:].strip() for x in r.lines if x.startswith("data:")]
            assert payloads and payloads[-1] == "[DONE]", payloads[-3:]
            last = json.loads(payloads[-2]) if len(payloads) > 1 else {}
            assert "error" in last or last["choices"][0]["finish_reason"], last
        assert proc.wait(120) == 0, "".join(log)[-4000:]
        took = time.monotonic() - t0
        if target == "process_group":  # the 2 s drain, the router and Serve stopped, Ray's daemons shut down
            assert took < 2 + 20, f"process-group SIGTERM took {took:.1f} s"
        deadline = time.monotonic() + 30  # Ray's daemons exit a moment after the driver
        while pids_with_env("DSV4_TEST_MARK", mark) and time.monotonic() < deadline:
            time.sleep(0.5)
        assert pids_with_env("DSV4_TEST_MARK", mark) == [], "processes left behind"
        assert not [d for d in os.listdir(tmp) if d.startswith("dsv4-metrics-")], os.listdir(tmp)
        assert "shutting down" in "".join(log), "".join(log)[-4000:]
        print(f"SIGTERM to exit: {took:.1f} s")
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(10)
        for pid in pids_with_env("DSV4_TEST_MARK", mark):
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        session.close()
        shutil.rmtree(tmp, ignore_errors=True)
