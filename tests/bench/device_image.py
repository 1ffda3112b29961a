"""Run a module as the lent GPU machine would, as far as packages go: ``python -m
tests.bench.device_image REPORT.json MODULE [ARGS...]`` runs MODULE as ``__main__`` and writes to
REPORT.json every third-party package that the project's own code (services.*, bench.*) imported
beyond what that machine's image has. Packages imported by those packages themselves (what
transformers pulls in when it is there) are theirs, not ours."""

from __future__ import annotations

import builtins
import json
import runpy
import sys

# the lent GPU machine's image (bench/gpu/fetch_wheels.sh lists what would travel as wheels)
DEVICE_IMAGE = frozenset({"torch", "transformers", "safetensors", "tokenizers", "grpc", "google", "numpy", "pytest"})
OURS = ("services", "bench")


def main(argv: list[str]) -> int:
    report, module, args = argv[0], argv[1], argv[2:]
    beyond: dict[str, set[str]] = {}
    real_import = builtins.__import__

    def watched(name, globals=None, locals=None, fromlist=(), level=0):
        importer = (globals or {}).get("__name__", "")
        top = name.split(".")[0]
        if (level == 0 and importer.split(".")[0] in OURS and top not in OURS and top not in DEVICE_IMAGE
                and top not in sys.stdlib_module_names):
            beyond.setdefault(top, set()).add(importer)
        return real_import(name, globals, locals, fromlist, level)

    builtins.__import__ = watched
    sys.argv = [module, *args]
    code = 0
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    finally:
        builtins.__import__ = real_import
        with open(report, "w") as f:
            json.dump({k: sorted(v) for k, v in beyond.items()}, f)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
