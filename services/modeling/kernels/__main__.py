"""`make kernels` (python -m services.modeling.kernels): build the CPU kernels now, not in the first worker."""

import logging
import sys

from services.modeling.kernels import cpu_kernels

logging.basicConfig(level=logging.INFO)
module = cpu_kernels()
print(f"CPU kernels: {module.__file__ if module else 'unavailable; workers use the PyTorch reference ops'}")
sys.exit(0)
