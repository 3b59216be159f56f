"""The RAM tier's decode read-ahead model (moecache.offline.readahead, issue 21 item 2): online
predictors never see what they predict, precision and recall count a hand-made trace right, the
timeline overlaps the disk with the CPU only within the compute window, computes a layer's kept
experts while its misses are read (and is Disk.tier_token_ms exactly without read-ahead), and
the flag's bad values are one line."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import TRACES, replay_cli

from moecache.formats.traces import read_trace
from moecache.offline import readahead
from moecache.offline.cost import Disk
from moecache.offline.readahead import PREDICTORS, WINDOW, Predictor, ReadAhead
from moecache.offline.replay import PerLayerReplay, ram_tier_slots, simulate

SYNTH = TRACES / "synth-qwen3-30b-a3b-L8.ram-tier.route.csv"
PROG = "python -m moecache.replay"
MB = 10**6


class Fixed(Predictor):
    """Always predicts the same experts (a list, best first)."""

    def __init__(self, experts):
        self.experts = experts

    def scores(self, src, selection, dst, future=None):
        score = np.zeros(self.n_expert)
        score[self.experts] = np.arange(len(self.experts), 0, -1)
        return score


def tier(predictor, width, tokens, *, gbps=1.0, host=1.0, kept=None, n_expert=4, read_us=0.0):
    """A ReadAhead over 1 MB experts, no dense weights, fed these decode tokens (each a list of
    per-layer selections of one expert; kept: (layers, n_expert) bool, the same every token; a
    selection is a hit iff kept)."""
    L = len(tokens[0])
    ra = ReadAhead(predictor if isinstance(predictor, str) else "oracle", width, Disk(gbps, read_us), host)
    if not isinstance(predictor, str):
        ra.predictor = predictor
    ra.bind([MB] * L, [0] * L, n_expert, 1)
    kept = np.zeros((L, n_expert), dtype=bool) if kept is None else kept
    for token in tokens:
        ids = np.array(token).reshape(L, 1)
        ra.decode(ids, kept[np.arange(L), ids[:, 0]][:, None], kept, np.zeros(L, dtype=np.int64))
    ra.finish()
    return ra


def chosen_by_step(monkeypatch, predictor, tokens):
    """Every read-ahead decision of a run: [(src layer, dst layer, experts)], in order."""
    picks = []
    best = readahead.choose_reads

    def recording(scores, kept, width):
        chosen = best(scores, kept, width)
        picks.append(tuple(chosen.tolist()))
        return chosen
    monkeypatch.setattr(readahead, "choose_reads", recording)
    tier(predictor, 2, tokens, n_expert=8)
    return picks


@pytest.mark.parametrize("name", [n for n in PREDICTORS if not PREDICTORS[n]().reads_future])
def test_online_predictors_never_see_what_they_predict(monkeypatch, name):
    """Two runs equal up to token 3's layer 1, then different: every read-ahead decided before
    layer 2 of token 3 (the prediction for layer 2 included) is the same in both. The oracle,
    which reads the future, differs (the check can fail)."""
    rng = np.random.default_rng(7)
    tokens = [list(rng.integers(0, 8, 4)) for _ in range(6)]
    changed = [t[:] for t in tokens]
    changed[3][2:] = [(e + 1) % 8 for e in changed[3][2:]]
    for t in changed[4:]:
        t[:] = [(e + 3) % 8 for e in t]
    decided = 3 * 4 + 2  # decisions at layers 0..3 of tokens 0-2 and layers 0..1 of token 3
    same = chosen_by_step(monkeypatch, name, tokens)[:decided]
    assert same == chosen_by_step(monkeypatch, name, changed)[:decided]
    if name == "temporal":
        oracle = chosen_by_step(monkeypatch, "oracle", tokens)[:decided]
        assert oracle != chosen_by_step(monkeypatch, "oracle", changed)[:decided]


def test_precision_and_recall_on_a_hand_trace():
    """Layers 0 and 1, one expert each per token: (0, 1), (0, 1), (0, 2). Temporal, R = 1, reads
    ahead t1's layer 0 (0: right), t1's layer 1 (1: right), t2's layer 0 (0: right) and t2's
    layer 1 (1: wrong; 2 was selected); none for t0's layer 1 (no earlier token) nor after t2."""
    tokens = [(0, 1), (0, 1), (0, 2)]
    ra = tier("temporal", 1, tokens)
    assert (ra.read_ahead, ra.useful, ra.misses) == (4, 3, 6)
    assert (ra.precision, ra.recall) == (0.75, 0.5)
    # expert 1 of layer 1 kept: it is a hit, never read ahead; the layer 0 read-aheads stay
    kept = np.zeros((2, 4), dtype=bool)
    kept[1, 1] = True
    ra = tier("temporal", 1, tokens, kept=kept)
    assert (ra.read_ahead, ra.useful, ra.misses) == (2, 2, 4)


def test_nothing_is_read_ahead_across_a_prompt():
    """The last layer reads ahead the next decode token's layer 0, not a prompt's; a prompt's
    tokens are learnt from (temporal then predicts the prompt's last token)."""
    def run(prompt):
        ra = ReadAhead("oracle", 1, Disk(1.0, 0.0), 1.0)
        ra.bind([MB, MB], [0, 0], 4, 1)
        kept, none = np.zeros((2, 4), dtype=bool), np.zeros(2, dtype=np.int64)
        ra.decode(np.array([[0], [1]]), np.array([[False], [False]]), kept, none)
        if prompt:
            ra.prompt(np.array([[2, 3], [3, 2]]))  # two tokens: (2, 3), then (3, 2)
        ra.decode(np.array([[2], [2]]), np.array([[False], [False]]), kept, none)
        ra.finish()
        return ra.read_ahead
    assert (run(False), run(True)) == (3, 2)
    temporal = ReadAhead("temporal", 1, Disk(1.0, 0.0), 1.0)
    temporal.bind([MB, MB], [0, 0], 4, 1)
    temporal.prompt(np.array([[2, 3], [3, 2]]))
    assert temporal.predictor.scores(0, np.array([2]), 1).argmax() == 2  # the prompt's last token


def test_the_overlap_is_capped_by_the_compute_window():
    """1 MB experts computed at 1 GB/s (1 ms a layer), read at 1 GB/s or 0.5 GB/s, no latency;
    every selection a miss. Without read-ahead a token is 2 x (read + compute): 4 ms, 6 ms."""
    never = Fixed([])
    tokens = [(0, 1), (2, 3)]
    assert tier(never, 1, tokens).seconds == pytest.approx(8e-3)
    assert tier(never, 1, tokens, gbps=0.5).seconds == pytest.approx(12e-3)
    # The oracle at 1 GB/s: only t0's layer 0 waits for its read (1 ms); every other read fits
    # the 1 ms the CPU computes before it is needed: 1 + 4 x 1 ms.
    assert tier("oracle", 1, tokens).seconds == pytest.approx(5e-3)
    # At 0.5 GB/s a read (2 ms) overlaps the 1 ms window only: each later layer waits 1 ms.
    # t0: read 0-2, compute 2-3, l1 waits to 4, compute 4-5; t1: waits 5-6, 6-7, waits 7-8, 8-9.
    assert tier("oracle", 1, tokens, gbps=0.5).seconds == pytest.approx(9e-3)
    # A wrong read-ahead (expert 3 of layer 1 in t0, then expert 3 of layer 0) holds the disk:
    # t0's layer 1 demand read waits behind it (queued 2-4, read 4-6): 7 ms against 6.
    wrong = tier(Fixed([3]), 1, [(0, 1)], gbps=0.5)
    assert wrong.seconds == pytest.approx(7e-3) and wrong.useful == 0 and wrong.read_ahead == 1
    # Reading what fits the window (R = w): at 0.5 GB/s a read does not fit 1 ms, so nothing is
    # read ahead and nothing is delayed; at 1 GB/s one fits.
    assert tier(Fixed([3]), WINDOW, [(0, 1)], gbps=0.5).read_ahead == 0
    assert tier(Fixed([3]), WINDOW, [(0, 1)], gbps=0.5).seconds == pytest.approx(6e-3)
    assert tier("oracle", WINDOW, tokens).seconds == pytest.approx(5e-3)


def test_the_kept_experts_are_computed_while_the_misses_are_read():
    """One layer, top-2: expert 0 kept, expert 1 missed, 1 MB each, computed at 1 GB/s: the kept
    one while the miss is read, then the miss: max(1, read) + 1 ms (reading, then computing
    both would take 3 and 4 ms)."""
    def run(gbps):
        ra = ReadAhead("none", 1, Disk(gbps, 0.0), 1.0)
        ra.bind([MB], [0], 4, 2)
        kept = np.array([[True, False, False, False]])
        ra.decode(np.array([[0, 1]]), np.array([[True, False]]), kept, np.zeros(1, dtype=np.int64))
        ra.finish()
        return ra.seconds
    assert (run(1.0), run(0.5), run(0.25)) == pytest.approx((2e-3, 3e-3, 5e-3))


@pytest.mark.parametrize("spares", [False, True], ids=["", "spares"])
@pytest.mark.parametrize("per_mb, per_request", [(0.0, 0.0), (0.358, 0.0), (0.106, 0.428)])
def test_without_read_ahead_the_timeline_is_the_disk_formula(monkeypatch, per_mb, per_request, spares):
    """On the live tier's trace, a read-ahead that reads nothing times the decode as
    ReplayResult.disk_ms (moecache.offline.cost.Disk.tier_token_ms) does, the CPU's work on the
    reads (ms per MB, ms per request) included, and reads its bytes, with the tier's spares
    (moecache.offline.spares: a miss found in memory read nothing) or without; every `kept` it is
    handed is what the graph found (a selection is a hit iff kept)."""
    trace = read_trace(str(SYNTH))
    k = ram_tier_slots(trace, 932)
    disk = Disk(0.95, 40, per_mb, per_request)
    ra = ReadAhead("temporal", 1, disk, 5.26)
    ra.predictor = Fixed([])
    decode = ra.decode
    seen = []

    def checked(ids, hit_mask, kept, boundary, in_memory=None):
        ids, hit_mask = np.asarray(ids), np.asarray(hit_mask)
        valid = ids >= 0
        rows = np.nonzero(valid)[0]
        assert (kept[rows, ids[valid]] == hit_mask[valid]).all()
        assert (in_memory is not None) == spares
        seen.append(1)
        decode(ids, hit_mask, kept, boundary, in_memory)
    monkeypatch.setattr(ra, "decode", checked)
    run = simulate(trace, PerLayerReplay("default", k, inserts=k, admission="eager", prefill="lookup", read_ahead=ra,
                                         spares=spares))
    assert (run.totals.get("spare_miss_bytes", 0) > 0) == spares
    assert len(seen) == ra.tokens == run.decode_tokens == run.decode_steps == 15
    assert ra.read_ahead == 0 and ra.misses == run.totals["misses"]
    assert ra.ms_per_token == pytest.approx(run.disk_ms(5.26, disk), rel=1e-12)
    assert ra.read_bytes == run.disk_reads()[0]


def test_the_read_cpu_is_charged_after_the_layer_beside_no_compute():
    """One layer, expert 0 kept, expert 1 missed, 1 MB each at 1 GB/s both ways: 2 ms, plus the
    CPU's work on the 1 MB read (0.5 ms per MB; 0.1 ms per request, an expert's 3 tensors), which
    no compute hides; the wait is the read's time beyond the kept expert's compute (none here)."""
    def run(read_cpu, gbps=1.0, per_request=0.0):
        ra = ReadAhead("none", 1, Disk(gbps, 0.0, read_cpu, per_request), 1.0)
        ra.bind([MB], [0], 4, 2)
        kept = np.array([[True, False, False, False]])
        ra.decode(np.array([[0, 1]]), np.array([[True, False]]), kept, np.zeros(1, dtype=np.int64))
        ra.finish()
        return ra.seconds, ra.wait_ms_per_token
    assert run(0.0) == pytest.approx((2e-3, 0.0))
    assert run(0.5) == pytest.approx((2.5e-3, 0.0))
    assert run(0.0, per_request=0.1) == pytest.approx((2.3e-3, 0.0))
    assert run(0.5, per_request=0.1) == pytest.approx((2.8e-3, 0.0))
    assert run(0.5, gbps=0.5) == pytest.approx((3.5e-3, 1.0))  # read 2 ms, kept 1 ms: 1 ms waited


def test_an_expert_read_ahead_costs_the_cpu_its_requests_as_a_demand_read_does():
    """Two layers, nothing kept, a disk fast enough that no read is waited for: layer 0's miss is
    read on demand, layer 1's ahead (the oracle); each is an expert's 3 tensors, 3 requests, so
    0.1 ms per request adds 0.6 ms to the token and 0.5 ms per MB 1 ms."""
    def run(per_mb, per_request):
        ra = ReadAhead("oracle", 1, Disk(1000.0, 0.0, per_mb, per_request), 1.0)
        ra.bind([MB, MB], [0, 0], 4, 1)
        ra.decode(np.array([[0], [1]]), np.array([[False], [False]]), np.zeros((2, 4), dtype=bool),
                  np.zeros(2, dtype=np.int64))
        ra.finish()
        assert (ra.read_ahead, ra.useful) == (1, 1)
        return ra.seconds
    bare = run(0.0, 0.0)
    assert run(0.0, 0.1) - bare == pytest.approx(0.6e-3)
    assert run(0.5, 0.0) - bare == pytest.approx(1e-3)
    assert run(0.5, 0.1) - bare == pytest.approx(1.6e-3)


def test_the_router_finds_its_recall_of_the_next_layers_misses_and_of_layer_0_from_the_embeddings(monkeypatch):
    """router stands for the next router on this layer's input, and for layer 0's on the token
    embeddings: with ROUTER_RECALL 1 it reads every miss ahead but the first token's layer 0's
    (no token before it); with 0 it reads only experts the layer did not select."""
    rng = np.random.default_rng(3)
    tokens = [list(rng.integers(0, 8, 4)) for _ in range(6)]
    monkeypatch.setattr(readahead, "ROUTER_RECALL", 1.0)
    ra = tier("router", 4, tokens, n_expert=8)
    assert ra.precision == 1.0 and ra.useful == ra.misses - 1  # the first token's layer 0 missed, unread
    monkeypatch.setattr(readahead, "ROUTER_RECALL", 0.0)
    ra = tier("router", 4, tokens, n_expert=8)
    assert ra.useful == 0 and ra.read_ahead == 4 * len(tokens) - 1


def test_cli_prints_the_read_ahead_beside_the_tier(capsys):
    assert replay_cli(SYNTH, "--ram-mib", "932", "--disk-gbps", "0.95", "--host-gbps", "5.26",
                      "--policies", "default", "--expert-read-ahead", "oracle:1,cooccur:w,none") == 0
    out = capsys.readouterr().out
    tier_row = next(line.split() for line in out.splitlines() if line.startswith("RAM tier"))
    assert tier_row[-2] == "35.38"  # the tier without read-ahead, unchanged
    rows = [line.split() for line in out.splitlines() if line.startswith("default(heat)")]
    assert [row[3:5] for row in rows] == [["oracle", "1"], ["cooccur", "w"], ["none", "1"]]
    assert rows[2][-2:] == ["35.38", "0.0"]  # reading nothing ahead is the tier
    assert rows[0][6:8] == ["100.0", "59.0"]  # the oracle's precision and recall
    assert float(rows[0][-2]) < 35.38 and float(rows[0][-1]) > 0


@pytest.mark.parametrize("args, message", [
    (["--ram-mib", "932", "--disk-gbps", "1", "--expert-read-ahead", "guess:1"],
     "argument --expert-read-ahead: 'guess:1': expected PREDICTOR:R with PREDICTOR one of"),
    (["--ram-mib", "932", "--disk-gbps", "1", "--expert-read-ahead", "cooccur"],
     "argument --expert-read-ahead: 'cooccur': expected PREDICTOR:R"),
    (["--ram-mib", "932", "--disk-gbps", "1", "--expert-read-ahead", "cooccur:0"],
     "argument --expert-read-ahead: 'cooccur:0': R "),
    (["--expert-read-ahead", "cooccur:1"], "--expert-read-ahead time the --ram-mib models: give --ram-mib too"),
])
def test_cli_bad_read_ahead_flags_are_one_line(capsys, args, message):
    assert replay_cli(SYNTH, *args) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.startswith(f"{PROG}: error: {message}"), err
    assert err.count("\n") == 1
