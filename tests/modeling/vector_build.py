"""A pytest plugin (``-p tests.modeling.vector_build``): the kernels module is the kernels written
per instruction set alone (matmuls and attention), built for ``SHARDLINE_CPU_ARCH``, so that their
tests run against another -march's build without compiling every kernel a second time
(test_kernels.py's AVX2 check)."""

from services.modeling import kernels

_module = kernels.vector_kernels(kernels.cpu_arch())


def _vector_module():
    return _module


# before the test modules import it by name: every caller, the kernels' own included, gets this one
kernels.cpu_kernels = _vector_module
