"""Profile data: what one transformer layer, the embedding and the output layer cost.

An entry is keyed by (GPU type, TP degree, micro-batch size, sequence length) and holds an
:class:`OpCost` for each of the three parts of a GPT. Every OpCost records whether it was
measured on a real device, estimated from the GPU catalog, or calibrated: estimated, then scaled
by how far the estimates missed on the measured GPU types (:meth:`Profile.calibrated_over`).
A profile also says in which precision its figures are (``precision``, spec/precision.py): the
one the job trains in, which the cost model then counts activation, P2P and state bytes in -
bf16 for the estimates and on GPUs, fp32 for a profile measured on a CPU (the runtime's CPU
mode trains fp32), and which attention its layers ran (``attention``, ``ATTENTIONS``): the
activation bytes of a layer depend on it (profiling/estimate.py ``layer_activation_bytes``), and
the estimates filling a measured profile's gaps must assume the same. A measured profile also
records the jit fusions its layers ran (``fusions``: megatron-core's TransformerConfig fields,
runtime/fusions.py), so a job whose layers run others can say that its plan's times are another
layer's (job.py). Profiles are plain YAML
or JSON (chosen by file suffix) so users can keep, edit and reuse them.

File form::

    model: gpt3-1.3b
    precision: bf16            # optional, default bf16
    attention: flash           # optional, default flash
    fusions: {bias_activation_fusion: true, bias_dropout_fusion: true}   # optional: measured
    entries:
      - {gpu: A100-80GB, tp: 2, micro_batch_size: 1, seq_length: 2048,
         layer:     {forward_s: ..., backward_s: ..., activation_bytes: ...,
                     activation_bytes_recompute: ..., param_count: ..., source: measured},
         embedding: {...},
         output:    {...}}
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path

import yaml

from megatron_autohet.errors import ConfigError
from megatron_autohet.spec._yaml import check_keys, get_field
from megatron_autohet.spec.precision import (PLANNING_PRECISION, PRECISIONS, TRAINED_PRECISIONS,
                                             Precision)

# measured: timed on a device; estimated: datasheet rates (profiling/estimate.py); calibrated: an
# estimate scaled by the measured-to-estimated ratio of measured entries (Profile.calibrated_over).
SOURCES = ("measured", "calibrated", "estimated")
PARTS = ("layer", "embedding", "output")
# How a layer computes attention, as far as its memory goes. flash: a fused kernel that keeps only
# per-row softmax statistics for backward (the runtime's torch SDPA - flash, memory-efficient or
# cuDNN - or Transformer Engine's fused attention); unfused: megatron-core's DotProductAttention,
# which keeps the [b, heads, s, s] softmax output, dropout mask and dropout output.
ATTENTIONS = ("flash", "unfused")
DEFAULT_ATTENTION = "flash"       # what runtime/stage_model.py builds (SDPA or TE)


def check_attention(attention: str) -> None:
    if attention not in ATTENTIONS:
        raise ValueError(f"attention {attention!r} is not one of {ATTENTIONS}")


@dataclass(frozen=True)
class OpCost:
    """Cost of one micro-batch through one part of the model on one GPU of its TP group."""

    forward_s: float
    backward_s: float
    activation_bytes: float            # kept from forward until backward (no recompute)
    activation_bytes_recompute: float  # kept under full activation recompute (the input only)
    param_count: int                   # parameters held by one GPU of the TP group
    source: str = "estimated"          # one of SOURCES


@dataclass(frozen=True)
class ProfileEntry:
    gpu: str
    tp: int
    micro_batch_size: int
    seq_length: int
    layer: OpCost
    embedding: OpCost
    output: OpCost     # final norm + output projection + cross-entropy loss

    @property
    def key(self) -> tuple[str, int, int, int]:
        return (self.gpu, self.tp, self.micro_batch_size, self.seq_length)

    def stage_compute_s(self, num_layers: int, first: bool, last: bool,
                        recompute: bool) -> tuple[float, float]:
        """(forward, backward) time of one micro-batch through a stage of ``num_layers`` layers
        (+ the embedding on the first stage, + the output layer and loss on the last); recompute
        re-runs the layers' forward inside the backward pass. The cost model's stage time
        (cost_model.stage_compute_s) and a run's profile (profiling/from_run.py) both use it."""
        fwd = num_layers * self.layer.forward_s
        bwd = num_layers * (self.layer.backward_s + (self.layer.forward_s if recompute else 0.0))
        if first:
            fwd += self.embedding.forward_s
            bwd += self.embedding.backward_s
        if last:
            fwd += self.output.forward_s
            bwd += self.output.backward_s
        return fwd, bwd

    def scaled(self, k: float, source: str | None = None) -> ProfileEntry:
        """Every forward and backward time times ``k`` (memory and parameters kept), each
        part's source set to ``source`` where given: a run's measured entry
        (profiling/from_run.py), a slowed GPU's (planner/space.py, spec/cluster.py speeds)."""
        return replace(self, **{part: replace(
            getattr(self, part), forward_s=getattr(self, part).forward_s * k,
            backward_s=getattr(self, part).backward_s * k,
            source=source or getattr(self, part).source) for part in PARTS})


@dataclass
class Profile:
    model: str
    entries: dict[tuple[str, int, int, int], ProfileEntry] = field(default_factory=dict)
    precision: Precision = PLANNING_PRECISION      # the figures' (and the job's) numerics
    attention: str = DEFAULT_ATTENTION             # ATTENTIONS: what the measured layers ran
    # TransformerConfig fusion field -> on, as the measured layers ran (None: not recorded, as
    # in the analytic estimates, which model no fusion)
    fusions: dict[str, bool] | None = None

    def __post_init__(self):
        check_attention(self.attention)

    def add(self, entry: ProfileEntry) -> None:
        self.entries[entry.key] = entry

    def get(self, gpu: str, tp: int, micro_batch_size: int, seq_length: int) -> ProfileEntry:
        """The entry for a key; a missing one is bad input (a measured profile that does not
        cover the plan or the search), reported as a ConfigError."""
        try:
            return self.entries[(gpu, tp, micro_batch_size, seq_length)]
        except KeyError:
            raise ConfigError("<profile>", "entries", f"no entry for gpu={gpu} tp={tp} "
                              f"micro_batch_size={micro_batch_size} seq_length={seq_length} "
                              f"(model {self.model})", "a profile covering every GPU type and TP "
                              "degree used (see `autohet profile`, or the analytic estimate)"
                              ) from None

    def has(self, gpu: str, tp: int, micro_batch_size: int, seq_length: int) -> bool:
        return (gpu, tp, micro_batch_size, seq_length) in self.entries

    def merged_over(self, base: "Profile") -> "Profile":
        """This profile's entries, with ``base`` filling the keys this one lacks; in this
        profile's precision. ``base`` must be for the same attention (ValueError: its activation
        bytes would be another layer's)."""
        if base.attention != self.attention:
            raise ValueError(f"a profile of {self.attention} attention cannot take entries "
                             f"estimated for {base.attention} attention")
        out = Profile(self.model, dict(base.entries), self.precision, self.attention,
                      self.fusions)
        out.entries.update(self.entries)
        return out

    def calibrated_over(self, base: "Profile") -> "Profile":
        """:meth:`merged_over`, with every estimated time scaled by how far the estimates miss
        on measured hardware: per part (layer, embedding, output) and direction, the geometric
        mean of measured / estimated time over the measured entries that ``base`` (the
        datasheet estimate) also has. An entry of a GPU type with measurements uses that type's
        own ratio (other TP degrees, micro-batch sizes), any other entry the ratio over all
        measured types. Scaled parts get ``source="calibrated"``; memory and parameter counts
        are computed, not measured, and stay as they are. Without measured parts nothing
        changes."""
        logs: dict[tuple[str | None, str, str], list[float]] = {}
        for key, entry in self.entries.items():
            estimate = base.entries.get(key)
            if estimate is None:
                continue
            for part in PARTS:
                mine, est = getattr(entry, part), getattr(estimate, part)
                if mine.source != "measured":
                    continue
                for direction in ("forward_s", "backward_s"):
                    a, b = getattr(mine, direction), getattr(est, direction)
                    if a > 0 and b > 0:
                        for gpu in (entry.gpu, None):
                            logs.setdefault((gpu, part, direction), []).append(math.log(a / b))
        ratio = {k: math.exp(sum(v) / len(v)) for k, v in logs.items()}
        out = self.merged_over(base)
        for key, entry in list(out.entries.items()):
            parts = {}
            for part in PARTS:
                cost = getattr(entry, part)
                scale = {d: ratio.get((entry.gpu, part, d), ratio.get((None, part, d)))
                         for d in ("forward_s", "backward_s")}
                if cost.source == "estimated" and None not in scale.values():
                    cost = replace(cost, forward_s=cost.forward_s * scale["forward_s"],
                                   backward_s=cost.backward_s * scale["backward_s"],
                                   source="calibrated")
                parts[part] = cost
            out.entries[key] = replace(entry, **parts)
        return out

    def figures_rank(self, key) -> tuple[int, int]:
        """How much of an entry was measured: (measured parts, calibrated parts); higher wins
        when profiles are merged (:func:`merge_profiles`)."""
        parts = [getattr(self.entries[key], part).source for part in PARTS]
        return parts.count("measured"), parts.count("calibrated")

    # ---- files -------------------------------------------------------------------------------
    def to_dict(self) -> dict:
        return {"model": self.model, "precision": self.precision.name,
                "attention": self.attention,
                **({"fusions": dict(self.fusions)} if self.fusions is not None else {}),
                "entries": [asdict(e) for e in sorted(self.entries.values(), key=lambda e: e.key)]}

    def save(self, path: str | Path) -> None:
        path = Path(path)
        text = (json.dumps(self.to_dict(), indent=1) if path.suffix == ".json"
                else yaml.safe_dump(self.to_dict(), sort_keys=False))
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(text)
        tmp.replace(path)

    @classmethod
    def load(cls, path: str | Path) -> "Profile":
        path = Path(path)
        if not path.is_file():
            raise ConfigError(path, "<file>", "file not found",
                              "a profile written by `autohet profile`")
        try:
            text = path.read_text()
            data = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
        except (json.JSONDecodeError, yaml.YAMLError, UnicodeDecodeError) as exc:
            raise ConfigError(path, "<file>", f"cannot parse: {exc}") from None
        return cls.from_dict(data, path)

    @classmethod
    def from_dict(cls, data, file="<profile>") -> "Profile":
        if not isinstance(data, dict) or not isinstance(data.get("model"), str):
            raise ConfigError(file, "model", "missing", "the model name the profile was made for")
        check_keys(data, {"model", "precision", "attention", "fusions", "entries"}, file, "")
        entries = data.get("entries")
        if not isinstance(entries, list):
            raise ConfigError(file, "entries", "missing or not a list", "a list of entries")
        precision = get_field(data, "precision", str, file, default=PLANNING_PRECISION.name)
        if precision not in TRAINED_PRECISIONS:
            raise ConfigError(file, "precision", f"got {precision!r}" + (
                ": not built (fp16 needs a dynamic loss scaler, which this runtime does not "
                "have)" if precision in PRECISIONS else ""), ", ".join(TRAINED_PRECISIONS))
        attention = get_field(data, "attention", str, file, default=DEFAULT_ATTENTION)
        if attention not in ATTENTIONS:
            raise ConfigError(file, "attention", f"got {attention!r}", ", ".join(ATTENTIONS))
        fusions = get_field(data, "fusions", dict, file, default=None)
        if fusions is not None and not all(isinstance(k, str) and isinstance(v, bool)
                                           for k, v in fusions.items()):
            raise ConfigError(file, "fusions", f"got {fusions!r}",
                              "a mapping of TransformerConfig fusion fields to true/false")
        profile = cls(data["model"], precision=PRECISIONS[precision], attention=attention,
                      fusions=fusions)
        for i, raw in enumerate(entries):
            profile.add(entry_from_dict(raw, file, f"entries[{i}]"))
        return profile


_ENTRY_FIELDS = {"gpu", "tp", "micro_batch_size", "seq_length", *PARTS}
_OP_COST_FIELDS = {"forward_s", "backward_s", "activation_bytes", "activation_bytes_recompute",
                   "param_count", "source"}


def entry_from_dict(raw, file="<profile>", where="entry") -> ProfileEntry:
    """One entry of a profile file (or of a measuring process's report), every field checked."""
    if not isinstance(raw, dict):
        raise ConfigError(file, where, f"expected a mapping, got {raw!r}")
    check_keys(raw, _ENTRY_FIELDS, file, where)
    parts = {part: _op_cost_from_dict(get_field(raw, part, dict, file, where), file,
                                      f"{where}.{part}") for part in PARTS}
    return ProfileEntry(
        gpu=get_field(raw, "gpu", str, file, where),
        tp=get_field(raw, "tp", int, file, where, positive=True),
        micro_batch_size=get_field(raw, "micro_batch_size", int, file, where, positive=True),
        seq_length=get_field(raw, "seq_length", int, file, where, positive=True),
        **parts)


def _op_cost_from_dict(raw: dict, file, where: str) -> OpCost:
    check_keys(raw, _OP_COST_FIELDS, file, where)
    source = get_field(raw, "source", str, file, where, default="estimated")
    if source not in SOURCES:
        raise ConfigError(file, f"{where}.source", f"got {source!r}", ", ".join(SOURCES))
    return OpCost(
        forward_s=get_field(raw, "forward_s", float, file, where, min_value=0),
        backward_s=get_field(raw, "backward_s", float, file, where, min_value=0),
        activation_bytes=get_field(raw, "activation_bytes", float, file, where, min_value=0),
        activation_bytes_recompute=get_field(raw, "activation_bytes_recompute", float, file,
                                             where, min_value=0),
        param_count=get_field(raw, "param_count", int, file, where, min_value=0),
        source=source)


def merge_profiles(profiles: list[Profile], files: list[str]) -> Profile:
    """Several profiles of one model as one (``autohet plan --profile A --profile B``): per key
    the entry with the most measured parts, then the most calibrated ones (a measured entry
    always wins over an estimate), the earlier file's on a tie. They must describe the same
    figures: one precision and attention, and the same fusions where they record any;
    ConfigError naming the first file that differs from the first."""
    out = Profile(profiles[0].model, precision=profiles[0].precision,
                  attention=profiles[0].attention, fusions=profiles[0].fusions)
    for profile, file in zip(profiles, files):
        for name, mine, theirs in (("precision", out.precision.name, profile.precision.name),
                                   ("attention", out.attention, profile.attention)):
            if mine != theirs:
                raise ConfigError(file, name, f"{theirs}, {files[0]} is {mine}",
                                  f"profiles of one {name} to merge")
        if profile.fusions is not None:
            if out.fusions is not None and out.fusions != profile.fusions:
                raise ConfigError(file, "fusions", f"{profile.fusions}, another profile given "
                                  f"has {out.fusions}", "profiles of layers run with the same "
                                  "fusions to merge")
            out.fusions = profile.fusions
        for key, entry in profile.entries.items():
            if key not in out.entries or profile.figures_rank(key) > out.figures_rank(key):
                out.entries[key] = entry
    return out
