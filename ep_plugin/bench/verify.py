"""Whether a timed case moved the right rows: one more dispatch and combine of the case's own tokens, checked.

A kernel that is fast because it moved the wrong rows must not give a figure. After a case's timed loops
every rank runs one dispatch and one combine of the same inputs (outside the timing) and checks two things,
neither of which needs another backend or the peers' tokens:

- **Dispatch, per local expert.** Each source sends, per expert, the sum over the tokens it routed there of
  each token's row checksum (its values weighted by their column, ``row_checksums``: a plain sum would miss
  values moved within a row, by a wrong offset in a vectorized copy, say), and how many tokens that is (one
  ``all_gather_object`` of 2E numbers). The expert's owner sums the row checksums of the rows it received for
  that expert, wherever the form puts them
  (a segment of the expert-row form, the rows whose local ids name it in the compact form): a row that went
  to the wrong expert, or the wrong row, changes the sum; a lost or doubled one changes the count too. The
  probs (top-k weights) the tokens carried there are summed on both sides the same way: they travel as they
  are, so a prob of another token or expert changes that sum; and so is each prob times its row's checksum, which a
  prob handed to another token of the same expert changes.
- **Round trip.** Each received row (dequantized for fp8) is scaled by its copy's factor, a power of two
  (``COPY_FACTORS``) picked by its expert in the expert-row form, by the receiving rank in the compact form, and
  has its copy's *marked column* (the expert's, or the rank's, index modulo the hidden size) zeroed; then it is
  combined: the result must be the token times the sum of the factors of the rows it went out as, less, in each
  marked column, the factor of the copy it marks. Unscaled and unmarked, every copy of a token would be alike,
  and a combine that read one copy k times, or another expert's row of the token, would pass. Four factors
  cannot tell every copy of a top-8 token apart; the marks can (with a hidden size of at least the experts).
  The factor of index i is picked by the digit sum of i in base 4 (not i mod 4), so that a combine off by a
  power of four (expert e + 4 for e, e ^ 8) meets another factor too. Scaling by a power of two and zeroing are
  exact, and no copy is negative: a sum of copies has no cancellation.

Tolerances. Round trip: a token's copies are one bf16 value times powers of two (fp8: both sides dequantize the
same data and scales alike), so their sum is exact in fp32; only its rounding to bf16 errs, within 2**-8
relative, once per stage that hands on a partial: three at most (hybrid in a hierarchical domain: the expert
rank's packet, the domain's partial, the source). The errors of a sum of copies all scale one value, of one
sign, so a correct value is off by less than 3 * 2**-8; ROUND_TRIP_RTOL = 2**-6 leaves a rounding of margin
(2**-7 does not: 7 copies of 1.65625 as 1 + (1 + 5) over two domains round three ties down, 2.07 * 2**-8). No
absolute term: there is no cancellation, a zero stays zero.
Rounding to nearest errs either way, so over the random tokens the mean signed error (weighted by magnitude)
shrinks like 1/sqrt(values), while a sum scaled wrong moves it by the whole error: it must stay within
ROUND_TRIP_BIAS or 4 * ROUND_TRIP_RTOL / sqrt(values), the larger (a sum x 0.99 passes each value, not this).
The checksums add the same bf16 values on both sides in fp64, only in another order: relative 1e-9 of the summed
magnitudes, where one wrong row of H values moves a sum by about sqrt(H). A NaN is never within a tolerance.
"""

from __future__ import annotations

import math
from typing import Optional, Union

import torch

from ep_plugin.handle import COMPACT

from .workload import FP8_BLOCK

ROUND_TRIP_RTOL = 2 ** -6  # 4 bf16 roundings: a correct sum rounds 3 times at most (module docstring)
ROUND_TRIP_BIAS = 2 ** -10  # the mean signed error is held this close to 0 at least (a quarter of one rounding)
CHECKSUM_RTOL = 1e-9
# The round trip's factors of the copies (``copy_factor``): powers of two, so scaling a bf16 row is exact.
COPY_FACTORS = (1.0, 2.0, 4.0, 8.0)
DEQUANT_CHUNK_ROWS = 4096  # fp8 rows dequantized this many at a time (a float copy of all would double memory)


def as_bf16_rows(rows, out: Optional[torch.Tensor] = None) -> torch.Tensor:
    """bf16 rows: the rows themselves, or fp8 (data, per-128 scales) dequantized into ``out`` (allocated if None)."""
    if not isinstance(rows, tuple):
        return rows
    data, scales = rows
    num_rows, hidden = data.shape
    if out is None:
        out = torch.empty(num_rows, hidden, device=data.device, dtype=torch.bfloat16)
    for start in range(0, num_rows, DEQUANT_CHUNK_ROWS):
        part = slice(start, min(start + DEQUANT_CHUNK_ROWS, num_rows))
        blocks = data[part].float().view(-1, hidden // FP8_BLOCK, FP8_BLOCK) * scales[part].float().unsqueeze(2)
        out[part] = blocks.view(-1, hidden).to(torch.bfloat16)
    return out


def chosen_experts(routing: dict, num_experts: int) -> torch.Tensor:
    """[T, E] bool: the experts each token went to, from either routing form (-1 ids: none)."""
    if "routing_map" in routing:
        return routing["routing_map"].bool()
    idx = routing["topk_idx"]
    chosen = torch.zeros(idx.shape[0], num_experts, dtype=torch.bool, device=idx.device)
    tokens, slots = (idx >= 0).nonzero(as_tuple=True)
    chosen[tokens, idx[tokens, slots]] = True
    return chosen


def dense_probs(routing: dict, num_experts: int) -> Optional[torch.Tensor]:
    """[T, E] fp32: each token's prob for each expert (0 where it did not go), or None without probs."""
    if "routing_map" in routing:
        return routing.get("probs")
    weights = routing.get("topk_weights")
    if weights is None:
        return None
    idx = routing["topk_idx"]
    dense = torch.zeros(idx.shape[0], num_experts, dtype=torch.float32, device=idx.device)
    tokens, slots = (idx >= 0).nonzero(as_tuple=True)
    dense[tokens, idx[tokens, slots]] = weights[tokens, slots].float()
    return dense


def copy_factor(index: int) -> float:
    """The round trip's factor of a copy by its index: its expert (expert-row form) or receiving rank (compact),
    picked by the index's digit sum in base 4 (module docstring)."""
    digits = 0
    while index:
        digits, index = digits + index % 4, index // 4
    return COPY_FACTORS[digits % len(COPY_FACTORS)]


def marked_column(index: int, hidden: int) -> int:
    """The column a copy of that index has zeroed before the round trip's combine (``scale_copies``)."""
    return index % hidden


def copy_factors(count: int, device=None) -> torch.Tensor:
    """[count] fp32: ``copy_factor`` of the indices 0 .. count - 1."""
    return torch.tensor([copy_factor(index) for index in range(count)], device=device)


def valid_rows(out, rows: torch.Tensor) -> int:
    """How many of ``rows`` (a dispatch output's) hold data: a non-blocking output's rows past
    ``num_valid_rows`` were not written by this dispatch."""
    if out.num_valid_rows is None:
        return rows.shape[0]
    return min(rows.shape[0], int(out.num_valid_rows.item()))


def copies_sent(chosen: torch.Tensor, num_local_experts: int, output_form: str) -> torch.Tensor:
    """[T, C] bool: the copies each token went out as: one per expert ([T, E], ``chosen``), or one per destination
    rank in the compact form ([T, R])."""
    if output_form == COMPACT:
        return chosen.view(chosen.shape[0], -1, num_local_experts).any(2)
    return chosen


def copies_per_token(chosen: torch.Tensor, num_local_experts: int, output_form: str) -> torch.Tensor:
    """[T] fp32: what a token's combined copies add up to, in tokens: the factors (``copy_factors``) of the rows
    it went out as, one per expert, or one per destination rank (compact)."""
    sent = copies_sent(chosen, num_local_experts, output_form)
    return (sent.float() * copy_factors(sent.shape[1], chosen.device)).sum(1)


class RoundTrip:
    """What each value of a token's combine must be (``expected``): the token times the factors of the copies it
    went out as, less, in each copy's marked column, that copy's factor (``scale_copies`` zeroed it there)."""

    def __init__(self, chosen: torch.Tensor, num_local_experts: int, output_form: str, hidden: int) -> None:
        self.sent = copies_sent(chosen, num_local_experts, output_form)  # [T, C]
        count = self.sent.shape[1]
        self.factors = copy_factors(count, chosen.device)
        self.columns = torch.tensor([marked_column(index, hidden) for index in range(count)], device=chosen.device)
        self.hidden = hidden

    def expected(self, tokens: torch.Tensor, part: slice) -> torch.Tensor:
        """[t, H] fp32: what the combine must give for the tokens of ``part``, value by value (exact: a bf16 value
        times sums of powers of two)."""
        x = tokens[part].float()
        per_copy = self.sent[part].float() * self.factors  # [t, C]
        # Less each copy's share in its marked column: a [t, C] correction, not a second [t, H] tensor.
        return (x * per_copy.sum(1, keepdim=True)).index_add_(1, self.columns, -x[:, self.columns] * per_copy)

    def factor_at(self, token: int, column: int) -> float:
        """What the token's value in ``column`` is multiplied by (for a message)."""
        per_copy = self.sent[token].float() * self.factors
        return float(per_copy.sum() - per_copy[self.columns == column].sum())


def scale_copies(out, rows: torch.Tensor, rank: int) -> None:
    """Multiply, in place, each row that ``out`` (a dispatch on ``rank``) received by its copy's factor, and zero
    its copy's marked column: its expert's in the expert-row form, ``rank``'s in the compact form. ``rows``: the
    output's rows in bf16 (``as_bf16_rows``), the ones the combine is then given. Rows past ``num_valid_rows``
    are left alone."""
    valid = valid_rows(out, rows)
    hidden = rows.shape[1]
    if out.handle.output_form == COMPACT:
        rows[:valid] *= copy_factor(rank)
        rows[:valid, marked_column(rank, hidden)] = 0
        return
    local = out.handle.num_local_experts
    start = 0
    for e, segment in enumerate(out.handle.tokens_per_expert.to(torch.int64).tolist()):
        end = min(start + segment, valid)
        if end > start:
            expert = rank * local + e
            rows[start:end] *= copy_factor(expert)
            rows[start:end, marked_column(expert, hidden)] = 0
        start += segment


def column_weights(hidden: int, device=None) -> torch.Tensor:
    """[H] fp32: 1 + j / H for column j, the checksum's weights: all different, so a row whose values moved within
    it (by any offset) sums to another checksum; near 1, so the checksum is as well conditioned as a plain sum."""
    return 1 + torch.arange(hidden, device=device, dtype=torch.float32) / hidden


def row_checksums(rows: torch.Tensor) -> torch.Tensor:
    """[N] fp64 checksum of each row: its values times ``column_weights``, summed; a chunk at a time (a float copy
    of every received row would double memory). Both sides multiply the same bf16 value by the same weight, so
    their products are equal; only the order of the fp64 sum differs."""
    weights = column_weights(rows.shape[1], rows.device)
    sums = [rows[start:start + DEQUANT_CHUNK_ROWS].float().mul_(weights).sum(1, dtype=torch.float64)
            for start in range(0, rows.shape[0], DEQUANT_CHUNK_ROWS)]
    return torch.cat(sums) if sums else rows.new_zeros(0, dtype=torch.float64)


def received_per_expert(out, rows: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """([L] fp64 sum of row checksums, [L] int64 row count, [L] fp64 sum of the probs, [L] fp64 sum of each prob
    times its row's checksum; the last two None without probs) on the host: what this rank received for each local
    expert.
    ``rows``: the dispatch output's rows in bf16 (``as_bf16_rows``)."""
    num_local_experts = out.handle.num_local_experts
    valid = valid_rows(out, rows)
    sums = row_checksums(rows[:valid])
    probs = out.probs[:valid].double() if out.probs is not None else None
    if out.handle.output_form == COMPACT:
        names = out.topk_idx[:valid].unsqueeze(2) == torch.arange(num_local_experts, device=rows.device)
        here = names.any(1)  # [rows, L]: the row carries a token for that expert
        if probs is None:
            return (sums.unsqueeze(1) * here).sum(0).cpu(), here.sum(0).cpu(), None, None
        probs_here = probs.unsqueeze(2) * names  # [rows, k, L]: each slot's prob, under the expert it names
        return ((sums.unsqueeze(1) * here).sum(0).cpu(), here.sum(0).cpu(), probs_here.sum((0, 1)).cpu(),
                (probs_here * sums.view(-1, 1, 1)).sum((0, 1)).cpu())
    # Expert-row form: segment e starts at the padded lengths before it; its real rows come first.
    padded = out.handle.tokens_per_expert.to(torch.int64).tolist()
    real = out.handle.num_real_tokens_per_expert.to(torch.int64).tolist()
    per_expert, counts, probs_per_expert, weighted, start = [], [], [], [], 0
    zero = sums.new_zeros(())
    for segment, rows_here in zip(padded, real, strict=True):
        end = min(start + rows_here, valid)
        per_expert.append(sums[start:end].sum() if end > start else zero)
        counts.append(max(end - start, 0))
        if probs is not None:
            probs_per_expert.append(probs[start:end].sum() if end > start else zero)
            weighted.append((probs[start:end] * sums[start:end]).sum() if end > start else zero)
        start += segment
    if probs is None:
        return torch.stack(per_expert).cpu(), torch.tensor(counts), None, None
    return (torch.stack(per_expert).cpu(), torch.tensor(counts), torch.stack(probs_per_expert).cpu(),
            torch.stack(weighted).cpu())


def sent_checksums(tokens: torch.Tensor, chosen: torch.Tensor,
                   probs: Optional[torch.Tensor] = None) -> tuple[Optional[torch.Tensor], ...]:
    """What this rank sends each expert, on the host: ([E] fp64 sum of the row checksums of the tokens routed
    there, [E] their count, [E] the sum of the checksums' magnitudes, for the tolerance; [E] fp64 sum of their
    probs, [E] of each prob times its token's row checksum and [E] of those products' magnitudes, or three None
    without probs). ``tokens``: bf16 [T, H]; ``probs``: ``dense_probs`` or None."""
    token_sums = row_checksums(tokens).unsqueeze(1)
    sent = ((token_sums * chosen).sum(0).cpu(), chosen.sum(0).cpu(), (token_sums.abs() * chosen).sum(0).cpu())
    if probs is None:
        return (*sent, None, None, None)
    routed = probs.double() * chosen
    return (*sent, routed.sum(0).cpu(), (routed * token_sums).sum(0).cpu(),
            (routed.abs() * token_sums.abs()).sum(0).cpu())


def dispatch_problem(rank: int, every_sent: list, got: tuple[torch.Tensor, torch.Tensor]) -> Optional[str]:
    """What this rank's dispatch output got wrong, or None: ``got`` (``received_per_expert``) against the
    sum over every source of its ``sent_checksums`` for this rank's experts."""
    got_sums, got_counts, got_probs, got_weighted = got
    local = got_sums.shape[0]
    num_experts = every_sent[0][0].shape[0]
    mine = slice(rank * local, (rank + 1) * local)

    def summed(field: int) -> Optional[torch.Tensor]:  # over every source, for this rank's experts
        parts = [sent[field] for sent in every_sent]
        return sum(part[mine] for part in parts) if all(part is not None for part in parts) else None

    want_sums, want_counts, scale = summed(0), summed(1), summed(2)
    want_probs, want_weighted, weighted_scale = summed(3), summed(4), summed(5)
    if (want_probs is None) != (got_probs is None):
        return (f"dispatch returned {'no ' if got_probs is None else ''}probs, and the sources sent "
                f"{'none' if want_probs is None else 'some'}")
    for e in range(local):
        expert = rank * local + e
        if int(got_counts[e]) != int(want_counts[e]):
            return (f"dispatch gave local expert {e} (expert {expert} of {num_experts}) {int(got_counts[e])} rows, "
                    f"the sources routed {int(want_counts[e])} there")
        # "not <=": a NaN row checksum (rows never written) is never within the tolerance.
        if not abs(float(got_sums[e]) - float(want_sums[e])) <= CHECKSUM_RTOL * float(scale[e]) + 1e-6:
            return (f"dispatch gave local expert {e} (expert {expert} of {num_experts}) the wrong rows: their row "
                    f"sums add up to {float(got_sums[e]):.6g}, the routed tokens' to {float(want_sums[e]):.6g}")
        # fp32 probs moved as they are: only fp64 rounding of the sums (in another order) stands between them.
        if want_probs is not None and not abs(float(got_probs[e]) - float(want_probs[e])) <= \
                CHECKSUM_RTOL * float(want_probs[e]) + 1e-6:
            return (f"dispatch gave local expert {e} (expert {expert} of {num_experts}) the wrong probs: they add up "
                    f"to {float(got_probs[e]):.9g}, the routed tokens' to {float(want_probs[e]):.9g}")
        if want_probs is not None and not abs(float(got_weighted[e]) - float(want_weighted[e])) <= \
                CHECKSUM_RTOL * float(weighted_scale[e]) + 1e-6:
            return (f"dispatch gave local expert {e} (expert {expert} of {num_experts}) probs on the wrong rows: each "
                    f"prob times its row's checksum adds up to {float(got_weighted[e]):.9g}, the routed tokens' to "
                    f"{float(want_weighted[e]):.9g}")
    return None


def round_trip_problem(tokens: torch.Tensor, copies: Union[torch.Tensor, RoundTrip],
                       combined: torch.Tensor) -> Optional[str]:
    """Whether combining the dispatched rows, each scaled by its copy's factor and its marked column zeroed
    (``scale_copies``), gave each token's value times its factor (``RoundTrip``; a [T] tensor, ``copies_per_token``:
    one factor for every value of a token, for rows that were not marked), or what it gave: each value within
    ROUND_TRIP_RTOL, and their mean signed error near 0 (module docstring). A chunk of tokens at a time: float
    copies of every token would cost ranks sharing a GPU gigabytes."""
    if not isinstance(copies, RoundTrip):
        copies = copies.to(tokens.device)
    wrong_values, first = 0, None
    signed_error, magnitude, nonzero = 0.0, 0.0, 0  # over every value: the mean signed error's parts
    for start in range(0, tokens.shape[0], DEQUANT_CHUNK_ROWS):
        part = slice(start, start + DEQUANT_CHUNK_ROWS)
        if isinstance(copies, RoundTrip):
            expected = copies.expected(tokens, part)
        else:
            expected = tokens[part].float() * copies[part].unsqueeze(1).float()
        error = combined[part].float() - expected
        wrong = ~(error.abs() <= ROUND_TRIP_RTOL * expected.abs())  # a NaN is wrong too
        count = int(wrong.sum())
        if count and first is None:
            token, column = (int(i) for i in wrong.nonzero()[0])
            times = (copies.factor_at(start + token, column) if isinstance(copies, RoundTrip)
                     else float(copies[start + token]))
            first = (start + token, column, float(combined[start + token, column]), float(expected[token, column]),
                     times)
        wrong_values += count
        signed_error += float((error * expected.sign()).sum(dtype=torch.float64))
        magnitude += float(expected.abs().sum(dtype=torch.float64))
        nonzero += int(expected.count_nonzero())
    if wrong_values:
        token, column, got, want, times = first
        return (f"combine of the dispatched rows is wrong at {wrong_values} of {combined.numel()} values (first: "
                f"token {token}, column {column}: {got:.4g}, expected {want:.4g} = the token x {times:g}, its copies' "
                f"factors, less those of the copies whose marked column this is)")
    if not nonzero:
        return None
    bias, limit = signed_error / magnitude, max(ROUND_TRIP_BIAS, 4 * ROUND_TRIP_RTOL / math.sqrt(nonzero))
    if abs(bias) > limit:
        return (f"combine of the dispatched rows is wrong: its values are {bias:+.3%} off the tokens x their copies' "
                f"factors on average over {nonzero} values (rounding alone stays within {limit:.3%} there)")
    return None
