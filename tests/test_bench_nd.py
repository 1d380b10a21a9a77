"""``bench nd``'s grid: every layout of the world, the ones the model cannot take left out by
``nd``'s own checks (no process is started here)."""
from __future__ import annotations

import math

from dlab.bench import nd as bench


def test_the_grid_is_every_factorisation_of_the_world_once():
    for world, count in ((4, 10), (8, 20)):  # ways to write 4 = 2^2 and 8 = 2^3 over 4 dims
        grid = bench.layouts(world)
        degrees = [tuple(o.get(d, 1) for d in ("pp", "dp", "cp", "tp")) for o in grid]
        assert len(set(degrees)) == len(grid) == count
        assert all(math.prod(d) == world for d in degrees)


def test_layouts_the_model_cannot_take_are_left_out_by_nds_checks():
    taken = [bench.label(o) for o in bench.layouts(8) if bench.runnable(8, o)]
    assert "tp8 sp" not in taken  # 4 heads do not split 8 ways
    assert "pp8" not in taken  # 4 blocks, 8 stages
    assert "pp2 x dp2 x tp2 zero1 sp" in taken and len(taken) == 17
