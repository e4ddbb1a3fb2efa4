"""What each `hsx` subcommand does with its parsed flags: the glue between the command line and the library.

On top of the package: hsx.cli (the parser and the exit statuses) alone imports this module, and nothing below
imports either. Each function takes argparse's namespace, calls the library, and prints what the command prints;
a problem is raised (hsx.errors) for hsx.cli to print as one line. The heavy imports (torch, datasets,
transformers) happen inside each command, on the call, so `hsx --help` imports none of them.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from hsx import ledgers
from hsx.config import config_of, config_overrides
from hsx.errors import HsxError, UsageError, file_system_error, file_system_line
from hsx.exports import EXPORTS, Export
from hsx.info import recorded_info


def write_json(dest: str, obj) -> None:
    """`--json` for plan, bench and verify alike: "-" is stdout, anything else a file path."""
    text = json.dumps(obj, indent=2) + "\n"
    if dest == "-":
        sys.stdout.write(text)
    else:
        try:
            Path(dest).write_text(text)
        except OSError as e:  # a folder, a missing parent, a read-only file system
            raise HsxError(f"cannot write --json {dest}: {e.strerror or e}") from None


def log_beside_json(dest: str | None):
    """The command's print: with `--json -` stdout is the JSON (as `hsx plan --json`), so lines and tables go to
    stderr."""
    return (lambda *a, **k: print(*a, **k, file=sys.stderr)) if dest == "-" else print


def extract(args: argparse.Namespace) -> None:
    cfg = config_of(args)
    if cfg.elastic and "torch" not in sys.modules:
        # The claims store's client logs each failed socket call as a C++ warning with a 20-frame stack dump, then
        # raises it, and hsx says what it means in one line (a store whose agent ended while this node waited at
        # its end, a lost store): torch's C++ warnings off, its errors kept, unless TORCH_CPP_LOG_LEVEL is set
        # (read once, when torch loads: hence here, before anything imports it).
        os.environ.setdefault("TORCH_CPP_LOG_LEVEL", "ERROR")
    from hsx.run import extract as run_extract

    run_extract(cfg)


def regenerate(args: argparse.Namespace) -> None:
    from hsx.config import REGENERATE_KEYS, load_regenerate_config
    from hsx.regeneration import regenerate as run_regenerate

    overrides = {k: getattr(args, k) for k in REGENERATE_KEYS.fields if getattr(args, k, None) is not None}
    run_regenerate(load_regenerate_config(args.config, overrides))


def plan(args: argparse.Namespace) -> None:
    from hsx.cost import format_plan, job_plan

    p = job_plan(args.config, config_overrides(args), shape=args.shape, tokens=args.tokens, gpu=args.gpu,
                 gpu_memory_gib=args.gpu_memory_gib, rate=args.rate)
    if args.json != "-":
        print(format_plan(p))
    if args.json:
        write_json(args.json, p)


def bench(args: argparse.Namespace) -> None:
    from hsx.bench import bench as run_bench
    from hsx.errors import check_range

    for flag, low, high in (("count", 1, 2**31 - 1), ("min_length", 1, 2**31 - 1), ("seed", 0, 2**32 - 1),
                            ("subset_a", 0, 2**31 - 1), ("subset_b", 0, 2**31 - 1), ("drift_rows", 0, 2**31 - 1)):
        check_range(f"--{flag.replace('_', '-')}", getattr(args, flag), low, high)
    for flag, low, high in (("mean", 1, 2**31 - 1), ("spread", 0, 100), ("tail", 0, 1), ("storage_gb", 0, None)):
        check_range(f"--{flag.replace('_', '-')}", getattr(args, flag), low, high, integer=False)
    log = log_beside_json(args.json)
    if args.gemms is not None:
        from hsx.bench import GPU_BENCH_SHAPE, bench_gemms

        check_range("--gemm-tokens", args.gemm_tokens, 1, 2**20)
        shapes = [s.strip() for s in (args.gemms or args.shape or GPU_BENCH_SHAPE).split(",") if s.strip()]
        results = bench_gemms(shapes, args.gemm_tokens, log=log)
        if args.json:
            write_json(args.json, results)
        return
    # The main process hands its results over once measured, and again with the profile's path when it is written.
    run_bench(args, log=log, on_results=(lambda results: write_json(args.json, results)) if args.json else None)


def merge(args: argparse.Namespace) -> None:
    from hsx.merge import merge as merge_dirs

    merge_dirs(args.output_dir, args.dirs, partial=args.partial)


def push(args: argparse.Namespace) -> None:
    from hsx.hub import push_output
    from hsx.sink import OutputDir

    if not (Path(args.output_dir) / "hsx.json").is_file():
        raise HsxError(f"{args.output_dir} is not a finished hsx output (no hsx.json)")
    out = OutputDir(args.output_dir, given_as="OUTPUT_DIR of `hsx push` (a dir `hsx extract` wrote)")
    # damage is named before the Hub is reached
    recorded_info(out.root), ledgers.manifest_records(out.state), ledgers.uploaded(out.state)
    with out.locked():
        push_output(args.output_dir, args.repo_id, private=args.hub_private, revision=args.hub_revision,
                    overwrite=args.hub_overwrite)


def _export(spec: Export):
    """The subcommand of one row of hsx.exports.EXPORTS: its hsx.export function, given its flags."""

    def run(args: argparse.Namespace) -> None:
        from hsx import export

        with _output_errors(args.output_dir, args.dest):
            getattr(export, spec.function)(args.output_dir, args.dest,
                                           **{name: getattr(args, name) for name in spec.options})

    run.__name__ = spec.function
    return run


def vocab(args: argparse.Namespace) -> None:
    from hsx.vocab import write_draft_vocab

    with _output_errors(args.output_dir):
        write_draft_vocab(args.output_dir, args.draft_vocab_size, args.dest)


def verify(args: argparse.Namespace) -> None:
    from hsx.errors import UsageError, check_range
    from hsx.verify import against_bf16
    from hsx.verify import verify as run_verify

    against = args.against_bf16
    if against is not None:
        check_range("--against-bf16", against, 1, 2**31 - 1)
    elif args.json:
        raise UsageError("--json writes the --against-bf16 report: give --against-bf16 N")
    samples = args.samples if args.samples is not None else (0 if against else 8)
    log = log_beside_json(args.json)
    run_verify(args.output_dir, samples=samples, tolerance=args.tolerance, seed=args.seed, model=args.model,
               trust_remote_code=args.trust_remote_code, log=log)
    if against:
        report = against_bf16(args.output_dir, against, model=args.model, trust_remote_code=args.trust_remote_code,
                              log=log)
        if args.json:
            write_json(args.json, report)


def serve(args: argparse.Namespace) -> None:
    from hsx.errors import check_range
    from hsx.serve import bench_serve
    from hsx.serve import serve as run_serve

    check_range("--port", args.port, 0, 65535)
    if args.bench is not None:
        check_range("--bench", args.bench, 0.1, 3600, integer=False)
        check_range("--clients", args.clients, 1, 256)
        if args.units_ahead is not None:
            check_range("--units-ahead", args.units_ahead, 0, 64)
        bench_serve(args.output_dir, args.bench, args.clients, units_ahead=args.units_ahead)
        return
    if args.clients != 1 or args.units_ahead is not None:
        raise UsageError(f"{'--clients' if args.clients != 1 else '--units-ahead'} is --bench's: what it measures")
    run_serve(args.output_dir, args.host, args.port, args.token_file, consumers=_names(args.consumers, "--consumers"))


def _names(given: str | None, flag: str) -> list[str] | None:
    """A comma-separated list of consumer names (UsageError for an empty one or a name that is not one)."""
    from hsx.errors import UsageError
    from hsx.schema import CONSUMER_NAME

    if given is None:
        return None
    names = [n.strip() for n in given.split(",")]
    bad = [n for n in names if not CONSUMER_NAME.fullmatch(n)]
    if bad:
        raise UsageError(f"{flag} {given[:80]!r}: comma-separated names of letters, digits and _ "
                         f"(not {bad[0][:40]!r})")
    return names


def consumers(args: argparse.Namespace) -> None:
    from hsx.errors import UsageError
    from hsx.follow import consumer_report, retire
    from hsx.ledgers import declare_consumers
    from hsx.sink import OutputDir

    if args.declare is not None and args.retire is not None:
        raise UsageError("--declare and --retire: one at a time")
    if args.declare is not None:
        out = OutputDir(Path(args.output_dir))
        if not out.root.is_dir():
            raise HsxError(f"{args.output_dir} is not a folder: make it (or start the job) first")
        out.check_no_links()
        new = declare_consumers(out.state, _names(args.declare, "--declare"), "hsx consumers --declare")
        print(f"hsx consumers: declared {', '.join(new) or 'nothing new'} in {args.output_dir}")
    elif args.retire is not None:
        retire(args.output_dir, args.retire)
    report = consumer_report(args.output_dir)
    if args.json:
        write_json(args.json, report)
    if args.retire is None:
        print(f"hsx consumers: {args.output_dir}: {len(report['consumers'])} consumer(s); {report['released']} of "
              f"its {report['units']} committed unit(s) consumed by all of them")
        for c in report["consumers"]:
            live = "a live local reader" if c["live"] else "no live local reader"
            print(f"  {c['name']}: declared by {c['declared_by']}; ranks {','.join(map(str, c['ranks'])) or '-'}; "
                  f"{c['consumed']} unit(s) consumed whole; {live}"
                  + (f"; holds back {len(c['holds_back'])} unit(s) the others consumed (--retire {c['name']} "
                     "releases them)" if c["holds_back"] else ""))
        for name, when in report["retired"].items():
            print(f"  {name}: retired {when}")


@contextmanager
def _output_errors(output_dir: str, dest: str | None = None) -> Iterator[None]:
    """An export's or vocab's ValueError/OSError is the output dir's (or DEST's) problem: one HsxError line; a
    file-system error without a path of its own is named as DEST's (what an export writes)."""
    try:
        yield
    except UsageError:  # (an ArgumentError is a ValueError too: a wrong argument, exit 2)
        raise
    except (ValueError, OSError) as e:
        fault = file_system_error(e)
        raise HsxError(file_system_line(fault, dest) if fault is not None else str(e)) from None
    except KeyError as e:
        raise HsxError(f"{output_dir}: hsx.json lacks {e} (not a finished hsx output?)") from None


COMMANDS = {"extract": extract, "regenerate": regenerate, "plan": plan, "bench": bench, "merge": merge, "push": push,
            **{spec.command: _export(spec) for spec in EXPORTS}, "vocab": vocab,
            "verify": verify, "serve": serve, "consumers": consumers}
