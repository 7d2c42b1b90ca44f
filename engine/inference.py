"""`inference`: `torch.inference_mode` around a function, entered only where
it is not on already.

A step passes through several such functions (the runner's launch, sample
and finish, the model's forward); `@torch.inference_mode()` builds and
enters a context for each call, about 4 us apiece in Python, 5% of a plain
decode step of the embedded model at batch 1. The engine's loops turn it on
once (`Engine.step`, the `AsyncEngine` loop), and the functions inside check
a flag."""

from __future__ import annotations

import functools

import torch


def inference(fn):
    @functools.wraps(fn)
    def run(*args, **kwargs):
        if torch.is_inference_mode_enabled():
            return fn(*args, **kwargs)
        with torch.inference_mode():
            return fn(*args, **kwargs)

    return run
