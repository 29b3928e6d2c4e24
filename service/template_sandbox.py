"""Chat templates in a sandbox with limits: what a request-supplied template may cost.

jinja2's ImmutableSandboxedEnvironment stops attribute and mutation attacks and caps `range()` at 100,000
items, but not time (nested loops) nor size (`"x" * 10**9`). Here:
- `LimitedSandbox` intercepts `*` and `**`: a repeated string/list may have at most `MAX_REPEAT_ITEMS`
  items, and exponents are bounded, so one operation cannot allocate gigabytes;
- `run_with_budget(fn, seconds)` runs fn in the calling thread with a tracer that raises `TemplateTimeout`
  once the budget is spent. The tracer follows template frames line by line (a loop with an empty body makes
  no calls) and everything else by call; a template is compiled to Python code whose file name is
  "<template>". It runs on an ingress worker thread (service/ingress_guard.py), never on the event loop.
"""

from __future__ import annotations

import sys
import time

from jinja2.exceptions import SecurityError
from jinja2.sandbox import ImmutableSandboxedEnvironment

MAX_REPEAT_ITEMS = 1 << 20
MAX_EXPONENT = 1024


class TemplateTimeout(RuntimeError):
    """A chat template ran past its time budget."""


class LimitedSandbox(ImmutableSandboxedEnvironment):
    intercepted_binops = frozenset(["*", "**"])

    def call_binop(self, context, operator, left, right):
        if operator == "**" and isinstance(right, (int, float)) and abs(right) > MAX_EXPONENT:
            raise SecurityError(f"exponent {right} is larger than {MAX_EXPONENT}")
        if operator == "*":
            for seq, n in ((left, right), (right, left)):
                if isinstance(seq, (str, list, tuple)) and isinstance(n, int) and len(seq) * n > MAX_REPEAT_ITEMS:
                    raise SecurityError(f"repetition would make {len(seq) * n} items (limit {MAX_REPEAT_ITEMS})")
        return super().call_binop(context, operator, left, right)


def run_with_budget(fn, budget_s: float):
    """fn() in this thread, raising TemplateTimeout if it runs longer than budget_s seconds."""
    deadline = time.monotonic() + budget_s

    def check():
        if time.monotonic() > deadline:
            raise TemplateTimeout(f"chat template exceeded its time budget of {budget_s:g} s")

    def local(frame, event, arg):
        check()
        return local

    def on_call(frame, event, arg):
        check()
        return local if frame.f_code.co_filename == "<template>" else None

    previous = sys.gettrace()
    sys.settrace(on_call)
    try:
        return fn()
    finally:
        sys.settrace(previous)
