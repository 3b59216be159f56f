"""The one of each small thing every tool needs: the argument parser, integer and rate parsing,
the file writer (atomic, never over a device) and the JSON writer, the memory check and the
progress display."""

from __future__ import annotations

import argparse
import errno
import json
import os
import re
import resource
import stat
import sys
import tempfile
from pathlib import Path
from typing import Callable, Sequence

__all__ = ["IntegerError", "OneLineParser", "Progress", "atomic_write", "available_memory", "gbps_arg", "int_arg",
           "int_list_arg", "one_line", "output_problem", "parse_gbps", "parse_int", "parse_int_list",
           "require_memory", "write_json"]


def one_line(message) -> str:
    """message with its whitespace (newlines included) collapsed to single spaces."""
    return " ".join(str(message).split())


# --- integers -----------------------------------------------------------------------------------

_DECIMAL = re.compile(r"-?[0-9]+")  # [0-9] is ASCII only: no other scripts' digits


class IntegerError(ValueError):
    """A value that is not an integer or is out of range. str(): '<name>=<value> <problem>';
    .detail: '<value> <problem>' (for argparse, which names the flag itself)."""

    def __init__(self, name: str, detail: str):
        super().__init__(f"{name}={detail}")
        self.name, self.detail = name, detail


def parse_int(value, name: str, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """value as an int, checked against [minimum, maximum]. Text must be ASCII decimal digits
    with an optional leading '-' and nothing else: Python's int() also takes surrounding
    whitespace, '+', '_' between digits and other scripts' digits, which C's strtol reads
    differently or not at all. An int (numpy's too, not bool) is range-checked only. Raises
    IntegerError naming `name` and the value (shortened when long)."""
    if isinstance(value, str):
        try:
            number = int(value) if _DECIMAL.fullmatch(value) else None
        except ValueError:  # more digits than Python converts (sys.get_int_max_str_digits)
            number = None
        if number is None:
            raise IntegerError(name, f"{_shown(value)} is not an integer")
    elif not isinstance(value, bool) and hasattr(value, "__index__"):
        number = value.__index__()
    else:
        raise IntegerError(name, f"{_shown(value)} is not an integer")
    if (minimum is not None and number < minimum) or (maximum is not None and number > maximum):
        if maximum is None:
            bound = f">= {minimum}"
        elif minimum is None:
            bound = f"<= {maximum}"
        else:
            bound = f"in [{minimum}, {maximum}]"
        raise IntegerError(name, f"{_shown(number)} must be {bound}")
    return number


def _shown(value, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[:limit - 3] + "..."


def parse_int_list(text: str, name: str, *, minimum: int | None = None,
                   maximum: int | None = None) -> list[int]:
    """Comma-separated integers ('8,16,32'), each checked by parse_int; at least one."""
    if not isinstance(text, str) or not text.strip(","):
        raise IntegerError(name, f"{text!r} is not a comma-separated list of integers")
    return [parse_int(part, name, minimum=minimum, maximum=maximum) for part in text.split(",")]


_RATE = re.compile(r"[0-9]+(?:\.[0-9]*)?|\.[0-9]+")  # ASCII decimal, as the integers: no sign, exponent, '_'
GBPS_RANGE = (0.001, 100000.0)  # a rate outside is a typo (a link of 1 MB/s, a memory of 100 TB/s)


def _gbps(value) -> tuple[float | None, str | None]:
    """(value as a rate in GB/s, None), or (None, '<value> <problem>')."""
    if isinstance(value, str):
        number = float(value) if _RATE.fullmatch(value) else None
    elif not isinstance(value, bool) and isinstance(value, (int, float)):
        number = float(value)
    else:
        number = None
    if number is None:
        return None, f"{_shown(value)} is not a decimal number of GB/s"
    low, high = GBPS_RANGE
    if not low <= number <= high:  # nan and inf too
        return None, f"{_shown(value)} must be in [{low:g}, {high:g}] GB/s"
    return number, None


def parse_gbps(value, name: str) -> float:
    """A rate in GB/s within GBPS_RANGE, as ASCII decimal text ('12', '0.5', no exponent,
    sign, '_' or spaces: what the integer variables take, with a point) or a number. Raises
    ValueError '<name>=<value> <problem>'."""
    number, problem = _gbps(value)
    if problem:
        raise ValueError(f"{name}={problem}")
    return number


def gbps_arg(text: str) -> float:
    """An argparse type: parse_gbps; argparse names the flag in the error."""
    number, problem = _gbps(text)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return number


gbps_arg.__name__ = "GB/s"


def int_arg(minimum: int | None = None, maximum: int | None = None) -> Callable[[str], int]:
    """An argparse type: parse_int with these bounds; argparse names the flag in the error."""
    def parse(text: str) -> int:
        try:
            return parse_int(text, "", minimum=minimum, maximum=maximum)
        except IntegerError as e:
            raise argparse.ArgumentTypeError(e.detail) from None
    parse.__name__ = "integer"
    return parse


def int_list_arg(minimum: int | None = None, maximum: int | None = None) -> Callable[[str], list]:
    """An argparse type: parse_int_list with these bounds, sorted without repeats."""
    def parse(text: str) -> list[int]:
        try:
            return sorted(set(parse_int_list(text, "", minimum=minimum, maximum=maximum)))
        except IntegerError as e:
            raise argparse.ArgumentTypeError(e.detail) from None
    parse.__name__ = "integer list"
    return parse


# --- command lines ------------------------------------------------------------------------------

class OneLineParser(argparse.ArgumentParser):
    """argparse with errors on one line, 'prog: error: message', exit status 2 (not usage text
    plus the error). run() extends that to the errors of the command's own work."""

    def error(self, message):
        self.exit(2, self.error_line(message))

    def error_line(self, message) -> str:
        return f"{self.prog}: error: {one_line(message) or 'failed'}\n"

    def options(self) -> list[argparse.Action]:
        """Every flag and positional argument as argparse holds them (option_strings, dest,
        default, choices): what docs/reference.md's tables are tested against."""
        return list(self._actions)

    def run(self, action: Callable[[argparse.Namespace], int | None],
            argv: Sequence[str] | None = None) -> int:
        """Parse argv (exit 2 on bad flags), call action(args) and return its status (None = 0).
        Never a traceback: a ValueError (bad input) returns 2, another Exception 1, Ctrl-C 130,
        each after one line 'prog: error: message' on stderr."""
        args = self.parse_args(argv)
        try:
            return action(args) or 0
        except ValueError as e:
            message, status = e, 2
        except KeyboardInterrupt:
            message, status = "interrupted", 130
        except Exception as e:  # noqa: BLE001 - a command line reports, never tracebacks
            message, status = one_line(e) or type(e).__name__, 1
        self._print_message(self.error_line(message), sys.stderr)
        return status


# --- files --------------------------------------------------------------------------------------

def write_json(path, value, *, indent: int | None = 1) -> Path:
    """The one writer of JSON files, atomically (atomic_write), strict JSON: a NaN or an infinity
    (which json.dumps writes as NaN and Infinity, and no other JSON reader takes) is a
    ValueError, never written."""
    return atomic_write(path, json.dumps(value, indent=indent, allow_nan=False) + "\n")


def current_umask() -> int:
    """The process's umask, read without changing it (os.umask can only set it: setting and
    restoring would race with other threads creating files)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _written_through(path) -> bool:
    """How atomic_write writes path, by what it names (os.stat follows symlinks, as a shell's `>`
    does): False for a regular file or nothing (a temporary file renamed over it), True for a
    character device or a FIFO (/dev/null, /dev/stdout on a terminal or a pipe: opened and
    written, since renaming would replace the device with a regular file). OSError naming what
    path is otherwise: a directory, a block device (a file system's disk: never a mistake to
    make quietly), a socket."""
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        return False
    if stat.S_ISREG(mode):
        return False
    if stat.S_ISCHR(mode) or stat.S_ISFIFO(mode):
        return True
    kind = ("a directory" if stat.S_ISDIR(mode) else "a block device" if stat.S_ISBLK(mode) else
            "a socket" if stat.S_ISSOCK(mode) else "not a regular file")
    raise OSError(errno.EISDIR if stat.S_ISDIR(mode) else errno.EINVAL, f"is {kind}", os.fspath(path))


def output_problem(path, *, devices: bool = True) -> str | None:
    """Why atomic_write cannot write path, found before the work that makes the data (None: it
    can). devices=False: only a regular file will do (a file written again and again, e.g.
    the stats every FLUSH_STEPS)."""
    path = os.fspath(path)
    if "\0" in path:
        return "contains a NUL character"
    if path.endswith(("/", os.sep)):
        return "ends with '/': a file name is needed"
    try:
        through = _written_through(path)
    except OSError as e:
        return e.strerror
    if through:
        if not devices:
            return "is not a regular file"
        return None if os.access(path, os.W_OK) else "not writable"
    folder = os.path.dirname(os.path.realpath(path) if os.path.islink(path) else os.path.abspath(path))
    if not os.path.isdir(folder):
        return f"directory {folder} does not exist"
    try:  # what the write will do, e.g. /proc and /sys refuse it
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".moecache-probe-")
    except OSError as e:
        return f"cannot create a file in {folder} ({e.strerror})"
    os.close(fd)
    os.unlink(probe)
    return None


def atomic_write(path, data: str | bytes | Callable[[Path], None]) -> Path:
    """Write data to path so that readers see the old file or the whole new one, never a part:
    it goes to a temporary file in the same directory, is flushed to disk and renamed over path.
    A symlink at path keeps pointing where it did: its target is what gets replaced (as a
    shell's `>` writes to the target). A character device or a FIFO at path is written through
    (opened for writing, nothing renamed): /dev/null and /dev/stdout stay what they are; any
    other kind of file there is refused with an OSError naming it (_written_through).
    data: text (UTF-8), bytes, or a function that writes the file whose Path it is given. On
    any failure the temporary file is removed and the error raised; path is untouched."""
    if not isinstance(data, (str, bytes, bytearray, memoryview)) and not callable(data):
        raise TypeError(f"atomic_write needs text, bytes or a writer function, got {type(data).__name__}")
    out = Path(os.fspath(path))
    if _written_through(out):
        _write(out, data)
        return out
    target = Path(os.path.realpath(out))
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    tmp = Path(tmp_name)
    try:
        os.close(fd)
        _write(tmp, data)
        with open(tmp, "rb+") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~current_umask())  # mkstemp's 0600 would ignore the user's umask
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    try:  # make the rename itself durable; best effort (not every file system allows it)
        dir_fd = os.open(target.parent, os.O_RDONLY)
        try:
            os.fsync(dir_fd)
        finally:
            os.close(dir_fd)
    except OSError:
        pass
    return out


def _write(path: Path, data) -> None:
    if callable(data):
        data(path)
        return
    with open(path, "wb") as f:
        f.write(data.encode("utf-8") if isinstance(data, str) else data)


# --- memory -------------------------------------------------------------------------------------

UNLIMITED = 1 << 60  # a cgroup without a limit reports about 2^63


def available_memory(proc: str = "/proc") -> tuple[int | None, str]:
    """The bytes this process can still take, and what limits it: the tightest of MemAvailable,
    every memory cgroup over the process (its limit less its use, the inactive file pages it
    holds counted free: the kernel drops them first; v1 memory.limit_in_bytes, v2 memory.max)
    and the address space `ulimit -v` leaves. (None, "unknown") where none is known. Every
    memory check reads it (require_memory; the RAM tier's sizing, moecache.live.ramtier): a
    cgroup's limit is invisible in MemAvailable, which the OOM killer does not wait for. proc:
    where /proc is (a test's copy)."""
    found = []
    available = _field(os.path.join(proc, "meminfo"), "MemAvailable", 1024)
    if available is not None:
        found.append((available, "MemAvailable"))
    for directory, v2 in _memory_cgroups(proc):
        limit = _read_int(os.path.join(directory, "memory.max" if v2 else "memory.limit_in_bytes"))
        used = _read_int(os.path.join(directory, "memory.current" if v2 else "memory.usage_in_bytes"))
        if limit is None or limit >= UNLIMITED or used is None:
            continue
        inactive = _field(os.path.join(directory, "memory.stat"), "inactive_file" if v2 else "total_inactive_file",
                          1) or 0
        found.append((max(0, limit - used + inactive), f"cgroup {directory}: {limit >> 20} MiB limit, "
                                                       f"{max(0, used - inactive) >> 20} MiB used"))
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    size = _field(os.path.join(proc, "self", "status"), "VmSize", 1024)
    if soft != resource.RLIM_INFINITY and size is not None:
        found.append((max(0, soft - size), f"ulimit -v: {soft >> 20} MiB of address space, {size >> 20} MiB mapped"))
    return min(found) if found else (None, "unknown")


def require_memory(nbytes: int, what: str) -> None:
    """ValueError naming `what` when nbytes exceed available_memory(), before allocating."""
    available, source = available_memory()
    if available is not None and nbytes > available:
        raise ValueError(f"{what} need {_size(nbytes)}, {_size(available)} available ({source})")


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit}"
    return f"{nbytes} bytes"


def _read_int(path: str) -> int | None:
    try:
        with open(path) as f:
            text = f.read().strip()
        return UNLIMITED if text == "max" else int(text)
    except (OSError, ValueError):
        return None


def _field(path: str, key: str, scale: int) -> int | None:
    """The value of `key` in a file of 'key: value [kB]' or 'key value' lines, times scale."""
    try:
        with open(path) as f:
            for line in f:
                fields = line.split()
                if fields and fields[0].rstrip(":") == key:
                    return int(fields[1]) * scale
    except (OSError, ValueError, IndexError):
        pass
    return None


def _memory_cgroups(proc: str):
    """(directory, v2) of each memory cgroup over this process, its own first, up to the root
    of each mounted hierarchy (v1's memory controller, v2's unified one)."""
    try:
        with open(os.path.join(proc, "self", "mountinfo")) as f:
            mounts = [line.split() for line in f]
        with open(os.path.join(proc, "self", "cgroup")) as f:
            member = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return
    for fields in mounts:
        end = fields.index("-") if "-" in fields else len(fields)  # the optional fields' end
        if len(fields) < end + 4:
            continue
        kind, options = fields[end + 1], fields[end + 3].split(",")
        if kind not in ("cgroup", "cgroup2") or (kind == "cgroup" and "memory" not in options):
            continue
        root, point = (field.replace("\\040", " ") for field in fields[3:5])
        for entry in member:
            if len(entry) != 3 or (entry[1] == "") != (kind == "cgroup2") or \
                    (kind == "cgroup" and "memory" not in entry[1].split(",")):
                continue
            path = entry[2]
            if os.path.commonpath([root, path]) != root:  # outside what this mount shows
                continue
            directory = os.path.join(point, os.path.relpath(path, root))
            while True:
                yield os.path.normpath(directory), kind == "cgroup2"
                if os.path.normpath(directory) == os.path.normpath(point):
                    break
                directory = os.path.dirname(os.path.normpath(directory))


# --- progress -----------------------------------------------------------------------------------

class Progress:
    """Progress of `total` units on stderr: tqdm when installed, else a plain bar, on a terminal
    only (silent when stderr is redirected, unless log_lines: then one line per step, for
    logs of long runs). Use advance(label) after each unit and close() at the end (or `with`)."""

    WIDTH = 30

    def __init__(self, total: int, *, unit: str = "run", log_lines: bool = False):
        self.total, self.done, self.bar = total, 0, None
        self.tty = sys.stderr.isatty()
        self.enabled = total > 1 and (self.tty or log_lines)
        if self.enabled and self.tty:
            try:
                from tqdm import tqdm
                self.bar = tqdm(total=total, file=sys.stderr, leave=False, unit=unit)
            except ImportError:
                pass

    def advance(self, label: str = "", steps: int = 1) -> None:
        self.done += steps
        if not self.enabled:
            return
        if self.bar is not None:
            self.bar.set_postfix_str(label)
            self.bar.update(steps)
            return
        filled = self.WIDTH * min(self.done, self.total) // self.total
        line = f"[{'#' * filled}{'.' * (self.WIDTH - filled)}] {self.done}/{self.total} {label}"
        if self.tty:
            sys.stderr.write("\r" + line.ljust(78))
        else:
            sys.stderr.write(line + "\n")
        sys.stderr.flush()

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
        elif self.enabled and self.tty:
            sys.stderr.write("\r" + " " * 78 + "\r")
            sys.stderr.flush()

    def __enter__(self) -> "Progress":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
