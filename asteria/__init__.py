"""Asteria: second-order optimizers (Shampoo, SOAP, KL-Shampoo) whose matrix refreshes run on C++
CPU workers, off the training critical path.

``asteria.optim`` holds the optimizers (native, synchronous mode); ``asteria.Runtime`` with an
``asteria.RuntimeConfig`` orchestrates their refreshes; ``asteria.lowlevel`` is the public
low-level API (the worker pool, host memory, the staging path, the spill store) for people
writing their own optimizers (docs/api.md); ``asteria.ops`` registers the matrix functions as
``torch.ops.asteria.*``. ``asteria._C`` is private.

Importing the package checks the C++ extension first (asteria/_ext.py): a missing extension, or
one built against another torch, raises ImportError saying how to rebuild.
"""

from asteria._ext import load_extension

__version__ = "0.1.0"

_C = load_extension()

# After the extension check, on purpose.
from asteria import lowlevel, ops, optim  # noqa: E402
from asteria.runtime import Runtime, RuntimeConfig  # noqa: E402

__all__ = ["Runtime", "RuntimeConfig", "__version__", "lowlevel", "ops", "optim"]
