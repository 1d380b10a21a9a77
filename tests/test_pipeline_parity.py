"""Every pipeline schedule trains exactly like ``single``: the same losses and final parameters
at 2 and 4 stages and as 2 pipelines x 2 data-parallel replicas (fp32 on Gloo, to 1e-5), with
every action on the timeline; GPipe's and 1F1B's activation peaks in the ratio the formula
gives; bad configs refused before any process starts."""
from __future__ import annotations

import pytest
from helpers import assert_same_training, losses

import dlab
from dlab.config import ConfigError
from dlab.estimate import pipeline as est
from dlab.parallel.pipeline import schedules
from dlab.parallel.pipeline.simulate import bubble

# 8 blocks, so 4 ranks x 2 virtual stages each still get a block per stage.
PIPE_GPT = {"model": "gpt", "batch_size": 8, "steps": 3,
            "model_options": {"n_layer": 8, "d_model": 32, "n_head": 2, "seq_len": 32}}
NAMES = ["naive", "gpipe", "1f1b", "interleaved", "zb-h1", "zbv"]


@pytest.fixture(scope="module")
def pipeline_runs(tmp_path_factory):
    """Runs shared by the tests of this module, each launched once: (schedule, world, dp)."""
    cache: dict[tuple, dlab.Run] = {}
    root = tmp_path_factory.mktemp("pipeline")

    def get(name: str, world: int, dp: int = 1) -> dlab.Run:
        if (name, world, dp) not in cache:
            options = {"dp": dp} if dp > 1 else {}
            cache[(name, world, dp)] = dlab.launch(f"pipeline-{name}", world, runs_dir=root,
                                                   wait=True, save_final=True, options=options,
                                                   **PIPE_GPT)
        return cache[(name, world, dp)]

    return get


@pytest.mark.parametrize("world", [2, 4])
@pytest.mark.parametrize("name", NAMES)
def test_schedule_matches_single(name, world, pipeline_runs, reference):
    run = pipeline_runs(name, world)
    assert_same_training(run, reference(**PIPE_GPT))
    assert all(losses(run, r) == losses(run, 0) for r in range(world))
    # every action of the schedule is on the timeline, tagged with its stage and micro-batch
    m = 1 if name == "naive" else 4
    sched = schedules.build(name, world, m, 2 if name in ("interleaved", "zbv") else 1)
    for r in range(world):
        events = [e for e in run.timeline(r) if e["step"] == 0 and "stage" in e]
        got = [(e["kind"], e["stage"], e["mb"]) for e in events]
        assert got == [(a.kind, a.stage, a.mb) for a in sched.actions[r]]
    measured = bubble([e for e in run.timeline() if "stage" in e])
    assert 0 <= measured < 1


@pytest.mark.parametrize("name", NAMES)
def test_pipeline_times_data_parallel_matches_single(name, pipeline_runs, reference):
    run = pipeline_runs(name, 4, dp=2)
    assert_same_training(run, reference(**PIPE_GPT))
    assert all(losses(run, r) == losses(run, 0) for r in range(4))
    # the data-parallel gradient all-reduce moved one copy of each rank's gradients per step
    for r in range(4):
        m = run.metrics(r)[-1]
        assert m["comm_by_op"]["all_reduce"]["calls"] >= 1


@pytest.mark.parametrize("name,k", [("zbv", 0), ("interleaved", 3)])
def test_receives_posted_at_the_action_or_ahead_train_like_single(name, k, runs_dir, reference):
    """``recv_ahead`` moves only when a receive is posted, never what it receives: the naive
    k=0 and a deep k=3 train exactly like ``single``, and each rank counts its k posted
    receive buffers (fp32 boundary activations, batch/m x seq x d) as communication buffers."""
    run = dlab.launch(f"pipeline-{name}", 4, runs_dir=runs_dir, wait=True, save_final=True,
                      options={"recv_ahead": k}, **PIPE_GPT)
    assert_same_training(run, reference(**PIPE_GPT))
    mo = PIPE_GPT["model_options"]
    boundary = PIPE_GPT["batch_size"] // 4 * mo["seq_len"] * mo["d_model"] * 4
    for r in range(4):
        assert run.metrics(r)[-1]["memory"]["comm_buffers"] == k * boundary


def test_stages_balanced_by_measured_time_train_like_single(runs_dir, reference):
    """``balance="time"``: rank 0 times every block and broadcasts the split; whatever split the
    timings give, the training is the same."""
    run = dlab.launch("pipeline-1f1b", 2, runs_dir=runs_dir, wait=True, save_final=True,
                      options={"balance": "time"}, **PIPE_GPT)
    assert_same_training(run, reference(**PIPE_GPT))
    stages = [{e["stage"] for e in run.timeline(r) if "stage" in e} for r in range(2)]
    assert stages == [{0}, {1}]


def test_activation_peaks_follow_in_flight_counts(pipeline_runs):
    """1F1B holds min(p-r, m) micro-batches where GPipe holds m: the measured peaks (storage
    counted) stand in exactly that ratio, rank by rank."""
    p, m = 4, 4
    gpipe, one_f = pipeline_runs("gpipe", p), pipeline_runs("1f1b", p)
    for r in range(p):
        g = gpipe.metrics(r)[-1]["memory"]["activations"]
        o = one_f.metrics(r)[-1]["memory"]["activations"]
        assert g > 0
        assert o / g == pytest.approx(est.in_flight("1f1b", p, m, r) / est.in_flight("gpipe", p, m, r))


def test_tied_embedding_is_held_by_first_and_last_stage(pipeline_runs):
    run = pipeline_runs("1f1b", 2)
    # both stage ranks count the tied matrix among their parameters: 256 x 32 fp32 each
    tied = 256 * 32 * 4
    for r in range(2):
        assert run.metrics(r)[-1]["memory"]["parameters"] > tied


@pytest.mark.parametrize("options, world, match", [
    ({"dp": 3}, 4, "dp=3 does not divide"),
    ({"microbatches": 3}, 2, "multiple of 3"),
    ({"microbatches": 2}, 4, "multiple of 4"),  # interleaved needs m % p == 0
    ({"virtual_stages": 4}, 4, "n_layer >= 16"),
    ({"micro_batches": 4}, 2, "unknown option"),
    ({"recv_ahead": -1}, 2, "recv_ahead must be a whole number >= 0"),
])
def test_bad_configs_are_refused_before_start(options, world, match, runs_dir):
    name = "pipeline-interleaved" if "virtual_stages" in options or options.get("microbatches") == 2 \
        else "pipeline-1f1b"
    with pytest.raises(ConfigError, match=match):
        dlab.launch(name, world, runs_dir=runs_dir, options=options, **PIPE_GPT)
    with pytest.raises(ConfigError, match="m=1"):
        dlab.launch("pipeline-naive", 2, runs_dir=runs_dir, options={"microbatches": 2}, **PIPE_GPT)
    assert not runs_dir.exists() or not any(runs_dir.iterdir())


def test_receives_posted_ahead_are_refused_on_nccl():
    """A posted NCCL receive holds the stream the next send to that peer needs: two ranks that
    each post a receive first would wait on each other, so NCCL defaults to recv_ahead=0 and
    refuses more; Gloo defaults to one per receive stream, 2 x the stages per rank."""
    from dlab.config import RunConfig
    from dlab.parallel import get

    cls = get("pipeline-1f1b")
    config = lambda **kw: RunConfig(strategy="pipeline-1f1b", world_size=2, **kw, **PIPE_GPT)  # noqa: E731
    assert cls.recv_ahead(config(backend="gloo")) == 2
    assert get("pipeline-interleaved").recv_ahead(config(backend="gloo")) == 4
    assert get("pipeline-zbv").recv_ahead(config(backend="gloo")) == 4
    assert cls.recv_ahead(config(backend="nccl")) == 0
    assert not any("recv_ahead" in p for p in cls.problems(config(backend="nccl")))
    refused = cls.problems(config(backend="nccl", options={"recv_ahead": 2}))
    assert any("recv_ahead=2 can deadlock on NCCL" in p for p in refused), refused
