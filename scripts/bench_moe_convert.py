"""Speed and peak memory of converting a MoE-shaped checkpoint (128 experts) to TP2 EP4 and back.

A random bf16 checkpoint of Qwen3-30B-A3B's layer shape (hidden 2048, 128 experts of width 768, top-8; 8 layers,
about 10 GB), or with `--shape glm4.5-air` of GLM-4.5-Air's (hidden 4096, a dense first layer, then 128 experts of
width 1408 and a shared expert, float32 router biases beside bf16 weights; `--layers 2`: about 7 GB), is written
with `scripts/random_checkpoint.py`; then, side by side in one run: `cp -r` of it, `bridge convert --to mcore --tp
2 --ep 4` and `bridge convert --to hf` back, each a child process timed with its peak RSS (`/usr/bin/time -v`); the
export is checked bit-identical to the source. Experts are streamed one (layer, expert) at a time, so peak memory
should not depend on the number of experts (goal: <= 2 GB).

    python scripts/bench_moe_convert.py --out bench_moe.json
    python scripts/bench_moe_convert.py --shape glm4.5-air --layers 2 --out bench_moe_glm.json
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from bench_convert import bridge_command, check_identical, run_child
from random_checkpoint import SHAPES, write_random_checkpoint


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=["qwen3-moe", "glm4.5-air"], default="qwen3-moe")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--out", type=Path, default=Path("bench_moe.json"))
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-moe-"))
    config = {**SHAPES[args.shape], "num_hidden_layers": args.layers}
    source, copy, mcore, back = (work / name for name in ("hf", "copy", "mcore", "hf-back"))
    size = write_random_checkpoint(source, config)
    bridge = bridge_command()
    rows = []
    try:
        for label, command, reads in (
            ("cp -r", ["cp", "-r", str(source), str(copy)], source),
            (
                "to mcore tp2 ep4",
                [
                    *bridge,
                    "convert",
                    "--to",
                    "mcore",
                    str(source),
                    str(mcore),
                    "--tp",
                    "2",
                    "--ep",
                    "4",
                    "--no-progress",
                ],
                source,
            ),
            ("to hf", [*bridge, "convert", "--to", "hf", str(mcore), str(back), "--no-progress"], mcore),
        ):
            sample = run_child(command, reads, work / f"{label.split()[0]}-{label.split()[-1]}.log")
            rows.append(
                {
                    "operation": label,
                    "seconds": sample.seconds,
                    "cpu_s": sample.cpu_s,
                    "peak_rss_mb": sample.peak_rss_mb,
                    "peak_anon_mb": sample.peak_anon_mb,
                }
            )
            shutil.rmtree(copy, ignore_errors=True)
        tensors = check_identical(source, back)
    finally:
        if args.workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    base = rows[0]["seconds"]
    print(
        f"{args.shape} shape, {args.layers} layers, 128 experts: {size / 1e9:.2f} GB; "
        f"export bit-identical ({tensors} tensors)"
    )
    print(f"{'operation':<18} {'seconds':>8} {'x cp -r':>8} {'CPU s':>7} {'peak RSS MB':>12}")
    for row in rows:
        row["ratio_to_cp"] = row["seconds"] / base
        print(
            f"{row['operation']:<18} {row['seconds']:8.1f} {row['ratio_to_cp']:8.2f} {row['cpu_s']:7.1f} "
            f"{row['peak_rss_mb']:12.0f}"
        )
    summary = {"shape": args.shape, "bytes": size, "layers": args.layers, "tensors": tensors, "rows": rows}
    args.out.write_text(json.dumps(summary, indent=2))


if __name__ == "__main__":
    main()
