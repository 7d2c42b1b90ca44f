#!/usr/bin/env python3
"""Train stepserve's embedded default model (and its speculative-decoding draft).

Corpus: the King James Bible as shipped by Debian's ``bible-kjv`` package
(public domain text).  One command reproduces everything::

    apt-get install -y bible-kjv          # provides /usr/bin/bible
    .venv/bin/python tools/train_default_model.py

The script

1. dumps the corpus with ``bible -f "Gen1:1-Rev22:21"`` (unless ``--corpus``
   already exists), strips the verse labels and groups verses into chapters;
   ~2% of the chapters are held out for validation,
2. trains a 4096-entry byte-level BPE tokenizer (``tokenizers``) with the
   special tokens ``<|endoftext|>`` (id 0), ``<|im_start|>``, ``<|im_end|>``
   and a ChatML chat template,
3. trains two ``transformers.LlamaForCausalLM`` models with plain PyTorch
   (AdamW, linear warmup + cosine decay, float32 on CPU) under wall-clock
   budgets: the target (~4.2M params) and a draft (~0.9M params),
4. saves both in bfloat16 safetensors together with the tokenizer files into
   ``engine/assets/kjv-llama`` and ``engine/assets/kjv-llama-draft``,
5. reloads the saved artifacts with ``AutoTokenizer`` / ``AutoModelForCausalLM``
   and evaluates them (held-out loss, greedy samples, greedy draft agreement),
   then writes ``engine/assets/README.md``.

The learning-rate schedule is driven by the fraction of the wall-clock budget
used, so the step count (and hence the exact weights) depends on machine
speed; everything else (split, tokenizer, data order) is seeded.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
# ChatML; with `tools`, the Hermes / Qwen tool format (a system block listing them, calls as
# <tool_call>{...}</tool_call>, results as <tool_response> user turns): the server's tool calling
CHAT_TEMPLATE = '{%- if tools %}\n{{- \'<|im_start|>system\\n\' }}\n{%- if messages[0][\'role\'] == \'system\' %}{{- messages[0][\'content\'] + \'\\n\\n\' }}{%- endif %}\n{{- \'# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>\' }}\n{%- for tool in tools %}{{- \'\\n\' + (tool | tojson) }}{%- endfor %}\n{{- \'\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{"name": <function-name>, "arguments": <args-json-object>}\\n</tool_call><|im_end|>\\n\' }}\n{%- endif %}\n{%- for message in messages %}\n{%- if tools and loop.first and message[\'role\'] == \'system\' %}\n{%- elif message[\'role\'] == \'assistant\' and message.get(\'tool_calls\') %}\n{{- \'<|im_start|>assistant\\n\' + (message[\'content\'] or \'\') }}\n{%- for call in message[\'tool_calls\'] %}\n{{- \'<tool_call>\\n{"name": "\' + call[\'function\'][\'name\'] + \'", "arguments": \' + (call[\'function\'][\'arguments\'] | tojson) + \'}\\n</tool_call>\' }}\n{%- endfor %}\n{{- \'<|im_end|>\\n\' }}\n{%- elif message[\'role\'] == \'tool\' %}\n{{- \'<|im_start|>user\\n<tool_response>\\n\' + message[\'content\'] + \'\\n</tool_response><|im_end|>\\n\' }}\n{%- else %}\n{{- \'<|im_start|>\' + message[\'role\'] + \'\\n\' + message[\'content\'] + \'<|im_end|>\' + \'\\n\' }}\n{%- endif %}\n{%- endfor %}\n{%- if add_generation_prompt %}{{- \'<|im_start|>assistant\\n\' }}{%- endif %}'
BIBLE_RANGE = "Gen1:1-Rev22:21"
VERSE_RE = re.compile(r"^([0-9]?[A-Za-z]+)(\d+):(\d+) (.*)$")
SAMPLE_PROMPTS = ["In the beginning", "And Jesus said unto them", "The LORD is my shepherd"]
CHAT_PROMPTS = [
    "Blessed are the poor in spirit: for theirs is the kingdom of heaven.",
    "Who art thou?",
]


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--corpus", default="/tmp/kjv.txt",
                   help="verse-per-line KJV dump; created with `bible -f %s` if missing" % BIBLE_RANGE)
    p.add_argument("--out-dir", default=str(REPO_ROOT / "engine" / "assets"),
                   help="writes kjv-llama/, kjv-llama-draft/ and README.md here")
    p.add_argument("--target-minutes", type=float, default=30.0, help="training wall-clock budget, target")
    p.add_argument("--draft-minutes", type=float, default=8.0, help="training wall-clock budget, draft")
    p.add_argument("--threads", type=int, default=1, help="torch / tokenizers threads")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--val-frac", type=float, default=0.02, help="fraction of chapters held out")
    p.add_argument("--chat-frac", type=float, default=0.15, help="fraction of training tokens in chat format")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=0, help="0 = choose from measured seconds/step")
    p.add_argument("--target-steps-goal", type=int, default=1500,
                   help="when choosing the batch size, aim for about this many optimizer steps")
    p.add_argument("--target-lr", type=float, default=2e-3)
    p.add_argument("--draft-lr", type=float, default=3e-3)
    p.add_argument("--weight-decay", type=float, default=0.1)
    p.add_argument("--warmup-frac", type=float, default=0.03)
    p.add_argument("--min-lr-frac", type=float, default=0.1, help="cosine floor as a fraction of peak lr")
    p.add_argument("--evals", type=int, default=8, help="held-out evaluations during each training run")
    p.add_argument("--agree-prompts", type=int, default=100)
    p.add_argument("--agree-tokens", type=int, default=32)
    p.add_argument("--sample-tokens", type=int, default=40)
    p.add_argument("--command-label", default=None,
                   help="command line to record in README.md (default: reconstructed from argv)")
    return p.parse_args(argv)


ARGS = parse_args()
# Thread limits must be in the environment before torch / tokenizers start their pools.
for _var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "RAYON_NUM_THREADS"):
    os.environ[_var] = str(ARGS.threads)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "true" if ARGS.threads > 1 else "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers  # noqa: E402
import transformers  # noqa: E402
from transformers import (AutoModelForCausalLM, AutoTokenizer, GenerationConfig,  # noqa: E402
                          LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast)

transformers.logging.set_verbosity_error()

T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:7.1f}s] {msg}", flush=True)


# --------------------------------------------------------------------------- corpus

def load_corpus(path: Path):
    """Return (chapters, package_version): chapters = list of (book, chapter, [verse texts])."""
    if not path.exists():
        log(f"corpus {path} missing; running `bible -f {BIBLE_RANGE}`")
        out = subprocess.run(["bible", "-f", BIBLE_RANGE], check=True, capture_output=True, text=True).stdout
        path.write_text(out)
    chapters: list[tuple[str, int, list[str]]] = []
    n_verses = 0
    last = None
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not line:
            continue
        m = VERSE_RE.match(line)
        if m is None:
            # a wrapped continuation line (not produced by `bible -f`, handled anyway)
            if not chapters:
                raise ValueError(f"unparseable first line: {raw!r}")
            chapters[-1][2][-1] += " " + line
            continue
        book, chap, _verse, text = m.group(1), int(m.group(2)), int(m.group(3)), m.group(4)
        text = re.sub(r"\s+", " ", text).strip()
        if (book, chap) != last:
            chapters.append((book, chap, []))
            last = (book, chap)
        chapters[-1][2].append(text)
        n_verses += 1
    try:
        version = subprocess.run(["dpkg-query", "-W", "-f=${Version}", "bible-kjv"],
                                 check=True, capture_output=True, text=True).stdout.strip()
    except Exception:
        version = "unknown"
    return chapters, n_verses, version


# --------------------------------------------------------------------------- tokenizer

def train_tokenizer(train_texts: list[str], vocab_size: int) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(add_prefix_space=False, trim_offsets=False)  # offsets only; adds no tokens
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # the chat role names appear in every chat sample; make sure they are seen
    extra = ["user\nassistant\nsystem\n"] * 200
    tok.train_from_iterator(train_texts + extra, trainer=trainer)
    for i, s in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    assert tok.get_vocab_size() == vocab_size, tok.get_vocab_size()
    return tok


def wrap_tokenizer(tok: Tokenizer, max_len: int) -> PreTrainedTokenizerFast:
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|endoftext|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
        unk_token=None,
        additional_special_tokens=["<|im_start|>", "<|im_end|>"],
        model_max_length=max_len,
        chat_template=CHAT_TEMPLATE,
        clean_up_tokenization_spaces=False,
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def save_tokenizer(hf_tok, out: Path) -> None:
    hf_tok.save_pretrained(str(out))
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    # make the loading class explicit: never re-interpreted as a (sentencepiece) LlamaTokenizer
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg["add_bos_token"] = False
    cfg["add_eos_token"] = False
    cfg.setdefault("bos_token", "<|endoftext|>")
    cfg.setdefault("eos_token", "<|endoftext|>")
    cfg.setdefault("pad_token", "<|endoftext|>")
    cfg["model_max_length"] = hf_tok.model_max_length
    # loader bookkeeping that must not be shipped
    for k in ("is_local", "local_files_only", "name_or_path", "_commit_hash"):
        cfg.pop(k, None)
    # transformers 5 writes a list under `extra_special_tokens`, which 4.x expects to be a dict;
    # `additional_special_tokens` is understood by both
    extra = cfg.pop("extra_special_tokens", None)
    if isinstance(extra, dict):
        cfg["extra_special_tokens"] = extra
    cfg["additional_special_tokens"] = ["<|im_start|>", "<|im_end|>"]
    # transformers 5 also writes chat_template.jinja; keep the template in tokenizer_config.json for 4.x
    cfg["chat_template"] = CHAT_TEMPLATE
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False) + "\n")


def check_tokenizer(path: Path, im_end_id: int) -> None:
    tok = AutoTokenizer.from_pretrained(str(path))
    assert tok.is_fast, type(tok)
    text = "In the beginning God created the heaven and the earth.\nAnd the earth"
    ids = tok(text)["input_ids"]
    assert ids == tok.encode(text, add_special_tokens=True), "encode mismatch"
    assert ids[0] != 0 and 0 not in ids, "tokenizer must not add BOS/EOS automatically"
    assert tok.decode(ids) == text, tok.decode(ids)
    u = "naïve “quotes” — ΑΩ 日本"
    assert tok.decode(tok.encode(u)) == u, "multi-byte UTF-8 must round-trip"
    chat = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                   add_generation_prompt=True)
    assert chat == "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n", repr(chat)
    cids = tok.encode(chat)
    assert cids.count(tok.convert_tokens_to_ids("<|im_start|>")) == 2 and im_end_id in cids, cids
    assert tok.eos_token_id == 0 and tok.bos_token_id == 0 and tok.pad_token_id == 0
    assert tok.convert_tokens_to_ids("<|im_end|>") == im_end_id


# --------------------------------------------------------------------------- data

def chat_text(hf_tok, user: str, assistant: str) -> str:
    return hf_tok.apply_chat_template(
        [{"role": "user", "content": user}, {"role": "assistant", "content": assistant}], tokenize=False)


class TrainData:
    """Per-epoch shuffled, packed stream of chapter documents and fresh chat samples."""

    def __init__(self, chapter_ids, chapter_verses, hf_tok, seq_len, chat_frac, seed):
        self.chapter_ids = chapter_ids
        self.pairs = [(v[i], v[i + 1]) for v in chapter_verses for i in range(len(v) - 1)]
        self.tok = hf_tok
        self.seq_len = seq_len
        self.rng = random.Random(seed)
        self.text_tokens = sum(len(c) + 1 for c in chapter_ids)
        self.chat_target = int(self.text_tokens * chat_frac / (1.0 - chat_frac))
        self.epoch = 0
        self.chat_tokens_last = 0
        self._seqs: list[list[int]] = []

    def _build_epoch(self):
        docs = [c for c in self.chapter_ids]
        chat_tokens = 0
        while chat_tokens < self.chat_target:
            batch = [self.rng.choice(self.pairs) for _ in range(256)]
            enc = self.tok([chat_text(self.tok, u, a) for u, a in batch], add_special_tokens=False)["input_ids"]
            for ids in enc:
                if chat_tokens >= self.chat_target:
                    break
                docs.append(ids)
                chat_tokens += len(ids) + 1
        self.chat_tokens_last = chat_tokens
        self.rng.shuffle(docs)
        stream: list[int] = []
        for d in docs:
            stream.extend(d)
            stream.append(0)  # <|endoftext|> separates documents
        n = len(stream) // self.seq_len
        seqs = [stream[i * self.seq_len:(i + 1) * self.seq_len] for i in range(n)]
        self.rng.shuffle(seqs)
        self._seqs = seqs
        self.epoch += 1
        self.seqs_per_epoch = n

    def batches(self, batch_size):
        while True:
            if len(self._seqs) < batch_size:
                self._build_epoch()
            out, self._seqs = self._seqs[:batch_size], self._seqs[batch_size:]
            yield torch.tensor(out, dtype=torch.long)


def pack_val(chapter_ids, seq_len):
    stream: list[int] = []
    for c in chapter_ids:
        stream.extend(c)
        stream.append(0)
    n = len(stream) // seq_len
    rest = stream[n * seq_len:]
    seqs = [stream[i * seq_len:(i + 1) * seq_len] for i in range(n)]
    if len(rest) > 1:
        seqs.append(rest)
    return seqs


@torch.no_grad()
def eval_loss(model, seqs, batch_size=16):
    """Mean next-token NLL (nats/token) over packed held-out sequences."""
    model.eval()
    tot, cnt = 0.0, 0
    full = [s for s in seqs if len(s) == len(seqs[0])]
    ragged = [s for s in seqs if len(s) != len(seqs[0])]
    groups = [full[i:i + batch_size] for i in range(0, len(full), batch_size)] + [[s] for s in ragged]
    for g in groups:
        x = torch.tensor(g, dtype=torch.long)
        logits = model(input_ids=x).logits.float()
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.size(-1)), x[:, 1:].reshape(-1), reduction="sum")
        tot += loss.item()
        cnt += x[:, 1:].numel()
    model.train()
    return tot / max(cnt, 1)


@torch.no_grad()
def eval_chat_loss(model, samples):
    """NLL (nats/token) of the assistant turn (content + <|im_end|>) given the user turn."""
    model.eval()
    tot, cnt = 0.0, 0
    for ids, start, end in samples:
        x = torch.tensor([ids], dtype=torch.long)
        logits = model(input_ids=x).logits.float()[0]
        tgt = x[0, start:end]
        tot += F.cross_entropy(logits[start - 1:end - 1], tgt, reduction="sum").item()
        cnt += tgt.numel()
    model.train()
    return tot / max(cnt, 1)


# --------------------------------------------------------------------------- training

def make_model(kind: str, vocab: int, im_end_id: int) -> LlamaForCausalLM:
    common = dict(vocab_size=vocab, max_position_embeddings=1024, rope_theta=10000.0, rms_norm_eps=1e-5,
                  tie_word_embeddings=True, bos_token_id=0, eos_token_id=[im_end_id, 0], pad_token_id=0,
                  hidden_act="silu", attention_bias=False, mlp_bias=False, initializer_range=0.02)
    if kind == "target":
        cfg = LlamaConfig(hidden_size=256, intermediate_size=768, num_hidden_layers=4,
                          num_attention_heads=4, num_key_value_heads=2, **common)
    else:
        cfg = LlamaConfig(hidden_size=128, intermediate_size=384, num_hidden_layers=2,
                          num_attention_heads=2, num_key_value_heads=1, **common)
    model = LlamaForCausalLM(cfg)
    model.generation_config = GenerationConfig(bos_token_id=0, eos_token_id=[im_end_id, 0], pad_token_id=0)
    return model


def n_params(model) -> int:
    return sum(p.numel() for p in model.parameters())


def make_optimizer(model, lr, wd):
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.ndim < 2]
    return torch.optim.AdamW([{"params": decay, "weight_decay": wd}, {"params": no_decay, "weight_decay": 0.0}],
                             lr=lr, betas=(0.9, 0.95), eps=1e-8)


def measure_step_seconds(kind, vocab, im_end_id, seq_len, batch_size, reps=3) -> float:
    torch.manual_seed(0)
    m = make_model(kind, vocab, im_end_id)
    m.train()
    opt = make_optimizer(m, 1e-4, 0.0)
    x = torch.randint(0, vocab, (batch_size, seq_len))
    times = []
    for i in range(reps + 1):
        t = time.perf_counter()
        m(input_ids=x, labels=x).loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i:  # first step is warm-up
            times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2]


def train(kind, data: TrainData, val_seqs, chat_val, args, lr, budget_s, vocab, im_end_id):
    probe_bs = 8
    sps = measure_step_seconds(kind, vocab, im_end_id, args.seq_len, probe_bs)
    tok_per_s = probe_bs * args.seq_len / sps
    planned_tokens = tok_per_s * budget_s
    epoch_tokens = data.text_tokens + data.chat_target
    if args.batch_size > 0:
        bs = args.batch_size
    else:
        bs = int(round(planned_tokens / (args.target_steps_goal * args.seq_len)))
        bs = max(4, min(32, bs))
    est_steps = planned_tokens / (bs * args.seq_len)
    log(f"[{kind}] measured {sps:.3f} s/step at batch {probe_bs}x{args.seq_len} ({tok_per_s:,.0f} tok/s); "
        f"budget {budget_s / 60:.1f} min -> ~{planned_tokens / 1e6:.2f}M tokens = ~{planned_tokens / epoch_tokens:.2f} "
        f"epochs; batch {bs}x{args.seq_len}, ~{est_steps:.0f} steps")

    torch.manual_seed(args.seed + (0 if kind == "target" else 1))
    model = make_model(kind, vocab, im_end_id)
    model.train()
    log(f"[{kind}] params {n_params(model):,}")
    opt = make_optimizer(model, lr, args.weight_decay)
    batches = data.batches(bs)
    history = []
    eval_every = budget_s / max(args.evals, 1)
    next_eval = eval_every
    train_time = 0.0
    step = 0
    tokens = 0
    run_loss, run_n = 0.0, 0
    last_log = time.time()
    v0 = eval_loss(model, val_seqs)
    log(f"[{kind}] step 0 val {v0:.4f}")
    history.append(dict(step=0, tokens=0, train_s=0.0, train_loss=None, val_loss=v0))
    while train_time < budget_s:
        frac = train_time / budget_s
        if frac < args.warmup_frac:
            cur_lr = lr * max(frac / args.warmup_frac, 0.01)
        else:
            p = (frac - args.warmup_frac) / (1.0 - args.warmup_frac)
            cur_lr = lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * min(p, 1.0))))
        for g in opt.param_groups:
            g["lr"] = cur_lr
        t = time.perf_counter()
        x = next(batches)
        loss = model(input_ids=x, labels=x).loss
        loss.backward()
        gnorm = torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        train_time += time.perf_counter() - t
        step += 1
        tokens += x.numel()
        run_loss += loss.item()
        run_n += 1
        if time.time() - last_log > 30:
            log(f"[{kind}] step {step} ep {tokens / epoch_tokens:.2f} train {run_loss / run_n:.4f} "
                f"lr {cur_lr:.2e} gnorm {gnorm:.2f} {tokens / train_time:,.0f} tok/s "
                f"({train_time / 60:.1f}/{budget_s / 60:.1f} min)")
            last_log = time.time()
        if train_time >= next_eval or train_time >= budget_s:
            v = eval_loss(model, val_seqs)
            tl = run_loss / max(run_n, 1)
            log(f"[{kind}] step {step} tokens {tokens / 1e6:.2f}M ep {tokens / epoch_tokens:.2f} "
                f"train {tl:.4f} val {v:.4f}")
            history.append(dict(step=step, tokens=tokens, train_s=round(train_time, 1), train_loss=tl, val_loss=v))
            run_loss, run_n = 0.0, 0
            next_eval += eval_every
    chat_v = eval_chat_loss(model, chat_val)
    info = dict(steps=step, tokens=tokens, epochs=tokens / epoch_tokens, batch_size=bs, seq_len=args.seq_len,
                train_s=train_time, peak_lr=lr, history=history, final_val_fp32=history[-1]["val_loss"],
                chat_val_fp32=chat_v, tok_per_s=tokens / max(train_time, 1e-9), data_epochs_built=data.epoch)
    log(f"[{kind}] done: {step} steps, {tokens / 1e6:.2f}M tokens ({info['epochs']:.2f} epochs) in "
        f"{train_time / 60:.1f} min; val {info['final_val_fp32']:.4f} chat-val {chat_v:.4f} (fp32)")
    return model, info


def save_model(model, hf_tok, out: Path):
    out.mkdir(parents=True, exist_ok=True)
    for f in out.iterdir():
        if f.is_file():
            f.unlink()
    model = model.to(torch.bfloat16)
    model.config.dtype = torch.bfloat16
    kw = {}
    import inspect
    if "safe_serialization" in inspect.signature(model.save_pretrained).parameters:
        kw["safe_serialization"] = True
    model.save_pretrained(str(out), **kw)
    save_tokenizer(hf_tok, out)
    cfg_path = out / "config.json"
    cfg = json.loads(cfg_path.read_text())
    # older transformers (<4.56) read `torch_dtype`, newer read `dtype`; rope_theta is read top-level by <5
    cfg.setdefault("dtype", "bfloat16")
    cfg["torch_dtype"] = "bfloat16"
    cfg.setdefault("rope_theta", 10000.0)
    cfg_path.write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    assert (out / "model.safetensors").exists(), list(out.iterdir())
    for f in out.iterdir():
        os.chmod(f, 0o644)


# --------------------------------------------------------------------------- evaluation of saved artifacts

@torch.no_grad()
def greedy(model, ids: list[int], n: int) -> list[int]:
    """n greedy tokens, full forward each step (no early stop)."""
    seq = list(ids)
    for _ in range(n):
        logits = model(input_ids=torch.tensor([seq])).logits[0, -1]
        seq.append(int(logits.argmax()))
    return seq[len(ids):]


@torch.no_grad()
def generate_text(model, tok, prompt_ids, n, eos):
    x = torch.tensor([prompt_ids])
    out = model.generate(input_ids=x, attention_mask=torch.ones_like(x), max_new_tokens=n, do_sample=False,
                         eos_token_id=eos, pad_token_id=0)
    new = out[0, len(prompt_ids):].tolist()
    return new, tok.decode(new, skip_special_tokens=False)


@torch.no_grad()
def agreement(target, draft, prompts: list[list[int]], n: int, k: int = 4):
    hits = total = 0
    fwd_steps = 0
    for p in prompts:
        gen = greedy(target, p, n)
        full = torch.tensor([p + gen])
        d_arg = draft(input_ids=full).logits[0, len(p) - 1:len(p) - 1 + n].argmax(-1).tolist()
        t_arg = target(input_ids=full).logits[0, len(p) - 1:len(p) - 1 + n].argmax(-1).tolist()
        mism = sum(a != b for a, b in zip(t_arg, gen))
        if mism:
            log(f"note: target batch forward differs from its step-wise greedy at {mism} position(s)")
        match = [a == b for a, b in zip(d_arg, gen)]
        hits += sum(match)
        total += n
        # greedy speculative decoding with k draft tokens per target verification step
        pos = 0
        while pos < n:
            acc = 0
            while acc < k and pos + acc < n and match[pos + acc]:
                acc += 1
            pos += acc + 1
            fwd_steps += 1
    return hits / total, len(prompts) * n / fwd_steps


def file_sizes(d: Path):
    return {f.name: f.stat().st_size for f in sorted(d.iterdir()) if f.is_file()}


def human(n: float) -> str:
    for unit in ("B", "KB", "MB"):
        if n < 1024 or unit == "MB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024


def main():
    args = ARGS
    torch.set_num_threads(args.threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:
        pass
    random.seed(args.seed)
    torch.manual_seed(args.seed)
    out_dir = Path(args.out_dir).resolve()
    target_dir, draft_dir = out_dir / "kjv-llama", out_dir / "kjv-llama-draft"
    command = args.command_label or "python " + " ".join(shlex.quote(a) for a in
                                                         [os.path.relpath(sys.argv[0], REPO_ROOT)] + sys.argv[1:])
    log(f"torch {torch.__version__}, transformers {transformers.__version__}, threads {torch.get_num_threads()}")
    log(f"command: {command}")

    # ---- corpus
    chapters, n_verses, pkg_version = load_corpus(Path(args.corpus))
    log(f"corpus: {n_verses} verses, {len(chapters)} chapters, {len({c[0] for c in chapters})} books "
        f"(bible-kjv {pkg_version})")
    rng = random.Random(args.seed)
    n_val = max(1, round(len(chapters) * args.val_frac))
    val_idx = set(rng.sample(range(len(chapters)), n_val))
    train_ch = [c for i, c in enumerate(chapters) if i not in val_idx]
    val_ch = [c for i, c in enumerate(chapters) if i in val_idx]
    val_names = [f"{b}{c}" for b, c, _ in val_ch]
    log(f"held out {len(val_ch)} chapters: {' '.join(val_names)}")
    train_texts = ["\n".join(v) for _, _, v in train_ch]
    val_texts = ["\n".join(v) for _, _, v in val_ch]

    # ---- tokenizer
    t = time.time()
    raw_tok = train_tokenizer(train_texts, args.vocab_size)
    hf_tok = wrap_tokenizer(raw_tok, 1024)
    im_end_id = raw_tok.token_to_id("<|im_end|>")
    tmp_tok_dir = out_dir / ".tokenizer-check"
    save_tokenizer(hf_tok, tmp_tok_dir)
    check_tokenizer(tmp_tok_dir, im_end_id)
    hf_tok = AutoTokenizer.from_pretrained(str(tmp_tok_dir))  # use exactly what gets shipped
    for f in tmp_tok_dir.iterdir():
        f.unlink()
    tmp_tok_dir.rmdir()
    train_ids = [e.ids for e in raw_tok.encode_batch(train_texts)]
    val_ids = [e.ids for e in raw_tok.encode_batch(val_texts)]
    n_chars = sum(len(s) for s in train_texts)
    n_tok = sum(len(s) for s in train_ids)
    log(f"tokenizer trained in {time.time() - t:.1f}s: vocab {raw_tok.get_vocab_size()}, <|im_end|>={im_end_id}; "
        f"train text {n_tok:,} tokens ({n_chars / n_tok:.2f} chars/token), val {sum(map(len, val_ids)):,} tokens")
    chat_example = hf_tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False,
                                              add_generation_prompt=True)
    log(f"chat template check: {chat_example!r}")

    data = TrainData(train_ids, [v for _, _, v in train_ch], hf_tok, args.seq_len, args.chat_frac, args.seed)
    val_seqs = pack_val(val_ids, args.seq_len)
    chat_val = []
    for _, _, v in val_ch:
        for i in range(len(v) - 1):
            prompt = hf_tok.apply_chat_template([{"role": "user", "content": v[i]}], tokenize=False,
                                                add_generation_prompt=True)
            full = chat_text(hf_tok, v[i], v[i + 1])
            p_ids = hf_tok.encode(prompt, add_special_tokens=False)
            f_ids = hf_tok.encode(full, add_special_tokens=False)
            assert f_ids[:len(p_ids)] == p_ids
            end = f_ids.index(im_end_id, len(p_ids)) + 1  # assistant content + <|im_end|>
            chat_val.append((f_ids, len(p_ids), end))
    rng.shuffle(chat_val)
    chat_val = chat_val[:200]
    log(f"train: {data.text_tokens:,} text tokens + ~{data.chat_target:,} chat tokens per epoch; "
        f"val: {len(val_seqs)} sequences, {len(chat_val)} chat samples")

    # ---- training
    target, tinfo = train("target", data, val_seqs, chat_val, args, args.target_lr, args.target_minutes * 60,
                          args.vocab_size, im_end_id)
    data_d = TrainData(train_ids, [v for _, _, v in train_ch], hf_tok, args.seq_len, args.chat_frac, args.seed + 7)
    draft, dinfo = train("draft", data_d, val_seqs, chat_val, args, args.draft_lr, args.draft_minutes * 60,
                         args.vocab_size, im_end_id)

    # ---- save (bf16)
    save_model(target, hf_tok, target_dir)
    save_model(draft, hf_tok, draft_dir)
    del target, draft
    log(f"saved {target_dir} and {draft_dir}")

    # ---- reload the shipped artifacts and evaluate
    tok = AutoTokenizer.from_pretrained(str(target_dir))
    check_tokenizer(target_dir, im_end_id)
    check_tokenizer(draft_dir, im_end_id)
    res = {}
    models_ = {}
    for name, d in (("target", target_dir), ("draft", draft_dir)):
        m16 = AutoModelForCausalLM.from_pretrained(str(d))
        assert m16.dtype == torch.bfloat16, m16.dtype
        assert isinstance(m16, LlamaForCausalLM)
        m = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32).eval()
        models_[name] = m
        res[name] = dict(params=n_params(m), val=eval_loss(m, val_seqs), chat_val=eval_chat_loss(m, chat_val),
                         files=file_sizes(d), config=json.loads((d / "config.json").read_text()))
        log(f"[{name}] shipped bf16 weights: val {res[name]['val']:.4f} nats/token "
            f"(ppl {math.exp(res[name]['val']):.1f}), chat-val {res[name]['chat_val']:.4f}, "
            f"params {res[name]['params']:,}")
        for f, s in res[name]["files"].items():
            log(f"    {d.name}/{f}: {s:,} bytes")
    target, draft = models_["target"], models_["draft"]

    samples = []
    for p in SAMPLE_PROMPTS:
        ids = tok.encode(p, add_special_tokens=False)
        for name, m in (("target", target), ("draft", draft)):
            new, txt = generate_text(m, tok, ids, args.sample_tokens, [im_end_id, 0])
            samples.append(dict(model=name, kind="text", prompt=p, completion=txt, n=len(new)))
            log(f"[{name}] {p!r} -> {txt!r}")
    for q in CHAT_PROMPTS:
        prompt = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        ids = tok.encode(prompt, add_special_tokens=False)
        for name, m in (("target", target), ("draft", draft)):
            new, txt = generate_text(m, tok, ids, args.sample_tokens, [im_end_id, 0])
            samples.append(dict(model=name, kind="chat", prompt=q, completion=txt, n=len(new),
                                ended=bool(new) and new[-1] == im_end_id))
            log(f"[{name}] chat {q!r} -> {txt!r}")

    # chat turn-ending rate on held-out verses
    vrng = random.Random(args.seed + 99)
    held_verses = [v[i] for _, _, v in val_ch for i in range(len(v))]
    chat_q = vrng.sample(held_verses, min(30, len(held_verses)))
    ended = 0
    for q in chat_q:
        prompt = tok.apply_chat_template([{"role": "user", "content": q}], tokenize=False, add_generation_prompt=True)
        new, _ = generate_text(target, tok, tok.encode(prompt, add_special_tokens=False), 96, [im_end_id, 0])
        ended += bool(new) and new[-1] == im_end_id
    im_end_rate = ended / len(chat_q)
    log(f"[target] chat replies ending with <|im_end|> within 96 tokens: {ended}/{len(chat_q)}")

    # greedy draft agreement on held-out verse prefixes
    prefixes = []
    for v in vrng.sample(held_verses, min(args.agree_prompts, len(held_verses))):
        words = v.split()
        prefixes.append(" ".join(words[:max(3, len(words) // 2)]))
    prompt_ids = [tok.encode(p, add_special_tokens=False) for p in prefixes]
    agree, tpf = agreement(target, draft, prompt_ids, args.agree_tokens)
    log(f"greedy draft agreement: {agree:.4f} over {len(prefixes)} held-out prefixes x {args.agree_tokens} tokens; "
        f"greedy speculative decoding with k=4 would emit {tpf:.2f} tokens per target forward")

    total_bytes = sum(res["target"]["files"].values()) + sum(res["draft"]["files"].values())
    assert total_bytes < 30 * 1024 * 1024, total_bytes
    wall = time.time() - T0
    write_readme(out_dir / "README.md", args, command, pkg_version, n_verses, chapters, val_names, raw_tok, n_tok,
                 n_chars, im_end_id, data, tinfo, dinfo, res, samples, im_end_rate, len(chat_q), agree, tpf,
                 len(prefixes), total_bytes, wall)
    log(f"wrote {out_dir / 'README.md'}; total {human(total_bytes)} in model dirs; wall time {wall / 60:.1f} min")


def write_readme(path, args, command, pkg_version, n_verses, chapters, val_names, raw_tok, n_tok, n_chars, im_end_id,
                 data, tinfo, dinfo, res, samples, im_end_rate, n_chat_q, agree, tpf, n_prefixes, total_bytes, wall):
    def cfg_line(c):
        keys = ["hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                "head_dim", "vocab_size", "max_position_embeddings", "rms_norm_eps", "tie_word_embeddings",
                "bos_token_id", "eos_token_id", "pad_token_id"]
        parts = [f"{k}={json.dumps(c.get(k))}" for k in keys]
        parts.append("rope_theta=" + json.dumps(c.get("rope_theta", (c.get("rope_parameters") or {}).get("rope_theta"))))
        parts.append("dtype=bfloat16")
        return ", ".join(parts)

    def hist_table(info):
        rows = ["| step | tokens | train min | train loss | val loss |", "|---:|---:|---:|---:|---:|"]
        for h in info["history"]:
            tl = "" if h["train_loss"] is None else f"{h['train_loss']:.3f}"
            rows.append(f"| {h['step']} | {h['tokens'] / 1e6:.2f}M | {h['train_s'] / 60:.1f} | {tl} | {h['val_loss']:.3f} |")
        return "\n".join(rows)

    def files_table():
        rows = ["| file | bytes |", "|---|---:|"]
        for name, d in (("target", "kjv-llama"), ("draft", "kjv-llama-draft")):
            for f, s in res[name]["files"].items():
                rows.append(f"| `{d}/{f}` | {s:,} |")
        return "\n".join(rows)

    def sample_block(kind):
        out = []
        for s in samples:
            if s["kind"] != kind:
                continue
            out.append(f"- **{s['model']}**, prompt `{json.dumps(s['prompt'])}` ->\n  `{json.dumps(s['completion'])}`")
        return "\n".join(out)

    t, d = res["target"], res["draft"]
    text = f"""# Embedded default model: `kjv-llama` (+ draft `kjv-llama-draft`)

Tiny Llama-architecture causal LMs trained from scratch on the King James Bible.
They exist so that stepserve has a real, self-contained model for tests, demos
and benchmarks on machines without network access: real weights, a real
byte-level BPE tokenizer with a chat template, and a matching smaller draft
model for speculative decoding. They are *not* useful language models beyond
producing KJV-flavoured text.

Both directories load offline with stock `transformers`:

```python
from transformers import AutoTokenizer, AutoModelForCausalLM
tok = AutoTokenizer.from_pretrained("engine/assets/kjv-llama")
model = AutoModelForCausalLM.from_pretrained("engine/assets/kjv-llama")  # bfloat16 weights
```

## Corpus and licence

- Source: Debian package `bible-kjv` (version {pkg_version}, text from
  `bible-kjv-text`), dumped with `bible -f "{BIBLE_RANGE}"`: {n_verses:,} verses,
  {len(chapters):,} chapters, one verse per line (`Ge1:1 In the beginning ...`);
  the verse labels are stripped. ASCII only.
- The KJV text (1611) is out of copyright (public domain; the Crown's letters-patent
  restriction applies only within the United Kingdom). Debian's
  `/usr/share/doc/bible-kjv/copyright` says: "The copyright for the King James Version
  text of the Bible is expired since the translation was done in 1611"; the Bible
  Retrieval System data files (Chip Chapin, HP, 1989) are "provided for unrestricted
  use ... Users may copy, modify or distribute this file at will" provided the legend is
  kept; the program code is GPL-2+. Only model weights derived from the text are
  shipped here, not the corpus or the program.
- Split: chapters are documents; {len(val_names)} chapters (~{args.val_frac:.0%}, seed {args.seed}) are held
  out for validation: {' '.join(val_names)}.

## Reproduce

```
apt-get install -y bible-kjv
{command}
```

(`--target-minutes {args.target_minutes:g} --draft-minutes {args.draft_minutes:g} --threads {args.threads}`
are the wall-clock budgets and CPU threads used; the learning-rate schedule follows the
fraction of the budget used, so the exact number of steps depends on machine speed.)
Training ran in float32 on CPU ({args.threads} thread(s)), torch {torch.__version__},
transformers {transformers.__version__}; total wall time of the command {wall / 60:.1f} min.

## Tokenizer

- Byte-level BPE trained with `tokenizers` on the training chapters: vocab {raw_tok.get_vocab_size()}
  (256 byte symbols + merges + 3 specials), `ByteLevel(add_prefix_space=False)` pre-tokenizer,
  `ByteLevel` decoder (any UTF-8 round-trips), {n_chars / n_tok:.2f} characters/token on the corpus.
- Special tokens: `<|endoftext|>` = 0 (bos, eos and pad for plain text; separates
  documents in training), `<|im_start|>` = 1, `<|im_end|>` = {im_end_id} (ends a chat turn).
- The tokenizer adds no special tokens by itself: plain text in, plain ids out.
- ChatML chat template: `<|im_start|>{{role}}\\n{{content}}<|im_end|>\\n` per message,
  plus `<|im_start|>assistant\\n` with `add_generation_prompt=True`.
- `config.json` / `generation_config.json` list `eos_token_id = [{im_end_id}, 0]` so generation stops at
  either `<|im_end|>` or `<|endoftext|>`.

## Training data

Chapters (verses joined by `\\n`) separated by `<|endoftext|>`, plus chat samples making up
~{args.chat_frac:.0%} of the training tokens (resampled every epoch): user = one verse, assistant = the
next verse, rendered with the chat template (so the model answers in KJV style and ends its turn
with `<|im_end|>`). Everything is packed into sequences of {args.seq_len} tokens. Per epoch:
{data.text_tokens:,} text tokens + ~{data.chat_target:,} chat tokens.
AdamW (betas 0.9/0.95, weight decay {args.weight_decay} on matrices), gradient clipping 1.0,
linear warmup over {args.warmup_frac:.0%} of the budget then cosine decay to {args.min_lr_frac:g} x peak.

## Models

| | target `kjv-llama` | draft `kjv-llama-draft` |
|---|---|---|
| parameters | {t['params']:,} | {d['params']:,} |
| layers / hidden / MLP | {t['config']['num_hidden_layers']} / {t['config']['hidden_size']} / {t['config']['intermediate_size']} | {d['config']['num_hidden_layers']} / {d['config']['hidden_size']} / {d['config']['intermediate_size']} |
| heads / kv heads (GQA) | {t['config']['num_attention_heads']} / {t['config']['num_key_value_heads']} | {d['config']['num_attention_heads']} / {d['config']['num_key_value_heads']} |
| peak lr | {tinfo['peak_lr']:g} | {dinfo['peak_lr']:g} |
| batch | {tinfo['batch_size']} x {tinfo['seq_len']} | {dinfo['batch_size']} x {dinfo['seq_len']} |
| steps / tokens / epochs | {tinfo['steps']:,} / {tinfo['tokens'] / 1e6:.2f}M / {tinfo['epochs']:.2f} | {dinfo['steps']:,} / {dinfo['tokens'] / 1e6:.2f}M / {dinfo['epochs']:.2f} |
| training time | {tinfo['train_s'] / 60:.1f} min ({tinfo['tok_per_s']:,.0f} tok/s) | {dinfo['train_s'] / 60:.1f} min ({dinfo['tok_per_s']:,.0f} tok/s) |
| **held-out val loss** (shipped bf16 weights) | **{t['val']:.4f}** nats/token (ppl {math.exp(t['val']):.1f}) | **{d['val']:.4f}** nats/token (ppl {math.exp(d['val']):.1f}) |
| val loss, fp32 weights before rounding | {tinfo['final_val_fp32']:.4f} | {dinfo['final_val_fp32']:.4f} |
| held-out chat reply loss (assistant turn incl. `<|im_end|>`) | {t['chat_val']:.4f} | {d['chat_val']:.4f} |

Target: {cfg_line(t['config'])}.

Draft: {cfg_line(d['config'])}.

Both: `LlamaForCausalLM`, SiLU MLP, no biases, RoPE (default), tied input/output embeddings,
weights stored as bfloat16 safetensors. Total size of both directories: {total_bytes:,} bytes
({human(total_bytes)}).

{files_table()}

### Loss curves

Target:

{hist_table(tinfo)}

Draft:

{hist_table(dinfo)}

## Evaluation of the shipped weights

Greedy draft agreement: for {n_prefixes} held-out verse prefixes (first half of the verse, at
least 3 words) the target generates {args.agree_tokens} greedy tokens; at each position the draft's
argmax given the same prefix equals the target's token **{agree:.1%}** of the time. In greedy
speculative decoding with 4 draft tokens per step this gives {tpf:.2f} tokens per target forward pass.

Chat: {im_end_rate:.0%} of target replies to {n_chat_q} held-out verses (as user messages) end with
`<|im_end|>` within 96 tokens.

Greedy samples ({args.sample_tokens} new tokens max, no BOS prepended, stopping at `<|im_end|>`/`<|endoftext|>`):

{sample_block('text')}

Chat samples (prompt rendered with the chat template and `add_generation_prompt=True`):

{sample_block('chat')}
"""
    path.write_text(text)


if __name__ == "__main__":
    main()
