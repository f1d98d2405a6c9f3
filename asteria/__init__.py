"""Asteria: second-order optimizers (Shampoo, SOAP, KL-Shampoo) whose matrix refreshes run on C++
CPU workers, off the training critical path.

Importing the package checks the C++ extension first (asteria/_ext.py): a missing extension, or
one built against another torch, raises ImportError saying how to rebuild.
"""

from asteria._ext import load_extension

__version__ = "0.1.0"

_C = load_extension()

from asteria import optim  # noqa: E402  (after the extension check, on purpose)

__all__ = ["__version__", "optim"]
