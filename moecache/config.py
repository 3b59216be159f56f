"""Cache configuration: LLAMA_MOE_CACHE_* environment variables, or the same as keyword arguments."""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, fields

from .policies import DEFAULT_POLICY, POLICIES
from .util import parse_int


class ConfigError(ValueError):
    """A bad configuration value; the message is one line naming the variable."""


ENV_PREFIX = "LLAMA_MOE_CACHE_"
MAX_BATCH = 512  # libllama's limit on max_batch


@dataclass(frozen=True)
class CacheConfig:
    slots: int = 0                 # experts cached per layer; 0 = off
    inserts: int = 2               # uploads per layer per decode step
    policy: str = DEFAULT_POLICY
    wait: int = 0                  # 1: each boundary waits for the last step's uploads
                                   # (replayable hit counts, may stall); 0: never stall
    debug: int = 0                 # print stats to stderr every N steps (and at exit); 0 = off
    stats: str | None = None       # write stats JSON here (atomically) at exit
    trace: str | None = None       # record live routing as route_trace v1
    profile: str | None = None     # usage profile: load at start to warm the cache, save at exit
    flush_steps: int = 64          # also write stats and profile every N decode steps, so that
                                   # they survive a crash; 0 = only when the cache closes
    max_batch: int = 32            # ubatches of up to this many tokens use the cache (decode,
                                   # speculative verification); larger ones are stock
    repack: int = 1                # 1: host experts repacked as stock --cpu-moe does (slots are
                                   # read from the model file); 0: plain buffers (copied from RAM)

    def __post_init__(self):
        for name, minimum, maximum in (("slots", 0, None), ("inserts", 1, None), ("debug", 0, None),
                                       ("wait", 0, 1), ("flush_steps", 0, None), ("max_batch", 1, MAX_BATCH),
                                       ("repack", 0, 1)):
            # keyword values too (attach(slots=...)): ints, or text parse_int reads, kept as int
            object.__setattr__(self, name, _parse_int(ENV_PREFIX + name.upper(), getattr(self, name),
                                                      minimum, maximum))
        if self.policy == "default":
            object.__setattr__(self, "policy", DEFAULT_POLICY)
        if self.policy not in POLICIES:
            raise ConfigError(f"{ENV_PREFIX}POLICY={self.policy!r} is not a policy; "
                              f"choose from default, {', '.join(sorted(POLICIES))}")
        if POLICIES[self.policy].offline_only:
            raise ConfigError(f"{ENV_PREFIX}POLICY={self.policy!r} needs future routing and only "
                              f"runs in offline replay (python -m moecache.replay)")
        for name in ("stats", "trace", "profile"):  # written later: say so now, not at exit
            path = getattr(self, name)
            problem = _unwritable(path) if path else None
            if problem:
                raise ConfigError(f"{ENV_PREFIX}{name.upper()}={path!r}: {problem}")

    @property
    def enabled(self) -> bool:
        return self.slots > 0

    @classmethod
    def from_env(cls, environ=None, **overrides) -> "CacheConfig":
        """LLAMA_MOE_CACHE_<NAME> for every field (unset or empty: the default); keyword
        arguments win over the environment. Another LLAMA_MOE_CACHE_ name is an error (a typo
        would otherwise be silently ignored)."""
        environ = os.environ if environ is None else environ
        known = [ENV_PREFIX + field.name.upper() for field in fields(cls)]
        unknown = sorted(name for name in environ if name.startswith(ENV_PREFIX) and name not in known)
        if unknown:
            raise ConfigError(f"{unknown[0]} is not a moecache variable; known: {', '.join(known)}")
        values = {}
        for field in fields(cls):
            name = ENV_PREFIX + field.name.upper()
            text = environ.get(name)
            if text is None or text == "":
                continue
            values[field.name] = text  # __post_init__ parses the integers
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def _unwritable(path: str) -> str | None:
    """Why a file cannot be written at path (atomically: a temporary file in its directory,
    renamed over it), or None."""
    if "\0" in path:
        return "contains a NUL character"
    if path.endswith(("/", os.sep)):
        return "ends with '/': a file name is needed"
    if os.path.isdir(path):
        return "is a directory"
    if os.path.lexists(path) and not os.path.isfile(path):
        return "is not a regular file"
    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder):
        return f"directory {folder} does not exist"
    try:  # what the write will do, e.g. /proc and /sys refuse it
        fd, probe = tempfile.mkstemp(dir=folder, prefix=".moecache-probe-")
    except OSError as e:
        return f"cannot create a file in {folder} ({e.strerror})"
    os.close(fd)
    os.unlink(probe)
    return None


def _parse_int(name: str, value, minimum: int | None = None, maximum: int | None = None) -> int:
    try:
        return parse_int(value, name, minimum=minimum, maximum=maximum)
    except ValueError as e:
        raise ConfigError(str(e)) from None
