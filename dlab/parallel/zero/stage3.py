"""``zero3``: optimizer state, gradients and parameters partitioned (ZeRO stage 3, P_os+g+p),
the design PyTorch calls Fully Sharded Data Parallel.

Between steps a rank holds only its 1/N shard of every unit. A block's full parameters exist
only while they are needed:

- forward: a forward-pre hook all-gathers the block into its flat buffer just before its
  forward; a forward hook frees the buffer's storage right after (``resize_(0)``: the
  parameters and the weights autograd saved become empty, not invalid);
- backward: a hook on the block's output fires when the gradient reaching the block is complete,
  i.e. just before the block's backward, and gathers the block again; when every gradient of the
  block has been accumulated it is flattened and reduce-scattered (as in ``zero2``) and the
  buffer freed again.
- prefetch (option ``prefetch``, default True): when block i starts its forward, block i+1's
  all-gather is launched asynchronously; when block i starts its backward, block i-1's. The
  gather then overlaps compute instead of stalling it, at the price of two gathered blocks at
  once instead of one (Zhao et al., "PyTorch FSDP", section 3.3, forward and backward prefetch).

The root unit (embeddings, final norm, head; the tied weight) is used at both ends of the
forward, so it is gathered once at the start of the step and freed after its gradients are
reduced at the end of backward, as FSDP treats its root module (not resharded after forward).

Bytes moved per rank: each block's parameters are gathered twice (forward, backward) and its
gradients reduce-scattered once, 3 (N-1)/N of their bytes against 2 (N-1)/N for DDP and stages
1-2: the 1.5x of the ZeRO paper (section 7.2.2); the root is gathered once.
"""
from __future__ import annotations

from dlab.parallel import register
from dlab.parallel.base import Option
from dlab.parallel.zero.stage2 import GradientSharding


@register("zero3")
class Zero3(GradientSharding):
    """ZeRO stage 3 (FSDP): parameters sharded too, gathered per block for forward and backward."""

    stage = 3
    OPTIONS = {**GradientSharding.OPTIONS,
               "prefetch": Option("bool", "gather the next block's parameters while this one "
                                  "computes", default=True)}

    def setup(self) -> None:
        super().setup()
        self.prefetch = self.ctx.config.options.get("prefetch", True)
        for u in self.units:
            u.free()
        self.gathering: dict[str, object] = {}
        self.blocks = [u for u in self.units if u.module is not None]
        self.root = next((u for u in self.units if u.module is None), None)
        for i, u in enumerate(self.blocks):
            u.module.register_forward_pre_hook(lambda _m, _a, i=i: self._before_block_forward(i))
            u.module.register_forward_hook(lambda _m, _a, out, i=i: self._after_block_forward(i, out))

    # --- gathering and freeing a unit -------------------------------------------------------------
    def _gather(self, u, wait: bool) -> None:
        if u.name in self.gathering or u.gathered:
            if wait and u.name in self.gathering:
                self.gathering.pop(u.name).wait()
            return
        u.allocate()
        self.transient.held("unit", u.flat)
        fut = self.gather_async(u, u.shard)
        if wait:
            fut.wait()
        else:
            self.gathering[u.name] = fut

    def _prefetch(self, i: int) -> None:
        if self.prefetch and 0 <= i < len(self.blocks):
            self._gather(self.blocks[i], wait=False)

    # --- hooks ----------------------------------------------------------------------------------
    def before_forward(self) -> None:
        if self.root is not None:
            self._gather(self.root, wait=True)
        self._prefetch(0)

    def _before_block_forward(self, i: int) -> None:
        self._gather(self.blocks[i], wait=True)
        self._prefetch(i + 1)

    def _after_block_forward(self, i: int, out) -> None:
        self.blocks[i].free()
        if getattr(out, "requires_grad", False):
            out.register_hook(lambda _grad: self._before_block_backward(i))

    def _before_block_backward(self, i: int) -> None:
        self._gather(self.blocks[i], wait=True)
        self._prefetch(i - 1)

    def unit_backward_done(self, u) -> None:
        self.reduce_unit(u)
        u.free()
