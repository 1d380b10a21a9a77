"""Local SGD and DiLoCo: data parallelism that communicates every H steps, not every step.

Every rank holds a replica and takes an optimizer step on its own shard of each global batch
with no communication (the *inner* step, with the run's optimizer); every H steps (option
``sync_every``) the replicas synchronise with one all-reduce of their parameters through the
counting ``Comm``. Bytes per rank fall from 2 (N-1)/N P on every step (``ddp``) to that on one
step in H (``dlab.theory.local_sgd``); the price is that replicas drift apart between syncs.

``outer="average"``: Local SGD (Stich, "Local SGD Converges Fast and Communicates Little",
2019; Lin et al., "Don't Use Large Mini-Batches, Use Local SGD", 2020): at a sync every replica
takes the mean of the replicas' parameters. With H = 1 and plain or momentum SGD this is ``ddp``
exactly, since the update is linear in the gradient.

``outer="diloco"``: DiLoCo (Douillard et al., "DiLoCo: Distributed Low-Communication Training
of Language Models", 2023). Every rank keeps the parameters of the last sync, theta. At a sync
the *outer gradient* is theta minus the mean of the replicas' parameters (each rank all-reduces
its own theta - theta_i, divided by N), and an outer SGD with Nesterov momentum (``outer_lr``,
default 0.7, ``outer_momentum``, default 0.9, the paper's) steps theta with it: torch's
``SGD(nesterov=True)``, buf = m buf + g, theta -= lr (g + m buf). Every replica restarts from
the new theta. With outer_lr = 1 and outer_momentum = 0 it is Local SGD's averaging.

The rules, the same on every rank:

- sync points: after the inner step of step t when (t + 1) is a multiple of H (after H, 2H, ...
  local steps, as in both papers), and after the run's last step whatever its number, so a run
  ends with every replica equal (a last round shorter than H when steps is not a multiple of
  H). ``full_state_dict`` is then the one model every rank holds.
- the inner optimizer's state (SGD momentum, Adam's moments) stays on its rank: neither reset
  nor averaged at a sync, as in DiLoCo (each worker keeps its inner AdamW state) and PyTorch's
  ``PostLocalSGDOptimizer`` (which averages parameters only).
- the logged loss is the mean of the replicas' losses, each on its shard at its own parameters;
  its 4-byte all-reduce is the loop's usual one for logging, outside ``Comm``.

``torch-local-sgd`` is PyTorch's own model averaging, the peer: ``PeriodicModelAverager``
called after every inner step, as ``PostLocalSGDOptimizer.step`` does.

Replicas differ between syncs, so checkpoints (rank 0's part of a replica) are refused: a
checkpoint would need every rank's parameters and inner state, and theta with its momentum.
"""
from __future__ import annotations

import time
import warnings
from contextlib import nullcontext

import torch
from torch.distributed.algorithms.model_averaging.averagers import PeriodicModelAverager
from torch.distributed.algorithms.model_averaging.utils import average_parameters

from dlab.comm import gloo as comm_model
from dlab.comm.instrumented import nbytes
from dlab.comm.wire import meter
from dlab.core.metrics import storage_bytes
from dlab.parallel import register
from dlab.parallel.base import Option, Strategy
from dlab.parallel.data_parallel.parameter_server import copy_flat_into
from dlab.parallel.data_parallel.replica import Replica

OUTER = ("average", "diloco")
SYNC_EVERY = Option("int", "H, the inner steps between two synchronisations, e.g. 4 (1: every step)",
                    default=4, minimum=1)
DILOCO_ONLY = ("outer_lr", "outer_momentum")


def option(config, name: str):
    return config.options.get(name, LocalSGD.OPTIONS[name].default)


def is_sync_step(step: int, sync_every: int, steps: int) -> bool:
    """The sync points of both strategies: after every H local steps, and after the last."""
    return (step + 1) % sync_every == 0 or step == steps - 1


class _Periodic(Replica):
    """What both strategies share: a replica per rank, never checkpointed (replicas differ
    between syncs), and the step t from the loop."""

    replicated = False
    checkpoint_state = Strategy.checkpoint_state
    load_checkpoint_state = Strategy.load_checkpoint_state

    @classmethod
    def predicted_state(cls, config, rank):
        """No formula: DiLoCo's outer step holds its own state beside the inner optimizer's."""
        return None

    def setup(self) -> None:
        super().setup()
        self.sync_every = option(self.ctx.config, "sync_every")

    def syncs_now(self) -> bool:
        return is_sync_step(self.ctx.timeline.step, self.sync_every, self.ctx.config.steps)

    def inner_step(self, batch) -> torch.Tensor:
        x, y = self.my_shard(batch)
        self.optimizer.zero_grad(set_to_none=True)
        self.meter.reset_peak()
        loss = self.forward_backward(x, y)
        with self.ctx.timeline.span("optimizer"):
            self.optimizer.step()
        return loss


@register("local-sgd")
class LocalSGD(_Periodic):
    """Inner steps without communication; every H steps an average (Local SGD) or an outer
    Nesterov step on the averaged change (DiLoCo)."""

    @classmethod
    def check_options(cls) -> dict:
        return {"sync_every": 1}  # H = 1 is DDP

    OPTIONS = {
        "sync_every": SYNC_EVERY,
        "outer": Option("choice", "'average' (Local SGD: replicas take the mean of their parameters) "
                        "or 'diloco' (an outer Nesterov SGD step on the mean change since the last "
                        "sync, Douillard et al. 2023)", default="average", choices=OUTER),
        "outer_lr": Option("number", "DiLoCo's outer learning rate (the paper's 0.7)", default=0.7,
                           minimum=0, above=True),
        "outer_momentum": Option("number", "DiLoCo's outer Nesterov momentum, at least 0 and below 1 "
                                 "(the paper's 0.9)", default=0.9, minimum=0),
    }

    @classmethod
    def problems(cls, config):
        p = super().problems(config)
        given = [k for k in DILOCO_ONLY if k in config.options]
        if option(config, "outer") == "average" and given:
            p.append(f"{' and '.join(given)} set the outer optimizer of outer='diloco'; plain "
                     f"averaging has none: set outer='diloco' or drop {', '.join(given)}")
        if option(config, "outer_momentum") >= 1:
            p.append(f"outer_momentum={option(config, 'outer_momentum')} makes the outer steps grow "
                     f"without bound; use a value below 1, e.g. 0.9 (the paper's)")
        return p

    def setup(self) -> None:
        super().setup()
        cfg = self.ctx.config
        self.diloco = option(cfg, "outer") == "diloco"
        self.flat = torch.cat([p.detach().reshape(-1) for p in self.params])  # the message
        if self.diloco:
            # theta, the parameters of the last sync, is the outer optimizer's one parameter
            self.theta = self.flat.clone()
            self.outer = torch.optim.SGD([self.theta], lr=option(cfg, "outer_lr"),
                                         momentum=option(cfg, "outer_momentum"), nesterov=True)

    def step(self, batch):
        loss = self.inner_step(batch)
        if self.syncs_now():
            self._sync()
        return self.mean_loss(loss)

    @torch.no_grad()
    def _sync(self) -> None:
        tl = self.ctx.timeline
        torch.cat([p.reshape(-1) for p in self.params], out=self.flat)
        if self.diloco:
            torch.sub(self.theta, self.flat, out=self.flat)  # this replica's outer gradient
        self.flat.div_(self.ctx.comm.size)  # the mean as a sum of x_i / N, as torch's averager
        with tl.span("all_reduce"):
            self.ctx.comm.all_reduce(self.flat)
        if self.diloco:
            self.theta.grad = self.flat
            with tl.span("optimizer", outer=True):
                self.outer.step()
            copy_flat_into(self.theta, self.params)
        else:
            copy_flat_into(self.flat, self.params)

    def memory(self):
        mem = super().memory()
        mem["comm_buffers"] = storage_bytes([self.flat])
        if self.diloco:  # theta and its outer momentum
            mem["optimizer"] += storage_bytes([self.theta, *self.outer.state[self.theta].values()])
        return mem


@register("torch-local-sgd")
class TorchLocalSGD(_Periodic):
    """PyTorch's model averaging: ``PeriodicModelAverager`` after every inner step.

    Its schedule: it averages when its call counter c (0, 1, ...) has c >= warmup_steps and
    (c - warmup_steps) % period == 0. With ``warmup_steps=0`` the first average comes after the
    *first* step: PostLocalSGD assumes the warm-up steps ran DDP, replicas equal, so its first
    average lands on step ``warmup_steps``. Here there is no DDP warm-up, and
    ``warmup_steps = H - 1`` gives the papers' schedule, the one ``local-sgd`` follows: averages
    after steps H-1, 2H-1, ... A last step off that schedule averages with torch's own
    ``average_parameters``, as ``local-sgd`` does, so replicas end equal.

    Bytes: torch all-reduces one flat copy of the parameters (divided by N first) on the
    backend directly, not through ``Comm``; the call is counted as ``Comm.all_reduce`` counts
    one of that size (ring model, Gloo's model), inside a wire window so the measured bytes are
    booked under ``all_reduce`` too.
    """

    @classmethod
    def check_options(cls) -> dict:
        return {"sync_every": 1}  # H = 1 is DDP

    OPTIONS = {"sync_every": SYNC_EVERY}

    def setup(self) -> None:
        super().setup()
        with warnings.catch_warnings():  # H = 1 is run on purpose: the DDP-equivalent point
            warnings.simplefilter("ignore")
            self.averager = PeriodicModelAverager(period=self.sync_every,
                                                  warmup_steps=self.sync_every - 1)

    def step(self, batch):
        loss = self.inner_step(batch)
        a = self.averager
        due = a.step >= a.warmup_steps and (a.step - a.warmup_steps) % a.period == 0
        with self._counted() if self.syncs_now() else nullcontext():
            a.average_parameters(self.params)
            if not due and self.syncs_now():  # the last step, off the schedule
                average_parameters(iter(self.params), a.process_group)
        return self.mean_loss(loss)

    def _counted(self):
        comm, payload = self.ctx.comm, sum(nbytes(p) for p in self.params)
        ring = 2 * (comm.size - 1) / comm.size * payload
        stats = comm.record("all_reduce", payload, ring, ring,
                            gloo=comm_model.gloo_all_reduce_bytes(payload, comm.size, comm.rank))
        return _Window(comm, stats, self.ctx.timeline)


class _Window:
    """Time and wire bytes of a collective called on the backend directly, booked as ``Comm``
    books its own (``dlab.comm.wire``)."""

    def __init__(self, comm, stats, timeline):
        self.comm, self.stats, self.timeline = comm, stats, timeline

    def __enter__(self):
        self.token = meter.begin(self.comm, "all_reduce", self.stats) if self.comm.measurable else None
        self.start, self.begin = self.timeline.now(), time.perf_counter()

    def __exit__(self, *exc):
        if self.token is not None:
            meter.end(self.token)
        self.comm.spent(self.stats, self.begin, blocked=True)
        self.timeline.add("all_reduce", self.start, self.timeline.now())
