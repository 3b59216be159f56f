"""The replay's trace adapter: a RouteTrace as the steps each cache model consumes, and when
each expert is used next (what the offline optima read ahead), computed here once.

- per-layer (moecache.core.engine.CacheEngine): (n_layers, n) ids, what the live cache would
  observe, in order; prompts fed per PREFILL_MODES.
- global (moecache.offline.budget): (layer index, keys) batches, keys = layer * n_expert +
  expert, one per layer for a turn's whole prefill, then one per layer per decode token.
- upstream (moecache.offline.upstream): (layer index, expert ids, n_tokens) per layer of each
  ubatch: a turn's prompt in ubatches of DEFAULT_UBATCH tokens, then each decode token alone.

Each is a list of (is_decode, [step, ...]) segments, adjacent steps of one phase together, so
the driver can tell decode counts from prefill ones. Sweeps replay one trace many times: its
steps and its NextUse are prepared once per trace and model.
"""

from __future__ import annotations

import weakref

import numpy as np

from ..core.policies import NextUse
from ..core.traces import DECODE, PREFILL, RouteTrace
from .upstream import DEFAULT_UBATCH

PER_LAYER, GLOBAL, UPSTREAM = "per-layer", "global", "upstream"
PREFILL_MODES = ("warm", "off", "plain")  # the per-layer model's prompts (moecache.offline.replay)

_prepared: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # trace -> {key: steps}


def _memo(trace, key, build):
    memo = _prepared.setdefault(trace, {})
    if key not in memo:
        memo[key] = build()
    return memo[key]


def segments(trace: RouteTrace, model: str, prefill: str | None = None) -> list[tuple[bool, list]]:
    """[(is_decode, [step input, ...])] of one model (prefill: the per-layer model's mode)."""
    build = {PER_LAYER: lambda: _observations(trace, prefill),
             GLOBAL: lambda: _batches(trace), UPSTREAM: lambda: ubatches(trace)}[model]
    return _memo(trace, (model, prefill), build)


def future(trace: RouteTrace, model: str, prefill: str | None = None) -> NextUse:
    """When each key is used next in a replay of `trace` through the per-layer or the global
    model: what their offline policies (belady) read ahead."""
    def build():
        items = [item for _, items in segments(trace, model, prefill) for item in items]
        if model == PER_LAYER:
            keys = observation_keys(items, trace.n_expert)
        else:
            keys = [np.unique(np.asarray(batch_keys, dtype=np.int64)) for _, batch_keys in items]
        return next_use(keys, trace.layers.size * trace.n_expert)
    return _memo(trace, ("future", model, prefill), build)


def observation_keys(observations, n_expert: int) -> list[np.ndarray]:
    """Each (n_layers, n) observation's distinct keys (layer * n_expert + expert), ascending:
    the experts an engine marks used in it."""
    keys = []
    for ids in observations:
        ids = np.asarray(ids)
        rows, cols = np.nonzero(ids >= 0)
        keys.append(np.unique(rows * n_expert + ids[rows, cols]))
    return keys


def next_use(step_keys, n_keys: int) -> NextUse:
    """step_keys: each step's distinct keys, ascending. For every step, the next step that uses
    each of its keys (+inf: none), and each key's first step."""
    sizes = [k.size for k in step_keys]
    keys = np.concatenate(step_keys).astype(np.int64) if step_keys else np.empty(0, dtype=np.int64)
    steps = np.repeat(np.arange(len(step_keys)), sizes)
    order = np.lexsort((steps, keys))  # by key, then step
    key, step = keys[order], steps[order]
    same_key = key[1:] == key[:-1]
    following = np.full(key.size, np.inf)
    following[:-1][same_key] = step[1:][same_key]
    after = np.empty(key.size)
    after[order] = following  # back in step order
    first = np.full(n_keys, np.inf)
    starts = np.concatenate(([True], ~same_key)) if key.size else np.empty(0, dtype=bool)
    first[key[starts]] = step[starts]
    return NextUse(first, list(step_keys), np.split(after, np.cumsum(sizes)[:-1]) if sizes else [])


def turns(trace: RouteTrace) -> list[slice]:
    """Each turn's step range (steps are in (turn, step) order)."""
    bounds = [0, *(np.flatnonzero(np.diff(trace.turn)) + 1).tolist(), len(trace.turn)]
    return [slice(a, b) for a, b in zip(bounds[:-1], bounds[1:])]


def _merged(segments):
    out = []
    for is_decode, items in segments:
        if items and out and out[-1][0] == is_decode:
            out[-1][1].extend(items)
        elif items:
            out.append((is_decode, list(items)))
    return out


def _observations(trace, prefill):
    """The per-layer model's steps: (n_layers, n) ids, what the live cache would observe, in
    order. The decode tokens of one recorded batch (a multi-token ubatch) are one observation;
    a turn's prompt is one ("plain"), or one per recorded batch, else per ubatch of
    DEFAULT_UBATCH tokens, as llama.cpp splits it ("warm"), or none ("off")."""
    segments = []
    for turn in turns(trace):
        ids, phase = trace.ids[turn], trace.phase[turn]
        prompt = phase == PREFILL
        if prefill == "plain" and prompt.any():
            segments.append((False, [_together(ids[prompt])]))
        elif prefill == "warm" and prompt.any():
            batch = trace.batch[turn][prompt]
            if (batch < 0).all():
                batch = np.arange(prompt.sum()) // DEFAULT_UBATCH
            starts = np.flatnonzero(np.diff(batch)) + 1
            segments.append((False, [_together(part) for part in np.split(ids[prompt], starts)]))
        decode = phase == DECODE
        segments.append((True, _by_batch(ids[decode], trace.batch[turn][decode])))
    return _merged(segments)


def _together(ids):
    """Steps (n, L, k) as one observation (L, n * k), token by token."""
    return np.ascontiguousarray(ids.transpose(1, 0, 2)).reshape(ids.shape[1], -1)


def _by_batch(ids, batch):
    """Steps (n, L, k) as observations: consecutive steps of one recorded batch together."""
    if len(ids) == 0 or (batch < 0).all():
        return list(ids)
    starts = np.flatnonzero((np.diff(batch) != 0) | (batch[1:] < 0)) + 1
    return [group[0] if len(group) == 1 else _together(group) for group in np.split(ids, starts)]


def _batches(trace):
    """The global model's steps: (layer index, keys) with keys layer * n_expert + expert, in
    the order that engine's load_layer calls run."""
    base = np.arange(trace.layers.size)[:, None] * trace.n_expert
    segments = []
    for turn in turns(trace):
        ids, phase = trace.ids[turn], trace.phase[turn]
        prefill = ids[phase == PREFILL]  # (tokens, L, k)
        batches = []
        for li in range(trace.layers.size):
            ids_li = prefill[:, li, :].ravel()  # token-major: the prompt tail's experts end hottest
            ids_li = ids_li[ids_li >= 0]
            if ids_li.size:
                batches.append((li, (ids_li + base[li, 0]).tolist()))
        segments.append((False, batches))
        decode = ids[phase == DECODE]
        keys = np.where(decode >= 0, decode + base, -1).tolist()  # (steps, L, k)
        if (decode < 0).any():  # bare routing: a layer without a selection looks nothing up
            keys = [[[key for key in row if key >= 0] for row in rows] for rows in keys]
        segments.append((True, [(li, row) for rows in keys for li, row in enumerate(rows) if row]))
    return _merged(segments)


def ubatches(trace: RouteTrace, n_ubatch: int = DEFAULT_UBATCH) -> list[tuple[bool, list]]:
    """The upstream model's steps: (layer index, expert ids, n_tokens) per layer of each
    ubatch: a turn's prompt in ubatches of n_ubatch tokens, then each decode token alone."""
    segments = []
    for turn in turns(trace):
        ids, phase = trace.ids[turn], trace.phase[turn]
        prefill = ids[phase == PREFILL]  # (tokens, L, k)
        steps = []
        for start in range(0, len(prefill), n_ubatch):
            ubatch = prefill[start:start + n_ubatch]
            steps += [(li, ubatch[:, li, :].ravel().tolist(), len(ubatch)) for li in range(trace.layers.size)]
        segments.append((False, steps))
        segments.append((True, [(li, row, 1) for rows in ids[phase == DECODE].tolist()
                                for li, row in enumerate(rows)]))
    return _merged(segments)
