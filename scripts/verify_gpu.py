"""Conversion and `bridge verify` on GPUs over NCCL, at real model shapes with random weights.

Generates a random bf16 checkpoint of a real shape (scripts/random_checkpoint.py), converts it ONCE (for
`--write-tp/--write-pp/--write-ep`), then loads that one checkpoint into megatron-core at every `--layouts` entry
(NCCL, one process per GPU) and compares logits with HF transformers on the GPU. Prints one line per layout and
writes the results as JSON.

In the project's environment (`bash scripts/setup.sh`; on a GPU machine with its own torch
`TORCH_SPEC= EXTRAS= bash scripts/setup.sh`, offline with `WHEELS=DIR`; then `. .venv/bin/activate`):

    python scripts/verify_gpu.py llama3-8b --write-tp 8 --layouts tp2 pp2 --dtypes bf16 fp32 --out results.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

from random_checkpoint import SHAPES, write_random_checkpoint

from hf_mcore_bridge.convert.layout import Layout
from hf_mcore_bridge.convert.to_mcore import convert_hf_to_mcore
from hf_mcore_bridge.megatron.verify import VerifyJob, verify
from hf_mcore_bridge.quiet import quiet_libraries


def parse_layout(text: str) -> Layout:
    """`tp2`, `pp2`, `tp2ep2`, `tp1` -> Layout."""
    sizes = {"tp": 1, "pp": 1, "ep": 1}
    rest = text
    while rest:
        name, rest = rest[:2], rest[2:]
        digits = ""
        while rest and rest[0].isdigit():
            digits, rest = digits + rest[0], rest[1:]
        sizes[name] = int(digits)
    return Layout(tp=sizes["tp"], pp=sizes["pp"], ep=sizes["ep"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/verify-gpu"))
    parser.add_argument("--layers", type=int)
    parser.add_argument("--write-tp", type=int, default=8)
    parser.add_argument("--write-pp", type=int, default=1)
    parser.add_argument("--write-ep", type=int, default=1)
    parser.add_argument("--layouts", nargs="+", default=["tp2", "pp2"])
    parser.add_argument("--dtypes", nargs="+", default=["bf16"])
    parser.add_argument("--seq-len", type=int, default=128)
    parser.add_argument("--out", type=Path, default=Path("verify_gpu.json"))
    args = parser.parse_args()
    quiet_libraries()
    config = dict(SHAPES[args.shape])
    if args.layers:
        config["num_hidden_layers"] = args.layers
    hf_dir, mcore_dir = args.workdir / f"{args.shape}-hf", args.workdir / f"{args.shape}-mcore"
    results = {"shape": args.shape, "config": config, "runs": []}
    start = time.perf_counter()
    size = write_random_checkpoint(hf_dir, config)
    results["generate_s"] = time.perf_counter() - start
    write = Layout(tp=args.write_tp, pp=args.write_pp, ep=args.write_ep)
    conversion = convert_hf_to_mcore(hf_dir, mcore_dir, layout=write, overwrite=True, show_progress=False)
    results["convert"] = {"layout": str(write), "seconds": conversion.seconds, "bytes": size}
    print(f"{args.shape}: {size / 2**30:.1f} GiB, converted for {write} in {conversion.seconds:.1f}s", flush=True)
    for dtype in args.dtypes:
        for text in args.layouts:
            layout = parse_layout(text)
            started = time.perf_counter()
            (result,) = verify([VerifyJob(hf_dir, mcore_dir)], layout, dtype=dtype, seq_len=args.seq_len)
            seconds = time.perf_counter() - started
            print(f"[{dtype}] {result.summary()} ({seconds:.0f}s)", flush=True)
            results["runs"].append(
                {
                    "layout": str(layout),
                    "dtype": dtype,
                    "max_abs_diff": result.max_abs_diff,
                    "mean_kl": result.mean_kl,
                    "top1_agreement": result.top1_agreement,
                    "tolerance": result.tolerance,
                    "passed": result.passed,
                    "seconds": seconds,
                }
            )
            args.out.write_text(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
