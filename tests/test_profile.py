"""Usage profiles: any file that is not a valid profile is one ProfileError line naming it."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from moecache.formats.profile import ProfileError, UsageProfile

REPO = Path(__file__).resolve().parent.parent

GOOD = {"format": "moecache-profile", "version": 1, "model": "m", "n_expert": 4,
        "layers": [0, 1], "counts": [[1, 2, 0, 3], [0, 0, 5, 1]]}


def _with(**changes):
    return json.dumps({**GOOD, **changes})


@pytest.mark.parametrize("content, message", [
    (_with(counts=[[1e308, 2, 0, 3], [0, 0, 5, 1]]), "counts[0][0]=1e+308 is not a whole number"),
    ('{"format": "moecache-profile", "version": 1, "model": "m", "n_expert": 4, "layers": [0, 1], '
     '"counts": [[99999999999999999999999, 2, 0, 3], [0, 0, 5, 1]]}', "counts[0][0]=9999"),
    (_with(counts=[[1, 2, 0, 3], [0, -1, 5, 1]]), "counts[1][1]=-1 is not a whole number"),
    (_with(counts=[[1, 2, 0, 3], [0, 0, 5, 1.5]]), "counts[1][3]=1.5 is not a whole number"),
    (_with(counts=[[1, 2, 0, 3], [0, 0, 5, 2.0]]), "counts[1][3]=2.0 is not a whole number"),
    (_with(counts=[[True, 2, 0, 3], [0, 0, 5, 1]]), "counts[0][0]=True is not a whole number"),
    (_with(counts=[["1", 2, 0, 3], [0, 0, 5, 1]]), "counts[0][0]='1' is not a whole number"),
    (_with(counts=[[1, 2, 0, 3], [0, 0, 5, None]]), "counts[1][3]=None is not a whole number"),
    (_with(counts=[[1, 2, 0, 3]]), "counts must be a list of 2 rows"),
    (_with(counts=[[1, 2, 0, 3], [0, 0, 5]]), "n_expert=4 but counts rows have 3 entries (row 1)"),
    (_with(counts=[[1, 2, 0, 3], 7]), "counts rows have no entries (row 1)"),
    (_with(counts={"0": [1]}), "counts must be a list"),
    (_with(layers=[0, 0]), "distinct layer numbers"),
    (_with(layers=[0, -1]), "distinct layer numbers"),
    (_with(layers=[], counts=[]), "non-empty list"),
    (_with(n_expert=4.0), "n_expert=4.0 is not a positive integer"),
    (_with(n_expert=0, counts=[[], []]), "n_expert=0 is not a positive integer"),
    (_with(model=["m"]), "model=['m'] is not a string"),
    (_with(version=True), "profile version True, expected 1"),
    (json.dumps({k: v for k, v in GOOD.items() if k != "layers"}), "missing field 'layers'"),
    ('{"format": "moecache-profile", "version": 1, "model": "m", "n_expert": 4, "layers": [0, 1], '
     '"counts": [[NaN, 2, 0, 3], [0, 0, 5, 1]]}', "counts[0][0]=nan is not a whole number"),
    ('{"format": "moecache-profile", "version": 1, "model": "m", "n_expert": 4, "layers": [0, 1], '
     '"counts": [[Infinity, 2, 0, 3], [0, 0, 5, 1]]}', "counts[0][0]=inf is not a whole number"),
    ('{"counts": ' + "9" * 5000 + "}", "not valid JSON"),
    ("[" * 100_000 + "]" * 100_000, "not valid JSON"),
    ("[1, 2]", "not a moecache-profile file"),
    ("{not json", "not valid JSON"),
    ("", "not valid JSON"),
])
def test_bad_profile_is_one_line_naming_the_file(tmp_path, content, message):
    path = tmp_path / "p.json"
    path.write_text(content)
    with pytest.raises(ProfileError) as err:
        UsageProfile.load(str(path))
    text = str(err.value)
    assert text.startswith(str(path)) and message in text and "\n" not in text, text


@pytest.mark.parametrize("content", [b"\xff\xfe\x00garbage\x80", bytes(range(256)), b"\x89PNG\r\n\x1a\n"],
                         ids=["garbage", "all-bytes", "png"])
def test_binary_profile_is_one_line_naming_the_file(tmp_path, content):
    path = tmp_path / "p.json"
    path.write_bytes(content)
    with pytest.raises(ProfileError, match="^" + str(path)):
        UsageProfile.load(str(path))


def test_a_directory_or_missing_file_is_a_profile_error(tmp_path):
    with pytest.raises(ProfileError, match="Is a directory"):
        UsageProfile.load(str(tmp_path))
    with pytest.raises(ProfileError, match="No such file"):
        UsageProfile.load(str(tmp_path / "absent.json"))


def test_largest_valid_counts_load_exactly(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(_with(counts=[[2**53, 0, 0, 0], [0, 0, 5, 1]]))
    assert UsageProfile.load(str(path)).counts[0, 0] == 2**53


def test_processes_sharing_a_profile_lose_no_counts(tmp_path):
    # each adds one step of use 40 times: read, merge and replace race without the lock
    path = tmp_path / "shared.json"
    code = textwrap.dedent(f"""
        from moecache.formats.profile import UsageProfile
        one = UsageProfile("m", [0, 1], [[1, 0, 2], [0, 1, 0]])
        for _ in range(40):
            one.add_to({str(path)!r})
    """)
    workers = [subprocess.Popen([sys.executable, "-c", code], cwd=REPO) for _ in range(3)]
    assert [w.wait(timeout=120) for w in workers] == [0, 0, 0]
    counts = UsageProfile.load(str(path)).counts
    assert counts.tolist() == [[120, 0, 240], [0, 120, 0]]
