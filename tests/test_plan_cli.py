"""``python -m dlab plan``: it ranks, it reads a model config and a cluster profile, it refuses
nonsense before any work saying what to change, and ``plan calibrate`` measures this CPU into a
profile the planner then reads."""
from __future__ import annotations

import json

import pytest

from dlab.cli.main import main
from dlab.plan import PlanLayout, clusters, models, plan
from dlab.theory.plan import kernels
from dlab.theory.plan.collectives import OPS


def test_cli_ranks_with_ranges_and_names_its_stack(capsys):
    assert main(["plan", "--model", "llama3-8b", "--gpus", "16", "--batch", "64", "--seq", "2048",
                 "--top", "3", "--stack", "torchtitan-fsdp2"]) == 0
    out = capsys.readouterr().out
    assert "layouts in" in out and "MFU" in out and "step range s" in out
    assert out.startswith("stack torchtitan-fsdp2: eager element-wise ops")


def test_cli_breaks_one_layout_down(capsys):
    assert main(["plan", "--model", "llama3-8b", "--layout", "tp=8,sequence_parallel=on,zero=1",
                 "--gpus", "16", "--batch", "16"]) == 0
    out = capsys.readouterr().out
    assert "dp2 x tp8 zero1 sp" in out and "(range " in out and "sent per step" in out


@pytest.mark.parametrize("argv,says", [
    (["--batch", "0"], "--batch 0: give a whole number >= 1"),
    (["--seq", "-8"], "--seq -8: give a whole number >= 1"),
    (["--top", "0"], "--top 0: give a whole number >= 1"),
    (["--gpus", "0"], "--gpus 0: give the number of GPUs"),
    (["--gpus", "-64"], "--gpus -64: give the number of GPUs"),
    (["--layout", "tp=0"], "--layout tp=0: tp is a degree or a count; give a whole number >= 1"),
    (["--layout", "dp=-2"], "--layout dp=-2: dp is a degree"),
    (["--layout", "micro_batch=0"], "--layout micro_batch=0: micro_batch is a degree or a count"),
    (["--layout", "zero=-1"], "--layout zero=-1: give 0 or more"),
    (["--layout", "tp=8,pq=2"], "key one of"),
    (["--layout", "tp=8,pp=4", "--gpus", "48"], "does not divide --gpus 48"),
    (["--layout", "tp=8,sequence_parallel=maybe"], "write sequence_parallel=1 or sequence_parallel=0"),
    (["--model", "gpt5"], "unknown model preset 'gpt5'"),
    (["--cluster", "tpu-v9"], "unknown cluster preset 'tpu-v9'"),
    (["--stack", "jax"], "--stack 'jax': choose one of"),
    (["--cluster", "missing.json", "--gpus", "8"], "cannot read the cluster profile missing.json"),
    (["calibrate", "--out", "no/such/folder/p.json"], "--out no/such/folder/p.json: give a file in a folder"),
    (["calibrate", "--ranks", "0"], "--ranks 0: give a whole number >= 1"),
])
def test_cli_refuses_nonsense_before_any_work_saying_what_to_change(argv, says, capsys):
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err
    assert says in err and "Traceback" not in err


def test_cli_reads_a_model_config(tmp_path, capsys):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"hidden_size": 2048, "num_hidden_layers": 16, "num_attention_heads": 16,
                               "intermediate_size": 8192, "vocab_size": 32000, "hidden_act": "silu"}))
    assert main(["plan", "--model", str(cfg), "--layout", "zero=3", "--gpus", "8", "--batch", "8",
                 "--seq", "2048"]) == 0
    assert "dp8 zero3" in capsys.readouterr().out


def test_calibrate_on_the_cpu_writes_a_profile_the_planner_reads(tmp_path, capsys, monkeypatch):
    """``plan calibrate --quick`` measures one thread's matmuls, attention, memory and two ranks'
    collectives (about 20 s here, mostly torchrun's start); ``--cluster`` reads the profile, and
    the planner prices a matmul at the rate the profile measured for that shape."""
    monkeypatch.chdir(tmp_path)
    out = tmp_path / "profile.json"
    assert main(["plan", "calibrate", "--quick", "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert f"wrote {out}" in said
    cluster = clusters.preset(str(out))
    m, n, k, rate = cluster.kernels.matmul_table[-1]
    assert kernels.matmul_time(cluster, m, n, k, elt=4) == pytest.approx(
        max(2 * m * n * k / rate, 4 * (m * k + k * n + m * n) / cluster.hbm) + cluster.kernels.launch)
    # every op is measured, or (its timings fitting no link, as on a busy machine) flagged and
    # left out, and then said by the calibration and by every prediction from the profile
    measured = {op for op, *_ in cluster.ops}
    flagged = {op for op in OPS if any(note.startswith(f"{op}: ") for note in cluster.notes)}
    assert measured | flagged == set(OPS) and not measured & flagged
    assert all(f"{op} (intra)" in said for op in measured)
    assert all(f"WARNING {op}: " in said for op in flagged)
    assert all(bw <= cluster.hbm for *_, bw in cluster.ops)  # no link moves bytes faster than a copy
    spec = models.preset("llama3-8b")
    p = plan(spec, cluster, PlanLayout(dp=2, zero=1), 2, 256)
    assert p.step_s > 0 and p.time["data_comm"] > 0
    assert main(["plan", "--model", "llama3-8b", "--cluster", str(out), "--layout", "dp=2,zero=1",
                 "--batch", "2", "--seq", "256"]) == 0
    assert "dp2 zero1 mb1" in capsys.readouterr().out


def test_cli_prints_the_published_rows_beside_their_predictions(capsys, tmp_path):
    from dlab.plan import published
    out_file = tmp_path / "published.json"
    assert main(["plan", "--published", "--json", str(out_file)]) == 0
    out = capsys.readouterr().out
    rows = json.loads(out_file.read_text())
    assert f"all: mean absolute error {published.mean_abs_error(rows):.1%}" in out
    assert "blind: MAE" in out and "(built on)" in out  # each source's first score beside its current
    assert len(rows) == len(published.ROWS)
    assert all(r["model"][:15] in out for r in rows)
