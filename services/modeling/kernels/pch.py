"""A precompiled header of the ATen headers every kernel translation unit includes.

Each of the kernel sources parses ``ATen/core/Tensor.h`` (about 4.5 s at -O3 on a 2-core AMD
EPYC); precompiled once per build (about 9 s), it brings a unit such as ``cpu_w8a8.cpp`` from
11.6 s to 7.6 s, so a cold build of the kernels takes about 20 s less wall time.

The header is compiled with the flags torch's extension build gives every unit, and included
first in each one (``-include``). Where the flags differ (another torch, another compiler), GCC
finds the precompiled form invalid and reads the header's text instead: the build is the same,
only slower. Its file name carries a hash of the flags and the torch version, so headers of
another torch are never taken from an old precompiled form.
"""

from __future__ import annotations

import hashlib
import logging
import os
import subprocess
import sysconfig
import tempfile
from pathlib import Path

import torch
from torch.utils.cpp_extension import include_paths

try:  # private to torch: a torch without it builds the kernels without the precompiled header
    from torch.utils.cpp_extension import _get_build_directory
except ImportError:  # pragma: no cover - torch 2.4 to 2.13 all have it
    _get_build_directory = None

log = logging.getLogger(__name__)

HEADERS = ("ATen/core/Tensor.h", "ATen/Parallel.h", "immintrin.h", "vector")


def torch_cflags(name: str, extra_cflags: list[str]) -> list[str]:
    """The flags ``torch.utils.cpp_extension.load`` compiles each unit of ``name`` with (Linux)."""
    includes = [*include_paths("cpu"), sysconfig.get_path("include", scheme="posix_prefix")]
    return [f"-DTORCH_EXTENSION_NAME={name}", "-DTORCH_API_INCLUDE_EXTENSION_H",
            *(flag for path in includes for flag in ("-isystem", path)), "-fPIC", "-std=c++20", *extra_cflags]


def precompiled_header_flags(name: str, extra_cflags: list[str]) -> list[str]:
    """``-include`` flags for the kernel units of build ``name``: the header, precompiled in the
    build's directory if it is not there yet; no flags where precompiling fails."""
    if _get_build_directory is None:
        return []
    build_dir = Path(_get_build_directory(name, verbose=False))
    compiler = os.environ.get("CXX", "c++")
    cflags = torch_cflags(name, extra_cflags)
    key = hashlib.sha1("\0".join([torch.__version__, compiler, *cflags, *HEADERS]).encode()).hexdigest()[:10]
    header = build_dir / f"shardline_pch_{key}.h"
    compiled = Path(f"{header}.gch")
    if not compiled.exists():
        build_dir.mkdir(parents=True, exist_ok=True)
        header.write_text("".join(f"#include <{h}>\n" for h in HEADERS))
        # written beside, then renamed: a process building at the same time reads either none or all of it
        fd, partial = tempfile.mkstemp(dir=build_dir, suffix=".gch.partial")
        os.close(fd)
        try:
            subprocess.run([compiler, *cflags, "-x", "c++-header", str(header), "-o", partial],
                           check=True, capture_output=True, timeout=600)
            os.replace(partial, compiled)
        except (OSError, subprocess.SubprocessError) as exc:
            log.warning("no precompiled header for the CPU kernels (%s): each unit parses the ATen headers", exc)
            Path(partial).unlink(missing_ok=True)
            return []
    return ["-include", str(header), "-Winvalid-pch"]
