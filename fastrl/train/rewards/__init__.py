"""The reward stage: reward functions (``functions``) and the pool that scores them (``pool``).

``fastrl.train.rewards`` hands on both rooms' names, as users import them."""

from fastrl.train.rewards.functions import (BUILTIN_REWARDS, RegexFormatReward, RewardFunction, completion_text,
                                            exact_match_reward, extract_final_answer, format_reward, math_answers_equal,
                                            math_reward, resolve_reward)
from fastrl.train.rewards.pool import NON_FINITE_TOTAL_METRIC, RewardPool, RewardResult

__all__ = ["BUILTIN_REWARDS", "NON_FINITE_TOTAL_METRIC", "RegexFormatReward", "RewardFunction", "RewardPool", "RewardResult",
           "completion_text", "exact_match_reward", "extract_final_answer", "format_reward", "math_answers_equal",
           "math_reward", "resolve_reward"]
