"""A prompt template cannot exhaust memory or time (issue 36): every text-multiplying operation is bounded by
`MAX_RENDER_CHARS` and a render by `RENDER_TIMEOUT_S`; either stops the run with one line naming the template."""

from __future__ import annotations

import time
from pathlib import Path

import jinja2
import pytest
from transformers import PreTrainedTokenizerFast

from easyrl.data import DataError, RLDataset
from easyrl.data.template_guard import GuardedEnvironment, TemplateLimitError, render_with_deadline
from tests.data.test_data_dataset import _cfg, _jsonl, tokenizer  # noqa: F401  (module-scoped fixture)


BOMBS = {
    "repeat": "{{ 'x' * 2000000000 }}",
    "repeat_column": "{{ content * 400000000 }}",
    "filter_width": "{{ content|center(2000000000) }}",
    "method_width": "{{ content.ljust(2000000000) }}",
    "percent_width": "{{ '%2000000000s' % content }}",
    "format_width": "{{ '{:>2000000000}'.format(content) }}",
    "power": "{{ 9 ** 100000000 }}",
    "concat_doubling": "{% set a = content %}" + "{% set a = a ~ a %}" * 40 + "{{ a|length }}",
    "namespace_doubling": "{% set ns = namespace(s=content) %}{% for i in range(60) %}{% set ns.s = ns.s + ns.s %}"
    "{% endfor %}{{ ns.s|length }}",
    "output_loops": "{% for i in range(100000) %}{% for j in range(100000) %}{{ content }}{% endfor %}{% endfor %}",
}


@pytest.mark.parametrize("name", list(BOMBS))
def test_growth_is_refused_naming_the_template(
    tmp_path: Path,
    tokenizer: PreTrainedTokenizerFast,  # noqa: F811
    name: str,
) -> None:
    template = tmp_path / f"{name}.jinja"
    template.write_text(BOMBS[name])
    spec = _jsonl(tmp_path / "d.jsonl", [{"prompt": "hello world", "answer": "1"}])
    with pytest.raises(DataError, match=rf"prompt template .*{name}\.jinja.*limit"):
        RLDataset(spec, _cfg(format_prompt=str(template), on_bad_row="drop"), tokenizer)


def test_real_templates_with_large_numbers_still_render() -> None:
    env = GuardedEnvironment(undefined=jinja2.StrictUndefined)
    text = "{{ '{:,}'.format(n) }} {{ n|string }} {{ '%d'|format(n) }} {{ n * 2 }} {{ '-' * 3 }}{{ 'a'|center(5) }}"
    assert render_with_deadline(env.from_string(text), {"n": 3_000_000_000}) == (
        "3,000,000,000 3000000000 3000000000 6000000000 ---  a  "
    )
    ids = "{{ 'ID 123456789: %5.2f' % x }} {{ 'ID 123456789 {:>6}'.format(x) }}"  # digits in text are no width
    assert render_with_deadline(env.from_string(ids), {"x": 1.5}) == "ID 123456789:  1.50 ID 123456789    1.5"


def test_a_render_past_its_deadline_is_stopped() -> None:
    """Nested loops that write nothing (10**10 iterations) are stopped by the watchdog, and the interrupt never
    lands in the code that runs after the render."""
    env = GuardedEnvironment()
    loops = env.from_string("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
    with pytest.raises(TemplateLimitError, match=r"took more than 0\.3 s"):
        render_with_deadline(loops, {}, timeout_s=0.3)
    assert render_with_deadline(env.from_string("{{ 1 + 1 }}"), {}) == "2"
    time.sleep(0.3)  # a stray interrupt would surface here
