#!/usr/bin/env bash
# The wheels `python -m bench.gpu.check` needs on the lent GPU machine beyond its image, fetched
# here (that machine reaches no package registry).
#
# The image: Python 3.12, torch 2.11 + CUDA 13, transformers, safetensors, tokenizers, grpcio,
# protobuf, pytest (and what those depend on: numpy, ...). The check's own code imports nothing
# else today, so WHEELS is empty: tests/bench/test_gpu_check.py runs the check on the CPU and
# fails if the project's code imports a package beyond that image (tests/bench/device_image.py),
# which is when a package belongs here.
#
# A package listed below is downloaded for CPython 3.12 on manylinux x86_64 (or pure Python)
# into bench/gpu/wheels/ (git-ignored), and the total is held under the device tool's 64 MiB.
# Carry it to the device run and install it there before the check:
#   carry: ["bench/gpu/wheels"]
#   command: pip install --no-index --find-links bench/gpu/wheels bench/gpu/wheels/*.whl && python -m bench.gpu.check ...
set -euo pipefail
cd "$(dirname "$0")"

WHEELS=()  # e.g. WHEELS=("gguf==0.17.1")
LIMIT_BYTES=$((64 * 1024 * 1024))

rm -rf wheels
mkdir -p wheels
if [ ${#WHEELS[@]} -eq 0 ]; then
  echo "fetch_wheels: nothing to fetch: the device image has every package the check imports"
  exit 0
fi
python3 -m pip download --quiet --no-deps --only-binary=:all: --implementation cp --python-version 3.12 \
  --platform manylinux2014_x86_64 --platform manylinux_2_28_x86_64 --platform any -d wheels "${WHEELS[@]}"
total=$(du -cb wheels/*.whl | tail -1 | cut -f1)
if [ "$total" -gt "$LIMIT_BYTES" ]; then
  echo "fetch_wheels: ${total} bytes of wheels, over the device run's ${LIMIT_BYTES}" >&2
  exit 1
fi
echo "fetch_wheels: $(ls wheels | wc -l) wheel(s), ${total} bytes in bench/gpu/wheels/"
