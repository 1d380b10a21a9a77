"""What every data-parallel strategy here shares: a whole model replica on each rank, and the
rank's contiguous slice of the global batch (``dlab.models.data.shard``, DistributedSampler without
shuffling).

Learning rate and global batch: data parallelism over N ranks with a per-rank batch b trains
on the global batch B = N b. dlab keeps B fixed when N changes (the same numbers as ``single``),
so the learning rate needs no change. A job that instead keeps b fixed and adds ranks grows B,
and then needs a larger learning rate to take the same progress per sample: the linear scaling
rule lr ~ B for SGD, with a warm-up (Goyal et al. 2017, "Accurate, Large Minibatch SGD"), or
roughly lr ~ sqrt(B) for Adam-type optimizers (Malladi et al. 2022), up to the critical batch
size beyond which a larger batch no longer buys fewer steps (McCandlish et al. 2018).
"""
from __future__ import annotations

import torch

from dlab.core.metrics import ActivationMeter
from dlab.models.data import shard
from dlab.parallel.base import WholeModel, data_parallel_problems


class Replica(WholeModel):
    """Base of the data-parallel strategies: one replica per rank, the batch split by rank.
    Replicas equal after every step checkpoint as one (rank 0's part); a subclass whose ranks
    hold different state (a parameter server's workers have no optimizer) opts out."""

    @classmethod
    def problems(cls, config):
        return super().problems(config) + data_parallel_problems(config, config.world_size)

    def setup(self) -> None:
        self.model = self.build_model()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = self.build_optimizer(self.params)
        self.meter = ActivationMeter(self.params)

    def my_shard(self, batch) -> tuple[torch.Tensor, torch.Tensor]:
        return tuple(t.to(self.ctx.device) for t in shard(batch, self.ctx.rank, self.ctx.world_size))
