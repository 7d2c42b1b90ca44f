"""Small random Hugging Face checkpoints, built with `transformers`, for tests
that compare our engine against the reference implementation."""

from __future__ import annotations

import os

import torch

VOCAB = 384

_TEXT = (
    "In the beginning God created the heaven and the earth. "
    "And the earth was without form, and void; and darkness was upon the face of the deep. "
    "The quick brown fox jumps over the lazy dog. Ünïcödé tëxt: naïve café, 東京, emoji 🙂. "
    "def main():\n    return 42\n"
)


def make_tokenizer(path: str, bos: bool = False) -> None:
    """A tiny byte-level BPE tokenizer, saved so AutoTokenizer loads it offline.
    `bos`: it puts its BOS (`<|endoftext|>`, id 0) before every text it
    encodes with special tokens, as Llama's and Mistral's tokenizers do."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB - 8,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator([_TEXT] * 20, trainer)
    if bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<|endoftext|> $A", pair="<|endoftext|> $A <|endoftext|> $B",
            special_tokens=[("<|endoftext|>", tok.token_to_id("<|endoftext|>"))])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|endoftext|>", bos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
    fast.chat_template = (
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    fast.save_pretrained(path)


ARCH_CONFIGS = {
    "llama": dict(model_type="llama"),
    "llama3": dict(
        model_type="llama",
        rope_scaling={
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
        rope_theta=500000.0,
    ),
    "qwen2": dict(model_type="qwen2"),
    "qwen3": dict(model_type="qwen3", head_dim=32),
    "mistral": dict(model_type="mistral", sliding_window=None),
}


def make_checkpoint(path: str, arch: str = "llama", dtype: torch.dtype = torch.float32, seed: int = 0,
                    tie: bool = False, layers: int = 2, head_dim: int | None = None, max_positions: int = 512,
                    bos: bool = False) -> str:
    """`head_dim`: 16 by default (32 for qwen3); GPU kernels want 64 or more,
    which this gives with hidden size 4 * head_dim (4 query heads, 2 KV heads).
    `max_positions`: the model's context (and so the engine's longest request).
    `bos`: a tokenizer that adds a BOS to a text (`make_tokenizer`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(ARCH_CONFIGS[arch])
    model_type = spec.pop("model_type")
    hidden = 64
    if head_dim is not None:
        hidden = 4 * head_dim
        if "head_dim" in spec:
            spec["head_dim"] = head_dim
    cfg = AutoConfig.for_model(
        model_type,
        vocab_size=VOCAB,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=max_positions,
        tie_word_embeddings=tie,
        # a wide init makes logits decisive, so greedy ties (which would make
        # token-for-token comparison meaningless) do not occur
        initializer_range=0.3,
        eos_token_id=0,
        bos_token_id=0,
        **spec,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg).to(dtype)
    os.makedirs(path, exist_ok=True)
    model.save_pretrained(path, safe_serialization=True)
    make_tokenizer(path, bos=bos)
    return path
