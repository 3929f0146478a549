"""Generator throughput (asv). The issue's target: 1,000,000 chat requests in under 60 s on 2 cores."""

from kvbench.generators import get, registry


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
