"""RL algorithms as pure tensor functions: advantage estimators, policy losses, KL, aggregation, controllers.

Advantage estimators and policy losses are looked up by name, so a user can add one from their own file::

    from easyrl.algorithms import register_advantage_estimator

    @register_advantage_estimator("my_adv")
    def my_adv(token_level_rewards, response_mask, index, **kwargs):
        ...
        return advantages, returns
"""

from easyrl.algorithms import advantages as _advantages  # noqa: F401  (registers the built-in estimators)
from easyrl.algorithms import policy_losses as _policy_losses  # noqa: F401  (registers the built-in losses)
from easyrl.algorithms.aggregation import LOSS_AGG_MODES, agg_count, agg_loss, masked_mean, masked_whiten
from easyrl.algorithms.controllers import (
    AdaptiveEntropyController,
    AdaptiveKLController,
    FixedKLController,
    KLController,
    get_kl_controller,
)
from easyrl.algorithms.distill import DISTILL_PENALTIES, distill_advantages, topk_forward_kl
from easyrl.algorithms.entropy import (
    entropy_from_logits,
    logprobs_from_logits,
    logprobs_from_logits_chunked,
    scale_logits,
)
from easyrl.algorithms.kl import KL_PENALTY_KINDS, kl_penalty
from easyrl.algorithms.policy_losses import ClipParams, PpoParams, SapoParams
from easyrl.algorithms.registry import (
    GROUP_ESTIMATORS,
    AdvantageFn,
    EstimatorNeeds,
    PolicyLossFn,
    UnknownNameError,
    estimator_needs,
    get_advantage_estimator,
    get_policy_loss,
    get_policy_loss_params,
    list_advantage_estimators,
    list_policy_losses,
    policy_loss_params,
    policy_loss_with_params,
    register_advantage_estimator,
    register_policy_loss,
)
from easyrl.algorithms.value import compute_value_loss


__all__ = [
    "DISTILL_PENALTIES",
    "GROUP_ESTIMATORS",
    "KL_PENALTY_KINDS",
    "LOSS_AGG_MODES",
    "AdaptiveEntropyController",
    "AdaptiveKLController",
    "AdvantageFn",
    "ClipParams",
    "EstimatorNeeds",
    "FixedKLController",
    "KLController",
    "PolicyLossFn",
    "PpoParams",
    "SapoParams",
    "UnknownNameError",
    "agg_count",
    "agg_loss",
    "compute_value_loss",
    "distill_advantages",
    "entropy_from_logits",
    "estimator_needs",
    "get_advantage_estimator",
    "get_kl_controller",
    "get_policy_loss",
    "get_policy_loss_params",
    "kl_penalty",
    "list_advantage_estimators",
    "list_policy_losses",
    "logprobs_from_logits",
    "logprobs_from_logits_chunked",
    "masked_mean",
    "masked_whiten",
    "policy_loss_params",
    "policy_loss_with_params",
    "register_advantage_estimator",
    "register_policy_loss",
    "scale_logits",
    "topk_forward_kl",
]
