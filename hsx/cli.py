"""Command line: `hsx extract --config recipes/X.yaml [--flag value ...]` (also `python -m hsx`, and
`accelerate launch -m hsx extract ...`).

Every ExtractConfig field is a flag; flags override the YAML. Problems the user can fix print as one line
(`hsx: error: ...`) with a non-zero exit and no traceback.
"""

from __future__ import annotations

import argparse
import sys
import types
import typing

from hsx.config import FIELDS, ExtractConfig, HsxError, load_config
from hsx.run import Stopped
from hsx.verify import VerifyFailed

HELP = {
    "revision": "model revision (branch, tag or commit) on the Hub",
    "tokenizer": "tokenizer folder or Hub id (default: the model's)",
    "dataset_config": "the dataset's configuration name on the Hub",
    "split": "input split (default train; slicing like train[:1000] works)",
    "storage_dtype": "bfloat16 (bit-exact, default), float16, float32 or float8_e4m3 (with per-token scales)",
    "dtype": "compute dtype of the model: bfloat16, float16 or float32",
    "attn_implementation": "transformers attention implementation (default sdpa)",
    "num_proc": "tokenization processes (default: up to 8 for 20k+ rows)",
    "trust_remote_code": "run the model repo's own code (off unless asked)",
    "model": "local folder or Hub id of the target model",
    "dataset": "Hub id, or a local .jsonl/.json/.parquet/.arrow file or folder",
    "layers": "decoder layers (0-based, negatives from the end), e.g. `1 -1` or `1,-1`, or a preset: "
              "eagle3, dflash, dflash-K",
    "final_hidden": "also store the final-norm output (transformers' hidden_states[N]) as final_hidden_state",
    "topk_logits": "also store the target's top-K logits and token ids per token (from the final-norm state, in "
                   "chunks; needs --final-hidden or a preset that includes it)",
    "max_length": "longer rows are truncated (and counted)",
    "output_dir": "where the Arrow dataset goes; rerunning the same command there continues the job",
    "push_to_hub": "a Hub dataset repo to upload the output to (token from HF_TOKEN or `hf auth login`)",
    "push_mode": "end: upload once the job is complete; stream: upload units as they are committed",
    "delete_after_upload": "stream mode: delete a unit locally once the Hub has it (outputs bigger than the disk)",
    "hub_private": "create the repo private (default) or public (--no-hub-private)",
    "hub_revision": "branch to push to",
    "nonfinite": "rows whose states hold NaN/Inf: skip (and count) them, or keep them with has_nonfinite set",
    "strict": "stop at the first unusable input row instead of skipping and counting it",
    "gpus_per_copy": "GPUs one model copy is spread over (device_map); launch one process per group: "
                     "`accelerate launch --num_processes GPUS/N`",
    "tp_size": "tensor parallel: shard each model copy over this many processes (one per GPU) with "
               "transformers' tp_plan; data parallel across the groups",
    "token_budget": "tokens per batch, padding included (default: 16384 on GPU, 4096 on CPU)",
    "unit_tokens": "tokens per output file, the grain of commit and resume (default: ~2 GiB of states)",
    "experts_implementation": "MoE experts: hsx_grouped (two grouped GEMMs, hsx.moe), grouped_mm (transformers'), "
                              "eager (a loop over experts); auto (default): hsx_grouped on CUDA, transformers' "
                              "choice on CPU",
    "sdpa_backend": "attention kernel for sdpa on CUDA: flash, cudnn, efficient, default",
    "packing": "varlen: each batch as one packed sequence (torch's flash varlen attention); none: right-padded "
               "batches; auto (default): varlen on one GPU per copy where the model allows it, else none",
    "compile": "torch.compile the model: auto (on for CUDA), on, off",
    "chat_template_kwargs": "JSON object passed to the chat template, e.g. '{\"enable_thinking\": false}'",
    "limit": "only the first N input rows",
    "overwrite": "delete what hsx wrote in --output-dir and start over",
}


def _add_config_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML recipe; flags override its keys")
    hints = typing.get_type_hints(ExtractConfig)
    for name, f in FIELDS.items():
        flag = "--" + name.replace("_", "-")
        hint = hints[name]
        args = typing.get_args(hint) if isinstance(hint, types.UnionType) or typing.get_origin(hint) else ()
        kind = next((a for a in args if a is not type(None)), hint)
        if name == "layers":
            p.add_argument(flag, nargs="+", default=None, help=HELP[name])
        elif kind is bool:
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=HELP.get(name))
        elif kind is int:
            p.add_argument(flag, type=int, default=None, help=HELP.get(name))
        else:
            p.add_argument(flag, type=str, default=None, help=HELP.get(name))


def config_overrides(args: argparse.Namespace) -> dict:
    return {k: getattr(args, k) for k in FIELDS if getattr(args, k, None) is not None}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hsx", description="Extract hidden states of chosen layers of a "
                                     "Hugging Face causal LM into an Arrow dataset.")
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("extract", help="run (or continue) an extraction job")
    _add_config_flags(ex)
    from hsx.bench import add_arguments as add_bench_arguments

    add_bench_arguments(sub.add_parser("bench", help="measure hsx against batch-1 and padded extraction"))
    pl = sub.add_parser("plan", help="weights, memory, token budget, disk and time of a job, before running it")
    _add_config_flags(pl)
    pl.add_argument("--shape", help="a named model shape instead of --model (see hsx.plan.SHAPES)")
    pl.add_argument("--tokens", type=int, help="total tokens (default: tokenize the dataset and count)")
    pl.add_argument("--rate", type=float, help="tokens/s to time the job at (default: the MFU measured for the "
                    "model's kind, dense 70%%, mixture of experts hsx.plan.PLAN_MFU_MOE, of an H200's "
                    "measured 790 TFLOP/s)")
    pl.add_argument("--gpu-memory-gib", type=float, default=139.0)
    pl.add_argument("--json", action="store_true", help="print the plan as JSON")
    me = sub.add_parser("merge", help="join the dirs the nodes of one job wrote into one output (metadata only)")
    me.add_argument("output_dir")
    me.add_argument("dirs", nargs="+", help="the nodes' output dirs (output_dir may be one of them)")
    pu = sub.add_parser("push", help="upload a complete output dir to a Hub dataset repo (resumable)")
    pu.add_argument("output_dir")
    pu.add_argument("repo_id")
    pu.add_argument("--revision", help="branch to push to (created if missing)")
    pu.add_argument("--public", action="store_true", help="create the repo public (default: private)")
    sf = sub.add_parser("export-specforge", help="write an output as SpecForge's offline EAGLE-3 files")
    sf.add_argument("output_dir")
    sf.add_argument("dest")
    sf.add_argument("--layers", nargs="+", type=int, help="the 3 stored layers to use (default: all 3)")
    ve = sub.add_parser("verify", help="re-read an output dir, check it, and recompute rows with the reference")
    ve.add_argument("output_dir")
    ve.add_argument("--samples", type=int, default=8, help="rows to recompute with the reference forward")
    ve.add_argument("--tolerance", type=float, default=2e-2,
                    help="worst allowed relative error (Frobenius, per layer) against the reference")
    ve.add_argument("--seed", type=int, default=0)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "extract":
            from hsx.run import extract

            extract(load_config(args.config, config_overrides(args)))
        elif args.command == "bench":
            from hsx.bench import bench

            bench(args)
        elif args.command == "merge":
            from hsx.sink import merge

            merge(args.output_dir, args.dirs)
        elif args.command == "push":
            from pathlib import Path

            from hsx.hub import push_output
            from hsx.sink import OutputDir

            if not (Path(args.output_dir) / "hsx.json").is_file():
                raise HsxError(f"{args.output_dir} is not a finished hsx output (no hsx.json)")
            with OutputDir(args.output_dir).locked():
                push_output(args.output_dir, args.repo_id, private=not args.public, revision=args.revision)
        elif args.command == "export-specforge":
            from hsx.load import export_specforge

            try:
                export_specforge(args.output_dir, args.dest, layers=args.layers)
            except (ValueError, FileNotFoundError) as e:
                raise HsxError(str(e)) from None
        elif args.command == "verify":
            from hsx.verify import verify

            verify(args.output_dir, samples=args.samples, tolerance=args.tolerance, seed=args.seed)
        elif args.command == "plan":
            from hsx.plan import plan_command

            plan_command(args)
    except HsxError as e:
        print(f"hsx: error: {e}", file=sys.stderr)
        return 2
    except VerifyFailed as e:
        print(f"hsx: verify failed: {e}", file=sys.stderr)
        return 1
    except Stopped as e:
        print(f"hsx: {e}", file=sys.stderr)
        return e.exit_code
    except KeyboardInterrupt:
        print("hsx: interrupted; finished units are kept: run the same command to continue", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
