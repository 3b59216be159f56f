"""moecache.util: the integer validator, the one-line parser, the atomic writer, the progress
display."""

from __future__ import annotations

import io
import json
import os
import socket
import stat
import subprocess
import sys
import textwrap
import threading

import numpy as np
import pytest

from moecache.util import (
    IntegerError,
    OneLineParser,
    Progress,
    atomic_write,
    available_memory,
    current_umask,
    int_arg,
    int_list_arg,
    output_problem,
    parse_gbps,
    parse_int,
    parse_int_list,
    write_json,
)


@pytest.mark.parametrize("value,expected", [
    ("0", 0), ("7", 7), ("-3", -3), ("0012", 12), ("-0", 0), (str(2**70), 2**70),
    (5, 5), (-5, -5), (np.int64(9), 9), (np.uint8(3), 3),
])
def test_parse_int_accepts_ascii_decimals_and_ints(value, expected):
    got = parse_int(value, "X")
    assert got == expected and type(got) is int


@pytest.mark.parametrize("value", [
    "", " ", "2 ", " 2", "\t2", "2\n", "1_0", "+1", "--1", "- 1", "1.0", "1e3", "0x10", "abc",
    "１２", "٣", "²", "1\x00", True, False, 1.0, None, [1], b"1",
])
def test_parse_int_rejects_what_strtol_would_not_read_whole(value):
    with pytest.raises(IntegerError) as err:
        parse_int(value, "LLAMA_MOE_CACHE_SLOTS")
    message = str(err.value)
    assert isinstance(err.value, ValueError)
    assert message == f"LLAMA_MOE_CACHE_SLOTS={value!r} is not an integer" and "\n" not in message


@pytest.mark.parametrize("value,limits,message", [
    ("0", dict(minimum=1), "n=0 must be >= 1"),
    (-2, dict(minimum=0), "n=-2 must be >= 0"),
    ("9", dict(maximum=8), "n=9 must be <= 8"),
    (1, dict(minimum=2, maximum=4), "n=1 must be in [2, 4]"),
    ("5", dict(minimum=2, maximum=4), "n=5 must be in [2, 4]"),
])
def test_parse_int_range_errors_name_the_value(value, limits, message):
    with pytest.raises(IntegerError, match=r"^" + message.replace("[", r"\[") + "$"):
        parse_int(value, "n", **limits)
    assert parse_int(limits.get("minimum", limits.get("maximum")), "n", **limits) is not None


def test_parse_int_long_values_are_shortened_in_the_message():
    with pytest.raises(IntegerError, match=r"^n='9{36}\.\.\. is not an integer$"):
        parse_int("9" * 5000, "n")  # more digits than int() converts
    with pytest.raises(IntegerError, match=r"^n=1{37}\.\.\. must be <= 8$"):
        parse_int("1" * 100, "n", maximum=8)
    assert parse_int("1" * 100, "n") == int("1" * 100)


def test_parse_int_list():
    assert parse_int_list("8,16,8", "--slots", minimum=0) == [8, 16, 8]
    for text, message in [("", "'' is not a comma-separated list"), (",", "',' is not a comma"),
                          ("4,x", "'x' is not an integer"), ("4, 8", "' 8' is not an integer"),
                          ("4,-1", "-1 must be >= 0")]:
        with pytest.raises(IntegerError, match=message):
            parse_int_list(text, "--slots", minimum=0)


def _parser():
    p = OneLineParser(prog="tool")
    p.add_argument("-n", type=int_arg(minimum=1), default=1)
    p.add_argument("--slots", type=int_list_arg(minimum=0), default=[0])
    return p


def test_argparse_types():
    args = _parser().parse_args(["-n", "3", "--slots", "16,0,8,16"])
    assert args.n == 3 and args.slots == [0, 8, 16]


@pytest.mark.parametrize("argv,line", [
    (["-n", "0"], "tool: error: argument -n: 0 must be >= 1"),
    (["-n", "1_0"], "tool: error: argument -n: '1_0' is not an integer"),
    (["--slots", "4,x"], "tool: error: argument --slots: 'x' is not an integer"),
    (["--bogus"], "tool: error: unrecognized arguments: --bogus"),
])
def test_one_line_parser_errors(capsys, argv, line):
    with pytest.raises(SystemExit) as exit_:
        _parser().parse_args(argv)
    assert exit_.value.code == 2
    assert capsys.readouterr().err == line + "\n"


@pytest.mark.parametrize("error,status,line", [
    (ValueError("bad\ninput"), 2, "tool: error: bad input"),
    (RuntimeError("download failed"), 1, "tool: error: download failed"),
    (KeyError(), 1, "tool: error: KeyError"),
    (KeyboardInterrupt(), 130, "tool: error: interrupted"),
])
def test_run_reports_the_action_errors_on_one_line(capsys, error, status, line):
    def action(args):
        raise error

    assert _parser().run(action, []) == status
    assert capsys.readouterr().err == line + "\n"
    assert _parser().run(lambda args: None, []) == 0
    assert _parser().run(lambda args: args.n + 4, ["-n", "3"]) == 7


def test_run_in_a_subprocess_prints_no_traceback():
    code = textwrap.dedent("""
        from moecache.util import OneLineParser
        def action(args):
            raise OSError(28, "No space left on device")
        raise SystemExit(OneLineParser(prog="tool").run(action, []))
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 1 and run.stderr == "tool: error: [Errno 28] No space left on device\n"


@pytest.mark.parametrize("data,expected", [("héllo\n", "héllo\n".encode()), (b"\x00\xff", b"\x00\xff")])
def test_atomic_write_text_and_bytes(tmp_path, data, expected):
    path = tmp_path / "out"
    path.write_text("old")
    assert atomic_write(str(path), data) == path
    assert path.read_bytes() == expected and os.listdir(tmp_path) == ["out"]
    assert path.stat().st_mode & 0o777 == 0o644


@pytest.mark.parametrize("umask,mode", [(0o077, 0o600), (0o002, 0o664)])
def test_atomic_write_follows_the_umask(tmp_path, umask, mode):
    old = os.umask(umask)
    try:
        assert current_umask() == umask
        atomic_write(tmp_path / "stats.json", "{}")
    finally:
        os.umask(old)
    assert (tmp_path / "stats.json").stat().st_mode & 0o777 == mode


def test_atomic_write_with_a_writer_function(tmp_path):
    atomic_write(tmp_path / "m.bin", lambda tmp: tmp.write_bytes(b"built"))
    assert (tmp_path / "m.bin").read_bytes() == b"built" and os.listdir(tmp_path) == ["m.bin"]


def test_atomic_write_failure_leaves_the_old_file_and_no_temporary(tmp_path):
    path = tmp_path / "out"
    path.write_text("old")

    def half_written(tmp):
        tmp.write_bytes(b"partial")
        raise RuntimeError("disk full")

    with pytest.raises(RuntimeError, match="disk full"):
        atomic_write(path, half_written)
    with pytest.raises(TypeError):
        atomic_write(path, 12)  # neither text, bytes nor a function
    assert path.read_text() == "old" and os.listdir(tmp_path) == ["out"]


def test_atomic_write_into_a_missing_directory_raises_oserror(tmp_path):
    with pytest.raises(OSError):
        atomic_write(tmp_path / "no" / "out", "x")
    assert os.listdir(tmp_path) == []


def _read_fifo(path, got):
    with open(path, "rb") as f:
        got.append(f.read())


@pytest.mark.parametrize("data", ["text\n", b"bytes", lambda path: path.write_bytes(b"function")])
def test_atomic_write_writes_through_a_fifo_never_replacing_it(tmp_path, data):
    fifo = tmp_path / "pipe"
    os.mkfifo(fifo)
    got = []
    reader = threading.Thread(target=_read_fifo, args=(fifo, got))
    reader.start()
    atomic_write(fifo, data)
    reader.join(timeout=10)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and os.listdir(tmp_path) == ["pipe"]
    assert got == [{str: b"text\n", bytes: b"bytes"}.get(type(data), b"function")]


def test_atomic_write_writes_through_a_symlink_to_dev_null(tmp_path):
    """/dev/null itself is never the test's target: a link to it is (as /dev/stdout is a link)."""
    link = tmp_path / "null"
    link.symlink_to("/dev/null")
    atomic_write(link, "discarded")
    assert os.readlink(link) == "/dev/null" and os.listdir(tmp_path) == ["null"]
    assert stat.S_ISCHR(os.stat("/dev/null").st_mode) and os.stat("/dev/null").st_size == 0
    assert output_problem(link) is None
    assert output_problem(link, devices=False) == "is not a regular file"


def test_atomic_write_through_a_symlink_replaces_its_target_and_keeps_the_link(tmp_path):
    (tmp_path / "data").mkdir()
    target = tmp_path / "data" / "stats.json"
    target.write_text("old")
    link = tmp_path / "stats.json"
    link.symlink_to(target)
    atomic_write(link, "new")
    assert link.is_symlink() and os.readlink(link) == str(target)
    assert target.read_text() == "new" and os.listdir(tmp_path / "data") == ["stats.json"]
    dangling = tmp_path / "dangling"
    dangling.symlink_to(tmp_path / "data" / "created")  # as a shell's > does: the target is created
    atomic_write(dangling, "made")
    assert dangling.is_symlink() and (tmp_path / "data" / "created").read_text() == "made"


def test_atomic_write_refuses_what_is_neither_a_file_nor_a_device_or_fifo(tmp_path):
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(tmp_path / "sock"))
    try:
        for path, kind in ((tmp_path / "sock", "a socket"), (tmp_path, "a directory")):
            with pytest.raises(OSError) as err:
                atomic_write(path, "x")
            assert err.value.strerror == f"is {kind}" and err.value.filename == str(path)
            assert output_problem(path) == f"is {kind}"
        assert stat.S_ISSOCK(os.lstat(tmp_path / "sock").st_mode)
    finally:
        sock.close()


@pytest.mark.parametrize("value", [float("inf"), float("nan"), {"payback_uses": [1.0, -float("inf")]}])
def test_write_json_never_writes_infinity_or_nan(tmp_path, value):
    path = tmp_path / "stats.json"
    with pytest.raises(ValueError, match="Out of range float values are not JSON compliant"):
        write_json(path, value)
    assert os.listdir(tmp_path) == []
    write_json(path, {"rate": 1e-3, "n": [1, 2]})
    assert json.loads(path.read_text()) == {"rate": 1e-3, "n": [1, 2]}


@pytest.mark.parametrize("text,expected", [("12", 12.0), ("0.5", 0.5), (".25", 0.25), ("3.", 3.0),
                                           ("0.001", 0.001), ("100000", 1e5), (2.5, 2.5), (40, 40.0)])
def test_parse_gbps_takes_ascii_decimals_in_range(text, expected):
    assert parse_gbps(text, "G") == expected


@pytest.mark.parametrize("value,problem", [
    ("5e-324", "is not a decimal number"), ("1e308", "is not a decimal number"), ("1_0", "is not a decimal number"),
    ("\u0665", "is not a decimal number"), ("\uff15", "is not a decimal number"), (" 5 ", "is not a decimal number"),
    ("+5", "is not a decimal number"), ("-1", "is not a decimal number"), ("inf", "is not a decimal number"),
    ("", "is not a decimal number"), (True, "is not a decimal number"), ("0", "must be in [0.001, 100000]"),
    ("0.0009", "must be in [0.001, 100000]"), ("100000.5", "must be in [0.001, 100000]"),
    ("9" * 400, "must be in [0.001, 100000]"), (float("inf"), "must be in"), (float("nan"), "must be in"),
    (5e-324, "must be in"),
])
def test_parse_gbps_refuses_what_is_not_a_sane_rate_in_one_line(value, problem):
    with pytest.raises(ValueError) as err:
        parse_gbps(value, "LLAMA_MOE_CACHE_LINK_GBPS")
    assert str(err.value).startswith(f"LLAMA_MOE_CACHE_LINK_GBPS={value!r}"[:40]) and problem in str(err.value)


def _fake_proc(tmp_path, *, v1_limit, v1_usage, v1_inactive, v2_max, v2_current, available_kib):
    """A /proc and cgroup mounts as a hybrid host has them: v1's memory controller with the
    process two levels down, v2's unified hierarchy one level down."""
    proc, v1, v2 = tmp_path / "proc", tmp_path / "cg" / "memory", tmp_path / "cg" / "unified"
    (proc / "self").mkdir(parents=True, exist_ok=True)
    (proc / "meminfo").write_text(f"MemTotal:       99999999 kB\nMemAvailable:   {available_kib} kB\n")
    (proc / "self" / "status").write_text("VmSize:\t  100000 kB\nVmRSS:\t   5000 kB\n")
    (proc / "self" / "cgroup").write_text("5:cpu:/\n4:memory:/jobs/job1\n0::/svc\n")
    (proc / "self" / "mountinfo").write_text(
        f"31 23 0:28 / {tmp_path / 'cg'} rw - tmpfs tmpfs rw\n"
        f"35 31 0:32 / {v1} rw,relatime - cgroup cgroup rw,memory\n"
        f"36 31 0:33 / {tmp_path / 'cg' / 'cpu'} rw,relatime - cgroup cgroup rw,cpu\n"
        f"41 31 0:38 / {v2} rw,relatime - cgroup2 cgroup2 rw\n")
    for directory, files in ((v1, {"memory.limit_in_bytes": str(2**63 - 4096), "memory.usage_in_bytes": "1"}),
                             (v1 / "jobs", {"memory.limit_in_bytes": str(2**63 - 4096), "memory.usage_in_bytes": "1"}),
                             (v1 / "jobs" / "job1", {"memory.limit_in_bytes": str(v1_limit),
                                                     "memory.usage_in_bytes": str(v1_usage),
                                                     "memory.stat": f"cache 5\ntotal_inactive_file {v1_inactive}\n"}),
                             (v2 / "svc", {"memory.max": v2_max, "memory.current": str(v2_current),
                                           "memory.stat": "anon 1\ninactive_file 0\n"})):
        directory.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            (directory / name).write_text(text + "\n")
    return str(proc)


def test_available_memory_is_the_tightest_of_the_cgroups_and_memavailable(tmp_path):
    mib = 1 << 20
    proc = _fake_proc(tmp_path, v1_limit=300 * mib, v1_usage=200 * mib, v1_inactive=20 * mib,
                      v2_max="max", v2_current=1, available_kib=8 << 20)
    v1 = tmp_path / "cg" / "memory" / "jobs" / "job1"
    # the limit less what the cgroup uses, its inactive file pages counted free
    assert available_memory(proc) == (120 * mib, f"cgroup {v1}: 300 MiB limit, 180 MiB used")
    proc = _fake_proc(tmp_path, v1_limit=300 * mib, v1_usage=200 * mib, v1_inactive=20 * mib,
                      v2_max=str(150 * mib), v2_current=100 * mib, available_kib=8 << 20)
    assert available_memory(proc)[0] == 50 * mib and "unified/svc: 150 MiB limit" in available_memory(proc)[1]
    proc = _fake_proc(tmp_path, v1_limit=300 * mib, v1_usage=200 * mib, v1_inactive=20 * mib,
                      v2_max="max", v2_current=1, available_kib=10 << 10)
    assert available_memory(proc) == (10 * mib, "MemAvailable")
    assert available_memory(str(tmp_path / "none")) == (None, "unknown")


def test_available_memory_sees_ulimit_v_and_require_memory_names_the_limit():
    code = textwrap.dedent("""
        import resource
        from moecache.util import available_memory, require_memory
        resource.setrlimit(resource.RLIMIT_AS, (4 << 30, resource.RLIM_INFINITY))
        free, source = available_memory()
        assert free < 4 << 30 and source.startswith("ulimit -v: 4096 MiB of address space"), source
        try:
            require_memory(5 << 30, "the tables")
        except ValueError as e:
            print(e)
    """)
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.startswith("the tables need 5.0 GiB, ") and "(ulimit -v: 4096 MiB" in run.stdout


class _Stderr(io.StringIO):
    def __init__(self, tty):
        super().__init__()
        self.tty = tty

    def isatty(self):
        return self.tty


def test_progress_silent_when_redirected(monkeypatch):
    err = _Stderr(tty=False)
    monkeypatch.setattr(sys, "stderr", err)
    with Progress(3) as progress:
        for i in range(3):
            progress.advance(f"run {i}")
    assert err.getvalue() == "" and progress.done == 3


def test_progress_log_lines_when_redirected(monkeypatch):
    err = _Stderr(tty=False)
    monkeypatch.setattr(sys, "stderr", err)
    with Progress(2, log_lines=True) as progress:
        progress.advance("a")
        progress.advance("b")
    assert err.getvalue().splitlines() == [f"[{'#' * 15}{'.' * 15}] 1/2 a", f"[{'#' * 30}] 2/2 b"]


def test_progress_bar_on_a_terminal(monkeypatch):
    err = _Stderr(tty=True)
    monkeypatch.setattr(sys, "stderr", err)
    monkeypatch.setitem(sys.modules, "tqdm", None)  # the plain bar, not tqdm
    with Progress(4) as progress:
        progress.advance("lru 8")
    out = err.getvalue()
    assert out.startswith("\r[#######") and "1/4 lru 8" in out and out.endswith("\r")
    assert "\n" not in out
