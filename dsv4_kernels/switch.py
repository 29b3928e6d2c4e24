"""One `DSV4_*` environment switch: its value kind, default, help and group, and how its raw string is parsed.

dsv4_kernels.settings declares every switch (one `Switch` per `Settings` field) and reads them; this module holds the
parsing rules that its docstring states, so the registry stays a list of declarations.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

PREFIX = "DSV4_"
KINDS = ("bool", "int", "float", "str", "choice", "json")
TRUE = ("1", "true", "yes", "on")
FALSE = ("0", "false", "no", "off")
AUTO = "auto"
GROUPS = {  # group -> heading of its table in docs/settings.md, in this order
    "kernels": "Kernels (dsv4_kernels)",
    "engine": "Engine: fast paths, decode, warm-up, loading",
    "transfer": "KV transfer (kv_transfer)",
    "service": "Service (HTTP API)",
    "tests": "Tests",
    "scripts": "Scripts (GPU benchmarks)",
    "deploy": "Deployment (Helm chart; read by the pods' shell commands, not by Python)",
}


@dataclass(frozen=True)
class Switch:
    """One environment switch: its variable, value kind, default and a one-line help."""

    name: str
    kind: str  # one of KINDS
    default: Any
    help: str
    group: str
    choices: tuple[str, ...] = ()  # kind "choice": the allowed values (lower case)
    minimum: int | float | None = None  # kind int / float: the smallest allowed value
    secret: bool = False  # never printed (its value, not its name)

    def __post_init__(self):
        if not self.name.startswith(PREFIX) or self.kind not in KINDS or self.group not in GROUPS:
            raise ValueError(f"bad switch definition {self!r}")
        if (self.kind == "choice") != bool(self.choices):
            raise ValueError(f"{self.name}: choices go with kind 'choice' only")

    @property
    def auto(self) -> bool:
        """Unset means "decide automatically" (the value is None)."""
        return self.default is None

    def accepted(self) -> str:
        """What the variable takes, in words (the error text and the table's type column)."""
        base = {
            "bool": "1/0, true/false, yes/no, on/off",
            "int": "an integer",
            "float": "a number",
            "str": "any text",
            "json": "a JSON object",
        }.get(self.kind) or ", ".join(self.choices)
        if self.minimum is not None:
            base += f" >= {self.minimum}"
        if self.kind == "bool" and self.auto:
            base += ", auto"
        return base

    def parse(self, raw: str | None) -> Any:
        """The value of the raw environment string (None or empty: the default); ValueError on a bad one."""
        if raw is None or not raw.strip():
            return self.default
        text = raw.strip()
        try:
            return self._convert(text)
        except ValueError:
            shown = "<hidden>" if self.secret else repr(raw)
            raise ValueError(
                f"{self.name}={shown} is not valid (accepted: {self.accepted()}); {self.name}: {self.help}"
            ) from None

    def _convert(self, text: str) -> Any:
        low = text.lower()
        if self.kind == "bool":
            if low in TRUE:
                return True
            if low in FALSE:
                return False
            if self.auto and low == AUTO:
                return None
            raise ValueError(text)
        if self.kind in ("int", "float"):
            value = int(text) if self.kind == "int" else float(text)
            if self.minimum is not None and value < self.minimum:
                raise ValueError(text)
            return value
        if self.kind == "choice":
            if low not in self.choices:
                raise ValueError(text)
            return low
        if self.kind == "json":
            value = json.loads(text)  # json.JSONDecodeError is a ValueError
            if not isinstance(value, dict):
                raise ValueError(text)
            return value
        return text

    def shown_default(self) -> str:
        """The default as the table shows it."""
        if self.default is None:
            return "unset"
        if isinstance(self.default, bool):
            return "1" if self.default else "0"
        return str(self.default)
