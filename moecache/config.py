"""Cache configuration: LLAMA_MOE_CACHE_* environment variables, or the same as keyword arguments."""

from __future__ import annotations

import os
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
    max_batch: int = 32            # ubatches of up to this many tokens use the cache (decode,
                                   # speculative verification); larger ones are stock

    def __post_init__(self):
        _require_int("SLOTS", self.slots, minimum=0)
        _require_int("INSERTS", self.inserts, minimum=1)
        _require_int("DEBUG", self.debug, minimum=0)
        _require_int("WAIT", self.wait, minimum=0)
        _require_int("MAX_BATCH", self.max_batch, minimum=1, maximum=MAX_BATCH)
        if self.wait > 1:
            raise ConfigError(f"{ENV_PREFIX}WAIT={self.wait} must be 0 or 1")
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
            folder = os.path.dirname(os.path.abspath(path)) if path else None
            if folder and not os.path.isdir(folder):
                raise ConfigError(f"{ENV_PREFIX}{name.upper()}={path!r}: directory {folder} does not exist")

    @property
    def enabled(self) -> bool:
        return self.slots > 0

    @classmethod
    def from_env(cls, environ=None, **overrides) -> "CacheConfig":
        """LLAMA_MOE_CACHE_<NAME> for every field; keyword arguments win over the environment."""
        environ = os.environ if environ is None else environ
        values = {}
        for field in fields(cls):
            name = ENV_PREFIX + field.name.upper()
            text = environ.get(name)
            if text is None or text == "":
                continue
            values[field.name] = _parse_int(name, text) if field.type == "int" else text
        values.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**values)


def _parse_int(name: str, value, minimum: int | None = None, maximum: int | None = None) -> int:
    try:
        return parse_int(value, name, minimum=minimum, maximum=maximum)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _require_int(name: str, value, minimum: int, maximum: int | None = None) -> None:
    _parse_int(ENV_PREFIX + name, value, minimum, maximum)
