"""Command line: `hsx extract --config recipes/X.yaml [--flag value ...]` (also `python -m hsx`; over several
processes `hsx launch [accelerate launch options] extract ...`, hsx.launch, or `accelerate launch -m hsx extract`).

Every ExtractConfig field is a flag, with the help, default and choices its field's metadata gives (hsx.config);
flags override the YAML. What each subcommand then does is hsx.commands, imported by this module alone. Problems
the user can fix print as one line (`hsx: error: ...`) with no traceback and exit 2 for a usage error (a flag,
recipe or argument that is wrong by itself, found before anything is read), 1 for a runtime error (the data, model
or output dir; a failed verify): hsx.errors.
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator

from hsx.config import ADVANCED, EXTRACT_KEYS, FIELDS, REGENERATE_KEYS, default_of
from hsx.errors import (EXIT_INTERRUPTED, EXIT_RUNTIME, EXIT_USAGE, INTERRUPTED, HsxError, Stopped, VerifyFailed,
                        exit_status, file_system_error, file_system_line, one_line, usage_line)


class _Parser(argparse.ArgumentParser):
    """argparse with a usage error in one line (hsx.errors.usage_line), exit 2, told by the parser whose flags are
    wrong: an unknown flag after `hsx extract` is extract's error, not the top level's (argparse's parse_args
    reports every leftover argument from the top parser). Subparsers are of this class too (add_subparsers)."""

    def error(self, message):
        self.exit(EXIT_USAGE, usage_line(self.prog, message) + "\n")

    def parse_args(self, args=None, namespace=None):
        ns, extras = self.parse_known_args(args, namespace)
        if extras:
            self._innermost(ns).error(f"unrecognized arguments: {' '.join(extras)}")
        return ns

    def _innermost(self, ns: argparse.Namespace) -> argparse.ArgumentParser:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction) and getattr(ns, action.dest, None) in action.choices:
                sub = action.choices[getattr(ns, action.dest)]
                return sub._innermost(ns) if isinstance(sub, _Parser) else sub
        return self


class _HelpFormatter(argparse.HelpFormatter):
    """Shows a flag's default after its help, unless the help already says it (a config key's does, from its
    field's metadata: its argparse default is None, so that an unset flag leaves the recipe's key)."""

    def _get_help_string(self, action):
        text = action.help or ""
        if action.default not in (None, False, "", argparse.SUPPRESS) and "(default" not in text:
            text += " (default: %(default)s)"
        return text


def _as_help(value) -> str:
    if isinstance(value, bool):
        return "on" if value else "off"
    return " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def config_flag(p: argparse.ArgumentParser, name: str, prefix: str = "", default=None, keys=None) -> None:
    """The flag of config key `name`, with the help, default and choices of its ExtractConfig field (hsx.config),
    and the type its FIELD_KINDS entry gives (values are parsed and range-checked there, not here). `default`:
    this command's own default (bench's); else the flag is None unless given, and the help names the config's."""
    keys = keys or EXTRACT_KEYS  # (`hsx regenerate`'s keys: REGENERATE_KEYS)
    f, (kind, _) = keys.fields[name], keys.kinds[name]
    text = prefix + f.metadata["help"]
    shown = default if default is not None else keys.default_of(name)
    if shown not in (None, "", [], {}):
        text += f" (default: {_as_help(shown)})"
    text = text.replace("%", "%%")
    flag = "--" + name.replace("_", "-")
    if kind == "layers":
        p.add_argument(flag, nargs="+", help=text)
    elif kind == "bool":
        p.add_argument(flag, action=argparse.BooleanOptionalAction, help=text)
    elif kind == "int":
        p.add_argument(flag, type=int, help=text)
    elif kind == "float":
        p.add_argument(flag, type=float, help=text)
    else:  # str, or a mapping given as a JSON object
        p.add_argument(flag, type=str, choices=f.metadata.get("choices"), help=text)
    if default is not None:
        p.set_defaults(**{name: default})


ADVANCED_HELP = ("kernel choices, for benchmarking or stepping around a kernel: each default picks what works "
                 "fastest on the device (recipe keys too)")


def _add_config_flags(p: argparse.ArgumentParser) -> None:
    p.add_argument("--config", help="YAML recipe; flags override its keys")
    advanced = p.add_argument_group("advanced", ADVANCED_HELP)
    for name in FIELDS:
        config_flag(advanced if name in ADVANCED else p, name)


def add_json_flag(p: argparse.ArgumentParser, what: str) -> None:
    """`--json` for plan and bench alike: alone or `--json -` prints JSON to stdout, `--json PATH` writes a file."""
    p.add_argument("--json", nargs="?", const="-", metavar="PATH",
                   help=f"{what} as JSON: `--json` or `--json -` prints to stdout, `--json PATH` writes the file")


def _add_bench_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--shape", help="named model shape with random weights (see hsx.cost.SHAPES; default: qwen3-8b on "
                   "a GPU, tiny on CPU, where an 8B float32 forward takes minutes a row)")
    p.add_argument("--model", help="a model (local folder or Hub id) instead of --shape (its weights are used)")
    config_flag(p, "layers", "as for extract: ", default=["dflash"])
    config_flag(p, "final_hidden", "as for extract: ", default=False)
    p.add_argument("--count", type=int, default=2000, help="rows")
    p.add_argument("--mean", type=float, default=344.0, help="mean length of the lognormal body, tokens")
    p.add_argument("--spread", type=float, default=0.8, help="sigma of the lognormal body")
    p.add_argument("--tail", type=float, default=0.01, help="fraction of rows uniform in [max/2, max]")
    p.add_argument("--min-length", type=int, default=16, help="shortest row drawn, tokens")
    p.add_argument("--max-length", type=int, help="longest row drawn (and extract's --max-length; default: extract's, "
                   f"{default_of('max_length')}, on a GPU; 512 on CPU, where (b)'s padded batches of 32 rows of 4k "
                   "tokens took minutes)")
    p.add_argument("--seed", type=int, default=0, help="seed of the drawn lengths, token ids and (a)'s subset")
    for name in ("token_budget", "compile", "sdpa_backend", "gpus_per_copy", "experts_implementation", "packing",
                 "storage_dtype"):
        config_flag(p, name, "(c), as extract's: ", default=default_of(name))
    config_flag(p, "fp8_gemm", "(a)-(c), as extract's: ", default=default_of("fp8_gemm"))
    p.add_argument("--subset-a", type=int, default=200, help="rows for (a)")
    p.add_argument("--subset-b", type=int, default=320, help="rows for (b)")
    p.add_argument("--skip", default="", help="comma-separated runs to skip: a,b")
    p.add_argument("--output-dir", help="where (c) writes (default: a temp dir, deleted unless --keep)")
    p.add_argument("--keep", action="store_true", help="keep (c)'s output and the drawn input")
    p.add_argument("--storage-gb", type=float,
                   help="after (c), write this many GB to --output-dir's filesystem, buffered and O_DIRECT, and "
                        "report (c)'s write rate as a share of it (default: 4x (c)'s output, within 0.25-4 GB; at "
                        "most a quarter of the free space; 0: skip)")
    add_json_flag(p, "the results")
    p.add_argument("--profile", help="also profile a dozen batches of (c) with torch.profiler; write the table here")
    p.add_argument("--scaling-baseline", help="under a launcher: the --json of the same bench in one process; "
                   "report (c)'s scaling efficiency against it (docs/scale-out.md)")
    p.add_argument("--drift-rows", type=int, default=8,
                   help="FP8 targets: before (c), the captured layers' relative error against the bf16 forward of "
                        "the same (dequantized) weights on this many rows (0: skip)")
    p.add_argument("--gemms", nargs="?", const="", metavar="SHAPES",
                   help="instead of (a)-(c): TFLOP/s of bf16 and of each FP8 block-scaled GEMM (cuBLAS; DeepGEMM, "
                        "fbgemm where installed) on every FP8 linear shape of these comma-separated shapes (alone: "
                        "--shape), then exit")
    p.add_argument("--gemm-tokens", type=int, default=16384, help="--gemms: rows (tokens) of each product")


def package_version() -> str:
    """The installed distribution's version (what pip reports), else the source tree's hsx.__version__."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("hsx")
    except PackageNotFoundError:
        from hsx import __version__

        return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="hsx", description="Extract hidden states of chosen layers of a "
                                     "Hugging Face causal LM into an Arrow dataset.")
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    def command(name: str, help: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help, formatter_class=_HelpFormatter)

    _add_config_flags(command("extract", "run (or continue) an extraction job"))
    rg = command("regenerate", "the target's own answers for a dataset's conversations, for extract (docs/regenerate.md)")
    rg.add_argument("--config", help="YAML recipe of regenerate's keys; flags override them")
    for name in REGENERATE_KEYS.fields:
        config_flag(rg, name, keys=REGENERATE_KEYS)
    # Listed here for `hsx --help`; main hands `hsx launch ...` to hsx.launch before this parser reads it.
    sub.add_parser("launch", add_help=False, help="run extract or bench over several processes: `hsx launch "
                   "[accelerate launch options] extract ...` (see `hsx launch --help`)")
    _add_bench_arguments(command("bench", "measure hsx against batch-1 and padded extraction"))
    pl = command("plan", "weights, memory, token budget, disk and time of a job, before running it")
    _add_config_flags(pl)
    pl.add_argument("--shape", help="a named model shape instead of --model (see hsx.cost.SHAPES)")
    pl.add_argument("--tokens", type=int, help="total tokens (default: tokenize the dataset and count)")
    from hsx.cost import DEFAULT_GPU, GPUS

    pl.add_argument("--gpu", choices=sorted(GPUS), default=DEFAULT_GPU,
                    help="the GPU to plan for (the machine planning needs none): its memory, its matmul rate (its "
                    "datasheet rate x the share of the datasheet a matmul reached on the H200, the GPU measured: one "
                    "basis for all; hsx.cost.GPUS) and the kernels that run there")
    pl.add_argument("--rate", type=float, help="tokens/s per model copy to time the job at (default: the MFU measured for "
                    "the model's kind, dense 70%%, mixture of experts hsx.cost.PLAN_MFU_MOE, of --gpu's planned "
                    "bf16 matmul rate over the model's FLOPs per token)")
    pl.add_argument("--gpu-memory-gib", type=float, help="memory per GPU (default: --gpu's, 139 for an H200)")
    add_json_flag(pl, "the plan")
    me = command("merge", "join the dirs the nodes of one job wrote into one output (metadata only)")
    me.add_argument("output_dir", help="the merged output dir to write (created if missing)")
    me.add_argument("dirs", nargs="+", help="the nodes' output dirs (output_dir may be one of them)")
    me.add_argument("--partial", action="store_true", help="join the units there are when some are in none of the "
                    "dirs (a node's dir was lost); the job's `hsx extract --output-dir OUTPUT_DIR` then writes the "
                    "rest and finishes it")
    pu = command("push", "upload a complete output dir to a Hub dataset repo (resumable)")
    pu.add_argument("output_dir", help="a finished hsx output dir (one with hsx.json)")
    pu.add_argument("repo_id", help="the Hub dataset repo, e.g. me/qwen3-8b-eagle3 (created if missing)")
    # the same flags, spelled the same, as `extract --push-to-hub`
    for name in ("hub_revision", "hub_private", "hub_overwrite"):
        config_flag(pu, name, default=default_of(name))
    from hsx.export import SPECFORGE_LAYOUTS  # (no torch, datasets or transformers: `hsx --help` stays fast)
    from hsx.exports import EXPORTS

    def specforge_flags(sf: argparse.ArgumentParser) -> None:
        sf.add_argument("output_dir", help="a finished hsx output dir (eagle3: 3 or more layers and --final-hidden)")
        sf.add_argument("dest", help="the folder to write rows_K-END/data_I.ckpt files into (an export resumes)")
        sf.add_argument("--layout", choices=SPECFORGE_LAYOUTS, default="eagle3",
                        help="eagle3: hidden_state (final norm) + aux_hidden_state (3 layers); dflash (DFlash, "
                             "DFlash2, Domino): hidden_states (every chosen layer); dspark: dflash's + "
                             "target_last_hidden_states (final norm)")
        sf.add_argument("--layers", nargs="+", type=int, help="stored layers to use, e.g. --layers 1 17 32 (default: "
                        "all; eagle3 takes 3)")

    def speculators_flags(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("output_dir", help="a finished hsx output dir")
        sp.add_argument("dest", help="the folder to write speculators' dataset, hidden_states/ and config into")
        sp.add_argument("--layers", nargs="+", type=int,
                        help="auxiliary layers (default: every stored one but the last decoder layer, the verifier's)")
        sp.add_argument("--draft-vocab-size", type=int, help="also write d2t-K.npy / t2d-K.npy for a K-token draft "
                        "vocabulary")

    own_flags = {"export_specforge": specforge_flags, "export_speculators": speculators_flags}
    for spec in EXPORTS:  # (hsx.exports: the one table of exports)
        ex = command(spec.command, spec.summary)
        own_flags[spec.function](ex)
        ex.add_argument("--overwrite", action="store_true", help="replace the export in DEST (only files its "
                        "hsx-export.json proves hsx wrote are deleted)")
        ex.add_argument("--delete-source", action="store_true", help="delete each unit of OUTPUT_DIR once its "
                        "exported files are durable (peak disk: the export plus one unit; OUTPUT_DIR is used up)")
    vo = command("vocab", "the d2t/t2d draft-vocabulary mapping (SpecForge and speculators files)")
    vo.add_argument("output_dir", help="a finished hsx output dir (it holds token_frequencies.npy)")
    vo.add_argument("--draft-vocab-size", type=int, required=True, help="tokens in the draft vocabulary")
    vo.add_argument("--dest", help="folder for the mapping files (default: the output dir)")
    ve = command("verify", "re-read an output dir, check it, and recompute rows with the reference")
    ve.add_argument("output_dir", help="the hsx output dir to check")
    ve.add_argument("--samples", type=int, help="rows to recompute with the reference forward (default: 8; 0 with "
                    "--against-bf16)")
    ve.add_argument("--tolerance", type=float, default=2e-2,
                    help="worst allowed relative error (Frobenius, per layer) against the reference")
    ve.add_argument("--seed", type=int, default=0, help="picks which rows are recomputed (the same seed, the same "
                    "rows)")
    ve.add_argument("--model", help="the reference model (local folder or Hub id; default: the folder hsx.json "
                    "records, run without its own code)")
    ve.add_argument("--trust-remote-code", action="store_true",
                    help="let the --model's own code run (never taken from hsx.json)")
    ve.add_argument("--against-bf16", type=int, metavar="N",
                    help="FP8 targets: run N rows spread over the output again, FP8 and on the bf16 weights "
                         "dequantized, and print each stored layer's relative error (stored vs bf16, FP8 vs bf16, "
                         "stored vs FP8); more than the output holds: all of them")
    add_json_flag(ve, "the --against-bf16 report")
    sv = command("serve", "serve an output dir's committed units to trainers over Arrow Flight (hsx.follow)")
    sv.add_argument("output_dir", help="the hsx output dir (being written by `hsx extract`, or finished)")
    sv.add_argument("--host", default="127.0.0.1", help="address to listen on; other than loopback needs a token")
    sv.add_argument("--port", type=int, default=8815, help="port to listen on (0: a free one, printed)")
    sv.add_argument("--token-file", help="file whose first line is the bearer token clients must send (default: "
                    "$HSX_SERVE_TOKEN)")
    sv.add_argument("--bench", type=float, metavar="SECONDS", help="instead of serving: GB/s a loopback server "
                    "hands out to clients reading every committed unit for SECONDS, checking each batch as "
                    "hsx.follow does")
    sv.add_argument("--clients", type=int, default=1, metavar="N", help="with --bench: N clients at once, each on "
                    "its own connection (several trainer ranks)")
    sv.add_argument("--units-ahead", type=int, metavar="N", help="with --bench: each client is an hsx.follow reader "
                    "taking every row, N units read ahead (what one trainer rank gets), instead of raw reads")
    sv.add_argument("--consumers", metavar="NAME,...", help="declare these consumers of the output dir: a unit is "
                    "deleted only once each of them (and every other declared consumer) consumed it")
    co = command("consumers", "list an output dir's consumers (hsx.follow with delete_consumed), declare some, or "
                 "retire one that stopped for good")
    co.add_argument("output_dir", help="the hsx output dir")
    co.add_argument("--declare", metavar="NAME,...", help="declare these consumers before any reads: units then "
                    "wait for each of them")
    co.add_argument("--retire", metavar="NAME", help="retire this consumer: it no longer holds units back; the units "
                    "every consumer left consumed are deleted, and named")
    add_json_flag(co, "the list of consumers")
    return parser


@contextlib.contextmanager
def _sigterm_as_interrupt(received: list[int]) -> Iterator[None]:
    """SIGTERM (a scheduler's, `kill`) ends a command as Ctrl-C does: one line, exit 143, the same cleanup on the
    way out, instead of a silent death by signal. Only where nothing handles it yet (left alone when ignored, as
    under nohup); `hsx extract` sets its own (stop after the unit) inside."""
    import signal
    import threading

    def on_term(signum, frame):
        received.append(signum)
        raise KeyboardInterrupt(signum)

    if threading.current_thread() is not threading.main_thread() or \
            signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        yield
        return
    signal.signal(signal.SIGTERM, on_term)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)


@contextlib.contextmanager
def _interrupts_out_of_finalizers() -> Iterator[None]:
    """A signal handler's exception (KeyboardInterrupt; torch elastic's SignalException in the launcher) raised while
    a finalizer runs (`__del__`, a weakref callback) cannot leave it: Python prints "Exception ignored ... Traceback"
    and goes on, so a second Ctrl-C would print a traceback and stop nothing. Within the block such an exception is
    delivered again to the main thread's handler for its signal, where it can propagate."""
    previous = sys.unraisablehook

    def unraisable(u):
        signum = _signal_of(u.exc_value)
        if signum is None:
            return previous(u)
        try:
            _interrupt_main_later(signum)
        except BaseException as e:  # the interrupt landed in this hook after all (a loaded machine): once more
            again = _signal_of(e)
            if again is None:
                raise
            _interrupt_main_later(again)

    sys.unraisablehook = unraisable
    try:
        yield
    finally:
        sys.unraisablehook = previous


def _signal_of(e: BaseException) -> int | None:
    """The signal a handler's exception stands for (KeyboardInterrupt: its number if it carries one, else SIGINT;
    torch elastic's SignalException: its sigval), None for any other exception."""
    import signal

    if type(e).__name__ == "SignalException":
        return int(e.sigval) if getattr(e, "sigval", None) is not None else None
    if isinstance(e, KeyboardInterrupt):
        return _carried_signal(e) or int(signal.SIGINT)
    return None


def _carried_signal(e: KeyboardInterrupt) -> int | None:
    """The signal number a KeyboardInterrupt carries (hsx's handlers raise KeyboardInterrupt(signum)), else None."""
    return e.args[0] if e.args and type(e.args[0]) is int and 0 < e.args[0] < 128 else None


def _interrupt_main_later(signum: int) -> None:
    """Run the main thread's handler for `signum` again, from another thread, once the main thread has left this
    hook (`unraisable`): called at once, or at a fixed delay, the handler could run inside the very hook that asks
    for it, where its exception is lost ("Exception ignored in sys.unraisablehook"; on a loaded machine a short
    delay did not always take the main thread out of the hook). The other thread watches the main thread's stack
    (sys._current_frames) until the hook's frame is gone, then sends the signal to it. The caller does not wait
    for that thread to start (threading.Thread.start does), for the same reason."""
    import _thread
    import signal
    import threading
    import time

    main = threading.main_thread().ident
    hook = getattr(sys.unraisablehook, "__code__", None)  # (called from the hook: `unraisable`'s code)

    def in_hook() -> bool:
        frame = sys._current_frames().get(main)
        while frame is not None:
            if frame.f_code is hook:
                return True
            frame = frame.f_back
        return False

    def later():
        while hook is not None and in_hook():
            time.sleep(0.001)
        if callable(signal.getsignal(signum)) and hasattr(signal, "pthread_kill"):
            try:  # a real signal: it also ends a blocking call the main thread is in (interrupt_main sets a flag)
                signal.pthread_kill(main, signum)
                return
            except OSError:  # (the main thread is gone)
                return
        _thread.interrupt_main(signum)  # (a handler no longer Python's: this does nothing, as the signal would)

    try:
        _thread.start_new_thread(later, ())
    except RuntimeError:  # no new thread at interpreter shutdown: the process is ending anyway
        pass


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    with _interrupts_out_of_finalizers():
        if argv[:1] == ["launch"]:  # (the launcher hands its signals to the ranks: hsx.launch)
            return _main(argv, [])
        received: list[int] = []
        with _sigterm_as_interrupt(received):
            return _main(argv, received)


def _main(argv: list[str], received: list[int]) -> int:
    from hsx.commands import COMMANDS

    parser = build_parser()
    try:
        if argv[:1] == ["launch"]:  # accelerate's options, which hsx's parser does not know: hsx.launch reads them
            from hsx.launch import launch

            _check_temporary_dir()
            return launch(argv[1:], parser)
        args = parser.parse_args(argv)
        _check_temporary_dir()
        COMMANDS[args.command](args)
    except HsxError as e:
        print(f"hsx: error: {e}", file=sys.stderr)
        return exit_status(e)
    except VerifyFailed as e:
        print(f"hsx: verify failed: {e}", file=sys.stderr)
        return exit_status(e)
    except Stopped as e:
        print(f"hsx: {e}", file=sys.stderr)
        return exit_status(e)
    except KeyboardInterrupt as e:
        print(INTERRUPTED, file=sys.stderr)
        return _interrupted_status(e, received)
    except Exception as e:
        interrupt = _interrupt_behind(e)
        if interrupt is None:
            fault = file_system_error(e)  # (a full disk, a size limit, a read-only dir: in any command)
            if fault is None:
                raise
            print(f"hsx: error: {file_system_line(fault)}", file=sys.stderr)
            return EXIT_RUNTIME
        # Raised by clean-up code the interrupt ran through (datasets' writer finalizing a file the interrupt
        # had closed, say): the command ended because of the signal, and says so in one line.
        print(INTERRUPTED, file=sys.stderr)
        return _interrupted_status(interrupt, received)
    return 0


def _check_temporary_dir() -> None:
    """HsxError unless Python finds a usable temporary directory: `import datasets` asks for one (through dill), so
    without one every command that reads or writes an output ended in a 47-line traceback of library imports. A
    file size limit (`ulimit -f`) makes none usable (Python writes a small file in each to choose)."""
    import resource
    import tempfile

    try:
        tempfile.gettempdir()
    except OSError as e:
        limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
        why = (f": files are limited to {limit:,} bytes here (ulimit -f); raise the limit"
               if limit != resource.RLIM_INFINITY and limit < (1 << 20) else
               ": make one writable, or set TMPDIR to a writable folder")
        raise HsxError(f"no usable temporary directory ({one_line(e, 200)}){why}") from None


def _interrupt_behind(e: BaseException) -> KeyboardInterrupt | None:
    """The KeyboardInterrupt that `e` was raised while handling (its __context__ chain), if any."""
    seen = set()
    while e is not None and id(e) not in seen and len(seen) < 64:
        if isinstance(e, KeyboardInterrupt):
            return e
        seen.add(id(e))
        e = e.__context__
    return None


def _interrupted_status(e: KeyboardInterrupt, received: list[int]) -> int:
    """128 + the signal: the one the interrupt carries (hsx's handlers raise KeyboardInterrupt(signum)), else
    the SIGTERM `_sigterm_as_interrupt` turned into it, else SIGINT's."""
    carried = _carried_signal(e)
    if carried:
        return 128 + carried
    return 128 + received[0] if received else EXIT_INTERRUPTED


if __name__ == "__main__":
    raise SystemExit(main())
