"""The trajectory viewer (``miles view RUN_DIR``): a local page over a run directory — steps, groups, each
sample's prompt and response token by token with rewards, the train-vs-rollout logprob difference of each
token, loss-masked tokens shaded, multi-turn episodes turn by turn, and the metric curves."""
