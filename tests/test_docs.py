"""docs/reference.md's tables held to the code, so that they cannot drift: the variables are
CacheConfig's fields, the flags run.py's and the replay's, each default the code's (or the rule
the code applies where it decides the default), and each bound the table states is accepted while
one beyond it is refused. The docs' own hygiene: every repository file they name exists, and no
local path."""

from __future__ import annotations

import argparse
import re
import subprocess
from dataclasses import fields
from pathlib import Path

import pytest

from moecache.core.admission import ADMISSIONS
from moecache.core.policies import POLICIES
from moecache.live import cli as run_cli
from moecache.live.config import ENV_PREFIX, CacheConfig, ConfigError
from moecache.offline import cli as replay_cli
from moecache.offline.readahead import PREDICTORS

REPO = Path(__file__).resolve().parent.parent
REFERENCE = REPO / "docs" / "reference.md"
CACHE_TABLE = "The cache: variables, run.py's flags and attach()"
REPLAY_TABLE = "The offline replay: `python -m moecache.replay`"
LIVE_POLICIES = {name for name, policy in POLICIES.items() if not policy.offline_only}


def cells(line: str) -> list[str]:
    """A markdown table row's cells ('|' inside backticks is text)."""
    out, cell, code = [], "", False
    for ch in line.strip()[1:-1]:
        code = not code if ch == "`" else code
        if ch == "|" and not code:
            out, cell = out + [cell.strip()], ""
        else:
            cell += ch
    return out + [cell.strip()]


def table(title: str) -> list[dict[str, str]]:
    section = REFERENCE.read_text().split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]
    rows = [cells(line) for line in section.splitlines() if line.startswith("|")]
    assert all(len(row) == len(rows[0]) for row in rows), title
    return [dict(zip(rows[0], row)) for row in rows[2:]]


def ticked(cell: str) -> list[str]:
    return re.findall(r"`([^`]*)`", cell)


def field_of(variable: str) -> str:
    return variable[len(ENV_PREFIX):].lower()


def by_flag(parser) -> dict[str, argparse.Action]:
    return {action.option_strings[0] if action.option_strings else action.dest: action
            for action in parser.options()}


def flags_of(row) -> list[str]:
    return ticked(row.get("run.py flag", row.get("flag", "")))


# --- what a valid-values cell says -------------------------------------------------------------

NUMBER = r"(-?[0-9.]+)"


def cases(cell: str, flag: str | None = None) -> tuple[list[str], list[str]]:
    """The values a 'valid values' cell accepts and the ones just beyond it, as text."""
    accepted, refused = [], []
    literal = re.match(r"`(\w+)`(?: \(not `([^`]+)`\))? or (.*)", cell)
    if literal:
        (refused if flag and flag == literal[2] else accepted).append(literal[1])
        cell = literal[3]
    if m := re.fullmatch(rf"integer in \[{NUMBER}, {NUMBER}\]", cell):
        low, high = int(m[1]), int(m[2])
        return accepted + [str(low), str(high)], refused + [str(low - 1), str(high + 1)]
    if m := re.fullmatch(rf"integers? >= {NUMBER}(, comma separated)?", cell):
        low = int(m[1])
        return accepted + [str(low), str(low + 2**40) if not m[2] else f"{low},{low + 1}"], refused + [str(low - 1)]
    if cell == "integer":
        return accepted + ["-1", "0", "7"], refused + ["x", "1.5"]
    if m := re.fullmatch(rf"decimal in \[{NUMBER}, {NUMBER}\]", cell):
        low, high = float(m[1]), float(m[2])
        return accepted + [m[1], m[2]], refused + [f"{low * 0.9:f}".rstrip("0"), f"{high * 1.1:.0f}", "1e3"]
    if m := re.fullmatch(rf"number >= {NUMBER}", cell):
        return accepted + [m[1]], refused + [f"{float(m[1]) - 1:g}", "x"]
    if m := re.fullmatch(rf"numbers > {NUMBER}, comma separated", cell):
        return accepted + [f"{float(m[1]) + 0.5:g}"], refused + [m[1]]
    if m := re.fullmatch(rf"numbers in \[{NUMBER}, {NUMBER}\), comma separated", cell):
        return accepted + [m[1], f"{m[1]},{float(m[2]) / 2:g}"], refused + [m[2]]
    if m := re.fullmatch(r"one (of|or more of) (`[^`]+`(?:, `[^`]+`)*)(, comma separated)?", cell):
        names = ticked(m[2])
        return accepted + names + ([",".join(names)] if m[3] else []), refused + ["no-such-value"]
    raise AssertionError(f"a valid-values cell the test cannot read: {cell!r}")


def named(cell: str) -> set[str]:
    """The names a 'one of' cell lists."""
    return set(ticked(cell.split(" of ", 1)[1])) if " of `" in cell else set()


FREE = {"a file path", "text", "a switch", "names, comma separated"}


# --- the cache's variables and run.py's flags ------------------------------------------------

def test_the_variables_are_cache_configs_fields():
    variables = [ticked(row["variable"])[0] for row in table(CACHE_TABLE) if row["variable"]]
    assert len(variables) == len(set(variables))
    assert set(variables) == {ENV_PREFIX + field.name.upper() for field in fields(CacheConfig)}


def test_the_flags_are_run_pys():
    actions = by_flag(run_cli.parser())
    rows = [flags_of(row) for row in table(CACHE_TABLE)]
    assert sorted(flag for row in rows for flag in row) == \
        sorted(flag for action in actions.values() for flag in action.option_strings)
    for row in filter(None, rows):  # one row an action, with all its spellings
        assert set(row) == set(actions[row[0]].option_strings)


def unset(default) -> bool:
    return default is None or default is False or default == [] or default == argparse.SUPPRESS


def shown(default) -> str:
    if isinstance(default, list):
        return ",".join(shown(v) for v in default)
    return f"{default:g}" if isinstance(default, float) else str(default)


def check_default(cell: str, default, where: str):
    if unset(default):  # the code decides it: the cell says how, in words
        assert cell.startswith("unset"), (where, cell)
    else:
        assert cell == f"`{shown(default)}`", (where, cell, default)


def test_the_defaults_are_the_codes():
    defaults = {ENV_PREFIX + field.name.upper(): field.default for field in fields(CacheConfig)}
    actions = by_flag(run_cli.parser())
    for row in table(CACHE_TABLE):
        flags = flags_of(row)
        if row["variable"]:
            variable = ticked(row["variable"])[0]
            check_default(row["default"], defaults[variable], variable)
            # a flag beside a variable defaults to it: run.py passes None on to CacheConfig
            assert all(actions[flag].default is None for flag in flags), flags
        else:
            check_default(row["default"], actions[flags[0]].default, flags[0])


def rule(variable: str) -> list[str]:
    return ticked(next(row["default"] for row in table(CACHE_TABLE) if ENV_PREFIX + variable in row["variable"]))


def test_the_default_admission_is_the_rule_the_table_states():
    default, other, *exceptions = rule("ADMISSION")
    assert {default, other} == set(ADMISSIONS) and set(exceptions) <= LIVE_POLICIES
    for policy in LIVE_POLICIES:
        assert CacheConfig.from_env({}, policy=policy).admission == (other if policy in exceptions else default)


def test_the_default_planner_is_the_rule_the_table_states():
    words = rule("PLANNER")
    admission = next(word for word in words if word in ADMISSIONS)
    policies = {word for word in words if word in LIVE_POLICIES}
    assert words[0] == "1" and words[-1] == "0" and policies
    for policy in LIVE_POLICIES:
        for timing in ADMISSIONS:
            try:
                config = CacheConfig.from_env({}, policy=policy, admission=timing)
            except ConfigError:  # arc, sieve: boundary only
                continue
            assert config.planner == int(timing == admission and policy in policies), (policy, timing)
            assert CacheConfig.from_env({}, policy=policy, admission=timing, ram_mib=64).planner == 0  # no RAM tier


def env_accepts(variable: str, value: str) -> bool:
    try:
        CacheConfig.from_env({variable: value})
    except ConfigError:
        return False
    return True


def flag_accepts(flag: str, value: str, variable: str | None) -> bool:
    """As run.py takes it: the parser, then CacheConfig with the flag's value as a keyword."""
    parser = run_cli.parser()
    try:
        args = parser.parse_args([flag, value])
        if variable:
            CacheConfig.from_env({}, **{field_of(variable): getattr(args, by_flag(parser)[flag].dest)})
    except (SystemExit, ConfigError):
        return False
    return True


@pytest.mark.parametrize("row", table(CACHE_TABLE), ids=lambda row: (row["variable"] or row["run.py flag"]).strip("`"))
def test_the_bounds_the_table_states_are_the_codes(row, tmp_path, capsys):
    valid, flags = row["valid values"], flags_of(row)
    variable = ticked(row["variable"])[0] if row["variable"] else None
    if valid == "a file path":
        if variable:
            assert env_accepts(variable, str(tmp_path / "out.json"))
            assert not env_accepts(variable, str(tmp_path))  # a directory
        return
    if valid in FREE:
        return
    for flag in [None] + flags:
        accepted, refused = cases(valid, flag)
        accepts = (lambda v: env_accepts(variable, v)) if flag is None else \
            (lambda v, flag=flag: flag_accepts(flag, v, variable))
        if flag is None and not variable:
            continue
        assert [v for v in accepted if not accepts(v)] == [], (flag or variable, valid)
        assert [v for v in refused if accepts(v)] == [], (flag or variable, valid)
    if variable == ENV_PREFIX + "POLICY":
        assert named(valid) == LIVE_POLICIES | {"default"}
    if variable == ENV_PREFIX + "ADMISSION":
        assert named(valid) == set(ADMISSIONS)


# --- the replay's flags ------------------------------------------------------------------------

def test_the_replay_flags_are_its_parsers():
    actions = by_flag(replay_cli.parser())
    rows = [flags_of(row) for row in table(REPLAY_TABLE)]
    assert sorted(flag for row in rows for flag in row) == \
        sorted(flag for action in actions.values() for flag in (action.option_strings or [action.dest]))
    for row in rows:
        assert set(row) == set(actions[row[0]].option_strings or [actions[row[0]].dest])


def test_the_replay_defaults_are_the_codes():
    actions = by_flag(replay_cli.parser())
    for row in table(REPLAY_TABLE):
        flag = flags_of(row)[0]
        check_default(row["default"], actions[flag].default, flag)
    decided = {flag: ticked(row["default"]) for row in table(REPLAY_TABLE) for flag in flags_of(row)[:1]}
    args = replay_cli.parser().parse_args(["trace.csv"])
    replay_cli.check_args(args)
    assert shown(args.slots) == decided["--slots"][0]
    assert decided["--disk-read-us"][0] == shown(replay_cli.DISK_READ_US)
    assert decided["--read-ahead-kb"][0] == shown(replay_cli.READ_AHEAD_KB)
    assert set(decided["--admission"]) == set(rule("ADMISSION"))  # the live cache's rule


def replay_accepts(flag: str, value: str) -> bool:
    try:
        replay_cli.parser().parse_args(["trace.csv", flag, value])
    except SystemExit:
        return False
    return True


@pytest.mark.parametrize("row", table(REPLAY_TABLE), ids=lambda row: row["flag"].strip("`"))
def test_the_replay_bounds_the_table_states_are_its_parsers(row, capsys):
    flag, valid = flags_of(row)[0], row["valid values"]
    action = by_flag(replay_cli.parser())[flag]
    if flag == "--expert-read-ahead":
        assert set(ticked(valid)) == set(PREDICTORS)
        assert replay_accepts(flag, ",".join(f"{name}:1" for name in PREDICTORS if name != "none") + ",none,oracle:w")
        assert not replay_accepts(flag, "oracle:0") and not replay_accepts(flag, "no-such:1")
        return
    if valid in FREE:
        return
    accepted, refused = cases(valid)
    assert [v for v in accepted if not replay_accepts(flag, v)] == [], (flag, valid)
    assert [v for v in refused if replay_accepts(flag, v)] == [], (flag, valid)
    if action.choices:
        assert named(valid) == set(action.choices)
    if flag == "--admission":
        assert named(valid) == set(ADMISSIONS)


def test_the_other_variables_are_read_somewhere():
    code = "\n".join(path.read_text(errors="replace") for part in ("moecache", "scripts", "tests")
                     for path in (REPO / part).rglob("*") if path.suffix in (".py", ".sh"))
    names = [ticked(row["variable"])[0] for row in table("Other variables")]
    assert names and [name for name in names if name not in code and name != "LLAMA_CPP_LIB_PATH"] == []


# --- the docs' hygiene -------------------------------------------------------------------------

DOCS = [REPO / "README.md", *sorted((REPO / "docs").rglob("*.md"))]
LOCAL_PATH = re.compile(r"(?<![\w.])(/root/|/home/|/work/|/tmp/(?!\.\.\./)[\w.-]+/)")  # /tmp/.../ elides
REPO_PATH = re.compile(r"(?<![\w/.$-])((?:docs|scripts|tests|moecache|native|patches|traces)/[\w./-]*\w)")
MODULE = re.compile(r"python3? -m (moecache(?:\.\w+)*)")
UPSTREAM_FILES = {"docs/moe-cache.md", "scripts/moe-cache-tune.py"}  # upstream llama.cpp's, at a tag
BUILT = {"moecache/_native.py"}  # written by native/build_ffi.py, never tracked


def tracked() -> set[str]:
    done = subprocess.run(["git", "ls-files"], cwd=REPO, capture_output=True, text=True)
    if done.returncode != 0:
        pytest.skip("not a git checkout")
    return set(done.stdout.splitlines())


def test_every_file_and_module_the_docs_name_is_in_the_repository():
    files = tracked()
    folders = {str(parent) for f in files for parent in Path(f).parents}
    missing = sorted({(doc.name, name) for doc in DOCS for name in REPO_PATH.findall(doc.read_text())
                      if name not in files | folders | UPSTREAM_FILES | BUILT})
    assert missing == []
    modules = {name for doc in DOCS for name in MODULE.findall(doc.read_text())}
    assert modules and sorted(name for name in modules if not {name.replace(".", "/") + ".py",
                                                             name.replace(".", "/") + "/__main__.py"} & files) == []


def test_no_local_paths_in_the_docs():
    found = [(doc.name, m[0]) for doc in DOCS for m in LOCAL_PATH.finditer(doc.read_text())]
    assert found == []


def test_the_series_version_the_docs_state_is_the_patchs():
    patch = (REPO / "patches" / "0004-llama-moe-expert-cache.patch").read_text()
    version = re.search(r"^\+\s*#define LLAMA_MOE_CACHE_VERSION (\d+)$", patch, re.M)[1]
    mechanism = (REPO / "docs" / "mechanism.md").read_text()
    stated = re.findall(r"`LLAMA_MOE_CACHE_VERSION` in `llama.h` \((\d+)\)", mechanism)
    assert stated == [version]
