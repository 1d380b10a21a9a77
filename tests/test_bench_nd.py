"""``bench nd``'s grid: every layout of the world, the ones the model cannot take left out by
``nd``'s own checks (no process is started here)."""
from __future__ import annotations

import json
import math
from pathlib import Path

from test_tensor_parity import fsdp_tp_param_bytes

from dlab import models
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


def test_the_peer_rows_name_their_precision_and_fp32_keeps_its_label():
    bf16 = bench.label({**bench.PEER_LAYOUT, "precision": "bf16"})
    assert bf16 == "dp2 x tp2 zero3 sp bf16"
    # the README selects the fp32 row by this label: a bf16 row beside it must not match too
    assert bench.label({**bench.PEER_LAYOUT, "precision": "fp32"}) == bench.label(bench.PEER_LAYOUT)
    assert bench.label(bench.PEER_LAYOUT) == "dp2 x tp2 zero3 sp"


class _Run:
    """A finished run's per-rank memory, as ``Run.metrics`` returns it (last step counts)."""

    def __init__(self, memory: list[dict]):
        self.memory, self.world_size = memory, len(memory)

    def metrics(self, rank):
        return [{"memory": {k: 0 for k in self.memory[rank]}}, {"memory": self.memory[rank]}]


def test_the_peers_model_state_is_its_fullest_ranks_parameters_gradients_and_optimizer():
    fuller = {"parameters": 3e6, "gradients": 3e6, "optimizer": 6e6, "activations": 9e6,
              "comm_buffers": 9e6}
    other = {**fuller, "optimizer": 5e6, "activations": 99e6}  # activations are not state
    assert bench.state_MB(_Run([other, fuller])) == 12.0


def test_the_stored_bf16_rows_model_state_is_each_sides_formula():
    """``docs/bench/nd-bf16.json``'s state row: ``nd``'s figure is ``estimate.nd``'s (2 + 2 + 12
    bytes per parameter, as the step row's ``state_model_MB``), the peer's is FSDP2's 4 + 4 + 8
    counted from the shapes (``fsdp_tp_param_bytes``): fp32 parameter and gradient shards with
    FSDP2's padding, Adam's two fp32 moments over the rank's rows without it, and a 4-byte step
    per parameter tensor, on the fuller dp rank."""
    rows = json.loads((Path(__file__).parents[1] / "docs/bench/nd-bf16.json").read_text())
    step, state = ([r for r in rows if r["metric"] == m] for m in ("step_s", "state_MB"))
    assert len(step) == len(state) == 1 and state[0]["precision"] == "bf16"
    assert state[0]["dlab"] == step[0]["state_MB"] == step[0]["state_model_MB"]
    tensors = len(list(models.build("gpt", bench.MODEL, 0).parameters()))
    padded = fsdp_tp_param_bytes(bench.MODEL, 2, 2)
    peer = max(2 * padded + 2 * fsdp_tp_param_bytes(bench.MODEL, 2, 2, d) + 4 * tensors
               for d in range(2))
    assert state[0]["peer"] == peer / bench.MB
