"""Command line: `hsx extract --config recipes/X.yaml [--flag value ...]` (also `python -m hsx`, and
`accelerate launch -m hsx extract ...`).

Every ExtractConfig field is a flag; flags override the YAML. Problems the user can fix print as one line
(`hsx: error: ...`) with no traceback and exit 2 for a usage error (a flag, recipe or argument that is wrong by
itself, found before anything is read), 1 for a runtime error (the data, model or output dir; a failed verify).
"""

from __future__ import annotations

import argparse
import sys

from hsx.config import CHOICES, FIELD_KINDS, FIELDS, ExtractConfig, load_config
from hsx.errors import EXIT_INTERRUPTED, HsxError, Stopped, VerifyFailed, exit_status

HELP = {
    "revision": "model revision (branch, tag or commit) on the Hub",
    "tokenizer": "tokenizer folder or Hub id (default: the model's)",
    "dataset_config": "the dataset's configuration name on the Hub",
    "split": "input split (default train; slicing like train[:1000] works)",
    "storage_dtype": "bfloat16 (bit-exact for bf16 compute, default), float16, float32 or float8_e4m3 (lossy, "
                     "with per-token scales; read back as bfloat16)",
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
    "allow_empty": "a job that writes no row (every input row skipped) succeeds with an empty dataset instead of "
                   "failing",
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
    "check_crc": "on resume or rerun, check the CRC-32 of every unit kept (default: sizes of all, CRC-32 of the "
                 "units of the interrupted run)",
}


def _add_config_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML recipe; flags override its keys")
    for name, (kind, _) in FIELD_KINDS.items():  # types and choices from hsx.config; ranges checked there too
        flag = "--" + name.replace("_", "-")
        if kind == "layers":
            p.add_argument(flag, nargs="+", default=None, help=HELP[name])
        elif kind == "bool":
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=HELP.get(name))
        elif kind == "int":
            p.add_argument(flag, type=int, default=None, help=HELP.get(name))
        else:  # str, or a mapping given as a JSON object
            p.add_argument(flag, type=str, default=None, choices=CHOICES.get(name), help=HELP.get(name))


def parse_config(args: argparse.Namespace) -> ExtractConfig:
    """The job's config from --config and the flags; any problem with them is a usage error (hsx.config)."""
    return load_config(args.config, config_overrides(args))


def add_json_flag(p: argparse.ArgumentParser, what: str) -> None:
    """`--json` for plan and bench alike: alone or `--json -` prints JSON to stdout, `--json PATH` writes a file."""
    p.add_argument("--json", nargs="?", const="-", metavar="PATH",
                   help=f"{what} as JSON: `--json` or `--json -` prints to stdout, `--json PATH` writes the file")


def write_json(dest: str, obj) -> None:
    import json
    from pathlib import Path

    text = json.dumps(obj, indent=2) + "\n"
    if dest == "-":
        sys.stdout.write(text)
    else:
        Path(dest).write_text(text)


def config_overrides(args: argparse.Namespace) -> dict:
    return {k: getattr(args, k) for k in FIELDS if getattr(args, k, None) is not None}


def package_version() -> str:
    """The installed distribution's version (what pip reports), else the source tree's hsx.__version__."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hsx")
    except PackageNotFoundError:
        from hsx import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hsx", description="Extract hidden states of chosen layers of a "
                                     "Hugging Face causal LM into an Arrow dataset.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    ex = sub.add_parser("extract", help="run (or continue) an extraction job")
    _add_config_flags(ex)
    from hsx.bench import add_arguments as add_bench_arguments

    add_bench_arguments(sub.add_parser("bench", help="measure hsx against batch-1 and padded extraction"))
    pl = sub.add_parser("plan", help="weights, memory, token budget, disk and time of a job, before running it")
    _add_config_flags(pl)
    pl.add_argument("--shape", help="a named model shape instead of --model (see hsx.cost.SHAPES)")
    pl.add_argument("--tokens", type=int, help="total tokens (default: tokenize the dataset and count)")
    from hsx.cost import DEFAULT_GPU, GPUS

    pl.add_argument("--gpu", choices=sorted(GPUS), default=DEFAULT_GPU,
                    help="the GPU to plan for (the machine planning needs none): its memory and matmul rate")
    pl.add_argument("--rate", type=float, help="tokens/s per model copy to time the job at (default: the MFU measured for "
                    "the model's kind, dense 70%%, mixture of experts hsx.cost.PLAN_MFU_MOE, of --gpu's measured "
                    "bf16 matmul rate over the model's FLOPs per token)")
    pl.add_argument("--gpu-memory-gib", type=float, help="memory per GPU (default: --gpu's, 139 for an H200)")
    add_json_flag(pl, "the plan")
    me = sub.add_parser("merge", help="join the dirs the nodes of one job wrote into one output (metadata only)")
    me.add_argument("output_dir", help="the merged output dir to write (created if missing)")
    me.add_argument("dirs", nargs="+", help="the nodes' output dirs (output_dir may be one of them)")
    pu = sub.add_parser("push", help="upload a complete output dir to a Hub dataset repo (resumable)")
    pu.add_argument("output_dir", help="a finished hsx output dir (one with hsx.json)")
    pu.add_argument("repo_id", help="the Hub dataset repo, e.g. me/qwen3-8b-eagle3 (created if missing)")
    # the same flags, spelled the same, as `extract --push-to-hub`
    pu.add_argument("--hub-revision", help=HELP["hub_revision"] + " (created if missing)")
    pu.add_argument("--hub-private", action=argparse.BooleanOptionalAction, default=True, help=HELP["hub_private"])
    sf = sub.add_parser("export-specforge", help="write an output as SpecForge's offline EAGLE-3 or DFlash files")
    sf.add_argument("output_dir", help="a finished hsx output dir (eagle3: 3 or more layers and --final-hidden)")
    sf.add_argument("dest", help="the folder to write rows_K-END/data_I.ckpt files into (an export resumes)")
    sf.add_argument("--layout", choices=["eagle3", "dflash"], default="eagle3",
                    help="eagle3: hidden_state (final norm) + aux_hidden_state (3 layers); dflash: hidden_states "
                         "(every chosen layer)")
    sf.add_argument("--layers", nargs="+", type=int, help="stored layers to use, e.g. --layers 1 17 32 (default: "
                    "all; eagle3 takes 3)")
    sf.add_argument("--overwrite", action="store_true", help="rewrite files already in DEST")
    sp = sub.add_parser("export-speculators", help="write an output as speculators' offline training dir")
    sp.add_argument("output_dir", help="a finished hsx output dir")
    sp.add_argument("dest", help="the folder to write speculators' dataset, hidden_states/ and config into")
    sp.add_argument("--layers", nargs="+", type=int,
                    help="auxiliary layers (default: every stored one but the last decoder layer, the verifier's)")
    sp.add_argument("--draft-vocab-size", type=int, help="also write d2t-K.npy / t2d-K.npy for a K-token draft "
                    "vocabulary")
    sp.add_argument("--overwrite", action="store_true", help="rewrite files already in DEST")
    vo = sub.add_parser("vocab", help="the d2t/t2d draft-vocabulary mapping (SpecForge and speculators files)")
    vo.add_argument("output_dir", help="a finished hsx output dir (it holds token_frequencies.npy)")
    vo.add_argument("--draft-vocab-size", type=int, required=True, help="tokens in the draft vocabulary")
    vo.add_argument("--dest", help="folder for the mapping files (default: the output dir)")
    ve = sub.add_parser("verify", help="re-read an output dir, check it, and recompute rows with the reference")
    ve.add_argument("output_dir", help="the hsx output dir to check")
    ve.add_argument("--samples", type=int, default=8, help="rows to recompute with the reference forward")
    ve.add_argument("--tolerance", type=float, default=2e-2,
                    help="worst allowed relative error (Frobenius, per layer) against the reference")
    ve.add_argument("--seed", type=int, default=0, help="picks which rows are recomputed (the same seed, the same "
                    "rows)")
    ve.add_argument("--model", help="the reference model (local folder or Hub id; default: the folder hsx.json "
                    "records, run without its own code)")
    ve.add_argument("--trust-remote-code", action="store_true",
                    help="let the --model's own code run (never taken from hsx.json)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "extract":
            from hsx.run import extract

            extract(parse_config(args))
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
            out = OutputDir(args.output_dir)
            out.read_info(), out.manifest_records(), out.uploaded()  # damage is named before the Hub is reached
            with out.locked():
                push_output(args.output_dir, args.repo_id, private=args.hub_private, revision=args.hub_revision)
        elif args.command in ("export-specforge", "export-speculators", "vocab"):
            from hsx.export import export_specforge, export_speculators
            from hsx.vocab import write_draft_vocab

            try:
                if args.command == "export-specforge":
                    export_specforge(args.output_dir, args.dest, layers=args.layers, layout=args.layout,
                                     overwrite=args.overwrite)
                elif args.command == "export-speculators":
                    export_speculators(args.output_dir, args.dest, layers=args.layers,
                                       draft_vocab_size=args.draft_vocab_size, overwrite=args.overwrite)
                else:
                    write_draft_vocab(args.output_dir, args.draft_vocab_size, args.dest)
            except (ValueError, OSError) as e:
                raise HsxError(str(e)) from None
            except KeyError as e:
                raise HsxError(f"{args.output_dir}: hsx.json lacks {e} (not a finished hsx output?)") from None
        elif args.command == "verify":
            from hsx.verify import verify

            verify(args.output_dir, samples=args.samples, tolerance=args.tolerance, seed=args.seed,
                   model=args.model, trust_remote_code=args.trust_remote_code)
        elif args.command == "plan":
            from hsx.cost import format_plan, job_plan

            p = job_plan(args.config, config_overrides(args), shape=args.shape, tokens=args.tokens, gpu=args.gpu,
                         gpu_memory_gib=args.gpu_memory_gib, rate=args.rate)
            if args.json != "-":
                print(format_plan(p))
            if args.json:
                write_json(args.json, p)
    except HsxError as e:
        print(f"hsx: error: {e}", file=sys.stderr)
        return exit_status(e)
    except VerifyFailed as e:
        print(f"hsx: verify failed: {e}", file=sys.stderr)
        return exit_status(e)
    except Stopped as e:
        print(f"hsx: {e}", file=sys.stderr)
        return exit_status(e)
    except KeyboardInterrupt:
        print("hsx: interrupted; finished units are kept: run the same command to continue", file=sys.stderr)
        return EXIT_INTERRUPTED
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
