"""RL post-training with rollout-state reuse (design §10): rollouts that save endpoints, rewards,
the GRPO objective, the bptt / recompute / reuse update estimators and the training loop."""

from .estimators import ESTIMATORS, endpoint_backward, neumann_backward, score_and_backward
from .grpo import action_logprobs, clipped_policy_loss, group_advantages
from .rewards import REWARDS, Problem, ProblemSource, get_reward, register_reward
from .rollout import Rollout, SavedStateError, SavedStates, check_saved_states, parameter_version, rollout, token_hash

__all__ = [
    "ESTIMATORS",
    "REWARDS",
    "Problem",
    "ProblemSource",
    "Rollout",
    "SavedStateError",
    "SavedStates",
    "action_logprobs",
    "check_saved_states",
    "clipped_policy_loss",
    "endpoint_backward",
    "get_reward",
    "group_advantages",
    "neumann_backward",
    "parameter_version",
    "register_reward",
    "rollout",
    "score_and_backward",
    "token_hash",
]
