"""A pytest plugin (``-p tests.modeling.vector_build``): the kernels module is the kernels written
per instruction set alone (matmuls and attention), built for ``SHARDLINE_CPU_ARCH``, so that their
tests run against another -march's build without compiling every kernel a second time
(test_kernels.py's AVX2 check).

What that build leaves out, the element-wise kernels (norms, rotary, sampling: generic C++ whose
bits do not depend on a layout), comes from this machine's native build, so that a model runs on
the other -march's matmuls and attention. The fused decoder-layer call is not offered: it would
run the native matmuls; the model's per-layer path runs instead. A model's ranks are processes of
their own, started from a fork server: a ``sitecustomize`` that imports this module, put on
``PYTHONPATH``, gives every process of the run the same kernels (test_kernels.py)."""

from services.modeling import kernels

_vector = kernels.vector_kernels(kernels.cpu_arch())
_native = kernels.all_kernels("native")


class _Mixed:
    """The vector build's kernels, the native build's for the rest, no fused decoder-layer call."""

    def __getattr__(self, name: str):
        if hasattr(_vector, name):
            return getattr(_vector, name)
        if name == "decoder_layers":
            raise AttributeError(name)
        return getattr(_native, name)


_module = _Mixed()


def _vector_module():
    return _module


# before the test modules import it by name: every caller, the kernels' own included, gets this one
kernels.cpu_kernels = _vector_module
