"""``python -m dlab gpu``: its CPU mode writes a folder that validates, every step's figures
against references written apart (the bytes a kernel saves, the model's parameter count, a
hand-made trace); its schema refuses what is missing, extra or ill-typed, naming it; a step that
raises, hangs or kills its process is recorded and the session goes on; the lessons never pass a
CPU folder or a published figure off as a GPU measurement."""
from __future__ import annotations

import gzip
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

from dlab.cli.main import main as cli
from dlab.models.gpt import GPTConfig
from dlab.plan import PlanLayout, models, plan, stacks
from dlab.theory.plan import cluster as clusters
from dlab.tools import check, device_profile
from dlab.tools.gpu import attention, calibration, gpt_step, lessons, schema, session, trace_summary


def _stub_check(quick, runs_dir, strategies):
    """``check.run_check``'s rows as its CPU run writes them (tests/test_check.py runs the real
    one): the step's own code is counting and writing them."""
    rows = [{"strategy": s, "ranks": 2, "backend": "gloo", "device": "cpu", "result": "ok",
             "loss_diff": 0.0, "param_diff": 0.0} for s in strategies]
    return "no GPU found: every check runs on Gloo/CPU", rows, [{"algorithm": "ring", "dlab": 1.0}]


@pytest.fixture(scope="module")
def cpu_session(tmp_path_factory):
    out = tmp_path_factory.mktemp("gpu") / "cpu-session"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(check, "run_check", _stub_check)
        folder, index = session.run_session(out, cpu=True, isolate=False, say=lambda *_: None)
    return folder, index


def _read(folder: Path, name: str) -> dict:
    return json.loads((folder / name).read_text())


def test_cpu_mode_runs_every_step_into_a_folder_that_validates(cpu_session):
    folder, index = cpu_session
    assert schema.problems(folder) == []
    assert [r["name"] for r in index["steps"]] == [s.name for s in session.STEPS]
    assert all(r["status"] == "ok" for r in index["steps"]), index["steps"]
    assert index["cpu_mode"] and not index["cuda"] and index["finished"]
    readme = (folder / "README.md").read_text()
    assert all(f"| {s.name} |" in readme for s in session.STEPS)
    clusters.load(folder / "profile.json")  # the profile --cluster reads
    assert _read(folder, "check.json")["passed"] == len(_read(folder, "check.json")["strategies_asked"])


def test_cpu_mode_says_why_each_cuda_only_figure_is_missing(cpu_session):
    folder, _ = cpu_session
    rows = _read(folder, "attention.json")["rows"]
    assert {r["backend"] for r in rows if r["why"]} == {"efficient", "cudnn"}
    mm = _read(folder, "matmul.json")["rows"]
    assert {r["dtype"] for r in mm if r["why"] == "needs CUDA"} == {"tf32", "fp8"}
    assert all(r["tflops"] > 0 for r in mm if r["dtype"] in ("fp32", "bf16"))
    alloc = _read(folder, "allocator.json")
    assert alloc["allocator_peak"] is None and "no CUDA" in alloc["why"]
    coll = _read(folder, "collectives.json")["rows"]
    assert all(r["why"] == "no CUDA" for r in coll if r["backend"] == "nccl")
    gloo = [r for r in coll if r["backend"] == "gloo"]
    assert gloo and all(r["ranks"] == 2 and r["seconds"] > 0 and r["busbw"] > 0 for r in gloo)


def test_attention_saves_what_each_kernel_keeps(cpu_session):
    """The flash kernel keeps q, k, v, its output (b a s h/a each) and a log-sum-exp a row; the
    math path keeps the s x s probabilities on top (4 bytes an element in fp32)."""
    folder, _ = cpu_session
    shape = attention.CPU
    b, a, h = shape["batch"], shape["heads"], shape["head_dim"]
    for r in _read(folder, "attention.json")["rows"]:
        s = r["seq"]
        if r["backend"] == "flash":
            assert r["saved_bytes"] == 4 * 4 * b * a * s * h + 4 * b * a * s, r
        if r["backend"] == "math":
            assert r["saved_bytes"] >= 4 * b * a * s * s + 2 * 4 * b * a * s * h, r


def test_the_allocator_step_counts_the_models_state_by_category(cpu_session):
    folder, _ = cpu_session
    cfg = GPTConfig(**gpt_step.CPU["model_options"])
    n = cfg.n_params()  # from the shapes
    # a block's two norms and six linears, a weight and a bias each; two embeddings, the final
    # norm (the head is tied): Adam keeps a 4-byte step counter per tensor beside its 8 n
    tensors = 16 * cfg.n_layer + 4
    phases = {p["phase"]: p["dlab"] for p in _read(folder, "allocator.json")["phases"]}
    assert list(phases) == ["forward", "backward", "optimizer"]
    assert all(p["parameters"] == 4 * n and p["optimizer"] == 8 * n + 4 * tensors for p in phases.values())
    assert phases["forward"]["gradients"] == 0 and phases["forward"]["activations"] > 0
    assert phases["backward"]["gradients"] == 4 * n and phases["backward"]["activations"] == 0


def test_the_profiled_step_is_summed_from_its_own_trace(cpu_session):
    folder, _ = cpu_session
    doc = _read(folder, "step_profile.json")
    with gzip.open(folder / "trace.json.gz") as f:
        events = json.load(f)["traceEvents"]
    again = trace_summary.summarize(events, "cpu_op")
    assert again["busy_s"] == doc["busy_s"] and again["gaps"] == doc["gaps"]
    assert [p["name"] for p in doc["phases"]] == ["forward", "backward", "optimizer"]
    assert [e["kind"] for e in doc["dlab_timeline"]] == ["forward", "backward", "optimizer"]
    assert 0 < doc["busy_s"] <= doc["step_s"] and doc["compute_s"] > 0 and doc["memory_s"] > 0
    assert doc["phases"][2]["compute_s"] == 0  # Adam does no matmul


def _x(name, cat, ts, dur, **args):
    return {"ph": "X", "name": name, "cat": cat, "ts": ts, "dur": dur, "tid": 1, "args": args}


def test_kernels_are_summed_by_the_phase_that_launched_them():
    """A hand-made GPU trace: the backward's matmul kernel runs after the backward's host span
    ended, yet is the backward's; the gaps are where no kernel ran (microseconds)."""
    events = [_x("dlab:step", "user_annotation", 0, 100), _x("dlab:forward", "user_annotation", 0, 10),
              _x("dlab:backward", "user_annotation", 10, 10),
              _x("cudaLaunchKernel", "cuda_runtime", 2, 1, correlation=1),
              _x("cudaLaunchKernel", "cuda_runtime", 5, 1, correlation=2),
              _x("cudaLaunchKernel", "cuda_runtime", 12, 1, correlation=3),
              _x("sm90_xmma_gemm_bf16", "kernel", 4, 20, correlation=1),
              _x("vectorized_elementwise_kernel", "kernel", 30, 10, correlation=2),
              _x("ampere_bf16_s16816gemm", "kernel", 60, 30, correlation=3)]
    got = trace_summary.summarize(events, "kernel")
    us = 1e-6
    assert got["step_s"] == pytest.approx(100 * us) and got["busy_s"] == pytest.approx(60 * us)
    assert got["gaps"] == 2 and got["largest_gap_s"] == pytest.approx(20 * us)
    assert got["compute_s"] == pytest.approx(50 * us) and got["memory_s"] == pytest.approx(10 * us)
    fwd, bwd = got["phases"]
    assert fwd["events"] == 2 and fwd["compute_s"] == pytest.approx(20 * us)
    assert fwd["memory_s"] == pytest.approx(10 * us)
    assert bwd["events"] == 1 and bwd["busy_s"] == pytest.approx(30 * us)
    assert bwd["host_s"] == pytest.approx(10 * us)


def _valid_folder(tmp_path: Path) -> Path:
    folder = tmp_path / "session"
    folder.mkdir()
    (folder / "env.json").write_text(json.dumps({
        "step": "env", "device": "cpu", "cuda": False, "versions": {"torch": "2"}, "python": "3",
        "platform": "linux", "cpu_cores": 2, "gpus": [], "features": {"cuda": False}, "nvidia_smi": None}))
    (folder / "index.json").write_text(json.dumps({
        "format": "dlab-gpu-session", "version": schema.VERSION, "device": "cpu", "cuda": False,
        "cpu_mode": True, "quick": False, "started": "2026-01-01T00:00:00", "finished": None,
        "command": "python -m dlab gpu --cpu", "budget_s": 300.0, "versions": {"torch": "2"},
        "steps": [{"name": "env", "status": "ok", "seconds": 0.1, "budget_s": 60.0,
                   "files": ["env.json"], "summary": "", "why": None}]}))
    return folder


def test_a_one_gpu_profile_takes_its_presets_links_and_drops_the_placeholders_warning(tmp_path):
    """One GPU measures no link: the profile borrows its generation's preset links and says so
    in ``measured``; the calibration's warning that the links are a 1 GB/s placeholder no longer
    holds and goes (the first H200 profile kept it beside the preset's links), other flags stay."""
    other = "all_gather: its times do not grow with its bytes"
    doc = {"generation": "H100", "measured": {"device": "NVIDIA H100 80GB HBM3"}, "gpus_per_node": 1,
           "links": {"intra": {"latency": 1e-5, "busbw": 1e9}, "inter": {"latency": 1e-5, "busbw": 1e9}},
           "flags": ["no collective measured (--ranks 1): the links are a placeholder of 1 GB/s", other]}
    got = calibration.borrow_links(doc, tmp_path / "profile.json")
    preset = clusters.PRESETS["h100-sxm"]
    assert got["links"]["intra"]["busbw"] == preset.intra.bandwidth and got["gpus_per_node"] == 8
    assert "h100-sxm preset's" in got["measured"]["links"] and got["flags"] == [other]
    assert json.loads((tmp_path / "profile.json").read_text())["flags"] == [other]


def test_a_profile_is_set_beside_its_own_gpus_preset():
    """An H200 runs an H100's kernels (its ``generation``) with its own memory: the committed
    H200 profile's 3.7 TB/s is 77 % of the H200's 4.8 TB/s, not 111 % of the H100's 3.35."""
    doc = json.loads((session.SESSIONS / "nvidia-h200-2026-11-29" / "profile.json").read_text())
    assert device_profile.preset_for(doc["measured"]["device"]) == "h200"
    assert device_profile.preset_for("NVIDIA H100 80GB HBM3") == "h100-sxm"
    assert device_profile.preset_for("cpu-x86_64") is None
    line = device_profile.describe(doc).splitlines()[-1]
    assert line.startswith("  against the H200 SXM") and "memory 77% of the data sheet" in line, line


@pytest.mark.parametrize("change, says", [
    (lambda d: d.pop("cpu_cores"), "env.cpu_cores: missing"),
    (lambda d: d.update(colour="blue"), "env.colour: not a field of this file"),
    (lambda d: d.update(cpu_cores="two"), "env.cpu_cores: expected integer, got str"),
    (lambda d: d["gpus"].append({"index": 0}), "env.gpus[0].name: missing"),
    (lambda d: d.update(cuda=1), "env.cuda: expected boolean"),
])
def test_the_schema_refuses_a_file_naming_the_field(tmp_path, change, says):
    folder = _valid_folder(tmp_path)
    assert schema.problems(folder) == []
    doc = json.loads((folder / "env.json").read_text())
    change(doc)
    (folder / "env.json").write_text(json.dumps(doc))
    found = schema.problems(folder)
    assert any(says in p for p in found), found
    with pytest.raises(schema.InvalidSession, match="not a valid GPU session folder"):
        schema.validate(folder)


def test_the_schema_refuses_a_missing_or_stray_file_and_an_unexplained_failure(tmp_path):
    folder = _valid_folder(tmp_path)
    (folder / "stray.bin").write_bytes(b"x")
    index = json.loads((folder / "index.json").read_text())
    index["steps"].append({"name": "matmul", "status": "failed", "seconds": 1.0, "budget_s": 90.0,
                           "files": ["matmul.json"], "summary": "", "why": None})
    (folder / "index.json").write_text(json.dumps(index))
    found = schema.problems(folder)
    assert any("stray.bin: in the folder but no step" in p for p in found), found
    assert any("matmul.json (matmul) is not in the folder" in p for p in found), found
    assert any("matmul is failed and says not why" in p for p in found), found


FIXTURE = '''
import os, time
from pathlib import Path

def raises(ctx):
    raise RuntimeError("boom")

def crashes(ctx):
    os._exit(3)

def hangs(ctx):
    Path(ctx.out, "hang.pid").write_text(str(os.getpid()))
    time.sleep(600)

def fine(ctx):
    return {"said": "fine"}, "fine", []
'''


def _fixture_steps(tmp_path, monkeypatch, *names):
    (tmp_path / "gpu_fixture_steps.py").write_text(textwrap.dedent(FIXTURE))
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))
    budgets = {"hangs": 3.0}
    return tuple(session.Step(n, f"gpu_fixture_steps:{n}", budgets.get(n, 60.0), n) for n in names)


def test_a_failing_crashing_or_hanging_step_is_recorded_and_the_session_goes_on(tmp_path, monkeypatch):
    steps = _fixture_steps(tmp_path, monkeypatch, "raises", "crashes", "hangs", "fine")
    out = tmp_path / "s"
    _, index = session.run_session(out, cpu=True, steps=steps, say=lambda *_: None)
    rows = {r["name"]: r for r in index["steps"]}
    assert rows["raises"]["status"] == "failed" and "RuntimeError: boom" in rows["raises"]["why"]
    assert rows["crashes"]["status"] == "failed" and "ended (3)" in rows["crashes"]["why"]
    assert rows["hangs"]["status"] == "timeout" and rows["hangs"]["seconds"] >= 3.0
    assert rows["fine"]["status"] == "ok" and json.loads((out / "fine.json").read_text())["said"] == "fine"
    assert not psutil.pid_exists(int((out / "hang.pid").read_text()))  # killed, not left behind
    assert "Traceback" in (out / "logs" / "raises.log").read_text()
    # a rerun of one step keeps the others' rows
    _, again = session.run_session(out, cpu=True, steps=steps, only=["fine"], say=lambda *_: None)
    assert [r["name"] for r in again["steps"]] == ["raises", "crashes", "hangs", "fine"]
    assert {r["name"]: r["status"] for r in again["steps"]}["hangs"] == "timeout"


def test_no_step_starts_once_the_sessions_budget_is_spent(tmp_path, monkeypatch):
    steps = _fixture_steps(tmp_path, monkeypatch, "hangs", "fine")
    # the hang takes at least its 3 s budget, leaving less than a step's minimum
    _, index = session.run_session(tmp_path / "s", cpu=True, steps=steps,
                                   budget_s=session.MIN_STEP_S + 2.0, say=lambda *_: None)
    fine = index["steps"][1]
    assert fine["status"] == "skipped" and "budget" in fine["why"] and not fine["files"]


def test_the_command_refuses_an_unknown_step_before_any_work(capsys):
    assert cli(["gpu", "--steps", "matmul,nope"]) == 2
    assert "--steps 'matmul,nope': name steps from env, calibrate" in capsys.readouterr().err


def test_the_lessons_name_their_source_and_never_take_a_cpu_folder_for_a_gpu(cpu_session, tmp_path):
    folder, _ = cpu_session
    root = tmp_path / "gpu"
    assert lessons.source(root, live=False).kind == "published"
    assert "No GPU of this project has measured this yet" in lessons.source(root, live=False).label
    shutil.copytree(folder, root / "cpu-x86_64-2026-01-01")  # a CPU-mode folder is no reference
    assert lessons.source(root, live=False).kind == "published" and lessons.latest_profile(root) is None
    gpu = root / "nvidia-h100-80gb-hbm3-2026-01-02"
    shutil.copytree(folder, gpu)
    index = json.loads((gpu / "index.json").read_text())
    index.update(cuda=True, device="NVIDIA H100 80GB HBM3", started="2026-01-02T10:00:00",
                 versions={**index["versions"], "cuda": "12.8", "driver": "570.1"})
    (gpu / "index.json").write_text(json.dumps(index))
    src = lessons.source(root, live=False)
    assert src.kind == "reference" and src.folder == gpu
    for said in ("not a live measurement", "NVIDIA H100 80GB HBM3", "2026-01-02", "CUDA 12.8",
                 "driver 570.1"):
        assert said in src.label, src.label
    assert src.doc("matmul") == json.loads((gpu / "matmul.json").read_text())
    assert lessons.latest_profile(root) == gpu / "profile.json"


@pytest.mark.slow
def test_the_command_in_cpu_mode_end_to_end(tmp_path):
    """The CLI as a lent machine runs it: every step in its own process, check for real."""
    out = tmp_path / "s"
    proc = subprocess.run([sys.executable, "-m", "dlab", "gpu", "--cpu", "--out", str(out)],
                          capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"wrote {out}: valid" in proc.stdout
    assert schema.problems(out) == []
    assert _read(out, "check.json")["passed"] >= 1


def _markdown(name: str) -> str:
    nb = json.loads((Path(__file__).parents[1] / "notebooks" / name).read_text())
    return "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")


def test_the_notebooks_prose_quotes_the_newest_session_as_measured():
    """Notebooks 15 and 11 read the H200 session's figures in their prose. Each quoted figure is
    recomputed here from the session's files (and, for the planner's step, from the planner), so
    a figure typed wrong, or a newer session committed without the prose following it, fails."""
    folder = lessons.sessions()[-1]
    assert folder.name == "nvidia-h200-2026-11-29", (
        f"the newest session is {folder.name}: notebooks 15 and 11 quote nvidia-h200-2026-11-29's "
        f"figures in their prose; read the new one there and update this test")
    doc = {name: json.loads((folder / f"{name}.json").read_text())
           for name in ("step_profile", "attention", "matmul", "allocator", "collectives")}
    step = doc["step_profile"]
    att = {(r["backend"], r["seq"]): r for r in doc["attention"]["rows"]}
    bf16 = max(r["tflops"] for r in doc["matmul"]["rows"] if r.get("dtype") == "bf16" and r.get("tflops"))
    alloc = doc["allocator"]
    gloo = next(r for r in doc["collectives"]["rows"] if r["backend"] == "gloo" and r["op"] == "all_reduce"
                and r["bytes"] == 1 << 25)
    fwd = next(p for p in step["phases"] if p["name"] == "forward")
    b, h, d = doc["attention"]["batch"], doc["attention"]["heads"], doc["attention"]["head_dim"]
    cudnn_8k = att["cudnn", 8192]
    quoted = {
        f"{step['busy_s'] * 1e3:.1f} ms of a {step['step_s'] * 1e3:.1f} ms step",
        f"({step['busy_s'] / step['step_s']:.0%}".replace("%", " %"),
        f"{fwd['host_s'] * 1e3:.1f} ms for {fwd['events']} kernels that ran {fwd['busy_s'] * 1e3:.1f} ms",
        f"reaches {att['cudnn', 16384]['tflops']:.0f} TFLOP/s at s = 16384",
        f"FlashAttention-2 (`flash`) {att['flash', 16384]['tflops']:.0f}",
        f"bf16 reaches {bf16:.0f} TFLOP/s",
        f"allocator peaked at {alloc['allocator_peak'] / 2**20:,.1f} MiB allocated",
        f"dlab counted {alloc['dlab_peak'] / 2**20:,.1f} MiB",
        f"takes {gloo['seconds'] * 1e3:.1f} ms, {gloo['busbw'] / 1e9:.1f} GB/s",
    }
    text15 = " ".join(_markdown("15_gpu.ipynb").split())
    assert [q for q in quoted if q not in text15] == []
    fwd_rate = attention.causal_flops(b, h, 8192, d) / cudnn_8k["forward_s"] / 1e12
    bwd_rate = 2.5 * attention.causal_flops(b, h, 8192, d) / cudnn_8k["backward_s"] / 1e12
    profile = json.loads((folder / "profile.json").read_text())
    assert profile["kernels"]["attention_table"][-1][1:] == pytest.approx([fwd_rate * 1e12, bwd_rate * 1e12])
    llama, stack = models.preset("llama3-70b"), stacks.preset("megatron-core-2024")
    lay = PlanLayout(dp=32, tp=8, pp=4, zero=1, sequence_parallel=True, schedule="interleaved",
                     virtual_stages=2, micro_batch=1)
    preset = plan(llama, clusters.preset("h100-sxm"), lay, 1024, 8192, stack).step_s
    measured = plan(llama, clusters.load(folder / "profile.json"), lay, 1024, 8192, stack).step_s
    text11 = " ".join(_markdown("11_planning_at_scale.ipynb").split())
    more = f"{measured / preset - 1:.0%}".replace("%", " %")
    said = f"the step is {measured:.2f} s instead of {preset:.2f} (+{more}"
    assert said in text11, said
