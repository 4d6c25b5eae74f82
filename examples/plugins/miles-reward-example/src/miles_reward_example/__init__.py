"""An example third-party Miles plugin: the ``keyword`` reward.

Installing this distribution is all it takes: Miles finds the plugin through its ``miles.plugins``
entry point, and ``reward.functions = ["keyword"]`` selects the reward.
"""

from miles_reward_example.keyword import KeywordReward, KeywordRewardSettings

__all__ = ["KeywordReward", "KeywordRewardSettings"]
__version__ = "0.1.0"
