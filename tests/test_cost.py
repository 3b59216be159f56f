"""The modelled cost per decode token: the formulas, checked by hand."""

import pytest

from moecache.offline.cost import DEFAULT_HOST_GBPS, DEFAULT_LINK_GBPS, Bandwidth

GB = 1e9


def test_stock_reads_every_selected_expert_on_the_host():
    assert Bandwidth(host_gbps=50, link_gbps=25).stock_ms(1 * GB) == pytest.approx(20.0)


def test_moecache_shares_host_bandwidth_with_its_uploads():
    bw = Bandwidth(host_gbps=50, link_gbps=25)
    # host: (0.4 + 0.1) GB / 50 GB/s = 10 ms; link: 0.1 / 25 = 4 ms
    assert bw.moecache_ms(0.4 * GB, 0.1 * GB) == pytest.approx(10.0)
    # the link bounds the token when uploads outgrow it: 0.5 / 25 = 20 ms > 0.6 / 50 = 12 ms
    assert bw.moecache_ms(0.1 * GB, 0.5 * GB) == pytest.approx(20.0)
    assert bw.moecache_ms(0, 0) == 0


def test_upstream_copies_misses_synchronously_over_the_slower_path():
    assert Bandwidth(host_gbps=50, link_gbps=25).upstream_ms(0.5 * GB) == pytest.approx(20.0)
    assert Bandwidth(host_gbps=20, link_gbps=25).upstream_ms(0.5 * GB) == pytest.approx(25.0)
    # experts the cache bypasses are read on the host
    assert Bandwidth(50, 25).upstream_ms(0.5 * GB, host_bytes=1 * GB) == pytest.approx(40.0)


def test_defaults_and_bad_bandwidths():
    assert Bandwidth() == Bandwidth(DEFAULT_HOST_GBPS, DEFAULT_LINK_GBPS)
    for bad in (0, -1, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="link_gbps"):
            Bandwidth(link_gbps=bad)
        with pytest.raises(ValueError, match="host_gbps"):
            Bandwidth(host_gbps=bad)


def test_each_replay_model_gets_its_formula():
    from moecache.offline.replay import ReplayResult

    totals = {"hits": 6, "misses": 4, "uploads": 1, "upload_bytes": 0.1 * GB,
              "miss_bytes": 0.4 * GB, "lookup_bytes": 1 * GB}
    bw = Bandwidth(host_gbps=50, link_gbps=25)

    def result(model):  # 2 decode tokens: per token, half of each total
        return ReplayResult(model, "p", 16, None, 2, 2, totals, totals, 1.0)

    assert result("per-layer").modelled_ms(bw) == pytest.approx(bw.moecache_ms(0.2 * GB, 0.05 * GB))
    # upstream: the uploaded misses over the link, the others (bypassed) on the host
    assert result("upstream").modelled_ms(bw) == pytest.approx(bw.upstream_ms(0.05 * GB, 0.15 * GB))
    assert result("per-layer").stock_ms(bw) == pytest.approx(10.0)
    assert result("global").modelled_ms(bw) is None
