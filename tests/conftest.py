import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from checkpoints import make_checkpoint  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def _small_gpu_kv_pools():
    """On a GPU an engine sizes its KV pool from free memory (0.9 of the GPU by
    default), so a second engine alive in the same process would find none:
    tests that give no size get 1 GiB, as on a CPU."""
    import torch

    if not torch.cuda.is_available():
        yield
        return
    from stepserve.engine.engine import EngineConfig

    post_init = EngineConfig.__post_init__

    def small(self):
        if self.kv_slots is None and self.kv_memory_gb is None:
            self.kv_memory_gb = 1.0
        post_init(self)

    EngineConfig.__post_init__ = small
    yield
    EngineConfig.__post_init__ = post_init


@pytest.fixture(scope="session")
def ckpt_factory(tmp_path_factory):
    """make(arch, dtype=..., tie=...) -> path, cached per configuration."""
    cache = {}

    def make(arch="llama", **kw):
        key = (arch, tuple(sorted((k, str(v)) for k, v in kw.items())))
        if key not in cache:
            path = str(tmp_path_factory.mktemp(f"ckpt-{arch}"))
            cache[key] = make_checkpoint(path, arch, **kw)
        return cache[key]

    return make


@pytest.fixture(scope="session")
def llama_ckpt(ckpt_factory):
    return ckpt_factory("llama")
