import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from checkpoints import make_checkpoint  # noqa: E402


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
