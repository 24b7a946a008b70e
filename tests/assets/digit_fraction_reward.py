"""A dense reward for tests on random-init models: the fraction of response characters that are digits.

A random tiny model almost never earns the digits task's reward, which would leave every advantage at zero;
this one varies within each group from the first step, so updates carry a real gradient signal.
"""

REWARD_TYPE = "batch"
REWARD_NAME = "digit_fraction"


def compute_score(reward_inputs: list[dict], **kwargs: object) -> list[dict[str, float]]:
    del kwargs  # accepted so tests can pass (secret) keyword arguments through
    scores = []
    for item in reward_inputs:
        text = item["response"]
        digits = sum(ch.isdigit() for ch in text) / max(len(text), 1)
        scores.append({"overall": digits, "digits": digits, "length": float(item["response_length"])})
    return scores
