"""A pytest plugin (``-p tests.modeling.matmul_build``): the kernels module is the matmul kernels
alone, built for ``SHARDLINE_CPU_ARCH``, so that the matmul tests run against another -march's
build without compiling every kernel a second time (test_kernels.py's AVX2 check)."""

from services.modeling import kernels

_module = kernels.matmul_kernels(kernels.cpu_arch())


def _matmul_module():
    return _module


# before the test modules import it by name: every caller, the kernels' own included, gets this one
kernels.cpu_kernels = _matmul_module
