"""A transformer at any scale, as the planner sees it: its shapes, parameters and FLOPs.

``Transformer`` is the shape of a decoder-only model: L layers of width h with a heads (g of
them for keys and values: grouped-query attention, Ainslie et al. 2023), an MLP of width f
(GeLU: two matrices, as GPT-2/3; SwiGLU: three, as Llama, Shazeer 2020), a vocabulary V, and
optionally E experts per MLP of which k serve each token (a Mixtral-like MoE). The lab's own
GPT (``dlab.models.gpt.GPTConfig``) converts with ``from_gpt``; the planner then uses
``dlab.theory``'s exact per-family formulas for it (``gpt`` keeps the config).

Parameters (Psi), counting the matrices and the embedding (norms, biases and positions are a
few h per layer, kept for the lab's model through its exact count):

    attention   2 h^2 + 2 h^2 g / a         (Q and the output projection; K and V are g/a wide)
    MLP         2 h f (GeLU) or 3 h f (SwiGLU), times E for a MoE (plus an h x E router)
    embedding   V h, and the head V h again unless tied

Model FLOPs per token (``flops_per_token``): 6 per parameter a token multiplies by (forward 2,
backward 4) plus attention's 12 L h s (QK^T and AV over all s keys, PaLM's convention, Chowdhery
et al. 2022 app. B: the causal mask is not discounted), counted by ``dlab.models.flops``, the
function the runtime's MFU uses (the lab's GPT by its own config, so the two agree to the FLOP).
A MoE counts k experts, not E.
"""
from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from dlab.models import flops


@dataclass(frozen=True)
class Transformer:
    name: str
    n_layer: int
    d_model: int
    n_head: int
    d_ff: int
    vocab: int
    n_kv_head: int = 0  # 0: as many as n_head (multi-head attention)
    mlp: str = "gelu"  # "gelu" (2 matrices) or "swiglu" (3)
    tied: bool = False
    n_expert: int = 1
    top_k: int = 1
    #: GPT-3-era models keep 1-byte dropout masks for backward (Korthikanti et al. count them)
    dropout: bool = False
    #: rotary position embeddings (Llama) rather than learned or none
    rope: bool = False
    #: "layernorm" (GPT) or "rmsnorm" (Llama): eager PyTorch runs the one as one kernel, the
    #: other as several (``dlab.theory.plan.ops``)
    norm: str = "layernorm"
    #: the layers' linear maps and norms carry biases (None: GPT-style LayerNorm models do,
    #: Megatron's and GPT-2's; RMSNorm models do not, Llama's)
    bias: bool | None = None
    #: Q, K and V are three matrices (None: Llama's and the lab's GPT are; Megatron's GPT has
    #: one fused QKV matrix)
    split_qkv: bool | None = None
    #: the lab's GPTConfig when this is dlab's own model (exact formulas apply), else None
    gpt: object = dataclasses.field(default=None, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.n_kv_head == 0:
            object.__setattr__(self, "n_kv_head", self.n_head)
        llama = self.norm == "rmsnorm"
        if self.bias is None:
            object.__setattr__(self, "bias", not llama)
        if self.split_qkv is None:
            object.__setattr__(self, "split_qkv", llama)

    @property
    def kv_width(self) -> int:
        """Width of K (and of V): h g / a."""
        return self.d_model * self.n_kv_head // self.n_head

    def attention_params(self) -> int:
        h = self.d_model
        return 2 * h * h + 2 * h * self.kv_width

    def expert_params(self) -> int:
        """One MLP (one expert of a MoE)."""
        return (3 if self.mlp == "swiglu" else 2) * self.d_model * self.d_ff

    def layer_params(self) -> int:
        router = self.d_model * self.n_expert if self.n_expert > 1 else 0
        return self.attention_params() + self.n_expert * self.expert_params() + router

    def active_layer_params(self) -> int:
        """Parameters one token multiplies by in a layer (k experts of E)."""
        return self.attention_params() + self.top_k * self.expert_params()

    def layer_tensors(self, tp: int = 1) -> list[tuple[str, float]]:
        """(module, elements on one of ``tp`` ranks) of every parameter tensor of one layer, in
        the order forward meets them: what a stack that gathers per tensor or per module
        (DeepSpeed's ZeRO-3) issues one collective for. The matrices and column-parallel biases
        are cut by tp; the norms and the row-parallel biases are whole on every rank."""
        h, kv, f = self.d_model, self.kv_width, self.d_ff
        bias = self.bias

        def linear(name, fan_in, fan_out, cut_out=True):
            out = [(name, fan_in * fan_out / tp)]
            return out + ([(name, fan_out / tp if cut_out else fan_out)] if bias else [])

        def norm(name):
            return [(name, h)] * (2 if self.norm == "layernorm" else 1)

        out = norm("norm 1")
        if self.split_qkv:
            out += linear("q", h, h) + linear("k", h, kv) + linear("v", h, kv)
        else:
            out += linear("qkv", h, h + 2 * kv)
        out += linear("projection", h, h, cut_out=False) + norm("norm 2")
        experts = self.n_expert if self.n_expert > 1 else 1
        if experts > 1:
            out.append(("router", h * experts))
        for e in range(experts):
            tag = f"expert {e} " if experts > 1 else ""
            ins = ("gate", "up") if self.mlp == "swiglu" else ("mlp in",)
            for name in ins:
                out += linear(tag + name, h, f)
            out += linear(tag + "mlp out", f, h, cut_out=False)
        return out

    def embedding_params(self) -> int:
        return self.vocab * self.d_model

    def n_params(self) -> int:
        if self.gpt is not None:
            return self.gpt.n_params()
        return self.n_layer * self.layer_params() + self.embedding_params() * (1 if self.tied else 2)

    def flops_per_token(self, seq_len: int) -> float:
        """Model FLOPs per trained token (above), what MFU counts: ``dlab.models.flops.per_token``,
        the runtime's count; for the lab's GPT its own config's, to the FLOP."""
        if self.gpt is not None:
            return dataclasses.replace(self.gpt, seq_len=seq_len).flops_per_token()
        matmul = self.n_layer * self.active_layer_params() + self.embedding_params()  # the head
        return flops.per_token(matmul, self.n_layer, self.d_model, seq_len)

    def recompute_flops_per_token(self, seq_len: int, recompute: str, every: int = 1) -> float:
        """FLOPs a token's forward repeats in backward (``dlab.models.flops.recomputed_per_token``):
        the whole layer's forward in every ``every``-th layer under full recomputation, the
        attention core's score and value products (4 h s a layer) under selective. HFU counts
        them; MFU does not."""
        if self.gpt is not None:
            cfg = dataclasses.replace(self.gpt, seq_len=seq_len)
            return cfg.recompute_flops_per_token(recompute, every)
        return flops.recomputed_per_token(recompute, every, self.n_layer, self.active_layer_params(),
                                          self.d_model, seq_len)

    def recomputed_share(self, recompute: str, every: int = 1) -> float:
        """The share of the layers whose recomputation runs in backward: under full
        recomputation the every-``every``-th (``dlab.models.flops.recomputed_layers``, as the
        FLOPs count them), under selective all of them (their attention core), else none."""
        if recompute == "full":
            return flops.recomputed_layers(self.n_layer, recompute, every) / self.n_layer
        return 1.0 if recompute == "selective" else 0.0

    def problems(self) -> list[str]:
        out = []
        if self.d_model % self.n_head:
            out.append(f"{self.name}: d_model={self.d_model} is not a multiple of n_head={self.n_head}")
        if self.n_head % self.n_kv_head:
            out.append(f"{self.name}: n_kv_head={self.n_kv_head} must divide n_head={self.n_head}")
        if self.mlp not in ("gelu", "swiglu"):
            out.append(f"{self.name}: mlp={self.mlp!r}; use 'gelu' or 'swiglu'")
        if self.norm not in ("layernorm", "rmsnorm"):
            out.append(f"{self.name}: norm={self.norm!r}; use 'layernorm' or 'rmsnorm'")
        if not 1 <= self.top_k <= self.n_expert:
            out.append(f"{self.name}: top_k={self.top_k} must be between 1 and n_expert={self.n_expert}")
        return out


def from_gpt(cfg, name: str = "lab GPT") -> Transformer:
    """The lab's GPT (or MoE) config as a ``Transformer``; ``gpt`` keeps it for the exact
    formulas of ``dlab.theory``."""
    return Transformer(name=name, n_layer=cfg.n_layer, d_model=cfg.d_model, n_head=cfg.n_head,
                       d_ff=cfg.d_ff, vocab=cfg.vocab_size, tied=cfg.tied,
                       n_expert=getattr(cfg, "n_expert", 1), top_k=getattr(cfg, "top_k", 1),
                       bias=True, split_qkv=True, gpt=cfg)


def llama(name: str, n_layer: int, d_model: int, n_head: int, d_ff: int, vocab: int,
          n_kv_head: int = 0, **more) -> Transformer:
    """A Llama-shaped model: SwiGLU, RMSNorm, rotary embeddings, no dropout, untied head."""
    return Transformer(name, n_layer, d_model, n_head, d_ff, vocab, n_kv_head=n_kv_head,
                       mlp="swiglu", rope=True, norm="rmsnorm", **more)


#: Well-known shapes. GPT-3: Brown et al. 2020, table 2.1 (learned positions, GeLU, dropout).
#: Llama 2: Touvron et al. 2023, table 1 and its released configurations.
#: Llama 3: Dubey et al. 2024, table 3 (GQA with 8 KV heads, SwiGLU, RoPE, no dropout).
#: Mixtral 8x7B: Jiang et al. 2024 (8 experts, top-2, Mistral 7B's attention).
#: The Megatron models are those of Narayanan et al. 2021 (table 1) and Korthikanti et al. 2022
#: (table 3): GPT shapes, vocabulary 51200, dropout.
PRESETS = {
    "gpt3-175b": Transformer("GPT-3 175B", 96, 12288, 96, 4 * 12288, 50257, dropout=True),
    "llama2-7b": llama("Llama 2 7B", 32, 4096, 32, 11008, 32000),
    "llama2-13b": llama("Llama 2 13B", 40, 5120, 40, 13824, 32000),
    # the 34B of Touvron et al. 2023 (trained, not released), as IBM's fms-fsdp configures it
    "llama2-34b": llama("Llama 2 34B", 48, 8192, 64, 22016, 32000, n_kv_head=8),
    "llama2-70b": llama("Llama 2 70B", 80, 8192, 64, 28672, 32000, n_kv_head=8),
    "llama3-8b": llama("Llama 3 8B", 32, 4096, 32, 14336, 128256, n_kv_head=8),
    "llama3-70b": llama("Llama 3 70B", 80, 8192, 64, 28672, 128256, n_kv_head=8),
    "llama3-405b": llama("Llama 3 405B", 126, 16384, 128, 53248, 128256, n_kv_head=8),
    "mixtral-8x7b": llama("Mixtral 8x7B", 32, 4096, 32, 14336, 32000, n_kv_head=8,
                          n_expert=8, top_k=2),
}


def megatron_gpt(name: str, n_layer: int, d_model: int, n_head: int, vocab: int = 51200) -> Transformer:
    """A GPT shape as Megatron-LM's papers train it (f = 4h, untied head counted by their
    FLOPs formula's V term, dropout on)."""
    return Transformer(name, n_layer, d_model, n_head, 4 * d_model, vocab, dropout=True)


def preset(name: str) -> Transformer:
    """A preset by name, or a Hugging Face style ``config.json`` by path (``from_config``)."""
    if name.endswith(".json"):
        return from_config(name)
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; choose one of {', '.join(PRESETS)}, or "
                         f"give a config.json") from None


#: Hugging Face config keys, then GPT-2 style ones, for each field
KEYS = {"d_model": ("hidden_size", "n_embd", "d_model"),
        "n_layer": ("num_hidden_layers", "n_layer", "n_layers"),
        "n_head": ("num_attention_heads", "n_head", "n_heads"),
        "n_kv_head": ("num_key_value_heads",),
        "d_ff": ("intermediate_size", "n_inner", "ffn_hidden_size"),
        "vocab": ("vocab_size",),
        "n_expert": ("num_local_experts", "num_experts", "n_routed_experts"),
        "top_k": ("num_experts_per_tok", "moe_topk")}
#: what each field counts, for the errors
MEANS = {"d_model": "the hidden size, e.g. 4096", "n_layer": "the layers, e.g. 32",
         "n_head": "the attention heads, e.g. 32", "n_kv_head": "the key-value heads, e.g. 8",
         "d_ff": "the MLP width, e.g. 14336", "vocab": "the vocabulary size, e.g. 32000",
         "n_expert": "the experts per MLP, e.g. 8", "top_k": "the experts per token, e.g. 2"}
#: no model has a dimension this large, and beyond it the planner's float arithmetic overflows
LARGEST = 10 ** 9
GATED = ("silu", "swish", "swiglu")


def _counts(cfg: dict) -> tuple[dict, dict, list[str]]:
    """(field: value, field: the config's key for it, problems) of the config's counts: each a
    JSON whole number from 1 to ``LARGEST`` (not a bool, a float or a string)."""
    got, key_of, bad = {}, {}, []
    for field, keys in KEYS.items():
        key = next((k for k in keys if cfg.get(k) is not None), None)
        if key is None:
            continue
        value = cfg[key]
        if isinstance(value, bool) or not isinstance(value, int):
            bad.append(f"{key}={json.dumps(value)} is not a whole number; give {MEANS[field]}")
        elif not 1 <= value <= LARGEST:
            bad.append(f"{key}={value} must be between 1 and {LARGEST:.0e}; give {MEANS[field]}")
        else:
            got[field], key_of[field] = value, key
    return got, key_of, bad


def _relations(got: dict, key_of: dict) -> list[str]:
    """What the counts must satisfy together, each in the config's own keys."""
    out = []
    h, a = got["d_model"], got["n_head"]
    if h % a:
        out.append(f"{key_of['d_model']}={h} is not a multiple of {key_of['n_head']}={a}: each head "
                   f"is {key_of['d_model']} / {key_of['n_head']} wide; change one of them")
    g = got.get("n_kv_head")
    if g is not None and a % g:
        out.append(f"{key_of['n_kv_head']}={g} does not divide {key_of['n_head']}={a}: grouped-query "
                   f"attention shares each key-value head among {key_of['n_head']} / "
                   f"{key_of['n_kv_head']} heads; give a divisor of {a}")
    e, k = got.get("n_expert", 1), got.get("top_k")
    if e > 1 and k is not None and k > e:
        out.append(f"{key_of['top_k']}={k} is more than {key_of['n_expert']}={e}: a token is routed "
                   f"to at most all the experts; give a number from 1 to {e}")
    return out


def from_config(path) -> Transformer:
    """A model from a Hugging Face style ``config.json``: hidden size, layers, heads, key-value
    heads, intermediate size, vocabulary, tied embeddings, experts. A SiLU activation means a
    gated (SwiGLU) MLP, as in Llama, Mistral and Qwen; an RMSNorm epsilon an RMSNorm; a rotary
    base rotary embeddings. A missing intermediate size is 4 h (GPT-2). Every field it reads is
    checked (its type, its range, and what the counts must satisfy together), and a problem is
    a ``ValueError`` that names the file, the key and what to write instead."""
    file = Path(path)
    try:
        cfg = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"cannot read the model config {path}: {e}") from None
    if not isinstance(cfg, dict):
        raise ValueError(f"{path} is not a JSON object of model settings")
    got, key_of, bad = _counts(cfg)
    missing = [keys[0] for field, keys in KEYS.items()
               if field in ("d_model", "n_layer", "n_head", "vocab")
               and all(cfg.get(k) is None for k in keys)]
    if missing:
        raise ValueError(f"{path} lacks {', '.join(missing)}: a config needs the hidden size, the "
                         f"layers, the attention heads and the vocabulary")
    tied = cfg.get("tie_word_embeddings")
    if tied is not None and not isinstance(tied, bool):
        bad.append(f"tie_word_embeddings={json.dumps(tied)} must be true or false")
    act = cfg.get("hidden_act", cfg.get("activation_function", "gelu"))
    if not isinstance(act, str):
        bad.append(f"hidden_act={json.dumps(act)} must be an activation's name, e.g. \"silu\" or "
                   f"\"gelu\"")
    if not bad:
        bad = _relations(got, key_of)
    if bad:
        raise ValueError(f"{path}: " + "; ".join(bad))
    gated = act.lower() in GATED
    experts = got.get("n_expert", 1)
    return Transformer(
        name=str(cfg.get("_name_or_path") or cfg.get("model_type") or file.stem),
        n_layer=got["n_layer"], d_model=got["d_model"], n_head=got["n_head"],
        d_ff=got.get("d_ff", 4 * got["d_model"]), vocab=got["vocab"],
        n_kv_head=got.get("n_kv_head", 0), mlp="swiglu" if gated else "gelu",
        tied=not gated if tied is None else tied,
        n_expert=experts, top_k=got.get("top_k", 1) if experts > 1 else 1,
        rope="rope_theta" in cfg or cfg.get("position_embedding_type") == "rotary",
        norm="rmsnorm" if "rms_norm_eps" in cfg else "layernorm")
