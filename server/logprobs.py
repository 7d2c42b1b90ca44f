"""Token logprobs in each endpoint's own format.

A token's text is its raw bytes, decoded: byte-level BPE pieces ("Ġthe") map
back through GPT-2's byte alphabet, SentencePiece byte tokens ("<0x0A>") to
their byte. A token that is only part of a UTF-8 character is shown as
``bytes:\\xNN...`` (OpenAI's convention); chat logprobs also carry the bytes.
"""

from __future__ import annotations

import functools
import math
import re
from typing import Sequence

from stepserve.engine.request import TokenLogprob

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@functools.cache
def _byte_decoder() -> dict[str, int]:
    """Inverse of GPT-2's bytes_to_unicode."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def finite_logprob(x: float) -> float:
    # JSON has no -inf: a token the grammar forbade has logprob -inf
    return x if math.isfinite(x) else -9999.0


class TokenTexts:
    """Per-token bytes and display strings, cached (the vocabulary is fixed)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        backend = getattr(tokenizer, "backend_tokenizer", None) or getattr(tokenizer, "_tokenizer", None)
        decoder = repr(getattr(backend, "decoder", "")) if backend is not None else ""
        self.byte_level = "ByteLevel" in decoder
        try:
            self.added = {int(i) for i in tokenizer.added_tokens_decoder}
        except Exception:
            self.added = set(getattr(tokenizer, "all_special_ids", []))

    @functools.lru_cache(maxsize=1 << 16)
    def bytes_of(self, token_id: int) -> bytes:
        piece = self.tokenizer.convert_ids_to_tokens(int(token_id))
        if piece is None:
            return b""
        if token_id in self.added:
            return piece.encode("utf-8")
        if self.byte_level:
            dec = _byte_decoder()
            if all(c in dec for c in piece):
                return bytes(dec[c] for c in piece)
        m = _BYTE_TOKEN.fullmatch(piece)
        if m:
            return bytes([int(m.group(1), 16)])
        return piece.replace("\u2581", " ").encode("utf-8")

    def text_of(self, token_id: int) -> str:
        b = self.bytes_of(token_id)
        try:
            return b.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{x:02x}" for x in b)


def completion_logprobs(texts: TokenTexts, lps: Sequence[TokenLogprob | None], offset: int,
                        token_ids: Sequence[int] = ()) -> tuple[dict, int]:
    """Legacy completions format; returns it and the text offset after it.

    ``top_logprobs`` always includes the sampled token (OpenAI: "up to
    logprobs+1 elements"). An entry may be None (the first prompt token of an
    echo has no logprob): its token comes from `token_ids` and its logprob
    and alternatives are null."""
    tokens, token_lps, tops, offsets = [], [], [], []
    for j, lp in enumerate(lps):
        s = texts.text_of(lp.token_id if lp is not None else token_ids[j])
        tokens.append(s)
        offsets.append(offset)
        offset += len(s)
        if lp is None:
            token_lps.append(None)
            tops.append(None)
            continue
        token_lps.append(finite_logprob(lp.logprob))
        top = {texts.text_of(t): finite_logprob(v) for t, v in lp.top}
        top.setdefault(s, finite_logprob(lp.logprob))
        tops.append(top)
    return {"tokens": tokens, "token_logprobs": token_lps, "top_logprobs": tops, "text_offset": offsets}, offset


def join_completion_logprobs(a: dict, b: dict) -> dict:
    return {k: a[k] + b[k] for k in a}


def chat_logprobs(texts: TokenTexts, lps: Sequence[TokenLogprob]) -> dict:
    def entry(t: int, v: float) -> dict:
        return {"token": texts.text_of(t), "logprob": finite_logprob(v), "bytes": list(texts.bytes_of(t))}

    content = []
    for lp in lps:
        e = entry(lp.token_id, lp.logprob)
        e["top_logprobs"] = [entry(t, v) for t, v in lp.top]
        content.append(e)
    return {"content": content, "refusal": None}


def native_logprobs(lps: Sequence[TokenLogprob]) -> list[dict]:
    return [
        {"token_id": lp.token_id, "logprob": finite_logprob(lp.logprob),
         "top": [[t, finite_logprob(v)] for t, v in lp.top]}
        for lp in lps
    ]


def vllm_prompt_logprobs(texts: TokenTexts, lps: Sequence[TokenLogprob | None]) -> list[dict | None]:
    """vLLM's `prompt_logprobs`: per prompt token (None for the first), a dict
    from token id to {logprob, rank, decoded_token} holding the prompt's own
    token and the most likely alternatives (ranks 1, 2, ...)."""
    out: list[dict | None] = []
    for e in lps:
        if e is None:
            out.append(None)
            continue
        d = {str(t): {"logprob": finite_logprob(lp), "rank": r, "decoded_token": texts.text_of(t)}
             for r, (t, lp) in enumerate(e.top, start=1)}
        d[str(e.token_id)] = {"logprob": finite_logprob(e.logprob), "rank": e.rank,
                              "decoded_token": texts.text_of(e.token_id)}
        out.append(d)
    return out
