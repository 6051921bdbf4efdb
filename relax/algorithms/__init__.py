"""Pure tensor functions of the RL algorithms and their registry (dependency-light)."""

from relax.algorithms.spec import ALGORITHM_SPECS, AlgorithmSpec, get_algorithm

__all__ = ["ALGORITHM_SPECS", "AlgorithmSpec", "get_algorithm"]
