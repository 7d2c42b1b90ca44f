"""Turns a committed `StepPlan` into tensors, runs the model and samples."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from stepserve.engine.attention import AttentionBackend
from stepserve.engine.forward_batch import ForwardBatch
from stepserve.engine.models.llama import LlamaForCausalLM
from stepserve.engine.sampler import RowInput, Sampler, SamplerOutput, SamplingBatch, argmax_rows
from stepserve.kvcache import ReqToTokenPool
from stepserve.scheduler.plan import StepPlan
from stepserve.scheduler.sequence import Seq


@dataclass
class PromptLogprobs:
    """Logprobs of prompt tokens `first, first + 1, ...` of `seq` (each given
    the tokens before it), computed by this step's chunk of its prefill."""

    seq: Seq
    first: int  # prompt position of the first token scored
    token_ids: list[int]
    logprobs: list[float]
    top: list[list[tuple[int, float]]]  # per token, the k most likely alternatives


@dataclass
class StepOutput:
    seqs: list[Seq]  # one per sampled token, in `plan.sampling()` order
    token_ids: list[int]
    sampler: SamplerOutput
    prep_s: float = 0.0  # CPU time building the batch tensors (outside the model)
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)


# prompt positions whose full-vocabulary logits are materialised at once
_PROMPT_LOGPROBS_CHUNK = 256


class ModelRunner:
    def __init__(
        self,
        model: LlamaForCausalLM,
        backend: AttentionBackend,
        req_pool: ReqToTokenPool,
        device: torch.device,
        sampler: Sampler | None = None,
    ):
        self.model = model
        self.backend = backend
        self.req_pool = req_pool
        self.device = device
        self.sampler = sampler or Sampler()
        self.vocab_size = model.config.vocab_size
        # bf16 matmuls on CPU (oneDNN) build a kernel per input shape on first
        # sight (~1 ms per matmul, measured); the step's token count changes
        # every step, so it is padded to a small set of shapes. float32 (MKL)
        # has no such cost, and CUDA graphs bring their own buckets.
        dtype = next(model.parameters()).dtype
        self.pad_tokens = device.type == "cpu" and dtype == torch.bfloat16

    def build_batch(self, plan: StepPlan) -> tuple[ForwardBatch, list[tuple]]:
        """The flat batch of `plan`, and for the rows that want prompt logprobs
        (sequence, first position, count, flat index)."""
        dev = self.device
        rows = plan.rows
        nd = plan.num_decode
        dec = rows[:nd]
        ids: list[int] = [r.seq.token_ids[r.start] for r in dec]
        pos: list[int] = [r.start for r in dec]
        last_index: list[int] = list(range(nd))
        extend_meta = []
        table = self.req_pool.table
        prompt_rows = []
        for r in rows[nd:]:
            first = len(ids)
            if r.seq.full_prefill:  # positions p < prompt_len - 1 score the prompt token at p + 1
                k = min(r.start + r.num_new, r.seq.prompt_len - 1) - r.start
                if k > 0:
                    prompt_rows.append((r.seq, r.start, k, first))
            ids.extend(r.seq.token_ids[r.start : r.start + r.num_new])
            pos.extend(range(r.start, r.start + r.num_new))
            last_index.append(len(ids) - 1)
            extend_meta.append((first, r.num_new, table[r.seq.row, : r.start + r.num_new]))
        real = len(ids)
        pad = self.token_bucket(real) - real if self.pad_tokens else 0
        if pad:
            ids.extend([0] * pad)
            pos.extend([0] * pad)
        positions = torch.tensor(pos, dtype=torch.long)
        decode_rows = decode_lens = None
        if nd:
            decode_lens = (positions[:nd] + 1).to(dev)
            decode_rows = torch.tensor([r.seq.row for r in dec], dtype=torch.long, device=dev)
        return ForwardBatch(
            input_ids=torch.tensor(ids, dtype=torch.long, device=dev),
            positions=positions.to(dev),
            out_slots=(plan.slots if not pad else torch.cat([plan.slots, plan.slots.new_zeros(pad)])).to(dev),
            num_decode=nd,
            req_to_token=table,
            decode_rows=decode_rows,
            decode_kv_lens=decode_lens,
            extend_rows=extend_meta,
            logits_indices=torch.tensor([last_index[i] for i, _ in plan.samples], dtype=torch.long, device=dev),
            hidden_indices=torch.cat([torch.arange(f, f + k) for _, _, k, f in prompt_rows]).to(dev)
            if prompt_rows else None,
            num_padding=pad,
        ), prompt_rows

    @staticmethod
    def token_bucket(n: int) -> int:
        """Token count rounded up to one of ~50 shapes: multiples of 8 up to 64,
        of 16 up to 256, of 64 beyond."""
        step = 8 if n <= 64 else 16 if n <= 256 else 64
        return -(-n // step) * step

    @torch.inference_mode()
    def run(self, plan: StepPlan, features=None) -> StepOutput:
        """The forward pass and sampling of `plan` (`features`, the core's
        StepFeatures of it, are not needed here)."""
        t0 = time.perf_counter()
        fb, prompt_rows = self.build_batch(plan)
        prep = time.perf_counter() - t0
        logits, hidden = self.model(fb, self.backend)
        prompt_lps = self._prompt_logprobs(hidden, prompt_rows) if prompt_rows else []
        seqs = [s for _, s in plan.samples]
        if not seqs:  # prefill chunks that sample nothing still wrote their KV
            return StepOutput([], [], SamplerOutput(torch.empty(0, dtype=torch.long)), prep, prompt_lps)
        for i, s in enumerate(seqs):  # constrained decoding (grammar masks): only those rows pay
            if s.logits_processor is not None:
                s.logits_processor(s.output_ids, logits[i])
        if all(s.plain_greedy for s in seqs):
            out = SamplerOutput(token_ids=argmax_rows(logits))  # nothing else asked for
        else:
            t0 = time.perf_counter()
            batch = SamplingBatch.build([self._row_input(s) for s in seqs], self.vocab_size, self.device)
            prep += time.perf_counter() - t0
            out = self.sampler(logits, batch)
        return StepOutput(seqs, out.token_ids.tolist(), out, prep, prompt_lps)

    def _prompt_logprobs(self, hidden: torch.Tensor, rows) -> list[PromptLogprobs]:
        """Log-softmax over the vocabulary at each scored prompt position, a
        chunk of positions at a time (a full row of logits per position)."""
        targets = [t for seq, start, k, _ in rows for t in seq.token_ids[start + 1 : start + 1 + k]]
        target = torch.tensor(targets, dtype=torch.long, device=hidden.device)
        kmax = min(max(seq.sampling.prompt_logprobs for seq, *_ in rows), self.vocab_size)
        chosen, top_v, top_i = [], [], []
        for s in range(0, len(targets), _PROMPT_LOGPROBS_CHUNK):
            logp = torch.log_softmax(self.model.compute_logits(hidden[s : s + _PROMPT_LOGPROBS_CHUNK]), dim=-1)
            chosen.append(logp.gather(1, target[s : s + _PROMPT_LOGPROBS_CHUNK, None]).squeeze(1))
            if kmax:
                v, i = logp.topk(kmax, dim=-1)
                top_v.append(v)
                top_i.append(i)
        lps = torch.cat(chosen).tolist()
        tv = torch.cat(top_v).tolist() if kmax else None
        ti = torch.cat(top_i).tolist() if kmax else None
        out, at = [], 0
        for seq, start, k, _ in rows:
            kk = seq.sampling.prompt_logprobs
            top = [list(zip(ti[j][:kk], tv[j][:kk])) for j in range(at, at + k)] if kk and kmax else [[]] * k
            out.append(PromptLogprobs(seq, start + 1, targets[at : at + k], lps[at : at + k], top))
            at += k
        return out

    @staticmethod
    def _row_input(seq: Seq) -> RowInput:
        params = seq.sampling
        mask = ()
        if seq.num_output < seq.min_tokens:
            mask = tuple(seq.stop_token_ids) + (() if seq.ignore_eos else tuple(seq.eos_token_ids))
        return RowInput(
            params=params,
            seed=seq.seed,
            counter=seq.num_output,
            prompt_ids=seq.token_ids[: seq.prompt_len] if params.repetition_penalty != 1.0 else (),
            output_ids=seq.output_ids if params.needs_penalties else (),
            stop_ids_to_mask=mask,
        )
