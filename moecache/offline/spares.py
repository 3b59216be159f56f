"""The live RAM tier's spares (docs/mechanism.md, "The RAM tier", 4.), MODELLED: an expert the
tier read without a slot, and a slot's victim, stays in memory while the room beyond the slots
(one layer's reads for a full ubatch) has space beside the reads in flight, the oldest dropped
first, the first layer's last (its misses are read ahead from the token embeddings alone); a layer
that selects it again, or a boundary that uploads it, reads nothing.

The room is the live tier's, min(E, n_ubatch x top-k) experts of the largest layer, less a decode
token's reads held beside the spares (IN_FLIGHT top-k's of the largest layer): live, the tier drops
spares as each read is queued, so what it holds at once moves within a layer; here the capacity is
fixed. A prompt drops every spare first, as the live tier's boundary does; with read-ahead it reads
what it selects (the live tier reads ahead what its tokens' predictions name: close to that),
without it every expert of layers 1.. (the live tier then reads the next layer whole). Left out:
the room the live tier gives back as the process grows.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

N_UBATCH = 512  # llama_cpp's default, the live sizing's (moecache.live.cli.N_UBATCH)
IN_FLIGHT = 1.0  # a decode token's reads held beside the spares, in top-k's of the largest layer


class Spares:
    """Per step of the engine: found(ids, hit_mask) before it, then retire(...) with its plan."""

    def __init__(self, expert_bytes, n_expert: int, n_used: int, n_ubatch: int = N_UBATCH,
                 whole_prompts: bool = True):
        self.expert_bytes = [int(b) for b in expert_bytes]
        self.n_expert, self.n_used, self.whole_prompts = n_expert, n_used, whole_prompts
        self.room = min(n_expert, n_ubatch * n_used) * max(self.expert_bytes)
        self.held: OrderedDict[tuple[int, int], int] = OrderedDict()  # (layer, expert) -> bytes, oldest first
        self.bytes = 0

    def capacity(self) -> int:
        """Bytes the spares may hold beside a decode token's reads in flight."""
        return max(0, self.room - IN_FLIGHT * self.n_used * max(self.expert_bytes))

    def in_memory(self) -> np.ndarray:
        """(n_layers, n_expert) bool: the spares now."""
        mask = np.zeros((len(self.expert_bytes), self.n_expert), dtype=bool)
        for layer, expert in self.held:
            mask[layer, expert] = True
        return mask

    def found(self, ids, hit_mask) -> np.ndarray:
        """The step's misses (ids (n_layers, m), -1 none, not in hit_mask) whose expert is a
        spare, like ids; each such expert leaves the list (its layer uses it), its bytes not read."""
        ids = np.asarray(ids)
        missed = (ids >= 0) & ~np.asarray(hit_mask, dtype=bool)
        out = np.zeros(ids.shape, dtype=bool)
        for layer, row in enumerate(ids):
            for expert in set(row[missed[layer]].tolist()):
                if self._take(layer, expert):
                    out[layer] |= missed[layer] & (row == expert)
        return out

    def found_uploads(self, rows) -> np.ndarray:
        """Uploads issued at a boundary ((n, >=2) rows of layer, expert): (n_layers,) how many
        found their expert among the spares (it leaves the list for its slot)."""
        counts = np.zeros(len(self.expert_bytes), dtype=np.int64)
        for layer, expert in np.asarray(rows)[:, :2].tolist():
            counts[layer] += self._take(layer, expert)
        return counts

    def retire(self, ids, hit_mask, kept_rows, victim_rows, slotted) -> None:
        """After the step: what it read and kept in no slot joins the list, newest last: its
        misses (in a step that selects at least E experts a layer, a prompt, which drops the list
        first: without read-ahead every expert of layers 1..), then the slots' victims
        (victim_rows). kept_rows: the uploads ((n, >=2) rows of layer, expert); slotted:
        (n_layers, n_expert) bool, the experts in slots. Then the oldest leave beyond capacity(),
        the first layer's last."""
        ids = np.asarray(ids)
        missed = (ids >= 0) & ~np.asarray(hit_mask, dtype=bool)
        kept = {tuple(r) for r in np.asarray(kept_rows)[:, :2].tolist()}
        prompt = ids.shape[1] >= self.n_expert
        if prompt:
            self.held.clear()
            self.bytes = 0
        whole = prompt and self.whole_prompts
        read = [(layer, e) for layer, row in enumerate(ids)
                for e in (range(self.n_expert) if whole and layer else dict.fromkeys(row[missed[layer]].tolist()))]
        victims = [tuple(r) for r in np.asarray(victim_rows)[:, :2].tolist()]
        for key in read + victims:
            if key not in kept and not slotted[key]:
                self._add(key)
        limit = self.capacity()
        while self.held and self.bytes > limit:
            key = next((k for k in self.held if k[0] != 0), next(iter(self.held)))
            self.bytes -= self.held.pop(key)

    def _take(self, layer: int, expert: int) -> bool:
        size = self.held.pop((layer, expert), None)
        if size is None:
            return False
        self.bytes -= size
        return True

    def _add(self, key) -> None:
        self.bytes -= self.held.pop(key, 0)
        self.held[key] = self.expert_bytes[key[0]]
        self.bytes += self.held[key]
