"""Write docs/config.md from the config dataclasses (run after changing a config field)."""

from pathlib import Path

from easyrl.config.docs import render_config_reference


if __name__ == "__main__":
    target = Path(__file__).resolve().parent.parent / "docs" / "config.md"
    target.write_text(render_config_reference(), encoding="utf-8")
    print(f"wrote {target}")
