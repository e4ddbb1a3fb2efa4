"""`hsx launch [accelerate launch options] COMMAND [ARGS]`: `accelerate launch -m hsx COMMAND ARGS`, ending with
one line and the ranks' exit status instead of the launcher's traceback.

Every `accelerate launch` option works: accelerate's own `launch_command_parser()` reads them and its
`launch_command()` runs the job. Only the end differs:
- Ctrl-C (SIGINT) or SIGTERM reaches the launcher; torch.distributed.elastic's agent passes it to every rank (each
  stops after its unit: hsx.run) and raises SignalException. One line, exit 128 + the signal's number (130, 143).
  A second signal makes the agent send SIGTERM too: the ranks stop at once, their finished units kept.
- ranks that fail (each printed its own `hsx: error: ...`) raise ChildFailedError: one line naming each failed rank
  and its exit status; exit with the first one's (1, 2; 128 + N for a rank killed by signal N).
- one process (accelerate's plain subprocess): it runs in its own session, as the agent starts ranks, with the same
  four signals forwarded, and its exit status passes through (accelerate itself turns it into a traceback, or 1);
  killed by a signal (the OOM killer's SIGKILL), one line names it.
- refused in one line before any process starts: the hsx command's flags and recipe (`hsx extract`'s whole
  config, as each rank would read it), a --config_file (or accelerate's default one) that is missing,
  not a regular file, not a mapping, uses YAML aliases or names a SageMaker job; fewer than 1 process, or more per
  machine than it has cores; over several machines, a process count that is not a multiple of theirs (accelerate
  would start fewer) or a --machine_rank outside them; any other value accelerate rejects (its ValueError, not its
  traceback).
- several processes start several: a launch accelerate would run as one process (no GPU, no --multi_gpu or other
  distributed mode) takes its --multi_gpu path, torch's launcher, on CPUs as on GPUs; --cpu with several processes
  is refused (accelerate runs it as one process, several only through mpirun).
- --debug (or `debug: true` in the config file) still sets ACCELERATE_DEBUG_MODE in the ranks; a failure still
  ends as above (accelerate's launchers, with --debug and ACCELERATE_ENABLE_RICH set, print the launcher's stack
  trace in place of raising it: the command exited 0 with its ranks failed).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator

from hsx.errors import EXIT_INTERRUPTED, EXIT_USAGE, INTERRUPTED, UsageError, one_line, usage_line

RANK_COMMANDS = ("extract", "bench", "regenerate")  # the commands that split their work over the ranks of a launch
RANK_COMMANDS_TEXT = f"{', '.join(RANK_COMMANDS[:-1])} or {RANK_COMMANDS[-1]}"
# What torch.distributed.elastic's agent catches (its default TORCHELASTIC_SIGNALS_TO_HANDLE) and passes to ranks.
FORWARDED = tuple(getattr(signal, s) for s in ("SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT") if hasattr(signal, s))


def _describe(parser: argparse.ArgumentParser) -> None:
    parser.prog = "hsx launch"
    parser.usage = "hsx launch [accelerate launch options] COMMAND [ARGS]"
    parser.description = (
        "Run `hsx COMMAND ARGS` (extract, bench or regenerate) as every process of an `accelerate launch`: accelerate's "
        "options (below, or its --config_file) first, then the hsx command and its flags. Ctrl-C stops each rank "
        "after its unit (twice: at once) and ends with one line, exit 130 (143 for SIGTERM); failed ranks end "
        "with one line naming them, and the first one's exit status.")
    # accelerate's formatter picks which options to show from sys.argv, which holds hsx's command line here
    parser.formatter_class = argparse.HelpFormatter
    for action in parser._actions:
        if action.dest == "training_script":
            action.metavar, action.help = "COMMAND", f"the hsx command: {RANK_COMMANDS_TEXT}"
        elif action.dest == "training_script_args":
            action.metavar, action.help = "ARGS", "its flags, as for `hsx COMMAND` (e.g. --config R --output-dir OUT)"
        elif action.dest in ("module", "no_python"):
            action.help = argparse.SUPPRESS  # hsx launch runs `python -m hsx` itself


def parse(argv: list[str], hsx_parser: argparse.ArgumentParser) -> argparse.Namespace:
    """accelerate's launch options from `argv`, with the training script set to `-m hsx COMMAND ARGS`. COMMAND and
    its flags are checked here by `hsx_parser` (hsx.cli's), once, rather than by every rank after the launch."""
    from accelerate.commands.launch import launch_command_parser

    parser = launch_command_parser()
    _describe(parser)
    parser.error = lambda message: parser.exit(EXIT_USAGE, usage_line(parser.prog, message) + "\n")  # one line
    args = parser.parse_args(argv)
    if getattr(args, "module", False) or getattr(args, "no_python", False):
        raise UsageError("hsx launch runs `python -m hsx COMMAND` itself: drop -m/--module and --no_python")
    command = args.training_script
    if command not in RANK_COMMANDS:
        raise UsageError(f"hsx launch runs {RANK_COMMANDS_TEXT}, not {command!r} (accelerate's options "
                         "go before the command, hsx's after it)")
    ns = hsx_parser.parse_args([command, *args.training_script_args])  # a bad flag: extract's one-line usage error, exit 2
    path, config = _check_accelerate_config(args)
    if path is None:
        _pass_accelerate_defaults(args)
    _run_every_process(args, config)
    if command == "extract":  # the recipe and the flags, read once here: every rank would fail on them alike,
        from hsx.config import config_of  # each with its own line, after the launch (a FIFO recipe: each hangs)

        config_of(ns)
    elif command == "regenerate":
        from hsx.config import REGENERATE_KEYS, load_regenerate_config

        load_regenerate_config(ns.config, {k: getattr(ns, k) for k in REGENERATE_KEYS.fields
                                           if getattr(ns, k, None) is not None})
    elif getattr(ns, "config", None):
        from hsx.config import read_recipe

        read_recipe(ns.config)
    args.module, args.training_script = True, "hsx"
    args.training_script_args = [command, *args.training_script_args]
    return args


MAX_ACCELERATE_CONFIG_BYTES = 1 << 20  # `accelerate config` writes ~0.5 KB


def _pass_accelerate_defaults(args: argparse.Namespace) -> None:
    """Without a config file, accelerate fills in --num_processes (its devices, at least 1), --num_machines 1,
    --mixed_precision no and --dynamo_backend no, and prints a 7-line "values were not passed" block at every launch
    saying so: hsx passes those same values (none of them changes what hsx runs: hsx picks its own dtype and
    compile), as the block asks, so the launch prints nothing of its own. Values given are kept."""
    import torch

    gpus = torch.cuda.device_count() if not args.cpu else 0
    if args.num_processes is None:
        args.num_processes = max(gpus, 1)
    if args.num_processes > 1 and gpus > 1:  # (accelerate turns it on and says so in the same block)
        args.multi_gpu = True
    for key, value in (("num_machines", 1), ("mixed_precision", "no"), ("dynamo_backend", "no")):
        if getattr(args, key, None) is None:
            setattr(args, key, value)


def _run_every_process(args: argparse.Namespace, config: dict) -> None:
    """Several processes start several processes. accelerate runs a launch it does not see as distributed (no GPU
    count above 1, no --multi_gpu, DeepSpeed, FSDP, Megatron-LM, TPU or mpirun hostfile) as ONE process through its
    plain subprocess launcher, whatever --num_processes says, and says nothing. hsx's ranks need no GPU to split a
    job (gloo on CPU: hsx.run), so such a launch takes accelerate's --multi_gpu path: torch's launcher starting
    every process, on CPUs as on GPUs. --cpu (or `use_cpu` in the config file) keeps accelerate on its plain
    launcher, which runs several CPU processes only through mpirun: refused in one line, saying so."""
    processes = getattr(args, "num_processes", None) or config.get("num_processes") or 1
    machines = getattr(args, "num_machines", None) or config.get("num_machines") or 1
    if processes <= 1 and machines <= 1:
        return
    chosen = [k for k in ("multi_gpu", "use_deepspeed", "use_fsdp", "use_megatron_lm", "tpu", "mpirun_hostfile")
              if getattr(args, k, None)]
    if chosen or str(config.get("distributed_type", "NO")).upper() not in ("NO", "MULTI_GPU", "MULTI_CPU"):
        return  # (a distributed type of the config file's, a launcher of its own: accelerate's choice stands)
    if args.cpu or config.get("use_cpu") is True:
        raise UsageError(f"--num_processes {processes} with --cpu: accelerate runs --cpu as one process (several "
                         "only through mpirun, --mpirun_hostfile); drop --cpu: on a machine without GPUs hsx launch "
                         "starts every process on the CPU")
    args.multi_gpu = True


def _check_accelerate_config(args: argparse.Namespace) -> tuple[str | None, dict]:
    """UsageError in one line for what accelerate would turn into a traceback, a hang or a job elsewhere: a
    --config_file (or accelerate's default one) that is missing, not a regular file (a FIFO hangs its reader),
    not a YAML/JSON mapping, or sets up a SageMaker job; a process count below 1, or more per machine than this
    machine has cores (each rank is a process with its own model). Returns the config file's path (None: none)
    and what it holds."""
    import yaml
    from accelerate.commands.config import default_config_file

    from hsx.config import HsxError, read_small_file

    path = args.config_file or (default_config_file if os.path.isfile(default_config_file) else None)
    config: dict = {}
    if path is not None:
        try:
            blob = read_small_file(path, MAX_ACCELERATE_CONFIG_BYTES, "accelerate config file")
        except HsxError as e:
            raise UsageError(str(e)) from None
        if len(blob) > MAX_ACCELERATE_CONFIG_BYTES:
            raise UsageError(f"accelerate config file {path}: over {MAX_ACCELERATE_CONFIG_BYTES >> 20} MiB")
        try:
            config = yaml.load(blob.decode("utf-8"), Loader=_no_alias_loader(yaml))  # (JSON is YAML)  # noqa: S506
        # (ValueError: a value YAML matched but cannot build, as a 5000-digit int or the date 2001-13-45)
        except (UnicodeDecodeError, yaml.YAMLError, RecursionError, ValueError, OverflowError) as e:
            raise UsageError(f"accelerate config file {path}: not valid YAML or JSON "
                             f"({one_line(e, 150)})") from None
        if not isinstance(config, dict):
            raise UsageError(f"accelerate config file {path}: expected a mapping of keys to values, got "
                             f"{type(config).__name__}")
        if config.get("compute_environment", "LOCAL_MACHINE") != "LOCAL_MACHINE":
            raise UsageError(f"accelerate config file {path}: compute_environment "
                             f"{str(config['compute_environment'])[:40]!r}; hsx launch starts processes on this "
                             "machine (LOCAL_MACHINE) only")
    for key in ("num_processes", "num_machines"):
        value = getattr(args, key, None)
        value = config.get(key) if value is None else value
        if value is not None and (type(value) is not int or value < 1):
            raise UsageError(f"--{key} must be an integer of at least 1, not {value!r}")
    processes = getattr(args, "num_processes", None) or config.get("num_processes") or 1
    machines = getattr(args, "num_machines", None) or config.get("num_machines") or 1
    given = getattr(args, "num_processes", None) or config.get("num_processes")
    if machines > 1 and given is not None and given % machines:  # (accelerate starts given // machines per node)
        raise UsageError(f"--num_processes {given:,} is the job's total over {machines:,} machines: give a multiple "
                         f"of {machines:,} (accelerate would start {given // machines:,} on each, "
                         f"{given // machines * machines:,} in all)")
    rank = getattr(args, "machine_rank", None)
    rank = config.get("machine_rank") if rank is None else rank
    if machines > 1 and rank is not None and not (type(rank) is int and 0 <= rank < machines):
        raise UsageError(f"--machine_rank {rank!r}: this machine's index among the {machines:,}, 0 to "
                         f"{machines - 1:,} (a rank outside waits for ever for a machine that is not coming)")
    cores = os.cpu_count() or 1
    if -(-processes // machines) > cores:
        raise UsageError(f"--num_processes {processes:,} over {machines:,} machine(s) starts "
                         f"{-(-processes // machines):,} processes on each; this one has {cores} cores")
    return path, config


def _no_alias_loader(yaml):
    """yaml's SafeLoader refusing aliases: a few lines of them build a structure of 10^9 nodes (a YAML bomb)."""
    class NoAliases(yaml.SafeLoader):
        def compose_node(self, parent, index):
            if self.check_event(yaml.AliasEvent):
                raise yaml.composer.ComposerError(None, None, "aliases (*name) are not allowed here",
                                                  self.peek_event().start_mark)
            return super().compose_node(parent, index)
    return NoAliases


def exit_code(returncode: int) -> int:
    """A process's exit status as a shell gives it: 128 + N for one killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def _signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def failed_ranks_line(failures: dict) -> tuple[str, int]:
    """The line for ranks that failed (ChildFailedError's failures: global rank -> ProcessFailure, with `exitcode`
    and `timestamp`), the first failure first, and the exit status to end with: the first failure's. The others
    may be ranks the agent stopped after it (SIGTERM: 143 once hsx handles it, killed by SIGTERM before): those come
    after any other failure, because a timestamp without an error file is the second the agent collected the
    failures, the same for all of them (a loaded machine ended with 143, the stopped rank 0, over rank 1's 1)."""
    def stopped(rank: int) -> bool:
        return exit_code(failures[rank].exitcode) == 128 + signal.SIGTERM

    order = sorted(failures, key=lambda r: (stopped(r), failures[r].timestamp, r))
    parts = []
    for rank in order:
        code = failures[rank].exitcode
        parts.append(f"rank {rank} was killed by {_signal_name(-code)}" if code < 0 else
                     f"rank {rank} exited with {code}")
    line = (f"hsx: error: {', '.join(parts)} (each rank's own lines above say why; once a rank fails, the "
            "launcher stops the others with SIGTERM)")
    return line, exit_code(failures[order[0]].exitcode) or 1


def _first_signal(error: BaseException) -> BaseException:
    """The first of the SignalExceptions a second (third) signal raised while the agent was handling the first."""
    while isinstance(error.__context__, type(error)):
        error = error.__context__
    return error


def _ignore_signals() -> None:
    """The ranks are gone when the launcher returns or raises: another Ctrl-C changes nothing, and must not break
    the last line with a traceback."""
    for sig in FORWARDED:
        signal.signal(sig, signal.SIG_IGN)


@contextlib.contextmanager
def _one_process_forwarding() -> Iterator[list[int]]:
    """accelerate's one-process launcher, replaced for the `launch_command` call: the process starts in its own
    session, and the launcher forwards it the signals it gets, as torch's agent does for ranks (a terminal's Ctrl-C
    reaches the launcher alone, so the process sees one signal, not two). accelerate's own raises
    CalledProcessError (a traceback), or exits 1 with --quiet: the yielded list gets the exit status instead."""
    import accelerate.commands.launch as accelerate_launch

    try:
        from accelerate.utils import prepare_simple_launcher_cmd_env
    except ImportError:  # an accelerate older than the one-process launcher's helper: its own launcher
        yield []
        return
    status: list[int] = []

    def simple_launcher(args: argparse.Namespace) -> None:
        cmd, env = prepare_simple_launcher_cmd_env(args)
        child: list[subprocess.Popen] = []
        pending: list[int] = []

        def forward(signum, frame):
            if child:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(child[0].pid, signum)
            else:
                pending.append(signum)

        previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
        try:
            child.append(subprocess.Popen(cmd, env=env, start_new_session=True))
            for signum in pending:  # arrived before the process existed
                forward(signum, None)
            returncode = child[0].wait()
            if returncode < 0:  # (a process that failed on its own printed its own line)
                print(f"hsx: error: the process was killed by {_signal_name(-returncode)}; finished units are "
                      "kept: run the same command to continue", file=sys.stderr)
            status.append(exit_code(returncode))
        finally:
            for sig, h in previous.items():
                signal.signal(sig, h)

    original = accelerate_launch.simple_launcher
    accelerate_launch.simple_launcher = simple_launcher
    try:
        yield status
    finally:
        accelerate_launch.simple_launcher = original


@contextlib.contextmanager
def _failures_raised() -> Iterator[None]:
    """accelerate's launchers, with --debug and ACCELERATE_ENABLE_RICH set, catch the torch.distributed launcher's
    exception and print it with rich instead of raising (the command exited 0 with every rank failed): for the
    `launch_command` call they see no rich, so they raise, and `launch` ends with its line and the ranks' exit
    status."""
    import accelerate.commands.launch as accelerate_launch

    original = accelerate_launch.is_rich_available
    accelerate_launch.is_rich_available = lambda: False
    try:
        yield
    finally:
        accelerate_launch.is_rich_available = original


def launch(argv: list[str], hsx_parser: argparse.ArgumentParser) -> int:
    """`hsx launch ARGV`; returns the exit status. The signal handlers it changes (torch's agent takes SIGINT and
    SIGTERM; once the ranks are gone they are ignored, so a last Ctrl-C cannot break the last line) are given back
    when it returns: a caller in the same process (hsx.cli.main from Python, a test) keeps its own, and the
    processes it starts later do not inherit an ignored SIGINT/SIGTERM."""
    previous = {sig: signal.getsignal(sig) for sig in FORWARDED}
    try:
        return _launch(argv, hsx_parser)
    finally:
        for sig, handler in previous.items():
            if handler is not None:  # (None: a handler not installed from Python, which cannot be put back)
                signal.signal(sig, handler)


def _launch(argv: list[str], hsx_parser: argparse.ArgumentParser) -> int:
    args = parse(argv, hsx_parser)
    from accelerate.commands.launch import launch_command
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    try:
        try:
            with _one_process_forwarding() as status, _failures_raised():
                launch_command(args)
        except SystemExit as e:
            # accelerate 1.16 ends its torchrun launcher with sys.exit(128 + signal) for the agent's SignalException
            # (130 for a KeyboardInterrupt, 1 after printing a ChildFailedError with --quiet): the exception it
            # handled is the exit's context, taken up here as if it had been raised
            cause = e.__context__
            if isinstance(cause, (SignalException, ChildFailedError, KeyboardInterrupt)):
                raise cause from None
            raise
    except SignalException as e:
        _ignore_signals()
        first = _first_signal(e)
        name = _signal_name(first.sigval)
        if first is e:
            print(f"hsx: {name}: every rank was asked to stop after its current unit; run the same command to "
                  "continue", file=sys.stderr)
        else:
            again = "again" if e.sigval == first.sigval else f"then {_signal_name(e.sigval)}"
            print(f"hsx: {name} {again}: the ranks were stopped at once; finished units are kept: run the same "
                  "command to continue", file=sys.stderr)
        return 128 + int(first.sigval)
    except ChildFailedError as e:
        _ignore_signals()
        line, code = failed_ranks_line(e.failures)
        print(line, file=sys.stderr)
        return code
    except subprocess.CalledProcessError as e:  # a launcher of accelerate's that runs a command (DeepSpeed's pdsh)
        _ignore_signals()
        print(f"hsx: error: the launched command exited with {exit_code(e.returncode)}", file=sys.stderr)
        return exit_code(e.returncode) or 1
    except (ValueError, TypeError, KeyError, AttributeError, OSError, ImportError) as e:
        # accelerate checking its options and config file before any rank started (a value it does not take)
        _ignore_signals()
        print(f"hsx: error: accelerate launch: {type(e).__name__}: {' '.join(str(e).split())[:300]}",
              file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # before the agent took over SIGINT: no rank was running
        _ignore_signals()
        print(INTERRUPTED, file=sys.stderr)
        return EXIT_INTERRUPTED
    return status[0] if status else 0
