"""RL objectives: advantage estimators, policy losses and their composable terms (built-in plugins)."""
