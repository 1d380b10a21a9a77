"""One device, one model, every precision of ``dlab.core.precision``: the training step that
notebook 01 runs, written out so that each byte of the 16 per parameter has a tensor to point at.

The recipe of Micikevicius et al. 2018 ("Mixed Precision Training", sec. 3):

- the model computes in the compute dtype (fp16 or bf16) and its gradients come out in it;
- the optimizer updates an fp32 *master* copy of the weights (sec. 3.1): an update lr * g
  smaller than half an fp16 step of the weight it is added to would round away, so a 16-bit
  weight would stop moving; the compute copy is cast from the master after each step;
- the loss and every reduction are computed in fp32 (sec. 3.3): the logits are cast up before
  the cross-entropy, and gradients are accumulated in fp32 where the precision says so
  (``bf16-fp32-grads``, Megatron-LM's ``main_grad``);
- fp16 scales the loss (sec. 3.2, ``dlab.core.precision.LossScaler``) so that small gradients
  stay above fp16's smallest subnormal, 6e-8; bf16 has fp32's exponent range and needs none.

``loss_weight`` multiplies the loss in the 16-bit backward and is divided out again in fp32:
it stands in for a model whose gradients are that much smaller than this small GPT's (late in
training, and in large models, most gradients are far below 1e-3: Micikevicius et al., fig. 3),
so the fp16 run without loss scaling shows what underflow does, and the runs stay comparable.

Memory by category (``memory``) is counted from the storages held after a step, as every
strategy counts it (``dlab.core.metrics``): ``parameters`` the compute copy, ``gradients`` the
gradients the backward accumulated (in fp32 where the precision keeps them so), ``optimizer``
the fp32 master (mixed precision) and the optimizer's state.

``AutocastTrainer`` is PyTorch's own way to the same step, for comparison: the parameters stay
fp32 (they are the masters; there is no 16-bit copy of the model), ``torch.autocast`` casts the
inputs of each operator on its lists as it runs (matmuls to the 16-bit dtype, losses up to
fp32; any other operator runs in the dtype of its inputs), the gradients come out fp32, and
fp16 scales its loss with ``torch.amp.GradScaler``. ``op_dtypes`` counts which dtype each
operator of a forward ran in.
"""
from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from dlab.core.metrics import optimizer_tensors, storage_bytes
from dlab.core.precision import PRECISIONS, LossScaler
from dlab.models.gpt import GPT, GPTConfig

OPTIMIZERS = ("adam", "sgd")


def _check_arguments(cfg: GPTConfig, optimizer: str, loss_weight: float) -> None:
    """What both trainers refuse before building anything."""
    if optimizer not in OPTIMIZERS:
        raise ValueError(f"optimizer must be 'adam' or 'sgd' (got {optimizer!r})")
    if not loss_weight > 0:
        raise ValueError(f"loss_weight must be positive (got {loss_weight})")
    problems = cfg.problems()
    if problems:
        raise ValueError("; ".join(problems))


class MixedPrecisionTrainer:
    """A GPT trained on one device in ``precision`` (a name of ``PRECISIONS``) with Adam or plain
    SGD, gradients accumulated over the micro-batches ``step`` is given, the loss scaled by
    ``scaler`` where one is given. Every precision starts from the same fp32 initialisation."""

    def __init__(self, cfg: GPTConfig, precision: str = "fp32", optimizer: str = "adam",
                 lr: float = 1e-3, scaler: LossScaler | None = None, loss_weight: float = 1.0,
                 seed: int = 0):
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {', '.join(map(repr, PRECISIONS))} "
                             f"(got {precision!r})")
        _check_arguments(cfg, optimizer, loss_weight)
        self.precision, self.scaler, self.loss_weight = PRECISIONS[precision], scaler, loss_weight
        torch.manual_seed(seed)
        self.model = GPT(cfg)
        params = list(self.model.parameters())
        mixed = self.precision.mixed
        # the master is the fp32 initialisation itself; the model is cast to the compute dtype
        self.master = [p.detach().clone() for p in params] if mixed else params
        self.model.to(self.precision.compute)
        make = torch.optim.Adam if optimizer == "adam" else torch.optim.SGD
        self.optimizer = make(self.master, lr=lr)
        # Megatron's main_grad: gradients accumulated in fp32 beside a 16-bit model
        self.main_grads = ([torch.zeros_like(m) for m in self.master]
                           if self.precision.grad_bytes == 4 and mixed else None)

    @property
    def params(self) -> list[torch.Tensor]:
        return list(self.model.parameters())

    def gradients(self) -> list[torch.Tensor]:
        """The gradients the backward accumulated, in the precision's gradient dtype."""
        if self.main_grads is not None:
            return self.main_grads
        return [p.grad for p in self.params if p.grad is not None]

    def zero_grad(self) -> None:
        for p in self.params:
            p.grad = None
        if self.main_grads is not None:
            for g in self.main_grads:
                g.zero_()

    def step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict:
        """One optimizer step over ``batches`` (micro-batches of one global batch): each loss is
        divided by their number, so k micro-batches of b/k sequences give the gradient of one
        batch of b. Returns the mean loss, whether the step was applied (False where the scaler
        found an inf or NaN), the scale, and the share of gradient elements that are exactly 0
        (underflow shows there)."""
        if not batches:
            raise ValueError("step needs at least one (inputs, targets) micro-batch")
        self.zero_grad()
        k, mean_loss = len(batches), 0.0
        for x, y in batches:
            logits = self.model(x)
            loss = GPT.criterion(logits.float(), y)  # the softmax and the mean in fp32
            mean_loss += loss.item() / k
            objective = loss * (self.loss_weight / k)
            if self.scaler is not None:
                objective = self.scaler.scale_loss(objective)
            objective.backward()
            if self.main_grads is not None:
                for g, p in zip(self.main_grads, self.params):
                    g.add_(p.grad.float())
                    p.grad = None
        grads32 = [g.float() for g in self.gradients()] if self.precision.mixed else self.gradients()
        zeros = sum(int((g == 0).sum()) for g in grads32) / sum(g.numel() for g in grads32)
        applied = True
        if self.scaler is not None:
            applied = self.scaler.update(self.scaler.unscale(grads32))
        if applied:
            for g in grads32:
                g.div_(self.loss_weight)
            if self.precision.mixed:
                for m, g in zip(self.master, grads32):
                    m.grad = g  # an fp32 copy that lives only through the update
            self.optimizer.step()
            if self.precision.mixed:
                with torch.no_grad():
                    for p, m in zip(self.params, self.master):
                        p.copy_(m)
                for m in self.master:
                    m.grad = None
        return {"loss": mean_loss, "applied": applied, "zero_grads": zeros,
                "scale": self.scaler.scale if self.scaler is not None else 1.0}

    def memory(self) -> dict[str, int]:
        """Bytes held now by category, each storage once (after a step: what a step keeps)."""
        masters = storage_bytes(self.master) if self.precision.mixed else 0
        return {"parameters": storage_bytes(self.params),
                "gradients": storage_bytes(self.gradients()),
                "optimizer": masters + storage_bytes(optimizer_tensors(self.optimizer))}


class AutocastTrainer:
    """The step of ``MixedPrecisionTrainer`` done PyTorch's way, with the same arguments and the
    same figures returned (``step``, ``memory``): the GPT keeps fp32 parameters, its forward and
    loss run under ``torch.autocast(device_type="cpu", dtype=...)`` (bf16 or fp16), the backward
    outside it (PyTorch's recipe), and ``scaler``, a ``torch.amp.GradScaler``, scales the loss
    where one is given. ``loss_weight`` multiplies the loss in the backward and is divided out of
    the fp32 gradients again, as in ``MixedPrecisionTrainer``. Every run starts from the same fp32
    initialisation as that trainer's, for a given ``seed``."""

    def __init__(self, cfg: GPTConfig, precision: str = "bf16", optimizer: str = "adam",
                 lr: float = 1e-3, scaler: torch.amp.GradScaler | None = None,
                 loss_weight: float = 1.0, seed: int = 0):
        if precision not in ("bf16", "fp16"):
            raise ValueError(f"AutocastTrainer computes in 'bf16' or 'fp16' (got {precision!r}): "
                             f"its gradients are fp32 in any case (the parameters are), and an "
                             f"fp32 run is MixedPrecisionTrainer(cfg, 'fp32')")
        _check_arguments(cfg, optimizer, loss_weight)
        self.precision, self.scaler, self.loss_weight = PRECISIONS[precision], scaler, loss_weight
        torch.manual_seed(seed)
        self.model = GPT(cfg)  # fp32, and it stays so: autocast casts per operator
        make = torch.optim.Adam if optimizer == "adam" else torch.optim.SGD
        self.optimizer = make(self.model.parameters(), lr=lr)

    @property
    def params(self) -> list[torch.Tensor]:
        return list(self.model.parameters())

    def gradients(self) -> list[torch.Tensor]:
        return [p.grad for p in self.params if p.grad is not None]

    def step(self, batches: list[tuple[torch.Tensor, torch.Tensor]]) -> dict:
        """One optimizer step over ``batches``, as ``MixedPrecisionTrainer.step``; a step is
        reported not applied where the scaler lowered its scale (it found an inf or a NaN and
        skipped the optimizer)."""
        if not batches:
            raise ValueError("step needs at least one (inputs, targets) micro-batch")
        self.optimizer.zero_grad(set_to_none=True)
        k, mean_loss = len(batches), 0.0
        for x, y in batches:
            with torch.autocast(device_type="cpu", dtype=self.precision.compute):
                loss = GPT.criterion(self.model(x), y)  # cross_entropy: on autocast's fp32 list
            mean_loss += loss.item() / k
            objective = loss * (self.loss_weight / k)
            if self.scaler is not None:
                objective = self.scaler.scale(objective)
            objective.backward()
        grads = self.gradients()
        zeros = sum(int((g == 0).sum()) for g in grads) / sum(g.numel() for g in grads)
        applied = True
        if self.scaler is not None:
            before = self.scaler.get_scale()
            self.scaler.unscale_(self.optimizer)  # divides the fp32 gradients, looks for inf/NaN
        for g in grads:
            g.div_(self.loss_weight)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)  # skipped where unscale_ found an inf or a NaN
            self.scaler.update()  # halves the scale after a skip, doubles it after a clean run
            applied = self.scaler.get_scale() >= before
        else:
            self.optimizer.step()
        return {"loss": mean_loss, "applied": applied, "zero_grads": zeros,
                "scale": self.scaler.get_scale() if self.scaler is not None else 1.0}

    def memory(self) -> dict[str, int]:
        """Bytes held after a step by category, as ``MixedPrecisionTrainer.memory`` counts them:
        fp32 parameters (no master beside them), fp32 gradients, the optimizer's state."""
        return {"parameters": storage_bytes(self.params),
                "gradients": storage_bytes(self.gradients()),
                "optimizer": storage_bytes(optimizer_tensors(self.optimizer))}


class _OpDtypes(TorchDispatchMode):
    def __init__(self, counts: Counter):
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        returns = func._schema.returns
        alias = returns[0].alias_info if returns else None
        view = alias is not None and not alias.is_write  # an in-place operator writes: counted
        if not view and func.overloadpacket.__name__ != "_unsafe_view":  # a view, undeclared
            outs = out if isinstance(out, (tuple, list)) else (out,)
            floats = [t for t in outs if isinstance(t, torch.Tensor) and t.is_floating_point()]
            if floats:
                ins = sorted({_name(a.dtype) for a in [*args, *(kwargs or {}).values()]
                              if isinstance(a, torch.Tensor) and a.is_floating_point()})
                self.counts[(func.overloadpacket.__name__, "+".join(ins) or "-",
                             _name(floats[0].dtype))] += 1
        return out


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def op_dtypes(fn: Callable[[], object]) -> Counter:
    """Run ``fn()`` and count the operators PyTorch ran, by (operator, the dtypes of its
    floating-point inputs joined by '+', the dtype of its first floating-point output), in the
    order first seen. Counted below autocast, so its casts (``_to_copy``) and the dtypes each
    operator actually ran in are seen; views and operators with no floating-point output are
    left out (an in-place operator is counted)."""
    counts: Counter = Counter()
    with _OpDtypes(counts):
        fn()
    return counts
