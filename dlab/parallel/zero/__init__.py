"""ZeRO stages 1, 2 and 3 written out, and PyTorch's FSDP2 as their peer.

- ``flat.py``: parameters grouped into units (a block each, plus a root), flattened, padded to
  a multiple of N and sharded: rank r owns chunk r of every unit.
- ``sharded.py``: what the stages share (fp32 master shards, the sharded optimizer step, memory
  by category, full state dict).
- ``zero1`` (``stage1.py``): optimizer state sharded.
- ``zero2`` (``stage2.py``): plus gradients reduce-scattered from backward hooks, only the shard
  kept.
- ``zero3`` (``stage3.py``): plus parameters sharded, each block gathered just before its forward
  and backward and freed right after, with prefetch.
- ``torch-fsdp2`` (``torch_fsdp.py``): ``torch.distributed.fsdp.fully_shard``, the peer.

``dlab.theory.memory`` has the formulas (bytes per rank by category, bytes moved per step)
the tests hold these to; ``python -m dlab bench zero`` sets them side by side.
"""
