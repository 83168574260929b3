"""A worker that reports which GPUs its process sees (importable by Ray workers)."""

from __future__ import annotations

import os

from trainer.controller.cluster import Cluster, remote
from trainer.controller.dispatch import Dispatch, register
from trainer.controller.worker import DEVICES_ENV, Worker


class GpuWorker(Worker):
    """Reports its process's view of the GPUs."""

    @register(Dispatch.ONE_TO_ALL)
    def gpus(self) -> dict[str, object]:
        """``visible``: ``CUDA_VISIBLE_DEVICES`` (what CUDA, torch and vLLM use); ``ray``: the
        GPU ids Ray assigned this actor (those of the bundle it was scheduled into);
        ``devices``: ``ENVHUB_DEVICES``."""
        import ray

        return {
            "visible": os.environ.get("CUDA_VISIBLE_DEVICES"),
            "ray": [str(i) for i in ray.get_gpu_ids()],
            "devices": os.environ.get(DEVICES_ENV),
        }


class GpuCluster(Cluster):
    worker_cls = GpuWorker

    gpus = remote(GpuWorker.gpus, per_rank=True)


def failing_gpu_probe() -> list[str]:
    """Stands in for the GPU-id probe when its worker cannot run (a broken driver, say)."""
    raise RuntimeError("no CUDA driver in this worker")
