"""What an `EngineLoop`'s callers get once it has ended: `LoopStopped`, and `StepFailed` for a step that raised.

A module of their own, without the loop, because callers across a process boundary tell these apart (the TCP links'
refusals, Ray errors read on the token path) in processes that run no engine: the HTTP ingress replica must not
import the loop, whose EngineCore pulls in torch (start-up time and RSS of every elastically scaled replica).
"""

from __future__ import annotations


class LoopStopped(RuntimeError):
    """The engine loop is not running (stopped, or ended by an exception: see `EngineLoop.error`)."""


class StepFailed(LoopStopped):
    """A step raised and ended the loop; the subscribers get this (the step's exception is `EngineLoop.error`)."""
