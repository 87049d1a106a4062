import os as _os

# OpenBLAS threads busy-wait ~0.1 s after each call by default. Prefill runs through BLAS and decode
# steps through specdec's numba kernels on the same two cores, so the spinning threads slowed the
# first decode steps of every turn (measured; experiments/README.md, "Figures moved out of code and
# configs"). 2^4 cycles: they sleep at once. Set before NumPy
# loads OpenBLAS; an explicit setting in the environment wins.
_os.environ.setdefault("OPENBLAS_THREAD_TIMEOUT", "4")

from specdec.resolvers import register as _register_resolvers  # noqa: E402

_register_resolvers()
