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
"""
from __future__ import annotations

import torch

from dlab.core.metrics import optimizer_tensors, storage_bytes
from dlab.core.precision import PRECISIONS, LossScaler
from dlab.models.gpt import GPT, GPTConfig

OPTIMIZERS = ("adam", "sgd")


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
        if optimizer not in OPTIMIZERS:
            raise ValueError(f"optimizer must be 'adam' or 'sgd' (got {optimizer!r})")
        if not loss_weight > 0:
            raise ValueError(f"loss_weight must be positive (got {loss_weight})")
        problems = cfg.problems()
        if problems:
            raise ValueError("; ".join(problems))
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
