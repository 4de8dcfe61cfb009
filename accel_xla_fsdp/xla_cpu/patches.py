"""Every name of another library that accel_xla_fsdp replaces at run time, in one table.

``PATCHES`` lists them, one entry per patched name: what it patches (``target``), the function
that makes the replacement from the original (``wrap``), why (the failure measured, or the
upstream behaviour worked around), on which platforms it applies and when it is installed. Nothing
else in the library assigns to another library's names: ``install(stage)`` is the one place that
does, and ``uninstall()`` puts every original back (the tests use it).

When (``Stage``):

* ``PACKAGE``, at ``import accel_xla_fsdp`` (any submodule's import runs it first): what must be in
  place before torch_xla's launcher starts the replica threads. Its worker process imports the
  replica function's module, so ``accel_xla_fsdp``, before it starts them; a replica that synced
  before the import would miss its turn at a graph boundary.
* ``ACCELERATE``, at the import of the Accelerate room (``accel_xla_fsdp.Accelerator``, which a
  script imports at module level): what a stock script's calls need on replica threads (seeding,
  ``from_pretrained``, logging, ``load_dataset``, SDPA masks). Not at the package's import: it
  imports transformers, which a script using the engine alone does not need.
* ``TRAINER``, at the import of the Trainer room (``accel_xla_fsdp.Trainer``): the two names
  ``transformers.trainer`` took from Accelerate. Not before: importing ``transformers.trainer``
  costs seconds.
* ``LAUNCHER``, under ``accel-xla-fsdp launch`` only, in every replica process before the script
  is run (launcher.py, after both rooms' stages): Accelerate's and transformers'
  names pointed at the engine, so that the script and the libraries it imports (TRL) need no change.
* ``PEFT_LOAD``, at the first ``from_pretrained`` that ``fsdp_cpu_ram_efficient_loading`` defers:
  PEFT's adapter placement, only ever reached after such a load. Importing PEFT to patch it
  earlier would cost every run seconds.
* ``DPO_TRAINER``, when a trainer that is a TRL ``DPOTrainer`` is built with
  ``XlaFsdpTrainerMixin`` (under ``accel-xla-fsdp launch`` every trainer is): TRL's DPO loss.
  Importing TRL to patch it earlier would cost every run seconds.

Where (``Platforms``): ``XLA_CPU`` entries are installed only when the platform is XLA:CPU, where
the replicas are threads of one process (and their replacements fall back to the original outside
replica threads); ``EVERY`` entries are installed on every platform, a TPU included, and the
reason says what a TPU needs them for.

How it is undone: ``uninstall()`` assigns each original back (or deletes the name where the
original was inherited from a base class), newest first.

    python -m accel_xla_fsdp.xla_cpu --patches      # the table
"""

from __future__ import annotations

import enum
import importlib
import inspect
import threading
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Tuple

from .. import _xla
from .seeds import ROUTED_FUNCTIONS, ROUTED_METHODS


class Stage(enum.Enum):
    PACKAGE = "import accel_xla_fsdp"
    ACCELERATE = "import of the Accelerate room (accel_xla_fsdp.Accelerator)"
    TRAINER = "import of the Trainer room (accel_xla_fsdp.Trainer)"
    LAUNCHER = "accel-xla-fsdp launch, in each replica process before the script runs"
    PEFT_LOAD = "first from_pretrained deferred by fsdp_cpu_ram_efficient_loading"
    DPO_TRAINER = "first TRL DPOTrainer built with XlaFsdpTrainerMixin (under accel-xla-fsdp launch: any)"


class Platforms(enum.Enum):
    XLA_CPU = "XLA:CPU (replica threads)"
    EVERY = "every platform"


@dataclass(frozen=True)
class Patch:
    """One replaced name. ``target`` is ``"module:attribute.path"``; ``wrap`` is
    ``"module:function"``, called once with the original, returning what takes its place."""

    target: str
    wrap: str
    why: str
    platforms: Platforms
    stage: Stage
    optional: bool = False  # its library may be absent: then nothing is patched

    def applies(self) -> bool:
        return self.platforms is Platforms.EVERY or _xla.on_cpu()


_BOUNDARIES = "accel_xla_fsdp.xla_cpu.graph_boundaries"
_RENDEZVOUS = "accel_xla_fsdp.xla_cpu.rendezvous"
_SEEDS = "accel_xla_fsdp.xla_cpu.seeds"
_LOADING = "accel_xla_fsdp.hf_accelerate.pretrained_loading"
_TRAINER = "accel_xla_fsdp.hf_trainer.trainer"
_LOGGING = "accel_xla_fsdp.xla_cpu.script_logging"
_LAUNCHER = "accel_xla_fsdp.launcher"

_SEED_WHY = (
    "replica threads share torch's one CPU generator: set_seed(42) in every replica then from_config gave "
    "another initial model on every run (0.13 max weight difference, measured), and a masking collator's "
    "masks depended on thread timing; a replica thread that seeded draws from a generator of its own (seeds.py)"
)
_LOAD_WHY = (
    "one model built at a time in the process, from the replica thread's own seed: 4 replica threads loading a "
    "tied-embedding model at once left lm_head.weight on the meta device, every time (measured); on a TPU the "
    "lock is never contended. With fsdp_cpu_ram_efficient_loading (every platform) the load reads no weights: "
    "prepare() reads each replica's slices into its shards (hf_accelerate/pretrained_loading.py)"
)

PATCHES: Tuple[Patch, ...] = (
    Patch(
        "torch_xla:_XLAC._xla_step_marker",
        f"{_BOUNDARIES}:step_marker",
        "every sync passes here: the before_graph_cut callbacks run on every platform (the engine frees idle "
        "units' full parameters, seeded() refuses a sync); on XLA:CPU the replica threads take turns, else they "
        "compile one program N times at once and XLA:CPU aborts a collective they reach over 15 s apart "
        "(graph_boundaries.py)",
        Platforms.EVERY,
        Stage.PACKAGE,
    ),
    Patch(
        "torch_xla._internal.pjrt:_run_thread_per_device",
        f"{_BOUNDARIES}:run_replica_threads",
        "torch_xla's launcher notices a failed replica only after the ones before it returned, and the others "
        "wait for it at their next collective (600 s, or for ever); here the first failure ends the worker "
        "process, and the launcher then stops the others (on a TPU, the other chips' processes)",
        Platforms.EVERY,
        Stage.PACKAGE,
    ),
    Patch(
        "torch_xla.core.xla_model:rendezvous",
        f"{_RENDEZVOUS}:rendezvous",
        "xm.rendezvous exchanges host values by an all-gather without a channel id, which hangs on XLA:CPU "
        "devices (Accelerate's wait_for_everyone, main_process_first, broadcast; the Trainer around saves): "
        "replica threads hand each other the values in memory",
        Platforms.XLA_CPU,
        Stage.PACKAGE,
    ),
    Patch(
        "torch_xla.core.xla_model:mesh_reduce",
        f"{_RENDEZVOUS}:mesh_reduce",
        "xm.mesh_reduce (the Trainer's logged loss) reads its value back mid-graph, every replica at once: "
        "on replica threads it syncs first, at a boundary where they take turns",
        Platforms.XLA_CPU,
        Stage.PACKAGE,
    ),
    Patch(
        "logging:root.handlers",
        f"{_LOGGING}:without_torch_xla_basic_config",
        "import torch_xla calls logging.basicConfig(), so a script's own basicConfig(level=INFO) does nothing and "
        "its logger.info lines are dropped (on a TPU too): torch_xla's untouched default handler is removed",
        Platforms.EVERY,
        Stage.ACCELERATE,
    ),
    Patch(
        "transformers.modeling_utils:PreTrainedModel.from_pretrained",
        f"{_LOADING}:locked_from_pretrained",
        _LOAD_WHY,
        Platforms.EVERY,
        Stage.ACCELERATE,
    ),
    Patch(
        "transformers.modeling_utils:PreTrainedModel._from_config",
        f"{_LOADING}:locked_from_config",
        "AutoModel*.from_config builds through it: " + _LOAD_WHY.split(". With")[0],
        Platforms.EVERY,
        Stage.ACCELERATE,
    ),
    Patch(
        "transformers.modeling_utils:safe_save_file",
        "accel_xla_fsdp.hf_accelerate.unwrapped_save:written_as_gathered",
        "unwrap_model(model).save_pretrained(...) held the whole gathered model on the writing process (issue 27: "
        "1.2 M above the live state): inside it, transformers' safetensors writer lays each file out with holes "
        "for the parameters, which the gathers then fill a piece at a time (unwrapped_save.py); elsewhere unchanged",
        Platforms.EVERY,
        Stage.ACCELERATE,
    ),
    Patch(
        "transformers.modeling_utils:PreTrainedModel._load_pretrained_model",
        f"{_LOADING}:deferred_or",
        "with fsdp_cpu_ram_efficient_loading, from_pretrained reads only the files' headers and buffers; "
        "prepare() reads each replica's slices of the weights into its shards, no replica holding the model whole",
        Platforms.EVERY,
        Stage.ACCELERATE,
    ),
    *(
        Patch(f"{module}:{name}", f"{_SEEDS}:{wrap}", _SEED_WHY, Platforms.XLA_CPU, Stage.ACCELERATE)
        for module in ("torch", "torch.random")
        for name, wrap in (
            ("manual_seed", "own_seed"),
            ("get_rng_state", "own_get_state"),
            ("set_rng_state", "own_set_state"),
        )
    ),
    *(
        Patch(f"torch:{name}", f"{_SEEDS}:routed", _SEED_WHY, Platforms.XLA_CPU, Stage.ACCELERATE)
        for name in ROUTED_FUNCTIONS
    ),
    *(
        Patch(f"torch:Tensor.{name}", f"{_SEEDS}:routed", _SEED_WHY, Platforms.XLA_CPU, Stage.ACCELERATE)
        for name in ROUTED_METHODS
    ),
    Patch(
        "transformers.utils.logging:set_verbosity",
        f"{_LOGGING}:per_thread_verbosity",
        "scripts set transformers' verbosity per process (info on the main one, error on the others); on "
        "replica threads the last one decided for all (0 log lines against 13 on the CPU, measured): each "
        "thread's records are filtered at its own level",
        Platforms.XLA_CPU,
        Stage.ACCELERATE,
    ),
    Patch(
        "datasets.utils.logging:set_verbosity",
        f"{_LOGGING}:per_thread_verbosity",
        "as transformers' set_verbosity, for datasets'",
        Platforms.XLA_CPU,
        Stage.ACCELERATE,
        optional=True,
    ),
    Patch(
        "tqdm.contrib.concurrent:ensure_lock",
        "accel_xla_fsdp.xla_cpu.tqdm_lock:taking_turns",
        "two replica threads inside thread_map (datasets.load_dataset) delete tqdm's class-wide lock twice: "
        "AttributeError: type object 'tqdm' has no attribute '_lock' (run_clm_no_trainer.py, 4 replicas); "
        "replica threads take turns through it",
        Platforms.XLA_CPU,
        Stage.ACCELERATE,
        optional=True,
    ),
    Patch(
        "dill.temp:capture",
        "accel_xla_fsdp.xla_cpu.dill_capture:per_thread",
        "dill swaps the process-wide sys.stdout for a StringIO while it disassembles a function datasets "
        "fingerprints (.map in TRL's dataset preparation); replica threads at once put back each other's "
        "StringIO: the Trainer's loss lines were lost and a bytecode listing printed (TRL's sft.py, 4 replicas, "
        "2 logs of 3); on replica threads each thread's writes go to its own capture",
        Platforms.XLA_CPU,
        Stage.ACCELERATE,
        optional=True,
    ),
    Patch(
        "transformers.masking_utils:_ignore_causal_mask_sdpa",
        "accel_xla_fsdp.xla_cpu.sdpa_mask:without_read_back",
        "asks fast_all(padding_mask), a host read-back mid-forward that replica threads run at once, outside "
        "their turns: both replicas of a launched Trainer died of SIGSEGV inside torch_xla there (once); XLA "
        "tensors get the answer transformers gives while tracing (build the mask)",
        Platforms.XLA_CPU,
        Stage.ACCELERATE,
        optional=True,
    ),
    Patch(
        "transformers.trainer:Accelerator",
        f"{_TRAINER}:accelerator_dispatch",
        "the Trainer builds its Accelerator by this name: ours for our Trainers (in the thread building one), "
        "Accelerate's for any other",
        Platforms.EVERY,
        Stage.TRAINER,
    ),
    Patch(
        "transformers.trainer:skip_first_batches",
        f"{_TRAINER}:skip_first_batches_dispatch",
        "Accelerate's skip_first_batches takes torch_xla's device loader apart on XLA; our prepare()'s "
        "dataloaders skip their own batches, any other is Accelerate's",
        Platforms.EVERY,
        Stage.TRAINER,
    ),
    Patch(
        "accelerate:Accelerator",
        f"{_LAUNCHER}:our_accelerator",
        "a stock Accelerate script's `from accelerate import Accelerator` gets accel_xla_fsdp's",
        Platforms.EVERY,
        Stage.LAUNCHER,
    ),
    Patch(
        "accelerate.accelerator:Accelerator",
        f"{_LAUNCHER}:our_accelerator",
        "the same name imported from its module (`from accelerate.accelerator import Accelerator`)",
        Platforms.EVERY,
        Stage.LAUNCHER,
    ),
    Patch(
        "transformers.trainer:Trainer.__new__",
        f"{_TRAINER}:mixin_new",
        "every Trainer, of any class (TRL's, defined at its import; a user's subclass), is built as its class "
        "with XlaFsdpTrainerMixin in front (made once per class): replacing the name transformers.Trainer would "
        "miss classes defined before, and clash with a subclass that takes the mixin itself",
        Platforms.EVERY,
        Stage.LAUNCHER,
    ),
    Patch(
        "builtins:__import__",
        f"{_LAUNCHER}:one_import_at_a_time",
        "every replica thread runs the script's imports: a thread waiting for a module that replaces itself in "
        "sys.modules (TRL's lazy module) was handed the module it replaced, `cannot import name 'SFTConfig' "
        "from 'trl'` (seen, 4 replicas); one import statement at a time",
        Platforms.XLA_CPU,
        Stage.LAUNCHER,
    ),
    Patch(
        "torch_xla.runtime:use_spmd",
        f"{_LAUNCHER}:refusing_spmd",
        "SPMD partitions one global device, which cannot run beside our replica per device: refused with why, "
        "when a library calls it (the launcher refuses a script that does before it starts)",
        Platforms.EVERY,
        Stage.LAUNCHER,
    ),
    Patch(
        "peft.tuners.tuners_utils:BaseTunerLayer._move_adapter_to_device_of_base_layer",
        f"{_LOADING}:remembering_adapters",
        "PEFT initializes an adapter on the CPU, then moves it to its base layer's device: the meta device for "
        "a model loaded with fsdp_cpu_ram_efficient_loading, where its values are lost; they are kept for "
        "prepare()",
        Platforms.EVERY,
        Stage.PEFT_LOAD,
        optional=True,
    ),
    Patch(
        "trl.trainer.dpo_trainer:DPOTrainer._compute_loss",
        "accel_xla_fsdp.hf_trainer.masked_reductions:reducing_masked_selections",
        "TRL's default metrics logits/chosen and logits/rejected sum a boolean-mask selection (x[mask].sum()), on "
        "XLA a gather of as many elements as the mask selects: a new program for every new token count (DPO, 4 "
        "replicas: 52 to 84 programs compiled over 6 steps, 4 to 5 new each step). On XLA, the original runs under "
        "a torch function mode that computes a whole sum or mean of such a selection as where(mask, x, 0).sum() "
        "(/ mask.sum()), one program: the same value to round-off and the same gradient; any other use of the "
        "selection is the selection (hf_trainer/masked_reductions.py)",
        Platforms.EVERY,
        Stage.DPO_TRAINER,
        optional=True,
    ),
)


@dataclass
class _Installed:
    patch: Patch
    owner: Any
    attribute: str
    original: Any  # as stored on ``owner`` itself (a classmethod object, say); _INHERITED if not there
    found: Any  # what the name gave (through base classes too): what ``wrap`` was called with
    replacement: Any


_INHERITED = object()  # the original was found on a base class, not on the owner itself
_installed: List[_Installed] = []
_installing = threading.RLock()  # replica threads install a stage at once (DPO_TRAINER: each builds a trainer)


def resolve(target: str) -> Tuple[Any, str]:
    """The object holding a target's name, and the name (may raise ImportError)."""
    module, _, path = target.partition(":")
    owner: Any = importlib.import_module(module)
    *outer, attribute = path.split(".")
    for name in outer:
        owner = getattr(owner, name)
    return owner, attribute


def current(target: str) -> Any:
    """What the target's name holds now, as stored (``inspect.getattr_static``: a classmethod
    object, not the bound method)."""
    owner, attribute = resolve(target)
    return inspect.getattr_static(owner, attribute)


def _function(path: str) -> Callable[[Any], Any]:
    module, _, name = path.partition(":")
    return getattr(importlib.import_module(module), name)


def install(stage: Stage) -> None:
    """Install every entry of ``stage`` that applies on this platform and is not installed yet."""
    with _installing:
        done = {entry.patch for entry in _installed}
        for patch in PATCHES:
            if patch.stage is stage and patch.applies() and patch not in done:
                _install(patch)


def _install(patch: Patch) -> None:
    try:
        owner, attribute = resolve(patch.target)
    except (ImportError, AttributeError):
        if patch.optional:
            return
        raise
    found = inspect.getattr_static(owner, attribute)
    own = vars(owner).get(attribute, _INHERITED) if isinstance(owner, type) else found
    replacement = _function(patch.wrap)(found)
    setattr(owner, attribute, replacement)
    _installed.append(_Installed(patch, owner, attribute, own, found, replacement))


def uninstall() -> None:
    """Put back every original, newest first."""
    while _installed:
        entry = _installed.pop()
        if entry.original is _INHERITED:
            delattr(entry.owner, entry.attribute)
        else:
            setattr(entry.owner, entry.attribute, entry.original)


def installed() -> Dict[str, Any]:
    """target -> the replacement installed there, for every installed entry."""
    return {entry.patch.target: entry.replacement for entry in _installed}


def original_of(target: str) -> Any:
    """What an installed target's name held before (as found: inherited from a base class too)."""
    return next(entry.found for entry in _installed if entry.patch.target == target)


def table() -> str:
    """The table, one block per entry, for ``python -m accel_xla_fsdp.xla_cpu --patches``."""
    blocks = []
    for i, patch in enumerate(PATCHES, 1):
        blocks.append(
            f"{i:2}. {patch.target}{'  (if installed)' if patch.optional else ''}\n"
            f"    by:        {patch.wrap}\n"
            f"    platforms: {patch.platforms.value}\n"
            f"    installed: at {patch.stage.value}\n"
            f"    undone:    uninstall() puts the original back\n"
            f"    why:       {patch.why}"
        )
    return "\n".join(blocks)
