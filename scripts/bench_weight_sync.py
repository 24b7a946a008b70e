"""What pushing the policy's weights to rollout workers of their own costs (`worker.rollout.placement: separate`):
the demo's task on a random model of the given width, a few steps, `timing_s/weight_transfer` per push against the
bytes pushed (`perf/weight_transfer_gb`), for each way the weights travel (`worker.rollout.weight_transfer`:
`broadcast` over a group of their own, `driver` through Ray's object store), side by side. CPU or GPU, whatever this
machine runs; prints one JSON line per width and transfer.

    python scripts/bench_weight_sync.py --hidden 256 1024 --steps 4 --transfer broadcast driver
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from easyrl.testing.tiny import build_tiny_checkpoint


REPO = Path(__file__).resolve().parent.parent


def measure(hidden: int, layers: int, steps: int, transfer: str, workdir: Path) -> dict[str, Any]:
    model = build_tiny_checkpoint(
        workdir / f"model{hidden}",
        hidden_size=hidden,
        num_layers=layers,
        num_heads=max(2, hidden // 64),
        num_kv_heads=max(1, hidden // 128),
        intermediate_size=hidden * 2,
    )
    run = workdir / f"run{hidden}_{transfer}"
    cmd = [
        sys.executable,
        "-m",
        "easyrl.cli",
        "train",
        str(REPO / "configs" / "demo.yaml"),
        "trainer.n_gpus_per_node=2",  # the layout of the figures recorded in docs/benchmarks.md (2 workers)
        f"worker.actor.model.model_path={model}",
        "worker.rollout.placement=separate",
        "worker.rollout.n_gpus=1",
        f"worker.rollout.weight_transfer={transfer}",
        f"trainer.max_steps={steps}",
        "trainer.val_freq=-1",
        "trainer.val_before_train=false",
        "trainer.save_freq=-1",
        f"trainer.save_checkpoint_path={run}",
        "trainer.logger=[file]",
    ]
    subprocess.run(cmd, check=True, cwd=REPO, stdout=subprocess.DEVNULL)
    rows = [json.loads(line) for line in (run / "experiment_log.jsonl").read_text().splitlines()]
    pushes = [r for r in rows if "timing_s/weight_transfer" in r]
    seconds = statistics.median(r["timing_s/weight_transfer"] for r in pushes)
    gb = pushes[0]["perf/weight_transfer_gb"]
    return {
        "hidden": hidden,
        "layers": layers,
        "transfer": transfer,
        "gb": round(gb, 4),
        "pushes": len(pushes),
        "s_per_push": round(seconds, 4),
        "s_per_gb": round(seconds / gb, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hidden", type=int, nargs="+", default=[256, 1024])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--transfer", nargs="+", default=["broadcast", "driver"], choices=["broadcast", "driver"])
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        for hidden in args.hidden:
            for transfer in args.transfer:  # alternating, so that drifting machine load hits both
                print(json.dumps(measure(hidden, args.layers, args.steps, transfer, Path(tmp))), flush=True)


if __name__ == "__main__":
    main()
