"""``Scratch``: an op's small device tensors carved from one allocation (``backends/compiled.py``).

The compiled backends hand the kernels the pieces' addresses and Python views of some of them; a
piece that overlapped another, started off its alignment or viewed the wrong bytes would corrupt a
dispatch. The argument structs built over a scratch's addresses are kept for the next scratch of the
same plan at the same address: one served at another address would point a kernel at memory the op
does not own. Runs on CPU memory: the carving is the same on any device.
"""

from __future__ import annotations

import pytest
import torch

from ep_plugin.backends.compiled import SCRATCH_ALIGN_BYTES, Scratch, ScratchPlan

FIELDS = [("send_slot", (7, 3), torch.int32), ("tokens_per_expert", (5,), torch.int64),
          ("empty", (0, 4), torch.int32), ("dense_probs", (7, 6), torch.float32), ("total_rows", (1,), torch.int64),
          ("flag", (1,), torch.int32), ("packet_rows", (3, 5), torch.int32)]


def test_pieces_are_aligned_disjoint_and_viewed_where_the_kernels_write():
    scratch = Scratch(ScratchPlan(FIELDS), torch.device("cpu"))
    views = {name: scratch.tensor(name) for name, _, _ in FIELDS}
    for name, shape, dtype in FIELDS:
        view = views[name]
        assert view.shape == shape and view.dtype == dtype, name
        assert scratch.address(name) % SCRATCH_ALIGN_BYTES == 0, name
        if view.numel():
            assert view.data_ptr() == scratch.address(name), name
            assert view.is_contiguous(), name
    for number, (name, _, _) in enumerate(FIELDS):  # each piece filled with its own number...
        views[name].fill_(number + 1)
    for number, (name, _, _) in enumerate(FIELDS):  # ...and none overwrote another
        assert bool((views[name] == number + 1).all()), name
    last_name, last_shape, last_dtype = FIELDS[-1]
    end = scratch.address(last_name) + torch.Size(last_shape).numel() * last_dtype.itemsize
    assert end <= scratch.base + 4 * scratch.plan.words  # the allocation holds every piece
    assert scratch.has("flag") and not scratch.has("peer_rows")


def test_an_empty_plan_still_allocates():
    scratch = Scratch(ScratchPlan([]), torch.device("cpu"))
    assert scratch.memory.numel() == 1


def test_tensors_of_a_run_are_the_pieces_themselves():
    fields = [("a", (3,), torch.int64), ("b", (4, 2), torch.int32), ("c", (5,), torch.int64), ("d", (1,), torch.int64),
              ("e", (2,), torch.int32)]
    scratch = Scratch(ScratchPlan(fields), torch.device("cpu"))
    a, c, d = scratch.tensors(("a", "c", "d"))  # a gap (b) between a and c, none between c and d
    for name, view in (("a", a), ("c", c), ("d", d)):
        single = scratch.tensor(name)
        assert view.dtype == single.dtype and view.shape == single.shape, name
        assert view.data_ptr() == scratch.address(name), name
    scratch.memory.zero_()
    scratch.tensor("c").fill_(7)
    assert a.tolist() == [0, 0, 0] and c.tolist() == [7] * 5 and d.tolist() == [0]
    assert scratch.tensors(("a", "c", "d"))[1].data_ptr() == c.data_ptr()  # the cached cut, reused


def test_tensors_refuses_pieces_it_cannot_cut_in_one_run():
    fields = [("a", (3,), torch.int64), ("b", (4, 2), torch.int32), ("c", (5,), torch.int64)]
    scratch = Scratch(ScratchPlan(fields), torch.device("cpu"))
    for names in (("a", "b"), ("c", "a"), ("b", "c")):  # dtypes differ, out of order, not 1-D
        with pytest.raises(ValueError, match="Scratch.tensors"):
            scratch.tensors(names)


CPU = torch.device("cpu")


def test_structs_are_shared_only_by_scratches_of_one_plan_at_one_address():
    plan, other = ScratchPlan(FIELDS), ScratchPlan(FIELDS)
    first, second = Scratch(plan, CPU), Scratch(plan, CPU)  # both alive: two addresses
    assert first.args("send", lambda: [first.address("send_slot")]) is not \
        second.args("send", lambda: [second.address("send_slot")])
    assert second.args("send", list) == [second.address("send_slot")]  # its own addresses, not the first's
    assert plan.prepared_at(first.base) is first.prepared  # a later allocation there gets these
    assert other.prepared_at(first.base) is not first.prepared  # another plan's pieces lie elsewhere
    for base in range(ScratchPlan.PREPARED_BASES + 1):  # addresses that keep changing: bounded
        plan.prepared_at((1 << 20) + base)
    assert len(plan.prepared) <= ScratchPlan.PREPARED_BASES


def test_args_are_built_once_per_address_and_key():
    scratch, builds = Scratch(ScratchPlan(FIELDS), CPU), []

    def build():
        builds.append(1)
        return {"send_slot": scratch.address("send_slot")}

    assert scratch.args("send", build) is scratch.args("send", build)
    assert scratch.args(("send", True), build) is not scratch.args("send", build)
    assert len(builds) == 2
