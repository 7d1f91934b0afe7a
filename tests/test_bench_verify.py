"""The bench's value check (ep_plugin/bench/verify.py) on CPU, for what the CPU reference backend cannot give it.

The compact form (elastic's default), num_valid_rows (non-blocking outputs) and fp8 rows come only from the GPU
backends: here they are built by hand from the sources' tokens and routing, as those backends lay them out
(``DispatchOutput``'s docstring). The expert-row form comes from a real reference dispatch; the round trip's
tolerance is checked against the roundings a correct combine does (verify.py's docstring).
"""

import pytest
import torch
import torch.distributed as dist

import ep_plugin
from ep_plugin.bench import verify
from ep_plugin.bench.workload import FP8_BLOCK, Shape, make_hidden, make_topk
from ep_plugin.handle import COMPACT, DispatchOutput, Handle
from ep_plugin.testing import run_ranks

NUM_EXPERTS, NUM_RANKS, LOCAL = 4, 2, 2  # rank 0 owns experts 0-1, rank 1 experts 2-3
HIDDEN = 2 * FP8_BLOCK
# Per source, each token's experts (-1: a slot left empty): on one rank, on both, or one expert only.
TOPK_IDX = [torch.tensor([[0, 1], [0, 2], [3, 2], [1, -1], [2, 0]]),
            torch.tensor([[1, 3], [2, 3], [0, 1], [3, -1], [1, 2]])]


def _sources(payload: str) -> list[tuple]:
    """Each source rank's (tokens: bf16, or fp8 (data, scales) as the bench quantizes them; its top-k routing)."""
    sources = []
    for rank, idx in enumerate(TOPK_IDX):
        shape = Shape(tokens=idx.shape[0], hidden=HIDDEN, topk=2, experts=NUM_EXPERTS, payload=payload,
                      routing="balanced")
        weights = torch.rand(idx.shape, generator=torch.Generator().manual_seed(rank)) * (idx >= 0)
        sources.append((make_hidden(shape, rank, torch.device("cpu"), torch.bfloat16),
                        dict(topk_idx=idx, topk_weights=weights)))
    return sources


def _take(hidden, rows):
    """Rows ``rows`` of bf16 tokens or of fp8 (data, scales)."""
    return tuple(part[rows] for part in hidden) if isinstance(hidden, tuple) else hidden[rows]


def _cat(parts):
    if isinstance(parts[0], tuple):
        return tuple(torch.cat(column) for column in zip(*parts, strict=True))
    return torch.cat(parts)


def _compact_output(sources, rank: int, *, unwritten_rows: int = 0) -> DispatchOutput:
    """What a compact dispatch gives ``rank``: one row per (token, this rank), by source rank then token; each row's
    top-k ids made local (-1 where the expert lives elsewhere) and its probs (0 there). ``unwritten_rows``: a
    non-blocking output's worst-case tail past ``num_valid_rows``, here what an earlier dispatch left (copies of
    the valid rows, ids and probs: valid-looking, so counting them changes every sum)."""
    rows, ids, probs = [], [], []
    for hidden, routing in sources:
        idx, weights = routing["topk_idx"], routing["topk_weights"]
        here = (idx >= 0) & (idx // LOCAL == rank)
        tokens = here.any(1).nonzero().view(-1)
        rows.append(_take(hidden, tokens))
        ids.append(torch.where(here, idx - rank * LOCAL, -1)[tokens])
        probs.append(torch.where(here, weights, 0.0)[tokens])
    rows, ids, probs = _cat(rows), torch.cat(ids), torch.cat(probs)
    valid = ids.shape[0]
    if unwritten_rows:
        tail = torch.arange(unwritten_rows) % valid
        rows, ids, probs = _cat([rows, _take(rows, tail)]), torch.cat([ids, ids[tail]]), torch.cat([probs, probs[tail]])
    per_expert = torch.stack([(ids[:valid] == e).any(1).sum() for e in range(LOCAL)])
    handle = Handle(backend=None, num_tokens=TOPK_IDX[rank].shape[0], hidden_size=HIDDEN,
                    hidden_dtype=torch.bfloat16, probs_shape=tuple(TOPK_IDX[rank].shape), num_experts=NUM_EXPERTS,
                    num_local_experts=LOCAL, pad_multiple=1, num_rows=ids.shape[0], tokens_per_expert=per_expert,
                    num_real_tokens_per_expert=per_expert, layout=None, output_form=COMPACT)
    return DispatchOutput(rows, probs, per_expert, handle, topk_idx=ids,
                          num_valid_rows=torch.tensor([valid]) if unwritten_rows else None)


def _sent(sources) -> list:
    """Every source's ``sent_checksums``, as the bench gathers them."""
    return [verify.sent_checksums(verify.as_bf16_rows(hidden), verify.chosen_experts(routing, NUM_EXPERTS),
                                  verify.dense_probs(routing, NUM_EXPERTS)) for hidden, routing in sources]


def _dispatch_problem(sources, rank: int, out: DispatchOutput):
    """The bench's dispatch check of ``out`` on ``rank`` (runner._Calls.verify, without the collectives)."""
    got = verify.received_per_expert(out, verify.as_bf16_rows(out.hidden))
    return verify.dispatch_problem(rank, _sent(sources), got)


def test_fp8_rows_are_dequantized_by_their_scales(monkeypatch):
    """Each block of 128 values times its scale, in bf16; a chunk of rows at a time, into ``out`` when given."""
    monkeypatch.setattr(verify, "DEQUANT_CHUNK_ROWS", 2)  # 3 rows: two chunks, the second short
    values = torch.tensor([1.0, -2.0, 0.5, 448.0, -0.015625, 3.5, 0.0, -448.0])  # exact in float8_e4m3fn
    data = values.repeat(3, HIDDEN // values.numel()).to(torch.float8_e4m3fn)
    scales = torch.tensor([[0.5, 4.0], [2.0 ** -9, 3.0], [-1.5, 1e-3]])
    want = (values.repeat(3, HIDDEN // values.numel()).view(3, 2, FP8_BLOCK) * scales.unsqueeze(2)).view(3, HIDDEN)
    torch.testing.assert_close(verify.as_bf16_rows((data, scales)), want.to(torch.bfloat16), rtol=0, atol=0)
    out = torch.full((3, HIDDEN), 7.0, dtype=torch.bfloat16)
    assert verify.as_bf16_rows((data, scales), out=out) is out
    torch.testing.assert_close(out, want.to(torch.bfloat16), rtol=0, atol=0)
    bf16 = torch.ones(2, HIDDEN, dtype=torch.bfloat16)
    assert verify.as_bf16_rows(bf16) is bf16  # bf16 rows are checked as they are


def test_fp8_rows_dequantize_to_the_tokens_the_bench_quantized():
    """The bench quantizes its tokens as data = x / scale (workload.make_hidden): dequantized, the fp8 rows are
    those tokens to within e4m3's rounding (3 mantissa bits: 2**-4 relative; 2**-9 of a scale near 0) and bf16's."""
    shape = Shape(tokens=64, hidden=HIDDEN, topk=2, experts=NUM_EXPERTS, payload="fp8", routing="balanced")
    data, scales = make_hidden(shape, 3, torch.device("cpu"), torch.bfloat16)
    tokens = make_hidden(Shape(**{**shape.__dict__, "payload": "bf16"}), 3, torch.device("cpu"), torch.bfloat16)
    dequantized = verify.as_bf16_rows((data, scales)).float()
    margin = (2 ** -4 + 2 ** -7) * tokens.float().abs() + 2 ** -9 * scales.repeat_interleave(FP8_BLOCK, 1)
    assert ((dequantized - tokens.float()).abs() <= margin).all()


@pytest.mark.parametrize("payload", ["bf16", "fp8"])
def test_compact_rows_count_for_the_local_experts_their_ids_name(payload):
    """A compact row is one token for every local expert its ids name: its row checksum (its values weighted by
    1 + column / H), one count and the prob of that slot go to each of them (a row for both of a rank's experts
    counts for both)."""
    sources = _sources(payload)
    weights = 1 + torch.arange(HIDDEN, dtype=torch.float32) / HIDDEN

    def checksum(row: torch.Tensor) -> float:
        return float((row.float() * weights).double().sum())

    for rank in range(NUM_RANKS):
        out = _compact_output(sources, rank)
        rows = verify.as_bf16_rows(out.hidden)
        sums, counts, probs, weighted = verify.received_per_expert(out, rows)
        want_sums, want_counts, want_probs = torch.zeros(LOCAL, dtype=torch.float64), [0] * LOCAL, [0.0] * LOCAL
        want_weighted = [0.0] * LOCAL
        for row in range(rows.shape[0]):
            for slot, expert in enumerate(out.topk_idx[row].tolist()):
                if expert >= 0:
                    want_sums[expert] += checksum(rows[row])
                    want_counts[expert] += 1
                    want_probs[expert] += float(out.probs[row, slot])
                    want_weighted[expert] += float(out.probs[row, slot]) * checksum(rows[row])
        assert counts.tolist() == want_counts, (rank, counts)
        torch.testing.assert_close(sums, want_sums, rtol=1e-12, atol=1e-9)
        torch.testing.assert_close(probs, torch.tensor(want_probs, dtype=torch.float64), rtol=1e-6, atol=1e-9)
        torch.testing.assert_close(weighted, torch.tensor(want_weighted, dtype=torch.float64), rtol=1e-6, atol=1e-9)
        assert _dispatch_problem(sources, rank, out) is None
    # By hand, rank 0 (experts 0 and 1): source 0's tokens 0, 1, 4 and source 1's token 2 chose expert 0;
    # source 0's 0, 3 and source 1's 0, 2, 4 expert 1, in 7 rows (source 0's tokens 0, 1, 3, 4; source 1's 0, 2, 4).
    out = _compact_output(sources, 0)
    assert verify.received_per_expert(out, verify.as_bf16_rows(out.hidden))[1].tolist() == [4, 5]
    assert out.topk_idx.shape[0] == 7


@pytest.mark.parametrize("payload", ["bf16", "fp8"])
def test_a_compact_row_with_another_rows_values_expert_or_probs_is_caught(payload):
    """Rank 0's rows 1 and 2 (source 0's tokens 1 and 3) each name one expert, 0 and 1: their values (fp8: their
    scales alone) or their ids swapped keep every count and change the experts' row sums; probs swapped within
    the row of a token for both experts change the probs' sums."""
    sources = _sources(payload)
    out = _compact_output(sources, 0)
    assert out.topk_idx[1].tolist() == [0, -1] and out.topk_idx[2].tolist() == [1, -1]
    swap = torch.tensor([0, 2, 1, 3, 4, 5, 6])
    if payload == "fp8":
        swapped_values = out._replace(hidden=(out.hidden[0], out.hidden[1][swap]))
    else:
        swapped_values = out._replace(hidden=out.hidden[swap])
    swapped_ids = out._replace(topk_idx=out.topk_idx[swap])
    probs = out.probs.clone()
    assert out.topk_idx[0].tolist() == [0, 1] and probs[0, 0] != probs[0, 1]
    probs[0] = probs[0].flip(0)
    # Two tokens' probs for one expert swapped (rows 1 and 3, source 0's tokens 1 and 4, expert 0 in slots 0 and
    # 1): the probs' sum for the expert stays, each prob times its row's sum does not.
    assert out.topk_idx[1].tolist() == [0, -1] and out.topk_idx[3].tolist() == [-1, 0]
    other_tokens = out.probs.clone()
    other_tokens[1, 0], other_tokens[3, 1] = out.probs[3, 1], out.probs[1, 0]
    for wrong, words in ((swapped_values, "the wrong rows"), (swapped_ids, "the wrong rows"),
                         (out._replace(probs=probs), "the wrong probs"),
                         (out._replace(probs=other_tokens), "probs on the wrong rows")):
        problem = _dispatch_problem(sources, 0, wrong)
        assert problem and words in problem, problem


@pytest.mark.parametrize("payload", ["bf16", "fp8"])
def test_rows_past_num_valid_rows_are_not_counted(payload):
    """A non-blocking compact output has the worst case's rows; those past num_valid_rows were not written by this
    dispatch (here: rows an earlier one left, with their ids): they count for no expert."""
    sources = _sources(payload)
    blocking = _compact_output(sources, 0)
    nonblocking = _compact_output(sources, 0, unwritten_rows=5)
    assert int(nonblocking.num_valid_rows) == blocking.topk_idx.shape[0] < nonblocking.topk_idx.shape[0]
    got = verify.received_per_expert(nonblocking, verify.as_bf16_rows(nonblocking.hidden))
    want = verify.received_per_expert(blocking, verify.as_bf16_rows(blocking.hidden))
    for got_part, want_part in zip(got, want, strict=True):
        torch.testing.assert_close(got_part, want_part, rtol=0, atol=0)
    assert _dispatch_problem(sources, 0, nonblocking) is None


def test_copies_per_token_adds_the_factors_of_a_tokens_rows():
    """The round trip sums a token's rows, each scaled by its copy's factor: one row per expert (the expert's
    factor) in the expert-row form, one per destination rank (the rank's factor) in the compact form (there the
    expert side has summed a rank's experts into the token's one row)."""
    # By the index's digit sum in base 4: 4 ("10") and 5 ("11") take 1 and 2's factors, not 0 and 1's.
    assert verify.copy_factors(6).tolist() == [1, 2, 4, 8, 2, 4]
    _, routing = _sources("bf16")[0]
    chosen = verify.chosen_experts(routing, NUM_EXPERTS)  # experts 0+1, 0+2, 3+2, 1, 2+0; ranks 0, 0+1, 1, 0, 1+0
    assert verify.copies_per_token(chosen, LOCAL, COMPACT).tolist() == [1, 3, 2, 1, 3]
    assert verify.copies_per_token(chosen, LOCAL, "expert_rows").tolist() == [3, 5, 12, 2, 5]
    tokens = torch.randn(5, HIDDEN, generator=torch.Generator().manual_seed(8)).to(torch.bfloat16)
    per_rank = tokens * torch.tensor([1, 3, 2, 1, 3], dtype=torch.bfloat16).unsqueeze(1)  # the compact round trip
    assert verify.round_trip_problem(tokens, verify.copies_per_token(chosen, LOCAL, COMPACT), per_rank) is None


def test_compact_rows_are_scaled_by_the_receiving_ranks_factor_up_to_num_valid_rows():
    """In the compact form every row a rank received is one copy per (token, that rank): rank 1's valid rows are
    doubled, rank 0's kept, each with the rank's marked column zeroed; rows past num_valid_rows (what an earlier
    dispatch left) are not touched."""
    sources = _sources("bf16")
    for rank, factor in ((0, 1.0), (1, 2.0)):
        out = _compact_output(sources, rank, unwritten_rows=3)
        valid = int(out.num_valid_rows)
        before = out.hidden.clone()
        verify.scale_copies(out, out.hidden, rank)
        want = before[:valid] * factor
        want[:, rank] = 0
        assert torch.equal(out.hidden[:valid], want), rank
        assert torch.equal(out.hidden[valid:], before[valid:]), rank


@pytest.mark.parametrize("read", [[0, 0], [1, 1], [0, 2]])
def test_a_combine_that_reads_the_wrong_copy_of_a_token_is_caught(read):
    """A token sent to experts 0 and 1 comes back as 1x + 2x its values. A combine that read one copy twice, or a
    row of another expert (2: a copy of another token's, here the same values) gives 2x, 4x or 5x: caught. With the
    copies alike (before the factors) each of these gave 2x, the right sum."""
    tokens = torch.randn(64, HIDDEN, generator=torch.Generator().manual_seed(10)).to(torch.bfloat16)
    chosen = torch.zeros(64, NUM_EXPERTS, dtype=torch.bool)
    chosen[:, :2] = True
    copies = verify.copies_per_token(chosen, LOCAL, "expert_rows")
    factors = verify.copy_factors(NUM_EXPERTS)
    combined = tokens * float(sum(factors[expert] for expert in read))
    problem = verify.round_trip_problem(tokens, copies, combined)
    assert problem and "wrong at" in problem and "x 3, its copies' factors" in problem, problem
    assert verify.round_trip_problem(tokens, copies, tokens * 3) is None


@pytest.mark.parametrize("pair", [(1, 4), (1, 5)])
def test_a_combine_that_reads_another_copy_of_a_token_twice_is_caught_also_where_their_factors_match(pair):
    """Four factors cannot tell a top-8 token's copies apart: experts 1 and 5 (5 = 1 + 4) had one factor, and a
    combine that read expert 5's row of a token for expert 1's (off by a power of four, a wrong bit) gave the
    right sum. The factor now follows the expert's digit sum in base 4 (1 and 5 differ), and each copy has its
    expert's column zeroed, which catches a pair with one factor too (1 and 4)."""
    hidden, num_experts = 64, 16
    tokens = torch.randn(32, hidden, generator=torch.Generator().manual_seed(11)).to(torch.bfloat16)
    chosen = torch.zeros(32, num_experts, dtype=torch.bool)
    chosen[:, list(pair)] = True
    first, second = pair

    def copy(expert: int) -> torch.Tensor:  # a copy as scale_copies leaves it
        row = tokens * verify.copy_factor(expert)
        row[:, verify.marked_column(expert, hidden)] = 0
        return row

    assert verify.copy_factor(1) == verify.copy_factor(4) and verify.copy_factor(1) != verify.copy_factor(5)
    expected = verify.RoundTrip(chosen, num_experts // 2, "expert_rows", hidden)
    assert verify.round_trip_problem(tokens, expected, copy(first) + copy(second)) is None
    problem = verify.round_trip_problem(tokens, expected, copy(second) + copy(second))
    assert problem and "wrong at" in problem, problem


def test_a_row_whose_values_moved_within_it_is_caught():
    """A row whose values moved by one column (a copy at a wrong offset) keeps its plain sum: the checksum weighs
    each value by its column."""
    sources = _sources("bf16")
    out = _compact_output(sources, 1)
    assert _dispatch_problem(sources, 1, out) is None
    out.hidden[2] = out.hidden[2].roll(1)
    problem = _dispatch_problem(sources, 1, out)
    assert problem and "the wrong rows" in problem, problem


def test_the_checked_fp8_tokens_differ_from_the_timed_ones_in_data_and_scales():
    """The check's fp8 tokens are the timed ones with the data's sign bits flipped (float8 has no negation) and the
    scales doubled: before, the scales were negated and the data kept, so a dispatch that never wrote the rows'
    data, only their scales, passed on the timed loop's data left in the memory the allocator hands out again;
    keeping the scales instead would let one pass that skipped them."""
    from ep_plugin.bench.runner import _negated

    shape = Shape(tokens=16, hidden=HIDDEN, topk=2, experts=NUM_EXPERTS, payload="fp8", routing="balanced")
    data, scales = make_hidden(shape, 1, torch.device("cpu"), torch.bfloat16)
    checked_data, checked_scales = _negated((data, scales))
    assert (checked_scales != scales).all()
    timed_bytes, checked_bytes = data.view(torch.uint8), checked_data.view(torch.uint8)
    nonzero = timed_bytes & 0x7F != 0
    assert nonzero.float().mean() > 0.9 and (timed_bytes != checked_bytes)[nonzero].all()
    torch.testing.assert_close(verify.as_bf16_rows((checked_data, checked_scales)),
                               -2 * verify.as_bf16_rows((data, scales)), rtol=0, atol=0)


def _check_reference_expert_rows(ctx) -> tuple:
    """A real reference dispatch (expert-row form) checked whole, then as if a budget had cut it (a non-blocking
    output past its rows: num_valid_rows counts what the senders had, more than the rows there); and the round
    trip of its real combine."""
    shape = Shape(tokens=16, hidden=64, topk=2, experts=8, payload="bf16", routing="balanced")
    cpu = torch.device("cpu")
    backend = ep_plugin.get_backend("reference")(hidden_size=64, num_experts=8, device="cpu")
    topk_idx, topk_weights = make_topk(shape, ctx.rank, 0, cpu)
    routing = dict(topk_idx=topk_idx, topk_weights=topk_weights)
    tokens = -make_hidden(shape, ctx.rank, cpu, torch.bfloat16)
    chosen = verify.chosen_experts(routing, 8)
    every = [None] * ctx.world_size
    dist.all_gather_object(every, verify.sent_checksums(tokens, chosen, verify.dense_probs(routing, 8)))
    out = backend.dispatch(tokens, **routing)
    whole = verify.dispatch_problem(ctx.rank, every, verify.received_per_expert(out, out.hidden))
    real = out.handle.num_real_tokens_per_expert.tolist()
    kept = real[0] + 1  # expert 0's rows and one of expert 1's
    cut = out._replace(hidden=out.hidden[:kept], probs=out.probs[:kept],
                       num_valid_rows=torch.tensor([out.hidden.shape[0]]))
    got = verify.received_per_expert(cut, cut.hidden)
    verify.scale_copies(out, out.hidden, ctx.rank)
    combined = backend.combine(out.hidden, out.handle).hidden
    expected = verify.RoundTrip(chosen, out.handle.num_local_experts, out.handle.output_form, 64)
    return (whole, real, got[1].tolist(), verify.dispatch_problem(ctx.rank, every, got),
            verify.round_trip_problem(tokens, expected, combined))


def test_an_expert_row_output_past_its_budget_counts_only_the_rows_it_has():
    """num_valid_rows above the output's rows (a budget too small): the segments are read up to the rows there,
    so the experts whose rows were cut come up short, and the check says so."""
    for rank, (whole, real, counts, problem, round_trip) in enumerate(
            run_ranks(_check_reference_expert_rows, NUM_RANKS, timeout_s=120)):
        assert whole is None and round_trip is None, (rank, whole, round_trip)
        assert real[1] > 1 and counts == [real[0], 1, 0, 0], (rank, real, counts)
        assert f"local expert 1 (expert {4 * rank + 1} of 8) 1 rows, the sources routed {real[1]} there" in problem


def _bf16(values: torch.Tensor) -> torch.Tensor:
    return values.to(torch.bfloat16).float()


def _rounded_per_stage(tokens: torch.Tensor, domains: list[list[int]]) -> torch.Tensor:
    """What hybrid inside a hierarchical backend returns for a token sent as ``domains`` (per domain, the copies on
    each of its ranks), every row unchanged: each rank's packet partial rounded to bf16, then the domain's partial
    (their fp32 sum), then the source's fp32 sum of the domains' partials (verify.py's docstring)."""
    x = tokens.float()
    partials = [_bf16(sum(_bf16(copies * x) for copies in ranks)) for ranks in domains]
    return sum(partials).to(torch.bfloat16)


@pytest.mark.parametrize("domains", [[[1], [1, 5]], [[3], [2, 3]], [[2, 3]], [[7]]])  # 3, 3, 2 and 1 roundings
def test_a_correct_combines_roundings_pass_the_round_trip_check(domains):
    """Three roundings of a sum of copies stay within the tolerance, also for the worst value over every split of
    up to 8 copies (7 copies of 1.65625 as 1 + (1 + 5): three ties rounded down, 2.07 bf16 roundings, past
    2**-7), and their mean stays near 0 over random tokens."""
    tokens = torch.randn(64, HIDDEN, generator=torch.Generator().manual_seed(5)).to(torch.bfloat16)
    tokens[0, 0], tokens[1, 0] = 1.65625, -1.65625
    copies = torch.full((64,), sum(map(sum, domains)))
    combined = _rounded_per_stage(tokens, domains)
    if domains == [[1], [1, 5]]:  # the premise: this value is off by more than 2**-7
        assert abs(float(combined[0, 0]) - 7 * 1.65625) / (7 * 1.65625) > 2 ** -7
    assert verify.round_trip_problem(tokens, copies, combined) is None


def test_one_value_two_percent_off_is_caught():
    """2% is past any correct rounding (under 3 * 2**-8): one such value fails the case."""
    tokens = torch.randn(64, HIDDEN, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    combined = tokens * 3
    combined[10, 20] = tokens[10, 20].float() * 3 * 0.98
    problem = verify.round_trip_problem(tokens, torch.full((64,), 3), combined)
    assert problem and "wrong at 1 of" in problem and "token 10, column 20" in problem, problem


@pytest.mark.parametrize("scale", [0.99, 1.01])
def test_a_sum_scaled_within_the_per_value_tolerance_is_caught_on_average(scale):
    """A sum x 0.99 or x 1.01 (rounded once: within 1% + 2**-8) passes every value's tolerance (2**-6), but moves
    the mean signed error by the whole 1%, where a correct op's rounding averages out (test above)."""
    tokens = torch.randn(64, HIDDEN, generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    combined = (tokens.float() * 7 * scale).to(torch.bfloat16)
    problem = verify.round_trip_problem(tokens, torch.full((64,), 7), combined)
    assert problem and "off the tokens x their copies' factors on average" in problem, problem


def test_a_nan_is_never_right():
    """NaN compared as no error (NaN > tolerance is False): a combine or dispatch that handed back rows never
    written (NaN in bf16 garbage) passed."""
    tokens = torch.randn(8, HIDDEN, generator=torch.Generator().manual_seed(9)).to(torch.bfloat16)
    combined = tokens * 2
    combined[3, 5] = float("nan")
    problem = verify.round_trip_problem(tokens, torch.full((8,), 2), combined)
    assert problem and "wrong at 1 of" in problem, problem
    sources = _sources("bf16")
    out = _compact_output(sources, 1)
    out.hidden[2, 7] = float("nan")
    problem = _dispatch_problem(sources, 1, out)
    assert problem and "the wrong rows" in problem, problem
