"""The README runs as written.

Every fenced code block of README.md (``` or ~~~, indented ones in list items
too) is extracted and, unless marked skipped, run; one test per block, named
by the README line of its opening fence (`test_readme_block[L23-python]`).

- ```python / ```py: written to a file and run as a script with sys.executable,
  in a fresh temp dir, with a timeout (a hang guard, not a timing check).
- ```sh / ```bash / ```shell: run with `bash -e` in a fresh temp dir, with the
  directory of sys.executable (.venv/bin) first on PATH, so `stepserve`
  resolves, and the same timeout.
- A block that mentions 127.0.0.1:8000 gets a real `stepserve serve` (the
  embedded model, as `make serve` runs it) that this module starts once on
  127.0.0.1 and a free port, and stops (SIGTERM) at the end; the block's
  `127.0.0.1:8000` is rewritten to that port. Runnable blocks may not name any
  other address, and run with HF_HUB_OFFLINE=1 and proxies unset: no traffic
  leaves 127.0.0.1.

Skip marker, the one convention: the line just before the opening fence is

    <!-- doctest: skip (REASON) -->

(an HTML comment, so GitHub does not render it; the reason must not be
empty; indent it like the fence inside a list item). Use it for blocks that
cannot run here in a few seconds: `make ...`, benchmarks, anything needing a
server on port 8000 for minutes or the full ../shared traces. A skipped
```python block must still compile and a skipped shell block must pass
`bash -n`. A block in any other language (or none) that is not marked fails,
and so does a `<!-- doctest ... -->` comment that is malformed or not right
before a fence: a new block cannot drift unnoticed.

A failing block fails its test with its README line, its source and its
output. Run just this file with `pytest tests/test_readme.py` (marker
`readme`; `-m "not readme"` leaves it out).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from server_util import HOST, free_port

pytestmark = pytest.mark.readme

README = Path(__file__).resolve().parent.parent / "README.md"
BIN_DIR = os.path.dirname(sys.executable)
README_ADDR = "127.0.0.1:8000"  # what the README's client examples talk to
BLOCK_TIMEOUT_S = 300  # hang guard per block (the first engine start may compile a kernel, ~45 s)
SERVER_START_TIMEOUT_S = 300
OUTPUT_TAIL = 8000

PYTHON_LANGS = {"python", "py", "python3"}
SHELL_LANGS = {"sh", "bash", "shell"}

MARKER_RE = re.compile(r"^\s*<!--\s*doctest:\s*skip\s*\((?P<reason>[^()]*\S[^()]*)\)\s*-->\s*$")
ANY_MARKER_RE = re.compile(r"<!--\s*doctest\b", re.IGNORECASE)
FENCE_RE = re.compile(r"^(?P<indent>\s*)(?P<fence>`{3,}|~{3,})\s*(?P<info>[^`]*)$")
OTHER_URL_RE = re.compile(r"\b(?:https?|wss?)://(?!127\.0\.0\.1(?:[:/]|$))[^\s\"')]+")


@dataclass
class Block:
    line: int  # 1-based README line of the opening fence
    lang: str
    source: str
    skip: str | None  # the marker's reason, or None

    @property
    def id(self) -> str:
        return f"L{self.line}-{self.lang or 'nolang'}"

    @property
    def where(self) -> str:
        return f"README.md line {self.line} (```{self.lang} block)"


def parse_readme(text: str) -> tuple[list[Block], list[str]]:
    """The fenced blocks, and problems with doctest markers (malformed, or not
    on the line just before an opening fence)."""
    lines = text.splitlines()
    blocks: list[Block] = []
    problems: list[str] = []
    used_markers: set[int] = set()
    i = 0
    while i < len(lines):
        m = FENCE_RE.match(lines[i])
        if not m:
            i += 1
            continue
        indent, fence = len(m.group("indent")), m.group("fence")
        info = m.group("info").strip()
        lang = info.split()[0].lower() if info else ""
        start = i
        body = []
        i += 1
        while i < len(lines):
            s = lines[i].strip()
            if s and set(s) == {fence[0]} and len(s) >= len(fence):
                break
            line = lines[i]
            body.append(line[indent:] if not line[:indent].strip() else line.lstrip())
            i += 1
        else:
            problems.append(f"README.md line {start + 1}: fence never closed")
        i += 1
        skip = None
        if start > 0 and ANY_MARKER_RE.search(lines[start - 1]):
            mm = MARKER_RE.match(lines[start - 1])
            if mm:
                skip = mm.group("reason").strip()
                used_markers.add(start - 1)
        blocks.append(Block(start + 1, lang, "\n".join(body) + "\n", skip))
    for n, line in enumerate(lines):
        if ANY_MARKER_RE.search(line) and n not in used_markers:
            problems.append(f"README.md line {n + 1}: {line.strip()!r} is not a valid marker "
                            f"(`<!-- doctest: skip (REASON) -->`) on the line just before a fence")
    return blocks, problems


BLOCKS, MARKER_PROBLEMS = parse_readme(README.read_text())


def block_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if k.lower() not in {"http_proxy", "https_proxy", "all_proxy", "ftp_proxy"}
           and k not in {"STEPSERVE_API_KEY", "OPENAI_BASE_URL", "OPENAI_API_KEY"}}
    env.update(PATH=BIN_DIR + os.pathsep + env.get("PATH", ""), NO_PROXY="127.0.0.1,localhost",
               no_proxy="127.0.0.1,localhost", HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
               PYTHONUNBUFFERED="1", **extra)
    return env


def kill_group(proc: subprocess.Popen) -> None:
    """Kills what is left of a block's process group (it runs in a session of its own)."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def tail(path: Path) -> str:
    text = path.read_text(errors="replace") if path.exists() else ""
    return text if len(text) <= OUTPUT_TAIL else "[...]\n" + text[-OUTPUT_TAIL:]


def block_failure(block: Block, source: str, what: str, output: str) -> str:
    numbered = "\n".join(f"{block.line + n:4d} | {line}" for n, line in enumerate(source.splitlines(), 1))
    return f"{block.where} {what}\n--- block (as run) ---\n{numbered}\n--- output ---\n{output}"


# -- the server the client examples talk to ---------------------------------------


class ReadmeServer:
    def __init__(self, workdir: Path):
        self.port = free_port()
        self.addr = f"{HOST}:{self.port}"
        self.log = workdir / "stepserve-serve.log"
        exe = os.path.join(BIN_DIR, "stepserve")
        cmd = [exe] if os.path.exists(exe) else [sys.executable, "-m", "stepserve.cli"]
        cmd += ["serve", "--host", HOST, "--port", str(self.port), "--log-level", "warning"]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(cmd, cwd=workdir, env=block_env(), stdout=log, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)

    def wait_ready(self) -> None:
        deadline = time.monotonic() + SERVER_START_TIMEOUT_S
        with httpx.Client(trust_env=False, timeout=2) as client:
            while True:
                if self.proc.poll() is not None:
                    raise RuntimeError(f"`stepserve serve` exited {self.proc.returncode}:\n{tail(self.log)}")
                try:
                    if client.get(f"http://{self.addr}/health").status_code == 200:
                        return
                except httpx.TransportError:
                    pass
                if time.monotonic() > deadline:
                    raise RuntimeError(f"`stepserve serve` not up after {SERVER_START_TIMEOUT_S} s:\n"
                                       f"{tail(self.log)}")
                time.sleep(0.2)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        kill_group(self.proc)
        self.proc.wait()


@pytest.fixture(scope="module")
def readme_server(tmp_path_factory):
    """A real `stepserve serve` on 127.0.0.1 and a free port, started on first use."""
    srv = ReadmeServer(tmp_path_factory.mktemp("readme-server"))
    try:
        srv.wait_ready()
        yield srv
    finally:
        srv.stop()


# -- the tests --------------------------------------------------------------------------


def test_readme_has_blocks_and_well_formed_markers():
    assert BLOCKS, "no fenced code block found in README.md"
    assert not MARKER_PROBLEMS, "\n".join(MARKER_PROBLEMS)


def syntax_check(block: Block, tmp_path: Path) -> None:
    if block.lang in PYTHON_LANGS:
        error = None
        try:
            compile(block.source, f"README.md:{block.line}", "exec")
        except SyntaxError as e:
            error = repr(e)
        if error:
            pytest.fail(block_failure(block, block.source, "does not compile", error), pytrace=False)
    elif block.lang in SHELL_LANGS:
        r = subprocess.run(["bash", "-n"], input=block.source, capture_output=True, text=True, cwd=tmp_path)
        if r.returncode:
            pytest.fail(block_failure(block, block.source, "fails `bash -n`", r.stdout + r.stderr), pytrace=False)


@pytest.mark.parametrize("block", BLOCKS, ids=[b.id for b in BLOCKS])
def test_readme_block(block: Block, tmp_path: Path, request):
    if block.lang not in PYTHON_LANGS | SHELL_LANGS:
        if block.skip is None:
            pytest.fail(f"{block.where}: this test cannot run a block in language {block.lang!r}; put "
                        f"`<!-- doctest: skip (REASON) -->` on the line just before its fence", pytrace=False)
        pytest.skip(f"{block.where}: {block.skip}")
    syntax_check(block, tmp_path)
    if block.skip is not None:
        pytest.skip(f"{block.where}: {block.skip}")

    source = block.source
    other = OTHER_URL_RE.findall(source)
    if other:
        pytest.fail(f"{block.where} names {other}: runnable blocks may only talk to http://{README_ADDR} "
                    f"(or mark the block skipped)", pytrace=False)
    if README_ADDR in source:
        srv = request.getfixturevalue("readme_server")
        source = source.replace(README_ADDR, srv.addr)

    if block.lang in PYTHON_LANGS:
        script = tmp_path / f"readme_L{block.line}.py"
        cmd = [sys.executable, str(script)]
    else:
        script = tmp_path / f"readme_L{block.line}.sh"
        cmd = ["bash", "-e", str(script)]
    script.write_text(source)
    out = tmp_path / "output.txt"
    with open(out, "wb") as f:
        proc = subprocess.Popen(cmd, cwd=tmp_path, env=block_env(), stdout=f, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    try:
        rc = proc.wait(BLOCK_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        rc = None
    finally:
        kill_group(proc)  # the block's own children too (an engine process it left behind)
        proc.wait()
    if rc is None:
        pytest.fail(block_failure(block, source, f"did not finish in {BLOCK_TIMEOUT_S} s", tail(out)),
                    pytrace=False)
    if rc != 0:
        pytest.fail(block_failure(block, source, f"exited {rc}", tail(out)), pytrace=False)
