"""The replay's trace adapter: a RouteTrace as the steps each cache model consumes, and when
each expert is used next (what the offline optima read ahead), computed here once.

- per-layer (moecache.core.engine.CacheEngine): (n_layers, n) ids, what the live cache would
  observe, in order; prompts fed per PREFILL_MODES.
- global (moecache.offline.budget): (layer index, keys) batches, keys = layer * n_expert +
  expert, one per layer for a turn's whole prefill, then one per layer per decode token.
- upstream (moecache.offline.upstream): (layer index, expert ids, n_tokens) per layer of each
  ubatch: a turn's prompt in ubatches of DEFAULT_UBATCH tokens, then each decode token alone.

Each is an iterator of (is_decode, [step, ...]) segments of one phase, so the driver can tell
decode counts from prefill ones. The segments are made as the driver takes them, a window of
WINDOW_STEPS steps at a time, and a mapped trace drops the pages of a window once it is
replayed (RouteTrace.drop_pages): a replay holds a window, never the whole trace's steps.
Sweeps replay one trace many times: its NextUse is prepared once per trace and model.
"""

from __future__ import annotations

import weakref

import numpy as np

from ..core.policies import NextUse
from ..formats.traces import DECODE, PREFILL, WINDOW_STEPS, RouteTrace
from .upstream import DEFAULT_UBATCH

PER_LAYER, GLOBAL, UPSTREAM, PAGE_CACHE = "per-layer", "global", "upstream", "page-cache"
PREFILL_MODES = ("warm", "off", "plain", "lookup")  # the per-layer model's prompts (moecache.offline.replay)

_prepared: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # trace -> {key: NextUse}


def segments(trace: RouteTrace, model: str, prefill: str | None = None):
    """(is_decode, [step input, ...]) of one model, made as they are taken (prefill: the
    per-layer model's mode)."""
    if model == PER_LAYER:
        return _observations(trace, prefill)
    return {GLOBAL: _batches, UPSTREAM: ubatches}[model](trace)


def future(trace: RouteTrace, model: str, prefill: str | None = None) -> NextUse:
    """When each key is used next in a replay of `trace` through the per-layer or the global
    model: what their offline policies (belady) read ahead."""
    memo = _prepared.setdefault(trace, {})
    key = (model, prefill)
    if key not in memo:
        items = (item for _, items in segments(trace, model, prefill) for item in items)
        if model == PER_LAYER:
            keys = observation_keys(items, trace.n_expert)
        else:
            keys = [np.unique(np.asarray(batch_keys, dtype=np.int64)) for _, batch_keys in items]
        memo[key] = next_use(keys, trace.layers.size * trace.n_expert)
    return memo[key]


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


def _phases(trace):
    """(the prompt's steps, the decode steps) of each turn, as step numbers."""
    for turn in turns(trace):
        phase = trace.phase[turn]
        yield turn.start + np.flatnonzero(phase == PREFILL), turn.start + np.flatnonzero(phase == DECODE)


def _windows(trace, steps, starts=None):
    """(positions in steps, their ids) of about WINDOW_STEPS steps at a time, cut only where a
    group begins (starts: positions in steps; None: anywhere). When the next window is asked
    for, the last one is replayed: the trace drops the pages it read."""
    n = len(steps)
    if starts is None:
        starts = np.arange(1, n)
    marks = np.searchsorted(starts, np.arange(WINDOW_STEPS, n, WINDOW_STEPS))
    cuts = [0, *np.unique(starts[marks[marks < starts.size]]).tolist()] if n else []
    for a, b in zip(cuts, [*cuts[1:], n]):
        yield slice(a, b), trace.ids[steps[a:b]]
        trace.drop_pages()


def _observations(trace, prefill):
    """The per-layer model's steps: (n_layers, n) ids, what the live cache would observe, in
    order. The decode tokens of one recorded batch (a multi-token ubatch) are one observation;
    a turn's prompt is one ("plain"), or one per recorded batch, else per ubatch of
    DEFAULT_UBATCH tokens, as llama.cpp splits it ("warm", "lookup"), or none ("off")."""
    for prompt, decode in _phases(trace):
        if prefill == "plain" and prompt.size:
            yield False, [_together(trace.ids[prompt])]
            trace.drop_pages()
        elif prefill in ("warm", "lookup") and prompt.size:
            batch = trace.batch[prompt]
            if (batch < 0).all():
                batch = np.arange(prompt.size) // DEFAULT_UBATCH
            for window, ids in _windows(trace, prompt, _prompt_starts(batch)):
                yield False, [_together(part) for part in np.split(ids, _prompt_starts(batch[window]))]
        batch = trace.batch[decode]
        for window, ids in _windows(trace, decode, _decode_starts(batch)):
            yield True, _by_batch(ids, batch[window])


def decode_steps(trace: RouteTrace) -> int:
    """The decode observations _observations makes: one per recorded batch of decode tokens (a
    multi-token ubatch is one step of the live cache, as its stats count them), one per token
    without a recorded batch."""
    return sum(int(decode.size > 0) + _decode_starts(trace.batch[decode]).size for _, decode in _phases(trace))


def _together(ids):
    """Steps (n, L, k) as one observation (L, n * k), token by token."""
    return np.ascontiguousarray(ids.transpose(1, 0, 2)).reshape(ids.shape[1], -1)


def _prompt_starts(batch):
    """Where an observation begins among a prompt's steps: at a new batch."""
    return np.flatnonzero(np.diff(batch)) + 1


def _decode_starts(batch):
    """Where an observation begins among decode steps: at a new recorded batch, and at every
    step without one (batch -1)."""
    return np.flatnonzero((np.diff(batch) != 0) | (batch[1:] < 0)) + 1


def _by_batch(ids, batch):
    """Steps (n, L, k) as observations: consecutive steps of one recorded batch together."""
    if len(ids) == 0 or (batch < 0).all():
        return list(ids)
    groups = np.split(ids, _decode_starts(batch))
    return [group[0] if len(group) == 1 else _together(group) for group in groups]


def _batches(trace):
    """The global model's steps: (layer index, keys) with keys layer * n_expert + expert, in
    the order that engine's load_layer calls run."""
    base = np.arange(trace.layers.size)[:, None] * trace.n_expert
    for prompt, decode in _phases(trace):
        prefill = trace.ids[prompt]  # (tokens, L, k): one batch per layer for the whole prompt
        batches = []
        for li in range(trace.layers.size):
            ids_li = prefill[:, li, :].ravel()  # token-major: the prompt tail's experts end hottest
            ids_li = ids_li[ids_li >= 0]
            if ids_li.size:
                batches.append((li, (ids_li + base[li, 0]).tolist()))
        yield False, batches
        trace.drop_pages()
        for _, ids in _windows(trace, decode):
            keys = np.where(ids >= 0, ids + base, -1).tolist()  # (steps, L, k)
            if (ids < 0).any():  # bare routing: a layer without a selection looks nothing up
                keys = [[[key for key in row if key >= 0] for row in rows] for rows in keys]
            yield True, [(li, row) for rows in keys for li, row in enumerate(rows) if row]


def ubatches(trace: RouteTrace, n_ubatch: int = DEFAULT_UBATCH):
    """The upstream model's steps: (layer index, expert ids, n_tokens) per layer of each
    ubatch: a turn's prompt in ubatches of n_ubatch tokens, then each decode token alone."""
    layers = range(trace.layers.size)
    for prompt, decode in _phases(trace):
        for _, ids in _windows(trace, prompt, np.arange(n_ubatch, prompt.size, n_ubatch)):
            yield False, [(li, ubatch[:, li, :].ravel().tolist(), len(ubatch))
                          for ubatch in np.split(ids, range(n_ubatch, len(ids), n_ubatch)) for li in layers]
        for _, ids in _windows(trace, decode):
            yield True, [(li, row, 1) for rows in ids.tolist() for li, row in enumerate(rows)]
