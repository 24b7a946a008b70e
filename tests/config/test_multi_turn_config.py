"""`worker.rollout.multi_turn`: paths resolved like the reward function's, each mistake one line naming the key."""

from __future__ import annotations

from pathlib import Path

import pytest

from easyrl.config import ConfigError, load_config
from easyrl.trainer.plan import plan_of
from easyrl.trainer.resolve import rollout_loop
from tests.conftest import REPO, base_config, write_config


CALC = "envs/calc.py:CalcEnv"


@pytest.fixture
def config(tmp_path: Path, tiny_model_dir: str, digits_data: dict[str, str]) -> str:
    return write_config(tmp_path / "c.yaml", base_config(tiny_model_dir, digits_data, tmp_path / "run"))


def test_off_by_default_and_on_with_an_environment_or_tools(config: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from easyrl.rollout.carry_over import CarryOverLoop
    from easyrl.rollout.episode import SingleTurnEpisode
    from easyrl.rollout.multi_turn import ToolEpisode

    monkeypatch.chdir(REPO)  # relative paths are read from the working directory, as the reward's
    cfg = load_config(config)
    assert not cfg.worker.rollout.multi_turn.enabled
    loop = rollout_loop(cfg, plan_of(cfg))  # the one schedule, synchronous at S = 0, with the single-turn episode
    assert isinstance(loop, CarryOverLoop) and loop.max_staleness == 0 and isinstance(loop.episode, SingleTurnEpisode)
    cfg = load_config(config, [f"worker.rollout.multi_turn.env={CALC}", "worker.rollout.multi_turn.max_turns=3"])
    assert cfg.worker.rollout.multi_turn.env == f"{REPO / 'envs' / 'calc.py'}:CalcEnv"  # made absolute
    loop = rollout_loop(cfg, plan_of(cfg))
    assert isinstance(loop, CarryOverLoop) and isinstance(loop.episode, ToolEpisode)
    assert loop.episode.budget.max_turns == 3
    budget = loop.episode.budget
    assert budget.max_total_tokens == cfg.data.max_response_length == budget.max_tokens_per_turn
    assert loop.engines == 2  # two workers, one HF engine each: every turn's request is padded to split evenly
    cfg = load_config(config, ["worker.rollout.multi_turn.tools=envs/calc_tools.py,python"])
    assert cfg.worker.rollout.multi_turn.tools == f"{REPO / 'envs' / 'calc_tools.py'},python"
    assert isinstance(rollout_loop(cfg, plan_of(cfg)).episode, ToolEpisode)


@pytest.mark.parametrize(
    ("overrides", "key", "message"),
    [
        (["env=envs/calc.py"], "multi_turn.env", "expected path/to/file.py:Class"),
        (["env=envs/nowhere.py:A"], "multi_turn.env", "environment file not found"),
        (["env=envs/calc.py:Calc"], "multi_turn.env", "no class 'Calc' in .*calc.py; it defines: CalcEnv"),
        ([f"env={CALC}", f"+envs.b={CALC}"], "multi_turn.envs", "is set together with env"),
        (["+envs.calc=envs/calc.py:Nope"], "multi_turn.envs.calc", "no class 'Nope'"),
        (["tools=envs/calc_tools.py,bash"], "multi_turn.tools", "'bash' is neither a .py file nor a built-in tool"),
        (["tools=envs/missing.py"], "multi_turn.tools", "tool file not found"),
        (["tools=python", "max_total_tokens=9"], "multi_turn.max_total_tokens", r"must lie in \[1, data.max_resp"),
        (["tools=python", "max_turns=0"], "multi_turn.max_turns", "must be at least 1"),
        (["tools=python", "tool_timeout_s=0"], "multi_turn.tool_timeout_s", r"must lie in \(0, 3600\] seconds"),
        (["tools=python", "tool_timeout_s=1e30"], "multi_turn.tool_timeout_s", r"must lie in \(0, 3600\] seconds"),
        (["tools=python", "tool_timeout_s=nan"], "multi_turn.tool_timeout_s", "must be finite"),
        (["tools=python", "env_timeout_s=1e30"], "multi_turn.env_timeout_s", r"must lie in \(0, 3600\] seconds"),
        (["tools=python", "max_env_error_ratio=1.5"], "multi_turn.max_env_error_ratio", r"must lie in \[0, 1\]"),
        (["tools=python", "tool_call_format=json"], "multi_turn.tool_call_format", "choose one of"),
    ],
)
def test_a_bad_multi_turn_section_names_the_key_and_the_fix(
    config: str, monkeypatch: pytest.MonkeyPatch, overrides: list[str], key: str, message: str
) -> None:
    monkeypatch.chdir(REPO)
    args = [f"{'+' if o.startswith('+') else ''}worker.rollout.multi_turn.{o.lstrip('+')}" for o in overrides]
    with pytest.raises(ConfigError, match=message) as info:
        load_config(config, args)
    assert info.value.key == f"worker.rollout.{key}"
