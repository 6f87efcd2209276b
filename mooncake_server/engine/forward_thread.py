"""The one thread of an engine process that runs torch with a thread team.

torch's CPU ops run on OpenMP (libgomp), which keeps a worker pool for every thread that starts
parallel work. Once the pools' threads outnumber the cores, libgomp stops spinning between
parallel regions (its "throttled" spin count) and every op of a forward pass wakes its workers
through the kernel instead. An engine used to load its model on one thread and run its passes
on another, so each process held two pools: on the 2-core machine here a one-token decode step
of SmolLM2 took 42 ms (auto kernels; 53 ms float32) where the same step on the loading thread
took 17 ms (31 ms), and the served token gap followed the slow figure.

So an engine process loads its model, times its kernels and runs every pass on this one
thread, and every other thread that touches torch (the event loop's sampling) runs its ops
alone, without a pool of its own.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import torch

from mooncake_server.engine.core_budget import machine_cores


def no_team_on_this_thread() -> None:
    """Run the calling thread's torch ops alone, and threads started later alone too.

    torch gives a thread its team size on its first parallel op, from the last size set on any
    thread: reading it first makes this thread's size stick, and setting 1 makes 1 the size a
    new thread takes. The forward thread keeps the team it set for itself.
    """
    torch.get_num_threads()
    torch.set_num_threads(1)


def forward_thread(name: str) -> ThreadPoolExecutor:
    """A one-worker executor for the model's work; its team starts at every core.

    `ModelRunner.step` sizes the team to the core budget before each pass; loading the model
    and timing kernels on this thread too keeps the process at one OpenMP pool.
    """
    return ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{name}-forward",
                              initializer=torch.set_num_threads, initargs=(machine_cores(),))
