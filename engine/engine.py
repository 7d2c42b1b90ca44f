"""`Engine`: the model, tokenizer and KV pool behind the shared step loop
(`scheduler.core.EngineCore`), and what a step's tokens mean to a request:
logprobs, prompt logprobs, stop strings, text."""

from __future__ import annotations

import collections
import json
import logging
import operator
import os
import random
import time
from dataclasses import dataclass, field
from typing import Sequence

import torch

from stepserve.engine import cpu_features, host_memory
from stepserve.engine.defaults import DEFAULT_DRAFT_MODEL, DEFAULT_MODEL
from stepserve.engine.attention import TorchAttention
from stepserve.engine.attention_flashinfer import FlashInferAttention, flashinfer_unavailable
from stepserve.engine.cuda_graph import DecodeGraphs, MixedGraphs
from stepserve.engine.detokenizer import IncrementalDetokenizer
from stepserve.engine.inference import inference
from stepserve.engine.loader import load_model
from stepserve.engine.model_runner import ModelRunner
from stepserve.engine.request import Branch, Request, TokenLogprob
from stepserve.engine.sampler import derive_seed
from stepserve.engine.sampling_params import SamplingParams
from stepserve.engine.speculative import (PROPOSERS, TOKEN_MAP_FILE, DraftModelProposer, NgramProposer,
                                          load_token_map)
from stepserve.kvcache import ReqToTokenPool, SlotAllocator, TokenKVPool
from stepserve.scheduler.branch_admission import BranchAdmissionSpec
from stepserve.scheduler.core import EngineCore, Stage
from stepserve.scheduler.errors import RequestError
from stepserve.scheduler.kv_manager import KVManager
from stepserve.scheduler.limits import Limits
from stepserve.scheduler.plan import StepPlan
from stepserve.scheduler.policies import branch_admission_policy, policy_stats, speculation_policy
from stepserve.scheduler.policy import StepPolicy
from stepserve.scheduler.scheduler import Scheduler, SchedulerConfig
from stepserve.scheduler.speculation import CPU_QUIET, CPU_SETTLE, SETTLE, SpecLengthSpec

log = logging.getLogger("stepserve.engine")


MAX_KV_SLOTS = (1 << 31) - 2  # slot ids (and flashinfer's page ids) are int32; one slot is the padding slot
MAX_CPU_THREADS = 1024


@dataclass
class EngineConfig:
    model: str | None = None  # Hugging Face directory; None = the embedded model
    tokenizer: str | None = None  # defaults to `model`
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda[:N]
    max_model_len: int | None = None  # default: the model's max_position_embeddings
    max_running: int = 256
    max_batched_tokens: int = 2048
    kv_slots: int | None = None  # KV pool size in tokens; default from kv_memory_gb
    # KV pool size in GiB; default: 1 on CPU, on a GPU what gpu_memory_utilization leaves
    kv_memory_gb: float | None = None
    gpu_memory_utilization: float = 0.9  # share of the GPU's memory the engine may hold (weights, KV, activations)
    admission: str = "fcfs"
    prefix_caching: bool = True
    # auto: flashinfer on CUDA where it imports, else torch (with the native CPU decode kernel where it
    # builds) | torch (SDPA, the reference) | flashinfer
    attention_backend: str = "auto"
    enforce_eager: bool = False  # no CUDA graphs for decode steps (they are used with flashinfer on CUDA)
    # steps with prompt chunks as CUDA graphs cut at the attention calls (`cuda_graph.MixedGraphs`): auto = where
    # decode steps run graphs (flashinfer on CUDA, not enforce_eager) | on (on the CPU: the same pieces, uncaptured)
    # | off
    mixed_step_graphs: str = "auto"
    # schedule and launch each step while the one before runs on the device (`EngineCore._step_overlap`):
    # auto = on CUDA without speculation | on | off. On the CPU the host is the device: nothing to hide.
    overlap_schedule: str = "auto"
    seed: int = 0  # seeds the per-request seeds of requests that give none
    check_invariants: bool = False  # run the KV integrity check after every step
    cpu_threads: int | None = None  # torch intra-op threads, process-wide (None: leave torch's setting)
    policies: list[StepPolicy] = field(default_factory=list)  # run after the built-in ones below
    # branch admission (scheduler/branch_admission.py): eager | off | cap:N | taper[:rho=R,utility=U]
    branch_policy: str = "eager"
    slo_ttft_s: float | None = None  # the SLOs TAPER plans against for requests that bring none
    slo_tpot_s: float | None = None
    latency_profile: str | None = None  # a `stepserve profile` JSON: the step model TAPER starts from
    step_log: str | None = None  # append the loop's timeline here, one JSON line per iteration (engine/step_log.py)
    # speculative decoding (engine/speculative.py, scheduler/speculation.py): the proposer
    # (none | draft | ngram), the draft model's directory (default: the embedded draft), and how
    # many tokens to draft per step (none | fixed:K | adaptive[:kmax=K])
    speculative: str = "none"
    draft_model: str | None = None
    spec_length: str | None = None  # default: adaptive when speculative is on
    # the tokens the draft model may propose (`speculative.load_token_map`): a JSON list or .pt file of token
    # ids; None: the draft directory's `speculative_token_map.json` where it has one, else every token;
    # "none": every token
    speculative_token_map: str | None = None

    def __post_init__(self):
        if not isinstance(self.branch_policy, str):
            raise ValueError(f"branch_policy must be a string (eager, off, cap:N or taper[:...]), got "
                             f"{self.branch_policy!r}")
        BranchAdmissionSpec.parse(self.branch_policy)
        for p in self.policies:
            if not all(callable(getattr(p, m, None)) for m in ("plan", "observe")):
                raise ValueError(f"policies: {p!r} is not a step policy (it needs plan and observe methods)")
        if self.speculative not in PROPOSERS:
            raise ValueError(f"speculative must be one of {', '.join(PROPOSERS)}, not {self.speculative!r}")
        if self.draft_model is not None and self.speculative != "draft":
            raise ValueError("draft_model is given but speculative is not 'draft'")
        if self.speculative_token_map is not None and self.speculative != "draft":
            raise ValueError("speculative_token_map is given but speculative is not 'draft'")
        if self.spec_length is not None:
            SpecLengthSpec.parse(self.spec_length)
            if self.speculative == "none":
                raise ValueError("spec_length is given but speculative is 'none' (draft or ngram)")
        for name in ("prefix_caching", "enforce_eager", "check_invariants"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        for name in ("max_running", "max_batched_tokens", "kv_slots", "max_model_len", "cpu_threads"):
            v = getattr(self, name, None)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 1):
                raise ValueError(f"{name} must be a positive integer, got {v!r}")
        if self.kv_slots is not None and self.kv_slots > MAX_KV_SLOTS:
            raise ValueError(f"kv_slots must be at most {MAX_KV_SLOTS} (slot ids are 32-bit), got {self.kv_slots}")
        if self.cpu_threads is not None and self.cpu_threads > MAX_CPU_THREADS:  # (torch crashes far beyond)
            raise ValueError(f"cpu_threads must be at most {MAX_CPU_THREADS}, got {self.cpu_threads}")
        try:
            if isinstance(self.seed, bool):
                raise TypeError
            self.seed = operator.index(self.seed)
        except TypeError:
            raise ValueError(f"seed must be an integer, got {self.seed!r}") from None
        if self.device != "auto":
            try:
                dev = torch.device(self.device)
            except (RuntimeError, TypeError):
                raise ValueError(f"device must be auto, cpu or cuda[:N], not {self.device!r}") from None
            if dev.type not in ("cpu", "cuda"):
                raise ValueError(f"device must be auto, cpu or cuda[:N], not {self.device!r}")
            if dev.type == "cuda" and not torch.cuda.is_available():
                raise ValueError(f"device {self.device!r}: this torch sees no CUDA device")
        if self.overlap_schedule not in ("auto", "on", "off"):
            raise ValueError(f"overlap_schedule must be auto, on or off, not {self.overlap_schedule!r}")
        if self.mixed_step_graphs not in ("auto", "on", "off"):
            raise ValueError(f"mixed_step_graphs must be auto, on or off, not {self.mixed_step_graphs!r}")
        if self.overlap_schedule == "on" and self.speculative != "none":
            raise ValueError("overlap_schedule 'on' cannot be combined with speculative decoding (a step's "
                             "drafts need the tokens of the step before on the host)")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"unknown attention backend {self.attention_backend!r} "
                             f"({', '.join(ATTENTION_BACKENDS)})")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.kv_memory_gb is not None and not 0 < self.kv_memory_gb < float("inf"):
            raise ValueError(f"kv_memory_gb must be a positive finite number, got {self.kv_memory_gb}")
        for name in ("slo_ttft_s", "slo_tpot_s"):
            v = getattr(self, name)
            if v is not None and not v > 0:
                raise ValueError(f"{name} must be positive, got {v}")

    def resolved_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)


ATTENTION_BACKENDS = ("auto", "torch", "flashinfer")


def activation_reserve_bytes(cfg, dtype: torch.dtype, max_batched_tokens: int, max_rows: int,
                             mixed_graphs: bool = False) -> int:
    """GPU memory kept free of the KV pool for one step's work: the largest
    step's activations (twice: a layer's input and output coexist with its
    temporaries), float32 logits of every sampled row four times over (the
    sampler's copies), and 256 MiB for flashinfer's workspaces, the CUDA graphs
    and the allocator's slack. With `mixed_graphs` (`MixedGraphs`), once more
    the largest step's activations: the pieces' static buffers and their
    graphs' memory pool hold them for good, beside what an eager step uses."""
    per_token = (4 * cfg.hidden_size + 3 * cfg.intermediate_size
                 + (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim) * dtype.itemsize
    steps = 3 if mixed_graphs else 2
    return steps * max_batched_tokens * per_token + 4 * max_rows * cfg.vocab_size * 4 + (256 << 20)


def gpu_kv_bytes(free: int, total: int, utilization: float, reserve: int) -> int:
    """Bytes the KV pool may take once the weights are loaded: the process may
    hold `utilization` of the GPU's `total` memory, of which `total - free` is
    already in use (the weights, and anything else on the GPU), and `reserve`
    goes to activations (`activation_reserve_bytes`)."""
    return max(0, int(total * utilization) - (total - free) - reserve)


@dataclass(frozen=True)
class EngineInfo:
    """What a front end needs to know of an engine it cannot touch (one in
    another process): limits for request checks, and where the tokenizer is."""

    model: str
    tokenizer: str  # directory the tokenizer loads from
    max_model_len: int
    vocab_size: int
    kv_capacity: int
    max_running: int
    eos_token_ids: tuple[int, ...]
    dtype: str
    device: str
    # how the engine schedules, for those that model it (a profile, the simulator)
    max_batched_tokens: int = 0
    overlap_schedule: bool = False
    speculative: str = "none"
    attention_backend: str = ""
    # which prompt chunks run as decode-shaped queries (`FoldRule`): what the step model's extend prices count
    fold_tokens: int = 0
    fold_pairs: int = 0


@dataclass
class EngineStats:
    """Totals and gauges for metrics, plus the wall times of the steps taken
    since `Engine.stats(since_step)`'s argument."""

    prompt_tokens: int = 0
    generation_tokens: int = 0
    finished: dict = field(default_factory=dict)  # finish reason -> sequences
    prefix_queried_tokens: int = 0
    prefix_hit_tokens: int = 0
    retractions: int = 0
    running: int = 0  # requests with a running sequence
    waiting: int = 0  # requests with nothing running, queued
    kv_used: int = 0
    kv_capacity: int = 1
    step_times: list = field(default_factory=list)  # wall_s of steps after since_step
    # tokens per step as vLLM's iteration_tokens_total counts them: generated, plus the whole prompt of each
    # sequence that got its first token (not the tokens computed: a prefix-cache hit counts)
    step_tokens: list = field(default_factory=list)
    last_step: int = -1
    policy: dict = field(default_factory=dict)  # the step policies' own counters (`policies.policy_stats`)


@dataclass
class KVReport:
    """`Engine.kv_report()`: the integrity check passed, and these sizes."""

    busy: bool  # requests still running or waiting
    protected: int  # cached slots locked by running requests
    accounted: int  # free + cached slots; equals capacity when nothing runs
    capacity: int


@dataclass
class CacheFlush:
    """`Engine.flush_cache()`: what the prefix cache gave back, and what it kept."""

    freed: int  # cached slots freed (tokens of prefixes no request held)
    held: int  # cached slots kept: prefixes running or waiting requests hold


def _needs_tokens(seq) -> bool:
    """A sequence whose sampling reads its output on the host (a grammar's
    state): under the overlap schedule its step is sampled only once the
    step before is finished. (Penalties count the token in flight on the
    device; a processor that says `reads_output = False`, such as
    `AllowedTokens`', reads none.)"""
    proc = seq.logits_processor
    return proc is not None and getattr(proc, "reads_output", True)


def _token_ids(tokens) -> list[int]:
    """Token ids as plain ints: Python or NumPy ints, or a 1-D integer tensor;
    a float or a bool is refused, not truncated."""
    if isinstance(tokens, (bytes, bytearray)):  # a Sequence[int] too: not a text, nor meant as ids
        raise RequestError("a prompt is a str or a sequence of token ids, not bytes (decode it first)", "prompt")
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() != 1 or tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
            raise RequestError(f"prompt token ids must be a 1-D integer tensor, got {tokens.dtype} of shape "
                               f"{tuple(tokens.shape)}", "prompt")
        return tokens.tolist()
    out = []
    for t in tokens:
        if isinstance(t, (bool, float)) or not hasattr(t, "__index__"):
            raise RequestError(f"prompt token ids must be integers, got {t!r}", "prompt")
        out.append(t.__index__())
    return out


def _positive_int(v, what: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise RequestError(f"{what} must be a positive integer, got {v!r}", "stages")
    return v


def builtin_policies(config: EngineConfig, proposer=None, device_type: str = "cpu") -> list[StepPolicy]:
    """The step policies `config` names (branch admission, speculation
    length), in their fixed order. `proposer`: the engine's, whose proposals
    the speculation length replays on the history, and asks for before the
    step's slots are reserved, when it is deterministic (the n-gram lookup).
    `device_type`: where the model runs; on a CPU the adaptive length times
    a plain step further from drafting (`CPU_SETTLE`), and a pair from plain
    decoding waits for plain steps on caches drafting or a prefill left
    alone (`CPU_QUIET`)."""
    model = costs = None
    if config.latency_profile:
        from stepserve.scheduler.latency_model import ServingCosts, load_profile

        profile = load_profile(config.latency_profile)
        model, costs = profile.model, ServingCosts.from_engine(profile.engine)
    out = []
    branch = branch_admission_policy(config.branch_policy, latency_model=model, slo_ttft_s=config.slo_ttft_s,
                                     slo_tpot_s=config.slo_tpot_s, costs=costs)
    if branch is not None:
        out.append(branch)
    if config.speculative != "none":
        ngram = isinstance(proposer, NgramProposer)
        spec = speculation_policy(config.spec_length or "adaptive", latency_model=model,
                                  replay=proposer.matches_for if ngram else None, propose=proposer.propose_for if ngram else None,
                                  settle=CPU_SETTLE if device_type == "cpu" else SETTLE,
                                  quiet=CPU_QUIET if device_type == "cpu" else 0)
        if spec is not None:
            out.append(spec)
    return out


def tokenizer_dir(config: EngineConfig) -> str:
    """The directory an engine of this config loads its tokenizer from."""
    return config.tokenizer or config.model or DEFAULT_MODEL


def load_tokenizer(path: str):
    """`AutoTokenizer.from_pretrained(path)`, offline. Where the directory's
    tokenizer_config.json names its tokenizer class (and brings no code of its
    own), AutoTokenizer is handed the model's config.json as a plain config:
    it reads only the model type and the names from it then, while loading it
    as the model's own config class imports torch.distributed and
    transformers' model-loading machinery (about 1 s, paid by every process
    that starts an engine or a server front end)."""
    from transformers import AutoTokenizer

    if not os.path.isdir(path):  # (nothing is downloaded: Hugging Face's message would be about repo ids)
        raise ValueError(f"tokenizer: {path!r} is not a directory (stepserve loads tokenizers from local "
                         "directories)")
    config = _plain_model_config(path)
    if config is None:
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    return AutoTokenizer.from_pretrained(path, local_files_only=True, config=config)


def _plain_model_config(path: str):
    """config.json as a base `PreTrainedConfig` (its model_type kept), or None
    where AutoTokenizer needs the model's own config class: no config.json, no
    tokenizer class named in tokenizer_config.json, or tokenizer code of the
    checkpoint's own (`auto_map`)."""
    from transformers import PretrainedConfig

    try:
        with open(os.path.join(path, "tokenizer_config.json")) as f:
            tok_cfg = json.load(f)
        with open(os.path.join(path, "config.json")) as f:
            model_cfg = json.load(f)
    except (OSError, ValueError):
        return None
    if not (isinstance(tok_cfg, dict) and isinstance(model_cfg, dict)) or not tok_cfg.get("tokenizer_class") \
            or "auto_map" in tok_cfg or "auto_map" in model_cfg or not model_cfg.get("model_type"):
        return None
    config = PretrainedConfig.from_dict(model_cfg)
    config._name_or_path = path  # (as AutoConfig sets it: AutoTokenizer matches some hub names on it)
    return config


def _generation_eos(model_dir: str) -> list[int]:
    path = os.path.join(model_dir, "generation_config.json")
    if not os.path.isfile(path):
        return []
    with open(path) as f:
        eos = json.load(f).get("eos_token_id")
    return [] if eos is None else ([eos] if isinstance(eos, int) else list(eos))


class Engine:
    def __init__(self, config: EngineConfig | None = None, **kwargs):
        config = config or EngineConfig(**kwargs)
        self.config = config
        host_memory.tune()  # freed activations stay mapped for the next step (`host_memory`)
        if config.cpu_threads is not None:
            torch.set_num_threads(config.cpu_threads)
        model_dir = config.model or DEFAULT_MODEL
        self.device = config.resolved_device()
        self.model_dir = model_dir
        self.tokenizer_dir = tokenizer_dir(config)
        self.model_config, self.model = load_model(model_dir, config.dtype, self.device)
        # float32 with products of many rows in bf16 (`loader.bf16_large_steps`): such steps round as bf16 does
        self.bf16_large_steps = self.model.bf16_large_steps
        mc = self.model_config
        self.dtype = next(self.model.parameters()).dtype
        self.tokenizer = load_tokenizer(self.tokenizer_dir)
        if config.max_model_len is not None and config.max_model_len > mc.max_position_embeddings:
            # as vLLM: positions past the model's context were never trained, so it is an error, not a clamp
            raise ValueError(f"max_model_len {config.max_model_len} is more than the model's context "
                             f"({mc.max_position_embeddings} tokens, max_position_embeddings in {model_dir})")
        self.max_model_len = config.max_model_len or mc.max_position_embeddings
        eos = set(mc.eos_token_ids) | set(_generation_eos(model_dir))
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        outside = sorted(t for t in eos if not 0 <= t < mc.vocab_size)
        if outside:  # the model can never sample them; the sampler's EOS mask must not index with them
            log.warning("EOS token ids %s are outside the model's vocabulary of %d; ignored", outside, mc.vocab_size)
        self.eos_token_ids = frozenset(eos - set(outside))

        draft = None
        if config.speculative == "draft":
            draft_dir = config.draft_model or DEFAULT_DRAFT_MODEL
            dcfg, dmodel = load_model(draft_dir, self.dtype, self.device,
                                      bf16_large=self.bf16_large_steps)
            if dcfg.vocab_size != mc.vocab_size:
                raise ValueError(f"the draft model's vocabulary ({dcfg.vocab_size}) differs from the target's "
                                 f"({mc.vocab_size}): it must share the target's tokenizer")
            token_map = config.speculative_token_map
            if token_map is not None and token_map != "none":
                token_map = load_token_map(token_map, mc.vocab_size)
            elif token_map is None and os.path.exists(os.path.join(draft_dir, TOKEN_MAP_FILE)):
                token_map = os.path.join(draft_dir, TOKEN_MAP_FILE)  # (a path: loaded below where it helps)
            else:
                token_map = None
            draft = (dcfg, dmodel, token_map)
        per_tok = mc.kv_bytes_per_token(self.dtype)
        if draft is not None:  # the draft's KV shares the slots: one token costs both
            per_tok += draft[0].kv_bytes_per_token(self.dtype)
        kv_slots = config.kv_slots
        if kv_slots is None:
            if config.kv_memory_gb is not None or self.device.type != "cuda":
                kv_bytes = int((config.kv_memory_gb or 1.0) * (1 << 30))
            else:
                torch.cuda.empty_cache()
                free, total = torch.cuda.mem_get_info(self.device)
                reserve = activation_reserve_bytes(mc, self.dtype, config.max_batched_tokens, config.max_running,
                                                   mixed_graphs=config.mixed_step_graphs != "off"
                                                   and not config.enforce_eager)
                kv_bytes = gpu_kv_bytes(free, total, config.gpu_memory_utilization, reserve)
            kv_slots = min(kv_bytes // per_tok, config.max_running * self.max_model_len)
            if kv_slots < self.max_model_len // 8:
                raise ValueError(f"only {kv_bytes / (1 << 30):.2f} GiB is left for the KV cache ({kv_slots} tokens) "
                                 "after the weights; raise gpu_memory_utilization or give kv_memory_gb")
        try:
            self.kv_pool = TokenKVPool(kv_slots + 1, mc.num_layers, mc.num_kv_heads, mc.head_dim, self.dtype,
                                       self.device)
        except (RuntimeError, MemoryError) as e:  # (torch.OutOfMemoryError is a RuntimeError)
            raise ValueError(f"a KV cache of {kv_slots} tokens ({kv_slots * per_tok / (1 << 30):.2f} GiB) does not "
                             f"fit in the {self.device} memory: give fewer kv_slots or less kv_memory_gb "
                             f"({str(e).splitlines()[0]})") from None
        log.info("KV cache: %d tokens (%.2f GiB) on %s", kv_slots, kv_slots * per_tok / (1 << 30), self.device)
        # the slot allocator, the req->token table and the radix tree live on the host whatever the device:
        # the scheduler's bookkeeping launches no device work, and the backends send what a step reads
        self.req_pool = ReqToTokenPool(ReqToTokenPool.rows_for(config.max_running), self.max_model_len + 1)
        kv = KVManager(SlotAllocator(kv_slots + 1), self.req_pool, config.prefix_caching)
        proposer = NgramProposer() if config.speculative == "ngram" else None
        self.policies = builtin_policies(config, proposer, self.device.type) + list(config.policies)
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_running=config.max_running,
                max_batched_tokens=config.max_batched_tokens,
                admission=config.admission,
                max_context=self.max_model_len,
                prefix_caching=config.prefix_caching,
            ),
            kv,
            self.policies,
        )
        backend = self._attention(self.kv_pool, mc, self.model)
        self.attention_backend = type(backend).__name__
        if draft is not None:
            dcfg, dmodel, token_map = draft
            dpool = TokenKVPool(kv_slots + 1, dcfg.num_layers, dcfg.num_kv_heads, dcfg.head_dim, self.dtype,
                                self.device)
            dbackend = self._attention(dpool, dcfg, dmodel)
            if isinstance(token_map, str):
                # the directory's map by default only where it makes the draft faster: the CPU's one-call greedy
                # steps, whose output head then reads the map's rows alone (elsewhere the draft's logits are
                # masked to it, which saves nothing)
                token_map = load_token_map(token_map, mc.vocab_size) if dmodel.native_step_tokens(dbackend) else None
            proposer = DraftModelProposer(dmodel, dbackend, dpool, self.req_pool, self.device, token_map)
        graphs = mixed = None
        if isinstance(backend, FlashInferAttention) and not config.enforce_eager:
            graphs = DecodeGraphs(self.model, backend, self.req_pool.table, config.max_running)
            graphs.capture()
        if config.mixed_step_graphs == "on" or (config.mixed_step_graphs == "auto" and graphs is not None):
            mixed = self._mixed_graphs(backend, config.max_batched_tokens)
        self.runner = ModelRunner(self.model, backend, self.req_pool, self.device, proposer=proposer, graphs=graphs,
                                  mixed_graphs=mixed)
        self.scheduler.fold = self.runner.fold_rule  # each plan's chunks are folded (or not) at commit, by its rule
        limits = Limits(self.max_model_len, kv.capacity, mc.vocab_size, self.req_pool.max_rows)
        overlap = config.overlap_schedule == "on" or (
            config.overlap_schedule == "auto" and self.device.type == "cuda" and proposer is None)
        self.core = EngineCore(self.scheduler, self.runner, self, limits,
                               check_every=1 if config.check_invariants else 0, overlap=overlap,
                               needs_tokens=_needs_tokens)
        self.overlap_schedule = overlap
        self.requests: dict[str, Request] = {}
        self._rng = random.Random(config.seed)
        self._next_req_id = 0
        self.totals = {"prompt_tokens": 0, "generation_tokens": 0, "finished": {}}
        self._changed: dict[str, Request] = {}  # requests a step's tokens changed (its return value)
        # (step, tokens) of recent steps as vLLM counts an iteration's tokens: those generated, plus the
        # whole prompt of each sequence that got its first token (what its iteration_tokens_total reads)
        self._iteration_tokens: collections.deque = collections.deque(maxlen=4096)

    def _mixed_graphs(self, backend, max_tokens: int) -> MixedGraphs | None:
        """The mixed-step pieces, captured; None (and a warning: those steps
        then run eagerly) where the capture fails."""
        mixed = MixedGraphs(self.model, backend, max_tokens)
        try:
            mixed.capture()
        except Exception as e:  # pragma: no cover - needs CUDA
            log.warning("mixed-step CUDA graphs could not be captured, those steps run eagerly: %s", e)
            if self.device.type == "cuda":
                torch.cuda.synchronize()
            return None
        return mixed

    def _attention(self, pool: TokenKVPool, mc, model):
        """The attention backend `config.attention_backend` names for `model`
        (of config `mc`) over `pool` (auto: flashinfer where it can serve, else
        torch); with flashinfer the model's small ops become its fused kernels."""
        choice = self.config.attention_backend
        if choice in ("auto", "flashinfer"):
            reason = flashinfer_unavailable(self.device, pool.dtype, mc.head_dim)
            if reason is None or (choice == "flashinfer" and self.device.type != "cuda"):
                # flashinfer named on a CPU: only a stand-in module can serve it (the CPU tests' fake)
                try:
                    backend = FlashInferAttention(pool, mc.num_heads, mc.num_kv_heads, mc.head_dim)
                except ImportError as e:
                    raise ValueError(f"attention_backend 'flashinfer' cannot be used: {reason} ({e})") from None
                model.use_kernels(backend.fi)
                return backend
            if choice == "flashinfer":
                raise ValueError(f"attention_backend 'flashinfer' cannot be used: {reason}")
            if self.device.type == "cuda":
                log.warning("attention backend: torch (SDPA), because %s; decode is much slower than with "
                            "flashinfer, and runs without CUDA graphs", reason)
        return TorchAttention(pool, mc.num_heads, mc.num_kv_heads, mc.head_dim,
                              native=None if choice == "auto" else False,
                              bf16_extend=getattr(model, "bf16_large_steps", False) and cpu_features.has_amx()
                              and os.environ.get("STEPSERVE_BF16_EXTEND", "1") != "0")

    @property
    def step_id(self) -> int:
        return self.core.step_id

    @property
    def records(self):
        """StepRecords of the most recent steps (a ring)."""
        return self.core.records

    # -- requests -------------------------------------------------------------
    @property
    def kv_capacity(self) -> int:
        return self.core.kv_capacity

    def tokenize(self, prompt: str, add_special_tokens: bool = True) -> list[int]:
        """A text prompt's token ids, with the special tokens the tokenizer
        adds to a text (Llama's and Mistral's BOS; none for Qwen's), as
        transformers, vLLM and SGLang tokenize a prompt. A text that continues
        one (a fork's branch suffix) or that a chat template rendered (its
        special tokens are already in the text) takes add_special_tokens=False."""
        return self.tokenizer.encode(prompt, add_special_tokens=add_special_tokens)

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        arrival_time: float | None = None,
        stages: Sequence[dict] | None = None,
        slo_ttft_s: float | None = None,
        slo_tpot_s: float | None = None,
        prompt_token_ids: Sequence[int] | None = None,
    ) -> Request:
        """`stages`: a fork/join request. Its first stage is this prompt and
        `params.max_tokens` (with n = 1); each later stage, started when the one
        before has finished, is `{"max_tokens": N}` (serial: generation goes
        on) or `{"branches": [{"prompt": SUFFIX, "max_tokens": N}, ...]}`
        (parallel: each branch continues from everything so far plus its own
        suffix, text or token ids). After a parallel stage the context is
        everything before it plus each branch's output, in branch order.

        `slo_ttft_s`, `slo_tpot_s`: this request's SLOs, which the step
        policies plan against (TAPER; default: `EngineConfig`'s).
        `prompt_token_ids`: a text prompt's ids, tokenized by the caller as
        `tokenize` would (`AsyncEngine`, which keeps tokenizing off the loop)."""
        params = (params or SamplingParams()).check_token_ids(self.model_config.vocab_size)
        if isinstance(prompt, str):
            text = prompt
            ids = self.tokenize(prompt) if prompt_token_ids is None else _token_ids(prompt_token_ids)
        else:
            text, ids = None, _token_ids(prompt)
        plen = len(ids)
        max_tokens = self.core.check_request(ids, params.max_tokens, params.n)
        for name, v in (("slo_ttft", slo_ttft_s), ("slo_tpot", slo_tpot_s)):
            if v is not None and not (isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v < 1e9):
                raise RequestError(f"{name} must be a positive number of seconds, got {v!r}", name)
        later = self._parse_stages(stages, params, max_tokens, ids) if stages else None
        if request_id is None:
            request_id = f"req-{self._next_req_id}"
            self._next_req_id += 1
        if request_id in self.requests:
            raise RequestError(f"duplicate request id {request_id!r}")
        now = time.monotonic() if arrival_time is None else arrival_time
        req = Request(request_id, text, ids, params, now)
        base_seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        full_prefill = params.prompt_logprobs is not None and plen > 1
        n_later = sum(len(st.branches) for st in later) if later else 0
        seqs = self.core.add_sequences(
            list(ids), max_tokens, now, req, seeds=[derive_seed(base_seed, b) for b in range(params.n)],
            stages=later, stage_seeds=[derive_seed(base_seed, b) for b in range(1, 1 + n_later)] if later else None,
            slo_ttft_s=slo_ttft_s, slo_tpot_s=slo_tpot_s,
            eos_token_ids=self.eos_token_ids, stop_token_ids=frozenset(params.stop_token_ids or ()),
            ignore_eos=params.ignore_eos, min_tokens=params.min_tokens, full_prefill=full_prefill,
            sampling=params, plain_greedy=req.plain_greedy,
            speculative=self.config.speculative != "none" and params.speculative
            and params.logits_processor_factory is None,
        )
        req.stages_left = len(later) if later else 0
        self._add_branches(req, seqs, ids, 0)
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None] * plen  # the first prompt token has no logprob
        self.requests[request_id] = req
        self.totals["prompt_tokens"] += plen
        return req

    def _add_branches(self, req: Request, seqs: list, context: list[int], stage: int) -> None:
        params = req.params
        for seq in seqs:
            branch = Branch(seq, IncrementalDetokenizer(self.tokenizer, context, params.skip_special_tokens),
                            stage=stage)
            if params.logprobs is not None:
                branch.logprobs = []
            if params.logits_processor_factory is not None:
                seq.logits_processor = params.logits_processor_factory()
            req.branches.append(branch)

    def _parse_stages(self, stages, params: SamplingParams, max_tokens: int, ids: list[int]) -> list[Stage]:
        """The later stages of a fork/join request, tokenized and checked."""
        if params.n != 1:
            raise RequestError("a fork/join request (stages) takes n = 1: its branches are its stages'", "n")
        if params.prompt_logprobs is not None:
            raise RequestError("prompt_logprobs is not supported with stages", "prompt_logprobs")
        vocab = self.model_config.vocab_size
        out = []
        for k, st in enumerate(stages, start=1):
            if not isinstance(st, dict) or ("branches" in st) == ("max_tokens" in st) or set(st) - {
                    "branches", "max_tokens"}:
                raise RequestError(f"stage {k}: give either max_tokens (a serial stage) or branches "
                                   "(a parallel stage), and nothing else", "stages")
            if "max_tokens" in st:
                out.append(Stage([([], _positive_int(st["max_tokens"], f"stage {k} max_tokens"))]))
                continue
            branches = st["branches"]
            if not isinstance(branches, list) or not branches:
                raise RequestError(f"stage {k}: branches must be a non-empty list", "stages")
            parsed = []
            for b, br in enumerate(branches):
                if not isinstance(br, dict) or "max_tokens" not in br or set(br) - {"prompt", "max_tokens"}:
                    raise RequestError(f"stage {k} branch {b}: give max_tokens and, optionally, prompt", "stages")
                suffix = br.get("prompt", "")
                if isinstance(suffix, str):
                    sid = self.tokenize(suffix, add_special_tokens=False) if suffix else []
                elif isinstance(suffix, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in suffix):
                    sid = list(suffix)
                    bad = [t for t in sid if not 0 <= t < vocab]
                    if bad:
                        raise RequestError(f"stage {k} branch {b}: token ids {bad[:5]} are outside the "
                                           f"vocabulary of {vocab}", "stages")
                else:
                    raise RequestError(f"stage {k} branch {b}: prompt must be a string or token ids", "stages")
                parsed.append((sid, _positive_int(br["max_tokens"], f"stage {k} branch {b} max_tokens")))
            out.append(Stage(parsed))
        self.core.check_stages(ids, max_tokens, out)
        return out

    def staged(self, group, seqs) -> None:
        """A fork/join request's next stage began."""
        req: Request = group
        req.stages_left -= 1
        stage = req.branches[-1].stage + 1
        for seq in seqs:
            self._add_branches(req, [seq], seq.token_ids[: seq.prompt_len], stage)

    def abort_request(self, request_id: str) -> Request | None:
        req = self.requests.pop(request_id, None)
        if req is None:
            return None
        self.core.drop_stages(req)
        req.stages_left = 0
        for seq in req.seqs:
            self.scheduler.abort(seq)
        self._mark_finished(req)
        return req

    def has_unfinished(self) -> bool:
        return self.core.has_work()

    # -- the step (the loop is EngineCore's; these are its hooks) -----------------
    @inference
    def step(self) -> list[Request]:
        """Runs one forward pass; returns the requests that changed."""
        self._changed = {}
        self.core.step()
        return list(self._changed.values())

    def admitted(self, seq) -> None:
        req = seq.group
        req.num_cached_tokens = max(req.num_cached_tokens, seq.num_cached)
        if req.first_scheduled_time is None:
            req.first_scheduled_time = self.scheduler.clock()  # the clock tokens are stamped with

    def ran(self, plan: StepPlan, out) -> None:
        for pl in out.prompt_logprobs:
            store = pl.seq.group.prompt_logprobs
            for j, (tok, lp, top, rank) in enumerate(zip(pl.token_ids, pl.logprobs, pl.top, pl.ranks)):
                store[pl.first + j] = TokenLogprob(tok, lp, top, rank)
            if pl.first + len(pl.token_ids) >= pl.seq.prompt_len:
                pl.seq.full_prefill = False  # scored to the end: a retraction may reuse the cache now

    def updated(self, plan: StepPlan, out, got) -> None:
        """Logprobs, stop strings and text of the sequences that got a token."""
        sched = self.scheduler
        changed = self._changed
        ended: list[Request] = []
        want_lp = out.sampler.logprobs is not None
        if want_lp:
            lp_all = out.sampler.logprobs.tolist()
            top_ids = out.sampler.top_ids.tolist() if out.sampler.top_ids is not None else None
            top_lps = out.sampler.top_logprobs.tolist() if out.sampler.top_logprobs is not None else None
        index = {id(s): i for i, s in enumerate(out.sampler_seqs or out.seqs)} if want_lp else None
        verify = {id(r.seq): r for r in plan.verify_rows} if plan.num_verify else None
        gen0 = self.totals["generation_tokens"]
        self.totals["generation_tokens"] += len(got)
        prompts = 0
        for seq in got:
            if seq.num_output == 1:
                prompts += seq.prompt_len
            req: Request = seq.group
            branch = req.branches[seq.branch]
            if verify is not None and id(seq) in verify:
                if self._took_run(req, branch, seq, verify[id(seq)], out):
                    ended.append(req)
                changed[req.request_id] = req
                continue
            tok = seq.token_ids[-1]
            if branch.logprobs is not None:
                i = index[id(seq)]
                k = req.params.logprobs or 0
                top = list(zip(top_ids[i][:k], top_lps[i][:k])) if k and top_ids is not None else []
                branch.logprobs.append(TokenLogprob(tok, lp_all[i], top))
                branch.cumulative_logprob += lp_all[i]
            proc = seq.logits_processor
            if proc is not None and getattr(proc, "error", None) is not None:
                self._constraint_failed(seq, branch, proc.error)
                ended.append(req)
                changed[req.request_id] = req
                continue
            stop = req.sync_text(branch) if req.params.stop else None
            if stop is not None:
                if not seq.finished:
                    sched.finish(seq, "stop")
                # (a token that is also a stop token, or the last max_tokens allows: the stop string still
                # decides the text and the stop reason, as in a speculative run, `_took_run`)
            elif seq.finished:
                if seq.finish_reason == "stop" and tok in seq.stop_token_ids:
                    branch.stop_reason = tok
                req.flush_text(branch, seq.finish_reason == "stop")
            if stop is not None or seq.finished:
                ended.append(req)
            changed[req.request_id] = req
        for req in ended:
            if req.finished:
                self._mark_finished(req)
        self._iteration_tokens.append((self.core.step_id, prompts + self.totals["generation_tokens"] - gen0))

    def _constraint_failed(self, seq, branch: Branch, error: str) -> None:
        """Its logits processor gave up before the output was complete (a
        grammar grown past llguidance's limits): the token it allowed is the
        end token, which would read as a complete output; the branch ends
        "abort" with the reason instead, and its text as it was."""
        log.warning("request %s: output constraint given up: %s", seq.group.request_id, error.splitlines()[0])
        if seq.finished:
            seq.finish_reason = "abort"
        else:
            self.scheduler.finish(seq, "abort")
        branch.stop_reason, branch.error = None, error
        seq.group.flush_text(branch)

    def _took_run(self, req: Request, branch: Branch, seq, row, out) -> bool:
        """A verify row's tokens (accepted drafts and the token after them):
        logprobs, stop strings -- which cut the run at the token that
        completes one -- and text. True if the branch ended."""
        ids = seq.token_ids
        end = len(ids)
        first = row.start + 1  # its length before this step
        stop = None
        if req.params.stop:
            for j in range(first + 1, end + 1):
                stop = req.sync_text(branch, upto=j)
                if stop is not None:
                    if j < end or not seq.finished:
                        self.scheduler.finish(seq, "stop", num_tokens=j)
                    end = j
                    break
        self.totals["generation_tokens"] += end - first - 1  # what the run kept; `updated` counted one
        if branch.logprobs is not None:
            for tok, (lp, top) in zip(ids[first:end], out.verify_logprobs[id(seq)]):
                branch.logprobs.append(TokenLogprob(tok, lp, top))
                branch.cumulative_logprob += lp
        if stop is None and seq.finished:
            if seq.finish_reason == "stop" and ids[-1] in seq.stop_token_ids:
                branch.stop_reason = ids[-1]
            req.flush_text(branch, seq.finish_reason == "stop")
        return stop is not None or seq.finished

    def _mark_finished(self, req: Request) -> None:
        if req.finished_time is None:
            req.finished_time = time.monotonic()
            for seq in req.seqs:
                r = seq.finish_reason or "abort"
                self.totals["finished"][r] = self.totals["finished"].get(r, 0) + 1
        self.requests.pop(req.request_id, None)

    def check(self) -> None:
        self.scheduler.check()

    # -- introspection (plain data, so it can cross a process boundary) ---------
    def info(self) -> EngineInfo:
        return EngineInfo(
            model=self.model_dir, tokenizer=self.tokenizer_dir, max_model_len=self.max_model_len,
            vocab_size=self.model_config.vocab_size, kv_capacity=self.kv_capacity,
            max_running=self.config.max_running, eos_token_ids=tuple(sorted(self.eos_token_ids)),
            dtype=str(self.dtype).removeprefix("torch."), device=str(self.device),
            max_batched_tokens=self.scheduler.cfg.max_batched_tokens, overlap_schedule=self.overlap_schedule,
            speculative=self.config.speculative, attention_backend=self.attention_backend,
            fold_tokens=self.runner.fold_rule.tokens, fold_pairs=self.runner.fold_rule.pairs,
        )

    def stats(self, since_step: int = -1) -> EngineStats:
        sched = self.scheduler
        running = {id(s.group) for s in sched.running}
        waiting = {id(s.group) for s in sched.waiting} - running
        times = []
        for rec in reversed(self.records):
            if rec.step <= since_step:
                break
            times.append(rec.wall_s)
        times.reverse()
        tokens = [n for step, n in self._iteration_tokens if step > since_step]
        return EngineStats(
            prompt_tokens=self.totals["prompt_tokens"],
            generation_tokens=self.totals["generation_tokens"],
            finished=dict(self.totals["finished"]),
            prefix_queried_tokens=sched.prefix_queried_tokens,
            prefix_hit_tokens=sched.prefix_hit_tokens,
            retractions=sched.num_retractions,
            running=len(running),
            waiting=len(waiting),
            kv_used=sched.kv.used(),
            kv_capacity=max(sched.kv.capacity, 1),
            step_times=times,
            step_tokens=tokens,
            last_step=self.step_id - 1,
            policy=policy_stats(self.policies),
        )

    def flush_cache(self) -> CacheFlush:
        """Empties the prefix cache of every prefix no request holds (SGLang's
        `/flush_cache`, vLLM's `reset_prefix_cache`), so that the next requests
        find it cold; the prefixes of running and waiting requests stay, locked,
        and go when those requests finish. Both models' KV (a draft model's
        shares the slots) are freed together, and the free slots are put back
        in order (`SlotAllocator.compact`), so that the next requests' KV lies
        in contiguous runs, as on a fresh engine, whatever the churn before."""
        kv = self.scheduler.kv
        tree = kv.tree
        freed = tree.evict(tree.evictable_size())
        kv.allocator.compact()
        return CacheFlush(freed=freed, held=tree.protected_size())

    def kv_report(self) -> KVReport:
        """Runs the KV integrity check (raises on a violation) and reports sizes."""
        self.check()
        kv = self.scheduler.kv
        return KVReport(busy=self.has_unfinished() or bool(self.requests), protected=kv.tree.protected_size(),
                        accounted=kv.allocator.available() + kv.tree.total_size(), capacity=kv.capacity)
