"""An example third-party Miles plugin: the ``median_grpo`` algorithm, built from a new advantage estimator
(``group_median``) and a new loss term (``drift``) over Miles' composable policy-gradient algorithm."""

from miles_algorithm_example.algorithm import MedianGRPO, MedianGRPOSettings

__all__ = ["MedianGRPO", "MedianGRPOSettings"]
__version__ = "0.1.0"
