"""The tool demo's calculator (envs/calc.py) three ways, for the tests of a resume with tool trajectories in flight
(tests/rollout/test_tool_resume.py, tests/trainer/test_multi_turn_e2e.py). Each keeps class-level counts, read by
the tests in the process that runs the tools (the driver's)."""


class ReplayedCalcEnv:
    """No `state_dict`: a resume rebuilds it by replaying its calls (deterministic, so exactly)."""

    calls = 0  # `mul` calls in this process, replays included

    def reset(self, prompt: str, **row) -> str:
        self.made = 0
        return prompt

    def mul(self, a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: the first factor
            b: the second factor
        """
        type(self).calls += 1
        self.made += 1
        return a * b


class SavedCalcEnv(ReplayedCalcEnv):
    """Saves and restores its own state: a resume loads it and replays nothing."""

    loads = 0

    def state_dict(self) -> dict:
        return {"made": self.made}

    def load_state_dict(self, state: dict) -> None:
        type(self).loads += 1
        self.made = state["made"]


class DriftingCalcEnv(ReplayedCalcEnv):
    """Answers with the number of its session (instances made so far in this process), as a remote service might
    name one: a fresh instance built for a replay has another number, so its replay never matches."""

    sessions = 0

    def reset(self, prompt: str, **row) -> str:
        type(self).sessions += 1
        self.session = type(self).sessions
        return super().reset(prompt, **row)

    def mul(self, a: int, b: int) -> str:
        """Multiply two integers.

        Args:
            a: the first factor
            b: the second factor
        """
        super().mul(a, b)
        return f"{a * b} (session {self.session})"
