"""Benchmarks of ragstream on real corpora: ``python -m bench.ingest`` (see bench/README.md).

The speed benchmarks run beside LlamaIndex with the same local USE embedder, so ragstream embeds with it
too (``RAGSTREAM_EMBEDDER_PROVIDER=local``) unless the environment says otherwise; the commands they start
inherit it. ``bench.quality`` and ``bench.default_embedder`` choose their models themselves.
"""

import os

os.environ.setdefault("RAGSTREAM_EMBEDDER_PROVIDER", "local")
