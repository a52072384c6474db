"""What each offline embedder costs: texts/s, CPU seconds and peak memory on the same InsuranceQA answers.

    .venv/bin/pip install insuranceqa-data==1.2
    .venv/bin/python -m bench.embedder_cost [--providers bilingual-pair bilingual local] [--texts 300] [--rounds 2]

Each run is a fresh process (so its peak RSS is its own): the provider's embedder as ``open_runtime`` builds
it, warmed up, embeds the first ``--texts`` answers in Chinese and then the same answers in English, in
batches of 64 as the embed stage sends them. The providers alternate for ``--rounds`` rounds. Printed per
run: texts/s, CPU seconds, peak RSS and the load average before and after.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import subprocess
import sys
import time

from ragstream.embedding import create_embedder
from ragstream.settings import EmbeddingProvider, EmbeddingSettings

__all__ = ["main"]

BATCH = 64


def answers(count: int) -> list[str]:
    """The first ``count`` InsuranceQA answers in Chinese, then the same in English."""
    import insuranceqa_data  # type: ignore[import-untyped]

    loaded = list(insuranceqa_data.load_answers().values())[:count]
    return [answer["zh"].strip() for answer in loaded] + [answer["en"].strip() for answer in loaded]


async def measure(provider: EmbeddingProvider, count: int) -> dict[str, object]:
    texts = answers(count)
    embedder = create_embedder(EmbeddingSettings(provider=provider))
    await embedder.warm_up()
    load_before = os.getloadavg()[0]
    started, cpu_started = time.perf_counter(), time.process_time()
    for start in range(0, len(texts), BATCH):
        await embedder.embed(texts[start : start + BATCH])
    seconds = time.perf_counter() - started
    await embedder.aclose()
    return {
        "provider": provider,
        "texts": len(texts),
        "texts_per_s": round(len(texts) / seconds, 1),
        "cpu_s": round(time.process_time() - cpu_started, 1),
        "peak_rss_mib": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024),
        "load1": [round(load_before, 1), round(os.getloadavg()[0], 1)],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--providers", nargs="+", default=["bilingual-pair", "bilingual", "local"])
    parser.add_argument("--texts", type=int, default=300, help="answers per language")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--one", help=argparse.SUPPRESS)  # a child run: measure this provider, print JSON
    args = parser.parse_args()
    if args.one:
        print(json.dumps(asyncio.run(measure(args.one, args.texts))))
        return
    print("| round | provider | texts | texts/s | CPU s | peak RSS MiB | load 1-min |")
    print("|---|---|---|---|---|---|---|")
    for round_number in range(1, args.rounds + 1):
        for provider in args.providers:
            command = [sys.executable, "-m", "bench.embedder_cost", "--one", provider, "--texts", str(args.texts)]
            run = json.loads(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
            print(
                f"| {round_number} | {provider} | {run['texts']} | {run['texts_per_s']} | {run['cpu_s']} |"
                f" {run['peak_rss_mib']} | {run['load1'][0]} → {run['load1'][1]} |",
                flush=True,
            )


if __name__ == "__main__":
    main()
