"""megatron-core's known-benign warnings and log records (megatron_autohet/known_warnings.py) are
ignored by the ``autohet`` main, which every CLI process and torchrun worker runs, and nothing
else is - on each supported megatron-core (scripts/test_mcore019.sh runs this file on 0.19).

Each case is a fresh interpreter: megatron-core gives its import-time warnings once per process.
"""

import re
import subprocess
import sys
import textwrap
from importlib.metadata import version

import pytest

from megatron_autohet.known_warnings import KNOWN_LOG_RECORDS, KNOWN_WARNINGS

pytestmark = pytest.mark.integration

# The installed megatron-core's minor version (from its metadata: importing it here would give
# its warnings in this process).
VERSION = ".".join(version("megatron-core").split(".")[:2])

# What a worker does with megatron-core, on one gloo rank on the CPU: import its layer specs and
# optimizer package (the Apex / Transformer Engine warnings), build a TransformerConfig (its
# deprecated default) and a GPTModel (0.19 logs its deprecation), build megatron's optimizer as
# the stock baseline and pretrain_gpt.py do (0.19 imports its MiMo model there), and load a
# step's common state as recovery does (0.19 logs load_common's deprecation). Then what is not
# on the lists: megatron-core's own deprecation of enable_cuda_graph, a listed message from
# another module and from another logger, another record of a listed logger (the filters are
# the emitting module's, not the message's).
_DRIVER = textwrap.dedent("""
    import logging
    import os
    import sys
    import tempfile
    import warnings

    import torch
    import torch.distributed as dist

    logging.basicConfig(format="log %(name)s: %(message)s")
    if sys.argv[1] == "main":
        from megatron_autohet.cli.main import main
        assert main([]) == 2            # `autohet` alone: the help, status 2
    from megatron.core import parallel_state, tensor_parallel
    from megatron.core.dist_checkpointing.serialization import load_common_state_dict
    from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
    from megatron.core.transformer import TransformerConfig

    from megatron_autohet.runtime.cpu_mode import enable_cpu_mode

    TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, enable_cuda_graph=True)
    enable_cpu_mode()
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    parallel_state.initialize_model_parallel()
    tensor_parallel.model_parallel_cuda_manual_seed(1)
    config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1,
                               use_cpu_initialization=True)
    model = DistributedDataParallel(config, DistributedDataParallelConfig(), GPTModel(
        config, get_gpt_layer_local_spec(), vocab_size=16, max_sequence_length=8))
    get_megatron_optimizer(OptimizerConfig(optimizer="adam", lr=1e-3), [model])
    with tempfile.TemporaryDirectory() as step:
        torch.save({}, os.path.join(step, "common.pt"))
        with open(os.path.join(step, "metadata.json"), "w") as metadata:
            metadata.write('{"sharded_backend": "torch_dist", "sharded_backend_version": 1, '
                           '"common_backend": "torch", "common_backend_version": 1}')
        load_common_state_dict(step)
    warnings.warn("Apex is not installed. Falling back to Torch Norm")
    logging.getLogger("elsewhere").warning("GPTModel IS DEPRECATED. (not megatron-core's)")
    logging.getLogger("megatron.core.models.gpt.gpt_model").warning("another record")
""")

# A warning as Python prints it: "<file>:<line>: <Category>: <message>"; a record as the driver
# logs it: "log <logger>: <message>".
_WARNING_LINE = re.compile(r"^(?P<file>\S+):\d+: (?P<category>\w+): (?P<message>.*)$", re.M)
_RECORD_LINE = re.compile(r"^log (?P<logger>\S+): (?P<message>.*)$", re.M)


def _output(mode: str) -> tuple[list[tuple[str, str]], list[tuple[str, str]]]:
    """(file, message) of every warning and (logger, message) of every record the driver's
    process printed."""
    run = subprocess.run([sys.executable, "-c", _DRIVER, mode], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return ([(m["file"], m["message"]) for m in _WARNING_LINE.finditer(run.stderr)],
            [(m["logger"], m["message"]) for m in _RECORD_LINE.finditer(run.stderr)])


def _from_megatron_core(seen, pattern: str) -> bool:
    return any("megatron/core/" in file and re.match(pattern, message) for file, message in seen)


def _logged(records, logger: str, pattern: str) -> bool:
    return any(name == logger and re.match(pattern, message) for name, message in records)


def test_every_listed_warning_is_given_without_the_filter():
    """The driver really triggers each warning and record listed for this megatron-core (and
    the lists hold no stale entry)."""
    seen, records = _output("bare")
    assert [m for m, versions, _ in KNOWN_WARNINGS
            if VERSION in versions and not _from_megatron_core(seen, m)] == []
    assert [m for name, m, versions, _ in KNOWN_LOG_RECORDS
            if VERSION in versions and not _logged(records, name, m)] == []


def test_the_autohet_main_ignores_the_listed_warnings_and_only_those():
    seen, records = _output("main")
    assert [m for m, _, _ in KNOWN_WARNINGS if _from_megatron_core(seen, m)] == []
    assert [m for name, m, _, _ in KNOWN_LOG_RECORDS if _logged(records, name, m)] == []
    assert _from_megatron_core(seen, r"enable_cuda_graph is deprecated")
    assert ("<string>", "Apex is not installed. Falling back to Torch Norm") in seen
    assert ("elsewhere", "GPTModel IS DEPRECATED. (not megatron-core's)") in records
    assert ("megatron.core.models.gpt.gpt_model", "another record") in records
