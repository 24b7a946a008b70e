"""The recipe matrix: every model family and every feature that changes what runs on the device, each a tiny
end-to-end run of 2 steps with its own checks, run one process per slice with a bounded time per recipe.

`python -m tests.recipes --device cuda --out OUT` (what `bash scripts/gpu_checks.sh recipes` runs on a lent GPU)
writes one JSON line per recipe to `OUT/recipes.jsonl` and a table to `OUT/recipes.table.md`; `--device cpu` runs
the recipes that have a CPU form over the HF engine (`cpu_smoke`, in CI). See docs/benchmarks.md for the tables.
"""
