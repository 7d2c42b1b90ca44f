"""Model configuration read straight from a Hugging Face `config.json`.

We parse the JSON ourselves instead of going through `transformers.AutoConfig`:
the engine must load models offline, and the rope fields moved between
transformers versions (`rope_theta` + `rope_scaling` before v5,
`rope_parameters` after), so one small normaliser covers both spellings.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field

import torch

# model_type -> the feature flags our single Llama-family implementation needs.
SUPPORTED_ARCHS = {
    "llama": dict(qkv_bias=False, qk_norm=False),
    "mistral": dict(qkv_bias=False, qk_norm=False),
    "qwen2": dict(qkv_bias=True, qk_norm=False),
    "qwen3": dict(qkv_bias=False, qk_norm=True),
}

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype | None:
    if name is None or isinstance(name, torch.dtype):
        return name
    try:
        return _DTYPES[str(name).replace("torch.", "")]
    except KeyError:
        raise ValueError(f"unsupported dtype {name!r}; use one of {sorted(_DTYPES)}") from None


@dataclass
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None
    max_position_embeddings: int
    tie_word_embeddings: bool
    qkv_bias: bool
    qk_norm: bool
    mlp_bias: bool = False
    attention_out_bias: bool = False
    checkpoint_dtype: torch.dtype | None = None
    bos_token_id: int | None = None
    eos_token_ids: list[int] = field(default_factory=list)

    @classmethod
    def from_dict(cls, cfg: dict) -> "ModelConfig":
        model_type = cfg.get("model_type", "llama")
        if model_type not in SUPPORTED_ARCHS:
            raise ValueError(
                f"unsupported model_type {model_type!r}; supported: {sorted(SUPPORTED_ARCHS)}"
            )
        flags = dict(SUPPORTED_ARCHS[model_type])
        if "attention_bias" in cfg and model_type != "qwen2":
            flags["qkv_bias"] = bool(cfg["attention_bias"])
        hidden_act = cfg.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise ValueError(f"unsupported hidden_act {hidden_act!r} (only silu)")
        num_heads = cfg["num_attention_heads"]
        head_dim = cfg.get("head_dim") or cfg["hidden_size"] // num_heads
        rope_theta, rope_scaling = _rope_fields(cfg)
        eos = cfg.get("eos_token_id")
        eos_ids = [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))
        return cls(
            model_type=model_type,
            vocab_size=cfg["vocab_size"],
            hidden_size=cfg["hidden_size"],
            intermediate_size=cfg["intermediate_size"],
            num_layers=cfg["num_hidden_layers"],
            num_heads=num_heads,
            num_kv_heads=cfg.get("num_key_value_heads") or num_heads,
            head_dim=head_dim,
            rms_norm_eps=cfg.get("rms_norm_eps", 1e-6),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=cfg.get("max_position_embeddings", 2048),
            tie_word_embeddings=cfg.get("tie_word_embeddings", False),
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            # Llama's attention_bias also puts a bias on o_proj; Qwen2 biases q/k/v only.
            attention_out_bias=bool(cfg.get("attention_bias", False)) and model_type == "llama",
            checkpoint_dtype=parse_dtype(cfg.get("torch_dtype") or cfg.get("dtype")),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            **flags,
        )

    @classmethod
    def from_pretrained(cls, model_dir: str) -> "ModelConfig":
        path = os.path.join(model_dir, "config.json")
        if not os.path.isfile(path):
            raise FileNotFoundError(f"no config.json in model directory {model_dir!r}")
        with open(path) as f:
            return cls.from_dict(json.load(f))

    def num_parameters(self) -> int:
        """Weights of the model (norms and biases left out): embedding, each
        layer's attention and MLP projections, and an untied output head."""
        h, q, kv = self.hidden_size, self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        layer = h * (q + 2 * kv) + q * h + 3 * h * self.intermediate_size
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.vocab_size * h + self.num_layers * layer + head

    def kv_bytes_per_token(self, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * elem


def _rope_fields(cfg: dict) -> tuple[float, dict | None]:
    params = cfg.get("rope_parameters")
    if isinstance(params, dict) and "rope_theta" in params:
        theta = float(params["rope_theta"])
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
    else:
        theta = float(cfg.get("rope_theta", 10000.0))
        scaling = dict(cfg["rope_scaling"]) if cfg.get("rope_scaling") else None
    if scaling is not None:
        kind = scaling.get("rope_type", scaling.get("type", "default"))
        if kind == "default":
            scaling = None
        elif kind not in ("llama3", "linear"):
            raise ValueError(f"unsupported rope scaling type {kind!r} (supported: llama3, linear)")
        else:
            scaling["rope_type"] = kind
    return theta, scaling
