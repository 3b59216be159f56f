"""Property-based fuzzing of everything a user hands the cache: route traces, usage profiles and
every LLAMA_MOE_CACHE_* variable. Whatever the input, the only exception is the module's own
one-line error (TraceError, ProfileError, ConfigError): never a traceback of another kind."""

from __future__ import annotations

import json
import os
import tempfile

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from moecache.profile import ProfileError, UsageProfile  # noqa: E402

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
