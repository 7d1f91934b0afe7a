"""SM autosizing: the expected-destinations formula, range and parity, zero guards, resolve_num_sms."""

import logging
import math
import random
import re

import pytest

from ep_plugin.config import Config
from ep_plugin.transport.sizing import (
    DEFAULT_NVLINK_GBYTES_PER_S,
    DEFAULT_SCALEOUT_GBYTES_PER_S,
    SM_WRITE_GBYTES_PER_S,
    autosize_sms,
    co_residency_limit,
    expected_destinations,
    resolve_num_sms,
)


def exact_destinations(n, experts, k):
    return n * (1 - math.comb(experts - experts // n, k) / math.comb(experts, k))


@pytest.mark.parametrize("n,experts,k", [(8, 256, 8), (16, 256, 6), (2, 64, 2), (64, 256, 8), (4, 32, 1)])
def test_expected_destinations_matches_the_binomial_formula(n, experts, k):
    assert expected_destinations(n, experts, k) == pytest.approx(exact_destinations(n, experts, k), rel=1e-12)


def test_expected_destinations_edge_cases():
    assert expected_destinations(1, 256, 8) == 1.0  # one rank receives every token
    assert expected_destinations(256, 256, 8) == pytest.approx(8.0)  # one expert per rank: k distinct ranks
    assert expected_destinations(8, 256, 0) == 0.0 and expected_destinations(8, 0, 8) == 0.0
    assert expected_destinations(0, 16, 4) == 1.0  # no groups means one
    assert expected_destinations(4, 8, 100) == 4.0  # k > E is clamped: every rank is hit


def test_single_gpu_test_bed_shape():
    # 8 ranks sharing one 132-SM H200, DeepSeek-like routing, bf16 rows, NVLink default.
    sizing = autosize_sms(device_sms=132, ranks_sharing_gpu=8, num_ranks=8, num_experts=256, topk=8,
                          hidden_bytes=7168 * 2)
    assert sizing.limit == 16 and sizing.num_sms == 14
    assert sizing.warnings == (f"NVLink bandwidth unknown (None); sizing SMs with the default "
                               f"{DEFAULT_NVLINK_GBYTES_PER_S:g} GB/s",)


def test_faster_links_never_get_fewer_sms():
    previous = 0
    for bandwidth in (10, 25, 50, 100, 200, 400, 800, 1600):
        sizing = autosize_sms(device_sms=132, ranks_sharing_gpu=1, num_ranks=16, num_experts=256, topk=8,
                              hidden_bytes=14336, domain_size=8, nvlink_gbytes_per_s=450.0,
                              scaleout_gbytes_per_s=bandwidth)
        assert sizing.num_sms >= previous
        previous = sizing.num_sms
    assert previous > 4  # the sweep reached past the minimum


def test_zero_or_missing_bandwidth_uses_the_default_with_a_warning():
    common = dict(device_sms=132, ranks_sharing_gpu=1, num_ranks=16, num_experts=256, topk=8, hidden_bytes=14336,
                  domain_size=8, nvlink_gbytes_per_s=450.0)
    reference = autosize_sms(**common, scaleout_gbytes_per_s=DEFAULT_SCALEOUT_GBYTES_PER_S)
    for unknown in (None, 0, 0.0, -5, float("nan")):
        sizing = autosize_sms(**common, scaleout_gbytes_per_s=unknown)
        # 0 must not silently pick the 4-SM minimum (DeepEP's in-domain failure): it is the default.
        assert sizing.num_sms == reference.num_sms > 4
        assert sizing.scaleout_gbytes_per_s == DEFAULT_SCALEOUT_GBYTES_PER_S
        assert any("scale-out bandwidth unknown" in w for w in sizing.warnings)
    assert reference.warnings == ()


def test_one_domain_needs_no_scaleout_bandwidth():
    sizing = autosize_sms(device_sms=132, ranks_sharing_gpu=1, num_ranks=8, num_experts=256, topk=8,
                          hidden_bytes=14336, nvlink_gbytes_per_s=450.0, scaleout_gbytes_per_s=None)
    assert sizing.warnings == ()


def test_autosize_never_divides_by_zero_and_stays_in_range():
    values = dict(
        device_sms=[0, 1, 2, 3, 4, 7, 78, 132, 148, 5000],
        ranks_sharing_gpu=[-1, 0, 1, 3, 8, 64, 200],
        num_ranks=[-2, 0, 1, 2, 8, 72],
        num_experts=[0, 1, 7, 256],
        topk=[-1, 0, 1, 8, 300],
        hidden_bytes=[0, 1, 14336],
        domain_size=[None, 0, 1, 4, 1000],
        nvlink_gbytes_per_s=[None, 0.0, -1.0, float("nan"), float("inf"), 1e-9, 450.0, 1e300],
        scaleout_gbytes_per_s=[None, 0, float("inf"), 1e-9, 50.0, 1e300],
        mps_thread_percentage=[None, 0.0, 12.5, 100.0, 250.0, float("nan")],
    )
    rng = random.Random(13)  # a fixed seed: the same 20000 draws on every run
    checked = refused = 0
    for _ in range(20000):
        chosen = {name: rng.choice(options) for name, options in values.items()}
        limit = co_residency_limit(chosen["device_sms"], chosen["ranks_sharing_gpu"], chosen["mps_thread_percentage"])
        if limit < 1:
            with pytest.raises(ValueError, match="not one block per rank"):
                autosize_sms(**chosen)
            refused += 1
            continue
        sizing = autosize_sms(**chosen)
        assert isinstance(sizing.num_sms, int) and 1 <= sizing.num_sms <= limit <= 1024, chosen
        assert sizing.num_sms >= min(4, limit - limit % 2 if limit >= 2 else limit), chosen
        if limit >= 2:
            assert sizing.num_sms % 2 == 0, chosen
        assert sizing.nvlink_gbytes_per_s > 0 and sizing.scaleout_gbytes_per_s > 0
        assert not math.isnan(sizing.demand)
        checked += 1
    assert checked > 10000 and refused > 100
    # Every zero / non-finite input was drawn many times; the degenerate corners explicitly:
    for corner in ({"num_ranks": 1}, {"topk": 0}, {"num_experts": 0}, {"hidden_bytes": 0}):
        args = {"device_sms": 132, "ranks_sharing_gpu": 1, "num_ranks": 8, "num_experts": 256, "topk": 8,
                "hidden_bytes": 14336, "nvlink_gbytes_per_s": 0.0, "scaleout_gbytes_per_s": 0.0, **corner}
        assert autosize_sms(**args).num_sms == 4  # nothing crosses a link: the minimum, no division


def test_co_residency_limit():
    assert co_residency_limit(132, 8) == 16
    assert co_residency_limit(132, 0) == 132
    assert co_residency_limit(132, 2, 25.0) == 33  # MPS share of the SMs is the tighter bound
    assert co_residency_limit(132, 200) == 0


def test_resolve_keeps_an_explicit_value():
    assert resolve_num_sms(Config(num_sms=24), device_sms=132, ranks_sharing_gpu=8, num_ranks=8, num_experts=256,
                           topk=8, hidden_bytes=14336) == 24


def test_resolve_autosizes_logs_defaults_and_honours_overrides(caplog):
    config = Config(num_sms=0)
    kwargs = dict(device_sms=132, ranks_sharing_gpu=8, num_ranks=8, num_experts=256, topk=8, hidden_bytes=14336)
    with caplog.at_level(logging.WARNING, logger="ep_plugin"):
        assert resolve_num_sms(config, **kwargs, environ={}) == 14
    assert any("NVLink bandwidth unknown" in record.getMessage() for record in caplog.records)
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="ep_plugin"):
        assert resolve_num_sms(config, **kwargs, nvlink_gbytes_per_s=450.0, environ={}) == 14
    assert caplog.records == []
    # max_sms_per_gpu replaces the detected count; MPS caps the rank's share.
    assert resolve_num_sms(config.replace(max_sms_per_gpu=48), **kwargs, nvlink_gbytes_per_s=450.0, environ={}) == 6
    assert resolve_num_sms(config, **kwargs, nvlink_gbytes_per_s=450.0,
                           environ={"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": "5"}) == 6
    with pytest.raises(ValueError, match="not one block per rank"):
        resolve_num_sms(config, **{**kwargs, "ranks_sharing_gpu": 200}, environ={})


def test_config_accepts_zero_and_rejects_negative():
    assert Config.from_env({"EP_PLUGIN_NUM_SMS": "0"}).num_sms == 0
    with pytest.raises(ValueError, match=r"num_sms must be in \[0, 1024\]"):
        Config.from_env({"EP_PLUGIN_NUM_SMS": "-1"})


def test_compiled_backends_size_with_their_own_measured_rates():
    """Our kernels move 13-20 GB/s per SM where DeepEP's rule assumes 200 (read) / 50 (write): sized
    with the backends' own rates, one rank per H200 at the standard shape asks for over twice the SMs."""
    from ep_plugin.backends.elastic import ElasticBackend
    from ep_plugin.backends.hybrid import HybridBackend

    common = dict(device_sms=132, ranks_sharing_gpu=1, num_ranks=8, num_experts=256, topk=8, hidden_bytes=14336,
                  nvlink_gbytes_per_s=450.0)
    deepep_rule = autosize_sms(**common).num_sms
    for cls in (HybridBackend, ElasticBackend):
        assert cls.sm_write_gbytes_per_s < SM_WRITE_GBYTES_PER_S, cls.name
        ours = autosize_sms(**common, sm_read_gbytes_per_s=cls.sm_read_gbytes_per_s,
                            sm_write_gbytes_per_s=cls.sm_write_gbytes_per_s).num_sms
        assert ours >= 2 * deepep_rule, (cls.name, ours, deepep_rule)


def test_the_backends_refuse_a_grid_that_the_mps_share_cannot_hold():
    """An explicit num_sms above a rank's MPS share of the SMs was let through (only SMs / sharing ranks
    was checked): its last blocks never became resident and the waits timed out naming a peer. (What the
    compiled backends' build checks on every rank; the exchange that makes every rank refuse is GPU-tested.)"""
    from ep_plugin.backends.compiled import co_residency_problem

    assert co_residency_problem(16, 2, 132, None) is None  # no MPS share set: 16 <= 132 // 2
    assert co_residency_problem(13, 2, 132, 10.0) is None  # 13 SMs per client
    problem = co_residency_problem(16, 2, 132, 10.0)
    assert re.search(r"CUDA_MPS_ACTIVE_THREAD_PERCENTAGE=10 lets each rank use 13.*<= 13", problem), problem
    assert "run fewer ranks per GPU or raise the percentage" in co_residency_problem(1, 2, 132, 0.5)  # not one SM
    assert "Lower EP_PLUGIN_NUM_SMS to <= 66" in co_residency_problem(67, 2, 132, None)
