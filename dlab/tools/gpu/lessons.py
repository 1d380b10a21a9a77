"""What notebook 15's sections (and notebook 11's last) show, from one of three sources, always
named at the top of what they print:

- **live**: CUDA is here; the section runs the session's step now (``--quick`` sizes) and shows
  what it measured;
- **reference**: no GPU here, but a GPU session was committed (``data/gpu/<device>-<date>/``,
  the newest valid one): its figures, labelled with the device, date and versions, never as a
  live measurement;
- **published**: no session folder exists yet; published figures, each with its source, and
  the plain statement that no GPU of this project has measured them.

Device-independent parts (what autograd saves, dlab's count by category, a CPU step's profile)
are measured on the CPU in any case, labelled as the CPU's.
"""
from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass
from pathlib import Path

import torch

from dlab.core.machine import GPU_PEAK_FLOPS
from dlab.theory.plan import cluster as clusters
from dlab.theory.plan.kernels import matmul_efficiency
from dlab.tools import device_profile
from dlab.tools.gpu import child, published, schema, session
from dlab.tools.gpu.matmul import BYTES

GB, MIB = 1e9, 2 ** 20
NOT_YET = ("No GPU of this project has measured this yet (data/gpu/ holds no session folder: "
           "`make gpu-session` on a lent GPU writes one); the GPU figures below are published "
           "ones, each with its source.")


def sessions(root: Path = session.SESSIONS) -> list[Path]:
    """The committed GPU sessions (valid folders that CUDA wrote), oldest first."""
    found = []
    for index in Path(root).glob("*/index.json"):
        doc = json.loads(index.read_text())
        if doc.get("cuda") and not schema.problems(index.parent):
            found.append((doc["started"], index.parent))
    return [p for _, p in sorted(found)]


@dataclass
class Source:
    kind: str  # "live", "reference" or "published"
    folder: Path | None
    label: str

    def doc(self, step: str) -> dict | None:
        """The step's JSON: measured now (live), read from the session (reference), or None."""
        if self.kind == "live":
            return _live(step)
        path = self.folder / f"{step}.json" if self.folder else None
        return json.loads(path.read_text()) if path and path.exists() else None

    def profile(self) -> dict | None:
        """The cluster profile: calibrated now at --quick sizes (live), the session's, or None."""
        if self.kind == "live":
            with tempfile.TemporaryDirectory() as tmp:
                return device_profile.profile(f"{tmp}/profile.json", quick=True, ranks=1,
                                              runs_dir=f"{tmp}/runs")
        path = self.folder / "profile.json" if self.folder else None
        return json.loads(path.read_text()) if path and path.exists() else None


def source(root: Path = session.SESSIONS, live: bool | None = None) -> Source:
    if torch.cuda.is_available() if live is None else live:
        return Source("live", None, f"Measured live on this GPU ({torch.cuda.get_device_name(0)}), now.")
    found = sessions(root)
    if not found:
        return Source("published", None, NOT_YET)
    index = json.loads((found[-1] / "index.json").read_text())
    v = index["versions"]
    return Source("reference", found[-1], (
        f"The committed reference of the last GPU session, not a live measurement: "
        f"{index['device']}, {index['started'][:10]}, torch {v.get('torch')}, CUDA {v.get('cuda')}, "
        f"driver {v.get('driver')} ({found[-1].relative_to(found[-1].parents[2])})."))


_LIVE: dict[str, dict] = {}


def _live(step: str, cuda: bool | None = None) -> dict:
    """Run one session step here, at --quick sizes, into a temporary folder (once per process)."""
    cuda = torch.cuda.is_available() if cuda is None else cuda
    key = f"{step}:{cuda}"
    if key not in _LIVE:
        target = next(s.target for s in session.STEPS if s.name == step)
        with tempfile.TemporaryDirectory(prefix="dlab-lesson-") as tmp:
            ctx = {"step": step, "out": tmp, "cuda": cuda, "quick": True,
                   "device": session.device_name(cuda), "runs_dir": f"{tmp}/runs"}
            child.execute(target, ctx)
            _LIVE[key] = json.loads((Path(tmp) / f"{step}.json").read_text())
    return _LIVE[key]


def cpu(step: str) -> dict:
    """A step measured on this CPU (the device-independent parts the lessons read here)."""
    return _live(step, cuda=False)


def latest_profile(root: Path = session.SESSIONS) -> Path | None:
    """The newest committed session's cluster profile, for ``plan --cluster``."""
    found = [p / "profile.json" for p in sessions(root) if (p / "profile.json").exists()]
    return found[-1] if found else None


# --- what each section prints ----------------------------------------------------------------

def profile_text(doc: dict) -> str:
    unit = "kernels" if doc["kind"] == "kernel" else "top-level operators"
    s = doc["step_s"]
    lines = [f"one step of a {doc['model']['n_layer']}-layer GPT (h = {doc['model']['d_model']}, "
             f"s = {doc['model']['seq_len']}, G = {doc['batch']}, {doc['precision']}): "
             f"{s * 1e3:.1f} ms, {doc['flops'] / s / 1e12:.3g} TFLOP/s of the model's FLOPs",
             f"  {unit} busy {doc['busy_s'] * 1e3:.1f} ms ({doc['busy_s'] / s:.0%}), idle "
             f"{doc['idle_s'] * 1e3:.1f} ms in {doc['gaps']} gaps (largest "
             f"{doc['largest_gap_s'] * 1e6:.0f} us)",
             f"  matmul and attention {doc['compute_s'] * 1e3:.1f} ms, everything else "
             f"{doc['memory_s'] * 1e3:.1f} ms "
             f"({doc['memory_s'] / max(doc['compute_s'] + doc['memory_s'], 1e-12):.0%})",
             f"  {'phase':10s} {'host span':>10s} {unit:>20s} {'busy':>9s} {'matmul':>9s} {'other':>9s}"]
    lines += [f"  {p['name']:10s} {p['host_s'] * 1e3:8.2f}ms {p['events']:20d} {p['busy_s'] * 1e3:7.2f}ms "
              f"{p['compute_s'] * 1e3:7.2f}ms {p['memory_s'] * 1e3:7.2f}ms" for p in doc["phases"]]
    lines += ["  the most time:"] + [f"    {t['seconds'] * 1e3:7.2f} ms x{t['count']:<4d} {t['bound']:7s} "
                                     f"{t['name'][:70]}" for t in doc["top"][:6]]
    return "\n".join(lines)


def operator_classes_text() -> str:
    p = published.OPERATOR_CLASSES
    lines = [f"Published: {p['source']}", f"  {'operator class':52s} {'% FLOPs':>8s} {'% time':>7s}"]
    lines += [f"  {name:52s} {flops:8.2f} {time:7.1f}" for name, flops, time in p["rows"]]
    return "\n".join(lines)


def _preset(generation: str) -> clusters.Cluster:
    return clusters.PRESETS["a100-80gb" if generation == "A100" else "h100-sxm"]


def matmul_shapes_text(profile: dict | None, shapes=None) -> str:
    """Measured matmul rates by shape (a session's profile) beside what the planner's preset
    assumes for them; without a profile, the assumption alone on the calibration's grid."""
    ref = _preset(profile.get("generation", "") if profile else "H100")
    rows = profile["kernels"]["matmul_table"] if profile else [
        (m, n, k, None) for m, n, k in (shapes or device_profile.FULL["shapes"])]
    lines = [f"{'m':>6s} {'n':>6s} {'k':>6s} {'measured':>10s} {'planner assumes':>16s}  ({ref.name})"]
    for m, n, k, got in rows:
        assumed = matmul_efficiency(ref.kernels, m, n, k) * ref.peak
        lines.append(f"{m:6d} {n:6d} {k:6d} " + (f"{got / 1e12:9.0f}T" if got else f"{'-':>10s}")
                     + f" {assumed / 1e12:15.0f}T")
    k = ref.kernels
    lines.append(f"the planner's best shape {k.best}: {k.matmul:.1%} of {ref.peak / 1e12:.0f} TFLOP/s "
                 f"(Bekman's maximum achievable matmul FLOPS, dlab.theory.plan.cluster)")
    return "\n".join(lines)


def attention_text(doc: dict) -> str:
    lines = [f"{doc['dtype']}, batch {doc['batch']}, {doc['heads']} heads of {doc['head_dim']}, causal",
             f"  {'kernel':10s} {'s':>6s} {'fwd ms':>8s} {'bwd ms':>8s} {'TFLOP/s':>8s} {'saved MiB':>10s} "
             f"{'peak MiB':>9s}"]
    for r in doc["rows"]:
        if r["why"]:
            lines.append(f"  {r['backend']:10s} {r['seq']:6d}  not measured: {r['why'][:80]}")
            continue
        peak = f"{r['peak_bytes'] / MIB:9.1f}" if r["peak_bytes"] is not None else f"{'-':>9s}"
        lines.append(f"  {r['backend']:10s} {r['seq']:6d} {r['forward_s'] * 1e3:8.3f} "
                     f"{r['backward_s'] * 1e3:8.3f} "
                     f"{r['tflops']:8.3g} {r['saved_bytes'] / MIB:10.2f} {peak}")
    return "\n".join(lines)


def attention_published_text() -> str:
    p = published.ATTENTION_H100
    lines = [f"Published: {p['source']}", f"  {'kernel':18s}" + "".join(f"{s:>7d}" for s in p["seqs"])]
    lines += [f"  {name:18s}" + "".join(f"{v:7d}" if v else f"{'OOM':>7s}" for v in values)
              for name, values in p["tflops"].items()]
    return "\n".join(lines)


def peaks(name: str = "H100") -> dict:
    """Datasheet dense peaks by precision (FLOP/s) of an H100 or H200."""
    return {"fp32": GPU_PEAK_FLOPS[name]["fp32"], "tf32": published.H100_SXM["peak"]["tf32"],
            "bf16": GPU_PEAK_FLOPS[name]["bf16"], "fp8": published.H100_SXM["peak"]["fp8"]}


def roofline_text(hbm: float | None = None) -> str:
    """The ridge point of each precision on an H100 SXM, and the square matmul size past it."""
    hbm = hbm or clusters.PRESETS["h100-sxm"].hbm
    lines = [f"H100 SXM, memory {hbm / 1e12:.2f} TB/s", f"  {'precision':9s} {'peak TFLOP/s':>12s} "
             f"{'ridge FLOP/byte':>16s} {'square side past it':>20s}"]
    for dtype, top in peaks().items():
        inp, out = BYTES[dtype]
        ridge = top / hbm
        # 2 n^3 / ((2 inp + out) n^2) = ridge  ->  n = ridge (2 inp + out) / 2
        lines.append(f"  {dtype:9s} {top / 1e12:12.1f} {ridge:16.0f} {ridge * (2 * inp + out) / 2:20.0f}")
    return "\n".join(lines)


def matmul_text(doc: dict) -> str:
    lines = [f"memory bandwidth {doc['bandwidth'] / GB:.3g} GB/s ({doc['bandwidth_source']})",
             f"  {'dtype':5s} {'n':>6s} {'FLOP/byte':>9s} {'TFLOP/s':>9s} {'of peak':>8s} "
             f"{'of roofline':>11s}"]
    for r in doc["rows"]:
        if r["why"]:
            if r["n"] == min(x["n"] for x in doc["rows"]):
                lines.append(f"  {r['dtype']:5s} not measured: {r['why']}")
            continue
        share = f"{r['share']:8.0%}" if r["share"] is not None else f"{'-':>8s}"
        roof = f"{r['roofline']:11.0%}" if r["roofline"] is not None else f"{'-':>11s}"
        lines.append(f"  {r['dtype']:5s} {r['n']:6d} {r['intensity']:9.0f} {r['tflops']:9.3g} {share} {roof}")
    return "\n".join(lines)


def allocator_text(doc: dict) -> str:
    lines = [f"{'MiB at the end of':17s}" + "".join(f"{k:>13s}" for k in doc["phases"][0]["dlab"])
             + f"{'dlab total':>13s}{'allocated':>13s}{'reserved':>13s}"]
    for p in doc["phases"]:
        cells = "".join(f"{v / MIB:13.2f}" for v in p["dlab"].values())
        alloc = "".join(f"{v / MIB:13.2f}" if v is not None else f"{'-':>13s}"
                        for v in (p["allocated"], p["reserved"]))
        lines.append(f"{p['phase']:17s}{cells}{p['dlab_total'] / MIB:13.2f}{alloc}")
    allocator = (f", the allocator's {doc['allocator_peak'] / MIB:.2f} MiB allocated, "
                 f"{doc['reserved_peak'] / MIB:.2f} MiB reserved" if doc["allocator_peak"] is not None
                 else f"; {doc['why']}")
    lines.append(f"step's peak: dlab's count {doc['dlab_peak'] / MIB:.2f} MiB{allocator}")
    return "\n".join(lines)


def collectives_text(doc: dict) -> str:
    lines = [f"  {'backend':8s} {'tensors':7s} {'ranks':>5s} {'op':15s} {'bytes':>10s} {'us':>10s} "
             f"{'bus GB/s':>9s}"]
    for r in doc["rows"]:
        if r["why"]:
            continue
        bw = f"{r['busbw'] / GB:9.3g}" if r["busbw"] else f"{'-':>9s}"
        lines.append(f"  {r['backend']:8s} {r['tensors']:7s} {r['ranks']:5d} {r['op']:15s} {r['bytes']:10d} "
                     f"{r['seconds'] * 1e6:10.1f} {bw}")
    return "\n".join(lines)


def allocator_published_text() -> str:
    a = published.ALLOCATOR
    return (f"Published: {a['source']}\n"
            f"  every block rounded up to {a['block']} bytes; a request up to {a['small'] // MIB} MiB is cut "
            f"from a {a['small_segment'] // MIB} MiB segment, a larger one from a "
            f"{a['large_segment'] // MIB} MiB segment (from {a['min_large'] // MIB} MiB up: its own segment, "
            f"rounded to {a['round_large'] // MIB} MiB); a freed block stays reserved for the next request")


def collectives_published_text() -> str:
    h100 = clusters.PRESETS["h100-sxm"]
    return (f"Published (the planner's preset, dlab.theory.plan.cluster): nccl-tests' all-reduce bus "
            f"bandwidth inside a DGX H100 {h100.intra.bandwidth / GB:.0f} GB/s (NVIDIA, GTC 2024 "
            f"S62129); one 400 Gb/s NDR NIC across nodes {h100.inter.bandwidth / GB:.0f} GB/s")
