"""Per-layer expert usage profiles: saved at exit, loaded at start to warm the cache.

A profile counts, per cached layer, the decode steps each expert was used in. At start the
glue loads it and calls engine.preload(profile.top(n_slots), rates=profile.rates(n_used)):
the most used experts are uploaded at the first boundary instead of being missed one INSERTS
batch at a time, and a policy that keeps use statistics starts from the profile's instead of
from nothing.

File: JSON {"format": "moecache-profile", "version": 1, "model": str, "n_expert": E,
"layers": [model layer numbers], "counts": [[E ints] per layer]}, written atomically.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import reprlib

import numpy as np

from ..util import write_json

FORMAT, VERSION = "moecache-profile", 1
# counts are decode steps: 2**53 keeps every sum of them exact in int64 and in JSON's doubles
MAX_COUNT = 2**53


class ProfileError(ValueError):
    """A profile that cannot be used; the message is one line naming the file."""


class UsageProfile:
    def __init__(self, model: str, layers, counts):
        """counts: (len(layers), n_expert), e.g. CacheEngine.usage."""
        self.model = model
        self.layers = [int(l) for l in layers]
        self.counts = np.array(counts, dtype=np.int64)
        if self.counts.ndim != 2 or self.counts.shape[0] != len(self.layers):
            raise ValueError(f"counts must be (len(layers)={len(self.layers)}, n_expert), "
                             f"got shape {self.counts.shape}")
        if (self.counts < 0).any():
            raise ValueError("counts must be >= 0")

    @property
    def n_expert(self) -> int:
        return self.counts.shape[1]

    @classmethod
    def from_ids(cls, model, layers, n_expert, ids) -> "UsageProfile":
        """From routing (steps, n_layers, n) with -1 for no selection; counts steps used in."""
        ids = np.asarray(ids)
        counts = np.zeros((ids.shape[1], n_expert), dtype=np.int64)
        for step_ids in ids:
            used = np.zeros_like(counts, dtype=bool)
            rows, cols = np.nonzero(step_ids >= 0)
            used[rows, step_ids[rows, cols]] = True
            counts += used
        return cls(model, layers, counts)

    def merged(self, other: "UsageProfile") -> "UsageProfile":
        """Counts of both runs, for profiles accumulated over sessions."""
        self.check_shape(other.layers, other.n_expert, what="the other profile")
        return UsageProfile(self.model, self.layers, self.counts + other.counts)

    def top(self, n: int) -> list[np.ndarray]:
        """Per layer, up to n used experts, most used first (ties: lower id first)."""
        order = np.argsort(-self.counts, axis=1, kind="stable")[:, :n]
        return [row[self.counts[li, row] > 0] for li, row in enumerate(order)]

    def rates(self, n_used: int) -> np.ndarray:
        """(layers, n_expert) uses per decode step. A decode step selects n_used distinct
        experts in every layer, so a layer's steps are its total count / n_used."""
        if n_used < 1:
            raise ValueError(f"n_used must be >= 1, got {n_used}")
        steps = self.counts.sum(axis=1, keepdims=True) / n_used
        return np.divide(self.counts, steps, out=np.zeros(self.counts.shape), where=steps > 0)

    def check_shape(self, layers, n_expert, *, what="this model", path="profile"):
        layers = [int(l) for l in layers]
        if layers != self.layers or n_expert != self.n_expert:
            raise ProfileError(f"{path}: profile covers {len(self.layers)} layers x {self.n_expert} "
                               f"experts (layers {_span(self.layers)}), {what} has {len(layers)} x "
                               f"{n_expert} (layers {_span(layers)})")

    def save(self, path: str) -> None:
        data = {"format": FORMAT, "version": VERSION, "model": self.model,
                "n_expert": self.n_expert, "layers": self.layers, "counts": self.counts.tolist()}
        write_json(path, data, indent=None)

    def add_to(self, path: str) -> None:
        """Add these counts to the profile at path (created if absent). Processes and contexts
        sharing one file take turns: read, merge and replace under an exclusive lock, so no
        one's counts are lost."""
        with _locked(path):
            total = self
            if os.path.exists(path):
                total = self.merged(UsageProfile.load(path, layers=self.layers, n_expert=self.n_expert))
            total.save(path)

    @classmethod
    def load(cls, path: str, *, layers=None, n_expert=None) -> "UsageProfile":
        """Load and, when layers/n_expert are given, check it fits the running model. Any
        problem with the file is a ProfileError naming it, never another exception."""
        try:
            with open(path, "rb") as f:
                data = json.loads(f.read().decode("utf-8"))
        except OSError as e:
            raise ProfileError(f"{path}: {e.strerror or e}") from None
        except UnicodeDecodeError:
            raise ProfileError(f"{path}: not a {FORMAT} file (not UTF-8 text)") from None
        except json.JSONDecodeError as e:
            raise ProfileError(f"{path}:{e.lineno}: not valid JSON ({e.msg})") from None
        except (ValueError, RecursionError) as e:  # e.g. an integer of 5000 digits, nesting
            raise ProfileError(f"{path}: not valid JSON ({type(e).__name__})") from None
        if not isinstance(data, dict) or data.get("format") != FORMAT:
            raise ProfileError(f"{path}: not a {FORMAT} file")
        if data.get("version") != VERSION or isinstance(data.get("version"), bool):
            raise ProfileError(f"{path}: profile version {reprlib.repr(data.get('version'))}, expected {VERSION}")
        missing = [key for key in ("model", "n_expert", "layers", "counts") if key not in data]
        if missing:
            raise ProfileError(f"{path}: missing field {missing[0]!r}")
        model_layers, counts = data["layers"], data["counts"]
        if not isinstance(data["model"], str):
            raise ProfileError(f"{path}: model={reprlib.repr(data['model'])} is not a string")
        if not _is_count(data["n_expert"], MAX_COUNT) or data["n_expert"] < 1:
            raise ProfileError(f"{path}: n_expert={reprlib.repr(data['n_expert'])} is not a positive integer")
        if (not isinstance(model_layers, list) or not model_layers
                or not all(_is_count(l, MAX_COUNT) for l in model_layers)
                or len(set(model_layers)) != len(model_layers)):
            raise ProfileError(f"{path}: layers must be a non-empty list of distinct layer numbers >= 0")
        if not isinstance(counts, list) or len(counts) != len(model_layers):
            raise ProfileError(f"{path}: counts must be a list of {len(model_layers)} rows, one per layer")
        for li, row in enumerate(counts):
            if not isinstance(row, list) or len(row) != data["n_expert"]:
                raise ProfileError(f"{path}: n_expert={data['n_expert']} but counts rows have "
                                   f"{len(row) if isinstance(row, list) else 'no'} entries (row {li})")
            bad = next((e for e, c in enumerate(row) if not _is_count(c, MAX_COUNT)), None)
            if bad is not None:
                raise ProfileError(f"{path}: counts[{li}][{bad}]={reprlib.repr(row[bad])} is not a whole "
                                   f"number of steps in [0, {MAX_COUNT}]")
        profile = cls(data["model"], model_layers, counts)
        if layers is not None or n_expert is not None:
            profile.check_shape(profile.layers if layers is None else layers,
                                profile.n_expert if n_expert is None else n_expert, path=path)
        return profile


def _is_count(value, maximum: int) -> bool:
    """A JSON integer (not a float such as 1.0 or 1e308, not a bool) in [0, maximum]."""
    return type(value) is int and 0 <= value <= maximum


def _span(layers):
    return f"{layers[0]}..{layers[-1]}" if layers else "none"


@contextlib.contextmanager
def _locked(path: str):
    """An exclusive lock for path's read-modify-write: on a lock file beside it, as the profile
    itself is replaced by each write."""
    directory, name = os.path.split(os.path.abspath(path))
    fd = os.open(os.path.join(directory, f".{name}.lock"), os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)
