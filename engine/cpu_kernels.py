"""Optional native CPU kernels, compiled on first use with torch's C++
extension loader (ninja + the system compiler, `-march=native` since the build
runs on the machine that uses it; `cpu_features` names the build after the
CPU's flags, so a shared build cache never hands a binary to a CPU that
lacks its instructions). Anything that goes wrong -- no compiler,
no ninja, a build error -- leaves the pure-torch path in charge, with a log line.
Set STEPSERVE_CPU_KERNELS=0 to skip them."""

from __future__ import annotations

import hashlib
import logging
import os
import sys
import threading

log = logging.getLogger("stepserve.cpu_kernels")

_SRC = os.path.join(os.path.dirname(os.path.abspath(__file__)), "csrc", "paged_decode_cpu.cpp")
_lock = threading.Lock()
_module = None
_tried = False


def paged_decode_module():
    """The compiled extension with `paged_decode(...)`, or None."""
    global _module, _tried
    if _tried:
        return _module
    with _lock:
        if _tried:
            return _module
        _tried = True
        if os.environ.get("STEPSERVE_CPU_KERNELS", "1") == "0":
            return None
        try:
            try:  # the `ninja` wheel puts its binary next to the interpreter or in ninja.BIN_DIR
                import ninja

                extra = [getattr(ninja, "BIN_DIR", ""), os.path.dirname(sys.executable)]
            except ImportError:
                extra = [os.path.dirname(sys.executable)]
            os.environ["PATH"] = os.pathsep.join([p for p in extra if p] + [os.environ.get("PATH", "")])
            from torch.utils.cpp_extension import load

            from stepserve.engine.cpu_features import kernel_build_tag, kernel_march

            with open(_SRC, "rb") as f:  # (two versions of stepserve on one machine keep a build each, rather
                src = hashlib.sha1(f.read()).hexdigest()[:8]  # than rebuilding over each other's)
            _module = load(
                name=f"stepserve_paged_decode_cpu_{kernel_build_tag()}_{src}",
                sources=[_SRC],
                extra_cflags=["-O3", f"-march={kernel_march()}", "-fopenmp"],
                extra_ldflags=["-fopenmp"],
                verbose=False,
            )
        except Exception as e:  # pragma: no cover - depends on the machine
            log.warning("native CPU decode attention unavailable, using the torch path: %s", e)
            _module = None
    return _module
