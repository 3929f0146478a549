"""How every kvbench report draws and writes a quantity, so one policy has one colour across reports and one
number reads the same in a table, a plot and the terminal: colours by policy, values scaled to their unit
(ms … h, KiB … TiB, tokens k/M), no scientific notation, labelled log ticks and a full-width figure size."""

from __future__ import annotations

import math

# Main plots span the page's content width (1100 px at 100 dpi, matching page.STYLE's max-width).
FULL_WIDTH = 11.0  # inches
SMALL_MULTIPLE = 3.6  # inches per panel in a grid of small plots

# One colour per policy in every report: the registry's names in sorted order take matplotlib's tab10/tab20
# colours in turn, so the same policy is the same colour wherever it is drawn (curves and points alike).
# The two bounds are drawn the same everywhere too.
BOUND_STYLE = {"color": "black", "linestyle": "--"}  # belady: the optimal policy
INFINITE_STYLE = {"color": "grey", "linestyle": ":"}  # the infinite cache: nothing passes it
PALETTE = (
    "#1f77b4",
    "#ff7f0e",
    "#2ca02c",
    "#d62728",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#17becf",
    "#bcbd22",
    "#aec7e8",
    "#ffbb78",
    "#98df8a",
    "#ff9896",
    "#c5b0d5",
    "#c49c94",
    "#f7b6d2",
    "#9edae5",
    "#dbdb8d",
)  # fmt: skip  (tab10 without its grey, then tab20's light tones: grey and black are the bounds')


def _policy_names() -> list[str]:
    from kvbench.cache import policies

    return [n for n in policies.registry() if n != "belady"]


def colour(name: str) -> str:
    """The colour of a policy (or any other series name: live, an engine) in every plot kvbench draws."""
    if name == "belady":
        return BOUND_STYLE["color"]
    known = _policy_names()
    if name in known:
        return PALETTE[known.index(name) % len(PALETTE)]
    # a name outside the registry (a backend, an engine, 'live'): a stable pick past the policies' colours
    index = len(known) + sum(name.encode()) % max(len(PALETTE) - len(known), 1)
    return PALETTE[index % len(PALETTE)]


def line_style(name: str) -> dict:
    """matplotlib keyword arguments for a policy's line: its colour, dashed black for the Belady bound."""
    return dict(BOUND_STYLE) if name == "belady" else {"color": colour(name)}


# -- numbers as words


def plain(x: float, digits: int = 4) -> str:
    """A number with `digits` significant digits and thousands separators, never in scientific notation."""
    if x is None or (isinstance(x, float) and not math.isfinite(x)):
        return "–" if x is None else str(x)
    if isinstance(x, bool):
        return "yes" if x else "no"
    if isinstance(x, int) or float(x).is_integer() and abs(x) >= 10 ** (digits - 1):
        return f"{round(x):,}"
    if x == 0:
        return "0"
    decimals = max(digits - 1 - math.floor(math.log10(abs(x))), 0)
    text = f"{x:,.{decimals}f}"
    return text.rstrip("0").rstrip(".") if "." in text else text  # 0.5, not 0.5000


def duration(seconds: float | None) -> str:
    """A time in the unit that suits it: 850 µs, 12.5 ms, 3.2 s, 4.1 min, 2.5 h, 3.0 d."""
    if seconds is None or not math.isfinite(seconds):
        return "–"
    s = abs(seconds)
    units = ((1e-3, 1e-6, "µs"), (1, 1e-3, "ms"), (120, 1, "s"), (7200, 60, "min"), (172800, 3600, "h"))
    for limit, per, unit in units:
        if s < limit:
            return f"{plain(seconds / per, 3)} {unit}"
    return f"{plain(seconds / 86400, 3)} d"


def size(nbytes: float | None) -> str:
    """Bytes in binary units: 512 B, 1.5 KiB, 12.3 GiB, 1.1 TiB."""
    if nbytes is None:
        return "–"
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(nbytes) < 1024 or unit == "TiB":
            return f"{plain(nbytes, 3)} {unit}" if unit != "B" else f"{int(nbytes):,} B"
        nbytes /= 1024
    raise AssertionError("unreachable")


def count(n: float | None) -> str:
    """A count of tokens, requests or blocks, short: 950, 12.3k, 4.5M, 1.2G."""
    if n is None:
        return "–"
    for limit, scale, unit in ((1e3, 1, ""), (1e6, 1e3, "k"), (1e9, 1e6, "M")):
        if abs(n) < limit:
            return f"{plain(n / scale, 3)}{unit}"
    return f"{plain(n / 1e9, 3)}G"


def time_axis(span_s: float) -> tuple[float, str]:
    """(divisor, unit) for a time axis spanning `span_s` seconds: seconds up to 5 min, then minutes, hours
    up to 3 days, then days."""
    for limit, scale, unit in ((300, 1, "s"), (3 * 3600, 60, "min"), (3 * 86400, 3600, "h")):
        if span_s <= limit:
            return scale, unit
    return 86400, "d"


def log_ticks(ax, axis: str = "x") -> None:
    """Label every decade of a log axis as a plain short count (1, 10, 100, 1k, 10k …), with minor ticks
    unlabelled: two labelled ticks on a wide axis say too little, 'scientific' 10^4 reads badly in a table."""
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    target = ax.xaxis if axis == "x" else ax.yaxis
    target.set_major_locator(LogLocator(base=10, numticks=12))
    target.set_major_formatter(FuncFormatter(lambda v, _: count(v)))
    target.set_minor_locator(LogLocator(base=10, subs=(2, 5), numticks=12))
    target.set_minor_formatter(NullFormatter())
