"""megatron-core's known-benign warnings (megatron_autohet/known_warnings.py) are ignored by the
``autohet`` main, which every CLI process and torchrun worker runs, and nothing else is.

Each case is a fresh interpreter: megatron-core gives its import-time warnings once per process.
"""

import re
import subprocess
import sys
import textwrap

import pytest

from megatron_autohet.known_warnings import KNOWN_WARNINGS

pytestmark = pytest.mark.integration

# What a worker does with megatron-core: import its layer specs and optimizer package (the Apex /
# Transformer Engine warnings), build a TransformerConfig (its deprecated default). Then two
# warnings that are not on the list: megatron-core's own deprecation of enable_cuda_graph, and
# a listed message from another module (the filter is megatron-core's, not the message's).
_DRIVER = textwrap.dedent("""
    import sys
    import warnings
    if sys.argv[1] == "main":
        from megatron_autohet.cli.main import main
        assert main([]) == 2            # `autohet` alone: the help, status 2
    import megatron.core.optimizer
    from megatron.core.models.gpt import gpt_layer_specs
    from megatron.core.transformer import TransformerConfig
    TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=1, enable_cuda_graph=True)
    warnings.warn("Apex is not installed. Falling back to Torch Norm")
""")

# A warning as Python prints it: "<file>:<line>: <Category>: <message>".
_WARNING_LINE = re.compile(r"^(?P<file>\S+):\d+: (?P<category>\w+): (?P<message>.*)$", re.M)


def _warnings(mode: str) -> list[tuple[str, str]]:
    """(file, message) of every warning the driver's process printed."""
    run = subprocess.run([sys.executable, "-c", _DRIVER, mode], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return [(m["file"], m["message"]) for m in _WARNING_LINE.finditer(run.stderr)]


def _from_megatron_core(seen, pattern: str) -> bool:
    return any("megatron/core/" in file and re.match(pattern, message) for file, message in seen)


def test_every_listed_warning_is_given_without_the_filter():
    """The driver really triggers each listed warning (and the list holds no stale entry)."""
    seen = _warnings("bare")
    assert [m for m, _ in KNOWN_WARNINGS if not _from_megatron_core(seen, m)] == []


def test_the_autohet_main_ignores_the_listed_warnings_and_only_those():
    seen = _warnings("main")
    assert [m for m, _ in KNOWN_WARNINGS if _from_megatron_core(seen, m)] == []
    assert _from_megatron_core(seen, r"enable_cuda_graph is deprecated")
    assert ("<string>", "Apex is not installed. Falling back to Torch Norm") in seen
