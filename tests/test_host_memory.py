"""The host allocator's thresholds (`engine/host_memory.py`): an engine keeps a
step's freed activations mapped instead of faulting them in again next step.

Each check runs in a fresh interpreter: the thresholds are process-wide and
glibc reads its environment variables once, at start."""

import json
import os
import platform
import subprocess
import sys

import pytest

pytestmark = pytest.mark.skipif(platform.system() != "Linux" or platform.libc_ver()[0] != "glibc",
                                reason="glibc's malloc only")

# How glibc serves an 8 MiB block: mmap'd regions (mallinfo2's hblks) before and
# after allocating it. Under glibc's defaults (an mmap threshold of 128 KiB,
# raised only after such a block is freed) the first one is a fresh mapping.
PROBE = r"""
import ctypes, json, sys
libc = ctypes.CDLL(None)

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]

libc.mallinfo2.restype = MallInfo2
libc.malloc.restype = ctypes.c_void_p
libc.malloc.argtypes = (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
out = {}
if "engine" in sys.argv:
    from stepserve.engine.engine import Engine
    from tests.checkpoints import make_checkpoint
    Engine(model=make_checkpoint(sys.argv[-1]), max_model_len=64, kv_memory_gb=0.01)
    from stepserve.engine import host_memory
    out["tune"] = host_memory.tune()
elif "tune" in sys.argv:
    from stepserve.engine import host_memory
    out["tune"] = host_memory.tune()
before = libc.mallinfo2().hblks
p = libc.malloc(8 << 20)
out["mmapped"] = libc.mallinfo2().hblks - before
libc.free(p)
print(json.dumps(out))
"""


def probe(*args, env=None) -> dict:
    e = {k: v for k, v in os.environ.items() if not k.startswith(("MALLOC_", "STEPSERVE_HOST_MALLOC"))}
    e.update(env or {})
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    r = subprocess.run([sys.executable, "-c", PROBE, *args], capture_output=True, text=True, env=e, cwd=root,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_glibc_maps_a_fresh_block_by_default():
    # the probe itself tells the two apart: without the tuning the block is its own mapping
    assert probe()["mmapped"] == 1


def test_tuned_blocks_come_from_the_heap():
    r = probe("tune")
    assert r["tune"]["applied"] is True
    assert r["mmapped"] == 0


def test_an_engine_tunes_its_process(tmp_path):
    r = probe("engine", str(tmp_path / "ckpt"))
    assert r["tune"]["applied"] is True
    assert r["mmapped"] == 0


@pytest.mark.parametrize("env", [{"STEPSERVE_HOST_MALLOC": "0"}, {"MALLOC_TRIM_THRESHOLD_": "131072"}])
def test_switched_off_or_left_to_the_user(env):
    r = probe("tune", env=env)
    assert r["tune"]["applied"] is False and r["tune"]["reason"]
    assert r["mmapped"] == 1
