"""A second model in the loop, declared where it is used (``algorithm.distill.teacher``, ``worker.reward.judge.model``,
``worker.reward.reward_model.model``): a local checkpoint (``model_path``) or an OpenAI-compatible server
(``base_url``, e.g. ``vllm serve``), with the limits every remote call runs under."""

from __future__ import annotations

from dataclasses import dataclass, field


PARSE_MATCH = ("last", "first")
"""Which match of a judge's `parse` regex is its verdict."""
ON_ERROR = ("zero", "raise")
"""What a call that still fails after its retries does: score 0 (counted) or raise."""


@dataclass
class ModelRefConfig:
    """One model other than the policy: local (`model_path`) or remote (`base_url`), never both."""

    name: str = ""
    """Display name in metrics (`<name>/requests`, `<name>/errors`, ...) and messages; empty: the role it serves
    (`teacher`, `judge`, `reward_model`)."""
    model_path: str | None = None
    """Local: a Hugging Face model folder or hub ID, loaded by easyrl itself (a teacher runs in an FSDP role of its
    own, placed like the reference; a reward model in the process that scores)."""
    tokenizer_path: str | None = None
    """Local: the tokenizer folder; default: `model_path`."""
    trust_remote_code: bool = False
    """Local: allow model code shipped in the model folder."""
    base_url: str | None = None
    """Remote: the OpenAI-compatible API root of a server you run, e.g. `http://judge-host:8000/v1` (`vllm serve`)."""
    served_model_name: str | None = None
    """Remote: the `model` field of each request (the server's `--served-model-name`); null: the first model the
    server lists at `/models`."""
    api_key_env: str | None = None
    """Remote: the name of the environment variable holding the API key (sent as a bearer token; its value is read in
    the process that calls, and never logged or written). Null: no key."""
    max_concurrency: int = 16
    """Remote: requests in flight at once, per process that calls (each reward worker, or the driver)."""
    timeout_s: float = 60.0
    """Remote: seconds one try of a request may take in all (connecting, waiting, reading the reply, however slowly the
    server sends it) before it counts as a timeout (and is retried)."""
    max_retries: int = 2
    """Remote: further tries of a request that failed (connection refused or reset, timeout, HTTP 5xx or 429, a reply
    that is not what the API promises: not JSON, the wrong shape, over the size the request allows, a number that is
    not finite), with exponential backoff from 0.5 s; a 4xx other than 429 is not retried."""
    on_error: str = "raise"
    """A request that still fails after its retries: `raise` (the reward call fails, counted as `reward/errors` and
    given `fallback_score` by the reward manager) or `zero` (that verdict scores 0, the reward function goes on);
    both are counted as `<name>/errors`."""

    @property
    def local(self) -> bool:
        """A local checkpoint easyrl loads itself."""
        return self.model_path is not None

    @property
    def remote(self) -> bool:
        """A server reached over HTTP."""
        return self.base_url is not None

    @property
    def declared(self) -> bool:
        """Either kind is set: the feature that holds this reference is on."""
        return self.local or self.remote


@dataclass
class JudgeSamplingConfig:
    """How the judge answers (the request's sampling fields)."""

    temperature: float = 0.0
    """0: the most likely verdict."""
    top_p: float = 1.0
    """Nucleus sampling."""
    max_tokens: int = 256
    """Longest reply; room for reasoning before the score, if the template asks for it."""
    seed: int | None = 0
    """Per-request seed, so the same input gets the same verdict at any temperature; null: the server's choice."""


@dataclass
class JudgeServerConfig:
    """How easyrl serves a local judge (`model.model_path`): a vLLM server it starts for the run, on devices of its
    own, and stops with it."""

    num_gpus: int = 1
    """GPUs the judge's server takes (tensor-parallel over them), beside the trainer's
    `trainer.nnodes x trainer.n_gpus_per_node`: the cluster needs them free. 0: the server shares the first GPU of
    its node with the trainer (one-GPU machines): give it its share with `--gpu-memory-utilization` in `args` and
    lower `worker.rollout.gpu_memory_utilization` so both fit. A CPU run (`trainer.device: cpu`) serves it on CPU and
    ignores this."""
    args: list[str] = field(default_factory=list)
    """Further `vllm serve` arguments, e.g. `[--max-model-len, "8192", --gpu-memory-utilization, "0.85"]`."""
    startup_timeout_s: float = 900.0
    """How long the server may take to load the model and answer."""


@dataclass
class JudgeConfig:
    """A generative judge (LLM-as-judge): a reward function that takes a `judge` argument gets it ready to call.
    Off while `model` is unset. See docs/judges_and_distillation.md."""

    model: ModelRefConfig = field(default_factory=ModelRefConfig)
    """The judge model, with its limits and `on_error`: an OpenAI-compatible server you run (`base_url`), or a local
    model (`model_path`) easyrl serves with vLLM for the run (see `server`)."""
    server: JudgeServerConfig = field(default_factory=JudgeServerConfig)
    """With a local judge (`model.model_path`): where and how easyrl serves it."""
    template: str | None = None
    """A `.jinja` file rendering the judge's message from one reward input: `{{ response }}`, `{{ prompt }}`,
    `{{ ground_truth }}` and every column of the row. Required with a model."""
    parse: str = r"(?i)score\s*[:=]\s*(-?\d+(?:\.\d+)?)"
    """How the score is read from the reply: a regular expression (its first group, or the whole match without a
    group, as a number; which match: `parse_match`) or `path/to/file.py:function` taking the reply text and returning
    a number (None: unreadable). A reply with no score, or one that is not a finite number, counts as
    `<name>/parse_errors` and follows `on_error`."""
    parse_match: str = "last"
    """Which match of a `parse` regular expression is the verdict: `last` (the judge's conclusion, after any score
    it quotes from the response under review, so a policy cannot write its own reward by quoting one) or `first`."""
    sampling: JudgeSamplingConfig = field(default_factory=JudgeSamplingConfig)
    """The judge's sampling."""


@dataclass
class RewardModelConfig:
    """A reward model: a sequence-classification model with one output, read as the score of (prompt, response). A
    reward function that takes a `reward_model` argument gets it ready to call. Off while `model` is unset."""

    model: ModelRefConfig = field(default_factory=ModelRefConfig)
    """Local (`model_path`: loaded by the process that scores, on CPU) or remote (`base_url`: a server's `/pooling`
    endpoint, e.g. `vllm serve --runner pooling`; the raw output, no sigmoid)."""
    template: str | None = None
    """A `.jinja` file rendering the text the model reads from one reward input (the keys of a judge template); null:
    the reward model's own chat template over a user turn (`prompt`) and an assistant turn (`response`)."""
    batch_size: int = 8
    """Local: samples per forward pass."""
