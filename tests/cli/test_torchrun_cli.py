"""`autohet torchrun` without Megatron-LM: torchrun's options and ending, and its one-line
refusals. (With a Megatron-LM checkout, tests/megatron/test_megatron_lm.py runs it on
pretrain_gpt.py --autohet-plan.)"""

import subprocess
import sys

import pytest

pytestmark = pytest.mark.e2e

JOB = """\
import os, signal, sys, time
print(f"rank {os.environ['RANK']} of {os.environ['WORLD_SIZE']}", flush=True)
if os.environ["RANK"] == "1":
    if sys.argv[1] == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    sys.exit(int(sys.argv[1]))
time.sleep(float(sys.argv[2]) if len(sys.argv) > 2 else 0)
"""


def _autohet_torchrun(tmp_path, *args):
    (tmp_path / "job.py").write_text(JOB)
    return subprocess.run([sys.executable, "-m", "megatron_autohet.cli.main", "torchrun",
                           *map(str, args)], capture_output=True, text=True, cwd=tmp_path,
                          timeout=300)


def test_a_job_that_ends_well_ends_as_torchrun(tmp_path):
    result = _autohet_torchrun(tmp_path, "--nproc-per-node", 2, "job.py", 0)
    assert result.returncode == 0, result.stderr
    assert sorted(result.stdout.splitlines()) == ["rank 0 of 2", "rank 1 of 2"]
    assert result.stderr == ""          # neither torchrun's OMP_NUM_THREADS banner nor more


@pytest.mark.parametrize("how,status,line", [
    ("3", 3, "autohet torchrun: rank 1 exited with status 3; its lines are above"),
    # rank 0 is still sleeping when rank 1 dies: the agent stops it, and says nothing of it
    ("kill", 137, "autohet torchrun: rank 1 was ended by signal 9; its lines are above"),
])
def test_a_failed_job_ends_in_one_line_with_the_ranks_status(tmp_path, how, status, line):
    result = _autohet_torchrun(tmp_path, "--nproc-per-node", 2, "job.py", how, 60)
    assert result.returncode == status, result.stderr
    assert result.stderr.splitlines() == [line], result.stderr
    assert "rank 1 of 2" in result.stdout


@pytest.mark.parametrize("args,line", [
    (["--nproc-per-node", "2", "--no-such-option", "job.py"],
     "autohet torchrun: error: <command line>: field 'torchrun's options': unrecognized "
     "arguments: --no-such-option (allowed: `autohet torchrun --help` lists them)"),
    (["--nproc-per-node", "2", "job.py", "--autohet-plan", "plan.yaml"],
     "autohet torchrun: error: <command line>: field 'training_script': job.py: Megatron-LM's "
     "training package does not import beside it (No module named 'megatron.training') "
     "(allowed: pretrain_gpt.py of a Megatron-LM checkout set up by "
     "scripts/setup_megatron_lm.sh)"),
    (["--nproc-per-node", "2", "missing.py", "--autohet-plan", "plan.yaml"],
     "autohet torchrun: error: <command line>: field 'training_script': missing.py is not a "
     "Python file (allowed: Megatron-LM's pretrain_gpt.py (its path), as with --autohet-plan)"),
])
def test_a_mistake_is_one_line_and_status_2_before_any_process(tmp_path, args, line):
    result = _autohet_torchrun(tmp_path, *args)
    assert result.returncode == 2
    assert result.stdout == "" and result.stderr.splitlines() == [line], result.stderr


def test_help_says_what_differs_and_lists_torchruns_options(tmp_path):
    result = _autohet_torchrun(tmp_path, "--help")
    assert result.returncode == 0
    assert "before any process starts" in result.stdout
    assert "rank R exited with status S; its lines are above" in result.stdout
    assert "usage: autohet torchrun" in result.stdout and "--nproc-per-node" in result.stdout
    listed = subprocess.run([sys.executable, "-m", "megatron_autohet.cli.main", "--help"],
                            capture_output=True, text=True, check=True).stdout
    assert "torchrun" in listed
