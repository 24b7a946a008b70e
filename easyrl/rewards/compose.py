"""The reward `worker.reward` describes, as one function: the reward function (or, with `route_key`, one function per
domain) with the scorers each asks for bound as arguments (`judge`, `reward_model`).

Loaded the same way in the driver (to check it before anything starts, and to run it with `num_workers: 0`) and in
every reward worker process, which builds its own scorers (HTTP clients and model weights do not travel).
"""

from __future__ import annotations

import asyncio
import functools
import inspect
from collections import defaultdict
from typing import Any

from easyrl.config.worker import RewardConfig
from easyrl.rewards.loader import RewardFunction, RewardLoadError, load_reward_function
from easyrl.scorers import SCORER_ARGS, Scorers, declared_scorers


__all__ = ["RoutedReward", "load_configured_reward", "scorer_params"]


def scorer_params(reward: RewardFunction) -> tuple[set[str], set[str]]:
    """(scorer arguments the function takes, those of them it requires: no default)."""
    fn = reward.fn.func if isinstance(reward.fn, functools.partial) else reward.fn
    params = inspect.signature(fn).parameters
    takes = {name for name in SCORER_ARGS if name in params}
    required = {name for name in takes if params[name].default is inspect.Parameter.empty}
    return takes, required


def _bind(reward: RewardFunction, scorers: Scorers | None, declared: dict[str, str]) -> RewardFunction:
    """`reward` with each scorer it takes bound; a required scorer the config does not set is refused."""
    takes, required = scorer_params(reward)
    missing = sorted(required - set(declared))
    if missing:
        raise RewardLoadError(
            f"{reward.name} takes a {missing[0]!r} argument, but worker.reward.{missing[0]}.model is not set: "
            f"declare the {missing[0]} (base_url or model_path), or give the argument a default"
        )
    if scorers is None:
        return reward
    bound = {name: scorers.clients[name] for name in takes if name in scorers.clients}
    return RewardFunction(
        name=reward.name,
        fn=functools.partial(reward.fn, **bound),
        reward_type=reward.reward_type,
        reward_name=reward.reward_name,
        is_async=reward.is_async,
        path=reward.path,
        function_name=reward.function_name,
        kwargs=reward.kwargs,
    )


class RoutedReward:
    """A batch reward function that sends each input to the function of its domain (`inputs[i][route_key]`), each
    function called as its type asks (a list, or one input at a time; async ones awaited together)."""

    def __init__(self, route_key: str, routes: dict[str, RewardFunction], default: RewardFunction) -> None:
        self.route_key, self.routes, self.default = route_key, routes, default

    def __call__(self, inputs: list[dict[str, Any]]) -> list[Any]:
        groups: dict[str, list[int]] = defaultdict(list)
        for i, item in enumerate(inputs):
            groups[str(item.get(self.route_key))].append(i)
        out: list[Any] = [None] * len(inputs)
        for value, indices in groups.items():
            reward = self.routes.get(value, self.default)
            results = _call(reward, [inputs[i] for i in indices])
            if not isinstance(results, list | tuple) or len(results) != len(indices):
                raise ValueError(
                    f"{reward.name} (route {self.route_key}={value!r}) did not return one result per input"
                )
            for i, result in zip(indices, results):
                out[i] = result
        return out


def _call(reward: RewardFunction, items: list[dict[str, Any]]) -> Any:
    """One domain's inputs through its function: a batch call, or one call per input (awaited together)."""
    if reward.reward_type == "batch":
        value = reward.fn(items)
        return asyncio.run(value) if inspect.iscoroutine(value) else value
    if reward.is_async:

        async def gather() -> list[Any]:
            return list(await asyncio.gather(*(reward.fn(item) for item in items)))

        return asyncio.run(gather())
    return [reward.fn(item) for item in items]


def load_configured_reward(cfg: RewardConfig, scorers: Scorers | None) -> RewardFunction:
    """The reward function `cfg` describes, with `scorers`' clients bound (None: only check that every function
    can get the scorers it requires, and that every declared scorer has a taker)."""
    assert cfg.reward_function is not None
    declared = declared_scorers(cfg)
    main = _bind(
        load_reward_function(cfg.reward_function, cfg.reward_function_kwargs, cfg.reward_type), scorers, declared
    )
    routes = {
        value: _bind(load_reward_function(spec, cfg.route_kwargs.get(value, {}), cfg.reward_type), scorers, declared)
        for value, spec in cfg.routes.items()
    }
    takers = set().union(*(scorer_params(r)[0] for r in (main, *routes.values())))
    unused = sorted(set(declared) - takers)
    if unused:
        raise RewardLoadError(
            f"worker.reward.{unused[0]} is set, but no reward function takes a {unused[0]!r} argument: add "
            f"{unused[0]} to the parameters of {main.name} (or of a routed function), e.g. "
            f"def compute_score(reward_inputs, {unused[0]}): ..."
        )
    if cfg.route_key is None:
        return main
    router = RoutedReward(cfg.route_key, routes, main)
    names = ", ".join(f"{value}: {r.name}" for value, r in routes.items())
    return RewardFunction(
        name=f"routes by {cfg.route_key} ({names}; else {main.name})",
        fn=router,
        reward_type="batch",
        reward_name="routed",
        is_async=False,
        path=main.path,
        function_name=main.function_name,
    )
