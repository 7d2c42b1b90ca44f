"""Decode steps replayed from CUDA graphs, one per batch-size bucket.

A decode step of b rows (with speculation: b decode-shaped queries) runs the
graph of the smallest bucket B >= b. Its inputs are copied into static buffers
and the rows b..B-1 are padding: token 0 at position 0, writing and reading
only the padding slot 0. Attention is re-planned into the bucket's fixed
buffers before each replay (`FlashInferAttention.plan_graph`); everything else
in the step -- embedding, every layer's projections, norms, rotary, KV writes,
the logits of all B rows -- is one graph launch instead of ~10 kernel launches
per layer from Python.

Steps with prefill chunks, prompt logprobs or more rows than the largest
bucket run eagerly. On a device without CUDA graphs (`capture=False`) the same
buffers, padding and plans are used and the forward runs eagerly on them: that
is how the CPU test suite checks this module against the eager path.
"""

from __future__ import annotations

import logging
import time

import torch

from stepserve.engine.forward_batch import ForwardBatch
from stepserve.engine.inference import inference

log = logging.getLogger("stepserve.engine")


def graph_buckets(max_rows: int) -> list[int]:
    """1, 2, 4, 8, 16, 32, then every 32 up to `max_rows` (which is always a bucket)."""
    if max_rows < 1:
        raise ValueError(f"max_rows must be at least 1, got {max_rows}")
    out = [b for b in (1, 2, 4, 8, 16, 32) if b < max_rows]
    b = 64
    while b < max_rows:
        out.append(b)
        b += 32
    out.append(max_rows)
    return out


def bucket_for(buckets: list[int], rows: int) -> int | None:
    for b in buckets:
        if b >= rows:
            return b
    return None


class DecodeGraphs:
    def __init__(self, model, backend, req_to_token: torch.Tensor, max_rows: int, capture: bool | None = None):
        self.model = model
        self.backend = backend
        self.table = req_to_token  # on the host (`kvcache/pool.py`); the plan reads it there
        self.device = next(model.parameters()).device
        self.capture_graphs = self.device.type == "cuda" if capture is None else capture
        self.buckets = graph_buckets(max_rows)
        bmax = self.buckets[-1]
        # the most page indices a step can name: every row at full context
        self.max_pages = bmax * req_to_token.shape[1]
        dev = self.device
        self.input_ids = torch.zeros(bmax, dtype=torch.long, device=dev)
        self.positions = torch.zeros(bmax, dtype=torch.long, device=dev)
        self.out_slots = torch.zeros(bmax, dtype=torch.long, device=dev)
        self.arange = torch.arange(bmax, dtype=torch.long, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}  # each graph's output buffer
        self.replays = 0  # steps served from a graph (or, without capture, from the static buffers)

    def _batch(self, bs: int) -> ForwardBatch:
        return ForwardBatch(
            input_ids=self.input_ids[:bs], positions=self.positions[:bs], out_slots=self.out_slots[:bs],
            num_decode=bs, req_to_token=self.table, decode_rows=None, decode_kv_lens=None,
            extend_rows=[], logits_indices=self.arange[:bs],
        )

    def _plan(self, bs: int, rows: torch.Tensor, lens: torch.Tensor) -> None:
        """`rows`, `lens`: the real rows' table rows and context lengths, on the host."""
        self.backend.plan_graph(bs, self.max_pages, self.table, rows, lens)

    @inference
    def capture(self) -> None:
        """Captures every bucket's graph, largest first (later ones reuse its
        memory pool); a no-op without CUDA graphs."""
        if not self.capture_graphs:
            return
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        none = torch.zeros(0, dtype=torch.long)
        for bs in reversed(self.buckets):
            fb = self._batch(bs)
            # every row a padding row: reads and writes slot 0 only
            self._plan(bs, none, none)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up: lazy inits and autotuning stay out of the graph
                for _ in range(2):
                    self.model.forward_planned(fb, self.backend)
            torch.cuda.current_stream().wait_stream(stream)
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g, pool=pool):
                logits, _ = self.model.forward_planned(fb, self.backend)
            self.graphs[bs], self.logits[bs] = g, logits
        torch.cuda.synchronize()
        log.info("captured %d decode CUDA graphs (batch sizes %s) in %.1f s", len(self.graphs), self.buckets,
                 time.perf_counter() - t0)

    def fits(self, fb: ForwardBatch) -> bool:
        """A pure decode step these graphs serve: decode-shaped queries only,
        no prompt logprobs, no padding."""
        return (not fb.extend_rows and fb.hidden_indices is None and not fb.num_padding
                and 0 < fb.num_decode <= self.buckets[-1])

    def run(self, fb: ForwardBatch) -> torch.Tensor:
        """Logits at `fb.logits_indices` of a step that `fits` (the graph
        computes every query's; a forking row samples its one query's logits
        several times)."""
        b = fb.num_decode
        bs = bucket_for(self.buckets, b)
        for buf, src in ((self.input_ids, fb.input_ids), (self.positions, fb.positions),
                         (self.out_slots, fb.out_slots)):
            buf[:b].copy_(src)
            if bs > b:
                buf[b:bs].zero_()
        self._plan(bs, fb.decode_rows, fb.decode_kv_lens)
        self.replays += 1
        if self.capture_graphs:
            self.graphs[bs].replay()
            logits = self.logits[bs]
        else:
            logits, _ = self.model.forward_planned(self._batch(bs), self.backend)
        return logits.index_select(0, fb.logits_indices)


# ---------------------------------------------------------------------------
# Steps with prompt chunks: the forward cut at its attention calls
# ---------------------------------------------------------------------------


def mixed_buckets(max_tokens: int) -> list[int]:
    """Token counts the mixed-step pieces are captured for: 16, 32, 64, 128,
    256, then 1.5x and 2x of each power of two (384, 512, 768, 1,024, ...)
    up to `max_tokens` (always a bucket): a step pads its tokens to the next,
    at most 1.5x its count past 256."""
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be at least 1, got {max_tokens}")
    out = [b for b in (16, 32, 64, 128) if b < max_tokens]
    b = 256
    while b < max_tokens:
        out.append(b)
        if b * 3 // 2 < max_tokens:
            out.append(b * 3 // 2)
        b *= 2
    out.append(max_tokens)
    return out


class PieceBuffers:
    """The static tensors the pieces of a forward read and write, views of
    the first `t` tokens of buffers sized for the largest bucket."""

    def __init__(self, full: dict[str, torch.Tensor], t: int):
        for name, buf in full.items():
            setattr(self, name, buf[:t])


class MixedGraphs:
    """Steps with prompt chunks (and decode steps too large for the decode
    graphs), as vLLM's piecewise CUDA graphs run them: the forward is cut at
    its attention calls into pieces (`LlamaForCausalLM.forward_piece`: the
    embedding, each layer's halves before and after attention, all of the
    products, norms, rotary and MLP); each piece is a CUDA graph per token
    bucket (`mixed_buckets`), and each attention call runs eagerly between
    two replays, planned for the step as ever (a step's ragged prompt chunks
    and contexts are a new shape each time; the pieces see only a token
    count). Eagerly such a step launches ~15 kernels per layer from Python:
    on a GPU host that took ~8-10 ms for a 28-layer 1.5B model (an H200's
    host, session 31's step log), against ~2 ms for a graphed decode step.

    The pieces run the bucket's token count, the step's tokens first and
    padding after (id 0 at position 0); the attention runs on the step's own
    tokens only, so the padding rows write no KV and carry whatever the output
    buffer holds, which no other row reads (every piece works row by row).
    The output head runs after the last piece, eagerly, on the rows that need
    logits.
    Without capture (`capture=False`, the CPU) the same buffers, padding and
    pieces run eagerly: that is how the CPU tests check this against the
    plain forward."""

    def __init__(self, model, backend, max_tokens: int, capture: bool | None = None):
        self.model = model
        self.backend = backend
        self.device = next(model.parameters()).device
        self.capture_graphs = self.device.type == "cuda" if capture is None else capture
        self.buckets = mixed_buckets(max_tokens)
        cfg = model.config
        dtype = next(model.parameters()).dtype
        dev, t = self.device, self.buckets[-1]
        hq, hkv, d, h = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim, cfg.hidden_size
        self.full = {
            "input_ids": torch.zeros(t, dtype=torch.long, device=dev),
            "positions": torch.zeros(t, dtype=torch.long, device=dev),
            "q": torch.zeros(t, hq, d, dtype=dtype, device=dev),
            "k": torch.zeros(t, hkv, d, dtype=dtype, device=dev),
            "v": torch.zeros(t, hkv, d, dtype=dtype, device=dev),
            "o": torch.zeros(t, hq, d, dtype=dtype, device=dev),
            "residual": torch.zeros(t, h, dtype=dtype, device=dev),
            "x": torch.zeros(t, h, dtype=dtype, device=dev),
        }
        self.num_pieces = len(model.model.layers) + 1
        self.graphs: dict[int, list] = {}  # bucket -> a graph per piece
        self.replays = 0  # steps served (with or without capture)

    @inference
    def capture(self) -> None:
        """Captures every bucket's pieces, largest first, in one memory pool
        (the pieces run one after another, so they may share it); a no-op
        without CUDA graphs. The attention between them is not captured."""
        if not self.capture_graphs:
            return
        t0 = time.perf_counter()
        pool = torch.cuda.graph_pool_handle()
        for t in reversed(self.buckets):
            bufs = PieceBuffers(self.full, t)
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):  # warm-up: lazy inits and autotuning stay out of the graphs
                for i in range(self.num_pieces):
                    self.model.forward_piece(i, bufs)
            torch.cuda.current_stream().wait_stream(stream)
            graphs = []
            for i in range(self.num_pieces):
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    self.model.forward_piece(i, bufs)
                graphs.append(g)
            self.graphs[t] = graphs
        torch.cuda.synchronize()
        log.info("captured %d mixed-step CUDA graph pieces (%d per token bucket %s) in %.1f s",
                 self.num_pieces * len(self.buckets), self.num_pieces, self.buckets, time.perf_counter() - t0)

    def fits(self, fb: ForwardBatch) -> bool:
        """A step these pieces serve: at most the largest bucket's tokens, no
        prompt logprobs (whose hidden states are read between chunks)."""
        return fb.hidden_indices is None and 0 < fb.input_ids.shape[0] <= self.buckets[-1]

    def run(self, fb: ForwardBatch) -> torch.Tensor:
        """Logits at `fb.logits_indices` of a step that `fits`."""
        n = fb.input_ids.shape[0]
        t = bucket_for(self.buckets, n)
        full = self.full
        full["input_ids"][:n].copy_(fb.input_ids)
        full["positions"][:n].copy_(fb.positions)
        if t > n:
            full["input_ids"][n:t].zero_()
            full["positions"][n:t].zero_()
        bufs = PieceBuffers(full, t)
        self.backend.prepare(fb)
        graphs = self.graphs.get(t) if self.capture_graphs else None
        forward = self.backend.forward
        q, k, v, o = bufs.q[:n], bufs.k[:n], bufs.v[:n], bufs.o[:n]  # the step's own tokens
        for i in range(self.num_pieces):
            if graphs is not None:
                graphs[i].replay()
            else:
                self.model.forward_piece(i, bufs)
            if i < self.num_pieces - 1:
                forward(i, q, k, v, fb, out=o)
        self.replays += 1
        logits, _ = self.model.logits_of(bufs.x, bufs.residual, fb)
        return logits
