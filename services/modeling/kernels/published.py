"""Built kernels shared by every checkout of the same sources.

torch's extension build (ninja) decides what to recompile by file times, so a fresh clone, all of
whose files are new, compiled every kernel again (about 50 s on a 2-core AMD EPYC) though a build
of the same bytes sat in ``~/.cache/torch_extensions``. So each build is also published under a
digest of what makes its binary: the sources' bytes, the compiler flags (``-march`` with them, and
for ``-march=native`` this CPU's vendor, model and feature flags, so that another machine class
sharing the cache never loads a build it cannot run), torch's and Python's versions. A process
whose digest names a published build imports it as it is; any other builds with ninja in its own
checkout's build directory (incrementally, as an edit wants) and publishes the result.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import platform
import shutil
import sys
import tempfile
from pathlib import Path
from types import ModuleType

import torch

# torch's private build directory (None without it: builds are not published then)
from services.modeling.kernels.pch import _get_build_directory

KERNEL_DIR = Path(__file__).parent


def _this_cpu() -> str | None:
    """What ``-march=native`` compiles for: the first processor's identity and feature flags."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return None
    wanted = ("vendor_id", "cpu family", "model", "flags")
    fields = {}
    for line in text.split("\n\n", 1)[0].splitlines():
        key, _, value = line.partition(":")
        if key.strip() in wanted:
            fields[key.strip()] = value.strip()
    return repr(sorted(fields.items())) if "flags" in fields else None


def digest(sources: list[Path], cflags: list[str]) -> str | None:
    """The digest of the build of ``sources`` with ``cflags``; None where it cannot be told (a
    native build on a machine without /proc/cpuinfo)."""
    h = hashlib.sha256()
    for part in (torch.__version__, str(torch.version.git_version), sys.version, platform.machine(),
                 *(p.name for p in sources), *cflags):
        h.update(part.encode() + b"\0")
    if "-march=native" in cflags:
        cpu = _this_cpu()
        if cpu is None:
            return None
        h.update(cpu.encode())
    for path in sorted(KERNEL_DIR.iterdir()):  # every source and header a unit may include
        if path.suffix in (".cpp", ".h"):
            h.update(path.name.encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:16]


def _root() -> Path | None:
    if _get_build_directory is None:
        return None
    return Path(_get_build_directory("shardline_published", verbose=False))


def find(key: str) -> Path | None:
    """The published build of ``key``, if there is one."""
    root = _root()
    found = sorted((root / key).glob("*.so")) if root is not None else []
    return found[0] if found else None


def load(path: Path) -> ModuleType:
    """Import a published build under the name it was built with (its file's)."""
    spec = importlib.util.spec_from_file_location(path.stem, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot import {path}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def publish(key: str, built: str) -> None:
    """Copy the module ninja built to where :func:`find` looks (written beside, then renamed: a
    process looking at the same time finds all of it or none)."""
    root = _root()
    if root is None or find(key) is not None:
        return
    target = root / key / Path(built).name
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, partial = tempfile.mkstemp(dir=target.parent, suffix=".partial")
    os.close(fd)
    try:
        shutil.copyfile(built, partial)
        os.chmod(partial, 0o755)  # as the linker leaves a module
        os.replace(partial, target)
    finally:
        Path(partial).unlink(missing_ok=True)
