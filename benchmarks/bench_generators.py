"""Trace generation: speed and peak memory (asv).

- `ChatMillion.time_chat_1m` / `peakmem_chat_1m`: one 1,000,000-request chat trace, in memory (the issue's
  target: under 60 s on 2 cores; a production-sized synthetic day).
- `EachKind.time_generate_20k` / `peakmem_generate_20k`: 20,000 requests of every registered generator kind
  (enumerated from `kvbench.trace.generators.registry()`, the `mix` blend included).

Generation only (`get(kind).run(n, seed)`), not validation or writing the parquet file.
"""

from kvbench.trace.generators import get, registry


class ChatMillion:
    # One large case, run once: it is the figure users care about (a production-sized synthetic day).
    number = 1
    repeat = 1
    timeout = 300

    def time_chat_1m(self):
        get("chat").run(1_000_000, seed=0)

    def peakmem_chat_1m(self):
        get("chat").run(1_000_000, seed=0)


class EachKind:
    params = sorted(registry())
    param_names = ["kind"]
    timeout = 120

    def time_generate_20k(self, kind):
        get(kind).run(20_000, seed=0)

    def peakmem_generate_20k(self, kind):
        get(kind).run(20_000, seed=0)
