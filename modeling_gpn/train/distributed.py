"""Starting Accelerate for one or many processes, and bounding what a multi-process run may wait for.

- `start_accelerator` refuses a launch of several processes that Accelerate starts as one each, sets the
  collectives' timeout (`--ddp-timeout`), and applies FSDP2 on CPU, which Accelerate would silently make DDP;
- `RunStage` names the stage a run is in, for errors, and is the watchdog of the end of a multi-process run
  (the process group's end and the interpreter's exit, which no collective timeout covers);
- `fit_fsdp_plugin` drops or refuses, in one line, the FSDP2 options Accelerate would fail on with the model;
- `collective_error` turns a gloo / NCCL failure into a `CollectiveError` naming that stage;
- `all_finite` and `stop_requested` are the two questions every process must answer alike.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from collections.abc import Callable, Iterable

    import torch
    from accelerate import Accelerator
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch import nn

from .errors import CollectiveError, LaunchError

# Variables that launchers set in every process of a multi-process job: torchrun / `accelerate launch`
# (WORLD_SIZE, LOCAL_WORLD_SIZE, RANK, LOCAL_RANK) and MPI launchers (read by Accelerate on CPU too).
LAUNCHER_SIZE_VARIABLES = ("WORLD_SIZE", "LOCAL_WORLD_SIZE", "PMI_SIZE", "OMPI_COMM_WORLD_SIZE", "MV2_COMM_WORLD_SIZE")
LAUNCHER_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "PMI_RANK", "OMPI_COMM_WORLD_RANK", "MV2_COMM_WORLD_RANK")


def launched_as_several_processes() -> list[str]:
    """The launcher variables that say this process is one of several ("WORLD_SIZE=2", "LOCAL_RANK=1"), or []."""

    def number(name: str) -> int:
        value = os.environ.get(name, "")
        return int(value) if value.strip().isdigit() else 0

    found = [f"{name}={os.environ[name]}" for name in LAUNCHER_SIZE_VARIABLES if number(name) > 1]
    found += [f"{name}={os.environ[name]}" for name in LAUNCHER_RANK_VARIABLES if number(name) > 0]
    return found


def started_by_a_launcher() -> bool:
    """Whether a launcher (torchrun, `accelerate launch` of several processes, mpirun) started this process: it
    sets a rank variable in each process it starts."""
    return any(name in os.environ for name in LAUNCHER_RANK_VARIABLES)


def fsdp_requested() -> int | None:
    """The FSDP version `accelerate launch --use_fsdp` (or a config file with distributed_type FSDP) asked for."""
    if os.environ.get("ACCELERATE_USE_FSDP", "false").lower() != "true":
        return None
    return int(os.environ.get("FSDP_VERSION", "1"))


def start_accelerator(config: dict, trackers: list[str], run_dir: Path) -> Accelerator:
    """The run's Accelerator, checked against the launch.

    - A job launched as several processes that Accelerate starts as one (an FSDP config file with `use_cpu`
      does not reach the processes, so on a machine without GPUs each comes up alone) would train the whole
      run once per process into the same folder: refused with the launch command that works.
    - Accelerate (1.16) makes an FSDP launch on CPU plain DDP without a word (it applies FSDP only on
      GPU-like devices); FSDP2 (`fully_shard`) runs on CPU with gloo, so it is applied here as asked.
      FSDP1 on CPU is refused by Accelerate itself; that is said in one line.
    - Mixed precision is applied as the run says, or refused: Accelerate trains fp16 on a CPU in float32 without a
      word, and this run's setting silently overrides a launcher's other choice (`accelerate launch
      --mixed_precision`).
    """
    import datetime

    import torch
    from accelerate import Accelerator, PartialState
    from accelerate.utils import DistributedType, FullyShardedDataParallelPlugin, InitProcessGroupKwargs

    on_cpu = os.environ.get("ACCELERATE_USE_CPU", "").lower() in ("1", "true", "yes") or not torch.cuda.is_available()
    if fsdp_requested() == 1 and on_cpu:
        raise LaunchError(
            "FSDP version 1 needs GPUs in Accelerate; on CPU launch FSDP2 with `ACCELERATE_USE_CPU=1 accelerate launch "
            "--use_fsdp --fsdp_version 2 --num_processes N --num_machines 1 -m modeling_gpn.train ...`"
        )
    asked = config["mixed_precision"]
    launched_with = os.environ.get("ACCELERATE_MIXED_PRECISION", "no")
    if launched_with not in ("no", asked):
        # The setting below overrides the launcher's (`accelerate launch --mixed_precision`, `accelerate config`),
        # which would otherwise be dropped without a word. (Its "no" is also its default: not a choice to check.)
        raise LaunchError(
            f"accelerate launch asked for mixed precision {launched_with}, but this run's setting is {asked} (the "
            f"built-in default, the recipe or --mixed-precision), which Accelerate would use: pass --mixed-precision "
            f"{launched_with}, or launch with --mixed_precision {asked}"
        )
    accelerator = Accelerator(
        mixed_precision=asked,
        log_with=trackers or None,
        project_dir=str(run_dir),
        # A process that stops (not dies) would otherwise hold the others for gloo's 30-minute default.
        kwargs_handlers=[InitProcessGroupKwargs(timeout=datetime.timedelta(seconds=config["ddp_timeout"]))],
    )
    if asked != "no" and not accelerator.native_amp and accelerator.distributed_type != DistributedType.DEEPSPEED:
        # Accelerate (1.16) applies fp16 only off the CPU; on a CPU it trains in float32 while the run says fp16.
        raise LaunchError(
            f"--mixed-precision {asked} is not applied on {accelerator.device.type.upper()} by Accelerate "
            f"{_accelerate_version()}: the run would train in float32. Use --mixed-precision bf16 or no there"
        )
    launched = launched_as_several_processes()
    if launched and accelerator.num_processes == 1:
        cause = (
            "no GPU was found and ACCELERATE_USE_CPU is not set (a config file's use_cpu does not reach the processes)"
            if on_cpu and not os.environ.get("ACCELERATE_USE_CPU")
            else f"Accelerate chose {accelerator.distributed_type.value}"
        )
        raise LaunchError(
            f"this job was launched as several processes ({', '.join(launched)}) but Accelerate started this one as a "
            f"single-process run ({cause}), so every process would train the whole run alone into {run_dir}. "
            "Launch on CPU with `ACCELERATE_USE_CPU=1 accelerate launch --multi_gpu --num_processes N --num_machines 1 "
            "-m modeling_gpn.train ...` (FSDP: `--use_fsdp --fsdp_version 2` instead of `--multi_gpu`), on GPUs with "
            "`accelerate launch --multi_gpu --num_processes N -m modeling_gpn.train ...`"
        )
    if fsdp_requested() == 2 and accelerator.distributed_type == DistributedType.MULTI_CPU:
        # Both states: Accelerate copies PartialState's type into AcceleratorState whenever one is created.
        # (PartialState holds a non-device type for DeepSpeed the same way; its collectives accept FSDP.)
        PartialState().distributed_type = DistributedType.FSDP
        accelerator.state.distributed_type = DistributedType.FSDP
        accelerator.state.fsdp_plugin = plugin = FullyShardedDataParallelPlugin()  # from the launcher's FSDP_*
        if asked != "no":
            # Accelerate's FSDP2 computes in low precision only through the plugin's policy (it wraps no autocast
            # around an FSDP2 model), which it sets only on a plugin of its own: this one trained in float32.
            plugin.set_mixed_precision(asked)
        if not accelerator.is_fsdp2:
            raise LaunchError(
                f"Could not apply FSDP2 on CPU with Accelerate {_accelerate_version()}: launch with "
                "--multi_gpu (DDP) instead"
            )
    return accelerator


def fit_fsdp_plugin(plugin: FullyShardedDataParallelPlugin, model: nn.Module, on_cpu: bool) -> str | None:
    """Before `accelerator.prepare(model)` under FSDP2: drop or refuse the options Accelerate (1.16) fails on
    with this model, a traceback deep in `fully_shard` otherwise. Returns a line saying what was changed, or None.

    - An auto-wrap unit that holds the input embedding (GPNModel named with `--fsdp_transformer_layer_cls_to_wrap`;
      `TRANSFORMER_BASED_WRAP` alone, `accelerate config`'s FSDP default, wraps nothing: a GPN's
      `_no_split_modules` names no module): Accelerate shards the embedding inside it a second time and fails
      ("Invariant encountered: value was None"). The policy is dropped: the model is sharded as one unit (for a
      GPN the same grouping: that unit held every weight).
    - `SIZE_BASED_WRAP` with a small `--fsdp_min_num_params`: it also wraps GPNModel and the ModuleList of
      predict layers (`fully_shard` refuses a container without a forward); the blocks it can shard apart are
      sharded apart instead (`_size_policy_as_blocks`).
    - Activation checkpointing without a wrap policy: Accelerate calls the missing policy (a TypeError); with
      one that wraps nothing (`TRANSFORMER_BASED_WRAP` alone), it would recompute nothing without a word.
    - Parameter offload on CPU: the parameters are in CPU memory already, and its pinned memory needs a GPU.
    - Mixed precision (a GPN): FSDP2's policy casts every floating input of a unit's forward to its `param_dtype`,
      so a block sharded apart would get the float32 recurrent state and memory in bf16 at every token (the memory
      write failed on it: "expected scalar type Float but found BFloat16"). A GPN casts each projection's input to
      its weight's dtype itself, so the inputs are left as they come (`cast_forward_inputs=False`).
    """
    import dataclasses

    from accelerate.utils.fsdp_utils import fsdp2_prepare_auto_wrap_policy
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    if isinstance(plugin.cpu_offload, CPUOffloadPolicy) and on_cpu:  # (no offload is the base OffloadPolicy())
        raise LaunchError(
            "--fsdp_offload_params moves the parameters to CPU memory: on CPU they are there already (and Accelerate "
            "fails pinning them without a GPU); launch without it"
        )
    mixed = plugin.mixed_precision_policy
    if isinstance(mixed, MixedPrecisionPolicy) and mixed.cast_forward_inputs and model.config.model_type == "gpn":
        plugin.mixed_precision_policy = dataclasses.replace(mixed, cast_forward_inputs=False)
    note = None
    size_based = _is_size_based(plugin.auto_wrap_policy)
    if size_based and not plugin.min_num_params > 0:
        plugin.auto_wrap_policy = None  # what Accelerate does with it (the policy would otherwise wrap everything)
    policy = fsdp2_prepare_auto_wrap_policy(plugin, model) if plugin.auto_wrap_policy is not None else None
    embedding = model.get_input_embeddings()
    wrapped = [m for m in model.modules() if m is not model and m is not embedding and policy(m)] if policy else []
    holders = [type(unit).__name__ for unit in wrapped if any(inner is embedding for inner in unit.modules())]
    if size_based and any(_why_not_a_unit(unit, model) for unit in wrapped):
        note = _size_policy_as_blocks(plugin, model, wrapped)
    elif holders:
        plugin.auto_wrap_policy = None
        note = (
            f"FSDP2: the auto-wrap policy's unit {holders[0]} holds the input embedding, which Accelerate cannot "
            "shard inside it: the model is sharded as one unit instead (the same grouping; to shard layers apart, "
            "name ones without the embedding with --fsdp_transformer_layer_cls_to_wrap, e.g. GPNPredictLayer)"
        )
    if plugin.activation_checkpointing and (plugin.auto_wrap_policy is None or not wrapped):
        raise LaunchError(
            "--fsdp_activation_checkpointing needs an auto-wrap policy naming the layers to recompute "
            "(--fsdp_auto_wrap_policy TRANSFORMER_BASED_WRAP with --fsdp_transformer_layer_cls_to_wrap of layers "
            "without the input embedding); a GPN's --bptt-segment already bounds its activation memory: launch "
            "without it"
        )
    return note


def _is_size_based(policy: Callable | str | None) -> bool:
    """Whether the plugin's auto-wrap policy is `SIZE_BASED_WRAP` (torch's function, or Accelerate's partial of it)."""
    from torch.distributed.fsdp.wrap import size_based_auto_wrap_policy

    return getattr(policy, "func", policy) is size_based_auto_wrap_policy


def _why_not_a_unit(module: nn.Module, model: nn.Module) -> str | None:
    """Why Accelerate's FSDP2 preparation cannot shard `module` as a unit of its own, or None: a container without
    a forward (`fully_shard` refuses a ModuleList), or one holding the input embedding or the output layer
    (Accelerate shards those again in a group of their own: a table in two groups fails in `fully_shard`)."""
    import torch

    if (
        isinstance(module, (torch.nn.ModuleList, torch.nn.ModuleDict))
        and type(module).forward is torch.nn.Module.forward
    ):
        return "is a container without a forward"
    ends = [model.get_input_embeddings(), model.get_output_embeddings()]
    tables = {id(p) for end in ends if end is not None for p in end.parameters()}
    if any(id(p) in tables for p in module.parameters()):
        return "holds the embedding"
    return None


def _size_policy_as_blocks(plugin: FullyShardedDataParallelPlugin, model: nn.Module, wrapped: list) -> str:
    """`SIZE_BASED_WRAP` whose units include one Accelerate cannot shard (a GPN's GPNModel and its ModuleList of
    predict layers, above any small `--fsdp_min_num_params`): Accelerate 1.16 would fail in `fully_shard`. Its
    other policy is one of classes, so the size rule becomes the classes whose every instance it wraps and that
    can be sharded apart (GPNPredictLayer, GPNMemoryWrite, ...); what is left (the embedding, the tied head, a
    Linear class that includes it) stays in the root unit. Returns the line that says so."""
    from torch.distributed.fsdp.wrap import transformer_auto_wrap_policy

    refused, why = next((unit, why) for unit in wrapped if (why := _why_not_a_unit(unit, model)))
    chosen = {id(unit) for unit in wrapped if _why_not_a_unit(unit, model) is None}
    every_instance: dict[str, bool] = {}
    for module in model.modules():
        if module is not model:
            name = type(module).__name__
            every_instance[name] = every_instance.get(name, True) and id(module) in chosen
    blocks = [name for name, chosen_in_every_instance in every_instance.items() if chosen_in_every_instance]
    asked = f"SIZE_BASED_WRAP over {plugin.min_num_params:,} parameters wraps {type(refused).__name__}, which {why}"
    if not blocks:
        plugin.auto_wrap_policy = None
        return f"FSDP2: {asked}: the model is sharded as one unit instead"
    plugin.auto_wrap_policy = transformer_auto_wrap_policy
    plugin.transformer_cls_names_to_wrap = blocks
    return (
        f"FSDP2: {asked}: sharded apart instead are the classes it wraps in every instance that hold no embedding "
        f"({', '.join(blocks)}), the rest as one unit"
    )


def _accelerate_version() -> str:
    import accelerate

    return accelerate.__version__


def distribution_name(accelerator: Accelerator) -> str:
    """How the processes share the work, for the run's summary line: "DDP", "FSDP2", ... or "single process"."""
    from accelerate.utils import DistributedType

    if accelerator.num_processes == 1:
        return "single process"
    if accelerator.distributed_type == DistributedType.FSDP:
        return f"FSDP{accelerator.state.fsdp_plugin.fsdp_version}"
    if accelerator.distributed_type == DistributedType.DEEPSPEED:
        return "DeepSpeed"
    return "DDP"


def is_fsdp(accelerator: Accelerator) -> bool:
    """Whether the run shards the model with FSDP."""
    from accelerate.utils import DistributedType

    return accelerator.distributed_type == DistributedType.FSDP


def all_finite(accelerator: Accelerator, tensors: Iterable[torch.Tensor]) -> bool:
    """Whether every tensor holds only finite values, on every process (a collective when world > 1)."""
    import torch

    with torch.no_grad():
        # FSDP: each process checks its own shard (the reduce below covers the others').
        flags = [torch.isfinite(local_part(t)).all() for t in tensors if torch.is_tensor(t) and t.is_floating_point()]
        bad = (
            torch.stack(flags).logical_not().any().float().to(accelerator.device)
            if flags
            else torch.zeros((), device=accelerator.device)
        )
    if accelerator.num_processes > 1:
        bad = accelerator.reduce(bad, reduction="sum")
    return not bool(bad > 0)


def local_part(tensor: torch.Tensor) -> torch.Tensor:
    """The part of a (possibly FSDP-sharded DTensor) tensor this process holds."""
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def stop_requested(accelerator: Accelerator, received: int | None) -> int | None:
    """The signal that asks to stop (`received` here, or on any other process), agreed by every process (a
    collective when world > 1)."""
    import torch

    received = received or 0
    if accelerator.num_processes > 1:
        received = int(accelerator.reduce(torch.tensor(received, device=accelerator.device), reduction="max"))
    return received or None


# --------------------------------------------------------------------------------------------------
# Where a multi-process run is, and a bound on the end of it
# --------------------------------------------------------------------------------------------------


class RunStage:
    """The stage a run is in ("training step 12", "saving the model", ...), for errors that name it.

    Collectives are bounded by --ddp-timeout (gloo / NCCL), but the end of the process group and the
    interpreter's exit (joining threads, atexit) are not: a stage entered with `watch=True` must end (the
    next `enter`, or `finish`) within `watchdog_s` seconds, or the process prints the stage and every
    thread's stack and exits 1 (the launcher then stops the others). Compute stages are not watched: their
    length is the model's, not a hang's.
    """

    def __init__(self, watchdog_s: float | None = None) -> None:
        self.name = "starting"
        self.watchdog_s = watchdog_s
        self._timer: threading.Timer | None = None

    def enter(self, name: str, watch: bool = False) -> None:
        """Enter stage `name`; with `watch`, it must end within the watchdog's seconds."""
        self.name = name
        self._cancel()
        if watch and self.watchdog_s:
            import faulthandler

            # A hang that holds the GIL (a C++ destructor joining gloo's threads) stops Python threads, this
            # timer included: faulthandler's own C thread then dumps the stacks and exits 5 s later.
            faulthandler.dump_traceback_later(self.watchdog_s + 5, exit=True)
            self._watching = True
            self._timer = threading.Timer(self.watchdog_s, self._expired, args=(name,))
            self._timer.daemon = True  # never keeps the process alive itself
            self._timer.start()

    def finish(self) -> None:
        """End the current stage (its watchdog stops)."""
        self._cancel()

    def _cancel(self) -> None:
        if getattr(self, "_watching", False):
            import faulthandler

            faulthandler.cancel_dump_traceback_later()
            self._watching = False
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _expired(self, name: str) -> None:
        import faulthandler

        os.write(
            2,
            f"\ngpn train: error: the run hung while {name}: still there after {self.watchdog_s:.0f} s "
            "(--ddp-timeout plus a margin); another process stopped responding, or the process cannot end. "
            "Whatever was written (model, checkpoints) is complete: files are written and then renamed. "
            "The stacks of this process's threads follow; it exits now so that the job ends\n".encode(),
        )
        faulthandler.dump_traceback(all_threads=True)
        os._exit(1)


def collective_error(error: BaseException, stage: str, ddp_timeout: int) -> CollectiveError | None:
    """A CollectiveError naming `stage` for a gloo/NCCL failure (a timeout, a peer that ended), else None."""
    text = str(error)
    first = text.splitlines()[0] if text else type(error).__name__
    lowered = text.lower()
    if "timed out" in lowered or "timeout" in lowered and "collective" in lowered:
        return CollectiveError(
            f"a collective operation timed out after --ddp-timeout {ddp_timeout} s while {stage}: another process "
            f"stopped responding, so the job fails instead of waiting ({first})"
        )
    if any(sign in lowered for sign in ("connection closed by peer", "connection reset by peer", "broken pipe")):
        return CollectiveError(f"another process ended while {stage}, so this one stops too ({first})")
    return None
