"""Cache configuration: LLAMA_MOE_CACHE_* environment variables, or the same as keyword arguments."""

from __future__ import annotations

import os
from dataclasses import dataclass, fields

from ..core.admission import ADMISSIONS, live_admission
from ..core.missplan import planner_by_default
from ..core.policies import DEFAULT_POLICY, POLICIES, resolve_policy
from ..util import output_problem, parse_gbps, parse_int


class ConfigError(ValueError):
    """A bad configuration value; the message is one line naming the variable."""


ENV_PREFIX = "LLAMA_MOE_CACHE_"
MAX_BATCH = 512  # libllama's limit on max_batch
C_INT_MAX = 2**31 - 1  # counts libllama takes as a C int


@dataclass(frozen=True)
class CacheConfig:
    slots: int | str = 0           # experts cached per layer; 0 = off; "auto": as MIB=auto
    mib: int | str = 0             # or a device budget in MiB over all devices (0 = off); "auto":
                                   # each device's free memory less RESERVE_MIB (moecache.live.sizing)
    reserve_mib: int = 1024        # MiB that auto sizing (and a failed allocation's retry) leaves
                                   # free on each device: llama.cpp's own --fit margin
    inserts: int = 2               # uploads per layer per decode step
    policy: str = DEFAULT_POLICY
    admission: str | None = None   # when a miss is uploaded: "eager", by libllama while the graph
                                   # that missed it runs (usable from the next token); "boundary",
                                   # at the next decode boundary. None: eager, or boundary for a
                                   # policy that picks its victims itself (arc, sieve)
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
    ram_mib: int | str = 0         # the RAM tier, for models larger than RAM: the experts kept in
                                   # host memory, in MiB over all layers, the others read from the
                                   # model file when selected; "auto": what the process may use
                                   # less what it holds (moecache.live.ramtier); 0 = off. With
                                   # SLOTS or MIB too, it serves the CPU half of the device cache
    read_ahead: int = 1            # the RAM tier alone, in decode: 1 reads each layer's likely experts
                                   # while the layer before computes (the next router applied to its
                                   # input, in the graph); 0: each layer reads its misses at its
                                   # router. A prompt reads the next layer whole either way
    planner: int | None = None     # 1: the miss planner (issue 22): some misses through the
                                   # copy-on-miss lane, an eager upload only when it pays back its
                                   # link time (moecache.live.rates); None: on wherever it can run
                                   # (moecache.core.missplan.planner_by_default), not with the RAM tier
    link_gbps: float | str | None = None  # the planner's host-to-device rate, GB/s; None: measured
    host_gbps: float | str | None = None  # the planner's host read rate, GB/s; None: measured

    def __post_init__(self):
        for name in ("slots", "mib", "ram_mib"):  # an integer, or auto
            if getattr(self, name) != "auto":
                object.__setattr__(self, name, _parse_int(ENV_PREFIX + name.upper(), getattr(self, name), 0,
                                                          C_INT_MAX if name == "slots" else None))
        if self.slots and self.mib and (self.slots, self.mib) != ("auto", "auto"):
            raise ConfigError(f"{ENV_PREFIX}SLOTS={self.slots} and {ENV_PREFIX}MIB={self.mib} both size "
                              f"the cache: set one")
        for name, minimum, maximum in (("reserve_mib", 0, None), ("inserts", 1, C_INT_MAX), ("debug", 0, None),
                                       ("wait", 0, 1), ("flush_steps", 0, None),
                                       ("max_batch", 1, MAX_BATCH), ("repack", 0, 1), ("read_ahead", 0, 1),
                                       ("planner", 0, 1)):
            if getattr(self, name) is None:  # planner: decided below, from the policy and timing
                continue
            # keyword values too (attach(slots=...)): ints, or text parse_int reads, kept as int
            object.__setattr__(self, name, _parse_int(ENV_PREFIX + name.upper(), getattr(self, name),
                                                      minimum, maximum))
        for name in ("link_gbps", "host_gbps"):
            if getattr(self, name) is not None:
                try:
                    object.__setattr__(self, name, parse_gbps(getattr(self, name), ENV_PREFIX + name.upper()))
                except ValueError as e:
                    raise ConfigError(str(e)) from None
        object.__setattr__(self, "policy", resolve_policy(self.policy))
        if self.policy not in POLICIES:
            raise ConfigError(f"{ENV_PREFIX}POLICY={self.policy!r} is not a policy; "
                              f"choose from default, {', '.join(sorted(POLICIES))}")
        if POLICIES[self.policy].offline_only:
            raise ConfigError(f"{ENV_PREFIX}POLICY={self.policy!r} needs future routing and only "
                              f"runs in offline replay (python -m moecache.replay)")
        ranks = POLICIES[self.policy].ranks_residents
        if self.admission is None:
            object.__setattr__(self, "admission", live_admission(POLICIES[self.policy]))
        if self.admission not in ADMISSIONS:
            raise ConfigError(f"{ENV_PREFIX}ADMISSION={self.admission!r} is not a timing; "
                              f"choose from {', '.join(ADMISSIONS)}")
        if self.admission == "eager" and not ranks:
            raise ConfigError(f"{ENV_PREFIX}ADMISSION=eager needs a policy that ranks experts; "
                              f"{ENV_PREFIX}POLICY={self.policy!r} picks its victims itself")
        self._check_planner()
        for name in ("stats", "trace", "profile"):  # written later: say so now, not at exit
            path = getattr(self, name)
            problem = output_problem(path, devices=False) if path else None
            if problem:
                raise ConfigError(f"{ENV_PREFIX}{name.upper()}={path!r}: {problem}")
        files = [(name, os.path.realpath(getattr(self, name))) for name in ("stats", "trace", "profile")
                 if getattr(self, name)]
        for i, (name, real) in enumerate(files):  # one would overwrite the other
            for other, other_real in files[i + 1:]:
                if real == other_real:
                    raise ConfigError(f"{ENV_PREFIX}{name.upper()} and {ENV_PREFIX}{other.upper()} name one "
                                      f"file ({getattr(self, name)!r}): give each its own")

    def _check_planner(self):
        """The planner shapes eager admission's worths in uses of a device cache's uploads. Unset, it
        runs wherever it can: it never lost in the modelled grid (planner_by_default)."""
        if self.planner is None:
            can_run = planner_by_default(POLICIES[self.policy], self.admission) and not self.ram_mib
            object.__setattr__(self, "planner", int(can_run))
            if not can_run:
                self._refuse_rates(f"off for {ENV_PREFIX}POLICY={self.policy}, {ENV_PREFIX}ADMISSION="
                                   f"{self.admission}" + (f", {ENV_PREFIX}RAM_MIB" if self.ram_mib else ""))
                return
        if not self.planner:
            self._refuse_rates(f"off ({ENV_PREFIX}PLANNER=0)")
            return
        if self.admission != "eager" or not POLICIES[self.policy].counts_uses:
            raise ConfigError(f"{ENV_PREFIX}PLANNER=1 needs eager admission and a policy whose worth counts uses "
                              f"(heat, lfu); got {ENV_PREFIX}ADMISSION={self.admission}, "
                              f"{ENV_PREFIX}POLICY={self.policy}")
        if self.ram_mib:
            raise ConfigError(f"{ENV_PREFIX}PLANNER=1 does not plan with the RAM tier ({ENV_PREFIX}RAM_MIB="
                              f"{self.ram_mib}): its rates leave out the model file's reads")

    def _refuse_rates(self, why: str):
        given = [f"{ENV_PREFIX}{name.upper()}" for name in ("link_gbps", "host_gbps") if getattr(self, name)]
        if given:
            raise ConfigError(f"{given[0]} sets a rate of the miss planner, which is {why}")

    @property
    def enabled(self) -> bool:
        return self.device_cache or self.ram_tier

    @property
    def device_cache(self) -> bool:
        """Slots on the device (SLOTS or MIB)."""
        return self.slots != 0 or self.mib != 0

    @property
    def ram_tier(self) -> bool:
        """The cache keeps experts in host memory and reads the others from the model file."""
        return self.ram_mib != 0

    @property
    def budget_mib(self) -> int | str | None:
        """The device memory budget: MiB, "auto", or None when SLOTS=K sizes the cache."""
        return "auto" if "auto" in (self.slots, self.mib) else (self.mib or None)

    @property
    def sized_by(self) -> str:
        """The setting that sizes the cache (the device cache's, with both tiers), as the user wrote it."""
        name = "slots" if self.slots else "mib" if self.mib else "ram_mib"
        return f"{ENV_PREFIX}{name.upper()}={getattr(self, name)}"

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


def _parse_int(name: str, value, minimum: int | None = None, maximum: int | None = None) -> int:
    try:
        return parse_int(value, name, minimum=minimum, maximum=maximum)
    except ValueError as e:
        raise ConfigError(str(e)) from None
