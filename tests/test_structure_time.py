"""Executable rules that keep `make test` inside its time budget (docs/testing.md, "Test time"): the set-ups that cost
seconds on CI's 2 cores are made once and shared, not remade by each module."""

from __future__ import annotations

import re
from pathlib import Path


TESTS = Path(__file__).resolve().parent


def _own_ray_sessions(source: str) -> list[int]:
    """Lines of a test module that define a `ray_session` fixture of its own or import another module's."""
    pattern = re.compile(r"^def ray_session\(|^from tests\..* import .*\bray_session\b")
    return [line for line, text in enumerate(source.splitlines(), 1) if pattern.search(text)]


def test_the_ray_modules_share_the_conftest_ray_session() -> None:
    """A local Ray start and stop cost ~5 s on 2 cores: the modules whose runs need Ray ask for tests/conftest.py's
    `ray_session`, which stays up from one such module to the next; a module-scoped copy would start its own."""
    assert _own_ray_sessions("def ray_session():\nfrom tests.trainer.test_e2e import run, ray_session\n") == [1, 2]
    found = [
        f"{path.relative_to(TESTS)}:{line}"
        for path in sorted(TESTS.rglob("test_*.py"))
        for line in _own_ray_sessions(path.read_text(encoding="utf-8"))
    ]
    assert not found, 'use pytest.mark.usefixtures("ray_session") (tests/conftest.py) instead, at ' + ", ".join(found)


def test_the_ray_modules_of_a_folder_run_one_after_another_after_the_others() -> None:
    """tests/conftest.py orders each folder's modules that use `ray_session` after its other modules, so the shared
    instance starts once per folder."""
    from types import SimpleNamespace

    from tests.conftest import ray_modules_last

    def item(path: str, *fixtures: str) -> SimpleNamespace:
        return SimpleNamespace(path=Path(path), fixturenames=fixtures)

    items = [item("a/x.py", "ray_session"), item("a/x.py"), item("a/y.py"), item("a/z.py", "ray_session"),
             item("a/z.py", "tmp_path"), item("b/u.py", "ray_session"), item("b/v.py")]  # fmt: skip
    assert ray_modules_last(items) == {Path("a/x.py"), Path("a/z.py"), Path("b/u.py")}
    assert [(str(i.path), i.fixturenames) for i in items] == [
        ("a/y.py", ()), ("a/x.py", ("ray_session",)), ("a/x.py", ()), ("a/z.py", ("ray_session",)),
        ("a/z.py", ("tmp_path",)), ("b/v.py", ()), ("b/u.py", ("ray_session",)),
    ]  # fmt: skip
    conftest = (TESTS / "conftest.py").read_text(encoding="utf-8")
    hook = conftest[conftest.index("def pytest_collection_modifyitems") : conftest.index("def ray_modules_last")]
    assert "ray_modules_last(items)" in hook
