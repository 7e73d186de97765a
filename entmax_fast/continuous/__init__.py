"""Continuous attention (Martins et al., NeurIPS 2020): the maths is docs/maths.md, section
"Continuous attention".

- ``one_d``: continuous softmax / sparsemax / 1.5-entmax over [0, 1], ``E_p[psi]`` and gradients;
- ``two_d``: continuous softmax / sparsemax over R^2, and the sparsemax quadrature error bound;
- ``basis``: the Gaussian RBF value function and its ridge fit (``GaussianBasis1d``);
- ``attention``: the ``ContinuousAttention`` layer built from the three above;
- ``_integrals``: the polynomial x Gaussian integral and the float64 working dtype;
- ``_checks``: the argument checks.
"""

from .attention import ContinuousAttention
from .basis import GaussianBasis1d, sequence_positions
from .one_d import continuous_density, continuous_entmax15, continuous_softmax, continuous_sparsemax
from .two_d import continuous_softmax_2d, continuous_sparsemax_2d, continuous_sparsemax_2d_error_bound

__all__ = [
    "continuous_softmax",
    "continuous_sparsemax",
    "continuous_entmax15",
    "continuous_softmax_2d",
    "continuous_sparsemax_2d",
    "continuous_sparsemax_2d_error_bound",
    "continuous_density",
    "GaussianBasis1d",
    "ContinuousAttention",
    "sequence_positions",
]
