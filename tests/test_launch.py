"""`hsx launch`: accelerate launch's options, then the hsx command; one line and the ranks' exit status at the end.

The launched runs use 2 gloo processes on this CPU machine (as tests/test_distributed.py does), or 1 (accelerate's
plain subprocess). SIGINT goes to the launcher's whole process group, as a terminal's Ctrl-C does: the ranks, in
sessions of their own, get it from the launcher only. Process counts, machine ranks, accelerate config files and
the hsx recipe are checked before any rank starts (one line); a process killed by a signal is named.
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from helpers import (
    Child,
    assert_equals_reference,
    assert_units_intact,
    child_env,
    committed_units,
    free_port,
    is_complete,
    message_lines,
)


def hsx_launch(argv: list[str], processes: int = 2) -> list[str]:
    """The launch command as a user types it: no --multi_gpu on this CPU machine (hsx launch starts every process)."""
    return [sys.executable, "-m", "hsx", "launch", "--num_processes", str(processes), "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_port", str(free_port()), *argv]


def launch(cmd: list[str], logs: Path) -> Child:
    return Child(cmd, logs, env=child_env())


def interrupt(child: Child, out: Path, after: int, times: int) -> int:
    """SIGINT `times` to the launcher's process group once `after` more units are committed; its exit status."""
    before = committed_units(out)
    assert child.poll_until(lambda: committed_units(out) >= before + after), child.stderr
    for _ in range(times):
        os.killpg(child.proc.pid, signal.SIGINT)  # the launcher is its session's leader: the terminal's group
        time.sleep(0.05)
    return child.wait()


def last_line(err: str) -> str:
    """stderr's last line that is not torch's log (W/E/I + date) or a progress bar."""
    lines = [line for line in message_lines(err) if not re.match(r"[WEI]\d{4} ", line)]
    assert lines, err
    return lines[-1]


@pytest.mark.slow
def test_ctrl_c_stops_every_rank_with_one_line_and_130_then_the_job_continues(tmp_path, fault_reference):
    """Ctrl-C once (each rank stops after its unit), then twice (at once): each time no traceback, exit 130, and
    one last line saying how to continue; the same command then finishes the job, every row once."""
    ref = fault_reference
    out = tmp_path / "out"
    for times in (1, 2):
        child = launch(hsx_launch(ref.argv(out)), tmp_path / f"run{times}")
        rc = interrupt(child, out, after=2, times=times)
        child.kill_tree(signal.SIGKILL)  # nothing of the job may outlive it
        assert "Traceback" not in child.stderr, child.stderr
        assert rc == 130, child.stderr
        line = last_line(child.stderr)
        assert line.startswith("hsx: SIGINT") and line.endswith("run the same command to continue"), line
        assert not is_complete(out)
        assert_units_intact(out)
    child = launch(hsx_launch(ref.argv(out)), tmp_path / "rerun")
    assert child.wait() == 0, child.stderr
    assert "continuing the job" in child.stdout
    assert_equals_reference(out, ref, world_size=2, verify=False)


@pytest.mark.slow
def test_failed_ranks_end_with_one_line_naming_them(tmp_path, fault_reference):
    """Every rank refuses the output dir (a file) with its own line: the launcher adds one line naming the failed
    rank(s) and exits with their status, 1, instead of torch's ChildFailedError traceback."""
    ref = fault_reference
    not_a_dir = tmp_path / "a-file"
    not_a_dir.write_text("")
    child = launch(hsx_launch(ref.argv(not_a_dir)), tmp_path / "run")
    rc = child.wait()
    assert "Traceback" not in child.stderr, child.stderr
    assert rc == 1, child.stderr
    assert "hsx: error: " in child.stderr and "is a file, not a folder" in child.stderr  # the ranks' own lines
    line = last_line(child.stderr)
    # the first rank to fail first; the other failed too, or was stopped by the launcher (SIGTERM)
    assert re.fullmatch(r"hsx: error: rank [01] exited with 1(, rank [01] (exited with (1|143)|was killed by "
                        r"SIGTERM))? \(.*\)", line), line


@pytest.mark.slow
def test_one_process_passes_its_exit_status_and_ctrl_c_through(tmp_path, fault_reference):
    """--num_processes 1 (accelerate's plain subprocess, which exits 1 or raises a traceback for any failure): a
    recipe refused in the process exits 2; Ctrl-C stops it after its unit, 130, no traceback."""
    ref = fault_reference
    bad = tmp_path / "bad.yaml"
    bad.write_text("bogus_key: 1\n")
    child = launch(hsx_launch(["extract", "--config", str(bad)], processes=1), tmp_path / "bad")
    rc = child.wait()
    assert rc == 2 and "Traceback" not in child.stderr, child.stderr
    assert last_line(child.stderr).startswith("hsx: error: config ")

    out = tmp_path / "out"
    child = launch(hsx_launch(ref.argv(out), processes=1), tmp_path / "run")
    rc = interrupt(child, out, after=2, times=1)
    child.kill_tree(signal.SIGKILL)
    assert rc == 130 and "Traceback" not in child.stderr, child.stderr
    assert "stopped cleanly after" in last_line(child.stderr)
    assert 2 <= len(assert_units_intact(out)) < ref.units


def test_help_and_what_it_refuses(capsys):
    from hsx.cli import main

    with pytest.raises(SystemExit) as e:
        main(["launch", "--help"])
    assert e.value.code == 0
    shown = capsys.readouterr().out
    assert shown.startswith("usage: hsx launch [accelerate launch options] COMMAND [ARGS]")
    assert "--num_processes" in shown and "--config_file" in shown and "--module" not in shown
    for argv, needle in [(["verify", "OUT"], "runs extract, bench or regenerate, not 'verify'"),
                         (["-m", "hsx", "extract"], "drop -m/--module"),
                         (["extract", "--num_processes", "2"], "unrecognized arguments: --num_processes")]:
        try:
            rc = main(["launch", *argv])
        except SystemExit as stop:  # argparse's own usage error, from hsx's parser
            rc = stop.code
        err = capsys.readouterr().err
        assert rc == 2 and needle in err and "Traceback" not in err, (argv, err)


def test_the_line_for_failed_ranks():
    from hsx.launch import failed_ranks_line

    failure = lambda code, at: SimpleNamespace(exitcode=code, timestamp=at)  # noqa: E731 - torch's ProcessFailure
    line, code = failed_ranks_line({0: failure(-9, 20), 3: failure(2, 10)})
    assert line.startswith("hsx: error: rank 3 exited with 2, rank 0 was killed by SIGKILL (") and code == 2
    assert failed_ranks_line({1: failure(-15, 0)})[1] == 143  # as a shell gives it
    # the same second (no error files): the rank the launcher stopped (SIGTERM, handled or not) after the failure
    line, code = failed_ranks_line({0: failure(143, 7), 1: failure(1, 7)})
    assert line.startswith("hsx: error: rank 1 exited with 1, rank 0 exited with 143 (") and code == 1
    assert failed_ranks_line({0: failure(-15, 7), 1: failure(1, 9)})[1] == 1
    assert failed_ranks_line({0: failure(143, 7), 1: failure(143, 7)})[1] == 143  # only stopped ranks: as before


def test_debug_still_ends_with_the_failed_ranks_line_and_status(tmp_path, monkeypatch, capsys):
    """--debug with ACCELERATE_ENABLE_RICH made accelerate's multi-process launcher print torch's ChildFailedError
    with rich instead of raising it: `hsx launch` exited 0 with its ranks failed, without the line naming them."""
    import torch.distributed.run
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

    from hsx.cli import main

    def ranks_fail(args):
        raise ChildFailedError("hsx", {1: ProcessFailure(local_rank=1, pid=1, exitcode=3, error_file="")})

    monkeypatch.setattr(torch.distributed.run, "run", ranks_fail)
    monkeypatch.setenv("ACCELERATE_ENABLE_RICH", "1")
    rc = main(["launch", "--debug", "--multi_gpu", "--num_processes", "2", "--num_machines", "1", "--mixed_precision",
               "no", "--dynamo_backend", "no", "--main_process_port", str(free_port()), "extract", "--config",
               "recipes/demo.yaml", "--output-dir", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 3, err
    assert last_line(err).startswith("hsx: error: rank 1 exited with 3 ("), err


def test_a_launch_passes_the_values_accelerate_would_warn_it_defaulted(caplog, tmp_path, monkeypatch):
    """Every `hsx launch` without a config file printed accelerate's 7-line "values were not passed" block: the
    same values are passed now (given ones kept), so accelerate's checks fill nothing in and print nothing."""
    import logging

    from accelerate.commands.launch import _validate_launch_command

    from hsx.cli import build_parser
    from hsx.launch import parse

    monkeypatch.setenv("HF_HOME", str(tmp_path))  # no accelerate default config file
    monkeypatch.setenv("ACCELERATE_CONFIG_FILE", str(tmp_path / "none.yaml"))
    argv = ["extract", "--config", "recipes/demo.yaml", "--output-dir", str(tmp_path / "o")]
    for extra, processes in (([], 1), (["--num_processes", "2", "--mixed_precision", "bf16"], 2)):
        args = parse([*extra, *argv], build_parser())
        assert (args.num_processes, args.num_machines, args.dynamo_backend) == (processes, 1, "no")
        assert args.mixed_precision == ("bf16" if extra else "no")
        with caplog.at_level(logging.WARNING):
            _validate_launch_command(args)
        assert "were not passed" not in caplog.text, caplog.text


def test_several_processes_without_a_gpu_start_several_processes(tmp_path, monkeypatch):
    """accelerate runs `--num_processes 2` without GPUs and without --multi_gpu as ONE process (its plain
    launcher), silently: hsx launch takes torch's launcher for it (every rank on the CPU), and refuses --cpu, which
    accelerate can run as several processes only through mpirun, in one line."""
    from hsx.cli import build_parser
    from hsx.errors import UsageError
    from hsx.launch import parse

    monkeypatch.setenv("HF_HOME", str(tmp_path))  # no accelerate default config file
    monkeypatch.setenv("ACCELERATE_CONFIG_FILE", str(tmp_path / "none.yaml"))
    monkeypatch.setattr("torch.cuda.device_count", lambda: 0)
    argv = ["extract", "--config", "recipes/demo.yaml", "--output-dir", str(tmp_path / "o")]
    assert parse(["--num_processes", "2", *argv], build_parser()).multi_gpu
    assert not parse(["--num_processes", "1", *argv], build_parser()).multi_gpu
    config = tmp_path / "two.yaml"
    config.write_text("distributed_type: 'NO'\nnum_processes: 2\n")
    assert parse(["--config_file", str(config), *argv], build_parser()).multi_gpu
    with pytest.raises(UsageError, match="--num_processes 2 with --cpu: .*drop --cpu"):
        parse(["--cpu", "--num_processes", "2", *argv], build_parser())
    config.write_text("distributed_type: DEEPSPEED\nnum_processes: 2\n")  # its own launcher: accelerate's choice
    assert not parse(["--config_file", str(config), *argv], build_parser()).multi_gpu


from helpers import LONG_DIGITS, the_error_line  # noqa: E402


# ---- accelerate's options and config files, and the hsx command, checked before any rank starts --------------------

@pytest.fixture
def accelerate_files(tmp_path) -> dict[str, Path]:
    files = {"bomb": "a: &a [x, x]\nb: [*a, *a]\n", "list": "[1, 2]\n",
             "sagemaker": "compute_environment: AMAZON_SAGEMAKER\n", "many": "num_processes: 999999\n",
             "zero": "num_processes: 0\n"}
    paths = {}
    for name, text in files.items():
        paths[name] = tmp_path / f"{name}.yaml"
        paths[name].write_text(text)
    paths["fifo"] = tmp_path / "fifo.yaml"
    os.mkfifo(paths["fifo"])
    paths["missing"] = tmp_path / "missing.yaml"
    return paths


@pytest.mark.parametrize("options,needle", [
    (["--num_processes", "0"], "at least 1"),
    (["--num_processes", "-1"], "at least 1"),
    (["--num_processes", "100000"], "processes on each"),
    (["--config_file", "{zero}"], "at least 1"),
    (["--config_file", "{many}"], "processes on each"),
    (["--config_file", "{missing}"], "No such file"),
    (["--config_file", "{fifo}"], "not a regular file"),
    (["--config_file", "{bomb}"], "aliases"),
    (["--config_file", "{list}"], "expected a mapping"),
    (["--config_file", "{sagemaker}"], "LOCAL_MACHINE"),
])
def test_launch_refuses_bad_process_counts_and_config_files_in_one_line(accelerate_files, options, needle,
                                                                        tmp_path, capsys):
    """0 or -1 processes ran one; 100,000 would start them all; a missing --config_file was accelerate's
    traceback, a FIFO hung it; a SageMaker config sends the job to AWS. All before any rank starts."""
    from hsx.cli import main

    options = [o.format(**accelerate_files) for o in options]
    rc = main(["launch", *options, "extract", "--config", "recipes/demo.yaml", "--output-dir", str(tmp_path / "o")])
    err = capsys.readouterr().err
    assert rc == 2 and needle in the_error_line(err), err
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("text,needle", [
    (f"num_processes: {LONG_DIGITS}\n", "accelerate config file"),
    ("num_processes: 1\nwhen: 2001-13-45\n", "accelerate config file"),  # a date YAML reads, that is no date
    (f'{{"num_processes": {LONG_DIGITS}}}\n', "accelerate config file"),
])
def test_launch_config_with_a_value_yaml_cannot_build_is_one_line(tmp_path, text, needle, capsys):
    from hsx.cli import main

    path = tmp_path / "accelerate.yaml"
    path.write_text(text)
    rc = main(["launch", "--config_file", str(path), "extract", "--config", "recipes/demo.yaml",
               "--output-dir", str(tmp_path / "o")])
    line = the_error_line(capsys.readouterr().err)
    assert rc == 2 and needle in line and str(path) in line, line
    assert not (tmp_path / "o").exists()


@pytest.mark.parametrize("options,needle", [
    (["--num_machines", "2", "--machine_rank", "2", "--num_processes", "2"], "0 to 1"),
    (["--num_machines", "2", "--machine_rank", "-1", "--num_processes", "2"], "0 to 1"),
    (["--num_machines", "2", "--machine_rank", "0", "--num_processes", "3"], "multiple of 2"),
    (["--num_machines", "2", "--machine_rank", "0", "--num_processes", "1"], "multiple of 2"),
    (["--config_file", "{two}", "--num_processes", "2"], "0 to 1"),
])
def test_launch_refuses_a_machine_rank_or_process_count_the_machines_cannot_run(tmp_path, monkeypatch, capsys,
                                                                                  options, needle):
    """A --machine_rank outside --num_machines made torchrun wait for ever for its rendezvous; 3 processes over 2
    machines started 2 (accelerate gives each machine num_processes // num_machines), 1 over 2 started none."""
    import accelerate.commands.launch

    from hsx.cli import main

    started = []
    monkeypatch.setattr(accelerate.commands.launch, "launch_command", started.append)
    (tmp_path / "two.yaml").write_text("num_machines: 2\nmachine_rank: 7\n")
    options = [o.format(two=tmp_path / "two.yaml") for o in options]
    rc = main(["launch", *options, "extract", "--config", "recipes/demo.yaml", "--output-dir", str(tmp_path / "o")])
    line = the_error_line(capsys.readouterr().err)
    assert rc == 2 and needle in line and not started, line
    rc = main(["launch", "--num_machines", "2", "--machine_rank", "1", "--num_processes", "2", "extract", "--config",
               "recipes/demo.yaml", "--output-dir", str(tmp_path / "o")])
    assert rc == 0 and len(started) == 1  # (the launch a good command line makes)


def test_launch_reads_the_hsx_recipe_and_flags_once_before_any_rank_starts(tmp_path, monkeypatch, capsys):
    """A recipe every rank fails on (a FIFO each rank's read refused, a key with a wrong value, --layers missing)
    started all the ranks, each printing its own line, then the launcher's."""
    import accelerate.commands.launch

    from hsx.cli import main

    started = []
    monkeypatch.setattr(accelerate.commands.launch, "launch_command", started.append)
    os.mkfifo(tmp_path / "fifo.yaml")
    (tmp_path / "bad.yaml").write_text("layers: [1]\nstorage_dtype: int4\n")
    for argv, needle in ((["--config", str(tmp_path / "fifo.yaml")], "is not a regular file"),
                         (["--config", str(tmp_path / "bad.yaml")], "storage_dtype"),
                         (["--model", "m", "--dataset", "d"], "--layers is required")):
        rc = main(["launch", "--num_processes", "2", "extract", *argv, "--output-dir", str(tmp_path / "o")])
        line = the_error_line(capsys.readouterr().err)
        assert rc != 0 and needle in line and not started, line
    assert not (tmp_path / "o").exists()
    rc = main(["launch", "--num_processes", "2", "extract", "--config", "recipes/demo.yaml", "--output-dir",
               str(tmp_path / "o")])
    assert rc == 0 and len(started) == 1


def test_one_launched_process_killed_by_a_signal_is_named(monkeypatch, capsys):
    """`hsx launch --num_processes 1` whose process was SIGKILLed (the OOM killer) exited 137 without a word."""
    import accelerate.commands.launch as accelerate_launch
    import accelerate.utils

    from hsx import launch

    cmd = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"]
    monkeypatch.setattr(accelerate.utils, "prepare_simple_launcher_cmd_env", lambda args: (cmd, dict(os.environ)))
    with launch._one_process_forwarding() as status:
        accelerate_launch.simple_launcher(None)
    assert status == [137]
    assert the_error_line(capsys.readouterr().err) == (
        "hsx: error: the process was killed by SIGKILL; finished units are kept: run the same command to continue")
