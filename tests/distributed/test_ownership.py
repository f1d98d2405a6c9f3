"""Topology arithmetic and block ownership (pure functions, no processes)."""

from __future__ import annotations

import pytest

from asteria.runtime.distributed import Topology, assign_owners, check_ranks_per_node


def test_topology_numbers_nodes_by_consecutive_ranks() -> None:
    top = Topology(world=8, rank=5, ranks_per_node=4)
    assert (top.nodes, top.node, top.local) == (2, 1, 1)
    assert top.representative(1) == 4 and top.node_of(3) == 0


@pytest.mark.parametrize("bad", [0, 3, -2, 2.0, True, None])
def test_a_node_size_that_does_not_divide_the_world_is_refused(bad) -> None:
    with pytest.raises(ValueError, match="must be a positive integer that divides the world"):
        check_ranks_per_node(bad, 4, "ranks_per_node")


def test_owners_balance_cubic_cost_across_nodes_then_ranks() -> None:
    dims = [64, 64, 48, 32, 32, 32, 16, 16, 8, 8, 4]
    blocks = [((i, 0), float(d**3)) for i, d in enumerate(dims)]
    owners = assign_owners(blocks, range(4), ranks_per_node=2)
    assert set(owners) == {k for k, _ in blocks}
    load = [sum(c for k, c in blocks if owners[k] == r) for r in range(4)]
    assert max(load) == 64**3  # the largest block alone: the best any assignment can do
    assert all(load)  # every rank owns something
    nodes = [load[0] + load[1], load[2] + load[3]]
    assert abs(nodes[0] - nodes[1]) <= 32**3
    # deterministic: the same answer whatever the input order
    assert assign_owners(list(reversed(blocks)), [3, 2, 1, 0], 2) == owners


def test_distributed_settings_without_a_process_group_are_refused() -> None:
    import torch

    from asteria.optim import SOAP
    from asteria.runtime import Runtime, RuntimeConfig

    opt = SOAP([torch.nn.Parameter(torch.zeros(3, 3))])
    with pytest.raises(ValueError, match="ranks_per_node applies to distributed mode only"):
        Runtime(None, opt, RuntimeConfig(workers=1), ranks_per_node=2)
    with pytest.raises(ValueError, match="needs an initialized torch.distributed process group"):
        Runtime(None, opt, RuntimeConfig(workers=1), distributed=True)
    with pytest.raises(ValueError, match="distributed must be True, False or None"):
        Runtime(None, opt, RuntimeConfig(workers=1), distributed="yes")
    Runtime(None, opt, RuntimeConfig(workers=1)).close()  # nothing was left attached
