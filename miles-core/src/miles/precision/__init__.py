"""Precision recipes: training dtypes and the format weights take on their way to the engines."""
