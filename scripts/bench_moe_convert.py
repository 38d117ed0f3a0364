"""Speed and peak memory of converting a mixture-of-experts checkpoint to TP2 EP4 and back.

A random checkpoint is written with `scripts/random_checkpoint.py`: by default bf16 of Qwen3-30B-A3B's layer shape
(hidden 2048, 128 experts of width 768, top-8; 8 layers, about 10 GB); `--shape glm4.5-air` takes GLM-4.5-Air's
(hidden 4096, a dense first layer, then 128 experts of width 1408 and a shared expert, float32 router biases beside
bf16 weights; `--layers 2`: about 7 GB), `--shape deepseek-v3` DeepSeek-V3's (multi-latent attention, hidden 7168,
32 experts of width 2048, a dense first layer; vocabulary 129280), and `--fp8` writes the linear layers as
DeepSeek's 128 x 128 FP8 blocks (`--fp8-scale-format`: DeepSeek-V3.1's ue8m0, default, or DeepSeek-V3's float32;
dequantized to bf16 on import, exported with `--fp8-blockwise`). Then, side by side in one run: `cp -r` of it,
`bridge convert --to mcore --tp 2 --ep 4` and `bridge convert --to hf` back, each a child process timed with its
peak RSS (`/usr/bin/time -v`); the export is checked bit-identical to the source (FP8 weights and scales too: the
mcore checkpoint keeps the source's scales). Experts are streamed one (layer, expert) at a time, so peak memory
should not depend on the number of experts or layers (goal: <= 2 GB; compare two `--layers`).

    python scripts/bench_moe_convert.py --out bench_moe.json
    python scripts/bench_moe_convert.py --shape glm4.5-air --layers 2 --out bench_moe_glm.json
    python scripts/bench_moe_convert.py --shape deepseek-v3 --fp8 --layers 2 --out bench_ds2.json
    python scripts/bench_moe_convert.py --shape deepseek-v3 --fp8 --fp8-scale-format float32 --layers 2
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

from hf_mcore_bridge.convert.fp8_checkpoint import SCALE_FORMATS


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", choices=("qwen3-moe", "glm4.5-air", "deepseek-v3"), default="qwen3-moe")
    parser.add_argument("--fp8", action="store_true", help="Source in FP8 blocks, exported with --fp8-blockwise.")
    parser.add_argument("--fp8-scale-format", choices=SCALE_FORMATS, default="ue8m0", help="Scales of --fp8.")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--workdir", type=Path)
    parser.add_argument("--out", type=Path, default=Path("bench_moe.json"))
    args = parser.parse_args()
    work = args.workdir or Path(tempfile.mkdtemp(prefix="bench-moe-"))
    config = {**SHAPES[args.shape], "num_hidden_layers": args.layers}
    source, copy, mcore, back = (work / name for name in ("hf", "copy", "mcore", "hf-back"))
    size = write_random_checkpoint(source, config, fp8=args.fp8, fp8_scale_format=args.fp8_scale_format)
    fp8_export = ["--fp8-blockwise"] if args.fp8 else []
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
            ("to hf", [*bridge, "convert", "--to", "hf", str(mcore), str(back), *fp8_export, "--no-progress"], mcore),
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
    experts = config.get("num_experts") or config.get("n_routed_experts")
    print(
        f"{args.shape} shape{' (FP8 blocks)' if args.fp8 else ''}, {args.layers} layers, {experts} experts: "
        f"{size / 1e9:.2f} GB; export bit-identical ({tensors} tensors)"
    )
    print(f"{'operation':<18} {'seconds':>8} {'x cp -r':>8} {'CPU s':>7} {'peak RSS MB':>12}")
    for row in rows:
        row["ratio_to_cp"] = row["seconds"] / base
        print(
            f"{row['operation']:<18} {row['seconds']:8.1f} {row['ratio_to_cp']:8.2f} {row['cpu_s']:7.1f} "
            f"{row['peak_rss_mb']:12.0f}"
        )
    fp8 = args.fp8_scale_format if args.fp8 else None
    summary = {"shape": args.shape, "fp8": fp8, "bytes": size, "layers": args.layers, "tensors": tensors}
    args.out.write_text(json.dumps(summary | {"rows": rows}, indent=2))


if __name__ == "__main__":
    main()
