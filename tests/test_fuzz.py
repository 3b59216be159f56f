"""Property-based fuzzing of everything a user hands the cache: route traces, usage profiles and
every LLAMA_MOE_CACHE_* variable. Whatever the input, the only exception is the module's own
one-line error (TraceError, ProfileError, ConfigError): never a traceback of another kind."""

from __future__ import annotations

import json
import os
import re
import tempfile

import numpy as np
import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from test_traces import SMALL as SMALL_TRACE  # noqa: E402

from moecache.formats import csv_trace  # noqa: E402
from moecache.formats.binary_trace import MAGIC as BINARY_MAGIC  # noqa: E402
from moecache.formats.csv_trace import OPTIONAL_COLUMNS, REQUIRED_COLUMNS  # noqa: E402
from moecache.formats.profile import ProfileError, UsageProfile  # noqa: E402
from moecache.formats.traces import TraceError, read_trace  # noqa: E402

# CI has 2 cores: a bounded number of examples per property, each fast
FUZZ = settings(max_examples=int(os.environ.get("FUZZ_EXAMPLES", 150)), deadline=2000, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])


def _one_line(error: Exception) -> None:
    text = str(error)
    assert text and "\n" not in text, repr(text)


@pytest.fixture(scope="module")
def scratch():
    """One file rewritten by every example (hypothesis runs examples in one test call)."""
    with tempfile.TemporaryDirectory() as folder:
        yield os.path.join(folder, "input")


def _write(path: str, content: bytes | str) -> str:
    with open(path, "wb") as f:
        f.write(content.encode("utf-8", "surrogatepass") if isinstance(content, str) else content)
    return path


# --- route traces -------------------------------------------------------------------------

TRACE_LINES = SMALL_TRACE.splitlines()  # a valid trace: 2 layers, top-2, a prefill and a decode step

# text a field might hold: numbers of every size and sign, separators, other scripts' digits
FIELD = st.one_of(
    st.integers(min_value=-2**70, max_value=2**70).map(str),
    st.sampled_from([2**31, 2**32, 2**53, 2**63 - 1, 2**63, 2**64, 10**25, -2**63 - 1]).map(str),
    st.floats(allow_nan=True, allow_infinity=True).map(repr),
    st.sampled_from(["", " ", "1 ", "+1", "1_0", "\uff11", "٣", "0x10", "1e3", "nan", ",", "=",
                     "\t", "\r", "\x00", '"', "'", "#", "layer=", "model=a b", "\u2028"]),
    st.text(max_size=12),
)


def _check_trace(path: str) -> None:
    try:
        trace = read_trace(path)
    except TraceError as e:
        _one_line(e)
    else:
        assert trace.ids.ndim == 3


@FUZZ
@given(st.binary(max_size=400))
def test_trace_reader_on_arbitrary_bytes(scratch, data):
    _check_trace(_write(scratch, data))
    _check_trace(_write(scratch, TRACE_LINES[0].encode() + b"\n" + data))
    _check_trace(_write(scratch, BINARY_MAGIC + b"\n" + data))  # the compact binary form's


@FUZZ
@given(st.integers(1, len(TRACE_LINES) - 1), st.integers(0, 8), FIELD)
def test_trace_reader_with_one_field_replaced(scratch, line, field, value):
    lines = list(TRACE_LINES)
    sep = "," if line >= 4 else " "
    parts = lines[line].split(sep)
    key, eq, _ = parts[field % len(parts)].partition("=")
    parts[field % len(parts)] = (key + eq if sep == " " else "") + value
    lines[line] = sep.join(parts)
    _check_trace(_write(scratch, "\n".join(lines) + "\n"))


@FUZZ
@given(st.data())
def test_trace_reader_on_mutated_traces(scratch, data):
    lines = list(TRACE_LINES)
    for _ in range(data.draw(st.integers(1, 3), label="edits")):
        i = data.draw(st.integers(0, len(lines) - 1), label="line")
        how = data.draw(st.sampled_from(["field", "line", "drop", "duplicate"]), label="how")
        if how == "field":
            sep = "," if i >= 4 else " "
            parts = lines[i].split(sep)
            j = data.draw(st.integers(0, len(parts) - 1), label="field")
            key, eq, _ = parts[j].partition("=")
            parts[j] = (key + eq if eq and sep == " " else "") + data.draw(FIELD, label="value")
            lines[i] = sep.join(parts)
        elif how == "line":
            lines[i] = data.draw(st.text(max_size=60), label="text")
        elif how == "drop":
            del lines[i]
        else:
            lines.insert(i, lines[i])
        if not lines:
            break
    _check_trace(_write(scratch, "\n".join(lines) + "\n"))


# a row's field: mostly a small integer, padded, signed or zero-led as the csv module and int()
# take it (the weight: a float), one of FIELD's oddities in one field out of ten
PADDED_INT = st.tuples(st.sampled_from(["", " ", "+", "-", "0", "\t"]), st.integers(0, 99).map(str),
                       st.sampled_from(["", " "])).map("".join)
ROW_COLUMNS = REQUIRED_COLUMNS + OPTIONAL_COLUMNS
ROW = st.tuples(*(st.integers(0, 9).flatmap(lambda n, weight=name == "weight": FIELD if n == 0 else
                                            st.floats().map(repr) if weight else PADDED_INT)
                  for name in ROW_COLUMNS))


@FUZZ
@given(st.lists(ROW, min_size=1, max_size=4), st.sampled_from(["\n", "\r\n", "\r"]))
def test_loadtxt_reads_a_block_as_the_csv_module_does(rows, end):
    """The trace reader takes numpy's loadtxt's values for a block only where they are the csv
    module's, int()'s and float()'s: the same values, and nothing they refuse."""
    text = "".join(",".join(row) + end for row in rows)
    fast = csv_trace.parse_fast(text, list(ROW_COLUMNS))
    if fast is None:
        return
    pieces = list(csv_trace.parse_exact("t.csv", text, 1, list(ROW_COLUMNS), None))
    assert len(pieces) == 1
    exact = pieces[0][1]
    for name in ROW_COLUMNS:
        assert np.array_equal(fast[name], exact[name], equal_nan=name == "weight"), name


# --- usage profiles -----------------------------------------------------------------------

GOOD_PROFILE = {"format": "moecache-profile", "version": 1, "model": "m", "n_expert": 4,
                "layers": [0, 1], "counts": [[1, 2, 0, 3], [0, 0, 5, 1]]}
NUMBER = st.one_of(
    st.integers(min_value=-2**80, max_value=2**80), st.floats(allow_nan=True, allow_infinity=True),
    st.sampled_from([2**53, 2**53 + 1, 2**63, 10**23, 1e308, -1, 0.5, 1.0, True, False]))
JSON_VALUE = st.recursive(
    st.none() | NUMBER | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=6), inner, max_size=4),
    max_leaves=20)


def _check_profile(path: str) -> None:
    try:
        profile = UsageProfile.load(path)
    except ProfileError as e:
        _one_line(e)
        assert str(e).startswith(path)
    else:  # what loads is the file's counts exactly (nothing truncated), and usable
        with open(path, encoding="utf-8") as f:
            counts = json.load(f)["counts"]
        assert all(type(c) is int for row in counts for c in row)
        assert profile.counts.tolist() == counts and (profile.counts >= 0).all()
        assert profile.counts.shape == (len(profile.layers), profile.n_expert)
        profile.top(2), profile.rates(2)


@FUZZ
@given(st.binary(max_size=300))
def test_profile_reader_on_arbitrary_bytes(scratch, data):
    _check_profile(_write(scratch, data))


@FUZZ
@given(st.integers(0, 1), st.integers(0, 3), NUMBER)
def test_profile_reader_with_one_count_replaced(scratch, layer, expert, value):
    profile = json.loads(json.dumps(GOOD_PROFILE))
    profile["counts"][layer][expert] = value
    _check_profile(_write(scratch, json.dumps(profile)))


@FUZZ
@given(st.data())
def test_profile_reader_on_mutated_profiles(scratch, data):
    profile = json.loads(json.dumps(GOOD_PROFILE))
    for _ in range(data.draw(st.integers(1, 3), label="edits")):
        key = data.draw(st.sampled_from(sorted(GOOD_PROFILE) + ["counts_cell", "extra"]), label="key")
        value = data.draw(JSON_VALUE, label="value")
        if key == "counts_cell" and isinstance(profile.get("counts"), list) and profile["counts"] \
                and isinstance(profile["counts"][0], list) and profile["counts"][0]:
            profile["counts"][0][data.draw(st.integers(0, len(profile["counts"][0]) - 1))] = value
        elif data.draw(st.booleans(), label="delete") and key in profile:
            del profile[key]
        else:
            profile[key] = value
    _check_profile(_write(scratch, json.dumps(profile)))


# --- LLAMA_MOE_CACHE_* variables ----------------------------------------------------------

from moecache.live.config import ENV_PREFIX, CacheConfig, ConfigError  # noqa: E402

INT_VARIABLES = ("SLOTS", "INSERTS", "WAIT", "DEBUG", "FLUSH_STEPS")
PATH_VARIABLES = ("STATS", "TRACE", "PROFILE")
VARIABLES = INT_VARIABLES + PATH_VARIABLES + ("POLICY",)

INT_TEXT = st.one_of(
    st.integers(min_value=-2**70, max_value=2**70).map(str),
    st.sampled_from(["2 ", " 2", "+2", "1_0", "\uff12", "\u0663", "0x10", "1e3", "2.0", "1\n",
                     "9" * 5000, "-0", "00", "\x00", "\u00b2", "inf", "nan", "true", ""]),
    st.text(max_size=8),
)
PATH_TEXT = st.one_of(
    st.sampled_from(["/", "/proc/stats.json", "/proc/self/x", "/sys/x", "/dev/null", "/nonexistent/x",
                     "dir/", ".", "..", "~", "a\x00b", "out.json", "\udcff.json", " ", ""]),
    st.text(alphabet=st.characters(blacklist_characters="/", blacklist_categories=("Cs",)), max_size=12),
)
POLICY_TEXT = st.one_of(st.sampled_from(["lru", "heat", "default", "belady", "LRU", " lru", ""]),
                        st.text(max_size=8))
VALUE = {**{name: INT_TEXT for name in INT_VARIABLES}, **{name: PATH_TEXT for name in PATH_VARIABLES},
         "POLICY": POLICY_TEXT}
ENVIRONMENT = st.fixed_dictionaries({}, optional={
    **{ENV_PREFIX + name: VALUE[name] for name in VARIABLES},
    ENV_PREFIX + "SLOT": INT_TEXT, ENV_PREFIX + "slots": INT_TEXT})  # typos


def _check_config(environ: dict) -> CacheConfig | None:
    try:
        config = CacheConfig.from_env(environ)
    except ConfigError as e:
        _one_line(e)
        named = re.match(ENV_PREFIX + r"\w+", str(e))
        assert named and named.group() in environ, (str(e), environ)  # names the culprit variable
        return None
    for name in INT_VARIABLES:  # a value taken is exactly the text: ASCII decimal digits only
        text = environ.get(ENV_PREFIX + name)
        if text:
            assert re.fullmatch(r"-?[0-9]+", text) and int(text) == getattr(config, name.lower()), (name, text)
    return config


@FUZZ
@given(ENVIRONMENT)
def test_every_variable_through_cache_config(tmp_path_factory, environ):
    folder = tmp_path_factory.getbasetemp()
    cwd = os.getcwd()
    os.chdir(folder)  # relative paths land in a scratch folder
    try:
        _check_config(environ)
    finally:
        os.chdir(cwd)


@FUZZ
@given(ENVIRONMENT.filter(lambda env: all("\x00" not in v and not any("\udc00" <= c <= "\udfff" for c in v)
                                          for v in env.values())))
def test_every_variable_through_zero_code_activation(tmp_path_factory, environ):
    """moecache.live.activate.install, what the patched llama_cpp runs at import: it never raises;
    a bad value is one logged line naming the variable, and the cache stays off."""
    import logging
    from unittest import mock

    activate = pytest.importorskip("moecache.live.activate")
    records: list[logging.LogRecord] = []
    handler = logging.Handler()
    handler.emit = records.append
    log = logging.getLogger("moecache")
    folder = tmp_path_factory.getbasetemp()
    clean = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    cwd = os.getcwd()
    os.chdir(folder)
    # a registered context callback stands in for an earlier install: no process-wide change here
    with mock.patch.dict(os.environ, {**clean, **environ}, clear=True), \
            mock.patch.object(activate, "context_callback", object()):
        log.addHandler(handler)
        try:
            installed = activate.install()
            expected = _check_config(environ)
        finally:
            log.removeHandler(handler)
            os.chdir(cwd)
    errors = [r.getMessage() for r in records if r.levelno >= logging.ERROR]
    if expected is None:
        assert installed is False and len(errors) == 1, errors
        _one_line(Exception(errors[0]))
        assert errors[0].startswith("moecache: error: " + ENV_PREFIX), errors
    else:
        assert installed is True and errors == [], errors


FLAG_VALUE = st.one_of(INT_TEXT, POLICY_TEXT)


@FUZZ
@given(ENVIRONMENT, st.lists(st.tuples(st.sampled_from(["-n", "-ngl", "-c", "-t", "--seed", "--slots",
                                                         "--inserts", "--policy", "-p"]), FLAG_VALUE),
                             max_size=4))
def test_run_py_flags_and_variables(tmp_path_factory, environ, flags):
    """run.py's command line with any flag values and variables (and a missing model, so that it
    stops after validating them): exit status 2 and one line, never a traceback."""
    import contextlib
    import io
    from unittest import mock

    from moecache.live import cli

    argv = [part for flag in flags for part in flag] + ["-m", "/nonexistent/model.gguf"]
    clean = {k: v for k, v in os.environ.items() if not k.startswith(ENV_PREFIX)}
    environ = {k: v for k, v in environ.items()
               if "\x00" not in v and not any("\udc00" <= c <= "\udfff" for c in v)}
    err = io.StringIO()
    cwd = os.getcwd()
    os.chdir(tmp_path_factory.getbasetemp())
    try:
        with mock.patch.dict(os.environ, {**clean, **environ}, clear=True), contextlib.redirect_stderr(err):
            try:
                status = cli.main(argv)
            except SystemExit as e:  # argparse
                status = e.code
    finally:
        os.chdir(cwd)
    lines = err.getvalue().splitlines()
    assert status == 2 and len(lines) == 1 and lines[0].startswith("run.py: error: "), (argv, environ, lines)
