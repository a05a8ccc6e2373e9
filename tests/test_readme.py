"""README.md's Python examples run as written: extracted from the file and executed in a child process."""

from __future__ import annotations

import ast
import builtins
import os
import re
import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def python_block_after(heading: str) -> str:
    """The first ```python block after the line starting with ``heading``."""
    text = README.read_text()
    start = text.index(heading)
    m = re.compile(r"```python\n(.*?)```\n", re.S).search(text, start)
    assert m is not None, heading
    return m.group(1)


def run_python(code: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "TMPDIR": str(tmp_path)}  # tempfile.mkdtemp() in the example lands here
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)


def undefined_names(code: str) -> set[str]:
    """Names the code reads but never binds (assigns, imports, loops over) and Python does not define."""
    tree = ast.parse(code)
    bound = set(dir(builtins))
    for node in ast.walk(tree):
        if isinstance(node, ast.Name) and not isinstance(node.ctx, ast.Load):
            bound.add(node.id)
        elif isinstance(node, ast.alias):
            bound.add((node.asname or node.name).split(".")[0])
    read = {node.id for node in ast.walk(tree) if isinstance(node, ast.Name) and isinstance(node.ctx, ast.Load)}
    return read - bound


def test_adapter_example_defines_every_name_and_runs(tmp_path: Path) -> None:
    """The engine adapter's step, as the README writes it: nothing a reader has to guess."""
    code = python_block_after("## Integrating into an engine")
    assert not undefined_names(code)
    proc = run_python(code + "\nprint(len(pages), req.num_cached_tokens, k_pool.shape)\n", tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["16", "512", "(4096,", "32,", "8,", "128)"]  # 1000 tokens; a 512-token chunk


def test_api_in_short_runs(tmp_path: Path) -> None:
    code = python_block_after("## API in short")
    assert "prompt = " in code and "cuda_stream = " in code  # nothing left undefined
    proc = run_python(code, tmp_path)
    assert proc.returncode == 0, proc.stderr


def test_host_and_disk_example_runs_after_it(tmp_path: Path) -> None:
    """The tiered example continues the first one. Its quotas (1 / 2 / 4 GiB) fit a laptop; here they
    are taken in MiB so the test does not allocate 4 GiB of disk (the code is otherwise as written)."""
    first = python_block_after("## API in short")
    tiers = python_block_after("With a host and a disk tier")
    assert tiers.count("<< 30") == 4 and "512 << 30" not in tiers
    proc = run_python(first + "\n" + tiers.replace("<< 30", "<< 20"), tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert [line.split()[0] for line in proc.stdout.splitlines()] == ["0", "1", "2"]  # a row per tier


def test_retention_example_runs(tmp_path: Path) -> None:
    proc = run_python(python_block_after("## Retention the engine controls"), tmp_path)
    assert proc.returncode == 0, proc.stderr


def test_sessions_example_runs(tmp_path: Path) -> None:
    code = python_block_after("### Sessions and directives")
    assert not undefined_names(code)
    proc = run_python(code, tmp_path)
    assert proc.returncode == 0, proc.stderr


def test_hybrid_example_runs(tmp_path: Path) -> None:
    proc = run_python(python_block_after("## Hybrid models"), tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["672", "2"]
