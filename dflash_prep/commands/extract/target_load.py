"""The target model of a rank: its weights loading on a thread of their own during start-up (`TargetLoad`), then, in
the main thread, the final norm described, the fused kernels applied and packed attention switched on
(`load_target`). (bench/timing.py wraps this module's `load_model`.)"""

from __future__ import annotations

import logging
import threading
import time

import torch

from dflash_prep.commands.job import Run, manifest_readable
from dflash_prep.target.kernels import append_kernels_record, apply_kernels
from dflash_prep.target.layers import decoder_layers, find_decoder
from dflash_prep.target.model import describe_source, drop_layers_after, load_model, load_replica_model
from dflash_prep.target.norms import describe_final_norm, write_final_norm
from dflash_prep.target.packing import use_packed_attention

log = logging.getLogger("dflash_prep")


class TargetLoad:
    """The target's weights loading on a thread of their own (`build_target`), started once the output is
    claimed, while this process's main thread tokenizes (the main process) or waits for the tokenized rows (the
    others) and plans; `result()` joins it before the forward loop. Start-up was tokenize, then load, then plan.

    Started only where it is safe (`start_if_safe`): one GPU per replica (a tensor-parallel load runs collectives
    that would interleave with the main thread's barriers), `data.num_proc` 1 or unset (tokenizing in forked processes
    while a thread holds locks inside the loader could leave a child waiting forever), and an output that may
    have work left (a finished one loads nothing). Random weights stay identical on every rank: the thread seeds
    and draws them as the main thread did, and nothing else draws random numbers meanwhile; torch's default
    dtype, which transformers sets while it builds a model, is not touched by the main thread meanwhile (the
    cost model's meta-device build is done before the thread starts).

    Threads share the GIL. Measured on 2 CPU cores, 4,200 demo rows beside the CPU-bound random init of a
    150M-parameter model (the worst case: both compete for the cores; on a GPU the load is mostly file reads and
    host-to-device copies, which release the GIL): tokenizing took 4.1-7.2 s beside the load instead of 2.3-4.6 s
    alone, the load 3.4-5.7 s; the two took 5.7-10 s one after the other, 4.1-7.2 s overlapped."""

    THREAD_NAME = "dflash-prep-load"

    def __init__(self, run: Run):
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()  # its "Loading weights" bar would cut through the tokenizing one
        self.run = run
        self.model = None
        self.error: BaseException | None = None
        self.seconds: float | None = None
        # The current CUDA device is per thread: the load thread takes this one's (`cuda` has no index of its own).
        self._cuda_index = None
        if run.device.type == "cuda":
            self._cuda_index = run.device.index if run.device.index is not None else torch.cuda.current_device()
        self._thread = threading.Thread(target=self._load, name=self.THREAD_NAME, daemon=True)
        self._thread.start()

    @classmethod
    def start_if_safe(cls, run: Run) -> TargetLoad | None:
        if (run.replica.gpus_per_replica != 1 or (run.recipe.data.num_proc or 1) > 1
                or (not run.recipe.output.overwrite and manifest_readable(run.out_dir))):
            return None
        return cls(run)

    @classmethod
    def in_flight(cls) -> bool:
        """A load thread of this process is still running."""
        return any(t.name == cls.THREAD_NAME and t.is_alive() for t in threading.enumerate())

    def _load(self) -> None:
        try:
            if self._cuda_index is not None:
                torch.cuda.set_device(self._cuda_index)
            t0 = time.perf_counter()
            self.model = build_target(self.run)
            self.seconds = time.perf_counter() - t0
        except BaseException as e:  # noqa: BLE001 - raised in the main thread by result()
            self.error = e

    def wait(self) -> None:
        self._thread.join()

    def result(self) -> torch.nn.Module:
        """The loaded model (the load's own error raised here, in the main thread)."""
        self.wait()
        if self.error is not None:
            raise self.error
        return self.model


def build_target(run: Run) -> torch.nn.Module:
    """Load the model and keep only the layers read from (on the load thread, or the main thread)."""
    if run.faults is not None:
        run.faults.before_load()
    model = (load_model(run.recipe.model, run.config, run.device) if run.replica.gpus_per_replica == 1 else
             load_replica_model(run.recipe.model, run.config, run.replica))
    capture_final = run.recipe.layers.capture_final
    drop_layers_after(model, run.num_layers - 1 if capture_final != "none" else run.layer_ids[-1])
    return model


def load_target(run: Run, load: TargetLoad | None) -> torch.nn.Module:
    """The model (loaded here, or by `load` during start-up), then in the main thread: describe the final norm
    (before the kernels patch it: that runs the norm on the CPU), apply the fused kernels (before the capture
    hooks are registered). Start-up seconds: `model_load` (the load itself), `model_load_wait` (how long the
    main thread waited for it after planning: 0 when the overlap hid it)."""
    t0 = time.perf_counter()
    model = load.result() if load is not None else build_target(run)
    waited = time.perf_counter() - t0
    run.startup_seconds.update(model_load=load.seconds if load is not None else waited, model_load_wait=waited,
                               model_load_overlapped=load is not None)
    capture_final = run.recipe.layers.capture_final
    layers_run = len(decoder_layers(find_decoder(model)))
    if run.is_main and capture_final == "before_norm":  # + the norm = the after-norm states at read time
        write_final_norm(run.out_dir, describe_final_norm(find_decoder(model).norm))
    log.info("model loaded in %.1fs%s: %s, %d of %d decoder layers run; hooks on layers %s%s",
             run.startup_seconds["model_load"], f" (during start-up; waited {waited:.1f}s for it)" if load else "",
             describe_source(run.recipe.model), layers_run, run.num_layers, run.layer_ids,
             f" + final ({capture_final})" if capture_final != "none" else "")
    apply_kernels(model, run.kernels)
    if run.is_main:
        append_kernels_record(run.out_dir, run.kernels.record(), run.world)
    log.info("batching.packing: %s (%s)", "packed rows" if run.packing.packed else "padded batches",
             run.packing.reason)
    if run.packing.packed:  # our varlen attention; per-segment Gated DeltaNet where fla's kernels are not used
        log.info("packed rows: %s", use_packed_attention(model, run.device.type))
    return model
