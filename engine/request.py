"""Engine-side request state and the outputs handed to callers."""

from __future__ import annotations

from dataclasses import dataclass, field

from stepserve.engine.detokenizer import IncrementalDetokenizer, find_stop, partial_stop_len
from stepserve.engine.sampling_params import SamplingParams
from stepserve.scheduler.sequence import Seq, SeqStatus

FINISHED = SeqStatus.FINISHED


@dataclass
class TokenLogprob:
    token_id: int
    logprob: float
    top: list[tuple[int, float]]  # most likely alternatives, best first
    rank: int | None = None  # 1 + the number of tokens more likely (given for prompt tokens)


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: str | int | None = None  # the stop string or token that ended it
    logprobs: list[TokenLogprob] | None = None
    cumulative_logprob: float | None = None
    stage: int = 0  # a fork/join request's stage this output belongs to (0: the first)
    error: str | None = None  # with finish_reason "abort": why its output constraint could not be followed

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestMetrics:
    arrival_time: float
    first_token_time: float | None = None
    finished_time: float | None = None
    first_scheduled_time: float | None = None  # first admitted into the running batch


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics
    # per prompt token (None for the first), when asked for (SamplingParams.prompt_logprobs);
    # in a stream, in the first delta after the prompt is computed
    prompt_logprobs: list[TokenLogprob | None] | None = None

    def merge(self, later: "RequestOutput") -> "RequestOutput":
        """Folds the delta that came after this one into it: the result is one
        delta covering both (text and tokens joined per choice, the later
        finish state). A streaming consumer that fell behind sends one chunk
        instead of several."""
        by_index = {o.index: o for o in self.outputs}
        for o in later.outputs:
            mine = by_index.get(o.index)
            if mine is None:
                by_index[o.index] = o
                self.outputs.append(o)
                continue
            mine.text += o.text
            mine.token_ids += o.token_ids
            if o.logprobs is not None:
                mine.logprobs = (mine.logprobs or []) + o.logprobs
            mine.finish_reason, mine.stop_reason, mine.error = o.finish_reason, o.stop_reason, o.error
            mine.cumulative_logprob = o.cumulative_logprob
        self.outputs.sort(key=lambda o: o.index)
        self.finished = later.finished
        self.prompt_logprobs = self.prompt_logprobs or later.prompt_logprobs
        self.num_cached_tokens = later.num_cached_tokens
        self.metrics = later.metrics
        return self


@dataclass(eq=False)
class Branch:
    """Per-branch text state: detokenizer, stop strings, what was sent."""

    seq: Seq
    detok: IncrementalDetokenizer
    text: str = ""
    logprobs: list[TokenLogprob] | None = None
    cumulative_logprob: float = 0.0
    stop_reason: str | int | None = None
    detok_pos: int = 0  # output tokens fed to the detokenizer so far
    sent_text: int = 0
    sent_tokens: int = 0
    done_reported: bool = False
    stage: int = 0
    error: str | None = None  # its logits processor gave up (a grammar too complex to follow): ended "abort"


@dataclass(eq=False)
class Request:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    params: SamplingParams
    arrival_time: float
    branches: list[Branch] = field(default_factory=list)
    num_cached_tokens: int = 0
    finished_time: float | None = None
    first_scheduled_time: float | None = None  # when a sequence of it was first admitted
    prompt_logprobs: list[TokenLogprob | None] | None = None  # filled as the prompt is computed
    prompt_logprobs_sent: bool = False
    stages_left: int = 0  # a fork/join request: stages not started yet

    @property
    def plain_greedy(self) -> bool:
        """One argmax serves its rows: no sampling tensors at all."""
        p = self.params
        return p.greedy and not p.needs_penalties and not p.logit_bias and p.logprobs is None and p.min_tokens == 0

    @property
    def seqs(self) -> list[Seq]:
        return [b.seq for b in self.branches]

    @property
    def finished(self) -> bool:
        return self.stages_left == 0 and all(b.seq.finished for b in self.branches)

    def sync_text(self, branch: Branch, upto: int | None = None) -> str | None:
        """Detokenizes the output tokens not yet turned into text; returns the
        stop string they completed, if any (the text is cut there).

        Text is built lazily: the step loop syncs every step only requests
        with stop strings (a stop must end the sequence at once); for the
        others it happens when an output is built, so an offline batch
        detokenizes once at the end and the step loop stays lean. `upto`:
        sync only the sequence's first `upto` tokens."""
        seq = branch.seq
        ids = seq.token_ids
        end = len(ids)  # (an end index, not a slice: this runs per row per step)
        if upto is not None:  # only the first `upto` tokens (a speculative run's, one at a time)
            end = min(upto, end)
        elif end and ids[-1] < 0:  # a placeholder: the token is still on its way (overlap schedule)
            end -= 1
        start = seq.prompt_len + branch.detok_pos
        if start >= end or branch.stop_reason is not None and isinstance(branch.stop_reason, str):
            return None
        add = branch.detok.add
        new = add(ids[start]) if end - start == 1 else "".join([add(ids[j]) for j in range(start, end)])
        branch.detok_pos = end - seq.prompt_len
        if not new:
            return None
        branch.text += new
        stops = self.params.stop
        if not stops or end - seq.prompt_len <= self.params.min_tokens:
            # (as vLLM: a stop string ends a branch only from its (min_tokens + 1)-th token on, the earliest a
            # stop token or EOS may come; one completed before that is output text)
            return None
        hit = find_stop(branch.text, stops, len(new))
        if hit is None:
            return None
        i, stop = hit
        branch.text = branch.text[: i + len(stop)] if self.params.include_stop_str_in_output else branch.text[:i]
        branch.stop_reason = stop
        return stop

    def flush_text(self, branch: Branch, stop_token: bool = False) -> None:
        """At the end of a branch, emits what the detokenizer still buffers (an
        incomplete UTF-8 sequence decodes to U+FFFD), so the final text equals
        decoding all output tokens at once. `stop_token`: it ended on an end
        or stop token, whose text is not output (as vLLM leaves it out) unless
        `include_stop_str_in_output`; the token itself stays in its ids."""
        if branch.stop_reason is not None and isinstance(branch.stop_reason, str):
            return  # truncated at a stop string: the tail is not part of the output
        self.sync_text(branch)
        ids = branch.seq.output_ids
        if stop_token and not self.params.include_stop_str_in_output:
            # (the token came in this step, so none of its text was sent yet)
            full = branch.detok.decode_all(ids[:-1])
            if len(full) >= branch.sent_text:
                branch.text = full
            return
        full = branch.detok.decode_all(ids)
        if full.startswith(branch.text) and len(full) > len(branch.text):
            branch.text = full

    def output(self, delta: bool) -> RequestOutput:
        """Whole outputs, or (delta=True) only what was not sent before.

        While a branch is running, text that could be the start of a stop string
        is held back, so a stop string never leaks into a stream.
        """
        # (runs per row per step in the engine loop: positional constructors, no properties in the loop)
        outs = []
        stops = self.params.stop
        done = self.stages_left == 0  # the request's `finished`, gathered on the way
        first = None  # the earliest first-token time of its branches
        for i, b in enumerate(self.branches):
            seq = b.seq
            self.sync_text(b)
            reason = seq.finish_reason
            ended = seq.status is FINISHED
            done = done and ended
            ft = seq.first_token_time
            if ft is not None and (first is None or ft < first):
                first = ft
            text = b.text
            if stops and not ended:
                text = text[: len(text) - partial_stop_len(text, stops)]
            ids, start = seq.token_ids, seq.prompt_len
            end = len(ids)
            if end > start and ids[-1] < 0:  # a placeholder: the token is still on its way (overlap schedule)
                end -= 1
            lps = b.logprobs
            if delta:
                if b.done_reported:
                    continue
                t0, k0 = b.sent_text, b.sent_tokens
                b.sent_text, b.sent_tokens = max(len(text), t0), end - start
                b.done_reported = reason is not None
                text = text[t0:]
                start += k0  # only the tokens not sent before (no copy of the whole output per step)
                lps = None if lps is None else lps[k0:]
                if not text and start >= end and reason is None:
                    continue
            outs.append(CompletionOutput(i, text, ids[start:end], reason, b.stop_reason, lps,
                                         b.cumulative_logprob if b.logprobs is not None else None, b.stage,
                                         b.error))
        prompt_lps = None
        if self.prompt_logprobs is not None and first is not None:  # complete once a token was sampled
            if not (delta and self.prompt_logprobs_sent):
                prompt_lps = self.prompt_logprobs
                self.prompt_logprobs_sent = self.prompt_logprobs_sent or delta
        return RequestOutput(self.request_id, self.prompt, self.prompt_ids, outs, done, self.num_cached_tokens,
                             RequestMetrics(self.arrival_time, first, self.finished_time, self.first_scheduled_time),
                             prompt_lps)
