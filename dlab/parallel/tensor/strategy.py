"""The ``tp`` strategy: Megatron-style tensor parallelism, optionally with sequence parallelism,
combined with data parallelism when there are more ranks than the tensor-parallel degree.

``options``: ``tp`` (the tensor-parallel degree t, default: every rank), ``sequence_parallel``
(default False) and ``reduce_scatter`` (``"backend"``, default, or ``"ring"``: sequence
parallelism's reduce-scatters by dlab's own ring, (N-1)/N of the input per rank where Gloo's, a
whole all-reduce, writes twice that). The layout is dp = world / t x tp = t (``dlab.layout``,
whose rules it checks): the t ranks of one tensor-parallel group are adjacent (on one node,
where the bandwidth is) and take the same data-parallel slice of the global batch; the
data-parallel replicas average their gradients after backward (``dlab.parallel.grads``), like
plain DDP.
"""
from __future__ import annotations

from dlab.comm.instrumented import reduce_scatter_option
from dlab.core.metrics import ActivationMeter, model_state_memory
from dlab.layout import DP, TP, Layout
from dlab.models.data import shard
from dlab.parallel import register
from dlab.parallel.base import REDUCE_SCATTER, Option, Strategy
from dlab.parallel.grads import reduce_gradients
from dlab.parallel.mesh import Mesh
from dlab.parallel.tensor.model import TensorParallelGPT, gather_full_state

OPTIONS = {
    "tp": Option("int", "the tensor-parallel degree (default: every rank)", minimum=1),
    "sequence_parallel": Option("bool", "split the sequence in the norms and dropout regions "
                                "(Korthikanti et al.)", default=False),
    **REDUCE_SCATTER,
}


class TensorParallelLayout:
    """What ``tp`` and its peer ``torch-tp`` share: the layout of their options, and the model
    they split (the GPT's heads, MLP and vocabulary)."""

    @classmethod
    def layout(cls, config) -> Layout:
        tp = config.options.get("tp", config.world_size)
        return Layout(dp=config.world_size // tp if tp and config.world_size % tp == 0 else 0,
                      tp=tp, sequence_parallel=bool(config.options.get("sequence_parallel", False)))

    @classmethod
    def model_problems(cls, config) -> list[str]:
        if config.model != "gpt":
            return [f"tensor parallelism here splits the GPT's heads, MLP and vocabulary; use "
                    f"model='gpt' (got {config.model!r})"]
        return []


@register("tp")
class TensorParallel(TensorParallelLayout, Strategy):
    """Megatron-LM tensor parallelism (Shoeybi et al. 2019) with optional sequence parallelism
    (Korthikanti et al. 2022), written on dlab's own f / g operators; TP x DP through a mesh."""

    OPTIONS = OPTIONS

    def setup(self) -> None:
        cfg = self.ctx.config
        lay = self.layout(cfg)
        self.tp, self.sp, self.dp = lay.tp, lay.sequence_parallel, lay.dp
        self.mesh = Mesh.of(lay, device_type=self.ctx.device.type)
        self.tp_comm, self.dp_comm = self.mesh.comm(TP), self.mesh.comm(DP)
        self.tp_comm.reduce_scatter_algorithm = reduce_scatter_option(cfg)
        full = self.build_model()  # same weights on every rank; each keeps its shard
        self.model = TensorParallelGPT(full, self.tp_comm, self.sp).to(self.ctx.device)
        del full
        self.params = list(self.model.parameters())
        self.sp_params = self.model.sequence_parallel_params()
        self.optimizer = self.build_optimizer(self.params)
        self.meter = ActivationMeter(self.params)

    def step(self, batch):
        x, y = (t.to(self.ctx.device) for t in shard(batch, self.mesh.rank(DP), self.dp))
        tl = self.ctx.timeline
        self.optimizer.zero_grad()
        self.meter.reset_peak()
        loss = self.forward_backward(x, y)
        if self.sp_params and self.tp > 1:
            # Under sequence parallelism each rank's layer norms, biases and positions saw only
            # its tokens: sum the partial gradients (one flat all-reduce per step).
            with tl.span("all_reduce", what="sequence_parallel"):
                reduce_gradients(self.sp_params, self.tp_comm, divide_by=1)
        if self.dp > 1:
            with tl.span("all_reduce"):  # data parallelism: average over the replicas
                reduce_gradients(self.params, self.dp_comm)
        with tl.span("optimizer"):
            self.optimizer.step()
        return self.mean_loss(loss, self.mesh.group(DP))

    def memory(self):
        mem = model_state_memory(self.params, self.optimizer)
        mem["activations"] = self.meter.peak
        mem["comm_buffers"] = 0
        return mem

    def comms(self):
        return [self.tp_comm, self.dp_comm]

    def full_state_dict(self):
        return gather_full_state(self.model, self.mesh.group(TP))
