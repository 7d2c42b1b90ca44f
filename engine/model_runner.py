"""Turns a committed `StepPlan` into tensors, runs the model and samples."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from stepserve.engine.attention import AttentionBackend
from stepserve.engine.forward_batch import ForwardBatch, ShapeLog, pads, to_device, token_bucket
from stepserve.engine.inference import inference
from stepserve.engine.models.llama import LlamaForCausalLM
from stepserve.engine.sampler import (PenaltyCounts, Sampler, SamplerOutput, SamplingBatch, argmax_rows,
                                     fill_placeholders, row_input)
from stepserve.engine.speculative import verify_rows
from stepserve.kvcache import ReqToTokenPool
from stepserve.scheduler.plan import FoldRule, StepPlan
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
    ranks: list[int] = field(default_factory=list)  # per token, 1 + the number of tokens more likely


@dataclass
class StepOutput:
    seqs: list[Seq]  # one per sampled token, in `plan.sampling()` order
    token_ids: list[int]
    sampler: SamplerOutput
    prep_s: float = 0.0  # CPU time building the batch tensors (outside the model)
    prompt_logprobs: list[PromptLogprobs] = field(default_factory=list)
    # the sequences `sampler` sampled, in its row order (None: `seqs`; verify rows are not among them)
    sampler_seqs: list[Seq] | None = None
    # verify rows that asked for logprobs: id(seq) -> (logprob, top) per token emitted this step
    verify_logprobs: dict = field(default_factory=dict)
    draft_s: float = 0.0  # of the run's time, the proposer's
    cold: bool = False  # the target's forward ran a shape it had not run before (`ModelRunner.run`)


@dataclass
class Launched:
    """A step started on the device (`ModelRunner.launch`), not yet finished."""

    plan: StepPlan
    seqs: list[Seq]  # the sampler's rows (verify rows are not among them)
    out: SamplerOutput | None  # on the device (None until sampled: `ModelRunner.sample`)
    copy: "tuple[SamplerOutput, object] | None"  # its host copy in flight, and the event that ends it
    prep: float
    cold: bool
    draft_s: float
    logits: torch.Tensor | None  # kept for the verify rows, and until sampled
    hidden: torch.Tensor | None  # kept for prompt logprobs
    prompt_rows: list
    tokens: torch.Tensor | None  # the sampled tokens on the device, in `plan.samples` order (no verify rows)
    prev: "Launched | None" = None  # the step launched before, until this one is sampled

    def wait(self) -> SamplerOutput:
        """The sampler's output on the host, once its copy has landed."""
        if self.copy is None:
            return self.out
        host, done = self.copy
        done.synchronize()
        return host


def host_copy(out: SamplerOutput):
    """Starts copying `out` from a CUDA device to pinned host memory without
    blocking: (the host `SamplerOutput`, a CUDA event recorded after the
    copies); None where `out` is already on the host."""
    if out.token_ids.device.type != "cuda":
        return None
    host = SamplerOutput(*(None if t is None else t.to("cpu", non_blocking=True)
                           for t in (out.token_ids, out.logprobs, out.top_ids, out.top_logprobs)))
    done = torch.cuda.Event()
    done.record()
    return host, done


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
        proposer=None,
        graphs=None,
        mixed_graphs=None,
    ):
        self.model = model
        self.backend = backend
        self.req_pool = req_pool
        self.device = device
        self.sampler = sampler or Sampler()
        self.proposer = proposer  # speculative decoding (engine/speculative.py): drafts the verify rows
        self.graphs = graphs  # DecodeGraphs (engine/cuda_graph.py): pure decode steps replay a CUDA graph
        self.mixed_graphs = mixed_graphs  # MixedGraphs: other steps replay graphs between eager attention calls
        self.penalty_counts: PenaltyCounts | None = None  # made when a sequence first samples with penalties
        self.vocab_size = model.config.vocab_size
        # bf16 products on the CPU build a kernel per row count: the steps from this many tokens are padded to a
        # bucket (`LlamaForCausalLM.pads_from`; None: never. CUDA graphs bring their own buckets)
        self.pads_from = model.pads_from()
        # which prompt chunks run as decode-shaped queries (`FoldRule`): all of a step of at most `tokens`
        # tokens (one native call), else each of at most `pairs` query-key pairs (through the paged kernel).
        # The engine gives it to the scheduler, which decides each plan's chunks at commit (`StepPlan.folded`)
        self.fold_rule = FoldRule(model.fold_step_tokens(backend), getattr(backend, "fold_pairs", 0))
        # a step whose forward shape is new pays one-off work on top, and says so (`StepOutput.cold`), and so
        # does a step whose draft forwards ran a new shape (`Proposer.cold`), so that what is priced from step
        # times leaves it out
        self.shapes = ShapeLog()

    def build_batch(self, plan: StepPlan) -> tuple[ForwardBatch, list[tuple]]:
        """The flat batch of `plan`, and for the rows that want prompt logprobs
        (sequence, first position, count, flat index).

        A verify row's pending token and drafts are decode-shaped queries, one
        per position, each reading its context through the req->token table;
        their logits follow those of the sampled rows (`logits_indices`)."""
        dev = self.device
        rows = plan.rows
        nd, nv = plan.num_decode, plan.num_verify
        dec = rows[:nd]
        ids: list[int] = [r.seq.token_ids[r.start] for r in dec]
        pos: list[int] = [r.start for r in dec]
        last_index: list[int] = list(range(nd))
        dec_rows = [r.seq.row for r in dec]
        verify_idx: list[int] = []
        # the step's slots as ints (`Scheduler._commit`: in row order, each row's `num_new`)
        out_slots: list[int] = plan.slots.tolist() if plan.slots is not None else []
        if nv:
            slots, out_slots, off = out_slots, out_slots[:nd], nd
            for r in rows[nd : nd + nv]:
                n = 1 + len(r.draft)
                first = len(ids)
                ids.append(r.seq.token_ids[r.start])
                ids.extend(r.draft)
                pos.extend(range(r.start, r.start + n))
                dec_rows.extend([r.seq.row] * n)
                last_index.append(first + n - 1)
                verify_idx.extend(range(first, first + n))
                out_slots.extend(slots[off : off + n])  # (the slots of drafts not made are left out)
                off += r.num_new
            out_slots.extend(slots[off:])
        ext = list(enumerate(rows[nd + nv :], nd + nv))
        last_index.extend([0] * len(ext))  # (each prompt chunk's, set below: its row's last token)
        folded = plan.folded  # (decided at commit, by the rule the scheduler has from us)
        if folded:
            # prompt chunks as decode-shaped queries, one per position, each reading its context through the
            # table (the step's KV is written first, as for a verify row's drafts)
            for (i, r), fold in zip(ext, folded):
                if fold:
                    ids.extend(r.seq.token_ids[r.start : r.start + r.num_new])
                    pos.extend(range(r.start, r.start + r.num_new))
                    dec_rows.extend([r.seq.row] * r.num_new)
                    last_index[i] = len(ids) - 1
            if not all(folded):  # the chunks' slots (in row order at the tail) follow their tokens' new order
                off = len(out_slots) - sum(r.num_new for _, r in ext)
                base, own = off, []
                for _, r in ext:
                    own.append(out_slots[off : off + r.num_new])
                    off += r.num_new
                out_slots[base:] = [x for want in (True, False) for s, fold in zip(own, folded) if fold == want
                                    for x in s]
            ext = [e for e, fold in zip(ext, folded) if not fold]
        num_dq = len(ids)  # decode-shaped queries: decode rows, every verify position, folded prompt chunks
        extend_meta = []
        table = self.req_pool.table
        prompt_rows = []
        for i, r in ext:
            first = len(ids)
            if r.seq.full_prefill:  # positions p < prompt_len - 1 score the prompt token at p + 1
                k = min(r.start + r.num_new, r.seq.prompt_len - 1) - r.start
                if k > 0:
                    prompt_rows.append((r.seq, r.start, k, first))
            ids.extend(r.seq.token_ids[r.start : r.start + r.num_new])
            pos.extend(range(r.start, r.start + r.num_new))
            last_index[i] = len(ids) - 1
            extend_meta.append((first, r.num_new, table[r.seq.row, : r.start + r.num_new]))
        real = len(ids)
        pad = token_bucket(real) - real if pads(real, self.pads_from) else 0
        if pad:
            ids.extend([0] * pad)
            pos.extend([0] * pad)
            out_slots.extend([0] * pad)
        if nv:
            a, b = plan.verify_samples()
            sampled = [last_index[i] for i, _ in plan.samples[:a] + plan.samples[b:]] + verify_idx
        else:
            sampled = [last_index[i] for i, _ in plan.samples]
        hidden = [i for _, _, k, f in prompt_rows for i in range(f, f + k)]
        # the decode-shaped queries' table rows and context lengths stay on the host (the CPU kernels and a
        # GPU backend's plan read them there)
        input_ids, positions, slots, logits_indices, hidden_indices, decode_rows, decode_lens = to_device(
            [ids, pos, out_slots, sampled, hidden], dev, [dec_rows, [p + 1 for p in pos[:num_dq]]])
        if not num_dq:
            decode_rows = decode_lens = None
        return ForwardBatch(
            input_ids=input_ids,
            positions=positions,
            out_slots=slots,
            num_decode=num_dq,
            req_to_token=table,
            decode_rows=decode_rows,
            decode_kv_lens=decode_lens,
            extend_rows=extend_meta,
            logits_indices=logits_indices,
            hidden_indices=hidden_indices if prompt_rows else None,
            num_padding=pad,
            pad_logits=pads(len(sampled), self.pads_from),
        ), prompt_rows

    def run(self, plan: StepPlan, features=None) -> StepOutput:
        """The forward pass and sampling of `plan` (`features`, the core's
        StepFeatures of it, are not needed here); verify rows are drafted by
        the proposer first, and verified after."""
        return self.finish(self.launch(plan))

    @inference
    def launch(self, plan: StepPlan, features=None, prev: "Launched | None" = None, sample: bool = True) -> "Launched":
        """Starts `plan`'s forward pass and sampling on the device and returns
        without waiting for them (on a GPU; on the CPU they are done on
        return): `finish` brings the tokens to the host. The sampled tokens
        are copied to the host as soon as they exist, behind an event, so
        that `finish` waits for them and not for work launched after.

        `prev`: the step launched before, not yet finished (overlap
        schedule): the placeholders `Scheduler.advance` left for its tokens
        (-1 - k for its k-th sample) are read from its tokens on the device.
        `sample=False`: the forward pass alone; `sample` samples later."""
        draft_s = 0.0
        nv = plan.num_verify
        if self.proposer is not None and plan.slots is not None:
            self.proposer.handed_out(plan.slots)
        if nv:
            t0 = time.perf_counter()
            self.proposer.propose(plan)
            draft_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        fb, prompt_rows = self.build_batch(plan)
        if prev is not None and prev.tokens is not None and fb.num_decode:
            fill_placeholders(fb.input_ids[: fb.num_decode], prev.tokens)
        prep = time.perf_counter() - t0
        cold = self.shapes.first_run(fb)
        if nv:
            cold |= self.proposer.cold  # the draft model's forwards, run above
        if self.graphs is not None and self.graphs.fits(fb):
            logits, hidden = self.graphs.run(fb), None
        elif self.mixed_graphs is not None and self.mixed_graphs.fits(fb) and not self.model.runs_natively(fb, self.backend):
            logits, hidden = self.mixed_graphs.run(fb), None
        else:
            logits, hidden = self.model(fb, self.backend)
        a, b = plan.verify_samples() if nv else (0, 0)
        seqs = [s for _, s in plan.samples[:a] + plan.samples[b:]]
        launched = Launched(plan, seqs, None, None, prep, cold, draft_s, logits, hidden, prompt_rows, None, prev)
        if sample:
            self.sample(launched)
        return launched

    @inference
    def sample(self, l: "Launched") -> None:
        """The second half of `launch`: samples the step's rows from its
        logits (on a GPU without waiting), and starts their copy to the host.
        `launch(sample=False)` leaves it for later: a row whose logits
        processor reads its output (a grammar) can be sampled only once the
        step before is finished (the overlap schedule finishes it while this
        step's forward runs). The rows of sequences that have ended since
        are sampled too, without their processors: their tokens are
        dropped."""
        seqs, logits, prev, nv = l.seqs, l.logits, l.prev, l.plan.num_verify
        out = SamplerOutput(torch.empty(0, dtype=torch.long))
        if seqs:
            for i, s in enumerate(seqs):  # constrained decoding (grammar masks): only those rows pay
                if s.logits_processor is not None and not s.finished:
                    s.logits_processor(s.output_ids, logits[i])
            sl = logits[: len(seqs)] if nv else logits
            if all(s.plain_greedy for s in seqs):
                out = SamplerOutput(token_ids=argmax_rows(sl))  # nothing else asked for
            else:
                t0 = time.perf_counter()
                if self.penalty_counts is None and any(s.sampling.needs_penalties for s in seqs):
                    self.penalty_counts = PenaltyCounts(self.vocab_size, self.device)
                batch = SamplingBatch.build([row_input(s, counts=True) for s in seqs], self.vocab_size, self.device,
                                            prev_tokens=prev.tokens if prev is not None else None,
                                            counts=self.penalty_counts)
                l.prep += time.perf_counter() - t0
                out = self.sampler(sl, batch)
        l.out, l.copy, l.prev = out, host_copy(out), None
        l.tokens = out.token_ids if seqs and not nv else None  # what a next step's placeholders read
        if not nv:
            l.logits = None

    @inference
    def finish(self, l: "Launched") -> StepOutput:
        """Waits for a launched step's tokens and completes its output:
        prompt logprobs, the verify rows' tokens."""
        plan, seqs, nv = l.plan, l.seqs, l.plan.num_verify
        out = l.wait()
        prompt_lps = self._prompt_logprobs(l.hidden, l.prompt_rows) if l.prompt_rows else []
        tokens = out.token_ids.tolist()
        if not nv:
            return StepOutput(seqs, tokens, out, l.prep, prompt_lps, cold=l.cold)
        a, b = plan.verify_samples()
        ver = verify_rows(plan.verify_rows, l.logits[len(seqs) :], self.vocab_size)
        # every sampled token in `plan.samples` order: the verify rows' sit between the decode rows' and the rest
        all_tokens = tokens[:a] + ver.tokens + tokens[a:]
        return StepOutput([s for _, s in plan.samples], all_tokens, out, l.prep, prompt_lps, sampler_seqs=seqs,
                          verify_logprobs={id(r.seq): lp for r, lp in zip(plan.verify_rows, ver.logprobs)
                                           if lp is not None},
                          draft_s=l.draft_s, cold=l.cold)

    def _prompt_logprobs(self, hidden: torch.Tensor, rows) -> list[PromptLogprobs]:
        """Log-softmax over the vocabulary at each scored prompt position, a
        chunk of positions at a time (a full row of logits per position)."""
        targets = [t for seq, start, k, _ in rows for t in seq.token_ids[start + 1 : start + 1 + k]]
        target = torch.tensor(targets, dtype=torch.long, device=hidden.device)
        kmax = min(max(seq.sampling.prompt_logprobs for seq, *_ in rows), self.vocab_size)
        chosen, ranks, top_v, top_i = [], [], [], []
        for s in range(0, len(targets), _PROMPT_LOGPROBS_CHUNK):
            logp = torch.log_softmax(self.model.compute_logits(hidden[s : s + _PROMPT_LOGPROBS_CHUNK]), dim=-1)
            got = logp.gather(1, target[s : s + _PROMPT_LOGPROBS_CHUNK, None])
            chosen.append(got.squeeze(1))
            ranks.append((logp > got).sum(dim=1) + 1)
            if kmax:
                v, i = logp.topk(kmax, dim=-1)
                top_v.append(v)
                top_i.append(i)
        lps = torch.cat(chosen).tolist()
        rank = torch.cat(ranks).tolist()
        tv = torch.cat(top_v).tolist() if kmax else None
        ti = torch.cat(top_i).tolist() if kmax else None
        out, at = [], 0
        for seq, start, k, _ in rows:
            kk = seq.sampling.prompt_logprobs
            top = [list(zip(ti[j][:kk], tv[j][:kk])) for j in range(at, at + k)] if kk and kmax else [[]] * k
            out.append(PromptLogprobs(seq, start + 1, targets[at : at + k], lps[at : at + k], top, rank[at : at + k]))
            at += k
        return out

