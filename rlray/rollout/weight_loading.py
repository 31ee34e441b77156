"""How a rollout worker's engine takes new weights: a published state dict loaded in
place, or vLLM's weight-transfer engine (rollout.weight_sync nccl or gloo)."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping
from typing import Any

from rlray.config import RolloutConfig
from rlray.rollout.engine_loop import EngineLoop


class _DropRotaryReloadWarning(logging.Filter):
    # Rotary embeddings have no weights to load; vLLM warns about them on every reload.
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("RotaryEmbedding: Failed to load weights")


def drop_rotary_reload_warnings() -> None:
    """Silences vLLM's warning, at every reload, that rotary embeddings loaded no weights."""
    logging.getLogger("vllm").addFilter(_DropRotaryReloadWarning())
    for handler in logging.getLogger("vllm").handlers:
        handler.addFilter(_DropRotaryReloadWarning())


class WeightLoading:
    """Loads new weights into the engine between two of its steps, and has no cached KV
    of the old weights serve a later request.

    A part of RolloutWorker (rlray.rollout.worker), which sets the attributes annotated
    here."""

    name: str
    rollout: RolloutConfig
    llm: Any
    """The vLLM engine (vllm.LLM)."""
    loop: EngineLoop
    """Steps the engine (rlray.rollout.engine_loop); holds the engine's policy version."""
    loads_directly: bool
    """Whether a weight load goes straight into the model's layers (load_weights): on
    CPU with torch's matmuls every layer keeps its weights as loaded, so vLLM's
    in-place reload, which restores and processes every layer around the load, has
    nothing to do but costs several times the load itself."""

    # vLLM's weight-transfer engine (rollout.weight_sync nccl or gloo; rlray.weights.transfer):
    # the learner's client calls these, and the tensors arrive inside update_weights.

    def open_weight_transfer(self, init_info: dict[str, Any]) -> None:
        """Joins the learner's transfer group (blocks until the learner opens it), leaving
        the group it was in (a reopened transfer's). The engine pauses meanwhile: its
        worker's group changes."""
        with self.loop.paused():
            self.llm.shutdown_weight_transfer_engine()
            self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        """Pauses the engine (between two of its steps) until finish_weight_update: no
        step may run on half-loaded weights."""
        self.loop.hold()
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """Receives every tensor the learner broadcasts and loads it (layerwise)."""
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, version: int) -> None:
        """Ends the update (vLLM processes the loaded layers); this worker holds `version`."""
        self.llm.finish_weight_update()
        self._loaded(version, self.llm.llm_engine.has_unfinished_requests())
        self.loop.release()

    def abandon_weight_update(self, reason: str) -> None:
        """The transfer's sender died (or its learner group broke) mid-sync: an update it
        started may hold the engine with its weights half-loaded, and nobody will finish
        it. The engine stops for good (EngineLoop.fail): the calls waiting for it, and any
        later, raise EngineFailed naming `reason`; the run goes on with new actors."""
        self.loop.fail(f"{self.name}: a weight transfer was abandoned ({reason})")

    def loads_tied_output(self, tied_output: str) -> bool:
        """Whether vLLM's model takes the tied output embedding under its own name."""
        # torch loads in the rollout actor only (rlray.cluster.roles imports this module)
        from rlray.weights.packing import weights_for_vllm

        architecture = self.llm.model_config.architecture
        return tied_output in weights_for_vllm({tied_output: None}, tied_output, architecture)

    def load_weights(self, version: int, weights: Mapping) -> float:
        """Loads a published state dict in place and returns the seconds it took."""
        started = time.perf_counter()
        items = list(weights.items())

        def reload(worker) -> None:  # runs on vLLM's worker, in this process
            if self.loads_directly:
                worker.model_runner.get_model().load_weights(iter(items))
            else:
                worker.reload_weights(weights_iterator=iter(items))

        with self.loop.paused() as running:
            self.llm.collective_rpc(reload)
            self._loaded(version, running)
        return time.perf_counter() - started

    def _loaded(self, version: int, running: bool) -> None:
        """After a weight load: no cached KV of the old weights may serve a request that
        starts later (RolloutConfig.in_flight_kv_cache says what running ones do)."""
        if not running:
            self.llm.reset_prefix_cache()
        elif self.rollout.in_flight_kv_cache == "recompute":
            # vLLM preempts the running requests; they resume by recomputing their KV.
            self.llm.reset_prefix_cache(reset_running_requests=True)
        # keep: the prefix cache is off, and running requests keep their own KV
        self.loop.version = version
