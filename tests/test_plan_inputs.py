"""Every file a user hands the planner is checked field by field before any work: a model's
config.json (``--model``), a cluster profile (``--cluster``), and what ``plan calibrate``
measures before it writes one. A bad field is one line that names the file, the field and what
to change, and exit status 2, never a traceback or a number that cannot be (a negative
communication time, an MFU of nan%)."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest

from dlab.cli.main import main
from dlab.plan import clusters
from dlab.runtime.benchmark import calls_per_sample
from dlab.theory.comm import AlphaBeta
from dlab.theory.plan.collectives import OPS, bus_bytes, steps
from dlab.theory.plan.kernels import Kernels
from dlab.tools import device_profile

LLAMA = {"architectures": ["LlamaForCausalLM"], "hidden_act": "silu", "hidden_size": 2048,
         "intermediate_size": 8192, "num_attention_heads": 16, "num_hidden_layers": 16,
         "num_key_value_heads": 4, "rms_norm_eps": 1e-05, "vocab_size": 32000}


def _refused(argv, capsys) -> str:
    assert main(["plan", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err and "\n" not in err, err
    return err


@pytest.mark.parametrize("change,says", [
    ({"hidden_size": 2050}, "hidden_size=2050 is not a multiple of num_attention_heads=16"),
    ({"num_key_value_heads": 5}, "num_key_value_heads=5 does not divide num_attention_heads=16"),
    ({"num_local_experts": 4, "num_experts_per_tok": 6},
     "num_experts_per_tok=6 is more than num_local_experts=4"),
    ({"hidden_size": math.inf}, "hidden_size=Infinity is not a whole number; give the hidden size"),
    ({"hidden_size": 10 ** 400}, "hidden_size=1" + "0" * 400 + " must be between 1 and 1e+09"),
    ({"hidden_size": 2048.0}, "hidden_size=2048.0 is not a whole number"),
    ({"num_hidden_layers": True}, "num_hidden_layers=true is not a whole number; give the layers"),
    ({"vocab_size": "32000"}, 'vocab_size="32000" is not a whole number'),
    ({"intermediate_size": 0}, "intermediate_size=0 must be between 1 and"),
    ({"num_attention_heads": -16}, "num_attention_heads=-16 must be between 1 and"),
    ({"tie_word_embeddings": "false"}, 'tie_word_embeddings="false" must be true or false'),
    ({"hidden_act": None, "activation_function": 3}, "hidden_act=3 must be an activation"),
])
@pytest.mark.parametrize("layout", [[], ["--layout", "dp=8"]], ids=["search", "layout"])
def test_a_model_config_the_planner_cannot_take_is_one_line_naming_the_field(change, says, layout,
                                                                              tmp_path, capsys):
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({k: v for k, v in {**LLAMA, **change}.items() if v is not None}))
    err = _refused(["--model", str(cfg), "--gpus", "8", "--batch", "8", "--seq", "2048", *layout],
                   capsys)
    assert f"{cfg}: " in err and says in err, err


def test_a_valid_config_with_every_checked_field_plans(tmp_path, capsys):
    cfg = tmp_path / "cfg.json"
    cfg.write_text(json.dumps({**LLAMA, "num_local_experts": 4, "num_experts_per_tok": 2,
                               "tie_word_embeddings": True}))
    assert main(["plan", "--model", str(cfg), "--layout", "dp=8,ep=2", "--gpus", "8", "--batch", "8",
                 "--seq", "2048"]) == 0
    assert "dp8 ep2" in capsys.readouterr().out


PROFILE = clusters.Cluster(
    "a profile", 1e11, 16e9, 2e10, 2, AlphaBeta.link(4e9, 3e-5), AlphaBeta.link(1e9, 1e-4), 1.0, 1.0,
    reserved=0.0, kernels=Kernels(matmul=1.0, sms=0, tile=(1, 1, 1), best=(256, 256, 256), fill=0.0,
                                  attention=(("fa2", 0.3, 0.2), ("fa3", 0.3, 0.2)), hbm=1.0,
                                  launch=5e-6, matmul_table=((256, 256, 256, 1e11),),
                                  attention_table=((512, 3e10, 2e10),)),
    ops=tuple((op, "intra", 2e-5, 5e9) for op in OPS), spread=(("matmul", 0.95, 1.05),),
    source="python -m dlab plan calibrate")


def _edit(doc: dict, field: str, value) -> dict:
    out = json.loads(json.dumps(doc))
    node = out
    *parents, last = field.split(".")
    for key in parents:
        node = node[int(key)] if isinstance(node, list) else node[key]
    node[int(last) if isinstance(node, list) else last] = value
    return out


@pytest.mark.parametrize("field,value,says", [
    ("peak_flops", 0, "peak_flops=0 must be above 0"),
    ("peak_flops", -1e12, "peak_flops=-1000000000000.0 must be above 0"),
    ("peak_flops", math.nan, "peak_flops=nan must be finite"),
    ("peak_flops", "1e12", "peak_flops='1e12' is not a number"),
    ("memory_bandwidth", 0, "memory_bandwidth=0 must be above 0"),
    ("memory_bytes", -8e9, "memory_bytes=-8000000000.0 must be above 0"),
    ("reserved_bytes", 32e9, "reserved_bytes=32000000000.0 must be less than memory_bytes"),
    ("gpus_per_node", True, "gpus_per_node=True is not a whole number"),
    ("gpus_per_node", 0, "gpus_per_node=0 must be from 1 to 1e+09"),
    ("peak_flops", 10 ** 400, "peak_flops=1" + "0" * 400 + " must be finite"),
    ("links.intra.busbw", 0, "links.intra.busbw=0 must be above 0"),
    ("links.inter.busbw", -5e9, "links.inter.busbw=-5000000000.0 must be above 0"),
    ("links.intra.latency", -1e-6, "links.intra.latency=-1e-06 must be 0 or more"),
    ("ops.0.3", 0.0, "ops[0] (all_reduce) busbw=0.0 must be above 0"),
    ("ops.1.3", -3e9, "ops[1] (all_gather) busbw=-3000000000.0 must be above 0"),
    ("ops.2.0", "broadcast", "ops[2]: 'broadcast' at 'intra': an op is one of"),
    ("kernels.matmul_table.0.3", 0, "kernels.matmul_table[0][3] (FLOP/s)=0 must be above 0"),
    ("kernels.matmul_table.0", [256, 256, 1e11], "kernels.matmul_table must be a list of rows of 4"),
    ("kernels.attention_table.0.0", 0.5, "kernels.attention_table[0][0] (keys)=0.5 is not a whole"),
    ("kernels.attention_table.0.2", math.inf, "(backward FLOP/s)=inf must be finite"),
    ("kernels.launch", -1e-6, "kernels.launch=-1e-06 must be 0 or more"),
    ("kernels.hbm", 0, "kernels.hbm=0 must be above 0"),
    ("kernels.tile", [1, 1], "kernels.tile=[1, 1] must be three whole numbers"),
    ("spread.0", ["matmul", 1.05, 0.95], "spread[0] (matmul): low 1.05 is above high 0.95"),
    ("spread.0", ["flux", 0.9, 1.1], "spread[0]: 'flux' is no constant"),
    ("flags", "busy", "flags must be a list of strings"),
])
def test_a_cluster_profile_with_a_field_that_cannot_be_is_one_line_naming_it(field, value, says,
                                                                             tmp_path, capsys):
    """Before this was checked: a zero bandwidth or peak was a ZeroDivisionError, a negative
    bandwidth -377 s of communication, a negative or NaN peak an MFU of -3.7 % or nan%."""
    doc = clusters.dump(PROFILE, tmp_path / "good.json")
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(_edit(doc, field, value)))
    with pytest.raises(ValueError, match="correct the field"):
        clusters.load(bad)
    err = _refused(["--model", "llama3-8b", "--cluster", str(bad), "--layout", "dp=2", "--batch", "2",
                    "--seq", "256"], capsys)
    assert f"{bad}: " in err and says in err, err
    assert main(["plan", "--model", "llama3-8b", "--cluster", str(tmp_path / "good.json"), "--layout",
                 "dp=2", "--batch", "2", "--seq", "256"]) == 0


# --- what calibration writes -------------------------------------------------------------------
def test_a_link_fit_recovers_a_link_and_flags_times_that_do_not_grow_with_the_bytes():
    """Times made from a 2 us step and 10 GB/s are fitted back exactly; times that shrink as the
    messages grow (noise, as a busy machine gives) fit no link: their bandwidth comes out
    infinite, above the memory's, and is flagged."""
    sizes = (1 << 12, 1 << 16, 1 << 20)
    n = 4
    made = [(s, steps("all_reduce", n) * 2e-6 + bus_bytes("all_reduce", s, n) / 1e10) for s in sizes]
    latency, busbw = device_profile.fit_link("all_reduce", n, made)
    assert (latency, busbw) == (pytest.approx(2e-6, rel=1e-6), pytest.approx(1e10, rel=1e-6))
    assert device_profile.unphysical("all_reduce", n, made, latency, busbw, ceiling=2e10) is None
    # the same link is not physical on a machine that copies memory at 5 GB/s
    assert "above the 5 GB/s" in device_profile.unphysical("all_reduce", n, made, latency, busbw, 5e9)
    noise = [(1 << 12, 3e-4), (1 << 16, 2e-4), (1 << 20, 1e-4)]
    latency, busbw = device_profile.fit_link("all_reduce", n, noise)
    assert busbw == math.inf and latency >= 0
    assert "do not grow with its bytes" in device_profile.unphysical("all_reduce", n, noise, latency,
                                                                       busbw, 2e10)


def test_a_gpu_calibration_times_work_that_fills_the_device_without_the_hosts_round_trip():
    """The first H200 session measured attention at one sequence of 4 heads of 64 (a few dozen
    tiles for 132 multiprocessors) and every kernel between two synchronisations (the host's
    20 us round trip in each rate, then the planner's launch on top): 3x below the same GPU's
    attention step. On a GPU the attention now has tiles for many waves at every length, and
    a short kernel is timed queued behind others, as a step runs it; the CPU grid is as it was."""
    sms, tile = 132, 128  # an H100's or H200's multiprocessors; FlashAttention's query tile
    for seq in device_profile.FULL["seqs"]:
        batch, heads, width = device_profile.attention_shape(seq, device_profile.FULL)
        assert batch * heads * math.ceil(seq / tile) >= 4 * sms and width == 128, seq
    assert device_profile.attention_shape(512, device_profile.CPU_GRID) == (1, 4, 64)
    assert device_profile.attention_shape(128, device_profile.QUICK) == (1, 4, 64)
    assert calls_per_sample(20e-6, cuda=True) >= 50  # a launch-sized call
    assert calls_per_sample(5e-3, cuda=True) == 1  # a long one is its own sample
    assert calls_per_sample(20e-6, cuda=False) == 1


def test_calibration_leaves_out_and_flags_a_collective_whose_fit_is_not_physical(monkeypatch, tmp_path):
    """The ranks' timings stand in for a run: all_reduce's shrink with the bytes (as measured on
    a busy machine, where ``--quick`` once wrote 1e6 GB/s), the others grow as a link's. The
    profile keeps the four that fit, flags all_reduce, and the planner says so."""
    sizes = (1 << 12, 1 << 16, 1 << 20)

    def timings(fn, ranks, *args, **kwargs):
        link = {(op, s): steps(op, 2) * 5e-6 + bus_bytes(op, s, 2) / 2e9 for op in OPS for s in sizes}
        link.update({("all_reduce", s): t for s, t in zip(sizes, (3e-4, 2e-4, 1e-4))})
        return [link] * ranks

    monkeypatch.setattr(device_profile, "spawn", timings)
    ops, flags = device_profile.collectives(2, sizes, 3, ceiling=1e10, runs_dir=tmp_path)
    assert [op for op, *_ in ops] == [op for op in OPS if op != "all_reduce"]
    assert all(bw == pytest.approx(2e9) for *_, bw in ops)
    assert len(flags) == 1 and flags[0].startswith("all_reduce: its times do not grow")
    doc = clusters.dump(dataclasses.replace(PROFILE, ops=ops), tmp_path / "p.json", flags=flags)
    assert any(line.startswith("  WARNING all_reduce") for line in device_profile.describe(doc).split("\n"))
    notes = clusters.load(tmp_path / "p.json").notes
    assert flags[0] in notes and any("measured no all_reduce inside" in n for n in notes)
