"""`--role colocated`: the tightly coupled baseline — one engine does prefill and decode itself.

A request walks: OpenAI API -> tokenized -> waiting in the engine loop -> running (its prompt is
prefilled in chunks inside the same forward passes that decode the other requests) -> finished.
No store, no transfer: every benchmark compares the disaggregated path against this.
"""

from __future__ import annotations

import asyncio
import logging

from fastapi import FastAPI
from prometheus_client import CollectorRegistry
from transformers import AutoTokenizer

from mooncake_server.api.limits import RequestLimits
from mooncake_server.api.openai_app import install_api
from mooncake_server.api.prompts import load_eos_token_ids
from mooncake_server.config import ServerConfig
from mooncake_server.cost_model.loading import load_perf_model
from mooncake_server.cost_model.passes import seed_pass_tokens
from mooncake_server.engine.factory import build_runner
from mooncake_server.engine.forward_thread import forward_thread, no_team_on_this_thread
from mooncake_server.engine.loop import EngineLoop, EngineMetrics
from mooncake_server.instance.app import Starting, instance_app
from mooncake_server.model_assets import resolve_model, served_name
from mooncake_server.roles.colocated.admission import ColocatedAdmission
from mooncake_server.roles.colocated.backend import LocalEngineBackend

log = logging.getLogger(__name__)

_QUIET_PASSES = 5  # one-token passes timed at start-up (with SLO flags)


def build_app(config: ServerConfig) -> FastAPI:
    """The colocated server: OpenAI API over an in-process engine."""
    registry = CollectorRegistry()
    engine_metrics = EngineMetrics(registry)
    # The model path is resolved now (converting the bundled model if needed), because the API
    # routes need the tokenizer before the app starts.
    # Converting it and loading the model run on the forward thread, as every pass will.
    executor = forward_thread("colocated")
    model_path = executor.submit(resolve_model, config.model).result()
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    runner, info = executor.submit(build_runner, config.replace(model=model_path),
                                   lambda nbytes: bytearray(nbytes)).result()
    no_team_on_this_thread()  # the event loop samples; the forward thread computes
    loop = EngineLoop(runner, executor, engine_metrics, config.max_batch_size,
                      config.prefill_chunk_tokens, config.decode_chunk_tokens)
    admission = None
    if config.ttft_slo_s is not None or config.tbt_slo_s is not None:
        model = load_perf_model(config.profile_path, config.block_tokens, config.dtype)
        admission = ColocatedAdmission(loop, model, ttft_slo_s=config.ttft_slo_s,
                                       tbt_slo_s=config.tbt_slo_s)
    backend = LocalEngineBackend(loop, info.max_model_len, admission)

    async def start(starting: Starting) -> None:
        no_team_on_this_thread()  # the event loop's own thread, whichever runs it
        stack = starting.stack
        stack.callback(runner.cores.close)
        stack.push_async_callback(asyncio.to_thread, executor.shutdown, True)
        if admission is not None:  # the engine's own speed before any request is measured
            quiet = await asyncio.get_running_loop().run_in_executor(
                executor, runner.quiet_step_s, _QUIET_PASSES)
            admission.seed_quiet_step(1, _QUIET_PASSES, quiet)
            tokens = seed_pass_tokens(config.prefill_chunk_tokens, info.max_model_len,
                                      runner.kv.num_blocks * runner.kv.layout.block_tokens)
            seconds = await asyncio.get_running_loop().run_in_executor(
                executor, runner.prompt_pass_s, tokens)
            admission.seed_prompt_pass(tokens, seconds)
            log.info("quiet decode step %.1f ms, full prompt pass of %d tokens %.2f s: %.2fx "
                     "and %.2fx the cost model's", quiet * 1000, tokens, seconds,
                     admission.decode_ratio, admission.prefill_ratio)
        loop.start()
        stack.push_async_callback(loop.stop)
        log.info("colocated engine ready: %s", info.name)

    app = instance_app(config, "mooncake-server colocated", registry, start)
    install_api(app, backend, tokenizer, served_name(config.model, config.served_model_name),
                info.max_model_len, registry,
                eos_token_ids=load_eos_token_ids(model_path, tokenizer),
                limits=RequestLimits.from_config(config), api_key=config.api_key,
                secret=config.cluster_secret, log_prompts=config.log_prompts)
    return app
