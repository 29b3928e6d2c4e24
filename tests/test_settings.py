"""dsv4_kernels.settings: the one reader of `DSV4_*` switches, its parsing rule, and its generated table.

- No code outside dsv4_kernels/settings.py reads a `DSV4_*` variable from os.environ (read with `ast`: writes
  into an environment, for a child process, are fine);
- every `DSV4_*` name the tree mentions is registered;
- docs/settings.md is what `python -m dsv4_kernels.settings_doc --markdown` writes;
- the rule: boolean spellings, numbers, choices, JSON, empty = unset, errors naming the variable, the value and
  what it accepts, one warning for an unknown name.
"""

from __future__ import annotations

import ast
import logging
import re
from pathlib import Path

import pytest

from dsv4_kernels import settings as switches
from dsv4_kernels import settings_doc
from dsv4_kernels.settings import BY_NAME, SWITCHES, Settings
from dsv4_kernels.switch import Switch

ROOT = Path(__file__).resolve().parents[1]
SCANNED = (
    "dsv4_kernels",
    "engine",
    "kv_transfer",
    "prefill_worker",
    "decode_worker",
    "router",
    "service",
    "deploy",
    "scripts",
    "benchmarks",
    "tests",
)
SETTINGS_FILE = ROOT / "dsv4_kernels" / "settings.py"
ENVIRON = {"os.environ", "environ"}
READERS = {"os.environ.get", "os.getenv", "os.environ.pop", "environ.get", "getenv", "environ.pop"}
NAME = re.compile(r"DSV4_[A-Z][A-Z0-9_]*[A-Z0-9]")


def python_files() -> list[Path]:
    return [
        p
        for d in SCANNED
        if (ROOT / d).is_dir()
        for p in sorted((ROOT / d).rglob("*.py"))
        if "_gen" not in p.parts and p != SETTINGS_FILE
    ]


def dsv4_names(tree: ast.AST) -> set[str]:
    """Identifiers this module binds to a DSV4_* name: `X = "DSV4_..."` or imported from dsv4_kernels.settings."""
    names = set()
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Assign)
            and isinstance(node.value, ast.Constant)
            and str(node.value.value).startswith("DSV4_")
        ):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.ImportFrom) and node.module == "dsv4_kernels.settings":
            names |= {a.asname or a.name for a in node.names if a.name.isupper()}
    return names


def is_dsv4(key: ast.AST, bound: set[str]) -> bool:
    """Does this key expression name a DSV4_* variable? (a literal, a bound constant, or an *_ENV alias)"""
    if isinstance(key, ast.Constant):
        return str(key.value).startswith("DSV4_")
    if isinstance(key, ast.JoinedStr):
        return (
            bool(key.values)
            and isinstance(key.values[0], ast.Constant)
            and str(key.values[0].value).startswith("DSV4_")
        )
    ident = key.id if isinstance(key, ast.Name) else key.attr if isinstance(key, ast.Attribute) else ""
    return (
        ident in bound
        or ident == "ENV"
        or ident.endswith("_ENV")
        or (isinstance(key, ast.Attribute) and ast.unparse(key.value).endswith("settings") and ident.isupper())
    )


def environment_reads(source: str, filename: str = "<src>") -> list[tuple[int, str]]:
    """[(line, code)] of each read of a DSV4_* variable from os.environ in `source`."""
    tree = ast.parse(source, filename=filename)
    bound = dsv4_names(tree)
    found = []
    for node in ast.walk(tree):
        key = None
        if isinstance(node, ast.Call) and ast.unparse(node.func) in READERS and node.args:
            key = node.args[0]
        elif isinstance(node, ast.Subscript) and isinstance(node.ctx, ast.Load) and ast.unparse(node.value) in ENVIRON:
            key = node.slice
        elif (
            isinstance(node, ast.Compare)
            and any(isinstance(op, (ast.In, ast.NotIn)) for op in node.ops)
            and any(ast.unparse(c) in ENVIRON for c in node.comparators)
        ):
            key = node.left
        if key is not None and is_dsv4(key, bound):
            found.append((node.lineno, ast.unparse(node)))
    return found


def test_the_scan_tells_reads_from_writes():
    src = """
import os
from dsv4_kernels.settings import TRITON
ENV = "DSV4_X"
a = os.environ.get("DSV4_A")
b = os.getenv("DSV4_B", "1")
c = os.environ["DSV4_C"]
d = "DSV4_D" in os.environ
e = os.environ.get(ENV)
f = os.environ.pop(TRITON, None)
g = os.environ.get(f"DSV4_{a}")
os.environ["DSV4_W"] = "1"
os.environ.setdefault("DSV4_S", "1")
env = dict(os.environ, DSV4_K="1")
env.update(DSV4_U="1")
h = os.environ.get("HOME")
"""
    lines = [line for line, _ in environment_reads(src)]
    assert lines == [5, 6, 7, 8, 9, 10, 11], environment_reads(src)


def test_no_code_reads_dsv4_variables_outside_the_settings_module():
    offenders = [
        f"{path.relative_to(ROOT)}:{line}: {code}"
        for path in python_files()
        for line, code in environment_reads(path.read_text(), str(path))
    ]
    assert not offenders, "read DSV4_* through dsv4_kernels.settings.settings():\n" + "\n".join(offenders)


def test_every_dsv4_name_in_the_tree_is_registered():
    files = [
        p
        for d in SCANNED
        if (ROOT / d).is_dir()
        for p in (ROOT / d).rglob("*")
        if p.is_file() and p.suffix in (".py", ".sh", ".yaml", ".tpl", ".md", ".toml")
    ]
    files += [
        ROOT / "README.md",
        ROOT / "BENCHMARKS.md",
        ROOT / "Makefile",
        ROOT / ".ci" / "run",
        *sorted((ROOT / "docs").glob("*.md")),
    ]
    unknown = {}
    for path in files:
        if path.exists() and path != Path(__file__):
            for name in NAME.findall(path.read_text(errors="replace")):
                if name not in BY_NAME:
                    unknown.setdefault(name, str(path.relative_to(ROOT)))
    assert not unknown, f"register these in dsv4_kernels/settings.py (name: a file naming it): {unknown}"


def test_docs_table_is_up_to_date():
    doc = ROOT / "docs" / "settings.md"
    assert doc.read_text() == settings_doc.markdown(), (
        "docs/settings.md is stale: python -m dsv4_kernels.settings_doc --markdown > docs/settings.md"
    )
    for s in SWITCHES:
        assert f"`{s.name}`" in doc.read_text()


def test_registry_is_well_formed():
    assert len(BY_NAME) == len(SWITCHES), "a name registered twice"
    for s in SWITCHES:
        assert s.help and not s.help.endswith("."), s.name
        assert getattr(switches, s.name.removeprefix("DSV4_")) == s.name, f"no constant for {s.name}"
        if s.default is not None and s.kind == "choice":
            assert s.default in s.choices, s.name
    assert Settings.from_env({}) == Settings(), "the defaults are the switches' defaults"


BOOL = Switch("DSV4_T_BOOL", "bool", True, "a test switch", "tests")
AUTO = Switch("DSV4_T_AUTO", "bool", None, "a test switch", "tests")


@pytest.mark.parametrize(
    "raw,value",
    [(r, True) for r in ("1", "true", "yes", "on", "TRUE", " On ", "Yes")]
    + [(r, False) for r in ("0", "false", "no", "off", "FALSE", "Off", " no ")],
)
def test_boolean_spellings(raw, value):
    assert BOOL.parse(raw) is value
    assert AUTO.parse(raw) is value


def test_unset_and_empty_mean_the_default_and_auto_only_where_unset_is_automatic():
    assert BOOL.parse(None) is True and BOOL.parse("") is True and BOOL.parse("  ") is True
    assert AUTO.parse(None) is None and AUTO.parse("auto") is None and AUTO.parse("AUTO") is None
    with pytest.raises(ValueError, match="DSV4_T_BOOL='auto'"):
        BOOL.parse("auto")


@pytest.mark.parametrize(
    "switch,raw",
    [
        (BOOL, "2"),
        (BOOL, "enabled"),
        (Switch("DSV4_T_INT", "int", 3, "an int", "tests", minimum=0), "1.5"),
        (Switch("DSV4_T_INT", "int", 3, "an int", "tests", minimum=0), "-1"),
        (Switch("DSV4_T_FLOAT", "float", 0.5, "a float", "tests"), "half"),
        (Switch("DSV4_T_CHOICE", "choice", "a", "a choice", "tests", choices=("a", "b")), "c"),
        (Switch("DSV4_T_JSON", "json", None, "an object", "tests"), "[1, 2]"),
        (Switch("DSV4_T_JSON", "json", None, "an object", "tests"), "{oops"),
    ],
)
def test_a_bad_value_names_the_variable_the_value_and_what_it_accepts(switch, raw):
    with pytest.raises(ValueError) as err:
        switch.parse(raw)
    text = str(err.value)
    assert text.startswith(f"{switch.name}={raw!r} is not valid"), text
    assert f"accepted: {switch.accepted()}" in text and switch.help in text


def test_numbers_choices_and_json_parse_once_here():
    assert Switch("DSV4_T_INT", "int", 3, "h", "tests").parse(" 42 ") == 42
    assert Switch("DSV4_T_FLOAT", "float", 0.5, "h", "tests").parse("2.5") == 2.5
    assert Switch("DSV4_T_CHOICE", "choice", "a", "h", "tests", choices=("a", "b")).parse("B") == "b"
    assert Switch("DSV4_T_JSON", "json", None, "h", "tests").parse('{"num_stages": 3}') == {"num_stages": 3}
    accepted = BY_NAME[switches.WARMUP].accepted()
    assert accepted == "1, quick, 0" and BY_NAME[switches.TRITON].accepted().endswith(", auto")


def test_a_secret_value_is_never_shown():
    key = Switch("DSV4_T_KEY", "int", None, "h", "tests", secret=True)
    with pytest.raises(ValueError) as err:
        key.parse("hunter2")
    assert "hunter2" not in str(err.value) and "<hidden>" in str(err.value)


def test_an_unknown_name_warns_once_with_the_closest_match(caplog):
    env = {"DSV4_TRITN": "1", "DSV4_NOTHING_LIKE_IT": "1", "DSV4_TRITON": "1", "HOME": "/"}
    with caplog.at_level(logging.WARNING, logger="dsv4.settings"):
        assert switches.warn_unknown(env) == ["DSV4_NOTHING_LIKE_IT", "DSV4_TRITN"]
        switches.warn_unknown(env)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2, lines
    assert "DSV4_TRITN" in lines[1] and "did you mean DSV4_TRITON?" in lines[1]
    assert "DSV4_NOTHING_LIKE_IT" in lines[0] and "did you mean" not in lines[0]


def test_settings_are_cached_and_monkeypatch_makes_them_parse_again(monkeypatch):
    first = switches.settings()
    assert switches.settings() is first, "parsed once"
    monkeypatch.setenv(switches.OVERLAP_DECODE, "true")  # the conftest monkeypatch drops the cache
    assert switches.settings().overlap_decode is True
    monkeypatch.setenv(switches.WARMUP, "yes")
    with pytest.raises(ValueError, match="DSV4_WARMUP='yes'"):
        switches.settings()
    monkeypatch.delenv(switches.WARMUP)
    assert switches.reload().warmup == "1"


def test_the_command_line_prints_values_and_the_table(capsys, monkeypatch):
    monkeypatch.setenv(switches.API_KEY, "sk-secret")
    assert settings_doc.main([]) == 0
    out = capsys.readouterr().out
    assert "DSV4_API_KEY=<hidden> (set)" in out and "sk-secret" not in out
    assert settings_doc.main(["--markdown"]) == 0
    assert capsys.readouterr().out == settings_doc.markdown()
