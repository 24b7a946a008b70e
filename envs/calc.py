"""A calculator environment: the model is asked for a product it cannot work out alone, and has a tool that can.

`worker.rollout.multi_turn.env: envs/calc.py:CalcEnv` (the tool demo, configs/demo_tools.yaml). One instance per
trajectory: `reset` gets the dataset row's columns and returns the prompt; every other public method is a tool, its
schema made from the type hints and the docstring.
"""


class CalcEnv:
    def reset(self, prompt: str, **row) -> str:
        self.calls = 0
        return prompt

    def mul(self, a: int, b: int) -> int:
        """Multiply two integers.

        Args:
            a: the first factor
            b: the second factor
        """
        self.calls += 1
        return a * b
