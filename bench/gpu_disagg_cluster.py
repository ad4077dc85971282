"""The cluster half of bench/gpu_disagg.py: one prefill and one decode node on Ray, long random
prompts, and every transfer handle of both nodes recorded as it ends (node subclasses that log
`nbytes`, `elapsed_s`, `phases` and `gpu_phases`)."""

from __future__ import annotations

import asyncio
import os
import time

import torch

from bench.host_probe import host_probe
from metadata.transfer import TransferState


def _recording_classes():
    """Node subclasses that log each transfer handle as it ends (Ray pickles them by value)."""
    from decode_node import DecodeNode
    from prefill_node import PrefillNode

    def entry(handle, tokens: int) -> dict:
        return {
            "tokens": tokens,
            "bytes": handle.nbytes,
            "elapsed_s": handle.elapsed_s,
            "phases": {**handle.phases, "end": handle.elapsed_s},
            "gpu_phases": dict(handle.gpu_phases),
            "ok": handle.state == TransferState.SUCCESS,
        }

    class RecordingPrefillNode(PrefillNode):
        def _open_channel(self):
            sender = super()._open_channel()
            # GPU phases: "kv_sent" of a begun transfer is its KV's time from ready to sent.
            sender.phase_events = sender.device.type == "cuda"
            if os.environ.get("PDCLUSTER_BENCH_PROFILE_POSTING"):
                import cProfile

                profiler, post = cProfile.Profile(), sender._post

                def profiled_post(*args):
                    profiler.enable()
                    try:
                        post(*args)
                    finally:
                        profiler.disable()

                sender._post = profiled_post
                self.__dict__["posting_profiler"] = profiler
            return sender

        def posting_profile(self) -> str:
            """The top of a cProfile of every posting (PDCLUSTER_BENCH_PROFILE_POSTING=1)."""
            import io
            import pstats

            profiler = self.__dict__.get("posting_profiler")
            if profiler is None:
                return ""
            out = io.StringIO()
            pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(25)
            return out.getvalue()

        def _finish_transfers(self) -> None:
            log = self.__dict__.setdefault("transfer_log", [])
            for pending in self.sending:
                if pending.handle.state in (TransferState.SUCCESS, TransferState.FAILED):
                    log.append(entry(pending.handle, len(pending.req.prompt_token_ids)))
            super()._finish_transfers()

        def transfers(self) -> list[dict]:
            return list(self.__dict__.get("transfer_log", []))

        def host(self) -> dict:
            return host_probe(str(self.runner.device))

    class RecordingDecodeNode(DecodeNode):
        def _land_transfers(self) -> None:
            # An ended transfer may wait for its PrefillResult: log it once it is settled.
            log = self.__dict__.setdefault("transfer_log", [])
            before = list(self.receiving)
            super()._land_transfers()
            settled = {id(t) for t in before} - {id(t) for t in self.receiving}
            for tracked in before:
                if id(tracked) in settled and tracked.handle is not None:
                    log.append(entry(tracked.handle, len(tracked.req.prompt_token_ids)))

        def transfers(self) -> list[dict]:
            return list(self.__dict__.get("transfer_log", []))

    return RecordingPrefillNode, RecordingDecodeNode


def run_cluster(model: str | None, device: str, tokens_list: list[int], reps: int) -> dict:
    import cluster.deploy.launcher as launcher
    from cluster.deploy.config import ClusterConfig
    from engine import SamplingParams
    from engine.loading.loader import EngineArgs

    prefill_cls, decode_cls = _recording_classes()
    launcher._prefill_class = lambda: prefill_cls
    launcher.DecodeNode = decode_cls
    engine = EngineArgs(model=model, device=device, kv_cache_tokens=max(tokens_list) * 4)
    t0 = time.perf_counter()
    cluster = launcher.Cluster.launch(ClusterConfig(engine=engine))
    launch_s = time.perf_counter() - t0
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    vocab = cluster.spec.model_config.vocab_size
    requests = []
    try:

        async def main() -> None:
            router = cluster.router
            await router.start()
            try:
                gen = torch.Generator().manual_seed(0)
                for n in tokens_list:
                    for rep in range(reps):
                        prompt = torch.randint(100, vocab - 100, (n,), generator=gen).tolist()
                        start = time.perf_counter()
                        async for _ in router.generate(f"bench-{n}-{rep}", prompt, params):
                            pass
                        requests.append({"tokens": n, "e2e_s": time.perf_counter() - start})
            finally:
                await router.close()

        asyncio.run(main())
        import ray

        time.sleep(0.5)
        prefill_log = ray.get(cluster.prefill_actors[0].transfers.remote(), timeout=60)
        decode_log = ray.get(cluster.decode_actors[0].transfers.remote(), timeout=60)
        prefill_host = ray.get(cluster.prefill_actors[0].host.remote(), timeout=60)
        profile = ray.get(cluster.prefill_actors[0].posting_profile.remote(), timeout=60)
        if profile:
            print(f"prefill node, posting:\n{profile}")
        empty = cluster.kv_pools_empty()
    finally:
        cluster.shutdown()
    return {
        "launch_s": launch_s,
        "requests": requests,
        "prefill": prefill_log,
        "decode": decode_log,
        "prefill_host": prefill_host,
        "kv_pools_empty": empty,
    }
