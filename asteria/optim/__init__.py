"""Asteria's second-order optimizers: ``torch.optim.Optimizer`` subclasses.

``SOAP``, ``KLShampoo`` and ``Shampoo`` share one base (``base.py``: blocking, the step skeleton,
state_dict) and keep only their algorithm's math in their own file. They run synchronously
("native mode") on their own; ``asteria.Runtime`` takes their refreshes off the critical path.
"""

from asteria.optim.base import KroneckerOptimizer
from asteria.optim.blocking import FactorBudgetWarning
from asteria.optim.kl_shampoo import KLShampoo
from asteria.optim.matrix_functions import MatrixFunctionError
from asteria.optim.shampoo import Shampoo
from asteria.optim.soap import SOAP

__all__ = [
    "FactorBudgetWarning",
    "KroneckerOptimizer",
    "KLShampoo",
    "MatrixFunctionError",
    "SOAP",
    "Shampoo",
]
